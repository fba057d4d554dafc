"""Attention prologue in one kernel: per-head q/k RMSNorm, RoPE, and the paged K/V write.

One block per token. The block loads all q heads and all k/v heads of its token as two halves
``[heads, d/2]`` (the rotate-half pairs are (i, i + d/2), so RoPE needs no shuffles), normalises,
rotates, stores q, and writes k and v into slot ``pos % page_size`` of page
``block_table[pos // page_size]``. For an INT8 cache it also computes each vector's scale
``max|x| / 127`` and rounds half to even (TileInfer.jl fuses the same three stages; the page layout
is PagedAttention's, Kwon et al. 2023).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Unsupported, Workspace
from tileinfer.ops.cutile._common import ZERO, ConstBool, ConstInt, dummy, is_pow2, launch, next_pow2, pdl_prologue

# 1.5 * 2**23: adding and subtracting it rounds a float32 |x| < 2**22 to the nearest integer,
# ties to even (IEEE round-to-nearest), which is torch.round's rule.
_RNE_MAGIC = 12582912.0


def _norm_rope(x1, x2, w1, w2, c, s, eps, D, HAS_NORM, dt):
    """RMSNorm (optional) then RoPE on the two halves [1, heads, D/2] (float32 in, float32 out).

    Each stage's result is rounded to the model dtype ``dt`` as the reference does (its norm and
    its rope each return the model dtype).
    """
    if HAS_NORM:
        ss = ct.sum(x1 * x1, axis=2, keepdims=True) + ct.sum(x2 * x2, axis=2, keepdims=True)
        inv = ct.rsqrt(ss / D + eps)
        x1 = ct.astype(ct.astype(x1 * inv * w1, dt), ct.float32)
        x2 = ct.astype(ct.astype(x2 * inv * w2, dt), ct.float32)
    o1 = ct.astype(ct.astype(x1 * c - x2 * s, dt), ct.float32)
    o2 = ct.astype(ct.astype(x2 * c + x1 * s, dt), ct.float32)
    return o1, o2


def _load_norm_w(w, HP, HALF, PER_HEAD, half):
    """Norm weight half as a tile broadcastable to [1, HP, HALF]."""
    if PER_HEAD:
        t = ct.load(w, (0, half), shape=(HP, HALF), padding_mode=ZERO)
        return ct.reshape(ct.astype(t, ct.float32), (1, HP, HALF))
    t = ct.load(w, (0, half), shape=(1, HALF), padding_mode=ZERO)
    return ct.reshape(ct.astype(t, ct.float32), (1, 1, HALF))


def _quantize(x1, x2, KP):
    """Symmetric INT8 of each head vector (halves [1, KP, HALF]): int8 halves, scale [1, KP, 1]."""
    amax = ct.maximum(ct.max(ct.abs(x1), axis=2, keepdims=True), ct.max(ct.abs(x2), axis=2, keepdims=True))
    # IEEE divisions (not the approximate ones), as the reference's tensor / tensor on any device
    scale = ct.truediv(amax, 127.0, rounding_mode=ct.RoundingMode.RN)
    safe = ct.where(scale > 0.0, scale, 1.0)
    y1 = ct.truediv(x1, safe, rounding_mode=ct.RoundingMode.RN)
    y2 = ct.truediv(x2, safe, rounding_mode=ct.RoundingMode.RN)
    q1 = ct.minimum(ct.maximum((y1 + _RNE_MAGIC) - _RNE_MAGIC, -127.0), 127.0)
    q2 = ct.minimum(ct.maximum((y2 + _RNE_MAGIC) - _RNE_MAGIC, -127.0), 127.0)
    return ct.astype(q1, ct.int8), ct.astype(q2, ct.int8), scale


@ct.kernel
def qk_norm_rope_kv_kernel(
    q,
    k,
    v,
    qn,
    kn,
    cos,
    sin,
    kc,
    vc,
    ks,
    vs,
    bt,
    pos,
    q_out,
    eps: float,
    HP: ConstInt,
    KP: ConstInt,
    HALF: ConstInt,
    PS: ConstInt,
    HAS_NORM: ConstBool,
    Q_PER_HEAD: ConstBool,
    K_PER_HEAD: ConstBool,
    INT8: ConstBool,
):
    pdl_prologue()
    t = ct.bid(0)
    p = ct.load(pos, (t,), shape=())
    D = 2 * HALF
    dt = q.dtype
    c = ct.reshape(ct.load(cos, (p, 0), shape=(1, HALF)), (1, 1, HALF))
    s = ct.reshape(ct.load(sin, (p, 0), shape=(1, HALF)), (1, 1, HALF))

    # q: norm + rope, stored to q_out
    q1 = ct.astype(ct.load(q, (t, 0, 0), shape=(1, HP, HALF), padding_mode=ZERO), ct.float32)
    q2 = ct.astype(ct.load(q, (t, 0, 1), shape=(1, HP, HALF), padding_mode=ZERO), ct.float32)
    qw1 = _load_norm_w(qn, HP, HALF, Q_PER_HEAD, 0)
    qw2 = _load_norm_w(qn, HP, HALF, Q_PER_HEAD, 1)
    q1, q2 = _norm_rope(q1, q2, qw1, qw2, c, s, eps, D, HAS_NORM, dt)
    ct.store(q_out, (t, 0, 0), ct.astype(q1, q_out.dtype))
    ct.store(q_out, (t, 0, 1), ct.astype(q2, q_out.dtype))

    # k: norm + rope; v as is
    k1 = ct.astype(ct.load(k, (t, 0, 0), shape=(1, KP, HALF), padding_mode=ZERO), ct.float32)
    k2 = ct.astype(ct.load(k, (t, 0, 1), shape=(1, KP, HALF), padding_mode=ZERO), ct.float32)
    kw1 = _load_norm_w(kn, KP, HALF, K_PER_HEAD, 0)
    kw2 = _load_norm_w(kn, KP, HALF, K_PER_HEAD, 1)
    k1, k2 = _norm_rope(k1, k2, kw1, kw2, c, s, eps, D, HAS_NORM, dt)
    v1 = ct.astype(ct.load(v, (t, 0, 0), shape=(1, KP, HALF), padding_mode=ZERO), ct.float32)
    v2 = ct.astype(ct.load(v, (t, 0, 1), shape=(1, KP, HALF), padding_mode=ZERO), ct.float32)

    # paged write: slot p % PS of page bt[p // PS]; cache tile [1, KP, 1, HALF]
    page = ct.load(bt, (p // PS,), shape=())
    slot = p % PS
    if INT8:
        kq1, kq2, ksc = _quantize(k1, k2, KP)
        vq1, vq2, vsc = _quantize(v1, v2, KP)
        ct.store(kc, (page, 0, slot, 0), ct.reshape(kq1, (1, KP, 1, HALF)))
        ct.store(kc, (page, 0, slot, 1), ct.reshape(kq2, (1, KP, 1, HALF)))
        ct.store(vc, (page, 0, slot, 0), ct.reshape(vq1, (1, KP, 1, HALF)))
        ct.store(vc, (page, 0, slot, 1), ct.reshape(vq2, (1, KP, 1, HALF)))
        ct.store(ks, (page, 0, slot), ksc)
        ct.store(vs, (page, 0, slot), vsc)
    else:
        cdt = kc.dtype
        ct.store(kc, (page, 0, slot, 0), ct.reshape(ct.astype(k1, cdt), (1, KP, 1, HALF)))
        ct.store(kc, (page, 0, slot, 1), ct.reshape(ct.astype(k2, cdt), (1, KP, 1, HALF)))
        ct.store(vc, (page, 0, slot, 0), ct.reshape(ct.astype(v1, cdt), (1, KP, 1, HALF)))
        ct.store(vc, (page, 0, slot, 1), ct.reshape(ct.astype(v2, cdt), (1, KP, 1, HALF)))


def _norm_2d(w: torch.Tensor | None, heads: int, d: int):
    """(weight as [W, d], per_head) for a norm weight [d] or [heads, d]; None if unsupported."""
    if w.numel() == d:
        return w.reshape(1, d), False
    if w.numel() == heads * d:
        return w.reshape(heads, d), True
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
    *,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Per-head q/k RMSNorm (when given) + RoPE + K/V page write, in one kernel launch.

    q: [T, heads, d]; k, v: [T, kv_heads, d] (strided views of the fused qkv output are fine);
    q_norm/k_norm: [d] or [heads|kv_heads, d] or None; cos_table/sin_table: float32
    [max_positions, d/2]; layer: the KV cache layer (bf16/float32 or int8 + float32 scales);
    block_table: int32 [max_pages]; positions: int32 [T] on the device. Returns the rotated q
    [T, heads, d] in q's dtype. Rotate-half RoPE (Su et al., 2021); INT8 scales max|x|/127 per
    vector with round-half-even, as ``reference.quantize_int8``. ``workspace`` holds the placeholder
    scales of a BF16 cache between calls (None: new ones).

    Raises:
        Unsupported: a head_dim that is not a power of two >= 16, norm weights of other shapes, or
            non-int32 positions / block table (before any write).
    """
    T, H, d = q.shape
    KVH = k.shape[1]
    if q_norm is not None:
        qn, kn = _norm_2d(q_norm, H, d), _norm_2d(k_norm, KVH, d)
    else:
        qn = kn = (cos_table, False)
    if not is_pow2(d) or d < 16:
        why = f"head_dim {d} is not a power of two >= 16"
    elif qn is None or kn is None:
        why = f"q/k norm weights {tuple(q_norm.shape)} / {tuple(k_norm.shape)} are not [d] or [heads, d]"
    elif positions.dtype != torch.int32 or block_table.dtype != torch.int32:
        why = f"positions {positions.dtype} and block table {block_table.dtype}, not both int32"
    else:
        why = None
    if why:
        raise Unsupported(why)
    q_out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    int8 = layer.int8
    ks = layer.k_scale if int8 else dummy(workspace, q.device)
    vs = layer.v_scale if int8 else dummy(workspace, q.device)
    launch(
        qk_norm_rope_kv_kernel,
        (T, 1, 1),
        (
            q,
            k,
            v,
            qn[0],
            kn[0],
            cos_table,
            sin_table,
            layer.k,
            layer.v,
            ks,
            vs,
            block_table,
            positions,
            q_out,
            float(eps),
            next_pow2(H),
            next_pow2(KVH),
            d // 2,
            layer.page_size,
            q_norm is not None,
            qn[1],
            kn[1],
            int8,
        ),
    )
    return q_out
