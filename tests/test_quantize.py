"""INT8 weights, the INT8 KV cache round trip, quantized checkpoints and ``python -m quantize``."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantize import QuantScheme, apply, kv_int8_of, quantization_config, write_checkpoint
from quantize.weights import BLOCK_LINEARS, quantize_weights
from tests.tiny_models import make_tiny, make_tiny_with_tokenizer
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer
from tileinfer.ops import reference

REPO = Path(__file__).resolve().parent.parent


def roundtrip_bound_holds(x, q, scale):
    """|x - q * scale| <= scale / 2 for every entry, up to float32 rounding (of x / scale, q * scale)."""
    x = x.float()
    err = (x - q.float() * scale[..., None]).abs()
    bound = scale[..., None] / 2 + 2 * torch.finfo(torch.float32).eps * x.abs()
    return bool((err <= bound).all())


@pytest.mark.parametrize("shape", [(896, 4864), (4864, 896), (128, 64)])
def test_int8_weight_roundtrip(shape):
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, a few large outliers, and an all-zero row
    w = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    w[3, 7] *= 50
    w[5] = 0
    out, names = quantize_weights({"lm_head.weight": w}, _config(0))
    q, scale = out["lm_head.weight"], out["lm_head.weight_scale"]
    assert names == ["lm_head.weight"]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    assert roundtrip_bound_holds(w, q, scale)
    assert q.abs().max() <= 127
    nonzero = scale > 0
    assert (q.abs().amax(1)[nonzero] == 127).all(), "each row's largest entry should map to ±127"
    assert (q[~nonzero] == 0).all()


def test_int8_kv_cache_roundtrip():
    """Vectors written through the engine's INT8 cache read back within half a step of their scale."""
    g = torch.Generator().manual_seed(1)
    T, kvh, d, page = 70, 2, 64, 16
    cache = PagedKVCache(1, num_pages=8, page_size=page, num_kv_heads=kvh, head_dim=d, dtype=torch.bfloat16, int8=True)
    layer = cache.layers[0]
    block_table = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int32)  # pages out of order
    k = (torch.randn(T, kvh, d, generator=g) * 3).to(torch.bfloat16)
    k[:, :, 5] *= 40  # an outlier channel
    v = torch.randn(T, kvh, d, generator=g).to(torch.bfloat16)
    reference.write_kv(layer, k, v, block_table, torch.arange(T, dtype=torch.int32))
    pos = torch.arange(T)
    pages, slots = block_table.long()[pos // page], pos % page
    for x, vals, scales in ((k, layer.k, layer.k_scale), (v, layer.v, layer.v_scale)):
        q = vals[pages, :, slots]  # [T, kvh, d]
        s = scales[pages, :, slots]
        assert q.dtype == torch.int8 and s.shape == (T, kvh)
        assert roundtrip_bound_holds(x, q, s)


def _config(layers, tied=False):
    from tileinfer.core.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
        attention_bias=False,
        qk_norm=False,
    )


def test_a_missing_weight_is_named():
    """An untied model without ``lm_head.weight`` (and a block without a projection): a UserError that
    names the tensor, not a KeyError; a tied one quantizes its embedding instead."""
    w = torch.randn(8, 4)
    with pytest.raises(UserError, match="checkpoint has no tensor 'lm_head.weight'"):
        quantize_weights({"model.embed_tokens.weight": w}, _config(0))
    with pytest.raises(UserError, match="no tensor 'model.layers.0.self_attn.q_proj.weight'"):
        quantize_weights({"lm_head.weight": w}, _config(1))
    out, names = quantize_weights({"model.embed_tokens.weight": w}, _config(0, tied=True))
    assert names == ["lm_head.weight"] and torch.equal(out["lm_head.weight"], reference.quantize_int8(w)[0])


def logits_of(model, ids, kv_int8=False):
    """Logits of every position of ``ids``, prefilled in chunks of 32 over pages of 16."""
    runner = ModelRunner(model, kv_int8=kv_int8, max_seq_len=128, page_size=16, prefill_chunk=32)
    return torch.cat([lg for _, lg in runner.chunks(runner.new_sequence(), ids, logits_from=0)])


@pytest.mark.parametrize("kind", ["llama", "llama3-scaled", "qwen2", "qwen3"])
def test_weight_quantization_covers_linears_and_lm_head(kind, tmp_path):
    make_tiny(kind, tmp_path)
    ck = load_checkpoint(tmp_path)
    c, sd = ck.config, ck.state_dict
    out, names = quantize_weights(sd, c)
    linears = {f"model.layers.{i}.{m}.weight" for i in range(c.num_hidden_layers) for m in BLOCK_LINEARS}
    assert set(names) == linears | {"lm_head.weight"}
    assert {n for n, t in out.items() if t.dtype == torch.int8} == set(names)
    assert set(out) == set(sd) | set(names) | {n + "_scale" for n in names}
    for n in names:
        assert out[n + "_scale"].dtype == torch.float32 and out[n + "_scale"].shape == (out[n].shape[0],)
    for n in sd:  # embedding, norms, biases: the very same tensors
        if n not in names:
            assert out[n] is sd[n]
    if c.tie_word_embeddings:
        assert "lm_head.weight" not in sd
        assert roundtrip_bound_holds(
            sd["model.embed_tokens.weight"], out["lm_head.weight"], out["lm_head.weight_scale"]
        )
    model, ref = (Transformer.from_state_dict(c, x, dtype=torch.float32) for x in (out, sd))
    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    got, expected = (logits_of(m, ids) for m in (model, ref))
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert 0 < rel < 0.05  # INT8 rounding on a 64-wide random model: small, not zero
    with pytest.raises(UserError, match="already int8"):
        quantize_weights(out, c)


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    return make_tiny_with_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3"))


def cli(*args):
    """Run ``python -m quantize ARGS`` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "quantize", *map(str, args)], cwd=REPO, capture_output=True, text=True)


def test_cli_checkpoint_reloads_with_identical_logits(tiny_with_tokenizer, tmp_path):
    from tileinfer.core.tokenizer import Tokenizer

    src = tiny_with_tokenizer
    out = tmp_path / "q"
    proc = cli(src, "--out", out, "--weights", "int8", "--kv-cache", "int8", "--smooth-keys")
    assert proc.returncode == 0, proc.stderr
    assert "tensors quantized" in proc.stdout

    ck = load_checkpoint(out)
    qc = ck.quantization
    assert qc["quant_method"] == "tileinfer-int8" and qc["weights"] == "int8" and qc["kv_cache"] == "int8"
    assert qc["smooth_keys"] is True and qc["smooth_alpha"] == 0.5 and qc["calibration"] == "builtin"
    assert qc["calibration_tokens"] > 0 and set(qc["source_sha256"]) >= {"config.json", "model.safetensors"}
    assert kv_int8_of(ck)
    sd = ck.state_dict
    assert sd["model.layers.0.self_attn.k_smooth"].shape == (ck.config.num_key_value_heads, ck.config.head_dim)
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    saved, orig = Tokenizer.load(out), Tokenizer.load(src)
    assert saved.encode("def f(x):\n") == orig.encode("def f(x):\n")
    assert saved.eos_token_ids == orig.eos_token_ids and saved.bos_token_id == orig.bos_token_id

    source = load_checkpoint(src)
    in_memory, _ = apply(source, None, QuantScheme("int8", "int8"), Tokenizer.load(src))
    ids = torch.randint(0, ck.config.vocab_size, (100,), generator=torch.Generator().manual_seed(3))
    from_disk = Transformer.from_state_dict(ck.config, ck.state_dict)
    from_memory = Transformer.from_state_dict(source.config, in_memory)
    assert torch.equal(logits_of(from_disk, ids, kv_int8_of(ck)), logits_of(from_memory, ids, kv_int8=True))


def test_cli_user_errors_exit_1(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    other = tmp_path / "gptq"  # another tool's quantized model
    other.mkdir()
    (other / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    for folder, force in ((out, ()), (out, ("--force",)), (other, ("--force",))):
        # --force replaces a checkpoint this tool wrote, never other files
        proc = cli(tiny_with_tokenizer, "--out", folder, *force)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert "not a quantized checkpoint" in proc.stderr
    assert (other / "config.json").exists()
    proc = cli(tmp_path / "missing", "--out", tmp_path / "o")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert (out / "keep.txt").exists() and not (tmp_path / "o").exists()


def test_write_checkpoint_atomic_and_force(tmp_path):
    make_tiny("llama", tmp_path / "src")
    ck = load_checkpoint(tmp_path / "src")
    sd, info = apply(ck, None, QuantScheme("int8", "bf16"), tokenizer=None)
    qc = quantization_config(info)
    assert qc == {"quant_method": "tileinfer-int8", "weights": "int8", "kv_cache": "bf16", "smooth_keys": False}
    out = tmp_path / "out"
    write_checkpoint(out, sd, ck.hf_config, qc)
    with pytest.raises(UserError, match="--force"):
        write_checkpoint(out, sd, ck.hf_config, qc)
    write_checkpoint(out, sd, ck.hf_config, qc, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"], "no temporary folders left behind"
    back = load_checkpoint(out)
    assert not kv_int8_of(back) and back.quantization["weights"] == "int8"
    for name, t in sd.items():
        expected = t if t.dtype == torch.int8 or name.endswith("_scale") else t.to(torch.bfloat16)
        assert torch.equal(back.state_dict[name], expected), name


def test_named_presets_are_the_conf_quant_files():
    """quantize.NAMED (the benchmarks' --quants) and conf/quant/*.yaml name the same presets with
    the same precisions, and an unknown name is refused rather than run as some other preset."""
    import yaml

    from quantize import NAMED, named_scheme

    files = {
        p.stem: yaml.safe_load(p.read_text()) for p in (Path(__file__).parents[1] / "conf" / "quant").glob("*.yaml")
    }
    assert set(files) == set(NAMED)
    for name, y in files.items():
        s = named_scheme(name)
        assert (s.weights, s.kv_cache) == (y["weights"], y["kv_cache"]) == NAMED[name], name
        assert not s.smoothing
    with pytest.raises(UserError, match="unknown quantization 'int8'"):
        named_scheme("int8")


@pytest.mark.parametrize(
    "module,argv,says",
    [
        ("decode", ["--quants", "bf16,int8_weight"], "unknown 'int8_weight'"),
        ("decode", ["--quants", "int8_both,"], "unknown ''"),
        ("decode", ["--models", "nosuch"], "unknown model 'nosuch'"),
        ("peers.bench", ["--quants", "int8_both"], "unknown 'int8_both'"),
        ("peers.bench", ["--peers", "gptfast,"], "--peers: unknown ''"),
        ("peers.bench", ["--models", "nosuch"], "unknown model 'nosuch'"),
        ("sweep_cost", ["--model", "nosuch"], "unknown model 'nosuch'"),
        ("sweep_cost", ["--quant", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_benchmarks_refuse_unknown_names(capsys, module, argv, says):
    """A typo in a benchmark's model or quantization ends with one usage line (exit 2) before any
    work, even without a GPU, not as a run of another preset or a traceback later."""
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
