"""Shared plumbing of the cuTile backend: launching, recording launches, workspaces, dtypes.

Every op wrapper builds its kernel arguments from tensor *shapes* only and hands them to
:func:`launch`. Two consequences the backend relies on:

- A step can be captured in a CUDA graph: no host sync, no data-dependent host branching, and the
  only allocations are the outputs (workspaces are cached per shape, see :func:`workspace`) and,
  in prefill (never captured), the widened copy of an INT8 weight (gemm.INT8_WIDEN_ROWS).
- The same wrappers run on ``meta`` tensors under :func:`recording`: nothing is launched, the
  launches are collected instead. The ahead-of-time compile (``python -m benchmarks.aot
  --backend cutile``) uses that to list, without a GPU, exactly the kernel variants a model needs,
  and the CPU test compiles each for sm_90.
"""

from __future__ import annotations

import contextlib
import math
import os

import cuda.tile as ct
import torch

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

ZERO = ct.PaddingMode.ZERO
NEG_INF = ct.PaddingMode.NEG_INF

# The H200's SM count: what the grid rules aim at where no device is at hand (meta tensors of the
# ahead-of-time compile); a launch on a GPU reads that GPU's count (tileinfer.ops.sm_count).
NUM_SMS = 132

# Programmatic dependent launch (Hopper): each kernel is launched with the PDL attribute, lets its
# successor launch as soon as all its blocks have started (``pdl_prologue``), and waits for its
# predecessor to complete before it reads anything. The successor's launch latency then overlaps
# this kernel's run, also inside a CUDA graph. TILEINFER_CUTILE_PDL=0 turns it off.
PDL = os.environ.get("TILEINFER_CUTILE_PDL", "1") != "0"

_recorder: list | None = None


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tile shapes in cuTile must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(kernel, grid: tuple, args: tuple) -> None:
    """Launch ``kernel`` on the current torch stream, or record it inside :func:`recording`."""
    grid = tuple(int(g) for g in grid)
    if _recorder is not None:
        _recorder.append((kernel, grid, args))
        return
    ct.launch(torch.cuda.current_stream(), grid, kernel, args, programmatic_dependent_launch=PDL)


def pdl_prologue():
    """First statement of every kernel: let the next kernel launch, then wait for the previous one
    to finish (its writes visible). Without the PDL launch attribute both are no-ops. The wait is
    unconditional so completion is transitive: kernel n+2 waiting on n+1 implies n is done."""
    ct.grid_dependency_control_launch_dependents()
    ct.grid_dependency_control_wait()


@contextlib.contextmanager
def recording():
    """Collect ``(kernel, grid, args)`` of every launch instead of running it (meta tensors)."""
    global _recorder
    prev, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = prev


_workspaces: dict = {}


def workspace(name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A scratch tensor reused across calls (split-K partials, split-KV partials).

    Cached per (name, shape, dtype, device) so a step allocates nothing but its outputs and a
    CUDA graph captured after the first call keeps pointing at the same memory. Kernels run in
    stream order, so reuse by the next launch is safe.
    """
    key = (name, tuple(shape), dtype, str(device))
    t = _workspaces.get(key)
    if t is None:
        t = torch.empty(shape, dtype=dtype, device=device)
        _workspaces[key] = t
    return t


def dummy(device, dtype=torch.float32) -> torch.Tensor:
    """A 1-element tensor passed where a kernel's optional input is absent (flag off)."""
    return workspace("dummy", (16,), dtype, device)


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


LOG2E = 1.0 / math.log(2.0)
