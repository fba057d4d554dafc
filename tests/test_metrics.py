"""evals.metrics against scipy / numpy computed independently in float64."""

import numpy as np
import pytest
import torch
from scipy.special import rel_entr
from scipy.stats import entropy

from evals.metrics import MetricsAccumulator, greedy_agreement_length, percentile, position_metrics, summarize


def _logits_from_probs(rows):
    """Logits whose softmax is each row of probabilities (log p; zero probability -> -inf)."""
    p = np.asarray(rows, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return torch.tensor(np.log(p), dtype=torch.float32)


def _softmax64(logits):
    x = logits.double()
    return torch.softmax(x, dim=-1).numpy()


HAND_MADE = [
    # (P, Q) as probability vectors over a 5-token vocabulary
    ([0.1, 0.2, 0.3, 0.25, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]),
    ([0.5, 0.5 - 1e-12, 1e-12, 0.0, 0.0], [0.25, 0.25, 0.25, 0.125, 0.125]),  # near-zero and zero P
    ([1 - 4e-7, 1e-7, 1e-7, 1e-7, 1e-7], [0.9, 0.025, 0.025, 0.025, 0.025]),  # one-hot-ish
    ([0.2, 0.2, 0.2, 0.2, 0.2], [1 - 4e-9, 1e-9, 1e-9, 1e-9, 1e-9]),  # Q one-hot-ish: large KL
]


@pytest.mark.parametrize("p,q", HAND_MADE)
def test_kl_entropy_match_scipy_on_hand_made_distributions(p, q):
    ref, cand = _logits_from_probs([p]), _logits_from_probs([q])
    m = position_metrics(ref, cand, torch.tensor([0]))
    # scipy on the float32-rounded distributions that the logits actually encode
    p64, q64 = _softmax64(ref)[0], _softmax64(cand)[0]
    kl, rkl = entropy(p64, q64), entropy(q64, p64)
    # Bounds beside the largest error measured over the four cases (2026-12-01). The outputs are
    # float32: one ulp is 6e-8 to 1.2e-7 relative, so no bound goes below ~1e-6 relative (a value
    # that happens to round well, as ln 2 does, measures far less than its ulp).
    assert kl == pytest.approx(rel_entr(p64, q64).sum(), rel=5e-14)  # float64 both: 5.8e-15
    assert m["kl"].item() == pytest.approx(kl, rel=2e-6, abs=1e-7)  # 4.6e-7 relative
    assert m["rkl"].item() == pytest.approx(rkl, rel=2e-6, abs=1e-7)  # 4.1e-7 relative
    # near-zero entropies (one-hot-ish P): the absolute bound binds, measured 1.2e-7
    assert m["entropy_base"].item() == pytest.approx(entropy(p64), rel=1e-5, abs=1e-6)
    assert m["entropy_cand"].item() == pytest.approx(entropy(q64), rel=1e-5, abs=1e-6)
    assert m["p_base"].item() == pytest.approx(p64[0], rel=1e-6)  # 7.7e-8
    assert m["p_cand"].item() == pytest.approx(q64[0], rel=1e-6)  # 3.0e-8


def test_hand_made_values_are_the_textbook_ones():
    # KL([.5,.5] || [.25,.75]) = .5 ln 2 + .5 ln(2/3), written out by hand
    m = position_metrics(_logits_from_probs([[0.5, 0.5]]), _logits_from_probs([[0.25, 0.75]]), torch.tensor([1]))
    # float32 outputs, bounds ~10 ulps; measured 4.7e-7 (KL), 2.8e-9 (ln 2), 8e-8 (p), 2.4e-7 (dp)
    assert m["kl"].item() == pytest.approx(0.5 * np.log(2) + 0.5 * np.log(2 / 3), rel=1e-6)
    assert m["entropy_base"].item() == pytest.approx(np.log(2), rel=1e-6)
    assert m["p_cand"].item() == pytest.approx(0.75, rel=1e-6)
    assert m["dp"].item() == pytest.approx(0.25, rel=1e-6)
    assert not m["top1_agree"].item()  # argmax P = 0 (tie, lowest id), argmax Q = 1


def test_infinite_kl_where_candidate_has_zero_probability():
    p, q = [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]
    m = position_metrics(_logits_from_probs([p]), _logits_from_probs([q]), torch.tensor([0]))
    assert np.isinf(m["kl"].item()) and np.isinf(entropy(p, q))
    assert m["rkl"].item() == pytest.approx(entropy(q, p), rel=1e-6)  # = ln 2, zeros skipped (float32: 2.8e-9)
    assert not torch.isnan(torch.stack([m[k].float() for k in ("kl", "rkl", "entropy_base")])).any()


@pytest.mark.parametrize("vocab,scale", [(1000, 1.0), (32000, 0.3), (151936, 0.05)])
def test_random_logits_match_scipy(vocab, scale):
    g = torch.Generator().manual_seed(vocab)
    n = 6
    ref = torch.randn(n, vocab, generator=g) * 4
    cand = ref + torch.randn(n, vocab, generator=g) * scale
    tokens = torch.randint(0, vocab, (n,), generator=g)
    m = position_metrics(ref, cand, tokens)
    p, q = _softmax64(ref), _softmax64(cand)
    # measured over the three vocabularies (2026-12-01): KL 1.1e-4 relative at KL ~1e-3 (151936
    # tokens, scale 0.05: float32 terms of a small sum), entropies 2.0e-6, probabilities 1.7e-7,
    # dp 3.3e-11 absolute (the drawn tokens' p are below 1e-3: an absolute bound, ample for them),
    # log-probabilities 5.4e-8
    np.testing.assert_allclose(m["kl"].numpy(), entropy(p, q, axis=-1), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m["rkl"].numpy(), entropy(q, p, axis=-1), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(m["entropy_base"].numpy(), entropy(p, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(m["entropy_cand"].numpy(), entropy(q, axis=-1), rtol=1e-5)
    rows = np.arange(n)
    np.testing.assert_allclose(m["p_base"].numpy(), p[rows, tokens], rtol=1e-6)
    np.testing.assert_allclose(m["p_cand"].numpy(), q[rows, tokens], rtol=1e-6)
    np.testing.assert_allclose(m["dp"].numpy(), q[rows, tokens] - p[rows, tokens], atol=1e-9)
    np.testing.assert_allclose(m["logp_base"].numpy(), np.log(p[rows, tokens]), rtol=1e-6)
    np.testing.assert_array_equal(m["top1_agree"].numpy(), p.argmax(-1) == q.argmax(-1))
    np.testing.assert_array_equal(m["argmax_cand"].numpy(), q.argmax(-1))
    for k in ("kl", "rkl", "p_base", "dp", "logp_cand", "entropy_base"):
        assert m[k].dtype == torch.float32 and m[k].shape == (n,)
    assert m["top1_agree"].dtype == torch.bool


def test_small_kl_has_no_float32_noise_floor():
    """Near-identical full-vocabulary logits (the INT8-KV case): the float64 partition functions
    keep the error far below the ~1e-6 of a plain float32 log_softmax difference."""
    g = torch.Generator().manual_seed(1)
    ref = (torch.randn(8, 151936, generator=g) * 3 + 20).bfloat16().float()
    cand = (ref + torch.randn(8, 151936, generator=g) * 0.02).bfloat16().float()
    m = position_metrics(ref, cand, torch.zeros(8, dtype=torch.long))
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    exact = (lp.exp() * (lp - lq)).sum(-1).numpy()
    assert np.abs(m["kl"].numpy() - exact).max() < 3e-7


def test_identical_logits_give_exactly_zero():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(5, 151936, generator=g) * 5).bfloat16()
    m = position_metrics(logits, logits.clone(), torch.arange(5))
    assert torch.equal(m["kl"], torch.zeros(5)) and torch.equal(m["rkl"], torch.zeros(5))
    assert torch.equal(m["dp"], torch.zeros(5))
    assert bool(m["top1_agree"].all())


def test_shape_errors():
    with pytest.raises(ValueError):
        position_metrics(torch.zeros(3, 10), torch.zeros(3, 11), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        position_metrics(torch.zeros(3, 10), torch.zeros(3, 10), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001, 1024])
def test_percentile_is_numpy_linear_interpolation(n):
    v = np.random.default_rng(n).exponential(size=n)
    for f in (0.0, 0.001, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0):
        # float64 both ways, interpolated in another order: measured 1.7e-16 (one ulp)
        assert percentile(v, f) == pytest.approx(np.quantile(v, f, method="linear"), rel=2e-15)
    assert percentile(v, 0.5) == pytest.approx(np.median(v), rel=2e-15)


def test_percentile_hand_values():
    # llama.cpp: r = f*(n-1), interpolate between sorted[floor r] and the next one
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([10.0, 0.0], 0.9) == pytest.approx(9.0)
    assert percentile(np.arange(11.0), 0.99) == pytest.approx(9.9)
    with pytest.raises(ValueError):
        percentile([], 0.5)


def _random_chunks(seed, sizes, vocab=512):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ref = torch.randn(n, vocab, generator=g) * 3
        cand = ref + torch.randn(n, vocab, generator=g) * 0.7
        out.append((ref, cand, torch.randint(0, vocab, (n,), generator=g)))
    return out


def test_summarize_matches_numpy():
    chunks = _random_chunks(3, [256, 256, 77])
    acc = MetricsAccumulator()
    for c in chunks:
        acc.add(*c)
    s = acc.summary()

    ref = torch.cat([c[0] for c in chunks]).double()
    cand = torch.cat([c[1] for c in chunks]).double()
    tok = torch.cat([c[2] for c in chunks]).numpy()
    p, q = torch.softmax(ref, -1).numpy(), torch.softmax(cand, -1).numpy()
    rows = np.arange(len(tok))
    kl = entropy(p, q, axis=-1)
    dp = q[rows, tok] - p[rows, tok]
    assert s["n_positions"] == 589
    # The per-position values are float32 (one ulp 6e-8 to 1.2e-7 relative): each statistic is held to
    # ~10 ulps, rel=1e-6; measured (2026-12-01) 1.1e-7 (max), 3.9e-7 (percentiles), and less for the
    # means, whose roundings partly cancel (3e-10 for kl_mean, at most 7.7e-8 for dp_mean)
    assert s["kl_mean"] == pytest.approx(kl.mean(), rel=1e-6)
    assert s["kl_max"] == pytest.approx(kl.max(), rel=1e-6)
    for key, f in (("kl_median", 0.5), ("kl_p90", 0.9), ("kl_p99", 0.99), ("kl_p999", 0.999)):
        assert s[key] == pytest.approx(np.quantile(kl, f), rel=1e-6), key
    assert s["rkl_mean"] == pytest.approx(entropy(q, p, axis=-1).mean(), rel=1e-6)
    assert s["top1_agree"] == np.mean(p.argmax(-1) == q.argmax(-1))  # a count over n: exact
    assert 0.0 < s["top1_agree"] < 1.0  # the data exercises both outcomes
    assert s["ppl_base"] == pytest.approx(np.exp(-np.log(p[rows, tok]).mean()), rel=1e-6)
    assert s["ppl_cand"] == pytest.approx(np.exp(-np.log(q[rows, tok]).mean()), rel=1e-6)
    assert s["ln_ppl_ratio"] == pytest.approx(np.log(s["ppl_cand"] / s["ppl_base"]), rel=5e-15)  # float64: 4e-16
    assert s["p_base_mean"] == pytest.approx(p[rows, tok].mean(), rel=1e-6)
    assert s["p_cand_mean"] == pytest.approx(q[rows, tok].mean(), rel=1e-6)
    assert s["dp_mean"] == pytest.approx(dp.mean(), rel=1e-6, abs=1e-10)  # 1.4e-11 absolute at 1.8e-4
    assert s["rms_dp"] == pytest.approx(np.sqrt(np.mean(dp**2)), rel=1e-6)


def test_accumulator_equals_one_shot_and_numpy_input_works():
    chunks = _random_chunks(4, [100, 28])
    acc = MetricsAccumulator()
    for c in chunks:
        acc.add(*c)
    one = position_metrics(*(torch.cat([c[i] for c in chunks]) for i in range(3)))
    for k, v in acc.per_position().items():
        assert torch.equal(v, one[k]), k
    as_numpy = {k: v.numpy() for k, v in one.items()}
    assert summarize(as_numpy) == acc.summary()  # the same values: bit for bit
    with pytest.raises(ValueError):
        MetricsAccumulator().summary()


@pytest.mark.parametrize(
    "argmax,reply,expected",
    [
        ([5, 6, 7], [1, 6, 7], 0),  # first reply token already differs
        ([5, 6, 9, 8, 0], [5, 6, 7, 8, 4], 2),  # first divergence at 2; later (mis)matches don't count
        ([5, 6, 7], [5, 6, 7], 3),  # full agreement
        ([], [], 0),
    ],
)
def test_greedy_agreement_length(argmax, reply, expected):
    assert greedy_agreement_length(argmax, reply) == expected
    assert greedy_agreement_length(torch.tensor(argmax, dtype=torch.long), np.array(reply, dtype=np.int32)) == expected


def test_greedy_agreement_from_position_metrics():
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(6, 50, generator=g)
    cand = ref.clone()
    cand[4, ref[4].argmax()] -= 100.0  # the candidate's greedy choice flips at position 4
    reply = ref.argmax(-1)  # the reference's greedy reply
    m = position_metrics(ref, cand, reply)
    assert greedy_agreement_length(m["argmax_cand"], reply) == 4
    with pytest.raises(ValueError):
        greedy_agreement_length([1, 2], [1, 2, 3])
