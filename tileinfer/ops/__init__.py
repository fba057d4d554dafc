"""Ops: every operation of a forward pass, once per backend, all behind the same signatures.

``reference`` (plain torch, CPU or CUDA) is the ground truth every fast backend is tested against;
``triton`` and ``cutile`` hold the tile kernels. :func:`get_backend` returns a backend module and
checks that it provides every function of ``OPS``. tests/ops/ holds one conformance suite per op
family, parametrized over the backends: a new backend is one that passes it.

Fallback policy, the same for every fast backend: each op states the inputs its kernels handle
(shapes, dtypes, layouts). Given any other input it calls :func:`fallback` and returns the
reference op's result, never silently: the entry "backend.op: reason" is logged once (a warning
on the ``tileinfer.ops`` logger) and recorded until :func:`reset_fallbacks`, and a job writes
:func:`fallbacks` into its result row, so a measurement that ran torch for some op says so. An
input the reference rejects too (mismatched shapes) is an error, not a fallback. The reference
backend never falls back. The shipped models' shapes stay inside every kernel's domain; the op
tests fail on any fallback they did not ask for.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

from tileinfer.core.errors import UserError

BACKENDS = ("reference", "triton", "cutile")

# The op signatures every backend implements (see tileinfer.ops.reference for the contracts).
OPS = (
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "swiglu",
    "lm_head",
    "qk_norm_rope_kv_write",
    "attention",
    "argmax",
    "sample",
)


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


def get_backend(name: str):
    """Import and return the backend module ``tileinfer.ops.<name>``, which provides every op of ``OPS``.

    Raises:
        UserError: unknown backend name, or a fast backend whose toolchain is missing.
        NotImplementedError: the module lacks some op of ``OPS`` (or has a non-callable in its place);
            the message names them.
    """
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        module = importlib.import_module(f"tileinfer.ops.{name}")
    except ImportError as e:
        raise UserError(f"backend {name!r} is not available here: {e}") from None
    missing = [op for op in OPS if not callable(getattr(module, op, None))]
    if missing:
        raise NotImplementedError(
            f"backend {name!r} (tileinfer.ops.{name}) lacks the ops {', '.join(missing)} "
            "that tileinfer.ops.OPS requires of every backend"
        )
    return module


_SMS: dict = {}


def sm_count(device: torch.device, default: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (read once per device), else ``default``: what a
    backend's grid rules assume where no GPU is at hand (meta tensors of the ahead-of-time compiles)."""
    if device.type != "cuda":
        return default
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


_FALLBACKS: set[str] = set()  # "backend.op: reason" of every fallback since reset_fallbacks()


def fallback(backend: str, op: str, reason: str) -> None:
    """Record that ``backend``'s ``op`` ran the reference op instead, because of ``reason`` (what about
    the input its kernels do not handle); logged as a warning once per distinct entry.

    The caller returns the reference op's result. ``reason`` names fixed properties (a head_dim, a
    dtype, a layout), not per-call values, so a run records one entry per cause.
    """
    entry = f"{backend}.{op}: {reason}"
    if entry not in _FALLBACKS:
        logging.getLogger(__name__).warning("fallback to the reference op: %s", entry)
        _FALLBACKS.add(entry)


def fallbacks() -> list[str]:
    """The fallbacks recorded since :func:`reset_fallbacks` (or the start), sorted: "backend.op: reason"."""
    return sorted(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget the recorded fallbacks (a job calls this before the run it reports on); an entry seen
    again is logged again."""
    _FALLBACKS.clear()
