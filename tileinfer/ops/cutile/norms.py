"""Embedding gather, RMSNorm, and residual add fused with RMSNorm (cuTile kernels).

One block per row: a hidden row (576-4096 values in the shipped configs) fits one tile, so each
kernel reads its inputs once and writes its outputs once. Statistics in float32, as the reference.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileinfer.ops import Unsupported
from tileinfer.ops.cutile._common import ZERO, ConstInt, launch, next_pow2, pdl_prologue

# A row wider than this is split into several tiles (embedding) or falls back to the reference (norms).
MAX_ROW_TILE = 8192


@ct.kernel
def embedding_kernel(ids, table, out, TILE: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    j = ct.bid(1)
    i = ct.astype(ct.load(ids, (t,), shape=()), ct.int32)
    row = ct.load(table, (i, j), shape=(1, TILE))
    ct.store(out, (t, j), row)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather rows: ids int [T] -> [T, hidden] in the table's dtype.

    One block per (token, row tile); the id is read on the device (no host sync).
    """
    T, hidden = ids.shape[0], table.shape[1]
    out = torch.empty(T, hidden, dtype=table.dtype, device=table.device)
    if T == 0:
        return out
    tile = min(next_pow2(hidden), 4096)
    launch(embedding_kernel, (T, -(-hidden // tile), 1), (ids, table, out, tile))
    return out


@ct.kernel
def rms_norm_kernel(x, w, out, eps: float, w_rows: int, N_TILE: ConstInt):
    """out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w[r % w_rows] (Zhang & Sennrich, 2019)."""
    pdl_prologue()
    r = ct.bid(0)
    xf = ct.astype(ct.load(x, (r, 0), shape=(1, N_TILE), padding_mode=ZERO), ct.float32)
    n = x.shape[1]
    inv = ct.rsqrt(ct.sum(xf * xf, axis=1, keepdims=True) / n + eps)
    wf = ct.astype(ct.load(w, (r % w_rows, 0), shape=(1, N_TILE), padding_mode=ZERO), ct.float32)
    ct.store(out, (r, 0), ct.astype((xf * inv) * wf, out.dtype))


@ct.kernel
def add_rms_norm_kernel(x, res, w, out, sum_out, eps: float, N_TILE: ConstInt):
    """sum_out = round(x + res); out = rms_norm(sum_out) * w, one row per block."""
    pdl_prologue()
    r = ct.bid(0)
    a = ct.astype(ct.load(x, (r, 0), shape=(1, N_TILE), padding_mode=ZERO), ct.float32)
    b = ct.astype(ct.load(res, (r, 0), shape=(1, N_TILE), padding_mode=ZERO), ct.float32)
    s = ct.astype(a + b, x.dtype)  # rounded to the model dtype, as transformers does
    ct.store(sum_out, (r, 0), s)
    sf = ct.astype(s, ct.float32)
    n = x.shape[1]
    inv = ct.rsqrt(ct.sum(sf * sf, axis=1, keepdims=True) / n + eps)
    wf = ct.astype(ct.load(w, (0, 0), shape=(1, N_TILE), padding_mode=ZERO), ct.float32)
    ct.store(out, (r, 0), ct.astype((sf * inv) * wf, out.dtype))


def _weight_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as [W, n] with row r of x (flattened to [R, n]) using row r % W, or None."""
    n = x.shape[-1]
    if weight.numel() == n:
        return weight.reshape(1, n)
    if (
        weight.dim() >= 2
        and x.dim() >= 2
        and tuple(weight.shape[-2:]) == tuple(x.shape[-2:])
        and weight.numel() == x.shape[-2] * n
    ):
        return weight.reshape(-1, n)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis: x [..., n] -> [..., n] in x's dtype, statistics in float32.

    weight: [n], or [heads, n] for x [..., heads, n] (per-head norms after key smoothing).

    Raises:
        Unsupported: other broadcast shapes of the weight, and rows wider than 8192.
    """
    n = x.shape[-1]
    w2 = _weight_rows(x, weight)
    if w2 is None:
        raise Unsupported(f"weight {tuple(weight.shape)} is neither [n] nor [heads, n]")
    if n > MAX_ROW_TILE:
        raise Unsupported(f"rows of {n} > {MAX_ROW_TILE} values")
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        launch(rms_norm_kernel, (x2.shape[0], 1, 1), (x2, w2, out, float(eps), int(w2.shape[0]), next_pow2(n)))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add fused with the next RMSNorm: ``(rms_norm(x + residual), x + residual)``.

    x, residual: [T, hidden] in the model dtype; weight [hidden]. The sum is rounded to the model
    dtype before it is normalised (transformers' order). Both outputs [T, hidden] in x's dtype.
    One read of x and residual, one write of each output (TileInfer.jl's fused add + norm).

    Raises:
        Unsupported: another weight shape, or rows wider than 8192.
    """
    n = x.shape[-1]
    if weight.numel() != n:
        raise Unsupported(f"weight {tuple(weight.shape)} is not [n]")
    if n > MAX_ROW_TILE:
        raise Unsupported(f"rows of {n} > {MAX_ROW_TILE} values")
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        launch(
            add_rms_norm_kernel, (x2.shape[0], 1, 1), (x2, r2, weight.reshape(1, n), out, s, float(eps), next_pow2(n))
        )
    return out.view(x.shape), s.view(x.shape)
