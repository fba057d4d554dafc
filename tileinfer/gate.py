"""Drift gate: fail a kernel, backend or quantization change that moves the output distribution.

    python -m tileinfer.gate model=smollm2-135m base.source=stored     # engine vs stored BF16 logits
    python -m tileinfer.gate backend=triton base.backend=reference base.quant=same
    python -m tileinfer.gate quant=int8_both                            # INT8 vs BF16, against the baseline
    python -m tileinfer.gate quant=int8_both --update-baseline          # accept the current numbers

The candidate configuration is scored afresh (rows go to a new folder under runs/gate/) against its
base (see ``BaseSettings`` in tileinfer/jobs/schema.py), then checked:

- kernel checks, when candidate and base share the quant config (only the backend or the code
  differs): mean KL, 99.9% KL and top-1 agreement against bounds fitted to the model dtype and KV
  cache (``gate.bounds``: about twice the drift of a valid reimplementation, measured);
- baseline checks, for every configuration: mean and 99.9% KL no more than ``gate.max_increase``
  worse than the baseline row of the same configuration, plus ``gate.floor`` (the noise floor of
  BF16 rounding, so a valid reordering of sums does not fail), top-1 agreement no more than
  ``gate.max_top1_drop`` lower. Baselines are plain Parquet
  tables of sweep rows; ``--update-baseline`` rewrites the matching rows, never silently. A backend
  with no baseline row of its own is checked against the reference backend's row of the same
  configuration (check ``baseline-ref``), its bounds widened by the kernel bounds of the setup
  (:func:`fallback_margin`); the gate prints the margin and the command that records the backend's
  own row.

The default ``gate.baseline`` (``evals/baselines/MODEL.parquet``) and ``base.dir`` name the tables and
stored base logits shipped in the ``evals`` package, found from any folder; other paths are relative
to the current folder.

Every check judges a sample estimate by its 95% interval (the row's ``<metric>_lo``/``_hi`` columns,
:mod:`evals.intervals`): it fails only when the whole interval lies beyond the bound on the bad side
(:func:`judge`), so a change is failed only when the data show it is worse than the bound, never for
noise; a point estimate beyond the bound whose interval still reaches it passes as ``PASS (noise)``.
99.9% KL is checked only on rows of at least ``gate.p999_min_positions`` positions (below, the
estimate is one of the largest two values); fewer give a ``SKIP`` line. Rows written before
intervals existed are judged by their point estimates.

Exit codes: 0 all checks hold; 1 some check failed (the verdict table says which); 2 usage errors.
"""

from __future__ import annotations

import shlex
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import hydra
import polars as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import evals
from tileinfer.core.errors import NonFiniteLogits, UserError, check_runs_dir, exit_on_user_error
from tileinfer.jobs import identity, job, schema, tables
from tileinfer.jobs.schema import Config

PASS, FAIL = "PASS", "FAIL"
NOISE = "PASS (noise)"  # the point estimate is beyond the bound, its interval is not: not shown to be worse
SKIP = "SKIP"  # 99.9% KL of too few positions
# The check of a backend without a baseline row of its own against the reference backend's row.
FALLBACK_CHECK, FALLBACK_BACKEND = "baseline-ref", "reference"
# gate.baseline's default (conf/gate.yaml, ``${model.name}`` filled in): the table shipped in evals/.
DEFAULT_BASELINE = "evals/baselines/{model}.parquet"
_outcome: list[int] = []  # exit code decided by the gate (absent: Hydra or a usage error ended the run)


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
    the drift allowed between two backends on one configuration (about twice that of a valid
    reimplementation). Mean and 99.9% KL may rise by the kernel KL bounds (drifts of independent
    roundings add, to first order); top-1 agreement may drop by the share of tokens the kernel bound
    lets flip, ``1 - top1_agree`` (exact: agreement with the base drops at most by disagreement with
    the reference backend)."""
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


def spec_checks(row: dict, gate) -> list[dict]:
    """A speculative row verified greedily: its reply equals the plain greedy reply, or differs first
    at a near-tie (the target's top-1 minus top-2 logit there at most ``gate.spec_tie_margin`` of the
    row's dtype).
    The candidate value is that margin, 0 for an exact reply; rows without the check give none."""
    if row.get("spec_exact") is None:
        return []
    margin = 0.0 if row["spec_exact"] else row["spec_mismatch_margin"]
    margin = float("inf") if margin is None else margin  # a mismatch without a margin: a length mismatch
    bound = schema.tie_margin(row.get("dtype"), gate.get("spec_tie_margin"))
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


def _same_config(row: dict) -> pl.Expr:
    """Baseline rows of ``row``'s configuration (identity.DRIFT columns equal, nulls equal to nulls)."""
    return pl.all_horizontal([pl.col(k).eq_missing(row[k]) for k in identity.DRIFT])


def baseline_row(row: dict, baseline: pl.DataFrame | None) -> tuple[dict | None, bool]:
    """The baseline row of ``row``'s configuration (identity.DRIFT), else, for a backend with no row of
    its own, the reference backend's row of the configuration that is the same in every other column
    (same base: the same stored base logits); and whether it is that stand-in."""
    if baseline is None or baseline.is_empty():
        return None, False
    match = baseline.filter(_same_config(row))
    if len(match):
        return match.row(0, named=True), False
    if row["backend"] != FALLBACK_BACKEND:
        match = baseline.filter(_same_config(row | {"backend": FALLBACK_BACKEND}))
        if len(match):
            return match.row(0, named=True), True
    return None, False


def evaluate(candidate: pl.DataFrame, baseline: pl.DataFrame | None, gate) -> pl.DataFrame:
    """The verdict table of candidate rows against bounds and baseline rows.

    Args:
        candidate: sweep rows (tileinfer.jobs.tables.make_row) with a ``kernel`` bool column (True when
            candidate and base share the quant config, so only kernels or code differ).
        baseline: earlier rows, or None.
        gate: the ``gate`` config: ``bounds``, ``max_increase``, ``floor``, ``max_top1_drop``.

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
        base, stand_in = baseline_row(r, baseline)
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


def update_baseline(path: Path, candidate: pl.DataFrame) -> None:
    """Replace the rows of ``candidate``'s configurations in the baseline table (atomically)."""
    keep = tables.upgrade(pl.read_parquet(path)) if path.exists() else None
    missing = [k for k in identity.DRIFT if keep is not None and k not in keep.columns]
    if missing:  # rows recorded before these identity columns existed cannot be matched: replaced whole
        print(f"baseline: dropped {len(keep)} row(s) recorded without the {', '.join(missing)} column(s)")
        keep = None
    # null-safe matching: smooth_alpha is null on bf16 rows, so the column may be typed Null
    for r in candidate.iter_rows(named=True) if keep is not None else ():
        keep = keep.filter(~_same_config(r))
    df = candidate if keep is None or keep.is_empty() else pl.concat([keep, candidate], how="diagonal_relaxed")
    tables.atomic_parquet(df, path)


def print_verdicts(v: pl.DataFrame) -> None:
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_hide_dataframe_shape=True,
        fmt_float="mixed",
        tbl_hide_column_data_types=True,
        tbl_width_chars=200,
    ):
        print(v)


def baseline_path(cfg: Config) -> Path | None:
    """The baseline table of ``gate.baseline``: the default (:data:`DEFAULT_BASELINE`) is the table
    shipped in the ``evals`` package, found from any folder; another path is relative to the current
    folder; None with ``gate.baseline=null``."""
    if cfg.gate.baseline is None:
        return None
    if cfg.gate.baseline == DEFAULT_BASELINE.format(model=cfg.model.name):
        return Path(evals.__file__).resolve().parent / "baselines" / f"{cfg.model.name}.parquet"
    return Path(cfg.gate.baseline)


def update_command(backend: str) -> str:
    """The command line that records this gate job's baseline rows: its own overrides (of this job, in a
    multirun) with the backend that ran, plus ``--update-baseline``."""
    keep = [o for o in HydraConfig.get().overrides.task if not o.startswith(("backend=", "gate.update_baseline="))]
    return shlex.join(["python", "-m", "tileinfer.gate", *keep, f"backend={backend}", "--update-baseline"])


def read_baseline(cfg: Config, kernel: bool) -> pl.DataFrame | None:
    """The baseline table the gate compares with (None with ``gate.baseline=null`` or when it is about
    to be written by ``--update-baseline``).

    Raises:
        UserError: kernel checks only (``gate.baseline=null``) for a candidate whose quant config
            differs from the base's; a baseline file that is missing or not Parquet.
    """
    if cfg.gate.baseline is None:
        if cfg.gate.update_baseline:
            raise UserError("--update-baseline needs a baseline file, but gate.baseline=null")
        if not kernel:
            raise UserError(
                "gate.baseline=null leaves only the kernel checks, which compare a candidate "
                "with a base of the same quant config: add base.quant=same"
            )
        return None
    path = baseline_path(cfg)
    if not path.exists():
        if cfg.gate.update_baseline:
            return None
        raise UserError(
            f"no baseline table {path}: record one with --update-baseline, "
            "or check kernels only with gate.baseline=null"
        )
    try:
        table = tables.upgrade(pl.read_parquet(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"baseline {path} is not a readable Parquet table ({type(e).__name__})") from None
    if not {"model", "quant", "prompt_set", "kl_mean"} <= set(table.columns):
        raise UserError(f"baseline {path} is not a table of sweep rows")
    if cfg.gate.update_baseline:  # update_baseline() rewrites it, replacing rows it cannot match
        return None
    missing = [k for k in identity.DRIFT if k not in table.columns]
    if missing:
        raise UserError(
            f"baseline {path} predates the {', '.join(missing)} column(s): record it again with --update-baseline"
        )
    return table


def run_gate(cfg: Config) -> int:
    """Score the candidate afresh, check it, print the verdict table; return the exit code."""
    j = job.resolve(cfg)
    baseline = read_baseline(cfg, kernel=j.scheme == j.base_scheme)  # usage errors before minutes of scoring
    paths = job.run(cfg, force=True)  # a gate judges the code as it is now, never earlier rows
    cand = pl.concat([pl.read_parquet(p) for p in paths], how="diagonal_relaxed").with_columns(
        kernel=pl.lit(j.scheme == j.base_scheme)
    )
    path = baseline_path(cfg)
    if cfg.gate.update_baseline:
        update_baseline(path, cand.drop("kernel"))
        print(f"baseline updated: {path} ({len(cand)} rows)")
        return 0
    verdicts = evaluate(cand, baseline, asdict(cfg.gate))
    if path is None:  # no baseline checks, e.g. a new backend before any baseline exists
        verdicts = verdicts.filter(pl.col("check").is_in(["kernel", "spec"]))
    else:
        print(f"baseline table: {path}")
    print_verdicts(verdicts)
    row = cand.row(0, named=True)
    if (verdicts["check"] == FALLBACK_CHECK).any():
        print(
            f"{fallback_note(row, asdict(cfg.gate))}; once it passes, record {row['backend']}'s own rows with: "
            f"{update_command(row['backend'])}"
        )
    failed = verdicts.filter(pl.col("verdict") == FAIL)
    if verdicts.is_empty():
        print("gate: FAIL (no checks ran)")
        return 1
    noise, skipped = (int((verdicts["verdict"] == v).sum()) for v in (NOISE, SKIP))
    if skipped:
        print(
            f"kl_p999 not checked ({skipped}x): fewer than gate.p999_min_positions={cfg.gate.p999_min_positions} "
            + (
                "scored positions (add positions: eval.n_windows or a longer ctx)"
                if cfg.eval.corpora
                else "scored positions (add positions: eval=corpus, or eval.n_score)"
            )
        )
    if failed.is_empty():
        extra = ", ".join(t for t in (noise and f"{noise} within noise", skipped and f"{skipped} skipped") if t)
        print(f"gate: PASS ({len(verdicts)} checks" + (f"; {extra}" if extra else "") + ")")
        return 0
    print(
        f"gate: FAIL ({len(failed)} of {len(verdicts)} checks)"
        + (
            f"; no baseline row: record one with: {update_command(row['backend'])}"
            if (failed["metric"] == "row present").any()
            else ""
        )
    )
    return 1


schema.register()


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="gate")
def main(cfg: DictConfig) -> None:
    try:
        with exit_on_user_error("tileinfer.gate"):
            try:
                _outcome.append(run_gate(schema.load(cfg)))
            except NonFiniteLogits as e:  # the code under test is broken: a failed check, not a usage error
                print(f"tileinfer.gate: FAIL: {e}", file=sys.stderr)
                _outcome.append(1)
    except Exception:  # noqa: BLE001 - usage errors exit above; anything else is a crash of the code under test
        traceback.print_exc()
        print("tileinfer.gate: FAIL: the run crashed (traceback above)", file=sys.stderr)
        _outcome.append(1)


def cli() -> None:
    """``--update-baseline`` is spelled as a flag, as users expect; Hydra sees gate.update_baseline=true.
    Hydra's own argument errors (exit 1) become exit 2, as every usage error here."""
    sys.argv = [("gate.update_baseline=true" if a == "--update-baseline" else a) for a in sys.argv]
    schema.check_argv("tileinfer.gate", sys.argv[1:])
    check_runs_dir("tileinfer.gate", sys.argv[1:], default="runs/gate")
    schema.check_jobs("tileinfer.gate", sys.argv[1:], config_name="gate")
    try:
        main()
    except SystemExit as e:
        if not _outcome and e.code == 1:  # Hydra's own errors
            sys.exit(2)
        raise
    sys.exit(max(_outcome) if _outcome else 2)  # a multirun fails when any of its jobs does


if __name__ == "__main__":
    cli()
