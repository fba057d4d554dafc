"""The gate's decisions at their edges (issue 15, "boundaries never pinned"), and its verdict table.

Every comparison of the gate's rules (evals.verdicts) is driven with a value exactly on its bound and
one float64 ulp beyond it (``math.nextafter``), so turning a ``<=``/``>=`` into a strict one, or the
reverse, changes a verdict; the interval rule is checked at both ends of the interval (swapping them changes a
verdict); 99.9% KL is checked from exactly ``p999_min_positions`` positions and skipped one below.
Every bound is checked for its own number, worked out by hand on a gate table whose entries all
differ and are exact in binary (so a bound computed from the wrong entry, e.g. 99.9% KL given the
mean-KL floor, or one setup's bounds for another, is a different number, and the values placed on a
bound are exactly equal to it, not within rounding). The verdict table: one row per check of every
candidate row, its columns and types fixed, a missing baseline row one FAIL.
"""

import math

import polars as pl
import pytest

from evals import verdicts
from tests.test_gate import row as gate_row
from tileinfer.core.errors import UserError
from tileinfer.jobs.identity import DRIFT

# Distinct for every setup and metric; powers of two (and sums of few) so every bound is exact.
BOUNDS = {
    "bfloat16": {"kl_mean": 2.0**-10, "kl_p999": 2.0**-6, "top1_agree": 0.96875},
    "bfloat16-int8kv": {"kl_mean": 2.0**-9, "kl_p999": 2.0**-4, "top1_agree": 0.9375},
    "float32": {"kl_mean": 2.0**-20, "kl_p999": 2.0**-16, "top1_agree": 0.9921875},
    "float32-int8kv": {"kl_mean": 2.0**-8, "kl_p999": 2.0**-3, "top1_agree": 0.875},
}
G = dict(
    bounds=BOUNDS,
    max_increase=0.5,
    floor={"kl_mean": 0.125, "kl_p999": 0.0625},
    max_top1_drop=0.125,
    p999_min_positions=2000,
    spec_tie_margin={"bfloat16": 1.0, "float32": 0.015625},
)
# The baseline row the baseline checks are relative to (kl_mean, kl_p999, top1_agree), and its bounds
# by hand: base * (1 + max_increase) + floor of the same metric; top-1: base - max_top1_drop.
BASE = dict(kl_mean=0.25, kl_p999=1.0, top1_agree=0.75)
BASELINE_BOUND = {"kl_mean": 0.25 * 1.5 + 0.125, "kl_p999": 1.0 * 1.5 + 0.0625, "top1_agree": 0.75 - 0.125}
SETUPS = [("bfloat16", "bf16"), ("bfloat16", "int8"), ("float32", "bf16"), ("float32", "int8")]


def beyond(bound: float, higher_is_better: bool) -> float:
    """The float64 next to ``bound`` on its bad side: one ulp worse."""
    return math.nextafter(bound, -math.inf if higher_is_better else math.inf)


def within(bound: float, higher_is_better: bool) -> float:
    return math.nextafter(bound, math.inf if higher_is_better else -math.inf)


def kernel_row(dtype="bfloat16", kv_cache="bf16", n_scored=2000, **metrics):
    """A kernel-check row: ``metrics`` are ``name=value`` or ``name=(value, lo, hi)``."""
    r = dict(prompt_set="edit", dtype=dtype, kv_cache=kv_cache, n_scored=n_scored, kl_mean=0.0, kl_p999=0.0)
    r["top1_agree"] = 1.0
    for name, v in metrics.items():
        if isinstance(v, tuple):
            r[name], r[f"{name}_lo"], r[f"{name}_hi"] = v
        else:
            r[name] = v
    return r


def by_metric(checks):
    return {v["metric"]: v for v in checks}


# --- judge: the interval rule at its edges ---------------------------------------------------------


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_an_estimate_exactly_on_the_bound_passes_and_one_ulp_beyond_is_noise(higher_is_better):
    """The bound itself is allowed (``value <= bound``, ``value >= bound`` for top-1): an estimate on it
    with an interval reaching either side is a PASS; one ulp worse is PASS (noise). Catches a strict
    comparison for the pass (on the bound: noise instead of pass) and a pass without its equality."""
    b = 0.5
    lo, hi = 0.25, 0.75  # the interval straddles the bound: never a FAIL
    assert verdicts.judge(b, lo, hi, b, higher_is_better) == verdicts.PASS
    assert verdicts.judge(b, b, b, b, higher_is_better) == verdicts.PASS  # a point interval on the bound
    assert verdicts.judge(beyond(b, higher_is_better), lo, hi, b, higher_is_better) == verdicts.NOISE
    assert verdicts.judge(within(b, higher_is_better), lo, hi, b, higher_is_better) == verdicts.PASS


def test_judge_defaults_to_a_metric_where_lower_is_better():
    """KL is the usual metric: without ``higher_is_better``, an estimate below the bound passes."""
    assert (
        verdicts.judge(0.25, 0.125, 0.75, 0.5) == verdicts.PASS
        and verdicts.judge(0.75, 0.625, 0.875, 0.5) == verdicts.FAIL
    )


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_an_interval_ending_exactly_on_the_bound_is_noise_and_one_ulp_beyond_fails(higher_is_better):
    """A check fails only when the whole interval lies beyond the bound: the interval's near end on the
    bound still reaches it (PASS (noise)); one ulp beyond, the whole interval is worse (FAIL). Catches
    ``lo >= bound`` for ``lo > bound`` (``hi <= bound`` for ``hi < bound``) and the reverse."""
    b, far = 0.5, (0.125 if higher_is_better else 0.875)  # the estimate and far end: well beyond
    near = b
    lo, hi = (far, near) if higher_is_better else (near, far)
    value = (lo + hi) / 2
    assert verdicts.judge(value, lo, hi, b, higher_is_better) == verdicts.NOISE
    near = beyond(b, higher_is_better)
    lo, hi = (far, near) if higher_is_better else (near, far)
    assert verdicts.judge(value, lo, hi, b, higher_is_better) == verdicts.FAIL
    assert verdicts.judge(near, near, near, b, higher_is_better) == verdicts.FAIL  # a point estimate one ulp beyond


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_the_interval_end_on_the_good_side_never_fails_a_check(higher_is_better):
    """Only the near end decides a FAIL: an estimate within the bound whose interval's far end lies
    beyond it passes, and an estimate beyond it whose far end is within is noise. Catches the interval's
    ends swapped in :func:`verdicts.judge` (lo for hi) and in :func:`verdicts.interval`."""
    metric = "top1_agree" if higher_is_better else "kl_mean"
    b = BOUNDS["bfloat16"][metric]  # 0.96875, 2**-10: the kernel check's own bound
    if higher_is_better:  # estimate within the bound, the interval's far end beyond it
        value, lo, hi = 0.984375, 0.9375, 0.9921875
    else:
        value, lo, hi = 0.875 * b, 0.75 * b, 1.75 * b
    assert verdicts.judge(value, lo, hi, b, higher_is_better) == verdicts.PASS
    # an estimate beyond the bound, the interval's end on the good side within it: noise, not a FAIL
    beyond_but_reaching = (0.9, 0.5, 0.984375) if higher_is_better else (1.5 * b, 0.5 * b, 2.5 * b)
    assert verdicts.judge(*beyond_but_reaching, b, higher_is_better) == verdicts.NOISE
    assert verdicts.interval({metric: value, f"{metric}_lo": lo, f"{metric}_hi": hi}, metric) == (lo, hi)
    assert verdicts.interval({metric: value}, metric) == (value, value)  # no interval columns: the point twice
    assert verdicts.interval({metric: value, f"{metric}_lo": lo, f"{metric}_hi": None}, metric) == (value, value)
    assert verdicts.interval({metric: value, f"{metric}_lo": None, f"{metric}_hi": hi}, metric) == (value, value)
    v = by_metric(verdicts.kernel_checks(kernel_row(**{metric: (value, lo, hi)}), G))[metric]
    assert (v["lo"], v["hi"], v["verdict"]) == (lo, hi, verdicts.PASS)


# --- 99.9% KL from p999_min_positions positions -----------------------------------------------------


def test_p999_is_checked_from_exactly_min_positions_and_skipped_one_below():
    """``n_scored >= p999_min_positions``: 2000 positions check 99.9% KL (here one ulp beyond its bound:
    FAIL), 1999 skip it, as does a row without a count; mean KL and top-1 are checked at any count.
    Catches ``>`` for ``>=`` and an off-by-one count, in the kernel and the baseline checks."""
    b = BOUNDS["bfloat16"]["kl_p999"]
    r = kernel_row(kl_p999=beyond(b, False))
    assert by_metric(verdicts.kernel_checks(r, G))["kl_p999"]["verdict"] == verdicts.FAIL
    assert verdicts.p999_checked(r, G) and not verdicts.p999_checked(r | dict(n_scored=1999), G)
    assert not verdicts.p999_checked({k: v for k, v in r.items() if k != "n_scored"}, G)
    assert not verdicts.p999_checked(r | dict(n_scored=None), G)
    few = by_metric(verdicts.kernel_checks(r | dict(n_scored=1999, kl_mean=1.0, top1_agree=0.0), G))
    assert [few[m]["verdict"] for m in ("kl_mean", "kl_p999", "top1_agree")] == [
        verdicts.FAIL,
        verdicts.SKIP,
        verdicts.FAIL,
    ]
    base = kernel_row(**BASE)
    over = kernel_row(kl_p999=beyond(BASELINE_BOUND["kl_p999"], False), kl_mean=1.0)
    assert by_metric(verdicts.baseline_checks(over, base, G))["kl_p999"]["verdict"] == verdicts.FAIL
    few = by_metric(verdicts.baseline_checks(over | dict(n_scored=1999), base, G))
    assert few["kl_p999"]["verdict"] == verdicts.SKIP and few["kl_mean"]["verdict"] == verdicts.FAIL


def test_the_p999_threshold_is_the_settings_own():
    """The count comes from ``gate.p999_min_positions`` (here 100, then 1), not a constant; a row without
    a count has none, so even a threshold of 1 skips it."""
    g = G | dict(p999_min_positions=100)
    assert verdicts.p999_checked(kernel_row(n_scored=100), g) and not verdicts.p999_checked(kernel_row(n_scored=99), g)
    one = G | dict(p999_min_positions=1)
    assert verdicts.p999_checked(kernel_row(n_scored=1), one) and not verdicts.p999_checked(
        kernel_row(n_scored=None), one
    )


# --- kernel bounds: each setup's own numbers ---------------------------------------------------------


@pytest.mark.parametrize("dtype,kv_cache", SETUPS)
def test_kernel_checks_use_their_setups_own_bounds(dtype, kv_cache):
    """Each of the three kernel checks of each of the four setups (model dtype, ``-int8kv`` with an
    INT8 KV cache) is judged against its own table entry: a value exactly on it passes, one ulp beyond
    fails (point intervals). Catches one metric's bound used for another, the INT8 cache ignored, a
    strict comparison."""
    setup = dtype + ("-int8kv" if kv_cache == "int8" else "")
    assert verdicts.setup_of(kernel_row(dtype, kv_cache)) == setup
    b = BOUNDS[setup]
    on = by_metric(verdicts.kernel_checks(kernel_row(dtype, kv_cache, **b) | dict(prompt_set="explain"), G))
    for m in ("kl_mean", "kl_p999", "top1_agree"):
        assert (on[m]["bound"], on[m]["candidate"], on[m]["verdict"]) == (b[m], b[m], verdicts.PASS), m
        assert (on[m]["check"], on[m]["prompt_set"], on[m]["baseline"]) == ("kernel", "explain", None), m
    for m in ("kl_mean", "kl_p999", "top1_agree"):
        off = kernel_row(dtype, kv_cache, **(b | {m: beyond(b[m], m == "top1_agree")}))
        got = {k: v["verdict"] for k, v in by_metric(verdicts.kernel_checks(off, G)).items()}
        assert got == {k: verdicts.FAIL if k == m else verdicts.PASS for k in got}, m


def test_a_setup_missing_from_the_table_is_a_usage_error():
    with pytest.raises(UserError, match="no entry 'float16'"):
        verdicts.kernel_checks(kernel_row("float16"), G)


# --- baseline bounds: base * (1 + max_increase) + the metric's own floor -----------------------------


def test_baseline_bounds_by_hand_and_values_exactly_on_them():
    """Mean KL 0.25 * 1.5 + 0.125 = 0.5, 99.9% KL 1.0 * 1.5 + 0.0625 = 1.5625 (its own floor: with the
    mean-KL floor it would be 1.625), top-1 0.75 - 0.125 = 0.625. A candidate exactly on all three
    passes; one ulp beyond on any one fails that one only."""
    base = kernel_row(**BASE)
    on = by_metric(verdicts.baseline_checks(kernel_row(**BASELINE_BOUND), base, G))
    assert {m: v["bound"] for m, v in on.items()} == {"kl_mean": 0.5, "kl_p999": 1.5625, "top1_agree": 0.625}
    assert {m: v["baseline"] for m, v in on.items()} == BASE
    assert {m: v["verdict"] for m, v in on.items()} == dict.fromkeys(BASE, verdicts.PASS)
    assert {v["check"] for v in on.values()} == {"baseline"}
    for m in BASE:
        off = kernel_row(**(BASELINE_BOUND | {m: beyond(BASELINE_BOUND[m], m == "top1_agree")}))
        got = {k: v["verdict"] for k, v in by_metric(verdicts.baseline_checks(off, base, G)).items()}
        assert got == {k: verdicts.FAIL if k == m else verdicts.PASS for k in got}, m


def test_baseline_bounds_follow_each_setting():
    """Each number of the rule enters once: doubling max_increase raises the KL bounds by base * 0.5,
    another floor moves only its own metric, max_top1_drop moves only top-1."""
    base = kernel_row(**BASE)

    def bounds(**kw):
        return {m: v["bound"] for m, v in by_metric(verdicts.baseline_checks(base, base, G | kw)).items()}

    assert bounds(max_increase=1.0) == {"kl_mean": 0.625, "kl_p999": 2.0625, "top1_agree": 0.625}
    assert bounds(floor={"kl_mean": 0.25, "kl_p999": 0.0625}) == {
        "kl_mean": 0.625,
        "kl_p999": 1.5625,
        "top1_agree": 0.625,
    }
    assert bounds(floor={"kl_mean": 0.125, "kl_p999": 0.5}) == {"kl_mean": 0.5, "kl_p999": 2.0, "top1_agree": 0.625}
    assert bounds(max_top1_drop=0.25) == {"kl_mean": 0.5, "kl_p999": 1.5625, "top1_agree": 0.5}


@pytest.mark.parametrize("dtype,kv_cache", SETUPS)
def test_the_stand_in_reference_row_widens_each_bound_by_its_own_kernel_bound(dtype, kv_cache):
    """A backend without its own baseline row is held to the reference backend's row with the kernel
    bounds of its setup added: mean KL + bounds.kl_mean, 99.9% KL + bounds.kl_p999, top-1 lower by
    1 - bounds.top1_agree (all exact here). Values exactly on these bounds pass, one ulp beyond fail."""
    setup = dtype + ("-int8kv" if kv_cache == "int8" else "")
    k = BOUNDS[setup]
    want = {
        "kl_mean": BASELINE_BOUND["kl_mean"] + k["kl_mean"],
        "kl_p999": BASELINE_BOUND["kl_p999"] + k["kl_p999"],
        "top1_agree": BASELINE_BOUND["top1_agree"] - (1 - k["top1_agree"]),
    }
    assert verdicts.fallback_margin(kernel_row(dtype, kv_cache), G) == {
        "kl_mean": k["kl_mean"],
        "kl_p999": k["kl_p999"],
        "top1_agree": 1 - k["top1_agree"],
    }
    ref = gate_row(dtype=dtype, kv_cache=kv_cache, n_scored=2000, **BASE)
    baseline = pl.DataFrame([{n: v for n, v in ref.items() if n != "kernel"}])
    cand = gate_row(dtype=dtype, kv_cache=kv_cache, n_scored=2000, backend="triton", **want)
    v = verdicts.evaluate(pl.DataFrame([cand]), baseline, G, DRIFT)
    assert v["check"].to_list() == [verdicts.FALLBACK_CHECK] * 3
    assert dict(zip(v["metric"], v["bound"])) == want
    assert v["verdict"].to_list() == [verdicts.PASS] * 3
    for m in want:
        off = cand | {m: beyond(want[m], m == "top1_agree")}
        v = verdicts.evaluate(pl.DataFrame([off]), baseline, G, DRIFT)
        assert dict(zip(v["metric"], v["verdict"])) == {n: verdicts.FAIL if n == m else verdicts.PASS for n in want}, m


def test_kernel_and_baseline_checks_both_run_on_a_kernel_row():
    """A row whose base shares its quant config gets the kernel checks and the baseline checks, in that
    order, each against its own bound."""
    ref = gate_row(n_scored=2000, kernel=True, kv_cache="bf16", **BASE)
    baseline = pl.DataFrame([{n: v for n, v in ref.items() if n != "kernel"}])
    v = verdicts.evaluate(pl.DataFrame([ref]), baseline, G, DRIFT)
    assert v["check"].to_list() == ["kernel"] * 3 + ["baseline"] * 3
    assert v["bound"].to_list() == [*BOUNDS["bfloat16"].values(), *BASELINE_BOUND.values()]


# --- speculative near-ties ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,margin", [("bfloat16", 1.0), ("float32", 0.015625), ("float16", 1.0)])
def test_a_speculative_mismatch_exactly_at_the_tie_margin_passes(dtype, margin):
    """The mismatch margin may equal the dtype's ``spec_tie_margin`` (a dtype it does not list: the
    widest); one ulp more fails; an exact reply (margin 0) passes, a length mismatch (no margin) fails."""

    def verdict(exact, m):
        r = dict(prompt_set="edit", dtype=dtype, spec_exact=exact, spec_mismatch_margin=m)
        (v,) = verdicts.spec_checks(r, G)
        assert (v["check"], v["prompt_set"], v["metric"], v["bound"]) == ("spec", "edit", "mismatch margin", margin)
        return v["verdict"], v["candidate"]

    assert verdict(False, margin) == (verdicts.PASS, margin)
    assert verdict(False, beyond(margin, False))[0] == verdicts.FAIL
    assert verdict(True, None) == (verdicts.PASS, 0.0)
    assert verdict(False, None) == (verdicts.FAIL, math.inf)
    assert verdicts.spec_checks(dict(prompt_set="edit", dtype=dtype, spec_exact=None), G) == []


# --- the verdict table ---------------------------------------------------------------------------

COLUMNS = dict(
    check=pl.String,
    prompt_set=pl.String,
    metric=pl.String,
    baseline=pl.Float64,
    candidate=pl.Float64,
    lo=pl.Float64,
    hi=pl.Float64,
    bound=pl.Float64,
    verdict=pl.String,
)


def baseline_of(*rows):
    return pl.DataFrame([{k: v for k, v in r.items() if k != "kernel"} for r in rows])


def test_a_missing_baseline_row_is_one_failed_check_with_nothing_to_compare():
    """No baseline row of the configuration (no table, an empty one, rows of other configurations):
    one FAIL, metric ``row present``, carrying the prompt set and no numbers, and no stand-in (a stand-in
    is only the reference backend's row of the same configuration)."""
    r = gate_row(prompt_set="explain")
    assert verdicts.baseline_checks(r, None, G) == [
        dict(
            check="baseline",
            prompt_set="explain",
            metric="row present",
            baseline=None,
            candidate=None,
            lo=None,
            hi=None,
            bound=None,
            verdict=verdicts.FAIL,
        )
    ]
    assert verdicts.baseline_row(r, None, DRIFT) == (None, False)
    assert verdicts.baseline_row(r, baseline_of(r).clear(), DRIFT) == (None, False)
    assert verdicts.baseline_row(r, baseline_of(gate_row(quant="int8_kv")), DRIFT) == (None, False)
    assert verdicts.baseline_row(r | dict(backend="triton"), baseline_of(gate_row(quant="int8_kv")), DRIFT) == (
        None,
        False,
    )
    own, stand_in = verdicts.baseline_row(r | dict(backend="triton"), baseline_of(r | dict(kl_mean=0.5)), DRIFT)
    assert (own["backend"], own["kl_mean"], stand_in) == ("reference", 0.5, True)


def test_the_verdict_table_has_every_check_of_every_row_in_fixed_columns():
    """Two kernel rows (two prompt sets) and a speculative one, no baseline table (``gate.baseline=null``):
    each row's kernel checks (none dropped by the next row's), its speculative check, and a ``row
    present`` FAIL (the gate filters those out without a table), in columns of fixed names and types
    (a table of missing rows still has float bounds)."""
    rows = [
        gate_row(prompt_set=ps, kernel=True, kv_cache="bf16", n_scored=2000, **BOUNDS["bfloat16"])
        for ps in ("edit", "explain")
    ]
    rows.append(gate_row(prompt_set="spec", spec_exact=False, spec_mismatch_margin=1.0, kernel=False))
    v = verdicts.evaluate(pl.DataFrame(rows), None, G, DRIFT)
    assert v.schema == pl.Schema(COLUMNS)
    assert v["prompt_set"].to_list() == ["edit"] * 4 + ["explain"] * 4 + ["spec"] * 2
    assert v["check"].to_list() == ["kernel"] * 3 + ["baseline"] + ["kernel"] * 3 + ["baseline", "spec", "baseline"]
    assert v["verdict"].to_list() == [verdicts.PASS] * 3 + [verdicts.FAIL] + [verdicts.PASS] * 3 + [
        verdicts.FAIL,
        verdicts.PASS,
        verdicts.FAIL,
    ]
    assert v["bound"].to_list()[8] == 1.0  # bfloat16's tie margin
    missing = verdicts.evaluate(pl.DataFrame(rows[2:]), pl.DataFrame(), G, DRIFT).filter(pl.col("check") == "baseline")
    assert missing.schema == pl.Schema(COLUMNS) and missing["metric"].to_list() == ["row present"]
