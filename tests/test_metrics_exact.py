"""evals.metrics against values worked out by hand or with numpy/scipy, not with the module itself
(tests/test_metrics.py holds the regression and property checks)."""

import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from evals.metrics import greedy_agreement_length, percentile, position_metrics, summarize


def test_position_metrics_equal_scipy_on_random_rows():
    """KL, reverse KL, entropies, log-probabilities and argmaxes of three random rows against
    scipy's ``entropy`` and ``log_softmax`` in float64. Catches a sign error in the partition
    term, reverse KL computed as KL, an entropy of Q taken under P. Measured error: < 2e-6 (float32
    logits); bound 1e-5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g) * 3
    y = x + torch.randn(3, 50, generator=g)
    nxt = torch.tensor([4, 0, 49])
    m = position_metrics(x, y, nxt)
    lp, lq = special.log_softmax(x.double().numpy(), -1), special.log_softmax(y.double().numpy(), -1)
    p, q = np.exp(lp), np.exp(lq)
    for i in range(3):
        assert m["kl"][i].item() == pytest.approx(stats.entropy(p[i], q[i]), abs=1e-5)
        assert m["rkl"][i].item() == pytest.approx(stats.entropy(q[i], p[i]), abs=1e-5)
        assert m["entropy_base"][i].item() == pytest.approx(stats.entropy(p[i]), abs=1e-5)
        assert m["entropy_cand"][i].item() == pytest.approx(stats.entropy(q[i]), abs=1e-5)
        assert m["logp_base"][i].item() == pytest.approx(lp[i, nxt[i]], abs=1e-5)
        assert m["logp_cand"][i].item() == pytest.approx(lq[i, nxt[i]], abs=1e-5)
        assert m["dp"][i].item() == pytest.approx(q[i, nxt[i]] - p[i, nxt[i]], abs=1e-6)
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
