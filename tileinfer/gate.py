"""Drift gate: fail a kernel, backend or quantization change that moves the output distribution.

    python -m tileinfer.gate model=smollm2-135m base.source=stored     # engine vs stored BF16 logits
    python -m tileinfer.gate backend=triton base.backend=reference base.quant=same
    python -m tileinfer.gate quant=int8_both                            # INT8 vs BF16, against the baseline
    python -m tileinfer.gate quant=int8_both --update-baseline          # accept the current numbers

The candidate configuration is scored afresh (rows go to a new folder under runs/gate/) against its
base (``BaseSettings`` in tileinfer/jobs/schema.py), then checked against the bounds and the
baseline table by the rules of :mod:`evals.verdicts`. Baselines are plain Parquet tables of sweep
rows; ``--update-baseline`` rewrites the matching rows, never silently. A backend without baseline
rows of its own is held to the reference backend's (check ``baseline-ref``); the gate prints the
margin and the command that records the backend's own rows. The default ``gate.baseline``
(``evals/baselines/MODEL.parquet``) and ``base.dir`` name the tables and stored base logits shipped
in the ``evals`` package, found from any folder; other paths are relative to the current folder.

Exit codes: 0 all checks hold; 1 some check failed (the verdict table says which); 2 usage errors.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import polars as pl

import evals
from evals.verdicts import FAIL, FALLBACK_CHECK, NOISE, SKIP, evaluate, fallback_note, same_config
from tileinfer import cli
from tileinfer.core.errors import NonFiniteLogits, UserError
from tileinfer.jobs import identity, job, plan, rows
from tileinfer.jobs.schema import Config

# gate.baseline's default (conf/gate.yaml, ``${model.name}`` filled in): the table shipped in evals/.
DEFAULT_BASELINE = "evals/baselines/{model}.parquet"


def update_baseline(path: Path, candidate: pl.DataFrame) -> None:
    """Replace the rows of ``candidate``'s configurations in the baseline table (atomically)."""
    keep = rows.upgrade(pl.read_parquet(path)) if path.exists() else None
    missing = [k for k in identity.DRIFT if keep is not None and k not in keep.columns]
    if missing:  # rows recorded before these identity columns existed cannot be matched: replaced whole
        print(f"baseline: dropped {len(keep)} row(s) recorded without the {', '.join(missing)} column(s)")
        keep = None
    # null-safe matching: smooth_alpha is null on bf16 rows, so the column may be typed Null
    for r in candidate.iter_rows(named=True) if keep is not None else ():
        keep = keep.filter(~same_config(r, identity.DRIFT))
    df = candidate if keep is None or keep.is_empty() else pl.concat([keep, candidate], how="diagonal_relaxed")
    rows.atomic_parquet(df, path)


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


def update_command(overrides: list[str], backend: str) -> str:
    """The command line that records this gate job's baseline rows: its own ``overrides`` (of this job,
    in a multirun) with the backend that ran, plus ``--update-baseline``."""
    keep = [o for o in overrides if not o.startswith(("backend=", "gate.update_baseline="))]
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
        table = rows.upgrade(pl.read_parquet(path))
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


def run_gate(cfg: Config, worker, overrides: list[str]) -> tuple[job.JobResult, int]:
    """Score the candidate afresh, check it, print the verdict table; return the rows and the exit code."""
    p = plan.resolve(cfg, worker)
    print(
        f"gate: {cfg.model.name} {p.candidate.label} on {p.candidate.backend} against {p.base.label} on "
        f"{p.base.backend} ({cfg.base.source} base), {len(p.sets)} scored set(s)",
        flush=True,
    )
    baseline = read_baseline(cfg, kernel=p.kernel_check)  # usage errors before minutes of scoring
    result = job.run(p, worker, force=True)  # a gate judges the code as it is now, never earlier rows
    cand = pl.DataFrame(list(result.rows)).with_columns(kernel=pl.lit(p.kernel_check))
    path = baseline_path(cfg)
    if cfg.gate.update_baseline:
        update_baseline(path, cand.drop("kernel"))
        print(f"baseline updated: {path} ({len(cand)} rows)")
        return result, 0
    print("gate: checking the rows")
    verdicts = evaluate(cand, baseline, asdict(cfg.gate), identity.DRIFT)
    if path is None:  # no baseline checks, e.g. a new backend before any baseline exists
        verdicts = verdicts.filter(pl.col("check").is_in(["kernel", "spec"]))
    else:
        print(f"baseline table: {path}")
    print_verdicts(verdicts)
    row = cand.row(0, named=True)
    record = update_command(overrides, row["backend"])
    if (verdicts["check"] == FALLBACK_CHECK).any():
        note = fallback_note(row, asdict(cfg.gate))
        print(f"{note}; once it passes, record {row['backend']}'s own rows with: {record}")
    failed = verdicts.filter(pl.col("verdict") == FAIL)
    if verdicts.is_empty():
        print("gate: FAIL (no checks ran)")
        return result, 1
    noise, skipped = (int((verdicts["verdict"] == v).sum()) for v in (NOISE, SKIP))
    if skipped:
        where = "eval.n_windows or a longer ctx" if cfg.eval.name == "corpus" else "eval=corpus, or eval.n_score"
        print(
            f"kl_p999 not checked ({skipped}x): fewer than gate.p999_min_positions={cfg.gate.p999_min_positions} "
            f"scored positions (add positions: {where})"
        )
    if failed.is_empty():
        extra = ", ".join(t for t in (noise and f"{noise} within noise", skipped and f"{skipped} skipped") if t)
        print(f"gate: PASS ({len(verdicts)} checks" + (f"; {extra}" if extra else "") + ")")
        return result, 0
    missing = (failed["metric"] == "row present").any()
    print(
        f"gate: FAIL ({len(failed)} of {len(verdicts)} checks)"
        + (f"; no baseline row: record one with: {record}" if missing else "")
    )
    return result, 1


def gate_job(cfg: Config, worker, context: cli.JobContext) -> tuple[job.JobResult | None, int]:
    """One job of the gate. Non-finite logits are the code under test failing, not a usage error."""
    try:
        return run_gate(cfg, worker, list(context.overrides))
    except NonFiniteLogits as e:
        print(f"tileinfer.gate: FAIL: {e}", file=sys.stderr)
        return None, 1


def main(argv: list[str] | None = None) -> int:
    """``--update-baseline`` is spelled as a flag, as users expect; Hydra sees gate.update_baseline=true.
    A multirun fails when any of its jobs does. A crash of the code under test is a failed gate (exit 1)."""
    argv = sys.argv[1:] if argv is None else argv
    flag = {"--update-baseline": "gate.update_baseline=true"}
    return cli.main("tileinfer.gate", argv, "gate", gate_job, aliases=flag)


if __name__ == "__main__":
    sys.exit(main())
