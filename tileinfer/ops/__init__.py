"""Ops: every operation of a forward pass, once per backend, all behind the same signatures.

``reference`` (plain torch, CPU or CUDA) is the ground truth every fast backend is tested against;
``triton`` and ``cutile`` hold the tile kernels. :func:`get_backend` returns a backend module; the
functions it must provide are listed in ``OPS``.
"""

from __future__ import annotations

import importlib
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
    """Import and return the backend module ``tileinfer.ops.<name>``.

    Raises:
        UserError: unknown backend name, or a fast backend whose toolchain is missing.
    """
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(f"tileinfer.ops.{name}")
    except ImportError as e:
        raise UserError(f"backend {name!r} is not available here: {e}") from None
