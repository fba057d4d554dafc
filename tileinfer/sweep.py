"""The main job: accuracy against BF16 beside speed, one row per (model, quant, ctx, prompt set).

    python -m tileinfer.sweep                                   # defaults (conf/config.yaml)
    python -m tileinfer.sweep quant=int8_both ctx=32k
    python -m tileinfer.sweep -m quant=bf16,int8_weights,int8_kv,int8_both ctx=1k,8k
    python -m tileinfer.sweep -m hydra/launcher=gpus quant=bf16,int8_both ctx=1k,8k   # a worker per GPU
    python -m tileinfer.sweep -m hydra/launcher=slurm runs_dir=/shared/runs ...          # a SLURM job each

Each job (see tileinfer.jobs.job) writes one Parquet row per prompt set under ``runs_dir/rows``,
atomically; a row that already exists is not computed again, so an interrupted sweep restarted with
the same command keeps what finished. Each job prints its rows and records what it did in
``rows.json`` in its log folder.

A multirun runs its jobs one after another in this process (Hydra's basic launcher), or in worker
processes through a Hydra launcher (conf/hydra/launcher: ``gpus``, joblib on one host; ``slurm``,
submitit). A worker takes one GPU for its life (tileinfer.core.gpu_slots) and keeps its loaded
models for its next jobs; jobs share the base replies and dequantized checkpoints on disk, made
once under file locks. Whatever the launcher, this process prints one line per finished job and,
at the end, all rows as one table, saved as ``summary.parquet`` / ``summary.md`` in its log folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import hydra
import polars as pl
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from tileinfer.core import files, gpu_slots
from tileinfer.core.errors import UserError, check_runs_dir, exit_on_user_error
from tileinfer.jobs import job, schema, tables

ROWS_LIST = "rows.json"  # in each job's Hydra output folder: its overrides, wall time and row files
POLL_S = 2.0  # how often the multirun's progress looks for finished jobs
_SWEEP = {"jobs": 1, "started": None}  # jobs of this command (schema.check_jobs) and when the first began


def read_rows(paths) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in dict.fromkeys(paths)], how="diagonal_relaxed")


schema.register()
OmegaConf.register_new_resolver("gpu_slots", gpu_slots.slot_count, replace=True)  # conf/hydra/launcher/gpus.yaml


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: one job of a run or multirun, in this process or a launcher's worker."""
    with exit_on_user_error("tileinfer.sweep"):
        gpu_slots.claim()  # first: before anything initialises CUDA
        keep_worker_alive()
        hc = HydraConfig.get()
        announce(hc)
        t0 = time.monotonic()
        paths = job.run(schema.load(cfg), cpu_workers=launcher_workers(hc))
        tables.print_table(read_rows(paths), where=paths)
        done = {"overrides": list(hc.overrides.task), "wall_s": time.monotonic() - t0, "rows": [str(p) for p in paths]}
        files.write_text(Path(hc.runtime.output_dir) / ROWS_LIST, json.dumps(done))


def launcher_workers(hc) -> int | None:
    """How many jobs the launcher may run on this host at once: 1 under Hydra's basic launcher, joblib's
    ``n_jobs`` (negative: CPU count + 1 + n_jobs, as joblib counts), None for another launcher."""
    target = hc.launcher._target_
    if target.endswith(".BasicLauncher"):
        return 1
    if "joblib" in target:
        n = int(hc.launcher.n_jobs)
        return n if n > 0 else max(1, (os.cpu_count() or 1) + 1 + n)
    return None


def keep_worker_alive() -> None:
    """Lift the leak guard of joblib's loky workers in this process (a no-op elsewhere).

    A loky worker restarts itself once its memory has grown 300 MB past its size after its first task.
    A sweep worker grows by what it keeps for its next jobs on purpose (models, quantized copies and
    base logits: tileinfer.jobs.job), so the guard restarted workers mid-multirun on the H200, losing
    those and paying a new process's imports and kernel loads (benchmarks/results/h200-2026-12-01-scaling.md).
    """
    loky = sys.modules.get("joblib.externals.loky.process_executor")
    if loky is not None:
        loky._MAX_MEMORY_LEAK_SIZE = sys.maxsize


def announce(hc) -> None:
    """Print ``job k/N: overrides`` before a job of a multirun. Under Hydra's basic launcher (the jobs
    one after another in this process) with the time the jobs so far took and a rough estimate for
    the rest (their mean time per job; cached rows make it an upper bound). In a launcher's worker,
    which sees only the jobs it is handed, the job's number and the worker's pid only: the progress
    of the whole multirun is the parent's (:class:`PrintSummary`)."""
    if hc.mode != RunMode.MULTIRUN:
        return
    what = " ".join(hc.overrides.task) or "(defaults)"
    if not hc.launcher._target_.endswith(".BasicLauncher"):
        print(f"=== job #{hc.job.num} in worker pid {os.getpid()}: {what} ===", file=sys.stderr, flush=True)
        return
    k, n, now = hc.job.num + 1, _SWEEP["jobs"], time.monotonic()
    _SWEEP["started"] = _SWEEP["started"] or now
    spent = now - _SWEEP["started"]
    eta = f"; {spent / 60:.1f} min so far, about {spent / (k - 1) * (n - k + 1) / 60:.0f} min left" if k > 1 else ""
    print(f"=== job {k}/{n}: {what}{eta} ===", file=sys.stderr, flush=True)


FIGURES = (("kl_mean", "mean KL {:.1e}"), ("top1_agree", "top-1 {:.1%}"), ("decode_tok_s", "decode {:.0f} tok/s"))


def progress_line(k: int, n: int, done: dict, swept: set[str]) -> str:
    """``job done k/N (wall 41 s): quant=int8_both ctx=1k | mean KL 2.1e-03, top-1 97.5%, decode 230
    tok/s``: a finished job's ``rows.json`` record, its overrides of the swept keys ``swept`` (all of
    them when none is swept), and the mean of its rows' :data:`FIGURES`."""
    parsed = OverridesParser.create().parse_overrides(done["overrides"])
    shown = " ".join(o.input_line for o in parsed if not swept or o.get_key_element() in swept) or "(defaults)"
    df = read_rows(done["rows"])
    means = {col: df[col].mean() for col, _ in FIGURES if col in df.columns}
    figures = ", ".join(text.format(means[col]) for col, text in FIGURES if means.get(col) is not None)
    of = f"{k}/{n}" if k <= n else str(k)  # n is 1 when check_jobs could not count (--config-dir)
    return f"job done {of} (wall {done['wall_s']:.1f} s): {shown} | {figures}"


class Progress:
    """A daemon thread that prints :func:`progress_line` for each job of a multirun as its
    ``rows.json`` appears in the sweep folder ``out`` (polled every :data:`POLL_S` seconds): the
    same whether the jobs run in this process or in workers on other hosts of a shared file system."""

    def __init__(self, out: Path, n_jobs: int, swept: set[str]):
        self.out, self.n_jobs, self.swept = out, n_jobs, swept
        self.seen: set[Path] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweep-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and print the jobs it has not printed yet."""
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Print one line per ``rows.json`` not printed yet, oldest first."""
        new = sorted(set(self.out.glob(f"*/{ROWS_LIST}")) - self.seen, key=lambda p: p.stat().st_mtime_ns)
        for f in new:
            self.seen.add(f)
            print(progress_line(len(self.seen), self.n_jobs, json.loads(f.read_text()), self.swept), flush=True)


class PrintSummary(Callback):
    """A multirun's progress and summary, printed by the process that started it, whatever the
    launcher: one line per finished job while it runs (:class:`Progress`), then every row it
    produced as one table, saved beside the logs."""

    def __init__(self):
        self.progress: Progress | None = None

    def __getstate__(self) -> dict:
        """Launchers pickle Hydra's callbacks for their workers; the progress thread stays here."""
        return {"progress": None}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
        swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
        self.progress = Progress(Path(config.hydra.sweep.dir), _SWEEP["jobs"], swept)
        self.progress.start()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.progress is not None:
            self.progress.stop()
        out = Path(config.hydra.sweep.dir)
        paths = [p for f in sorted(out.glob(f"*/{ROWS_LIST}")) for p in json.loads(f.read_text())["rows"]]
        if not paths:
            return
        df = read_rows(paths)
        with exit_on_user_error("tileinfer.sweep"):
            tables.write_summary(df, out)
        print(f"\n=== sweep summary ({len(df)} rows; {out}/summary.md) ===")
        tables.print_table(df, where=paths)


# hydra/launcher options: this project's presets (conf/hydra/launcher) and the plugins' own, with the
# plugin each needs (None: Hydra itself).
LAUNCHERS = {
    "basic": None,
    "gpus": "hydra_joblib_launcher",
    "joblib": "hydra_joblib_launcher",
    "slurm": "hydra_submitit_launcher",
    "submitit_local": "hydra_submitit_launcher",
    "submitit_slurm": "hydra_submitit_launcher",
}
EXTRA = {"hydra_joblib_launcher": "joblib", "hydra_submitit_launcher": "slurm"}


def check_launcher(argv: list[str], slots: int) -> None:
    """Refuse, with one line, a launcher that is unknown or not installed, and a joblib ``n_jobs`` that
    is not a positive count or exceeds the GPU slots (``slots``; 0 without a pool): a worker without
    a slot would wait for ever, since the others keep theirs until the multirun ends.

    Raises:
        UserError: any of these.
    """
    values = {k: v for k, _, v in (a.partition("=") for a in argv if "=" in a)}
    launcher = values.get("hydra/launcher", "basic")
    if launcher not in LAUNCHERS:
        raise UserError(f"hydra/launcher={launcher}: expected one of {', '.join(LAUNCHERS)}")
    plugin = LAUNCHERS[launcher]
    if plugin and importlib.util.find_spec(f"hydra_plugins.{plugin}") is None:
        raise UserError(
            f'hydra/launcher={launcher} needs {plugin.replace("_", "-")}: pip install -e ".[{EXTRA[plugin]}]"'
        )
    if plugin != "hydra_joblib_launcher":
        return
    text = values.get("hydra.launcher.n_jobs", str(slots or 1) if launcher == "gpus" else "-1")
    try:
        n = int(text)
    except ValueError:
        raise UserError(f"hydra.launcher.n_jobs={text}: expected a whole number of workers") from None
    workers = n if n > 0 else (os.cpu_count() or 1) + 1 + n
    if n == 0 or workers < 1:
        raise UserError(f"hydra.launcher.n_jobs={text}: expected at least one worker")
    if slots and workers > slots:
        raise UserError(
            f"hydra.launcher.n_jobs={text} starts {workers} workers for {slots} GPU slot(s) of "
            f"{gpu_slots.POOL_VAR}: at most {slots}, or name a GPU twice ({gpu_slots.POOL_VAR}=0,0) for two on it"
        )


def _terminate(signum, frame) -> None:
    """SIGTERM (kill, timeout, a scheduler) ends the command as Ctrl-C does, so the launcher stops its
    workers (left running otherwise, holding their GPU slots)."""
    raise KeyboardInterrupt


def cli(argv: list[str]) -> None:
    """``python -m tileinfer.sweep ARGS``: check every job of the command line, give the GPUs of this
    host to the workers a launcher will start (:func:`tileinfer.core.gpu_slots.export_pool`), run."""
    schema.check_argv("tileinfer.sweep", argv)
    check_runs_dir("tileinfer.sweep", argv)
    _SWEEP["jobs"] = schema.check_jobs("tileinfer.sweep", argv)
    with exit_on_user_error("tileinfer.sweep"):
        gpu_slots.export_pool()
        check_launcher(argv, len(gpu_slots.pool()))  # also refuses a malformed $TILEINFER_GPUS
        signal.signal(signal.SIGTERM, _terminate)
        main()


if __name__ == "__main__":
    # Run as the module tileinfer.sweep, not as __main__: Hydra's callback (tileinfer.sweep.PrintSummary)
    # imports it under that name and must see this command's _SWEEP, and workers import it by that name.
    from tileinfer.sweep import cli

    cli(sys.argv[1:])
