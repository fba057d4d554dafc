"""Drift gate: fail a kernel, backend or quantization change that moves the output distribution.

    python -m tileinfer.gate model=smollm2-135m reference.source=stored            # engine vs stored BF16 reference
    python -m tileinfer.gate backend=triton reference.backend=reference reference.quant=same
    python -m tileinfer.gate quant=int8_both                                         # INT8 vs BF16, against the baseline
    python -m tileinfer.gate quant=int8_both --update-baseline                       # accept the current numbers

The candidate configuration is scored afresh (rows go to a new folder under runs/gate/) against its
reference (see ``reference`` in conf/config.yaml), then checked:

- kernel checks, when candidate and reference share the quant config (only the backend or the code
  differs): mean KL, 99.9% KL and top-1 agreement against bounds fitted to the model dtype and KV
  cache (``gate.bounds``: about twice the drift of a valid reimplementation, measured);
- baseline checks, for every configuration: mean and 99.9% KL no more than ``gate.max_increase``
  worse than the baseline row of the same configuration, plus ``gate.floor`` (the noise floor of
  BF16 rounding, so a valid reordering of sums does not fail), top-1 agreement no more than
  ``gate.max_top1_drop`` lower. Baselines are plain Parquet
  tables of sweep rows; ``--update-baseline`` rewrites the matching rows, never silently.

Exit codes: 0 all checks hold; 1 some check failed (the verdict table says which); 2 usage errors.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

import hydra
import polars as pl
from omegaconf import DictConfig

from tileinfer.jobs import job, tables
from tileinfer.core.errors import NonFiniteLogits, UserError, check_runs_dir, exit_on_user_error

# Columns that identify "the same configuration" in a baseline table.
KEY = ["model", "model_sha256", "quant", "smooth_keys", "smooth_alpha", "calibration_tokens", "ctx_tokens",
       "prompt_set", "backend", "dtype", "reference", "n_scored"]
PASS, FAIL = "PASS", "FAIL"
_outcome: list[int] = []  # exit code decided by the gate (absent: Hydra or a usage error ended the run)


def _verdict(kind: str, prompt_set: str, metric: str, baseline, candidate: float, bound: float,
             higher_is_better: bool = False) -> dict:
    ok = candidate >= bound if higher_is_better else candidate <= bound
    return dict(check=kind, prompt_set=prompt_set, metric=metric, baseline=baseline, candidate=candidate,
                bound=bound, verdict=PASS if ok else FAIL)


def bounds_for(row: dict, gate) -> dict:
    """Kernel-check bounds for a row: by model dtype, and ``<dtype>-int8kv`` with an INT8 cache, whose
    rounding amplifies any perturbation (measured noise floors in conf/gate.yaml)."""
    key = row["dtype"] + ("-int8kv" if row["kv_cache"] == "int8" else "")
    if key not in gate["bounds"]:
        raise UserError(f"gate.bounds has no entry {key!r}")
    return gate["bounds"][key]


def kernel_checks(row: dict, gate) -> list[dict]:
    """Candidate vs a reference with the same quant config: mean KL, 99.9% KL, top-1 agreement."""
    b, ps = bounds_for(row, gate), row["prompt_set"]
    return [_verdict("kernel", ps, "kl_mean", None, row["kl_mean"], b["kl_mean"]),
            _verdict("kernel", ps, "kl_p999", None, row["kl_p999"], b["kl_p999"]),
            _verdict("kernel", ps, "top1_agree", None, row["top1_agree"], b["top1_agree"], higher_is_better=True)]


def baseline_checks(row: dict, base: dict | None, gate) -> list[dict]:
    """Candidate vs the baseline row of the same configuration (None: a FAIL, "row present")."""
    ps = row["prompt_set"]
    if base is None:
        return [dict(check="baseline", prompt_set=ps, metric="row present", baseline=None, candidate=None,
                     bound=None, verdict=FAIL)]
    out = [_verdict("baseline", ps, m, base[m], row[m], base[m] * (1 + gate["max_increase"]) + gate["floor"][m])
           for m in ("kl_mean", "kl_p999")]
    out.append(_verdict("baseline", ps, "top1_agree", base["top1_agree"], row["top1_agree"],
                        base["top1_agree"] - gate["max_top1_drop"], higher_is_better=True))
    return out


def _same_config(row: dict, columns) -> pl.Expr:
    """Baseline rows of ``row``'s configuration (``KEY`` columns equal, nulls equal to nulls)."""
    return pl.all_horizontal([pl.col(k).eq_missing(row[k]) for k in KEY if k in columns])


def evaluate(candidate: pl.DataFrame, baseline: pl.DataFrame | None, gate) -> pl.DataFrame:
    """The verdict table of candidate rows against bounds and baseline rows.

    Args:
        candidate: sweep rows (tileinfer.jobs.tables.make_row) with a ``kernel`` bool column (True when
            candidate and reference share the quant config, so only kernels or code differ).
        baseline: earlier rows, or None.
        gate: the ``gate`` config: ``bounds``, ``max_increase``, ``floor``, ``max_top1_drop``.

    Returns:
        One row per check: check (kernel | baseline), prompt_set, metric, baseline, candidate, bound,
        verdict (PASS | FAIL). A missing baseline row fails (metric ``row present``): the gate
        cannot certify a configuration it has no record of.
    """
    out: list[dict] = []
    for r in candidate.iter_rows(named=True):
        if r["kernel"]:
            out += kernel_checks(r, gate)
        base = None
        if baseline is not None and not baseline.is_empty():
            match = baseline.filter(_same_config(r, baseline.columns))
            base = match.row(0, named=True) if len(match) else None
        out += baseline_checks(r, base, gate)
    return pl.DataFrame(out, schema={"check": pl.String, "prompt_set": pl.String, "metric": pl.String,
                                     "baseline": pl.Float64, "candidate": pl.Float64, "bound": pl.Float64,
                                     "verdict": pl.String})


def update_baseline(path: Path, candidate: pl.DataFrame) -> None:
    """Replace the rows of ``candidate``'s configurations in the baseline table (atomically)."""
    keep = pl.read_parquet(path) if path.exists() else None
    # null-safe matching: smooth_alpha is null on bf16 rows, so the column may be typed Null
    for r in candidate.iter_rows(named=True) if keep is not None else ():
        keep = keep.filter(~_same_config(r, keep.columns))
    df = candidate if keep is None or keep.is_empty() else pl.concat([keep, candidate], how="diagonal_relaxed")
    tables.atomic_parquet(df, path)


def print_verdicts(v: pl.DataFrame) -> None:
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_hide_dataframe_shape=True, fmt_float="mixed",
                   tbl_hide_column_data_types=True, tbl_width_chars=200):
        print(v)


def read_baseline(cfg: DictConfig, kernel: bool) -> pl.DataFrame | None:
    """The baseline table the gate compares with (None with ``gate.baseline=null`` or when it is about
    to be written by ``--update-baseline``).

    Raises:
        UserError: kernel checks only (``gate.baseline=null``) for a candidate whose quant config
            differs from the reference's; a baseline file that is missing or not Parquet.
    """
    if cfg.gate.baseline is None:
        if cfg.gate.update_baseline:
            raise UserError("--update-baseline needs a baseline file, but gate.baseline=null")
        if not kernel:
            raise UserError("gate.baseline=null leaves only the kernel checks, which compare a candidate "
                            "with a reference of the same quant config: add reference.quant=same")
        return None
    path = Path(cfg.gate.baseline)
    if not path.exists():
        if cfg.gate.update_baseline:
            return None
        raise UserError(f"no baseline table {path}: record one with --update-baseline, "
                        "or check kernels only with gate.baseline=null")
    try:
        table = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"baseline {path} is not a readable Parquet table ({type(e).__name__})") from None
    missing = [k for k in ("model", "quant", "prompt_set", "kl_mean") if k not in table.columns]
    if missing:
        raise UserError(f"baseline {path} is not a table of sweep rows (no {', '.join(missing)} column)")
    return table


def check_gate_settings(gate) -> None:
    """Raise UserError for a bound, margin or floor of ``gate`` that is not a number in its range
    (checked before any scoring)."""
    if not isinstance(gate.get("bounds"), Mapping) or not gate.bounds:
        raise UserError("gate.bounds: expected bounds per setup, e.g. gate.bounds.bfloat16.kl_mean=1e-3")
    for setup, b in gate.bounds.items():
        for metric, hi in (("kl_mean", None), ("kl_p999", None), ("top1_agree", 1.0)):
            job.check_number(f"gate.bounds.{setup}.{metric}", b.get(metric) if isinstance(b, Mapping) else None,
                             lo=0.0, hi=hi)
    job.check_number("gate.max_increase", gate.get("max_increase"), lo=-1.0)  # < 0 demands an improvement
    job.check_number("gate.max_top1_drop", gate.get("max_top1_drop"), lo=0.0, hi=1.0)
    floor = gate.get("floor")
    for metric in ("kl_mean", "kl_p999"):
        job.check_number(f"gate.floor.{metric}", floor.get(metric) if isinstance(floor, Mapping) else None, lo=0.0)


def run_gate(cfg: DictConfig) -> int:
    """Score the candidate afresh, check it, print the verdict table; return the exit code."""
    check_gate_settings(cfg.gate)
    j = job.resolve(cfg)
    baseline = read_baseline(cfg, kernel=j.spec == j.ref_spec)  # usage errors before minutes of scoring
    paths = job.run(cfg, force=True)  # a gate judges the code as it is now, never earlier rows
    cand = pl.concat([pl.read_parquet(p) for p in paths], how="diagonal_relaxed").with_columns(
        kernel=pl.lit(j.spec == j.ref_spec))
    if cfg.gate.baseline is None:  # kernel checks only, e.g. a new backend before any baseline exists
        verdicts = evaluate(cand.filter(pl.col("kernel")), None, cfg.gate).filter(pl.col("check") == "kernel")
        print_verdicts(verdicts)
        return 1 if (verdicts["verdict"] == FAIL).any() or verdicts.is_empty() else 0
    base_path = Path(cfg.gate.baseline)
    if cfg.gate.update_baseline:
        update_baseline(base_path, cand.drop("kernel"))
        print(f"baseline updated: {base_path} ({len(cand)} rows)")
        return 0
    verdicts = evaluate(cand, baseline, cfg.gate)
    print_verdicts(verdicts)
    failed = verdicts.filter(pl.col("verdict") == FAIL)
    if failed.is_empty():
        print(f"gate: PASS ({len(verdicts)} checks)")
        return 0
    print(f"gate: FAIL ({len(failed)} of {len(verdicts)} checks)"
          + ("; no baseline row: record one with --update-baseline" if (failed["metric"] == "row present").any() else ""))
    return 1


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="gate")
def main(cfg: DictConfig) -> None:
    try:
        with exit_on_user_error("tileinfer.gate", code=2):
            try:
                _outcome.append(run_gate(cfg))
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
    check_runs_dir("tileinfer.gate", sys.argv[1:], exit_code=2, default="runs/gate")
    try:
        main()
    except SystemExit as e:
        if not _outcome and e.code == 1:  # Hydra's own errors
            sys.exit(2)
        raise
    sys.exit(_outcome[0] if _outcome else 2)


if __name__ == "__main__":
    cli()
