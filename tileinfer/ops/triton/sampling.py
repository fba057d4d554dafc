"""Greedy token choice on the device: argmax over float32 logits, inside a captured decode step.

Two kernels, neither synchronising with the host: chunks of the vocabulary reduce to (max, lowest
index at the max) in parallel, then one program per row merges the chunks (ties resolve to the
lowest id, as torch). Sampled decoding draws on the host side with the reference sampler
(``tileinfer.ops.reference.sample``), which the engine calls directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileinfer.ops import Unsupported
from tileinfer.ops.triton._common import cdiv, next_pow2, pdl_launch, pdl_prologue

ARGMAX_CHUNK = 4096  # logits per program of the first kernel


@triton.jit
def _argmax_partial_kernel(x_ptr, pv_ptr, pi_ptr, V, S, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
    m = tl.max(x, axis=0)
    i = tl.min(tl.where((x == m) & (offs < V), offs, 2147483647), axis=0)
    tl.store(pv_ptr + row * S + c, m)
    tl.store(pi_ptr + row * S + c, i)


@triton.jit
def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, S, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    v = tl.load(pv_ptr + row * S + s, mask=s < S, other=float("-inf"))
    i = tl.load(pi_ptr + row * S + s, mask=s < S, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token per row: logits float32 [T, vocab] -> int64 [T] (lowest id on ties).

    Raises:
        Unsupported: rows that are not contiguous.
    """
    if logits.stride(1) != 1:
        raise Unsupported("logits rows not contiguous")
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    S = cdiv(V, ARGMAX_CHUNK)
    pv = torch.empty((T, S), dtype=torch.float32, device=logits.device)
    pi = torch.empty((T, S), dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(T, S)](
        logits, pv, pi, V, S, logits.stride(0), CHUNK=ARGMAX_CHUNK, num_warps=8, **pdl_launch(logits)
    )
    _argmax_final_kernel[(T,)](pv, pi, out, S, BLOCK_S=next_pow2(S), num_warps=1, **pdl_launch(pv))
    return out
