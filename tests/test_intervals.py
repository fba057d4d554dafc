"""Interval statistics (evals/intervals.py) against closed forms, and the bootstrap's resampling units."""

import math

import numpy as np
import pytest
import scipy.stats

from evals import intervals


def wilson_closed_form(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson (1927): (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


@pytest.mark.parametrize("k,n", [(127, 128), (128, 128), (0, 10), (300, 619)])
def test_wilson_matches_its_closed_form(k, n):
    z = scipy.stats.norm.ppf(0.975)
    assert intervals.wilson(k, n) == pytest.approx(wilson_closed_form(k, n, z), abs=1e-9)


def test_wilson_on_127_of_128_is_the_issue_s_example():
    lo, hi = intervals.wilson(127, 128)
    assert round(100 * lo, 1) == 95.7 and round(100 * hi, 1) == 99.9


def test_units_are_windows_when_there_are_enough_else_blocks_within_each_window():
    group = np.repeat(np.arange(12), 5)
    unit, block = intervals.resampling_units(group)
    assert block is None and (unit == group).all()
    group = np.repeat([0, 1], [30, 27])  # two prompts: blocks of ceil(30 ** (1/3)) = 4 positions
    unit, block = intervals.resampling_units(group)
    assert block == 4
    assert unit.tolist() == [i // 4 for i in range(30)] + [8 + i // 4 for i in range(27)]  # 8 blocks in the first
    assert intervals.resampling_units(group, min_units=2)[1] is None


def test_seeded_bootstrap_is_reproducible_and_near_the_t_interval_of_a_mean():
    x = np.random.default_rng(3).normal(2.0, 1.0, 400)
    unit = np.arange(400)
    stat = lambda idx: np.r_[x[idx].mean()]  # noqa: E731
    lo, hi = intervals.bootstrap_units(unit, stat, seed=5)
    assert (lo, hi) == intervals.bootstrap_units(unit, stat, seed=5)
    t = scipy.stats.t.ppf(0.975, 399) * x.std(ddof=1) / math.sqrt(400)
    assert lo[0] == pytest.approx(x.mean() - t, abs=0.15 * t) and hi[0] == pytest.approx(x.mean() + t, abs=0.15 * t)


def test_constant_data_give_a_zero_width_interval_and_one_unit_none():
    stat = lambda idx: np.r_[np.ones(len(idx)).mean()]  # noqa: E731
    lo, hi = intervals.bootstrap_units(np.arange(20), stat)
    assert lo[0] == hi[0] == 1.0
    lo, hi = intervals.bootstrap_units(np.zeros(20, int), stat)
    assert np.isnan(lo[0]) and np.isnan(hi[0])


def test_row_intervals_contain_the_estimates_and_llama_sigmas_match_their_formulas():
    rng = np.random.default_rng(0)
    n = 12 * 50
    pp = {
        "kl": rng.exponential(1e-3, n),
        "top1_agree": rng.random(n) < 0.98,
        "logp_base": -rng.exponential(1.0, n),
        "logp_cand": -rng.exponential(1.0, n),
    }
    row = intervals.row_intervals(pp, np.repeat(np.arange(12), 50), "window")
    assert row["ci_unit"] == "window" and row["ci_units"] == 12
    kl = pp["kl"]
    assert row["kl_mean_lo"] < kl.mean() < row["kl_mean_hi"]
    assert row["kl_p99_lo"] <= np.quantile(kl, 0.99) <= row["kl_p99_hi"]
    ln_ratio = np.mean(pp["logp_base"] - pp["logp_cand"])
    assert row["ln_ppl_ratio_lo"] < ln_ratio < row["ln_ppl_ratio_hi"]
    assert (row["top1_agree_lo"], row["top1_agree_hi"]) == intervals.wilson(int(pp["top1_agree"].sum()), n)
    assert row["kl_mean_sigma"] == pytest.approx(kl.std() / math.sqrt(n - 1))
    p = pp["top1_agree"].mean()
    assert row["top1_agree_sigma"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    nb, nq = -pp["logp_base"], -pp["logp_cand"]
    cov = np.cov(nb, nq, ddof=0)
    want = math.sqrt((cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]) / (n - 1))
    assert row["ln_ppl_ratio_sigma"] == pytest.approx(want)
    assert row["ppl_base_sigma"] == pytest.approx(math.exp(nb.mean()) * nb.std() / math.sqrt(n - 1))


def test_paired_difference_cancels_shared_variation():
    rng = np.random.default_rng(1)
    b = rng.exponential(1e-2, 500)
    d, lo, hi = intervals.paired_difference(b - 1e-4, b, np.repeat(np.arange(10), 50))
    assert d == pytest.approx(-1e-4) and lo == pytest.approx(-1e-4) and hi == pytest.approx(-1e-4)
    a = b * rng.uniform(0.4, 0.6, 500)  # a kernel that halves KL, position by position
    d, lo, hi = intervals.paired_difference(a, b, np.repeat(np.arange(10), 50))
    assert lo < d < hi < 0
    with pytest.raises(ValueError):
        intervals.paired_difference(a, b[:-1], np.zeros(500))
