"""Result rows: one Polars row per scored set of a job, built from values, written atomically, and
read back by one reader.

A row file ``rows/MODEL/BACKEND/LABEL-HASH.parquet`` holds the row; ``LABEL-HASH.positions.parquet``
beside it holds the per-position KL divergence, top-1 agreement, Δp and next-token
log-probabilities along the scored window, with the item (prompt or window, ``group``) of each
position (for plots, paired differences and intervals). The row's presence marks the job done.
"""

from __future__ import annotations

import io
import sys
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import torch

from tileinfer.core import files
from tileinfer.core.errors import UserError
from tileinfer.core.provenance import git_commit
from tileinfer.jobs.identity import ADDED, IDENTITY, RENAMED


def make_row(key: dict, statistics: dict, columns: dict, wall_s: float) -> dict:
    """One table row: the identity columns ``key`` (:meth:`tileinfer.jobs.plan.Plan.identity`), the
    scored set's ``statistics`` (:func:`evals.drift.set_statistics`), what the job measured besides
    (``columns``: weights and KV cache bytes, peak memory, KL estimate, fallbacks, speculation), and
    provenance (torch, the commit, when it finished, the ``wall_s`` seconds it took)."""
    return {
        **key,
        **statistics,
        **columns,
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
    }


def atomic_parquet(df: pl.DataFrame, path: Path) -> None:
    """Write ``df`` to ``path`` atomically; an OS failure (full disk, read-only) is a one-line UserError.

    The table is serialized in memory first: polars' own file writer reports a full disk as a
    parquet format error ("Invalid thrift") and leaves its partial file behind.
    """
    buf = io.BytesIO()
    df.write_parquet(buf)
    files.write_bytes(path, buf.getvalue())


def write_row(path: Path, row: dict, per_position: dict[str, torch.Tensor]) -> None:
    """Write the per-position table, then the row (the row's presence marks the job done); when the
    row cannot be written, the per-position table is removed again (no orphan beside no row)."""
    pos = pl.DataFrame(
        {"position": list(range(len(per_position["kl"])))} | {k: v.cpu().numpy() for k, v in per_position.items()}
    )
    pos_path = positions_path(path)
    atomic_parquet(pos, pos_path)
    try:
        atomic_parquet(pl.DataFrame([row]), path)
    except BaseException:
        pos_path.unlink(missing_ok=True)
        raise


def positions_path(row_file: Path | str) -> Path:
    """The per-position table beside a row file."""
    return Path(row_file).with_suffix(".positions.parquet")


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished row (a missing, empty or damaged file does not; a damaged
    one is named on stderr, and the job computes it again)."""
    if not path.exists():
        return False
    try:
        return not pl.scan_parquet(path).collect().is_empty()
    except Exception as e:  # noqa: BLE001 - any unreadable file is not a finished row
        print(f"warning: {path} is damaged ({_why(e)}): computing its row again", file=sys.stderr)
        return False


def upgrade(df: pl.DataFrame) -> pl.DataFrame:
    """Rows written under older column names, renamed to today's (:data:`tileinfer.jobs.identity.RENAMED`),
    with identity columns added since (:data:`tileinfer.jobs.identity.ADDED`) at their old meaning."""
    df = df.rename({old: new for old, new in RENAMED.items() if old in df.columns and new not in df.columns})
    return df.with_columns(pl.lit(v).alias(c) for c, v in ADDED.items() if c not in df.columns)


def row_files(folder: Path) -> list[Path]:
    """The row files under ``folder`` (any depth): Parquet files but positions, summaries and temporaries."""
    return sorted(
        p
        for p in Path(folder).rglob("*.parquet")
        if not p.name.endswith(".positions.parquet") and not p.name.startswith((".", "summary"))
    )


def _why(e: Exception) -> str:
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def read(source: Path | list[Path]) -> pl.DataFrame:
    """The one reader of result rows: every row file of ``source`` (a folder, read at any depth, or a
    list of files) as one table, with today's column names (:func:`upgrade`) and each row's file in a
    column ``row_file``. A damaged file is skipped with a warning naming it; no files give an empty
    table. :func:`newest` is the one rule for rows of one identity.

    Raises:
        UserError: a file of an explicit list that cannot be read (it was just written: a fault).
    """
    listed = isinstance(source, list)
    frames = []
    for f in source if listed else row_files(source):
        try:
            frames.append(upgrade(pl.scan_parquet(f).collect()).with_columns(row_file=pl.lit(str(f))))
        except Exception as e:  # noqa: BLE001 - whatever is wrong with one file
            if listed:
                raise UserError(f"cannot read the row file {f} ({_why(e)})") from None
            print(
                f"warning: skipped the damaged row file {f} ({_why(e)}); delete it to compute its row again",
                file=sys.stderr,
            )
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def newest(df: pl.DataFrame) -> pl.DataFrame:
    """Rows of one identity (tileinfer.jobs.identity.IDENTITY, over the columns present) once, the
    newest ``finished_at``, in their order."""
    key = [c for c in IDENTITY if c in df.columns]
    if not key:
        return df
    if "finished_at" in df.columns:
        df = df.sort("finished_at", nulls_last=False)
    return df.unique(subset=key, keep="last", maintain_order=True)


def read_sweep(runs_dir: Path) -> tuple[pl.DataFrame, Path, int]:
    """The sweep rows of a runs folder (``runs_dir/rows``, or ``runs_dir`` itself when it is such a
    ``rows`` folder), one per identity (:func:`newest`), the folder read and how
    many older rows of an identity were left out.

    Raises:
        UserError: not a folder, or no rows in it.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"{runs_dir} is not a folder")
    folder = runs_dir if runs_dir.name == "rows" and not (runs_dir / "rows").is_dir() else runs_dir / "rows"
    df = read(folder) if folder.is_dir() else None
    if df is None or df.is_empty():
        raise UserError(f"no result rows under {folder} (run python -m tileinfer.sweep first)")
    kept = newest(df)
    return kept, folder, len(df) - len(kept)
