"""Result tables: one Polars row per (model, quant, ctx, prompt set, backend), written atomically.

A row file ``rows/.../NAME.parquet`` holds the row; ``NAME.positions.parquet`` beside it holds the
per-position KL divergence, top-1 agreement and Δp along the scored window (for plots). A summary
gathers every row under a folder into one table, printed and saved as Parquet and Markdown.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import torch

from evals.metrics import summarize
from tileinfer.jobs.identity import RENAMED

# Columns shown when a table is printed (all columns are saved).
SHOWN = [
    "model",
    "quant",
    "smooth_keys",
    "ctx",
    "prompt_set",
    "backend",
    "kl_mean",
    "kl_p99",
    "kl_max",
    "top1_agree",
    "greedy_agree_len",
    "n_scored",
    "prefill_tok_s",
    "decode_tok_s",
]
REPO = Path(__file__).resolve().parents[2]  # the checkout (site-packages when installed: commit unknown)


def git_commit() -> str:
    """Short commit of the code that ran, ``-dirty`` when it had uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def make_row(
    key: dict,
    results: list[tuple[dict, dict]],
    *,
    device: torch.device,
    weights_bytes: int,
    kv_bytes: int,
    wall_s: float,
    kl_estimate: str,
    fallbacks: list[str],
) -> dict:
    """One table row from the :func:`tileinfer.jobs.drift.score` results of a prompt set's prompts.

    Args:
        key: the row's identity columns (tileinfer.jobs.identity).
        results: (summary, per-position arrays) per prompt.
        device: where the candidate ran (peak memory is read on CUDA).
        weights_bytes, kv_bytes: bytes of the candidate's weights and of its KV cache at the job's length.
        wall_s: seconds the prompt set took.
        kl_estimate: ``exact``, or ``topkK+tail`` against stored base logits.
        fallbacks: the ops that ran on another backend than asked (tileinfer.ops.fallbacks()).

    Statistics are taken over the positions of all prompts together; speeds are means over prompts.
    """
    per_pos = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}
    stats = summarize(per_pos) if len(results) > 1 else dict(results[0][0])
    if len(results) > 1:
        stats["greedy_agree_len"] = sum(r[0]["greedy_agree_len"] for r in results) / len(results)
        stats["n_scored"] = sum(r[0]["n_scored"] for r in results)
        for k in ("prefill_ms", "prefill_tok_s", "decode_tok_s", "decode_ms_per_tok"):
            stats[k] = sum(r[0][k] for r in results) / len(results)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        **key,
        "n_prompts": len(results),
        **stats,
        "weights_bytes": weights_bytes,
        "kv_cache_bytes": kv_bytes,
        "peak_mem_bytes": peak,
        "kl_estimate": kl_estimate,
        "fallbacks": "; ".join(fallbacks),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
    }


def upgrade(df: pl.DataFrame) -> pl.DataFrame:
    """Rows written under older column names, renamed to today's (tileinfer.jobs.identity.RENAMED)."""
    return df.rename({old: new for old, new in RENAMED.items() if old in df.columns and new not in df.columns})


def atomic_parquet(df: pl.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    df.write_parquet(tmp)
    os.replace(tmp, path)


def write_row(path: Path, row: dict, per_position: dict[str, torch.Tensor]) -> None:
    """Write the per-position table, then the row (the row's presence marks the job done)."""
    pos = pl.DataFrame(
        {"position": list(range(len(per_position["kl"])))} | {k: v.cpu().numpy() for k, v in per_position.items()}
    )
    atomic_parquet(pos, path.with_suffix(".positions.parquet"))
    atomic_parquet(pl.DataFrame([row]), path)


def is_complete_row(path: Path) -> bool:
    """Whether ``path`` holds a finished row (a missing, empty or damaged file does not)."""
    try:
        return not pl.read_parquet(path).is_empty()
    except Exception:  # noqa: BLE001 - any unreadable file is not a finished row
        return False


def row_files(runs_dir: Path) -> list[Path]:
    """The row files under ``runs_dir`` (any depth): Parquet files but positions, summaries and temporaries."""
    return sorted(
        p
        for p in Path(runs_dir).rglob("*.parquet")
        if not p.name.endswith(".positions.parquet") and not p.name.startswith((".", "summary"))
    )


def read_row_files(files) -> list[pl.DataFrame]:
    """Each readable file as a frame with its path in a column ``row_file``; an unreadable one (damaged,
    not Parquet) is skipped with a warning on stderr rather than hiding every other row."""
    frames = []
    for f in files:
        try:
            frames.append(upgrade(pl.read_parquet(f)).with_columns(row_file=pl.lit(str(f))))
        except Exception as e:  # noqa: BLE001 - whatever is wrong with one file
            print(f"warning: skipped {f} ({type(e).__name__})", file=sys.stderr)
    return frames


def collect(runs_dir: Path) -> pl.DataFrame:
    """Every row under ``runs_dir`` (any depth) as one table; empty table when there are none."""
    frames = read_row_files(row_files(runs_dir))
    if not frames:
        return pl.DataFrame()
    return pl.concat(frames, how="diagonal_relaxed").drop("row_file")


def _fmt(df: pl.DataFrame) -> pl.DataFrame:
    """The shown columns, sorted, as text: KL in scientific notation (values span 1e-7..1), top-1
    agreement in percent, speeds to one decimal."""
    cols = [c for c in SHOWN if c in df.columns]
    df = df.select(cols).sort([c for c in ("model", "ctx", "prompt_set", "quant") if c in cols])
    text = {c: (lambda v: f"{v:.2e}") for c in cols if c.startswith("kl_")}
    text |= {
        "top1_agree": lambda v: f"{100 * v:.2f}%",
        "prefill_tok_s": lambda v: f"{v:.1f}",
        "decode_tok_s": lambda v: f"{v:.1f}",
    }
    return df.with_columns(pl.col(c).map_elements(f, return_dtype=pl.String) for c, f in text.items() if c in cols)


def to_markdown(df: pl.DataFrame) -> str:
    with pl.Config(
        tbl_formatting="MARKDOWN",
        tbl_hide_column_data_types=True,
        tbl_hide_dataframe_shape=True,
        tbl_rows=-1,
        tbl_cols=-1,
        fmt_str_lengths=60,
        tbl_width_chars=10_000,
    ):  # never wrap cells across lines
        return str(_fmt(df))


def print_table(df: pl.DataFrame) -> None:
    """Print the shown columns of ``df`` (see :func:`_fmt`)."""
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        tbl_width_chars=250,
        fmt_str_lengths=40,
    ):
        print(_fmt(df))


def write_summary(df: pl.DataFrame, out_dir: Path) -> None:
    """Save ``df`` as ``summary.parquet`` and ``summary.md`` in ``out_dir`` (atomically)."""
    out_dir = Path(out_dir)
    atomic_parquet(df, out_dir / "summary.parquet")
    tmp = out_dir / f".summary.md.tmp{os.getpid()}"
    tmp.write_text(to_markdown(df) + "\n")
    os.replace(tmp, out_dir / "summary.md")
