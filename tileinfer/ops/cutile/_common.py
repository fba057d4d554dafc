"""Shared plumbing of the cuTile backend: launching, scratch buffers, dtypes.

Every op wrapper builds its kernel arguments from tensor *shapes* only and hands them to
:func:`launch`. Two consequences the backend relies on:

- A step can be captured in a CUDA graph: no host sync, no data-dependent host branching, and the
  only allocations are the outputs (scratch buffers are kept per shape in the Backend's
  :class:`~tileinfer.ops.Workspace`, see :func:`scratch`) and, in prefill (never captured), the
  widened copy of an INT8 weight (``Tuning.int8_widen_rows``).
- The same wrappers run on ``meta`` tensors: the ahead-of-time compile (``python -m benchmarks.aot
  --backend cutile``) records the launches (it stands in for ``cuda.tile.launch``) to list, without
  a GPU, exactly the kernel variants a model needs, and the CPU test compiles each for sm_90.
"""

from __future__ import annotations

import math
import os

import cuda.tile as ct
import torch

from tileinfer.ops.workspace import Workspace

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

ZERO = ct.PaddingMode.ZERO
NEG_INF = ct.PaddingMode.NEG_INF

# Programmatic dependent launch (Hopper): each kernel is launched with the PDL attribute, lets its
# successor launch as soon as all its blocks have started (``pdl_prologue``), and waits for its
# predecessor to complete before it reads anything. The successor's launch latency then overlaps
# this kernel's run, also inside a CUDA graph. TILEINFER_CUTILE_PDL=0 turns it off.
PDL = os.environ.get("TILEINFER_CUTILE_PDL", "1") != "0"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tile shapes in cuTile must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(kernel, grid: tuple, args: tuple) -> None:
    """Launch ``kernel`` over ``grid`` on the current torch CUDA stream (with the PDL attribute, see
    :data:`PDL`); when its tensors are not on a GPU (meta) no stream is named."""
    grid = tuple(int(g) for g in grid)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    stream = torch.cuda.current_stream() if device.type == "cuda" else None
    ct.launch(stream, grid, kernel, args, programmatic_dependent_launch=PDL)


def pdl_prologue():
    """First statement of every kernel: let the next kernel launch, then wait for the previous one
    to finish (its writes visible). Without the PDL launch attribute both are no-ops. The wait is
    unconditional so completion is transitive: kernel n+2 waiting on n+1 implies n is done."""
    ct.grid_dependency_control_launch_dependents()
    ct.grid_dependency_control_wait()


def scratch(workspace: Workspace | None, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A scratch tensor (split-K and split-KV partials, argmax partials) kept in ``workspace`` per
    (name, shape, dtype, device), so a step allocates nothing but its outputs and a CUDA graph
    captured after the first call keeps pointing at the same memory; kernels run in stream order,
    so reuse by the next launch is safe. Without a workspace: a new tensor."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = ("cutile", name, tuple(shape), dtype, str(device))
    return workspace.get(key, lambda: torch.empty(shape, dtype=dtype, device=device))


def dummy(workspace: Workspace | None, device, dtype=torch.float32) -> torch.Tensor:
    """A 16-element tensor passed where a kernel's optional input is absent (flag off)."""
    return scratch(workspace, "dummy", (16,), dtype, device)


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


LOG2E = 1.0 / math.log(2.0)
