"""The main job end to end on SmolLM2 with a short context, through the real command line."""

import subprocess
import sys

import polars as pl
import pytest

from tileinfer.jobs import tables

SHORT = [
    "model=smollm2-135m",
    "ctx=1k",
    "eval.n_score=24",
    "speed.decode_tokens=4",
    "quant.calibration_tokens=256",
    "kv.prefill_chunk=256",
]


def sweep(tmp_path, *overrides, multirun=False, check=True):
    cmd = [
        sys.executable,
        "-m",
        "tileinfer.sweep",
        *(["-m"] if multirun else []),
        *SHORT,
        f"runs_dir={tmp_path}",
        *overrides,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("runs")
    sweep(d, "quant=bf16,int8_weights,int8_kv,int8_both", multirun=True)
    return d


def test_sweep_writes_one_row_per_config_and_prompt_set(runs):
    df = tables.collect(runs / "rows")
    assert len(df) == 8 and set(df["quant"]) == {"bf16", "int8_weights", "int8_kv", "int8_both"}
    assert set(df["prompt_set"]) == {"edit", "explain"}
    assert (df["ctx_tokens"] == 1024).all() and (df["n_scored"] > 0).all()
    # the multirun's summary table was saved beside its logs
    assert len(list((runs / "logs").rglob("summary.md"))) == 1


def test_bf16_against_itself_is_exactly_zero_and_int8_is_finite_positive(runs):
    df = tables.collect(runs / "rows")
    bf16 = df.filter(pl.col("quant") == "bf16")
    assert (bf16["kl_max"] == 0).all() and (bf16["top1_agree"] == 1).all()
    assert (bf16["greedy_agree_len"] == bf16["n_scored"]).all()
    q = df.filter(pl.col("quant") != "bf16")
    assert q["kl_mean"].is_finite().all() and (q["kl_mean"] > 0).all()
    assert (q["decode_tok_s"] > 0).all() and (q["prefill_tok_s"] > 0).all()


def test_rerun_skips_finished_rows(runs):
    before = {p: p.stat().st_mtime_ns for p in (runs / "rows").rglob("*.parquet")}
    out = sweep(runs, "quant=int8_both")
    assert "already done" in out.stdout
    assert before == {p: p.stat().st_mtime_ns for p in (runs / "rows").rglob("*.parquet")}


def test_smoothing_switch_makes_a_separate_row(runs):
    sweep(runs, "quant=int8_kv", "quant.smooth_keys=false")
    df = tables.collect(runs / "rows").filter(pl.col("quant") == "int8_kv")
    assert sorted(df["smooth_keys"].to_list()) == [False, False, True, True]


@pytest.mark.parametrize(
    "override,message",
    [
        (["ctx=32k"], "exceeds the context of smollm2-135m"),
        (["model=no-such-model"], "no-such-model"),
        (["quant.weights=int4"], "quant.weights=int4: expected one of bf16, int8"),
    ],
)
def test_user_errors_are_one_line_and_nonzero(tmp_path, override, message):
    out = sweep(tmp_path, *override, check=False)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("*.parquet"))
