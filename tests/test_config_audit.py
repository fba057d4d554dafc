"""Every config.json field that changes the math is implemented as transformers implements it, or
refused with one line naming it (tileinfer.core.config). Logits against transformers on tiny random
checkpoints, float32 on the CPU."""

import json

import pytest
import torch
import transformers

from tests.tiny_models import make_tiny
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.config import QUANT_METHOD, ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer

CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
# 32 heads: the architectures' default KV head counts (Mistral 8, Qwen2 32) must divide them
MINIMAL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=32)


def engine_logits(folder, ids):
    ck = load_checkpoint(folder)
    model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=torch.float32)
    runner = ModelRunner(model, page_size=16, prefill_chunk=37, max_seq_len=256)
    return torch.cat([lg for _, lg in runner.chunks(runner.new_sequence(), ids, logits_from=0)])


def hf_logits(folder, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def assert_match(folder, n=150):
    ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(1))
    want, got = hf_logits(folder, ids), engine_logits(folder, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def edit_config(folder, **changes):
    """Change config.json as a user (or another tool's version) would write it; None deletes a key."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


# --------------------------------------------------------------------- implemented, against transformers


@pytest.mark.parametrize("kind", ["llama-bias", "qwen3-bias"])
def test_attention_bias_includes_o_proj(kind, tmp_path):
    """transformers' attention_bias biases q, k, v *and* o_proj (llama, qwen3)."""
    hf = make_tiny(kind, tmp_path)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    assert load_checkpoint(tmp_path).config.o_proj_bias
    assert_match(tmp_path)


@pytest.mark.parametrize(
    "changes",
    [
        # rope_parameters (transformers v5) wins over a top-level rope_theta
        dict(rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        # a legacy rope_scaling (legacy "type" spelling) replaces rope_parameters, theta and all
        dict(
            rope_scaling={"type": "linear", "factor": 4.0}, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
        # llama3 without original_max_position_embeddings: max_position_embeddings stands in
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1e4,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            }
        ),
        # dynamic NTK: plain RoPE up to max_position_embeddings
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    ],
    ids=["theta-precedence", "legacy-rope-scaling", "llama3-default-original-ctx", "dynamic"],
)
def test_rope_settings_match_transformers(changes, tmp_path):
    make_tiny("llama", tmp_path)
    edit_config(tmp_path, **changes)
    assert_match(tmp_path)


def test_qwen_window_without_sliding_layers_is_full_attention(tmp_path):
    """use_sliding_window with max_window_layers >= num_hidden_layers: no layer slides."""
    make_tiny("qwen2", tmp_path, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert load_checkpoint(tmp_path).config.sliding_window is None
    assert_match(tmp_path)


def test_mistral_window_applies_whatever_use_sliding_window_says(tmp_path):
    """transformers' Mistral slides on every layer and never reads use_sliding_window: past the
    window the engine (full attention) would be wrong, so it refuses to run there."""
    make_tiny("mistral", tmp_path, sliding_window=32)
    edit_config(tmp_path, use_sliding_window=False)
    assert load_checkpoint(tmp_path).config.sliding_window == 32
    assert_match(tmp_path, n=32)
    with pytest.raises(UserError, match="sliding window of 32"):
        assert_match(tmp_path, n=40)


MINIMAL_CASES = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"attention_bias": True}),
    ("qwen3", {"attention_bias": True}),
    ("qwen2", {"attention_bias": True}),
    ("llama", {"num_key_value_heads": None, "head_dim": None}),
    ("mistral", {"use_sliding_window": False, "sliding_window": 32}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 2}),
    (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    ("qwen3", {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 5e5}),
]


@pytest.mark.parametrize("model_type,extra", MINIMAL_CASES)
def test_defaults_and_resolution_equal_transformers(model_type, extra):
    """A config.json that omits fields gets transformers' per-architecture defaults (Mistral's 8 KV
    heads and 4096 window, Qwen3's head_dim 128, the context lengths), and biases and windows resolve
    as transformers' modules resolve them."""
    d = {"model_type": model_type, **MINIMAL, **extra}
    cfg_cls, model_cls = CLASSES[model_type]
    hf_cfg = cfg_cls(**{k: v for k, v in d.items() if k != "model_type"})
    attn = model_cls(hf_cfg).model.layers
    windows = {getattr(L.self_attn, "sliding_window", None) for L in attn}
    if model_type == "mistral":  # its attention reads config.sliding_window on every layer
        windows = {hf_cfg.sliding_window}
    ours = ModelConfig.from_hf(d)
    assert ours.num_key_value_heads == hf_cfg.num_key_value_heads
    assert ours.head_dim == attn[0].self_attn.head_dim
    assert ours.rms_norm_eps == hf_cfg.rms_norm_eps
    assert ours.max_position_embeddings == hf_cfg.max_position_embeddings
    assert ours.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert ours.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert ours.attention_bias == (attn[0].self_attn.q_proj.bias is not None)
    assert ours.o_proj_bias == (attn[0].self_attn.o_proj.bias is not None)
    assert ours.sliding_window == max((w for w in windows if w is not None), default=None)


# --------------------------------------------------------------------- refused, in one line naming the field


REFUSED = [
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type='yarn'"),
    ("llama", dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}), "'longrope'"),
    ("llama", dict(rope_scaling={"type": "su", "factor": 2.0}), "rope_type='su'"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("llama", dict(rope_scaling={"type": "linear", "factor": -1.0}), "linear factor=-1.0"),
    ("llama", dict(rope_scaling={"type": "linear", "factor": 0.5}), "linear factor=0.5"),
    ("llama", dict(rope_scaling={"type": "dynamic"}), "dynamic factor=None"),
    ("llama", dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters="),
    ("llama", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    ("llama", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("llama", dict(query_pre_attn_scalar=144), "query_pre_attn_scalar=144"),
    ("llama", dict(embedding_multiplier=12.0), "embedding_multiplier=12.0"),
    ("llama", dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quant_method='gptq'"),
    ("llama", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types="),
    ("qwen2", dict(attention_bias=False), "attention_bias=False"),
    ("mistral", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
]


@pytest.mark.parametrize("kind,changes,names", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_fields_are_one_line_naming_them(kind, changes, names, tmp_path):
    make_tiny(kind, tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(UserError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and names in msg and str(tmp_path / "config.json") in msg


def test_unused_tensor_is_refused(tmp_path):
    """o_proj biases that config.json's attention_bias does not switch on would be dropped."""
    make_tiny("llama-bias", tmp_path)
    edit_config(tmp_path, attention_bias=False)
    with pytest.raises(UserError, match=r"tensor model\.layers\.0\.self_attn\.[qkvo]_proj\.bias is not used"):
        load_checkpoint(tmp_path)


def test_quant_method_is_the_quantize_tools():
    from quantize.checkpoint import QUANT_METHOD as WRITTEN

    assert QUANT_METHOD == WRITTEN


def test_registry_refuses_a_checkpoint_whose_biases_differ_from_its_conf():
    """A conf/model entry fixes the GEMM variants (benchmarks, AOT): a checkpoint with o_proj
    biases behind a name whose table has none is a wrong file, not the model."""
    from tileinfer.core import registry

    want = registry.model_entry("smollm2-135m")["config"]
    biased = ModelConfig.from_hf(want | {"attention_bias": True})
    with pytest.raises(UserError, match="o_proj_bias True .conf/model says False."):
        registry.check_checkpoint_config("smollm2-135m", biased, want)
