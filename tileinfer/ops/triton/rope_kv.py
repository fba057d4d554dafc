"""Attention prologue in one kernel: per-head q/k RMSNorm, RoPE, and the K/V write into the pages.

One program per (token, head) of q, k and v together (grid [T, heads + kv_heads]): a q program
normalises and rotates its head and writes the rotated q; a kv program does the same to its key
head, then writes the key and the value into slot ``pos % page_size`` of page
``block_table[pos // page_size]`` (PagedAttention's layout), quantising each vector to INT8 with its
own float32 scale when the cache is INT8. This is TileInfer.jl's fused prologue: q, k and v are read
once from the qkv GEMM output and nothing intermediate touches memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Unsupported
from tileinfer.ops.triton._common import cast, pdl_launch, pdl_prologue, rint_f32


@triton.jit
def _norm_rope(x_ptr, nw_ptr, cos, sin, offs, eps, HEAD_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Load one head's two halves, RMSNorm it (optional) and rotate it; float32 halves back.

    The rounding points follow the reference: the normalised head is rounded to the model dtype
    before RoPE, as two separate ops would store it.
    """
    HALF: tl.constexpr = HEAD_D // 2
    x1 = tl.load(x_ptr + offs)
    x2 = tl.load(x_ptr + HALF + offs)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_D + eps)
        w1 = tl.load(nw_ptr + offs).to(tl.float32)
        w2 = tl.load(nw_ptr + HALF + offs).to(tl.float32)
        x1 = cast(x1 * rstd * w1, dt).to(tl.float32)
        x2 = cast(x2 * rstd * w2, dt).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _quant_store(v_ptr, s_ptr, x1, x2, offs, HALF: tl.constexpr):
    """Symmetric INT8 of one vector: scale = max|x| / 127, q = round-half-even(x / scale)."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=0), tl.max(tl.abs(x2), axis=0))
    scale = tl.math.div_rn(amax, 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    q1 = tl.clamp(rint_f32(tl.math.div_rn(x1, safe)), -127.0, 127.0)
    q2 = tl.clamp(rint_f32(tl.math.div_rn(x2, safe)), -127.0, 127.0)
    tl.store(v_ptr + offs, q1.to(tl.int8))
    tl.store(v_ptr + HALF + offs, q2.to(tl.int8))
    tl.store(s_ptr, scale)


@triton.jit(do_not_specialize=["N_HEADS"])
def _qk_norm_rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qn_ptr,
    kn_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    bt_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qn,
    stride_kn,
    stride_cos,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    stride_ss,
    eps,
    N_HEADS,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    INT8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    HALF: tl.constexpr = HEAD_D // 2
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + offs)
    sin = tl.load(sin_ptr + pos * stride_cos + offs)
    if j < N_HEADS:
        o1, o2 = _norm_rope(
            q_ptr + t * stride_qt + j * stride_qh, qn_ptr + j * stride_qn, cos, sin, offs, eps, HEAD_D, HAS_NORM
        )
        out = qo_ptr + t * stride_ot + j * stride_oh
        tl.store(out + offs, cast(o1, qo_ptr.dtype.element_ty))
        tl.store(out + HALF + offs, cast(o2, qo_ptr.dtype.element_ty))
    else:
        h = j - N_HEADS
        k1, k2 = _norm_rope(
            k_ptr + t * stride_kt + h * stride_kh, kn_ptr + h * stride_kn, cos, sin, offs, eps, HEAD_D, HAS_NORM
        )
        # the rotated key is rounded to the model dtype first, as the reference hands it on
        kdt = k_ptr.dtype.element_ty
        k1 = cast(k1, kdt).to(tl.float32)
        k2 = cast(k2, kdt).to(tl.float32)
        v1 = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs).to(tl.float32)
        v2 = tl.load(v_ptr + t * stride_vt + h * stride_vh + HALF + offs).to(tl.float32)
        page = tl.load(bt_ptr + pos // PAGE).to(tl.int64)
        slot = pos % PAGE
        c_off = page * stride_cp + h * stride_ch + slot * stride_cs
        s_off = page * stride_sp + h * stride_sh + slot * stride_ss
        if INT8:
            _quant_store(kc_ptr + c_off, ks_ptr + s_off, k1, k2, offs, HALF)
            _quant_store(vc_ptr + c_off, vs_ptr + s_off, v1, v2, offs, HALF)
        else:
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + c_off + offs, cast(k1, cdt))
            tl.store(kc_ptr + c_off + HALF + offs, cast(k2, cdt))
            tl.store(vc_ptr + c_off + offs, cast(v1, cdt))
            tl.store(vc_ptr + c_off + HALF + offs, cast(v2, cdt))


def _norm_stride(w, heads: int, d: int) -> int | None:
    """Stride between the heads' rows of a norm weight ([d]: 0, shared; [heads, d] with contiguous
    rows), None for other shapes."""
    if w.numel() == d:
        return 0
    if w.numel() == heads * d and w.shape[-2:] == (heads, d) and w.stride(-1) == 1:
        return w.stride(-2)
    return None


def _unsupported(q, k, v, q_norm, k_norm, cos_table, sin_table, layer: KVLayer) -> str | None:
    """Why the kernel cannot take these inputs, or None: it needs a power-of-two head_dim, contiguous
    head vectors, norm weights [d] or [heads, d], and K and V pools (and scales) of one layout."""
    d = q.shape[2]
    if d % 2 or d & (d - 1):
        return f"head_dim {d} is not a power of two"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "q, k or v head vectors not contiguous"
    if cos_table.stride(1) != 1 or sin_table.stride() != cos_table.stride():
        return "cos/sin tables not contiguous rows of one layout"
    if q_norm is not None and (
        _norm_stride(q_norm, q.shape[1], d) is None or _norm_stride(k_norm, k.shape[1], d) is None
    ):
        return f"q/k norm weights {tuple(q_norm.shape)} / {tuple(k_norm.shape)} are not [d] or contiguous [heads, d]"
    if layer.k.stride() != layer.v.stride() or layer.k.stride(3) != 1:
        return "K and V pages of different layouts or with non-contiguous vectors"
    if layer.int8 and layer.k_scale.stride() != layer.v_scale.stride():
        return "K and V scales of different layouts"
    return None


def qk_norm_rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    layer: KVLayer,
    block_table: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Per-head q/k RMSNorm (when given) + RoPE (rotate-half) + K/V write into the pages, one launch.

    q: [T, heads, d]; k, v: [T, kv_heads, d] (strided views of the qkv GEMM output are fine, the
    last axis contiguous); q_norm/k_norm: [d] or [heads|kv_heads, d] or None; cos_table/sin_table:
    float32 [max_positions, d/2]; block_table int [max_pages]; positions int [T] (on the device,
    read by the kernel). An INT8 layer gets int8 values and a float32 scale max|x|/127 per vector
    (round half to even). Returns the rotated q, [T, heads, d] contiguous, in q's dtype.

    Raises:
        Unsupported: inputs outside the kernel's domain (see :func:`_unsupported`), before any write.
    """
    why = _unsupported(q, k, v, q_norm, k_norm, cos_table, sin_table, layer)
    if why:
        raise Unsupported(why)
    T, H, d = q.shape
    KVH = k.shape[1]
    q_out = torch.empty((T, H, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    has_norm = q_norm is not None
    qn = q_norm if has_norm else q_out
    kn = k_norm if has_norm else q_out
    sqn = _norm_stride(q_norm, H, d) if has_norm else 0
    skn = _norm_stride(k_norm, KVH, d) if has_norm else 0
    kc, vc = layer.k, layer.v
    ks = layer.k_scale if layer.int8 else kc
    vs = layer.v_scale if layer.int8 else kc
    sp, sh, ss = (ks.stride(0), ks.stride(1), ks.stride(2)) if layer.int8 else (0, 0, 0)
    _qk_norm_rope_kv_kernel[(T, H + KVH)](
        q,
        k,
        v,
        qn,
        kn,
        cos_table,
        sin_table,
        positions,
        block_table,
        q_out,
        kc,
        vc,
        ks,
        vs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        sqn,
        skn,
        cos_table.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        sp,
        sh,
        ss,
        float(eps),
        N_HEADS=H,
        HEAD_D=d,
        PAGE=layer.page_size,
        HAS_NORM=has_norm,
        INT8=layer.int8,
        num_warps=1 if d <= 64 else 2,
        **pdl_launch(q),
    )
    return q_out
