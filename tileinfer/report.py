"""Accuracy-versus-speed report of a sweep: one Markdown file with tables and plots.

    python -m tileinfer.report runs/                  # writes runs/report/
    python -m tileinfer.report runs/ --out /tmp/rep

Reads the sweep's result rows of RUNS_DIR (``RUNS_DIR/rows/``, not the gate's runs; one per row
identity, the newest: :func:`tileinfer.jobs.rows.read_sweep`) and writes into the output folder:

- ``summary.parquet`` / ``summary.md``: all rows as one table (:func:`tileinfer.jobs.tables.write_summary`);
- ``scatter-*.png``: mean KL (log scale) against decode speed, one plot per section;
- ``kl_by_position-*.png``: KL along the scored window, one plot per section and scored set;
- ``report.md``: one section per (model, ctx, backend) and setup (rows that differ in another
  identity column are not comparable: the columns that vary name the section), with one table per
  scored set (never averaged together): the drift columns under llama.cpp's ``--kl-divergence``
  names with their 95% intervals, llama.cpp's ± 1σ figures, and prefill/decode speed as a ratio to
  the BF16 row. Rows whose scored window is degenerate (the reply mostly repeats itself, so KL is
  understated) are named in a warning and marked in a column. Speculative rows score the same drift
  as plain ones: the drift tables show each configuration's plain row (``spec=none``; a speculative
  row where there is none), and a "Speculative decoding" part gives one line per proposer setting
  with two plots (``spec_speedup-*.png``, ``spec_acceptance-*.png``). Configurations that scored the
  same positions and differ in one setting (key smoothing, backend) get paired differences.

Plot files are named by model, ctx, backend and a short hash of the rest of the section's setup.
Every file is written atomically and ``report.md`` last, so an interrupted report never leaves a
half-written file under a final name.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from evals.intervals import paired_difference  # noqa: E402
from evals.metrics import DEGENERATE_REPEAT, LLAMA_CPP_LABELS  # noqa: E402
from evals.verdicts import SPEC_TIE_MARGIN, spec_outcome  # noqa: E402
from quantize import NAMED  # noqa: E402
from tileinfer.cli import exit_on_error  # noqa: E402
from tileinfer.core import files  # noqa: E402
from tileinfer.core.errors import UserError  # noqa: E402
from tileinfer.jobs import identity, schema, tables  # noqa: E402
from tileinfer.jobs.rows import positions_path, read_sweep  # noqa: E402

GROUP = ["model", "ctx", "backend"]  # one report section each...
CONFIG = ["quant", "smooth_keys", "smooth_alpha"]  # ...with one table row each (per scored set)...
# ...and, in the speculative decoding tables, one line per proposer and its settings beside it...
SPEC = {"spec": pl.String, "spec_k": pl.Int64, "spec_settings": pl.String, "spec_temperature": pl.Float64}
# ...and one section per setup: the other identity columns, but those the ones above determine.
DETERMINED = (
    *("prompt_set", "prompts_sha256", "corpus", "model_sha256", "weights", "kv_cache", "ctx_tokens"),
    *("calibration_tokens", "calibration_sha256"),
)
SETUP = [c for c in identity.IDENTITY if c not in (*GROUP, *CONFIG, *SPEC, *DETERMINED)]
DFLASH_NOTE = (
    "Acceptance figures of `dflash` rows need a real drafter checkpoint; random drafter weights give "
    "near-zero acceptance."
)


def _label(key: str) -> str:
    return " ".join(LLAMA_CPP_LABELS[key].split())  # "Mean    KLD" -> "Mean KLD"


# (column, header, format, scale) of the drift part of each table, in llama.cpp's names.
DRIFT_COLUMNS = [
    *((c, _label(c), "{:.4g}", 1) for c in ("kl_mean", "kl_median", "kl_p99", "kl_p999", "kl_max")),
    ("rms_dp", _label("rms_dp") + " (%)", "{:.3f}", 100),
    ("top1_agree", _label("top1_agree") + " (%)", "{:.2f}", 100),
    ("ppl_base", _label("ppl_base"), "{:.4f}", 1),
    ("ppl_cand", _label("ppl_cand"), "{:.4f}", 1),
    ("ln_ppl_ratio", _label("ln_ppl_ratio"), "{:.4g}", 1),
]
# llama.cpp's "± 1 sigma" figures (evals.intervals.llama_sigma), in a table of their own.
SIGMA_COLUMNS = [c for c in DRIFT_COLUMNS if c[0] in ("kl_mean", "top1_agree", "ppl_base", "ppl_cand", "ln_ppl_ratio")]
SPEC_COLUMNS = [
    ("spec_acceptance_rate", "Acceptance rate (%)", "{:.1f}", 100),
    ("spec_acceptance_length", "Mean acceptance length", "{:.2f}", 1),
    ("spec_tokens_per_forward", "Tokens per target forward", "{:.2f}", 1),
]
# Configurations compared position by position where they scored the same positions: the one column
# in which two rows differ -> what the difference measures.
PAIRED = {"smooth_keys": "key smoothing", "backend": "backend"}


def load_rows(runs_dir: Path) -> tuple[pl.DataFrame, Path, int]:
    """The sweep rows of ``runs_dir`` (:func:`tileinfer.jobs.rows.read_sweep`), sorted for display (plain
    before speculative rows) and labelled (``config``), the folder read, and how many older rows of
    an identity were left out. Parquet files that are not sweep rows are left out.

    Raises:
        UserError: ``runs_dir`` is not a folder or holds no result rows.
    """
    df, folder, older = read_sweep(runs_dir)
    needed = [*GROUP, "quant", "prompt_set", "kl_mean"]
    if set(needed) <= set(df.columns):
        df = df.filter(pl.all_horizontal(pl.col(needed).is_not_null()))
    if df.is_empty() or not {*needed, *CONFIG} <= set(df.columns):
        raise UserError(f"no result rows under {folder} (run python -m tileinfer.sweep first)")
    # rows written before these columns existed (before speculative decoding: spec=none)
    df = df.with_columns([pl.lit(None, pl.String).alias(c) for c in (*SETUP, "corpus") if c not in df.columns])
    df = df.with_columns(pl.col(c).cast(t) if c in df.columns else pl.lit(None, t).alias(c) for c, t in SPEC.items())
    df = df.with_columns(pl.col("spec").fill_null("none"), pl.col("smooth_keys").fill_null(False))

    def order(col: str, values: list) -> pl.Expr:
        return pl.col(col).replace_strict(values, list(range(len(values))), default=len(values))

    df = df.sort(
        "model",
        *([pl.col("ctx_tokens").min().over("model", "ctx")] if "ctx_tokens" in df.columns else []),
        "ctx",
        "backend",
        "prompt_set",
        order("quant", list(NAMED)),
        "quant",
        pl.col("smooth_keys").not_(),
        "smooth_alpha",
        order("spec", list(schema.PROPOSERS)),
        *SPEC,
    )
    show_alpha = df.filter(pl.col("smooth_keys"))["smooth_alpha"].n_unique() > 1  # only when several
    labels = [config_label(q, s, a, show_alpha) for q, s, a in df.select(CONFIG).iter_rows()]
    return df.with_columns(config=pl.Series(labels, dtype=pl.String)), folder, older


def plain_rows(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per configuration and scored set, for the drift tables and plots: the plain one
    (``spec=none``), or the first speculative one where there is none (drift is scored alike: the
    proposer only runs after the scored window)."""
    return rows.unique(subset=[*GROUP, *SETUP, *CONFIG, "prompt_set", "corpus"], keep="first", maintain_order=True)


def config_label(quant: str, smooth_keys: bool, alpha, show_alpha: bool = False) -> str:
    """Readable name of a configuration: ``int8_kv (smoothed keys)``, ``int8_kv``, ``bf16``."""
    if not smooth_keys:
        return quant
    return f"{quant} (smoothed keys, α={alpha:g})" if show_alpha and alpha is not None else f"{quant} (smoothed keys)"


def _finite(value) -> bool:
    return value is not None and bool(np.isfinite(value))


def _fmt(value, pattern: str, scale: float = 1) -> str:
    return pattern.format(value * scale) if _finite(value) else "–"


def _values(df: pl.DataFrame, column: str) -> str:
    """The distinct values of ``column`` as text."""
    return ", ".join(map(str, df[column].unique(maintain_order=True)))


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)  # rows written before the column existed


def _with_interval(r: dict, column: str, pattern: str, scale: float = 1) -> str:
    """``value [lo, hi]`` where the row has the 95% interval of ``column``, else the value alone."""
    lo, hi = r.get(f"{column}_lo"), r.get(f"{column}_hi")
    text = _fmt(r.get(column), pattern, scale)
    return f"{text} [{_fmt(lo, pattern, scale)}, {_fmt(hi, pattern, scale)}]" if _finite(lo) and _finite(hi) else text


def _with_sigma(r: dict, column: str, pattern: str, scale: float = 1) -> str:
    """``value ± sigma`` (llama.cpp's one standard error) where the row has it."""
    sigma = r.get(f"{column}_sigma")
    return _fmt(r.get(column), pattern, scale) + (f" ± {_fmt(sigma, pattern, scale)}" if _finite(sigma) else "")


def _speed(value, ref) -> str:
    """``1,234 (1.76×)`` (three significant digits below 100 tok/s); without a BF16 base just ``1,234``."""
    if not _finite(value):
        return "–"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    return f"{text} ({value / ref:.2f}×)" if ref else text


def _repetition(r: dict) -> str:
    """``12%``; ``**80%, degenerate**``; ``?`` for a row written before repetition was measured."""
    if r.get("degenerate") is None:
        return "?"
    frac = _fmt(r.get("reply_repeat_frac"), "{:.0f}%", 100)
    return f"**{frac}, degenerate**" if r["degenerate"] else frac


def md_table(head: list[str], cells: list[list[str]]) -> str:
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(c) + " |" for c in cells]
    )


def drift_table(rows: pl.DataFrame) -> tuple[str, list[str]]:
    """A Markdown table with one row per configuration of one scored set (BF16 first) and the notes it
    needs (missing BF16 base, KL estimated rather than exact, the intervals' method)."""
    bf16 = rows.filter(pl.col("quant") == "bf16")
    ref = bf16.row(0, named=True) if len(bf16) else {}
    notes = [] if ref else ["no BF16 row here, so speeds are shown without ratios."]
    est = "kl_estimate" in rows.columns and rows["kl_estimate"].drop_nulls().ne("exact").any()
    rep = "degenerate" in rows.columns or "reply_repeat_frac" in rows.columns
    head = ["Config", *(h for _, h, *_ in DRIFT_COLUMNS), "Greedy agree len (tokens)", "Prefill tok/s", "Decode tok/s"]
    head += (["KL estimate"] if est else []) + (["Reply repetition"] if rep else [])
    cells = []
    for r in rows.iter_rows(named=True):
        per_item = r["n_scored"] / max(r.get("n_prompts") or 1, 1) if r.get("n_scored") else None
        greedy = _fmt(r.get("greedy_agree_len"), "{:.4g}") + (f" of {per_item:.0f}" if per_item else "")
        cells.append(
            [r["config"], *(_with_interval(r, c, f, s) for c, _, f, s in DRIFT_COLUMNS), greedy]
            + [_speed(r.get(c), ref.get(c)) for c in ("prefill_tok_s", "decode_tok_s")]
            + ([r.get("kl_estimate") or "–"] if est else [])
            + ([_repetition(r)] if rep else [])
        )
    if borrowed := [
        f"{c} (spec={s})" for c, s in rows.filter(pl.col("spec") != "none").select("config", "spec").rows()
    ]:
        notes.append(
            f"no plain (spec=none) row of {', '.join(borrowed)}: its drift and decode speed are those of its "
            "speculative row (drift is scored alike; its plain decode was timed in that job)."
        )
    if "ci_unit" in rows.columns and rows["ci_unit"].is_not_null().any():
        units = ", ".join(
            f"{u} ({n})" for u, n in rows.select("ci_unit", "ci_units").unique(maintain_order=True).rows()
        )
        notes.append(
            "[lo, hi]: 95% intervals; Same top p by Wilson's score interval, the KL statistics and "
            f"ln(PPL(Q)/PPL(base)) by the BCa bootstrap over the scored set's units ({units}: unit, and "
            "how many resampled; a block is a run of consecutive positions, evals/intervals.py)."
        )
    if est:
        notes.append(
            "some KL values are estimates (see the KL estimate column), not exact sums over the vocabulary: "
            "topkK+tail is the KL of the distributions coarsened to the base's top K tokens plus the rest, "
            "a lower bound of the exact KL (how much lower: docs/rows.md)."
        )
    return md_table(head, cells), notes


def sigma_table(rows: pl.DataFrame) -> str | None:
    """llama.cpp's ``value ± 1 sigma`` figures of each configuration, or None for rows without them."""
    if "kl_mean_sigma" not in rows.columns or rows["kl_mean_sigma"].is_null().all():
        return None
    head = ["Config", *(f"{h} ± 1σ" for _, h, *_ in SIGMA_COLUMNS)]
    cells = [
        [r["config"], *(_with_sigma(r, c, f, s) for c, _, f, s in SIGMA_COLUMNS)] for r in rows.iter_rows(named=True)
    ]
    return md_table(head, cells)


def _positions(r: dict) -> pl.DataFrame | None:
    """The per-position table of a row (``group`` 0 throughout for files written before it was saved),
    or None without a readable positions file."""
    try:
        p = pl.read_parquet(positions_path(r["row_file"])).sort("position")
    except Exception:  # noqa: BLE001 - missing or damaged: the plot or pair is left out, with a note
        return None
    return p if "group" in p.columns else p.with_columns(group=pl.lit(0))


def paired_table(rows: pl.DataFrame) -> str | None:
    """Mean KL differences, with 95% intervals (:func:`evals.intervals.paired_difference`), of rows that
    scored the same positions and differ in one column of :data:`PAIRED` only: what key smoothing buys,
    what a backend changes. None when no such pair exists."""
    fixed = [c for c in (*identity.CONFIG, *identity.SCORING, "n_scored") if c in rows.columns and c not in PAIRED]
    cells = []
    for column, what in PAIRED.items():
        free = (
            {column, "smooth_alpha", "calibration_tokens", "calibration_sha256"}
            if column == "smooth_keys"
            else {column}
        )
        for _, pair in rows.group_by([c for c in fixed if c not in free], maintain_order=True):
            if len(pair) != 2 or pair[column].n_unique() != 2:
                continue
            a, b = pair.sort(column, descending=True).iter_rows(named=True)
            pa, pb = _positions(a), _positions(b)
            if pa is None or pb is None or len(pa) != len(pb):
                continue
            d, lo, hi = paired_difference(pa["kl"].to_numpy(), pb["kl"].to_numpy(), pa["group"].to_numpy())
            relative = f"{d / b['kl_mean']:+.0%}" if b["kl_mean"] else "–"
            where = f"{a['model']}, ctx {a['ctx']}, {a['prompt_set']}"
            ab = [f"{r['config']}, {r['backend']}" for r in (a, b)]
            cells.append([what, where, *ab, f"{d:.4g} [{lo:.4g}, {hi:.4g}]", relative])
    head = ["change", "where", "A", "B", "Mean KLD A − B [95%]", "relative to B"]
    return md_table(head, cells) if cells else None


def _plot(path: Path, title: str, xlabel: str, ylabel: str, draw, figsize=(8, 4.8)) -> None:
    """Draw with ``draw(ax)``, label, and write the figure as PNG to ``path`` atomically (rendered in
    memory: :func:`tileinfer.core.files.write_bytes` makes OS failures one-line errors)."""
    fig, ax = plt.subplots(figsize=figsize)
    try:
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    files.write_bytes(path, buf.getvalue())


def _colors(keys) -> dict:
    """One color per key (configuration, proposer), in order, shared by a section's plots."""
    cmap = plt.get_cmap("tab10")
    return {k: cmap(i % 10) for i, k in enumerate(dict.fromkeys(keys))}


def scatter_plot(group: pl.DataFrame, title: str, colors: dict, path: Path) -> list[str]:
    """Mean KL against decode speed of one section: a marker per row (color = configuration, shape =
    scored set) with its 95% interval, each BF16 row a vertical line at its decode speed (its KL is
    0, which a log axis cannot show). Returns notes on rows that could not be drawn."""
    notes, markers = [], dict(zip(dict.fromkeys(group["prompt_set"]), "osD^vP*X"))
    quantized = group.filter(pl.col("quant") != "bf16")

    def draw(ax):
        styles = ["--", ":", "-.", (0, (6, 2, 1, 2))] * 4
        bf16 = group.filter(pl.col("quant") == "bf16").select("prompt_set", "decode_tok_s").rows()
        for (ps, speed), ls in zip(bf16, styles):
            if _finite(speed):
                ax.axvline(speed, color="0.35", ls=ls, lw=1.2, label=f"bf16 (KL = 0), {ps}")
        plotted = 0
        for r in quantized.iter_rows(named=True):
            lab, speed, kl = r["config"], r.get("decode_tok_s"), r.get("kl_mean")
            if not _finite(speed) or not _finite(kl) or kl <= 0:
                notes.append(
                    f"{lab} / {r['prompt_set']}: decode speed {speed}, mean KL {kl}: not plotted on a log axis."
                )
                continue
            plotted += 1
            lo, hi = r.get("kl_mean_lo"), r.get("kl_mean_hi")
            if _finite(lo) and _finite(hi):
                ax.errorbar(speed, kl, yerr=[[kl - lo], [hi - kl]], fmt="none", ecolor=colors[lab], capsize=3)
            ax.scatter(
                speed, kl, color=colors[lab], marker=markers[r["prompt_set"]], s=60, edgecolors="black", zorder=3
            )
        for lab in dict.fromkeys(quantized["config"]):
            ax.scatter([], [], color=colors[lab], marker="s", label=lab)
        for ps, m in markers.items():
            ax.scatter([], [], color="white", edgecolors="black", marker=m, label=ps)
        if not plotted:  # only BF16 lines: a log axis needs positive limits to draw them
            ax.set_ylim(1e-6, 1.0)
        ax.set_yscale("log", nonpositive="clip")  # an interval reaching 0 is cut at the axis

    ylabel = "mean KL(BF16 ‖ config) (nats, log scale; bars: 95% interval)"
    _plot(path, f"Accuracy vs. speed — {title}", "decode speed (tokens/s, higher is better)", ylabel, draw)
    return notes


def _rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Centered rolling mean; near the ends the window is cut short (no padding)."""
    c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
    i = np.arange(len(x))
    lo, hi = np.maximum(i - window // 2, 0), np.minimum(i + (window + 1) // 2, len(x))
    return (c[hi] - c[lo]) / (hi - lo)


def position_plot(rows: pl.DataFrame, title: str, colors: dict, path: Path) -> tuple[bool, list[str]]:
    """KL per position along the scored window of each configuration of one scored set (raw values
    faint, a rolling mean bold). BF16 rows are drawn only where their KL is not 0 (a fast backend's
    kernel drift). Returns whether a figure was written and notes on skipped configurations."""
    notes, lines = [], []
    for r in rows.filter((pl.col("quant") != "bf16") | (pl.col("kl_mean") > 0)).iter_rows(named=True):
        p = _positions(r)
        if p is None:
            notes.append(
                f"{r['config']}: no readable positions file ({positions_path(r['row_file']).name}), line skipped."
            )
        else:
            lines.append((r["config"], p["position"].to_numpy(), p["kl"].to_numpy().astype(np.float64)))
    if not lines:
        return False, notes
    window = max(8, max(len(x) for _, x, _ in lines) // 16)

    def draw(ax):
        lowest = []
        for lab, x, kl in lines:
            smooth = _rolling_mean(kl, window)
            ax.plot(x, kl, color=colors[lab], lw=0.6, alpha=0.25)
            ax.plot(x, smooth, color=colors[lab], lw=2, label=lab)
            lowest += [v for v in (smooth[smooth > 0].min(initial=np.inf),) if np.isfinite(v)]
        ax.plot([], [], color="0.5", lw=0.6, alpha=0.5, label="raw, per position")
        ax.set_yscale("log")
        if lowest:  # raw dips far below the trend would squash it; cut them off 1.5 decades below
            ax.set_ylim(bottom=min(lowest) / 30)

    xlabel = "position in the scored window (tokens after the prompt" + (
        "; all items, concatenated)" if rows["n_prompts"].max() > 1 else ")"
    )
    title = f"KL along the scored window — {title}\n(bold: rolling mean over {window} positions)"
    _plot(path, title, xlabel, "KL(BF16 ‖ config) (nats, log scale)", draw, figsize=(9, 4.8))
    return True, notes


def exact_cell(r: dict) -> str:
    """Whether a greedy speculative reply equals the plain one (:func:`evals.verdicts.spec_outcome`):
    ``yes``; ``no at step 12, margin 0.031: near-tie``; ``**no at step 3, margin 4.2: MISMATCH**``;
    ``– (sampled)`` when verification samples; ``–`` for a plain row."""
    outcome = spec_outcome(r)
    if outcome in (None, "yes"):
        return "–" if r["spec"] == "none" else "yes" if outcome else "– (sampled)" if r.get("spec_temperature") else "?"
    step, margin = r.get("spec_first_mismatch"), _fmt(r.get("spec_mismatch_margin"), "{:.3g}")
    at = "no" + (f" at step {step}" if step is not None else "")
    return f"{at}, margin {margin}: near-tie" if outcome == "tie" else f"**{at}, margin {margin}: MISMATCH**"


def _spec_label(r: dict) -> str:
    """``ngram/int8_kv/k=4 (min_n=5,max_n=5), T=0.7``: a speculative row's name in tables and plots."""
    if r["spec"] == "none":
        return "none (plain)"
    settings = f" ({r['spec_settings']})" if r.get("spec_settings") else ""
    return f"{r['spec']} {r['config']}/k={_or_unknown(r['spec_k'])}{settings}" + (
        f", T={r['spec_temperature']:g}" if r.get("spec_temperature") else ""
    )


def spec_section(group: pl.DataFrame, title: str, slug: str, out_dir: Path) -> list[str]:
    """The Markdown lines of one section's speculative decoding part (a table per scored set, then the
    speed-up and acceptance plots, written into ``out_dir``); none when no row speculates."""
    speculative = group.filter(pl.col("spec") != "none")
    if speculative.is_empty():
        return []
    margins = ", ".join(f"{d} {m:g}" for d, m in SPEC_TIE_MARGIN.items())
    md = [
        "",
        "### Speculative decoding",
        "",
        "The timed decode steps after the prompt, decoded speculatively and plainly in the same job: the "
        "speed-up is speculative over plain decode tok/s of that row. Acceptance rate is accepted over drafted "
        "tokens; mean acceptance length is 1 + accepted/drafts (vLLM's); tokens per target forward is new tokens "
        "over forwards of the target; draft and verify ms are per target step. Exact: whether the greedy "
        "speculative reply equals the plain one, else the first step where it differs and the target's top-1 "
        f"minus top-2 logit there (up to the near-tie margin of the dtype, {margins} logits: rounding between the "
        "verify and the decode path; above: a MISMATCH, a bug).",
    ]
    head = ["Config", "Proposer", "k", *(h for _, h, *_ in SPEC_COLUMNS), "Plain decode tok/s", "Speculative tok/s"]
    head += ["Speed-up (×)", "Draft ms/step", "Verify ms/step", "Exact (greedy reply = plain)"]
    for (prompt_set,), rs in group.group_by("prompt_set", maintain_order=True):
        if rs["spec"].eq("none").all():
            continue
        cells = [
            [r["config"], _spec_label(r), "–" if r["spec"] == "none" else _or_unknown(r.get("spec_k"))]
            + [_fmt(r.get(c), f, s) for c, _, f, s in SPEC_COLUMNS]
            + [_speed(r.get("decode_tok_s"), None), _speed(r.get("spec_decode_tok_s"), None)]
            + ["1 (plain)" if r["spec"] == "none" else _fmt(r.get("spec_speedup"), "{:.2f}")]
            + [_fmt(r.get("spec_draft_ms"), "{:.3g}"), _fmt(r.get("spec_verify_ms"), "{:.3g}"), exact_cell(r)]
            for r in rs.iter_rows(named=True)
        ]
        md += ["", f"#### `{prompt_set}` (speculative decoding)", "", md_table(head, cells)]
        if rs["spec_temperature"].gt(0).any():
            md.append(
                "\nNote: rows with T > 0 verify by rejection sampling: their reply is not the greedy one, so it is "
                "not compared (exact –), and their acceptance depends on the seed."
            )
    md += ["", f"Note: {DFLASH_NOTE}"]
    colors = _colors(speculative["spec"])
    named = [
        (r, _spec_label(r) + (f", {r['prompt_set']}" if group["prompt_set"].n_unique() > 1 else ""))
        for r in speculative.iter_rows(named=True)
    ]
    points = [
        (r, lab) for r, lab in named if _finite(r.get("spec_acceptance_length")) and _finite(r.get("spec_speedup"))
    ]
    curves = [(r, lab) for r, lab in named if any(_finite(v) for v in r.get("spec_acceptance_at") or [])]
    md += [
        f"\nNote: {lab}: no speed-up or acceptance figures, not plotted." for r, lab in named if (r, lab) not in points
    ]

    def speedup(ax):
        ax.axhline(1.0, color="0.35", ls="--", lw=1.2, label="plain decoding (1×)")
        for r, lab in points:
            x, y = r["spec_acceptance_length"], r["spec_speedup"]
            ax.scatter(x, y, color=colors[r["spec"]], s=60, edgecolors="black", zorder=3, label=lab)

    def acceptance(ax):
        for r, lab in curves:
            at = np.array([np.nan if v is None else v for v in r["spec_acceptance_at"]], dtype=np.float64)
            ax.plot(np.arange(1, len(at) + 1), at, color=colors[r["spec"]], marker="o", lw=1.5, ms=5, label=lab)
        ax.set_ylim(-0.02, 1.02)

    for what, rows_, draw, xlabel, ylabel in (
        ("speedup", points, speedup, "mean acceptance length (1 + accepted/drafts)", "speed-up (speculative / plain)"),
        ("acceptance", curves, acceptance, "position in the draft (1: first drafted token)", "acceptance rate there"),
    ):
        if rows_:
            path = out_dir / f"spec_{what}-{slug}.png"
            _plot(path, f"Speculative decoding {what} — {title}", xlabel, ylabel, draw)
            md += ["", f"![speculative decoding {what}, {title}]({path.name})"]
    return md


def _slug(parts: list, rest: list) -> str:
    """A file name part: the readable ``parts`` and a short hash of the ``rest`` of a section's setup."""
    readable = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", str(p)) for p in parts)
    return f"{readable}-{hashlib.sha256(repr(rest).encode()).hexdigest()[:6]}" if rest else readable


def render(runs_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the report of the rows under ``runs_dir`` into ``out_dir`` (default ``runs_dir/report``):
    summary table, PNG plots, then ``report.md``. Returns the path of ``report.md``.

    Raises:
        UserError: no rows.
    """
    runs_dir = Path(runs_dir)
    out_dir = Path(out_dir) if out_dir else runs_dir / "report"
    rows, folder, older = load_rows(runs_dir)
    files.make_dir(out_dir)
    (out_dir / "report.md").unlink(missing_ok=True)  # never an old report beside new plots
    tables.write_summary(rows.drop("row_file", "config"), out_dir)
    print(f"report: {len(rows)} result rows from {folder}" + (f" ({older} older left out)" if older else ""))
    plain = plain_rows(rows)
    md = [
        f"# tileinfer report: {runs_dir}",
        "",
        f"{len(rows)} result rows from `{folder}`, generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. "
        "All rows: [summary.md](summary.md) / `summary.parquet`.",
        "",
        "Drift statistics are those of llama.cpp's `perplexity --kl-divergence`, under its names: "
        "KL(base ‖ config) in nats over the scored positions, RMS Δp and Same top p in percent. Greedy agree len "
        "is how many leading reply tokens the configuration reproduces greedily (mean over items, of the "
        "window length). **Scored sets are not averaged together**: each gets its own table, every number is "
        "exactly the sweep's row. Speeds are tokens/s with the ratio to the BF16 row of the same table in "
        "parentheses (above 1.00× is faster). Reply repetition is the share of the scored reply that continues "
        f"a 4-gram seen earlier in it; above {DEGENERATE_REPEAT:.0%} the window is degenerate (trivially "
        "predictable, so KL understates the drift); ? marks rows written before it was measured.",
    ]
    warnings = [tables.degenerate_note(plain)]
    if mismatches := [
        "/".join(map(str, (r["model"], r["config"], r["ctx"], r["prompt_set"], r["backend"], r["spec"])))
        for r in rows.iter_rows(named=True)
        if exact_cell(r).endswith("MISMATCH**")
    ]:
        warnings.append(
            f"{len(mismatches)} speculative row(s) left the plain greedy reply beyond a near-tie "
            f"(MISMATCH): {', '.join(mismatches)}"
        )
    for w in filter(None, warnings):
        print(f"warning: {w}")
        md += ["", f"**Warning:** {w}"]
    if older:
        md += ["", f"Note: {older} older row(s) of a configuration that has a newer row were left out."]
    varying = [c for c in SETUP if rows[c].n_unique() > 1]
    several_backends = rows["backend"].n_unique() > 1
    for (model, ctx, backend, *setup), every in rows.group_by([*GROUP, *varying], maintain_order=True):
        group = plain_rows(every)
        title = f"{model}, ctx {ctx}" + (f", backend {backend}" if several_backends else "")
        title += "".join(f", {c} {_or_unknown(v)}" for c, v in zip(varying, setup))
        slug = _slug([model, ctx, backend], setup)
        md += [
            "",
            f"## {title}",
            "",
            f"Model `{model}`, ctx {ctx} ({_values(group, 'ctx_tokens')} prompt tokens), backend `{backend}`, "
            f"device {_values(group, 'device')}.",
        ]
        colors = _colors(group["config"])
        for (prompt_set, corpus), rs in group.group_by("prompt_set", "corpus", maintain_order=True):
            table, notes = drift_table(rs)
            if corpus is not None:
                source = f"`{corpus}`, " if corpus != prompt_set else ""
                kind = f"Corpus `{prompt_set}` ({source}{rs['n_windows'].max()} window(s)"
            else:
                kind = f"Prompt set `{prompt_set}` ({rs['n_prompts'].max()} prompt(s)"
            md += [
                "",
                f"### {kind}, {rs['n_scored'].max()} scored positions)",
                "",
                table,
                *(f"\nNote: {t}" for t in notes),
            ]
            if (degenerate := tables.degenerate_note(rs)) is not None:
                md += ["", f"**Warning:** {degenerate}"]
            if sigma := sigma_table(rs):
                md += ["", f"#### llama.cpp's ± 1σ figures, {prompt_set}", ""]
                md += [
                    "Positions taken as independent, as llama.cpp does: narrower than the intervals above.",
                    "",
                    sigma,
                ]
        scatter = out_dir / f"scatter-{slug}.png"
        notes = scatter_plot(group, title, colors, scatter)
        md += ["", f"![mean KL against decode speed, {title}]({scatter.name})", *(f"\nNote: {t}" for t in notes)]
        for (prompt_set,), rs in group.group_by("prompt_set", maintain_order=True):
            fig = out_dir / f"kl_by_position-{slug}-{re.sub(r'[^A-Za-z0-9.]+', '_', prompt_set)}.png"
            written, notes = position_plot(rs, f"{title}, {prompt_set}", colors, fig)
            if written:
                md += ["", f"![KL per position, {title}, {prompt_set}]({fig.name})"]
            md += [f"\nNote: {t}" for t in notes]
        md += spec_section(every, title, slug, out_dir)
    if paired := paired_table(plain):
        md += [
            "",
            "## Paired differences",
            "",
            "Configurations that scored the same positions and differ in one setting, compared position by "
            "position (the shared variation cancels; 95% BCa interval over the same units as the rows'):",
            "",
            paired,
        ]
    report = out_dir / "report.md"
    files.write_text(report, "\n".join(md) + "\n")
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="tileinfer.report", description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path, help="runs folder of the sweep (its rows/ are read)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: RUNS_DIR/report)")
    args = ap.parse_args(argv)
    with exit_on_error("tileinfer.report"):
        print(f"wrote {render(args.runs_dir, args.out)}")


if __name__ == "__main__":
    main()
