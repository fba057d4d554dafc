"""tileinfer.core.checkpoint.gguf_file against gguf.GGUFReader and transformers' own GGUF loader."""

import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from tileinfer.core.checkpoint import gguf_file
from tileinfer.core.checkpoint.gguf_file import gguf_metadata, load_gguf, read_header
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError


def _transformers_state(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.config, model.state_dict()


def test_header_equals_gguf_reader(smollm2_gguf):
    ours, ref = read_header(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.offset, info.nbytes, info.ggml_type) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "qwen05_gguf"])
def test_state_dict_equals_transformers(fixture, request):
    """Names, shapes and float32 values equal transformers' (llama: q/k un-permuted; qwen2: biases, untied head)."""
    path = request.getfixturevalue(fixture)
    cfg, sd = load_gguf(path, dtype=torch.float32, cache=False)
    ref_cfg, ref = _transformers_state(path)
    if cfg["tie_word_embeddings"]:
        assert torch.equal(ref.pop("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert sorted(sd) == sorted(ref)
    for name, tensor in ref.items():
        assert sd[name].dtype == torch.float32 and sd[name].shape == tensor.shape, name
        assert torch.equal(sd[name], tensor), name
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "model_type",
    ):
        assert cfg[key] == getattr(ref_cfg, key), key
    assert cfg["rope_theta"] == ref_cfg.rope_parameters["rope_theta"]
    mc = ModelConfig.from_hf(cfg)
    assert mc.head_dim == (getattr(ref_cfg, "head_dim", None) or ref_cfg.hidden_size // ref_cfg.num_attention_heads)
    assert mc.attention_bias == (cfg["model_type"] == "qwen2")


def test_default_dtype_is_bf16_rounding_of_float32(smollm2_gguf):
    _, f32 = load_gguf(smollm2_gguf, dtype=torch.float32, cache=False)
    _, bf16 = load_gguf(smollm2_gguf, cache=False)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name in f32:
        assert torch.equal(bf16[name], f32[name].to(torch.bfloat16)), name


def test_tensors_are_writable_copies(smollm2_gguf):
    _, sd = load_gguf(smollm2_gguf, dtype=torch.float32, cache=False)
    w = sd["model.norm.weight"]  # stored as F32 in the file: must not alias the read-only map
    w.add_(1.0)
    _, again = load_gguf(smollm2_gguf, dtype=torch.float32, cache=False)
    assert torch.equal(again["model.norm.weight"] + 1.0, w)


def test_dequant_cache_round_trip_and_invalidation(smollm2_gguf, tmp_path, monkeypatch):
    gguf_copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, gguf_copy)
    home = tmp_path / "home"
    cfg, sd = load_gguf(gguf_copy, cache=True, home=home)
    files = list((home / "dequant").glob("*.safetensors"))
    assert len(files) == 1 and "bfloat16" in files[0].name
    real = gguf_file._dequantize_all
    monkeypatch.setattr(gguf_file, "_dequantize_all", lambda *a: pytest.fail("cache not used"))
    cfg2, sd2 = load_gguf(gguf_copy, cache=True, home=home)
    assert cfg2 == cfg and sorted(sd2) == sorted(sd)
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    # A changed file (new mtime) gets a new cache entry, and the stale one is removed.
    monkeypatch.setattr(gguf_file, "_dequantize_all", real)
    st = gguf_copy.stat()
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_gguf(gguf_copy, cache=True, home=home)
    files2 = list((home / "dequant").glob("*.safetensors"))
    assert len(files2) == 1 and files2 != files
    # Bytes written into the cache after it was made (same size): rebuilt from the GGUF, not trusted.
    with open(files2[0], "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\x7f" * 4096)
    cfg3, sd3 = load_gguf(gguf_copy, cache=True, home=home)
    assert all(torch.equal(sd[k], sd3[k]) for k in sd)


def test_truncated_file_is_user_error(smollm2_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm2_gguf.read_bytes()[: smollm2_gguf.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated") as e:
        load_gguf(bad, cache=False)
    assert str(bad) in str(e.value)
    bad.write_bytes(smollm2_gguf.read_bytes()[:100_000])  # cut inside the metadata
    with pytest.raises(UserError, match="truncated or corrupt GGUF header"):
        gguf_metadata(bad)


def test_not_a_gguf_is_user_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(UserError, match="not a GGUF"):
        load_gguf(bad)
    bad.write_bytes(b"")
    with pytest.raises(UserError, match=str(bad)):
        load_gguf(bad)


def _write_gguf(path, arch, tensors, extra=()):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    for key, value in extra:
        w.add_uint32(key, value)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_and_tensor_are_user_errors(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((10, 8), np.float32)})
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'"):
        load_gguf(path, cache=False)
    path = tmp_path / "odd.gguf"
    _write_gguf(
        path,
        "llama",
        {"token_embd.weight": np.zeros((10, 8), np.float32), "blk.0.mystery.weight": np.zeros((8,), np.float32)},
    )
    with pytest.raises(UserError, match="unexpected tensor blk.0.mystery.weight"):
        load_gguf(path, cache=False)
    path = tmp_path / "partial.gguf"
    _write_gguf(
        path,
        "llama",
        {"token_embd.weight": np.zeros((10, 8), np.float32), "output_norm.weight": np.ones((8,), np.float32)},
    )
    with pytest.raises(UserError, match="lacks .* tensors, e.g. model.layers.0"):
        load_gguf(path, cache=False)
