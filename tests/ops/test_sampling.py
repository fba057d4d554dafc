"""Token selection of every backend: argmax against the reference, sampling against the reference's
filtered distribution (temperature, then top-k, then top-p).

argmax must equal the reference exactly, ties to the lowest id. A sampler's draws must stay in the
kept set and their histogram must match the filtered softmax (total variation, or the largest
frequency error over many draws); seeded draws reproduce. Small (interpreter): vocabularies of 150
to 10000, Triton's candidate settings shrunk so both its candidate path and its full-pass fallback
run. Model (GPU): the registered vocabularies (49152, 151936) and a 40-token one for tight
frequency bounds.
"""

from __future__ import annotations

import pytest
import torch

from tests.numerics import MODELS, filtered
from tileinfer.ops import reference as R

VOCABS = sorted({c.vocab_size for c in MODELS.values()})


@pytest.mark.cases("T,V", small=[(3, 10000)], model=[(T, V) for V in VOCABS for T in (1, 5, 16)])
def test_argmax(target, T, V):
    x = torch.randn(T, V, device=target.device) * 4
    assert torch.equal(target.ops.argmax(x), R.argmax(x))
    x[:, 7] = x[:, V - 3] = 100.0  # ties in two chunks on every row: the lowest id wins
    x[0, 5] = x[0, V // 2] = x[0, V - 1] = 200.0
    x[-1, :] = 1.0  # every id tied
    assert torch.equal(target.ops.argmax(x), R.argmax(x))


@pytest.mark.cases(
    "V,N,t,k,p",
    small=[
        (150, 32, 1.0, 0, 1.0),
        (150, 32, 0.7, 12, 0.9),
        (300, 32, 1.0, 0, 0.6),
        (300, 32, 1.3, 5, 1.0),
        (300, 32, 0.5, 1, 1.0),
    ],
    model=[(151936, 8192, t, k, p) for t, k, p in ((0.7, 20, 0.95), (1.0, 0, 0.9), (1.0, 50, 1.0), (0.6, 0, 1.0))],
)
def test_sample_matches_the_filtered_distribution(target, monkeypatch, V, N, t, k, p):
    """N rows of the same logits, a tie at the top: the total variation between the histogram of the
    draws and the filtered softmax stays within what N draws allow."""
    interpreted = target.device == "cpu"
    if interpreted:  # several candidate blocks per row at a small vocabulary
        from tileinfer.ops.triton import sampling

        for name, value in (("SAMPLE_BLOCK", 64), ("CAND_CHUNK", 64), ("CAND_K", 8), ("MERGE_K", 16)):
            monkeypatch.setattr(sampling, name, value)
    x = torch.randn(1, V, device=target.device) * 2
    x[0, 3] = x[0, 77] = x[0].max() + 0.5
    s = target.ops.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator(target.device).manual_seed(3))
    keep, probs = filtered(x, t, k, p)
    assert s.dtype == torch.int64 and s.shape == (N,)
    assert keep[0][s].all(), "a token outside the top-k / top-p set"
    kept = int(keep.sum())
    hist = torch.bincount(s, minlength=V).double() / N
    tv = 0.5 * (hist - probs[0].double()).abs().sum().item()
    # loose in the interpreter, which affords 32 draws
    bound = 0.15 + 0.5 * (kept / N) ** 0.5 if interpreted else 0.05 + 0.6 * (min(kept, N) / N) ** 0.5
    assert tv < bound, (tv, kept)


@pytest.mark.cases("k,p", model=[(0, 1.0), (20, 1.0), (0, 0.9), (50, 0.8), (1, 1.0)])
def test_sample_stays_in_the_kept_set(target, k, p):
    """64 different rows of the largest vocabulary, the default generator; top_k = 1 is argmax."""
    logits = torch.randn(64, max(VOCABS), device=target.device) * 3
    keep, _ = filtered(logits, 0.7, k, p)
    tok = target.ops.sample(logits, 0.7, k, p, None)
    assert tok.dtype == torch.int64 and tok.shape == (64,)
    assert bool(keep.gather(1, tok[:, None]).all()), "sampled a token the filters drop"
    if k == 1:
        assert torch.equal(tok, R.argmax(logits))


@pytest.mark.cases("k,p", model=[(0, 1.0), (6, 1.0), (0, 0.7), (10, 0.6)])
def test_sample_frequencies_over_many_draws(target, k, p):
    """20000 draws from one 40-token row: every frequency within 0.015 of the filtered softmax, and
    the same seed gives the same draws."""
    V, N = 40, 20000
    logits = (torch.randn(V, device=target.device) * 1.5).expand(N, V).contiguous()
    keep, probs = filtered(logits[:1], 0.8, k, p)
    tok = target.ops.sample(logits, 0.8, k, p, torch.Generator(target.device).manual_seed(1234))
    freq = torch.bincount(tok, minlength=V).double() / N
    assert float((freq - probs[0].double()).abs().max()) < 0.015
    assert bool(keep[0][tok].all())
    again = target.ops.sample(logits, 0.8, k, p, torch.Generator(target.device).manual_seed(1234))
    assert torch.equal(tok, again), "seeded draws reproduce"
