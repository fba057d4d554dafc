"""The front end of the Hydra commands (sweep, gate, record): one pass over argv, then Hydra runs the jobs.

:func:`parse` reads the command line once, with Hydra's own argument parser; it expands a multirun
with Hydra's own sweep expansion and composes every job with Hydra's config loader (the one that
then runs it), checked by :func:`tileinfer.jobs.schema.load`, before any job starts: a bad value in
the last job is refused before the first computes anything. :func:`run` hands the jobs to Hydra,
whose launcher (basic, joblib, submitit) runs them and returns each job's :class:`Outcome` as a
value. This is also the only module that maps errors to exit codes and one-line messages
(:func:`error_line`); the engine only raises.

Exit codes: 0 done; 2 a mistake in the input (a bad setting, a missing or corrupt checkpoint, a
prompt longer than the context, out of GPU memory), said in one line; 1 a failed gate check, or a
crash of the code (with its traceback); 130 interrupted.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import _run_hydra, create_automatic_config_search_path, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from tileinfer.core import files, gpu_slots
from tileinfer.core.errors import UserError
from tileinfer.jobs import schema
from tileinfer.jobs.schema import Config

USAGE_ERROR = 2
CONFIG_PATH = "pkg://tileinfer.conf"
# hydra/launcher options and the plugin each needs (this project's presets in conf/hydra/launcher and
# the plugins' own), for the install hint when one is missing.
LAUNCHERS = {
    "gpus": ("hydra_joblib_launcher", "joblib"),
    "joblib": ("hydra_joblib_launcher", "joblib"),
    "slurm": ("hydra_submitit_launcher", "slurm"),
    "submitit_local": ("hydra_submitit_launcher", "slurm"),
    "submitit_slurm": ("hydra_submitit_launcher", "slurm"),
}
RENAMED_GROUPS = {"reference": "base"}  # settings renamed since earlier releases: old group -> new group
# Hydra's flags that print something instead of running jobs.
INFO_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")


def error_line(e: BaseException) -> str | None:
    """The one line a command prints for an error in the user's input, or None for a bug (which keeps
    its traceback): a :class:`UserError`, running out of GPU memory (a sizing choice: model, ctx), an
    OS error on a named file (a folder that cannot be written, a full disk)."""
    if isinstance(e, UserError):
        return str(e)
    torch = sys.modules.get("torch")  # no GPU memory ran out unless torch was loaded
    if torch is not None and isinstance(e, torch.cuda.OutOfMemoryError):
        return f"out of GPU memory ({str(e).splitlines()[0]}); try a smaller model or ctx"
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return None


@contextmanager
def exit_on_error(prog: str):
    """Turn an error in the user's input raised inside the block into ``prog: error: ...`` and exit
    :data:`USAGE_ERROR` (:func:`error_line`); Ctrl-C into exit 130 (whatever was written is complete:
    results are written atomically)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished results are kept, the same command resumes", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _first_line(e: BaseException) -> str:
    """A Hydra error in one line: its first line, its cause's first line (the type error behind "Error
    merging override"), and the options of a missing config group option."""
    first = lambda x: next((ln.strip() for ln in str(x).splitlines() if ln.strip()), type(x).__name__)  # noqa: E731
    parts = [first(e)] + ([first(e.__cause__)] if e.__cause__ is not None else [])
    if getattr(e, "options", None):
        parts.append(f"available: {', '.join(e.options)}")
    return ": ".join(parts)


@dataclass(frozen=True)
class Invocation:
    """A checked command line: Hydra's parsed arguments, every job's overrides and checked config,
    and how many jobs may run on this host's CPU at once (1 under Hydra's basic launcher, joblib's
    worker count, None for another launcher)."""

    prog: str
    config_name: str
    args: Any
    jobs: tuple[tuple[str, ...], ...] = ()
    configs: tuple[Config, ...] = ()
    cpu_workers: int | None = 1
    labels: tuple[str, ...] = ()  # each job's overrides of the keys a multirun sweeps

    @property
    def informational(self) -> bool:
        """Whether Hydra only prints something (--help, --cfg, --info, ...) instead of running jobs."""
        return any(getattr(self.args, flag) for flag in INFO_FLAGS)


def _hydra(config_dir: str | None) -> Hydra:
    """Hydra over the project's configs (and ``--config-dir``, first), as ``hydra.main`` builds it."""
    search_path = create_automatic_config_search_path(None, None, CONFIG_PATH)
    if config_dir is not None:
        folder = os.path.abspath(config_dir)
        if not os.path.isdir(folder):
            raise UserError(f"--config-dir {config_dir}: no such folder")
        search_path.prepend(provider="command-line", path=f"file://{folder}")
    return Hydra.create_main_hydra2(task_name="tileinfer", config_search_path=search_path)


def parse(prog: str, argv: list[str], config_name: str, aliases: dict[str, str] | None = None) -> Invocation:
    """Read ``argv`` once and check every job it names (see the module docstring).

    ``aliases`` spell a setting as a flag (``--update-baseline`` for ``gate.update_baseline=true``).

    Raises:
        UserError: a renamed or misspelled setting, a value out of range, a checkpoint path given as
            ``model=PATH``, an unknown or missing launcher, more joblib workers than GPU slots, an
            empty ``runs_dir`` or one that cannot be written (one line each).
    """
    args = get_args_parser().parse_args([(aliases or {}).get(a, a) for a in argv])
    inv = Invocation(prog, args.config_name or config_name, args)
    if inv.informational:
        return inv
    parsed, hydra = OverridesParser.create().parse_overrides(args.overrides), _hydra(args.config_dir)
    for o in parsed:
        _check_override(o, hydra.config_loader.get_group_options(o.get_key_element()))
    jobs = BasicSweeper.split_arguments(parsed, None)[0] if args.multirun else [list(args.overrides)]
    configs, launcher = [], None
    try:
        for overrides in jobs:
            cfg = hydra.compose_config(inv.config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False)
            launcher = launcher or OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
            with open_dict(cfg):
                del cfg["hydra"]
            configs.append(schema.load(cfg))
    except UserError:
        raise
    except Exception as e:  # Hydra's parse, composition and type errors, in one line
        raise UserError(_launcher_hint(parsed) or _first_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    for cfg in configs:  # Hydra makes its log folder there before any job runs
        if cfg.runs_dir == "":  # its log folder would be /logs/..., at the file system's root
            raise UserError("runs_dir is empty")
        try:
            files.check_writable(cfg.runs_dir)
        except UserError as e:  # name the setting: the folder may come from a default (runs/gate/...)
            raise UserError(f"runs_dir: {e}") from None
    slots = len(gpu_slots.pool())  # also refuses a malformed $TILEINFER_GPUS
    workers = _check_launcher(launcher, slots) if args.multirun else 1
    swept = tuple(f"{o.get_key_element()}=" for o in parsed if o.is_sweep_override())  # as split_arguments writes
    labels = tuple(" ".join(o for o in job if o.startswith(swept)) or "(defaults)" for job in jobs)
    return Invocation(prog, inv.config_name, args, tuple(map(tuple, jobs)), tuple(configs), workers, labels)


def _check_override(o, options: list[str]) -> None:
    """The one-line hints Hydra's errors lack: a renamed setting, a checkpoint path given as
    ``model=PATH``, a config group (whose ``options`` are given) set to a number (``ctx=0``)."""
    key = o.get_key_element().lstrip("+~")
    group = key.split(".", 1)[0]
    if group in RENAMED_GROUPS:
        raise UserError(
            f"{group}.* is now {RENAMED_GROUPS[group]}.*: write {o.input_line.replace(group, RENAMED_GROUPS[group], 1)}"
        )
    values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    if options and any(not isinstance(v, str) for v in values):
        setting = f", or a setting such as {key}.tokens=N" if key == "ctx" else ""
        raise UserError(f"{o.input_line}: {key} takes one of {', '.join(options)}{setting}")
    for v in map(str, values if key == "model" else ()):
        if "/" in v or v.endswith(".gguf") or Path(v).expanduser().exists():
            raise UserError(f"model={v}: a local checkpoint is given as model.path={v}")


def _launcher_hint(parsed) -> str | None:
    """The install hint for a ``hydra/launcher`` (of the parsed overrides) whose plugin is missing."""
    for o in parsed:
        value = o.get_value_element_as_str() if o.get_key_element() == "hydra/launcher" else None
        if value in LAUNCHERS and importlib.util.find_spec(f"hydra_plugins.{LAUNCHERS[value][0]}") is None:
            plugin, extra = LAUNCHERS[value]
            return f'hydra/launcher={value} needs {plugin.replace("_", "-")}: pip install -e ".[{extra}]"'
    return None


def _check_launcher(launcher: dict, slots: int) -> int | None:
    """How many jobs the launcher runs on this host at once: 1 for Hydra's basic launcher, joblib's
    ``n_jobs`` (negative: CPU count + 1 + n_jobs, as joblib counts), None for another launcher.

    Raises:
        UserError: a joblib ``n_jobs`` that is not a positive count or exceeds the ``slots`` of the GPU
            pool: a worker without a slot would wait for ever, as the others keep theirs to the end.
    """
    target = launcher["_target_"]
    if target.endswith(".BasicLauncher"):
        return 1
    if "joblib" not in target:
        return None
    n = int(launcher["n_jobs"])
    workers = n if n > 0 else (os.cpu_count() or 1) + 1 + n
    if n == 0 or workers < 1:
        raise UserError(f"hydra.launcher.n_jobs={n}: expected at least one worker")
    if slots and workers > slots:
        raise UserError(
            f"hydra.launcher.n_jobs={n} starts {workers} workers for {slots} GPU slot(s) of "
            f"{gpu_slots.POOL_VAR}: at most {slots}, or name a GPU twice ({gpu_slots.POOL_VAR}=0,0) for two on it"
        )
    return workers


@dataclass(frozen=True)
class Outcome:
    """What one job returns to the command: its overrides, wall time, the command's result (the
    sweep's and gate's :class:`tileinfer.jobs.job.JobResult`), the command's exit code for it (the
    gate's verdict), or the one-line error that stopped it."""

    overrides: tuple[str, ...]
    wall_s: float
    result: Any = None
    code: int = 0
    error: str | None = None
    sweep_dir: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class JobContext:
    """What a command's job knows of its command line: its overrides, and how many jobs may run on
    this host's CPU at once (:attr:`Invocation.cpu_workers`)."""

    overrides: tuple[str, ...]
    cpu_workers: int | None


Job = Callable[[Config, Any, JobContext], tuple[Any, int]]  # (config, tileinfer.jobs.worker.Worker, context)


def keep_worker_alive() -> None:
    """Lift the leak guard of joblib's loky workers in this process (a no-op elsewhere): a loky worker
    restarts itself once its memory grew 300 MB past its size after its first task, which the caches of
    a worker that loaded a model do, and a restart costs a new process's imports and kernel loads
    (benchmarks/results/h200-2026-12-01-scaling.md)."""
    loky = sys.modules.get("joblib.externals.loky.process_executor")
    if loky is not None:
        loky._MAX_MEMORY_LEAK_SIZE = sys.maxsize


class Task:
    """The function Hydra runs for each job: claims a GPU slot, checks the job's config, runs the
    command's job with this process's :class:`Worker`, prints one line when it starts and one when
    it ends, and returns an :class:`Outcome` (an error in the user's input included, so a multirun
    goes on with its other jobs). Launchers pickle it for their worker processes."""

    def __init__(self, prog: str, job: Job, inv: Invocation):
        self.prog, self.job, self.labels, self.cpu_workers = prog, job, inv.labels, inv.cpu_workers
        from tileinfer.jobs.worker import Worker  # the engine's imports only where a job runs

        self.worker = Worker()
        self.started: float | None = None

    def __call__(self, cfg: DictConfig) -> Outcome:
        gpu_slots.claim()  # first: before anything initialises CUDA
        keep_worker_alive()
        hc = HydraConfig.get()
        overrides = tuple(hc.overrides.task)
        multirun = hc.mode == RunMode.MULTIRUN
        if multirun:
            print(f"=== job {self._progress(hc.job.num)}: {' '.join(overrides)} ===", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result, code = self.job(schema.load(cfg), self.worker, JobContext(overrides, self.cpu_workers))
            out = Outcome(overrides, time.monotonic() - t0, result, code)
        except Exception as e:
            line = error_line(e)
            if line is None:
                raise
            print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
            out = Outcome(overrides, time.monotonic() - t0, error=line)
        if multirun:
            k, n, label = hc.job.num + 1, len(self.labels), self.labels[hc.job.num]
            print(f"job done {k}/{n} (wall {out.wall_s:.1f} s): {label} | {_figures(out)}", flush=True)
            return Outcome(out.overrides, out.wall_s, out.result, out.code, out.error, hc.sweep.dir)
        return out

    def _progress(self, num: int) -> str:
        """``k/N``, and in one process (Hydra's basic launcher) the time so far and a rough estimate of
        the rest (the mean time per job so far; reused rows make it an upper bound)."""
        k, n, now = num + 1, len(self.labels), time.monotonic()
        if self.cpu_workers != 1 or k == 1 or self.started is None:
            self.started = self.started or now
            return f"{k}/{n}" + ("" if self.cpu_workers == 1 else f" in worker pid {os.getpid()}")
        spent = now - self.started
        return f"{k}/{n}; {spent / 60:.1f} min so far, about {spent / (k - 1) * (n - k + 1) / 60:.0f} min left"


FIGURES = (("kl_mean", "mean KL {:.1e}"), ("top1_agree", "top-1 {:.1%}"), ("decode_tok_s", "decode {:.0f} tok/s"))


def _figures(out: Outcome) -> str:
    """``mean KL 2.1e-03, top-1 97.5%, decode 230 tok/s``: the mean of a job's rows' figures, or its error."""
    if out.error is not None:
        return f"error: {out.error}"
    rows = getattr(out.result, "rows", ())
    means = {
        c: sum(r[c] for r in rows) / len(rows) for c, _ in FIGURES if rows and all(r.get(c) is not None for r in rows)
    }
    return ", ".join(text.format(means[c]) for c, text in FIGURES if c in means)


def _terminate(signum, frame) -> None:
    """SIGTERM (kill, timeout, a scheduler) ends the command as Ctrl-C does, so a launcher stops its
    workers (left running otherwise, holding their GPU slots)."""
    raise KeyboardInterrupt


def run(inv: Invocation, job: Job) -> list[Outcome]:
    """Run the checked jobs of ``inv`` through Hydra (its launcher) and return their outcomes in job
    order. A launcher whose jobs print elsewhere (submitit's) gets their progress lines printed here
    when it returns. An informational command line (``--help``, ``--cfg job``) is Hydra's to print."""
    task = Task(inv.prog, job, inv)
    if inv.informational:
        _run_hydra(
            args=inv.args,
            args_parser=get_args_parser(),
            task_function=task,
            config_path=CONFIG_PATH,
            config_name=inv.config_name,
        )
        return []
    signal.signal(signal.SIGTERM, _terminate)
    hydra = _hydra(inv.args.config_dir)
    try:
        if inv.args.multirun:
            batches = hydra.multirun(inv.config_name, task, [*inv.args.overrides, "hydra.mode=MULTIRUN"])
            outcomes = [r.return_value for batch in batches for r in batch]
            for k, (label, out) in enumerate(zip(inv.labels, outcomes) if inv.cpu_workers is None else ()):
                print(f"job done {k + 1}/{len(outcomes)} (wall {out.wall_s:.1f} s): {label} | {_figures(out)}")
            return outcomes
        return [hydra.run(inv.config_name, task, [*inv.args.overrides, "hydra.mode=RUN"]).return_value]
    finally:
        GlobalHydra.instance().clear()


def main(prog: str, argv: list[str], config_name: str, job: Job, finish=None, aliases=None) -> int:
    """Parse, run and finish a Hydra command; return its exit code: the largest of the jobs' codes, 2
    when a job stopped on an error in the user's input. ``finish(outcomes)`` prints what the command
    prints at the end (the sweep's summary)."""
    schema.register()
    with exit_on_error(prog):
        gpu_slots.export_pool()  # the GPUs of this host, for the workers a launcher starts
        inv = parse(prog, argv, config_name, aliases)
        outcomes = run(inv, job)
        if finish is not None and outcomes:
            finish(outcomes)
    failed = [o for o in outcomes if o.error is not None]
    if failed and len(outcomes) > 1:
        print(f"{prog}: {len(failed)} of {len(outcomes)} jobs stopped on an error:", file=sys.stderr)
        for o in failed:
            print(f"  {' '.join(o.overrides) or '(defaults)'}: {o.error}", file=sys.stderr)
    return USAGE_ERROR if failed else max((o.code for o in outcomes), default=0)
