"""Gather the sweep's result rows of a runs folder into one table: printed, and saved beside it.

python -m tileinfer.summary runs/        # writes runs/summary.parquet and runs/summary.md

Rows are read from ``runs/rows/`` only (the gate's runs under ``runs/gate/`` score the same
configurations again), once per row identity, the newest (:func:`tileinfer.jobs.tables.sweep_rows`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tileinfer.core.errors import UserError, exit_on_user_error
from tileinfer.jobs import tables


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="tileinfer.summary", description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path, nargs="?", default=Path("runs"))
    args = ap.parse_args(argv)
    with exit_on_user_error("tileinfer.summary"):
        if not args.runs_dir.is_dir():
            raise UserError(f"{args.runs_dir} is not a folder")
        df, rows_dir, duplicates = tables.sweep_rows(args.runs_dir)
        if df.is_empty():
            raise UserError(f"no result rows under {rows_dir} (run python -m tileinfer.sweep first)")
        df = df.drop("row_file")
        tables.write_summary(df, args.runs_dir)
        tables.print_table(df, where=rows_dir)
        if duplicates:
            print(f"{duplicates} older row(s) of the same identity left out (the newest kept)")
        print(f"saved: {args.runs_dir / 'summary.parquet'}, {args.runs_dir / 'summary.md'}")


if __name__ == "__main__":
    main()
