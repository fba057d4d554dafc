"""Non-finite logits stop the scoring pass; recorded base logits are reused only when intact; a corpus
row's KL."""

import pytest
import torch

from evals import corpus
from evals.base_store import LiveBase
from evals.drift import base_pass, score, set_statistics
from evals.evaluation import Item, ScoredSet
from tests.passes import full_logits
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import NonFiniteLogits
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.snapshots import Snapshots
from tileinfer.jobs import rows
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
    tokens = tuple(range(1, 61))
    ref = full_logits(runner(), tokens, 40)
    assert torch.isfinite(ref.logits).all() and ref.logits.shape == (20, 256)
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        full_logits(runner(poison_layer=1), tokens, 40)
    with pytest.raises(NonFiniteLogits):
        score(runner(poison_layer=0), ref, decode_steps=0)


def one_item(prompt, n_reply) -> ScoredSet:
    """A scored set of one prompt followed by the base's greedy reply of ``n_reply`` tokens."""
    return ScoredSet("edit", (Item(tuple(prompt), None, n_reply),), "prompt", {}, 1, f"n{n_reply}")


def test_recorded_base_logits_are_reused_and_a_damaged_file_is_not(tmp_path):
    """The base side of an item is recorded once on disk (runs_dir/cache/base) and read back by every
    later store over the same folder without running the base model; another prompt, reply length or
    base configuration is another file; a file cut short is recorded again, and a base pass that meets
    non-finite logits records nothing."""
    made = []

    def store(key="bf16", folder=tmp_path, poison_layer=None):
        return LiveBase(folder, {"base": key}, lambda: made.append(key) or runner(poison_layer), set(), 0.0)

    prompt, scored = list(range(1, 41)), one_item(range(1, 41), 8)
    first = store().logits(scored, 0)
    assert made == ["bf16"] and first.tokens[:40].tolist() == prompt and len(first.tokens) == 48
    path = store().path(scored, 0)
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]
    again = store().logits(scored, 0)  # another job's store: read from the file, no base runner made
    assert made == ["bf16"] and torch.equal(again.tokens, first.tokens) and torch.equal(again.logits, first.logits)
    others = {store().path(one_item(prompt[1:], 8), 0), store().path(one_item(prompt, 9), 0)}
    others.add(store("int8").path(scored, 0))
    assert path not in others and len(others) == 3
    data = path.read_bytes()
    path.unlink()  # a new file (the tensors read above map the old one's pages)
    path.write_bytes(data[:100])  # cut short
    redone = store().logits(scored, 0)
    assert made == ["bf16"] * 2 and torch.equal(redone.logits, first.logits)
    with pytest.raises(NonFiniteLogits):
        store(folder=tmp_path / "poisoned", poison_layer=1).logits(scored, 0)
    assert not [p for p in (tmp_path / "poisoned").iterdir() if p.suffix == ".safetensors"]


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
    # the scored set of evals.corpus.CorpusDrift, and what jobs.job.score_set makes of it
    items = tuple(Item(tuple(w[:n]), tuple(w[n:]), len(w) - n) for w in windows)
    scored = ScoredSet("tokens", items, "window", {}, 1, "window")
    passes = [score(cand_r, base_pass(base_r, i, set(), Snapshots(None)), decode_steps=0) for i in items]
    stats, _ = set_statistics(scored, passes, [w[n:] for w in windows])
    row = rows.make_row({}, stats, {}, 1.0)

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
