"""Paged flash-attention: a causal prefill kernel and a split-KV decode kernel with its combine.

Both read K and V in place from the page pool through the block table (PagedAttention, Kwon et al.
2023): key position n of the sequence is slot ``n % page_size`` of page ``block_table[n //
page_size]``; no gathered or dequantized copy of the cache is ever made. Scores and the softmax run
in float32 with the online-softmax recurrence of FlashAttention-2 (Dao, 2023), in base 2.

GQA packing (TileInfer.jl's roadmap item): one program serves all ``group = heads / kv_heads`` query
heads of one KV head, as extra rows of its query tile (row r = token r // group, head r % group), so
each K/V tile is loaded once for the whole group.

* Prefill (``T > 16`` query rows): grid [row blocks, kv_heads]; row blocks are launched heaviest
  (latest tokens, longest causal range) first to shorten the tail. Blocks of keys every row of the
  tile may see run unmasked; the last blocks up to the tile's largest position apply the causal mask.
* Decode and verify (``T <= 16``): FlashDecoding (Dao et al., 2023) / split-KV: the context is cut
  into ``num_splits`` chunks, one program per (kv_head, chunk), so even one sequence fills all SMs;
  each writes an unnormalised partial (acc, max, sum) and a combine kernel merges them. The number
  of chunks depends only on the block table's length and the KV heads (a static shape): the context
  length is read from ``positions`` on the device, and chunks past it write an empty partial.

INT8 cache: keys and values are int8 with one float32 scale per vector, never dequantized to a
copy. The key scale multiplies its column of scores; the value scale multiplies its probability
before P @ V, as in the reference (the row sum uses the unscaled p). V is read as int32 words and
widened in registers: an int8 tile as the transposed P @ V operand is read out of shared memory a
byte at a time.

Tiles and split counts come from the plans of :mod:`.plan` (tables of a :class:`~.tuning.Tuning`
argument, split counts from the SM count); the decode grid depends only on static shapes, so a
captured CUDA graph replays as the context grows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Unsupported, sm_count
from tileinfer.ops.triton._common import (
    cast,
    dot_dtype,
    dot_precision,
    i8x4_byte_to_f32,
    next_pow2,
    pdl_launch,
    pdl_prologue,
)
from tileinfer.ops.triton.plan import (
    DECODE_MAX_ROWS,
    DecodePlan,
    PrefillPlan,
    plan_decode_attention,
    plan_prefill_attention,
)
from tileinfer.ops.triton.tuning import TUNING, Tuning

LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(
    bt_ptr, n, kvh, MAXP, stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss, PAGE: tl.constexpr
):
    """Element offsets of key positions ``n`` (a vector) in the cache and in the scale arrays."""
    page = tl.load(bt_ptr + tl.minimum(n // PAGE, MAXP - 1)).to(tl.int64)
    slot = n % PAGE
    c = page * stride_cp + kvh * stride_ch + slot * stride_cs
    s = page * stride_sp + kvh * stride_sh + slot * stride_ss
    return c, s


@triton.jit
def _unpack_i8x4(w):
    """int32 words [R, W] holding 4 int8 each (byte i of word j = element 4j + i) -> float32 [R, 4W].

    Widened with integer ops and one FADD (``i8x4_byte_to_f32``); the joins and the reshape stay in
    registers. Reading INT8 values as words keeps Triton from reading the int8 tile out of shared
    memory one byte at a time (what it does for an int8 operand of P @ V).
    """
    a = tl.join(i8x4_byte_to_f32(w, 0), i8x4_byte_to_f32(w, 8))
    b = tl.join(i8x4_byte_to_f32(w, 16), i8x4_byte_to_f32(w, 24))
    x = tl.permute(tl.join(a, b), (0, 1, 3, 2))
    return tl.reshape(x, (w.shape[0], 4 * w.shape[1]))


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    n,
    pos_r,
    hi_pos,
    kvh,
    bt_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    MAXP,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    stride_ss,
    qk_scale,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    INT8: tl.constexpr,
    MASK: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
):
    """One FlashAttention-2 step over the keys ``n``: scores, online softmax, P @ V."""
    d = tl.arange(0, HEAD_D)
    c_off, s_off = _kv_offsets(
        bt_ptr, n, kvh, MAXP, stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss, PAGE
    )
    k = tl.load(k_ptr + c_off[:, None] + d[None, :])
    live = n <= hi_pos
    s = tl.dot(q, tl.trans(k.to(DOT_T)), input_precision=PREC)
    if INT8:
        s = s * tl.load(ks_ptr + s_off)[None, :]
    s = s * qk_scale
    if MASK:
        # slots past the last written position may hold anything (NaN included): select, never
        # multiply, and zero the values read there
        s = tl.where(n[None, :] <= pos_r[:, None], s, float("-inf"))
    if INT8:
        # V as int32 words (v_ptr is the int8 pool viewed as int32; offsets in words)
        dw = tl.arange(0, HEAD_D // 4)
        if MASK:
            vw = tl.load(v_ptr + c_off[:, None] // 4 + dw[None, :], mask=live[:, None], other=0)
        else:
            vw = tl.load(v_ptr + c_off[:, None] // 4 + dw[None, :])
    else:
        if MASK:
            v = tl.load(v_ptr + c_off[:, None] + d[None, :], mask=live[:, None], other=0)
        else:
            v = tl.load(v_ptr + c_off[:, None] + d[None, :])
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if INT8:
        # sum_n (p_n * vs_n) * v_nd, as the reference and cuTile: the value scale goes on the
        # probabilities, so P @ V rounds once to bf16 (p * vs); int8 values widen to bf16 exactly.
        # (Scaling V's rows rounded twice; on smollm2 the KL difference was within noise.)
        if MASK:
            vs = tl.load(vs_ptr + s_off, mask=live, other=0.0)
        else:
            vs = tl.load(vs_ptr + s_off)
        p = p * vs[None, :]
        vv = cast(_unpack_i8x4(vw), DOT_T)
    else:
        vv = v.to(DOT_T)
    acc = tl.dot(cast(p, DOT_T), vv, acc, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _load_q(q_ptr, pos_ptr, r, T, G, kvh, stride_qt, stride_qh, HEAD_D: tl.constexpr, DOT_T: tl.constexpr):
    """Rows r of the packed query tile: token r // G, head kvh * G + r % G; and their positions."""
    t = r // G
    h = kvh * G + r % G
    ok = t < T
    pos = tl.load(pos_ptr + t, mask=ok, other=0).to(tl.int32)
    d = tl.arange(0, HEAD_D)
    q = tl.load(
        q_ptr + t[:, None].to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :], mask=ok[:, None], other=0.0
    )
    return q.to(DOT_T), pos, t, h, ok


@triton.jit(do_not_specialize=["T", "G"])
def _attn_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    pos_ptr,
    o_ptr,
    T,
    G,
    MAXP,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    stride_ss,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT8: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
):
    """Causal paged attention for a chunk of T query tokens (GQA-packed rows, FlashAttention-2)."""
    kvh = tl.program_id(1)
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest row blocks first
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    q, pos_r, t, h, ok = _load_q(q_ptr, pos_ptr, r, T, G, kvh, stride_qt, stride_qh, HEAD_D, DOT_T)
    lo_pos = tl.min(tl.where(ok, pos_r, 2147483647), axis=0)
    hi_pos = tl.max(tl.where(ok, pos_r, -1), axis=0)
    n_full = (lo_pos + 1) // BLOCK_N  # blocks that every row of the tile sees whole
    n_end = tl.cdiv(hi_pos + 1, BLOCK_N)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)
    for j in range(0, n_full):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            n,
            pos_r,
            hi_pos,
            kvh,
            bt_ptr,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            MAXP,
            stride_cp,
            stride_ch,
            stride_cs,
            stride_sp,
            stride_sh,
            stride_ss,
            qk_scale,
            HEAD_D,
            PAGE,
            INT8,
            False,
            DOT_T,
            PREC,
        )
    for j in range(n_full, n_end):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            n,
            pos_r,
            hi_pos,
            kvh,
            bt_ptr,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            MAXP,
            stride_cp,
            stride_ch,
            stride_cs,
            stride_sp,
            stride_sh,
            stride_ss,
            qk_scale,
            HEAD_D,
            PAGE,
            INT8,
            True,
            DOT_T,
            PREC,
        )
    out = acc / l_i[:, None]
    d = tl.arange(0, HEAD_D)
    o = o_ptr + t[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o, cast(out, o_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit(do_not_specialize=["T", "G", "H"])
def _attn_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    pos_ptr,
    wacc_ptr,
    wml_ptr,
    T,
    G,
    H,
    MAXP,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    stride_ss,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INT8: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (kv_head, context chunk) of split-KV decode: unnormalised partial acc, max, sum.

    Partials go to wacc [splits, T * H, HEAD_D] and wml [splits, 2, T * H] (max in log2 units, sum).
    """
    pdl_prologue(PDL)
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    r = tl.arange(0, BLOCK_M)
    q, pos_r, t, h, ok = _load_q(q_ptr, pos_ptr, r, T, G, kvh, stride_qt, stride_qh, HEAD_D, DOT_T)
    tt = tl.arange(0, BLOCK_T)
    hi_pos = tl.max(tl.load(pos_ptr + tt, mask=tt < T, other=-1), axis=0).to(tl.int32)
    n_blocks = tl.cdiv(hi_pos + 1, BLOCK_N)
    per = tl.cdiv(n_blocks, n_splits)
    start = split * per
    end = tl.minimum(start + per, n_blocks)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)
    for j in range(start, end):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            n,
            pos_r,
            hi_pos,
            kvh,
            bt_ptr,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            MAXP,
            stride_cp,
            stride_ch,
            stride_cs,
            stride_sp,
            stride_sh,
            stride_ss,
            qk_scale,
            HEAD_D,
            PAGE,
            INT8,
            True,
            DOT_T,
            PREC,
        )
    rows = T * H
    row = (t * H + h).to(tl.int64)
    d = tl.arange(0, HEAD_D)
    base = split.to(tl.int64) * rows
    tl.store(wacc_ptr + (base + row)[:, None] * HEAD_D + d[None, :], acc, mask=ok[:, None])
    tl.store(wml_ptr + 2 * base + row, m_i, mask=ok)
    tl.store(wml_ptr + 2 * base + rows + row, l_i, mask=ok)


@triton.jit(do_not_specialize=["H", "rows"])
def _attn_combine_kernel(
    wacc_ptr,
    wml_ptr,
    o_ptr,
    H,
    rows,
    n_splits,
    stride_ot,
    stride_oh,
    HEAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge the split partials of one (token, head) row: out = sum_s w_s acc_s / sum_s w_s l_s."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < n_splits
    m = tl.load(wml_ptr + 2 * s.to(tl.int64) * rows + row, mask=ok, other=-1.0e30)
    l = tl.load(wml_ptr + 2 * s.to(tl.int64) * rows + rows + row, mask=ok, other=0.0)
    w = tl.math.exp2(m - tl.max(m, axis=0))
    d = tl.arange(0, HEAD_D)
    a = tl.load(wacc_ptr + (s.to(tl.int64) * rows + row)[:, None] * HEAD_D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(a * w[:, None], axis=0) / tl.sum(w * l, axis=0)
    t = row // H
    h = row % H
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, cast(out, o_ptr.dtype.element_ty))


def _unsupported(q: torch.Tensor, layer: KVLayer) -> str | None:
    """Why the kernels cannot take these inputs, or None: they need a power-of-two head_dim >= 16,
    contiguous head vectors, K and V pools (and scales) of one layout, and for an INT8 pool rows
    and strides in whole int32 words (V is read 4 values at a time)."""
    D = q.shape[2]
    if D < 16 or D & (D - 1):
        return f"head_dim {D} is not a power of two >= 16"
    kc, vc = layer.k, layer.v
    if q.stride(2) != 1 or kc.stride(3) != 1:
        return "q or cached head vectors not contiguous"
    if kc.stride() != vc.stride():
        return "K and V pages of different layouts"
    if layer.int8 and (vc.shape[3] % 4 or any(st % 4 for st in vc.stride()[:3])):
        return "INT8 V pages not in whole int32 words"
    if layer.int8 and layer.k_scale.stride() != layer.v_scale.stride():
        return "K and V scales of different layouts"
    return None


def _cache_args(layer: KVLayer):
    """Kernel arguments of a layer's pool (its layout checked by :func:`_unsupported`); an INT8 V
    pool is passed as int32 words (4 values each), its element offsets divided by 4 in the kernel."""
    kc, vc = layer.k, layer.v
    if layer.int8:
        vc = vc.view(torch.int32)
        ks, vs = layer.k_scale, layer.v_scale
        sc = (ks.stride(0), ks.stride(1), ks.stride(2))
    else:
        ks = vs = kc
        sc = (0, 0, 0)
    return kc, vc, ks, vs, (kc.stride(0), kc.stride(1), kc.stride(2)) + sc


def attention(
    q: torch.Tensor,
    layer: KVLayer,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    *,
    plan: DecodePlan | PrefillPlan | None = None,
    tuning: Tuning = TUNING,
) -> torch.Tensor:
    """Causal paged attention with GQA for queries at ``positions`` over the cached sequence.

    q: [T, heads, d] (rotated; the keys/values of these positions already written); layer: the
    page pool [num_pages, kv_heads, page_size, d] (bf16/f32, or int8 + float32 scales
    [num_pages, kv_heads, page_size]); block_table: int [max_pages]; positions: int [T] on the device.
    The query at position p attends to cached positions 0..p. T <= 16: split-KV decode + combine
    (:func:`~.plan.plan_decode_attention`); else the prefill kernel
    (:func:`~.plan.plan_prefill_attention`). ``plan`` replaces the planned launch (a DecodePlan for
    T <= 16, else a PrefillPlan); ``tuning`` holds the tiles and the SM count the plans use.
    Returns [T, heads, d] in q's dtype.

    Raises:
        ValueError: heads not a multiple of the KV heads (no GQA grouping; the reference rejects it too).
        TypeError: ``plan`` of the other kind.
        Unsupported: inputs outside the kernels' domain (see :func:`_unsupported`).
    """
    T, H, D = q.shape
    KVH = layer.k.shape[1]
    if H % KVH:
        raise ValueError(f"attention: {H} query heads are not a multiple of {KVH} KV heads")
    G = H // KVH
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:  # before the domain check: the reference cannot take zero rows
        return out
    why = _unsupported(q, layer)
    if why:
        raise Unsupported(why)
    if T <= DECODE_MAX_ROWS:
        if plan is None:
            sms = tuning.sms or sm_count(q.device)
            max_positions = block_table.shape[0] * layer.page_size
            plan = plan_decode_attention(T, G, KVH, max_positions, D, int8=layer.int8, sms=sms, tuning=tuning)
        elif not isinstance(plan, DecodePlan):
            raise TypeError(f"attention: {T} query rows take a DecodePlan, not {plan!r}")
        _launch_decode(q, layer, block_table, positions, sm_scale, out, plan)
    else:
        if plan is None:
            plan = plan_prefill_attention(T, G, int8=layer.int8, tuning=tuning)
        elif not isinstance(plan, PrefillPlan):
            raise TypeError(f"attention: {T} query rows take a PrefillPlan, not {plan!r}")
        _launch_prefill(q, layer, block_table, positions, sm_scale, out, plan)
    return out


def _launch_decode(q, layer: KVLayer, block_table, positions, sm_scale: float, out, plan: DecodePlan) -> None:
    T, H, D = q.shape
    KVH = layer.k.shape[1]
    kc, vc, ks, vs, strides = _cache_args(layer)
    rows, splits = T * H, plan.splits
    wacc = torch.empty((splits, rows, D), dtype=torch.float32, device=q.device)
    wml = torch.empty((splits, 2, rows), dtype=torch.float32, device=q.device)
    _attn_decode_split_kernel[(KVH, splits)](
        q, kc, vc, ks, vs, block_table, positions, wacc, wml,
        T, H // KVH, H, block_table.shape[0], float(sm_scale) * LOG2E, q.stride(0), q.stride(1), *strides,
        HEAD_D=D,
        PAGE=layer.page_size,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.tile.block_n,
        BLOCK_T=next_pow2(T),
        INT8=layer.int8,
        DOT_T=dot_dtype(q.dtype),
        PREC=dot_precision(q.dtype),
        num_warps=plan.tile.warps,
        num_stages=plan.tile.stages,
        **pdl_launch(q),
    )  # fmt: skip
    _attn_combine_kernel[(rows,)](
        wacc, wml, out, H, rows, splits, out.stride(0), out.stride(1),
        HEAD_D=D,
        BLOCK_S=next_pow2(splits),
        num_warps=plan.combine_warps,
        **pdl_launch(wacc),
    )  # fmt: skip


def _launch_prefill(q, layer: KVLayer, block_table, positions, sm_scale: float, out, plan: PrefillPlan) -> None:
    T, H, D = q.shape
    KVH = layer.k.shape[1]
    kc, vc, ks, vs, strides = _cache_args(layer)
    t = plan.tile
    _attn_prefill_kernel[(plan.programs, KVH)](
        q, kc, vc, ks, vs, block_table, positions, out,
        T, H // KVH, block_table.shape[0], float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
        HEAD_D=D,
        PAGE=layer.page_size,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        INT8=layer.int8,
        DOT_T=dot_dtype(q.dtype),
        PREC=dot_precision(q.dtype),
        num_warps=t.warps,
        num_stages=t.stages,
    )  # fmt: skip
