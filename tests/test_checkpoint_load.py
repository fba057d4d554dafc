"""load_checkpoint on GGUF files and folders: every metadata key that changes the math is read or
refused, NaN weights are found at load (and never cached), and a pre-quantized checkpoint says so.
GGUF files are tiny random models written the way llama.cpp's converter writes them; logits against
transformers on the same weights, float32 on the CPU."""

import errno
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from tests.test_model_vs_transformers import LOGITS_TOL
from tests.tiny_models import make_tiny, write_gguf
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.checkpoint.gguf_file import GGUFHeader, TensorInfo, gguf_config, hf_name, load_gguf
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer

LINEAR_4 = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def assert_logits_match(hf, path, n=120):
    ids = torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    ck = load_checkpoint(path, dtype=torch.float32)
    model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=torch.float32)
    runner = ModelRunner(model, page_size=16, prefill_chunk=37, max_seq_len=256)
    got = torch.cat([lg for _, lg in runner.chunks(runner.new_sequence(), ids, logits_from=0)])
    # float32 on both sides: measured <= 1.2e-6 (tests/test_model_vs_transformers.py's LOGITS_TOL and its measurements)
    assert ((got - want).abs().max() / want.abs().max()).item() < LOGITS_TOL


def one_line_naming(e, *parts):
    msg = str(e.value)
    return "\n" not in msg and all(str(p) in msg for p in parts)


# --------------------------------------------------------------------- GGUF: implemented


@pytest.mark.parametrize("kind", ["llama-bias", "qwen3-bias"])
def test_gguf_attention_bias_includes_o_proj(kind, tmp_path):
    hf = make_tiny(kind, tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf")
    assert load_checkpoint(path).config.o_proj_bias
    assert_logits_match(hf, path)


@pytest.mark.parametrize(
    "metadata",
    [
        [("{arch}.rope.scale_linear", 4.0)],  # the key of older converters
        [("{arch}.rope.scaling.factor", 4.0)],  # no type: llama.cpp's default is linear
        [("{arch}.rope.scaling.type", "linear"), ("{arch}.rope.scaling.factor", 4.0)],
    ],
    ids=["scale_linear", "factor-without-type", "type-and-factor"],
)
def test_gguf_linear_rope_factor(metadata, tmp_path):
    hf = make_tiny("llama", tmp_path, rope_parameters=LINEAR_4)
    path = write_gguf(hf, tmp_path / "m.gguf", metadata)
    assert_logits_match(hf, path)


def test_gguf_rope_scaling_type_none_ignores_the_factor(tmp_path):
    hf = make_tiny("llama", tmp_path)
    path = write_gguf(
        hf, tmp_path / "m.gguf", [("{arch}.rope.scaling.type", "none"), ("{arch}.rope.scale_linear", 4.0)]
    )
    assert_logits_match(hf, path)


def header(arch, metadata, tensors=("token_embd.weight",)):
    """An in-memory GGUF header (no file): ``{arch}.`` prefixed to the metadata keys given, F32
    tensors of the names given (the embedding 96 x 64)."""
    md = {"general.architecture": arch} | {
        (k if k.startswith("tokenizer.") else f"{arch}.{k}"): v for k, v in metadata.items()
    }
    shape = {"token_embd.weight": (96, 64)}
    infos = {n: TensorInfo(n, shape.get(n, (64,)), GGMLQuantizationType.F32, 0, 0) for n in tensors}
    return GGUFHeader(Path("tiny.gguf"), md, infos)


REQUIRED = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128}
REQUIRED |= {"attention.head_count": 4}


def test_gguf_config_defaults_are_llama_cpps():
    """The five keys every file has, nothing else: the config states llama.cpp's defaults, each by hand
    (KV heads = heads, head_dim = 64 / 4, RMSNorm eps 1e-6, RoPE base 10000, no scaling, no window),
    the vocabulary from the embedding, tied (no output.weight), no biases, no BOS/EOS."""
    cfg = gguf_config(header("llama", REQUIRED))
    assert cfg == dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
        attention_bias=False,
    )
    assert "attention_bias" not in gguf_config(header("qwen2", REQUIRED))  # qwen2's biases are always on


def test_gguf_config_reads_every_key_it_maps():
    """Each optional key lands in its own field: KV heads, eps, RoPE base, BOS/EOS, the vocabulary key
    without an embedding tensor, an output.weight (untied), an o_proj bias alone (llama's attention_bias
    covers q, k, v and o), a window (qwen: on every layer), the older linear factor key."""
    md = REQUIRED | {
        "attention.head_count_kv": 2,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 1e6,
        "vocab_size": 80,
        "attention.sliding_window": 32,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    cfg = gguf_config(header("qwen2", md, ("output.weight",)))
    assert {k: cfg[k] for k in ("num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size")} == dict(
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6, vocab_size=80
    )
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == (1, 2, False)
    assert (cfg["sliding_window"], cfg["use_sliding_window"], cfg["max_window_layers"]) == (32, True, 0)
    qwen3 = gguf_config(header("qwen3", md))
    assert (qwen3["sliding_window"], qwen3["use_sliding_window"], qwen3["max_window_layers"]) == (32, True, 0)
    mistral = gguf_config(header("mistral", md))
    assert (
        mistral["sliding_window"] == 32 and "use_sliding_window" not in mistral and "max_window_layers" not in mistral
    )
    for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
        assert gguf_config(header("llama", REQUIRED, ("token_embd.weight", f"blk.0.{t}.bias")))["attention_bias"], t
    linear = gguf_config(header("llama", REQUIRED | {"rope.scale_linear": 4.0}))
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert "rope_scaling" not in gguf_config(header("llama", REQUIRED | {"rope.scaling.factor": 1.0}))
    assert "rope_scaling" not in gguf_config(header("llama", REQUIRED | {"rope.scale_linear": 0.0}))  # 0: unset


def test_gguf_config_names_what_it_refuses():
    """An unknown architecture lists the supported ones; a missing required key, per-frequency RoPE
    factors and a config the engine cannot run name the file and the problem."""
    with pytest.raises(
        UserError, match="tiny.gguf: unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"
    ):
        gguf_config(header("gpt2", REQUIRED))
    with pytest.raises(UserError, match="tiny.gguf: GGUF metadata has no llama.context_length"):
        gguf_config(header("llama", {k: v for k, v in REQUIRED.items() if k != "context_length"}))
    with pytest.raises(
        UserError, match=r"tiny.gguf: per-frequency RoPE factors \(rope_freqs.weight\) are not supported"
    ):
        gguf_config(header("llama", REQUIRED, ("token_embd.weight", "rope_freqs.weight")))
    with pytest.raises(UserError, match="^tiny.gguf: .*factor=0.5: expected a number >= 1"):
        gguf_config(header("llama", REQUIRED | {"rope.scale_linear": 0.5}))  # ModelConfig refuses it


def test_gguf_tensor_names_map_to_transformers_names_or_to_none():
    assert hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.0.ssm_a.weight") is None and hf_name("rope_freqs.weight") is None


def test_gguf_tensors_are_writable_copies_in_the_dtype_asked(tmp_path):
    """Every tensor in the dtype asked (bf16, float32), each its own writable copy: an F32 tensor is
    never a view of the read-only file map (torch warns about a non-writable array, once a process,
    and the write below would fault: with the copy dropped this test dies of SIGSEGV, measured)."""
    path = write_gguf(make_tiny("llama", tmp_path), tmp_path / "m.gguf")
    for dt in (torch.bfloat16, torch.float32):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, sd = load_gguf(path, dtype=dt, cache=False)
        assert {t.dtype for t in sd.values()} == {dt}
        sd["model.norm.weight"].add_(1)


# --------------------------------------------------------------------- GGUF: refused in one line


REFUSED_METADATA = [
    ([("{arch}.rope.scaling.type", "yarn"), ("{arch}.rope.scaling.factor", 4.0)], "rope.scaling.type='yarn'"),
    ([("{arch}.rope.scaling.attn_factor", 2.0)], "rope.scaling.attn_factor=2.0"),
    ([("{arch}.attn_logit_softcapping", 50.0)], "attn_logit_softcapping=50.0"),
    ([("{arch}.final_logit_softcapping", 30.0)], "final_logit_softcapping=30.0"),
    ([("{arch}.attention.scale", 0.5)], "attention.scale=0.5"),
    ([("{arch}.expert_count", 4)], "expert_count=4"),
    ([("{arch}.rope.dimension_count", 8)], "rope.dimension_count=8"),
    ([("{arch}.attention.value_length", 8)], "attention.value_length=8"),
]


@pytest.mark.parametrize("metadata,names", REFUSED_METADATA, ids=[r[1] for r in REFUSED_METADATA])
def test_gguf_metadata_that_changes_the_math_is_refused(metadata, names, tmp_path):
    hf = make_tiny("llama", tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf", metadata)
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    assert one_line_naming(e, path, names)


@pytest.mark.parametrize(
    "kind,tensor,shape",
    [
        ("qwen2", "blk.0.attn_output.bias", (64,)),  # transformers' qwen2 has no o_proj bias
        ("llama", "blk.0.ffn_gate.bias", (112,)),  # an MLP bias (the swiglu op takes none)
        ("mistral", "blk.1.attn_q.bias", (64,)),
    ],
)
def test_gguf_tensor_the_model_would_not_use_is_refused(kind, tensor, shape, tmp_path):
    hf = make_tiny(kind, tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf", extra_tensors={tensor: np.ones(shape, np.float32)})
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    assert one_line_naming(e, path, tensor)


# --------------------------------------------------------------------- non-finite weights, found at load


def _flip_tensor_type(path, name, new_type):
    """Overwrite the type field of tensor ``name`` in a GGUF header (as a damaged file would have it)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    struct.pack_into("<I", data, pos + 4 + 8 * n_dims, int(new_type))
    path.write_bytes(bytes(data))


def test_gguf_tensor_type_flipped_to_q5_1_fails_at_load_and_is_not_cached(tmp_path):
    hf = make_tiny("llama", tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf", qtypes={"token_embd.weight": GGMLQuantizationType.Q5_0})
    load_gguf(path, cache=False)  # the intact file loads
    _flip_tensor_type(path, "token_embd.weight", GGMLQuantizationType.Q5_1)
    home = tmp_path / "home"
    with pytest.raises(UserError) as e:
        load_gguf(path, cache=True, home=home)
    assert one_line_naming(e, path, "token_embd.weight", "NaN or infinite")
    assert not (home / "dequant").exists() or not any((home / "dequant").iterdir())


def test_gguf_nan_weight_fails_at_load_and_is_not_cached(tmp_path):
    hf = make_tiny("qwen2", tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    norm = hf.model.norm.weight.detach().numpy().astype(np.float32).tobytes()  # output_norm, stored F32
    at = data.index(norm)
    data[at : at + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))
    home = tmp_path / "home"
    with pytest.raises(UserError) as e:
        load_gguf(path, cache=True, home=home)
    assert one_line_naming(e, path, "output_norm.weight")
    assert not (home / "dequant").exists() or not any((home / "dequant").iterdir())


def test_safetensors_nan_weight_fails_at_load(tmp_path):
    make_tiny("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    sd = load_file(file)
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(UserError) as e:
        load_checkpoint(tmp_path)
    assert one_line_naming(e, file, "model.layers.1.mlp.up_proj.weight")


def test_dequant_cache_write_failure_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    hf = make_tiny("llama", tmp_path)
    path = write_gguf(hf, tmp_path / "m.gguf")

    def disk_full(sd, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    home = tmp_path / "home"
    with pytest.raises(UserError) as e:
        load_gguf(path, cache=True, home=home)
    assert one_line_naming(e, home / "dequant", "No space left on device")
    assert list((home / "dequant").iterdir()) == []


# --------------------------------------------------------------------- pre-quantized checkpoints


def test_quantization_says_whether_weights_are_pre_quantized(tmp_path):
    from quantize import QuantScheme, apply, quantization_config, write_checkpoint

    make_tiny("llama", tmp_path / "src")
    src = load_checkpoint(tmp_path / "src")
    assert src.quantization is None
    sd, info = apply(src, None, QuantScheme("int8", "bf16"), tokenizer=None)
    write_checkpoint(tmp_path / "q8", sd, src.hf_config, quantization_config(info))
    q8 = load_checkpoint(tmp_path / "q8")
    assert q8.quantization["quant_method"] == "tileinfer-int8" and q8.quantization["weights"] == "int8"


def test_int8_weights_without_quantization_config_are_refused(tmp_path):
    from quantize import QuantScheme, apply

    make_tiny("llama", tmp_path)
    sd, _ = apply(load_checkpoint(tmp_path), None, QuantScheme("int8", "bf16"), tokenizer=None)
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    with pytest.raises(UserError) as e:
        load_checkpoint(tmp_path)
    assert one_line_naming(e, tmp_path, "int8", "quantization_config")
