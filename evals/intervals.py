"""Confidence intervals of the drift statistics, and llama.cpp's +- 1 sigma figures beside them.

Every statistic of a row is an estimate from a sample of scored positions. This module gives each
one a two-sided 95% interval:

- ``top1_agree``: the Wilson score interval (Wilson 1927, "Probable inference, the law of
  succession, and statistical inference"), ``scipy.stats.binomtest(k, n).proportion_ci("wilson")``.
  It treats positions as independent draws, which neighbouring positions are not quite.
- ``kl_mean``, the KL percentiles and ``ln_ppl_ratio`` (``ln(PPL(Q)/PPL(base))``; exponentiate for the
  PPL ratio): the bias-corrected and accelerated (BCa) bootstrap (Efron 1987, "Better bootstrap
  confidence intervals"), ``scipy.stats.bootstrap(method="BCa")``, resampling whole *units* of
  positions rather than positions, because positions of one window or reply are correlated. A unit
  is a window (corpus rows) or a prompt when a row has at least :data:`MIN_UNITS` of them; with
  fewer (a prompt set of one or two prompts, a corpus run on a few windows) it is a block of
  ``ceil(m ** (1/3))`` consecutive positions of one window or prompt of ``m`` positions (the
  non-overlapping block bootstrap of Carlstein 1986, the block length of order ``n^(1/3)`` of Hall,
  Horowitz & Jing 1995), never crossing from one window or prompt into the next. A block bootstrap
  assumes the dependence between positions dies out within a block; a bootstrap over a handful of
  windows cannot estimate a spread at all.
- :func:`paired_difference`: the difference of a statistic between two configurations scored on
  the same positions (what key smoothing buys, what a kernel change costs), with the same resampling
  applied to both at once, so the shared position-to-position variation cancels.

``llama_sigma`` gives the standard errors llama.cpp's ``perplexity --kl-divergence`` prints after
``±`` (``tools/perplexity/perplexity.cpp``: ``mean_and_uncertainty``, ``covariance``), labelled as
such: they assume independent positions, so they are narrower than the intervals above.

Every bootstrap is seeded (:data:`SEED`), so a row's intervals are reproducible.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import scipy.stats

CONFIDENCE = 0.95
N_RESAMPLES = 2000
SEED = 0
# Windows or prompts below this many are too few to resample: blocks of positions are resampled instead.
MIN_UNITS = 10
# Row statistic -> quantile, as evals.metrics.summarize defines them (llama.cpp's percentiles).
QUANTILES = {"kl_median": 0.5, "kl_p90": 0.90, "kl_p99": 0.99, "kl_p999": 0.999}
# The statistics bootstrapped for a row, in the order of :func:`_row_statistics`' output.
BOOTSTRAPPED = ("kl_mean", *QUANTILES, "ln_ppl_ratio")


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n`` (Wilson 1927), via
    ``scipy.stats.binomtest(successes, n).proportion_ci(confidence, method="wilson")`` (no continuity
    correction). 127 of 128 gives (0.9571, 0.9986).

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside 0..n.
    """
    ci = scipy.stats.binomtest(int(successes), int(n)).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def resampling_units(group, min_units: int = MIN_UNITS) -> tuple[np.ndarray, int | None]:
    """The unit each position is resampled with: its window or prompt, or a block of positions.

    Args:
        group: ``[N]`` int, the window or prompt of each position; a group's positions are
            consecutive and in order.
        min_units: fewest groups that are resampled as they are.

    Returns:
        ``(unit, block)``: ``unit`` int64 ``[N]``, 0-based unit ids, nondecreasing; ``block`` None when the
        units are the groups, else the length of the blocks, ``ceil(m ** (1/3))`` for the largest group
        of ``m`` positions (a group's last block may be shorter).
    """
    group = np.asarray(group).ravel()
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if group.size else np.zeros(0, np.int64)
    sizes = np.diff(np.r_[starts, group.size])
    if len(starts) >= min_units or group.size == 0:
        return np.repeat(np.arange(len(starts)), sizes), None
    block = math.ceil(int(sizes.max()) ** (1 / 3))
    offset = np.cumsum(np.r_[0, -(-sizes[:-1] // block)])  # blocks before each group
    unit = np.concatenate([offset[g] + np.arange(m) // block for g, m in enumerate(sizes)])
    return unit.astype(np.int64), block


def bootstrap_units(
    unit, statistic: Callable[[np.ndarray], np.ndarray], seed: int = SEED, n_resamples: int = N_RESAMPLES
) -> tuple[np.ndarray, np.ndarray]:
    """BCa intervals (Efron 1987) of a vector ``statistic`` of positions, resampling whole units.

    Args:
        unit: ``[N]`` nondecreasing unit ids (:func:`resampling_units`).
        statistic: maps an index array into the ``N`` positions (a resample: the positions of the
            drawn units, concatenated) to a float vector ``[S]``.
        seed, n_resamples: the bootstrap's generator seed and number of resamples.

    Returns:
        ``(lo, hi)``, float64 ``[S]``. Where BCa is undefined (every resample gives the same value, e.g.
        a KL percentile that is 0 in every resample) the percentile interval of the same resamples is
        used; with fewer than two units both are NaN.
    """
    unit = np.asarray(unit).ravel()
    starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]]) if unit.size else np.zeros(0, np.int64)
    sizes = np.diff(np.r_[starts, unit.size])

    def positions(drawn: np.ndarray) -> np.ndarray:  # the positions of units ``drawn``, concatenated
        lengths = sizes[drawn]
        shift = np.repeat(starts[drawn] - np.cumsum(np.r_[0, lengths[:-1]]), lengths)
        return np.arange(lengths.sum()) + shift

    full = np.asarray(statistic(np.arange(unit.size)), dtype=np.float64)
    if len(starts) < 2:
        return np.full_like(full, np.nan), np.full_like(full, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate statistics: handled below
        res = scipy.stats.bootstrap(
            (np.arange(len(starts)),),
            lambda drawn: statistic(positions(drawn)),
            vectorized=False,
            n_resamples=n_resamples,
            confidence_level=CONFIDENCE,
            method="BCa",
            rng=np.random.default_rng(seed),
        )
    lo, hi = (np.atleast_1d(np.asarray(v, dtype=np.float64)) for v in res.confidence_interval)
    dist = np.atleast_2d(res.bootstrap_distribution)
    tail = (1 - CONFIDENCE) / 2
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    lo[bad] = np.quantile(dist[bad], tail, axis=-1)
    hi[bad] = np.quantile(dist[bad], 1 - tail, axis=-1)
    return lo, hi


def _row_statistics(a: Mapping[str, np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """The statistics of :data:`BOOTSTRAPPED` over the positions given by an index array."""
    kl, ln_ratio = a["kl"], a["logp_base"] - a["logp_cand"]
    q = list(QUANTILES.values())

    def stat(idx: np.ndarray) -> np.ndarray:
        k = kl[idx]
        return np.r_[k.mean(), np.quantile(k, q), ln_ratio[idx].mean()]

    return stat


def _mean_sigma(x: np.ndarray) -> float:
    """llama.cpp's ``mean_and_uncertainty``: sqrt((mean(x^2) - mean(x)^2) / (n - 1)), 0 for n <= 10."""
    n = x.size
    var = float(np.mean(x * x) - np.mean(x) ** 2)
    return math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def llama_sigma(per_position: Mapping[str, object]) -> dict[str, float]:
    """The ``±`` figures of llama.cpp's ``perplexity --kl-divergence`` (one standard error, positions
    taken as independent; ``tools/perplexity/perplexity.cpp``).

    Args:
        per_position: ``kl``, ``top1_agree``, ``logp_base``, ``logp_cand`` as 1-D arrays of length N.

    Returns:
        ``kl_mean_sigma`` (nats), ``top1_agree_sigma`` (fraction; llama.cpp prints percent),
        ``ppl_base_sigma``, ``ppl_cand_sigma`` (PPL * sigma of the mean NLL), ``ln_ppl_ratio_sigma``
        (sqrt(s_Q^2 + s_base^2 - 2 cov), the covariance of the two NLLs / (n - 1), 0 below 10 positions).
    """
    a = {
        k: np.asarray(per_position[k], dtype=np.float64).ravel() for k in ("kl", "top1_agree", "logp_base", "logp_cand")
    }
    n = a["kl"].size
    nll_b, nll_q = -a["logp_base"], -a["logp_cand"]
    s_b, s_q = _mean_sigma(nll_b), _mean_sigma(nll_q)
    cov = float(np.mean(nll_b * nll_q) - nll_b.mean() * nll_q.mean()) / (n - 1) if n >= 10 else 0.0
    p = float(a["top1_agree"].mean())
    return {
        "kl_mean_sigma": _mean_sigma(a["kl"]),
        "top1_agree_sigma": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
        "ppl_base_sigma": math.exp(nll_b.mean()) * s_b,
        "ppl_cand_sigma": math.exp(nll_q.mean()) * s_q,
        "ln_ppl_ratio_sigma": math.sqrt(max(s_q * s_q + s_b * s_b - 2 * cov, 0.0)),
    }


def row_intervals(per_position: Mapping[str, object], group, unit: str) -> dict:
    """Interval columns of a row: ``<stat>_lo`` and ``<stat>_hi`` for ``top1_agree`` (Wilson) and each
    of :data:`BOOTSTRAPPED` (BCa over units), the :func:`llama_sigma` figures, ``ci_unit`` (``unit``,
    i.e. window or prompt, or ``block of L positions``), ``ci_units`` (how many units were resampled)
    and ``ci_level``.

    Args:
        per_position: ``kl``, ``top1_agree``, ``logp_base``, ``logp_cand``: 1-D arrays of length N
            (torch tensors or numpy arrays); without the two log-probabilities the PPL figures are NaN.
        group: ``[N]`` the window or prompt index of each position (:func:`resampling_units`).
        unit: what a group is: ``window`` or ``prompt``.

    Raises:
        ValueError: no positions, or arrays of different lengths.
    """
    n, group = len(per_position["kl"]), _numpy(group)
    # without next-token log-probabilities (not a position_metrics dict) the PPL figures are NaN
    a = {k: _numpy(per_position[k]) if k in per_position else np.full(n, np.nan) for k in ("logp_base", "logp_cand")}
    a |= {k: _numpy(per_position[k]) for k in ("kl", "top1_agree")}
    if n == 0 or any(v.size != n for v in a.values()) or group.size != n:
        raise ValueError(f"intervals need equally long position arrays; got {n} positions and {group.size} groups")
    units, block = resampling_units(group)
    lo, hi = bootstrap_units(units, _row_statistics(a))
    out = {f"{s}_{side}": float(v[i]) for i, s in enumerate(BOOTSTRAPPED) for side, v in (("lo", lo), ("hi", hi))}
    t_lo, t_hi = wilson(int(a["top1_agree"].sum()), n)
    return out | {
        "top1_agree_lo": t_lo,
        "top1_agree_hi": t_hi,
        **llama_sigma(a),
        "ci_unit": unit if block is None else f"block of {block} positions",
        "ci_units": int(units[-1]) + 1,
        "ci_level": CONFIDENCE,
    }


def paired_difference(a, b, group, seed: int = SEED) -> tuple[float, float, float]:
    """Mean of ``a - b`` over positions scored alike by two configurations, with its BCa interval.

    Args:
        a, b: ``[N]`` float, one per-position statistic (e.g. KL) of two rows over the same positions.
        group: ``[N]`` their window or prompt index (resampled as :func:`row_intervals` does).

    Returns:
        ``(difference, lo, hi)``: below 0, ``a`` is lower (better, for KL) than ``b``.

    Raises:
        ValueError: arrays of different lengths.
    """
    a, b, group = _numpy(a), _numpy(b), _numpy(group)
    if a.size != b.size or a.size != group.size or a.size == 0:
        raise ValueError(f"paired positions differ in number: {a.size}, {b.size}, {group.size} groups")
    d = a - b
    lo, hi = bootstrap_units(resampling_units(group)[0], lambda idx: np.r_[d[idx].mean()], seed)
    return float(d.mean()), float(lo[0]), float(hi[0])


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor: evals.metrics gives them
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).ravel()
