"""cuTile backend: every op of ``tileinfer.ops.OPS`` as cuTile Python kernels (pip ``cuda-tile``).

The signatures and numerics are those of :mod:`tileinfer.ops.reference` (the ground truth). One
module per kernel family: ``norms`` (embedding, RMSNorm, add + RMSNorm), ``rope_kv`` (q/k norm +
RoPE + paged K/V write), ``gemm`` (GEMV / skinny GEMM / GEMM, BF16 and INT8, fused SwiGLU,
float32 logits), ``paged_attention`` (paged prefill and split-KV decode flash-attention),
``sampling`` (the greedy argmax); ``tuning`` holds every switch and tile size (one immutable
``Tuning``, ``TUNING`` as shipped) and ``plan`` the pure functions that choose a launch from it.
The module names differ from the op names on purpose: ``from tileinfer.ops.cutile import linear``
must give the op, not a module. Per-kernel notes and measurements: benchmarks/cutile-NOTES.md at
the top of the checkout.

Importing this module without ``cuda.tile`` raises ImportError, which ``get_backend`` turns into
a UserError. The kernels compile on first launch (JIT, cached on disk by cuTile), or ahead of time
(``python -m benchmarks.aot --backend cutile``).
"""

from __future__ import annotations

try:
    import cuda.tile  # noqa: F401
except Exception as e:  # the package, or its native extension, is missing
    raise ImportError(f"cuda.tile (pip package cuda-tile) is not importable: {e}") from None

from tileinfer.ops.cutile.gemm import linear, lm_head, swiglu
from tileinfer.ops.cutile.norms import add_rms_norm, embedding, rms_norm
from tileinfer.ops.cutile.paged_attention import attention
from tileinfer.ops.cutile.rope_kv import qk_norm_rope_kv_write
from tileinfer.ops.cutile.sampling import argmax
from tileinfer.ops.cutile.tuning import TUNING, Tuning

# Every launch path is capturable in a CUDA graph (no allocation outside the graph pool, host sync
# or data-dependent host branching in a step): the runner replays decode steps from one graph.
CUDA_GRAPHS = True

__all__ = [
    "TUNING",
    "Tuning",
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "swiglu",
    "lm_head",
    "qk_norm_rope_kv_write",
    "attention",
    "argmax",
]
