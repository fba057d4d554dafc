"""Stored base logits and baselines serve any backend, device and current folder (issue 10, E and Smaller).

Stored BF16 base logits are found whichever backend recorded them; a backend without a baseline row
of its own is checked against the reference backend's row with the kernel bounds as stated extra
margin; the gate finds the shipped evals/ tables from any folder and names the exact command that
records a missing baseline row.
"""

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from omegaconf import OmegaConf

from evals import base_logits, verdicts
from tests.test_gate import row as gate_row
from tileinfer import gate
from tileinfer.jobs import rows
from tileinfer.jobs.identity import DRIFT
from tileinfer.jobs.schema import BaseSettings

REPO = Path(__file__).resolve().parent.parent
GATE = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "gate.yaml").gate)
SHIPPED = REPO / "evals" / "base_logits" / "smollm2-135m"
STREAMS = ["bf16-nosmooth-edit0-ctx1024-n128", "bf16-nosmooth-explain0-ctx1024-n128"]
# a short job: 64 prompt tokens of a text file, 8 scored
TINY = [
    "model=smollm2-135m",
    "ctx.tokens=64",
    "eval.n_score=8",
    f"eval.prompt_sets=[{REPO / 'evals' / 'data' / 'stdlib' / 'textwrap.py.txt'}]",
    "speed.decode_tokens=4",
    "quant=bf16",
]
# a gate job on the shipped stored base logits (one prompt set)
QUICK = [
    "model=smollm2-135m",
    "ctx=1k",
    "eval.n_score=128",
    "eval.prompt_sets=[edit]",
    "base.source=stored",
    "speed.decode_tokens=4",
    "quant=bf16",
]


def run_gate(*args, cwd=None):
    cmd = [sys.executable, "-m", "tileinfer.gate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd)


# --- which backend's recording a job reads -------------------------------------------------------


def record(folder: Path, backend: str, streams=STREAMS) -> None:
    """Fake recordings of ``streams`` by ``backend`` under ``folder/smollm2-135m``."""
    (folder / "smollm2-135m").mkdir(parents=True, exist_ok=True)
    for s in streams:
        (folder / "smollm2-135m" / f"{backend}-{s}.topk").write_bytes(b"")


def test_the_reference_backends_recording_is_read_first(tmp_path):
    record(tmp_path, "triton")
    record(tmp_path, "reference")
    assert base_logits.stored_backend(str(tmp_path), "smollm2-135m", STREAMS) == "reference"


def test_another_backends_recording_serves_when_the_reference_backend_has_none(tmp_path):
    record(tmp_path, "triton")
    record(tmp_path, "reference", STREAMS[:1])  # incomplete: one prompt set only
    assert base_logits.stored_backend(str(tmp_path), "smollm2-135m", STREAMS) == "triton"


def test_base_backend_picks_the_recording_and_nothing_recorded_names_the_reference_file(tmp_path):
    record(tmp_path, "reference")
    assert base_logits.stored_backend(str(tmp_path), "smollm2-135m", STREAMS, backend="cutile") == "cutile"
    assert base_logits.stored_backend(str(tmp_path / "none"), "smollm2-135m", STREAMS) == "reference"


def test_the_default_base_dir_is_the_shipped_folder_and_other_paths_are_relative_to_the_current_one():
    assert BaseSettings().dir == base_logits.DEFAULT_DIR  # the schema's default is the spelling recognised
    assert base_logits.base_logits_dir(base_logits.DEFAULT_DIR) == REPO / "evals" / "base_logits"
    assert base_logits.base_logits_dir("mine/base_logits") == Path("mine/base_logits")
    shipped = base_logits.stored_path(base_logits.DEFAULT_DIR, "smollm2-135m", "reference", STREAMS[0])
    assert shipped == SHIPPED / f"reference-{STREAMS[0]}.topk" and shipped.is_file()
    assert base_logits.stored_backend(base_logits.DEFAULT_DIR, "smollm2-135m", STREAMS) == "reference"


def test_the_default_baseline_is_the_shipped_table():
    assert GATE["baseline"] == gate.DEFAULT_BASELINE.format(model="${model.name}")  # conf/gate.yaml's default
    cfg = OmegaConf.create(
        {"gate": {"baseline": "evals/baselines/smollm2-135m.parquet"}, "model": {"name": "smollm2-135m"}}
    )
    assert gate.baseline_path(cfg) == REPO / "evals" / "baselines" / "smollm2-135m.parquet"
    cfg.gate.baseline = "evals/baselines/other.parquet"  # another path, as given
    assert gate.baseline_path(cfg) == Path("evals/baselines/other.parquet")


# --- a backend without a baseline row of its own ---------------------------------------------------


def row(**kw):
    """A candidate row of smollm2 INT8 (weights and KV cache) against the stored BF16 base logits."""
    return gate_row(**({"model": "smollm2-135m", "top1_agree": 0.96875} | kw))


def baseline_of(*rows):
    return pl.DataFrame([{k: v for k, v in r.items() if k != "kernel"} for r in rows])


def test_a_backend_without_its_own_row_is_held_to_the_reference_row_with_the_kernel_bounds_as_margin():
    v = verdicts.evaluate(pl.DataFrame([row(backend="triton", kl_mean=5.0e-3)]), baseline_of(row()), GATE, DRIFT)
    assert v["check"].to_list() == ["baseline-ref"] * 3
    bound = dict(zip(v["metric"], v["bound"]))
    k = GATE["bounds"]["bfloat16-int8kv"]  # kl_mean 3e-3, kl_p999 0.1, top1_agree 0.97
    assert bound["kl_mean"] == pytest.approx(3.8e-3 * 1.1 + 5e-4 + k["kl_mean"])
    assert bound["kl_p999"] == pytest.approx(3.7e-2 * 1.1 + 1e-2 + k["kl_p999"])
    assert bound["top1_agree"] == pytest.approx(0.96875 - 0.01 - (1 - k["top1_agree"]))
    # passes there, where the reference backend's own bound (4.7e-3) would fail it...
    assert list(v["verdict"]) == [verdicts.PASS, verdicts.SKIP, verdicts.PASS]  # 128 positions: 99.9% KL not checked
    # ...but a drift beyond the margin fails
    far = verdicts.evaluate(pl.DataFrame([row(backend="triton", kl_mean=9.0e-3)]), baseline_of(row()), GATE, DRIFT)
    assert far.filter(pl.col("verdict") == verdicts.FAIL)["metric"].to_list() == ["kl_mean"]


def test_the_fallback_note_states_the_margin():
    note = verdicts.fallback_note(row(backend="triton"), GATE)
    assert note.startswith("baseline-ref: no baseline row for backend=triton")
    assert "gate.bounds.bfloat16-int8kv: kl_mean +0.003, kl_p999 +0.1, top1_agree -0.05" in note


def test_a_backends_own_row_wins_and_another_base_is_no_stand_in():
    own = verdicts.evaluate(
        pl.DataFrame([row(backend="triton")]), baseline_of(row(), row(backend="triton")), GATE, DRIFT
    )
    assert own["check"].to_list() == ["baseline"] * 3
    other_base = verdicts.evaluate(
        pl.DataFrame([row(backend="triton", base="stored:triton/bf16-nosmooth")]), baseline_of(row()), GATE, DRIFT
    )
    assert other_base["metric"].to_list() == ["row present"] and other_base["verdict"][0] == verdicts.FAIL
    ref = verdicts.evaluate(pl.DataFrame([row(quant="int8_kv")]), baseline_of(row()), GATE, DRIFT)
    assert ref["metric"].to_list() == ["row present"]


# --- through the command line --------------------------------------------------------------------


def test_the_gate_finds_the_shipped_tables_from_another_folder(tmp_path, smollm2_gguf):
    out = run_gate(*QUICK, f"runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"baseline table: {REPO / 'evals' / 'baselines' / 'smollm2-135m.parquet'}" in out.stdout
    assert "gate: PASS" in out.stdout
    # a path given explicitly stays relative to the current folder
    mine = run_gate(*QUICK, f"runs_dir={tmp_path / 'runs'}", "gate.baseline=mine.parquet", cwd=tmp_path)
    assert mine.returncode == 2 and "no baseline table mine.parquet" in mine.stderr, mine.stderr


def test_stored_base_logits_recorded_by_another_backend_are_read_without_flags(tmp_path, smollm2_gguf):
    base, runs = tmp_path / "base", tmp_path / "runs"
    rec = [sys.executable, "-m", "tileinfer.record", *TINY, f"base.dir={base}", f"runs_dir={runs}"]
    made = subprocess.run(rec, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    for f in (base / "smollm2-135m").glob("reference-*.topk"):  # as if the triton backend had recorded it
        f.rename(f.with_name(f.name.replace("reference-", "triton-", 1)))
    out = run_gate(*TINY, "base.source=stored", f"base.dir={base}", "gate.baseline=null", f"runs_dir={runs}")
    assert out.returncode == 0, out.stdout + out.stderr
    table = rows.read(runs / "rows")
    assert table["backend"].to_list() == ["reference"] and table["base"].to_list() == ["stored:triton/bf16-nosmooth"]


def test_a_missing_baseline_row_names_the_command_that_records_it(tmp_path, smollm2_gguf):
    table = tmp_path / "baseline.parquet"  # rows of other configurations only
    shutil.copy(REPO / "evals" / "baselines" / "smollm2-135m.parquet", table)
    args = [*TINY, f"runs_dir={tmp_path / 'runs'}", f"gate.baseline={table}"]
    out = run_gate(*args)
    assert out.returncode == 1 and "row present" in out.stdout, out.stdout + out.stderr
    command = out.stdout.split("no baseline row: record one with: ", 1)[1].strip()
    assert command == shlex.join(["python", "-m", "tileinfer.gate", *args, "backend=reference", "--update-baseline"])
    made = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    recorded = pl.read_parquet(table).filter(pl.col("base") == "live:reference/bf16-nosmooth")
    assert recorded["prompt_set"].to_list() == ["textwrap.py"] and recorded["ctx_tokens"].to_list() == [64]
