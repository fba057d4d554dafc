"""Token selection: every backend's argmax against the reference, and the reference sampler (the one
generation uses for sampled decoding) against its filtered distribution (temperature, then top-k,
then top-p).

argmax must equal the reference exactly, ties to the lowest id. The sampler's draws must stay in the
kept set and their histogram must pass a chi-square test whose power against planted bugs (the
temperature squared, always the argmax) is checked (tests/numerics.py ``chi2_test``); seeded draws
reproduce. argmax small (interpreter): vocabularies of 10000 and the shipped 151936; model (GPU):
the registered vocabularies.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.numerics import MODELS, chi2_test, filtered
from tileinfer.ops import reference as R

VOCABS = sorted({c.vocab_size for c in MODELS.values()})


@pytest.mark.cases("T,V", small=[(3, 10000), (2, 151936)], model=[(T, V) for V in VOCABS for T in (1, 5, 16)])
def test_argmax(target, T, V):
    x = torch.randn(T, V, device=target.device) * 4
    assert torch.equal(target.ops.argmax(x), R.argmax(x))
    x[:, 7] = x[:, V - 3] = 100.0  # ties in two chunks on every row: the lowest id wins
    x[0, 5] = x[0, V // 2] = x[0, V - 1] = 200.0
    x[-1, :] = 1.0  # every id tied
    assert torch.equal(target.ops.argmax(x), R.argmax(x))


def alternatives(x: torch.Tensor, t: float, k: int, p: float) -> list[torch.Tensor]:
    """What two planted sampler bugs draw from: the temperature squared, and always the argmax."""
    squared = filtered(x, t * t, k, p)[1][0]
    greedy = torch.zeros(x.shape[-1], device=x.device)
    greedy[R.argmax(x)[0]] = 1.0
    return [squared, greedy] if t != 1.0 else [greedy]


@pytest.mark.parametrize("V,t,k,p", [(200, 0.7, 0, 1.0), (200, 0.6, 20, 0.9), (200, 1.2, 0, 0.7)])
def test_reference_sampler_passes_chi_square(V, t, k, p):
    """The reference sampler, 20000 draws from one row, against the distribution computed here
    (tests/numerics.py ``filtered``, not ``reference.sampling_probs``): chi-square p >= 1e-4, with a
    power >= 0.999 against the temperature squared and against always returning the argmax."""
    N = 20000
    x = torch.randn(1, V) * 2
    s = R.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator().manual_seed(5))
    keep, probs = filtered(x, t, k, p)
    assert keep[0][s].all()
    chi2_test(s, probs[0], alternatives=alternatives(x, t, k, p))


def test_reference_sampling_probs_by_hand():
    """``reference.sampling_probs`` (what the samplers and speculative decoding's rejection step draw
    from) at its edges, against values worked out by hand: top_k = 1 keeps the argmax alone, top_k = 0
    or >= the vocabulary keeps all; top-p drops a token once the mass before it reaches p (on four equal
    logits the masses are exact: at p = 0.5 the third token's 0.5 before it drops it, at p = 0.25 the
    second's); temperature 0, or anything below 1e-6, divides by 1e-6: logits 1e-5 apart become 10
    apart. Catches ``1 < top_k`` for ``0 < top_k``, ``<=`` for ``<`` at the k-th value, a strict
    top-p comparison, another temperature floor."""
    x = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    assert R.sampling_probs(x, 1.0, 1, 1.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    e = math.e
    assert R.sampling_probs(x, 1.0, 2, 1.0)[0].tolist() == pytest.approx([0, e / (1 + e), 1 / (1 + e), 0], abs=1e-7)
    z = sum(math.exp(v) for v in (0.0, 2.0, 1.0, -1.0))
    everything = [math.exp(v) / z for v in (0.0, 2.0, 1.0, -1.0)]
    for k in (0, 4, 5):
        assert R.sampling_probs(x, 1.0, k, 1.0)[0].tolist() == pytest.approx(everything, abs=1e-7), k
    z2 = sum(math.exp(2 * v) for v in (0.0, 2.0, 1.0, -1.0))  # temperature 0.5 doubles the logits
    halved = [math.exp(2 * v) / z2 for v in (0.0, 2.0, 1.0, -1.0)]
    assert R.sampling_probs(x, 0.5, 0, 1.0)[0].tolist() == pytest.approx(halved, abs=1e-7)
    # top-p on equal logits (probabilities 0.25, exact); which of the tied tokens stay is the sort's choice
    flat = torch.zeros(1, 4)
    for p, kept in ((0.5, 2), (0.25, 1), (0.5000001, 3), (0.75, 3), (1.0, 4)):
        probs = R.sampling_probs(flat, 1.0, 0, p)[0]
        assert sorted(probs.tolist()) == pytest.approx([0.0] * (4 - kept) + [1.0 / kept] * kept, abs=1e-7), p
    near = torch.tensor([[0.0, 1e-5]])
    for t in (0.0, 1e-7, 1e-6):  # below the floor, and on it: 1e-5 / 1e-6 = 10
        assert R.sampling_probs(near, t, 0, 1.0)[0, 0].item() == pytest.approx(1 / (1 + math.exp(10)), rel=1e-4), t
    assert R.sampling_probs(near, 2e-6, 0, 1.0)[0, 0].item() == pytest.approx(1 / (1 + math.exp(5)), rel=1e-4)
    # top_p = 1 filters nothing, not even a token below float32's resolution of the cumulative mass
    # (1 - 9e-14 rounds to 1, so "mass before it >= 1" would drop it)
    tiny = R.sampling_probs(torch.tensor([[0.0, -30.0]]), 1.0, 0, 1.0)[0, 1].item()
    assert tiny == pytest.approx(math.exp(-30) / (1 + math.exp(-30)), rel=1e-5, abs=0)


def test_reference_argmax_and_seeded_sampling_by_hand():
    """argmax per row, the lowest id on ties; one seeded generator gives the same draws twice and
    draws from it, not from torch's global stream."""
    x = torch.tensor([[0.0, 3.0, 3.0], [5.0, -1.0, 5.0]])
    assert R.argmax(x).tolist() == [1, 0]
    logits = torch.zeros(64, 1000)
    a, b = (R.sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(7)) for _ in range(2))
    torch.manual_seed(123)
    c = R.sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and torch.equal(a, c) and a.shape == (64,) and a.dtype == torch.int64
