"""The llama GGUF q/k un-permute at every GQA ratio real models use (1, 2, 3, 4, 6, 7, 8).

llama.cpp's converter permutes the rows of ``attn_q`` with the query head count and those of
``attn_k`` with the KV head count (``LlamaModel.permute``); the loader must undo each with its own
count. The one real llama GGUF in the suite (SmolLM2, GQA ratio 3) cannot tell a loader that skips
the un-permute for plain MHA (ratio 1), or un-permutes k with the query head count, from a correct
one. Here tiny one-layer llama models are written as GGUF files by the test
(tests/tiny_models.py:write_gguf, llama.cpp's permute) and read back; the expectation is the
model's own weights, and transformers' GGUF loader reading the same file.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny, write_gguf
from tileinfer.core.checkpoint.gguf_file import load_gguf

RATIOS = (1, 2, 3, 4, 6, 7, 8)  # MHA; Qwen2.5-0.5B (7); Llama-3 8B, Qwen3-8B (4); SmolLM2 (3); ...


@pytest.mark.parametrize("ratio", RATIOS)
def test_gguf_qk_unpermute_at_every_gqa_ratio(ratio, tmp_path):
    """q_proj/k_proj (and the rest) read back bit for bit equal to the weights that were written.

    Catches: the un-permute skipped when kv_heads == heads, k un-permuted with the query head count,
    q with the KV head count, the pair axes swapped in ``_unpermute`` (head_dim 16: 8 pairs, so a
    swapped reshape is not the identity)."""
    kv_heads = 2 if ratio < 8 else 1  # two KV heads where the query heads stay <= 14
    hf = make_tiny(
        "llama",
        tmp_path,
        num_hidden_layers=1,
        num_attention_heads=ratio * kv_heads,
        num_key_value_heads=kv_heads,
        hidden_size=16 * ratio * kv_heads,
        head_dim=16,
    )
    path = write_gguf(hf, tmp_path / f"gqa{ratio}.gguf")
    cfg, sd = load_gguf(path, dtype=torch.float32, cache=False)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (ratio * kv_heads, kv_heads)
    want = hf.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(sd[name], want[name]), f"{name} at GQA ratio {ratio}: rows in the wrong order"
    for name, tensor in want.items():
        assert torch.equal(sd[name], tensor), name


@pytest.mark.parametrize("ratio", (1, 4, 7))
def test_gguf_qk_unpermute_equals_transformers_loader(ratio, tmp_path):
    """An expectation independent of tests/tiny_models.py's permute: transformers' own GGUF reader
    (``reverse_permute_weights``) on the same file gives the same q/k rows."""
    from transformers import AutoModelForCausalLM

    hf = make_tiny(
        "llama",
        tmp_path,
        num_hidden_layers=1,
        num_attention_heads=2 * ratio,
        num_key_value_heads=2,
        hidden_size=32 * ratio,
        head_dim=16,
    )
    # transformers takes the vocabulary size from the metadata (32000 without it), the engine from token_embd
    path = write_gguf(hf, tmp_path / "m.gguf", [("{arch}.vocab_size", hf.config.vocab_size)])
    _, sd = load_gguf(path, dtype=torch.float32, cache=False)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(sd[name], ref[name]), name
