"""Gather the sweep's result rows of a runs folder into one table: printed, and saved beside it.

python -m tileinfer.summary runs/        # writes runs/summary.parquet and runs/summary.md

Rows are read from ``runs/rows/`` only (the gate's runs under ``runs/gate/`` score the same
configurations again), once per row identity, the newest (:func:`tileinfer.jobs.rows.read`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tileinfer.cli import exit_on_error
from tileinfer.core.errors import UserError
from tileinfer.jobs import rows, tables


def sweep_rows(runs_dir: Path) -> tuple:
    """The sweep rows of a runs folder (``runs_dir/rows``, or ``runs_dir`` itself when it is such a
    ``rows`` folder), one per identity (:func:`tileinfer.jobs.rows.newest`), the folder read and how
    many older rows of an identity were left out.

    Raises:
        UserError: not a folder, or no rows in it.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"{runs_dir} is not a folder")
    folder = runs_dir if runs_dir.name == "rows" and not (runs_dir / "rows").is_dir() else runs_dir / "rows"
    df = rows.read(folder) if folder.is_dir() else None
    if df is None or df.is_empty():
        raise UserError(f"no result rows under {folder} (run python -m tileinfer.sweep first)")
    kept = rows.newest(df)
    return kept, folder, len(df) - len(kept)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="tileinfer.summary", description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path, nargs="?", default=Path("runs"))
    args = ap.parse_args(argv)
    with exit_on_error("tileinfer.summary"):
        df, folder, older = sweep_rows(args.runs_dir)
        df = df.drop("row_file")
        tables.write_summary(df, args.runs_dir)
        tables.print_table(df, where=folder)
        if older:
            print(f"{older} older row(s) of the same identity left out (the newest kept)")
        print(f"saved: {args.runs_dir / 'summary.parquet'}, {args.runs_dir / 'summary.md'}")


if __name__ == "__main__":
    main()
