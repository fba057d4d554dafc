"""Paged flash-attention: a prefill kernel, and a split-KV decode kernel with its combine step.

Both read the KV pages in place through the block table (PagedAttention, Kwon et al. 2023), one
page of ``page_size`` keys per step, with the online softmax of FlashAttention-2 (Dao, 2023) in
base 2. The context length is read from ``positions`` on the device, so a step can be replayed from
a CUDA graph at any length; grids depend only on shapes.

- Prefill (T > 16 query rows): one block per (64 query rows, query head); causal mask per row
  (key j is visible to the query at position p iff j <= p), applied only on pages that reach past
  the block's smallest query position.
- Decode / verify (T <= 16): one block per (KV head, split); the block takes every query head of
  its GQA group and every query row at once (rows padded to >= 16 for the tensor cores), and
  walks its share of the pages; the context is cut into a fixed number of splits so all SMs work
  even for one sequence (FlashDecoding, Dao et al. 2023; TileInfer.jl's split-KV). A second
  kernel merges the splits' (max, sum, output) triples.

INT8 caches are never dequantized to memory: the key scale multiplies its column of scores, the
value scale its probability (TileInfer.jl's INT8 KV cache). Prefill converts int8 tiles to the
query dtype in registers for the tensor cores; bf16 decode reads them as int32 words instead
(:func:`decode_split_int8_kernel`, one query row).
"""

from __future__ import annotations

import functools
import math

import cuda.tile as ct
import torch

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Unsupported, Workspace, sm_count
from tileinfer.ops.cutile._common import (
    LOG2E,
    ZERO,
    ConstBool,
    ConstInt,
    cdiv,
    dummy,
    is_pow2,
    launch,
    pdl_prologue,
    scratch,
)
from tileinfer.ops.cutile.plan import (
    DECODE_ROWS,
    DecodePlan,
    PrefillPlan,
    plan_decode_attention,
    plan_prefill_attention,
)
from tileinfer.ops.cutile.tuning import TUNING, Tuning

_BIG = 1 << 30
_NEG_INF = -math.inf


def _attend_page(qt, kc, vc, ks, vs, page, h, pi, qpos, L, pmin, m_i, l_i, acc, scale2, M, D, PS, INT8):
    """One page of keys for the query tile qt [M, D]: online-softmax update of (m, l, acc).

    Scores are in base-2 units (scale2 = sm_scale * log2 e). Keys past a row's position are
    masked only when the page reaches past the smallest query position (pmin): earlier pages
    are visible to every row. Values past the context (L) are zeroed on such pages, since an
    unwritten slot may hold NaN and 0 * NaN would leak into the product.
    """
    need_mask = (pi + 1) * PS - 1 > pmin
    kt = ct.reshape(ct.load(kc, (page, h, 0, 0), shape=(1, 1, D, PS), order=(0, 1, 3, 2), latency=8), (D, PS))
    if kt.dtype != qt.dtype:
        kt = ct.astype(kt, qt.dtype)  # int8 keys: exact in bf16, converted in registers
    s = ct.mma(qt, kt, ct.zeros((M, PS), ct.float32))
    if INT8:
        s = s * ct.reshape(ct.load(ks, (page, h, 0), shape=(1, 1, PS)), (1, PS))
    s = s * scale2
    kpos = pi * PS + ct.arange(PS, dtype=ct.int32)
    if need_mask:
        s = ct.where(ct.reshape(kpos, (1, PS)) <= qpos, s, _NEG_INF)
    m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
    m_safe = ct.where(m_new == _NEG_INF, 0.0, m_new)  # a row with no visible key yet
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m_i - m_safe)
    l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
    v = ct.reshape(ct.load(vc, (page, h, 0, 0), shape=(1, 1, PS, D), latency=8), (PS, D))
    if INT8:
        p = p * ct.reshape(ct.load(vs, (page, h, 0), shape=(1, 1, PS)), (1, PS))
        if need_mask:
            p = ct.where(ct.reshape(kpos, (1, PS)) <= qpos, p, 0.0)  # 0 * garbage scale
    elif need_mask:
        v = ct.where(ct.reshape(kpos, (PS, 1)) < L, v, 0.0)
    if v.dtype != qt.dtype:
        v = ct.astype(v, qt.dtype)
    acc = ct.mma(ct.astype(p, qt.dtype), v, acc * alpha)
    return m_new, l_i, acc


# 128 query rows and 8 worker warps: no spills (SASS), and faster than 64-row tiles at two blocks
# per SM (benchmarks/cutile-NOTES.md, "attention")
@ct.kernel(num_worker_warps=8)
def prefill_attention_kernel(
    q, kc, vc, ks, vs, bt, pos, out, scale2: float, TM: ConstInt, D: ConstInt, PS: ConstInt, INT8: ConstBool
):
    pdl_prologue()
    mb = ct.bid(0)
    hq = ct.bid(1)
    G = q.shape[1] // kc.shape[1]
    h = hq // G
    T = q.shape[0]
    qt = ct.reshape(ct.load(q, (mb, hq, 0), shape=(TM, 1, D), padding_mode=ZERO), (TM, D))
    posv = ct.load(pos, (mb,), shape=(TM,), padding_mode=ZERO)
    rows = mb * TM + ct.arange(TM, dtype=ct.int32)
    pmin = ct.min(ct.where(rows < T, posv, _BIG))
    L = ct.max(posv) + 1
    qpos = ct.reshape(posv, (TM, 1))
    m_i = ct.full((TM, 1), _NEG_INF, ct.float32)
    l_i = ct.zeros((TM, 1), ct.float32)
    acc = ct.zeros((TM, D), ct.float32)
    for pi in range(ct.cdiv(L, PS)):
        page = ct.load(bt, (pi,), shape=())
        m_i, l_i, acc = _attend_page(
            qt, kc, vc, ks, vs, page, h, pi, qpos, L, pmin, m_i, l_i, acc, scale2, TM, D, PS, INT8
        )
    o = acc / l_i
    ct.store(out, (mb, hq, 0), ct.reshape(ct.astype(o, out.dtype), (TM, 1, D)))


def _split_pages(pos, T, s, S: int, TP: int, GP: int, PS: int):
    """A decode split's share of the pages: (smallest query position, context length, each tile
    row's query position [TP * GP, 1], first page, end page) of split ``s`` of ``S``."""
    posv = ct.load(pos, (0,), shape=(TP,), padding_mode=ZERO)
    rows = ct.arange(TP, dtype=ct.int32)
    pmin = ct.min(ct.where(rows < T, posv, _BIG))
    L = ct.max(posv) + 1
    qpos = ct.reshape(ct.broadcast_to(ct.reshape(posv, (TP, 1)), (TP, GP)), (TP * GP, 1))
    n_pages = ct.cdiv(L, PS)
    per = ct.cdiv(n_pages, S)
    p0 = s * per
    return pmin, L, qpos, p0, min(p0 + per, n_pages)


def _store_stats(m_part, l_part, m_i, l_i, s, h, G, TP: int, GP: int):
    """Store a split's running max and sum [TP * GP, 1] for the G query heads of KV head h."""
    mp = m_part.slice(axis=2, start=h * G, stop=h * G + G)
    ct.store(mp, (s, 0, 0), ct.reshape(m_i, (1, TP, GP)))
    lp = l_part.slice(axis=2, start=h * G, stop=h * G + G)
    ct.store(lp, (s, 0, 0), ct.reshape(l_i, (1, TP, GP)))


@ct.kernel
def decode_split_kernel(
    q,
    kc,
    vc,
    ks,
    vs,
    bt,
    pos,
    o_part,
    m_part,
    l_part,
    scale2: float,
    TP: ConstInt,
    GP: ConstInt,
    D: ConstInt,
    PS: ConstInt,
    INT8: ConstBool,
):
    pdl_prologue()
    h = ct.bid(0)
    s = ct.bid(1)
    S = ct.num_blocks(1)
    G = q.shape[1] // kc.shape[1]
    T = q.shape[0]
    M = TP * GP
    qh = q.slice(axis=1, start=h * G, stop=h * G + G)
    qt = ct.reshape(ct.load(qh, (0, 0, 0), shape=(TP, GP, D), padding_mode=ZERO), (M, D))
    pmin, L, qpos, p0, p1 = _split_pages(pos, T, s, S, TP, GP, PS)
    m_i = ct.full((M, 1), _NEG_INF, ct.float32)
    l_i = ct.zeros((M, 1), ct.float32)
    acc = ct.zeros((M, D), ct.float32)
    for pi in range(p0, p1):
        page = ct.load(bt, (pi,), shape=())
        m_i, l_i, acc = _attend_page(
            qt, kc, vc, ks, vs, page, h, pi, qpos, L, pmin, m_i, l_i, acc, scale2, M, D, PS, INT8
        )
    op = o_part.slice(axis=2, start=h * G, stop=h * G + G)
    ct.store(op, (s, 0, 0, 0), ct.reshape(acc, (1, TP, GP, D)))
    _store_stats(m_part, l_part, m_i, l_i, s, h, G, TP, GP)


# ------------------------------------------------------- INT8 decode without int8 -> bf16 conversion
#
# The mma path above converts each int8 key and value to bf16 in registers (I2F after byte loads
# from a transposed int8 tile in shared memory): that conversion, not memory, bounds its INT8
# decode (benchmarks/cutile-NOTES.md). Here the pages are read as int32 words (4 values each: byte
# i of word j is element 4j + i) and each byte becomes its exact float32 value by a shift, one LOP3
# and one FADD (FasterTransformer's magic-number conversion: the byte with its sign bit flipped,
# OR-ed into the mantissa of 2^23, minus (2^23 + 128) = 8388736). Each byte plane is one tf32 mma: scores
# sum_i q[:, i::4] @ K[:, i::4]^T, and outputs acc_i = (p * vs) @ V[:, i::4], stored interleaved.
# tf32 is exact for int8 values and bf16 queries; p * vs rounds to tf32's 10 bits, finer than the
# mma path's bf16. Four separate 2-D mmas, not one batched 3-D mma: a batched one replicates the
# softmax state per plane and spills.


def _byte(w, i: int):
    """Byte ``i`` of each int32 word of ``w`` as its signed value (-128..127), exact, in tfloat32."""
    u = w if i == 0 else w >> (8 * i)
    return ct.astype(ct.bitcast((u & 0xFF) ^ 0x4B000080, ct.float32) - 8388736.0, ct.tfloat32)


def _plane(t4, i: int, M: int, DW: int):
    """Plane ``i`` [M, DW] of a [4, M, DW] tile."""
    return ct.reshape(ct.extract(t4, (i, 0, 0), shape=(1, M, DW)), (M, DW))


@ct.kernel
def decode_split_int8_kernel(
    q,
    kw,
    vw,
    ks,
    vs,
    bt,
    pos,
    o_part,
    m_part,
    l_part,
    scale2: float,
    TP: ConstInt,
    GP: ConstInt,
    DW: ConstInt,
    PS: ConstInt,
):
    """Split-KV decode over an INT8 cache read as words: as :func:`decode_split_kernel`, but kw, vw
    are the int8 pools viewed as int32 [pages, kv_heads, page_size, head_dim / 4] and o_part is
    [splits, T, heads, head_dim / 4, 4] (the same memory as [splits, T, heads, head_dim])."""
    pdl_prologue()
    h = ct.bid(0)
    s = ct.bid(1)
    S = ct.num_blocks(1)
    G = q.shape[1] // kw.shape[1]
    T = q.shape[0]
    M = TP * GP
    D = 4 * DW
    qh = q.slice(axis=1, start=h * G, stop=h * G + G)
    qt = ct.astype(ct.reshape(ct.load(qh, (0, 0, 0), shape=(TP, GP, D), padding_mode=ZERO), (M, D)), ct.float32)
    q4 = ct.astype(ct.permute(ct.reshape(qt, (M, DW, 4)), (2, 0, 1)), ct.tfloat32)  # plane i: q[:, i::4]
    q0, q1, q2, q3 = _plane(q4, 0, M, DW), _plane(q4, 1, M, DW), _plane(q4, 2, M, DW), _plane(q4, 3, M, DW)
    pmin, _, qpos, p0, p1 = _split_pages(pos, T, s, S, TP, GP, PS)
    m_i = ct.full((M, 1), _NEG_INF, ct.float32)
    l_i = ct.zeros((M, 1), ct.float32)
    a0 = ct.zeros((M, DW), ct.float32)
    a1, a2, a3 = a0, a0, a0
    for pi in range(p0, p1):
        page = ct.load(bt, (pi,), shape=())
        kt = ct.reshape(ct.load(kw, (page, h, 0, 0), shape=(1, 1, DW, PS), order=(0, 1, 3, 2), latency=8), (DW, PS))
        sc = ct.mma(q0, _byte(kt, 0), ct.zeros((M, PS), ct.float32))
        sc = ct.mma(q1, _byte(kt, 1), sc)
        sc = ct.mma(q2, _byte(kt, 2), sc)
        sc = ct.mma(q3, _byte(kt, 3), sc)
        sc = sc * ct.reshape(ct.load(ks, (page, h, 0), shape=(1, 1, PS)), (1, PS)) * scale2
        kpos = pi * PS + ct.arange(PS, dtype=ct.int32)
        visible = ct.reshape(kpos, (1, PS)) <= qpos
        if (pi + 1) * PS - 1 > pmin:
            sc = ct.where(visible, sc, _NEG_INF)
        m_new = ct.maximum(m_i, ct.max(sc, axis=1, keepdims=True))
        m_safe = ct.where(m_new == _NEG_INF, 0.0, m_new)  # a row with no visible key yet
        p = ct.exp2(sc - m_safe)
        alpha = ct.exp2(m_i - m_safe)
        l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
        pv = p * ct.reshape(ct.load(vs, (page, h, 0), shape=(1, 1, PS)), (1, PS))
        pv = ct.astype(ct.where(visible, pv, 0.0), ct.tfloat32)  # slots past the context: their scale may be NaN
        vt = ct.reshape(ct.load(vw, (page, h, 0, 0), shape=(1, 1, PS, DW), latency=8), (PS, DW))
        a0 = ct.mma(pv, _byte(vt, 0), a0 * alpha)
        a1 = ct.mma(pv, _byte(vt, 1), a1 * alpha)
        a2 = ct.mma(pv, _byte(vt, 2), a2 * alpha)
        a3 = ct.mma(pv, _byte(vt, 3), a3 * alpha)
        m_i = m_new
    op = o_part.slice(axis=2, start=h * G, stop=h * G + G)
    ct.store(op, (s, 0, 0, 0, 0), ct.reshape(a0, (1, TP, GP, DW, 1)))
    ct.store(op, (s, 0, 0, 0, 1), ct.reshape(a1, (1, TP, GP, DW, 1)))
    ct.store(op, (s, 0, 0, 0, 2), ct.reshape(a2, (1, TP, GP, DW, 1)))
    ct.store(op, (s, 0, 0, 0, 3), ct.reshape(a3, (1, TP, GP, DW, 1)))
    _store_stats(m_part, l_part, m_i, l_i, s, h, G, TP, GP)


@ct.kernel
def decode_combine_kernel(o_part, m_part, l_part, out, SP: ConstInt, D: ConstInt):
    """Merge the splits of one (query row, head): out = sum_s w_s acc_s / sum_s w_s l_s."""
    pdl_prologue()
    t = ct.bid(0)
    hq = ct.bid(1)
    m = ct.reshape(ct.load(m_part, (0, t, hq), shape=(SP, 1, 1), padding_mode=ct.PaddingMode.NEG_INF), (SP, 1))
    l = ct.reshape(ct.load(l_part, (0, t, hq), shape=(SP, 1, 1), padding_mode=ZERO), (SP, 1))
    o = ct.reshape(ct.load(o_part, (0, t, hq, 0), shape=(SP, 1, 1, D), padding_mode=ZERO), (SP, D))
    mx = ct.max(m, axis=0, keepdims=True)
    mx = ct.where(mx == _NEG_INF, 0.0, mx)
    w = ct.exp2(m - mx)
    den = ct.sum(w * l, axis=0, keepdims=True)
    num = ct.sum(w * o, axis=0, keepdims=True)
    ct.store(out, (t, hq, 0), ct.reshape(ct.astype(num / den, out.dtype), (1, 1, D)))


def _unsupported(D: int, PS: int, block_table: torch.Tensor, positions: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs, or None: their tiles need power-of-two head and
    page sizes of at least 16, and they read int32 block tables and positions."""
    if not is_pow2(D) or D < 16:
        return f"head_dim {D} is not a power of two >= 16"
    if not is_pow2(PS) or PS < 16:
        return f"page size {PS} is not a power of two >= 16"
    if positions.dtype != torch.int32 or block_table.dtype != torch.int32:
        return f"positions {positions.dtype} and block table {block_table.dtype}, not both int32"
    return None


@functools.cache
def _prefill_kernel(hints: tuple[tuple[str, int | None], ...]):
    """The prefill kernel with ``hints`` in place of its own compiler hints (none: as it is)."""
    return prefill_attention_kernel.replace_hints(**dict(hints)) if hints else prefill_attention_kernel


def attention(
    q: torch.Tensor,
    layer: KVLayer,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    *,
    plan: DecodePlan | PrefillPlan | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Causal paged attention with GQA for queries at ``positions`` over the cached sequence.

    q: [T, heads, d] (rotated; the keys/values of these positions already written); layer: KV
    cache layer [num_pages, kv_heads, page_size, d] (bf16/float32, or int8 + float32 scales
    [num_pages, kv_heads, page_size]); block_table: int32 [max_pages]; positions: int32 [T] on the
    device. Returns [T, heads, d] in q's dtype. T <= 16: split-KV decode + combine (two launches,
    :func:`~.plan.plan_decode_attention`); larger T: the prefill kernel (one launch,
    :func:`~.plan.plan_prefill_attention`). ``plan`` replaces the planned launch (a DecodePlan for
    T <= 16, else a PrefillPlan); ``tuning`` holds the switches and the SM count the plans use;
    ``workspace`` keeps the split partials between calls (None: new ones).

    Raises:
        ValueError: heads not a multiple of the KV heads (no GQA grouping; the reference rejects it too).
        Unsupported: other inputs (see :func:`_unsupported`).
        TypeError: a ``plan`` of the other kind.
    """
    T, H, D = q.shape
    KVH, PS = layer.k.shape[1], layer.page_size
    if H % KVH:
        raise ValueError(f"attention: {H} query heads are not a multiple of {KVH} KV heads")
    why = _unsupported(D, PS, block_table, positions)
    if why:
        raise Unsupported(why)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    want = DecodePlan if T <= DECODE_ROWS else PrefillPlan
    if plan is None and T <= DECODE_ROWS:
        sms = tuning.sms or sm_count(q.device)
        bf16 = q.dtype == torch.bfloat16
        plan = plan_decode_attention(
            T, H // KVH, KVH, block_table.shape[0], D, int8=layer.int8, bf16=bf16, sms=sms, tuning=tuning
        )
    elif plan is None:
        plan = plan_prefill_attention(tuning)
    elif not isinstance(plan, want):
        raise TypeError(f"attention: {T} query rows take a {want.__name__}, not {plan!r}")
    int8 = layer.int8
    ks = layer.k_scale if int8 else dummy(workspace, q.device)
    vs = layer.v_scale if int8 else dummy(workspace, q.device)
    scale2 = float(sm_scale) * LOG2E
    if isinstance(plan, PrefillPlan):
        args = (q, layer.k, layer.v, ks, vs, block_table, positions, out, scale2, plan.rows, D, PS, int8)
        launch(_prefill_kernel(plan.hints), (cdiv(T, plan.rows), H, 1), args)
        return out
    S = plan.splits
    o_part = scratch(workspace, "attn_o", (S, T, H, D), torch.float32, q.device)
    m_part = scratch(workspace, "attn_m", (S, T, H), torch.float32, q.device)
    l_part = scratch(workspace, "attn_l", (S, T, H), torch.float32, q.device)
    parts = (m_part, l_part, scale2, plan.tp, plan.gp)
    if plan.int8_words:
        kw, vw, o5 = layer.k.view(torch.int32), layer.v.view(torch.int32), o_part.view(S, T, H, D // 4, 4)
        args = (q, kw, vw, ks, vs, block_table, positions, o5, *parts, D // 4, PS)
        launch(decode_split_int8_kernel, (KVH, S, 1), args)
    else:
        args = (q, layer.k, layer.v, ks, vs, block_table, positions, o_part, *parts, D, PS, int8)
        launch(decode_split_kernel, (KVH, S, 1), args)
    launch(decode_combine_kernel, (T, H, 1), (o_part, m_part, l_part, out, S, D))
    return out
