"""Accuracy-versus-speed report of a sweep: one Markdown file with tables and plots.

    python -m tileinfer.report runs/                  # writes runs/report/
    python -m tileinfer.report runs/ --out /tmp/rep

Reads the sweep's result rows of RUNS_DIR (the Parquet rows of ``python -m tileinfer.sweep`` under
``RUNS_DIR/rows/``, not the gate's runs; one per row identity, the newest:
:func:`tileinfer.jobs.tables.sweep_rows`) and writes into the output folder:

- ``summary.parquet`` / ``summary.md``: all rows as one table (:func:`tileinfer.jobs.tables.write_summary`);
- ``scatter-*.png``: mean KL (log scale) against decode speed, one plot per (model, ctx, backend);
- ``kl_by_position-*.png``: KL along the scored window, one plot per (model, ctx, backend, prompt set);
- ``report.md``: one section per (model, ctx, backend) with one table per prompt set (prompt sets
  are never averaged together), the drift columns under llama.cpp's ``--kl-divergence`` names and
  prefill/decode speed as a ratio to the BF16 row; the plots are linked from it. Rows whose scored
  window is degenerate (the reply mostly repeats itself, so KL is understated) are named in a warning
  and marked in a column; rows written before repetition was measured show ``?`` there.
  Rows with speculative decoding (``spec`` other than ``none``) score the same drift as plain ones:
  these tables show each configuration's plain row (``spec=none``; a speculative row where there is none);
- a "Speculative decoding" part in each section that has speculative rows: one table per prompt set with
  one line per (config, proposer and its settings) beside the plain rows, the first step where a greedy
  speculative reply left the plain one and the target's logit margin there, and two plots:
  ``spec_speedup-*.png`` (speed-up against mean acceptance length) and ``spec_acceptance-*.png``
  (acceptance rate along the draft).

Every file is written to a temporary name first and then renamed, and ``report.md`` comes last, so
an interrupted report never leaves a half-written file under a final name.
"""

from __future__ import annotations

import argparse
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
from tileinfer.core import files  # noqa: E402
from tileinfer.core.errors import UserError, exit_on_user_error  # noqa: E402
from tileinfer.jobs import identity, schema, tables  # noqa: E402

GROUP = ["model", "ctx", "backend"]  # one report section each...
CONFIG = ["quant", "smooth_keys", "smooth_alpha"]  # ...with one table row each (per prompt set)...
# ...and, in the speculative decoding tables, one line per proposer and its settings beside it...
SPEC = {"spec": pl.String, "spec_k": pl.Int64, "spec_settings": pl.String, "spec_temperature": pl.Float64}
# ...and one section per setup: rows that differ in any other identity column (tileinfer.jobs.identity:
# scoring window, base, runner settings, timing, machine) are not comparable; the columns that vary
# are named in the section title. Left out: columns the ones above determine.
DETERMINED = (
    "prompt_set",
    "prompts_sha256",
    "corpus",
    "model_sha256",
    "weights",
    "kv_cache",
    "calibration_tokens",
    "calibration_sha256",
    "ctx_tokens",
)
SETUP = [c for c in identity.IDENTITY if c not in (*GROUP, *CONFIG, *SPEC, *DETERMINED)]
QUANT_ORDER = ["bf16", "int8_weights", "int8_kv", "int8_both"]
SPEC_ORDER = ["none", "ngram", "draft", "dflash"]
DFLASH_NOTE = (
    "Acceptance figures of `dflash` rows need a real drafter checkpoint; random drafter weights give "
    "near-zero acceptance."
)
REPETITION = {"reply_repeat_frac", "degenerate"}  # row columns of the scored reply's repetition


def _label(key: str) -> str:
    return " ".join(LLAMA_CPP_LABELS[key].split())  # "Mean    KLD" -> "Mean KLD"


# (column, header, formatter) of the drift part of each table, in llama.cpp's names.
DRIFT_COLUMNS = [
    ("kl_mean", _label("kl_mean"), "{:.4g}"),
    ("kl_median", _label("kl_median"), "{:.4g}"),
    ("kl_p99", _label("kl_p99"), "{:.4g}"),
    ("kl_p999", _label("kl_p999"), "{:.4g}"),
    ("kl_max", _label("kl_max"), "{:.4g}"),
    ("rms_dp", _label("rms_dp") + " (%)", "{:.3f}", 100),
    ("top1_agree", _label("top1_agree") + " (%)", "{:.2f}", 100),
    ("ppl_base", _label("ppl_base"), "{:.4f}"),
    ("ppl_cand", _label("ppl_cand"), "{:.4f}"),
    ("ln_ppl_ratio", _label("ln_ppl_ratio"), "{:.4g}"),
]
# llama.cpp's "± 1 sigma" figures (evals.intervals.llama_sigma), shown in a table of their own.
SIGMA_COLUMNS = [
    ("kl_mean", _label("kl_mean"), "{:.4g}"),
    ("top1_agree", _label("top1_agree") + " (%)", "{:.2f}", 100),
    ("ppl_base", _label("ppl_base"), "{:.4f}"),
    ("ppl_cand", _label("ppl_cand"), "{:.4f}"),
    ("ln_ppl_ratio", _label("ln_ppl_ratio"), "{:.4g}"),
]
# Configurations compared position by position where they scored the same positions: the one column
# in which two rows differ -> what the difference measures.
PAIRED = {"smooth_keys": "key smoothing", "backend": "backend"}


def load_rows(runs_dir: Path) -> tuple[pl.DataFrame, Path, int]:
    """The sweep rows of ``runs_dir`` (:func:`tables.sweep_rows`: under ``runs_dir/rows``, once per row
    identity), with the row's file in an extra column ``row_file`` so its positions file can be
    found; the folder read; how many duplicate rows were dropped. Parquet files that are not sweep
    rows (no model, quant, ctx, backend, prompt set or mean KL) are left out.

    Raises:
        UserError: ``runs_dir`` is not a folder or holds no result rows.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"{runs_dir} is not a folder")
    df, rows_dir, duplicates = tables.sweep_rows(runs_dir)
    needed = [*GROUP, "quant", "prompt_set", "kl_mean"]
    if set(needed) <= set(df.columns):
        df = df.filter(pl.all_horizontal(pl.col(needed).is_not_null()))
    if df.is_empty() or not {*needed, *CONFIG} <= set(df.columns):
        raise UserError(f"no result rows under {rows_dir} (run python -m tileinfer.sweep first)")
    # rows written before these columns existed (before speculative decoding: spec=none)
    df = df.with_columns([pl.lit(None, pl.String).alias(c) for c in (*SETUP, "corpus") if c not in df.columns])
    df = df.with_columns(pl.col(c).cast(t) if c in df.columns else pl.lit(None, t).alias(c) for c, t in SPEC.items())
    df = df.with_columns(pl.col("spec").fill_null("none"))
    return df, rows_dir, duplicates


def latest_rows(df: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """The newest row of each (group, config, speculation, prompt set), sorted for display (plain
    before speculative rows) and labelled in a column ``config`` (:func:`config_label`), and how many
    older rows of the same key were dropped (e.g. an earlier run with another n_score)."""
    key = [*GROUP, *SETUP, *CONFIG, *SPEC, "prompt_set", "corpus"]  # two corpus files may share a name
    df = df.with_columns(pl.col("smooth_keys").fill_null(False))
    if "finished_at" in df.columns:
        df = df.sort("finished_at", nulls_last=False)
    newest = df.unique(subset=key, keep="last", maintain_order=True)
    order = pl.col("quant").replace_strict(QUANT_ORDER, list(range(len(QUANT_ORDER))), default=len(QUANT_ORDER))
    ctx_size = [pl.col("ctx_tokens").min().over("model", "ctx")] if "ctx_tokens" in df.columns else []
    newest = newest.sort(
        [
            "model",
            *ctx_size,
            "ctx",
            "backend",
            "prompt_set",
            order,
            "quant",
            pl.col("smooth_keys").not_(),
            "smooth_alpha",
            pl.col("spec").replace_strict(SPEC_ORDER, list(range(len(SPEC_ORDER))), default=len(SPEC_ORDER)),
            *SPEC,
        ]
    )
    # Name α only when smoothed rows with several α are present.
    show_alpha = newest.filter(pl.col("smooth_keys"))["smooth_alpha"].n_unique() > 1
    labels = [config_label(q, s, a, show_alpha) for q, s, a in newest.select(CONFIG).iter_rows()]
    return newest.with_columns(config=pl.Series(labels, dtype=pl.String)), len(df) - len(newest)


def plain_rows(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per (group, config, prompt set) of :func:`latest_rows`, for the drift tables and plots:
    the plain one (``spec=none``), or the first speculative one where there is no plain row (drift is
    scored alike: the proposer only runs after the scored window)."""
    return rows.unique(subset=[*GROUP, *SETUP, *CONFIG, "prompt_set", "corpus"], keep="first", maintain_order=True)


def config_label(quant: str, smooth_keys: bool, alpha, show_alpha: bool = False) -> str:
    """Readable name of a configuration: ``int8_kv (smoothed keys)``, ``int8_kv``, ``bf16``."""
    if not smooth_keys:
        return quant
    return f"{quant} (smoothed keys, α={alpha:g})" if show_alpha and alpha is not None else f"{quant} (smoothed keys)"


def _values(df: pl.DataFrame, column: str) -> str:
    """The distinct values of ``column`` as text ("?" when the column is absent)."""
    return ", ".join(map(str, df[column].unique(maintain_order=True))) if column in df.columns else "?"


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)  # rows written before the column existed


def _slug(*parts) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9._]+", "_", str(p)) for p in parts)


def _fmt(value, pattern: str, scale: float = 1) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "–"
    return pattern.format(value * scale)


def _with_interval(r: dict, column: str, pattern: str, scale: float = 1) -> str:
    """``value [lo, hi]`` where the row has the 95% interval of ``column``, else the value alone."""
    text = _fmt(r.get(column), pattern, scale)
    lo, hi = r.get(f"{column}_lo"), r.get(f"{column}_hi")
    if not (_finite(lo) and _finite(hi)):
        return text
    return f"{text} [{_fmt(lo, pattern, scale)}, {_fmt(hi, pattern, scale)}]"


def _with_sigma(r: dict, column: str, pattern: str, scale: float = 1) -> str:
    """``value ± sigma`` (llama.cpp's one standard error) where the row has it."""
    sigma = r.get(f"{column}_sigma")
    return _fmt(r.get(column), pattern, scale) + (f" ± {_fmt(sigma, pattern, scale)}" if _finite(sigma) else "")


def _speed(value, ref) -> str:
    """``1,234 (1.76×)`` (three significant digits below 100 tok/s); without a BF16 base
    just ``1,234``."""
    if value is None:
        return "–"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    return f"{text} ({value / ref:.2f}×)" if ref else text


def _repetition(r: dict) -> str:
    """``12%``; ``**80%, degenerate**``; ``?`` for a row written before repetition was measured."""
    if r.get("degenerate") is None:
        return "?"
    frac = _fmt(r.get("reply_repeat_frac"), "{:.0f}%", 100)
    return f"**{frac}, degenerate**" if r["degenerate"] else frac


def markdown_table(rows: pl.DataFrame) -> tuple[str, list[str]]:
    """A Markdown table with one row per configuration of one prompt set (BF16 first) and the
    notes it needs (missing BF16 base, KL estimated rather than exact)."""
    notes = []
    bf16 = rows.filter(pl.col("quant") == "bf16")
    ref = bf16.row(0, named=True) if len(bf16) else {}
    if not ref:
        notes.append("no BF16 row here, so speeds are shown without ratios.")
    est = "kl_estimate" in rows.columns and rows["kl_estimate"].drop_nulls().ne("exact").any()
    rep = bool(REPETITION & set(rows.columns))
    head = (
        ["Config"]
        + [h for _, h, *_ in DRIFT_COLUMNS]
        + ["Greedy agree len (tokens)", "Prefill tok/s", "Decode tok/s"]
        + (["KL estimate"] if est else [])
        + (["Reply repetition"] if rep else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.iter_rows(named=True):
        per_prompt = r["n_scored"] / max(r.get("n_prompts") or 1, 1) if r.get("n_scored") else None
        greedy = _fmt(r.get("greedy_agree_len"), "{:.4g}") + (f" of {per_prompt:.0f}" if per_prompt else "")
        cells = (
            [r["config"]]
            + [_with_interval(r, c, f, *s) for c, _, f, *s in DRIFT_COLUMNS]
            + [
                greedy,
                _speed(r.get("prefill_tok_s"), ref.get("prefill_tok_s")),
                _speed(r.get("decode_tok_s"), ref.get("decode_tok_s")),
            ]
            + ([r.get("kl_estimate") or "–"] if est else [])
            + ([_repetition(r)] if rep else [])
        )
        lines.append("| " + " | ".join(cells) + " |")
    if "spec" in rows.columns:
        speculative = rows.filter(pl.col("spec") != "none").select("config", "spec").iter_rows()
        if borrowed := [f"{c} (spec={s})" for c, s in speculative]:
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
            f"ln(PPL(Q)/PPL(base)) by the BCa bootstrap over {units} (evals/intervals.py)."
        )
    if est:
        notes.append(
            "some KL values are estimates (see the KL estimate column), not exact sums over the vocabulary: "
            "topkK+tail is the KL of the distributions coarsened to the base's top K tokens plus the rest, "
            "a lower bound of the exact KL (measured on SmolLM2 INT8 weights: mean KL 9.6% low at K=64, "
            "4.8% at K=256; 99.9% KL 2.7% low at K=64; tests/test_base_logits.py)."
        )
    return "\n".join(lines), notes


def sigma_table(rows: pl.DataFrame) -> str | None:
    """llama.cpp's ``value ± 1 sigma`` figures of each configuration (positions taken as independent), or
    None for rows without them."""
    if "kl_mean_sigma" not in rows.columns or rows["kl_mean_sigma"].is_null().all():
        return None
    head = ["Config"] + [f"{h} ± 1σ" for _, h, *_ in SIGMA_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.iter_rows(named=True):
        lines.append(
            "| " + " | ".join([r["config"]] + [_with_sigma(r, c, f, *s) for c, _, f, *s in SIGMA_COLUMNS]) + " |"
        )
    return "\n".join(lines)


def _positions(r: dict) -> pl.DataFrame | None:
    """The per-position KL and window or prompt of a row (``group`` 0 throughout for files written before
    it was saved), or None without a positions file."""
    f = Path(r["row_file"]).with_suffix(".positions.parquet")
    if not f.is_file():
        return None
    p = pl.read_parquet(f).sort("position")
    return p if "group" in p.columns else p.with_columns(group=pl.lit(0))


def paired_table(rows: pl.DataFrame) -> str | None:
    """Mean KL differences, with 95% intervals (:func:`evals.intervals.paired_difference`), of rows that
    scored the same positions (same prompt set or corpus, base, prompts, count) and differ in one column of
    :data:`PAIRED` only: what key smoothing buys, what a backend changes. None when no such pair exists."""
    fixed = [c for c in (*identity.CONFIG, *identity.SCORING, "n_scored") if c in rows.columns and c not in PAIRED]
    lines = []
    for column, what in PAIRED.items():
        free = (
            {column, "smooth_alpha", "calibration_tokens", "calibration_sha256"}
            if column == "smooth_keys"
            else {column}
        )
        key = [c for c in fixed if c not in free]
        for _, pair in rows.group_by(key, maintain_order=True):
            if len(pair) != 2 or pair[column].n_unique() != 2:
                continue
            a, b = pair.sort(column, descending=True).iter_rows(named=True)
            pa, pb = _positions(a), _positions(b)
            if pa is None or pb is None or len(pa) != len(pb):
                continue
            d, lo, hi = paired_difference(pa["kl"].to_numpy(), pb["kl"].to_numpy(), pa["group"].to_numpy())
            relative = f"{d / b['kl_mean']:+.0%}" if b["kl_mean"] else "–"
            lines.append(
                f"| {what} | {a['model']}, ctx {a['ctx']}, {a['prompt_set']} | {a['config']}, {a['backend']} | "
                f"{b['config']}, {b['backend']} | {d:.4g} [{lo:.4g}, {hi:.4g}] | {relative} |"
            )
    if not lines:
        return None
    head = "| change | where | A | B | Mean KLD A − B [95%] | relative to B |\n|---|---|---|---|---|---|"
    return head + "\n" + "\n".join(lines)


def _save(fig, path: Path) -> None:
    """Write ``fig`` as PNG to ``path`` atomically and close it (rendered in memory: the file is
    written by :func:`tileinfer.core.files.write_bytes`, whose OS failures are one-line errors)."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    files.write_bytes(path, buf.getvalue())


def _colors(group: pl.DataFrame) -> dict[str, tuple]:
    """One color per configuration of a group, in table order, shared by all of its plots."""
    cmap = plt.get_cmap("tab10")
    return {lab: cmap(i % 10) for i, lab in enumerate(dict.fromkeys(group["config"]))}


def scatter_plot(group: pl.DataFrame, title: str, colors: dict, path: Path) -> list[str]:
    """Write the mean-KL-against-decode-speed scatter of one group to ``path``: one marker per row
    (color = configuration, shape = prompt set) and each BF16 row as a vertical line at its decode
    speed (its KL is 0, which a log axis cannot show). Returns notes on rows that could not be drawn."""
    notes, plotted = [], 0
    fig, ax = plt.subplots(figsize=(8, 4.8))
    markers = dict(zip(dict.fromkeys(group["prompt_set"]), "osD^vP*X"))
    bf16 = dict(group.filter(pl.col("quant") == "bf16").select("prompt_set", "decode_tok_s").iter_rows())
    for (ps, speed), ls in zip(bf16.items(), ["--", ":", "-.", (0, (6, 2, 1, 2))] * 4):
        if speed:
            ax.axvline(speed, color="0.35", ls=ls, lw=1.2, label=f"bf16 (KL = 0), prompt set {ps}")
    for r in group.filter(pl.col("quant") != "bf16").iter_rows(named=True):
        lab, speed, kl = r["config"], r.get("decode_tok_s"), r.get("kl_mean")
        if speed is None:
            notes.append(f"{lab} / {r['prompt_set']}: no decode speed, not plotted.")
        elif kl is None or not kl > 0 or not np.isfinite(kl):
            notes.append(f"{lab} / {r['prompt_set']}: mean KL {kl} cannot be shown on a log axis, not plotted.")
        else:
            plotted += 1
            lo, hi = r.get("kl_mean_lo"), r.get("kl_mean_hi")
            if _finite(lo) and _finite(hi):  # the 95% interval of the mean KL
                ax.errorbar(speed, kl, yerr=[[kl - lo], [hi - kl]], fmt="none", ecolor=colors[lab], capsize=3, zorder=2)
            ax.scatter(
                speed,
                kl,
                color=colors[lab],
                marker=markers[r["prompt_set"]],
                s=60,
                edgecolors="black",
                linewidths=0.5,
                zorder=3,
            )
    # Legend: one entry per configuration (color) and per prompt set (shape).
    for lab in dict.fromkeys(group.filter(pl.col("quant") != "bf16")["config"]):
        ax.scatter([], [], color=colors[lab], marker="s", label=lab)
    for ps, m in markers.items():
        ax.scatter([], [], color="white", edgecolors="black", marker=m, label=f"prompt set: {ps}")
    if not plotted:  # only BF16 lines: a log axis needs positive limits to draw them
        ax.set_ylim(1e-6, 1.0)
    ax.set_yscale("log", nonpositive="clip")  # an interval reaching 0 is cut at the axis
    ax.set_xlabel("decode speed (tokens/s, higher is better)")
    ax.set_ylabel("mean KL(BF16 ‖ config) (nats, log scale; bars: 95% interval)")
    ax.set_title(f"Accuracy vs. speed — {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    _save(fig, path)
    return notes


def _rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Centered rolling mean; near the ends the window is cut short (no padding)."""
    c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
    i = np.arange(len(x))
    lo, hi = np.maximum(i - window // 2, 0), np.minimum(i + (window + 1) // 2, len(x))
    return (c[hi] - c[lo]) / (hi - lo)


def position_plot(rows: pl.DataFrame, title: str, colors: dict, path: Path) -> tuple[bool, list[str]]:
    """Write KL per position along the scored window for each non-BF16 configuration of one prompt
    set to ``path`` (raw values faint, a rolling mean over them bold). Returns whether a figure was
    written (not when no positions file could be read) and notes on skipped configurations."""
    notes, lines = [], []
    # a bf16 row is zero when it is the base itself; a fast backend's bf16 row is its kernel drift
    drawn = (pl.col("quant") != "bf16") | (pl.col("kl_mean") > 0)
    for r in rows.filter(drawn).iter_rows(named=True):
        lab = r["config"]
        pos_file = Path(r["row_file"]).with_suffix(".positions.parquet")
        if not pos_file.is_file():
            notes.append(f"{lab}: no positions file ({pos_file.name}), line skipped.")
            continue
        p = pl.read_parquet(pos_file, columns=["position", "kl"]).sort("position")
        lines.append((lab, p["position"].to_numpy(), p["kl"].to_numpy().astype(np.float64)))
    if not lines:
        return False, notes
    n = max(len(x) for _, x, _ in lines)
    window = max(8, n // 16)
    fig, ax = plt.subplots(figsize=(9, 4.8))
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
    ax.set_xlabel("position in the scored window (tokens after the prompt)")
    ax.set_ylabel("KL(BF16 ‖ config) (nats, log scale)")
    zero = "; bf16 is 0 everywhere, not drawn" if len(rows.filter(~drawn)) else ""
    ax.set_title(
        f"KL along the scored window — {title}\n(bold: rolling mean over {window} positions{zero})", fontsize=10
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    if rows["n_prompts"].max() > 1:
        ax.set_xlabel("position in the scored windows of all prompts, concatenated (tokens)")
    _save(fig, path)
    return True, notes


def _finite(value) -> bool:
    return value is not None and bool(np.isfinite(value))


def _is_corpus(rows: pl.DataFrame) -> bool:
    """Whether ``rows`` (of one prompt set) scored a corpus's windows rather than prompts and replies."""
    return "corpus" in rows.columns and rows["corpus"].is_not_null().any()


def exact_cell(r: dict) -> str:
    """Whether a greedy speculative reply equals the plain one: ``yes``; ``no at step 12, margin 0.031:
    near-tie`` (the target's top-1 led its top-2 by at most ``schema.tie_margin`` of the row's dtype there:
    rounding);
    ``**no at step 3, margin 4.2: MISMATCH**`` (a wider margin, or none known: a bug); ``– (sampled)``
    when verification samples (nothing to compare); ``–`` for a plain row."""
    if r["spec"] == "none":
        return "–"
    if r.get("spec_exact") is None:
        return "– (sampled)" if r.get("spec_temperature") else "?"
    if r["spec_exact"]:
        return "yes"
    step, margin = r.get("spec_first_mismatch"), r.get("spec_mismatch_margin")
    at = "no" + (f" at step {step}" if step is not None else "")
    if not _finite(margin):
        return f"**{at}, margin ?: MISMATCH**"
    if margin <= schema.tie_margin(r.get("dtype")):
        return f"{at}, margin {margin:.3g}: near-tie"
    return f"**{at}, margin {margin:.3g}: MISMATCH**"


def _proposer(r: dict) -> str:
    """``ngram (min_n=5,max_n=5)``, ``draft (...), T=0.7``; ``none (plain)``."""
    if r["spec"] == "none":
        return "none (plain)"
    temperature = r.get("spec_temperature")
    return (
        r["spec"]
        + (f" ({r['spec_settings']})" if r.get("spec_settings") else "")
        + (f", T={temperature:g}" if temperature else "")
    )


# (column, header, formatter) of the speculative part of each speculative decoding table.
SPEC_COLUMNS = [
    ("spec_acceptance_rate", "Acceptance rate (%)", "{:.1f}", 100),
    ("spec_acceptance_length", "Mean acceptance length", "{:.2f}"),
    ("spec_tokens_per_forward", "Tokens per target forward", "{:.2f}"),
]


def spec_table(rows: pl.DataFrame) -> tuple[str, list[str]]:
    """A Markdown table of one prompt set's plain and speculative rows (:func:`latest_rows` order: per
    configuration, the plain row first) and the notes it needs (sampled rows)."""
    head = (
        ["Config", "Proposer", "k"]
        + [h for _, h, *_ in SPEC_COLUMNS]
        + [
            "Plain decode tok/s",
            "Speculative tok/s",
            "Speed-up (×)",
            "Draft ms/step",
            "Verify ms/step",
            "Exact (greedy reply = plain)",
        ]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.iter_rows(named=True):
        plain = r["spec"] == "none"
        cells = (
            [r["config"], _proposer(r), _or_unknown(r.get("spec_k")) if not plain else "–"]
            + [_fmt(r.get(c), f, *s) for c, _, f, *s in SPEC_COLUMNS]
            + [
                _speed(r.get("decode_tok_s"), None),
                _speed(r.get("spec_decode_tok_s"), None),
                "1 (plain)" if plain else _fmt(r.get("spec_speedup"), "{:.2f}"),
                _fmt(r.get("spec_draft_ms"), "{:.3g}"),
                _fmt(r.get("spec_verify_ms"), "{:.3g}"),
                exact_cell(r),
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if rows["spec_temperature"].gt(0).any():
        notes.append(
            "rows with T > 0 verify by rejection sampling: their reply is not the greedy one, so it is not "
            "compared (exact –), and their acceptance depends on the seed."
        )
    return "\n".join(lines), notes


def _spec_labels(rows: pl.DataFrame) -> list[str]:
    """A short name per speculative row of a group: ``int8_kv/k=4``, plus what else tells rows apart
    in it (the proposer's settings, temperature, prompt set)."""
    settings = rows.group_by("spec").agg(pl.col("spec_settings").n_unique()).filter(pl.col("spec_settings") > 1)
    several_settings = set(settings["spec"])
    several_temperatures = rows["spec_temperature"].n_unique() > 1
    several_sets = rows["prompt_set"].n_unique() > 1
    return [
        f"{r['config']}/k={_or_unknown(r['spec_k'])}"
        + (f" ({r['spec_settings']})" if r["spec"] in several_settings else "")
        + (f", T={r['spec_temperature']:g}" if several_temperatures and r["spec_temperature"] is not None else "")
        + (f", {r['prompt_set']}" if several_sets else "")
        for r in rows.iter_rows(named=True)
    ]


def _proposer_styles(rows: pl.DataFrame) -> dict[str, tuple]:
    """(color, marker, line style) per proposer, the same in every plot."""
    cmap = plt.get_cmap("tab10")
    styles = ["-", "--", "-.", ":"]
    order = SPEC_ORDER + sorted(set(rows["spec"]) - set(SPEC_ORDER))
    return {p: (cmap(i % 10), "osD^vP*X"[i % 8], styles[i % 4]) for i, p in enumerate(order)}


def speedup_plot(rows: pl.DataFrame, title: str, path: Path) -> tuple[bool, list[str]]:
    """Write the speed-up against mean acceptance length of one group's speculative rows to ``path``:
    one point per row (color and marker = proposer, labelled ``config/k``) and a dashed line at 1×
    (plain decoding). Returns whether a figure was written and notes on rows that could not be drawn."""
    notes, points = [], []
    styles = _proposer_styles(rows)
    for r, lab in zip(rows.iter_rows(named=True), _spec_labels(rows)):
        x, y = r.get("spec_acceptance_length"), r.get("spec_speedup")
        if _finite(x) and _finite(y):
            points.append((r["spec"], lab, x, y))
        else:
            notes.append(f"{r['spec']} {lab}: no speed-up or mean acceptance length, not plotted.")
    if not points:
        return False, notes
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.axhline(1.0, color="0.35", ls="--", lw=1.2, label="plain decoding (1×)")
    for spec in dict.fromkeys(p[0] for p in points):
        color, marker, _ = styles[spec]
        xs, ys = [p[2] for p in points if p[0] == spec], [p[3] for p in points if p[0] == spec]
        ax.scatter(xs, ys, color=color, marker=marker, s=60, edgecolors="black", linewidths=0.5, zorder=3, label=spec)
    for _, lab, x, y in points:
        ax.annotate(lab, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set_xlabel("mean acceptance length (tokens per draft round, 1 + accepted/drafts)")
    ax.set_ylabel("speed-up (speculative / plain decode tok/s)")
    ax.set_title(f"Speculative decoding speed-up — {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    _save(fig, path)
    return True, notes


def acceptance_plot(rows: pl.DataFrame, title: str, path: Path) -> tuple[bool, list[str]]:
    """Write the acceptance rate at each position of the draft (``spec_acceptance_at``) of one group's
    speculative rows to ``path``, one line per row (color, marker and style by proposer, shade by
    row). Returns whether a figure was written and notes on rows without the figures."""
    notes, lines = [], []
    styles = _proposer_styles(rows)
    for r, lab in zip(rows.iter_rows(named=True), _spec_labels(rows)):
        at = [np.nan if v is None else v for v in (r.get("spec_acceptance_at") or [])]
        if any(np.isfinite(at)):
            lines.append((r["spec"], lab, np.asarray(at, dtype=np.float64)))
        else:
            notes.append(f"{r['spec']} {lab}: no acceptance rate per draft position, not plotted.")
    if not lines:
        return False, notes
    fig, ax = plt.subplots(figsize=(9, 4.8))
    cmap = plt.get_cmap("tab20")
    for i, (spec, lab, at) in enumerate(lines):
        _, marker, ls = styles[spec]
        x = np.arange(1, len(at) + 1)
        ax.plot(x, at, color=cmap(i % 20), marker=marker, ls=ls, lw=1.5, ms=5, label=f"{spec} {lab}")
    ax.set_xticks(range(1, max(len(at) for *_, at in lines) + 1))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("position in the draft (1: first drafted token)")
    ax.set_ylabel("acceptance rate (accepted / drafted there)")
    ax.set_title(f"Acceptance along the draft — {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    _save(fig, path)
    return True, notes


def spec_section(group: pl.DataFrame, title: str, slug: list, out_dir: Path) -> list[str]:
    """The Markdown lines of one group's speculative decoding part (tables per prompt set, then the
    plots, written into ``out_dir``); none when no row of the group speculates."""
    speculative = group.filter(pl.col("spec") != "none")
    if speculative.is_empty():
        return []
    md = [
        "",
        "### Speculative decoding",
        "",
        "The timed decode steps after the prompt, decoded speculatively and plainly in the same job: the "
        "speed-up is speculative over plain decode tok/s of that row; plain (spec=none) rows are the "
        "baseline. Acceptance rate is accepted over drafted tokens; mean acceptance length is "
        "1 + accepted/drafts (vLLM's); tokens per target forward is new tokens over forwards of the target "
        "model; draft and verify ms are per target step. Exact: whether the greedy speculative reply equals "
        "the plain greedy one, else the first step where it differs and the target's top-1 minus top-2 logit there "
        "(up to the near-tie margin of the model dtype, "
        + ", ".join(f"{d} {m:g}" for d, m in schema.SPEC_TIE_MARGIN.items())
        + " logits: rounding between the verify and the decode path; above: a MISMATCH, a bug).",
    ]
    for (prompt_set,), rs in group.group_by("prompt_set", maintain_order=True):
        if rs["spec"].ne("none").any():
            table, notes = spec_table(rs)
            md += ["", f"#### Prompt set `{prompt_set}` (speculative decoding)", "", table]
            md += [f"\nNote: {t}" for t in notes]
    md += ["", f"Note: {DFLASH_NOTE}"]
    path = out_dir / f"spec_speedup-{_slug(*slug)}.png"
    written, notes = speedup_plot(speculative, title, path)
    if written:
        md += ["", f"![speculative speed-up against mean acceptance length, {title}]({path.name})"]
    path = out_dir / f"spec_acceptance-{_slug(*slug)}.png"
    written, more = acceptance_plot(speculative, title, path)
    if written:
        md += ["", f"![acceptance rate along the draft, {title}]({path.name})"]
    return md + [f"\nNote: {t}" for t in notes + more]


def render(runs_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the report of the rows under ``runs_dir`` into ``out_dir`` (default
    ``runs_dir/report``): summary table, PNG plots, then ``report.md``. Returns the path of
    ``report.md``. Raises UserError when there are no rows."""
    runs_dir = Path(runs_dir)
    out_dir = Path(out_dir) if out_dir else runs_dir / "report"
    df, rows_dir, duplicates = load_rows(runs_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables.write_summary(df.drop("row_file"), out_dir)
    rows, dropped = latest_rows(df)
    dropped += duplicates
    several_backends = rows["backend"].n_unique() > 1
    print(f"report: {len(rows)} result rows from {rows_dir}" + (f" ({dropped} older left out)" if dropped else ""))
    degenerate = tables.degenerate_note(plain_rows(rows))  # a speculative row repeats its plain row's reply
    if degenerate:
        print(f"warning: {degenerate}")

    md = [
        f"# tileinfer report: {runs_dir}",
        "",
        f"{len(rows)} result rows from `{rows_dir}`, generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. "
        "All rows: [summary.md](summary.md) / `summary.parquet`.",
        "",
        "Drift statistics are those of llama.cpp's `perplexity --kl-divergence`, under its names: "
        "KL(BF16 ‖ config) in nats over the scored positions (the BF16 model's greedy reply after a prompt "
        "of ctx tokens), "
        "RMS Δp and Same top p in percent. Greedy agree len is how many leading reply tokens the "
        "configuration reproduces greedily (mean over prompts, of the window length). "
        "**Prompt sets are not averaged together**: each gets its own table, every number is exactly "
        "the sweep's row. Speeds are tokens/s with the ratio to the BF16 row of the same table in "
        "parentheses (above 1.00× is faster).",
    ]
    if REPETITION & set(rows.columns):
        md[-1] += (
            " Reply repetition is the share of the scored reply that continues a 4-gram seen earlier in it; "
            f"above {DEGENERATE_REPEAT:.0%} the window is degenerate (trivially predictable, so KL understates "
            "the drift); "
            "? marks rows written before it was measured."
        )
    if rows["spec"].ne("none").any():
        md[-1] += (
            " Rows with speculative decoding score the same drift as plain ones: the drift tables show the plain "
            "(spec=none) row of each configuration; their speculative figures are in the sections' "
            '"Speculative decoding" parts.'
        )
    if degenerate:
        md += ["", f"**Warning:** {degenerate}"]
    mismatches = [
        "/".join(map(str, (r["model"], r["config"], r["ctx"], r["prompt_set"], r["backend"], r["spec"])))
        for r in rows.iter_rows(named=True)
        if exact_cell(r).endswith("MISMATCH**")
    ]
    if mismatches:
        mismatch = (
            f"{len(mismatches)} speculative row(s) left the plain greedy reply beyond a near-tie (MISMATCH): "
            + ", ".join(mismatches)
        )
        print(f"warning: {mismatch}")
        md += ["", f"**Warning:** {mismatch}"]
    if dropped:
        md += ["", f"Note: {dropped} older row(s) of a configuration that has a newer row were left out."]
    varying = [c for c in SETUP if rows[c].n_unique() > 1]
    for key, every in rows.group_by([*GROUP, *varying], maintain_order=True):
        model, ctx, backend, *setup = key
        group = plain_rows(every)
        title = (
            f"{model}, ctx {ctx}"
            + (f", backend {backend}" if several_backends else "")
            + "".join(f", {c} {_or_unknown(v)}" for c, v in zip(varying, setup))
        )
        slug = [model, ctx, backend, *map(_or_unknown, setup)]
        md += [
            "",
            f"## {title}",
            "",
            f"Model `{model}`, ctx {ctx} ({_values(group, 'ctx_tokens')} prompt "
            f"tokens), backend `{backend}`, device {_values(group, 'device')}.",
        ]
        colors = _colors(group)
        for (prompt_set, corpus), rs in group.group_by("prompt_set", "corpus", maintain_order=True):
            table, notes = markdown_table(rs)
            n = rs["n_scored"].max()
            source = f"`{corpus}`, " if corpus and corpus != prompt_set else ""
            kind = (
                f"Corpus `{prompt_set}` ({source}{rs['n_windows'].max()} window(s)"
                if _is_corpus(rs)
                else (f"Prompt set `{prompt_set}` ({rs['n_prompts'].max()} prompt(s)")
            )
            md += ["", f"### {kind}, {n} scored positions)", "", table]
            md += [f"\nNote: {t}" for t in notes]
            sigma = sigma_table(rs)
            if sigma:
                md += ["", f"#### llama.cpp's ± 1σ figures, {prompt_set}", ""]
                md += ["Positions taken as independent, as llama.cpp does: narrower than the intervals above.", ""]
                md += [sigma]
        scatter = out_dir / f"scatter-{_slug(*slug)}.png"
        notes = scatter_plot(group, title, colors, scatter)
        md += ["", f"![mean KL against decode speed, {title}]({scatter.name})"]
        md += [f"\nNote: {t}" for t in notes]
        for (prompt_set,), rs in group.group_by("prompt_set", maintain_order=True):
            fig = out_dir / f"kl_by_position-{_slug(*slug, prompt_set)}.png"
            written, notes = position_plot(rs, f"{title}, prompt set {prompt_set}", colors, fig)
            if written:
                md += ["", f"![KL per position, {title}, prompt set {prompt_set}]({fig.name})"]
            elif rs["quant"].ne("bf16").any():
                notes.append(f"no positions files for prompt set {prompt_set}, so no KL-per-position plot.")
            md += [f"\nNote: {t}" for t in notes]
        md += spec_section(every, title, slug, out_dir)
    paired = paired_table(plain_rows(rows))
    if paired:
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
    with exit_on_user_error("tileinfer.report"):
        print(f"wrote {render(args.runs_dir, args.out)}")


if __name__ == "__main__":
    main()
