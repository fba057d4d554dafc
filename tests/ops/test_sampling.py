"""Token selection of every backend: argmax against the reference, sampling against the reference's
filtered distribution (temperature, then top-k, then top-p).

argmax must equal the reference exactly, ties to the lowest id. A sampler's draws must stay in the
kept set and their histogram must pass a chi-square test whose power against planted bugs (the
temperature squared, always the argmax) is checked (tests/numerics.py ``chi2_test``); seeded draws
reproduce. Small (interpreter): vocabularies of 24 to 10000 and the shipped 151936 for argmax,
Triton's candidate settings shrunk so both its candidate path and its full-pass fallback run, and
one case at the shipped settings (two 4096-token candidate chunks: ~5 s each in the interpreter,
so the 37 chunks of a 151936 vocabulary, ~3 min, are left to the GPU); the distribution exactly,
on a stratified grid of uniforms. Model (GPU): the registered vocabularies (49152, 151936) and a
40-token one, 8192 to 20000 draws.
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


SMALL_BLOCKS = (("SAMPLE_BLOCK", 64), ("CAND_CHUNK", 64), ("CAND_K", 8), ("MERGE_K", 16))


@pytest.mark.cases(
    "V,N,t,k,p",
    small=[(150, 32, 1.0, 0, 1.0), (300, 32, 0.7, 12, 0.9), (300, 32, 0.5, 1, 1.0)],
    model=[(151936, 8192, t, k, p) for t, k, p in ((0.7, 20, 0.95), (1.0, 0, 0.9), (1.0, 50, 1.0), (0.6, 0, 1.0))],
)
def test_sample_matches_the_filtered_distribution(target, monkeypatch, V, N, t, k, p):
    """N rows of the same logits, a tie at the top: every draw in the kept set, and (GPU, 8192 draws)
    the histogram passes a chi-square test (p >= 1e-4) whose power against a sampler with the
    temperature squared or one that always returns the argmax is checked to be >= 0.999. The
    interpreter affords 32 draws (Triton's candidate settings shrunk so both its candidate path and
    its full-pass fallback run): membership only; its distribution is checked exactly by
    :func:`test_sample_inverse_cdf_is_exact_on_a_stratified_grid`."""
    interpreted = target.device == "cpu"
    if interpreted:  # several candidate blocks per row at a small vocabulary
        from tileinfer.ops.triton import sampling

        for name, value in SMALL_BLOCKS:
            monkeypatch.setattr(sampling, name, value)
    x = torch.randn(1, V, device=target.device) * 2
    x[0, 3] = x[0, 77] = x[0].max() + 0.5
    s = target.ops.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator(target.device).manual_seed(3))
    keep, probs = filtered(x, t, k, p)
    assert s.dtype == torch.int64 and s.shape == (N,)
    assert keep[0][s].all(), "a token outside the top-k / top-p set"
    if not interpreted:
        chi2_test(s, probs[0], alternatives=alternatives(x, t, k, p))


@pytest.mark.cases("V", small=[4096 + 904])
def test_sample_at_the_shipped_block_sizes(target, V):
    """Triton's sampler at its shipped settings (4096-token candidate chunks, 64 candidates each, 256
    merged), over two chunks, the second partial: two rows whose top token lies in different chunks,
    top_k = 1 must give the argmax (~10 s in the interpreter: 4 candidate programs). Catches a bug
    only the real block sizes reach (the other interpreter cases shrink them): a merge that reads one
    chunk's candidates, a chunk offset off by one block."""
    x = torch.randn(2, V, device=target.device) * 3
    x[1, V - 5] = x[1].max() + 4  # row 1's favourite in the partial second chunk
    x[0, 100] = x[0].max() + 4  # row 0's in the first
    assert torch.equal(target.ops.sample(x, 0.7, 1, 1.0, torch.Generator(target.device).manual_seed(2)), R.argmax(x))


# every token a candidate (the select kernel's exact path, top-p included)
ALL_CANDIDATES = (("SAMPLE_BLOCK", 64), ("CAND_CHUNK", 64), ("CAND_K", 64), ("MERGE_K", 64))


@pytest.mark.cases(
    "V,t,k,p,blocks",
    small=[
        (24, 0.7, 0, 1.0, "shrunk"),  # 8 candidates of 24: the full-pass kernel draws
        (24, 0.6, 8, 1.0, "shrunk"),
        (40, 0.8, 0, 0.8, "all"),  # top-p (the full pass would draw it by rejection: not one uniform)
        (40, 1.0, 7, 0.9, "all"),
    ],
    targets=("triton-interpret", "triton"),
)
def test_sample_inverse_cdf_is_exact_on_a_stratified_grid(target, monkeypatch, V, t, k, p, blocks):
    """Triton's sampler draws by inverse CDF from one uniform per row: fed the grid u_i = (i + 0.5) / N
    instead of random uniforms, token j must come out N * p_j times up to one (p the filtered
    softmax): an exact check of the distribution from only N = 64 rows. The same check against the
    distributions of a sampler with the temperature squared or one that always returns the argmax
    is verified to fail (they differ by more than 3 counts). Catches those two, a top-p or top-k off
    by one token, a wrong softmax normaliser."""
    from tileinfer.ops.triton import sampling

    for name, value in SMALL_BLOCKS if blocks == "shrunk" else ALL_CANDIDATES:
        monkeypatch.setattr(sampling, name, value)
    N = 64
    x = torch.randn(1, V, device=target.device) * 2
    keep, probs = filtered(x, t, k, p)
    for alt in alternatives(x, t, k, p):
        assert float((alt - probs[0]).abs().max()) * N > 3, "the grid cannot tell this alternative apart"
    grid = ((torch.arange(N, device=target.device, dtype=torch.float32) + 0.5) / N)[:, None]
    real_rand = torch.rand

    def stratified(size, *args, **kw):
        assert tuple(size)[0] == N, size
        return (grid * torch.ones(size, device=target.device)).contiguous()  # every round the same u

    monkeypatch.setattr(torch, "rand", stratified)
    try:
        s = target.ops.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator(target.device).manual_seed(0))
    finally:
        monkeypatch.setattr(torch, "rand", real_rand)
    assert keep[0][s].all(), "a token outside the top-k / top-p set"
    counts = torch.bincount(s, minlength=V).double()
    dev = (counts - N * probs[0].double()).abs().max().item()
    assert dev <= 1.0 + 1e-3, f"a token drawn {dev:.2f} times more or less often than its probability says"


@pytest.mark.cases(
    "V,t,k,p", small=[(200, 0.7, 0, 1.0), (200, 0.6, 20, 0.9), (200, 1.2, 0, 0.7)], targets=("reference",)
)
def test_reference_sampler_passes_chi_square(target, V, t, k, p):
    """The reference sampler, 20000 draws from one row, against the distribution computed here
    (tests/numerics.py ``filtered``, not ``reference.sampling_probs``): chi-square p >= 1e-4, with a
    power >= 0.999 against the temperature squared and against always returning the argmax."""
    N = 20000
    x = torch.randn(1, V) * 2
    s = target.ops.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator().manual_seed(5))
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
    """20000 draws from one 40-token row: chi-square against the filtered softmax (p >= 1e-4, power
    >= 0.999 against the temperature squared and the argmax), and the same seed gives the same draws."""
    V, N = 40, 20000
    logits = (torch.randn(V, device=target.device) * 1.5).expand(N, V).contiguous()
    keep, probs = filtered(logits[:1], 0.8, k, p)
    tok = target.ops.sample(logits, 0.8, k, p, torch.Generator(target.device).manual_seed(1234))
    assert bool(keep[0][tok].all())
    chi2_test(tok, probs[0], alternatives=alternatives(logits[:1], 0.8, k, p))
    again = target.ops.sample(logits, 0.8, k, p, torch.Generator(target.device).manual_seed(1234))
    assert torch.equal(tok, again), "seeded draws reproduce"
