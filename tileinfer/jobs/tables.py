"""Result tables: one Polars row per (model, quant, ctx, prompt set, backend), written atomically.

A row file ``rows/.../NAME.parquet`` holds the row; ``NAME.positions.parquet`` beside it holds the
per-position KL divergence, top-1 agreement, Δp and next-token log-probabilities along the scored
window, and the window or prompt (``group``) of each position (for plots, paired differences and
intervals). A summary gathers every row under a folder into one table, printed and saved as Parquet
and Markdown.
"""

from __future__ import annotations

import io
import math
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import torch

from evals.intervals import row_intervals
from evals.metrics import DEGENERATE_REPEAT, repeated_ngram_fraction, summarize
from tileinfer.core import files
from tileinfer.jobs.identity import ADDED, IDENTITY, RENAMED
from tileinfer.jobs.schema import tie_margin

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
    # speculative decoding (shown where a row speculates: write_summary): proposer, mean acceptance
    # length, speed-up over plain decoding and whether the greedy reply stayed the plain one
    "spec",
    "spec_k",
    "spec_acceptance_length",
    "spec_speedup",
    "spec_exact",
]
# Per-position values saved beside a row (write_row), with each position's window or prompt (``group``).
POSITION_COLUMNS = ("kl", "top1_agree", "dp", "logp_base", "logp_cand")
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


def speed_columns(rep_tok_s: list[float]) -> dict:
    """A row's decode speed from the tok/s of its timed repetitions (of every prompt that timed
    some): ``decode_tok_s`` their median, ``decode_ms_per_tok`` its inverse, ``decode_tok_s_min`` /
    ``decode_tok_s_max`` the spread and ``decode_reps`` how many; NaN speeds without any."""
    if not rep_tok_s:
        nan = float("nan")
        return dict(decode_tok_s=nan, decode_ms_per_tok=nan, decode_tok_s_min=nan, decode_tok_s_max=nan, decode_reps=0)
    median = statistics.median(rep_tok_s)
    return dict(
        decode_tok_s=median,
        decode_ms_per_tok=1e3 / median,
        decode_tok_s_min=min(rep_tok_s),
        decode_tok_s_max=max(rep_tok_s),
        decode_reps=len(rep_tok_s),
    )


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
    replies: list[list[int]],
    extra: dict | None = None,
    unit: str = "prompt",
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
        replies: the scored reply (token ids) of each prompt: ``reply_repeat_frac`` is the share of
            their tokens that complete a 4-gram seen earlier in the same reply
            (:func:`evals.metrics.repeated_ngram_fraction`), and ``degenerate`` flags a window above
            :data:`evals.metrics.DEGENERATE_REPEAT` (a reply stuck in a loop is trivially
            predictable, so its KL understates the drift on real text).
        extra: more columns, placed after the speeds (the speculative decoding columns, a corpus's
            token count).
        unit: what one result is, ``prompt`` or (a corpus) ``window``: the unit the intervals resample.

    Statistics are taken over the positions of all prompts together, with their 95% intervals
    (:func:`evals.intervals.row_intervals`); prefill speeds are means over the prompts that timed them, decode speeds
    (:func:`speed_columns`) pool their timed repetitions.
    """
    per_pos = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}
    stats = summarize(per_pos) if len(results) > 1 else dict(results[0][0])
    if len(results) > 1:
        stats["greedy_agree_len"] = sum(r[0]["greedy_agree_len"] for r in results) / len(results)
        stats["n_scored"] = sum(r[0]["n_scored"] for r in results)
        for k in ("prefill_ms", "prefill_tok_s"):
            timed = [r[0][k] for r in results if math.isfinite(r[0][k])]  # a corpus decodes after one window
            stats[k] = sum(timed) / len(timed) if timed else float("nan")
    stats.pop("decode_rep_tok_s", None)  # one prompt's summary: condensed with the others' below
    stats |= speed_columns([v for r in results for v in r[0]["decode_rep_tok_s"]])
    stats |= row_intervals(per_pos, position_groups(results), unit)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    repeat = sum(repeated_ngram_fraction(r) * len(r) for r in replies) / max(1, sum(map(len, replies)))
    return {
        **key,
        "n_prompts": len(results),
        **stats,
        **(extra or {}),
        "reply_repeat_frac": repeat,
        "degenerate": repeat > DEGENERATE_REPEAT,
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


def position_groups(results: list[tuple[dict, dict]]) -> torch.Tensor:
    """int64 [positions]: the index of the prompt or window (the result) each scored position belongs to."""
    return torch.cat([torch.full((len(r[1]["kl"]),), i) for i, r in enumerate(results)])


def upgrade(df: pl.DataFrame) -> pl.DataFrame:
    """Rows written under older column names, renamed to today's (tileinfer.jobs.identity.RENAMED),
    with identity columns added since (:data:`tileinfer.jobs.identity.ADDED`) at their old meaning."""
    df = df.rename({old: new for old, new in RENAMED.items() if old in df.columns and new not in df.columns})
    return df.with_columns(pl.lit(v).alias(c) for c, v in ADDED.items() if c not in df.columns)


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
    pos_path = path.with_suffix(".positions.parquet")
    atomic_parquet(pos, pos_path)
    try:
        atomic_parquet(pl.DataFrame([row]), path)
    except BaseException:
        pos_path.unlink(missing_ok=True)
        raise


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


def sweep_rows(runs_dir: Path) -> tuple[pl.DataFrame, Path, int]:
    """The sweep rows of a runs folder, for summaries and reports.

    Only the rows under ``runs_dir/rows`` (or ``runs_dir`` itself when it is such a ``rows`` folder)
    are read: the gate scores afresh into folders of its own (``runs/gate/*/rows``), whose rows
    would repeat the sweep's. Rows of one identity (tileinfer.jobs.identity.IDENTITY, over the
    columns present) are kept once, the newest ``finished_at``.

    Returns:
        The rows (each with its file in a column ``row_file``; empty when there are none), the
        folder read and how many duplicate rows were dropped.
    """
    runs_dir = Path(runs_dir)
    rows_dir = runs_dir if runs_dir.name == "rows" and not (runs_dir / "rows").is_dir() else runs_dir / "rows"
    frames = read_row_files(row_files(rows_dir)) if rows_dir.is_dir() else []
    if not frames:
        return pl.DataFrame(), rows_dir, 0
    df = pl.concat(frames, how="diagonal_relaxed")
    key = [c for c in IDENTITY if c in df.columns]
    if not key:  # no row of a sweep: nothing to match duplicates on
        return df, rows_dir, 0
    if "finished_at" in df.columns:
        df = df.sort("finished_at", nulls_last=False)
    newest = df.unique(subset=key, keep="last", maintain_order=True)
    return newest, rows_dir, len(df) - len(newest)


def _fmt(df: pl.DataFrame, shown=SHOWN) -> pl.DataFrame:
    """The ``shown`` columns, sorted, as text: KL in scientific notation (values span 1e-7..1), top-1
    agreement in percent, speeds to one decimal, greedy agreement lengths as counts."""
    cols = [c for c in shown if c in df.columns]
    df = df.sort([c for c in ("model", "ctx_tokens", "ctx", "prompt_set", "quant") if c in df.columns]).select(cols)
    text = {c: (lambda v: f"{v:.2e}") for c in cols if c.startswith("kl_")}
    text |= {
        "top1_agree": lambda v: f"{100 * v:.2f}%",
        "greedy_agree_len": lambda v: f"{v:g}",
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


# A printed table: these identity columns where they vary (else once, in a line above it)...
PRINTED_IDENTITY = ["model", "quant", "ctx", "prompt_set", "backend", "base", "device"]
# ...then these (every column is in the saved summary), and the repetition of the scored reply.
PRINTED = ["kl_mean", "kl_p99", "top1_agree", "greedy_agree_len", "decode_tok_s"]
PRINT_WIDTH = 120


def degenerate_note(df: pl.DataFrame) -> str | None:
    """The warning that names the rows whose scored window is degenerate (``degenerate`` true: more of
    the scored reply than :data:`evals.metrics.DEGENERATE_REPEAT` continues a 4-gram seen earlier, so
    it is trivially predictable and its KL understates the drift), or None. Rows without the column
    (written before it existed) are unknown, not degenerate."""
    if "degenerate" not in df.columns:
        return None
    bad = _quant_label(df).filter(pl.col("degenerate").cast(pl.Boolean).fill_null(False))
    if bad.is_empty():
        return None
    key = [c for c in ("model", "quant", "ctx", "prompt_set", "backend") if c in bad.columns]
    names = ["/".join(map(str, r)) for r in bad.select(key).iter_rows()]
    return (
        f"{len(bad)} row(s) scored a degenerate window (over {DEGENERATE_REPEAT:.0%} of the reply repeats an "
        f"earlier 4-gram, so their KL understates the drift): {', '.join(names)}"
    )


def _quant_label(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with ``quant`` naming its key smoothing (``int8_kv+smooth``), as printed."""
    if "smooth_keys" not in df.columns:
        return df
    smooth = pl.col("smooth_keys").cast(pl.Boolean).fill_null(False)
    return df.with_columns(quant=pl.when(smooth).then(pl.col("quant") + "+smooth").otherwise(pl.col("quant")))


def _repeat(frac, degenerate) -> str:
    """The ``repeat`` cell: the share of the scored reply that repeats an earlier 4-gram, ``!`` when the
    window is degenerate, ``?`` when unknown (a row written before the measure existed)."""
    if degenerate is None:
        return "?"
    return (f"{100 * frac:.0f}%" if frac is not None else "") + (" !" if degenerate else "")


def _printed(df: pl.DataFrame) -> tuple[str, pl.DataFrame]:
    """The line of identity columns that hold one value (``model=... backend=...``) and the table of
    the ones that vary beside :data:`PRINTED` (quant names its key smoothing: ``int8_kv+smooth``)."""
    df = _quant_label(df)
    ident = [c for c in PRINTED_IDENTITY if c in df.columns]
    constant = [c for c in ident if df[c].n_unique() == 1]
    shown = [c for c in ident if c not in constant] + PRINTED
    if {"degenerate", "reply_repeat_frac"} & set(df.columns):
        cols = [(pl.col(c) if c in df.columns else pl.lit(None)).alias(c) for c in ("reply_repeat_frac", "degenerate")]
        df = df.with_columns(repeat=pl.Series([_repeat(f, d) for f, d in df.select(cols).iter_rows()], dtype=pl.String))
        shown.append("repeat")
    return " ".join(f"{c}={df[c][0]}" for c in constant), _fmt(df, shown)


def print_table(df: pl.DataFrame, where=None) -> None:
    """Print ``df`` in about :data:`PRINT_WIDTH` characters: a line of the identity columns that hold
    one value (``model=... backend=... device=...``), a table of those that vary beside mean and 99%
    KL, top-1 agreement, greedy agreement length, decode speed and (rows that measured it) the
    repetition of the scored reply, a warning naming degenerate windows (:func:`degenerate_note`),
    and where the rows are.

    When a row speculates (``spec`` other than ``none``), the table is one row per proposer setting
    too and trades 99% KL, top-1 agreement and greedy agreement length (the same as the plain row's)
    for ``spec``, ``spec_k``, ``acc_len`` (mean acceptance length), ``speedup`` (over the plain decode
    speed shown) and ``exact`` (``yes``: the greedy speculative reply is the plain one; ``tie@N``: it
    first differs at step N where the target's top two logits were within the near-tie margin of the
    row's dtype (``schema.tie_margin``), rounding; ``NO@N``:
    a wider margin, a bug, also named in a warning).

    Args:
        df: rows (:func:`make_row`).
        where: the folder of the rows, or their files (their common folder is named); None: not said.
    """
    spec = pl.col("spec").cast(pl.String).fill_null("none") if "spec" in df.columns else None
    mismatch = None
    if spec is None or not df.select(spec.ne("none").any()).item():
        head, table = _printed(df)
        note = degenerate_note(df)
    else:
        order = ["none", "ngram", "draft", "dflash"]
        df = df.with_columns(spec).sort(
            [c for c in ("model", "ctx_tokens", "ctx", "prompt_set", "quant") if c in df.columns]
            + [pl.col("spec").replace_strict(order, list(range(len(order))), default=len(order)), "spec"]
            + [c for c in ("spec_k", "spec_settings", "spec_temperature") if c in df.columns],
            maintain_order=True,
        )
        cells, bad = {"spec_k": [], "acc_len": [], "speedup": [], "exact": []}, 0
        cols = ["spec_k", "spec_acceptance_length", "spec_speedup", "spec_exact", "spec_first_mismatch"]
        cols = [
            pl.col(c) if c in df.columns else pl.lit(None).alias(c) for c in [*cols, "spec_mismatch_margin", "dtype"]
        ]
        for name, k, length, speedup, exact, step, margin, dtype in df.select("spec", *cols).iter_rows():
            plain = name == "none"
            for c, v in (("spec_k", k), ("acc_len", length), ("speedup", speedup)):
                cells[c].append("" if plain or v is None else f"{v}" if c == "spec_k" else f"{v:.2f}")
            if plain or exact is None:
                cells["exact"].append("" if plain else "–")  # sampled, or not measured
            elif exact:
                cells["exact"].append("yes")
            else:
                tie = margin is not None and margin <= tie_margin(dtype)  # an unknown or NaN margin is no tie
                cells["exact"].append(("tie" if tie else "NO") + ("" if step is None else f"@{step}"))
                bad += not tie
        note = degenerate_note(  # once per configuration: its speculative rows score the same reply
            df.unique(
                [c for c in ("model", "quant", "smooth_keys", "ctx", "prompt_set", "backend") if c in df.columns],
                keep="first",
                maintain_order=True,
            )
        )
        df = df.with_columns(pl.Series(c, v, dtype=pl.String) for c, v in cells.items()).with_row_index("_row")
        # the identity columns that vary, mean KL and decode speed, the speculation, the repetition
        labelled = _quant_label(df)
        ident = [c for c in PRINTED_IDENTITY if c in df.columns]
        constant = [c for c in ident if labelled[c].n_unique() == 1]
        shown = [c for c in ident if c not in constant] + ["kl_mean", "decode_tok_s", "spec", *cells]
        if {"degenerate", "reply_repeat_frac"} & set(df.columns):
            rep = [
                (pl.col(c) if c in df.columns else pl.lit(None)).alias(c) for c in ("reply_repeat_frac", "degenerate")
            ]
            repeat = [_repeat(f, d) for f, d in df.select(rep).iter_rows()]
            labelled = labelled.with_columns(repeat=pl.Series(repeat, dtype=pl.String))
            shown.append("repeat")
        head = " ".join(f"{c}={labelled[c][0]}" for c in constant)
        table = _fmt(labelled, [*shown, "_row"]).sort("_row").drop("_row")
        if bad:  # named by the table's NO@N
            mismatch = f"{bad} speculative row(s) parted from the plain greedy reply beyond a near-tie (NO@step)"
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        tbl_width_chars=PRINT_WIDTH,
        fmt_str_lengths=40,
    ):
        lines = (head, str(table), note and f"warning: {note}", mismatch and f"warning: {mismatch}")
        print("\n".join(line for line in lines if line))
    if where is not None:
        folders = [where] if isinstance(where, (str, Path)) else [Path(p).parent for p in where]
        print(f"{len(df)} row(s) in {os.path.commonpath(folders)}")


def write_summary(df: pl.DataFrame, out_dir: Path) -> None:
    """Save ``df`` as ``summary.parquet`` and ``summary.md`` in ``out_dir`` (atomically). The Markdown
    table shows the speculative decoding columns of :data:`SHOWN` only when a row speculates."""
    out_dir = Path(out_dir)
    atomic_parquet(df, out_dir / "summary.parquet")
    spec = [c for c in SHOWN if c.startswith("spec") and c in df.columns]
    if "spec" in df.columns and df["spec"].cast(pl.String).fill_null("none").ne("none").any():
        md = df.with_columns(pl.col(c).round(3) for c in spec if df[c].dtype.is_float())
    else:
        md = df.drop(spec)
    files.write_text(out_dir / "summary.md", to_markdown(md) + "\n")
