"""Greedy token choice on the device: argmax over float32 logits, inside a captured decode step.

Chunks of the vocabulary are reduced in parallel (one block per (row, 4096 logits)), then one block
per row merges the chunk winners. No NaN checks (logits are never NaN, and a NaN-propagating argmax
is slower: TileInfer.jl's measurement); ties go to the lowest id as torch.argmax. Sampled decoding
draws with the reference sampler (``tileinfer.ops.reference.sample``), which the engine calls
directly.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileinfer.ops import Workspace
from tileinfer.ops.cutile._common import ConstInt, cdiv, launch, next_pow2, pdl_prologue, scratch

CHUNK = 4096  # logits per block of the first kernel


@ct.kernel
def argmax_partial_kernel(logits, vals, idxs, CH: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    c = ct.bid(1)
    x = ct.reshape(ct.load(logits, (t, c), shape=(1, CH), padding_mode=ct.PaddingMode.NEG_INF), (CH,))
    ct.store(vals, (t, c), ct.max(x))
    ct.store(idxs, (t, c), ct.argmax(x) + c * CH)


@ct.kernel
def argmax_final_kernel(vals, idxs, out, CP: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    v = ct.reshape(ct.load(vals, (t, 0), shape=(1, CP), padding_mode=ct.PaddingMode.NEG_INF), (CP,))
    ix = ct.reshape(ct.load(idxs, (t, 0), shape=(1, CP), padding_mode=ct.PaddingMode.ZERO), (CP,))
    j = ct.argmax(v)  # lowest chunk among equal maxima -> lowest id overall
    sel = ct.sum(ct.where(ct.arange(CP, dtype=ct.int32) == j, ix, 0))
    ct.store(out, (t,), ct.astype(sel, ct.int64))


def argmax(logits: torch.Tensor, *, workspace: Workspace | None = None) -> torch.Tensor:
    """Greedy token per row: logits float32 [T, vocab] -> int64 [T] (lowest id on ties). ``workspace``
    holds the per-chunk partials between calls (None: new ones)."""
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    nc = cdiv(V, CHUNK)
    vals = scratch(workspace, "argmax_v", (T, nc), torch.float32, logits.device)
    idxs = scratch(workspace, "argmax_i", (T, nc), torch.int32, logits.device)
    launch(argmax_partial_kernel, (T, nc, 1), (logits, vals, idxs, CHUNK))
    launch(argmax_final_kernel, (T, 1, 1), (vals, idxs, out, next_pow2(nc)))
    return out
