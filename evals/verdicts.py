"""The drift gate's decisions: rows against bounds and baseline rows, each judged by its interval.

Checks (the command, tileinfer.gate, scores the candidate and reads the baseline table):

- kernel checks, when candidate and base share the quant config (only the backend or the code
  differs): mean KL, 99.9% KL and top-1 agreement against bounds fitted to the model dtype and KV
  cache (``gate.bounds``, conf/gate.yaml says how they were fitted);
- baseline checks, for every configuration: mean and 99.9% KL no more than ``gate.max_increase``
  worse than the baseline row of the same configuration, plus ``gate.floor`` (the noise floor of
  BF16 rounding, so a valid reordering of sums does not fail), top-1 agreement no more than
  ``gate.max_top1_drop`` lower. A backend with no baseline row of its own is checked against the
  reference backend's row of the same configuration (check ``baseline-ref``), its bounds widened by
  the kernel bounds of the setup (:func:`fallback_margin`);
- speculative rows verified greedily: the speculative reply equals the plain one, or parts from it at a
  near-tie (:func:`spec_checks`).

Every check judges a sample estimate by its 95% interval (the row's ``<metric>_lo``/``_hi`` columns,
:mod:`evals.intervals`): it fails only when the whole interval lies beyond the bound on the bad side
(:func:`judge`), so a change is failed only when the data show it is worse than the bound, never for
noise; a point estimate beyond the bound whose interval still reaches it passes as ``PASS (noise)``.
99.9% KL is checked only on rows of at least ``gate.p999_min_positions`` positions (below, the
estimate is one of the largest two values); fewer give a ``SKIP`` line. Rows written before
intervals existed are judged by their point estimates.
"""

from __future__ import annotations

import polars as pl

from tileinfer.core.errors import UserError

PASS, FAIL = "PASS", "FAIL"
NOISE = "PASS (noise)"  # the point estimate is beyond the bound, its interval is not: not shown to be worse
SKIP = "SKIP"  # 99.9% KL of too few positions
# The check of a backend without a baseline row of its own against the reference backend's row.
FALLBACK_CHECK, FALLBACK_BACKEND = "baseline-ref", "reference"
# Logits, per model dtype: a greedy speculative reply that parts from the plain one where the
# target's top-1 led its top-2 by at most this is a near-tie (a verify step rounds differently from a
# decode step), beyond it a bug. BF16 on the H200 moved the top-1 minus top-2 margin by up to 0.75
# logits between the two paths (benchmarks/results/h200-2026-11-30-verify-margin.md); float32 by
# rounding only. The gate's default (gate.spec_tie_margin); the report and printed tables use it too.
SPEC_TIE_MARGIN = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.01}


def tie_margin(dtype: str | None, margins: dict | None = None) -> float:
    """The near-tie margin (logits) of a model dtype (:data:`SPEC_TIE_MARGIN`, or ``margins``); the
    widest one for a dtype it does not list."""
    margins = SPEC_TIE_MARGIN if margins is None else margins
    return float(margins.get(dtype, max(margins.values())))


def judge(value: float, lo: float, hi: float, bound: float, higher_is_better: bool = False) -> str:
    """The verdict of one check: FAIL when the whole interval [lo, hi] lies beyond ``bound`` on the bad
    side (below it for a metric where higher is better, above it otherwise), PASS when the point
    estimate ``value`` is within the bound, NOISE when only the point estimate is beyond it.

    The rule tests "worse than the bound" at the interval's level (2.5% one-sided for a 95% interval):
    a fault is failed once the data show it, and a valid change is not failed for the sampling noise of
    a small window. Its cost is power: a fault only slightly beyond a bound needs more positions to fail.
    """
    if higher_is_better:
        return FAIL if hi < bound else PASS if value >= bound else NOISE
    return FAIL if lo > bound else PASS if value <= bound else NOISE


def interval(row: dict, metric: str) -> tuple[float, float]:
    """The row's 95% interval of ``metric`` (its ``_lo``/``_hi`` columns); the point estimate twice for a
    row without them (written before intervals existed, or a hand-made one)."""
    lo, hi = row.get(f"{metric}_lo"), row.get(f"{metric}_hi")
    return (row[metric], row[metric]) if lo is None or hi is None else (lo, hi)


def _verdict(
    kind: str,
    row: dict,
    metric: str,
    baseline,
    bound: float,
    higher_is_better: bool = False,
    verdict: str | None = None,
) -> dict:
    lo, hi = interval(row, metric)
    return dict(
        check=kind,
        prompt_set=row["prompt_set"],
        metric=metric,
        baseline=baseline,
        candidate=row[metric],
        lo=lo,
        hi=hi,
        bound=bound,
        verdict=verdict or judge(row[metric], lo, hi, bound, higher_is_better),
    )


def p999_checked(row: dict, gate) -> bool:
    """Whether the row has positions enough (``gate.p999_min_positions``) for its 99.9% KL to be checked."""
    return (row.get("n_scored") or 0) >= gate["p999_min_positions"]


def setup_of(row: dict) -> str:
    """The ``gate.bounds`` entry of a row: its model dtype, ``<dtype>-int8kv`` with an INT8 KV cache."""
    return row["dtype"] + ("-int8kv" if row["kv_cache"] == "int8" else "")


def bounds_for(row: dict, gate) -> dict:
    """Kernel-check bounds for a row: by model dtype, and ``<dtype>-int8kv`` with an INT8 cache, whose
    rounding amplifies any perturbation (measured noise floors in conf/gate.yaml)."""
    key = setup_of(row)
    if key not in gate["bounds"]:
        raise UserError(f"gate.bounds has no entry {key!r}")
    return gate["bounds"][key]


def fallback_margin(row: dict, gate) -> dict:
    """What a baseline check adds to its bounds when it compares a backend's row with the reference
    backend's row (the backend has none of its own): the kernel bounds of the row's setup, which are
    the drift allowed between two backends on one configuration (1.3 times the largest estimate of a
    valid reimplementation, rounded up a step: conf/gate.yaml). Mean and 99.9% KL may rise by the
    kernel KL bounds (drifts of independent roundings add, to first order); top-1 agreement may drop
    by the share of tokens the kernel bound lets flip, ``1 - top1_agree`` (exact: agreement with the
    base drops at most by disagreement with the reference backend)."""
    b = bounds_for(row, gate)
    return {"kl_mean": b["kl_mean"], "kl_p999": b["kl_p999"], "top1_agree": 1 - b["top1_agree"]}


def fallback_note(row: dict, gate) -> str:
    """The line that says a ``baseline-ref`` check stood in for a baseline row, and with which margin."""
    m = fallback_margin(row, gate)
    return (
        f"{FALLBACK_CHECK}: no baseline row for backend={row['backend']}, so the reference backend's row stands "
        f"in, bounds widened by the kernel bounds gate.bounds.{setup_of(row)}: kl_mean +{m['kl_mean']:g}, "
        f"kl_p999 +{m['kl_p999']:g}, top1_agree -{m['top1_agree']:g}"
    )


def kernel_checks(row: dict, gate) -> list[dict]:
    """Candidate vs a base with the same quant config: mean KL, 99.9% KL (on enough positions), top-1
    agreement, each judged by its interval (:func:`judge`)."""
    b, p999 = bounds_for(row, gate), p999_checked(row, gate)
    return [
        _verdict("kernel", row, "kl_mean", None, b["kl_mean"]),
        _verdict("kernel", row, "kl_p999", None, b["kl_p999"], verdict=None if p999 else SKIP),
        _verdict("kernel", row, "top1_agree", None, b["top1_agree"], higher_is_better=True),
    ]


def spec_outcome(row: dict) -> str | None:
    """How a speculative row's greedy reply compares with the plain one: ``yes`` (token for token),
    ``tie`` (it parts where the target's top-1 led its top-2 by at most :func:`tie_margin` of the row's
    dtype: rounding between the verify and the decode path), ``mismatch`` (a wider margin, or none
    known: a bug); None when nothing is compared (a plain row, sampled verification)."""
    if row.get("spec") in (None, "none") or row.get("spec_exact") is None:
        return None
    margin = row.get("spec_mismatch_margin")
    if row["spec_exact"]:
        return "yes"
    return "tie" if margin is not None and margin <= tie_margin(row.get("dtype")) else "mismatch"


def spec_checks(row: dict, gate) -> list[dict]:
    """A speculative row verified greedily: its reply equals the plain greedy reply, or differs first
    at a near-tie (the target's top-1 minus top-2 logit there at most ``gate.spec_tie_margin`` of the
    row's dtype).
    The candidate value is that margin, 0 for an exact reply; rows without the check give none."""
    if row.get("spec_exact") is None:
        return []
    margin = 0.0 if row["spec_exact"] else row["spec_mismatch_margin"]
    margin = float("inf") if margin is None else margin  # a mismatch without a margin: a length mismatch
    bound = tie_margin(row.get("dtype"), gate.get("spec_tie_margin"))
    measured = {"prompt_set": row["prompt_set"], "mismatch margin": margin}  # a count, not an estimate: no interval
    return [_verdict("spec", measured, "mismatch margin", None, bound)]


def baseline_checks(row: dict, base: dict | None, gate, margin: dict | None = None) -> list[dict]:
    """Candidate vs the baseline row of the same configuration (None: a FAIL, "row present"); with a
    ``margin`` (:func:`fallback_margin`) the row is the reference backend's and the checks are
    ``baseline-ref`` ones, their bounds widened by it."""
    ps, kind, extra = row["prompt_set"], "baseline" if margin is None else FALLBACK_CHECK, margin or {}
    if base is None:
        return [
            dict(
                check="baseline",
                prompt_set=ps,
                metric="row present",
                baseline=None,
                candidate=None,
                lo=None,
                hi=None,
                bound=None,
                verdict=FAIL,
            )
        ]
    out = [
        _verdict(
            kind,
            row,
            m,
            base[m],
            base[m] * (1 + gate["max_increase"]) + gate["floor"][m] + extra.get(m, 0.0),
            verdict=None if m == "kl_mean" or p999_checked(row, gate) else SKIP,
        )
        for m in ("kl_mean", "kl_p999")
    ]
    out.append(
        _verdict(
            kind,
            row,
            "top1_agree",
            base["top1_agree"],
            base["top1_agree"] - gate["max_top1_drop"] - extra.get("top1_agree", 0.0),
            higher_is_better=True,
        )
    )
    return out


def same_config(row: dict, columns) -> pl.Expr:
    """Rows of ``row``'s configuration: the ``columns`` that identify it (tileinfer.jobs.identity.DRIFT)
    equal, nulls equal to nulls."""
    return pl.all_horizontal([pl.col(k).eq_missing(row[k]) for k in columns])


def baseline_row(row: dict, baseline: pl.DataFrame | None, columns) -> tuple[dict | None, bool]:
    """The baseline row of ``row``'s configuration (:func:`same_config`), else, for a backend with no row of
    its own, the reference backend's row of the configuration that is the same in every other column
    (same base: the same stored base logits); and whether it is that stand-in."""
    if baseline is None or baseline.is_empty():
        return None, False
    match = baseline.filter(same_config(row, columns))
    if len(match):
        return match.row(0, named=True), False
    if row["backend"] != FALLBACK_BACKEND:
        match = baseline.filter(same_config(row | {"backend": FALLBACK_BACKEND}, columns))
        if len(match):
            return match.row(0, named=True), True
    return None, False


def evaluate(candidate: pl.DataFrame, baseline: pl.DataFrame | None, gate, columns) -> pl.DataFrame:
    """The verdict table of candidate rows against bounds and baseline rows.

    Args:
        candidate: sweep rows (tileinfer.jobs.rows.make_row) with a ``kernel`` bool column (True when
            candidate and base share the quant config, so only kernels or code differ).
        baseline: earlier rows, or None.
        gate: the ``gate`` config: ``bounds``, ``max_increase``, ``floor``, ``max_top1_drop``.
        columns: the columns that identify a configuration across runs (tileinfer.jobs.identity.DRIFT).

    Returns:
        One row per check: check (kernel | spec | baseline | baseline-ref), prompt_set, metric, baseline,
        candidate, lo and hi (its 95% interval), bound, verdict (PASS | PASS (noise) | FAIL | SKIP,
        :func:`judge`, :func:`p999_checked`). ``baseline-ref``: the candidate's backend has no
        row, the reference backend's row stands in with bounds widened by :func:`fallback_margin`.
        A missing baseline row fails (metric ``row present``): the gate cannot certify a
        configuration it has no record of.
    """
    out: list[dict] = []
    for r in candidate.iter_rows(named=True):
        if r["kernel"]:
            out += kernel_checks(r, gate)
        out += spec_checks(r, gate)
        base, stand_in = baseline_row(r, baseline, columns)
        out += baseline_checks(r, base, gate, fallback_margin(r, gate) if stand_in else None)
    return pl.DataFrame(
        out,
        schema={
            "check": pl.String,
            "prompt_set": pl.String,
            "metric": pl.String,
            "baseline": pl.Float64,
            "candidate": pl.Float64,
            "lo": pl.Float64,
            "hi": pl.Float64,
            "bound": pl.Float64,
            "verdict": pl.String,
        },
    )
