"""Ops: every operation of a forward pass, once per backend, all behind the same signatures.

``reference`` (plain torch, CPU or CUDA) is the ground truth every fast backend is tested against;
``triton`` and ``cutile`` hold the tile kernels. :func:`get_backend` returns a new :class:`Backend`:
every op of ``OPS`` as an attribute, and the instance's own fallback record and workspace.
tests/ops/ holds one conformance suite per op family, parametrized over the backends: a new backend
is one that passes it.

Fallback policy, the same for every fast backend: each op states the inputs its kernels handle
(shapes, dtypes, layouts). Given any other input it raises :class:`Unsupported` before launching
anything, and the :class:`Backend` returns the reference op's result instead, never silently: the
entry "backend.op: reason" is logged once (a warning on the ``tileinfer.ops`` logger) and recorded
until ``Backend.reset_fallbacks()``, and a job writes ``Backend.fallbacks()`` into its result row,
so a measurement that ran torch for some op says so. An input the reference rejects too
(mismatched shapes) is an error, not a fallback. The reference backend never falls back. The
shipped models' shapes stay inside every kernel's domain; the op tests fail on any fallback they did
not ask for.

Tuning: a fast backend's tile tables and switches are one immutable object, its ``TUNING``
(``tileinfer/ops/<backend>/tuning.py``), which its ops take as an argument; a Backend holds one
(``Backend.with_tuning`` makes another). Grid rules aim at the device's SM count
(:func:`sm_count`) unless the tuning names one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tileinfer.ops.backend import (
    BACKENDS,
    OPS,
    Backend,
    Unsupported,
    get_backend,
)
from tileinfer.ops.workspace import Workspace

__all__ = [
    "BACKENDS",
    "DEFAULT_SMS",
    "OPS",
    "Backend",
    "Int8Weight",
    "Unsupported",
    "Workspace",
    "get_backend",
    "sm_count",
]


@dataclass
class Int8Weight:
    """A linear layer's weight in symmetric INT8 with one float32 scale per output channel.

    ``w ≈ q * scale[:, None]`` with ``scale = max|w_row| / 127`` (TileInfer.jl's weight-only INT8,
    after the LLM.int8()/SmoothQuant per-channel scheme).

    Attributes:
        q: int8 [out_features, in_features], values in [-127, 127].
        scale: float32 [out_features].
    """

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def to(self, device) -> "Int8Weight":
        return Int8Weight(self.q.to(device), self.scale.to(device))


# The H200's SM count: what the grid rules plan for where no GPU is at hand (meta tensors, as in the
# ahead-of-time compile, which names it explicitly; tensors on the CPU, as in Triton's interpreter).
DEFAULT_SMS = 132


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (read once per device), else :data:`DEFAULT_SMS`."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
