"""GPU slots: each worker process of a sweep takes one GPU for its whole life, before any CUDA call.

Hydra's launchers run a multirun's jobs in worker processes (joblib's loky pool, submitit's local
jobs) and hand each free worker the next job. A worker cannot choose its GPU as ``hydra.job.num % n``:
jobs finish out of order, so with two GPUs job 3 can start while job 1 still runs, and both would
use GPU 1 while GPU 0 idles. A worker also cannot change GPU from one job to the next: CUDA reads
``CUDA_VISIBLE_DEVICES`` once, and the worker keeps its loaded models on that GPU for its next jobs.
And submitit's local executor sets ``CUDA_VISIBLE_DEVICES`` to the same GPUs for every job.

So each worker claims a slot of a pool, once: the first slot whose lock file it can take, held
until the process exits (the operating system frees the lock then, even after a SIGKILL), and sets
``CUDA_VISIBLE_DEVICES`` to that slot's GPU. The pool is ``$TILEINFER_GPUS``, a comma list of GPU
ids as ``CUDA_VISIBLE_DEVICES`` takes them; an id given twice (``0,0``) makes two slots on one GPU,
for two workers sharing it. ``python -m tileinfer.sweep`` sets it (:func:`export_pool`) for the
workers it starts. Lock files are named by GPU id, so two commands of one user on one machine share
the slots: a GPU runs one worker of either at a time, unless its id is repeated in the pool.

Under SLURM (``$SLURM_JOB_ID`` set) nothing is claimed: the scheduler gave the job its GPU, and the
environment a job inherits from the login node says nothing about the compute node.

Imports neither torch nor CUDA: it must run before either is initialised.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from tileinfer.core.errors import UserError

POOL_VAR = "TILEINFER_GPUS"
POLL_S = 2.0  # how often a worker that found every slot taken tries again

_HELD: dict = {}  # this process's slot ("slot") and its lock ("lock"), held until the process exits


@dataclass(frozen=True)
class Slot:
    """A claimed slot: its place in the pool, its GPU id (the value given to ``CUDA_VISIBLE_DEVICES``)
    and how many slots of the pool name that GPU (``0,0``: 2, two workers timing on one GPU)."""

    index: int
    device: str
    workers: int = 1


def pool() -> list[str]:
    """The GPU ids of ``$TILEINFER_GPUS`` in order (empty when unset or empty).

    Raises:
        UserError: an empty entry (``0,,1``) or an id that cannot name a lock file.
    """
    text = os.environ.get(POOL_VAR, "").strip()
    if not text:
        return []
    ids = [d.strip() for d in text.split(",")]
    if any(not re.fullmatch(r"[A-Za-z0-9._:-]+", d) for d in ids):
        raise UserError(f"{POOL_VAR}={text}: expected a comma list of GPU ids (e.g. 0,1; 0,0 for two workers on GPU 0)")
    return ids


def slot_count() -> int:
    """How many workers the pool gives a GPU: its length (1 without a pool, on the CPU). The
    ``hydra/launcher=gpus`` preset starts that many (``${gpu_slots:}``)."""
    return max(1, len(pool()))


def export_pool() -> None:
    """Set ``$TILEINFER_GPUS`` for the worker processes a sweep starts (they inherit it), unless it is
    set already or the command runs under SLURM: the entries of ``$CUDA_VISIBLE_DEVICES`` when that is
    set, else the GPUs ``nvidia-smi -L`` lists. Without a GPU (no ``nvidia-smi``, an empty
    ``CUDA_VISIBLE_DEVICES``) it stays unset, and :func:`claim` claims nothing."""
    if POOL_VAR in os.environ or "SLURM_JOB_ID" in os.environ:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else _listed_gpus()
    if ids:
        os.environ[POOL_VAR] = ",".join(ids)


def _listed_gpus() -> list[str]:
    """Indices of the GPUs ``nvidia-smi -L`` lists (``GPU 0: NVIDIA H200 (UUID: ...)``); none without it."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return re.findall(r"^GPU (\d+):", out, flags=re.MULTILINE)


def lock_dir() -> Path:
    """Where the slot locks live: one folder per user in the temporary folder (``$TMPDIR``)."""
    return Path(tempfile.gettempdir()) / f"tileinfer-gpu-slots-{os.getuid()}"


def claim() -> Slot | None:
    """Claim a GPU slot for this process and set ``CUDA_VISIBLE_DEVICES`` to its GPU; call it before
    anything initialises CUDA. Waits (printing one line, polling every :data:`POLL_S` seconds) while
    every slot is taken. A second call returns the slot already held.

    Returns:
        The slot, or None when there is no pool (no GPU) or under SLURM.

    Raises:
        UserError: a malformed ``$TILEINFER_GPUS`` (:func:`pool`), or a lock folder that cannot be made.
        RuntimeError: CUDA was initialised in this process with other visible devices (a bug: the
            claim came too late to choose the GPU).
    """
    if "slot" in _HELD:
        return _HELD["slot"]
    ids = pool()
    if not ids or "SLURM_JOB_ID" in os.environ:
        return None
    folder = lock_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make the GPU slot folder {folder}: {e.strerror}") from None
    # the n-th occurrence of an id in the pool is lock gpuID.n: pools "0,1" and "1" share GPU 1's lock
    names = [f"gpu{d}.{ids[:i].count(d)}" for i, d in enumerate(ids)]
    waiting = False
    while True:
        for i, (device, name) in enumerate(zip(ids, names, strict=True)):
            lock = FileLock(folder / f"{name}.lock", thread_local=False)
            try:
                lock.acquire(blocking=False)
            except Timeout:
                continue
            (folder / f"{name}.pid").write_text(str(os.getpid()))
            _check_cuda_not_started(device, lock)
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = device
            _HELD.update(slot=Slot(i, device, ids.count(device)), lock=lock)
            was = f", was {before}" if before not in (None, device) else ""  # e.g. submitit's local executor's
            print(
                f"worker pid {os.getpid()}: GPU slot {i} (CUDA_VISIBLE_DEVICES={device}{was})",
                file=sys.stderr,
                flush=True,
            )
            return _HELD["slot"]
        if not waiting:
            pids = ", ".join(_holder(folder / f"{n}.pid") for n in names)
            print(f"waiting for a free GPU slot ({len(ids)} claimed by pids {pids})", file=sys.stderr, flush=True)
            waiting = True
        time.sleep(POLL_S)


def held() -> Slot | None:
    """The slot this process claimed (:func:`claim`), or None."""
    return _HELD.get("slot")


def _holder(pid_file: Path) -> str:
    try:
        return pid_file.read_text().strip() or "?"
    except OSError:
        return "?"


def _check_cuda_not_started(device: str, lock: FileLock) -> None:
    """Raise RuntimeError (releasing ``lock``) when torch already initialised CUDA in this process
    with other visible devices than ``device``: setting the variable now would change nothing."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible != device:
        lock.release()
        raise RuntimeError(
            f"gpu_slots.claim() after CUDA was initialised with CUDA_VISIBLE_DEVICES={visible}: "
            f"call it before any CUDA call to get slot GPU {device}"
        )
