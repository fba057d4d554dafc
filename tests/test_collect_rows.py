"""summary and report read the sweep's rows once each; the printed table fits a terminal (issue 10, B and Smaller).

The gate scores afresh into runs/gate/*/rows, so a summary or report of runs/ must not count those
rows again; rows of one identity are kept once (the newest); the printed table keeps to about 120
characters, names the constant columns once and says where the rows are; degenerate scored windows
are flagged, rows written before repetition was measured are unknown, not degenerate.
"""

import re
import shutil

import numpy as np
import polars as pl

from tests.test_report import CONFIGS, collect, fake_row, write_runs
from tileinfer import report, summary
from tileinfer.jobs import tables
from tileinfer.jobs.rows import write_row

N_ROWS = 2 * 2 * len(CONFIGS)  # write_runs: ctx 1k and 8k, prompt sets edit and explain


def with_gate_runs(runs):
    """Two gate runs beside the sweep's rows, as ``python -m tileinfer.gate`` lays them out."""
    for stamp in ("2026-01-01_00-00-00", "2026-01-02_00-00-00"):
        shutil.copytree(runs / "rows", runs / "gate" / stamp / "rows")
    return runs


def test_summary_reads_the_sweep_rows_only_and_says_from_where(tmp_path, capsys):
    runs = with_gate_runs(write_runs(tmp_path / "runs"))
    summary.main([str(runs)])
    out = capsys.readouterr().out
    assert len(pl.read_parquet(runs / "summary.parquet")) == N_ROWS
    assert f"{N_ROWS} row(s) in {runs / 'rows'}" in out
    summary.main([str(runs / "rows")])  # the rows folder itself also works
    assert f"{N_ROWS} row(s) in {runs / 'rows'}" in capsys.readouterr().out


def test_report_reads_the_sweep_rows_only_and_says_from_where(tmp_path, capsys):
    runs = with_gate_runs(write_runs(tmp_path / "runs"))
    md = report.render(runs).read_text()
    assert f"{N_ROWS} result rows from `{runs / 'rows'}`" in md and "older row" not in md
    assert f"report: {N_ROWS} result rows from {runs / 'rows'}" in capsys.readouterr().out
    assert len(pl.read_parquet(runs / "report" / "summary.parquet")) == N_ROWS


def test_rows_of_one_identity_are_kept_once_the_newest(tmp_path, capsys):
    runs = write_runs(tmp_path / "runs", ctxs=("1k",), prompt_sets=("edit",))
    row, pos = fake_row(*CONFIGS[1], ctx="1k", prompt_set="edit", rng=np.random.default_rng(5))
    for name, finished, kl in [
        ("older", "2024-01-01T00:00:00+00:00", 0.5),
        ("newer", "2026-01-01T00:00:00+00:00", 0.25),
    ]:
        write_row(runs / "rows" / "copies" / f"{name}.parquet", row | {"finished_at": finished, "kl_mean": kl}, pos)
    summary.main([str(runs)])
    out = capsys.readouterr().out
    df = pl.read_parquet(runs / "summary.parquet")
    assert len(df) == len(CONFIGS) and df.filter(pl.col("quant") == CONFIGS[1][0])["kl_mean"].to_list() == [0.25]
    assert "2 older row(s) of the same identity left out (the newest kept)" in out


def printed(df, capsys, **kw) -> str:
    tables.print_table(df, **kw)
    return capsys.readouterr().out


def test_the_printed_table_fits_120_characters_and_names_constant_columns_once(tmp_path, capsys):
    runs = write_runs(tmp_path / "runs")
    df = collect(runs / "rows").with_columns(model=pl.lit("qwen2.5-coder-0.5b"))
    out = printed(df, capsys)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120, out
    assert lines[0] == "model=qwen2.5-coder-0.5b backend=reference device=cpu"
    header = re.split(r"\s*[│┆]\s*", lines[2].strip("│ "))
    assert header == [
        "quant",
        "ctx",
        "prompt_set",
        "kl_mean",
        "kl_p99",
        "top1_agree",
        "greedy_agree_len",
        "decode_tok_s",
    ]
    assert "int8_kv+smooth" in out and "int8_kv " in out  # key smoothing named in the quant column
    assert printed(df, capsys, where=runs / "rows").splitlines()[-1] == f"{N_ROWS} row(s) in {runs / 'rows'}"
    files = sorted((runs / "rows").rglob("*.parquet"))
    assert (
        printed(df, capsys, where=files).splitlines()[-1]
        == f"{N_ROWS} row(s) in {runs / 'rows' / 'smollm2-135m' / 'reference'}"
    )


def test_degenerate_windows_are_flagged_and_old_rows_are_unknown(tmp_path, capsys):
    runs = write_runs(tmp_path / "runs", ctxs=("1k",), prompt_sets=("explain",))
    df = collect(runs / "rows")
    # bf16: degenerate; int8_weights: measured, fine; the rest: written before the columns existed
    measured = {"bf16": (0.8, True), "int8_weights": (0.1, False)}
    df = df.with_columns(
        reply_repeat_frac=pl.Series([measured.get(q, (None, None))[0] for q in df["quant"]], dtype=pl.Float64),
        degenerate=pl.Series([measured.get(q, (None, None))[1] for q in df["quant"]], dtype=pl.Boolean),
    )
    out = printed(df, capsys)
    cells = {
        line.split("┆")[0].strip("│ "): line.split("┆")[-1].strip("│ ") for line in out.splitlines() if "┆" in line
    }
    assert cells["bf16"] == "80% !" and cells["int8_weights"] == "10%" and cells["int8_kv"] == "?"
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "1 row(s) scored a degenerate window" in warning[0]
    assert warning[0].endswith(": smollm2-135m/bf16/1k/explain/reference")
    # rows without the columns at all: no column, no warning
    old = printed(df.drop("reply_repeat_frac", "degenerate"), capsys)
    assert "repeat" not in old and "warning" not in old
