"""Linear layers: skinny GEMM (decode/verify, 1-16 rows) and tiled GEMM (prefill), BF16 or INT8.

``y = x @ w.T``, with w [out, in] row-major (transformers' layout, no transposed copy: the GEMM
loads the weight tile with ``order=(1, 0)``, the skinny kernels use it as the A operand as it
is stored). Three epilogues share the kernels:

- linear: round to the model dtype like ``F.linear``; INT8 weights multiply one float32 scale per
  output channel into the product (TileInfer.jl's weight-only INT8); optional bias.
- swiglu: the gate and up rows of the stacked ``gate_up_proj`` are two accumulators of the same
  block; ``silu(gate) * up`` is applied before the only store (Shazeer, 2020), so the [T, 2*inter]
  intermediate never reaches memory.
- logits (lm_head): float32 output, no rounding.

Decode steps are memory-bound: each weight byte is read once. Rows are padded to 16 for the
tensor cores (TileInfer.jl's lesson: below 16 rows the small-matrix path spills and is far slower).
When the output is too narrow to give about one block per SM, the reduction axis is split (split-K)
into a float32 workspace that a second small kernel sums and finishes. The skinny kernels start
streaming their first weight tile before the PDL wait (see _common.py).

Decode (T == 1) with an INT8 weight and bf16/fp16 activations takes neither path: a float32 FMA
GEMV over int32 words of the weight whose bytes become floats by bit operations
(:func:`gemv_int8_unit_kernel`, :func:`gemv_swiglu_int8_unit_kernel`): no bf16 conversion, no mma;
one bf16/fp16 row against a long enough weight in its dtype may take the float32-FMA GEMV
(:func:`gemv_fma_kernel`). Prefill from ``Tuning.int8_widen_rows`` rows widens an INT8 weight once
(:func:`widen_kernel`) and runs the tiled GEMM on the exact copy, as the Triton backend does.
Which kernels and tiles a call takes is planned by :mod:`.plan` from a :class:`~.tuning.Tuning`.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from tileinfer.ops import Int8Weight, Unsupported, Workspace, sm_count
from tileinfer.ops.cutile._common import ZERO, ConstBool, ConstInt, cdiv, dummy, launch, pdl_prologue, scratch
from tileinfer.ops.cutile.plan import SKINNY_ROWS, GemmPlan, SkinnyPlan, plan_gemm, plan_skinny
from tileinfer.ops.cutile.tuning import TUNING, Tuning

WIDEN_TILE = (64, 256)  # int8 rows x columns per widening block

# ------------------------------------------------------------------------------------ helpers


def _operands(w, x, INT8):
    """Bring the weight tile ``w`` and the activation tile ``x`` to one dtype for the mma: INT8
    weights convert to the activation dtype (exact for |q| <= 127); a float32 weight (lm_head
    kept in float32) lifts the activations to float32."""
    if INT8:
        w = ct.astype(w, x.dtype)
    elif w.dtype != x.dtype:
        w = ct.astype(w, ct.float32)
        x = ct.astype(x, ct.float32)
    return w, x


def _finish(acc, sc, bias, dt, INT8, HAS_BIAS, LOGITS):
    """Epilogue of one accumulator (float32 [rows, TN]) -> float32 values ready for the store.

    Mirrors the reference's roundings: F.linear rounds its product to the model dtype, the INT8
    scale is applied to that and rounded again, the bias add is rounded once more. Logits keep the
    float32 product (times the INT8 scale).
    """
    if LOGITS:
        y = acc
        if INT8:
            y = y * sc
        return y
    y = ct.astype(ct.astype(acc, dt), ct.float32)
    if INT8:
        y = ct.astype(ct.astype(y * sc, dt), ct.float32)
    if HAS_BIAS:
        y = ct.astype(ct.astype(y + bias, dt), ct.float32)
    return y


def _row_vec(arr, j, TN, ENABLED):
    """Per-output-channel vector tile [1, TN] (float32) at tile j, or 0 when the input is absent."""
    if ENABLED:
        return ct.reshape(ct.astype(ct.load(arr, (j,), shape=(TN,), padding_mode=ZERO), ct.float32), (1, TN))
    return 0.0


def _gate_up_scales(scale, j, TN, inter, INT8):
    """Per-channel scales of the gate and up halves of a stacked INT8 gate_up weight."""
    if INT8:
        return (
            _row_vec(scale.slice(axis=0, start=0, stop=inter), j, TN, True),
            _row_vec(scale.slice(axis=0, start=inter, stop=2 * inter), j, TN, True),
        )
    return 0.0, 0.0


def _silu_mul(g, u):
    return g / (1.0 + ct.exp(-g)) * u


# ------------------------------------------------------------------------------ skinny kernels
#
# The weight tile is the A operand ([TN, TK], as stored) and the 16 padded activation rows the B
# operand ([TK, 16], x loaded transposed): the product is [TN, 16], transposed in the epilogue.
# With M = TN >= 64 this lowers to Hopper's warpgroup MMA (HGMMA) with no spills; the other way
# round (x as A, M = 16) cuTile 1.7 emitted HMMA for TN >= 32 and, for TN = 16, neither HMMA nor
# HGMMA but heavy spills (SASS of the sm_90 cubins, benchmarks/cutile-NOTES.md, "linear / swiglu /
# lm_head").


def _skinny_acc(x, w, j, k0, k1, nk, TN, TK, INT8):
    """acc^T [16, TN] over K tiles [k0, k1) (nk tiles in all).

    The first weight tile is requested *before* waiting for the previous kernel (PDL): weights are
    never written by an earlier kernel of a step, so their stream starts during the predecessor's
    tail. The activations are read only after the wait.
    """
    w0 = ct.load(w, (j, min(k0, nk - 1)), shape=(TN, TK), padding_mode=ZERO, latency=10)
    ct.grid_dependency_control_wait()
    acc = ct.zeros((TN, 16), ct.float32)
    if k0 < k1:
        x0 = ct.load(x, (k0, 0), shape=(TK, 16), order=(1, 0), padding_mode=ZERO)
        w0, x0 = _operands(w0, x0, INT8)
        acc = ct.mma(w0, x0, acc)
    for kk in range(k0 + 1, k1):
        xt = ct.load(x, (kk, 0), shape=(TK, 16), order=(1, 0), padding_mode=ZERO)
        wt = ct.load(w, (j, kk), shape=(TN, TK), padding_mode=ZERO, latency=10)
        wt, xt = _operands(wt, xt, INT8)
        acc = ct.mma(wt, xt, acc)
    return ct.transpose(acc)


@ct.kernel(occupancy=2)
def gemv_kernel(
    x, w, scale, bias, out, TN: ConstInt, TK: ConstInt, INT8: ConstBool, HAS_BIAS: ConstBool, LOGITS: ConstBool
):
    """One block per TN output channels; x padded to 16 rows; full reduction in the block."""
    ct.grid_dependency_control_launch_dependents()  # the wait is in _skinny_acc
    j = ct.bid(0)
    nk = ct.cdiv(x.shape[1], TK)
    acc = _skinny_acc(x, w, j, 0, nk, nk, TN, TK, INT8)
    y = _finish(acc, _row_vec(scale, j, TN, INT8), _row_vec(bias, j, TN, HAS_BIAS), out.dtype, INT8, HAS_BIAS, LOGITS)
    ct.store(out, (0, j), ct.astype(y, out.dtype))


@ct.kernel(occupancy=2)
def gemv_swiglu_kernel(x, w, scale, out, TN: ConstInt, TK: ConstInt, INT8: ConstBool):
    """SwiGLU GEMV: gate rows [0, inter) and up rows [inter, 2 inter) of w, fused epilogue.
    As in _skinny_acc, the first gate and up tiles are requested before the PDL wait."""
    ct.grid_dependency_control_launch_dependents()
    j = ct.bid(0)
    inter = out.shape[1]
    wg = w.slice(axis=0, start=0, stop=inter)
    wu = w.slice(axis=0, start=inter, stop=2 * inter)
    bg = ct.load(wg, (j, 0), shape=(TN, TK), padding_mode=ZERO, latency=10)
    bu = ct.load(wu, (j, 0), shape=(TN, TK), padding_mode=ZERO, latency=10)
    ct.grid_dependency_control_wait()
    xt = ct.load(x, (0, 0), shape=(TK, 16), order=(1, 0), padding_mode=ZERO)
    bg, x1 = _operands(bg, xt, INT8)
    bu, x2 = _operands(bu, xt, INT8)
    accg = ct.mma(bg, x1, ct.zeros((TN, 16), ct.float32))
    accu = ct.mma(bu, x2, ct.zeros((TN, 16), ct.float32))
    for kk in range(1, ct.cdiv(x.shape[1], TK)):
        xt = ct.load(x, (kk, 0), shape=(TK, 16), order=(1, 0), padding_mode=ZERO)
        bg = ct.load(wg, (j, kk), shape=(TN, TK), padding_mode=ZERO, latency=10)
        bu = ct.load(wu, (j, kk), shape=(TN, TK), padding_mode=ZERO, latency=10)
        bg, x1 = _operands(bg, xt, INT8)
        bu, x2 = _operands(bu, xt, INT8)
        accg = ct.mma(bg, x1, accg)
        accu = ct.mma(bu, x2, accu)
    scg, scu = _gate_up_scales(scale, j, TN, inter, INT8)
    g = _finish(ct.transpose(accg), scg, 0.0, out.dtype, INT8, False, False)
    u = _finish(ct.transpose(accu), scu, 0.0, out.dtype, INT8, False, False)
    ct.store(out, (0, j), ct.astype(_silu_mul(g, u), out.dtype))


@ct.kernel(occupancy=2)
def gemv_partial_kernel(x, w, ws, TN: ConstInt, TK: ConstInt, INT8: ConstBool):
    """Split-K part: block (j, s) reduces the s-th slice of K tiles into ws[s, :T, j*TN:...]."""
    ct.grid_dependency_control_launch_dependents()  # the wait is in _skinny_acc
    j = ct.bid(0)
    s = ct.bid(1)
    nk = ct.cdiv(x.shape[1], TK)
    per = ct.cdiv(nk, ct.num_blocks(1))
    k0 = s * per
    acc = _skinny_acc(x, w, j, k0, min(k0 + per, nk), nk, TN, TK, INT8)
    ct.store(ws, (s, 0, j), ct.reshape(acc, (1, 16, TN)))


@ct.kernel
def gemv_reduce_kernel(
    ws,
    scale,
    bias,
    out,
    SP: ConstInt,
    TN: ConstInt,
    INT8: ConstBool,
    HAS_BIAS: ConstBool,
    LOGITS: ConstBool,
    SWIGLU: ConstBool,
):
    """Split-K finish: sum the SP partials of TN channels, then the linear/logits/swiglu end."""
    pdl_prologue()
    j = ct.bid(0)
    if SWIGLU:
        inter = out.shape[1]
        g = ct.sum(
            ct.load(ws.slice(axis=2, start=0, stop=inter), (0, 0, j), shape=(SP, 16, TN), padding_mode=ZERO), axis=0
        )
        u = ct.sum(
            ct.load(ws.slice(axis=2, start=inter, stop=2 * inter), (0, 0, j), shape=(SP, 16, TN), padding_mode=ZERO),
            axis=0,
        )
        scg, scu = _gate_up_scales(scale, j, TN, inter, INT8)
        g = _finish(g, scg, 0.0, out.dtype, INT8, False, False)
        u = _finish(u, scu, 0.0, out.dtype, INT8, False, False)
        y = _silu_mul(g, u)
    else:
        acc = ct.sum(ct.load(ws, (0, 0, j), shape=(SP, 16, TN), padding_mode=ZERO), axis=0)
        y = _finish(
            acc, _row_vec(scale, j, TN, INT8), _row_vec(bias, j, TN, HAS_BIAS), out.dtype, INT8, HAS_BIAS, LOGITS
        )
    ct.store(out, (0, j), ct.astype(y, out.dtype))


# ------------------------------------------------------------- INT8 decode GEMV (unit floats)
#
# T == 1, INT8 weight, bf16/fp16 activations and output; no tensor cores and no bf16 conversion.
# The weight is read as int32 words (int8 [N, K] viewed as int32 [N, K / 4]: byte i of word j is
# weight 4j + i, little-endian); the activations as one contiguous [1, 4 * TKW] load per tile,
# regrouped in registers to [4, TKW] so that row i holds x[4j + i], the multiplier of byte i of
# word column j. Each weight w becomes a float32 by bit operations only:
#
#   u = (w & 0xFF) ^ 0x80                       the signed byte plus 128 (0..255)
#   f = bitcast_f32(0x3F800000 | (u << 8))      = 1 + u * 2^-15 exactly
#
# and ``acc[n, j] += f * x[4j + i]`` in float32 over the K tiles, with ``xs`` summing x. Since
# ``sum_k f_k x_k = (1 + 2^-8) sum_k x_k + 2^-15 sum_k w_k x_k``, the dot product is
# ``(sum_j acc[n, j] - 1.00390625 * sum x) * 32768``: the bias comes off once per output, not once
# per weight. The byte-into-a-magic-exponent conversion is FasterTransformer's (PRMT into
# 0x4B000000 then one subtraction per weight, ``FastInterleavedAndBiasedNumericArrayConverter``);
# the subtraction moved out of the loop is the Triton backend's ``i8_to_unit_f32``. The price:
# each product carries the bias, so a weight's part keeps ~15 of its 24 bits (relative error
# ~5e-5 of the row's largest output), negligible against bf16/fp16 rounding but not float32's:
# float32 activations and float32 logits (lm_head) keep the exact mma path.
#
# SASS (sm_90): per weight in the loop one FFMA, one LOP3 (``(u & 0xFF00) ^ 0x3F808000``), 3/4 of
# a shift, no I2F/F2F/PRMT; besides, ptxas re-materializes the 0xFF00 mask now and then, and x is
# unpacked and summed: fewer instructions a weight than the mma kernels' int8 tiles, swiglu fewer
# than linear (its [2 * TN, TKW] tile shares each x value among more rows); the counts are in
# benchmarks/cutile-NOTES.md ("linear / swiglu / lm_head"). cuTile 1.7 has no inline PTX, so the
# Triton kernel's one-PRMT-a-weight conversion is out of reach.


def _unit_fma(acc, wt, xt):
    """acc [R, TKW] += sum_i f(byte i of wt) * x_i, for wt int32 words [R, TKW] and xt float32
    [4, TKW] (row i: the multipliers of byte i).

    Byte i moved to bits 8-15 and XOR-ed with 0x3F808000 is the bit pattern of ``1 + (b + 128) *
    2^-15``: the 0x80 flips the byte's sign bit (b + 128 as unsigned), the rest sets the exponent
    of 1.0 (disjoint bits, so XOR is OR there). One shift (none for byte 1) and one LOP3 a weight;
    the arithmetic shifts' sign bits fall outside the mask.
    """
    for i in ct.static_iter(range(4)):
        if i == 0:
            u = wt << 8
        elif i == 1:
            u = wt
        else:
            u = wt >> (8 * i - 8)
        f = ct.bitcast((u & 0xFF00) ^ 0x3F808000, ct.float32)
        acc = acc + f * ct.extract(xt, (i, 0), shape=(1, xt.shape[1]))
    return acc


def _unit_x(x, kk, TKW):
    """x[4j + i] at [i, j - kk * TKW] as float32 [4, TKW] (zero past K): the row's 4 * TKW
    values from x [1, K] in one contiguous load, regrouped in registers."""
    xt = ct.load(x, (0, kk), shape=(1, 4 * TKW), padding_mode=ZERO)
    return ct.transpose(ct.reshape(ct.astype(xt, ct.float32), (TKW, 4)))


def _unit_dot(acc, xs):
    """[R] dot products from the unit-float accumulator [R, TKW] and the running sum of x [4, TKW]:
    ``(sum_j acc[:, j] - (1 + 2^-8) sum x) * 2^15``."""
    return (ct.sum(acc, axis=1) - 1.00390625 * ct.sum(xs)) * 32768.0


@ct.kernel(occupancy=2)
def gemv_int8_unit_kernel(x, w, scale, bias, out, TN: ConstInt, TKW: ConstInt, HAS_BIAS: ConstBool):
    """INT8 decode linear, out = x @ (q * scale).T (+ bias), the weight's bytes as unit floats.

    x: bf16/fp16 [1, K]; w: int32 [N, K / 4] (the int8 [N, K] weight's words); scale: float32
    [N]; bias: [N] or a dummy (HAS_BIAS); out: [1, N] in x's dtype. One block per TN output
    channels, all of K in the block (float32 register tile [TN, TKW]), then ``_finish``. The first
    weight tile is requested before the PDL wait.
    """
    ct.grid_dependency_control_launch_dependents()
    j = ct.bid(0)
    nk = ct.cdiv(w.shape[1], TKW)
    wt = ct.load(w, (j, 0), shape=(TN, TKW), padding_mode=ZERO, latency=10)
    ct.grid_dependency_control_wait()
    xt = _unit_x(x, 0, TKW)
    xs = xt
    acc = _unit_fma(ct.zeros((TN, TKW), ct.float32), wt, xt)
    for kk in range(1, nk):
        wt = ct.load(w, (j, kk), shape=(TN, TKW), padding_mode=ZERO, latency=10)
        xt = _unit_x(x, kk, TKW)
        xs = xs + xt
        acc = _unit_fma(acc, wt, xt)
    y = ct.reshape(_unit_dot(acc, xs), (1, TN))
    y = _finish(y, _row_vec(scale, j, TN, True), _row_vec(bias, j, TN, HAS_BIAS), out.dtype, True, HAS_BIAS, False)
    ct.store(out, (0, j), ct.astype(y, out.dtype))


@ct.kernel(occupancy=2)
def gemv_swiglu_int8_unit_kernel(x, w, scale, out, TN: ConstInt, TKW: ConstInt):
    """INT8 decode SwiGLU, out = silu(x @ Wg.T) * (x @ Wu.T), the weights' bytes as unit floats.

    x: bf16/fp16 [1, K]; w: int32 [2, inter, K / 4] (the stacked int8 gate_up weight's words,
    gate half first); scale: float32 [2 * inter]; out: [1, inter] in x's dtype. One block per TN
    channels of both halves, loaded as one [2, TN, TKW] tile and reshaped to [2 * TN, TKW] (two
    separate tiles made cuTile 1.7 compute the up tile twice over; a 3-D accumulator went through
    shared memory each step), so one accumulator. The first tile is requested before the PDL wait.
    """
    ct.grid_dependency_control_launch_dependents()
    j = ct.bid(0)
    inter = out.shape[1]
    nk = ct.cdiv(w.shape[2], TKW)
    wt = ct.reshape(ct.load(w, (0, j, 0), shape=(2, TN, TKW), padding_mode=ZERO, latency=10), (2 * TN, TKW))
    ct.grid_dependency_control_wait()
    xt = _unit_x(x, 0, TKW)
    xs = xt
    acc = _unit_fma(ct.zeros((2 * TN, TKW), ct.float32), wt, xt)
    for kk in range(1, nk):
        wt = ct.reshape(ct.load(w, (0, j, kk), shape=(2, TN, TKW), padding_mode=ZERO, latency=10), (2 * TN, TKW))
        xt = _unit_x(x, kk, TKW)
        xs = xs + xt
        acc = _unit_fma(acc, wt, xt)
    y = ct.reshape(_unit_dot(acc, xs), (2, TN))  # gate, up
    scg, scu = _gate_up_scales(scale, j, TN, inter, True)
    g = _finish(ct.extract(y, (0, 0), shape=(1, TN)), scg, 0.0, out.dtype, True, False, False)
    u = _finish(ct.extract(y, (1, 0), shape=(1, TN)), scu, 0.0, out.dtype, True, False, False)
    ct.store(out, (0, j), ct.astype(_silu_mul(g, u), out.dtype))


# BF16 decode GEMV without tensor cores (T == 1): the mma kernels above pad x to 16 rows and need
# 64-row weight tiles (the HGMMA M), so a 4B gate_up has 152 blocks; here each block owns Tuning.fma_tn
# rows, converts its weight tile to float32 and accumulates ``w * x`` elementwise in a [TN, TK]
# register tile, reduced once at the end (the Triton backend's ``_gemv_kernel`` design): thousands
# of short blocks keep more loads in flight.


def _fma_x(x, kk, TK):
    """x[0, kk * TK : (kk + 1) * TK] as float32 [1, TK] (zero past K)."""
    return ct.astype(ct.load(x, (0, kk), shape=(1, TK), padding_mode=ZERO), ct.float32)


@ct.kernel(occupancy=4)
def gemv_fma_kernel(x, w, bias, out, TN: ConstInt, TK: ConstInt, HAS_BIAS: ConstBool):
    """BF16/fp16 decode linear, out = x @ w.T (+ bias), float32 FMAs.

    x: [1, K]; w: [N, K] in x's dtype; bias: [N] or a dummy (HAS_BIAS); out: [1, N] in x's dtype.
    One block per TN output channels, all of K in the block, then ``_finish``. The first weight
    tile is requested before the PDL wait.
    """
    ct.grid_dependency_control_launch_dependents()
    j = ct.bid(0)
    nk = ct.cdiv(w.shape[1], TK)
    wt = ct.load(w, (j, 0), shape=(TN, TK), padding_mode=ZERO, latency=10)
    ct.grid_dependency_control_wait()
    acc = ct.astype(wt, ct.float32) * _fma_x(x, 0, TK)
    for kk in range(1, nk):
        wt = ct.load(w, (j, kk), shape=(TN, TK), padding_mode=ZERO, latency=10)
        acc = acc + ct.astype(wt, ct.float32) * _fma_x(x, kk, TK)
    y = ct.reshape(ct.sum(acc, axis=1), (1, TN))
    y = _finish(y, 0.0, _row_vec(bias, j, TN, HAS_BIAS), out.dtype, False, HAS_BIAS, False)
    ct.store(out, (0, j), ct.astype(y, out.dtype))


@ct.kernel(occupancy=4)
def gemv_swiglu_fma_kernel(x, w, out, TN: ConstInt, TK: ConstInt):
    """BF16/fp16 decode SwiGLU, out = silu(x @ Wg.T) * (x @ Wu.T), float32 FMAs.

    x: [1, K]; w: [2, inter, K] (the stacked gate_up weight, gate half first) in x's dtype; out:
    [1, inter]. One block per TN channels of both halves, loaded as one [2, TN, TK] tile and
    reshaped to [2 * TN, TK] (as ``gemv_swiglu_int8_unit_kernel``), one accumulator.
    """
    ct.grid_dependency_control_launch_dependents()
    j = ct.bid(0)
    nk = ct.cdiv(w.shape[2], TK)
    wt = ct.load(w, (0, j, 0), shape=(2, TN, TK), padding_mode=ZERO, latency=10)
    ct.grid_dependency_control_wait()
    acc = ct.astype(ct.reshape(wt, (2 * TN, TK)), ct.float32) * _fma_x(x, 0, TK)
    for kk in range(1, nk):
        wt = ct.load(w, (0, j, kk), shape=(2, TN, TK), padding_mode=ZERO, latency=10)
        acc = acc + ct.astype(ct.reshape(wt, (2 * TN, TK)), ct.float32) * _fma_x(x, kk, TK)
    y = ct.reshape(ct.sum(acc, axis=1), (2, TN))  # gate, up
    g = _finish(ct.extract(y, (0, 0), shape=(1, TN)), 0.0, 0.0, out.dtype, False, False, False)
    u = _finish(ct.extract(y, (1, 0), shape=(1, TN)), 0.0, 0.0, out.dtype, False, False, False)
    ct.store(out, (0, j), ct.astype(_silu_mul(g, u), out.dtype))


# -------------------------------------------------------------------------------- GEMM kernels


@ct.kernel
def gemm_kernel(
    x,
    w,
    scale,
    bias,
    out,
    TM: ConstInt,
    TN: ConstInt,
    TK: ConstInt,
    INT8: ConstBool,
    HAS_BIAS: ConstBool,
    LOGITS: ConstBool,
):
    """Prefill GEMM: block (m, n) owns out[m*TM:, n*TN:]; m varies fastest in launch order so the
    blocks sharing a weight tile run together and the weight is read from memory once."""
    pdl_prologue()
    bm = ct.bid(0)
    bn = ct.bid(1)
    acc = ct.zeros((TM, TN), ct.float32)
    for kk in range(ct.cdiv(x.shape[1], TK)):
        a = ct.load(x, (bm, kk), shape=(TM, TK), padding_mode=ZERO)
        b = ct.load(w, (kk, bn), shape=(TK, TN), order=(1, 0), padding_mode=ZERO)
        b, a = _operands(b, a, INT8)
        acc = ct.mma(a, b, acc)
    y = _finish(acc, _row_vec(scale, bn, TN, INT8), _row_vec(bias, bn, TN, HAS_BIAS), out.dtype, INT8, HAS_BIAS, LOGITS)
    ct.store(out, (bm, bn), ct.astype(y, out.dtype))


@ct.kernel
def gemm_swiglu_kernel(x, w, scale, out, TM: ConstInt, TN: ConstInt, TK: ConstInt, INT8: ConstBool):
    """Prefill SwiGLU GEMM: gate and up accumulators side by side, silu(g) * u in the epilogue."""
    pdl_prologue()
    bm = ct.bid(0)
    bn = ct.bid(1)
    inter = out.shape[1]
    wg = w.slice(axis=0, start=0, stop=inter)
    wu = w.slice(axis=0, start=inter, stop=2 * inter)
    accg = ct.zeros((TM, TN), ct.float32)
    accu = ct.zeros((TM, TN), ct.float32)
    for kk in range(ct.cdiv(x.shape[1], TK)):
        a = ct.load(x, (bm, kk), shape=(TM, TK), padding_mode=ZERO)
        bg = ct.load(wg, (kk, bn), shape=(TK, TN), order=(1, 0), padding_mode=ZERO)
        bu = ct.load(wu, (kk, bn), shape=(TK, TN), order=(1, 0), padding_mode=ZERO)
        bg, a1 = _operands(bg, a, INT8)
        bu, a2 = _operands(bu, a, INT8)
        accg = ct.mma(a1, bg, accg)
        accu = ct.mma(a2, bu, accu)
    scg, scu = _gate_up_scales(scale, bn, TN, inter, INT8)
    g = _finish(accg, scg, 0.0, out.dtype, INT8, False, False)
    u = _finish(accu, scu, 0.0, out.dtype, INT8, False, False)
    ct.store(out, (bm, bn), ct.astype(_silu_mul(g, u), out.dtype))


@ct.kernel
def widen_kernel(q, out, TR: ConstInt, TC: ConstInt):
    """out = q in out's dtype: q int8 [N, K] -> out [N, K] bf16/fp16/float32 (exact for int8
    codes); one [TR, TC] tile per block. Waits for the previous kernel before writing: ``out`` is
    fresh memory that a kernel still running under PDL may have been reading."""
    pdl_prologue()
    t = ct.load(q, (ct.bid(0), ct.bid(1)), shape=(TR, TC), padding_mode=ZERO)
    ct.store(out, (ct.bid(0), ct.bid(1)), ct.astype(t, out.dtype))


# ------------------------------------------------------------------------------------ launch


def _check_x(op: str, x: torch.Tensor, wq: torch.Tensor) -> None:
    """The kernels take x [T, in] only.

    Raises:
        Unsupported: x is not 2-D.
        ValueError: x's features differ from the weight's columns.
    """
    if x.dim() != 2:
        raise Unsupported(f"x is {x.dim()}-D, not [T, in]")
    if x.shape[1] != wq.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[1]} features, the weight {wq.shape[1]} columns")


def _words(wq: torch.Tensor) -> bool:
    """Whether an int8 weight views as int32 words: rows of a multiple of 4 bytes, unit column
    stride, 4-byte aligned."""
    return wq.shape[1] % 4 == 0 and wq.stride(1) == 1 and wq.stride(0) % 4 == 0 and wq.storage_offset() % 4 == 0


def _plan(x: torch.Tensor, wq: torch.Tensor, int8: bool, n_out: int, swiglu: bool, logits: bool, tuning: Tuning):
    """The planned launch (:func:`plan_skinny` up to SKINNY_ROWS rows, else :func:`plan_gemm`)."""
    T = x.shape[0]
    if T > SKINNY_ROWS:
        return plan_gemm(T, int8=int8, swiglu=swiglu, tuning=tuning)
    return plan_skinny(
        T,
        n_out,
        wq.shape[0],
        x.shape[1],
        int8=int8,
        swiglu=swiglu,
        half_row=not logits and T == 1 and x.dtype in (torch.bfloat16, torch.float16),
        words=int8 and _words(wq),
        w_like_x=wq.dtype == x.dtype and wq.stride(1) == 1,
        w_bytes=wq.element_size(),
        sms=tuning.sms or sm_count(x.device),
        tuning=tuning,
    )


def _run_unit(x, wq: torch.Tensor, scale, b, has_bias: bool, out: torch.Tensor, swiglu: bool, p: SkinnyPlan):
    """The unit-float INT8 GEMV: the int8 weight [N, K] as int32 words [N, K / 4] ([2, inter, K / 4]
    for swiglu); one block per ``p.tn`` output channels."""
    w32 = wq.view(torch.int32)
    grid = (cdiv(out.shape[1], p.tn), 1, 1)
    if swiglu:
        w32 = w32.view(2, out.shape[1], w32.shape[1])
        launch(gemv_swiglu_int8_unit_kernel, grid, (x, w32, scale, out, p.tn, p.tk))
    else:
        launch(gemv_int8_unit_kernel, grid, (x, w32, scale, b, out, p.tn, p.tk, has_bias))


def _run_fma(x, wq: torch.Tensor, b, has_bias: bool, out: torch.Tensor, swiglu: bool, p: SkinnyPlan):
    """The float32-FMA GEMV; one block per ``p.tn`` output channels (swiglu: a half-width K tile,
    whose [2 * TN, TK / 2] registers match the linear kernel's; a full one spills)."""
    grid = (cdiv(out.shape[1], p.tn), 1, 1)
    if swiglu:
        launch(gemv_swiglu_fma_kernel, grid, (x, wq.unflatten(0, (2, out.shape[1])), out, p.tn, p.tk))
    else:
        launch(gemv_fma_kernel, grid, (x, wq, b, out, p.tn, p.tk, has_bias))


def _run_mma(x, wq, int8, sc, b, has_bias, logits, out, swiglu, p: SkinnyPlan, workspace: Workspace | None):
    """The tensor-core skinny product: one pass, or ``p.splits`` K slices into a float32 scratch
    [S, T, n_w] that a second kernel sums and finishes."""
    n_out, tn, tk, s = out.shape[1], p.tn, p.tk, p.splits
    if s > 1:
        ws = scratch(workspace, "splitk", (s, x.shape[0], wq.shape[0]), torch.float32, x.device)
        launch(gemv_partial_kernel, (cdiv(wq.shape[0], tn), s, 1), (x, wq, ws, tn, tk, int8))
        launch(gemv_reduce_kernel, (cdiv(n_out, tn), 1, 1), (ws, sc, b, out, s, tn, int8, has_bias, logits, swiglu))
    elif swiglu:
        launch(gemv_swiglu_kernel, (cdiv(n_out, tn), 1, 1), (x, wq, sc, out, tn, tk, int8))
    else:
        launch(gemv_kernel, (cdiv(n_out, tn), 1, 1), (x, wq, sc, b, out, tn, tk, int8, has_bias, logits))


def _widen(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 weight [N, K] (any strides) as a new [N, K] tensor of ``dtype`` holding the same
    integers, one pass (:func:`widen_kernel`): 1 byte read and 2 (bf16/fp16) or 4 (float32) written
    a weight. Made per call and freed after it (nothing cached: the point of INT8 weights is their
    memory), so a prefill chunk's peak memory grows by one copy of the largest weight it multiplies
    (the lm_head when every row is scored)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    tr, tc = WIDEN_TILE
    launch(widen_kernel, (cdiv(q.shape[0], tr), cdiv(q.shape[1], tc), 1), (q, out, tr, tc))
    return out


def _run_gemm(x, wq, int8, sc, b, has_bias, logits, out, swiglu, p: GemmPlan):
    if p.widen:
        wq = _widen(wq, x.dtype)  # INT8 stays set: the copy holds the codes, the epilogue scales
    grid = (cdiv(x.shape[0], p.tm), cdiv(out.shape[1], p.tn), 1)
    if swiglu:
        launch(gemm_swiglu_kernel, grid, (x, wq, sc, out, p.tm, p.tn, p.tk, int8))
    else:
        launch(gemm_kernel, grid, (x, wq, sc, b, out, p.tm, p.tn, p.tk, int8, has_bias, logits))


def _run(x, w, bias, out, swiglu: bool, logits: bool, plan, tuning: Tuning, workspace) -> torch.Tensor:
    """Plan (unless ``plan`` is given) and launch ``x @ w.T`` into ``out``.

    Raises:
        TypeError: ``plan`` is not a SkinnyPlan (1 to 16 rows) or a GemmPlan (more).
    """
    int8 = isinstance(w, Int8Weight)
    wq, scale = (w.q, w.scale) if int8 else (w, None)
    if x.shape[0] == 0:
        return out
    want = SkinnyPlan if x.shape[0] <= SKINNY_ROWS else GemmPlan
    if plan is None:
        plan = _plan(x, wq, int8, out.shape[1], swiglu, logits, tuning)
    elif not isinstance(plan, want):
        raise TypeError(f"{x.shape[0]} rows take a {want.__name__}, not {plan!r}")
    sc = scale if int8 else dummy(workspace, x.device)
    b = bias if bias is not None else dummy(workspace, x.device)
    has_bias = bias is not None
    if isinstance(plan, GemmPlan):
        _run_gemm(x, wq, int8, sc, b, has_bias, logits, out, swiglu, plan)
    elif plan.kernel == "unit":
        _run_unit(x, wq, sc, b, has_bias, out, swiglu, plan)
    elif plan.kernel == "fma":
        _run_fma(x, wq, b, has_bias, out, swiglu, plan)
    else:
        _run_mma(x, wq, int8, sc, b, has_bias, logits, out, swiglu, plan, workspace)
    return out


def linear(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    *,
    plan: SkinnyPlan | GemmPlan | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias``: x [T, in] -> [T, out] in x's dtype.

    w: [out, in] in x's dtype, or an Int8Weight (int8 [out, in] + float32 scale [out], the scale
    applied in the epilogue). bias: [out] or None. T <= 16 runs the skinny kernels (T == 1 with an
    INT8 weight and bf16/fp16 x: the unit-float GEMV, ``gemv_int8_unit_kernel``), larger T the tiled
    GEMM (an INT8 weight widened to x's dtype first from ``tuning.int8_widen_rows`` rows). ``plan``
    replaces the planned launch (a SkinnyPlan for T <= 16, else a GemmPlan; it must suit the
    inputs: "unit" an INT8 weight in int32 words and one bf16/fp16 row, "fma" one such row and a
    weight in its dtype); ``tuning`` holds the switches and the SM count the plan uses;
    ``workspace`` keeps split-K partials between calls (None: new ones).

    Raises:
        Unsupported: x is not 2-D.
        ValueError: x's features differ from the weight's columns.
        TypeError: a ``plan`` of the other kind.
    """
    wq = w.q if isinstance(w, Int8Weight) else w
    _check_x("linear", x, wq)
    out = torch.empty(x.shape[0], wq.shape[0], dtype=x.dtype, device=x.device)
    return _run(x, w, bias, out, False, False, plan, tuning, workspace)


def swiglu(
    x: torch.Tensor,
    w_gate_up,
    *,
    plan: SkinnyPlan | GemmPlan | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """SwiGLU MLP input: ``silu(x @ Wg.T) * (x @ Wu.T)`` with SiLU-and-multiply in the epilogue.

    x: [T, hidden]; w_gate_up: [2 * inter, hidden] (gate rows first) or an Int8Weight of that
    shape. Returns [T, inter] in x's dtype. T == 1 with an INT8 weight and bf16/fp16 x runs the
    unit-float GEMV (``gemv_swiglu_int8_unit_kernel``). Keywords and errors as :func:`linear`.
    """
    wq = w_gate_up.q if isinstance(w_gate_up, Int8Weight) else w_gate_up
    _check_x("swiglu", x, wq)
    out = torch.empty(x.shape[0], wq.shape[0] // 2, dtype=x.dtype, device=x.device)
    return _run(x, w_gate_up, None, out, True, False, plan, tuning, workspace)


def lm_head(
    x: torch.Tensor,
    w,
    *,
    plan: SkinnyPlan | GemmPlan | None = None,
    tuning: Tuning = TUNING,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Logits in float32: x [T, hidden] @ w.T -> [T, vocab] float32, accumulated in float32.

    w: [vocab, hidden] (model dtype or float32) or an Int8Weight. BF16 products are exact in
    float32, so only the summation order differs from the reference's float32 matmul. Keywords and
    errors as :func:`linear`.
    """
    wq = w.q if isinstance(w, Int8Weight) else w
    _check_x("lm_head", x, wq)
    out = torch.empty(x.shape[0], wq.shape[0], dtype=torch.float32, device=x.device)
    return _run(x, w, None, out, False, True, plan, tuning, workspace)
