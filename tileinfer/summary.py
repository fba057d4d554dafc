"""Gather every result row under a runs folder into one table: printed, and saved beside it.

python -m tileinfer.summary runs/        # writes runs/summary.parquet and runs/summary.md
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
        df = tables.collect(args.runs_dir)
        if df.is_empty():
            raise UserError(f"no result rows under {args.runs_dir}")
        tables.write_summary(df, args.runs_dir)
        tables.print_table(df)
        print(f"{len(df)} rows -> {args.runs_dir / 'summary.parquet'}, {args.runs_dir / 'summary.md'}")


if __name__ == "__main__":
    main()
