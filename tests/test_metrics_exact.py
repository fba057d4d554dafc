"""evals.metrics against values worked out by hand or with numpy/scipy, not with the module itself
(tests/test_metrics.py holds the regression and property checks)."""

import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from evals.metrics import (
    MetricsAccumulator,
    greedy_agreement_length,
    percentile,
    position_metrics,
    repeated_ngram_fraction,
    summarize,
)


def test_position_metrics_equal_scipy_on_random_rows():
    """KL, reverse KL, entropies, log-probabilities and argmaxes of three random rows against
    scipy's ``entropy`` and ``log_softmax`` in float64. Catches a sign error in the partition
    term, reverse KL computed as KL, an entropy of Q taken under P. Measured errors (float32 outputs,
    2026-12-01): KL 2.4e-7, reverse KL 1.8e-7, entropies 9.9e-7, log-probabilities 9.5e-8, dp 5.6e-10
    (probabilities below 1e-2); each bound ~10x its measured error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g) * 3
    y = x + torch.randn(3, 50, generator=g)
    nxt = torch.tensor([4, 0, 49])
    m = position_metrics(x, y, nxt)
    lp, lq = special.log_softmax(x.double().numpy(), -1), special.log_softmax(y.double().numpy(), -1)
    p, q = np.exp(lp), np.exp(lq)
    for i in range(3):
        assert m["kl"][i].item() == pytest.approx(stats.entropy(p[i], q[i]), abs=2e-6)
        assert m["rkl"][i].item() == pytest.approx(stats.entropy(q[i], p[i]), abs=2e-6)
        assert m["entropy_base"][i].item() == pytest.approx(stats.entropy(p[i]), abs=1e-5)
        assert m["entropy_cand"][i].item() == pytest.approx(stats.entropy(q[i]), abs=1e-5)
        assert m["logp_base"][i].item() == pytest.approx(lp[i, nxt[i]], abs=1e-6)
        assert m["logp_cand"][i].item() == pytest.approx(lq[i, nxt[i]], abs=1e-6)
        assert m["dp"][i].item() == pytest.approx(q[i, nxt[i]] - p[i, nxt[i]], abs=5e-9)
    assert m["argmax_base"].tolist() == np.argmax(p, -1).tolist()
    assert m["top1_agree"].tolist() == (np.argmax(p, -1) == np.argmax(q, -1)).tolist()


def test_two_token_kl_by_hand():
    """P = (1/2, 1/2), Q = softmax(0, ln 3) = (1/4, 3/4): KL, reverse KL, H(P) = ln 2 and p_cand by
    hand. Bound 1e-6: the outputs are float32 (measured error 1.2e-7, one float32 ulp of ~0.13)."""
    x = torch.tensor([[0.0, 0.0]])
    y = torch.tensor([[0.0, math.log(3.0)]])
    m = position_metrics(x, y, torch.tensor([1]))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert m["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert m["rkl"].item() == pytest.approx(rkl, abs=1e-6)
    assert m["entropy_base"].item() == pytest.approx(math.log(2), abs=1e-6)
    assert m["p_cand"].item() == pytest.approx(0.75, abs=1e-6) and m["dp"].item() == pytest.approx(0.25, abs=1e-6)


def test_percentile_by_hand():
    """llama.cpp's linear interpolation: values 1..5 (unsorted), median 3, p90 = 4.6, p25 = 2; an even
    count's median is the midpoint. Catches nearest-rank, floor-only, off-by-one ranks."""
    v = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(v, 0.5) == 3.0
    assert percentile(v, 0.9) == pytest.approx(4.6)
    assert percentile(v, 0.25) == 2.0
    assert percentile([1.0, 2.0, 10.0, 4.0], 0.5) == 3.0
    assert percentile(v, 0.0) == 1.0 and percentile(v, 1.0) == 5.0


def test_greedy_agreement_length_by_hand():
    """The common prefix length: 2 for a first mismatch at index 2, 0 at index 0, n when equal."""
    assert greedy_agreement_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert greedy_agreement_length([7, 2], [1, 2]) == 0
    assert greedy_agreement_length([1, 2, 3], [1, 2, 3]) == 3


def test_summarize_by_hand():
    """rms_dp is the root mean square of dp (not the mean |dp|), perplexities exp(mean NLL)."""
    per = {
        "kl": np.array([0.0, 0.2, 0.4, 0.6]),
        "rkl": np.array([0.1, 0.1, 0.1, 0.1]),
        "top1_agree": np.array([True, True, False, True]),
        "p_base": np.array([0.5, 0.5, 0.5, 0.5]),
        "p_cand": np.array([0.5, 0.8, 0.5, 0.2]),
        "dp": np.array([0.0, 0.3, 0.0, -0.3]),
        "logp_base": np.log(np.array([0.5, 0.5, 0.5, 0.5])),
        "logp_cand": np.log(np.array([0.5, 0.8, 0.5, 0.2])),
    }
    per |= {k: np.zeros(4) for k in ("entropy_base", "entropy_cand")}
    per |= {k: np.zeros(4, dtype=np.int64) for k in ("argmax_base", "argmax_cand")}
    s = summarize(per)
    assert s["rms_dp"] == pytest.approx(math.sqrt(0.045))
    assert s["kl_mean"] == pytest.approx(0.3) and s["kl_median"] == pytest.approx(0.3)
    assert s["top1_agree"] == 0.75 and s["ppl_base"] == pytest.approx(2.0)
    assert s["ppl_cand"] == pytest.approx(math.exp(-np.log([0.5, 0.8, 0.5, 0.2]).mean()))


def test_summarize_percentiles_by_hand():
    """Every KL statistic of summarize on KL values 0, 1, ..., 10 (shuffled): mean 5, median 5, p90 9,
    p99 9.9, p99.9 9.99 (interpolated between 9 and 10 at rank 0.99 x 10 and 0.999 x 10), max 10.
    Catches one percentile computed at another's fraction, the max taken as the last value."""
    kl = np.array([3.0, 10.0, 0.0, 7.0, 1.0, 9.0, 2.0, 8.0, 4.0, 6.0, 5.0])
    n = kl.size
    per = {"kl": kl, "rkl": kl / 2, "top1_agree": np.ones(n, dtype=bool)}
    per |= {k: np.full(n, 0.5) for k in ("p_base", "p_cand")} | {
        k: np.full(n, math.log(0.5)) for k in ("logp_base", "logp_cand")
    }
    s = summarize(per)
    want = dict(kl_mean=5.0, kl_median=5.0, kl_p90=9.0, kl_p99=9.9, kl_p999=9.99, kl_max=10.0, rkl_mean=2.5)
    assert {k: s[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert s["n_positions"] == n and s["top1_agree"] == 1.0 and s["ln_ppl_ratio"] == 0.0


def test_one_position_is_a_summary_and_none_is_an_error_that_says_so():
    """A single scored position summarizes (every KL statistic is its value); no positions, arrays of
    other lengths, an empty percentile and replies of other lengths are ValueErrors naming the problem
    (an empty accumulator too, not a torch error)."""
    one = {"kl": np.array([0.25]), "rkl": np.array([0.5]), "top1_agree": np.array([False])}
    one |= {k: np.array([0.5]) for k in ("p_base", "p_cand")} | {k: np.log([0.5]) for k in ("logp_base", "logp_cand")}
    s = summarize(one)
    assert [s[k] for k in ("kl_mean", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max")] == [0.25] * 6
    assert s["n_positions"] == 1 and s["top1_agree"] == 0.0 and s["rkl_mean"] == 0.5
    with pytest.raises(ValueError, match="no scored positions to summarize"):
        summarize({k: v[:0] for k, v in one.items()})
    with pytest.raises(ValueError, match="no scored positions to summarize"):
        MetricsAccumulator().summary()
    with pytest.raises(ValueError, match=r"per-position arrays differ in length: .*'rkl': 2"):
        summarize(one | {"rkl": np.array([0.5, 0.5])})
    with pytest.raises(ValueError, match="percentile of an empty array"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="argmax has 2 positions but the reply has 3 tokens"):
        greedy_agreement_length([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match=r"next_tokens must be \[2\]; got \(3,\)"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must both be \[N, V\]; got \(2, 5\) and \(2, 4\)"):
        position_metrics(torch.zeros(2, 5), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


def test_repeated_ngram_fraction_by_hand():
    """The share of tokens completing an n-gram seen before in the reply: [1, 2, 3, 4] twice repeats one
    4-gram of 8 tokens; a shared 3-gram or 2-gram is not a repeated 4-gram; with n = 2, [1, 2, 1, 2, 1]
    repeats (1, 2) and (2, 1) once each. Catches n-grams of another length, a scan starting early."""
    assert repeated_ngram_fraction([1, 2, 3, 4, 1, 2, 3, 4]) == 1 / 8
    assert repeated_ngram_fraction([5, 1, 2, 3, 6, 1, 2, 3]) == 0.0  # (1, 2, 3) twice
    assert repeated_ngram_fraction([1, 2, 7, 8, 1, 2, 9, 9]) == 0.0  # (1, 2) twice
    assert repeated_ngram_fraction([1, 2, 1, 2, 1], n=2) == 2 / 5
    assert repeated_ngram_fraction([7, 7, 7]) == 0.0 and repeated_ngram_fraction([]) == 0.0
