"""Launch plans of the cuTile backend: pure functions from shapes, dtypes, flags and the SM count to
the typed plan a launch uses, callable without a GPU (tests check them at every shipped shape).

* :func:`plan_skinny` - 1 to ``SKINNY_ROWS`` rows: the unit-float INT8 GEMV, the float32-FMA GEMV,
  or the tensor-core skinny product with its split-K factor;
* :func:`plan_gemm` - the prefill GEMM's tiles, and whether an INT8 weight is widened first;
* :func:`plan_decode_attention` - split-KV decode: splits, tile rows, the INT8 word kernel;
* :func:`plan_prefill_attention` - prefill attention: rows per block, compiler hints.

The switches and tile sizes they choose from are a :class:`~tileinfer.ops.cutile.tuning.Tuning`
argument.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from tileinfer.ops.cutile._common import cdiv, next_pow2
from tileinfer.ops.cutile.tuning import TUNING, Tuning

SKINNY_ROWS = 16  # decode / verify steps up to this many rows use the skinny kernels
SKINNY_TN = 64  # output channels per tensor-core skinny block (the HGMMA M; 64 is its minimum)
MAX_SPLIT = 16  # most split-K slices
MIN_K_TILES = 2  # each split-K slice reduces at least this many K tiles
DECODE_ROWS = 16  # T <= this: split-KV decode kernels; larger T: prefill kernel
MAX_SPLITS = 128  # most split-KV context splits


# ---------------------------------------------------------------------------- linear layers


class SkinnyPlan(NamedTuple):
    """A product of 1 to 16 rows: one block per ``tn`` output channels (and per split)."""

    kernel: Literal["unit", "fma", "mma"]  # unit-float INT8 GEMV, float32-FMA GEMV, tensor cores
    tn: int  # output channels per block
    tk: int  # reduction per tile (unit: int32 words of 4 weights)
    splits: int  # mma: split-K slices (1: one pass); the others: 1


class GemmPlan(NamedTuple):
    """A prefill GEMM: block (m, n) owns out[m * tm:, n * tn:]."""

    tm: int
    tn: int  # output channels per block (SwiGLU: of gate and of up, two accumulators)
    tk: int
    widen: bool  # an INT8 weight is first widened to an exact copy in x's dtype


def mma_plan(n_out: int, n_w: int, k: int, w_bytes: int, swiglu: bool, sms: int, tuning: Tuning = TUNING) -> SkinnyPlan:
    """The tensor-core skinny product: SKINNY_TN channels per block, TK of the reduction per load (a
    16 KB weight tile: 64 x 128 bf16, 64 x 256 int8), and the smallest power-of-two split S that gives
    ``tuning.split_k_busy_percent`` of ``sms`` in blocks, each split keeping >= MIN_K_TILES tiles of K.

    n_out: output channels (inter for SwiGLU); n_w: weight rows; k: reduction; w_bytes: 1 for INT8
    weights (2 bf16/fp16, 4 float32).
    """
    tk = 128 if w_bytes >= 2 else 256
    nk = cdiv(k, tk)
    min_blocks = cdiv(sms * tuning.split_k_busy_percent, 100)
    s = 1
    if tuning.split_k and cdiv(n_out if swiglu else n_w, SKINNY_TN) < min_blocks:
        tiles = cdiv(n_w, SKINNY_TN)
        s = 2
        while s < MAX_SPLIT and tiles * s < min_blocks and 2 * s * MIN_K_TILES <= nk:
            s *= 2
        if s * MIN_K_TILES > nk:
            s = 1
    return SkinnyPlan("mma", SKINNY_TN, tk, s)


def plan_skinny(
    rows: int,
    n_out: int,
    n_w: int,
    k: int,
    *,
    int8: bool,
    swiglu: bool,
    half_row: bool,
    words: bool,
    w_like_x: bool,
    w_bytes: int,
    sms: int,
    tuning: Tuning = TUNING,
) -> SkinnyPlan:
    """The launch for ``rows`` (1..16) rows of x [rows, k] against a weight of ``n_w`` rows giving
    ``n_out`` outputs.

    ``half_row``: one row of bf16/fp16 activations and an output in x's dtype (not the float32
    logits): what both GEMVs without tensor cores need. ``words``: the weight views as int32 words
    (rows of a multiple of 4 bytes, unit column stride, 4-byte aligned). ``w_like_x``: the weight
    is in x's dtype with unit column stride. The unit-float GEMV takes INT8 ``half_row`` products
    whose weight is ``words`` (``tuning.int8_unit``); the FMA GEMV takes ``half_row`` products of a
    ``w_like_x`` weight with k >= ``tuning.fma_min_k`` that :func:`mma_plan` does not split
    (``tuning.bf16_fma``; ``fma_split_shapes``: split ones too); everything else runs the tensor cores.
    """
    if tuning.int8_unit and int8 and half_row and words:
        return SkinnyPlan("unit", tuning.unit_tn, tuning.unit_tkw, 1)
    mma = mma_plan(n_out, n_w, k, w_bytes, swiglu, sms, tuning)
    fma = tuning.bf16_fma and not int8 and half_row and w_like_x and k >= tuning.fma_min_k
    if fma and (tuning.fma_split_shapes or mma.splits == 1):
        return SkinnyPlan("fma", tuning.fma_tn, tuning.fma_tk // 2 if swiglu else tuning.fma_tk, 1)
    return mma


def plan_gemm(rows: int, *, int8: bool, swiglu: bool, tuning: Tuning = TUNING) -> GemmPlan:
    """The prefill GEMM for ``rows`` rows: 128 x 128 x 64 tiles (64 wide per accumulator for SwiGLU,
    which holds two), 64-row tiles for short chunks so the grid has more blocks; an INT8 weight is
    widened first from ``tuning.int8_widen_rows`` rows."""
    return GemmPlan(128 if rows > 64 else 64, 64 if swiglu else 128, 64, int8 and rows >= tuning.int8_widen_rows)


# ---------------------------------------------------------------------------- attention


class DecodePlan(NamedTuple):
    """A split-KV decode launch: grid (KV heads, ``splits``), then the combine kernel."""

    splits: int  # context splits per KV head
    tp: int  # query rows per tile (T padded to a power of two)
    gp: int  # group heads per tile (padded to a power of two); tp * gp >= 16
    int8_words: bool  # the INT8 cache read as int32 words (decode_split_int8_kernel)


class PrefillPlan(NamedTuple):
    """A prefill attention launch: grid (cdiv(T, ``rows``), heads)."""

    rows: int  # query rows per block
    hints: tuple[tuple[str, int | None], ...] = ()  # compiler hints in place of the kernel's own


def decode_splits(kv_heads: int, max_pages: int, sms: int) -> int:
    """Context splits per KV head, from shapes and the SM count ``sms`` only: the largest power of
    two whose blocks (kv_heads x splits) fit in one wave of one block per SM, and no more than the
    pages rounded up to a power of two or MAX_SPLITS. For 8 KV heads on the H200 this beat more
    splits (more waves) and fewer (fewer pages in flight) in whole-model decode
    (results/h200-2026-12-03-cutile-attn-splits.md); other KV head counts follow the rule unmeasured.
    """
    one_wave = 1 << (max(1, sms // kv_heads).bit_length() - 1)
    return max(1, min(one_wave, next_pow2(max_pages), MAX_SPLITS))


def decode_rows(rows: int, group: int) -> tuple[int, int]:
    """(TP, GP): query rows and group heads per tile, padded so TP * GP >= 16 (tensor cores)."""
    gp = next_pow2(group)
    tp = next_pow2(rows)
    if tp * gp < 16:
        tp = 16 // gp
    return tp, gp


def plan_decode_attention(
    rows: int,
    group: int,
    kv_heads: int,
    max_pages: int,
    head_dim: int,
    *,
    int8: bool,
    bf16: bool,
    sms: int,
    tuning: Tuning = TUNING,
) -> DecodePlan:
    """The split-KV decode launch for ``rows`` (1..16) query rows of ``group`` heads per KV head over
    a block table of ``max_pages`` pages (:func:`decode_splits`, :func:`decode_rows`). An INT8 cache
    takes the int32-word kernel for one bf16 query row (``bf16``: the queries' dtype), a padded
    tile of at most 16 rows and head_dim 128 (``tuning.decode_int8_words``): outside these its
    sm_90 build spills (``python -m benchmarks.aot --backend cutile --sass --filter decode_split``),
    and the mma path takes them."""
    tp, gp = decode_rows(rows, group)
    words = tuning.decode_int8_words and int8 and bf16 and rows == 1 and tp * gp <= 16 and head_dim == 128
    return DecodePlan(decode_splits(kv_heads, max_pages, sms), tp, gp, words)


def plan_prefill_attention(tuning: Tuning = TUNING) -> PrefillPlan:
    """The prefill attention launch: ``tuning.prefill_rows`` query rows per block, its hints."""
    return PrefillPlan(tuning.prefill_rows, tuning.prefill_hints)
