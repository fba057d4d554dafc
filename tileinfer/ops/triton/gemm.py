"""Linear layers: a GEMV / skinny-GEMM kernel for decode and verify steps (1 to 16 rows) and GEMMs
for prefill, for BF16 weights and weight-only INT8 (one float32 scale per output channel, applied in
the epilogue), with bias, SwiGLU and float32-logit epilogues.

* Decode (1 row) is memory-bound - each weight byte is read once per step (TileInfer.jl's M4/M8
  lesson): ``_gemv_kernel`` streams the weight in [BLOCK_N, BLOCK_K] tiles, one float32 FMA per
  weight into a register tile reduced once at the end; many small programs keep enough bytes in
  flight, and a cp.async ring (Triton's pipeliner) keeps the weight loads going during the FMAs.
  INT8 weights are widened without I2F (a quarter-rate instruction that would cap the kernel below
  the roofline): by default one PRMT a weight into biased floats whose bias is removed once per
  output (``i8_to_unit_f32``); exact variants (sign extension or int32 words plus the 2^23 magic
  number) for float32 outputs.
* Verify (2..16 rows): the same kernel with rows padded to 16 and ``tl.dot`` (below 16 rows the
  tensor cores go unused - the Julia engine's 8-vs-16-row lesson), cp.async-pipelined.
* Prefill: ``_gemm_tma_kernel``, a persistent GEMM fed by TMA descriptors (Triton tutorial 09),
  ``_gemm_kernel``, the classic pointer-based tiled GEMM (grouped order, cp.async, wgmma), or, for
  shapes whose tiles leave the last wave mostly idle, ``_gemm_streamk_kernel`` (stream-K), per the
  plan. From ``Tuning.int8_dequant_rows`` rows an INT8 weight is widened to a bf16 scratch copy
  first (one pass) instead of being converted once per 128-row block inside the GEMM, unless the
  plan picks the TMA kernel's "swap AB" form: out^T = W @ x^T, the int8 weight tile as wgmma's A
  operand, converted to bf16 in registers and read by wgmma from there (only x goes through shared
  memory to the tensor cores).

SwiGLU: the gate and up outputs of the same columns meet in one program and ``silu(gate) * up``
happens in the epilogue, so the [T, 2 * inter] intermediate never exists. The GEMV and the pointer
GEMM read tiles whose rows interleave gate row i and up row i; the TMA GEMM loads a gate tile and
an up tile per k-step into two accumulators (swap AB: one 3-D tile of both into one accumulator).

Each op plans its launch (:mod:`.plan`: pure functions of shapes, dtypes, flags and the SM count)
from the tile tables of a :class:`~.tuning.Tuning` argument, not from autotuning at import time,
then launches it; a ``tile`` argument replaces the planned tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tileinfer.ops import Int8Weight, Unsupported, Workspace, sm_count
from tileinfer.ops.triton._common import (
    INTERPRET,
    cast,
    cdiv,
    dot_dtype,
    dot_precision,
    i8_to_unit_f32,
    i8x4_byte_to_f32,
    pdl_launch,
    pdl_prologue,
)
from tileinfer.ops.triton.plan import GEMV_MAX_ROWS, GemmPlan, GemvPlan, plan_gemm, plan_gemv
from tileinfer.ops.triton.tuning import TUNING, GemmTile, GemvTile, RowMode, Tuning

# ---------------------------------------------------------------------------- kernels


@triton.jit
def _weight_rows(pid, N, UP_OFF, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """Weight row of each tile row, and the output column it feeds.

    SwiGLU tiles interleave gate row c and up row c (UP_OFF = inter rows further), so the tile's
    BLOCK_N rows give BLOCK_N // 2 output columns. Columns past N are clamped to N - 1 (loaded,
    never stored), which keeps the weight loads unmasked.
    """
    r = tl.arange(0, BLOCK_N)
    if SWIGLU:
        col = pid * (BLOCK_N // 2) + r // 2
        row = tl.minimum(col, N - 1) + (r % 2) * UP_OFF
    else:
        col = pid * BLOCK_N + r
        row = tl.minimum(col, N - 1)
    return row.to(tl.int64), col


@triton.jit
def _epilogue(
    y,
    offs_t,
    T,
    cols,
    N,
    s_ptr,
    b_ptr,
    o_ptr,
    stride_ot,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROUND: tl.constexpr,
):
    """y: float32 [rows, tile_cols] -> scale, bias, SwiGLU, store; rounding as the reference does.

    The reference rounds the product to the output dtype, then scales (INT8) and rounds again, then
    adds the bias; SwiGLU rounds gate and up before ``silu(gate) * up``. ``ROUND`` is False for
    float32 outputs (lm_head), where nothing is rounded.
    """
    out_t: tl.constexpr = o_ptr.dtype.element_ty
    if ROUND:
        y = cast(y, out_t).to(tl.float32)
    if W_INT8:
        s_cols = tl.minimum(cols, N - 1)
        if SWIGLU:
            # interleaved rows: even tile rows are gate rows, odd are up rows
            s_rows = s_cols + (tl.arange(0, cols.shape[0]) % 2) * N
        else:
            s_rows = s_cols
        y = y * tl.load(s_ptr + s_rows)[None, :]
        if ROUND:
            y = cast(y, out_t).to(tl.float32)
    if SWIGLU:
        g, u = tl.split(tl.reshape(y, (y.shape[0], y.shape[1] // 2, 2)))
        y = g * tl.sigmoid(g) * u
        cols = tl.reshape(cols, (cols.shape[0] // 2, 2))
        cols, _ = tl.split(cols)
    if HAS_BIAS:
        b = tl.load(b_ptr + tl.minimum(cols, N - 1)).to(tl.float32)
        y = y + b[None, :]
    mask = (offs_t < T)[:, None] & (cols < N)[None, :]
    tl.store(o_ptr + offs_t[:, None].to(tl.int64) * stride_ot + cols[None, :], cast(y, out_t), mask=mask)


@triton.jit
def _row_tile(w_rows, k0, K, KW: tl.constexpr, W_INT8: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BLOCK_N, KW] weight tile at column k0 (int32 words of 4 weights when W_INT8 == 2)."""
    if W_INT8 == 2:
        idx = k0 // 4 + tl.arange(0, KW)
        lim = K // 4
    else:
        idx = k0 + tl.arange(0, KW)
        lim = K
    if EVEN_K:
        return tl.load(w_rows + idx[None, :])
    return tl.load(w_rows + idx[None, :], mask=(idx < lim)[None, :], other=0)


@triton.jit
def _row_fma(acc, xs, wv, x_ptr, k0, K, KW: tl.constexpr, W_INT8: tl.constexpr):
    """acc[n, j] += w[n, k0 + j] * x[k0 + j] in float32.

    W_INT8 == 1: int8 weights sign-extended and widened with the 2^23 magic number (4 full-rate
    instructions a weight with the FMA; I2F runs at a quarter of that). W_INT8 == 2: int32
    words, byte i of word j is weight 4j + i, widened with ``i8x4_byte_to_f32``. W_INT8 == 4: int8
    weights as ``i8_to_unit_f32`` biased floats (about 2.25 instructions a weight with the FMA);
    ``xs`` sums x so that the caller can remove the bias once per output.
    """
    if W_INT8 == 2:
        kw = k0 // 4 + tl.arange(0, KW)
        for i in tl.static_range(4):
            kx = kw * 4 + i
            xi = tl.load(x_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
            acc += i8x4_byte_to_f32(wv, 8 * i) * xi[None, :]
    else:
        kk = k0 + tl.arange(0, KW)
        xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if W_INT8 == 1:
            # sign-extend, add into the mantissa of 2^23 + 128, subtract: exact, no I2F
            wf = (wv.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        elif W_INT8 == 4:
            wf = i8_to_unit_f32(wv)
            xs += xv
        else:
            wf = wv.to(tl.float32)
        acc += wf * xv[None, :]
    return acc, xs


@triton.jit(do_not_specialize=["T"])  # row count: masks handle any value
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_ptr,
    T,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_ot,
    UP_OFF,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
    PIPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[t, n] = sum_k x[t, k] * w[n, k] for T <= 16 rows.

    BLOCK_T == 1: float32 products accumulated elementwise in a [BLOCK_N, BLOCK_K(/4)] register
    tile (no tensor cores; one FMA per weight), reduced once at the end; with PIPE >= 2 the weight
    tiles stream through a shared-memory ring, PIPE deep. W_INT8 (0 bf16, 1 int8, 2 int8 read as
    int32 words [N, K / 4], 4 int8 as biased floats): see ``_row_fma``. BLOCK_T == 16: rows padded
    to 16, ``tl.dot`` (cp.async-pipelined by num_stages); with INT8 the int8 weight itself,
    converted to bf16 in registers.
    """
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    rows, cols = _weight_rows(pid, N, UP_OFF, BLOCK_N, SWIGLU)
    w_rows = w_ptr + rows[:, None] * stride_wn
    offs_t = tl.arange(0, BLOCK_T)
    if BLOCK_T == 1:
        KW: tl.constexpr = BLOCK_K // 4 if W_INT8 == 2 else BLOCK_K
        acc = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
        xs = tl.zeros((KW,), dtype=tl.float32)  # sum of x, for W_INT8 == 4 only
        # PIPE > 1: Triton's software pipeliner streams the weight tiles through a PIPE-deep
        # shared-memory ring (cp.async), so loads stay in flight while the FMAs run
        for k0 in tl.range(0, K, BLOCK_K, num_stages=PIPE):
            wv = _row_tile(w_rows, k0, K, KW, W_INT8, EVEN_K)
            acc, xs = _row_fma(acc, xs, wv, x_ptr, k0, K, KW, W_INT8)
        y = tl.sum(acc, axis=1)
        if W_INT8 == 4:
            # sum_k (1 + (w_k + 128) 2^-15) x_k -> sum_k w_k x_k (the bias of i8_to_unit_f32)
            y = (y - 1.00390625 * tl.sum(xs, axis=0)) * 32768.0
        y = y[None, :]
    else:
        x_rows = x_ptr + offs_t[:, None] * stride_xt
        t_ok = (offs_t < T)[:, None]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                wv = tl.load(w_rows + kk[None, :])
            else:
                wv = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0)
            # int8 -> bf16 here is Triton's PRMT/HADD2 conversion, no I2F
            xv = tl.load(x_rows + kk[None, :], mask=t_ok & (kk < K)[None, :], other=0.0)
            acc = tl.dot(xv.to(DOT_T), tl.trans(wv.to(DOT_T)), acc, input_precision=PREC)
        y = acc
    _epilogue(y, offs_t, T, cols, N, s_ptr, b_ptr, o_ptr, stride_ot, W_INT8, HAS_BIAS, SWIGLU, ROUND)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    UP_OFF,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
):
    """Tiled GEMM out[m, n] = sum_k x[m, k] * w[n, k] (Triton's matmul tutorial: grouped order).

    W_INT8: w_ptr holds int8 [N, K]; each tile is converted to the dot type in registers.
    """
    pid = tl.program_id(0)
    n_cols = N
    COLS: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(n_cols, COLS)
    # grouped ordering: GROUP_M row-blocks share each weight column-block while it is in L2
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows, cols = _weight_rows(pid_n, N, UP_OFF, BLOCK_N, SWIGLU)
    x_rows = x_ptr + rows_x[:, None] * stride_xm
    w_rows = w_ptr + rows[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :])
            b = tl.load(w_rows + kk[None, :])
        else:
            a = tl.load(x_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0)
        acc = tl.dot(a.to(DOT_T), tl.trans(b.to(DOT_T)), acc, input_precision=PREC)
    _epilogue(acc, offs_m, M, cols, N, s_ptr, b_ptr, o_ptr, stride_om, W_INT8, HAS_BIAS, SWIGLU, ROUND)


@triton.jit
def _tile_coords(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-blocks share each weight column-block while it is in L2."""
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _bcast(v, SWAP_AB: tl.constexpr, ALONG_COLS: tl.constexpr):
    """A vector over the output's columns (ALONG_COLS) or rows, shaped to broadcast against the
    accumulator: [rows, cols], or [cols, rows] when SWAP_AB."""
    AXIS: tl.constexpr = 1 if SWAP_AB == ALONG_COLS else 0
    return tl.expand_dims(v, AXIS)


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(
    a_desc,
    b_desc,
    s_ptr,
    bias_ptr,
    o_ptr,
    M,
    N,
    K,
    stride_om,
    UP_OFF,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROUND: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """Persistent GEMM with TMA loads (Triton tutorial 09): NUM_SMS programs walk the output tiles.

    Tiles are loaded by the bulk tensor copy engine through descriptors (out-of-range rows and
    columns read as zeros, so no masks); with WARP_SPEC, Triton splits producer (TMA) and consumer
    (wgmma + epilogue) warps. SwiGLU: BLOCK_N is the output width; each k-step loads the gate tile
    and the up tile (UP_OFF rows further) and keeps two accumulators.

    SWAP_AB ("swap AB", for INT8 weights): the product is computed transposed, out^T tile =
    w tile [BLOCK_N, BLOCK_K] @ x tile^T, so the weight is wgmma's A operand. Converted to the dot
    type in registers, it stays there (wgmma reads A from registers; Triton keeps a dot's A operand
    in registers when an elementwise op produces it), and only x goes through shared memory to the
    tensor cores: the int8 tile goes TMA -> shared -> registers -> convert -> wgmma, with no store of
    the converted tile back to shared memory. The weight rows are wgmma's M (64 a warpgroup), the
    tokens its N. The epilogue works on the transposed tile (scales and bias along its rows) and
    stores it transposed. SwiGLU reads gate and up rows as one 3-D tile [2, BLOCK_N, BLOCK_K] (one
    dot, one accumulator split in the epilogue): with two dots, ptxas serializes every wgmma (its
    C7515: the second dot's A registers are written while the first runs). The tile loop is not
    flattened into the k-loop for the same reason (the accumulator reset inside the pipelined loop).
    """
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=not SWAP_AB, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        if SWAP_AB:
            # SwiGLU: one [2 * BLOCK_N, BLOCK_M] accumulator, gate rows then up rows (b_desc is 3-D)
            acc = tl.zeros((2 * BLOCK_N if SWIGLU else BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if SWIGLU:
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BLOCK_K]).to(DOT_T)
            if SWAP_AB:
                if SWIGLU:
                    b = b_desc.load([0, on, ki * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K).to(DOT_T)
                else:
                    b = b_desc.load([on, ki * BLOCK_K]).to(DOT_T)
                acc = tl.dot(b, a.T, acc, input_precision=PREC)
            else:
                b = b_desc.load([on, ki * BLOCK_K]).to(DOT_T)
                acc = tl.dot(a, b.T, acc, input_precision=PREC)
                if SWIGLU:
                    bu = b_desc.load([UP_OFF + on, ki * BLOCK_K]).to(DOT_T)
                    acc_u = tl.dot(a, bu.T, acc_u, input_precision=PREC)
        if not SWIGLU or SWAP_AB:
            acc_u = acc  # unused: no up accumulator, or the up rows are in acc
        _store_tile(
            acc, acc_u, om, on, M, N, s_ptr, bias_ptr, o_ptr, stride_om, UP_OFF,
            BLOCK_M, BLOCK_N, W_INT8, HAS_BIAS, SWIGLU, ROUND, SWAP_AB,
        )  # fmt: skip


@triton.jit
def _store_tile(
    acc,
    acc_u,
    om,
    on,
    M,
    N,
    s_ptr,
    bias_ptr,
    o_ptr,
    stride_om,
    UP_OFF,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROUND: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """Epilogue of the TMA kernels: the float32 accumulator of the output tile at (om, on) (with
    SwiGLU acc the gate, acc_u the up product; swap AB: acc [(2 *) BLOCK_N, BLOCK_M], transposed)
    rounded to the output dtype where the reference rounds, scaled (INT8), gated, biased, stored."""
    out_t: tl.constexpr = o_ptr.dtype.element_ty
    rows = om + tl.arange(0, BLOCK_M)
    cols = on + tl.arange(0, BLOCK_N)
    cc = tl.minimum(cols, N - 1)
    y = acc
    if SWAP_AB:
        if SWIGLU:
            y, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    if ROUND:
        y = cast(y, out_t).to(tl.float32)
    if W_INT8:
        y = y * _bcast(tl.load(s_ptr + cc), SWAP_AB, True)
        if ROUND:
            y = cast(y, out_t).to(tl.float32)
    if SWIGLU:
        u = acc_u
        if ROUND:
            u = cast(u, out_t).to(tl.float32)
        if W_INT8:
            u = u * _bcast(tl.load(s_ptr + UP_OFF + cc), SWAP_AB, True)
            if ROUND:
                u = cast(u, out_t).to(tl.float32)
        y = y * tl.sigmoid(y) * u
    if HAS_BIAS:
        y = y + _bcast(tl.load(bias_ptr + cc).to(tl.float32), SWAP_AB, True)
    r64 = rows.to(tl.int64) * stride_om
    offs = _bcast(r64, SWAP_AB, False) + _bcast(cols, SWAP_AB, True)
    mask = _bcast(rows < M, SWAP_AB, False) & _bcast(cols < N, SWAP_AB, True)
    tl.store(o_ptr + offs, cast(y, out_t), mask=mask)


@triton.jit
def _sk_start(pid, total, P):
    """First k-iteration of stream-K program ``pid`` of ``P`` (an equal share of ``total``, +-1)."""
    return (pid.to(tl.int64) * total // P).to(tl.int32)


@triton.jit(do_not_specialize=["M"])
def _gemm_streamk_kernel(
    a_desc,
    b_desc,
    s_ptr,
    bias_ptr,
    o_ptr,
    ws_ptr,
    flag_ptr,
    M,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
):
    """Stream-K GEMM (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix
    Multiplication on the GPU", PPoPP 2023): out = x @ w.T for outputs whose tile count leaves the
    last wave of a tile-per-program GEMM mostly idle (Qwen3-4B's down at 1k tokens: 80 tiles of
    128 x 256 on an H200).

    The grid's P programs (at most one per SM; waits assume every program gets an SM, which MPS
    limits or concurrent kernels holding SMs could break) first run the full waves
    of tiles whole (data-parallel, the "DP + stream-K" hybrid of the paper), then split the
    remaining tiles' k-steps into P equal contiguous ranges, so a tile may be shared by up to
    ceil(k_tiles / share) + 1 programs. A program walks its range from the end: its last fragment,
    when it stops short of the tile's end, goes first to its float32 slot in ``ws_ptr``
    [P, BLOCK_M, BLOCK_N] and raises ``flag_ptr[pid]`` (release); its first fragment, when it ends a
    tile that began in an earlier program, comes last and adds the slots of those programs
    (pid - 1, pid - 2, ...; acquire, then the flag back to 0 for the next launch) before the
    epilogue. Waits are only on lower program ids, which stored their slots as soon as their
    full-wave tiles were done, so the wait is short (and the interpreter, running programs in order,
    never waits). The sum order is fixed: for a given tile and SM count the result is the same bits
    every run. TMA loads as in ``_gemm_tma_kernel``; no SwiGLU, no swap AB.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles = grid_m * grid_n
    dp_tiles = (tiles // P) * P
    for tile in range(pid, dp_tiles, P):  # the full waves: a whole tile a program
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = _k_steps(a_desc, b_desc, om, on, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, DOT_T, PREC)
        _store_tile(
            acc, acc, om, on, M, N, s_ptr, bias_ptr, o_ptr, stride_om, 0,
            BLOCK_M, BLOCK_N, W_INT8, HAS_BIAS, False, ROUND, False,
        )  # fmt: skip
    # the rest, stream-K: iterations of the tiles from dp_tiles on, counted from 0
    total = (tiles - dp_tiles) * k_tiles
    start = _sk_start(pid, total, P)
    it_end = _sk_start(pid + 1, total, P)
    slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while it_end > start:
        t0 = (it_end - 1) // k_tiles * k_tiles
        k_lo = tl.maximum(start, t0) - t0
        k_hi = it_end - t0
        pid_m, pid_n = _tile_coords(dp_tiles + t0 // k_tiles, grid_m, grid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = _k_steps(a_desc, b_desc, om, on, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, DOT_T, PREC)
        if k_hi < k_tiles:
            # the tile's end belongs to a later program: hand this part over
            tl.store(ws_ptr + pid.to(tl.int64) * (BLOCK_M * BLOCK_N) + slot, acc, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's part is stored before the flag goes up
            tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
        else:
            j = pid - 1
            while _sk_start(j + 1, total, P) > t0:  # program j's range ends inside this tile
                # with fewer iterations than programs some programs have none: skip those
                if _sk_start(j, total, P) < _sk_start(j + 1, total, P):
                    while tl.atomic_add(flag_ptr + j, 0, sem="acquire") == 0:
                        pass
                    # .cg: L1 is not coherent across SMs (the acquire above already orders these loads)
                    acc += tl.load(ws_ptr + j.to(tl.int64) * (BLOCK_M * BLOCK_N) + slot, cache_modifier=".cg")
                    tl.atomic_xchg(flag_ptr + j, 0, sem="relaxed")
                j -= 1
            _store_tile(
                acc, acc, om, on, M, N, s_ptr, bias_ptr, o_ptr, stride_om, 0,
                BLOCK_M, BLOCK_N, W_INT8, HAS_BIAS, False, ROUND, False,
            )  # fmt: skip
        it_end = t0 + k_lo


@triton.jit
def _k_steps(
    a_desc,
    b_desc,
    om,
    on,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_T: tl.constexpr,
    PREC: tl.constexpr,
):
    """x[om:, k] @ w[on:, k].T over k-steps k_lo..k_hi of the tile at (om, on), float32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        a = a_desc.load([om, ki * BLOCK_K]).to(DOT_T)
        b = b_desc.load([on, ki * BLOCK_K]).to(DOT_T)
        acc = tl.dot(a, b.T, acc, input_precision=PREC)
    return acc


# ---------------------------------------------------------------------------- launch


@triton.jit
def _widen_kernel(q_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    # through float32: exact, and the interpreter has no int8 -> bf16 cast
    tl.store(o_ptr + offs, cast(tl.load(q_ptr + offs, mask=m).to(tl.float32), o_ptr.dtype.element_ty), mask=m)


def _widen_int8(q: torch.Tensor, dtype) -> torch.Tensor:
    """int8 [N, K], contiguous -> the same integers in ``dtype`` (exact for |q| <= 127 in bf16), one pass."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n = q.numel()
    _widen_kernel[(cdiv(n, 8192),)](q, out, n, BLOCK=8192, num_warps=8)
    return out


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read ``t`` [rows, cols]: unit column stride, 16-byte aligned base
    and row stride."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _streamk_workspace(
    workspace: Workspace, device: torch.device, programs: int, tile: int, sms: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream-K's float32 partial tiles [programs * tile] and its int32 flags [programs], one pair
    per (device, stream), held by ``workspace``. The flags are all zero between launches (each launch
    lowers every flag it raised), so the pair serves every launch on its stream, CUDA graph replays
    included. Launches on two streams at once sharing one pair could read each other's partials and
    then spin forever, hence the per-stream key. The pair is sized for ``sms`` programs and 128 x 256
    tiles at first use; a larger one replaces it only outside a graph capture (a captured graph keeps
    the addresses it saw), and the old pair is kept, since a graph captured earlier may still use it.

    Raises:
        RuntimeError: the pair must be made or grow while a CUDA graph is being captured.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = workspace.get(("streamk", device, stream), list)
    if held and held[-1][0].numel() >= programs * tile and held[-1][1].numel() >= programs:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "stream-K workspace: first use or growth inside a CUDA graph capture; run the GEMM once before capturing"
        )
    n = max(programs, sms)
    held.append(
        (
            torch.empty(n * max(tile, 128 * 256), dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device),
        )
    )
    return held[-1]


def _check_operands(x: torch.Tensor, w, bias, swiglu: bool, op: str) -> None:
    """Raise for operands the GEMV/GEMM kernels cannot take, before anything runs (the INT8
    layouts of single plans are checked in :func:`_matmul`).

    Raises:
        ValueError: x's features differ from the weight's columns.
        Unsupported: x that is not 2-D, weight rows or a bias that are not contiguous.
    """
    if x.dim() != 2:
        raise Unsupported(f"x is {x.dim()}-D, not [T, in]")
    wq = w.q if isinstance(w, Int8Weight) else w
    if wq.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[1]} features, the weight {wq.shape[1]} columns")
    if wq.stride(1) != 1:
        raise Unsupported("weight rows not contiguous")
    if bias is not None and not swiglu and not bias.is_contiguous():
        raise Unsupported("bias not contiguous")


class _Operands(NamedTuple):
    """What every GEMV/GEMM launch passes besides its plan (see :func:`_matmul`)."""

    x: torch.Tensor  # [T, K], unit column stride
    w: torch.Tensor  # [n_rows, K] in x's dtype, int8, or (the GEMV's RowMode.WORDS) int32 words
    scale: torch.Tensor  # float32 [n_rows] of an INT8 weight; a placeholder otherwise
    bias: torch.Tensor  # [N]; a placeholder when has_bias is False
    out: torch.Tensor  # [T, N]
    int8: bool
    has_bias: bool
    swiglu: bool  # w holds the gate rows, then the up rows (up_off = N rows further)


def _matmul(
    x: torch.Tensor, w, bias, out_dtype, swiglu: bool, op: str, tile, tuning: Tuning, workspace
) -> torch.Tensor:
    """Shared launcher of ``op``: x [T, K] @ w.T -> [T, N] in ``out_dtype`` (N = rows of w, halved for
    SwiGLU): plan (:func:`plan_gemv` up to GEMV_MAX_ROWS rows, else :func:`plan_gemm`), check the
    layouts the plan needs, launch.

    Raises:
        ValueError: x's features differ from the weight's columns.
        TypeError: ``tile`` is not a GemvTile (1 to 16 rows) or a GemmTile (more).
        Unsupported: see :func:`_check_operands`; also an INT8 weight that the int32-word GEMV or the
            widening pass cannot read as one contiguous block.
    """
    _check_operands(x, w, bias, swiglu, op)
    T, K = x.shape
    int8 = isinstance(w, Int8Weight)
    wq = w.q if int8 else w
    n_rows = wq.shape[0]
    N = n_rows // 2 if swiglu else n_rows
    out = torch.empty((T, N), dtype=out_dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    has_bias = bias is not None and not swiglu  # the reference's swiglu takes no bias
    # absent inputs are passed as the weight as given (never read; one pointer type per weight dtype)
    scale = w.scale if int8 else wq
    b = bias if bias is not None else wq
    if T <= GEMV_MAX_ROWS:
        if tile is not None and not isinstance(tile, GemvTile):
            raise TypeError(f"{op}: {T} rows take a GemvTile, not {tile!r}")
        f32 = torch.float32 in (x.dtype, out_dtype)
        plan = plan_gemv(T, n_rows, K, int8=int8, swiglu=swiglu, float32=f32, tuning=tuning, tile=tile)
        if plan.w_int8 == RowMode.WORDS:  # this INT8 GEMV reads the weight as int32 words
            if K % 4 or not wq.is_contiguous():
                raise Unsupported("INT8 weight not contiguous in whole int32 words")
            wq = wq.view(torch.int32)
    else:
        if tile is not None and not isinstance(tile, GemmTile):
            raise TypeError(f"{op}: {T} rows take a GemmTile, not {tile!r}")
        # x with a strided last axis is copied first: a fresh tensor, aligned, rows of K elements
        tma_x = _tma_ok(x) if x.stride(1) == 1 else (K * x.element_size()) % 16 == 0
        plan = plan_gemm(
            T,
            N,
            K,
            int8=int8,
            swiglu=swiglu,
            float32_out=out_dtype == torch.float32,
            x_bytes=x.element_size(),
            tma_x=tma_x,
            tma_w=_tma_ok(wq),
            sms=tuning.sms or sm_count(x.device),
            tuning=tuning,
            tile=tile,
        )
        if plan.widen and not wq.is_contiguous():  # the widening pass reads the weight as one flat block
            raise Unsupported("INT8 weight not contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    if T > GEMV_MAX_ROWS and plan.widen:
        wq = _widen_int8(wq, x.dtype)  # exact copy; the epilogue still applies the INT8 scales
    args = _Operands(x, wq, scale, b, out, int8, has_bias, swiglu)
    if T <= GEMV_MAX_ROWS:
        _launch_gemv(args, plan)
    elif plan.tile.kernel == "ptr":
        _launch_ptr(args, plan)
    elif plan.tile.kernel == "streamk":
        _launch_streamk(args, plan, workspace if workspace is not None else Workspace())
    else:
        _launch_tma(args, plan)
    return out


def _dot_args(a: _Operands) -> dict:
    """The constexprs every GEMV/GEMM kernel takes for its dot and its rounding."""
    return dict(ROUND=a.out.dtype != torch.float32, DOT_T=dot_dtype(a.x.dtype), PREC=dot_precision(a.x.dtype))


def _launch_gemv(a: _Operands, plan: GemvPlan) -> None:
    T, K = a.x.shape
    N = a.out.shape[1]
    _gemv_kernel[(plan.programs,)](
        a.x, a.w, a.scale, a.bias, a.out,
        T, N, K, a.x.stride(0), a.w.stride(0), a.out.stride(0), N if a.swiglu else 0,
        BLOCK_T=16 if plan.dot else 1,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        W_INT8=plan.w_int8,
        HAS_BIAS=a.has_bias,
        SWIGLU=a.swiglu,
        EVEN_K=K % plan.block_k == 0,
        PIPE=plan.pipe,
        num_warps=plan.warps,
        num_stages=plan.stages,
        **_dot_args(a),
        **pdl_launch(a.x),
    )  # fmt: skip


def _launch_ptr(a: _Operands, plan: GemmPlan) -> None:
    T, K = a.x.shape
    N = a.out.shape[1]
    t = plan.tile
    _gemm_kernel[(plan.programs,)](
        a.x, a.w, a.scale, a.bias, a.out,
        T, N, K, a.x.stride(0), a.w.stride(0), a.out.stride(0), N if a.swiglu else 0,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n * 2 if a.swiglu else t.block_n,  # the pointer kernel's tile holds gate and up rows
        BLOCK_K=t.block_k,
        GROUP_M=t.group_m,
        W_INT8=a.int8,
        HAS_BIAS=a.has_bias,
        SWIGLU=a.swiglu,
        EVEN_K=K % t.block_k == 0,
        num_warps=t.warps,
        num_stages=t.stages,
        **_dot_args(a),
    )  # fmt: skip


def _launch_streamk(a: _Operands, plan: GemmPlan, workspace: Workspace) -> None:
    T, K = a.x.shape
    N = a.out.shape[1]
    t = plan.tile
    ws, flags = _streamk_workspace(workspace, a.x.device, plan.programs, t.block_m * t.block_n, plan.sms)
    _gemm_streamk_kernel[(plan.programs,)](
        TensorDescriptor(a.x, [T, K], [a.x.stride(0), 1], [t.block_m, t.block_k]),
        TensorDescriptor(a.w, [a.w.shape[0], K], [a.w.stride(0), 1], [t.block_n, t.block_k]),
        a.scale, a.bias, a.out, ws, flags,
        T, N, K, a.out.stride(0),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP_M=t.group_m,
        W_INT8=a.int8,
        HAS_BIAS=a.has_bias,
        num_warps=t.warps,
        num_stages=t.stages,
        **_dot_args(a),
    )  # fmt: skip


def _launch_tma(a: _Operands, plan: GemmPlan) -> None:
    """The persistent TMA kernel: "tma", "tma_ws" or "swap"."""
    T, K = a.x.shape
    N = a.out.shape[1]
    t = plan.tile
    w = a.w
    a_desc = TensorDescriptor(a.x, [T, K], [a.x.stride(0), 1], [t.block_m, t.block_k])
    if t.kernel == "swap" and a.swiglu:  # gate and up rows as one 3-D tile [2, block_n, block_k]
        b_desc = TensorDescriptor(w, [2, N, K], [N * w.stride(0), w.stride(0), 1], [2, t.block_n, t.block_k])
    else:
        b_desc = TensorDescriptor(w, [w.shape[0], K], [w.stride(0), 1], [t.block_n, t.block_k])
    _gemm_tma_kernel[(plan.programs,)](
        a_desc, b_desc, a.scale, a.bias, a.out,
        T, N, K, a.out.stride(0), N if a.swiglu else 0,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP_M=t.group_m,
        NUM_SMS=plan.sms,
        W_INT8=a.int8,
        HAS_BIAS=a.has_bias,
        SWIGLU=a.swiglu,
        WARP_SPEC=t.kernel == "tma_ws" and not INTERPRET,
        SWAP_AB=t.kernel == "swap",
        num_warps=t.warps,
        num_stages=t.stages,
        **_dot_args(a),
    )  # fmt: skip


def linear(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    *,
    tile: GemvTile | GemmTile | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias``: x [T, in] -> [T, out] in x's dtype.

    w: [out, in] in x's dtype, or an :class:`Int8Weight` (int8 [out, in] + float32 scale [out],
    scale applied to the float32 product in the epilogue). T <= 16: GEMV kernel; else GEMM. ``tile``
    replaces the planned one (a GemvTile for T <= 16, else a GemmTile); ``tuning`` holds the tables
    the plan chooses from and the SM count; ``workspace`` keeps stream-K's partials between calls
    (None: fresh ones for this call). Raises as :func:`_matmul`.
    """
    return _matmul(x, w, bias, x.dtype, False, "linear", tile, tuning, workspace)


def swiglu(
    x: torch.Tensor,
    w_gate_up,
    *,
    tile: GemvTile | GemmTile | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """SwiGLU MLP input (Shazeer, 2020): ``silu(x @ Wg.T) * (x @ Wu.T)`` with the gating fused into
    the epilogue of the gate/up GEMM/GEMV.

    x: [T, hidden]; w_gate_up: [2 * inter, hidden] (gate rows then up rows), or an
    :class:`Int8Weight` of that shape. Returns [T, inter] in x's dtype. Keywords and errors as
    :func:`linear`.
    """
    return _matmul(x, w_gate_up, None, x.dtype, True, "swiglu", tile, tuning, workspace)


def lm_head(
    x: torch.Tensor,
    w,
    *,
    tile: GemvTile | GemmTile | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Logits in float32: x [T, hidden] @ w.T -> [T, vocab] float32, accumulated in float32.

    w: [vocab, hidden] (model dtype or float32) or an :class:`Int8Weight`. With a float32 weight and
    bf16 activations the activations are upcast (the product then runs in float32). Keywords and
    errors as :func:`linear`.
    """
    _check_operands(x, w, None, False, "lm_head")
    if not isinstance(w, Int8Weight) and w.dtype != x.dtype and w.dtype == torch.float32:
        x = x.to(torch.float32)
    return _matmul(x, w, None, torch.float32, False, "lm_head", tile, tuning, workspace)
