"""Non-finite logits stop the scoring pass; saved replies are reused only when intact; a corpus row's KL."""

import pytest
import torch

from evals import corpus
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import NonFiniteLogits
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs import drift, tables
from tileinfer.jobs.resume import Snapshots
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


def test_a_corpus_row_is_the_kl_over_the_windows_second_halves():
    # base: the tiny model; candidate: its weights with 2% noise, over windows of 24 tokens
    sd = random_state_dict(TINY, seed=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    noisy = {k: v * (1 + 0.02 * torch.randn(v.shape, generator=g)) for k, v in sd.items()}
    base_r, cand_r = (
        ModelRunner(Transformer.from_state_dict(ModelConfig.from_hf(TINY), w), max_seq_len=64, page_size=16)
        for w in (sd, noisy)
    )
    ctx, n = 24, corpus.prompt_len(24)
    windows = corpus.windows(torch.randint(2, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist(), ctx, 1)
    results = []
    for w in windows:  # as job.Job.live_base and job.run score a corpus
        base = drift.base_pass(base_r, w[:n], ctx - n, set(), Snapshots(None), w[n:])
        results.append(drift.score(cand_r, base, decode_steps=0))
    kw = dict(device=torch.device("cpu"), weights_bytes=1, kv_bytes=1, wall_s=1.0, kl_estimate="exact", fallbacks=[])
    row = tables.make_row({}, results, replies=[w[n:] for w in windows], unit="window", **kw)

    def window_logits(r, w):  # every position of the window in one forward step
        seq = r.new_sequence()
        try:
            return torch.log_softmax(r.step(seq, torch.tensor(w)).double(), dim=-1)
        finally:
            seq.release()

    kl, nll = [], []
    for w in windows:
        lp, lq = window_logits(base_r, w), window_logits(cand_r, w)
        scored = slice(ctx // 2, ctx - 1)  # positions 12..22 predict tokens 13..23
        kl.append((lp.exp() * (lp - lq)).sum(-1)[scored])
        nll.append(-lp[scored].gather(-1, torch.tensor(w[ctx // 2 + 1 :])[:, None])[:, 0])
    kl, nll = torch.cat(kl), torch.cat(nll)
    assert len(windows) == 3 and row["n_scored"] == 3 * (ctx - 1 - ctx // 2) == len(kl)
    # kl_mean: float32 per-position KL of small values against float64, measured 7.3e-5 relative
    assert row["kl_mean"] > 0 and row["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-4, abs=1e-9)
    # a float32 mean NLL of ~23.7 is exact to ~1 ulp (1.9e-6), and exp turns that into the relative error
    # of the PPL: measured 2.2e-8 on one thread, 3.2e-7 on two (CI)
    assert row["ppl_base"] == pytest.approx(float(nll.mean().exp()), rel=2e-6)
    assert row["kl_mean_lo"] <= row["kl_mean"] <= row["kl_mean_hi"] and row["ci_unit"] == "block of 3 positions"
