"""Embedding gather, RMSNorm, and the residual add fused with the next RMSNorm.

One program per token row: the row (at most a few thousand elements) is loaded once, its
statistics are reduced in float32 in registers, and it is written once, so these kernels move the
minimum bytes (TileInfer.jl's fused ``add_rms_norm``: one read of x and residual, one write of the
sum and of the normalised row, instead of three passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileinfer.ops import Unsupported
from tileinfer.ops.triton._common import cast, next_pow2, pdl_launch, pdl_prologue


@triton.jit
def _embedding_kernel(
    ids_ptr, table_ptr, out_ptr, H, stride_t, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_prologue(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * stride_o + offs, tl.load(table_ptr + row * stride_t + offs, mask=m), mask=m)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather rows of the embedding table: ids int [T] -> [T, hidden] in the table's dtype.

    Raises:
        Unsupported: a table whose rows are not contiguous.
    """
    if table.stride(1) != 1:
        raise Unsupported("table rows not contiguous")
    T, H = ids.shape[0], table.shape[1]
    out = torch.empty((T, H), dtype=table.dtype, device=table.device)
    if T == 0:
        return out
    block = min(next_pow2(H), 2048)
    _embedding_kernel[(T, triton.cdiv(H, block))](
        ids, table, out, H, table.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl_launch(ids)
    )
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    n,
    w_rows,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    stride_w,
    eps,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        # the sum is rounded to the residual stream's dtype before it is normalised (transformers)
        r = tl.load(r_ptr + row * stride_r + offs, mask=m, other=0.0)
        s = cast(x.to(tl.float32) + r.to(tl.float32), s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + offs, s, mask=m)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + (row % w_rows) * stride_w + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, cast(xf * rstd * w, y_ptr.dtype.element_ty), mask=m)


def _weight_rows(weight: torch.Tensor, x_shape, n: int):
    """Weight as [R, n] with row ``i % R`` for x row i, or None when that cannot express the broadcast."""
    w = weight
    while w.dim() > 1 and w.shape[0] == 1:
        w = w[0]
    if w.numel() == n:
        return w.reshape(1, n)
    if w.dim() >= 2 and tuple(x_shape[-w.dim() :]) == tuple(w.shape):
        return w.reshape(-1, n)
    return None


def _launch_norm(x, residual, weight, eps):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise Unsupported("rows not contiguous")
    rows = x2.shape[0]
    w2 = _weight_rows(weight, x.shape, n)
    if w2 is None:  # unusual broadcast: materialise it (not on the model's paths)
        w2 = torch.broadcast_to(weight, x.shape).reshape(-1, n).contiguous()
    if w2.stride(-1) != 1:
        w2 = w2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    if residual is not None:
        s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        s2 = s.view(-1, n)
    else:
        s2 = s = x2
    if rows == 0:
        return y, (s if residual is not None else None)
    block = next_pow2(n)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(rows,)](
        x2,
        r2,
        w2,
        y2,
        s2,
        n,
        w2.shape[0],
        x2.stride(0),
        r2.stride(0),
        y2.stride(0),
        s2.stride(0),
        w2.stride(0),
        float(eps),
        BLOCK=block,
        HAS_RES=residual is not None,
        num_warps=warps,
        **pdl_launch(x2),
    )
    return y, (s if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) over the last axis: ``x / sqrt(mean(x²) + eps) * weight``.

    x: [..., n]; weight: [n], or [..., n] matching x's trailing axes (one row per head). Statistics
    in float32; output in x's dtype. One program per row.

    Raises:
        Unsupported: rows that are not contiguous (last-axis stride != 1).
    """
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add fused with the next RMSNorm: ``(rms_norm(x + residual), x + residual)``.

    x, residual: [T, hidden] in the model dtype; the sum is rounded to that dtype before it is
    normalised and returned as the next residual. One read of each input, one write of each output.

    Raises:
        Unsupported: rows that are not contiguous.
    """
    return _launch_norm(x, residual, weight, eps)
