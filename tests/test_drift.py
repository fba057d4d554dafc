"""The scoring pass refuses non-finite logits; saved reference replies are reused only when intact."""

import pytest
import torch

from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import NonFiniteLogits
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs import drift
from tileinfer.models import Transformer

TINY = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def runner(poison_layer: int | None = None) -> ModelRunner:
    sd = random_state_dict(TINY, seed=0, dtype=torch.float32)
    if poison_layer is not None:  # as a corrupted checkpoint's bytes would be: one NaN weight
        sd[f"model.layers.{poison_layer}.mlp.down_proj.weight"][3, 5] = float("nan")
    model = Transformer.from_state_dict(ModelConfig.from_hf(TINY), sd, dtype=torch.float32)
    return ModelRunner(model, "reference", max_seq_len=128, page_size=16, prefill_chunk=32)


def test_non_finite_logits_stop_the_scoring_pass():
    stream = drift.Stream(tuple(range(1, 61)), 40)
    ref = drift.full_logits(runner(), stream)
    assert torch.isfinite(ref.logits).all() and ref.logits.shape == (20, 256)
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        drift.full_logits(runner(poison_layer=1), stream)
    with pytest.raises(NonFiniteLogits):
        drift.score(runner(poison_layer=0), ref, decode_steps=0)


def test_a_saved_reply_is_reused_and_a_damaged_one_is_not(tmp_path):
    r, prompt, cache = runner(), list(range(1, 41)), tmp_path / "edit0.json"
    assert drift.load_stream(cache, prompt, 8) is None
    base = drift.base_pass(r, prompt, 8, set(), drift.Snapshots(None))
    first = drift.Stream(tuple(base.tokens.tolist()), base.prompt_len)
    drift.save_stream(first, 8, cache)
    assert drift.load_stream(cache, prompt, 8) == first
    assert drift.load_stream(cache, prompt[1:], 8) is None and drift.load_stream(cache, prompt, 9) is None
    cache.write_text('{"prompt": [1, 2')  # cut short
    assert drift.load_stream(cache, prompt, 8) is None
