"""The main job end to end on SmolLM2 with a short context, through the real command line."""

import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from evals.drift import speed_columns
from tileinfer.jobs import rows

REPO = Path(__file__).resolve().parent.parent
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
    df = rows.read(runs / "rows")
    assert len(df) == 8 and set(df["quant"]) == {"bf16", "int8_weights", "int8_kv", "int8_both"}
    assert set(df["prompt_set"]) == {"edit", "explain"}
    assert (df["ctx_tokens"] == 1024).all() and (df["n_scored"] > 0).all()
    # the multirun's summary table was saved beside its logs
    assert len(list((runs / "logs").rglob("summary.md"))) == 1


def test_bf16_against_itself_is_exactly_zero_and_int8_is_finite_positive(runs):
    df = rows.read(runs / "rows")
    bf16 = df.filter(pl.col("quant") == "bf16")
    assert (bf16["kl_max"] == 0).all() and (bf16["top1_agree"] == 1).all()
    assert (bf16["greedy_agree_len"] == bf16["n_scored"]).all()
    q = df.filter(pl.col("quant") != "bf16")
    assert q["kl_mean"].is_finite().all() and (q["kl_mean"] > 0).all()
    assert (q["decode_tok_s"] > 0).all() and (q["prefill_tok_s"] > 0).all()


def test_decode_speed_is_the_median_of_the_timed_repetitions_with_their_spread(runs):
    df = rows.read(runs / "rows")
    assert (df["decode_repeats"] == 5).all() and (df["decode_reps"] == 5 * df["n_prompts"]).all()
    assert (df["decode_tok_s_min"] <= df["decode_tok_s"]).all() and (df["decode_tok_s"] <= df["decode_tok_s_max"]).all()
    assert ((df["decode_ms_per_tok"] * df["decode_tok_s"] - 1e3).abs() < 1e-6).all()


def test_speed_columns_take_the_median_of_every_repetition():
    # an odd and an even count, and one slow outlier that a mean would follow
    assert speed_columns([10.0, 30.0, 20.0]) == dict(
        decode_tok_s=20.0, decode_ms_per_tok=50.0, decode_tok_s_min=10.0, decode_tok_s_max=30.0, decode_reps=3
    )
    assert speed_columns([100.0, 100.0, 2.0, 100.0])["decode_tok_s"] == 100.0
    assert speed_columns([1.0, 2.0, 4.0, 8.0])["decode_tok_s"] == 3.0
    none = speed_columns([])
    assert none["decode_reps"] == 0 and all(v != v for k, v in none.items() if k != "decode_reps")


def test_rerun_skips_finished_rows(runs):
    before = {p: p.stat().st_mtime_ns for p in (runs / "rows").rglob("*.parquet")}
    out = sweep(runs, "quant=int8_both")
    assert "already done" in out.stdout
    assert before == {p: p.stat().st_mtime_ns for p in (runs / "rows").rglob("*.parquet")}


def test_smoothing_switch_makes_a_separate_row(runs):
    sweep(runs, "quant=int8_kv", "quant.smooth_keys=false")
    df = rows.read(runs / "rows").filter(pl.col("quant") == "int8_kv")
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


def test_two_prompt_files_of_one_name_are_refused(tmp_path):
    text = (REPO / "evals" / "data" / "stdlib" / "statistics.py.txt").read_text()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "doc.txt").write_text(text)
    out = sweep(tmp_path, f"eval.prompt_sets=[{tmp_path}/a/doc.txt,{tmp_path}/b/doc.txt]", check=False)
    assert out.returncode == 2 and "b/doc.txt has the name 'doc' of prompt set" in out.stderr, out.stderr
    assert not list(tmp_path.rglob("*.parquet"))


def test_stored_base_logits_of_another_prompt_are_refused(tmp_path):
    # the explain file stored under the edit prompt's name: its tokens are not the edit prompt's
    src, dst = REPO / "evals" / "base_logits" / "smollm2-135m", tmp_path / "base" / "smollm2-135m"
    dst.mkdir(parents=True)
    for f in src.glob("*explain0*.topk"):
        shutil.copy(f, dst / f.name.replace("explain0", "edit0").replace("-n128", "-n24"))  # SHORT's n_score
    out = sweep(
        tmp_path,
        "quant=bf16",
        "eval.prompt_sets=[edit]",
        "base.source=stored",
        f"base.dir={tmp_path / 'base'}",
        check=False,
    )
    assert out.returncode == 2 and "were recorded on another prompt" in out.stderr, out.stderr
