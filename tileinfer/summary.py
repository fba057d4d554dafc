"""Gather the sweep's result rows of a runs folder into one table: printed, and saved beside it.

python -m tileinfer.summary runs/        # writes runs/summary.parquet and runs/summary.md

Rows are read from ``runs/rows/`` only (the gate's runs under ``runs/gate/`` score the same
configurations again), once per row identity, the newest (:func:`tileinfer.jobs.rows.read_sweep`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tileinfer.cli import exit_on_error
from tileinfer.jobs import tables
from tileinfer.jobs.rows import read_sweep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="tileinfer.summary", description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path, nargs="?", default=Path("runs"))
    args = ap.parse_args(argv)
    with exit_on_error("tileinfer.summary"):
        df, folder, older = read_sweep(args.runs_dir)
        df = df.drop("row_file")
        tables.write_summary(df, args.runs_dir)
        tables.print_table(df, where=folder)
        if older:
            print(f"{older} older row(s) of the same identity left out (the newest kept)")
        print(f"saved: {args.runs_dir / 'summary.parquet'}, {args.runs_dir / 'summary.md'}")


if __name__ == "__main__":
    main()
