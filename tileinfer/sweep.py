"""The main job: accuracy against BF16 beside speed, one row per (model, quant, ctx, prompt set).

    python -m tileinfer.sweep                                   # defaults (conf/config.yaml)
    python -m tileinfer.sweep quant=int8_both ctx=32k
    python -m tileinfer.sweep -m quant=bf16,int8_weights,int8_kv,int8_both ctx=1k,8k

Each job (see tileinfer.jobs.job) writes one Parquet row per prompt set under ``runs_dir/rows``,
atomically; a row that already exists is not computed again, so an interrupted sweep restarted with
the same command keeps what finished. Each job prints its rows; a multirun prints all of them at
the end and saves them as ``summary.parquet`` / ``summary.md`` in its log folder.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
import polars as pl
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from tileinfer.core import files
from tileinfer.core.errors import check_runs_dir, exit_on_user_error
from tileinfer.jobs import job, schema, tables

ROWS_LIST = "rows.json"  # in each job's Hydra output folder: the row files the job produced
_SWEEP = {"jobs": 1, "started": None}  # jobs of this command (schema.check_jobs) and when the first began


def read_rows(paths) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in dict.fromkeys(paths)], how="diagonal_relaxed")


schema.register()


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: one job of a run or multirun."""
    announce(HydraConfig.get())
    with exit_on_user_error("tileinfer.sweep"):
        paths = job.run(schema.load(cfg))
        tables.print_table(read_rows(paths), where=paths)
        files.write_text(Path(HydraConfig.get().runtime.output_dir) / ROWS_LIST, json.dumps([str(p) for p in paths]))


def announce(hc) -> None:
    """Print ``job k/N: overrides`` before a job of a multirun, with the time the jobs so far took and
    a rough estimate for the rest (their mean time per job; cached rows make it an upper bound)."""
    if hc.mode != RunMode.MULTIRUN:
        return
    k, n, now = hc.job.num + 1, _SWEEP["jobs"], time.monotonic()
    _SWEEP["started"] = _SWEEP["started"] or now
    spent = now - _SWEEP["started"]
    eta = f"; {spent / 60:.1f} min so far, about {spent / (k - 1) * (n - k + 1) / 60:.0f} min left" if k > 1 else ""
    print(f"=== job {k}/{n}: {' '.join(hc.overrides.task) or '(defaults)'}{eta} ===", file=sys.stderr, flush=True)


class PrintSummary(Callback):
    """After a multirun: print every row it produced as one table and save it beside the logs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        out = Path(config.hydra.sweep.dir)
        paths = [p for f in sorted(out.glob(f"*/{ROWS_LIST}")) for p in json.loads(f.read_text())]
        if not paths:
            return
        df = read_rows(paths)
        with exit_on_user_error("tileinfer.sweep"):
            tables.write_summary(df, out)
        print(f"\n=== sweep summary ({len(df)} rows; {out}/summary.md) ===")
        tables.print_table(df, where=paths)


if __name__ == "__main__":
    schema.check_argv("tileinfer.sweep", sys.argv[1:])
    check_runs_dir("tileinfer.sweep", sys.argv[1:])
    _SWEEP["jobs"] = schema.check_jobs("tileinfer.sweep", sys.argv[1:])
    main()
