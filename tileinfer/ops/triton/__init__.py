"""Triton backend: every op of ``tileinfer.ops.OPS`` as hand-written Triton kernels.

Signatures and semantics are those of :mod:`tileinfer.ops.reference` (the ground truth the tests
compare against). One module per kernel family:

* :mod:`.norms` - embedding gather, RMSNorm, residual add fused with RMSNorm;
* :mod:`.rope_kv` - q/k RMSNorm + RoPE + paged K/V write (BF16 or INT8 with per-vector scales);
* :mod:`.gemm` - GEMV (1-16 rows) and GEMM (prefill), BF16 and INT8 weights, SwiGLU and
  float32-logit epilogues;
* :mod:`.paged_attention` - paged flash-attention: causal prefill, split-KV decode + combine;
* :mod:`.sampling` - the greedy argmax on the device (sampled decoding uses the reference sampler);
* :mod:`.tuning` - every tile table and switch, one immutable :class:`Tuning` (``TUNING`` as shipped),
  and :mod:`.plan` - the pure functions that choose a launch's tiles and grid from it;
* ahead-of-time compile for sm_90 without a GPU (the CI check): ``python -m benchmarks.aot --backend triton``.

CUDA graphs: no op reads a device value on the host or branches on one; grid sizes depend only on
shapes (token count, heads, the block table's length). The ops allocate their outputs and, where a
second kernel merges partial results (split-KV decode, argmax), a small workspace with
``torch.empty`` - which the caching allocator serves from the graph's private pool during capture.
Stream-K GEMMs (prefill only) keep their partials and flags in the Backend's workspace.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on the CPU.
"""

from tileinfer.ops.triton.gemm import linear, lm_head, swiglu
from tileinfer.ops.triton.norms import add_rms_norm, embedding, rms_norm
from tileinfer.ops.triton.paged_attention import attention
from tileinfer.ops.triton.rope_kv import qk_norm_rope_kv_write
from tileinfer.ops.triton.sampling import argmax
from tileinfer.ops.triton.tuning import TUNING, Tuning

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
