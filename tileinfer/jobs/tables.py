"""Result tables as people read them: rows (tileinfer.jobs.rows) printed to fit a terminal, and a
summary of many rows saved as Parquet and Markdown."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from evals.metrics import DEGENERATE_REPEAT
from evals.verdicts import spec_outcome
from tileinfer.core import files
from tileinfer.jobs.rows import atomic_parquet
from tileinfer.jobs.schema import PROPOSERS

# Columns shown when a table is printed (all columns are saved).
SHOWN = (
    *("model", "quant", "smooth_keys", "ctx", "prompt_set", "backend", "kl_mean", "kl_p99", "kl_max", "top1_agree"),
    *("greedy_agree_len", "n_scored", "prefill_tok_s", "decode_tok_s"),
    # speculative decoding (shown where a row speculates: write_summary): proposer, mean acceptance
    # length, speed-up over plain decoding and whether the greedy reply stayed the plain one
    *("spec", "spec_k", "spec_acceptance_length", "spec_speedup", "spec_exact"),
)


def _fmt(df: pl.DataFrame, shown=SHOWN) -> pl.DataFrame:
    """The ``shown`` columns, sorted, as text: KL in scientific notation (values span 1e-7..1), top-1
    agreement in percent, speeds to one decimal, greedy agreement lengths as counts."""
    cols = [c for c in shown if c in df.columns]
    keys = [c for c in ("model", "ctx_tokens", "ctx", "prompt_set", "quant") if c in df.columns]
    df = df.sort(keys, maintain_order=True).select(cols)
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
PRINTED_IDENTITY = ("model", "quant", "ctx", "prompt_set", "backend", "base", "device")
# ...then these (every column is in the saved summary), and the repetition of the scored reply.
PRINTED = ("kl_mean", "kl_p99", "top1_agree", "greedy_agree_len", "decode_tok_s")
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


def _exact(row: dict) -> str:
    """The ``exact`` cell of a speculative row (:func:`evals.verdicts.spec_outcome`): ``yes``, ``tie@N``
    (it first differs at step N, at a near-tie), ``NO@N`` (a bug), ``–`` (sampled)."""
    outcome, step = spec_outcome(row), row.get("spec_first_mismatch")
    at = "" if step is None else f"@{step}"
    return {None: "–", "yes": "yes", "tie": f"tie{at}"}.get(outcome, f"NO{at}")


def print_table(df: pl.DataFrame, where=None) -> None:
    """Print ``df`` in about :data:`PRINT_WIDTH` characters: a line of the identity columns that hold
    one value (``model=... backend=... device=...``), a table of those that vary beside mean and 99%
    KL, top-1 agreement, greedy agreement length, decode speed and (rows that measured it) the
    repetition of the scored reply, a warning naming degenerate windows (:func:`degenerate_note`),
    and where the rows are (``where``: their folder, or their files).

    When a row speculates (``spec`` other than ``none``), the table is one row per proposer setting
    too and trades 99% KL, top-1 agreement and greedy agreement length (the same as the plain row's)
    for ``spec``, ``spec_k``, ``acc_len`` (mean acceptance length), ``speedup`` (over the plain decode
    speed shown) and ``exact`` (:func:`_exact`; a ``NO`` is also named in a warning).
    """
    n = len(df)
    if "spec" in df.columns:
        df = df.with_columns(pl.col("spec").cast(pl.String).fill_null("none"))
    speculative = "spec" in df.columns and df["spec"].ne("none").any()
    note, mismatch, shown = degenerate_note(df.filter(pl.col("spec") == "none") if speculative else df), None, PRINTED
    df = _quant_label(df)
    if speculative:  # each configuration's plain row, then its proposers in table order
        order, keys = list(PROPOSERS), [c for c in ("spec_k", "spec_settings", "spec_temperature") if c in df.columns]
        rank = pl.col("spec").replace_strict(order, list(range(len(order))), default=len(order))
        df = df.sort(rank, "spec", *keys, maintain_order=True, nulls_last=False)
        cells = {"spec_k": [], "acc_len": [], "speedup": [], "exact": []}
        for r in df.iter_rows(named=True):
            k, length, speedup = r.get("spec_k"), r.get("spec_acceptance_length"), r.get("spec_speedup")
            plain = r["spec"] == "none"
            cells["spec_k"].append("" if plain or k is None else str(k))
            cells["acc_len"].append("" if plain or length is None else f"{length:.2f}")
            cells["speedup"].append("" if plain or speedup is None else f"{speedup:.2f}")
            cells["exact"].append("" if plain else _exact(r))
        df = df.with_columns(pl.Series(c, v, dtype=pl.String) for c, v in cells.items())
        if bad := sum(c.startswith("NO") for c in cells["exact"]):  # named by the table's NO@N
            mismatch = f"{bad} speculative row(s) parted from the plain greedy reply beyond a near-tie (NO@step)"
        shown = ["kl_mean", "decode_tok_s", "spec", *cells]
    ident = [c for c in PRINTED_IDENTITY if c in df.columns]
    constant = [c for c in ident if df[c].n_unique() == 1]
    shown = [*(c for c in ident if c not in constant), *shown]
    if {"degenerate", "reply_repeat_frac"} & set(df.columns):
        cols = [(pl.col(c) if c in df.columns else pl.lit(None)).alias(c) for c in ("reply_repeat_frac", "degenerate")]
        df = df.with_columns(repeat=pl.Series([_repeat(f, d) for f, d in df.select(cols).iter_rows()], dtype=pl.String))
        shown.append("repeat")
    table = _fmt(df, shown)
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        tbl_width_chars=PRINT_WIDTH,
        fmt_str_lengths=40,
    ):
        head = " ".join(f"{c}={df[c][0]}" for c in constant)
        lines = (head, str(table), note and f"warning: {note}", mismatch and f"warning: {mismatch}")
        print("\n".join(line for line in lines if line))
    if where is not None:
        folders = [where] if isinstance(where, (str, Path)) else [Path(p).parent for p in where]
        print(f"{n} row(s) in {os.path.commonpath(folders)}")


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
