"""load_checkpoint on GGUF files and folders: every metadata key that changes the math is read or
refused, NaN weights are found at load (and never cached), and a pre-quantized checkpoint says so.
GGUF files are tiny random models written the way llama.cpp's converter writes them; logits against
transformers on the same weights, float32 on the CPU."""

import errno
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from tests.test_model_vs_transformers import LOGITS_TOL
from tests.tiny_models import make_tiny, write_gguf
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.checkpoint.gguf_file import load_gguf
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
