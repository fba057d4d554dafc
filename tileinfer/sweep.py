"""The main job: accuracy against BF16 beside speed, one row per (model, quant, ctx, scored set).

    python -m tileinfer.sweep                                   # defaults (conf/config.yaml)
    python -m tileinfer.sweep quant=int8_both ctx=32k
    python -m tileinfer.sweep -m quant=bf16,int8_weights,int8_kv,int8_both ctx=1k,8k
    python -m tileinfer.sweep -m hydra/launcher=gpus quant=bf16,int8_both ctx=1k,8k   # a worker per GPU
    python -m tileinfer.sweep -m hydra/launcher=slurm runs_dir=/shared/runs ...          # a SLURM job each

Each job (tileinfer.jobs.job) writes one Parquet row per scored set under ``runs_dir/rows``,
atomically; a row that already exists is not computed again, so an interrupted sweep restarted with
the same command keeps what finished. A multirun runs its jobs one after another in this process
(Hydra's basic launcher), or in worker processes through a Hydra launcher (conf/hydra/launcher:
``gpus``, joblib on one host; ``slurm``, submitit). Each job prints its rows; a multirun prints a
line per finished job and, at the end, all rows as one table, saved as ``summary.parquet`` /
``summary.md`` in its log folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from tileinfer import cli
from tileinfer.jobs import job, plan, rows, tables


def sweep_job(cfg, worker, context: cli.JobContext):
    """One job of the sweep: its missing rows computed, all its rows printed."""
    result = job.run(plan.resolve(cfg, worker, context.cpu_workers), worker)
    tables.print_table(pl.DataFrame(list(result.rows)), where=result.paths)
    return result, 0


def summary(outcomes: list[cli.Outcome]) -> None:
    """A multirun's rows as one table, printed and saved beside its logs."""
    done = [o for o in outcomes if o.result is not None]
    if len(outcomes) < 2 or not done:
        return
    paths = [p for o in done for p in o.result.paths]
    df = rows.read(paths).drop("row_file")
    out = Path(outcomes[0].sweep_dir)
    tables.write_summary(df, out)
    print(f"\n=== sweep summary ({len(df)} rows; {out}/summary.md) ===")
    tables.print_table(df, where=paths)


def main(argv: list[str] | None = None) -> int:
    return cli.main("tileinfer.sweep", sys.argv[1:] if argv is None else argv, "config", sweep_job, summary)


if __name__ == "__main__":
    sys.exit(main())
