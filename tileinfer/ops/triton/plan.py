"""Launch plans of the Triton backend: pure functions from shapes, dtypes, flags and the SM count to
the typed plan a launch uses, callable without a GPU (tests check them at every shipped shape).

* :func:`plan_gemv` - the GEMV kernel, 1 to ``GEMV_MAX_ROWS`` rows;
* :func:`plan_gemm` - the prefill GEMMs (pointer, persistent TMA, swap AB, stream-K), and whether an
  INT8 weight is widened first;
* :func:`plan_decode_attention` - split-KV decode: tile and number of context splits;
* :func:`plan_prefill_attention` - causal prefill attention: tile and grid.

The tables they choose from are a :class:`~tileinfer.ops.triton.tuning.Tuning` argument.
"""

from __future__ import annotations

from typing import NamedTuple

from tileinfer.ops.triton._common import cdiv, next_pow2
from tileinfer.ops.triton.tuning import TUNING, DecodeTile, GemmTile, GemvTile, PrefillTile, RowMode, Tuning

GEMV_MAX_ROWS = 16  # more rows of x take the GEMMs
DECODE_MAX_ROWS = 16  # more query rows take the prefill attention kernel


# ---------------------------------------------------------------------------- GEMV


class GemvPlan(NamedTuple):
    """A GEMV launch: one program per ``block_n`` weight rows, ``programs`` of them."""

    dot: bool  # rows padded to 16 through tl.dot; else one row of float32 FMAs
    block_n: int
    block_k: int
    w_int8: int  # the kernel's W_INT8: 0 (weight in x's dtype) or the RowMode value of the conversion
    pipe: int  # one row: depth of the cp.async ring of its weight tiles (1: none)
    warps: int
    stages: int  # the launch's num_stages (pipelines the dot loop)
    programs: int


def gemv_tile(rows: int, n_rows: int, k: int, int8: bool, tuning: Tuning = TUNING) -> GemvTile:
    """The table's tile for ``rows`` (1..16) rows of x against a weight of ``n_rows`` x ``k``: the shape's
    own entry, else the first of the row tables that fits (one row) or the 16-row tile."""
    name = ("gemv1" if rows == 1 else "gemv16") + ("_int8" if int8 else "_bf16")
    entry = getattr(tuning, name + "_shapes").get((n_rows, k))
    if entry is not None:
        return entry
    if rows > 1:
        return getattr(tuning, name)
    return next(tile for most, tile in getattr(tuning, name) if most is None or n_rows <= most)


def plan_gemv(
    rows: int,
    n_rows: int,
    k: int,
    *,
    int8: bool,
    swiglu: bool,
    float32: bool,
    tuning: Tuning = TUNING,
    tile: GemvTile | None = None,
) -> GemvPlan:
    """The GEMV launch for ``rows`` (1..16) rows of x [rows, k] against a weight of ``n_rows`` rows
    (SwiGLU: gate then up, 2 * inter), with ``tile`` or the table's (:func:`gemv_tile`).

    One row takes the tile's row mode: its INT8 conversion, or RowMode.DOT for the padded tensor-core
    path; more rows always take that path. ``float32`` (x or the output is float32) replaces unit
    floats by the exact sign-extended conversion (unit floats keep ~15 bits of each product).
    """
    tile = tile if tile is not None else gemv_tile(rows, n_rows, k, int8, tuning)
    row_mode = tile.row_mode if rows == 1 else None
    dot = rows > 1 or row_mode == RowMode.DOT
    mode = int(row_mode) if (not dot and int8 and row_mode is not None) else int(int8)
    if mode == RowMode.UNIT and float32:
        mode = int(RowMode.SIGN_EXTEND)
    pipe, stages = (1, tile.stages) if dot else (tile.stages, 1)
    cols = tile.block_n // 2 if swiglu else tile.block_n
    n_out = n_rows // 2 if swiglu else n_rows
    return GemvPlan(dot, tile.block_n, tile.block_k, mode, pipe, tile.warps, stages, cdiv(n_out, cols))


# ---------------------------------------------------------------------------- GEMM


class GemmPlan(NamedTuple):
    """A prefill GEMM launch."""

    tile: GemmTile  # as launched: the kernel after the TMA and stream-K checks, block sizes clamped
    widen: bool  # an INT8 weight is first widened to an exact copy in x's dtype
    programs: int  # the grid
    sms: int  # the SM count planned for: the persistent kernels' program stride


def _gemm_list(int8: bool, swiglu: bool, tuning: Tuning) -> tuple[GemmTile, ...]:
    return getattr(tuning, ("gemm_int8" if int8 else "gemm_bf16") + ("_swiglu" if swiglu else ""))


def gemm_tile(rows: int, n_out: int, k: int, int8: bool, swiglu: bool, sms: int, tuning: Tuning = TUNING) -> GemmTile:
    """The table's tile for an output [rows, n_out] with reduction ``k``: the shape's own entry, else
    :func:`gemm_rule_tile`."""
    entry = (tuning.gemm_int8_shapes if int8 else tuning.gemm_bf16_shapes).get((rows, n_out, k))
    return entry if entry is not None else gemm_rule_tile(rows, n_out, int8, swiglu, sms, tuning)


def gemm_rule_tile(rows: int, n_out: int, int8: bool, swiglu: bool, sms: int, tuning: Tuning = TUNING) -> GemmTile:
    """The first tile of the weight's list that makes at least half a wave of programs on ``sms``
    SMs for an output [rows, n_out] (small outputs take smaller tiles), else the list's last."""
    tiles = _gemm_list(int8, swiglu, tuning)
    return next((t for t in tiles if cdiv(rows, t.block_m) * cdiv(n_out, t.block_n) >= sms // 2), tiles[-1])


def streamk_remainder_small(tiles: int, sms: int) -> bool:
    """Whether the tiles left after stream-K's full waves are too few to share out: under sms / 8
    tiles, each program gets a sliver of k-steps and one program would add up to ~sms partial tiles
    in series (one tile left over: that tile's k-steps over every program)."""
    return 0 < tiles % sms * 8 < sms


def plan_gemm(
    rows: int,
    n_out: int,
    k: int,
    *,
    int8: bool,
    swiglu: bool,
    float32_out: bool,
    x_bytes: int,
    tma_x: bool,
    tma_w: bool,
    sms: int,
    tuning: Tuning = TUNING,
    tile: GemmTile | None = None,
) -> GemmPlan:
    """The GEMM launch for x [rows, k] against a weight giving ``n_out`` outputs (SwiGLU: of the gated
    product): ``tile``, else the shape's entry of the weight's table, else the weight's list rule
    (:func:`gemm_rule_tile`).

    ``x_bytes``: x's element size; ``tma_x``/``tma_w``: whether TMA can read x and the weight as
    given (16-byte aligned bases and rows, unit column stride). From ``tuning.int8_dequant_rows``
    rows an INT8 weight is widened first unless the tile is "swap" (which needs TMA: without it the
    list's pointer tile); a tile from the INT8 list rule then gives way to the BF16 table's tile (a
    given tile or an INT8 shape entry runs as it is). SwiGLU and float32 outputs cap the tile at 128
    columns (two accumulators, or a float32 tile staged in shared memory for the store, would
    overflow it), and a swap tile's tokens at 128 for float32 outputs. A kernel other than "ptr"
    needs TMA; stream-K takes neither SwiGLU nor a remainder of under sms / 8 tiles
    (:func:`streamk_remainder_small`), which run "tma".
    """
    if tile is None:
        tile = (tuning.gemm_int8_shapes if int8 else tuning.gemm_bf16_shapes).get((rows, n_out, k))
    from_rule = tile is None
    chosen = gemm_rule_tile(rows, n_out, int8, swiglu, sms, tuning) if from_rule else tile
    if chosen.kernel == "swap" and not (tma_x and tma_w):
        chosen, from_rule = _gemm_list(int8, swiglu, tuning)[-1], True
    widen = int8 and rows >= tuning.int8_dequant_rows and chosen.kernel != "swap"
    if widen and from_rule:
        chosen = gemm_tile(rows, n_out, k, False, swiglu, sms, tuning)
    bm, bn, kind = chosen.block_m, chosen.block_n, chosen.kernel
    if (swiglu or float32_out) and bn > 128:
        bn = 128
    if kind == "swap" and float32_out:
        bm = min(bm, 128)
    # the widened copy is a fresh contiguous tensor: TMA reads it when its rows are whole 16 bytes
    tma = tma_x and ((k * x_bytes) % 16 == 0 if widen else tma_w)
    if kind != "ptr" and not tma:
        kind = "ptr"
    tiles = cdiv(rows, bm) * cdiv(n_out, bn)
    if kind == "streamk" and (swiglu or streamk_remainder_small(tiles, sms)):
        kind = "tma"
    if kind == "ptr":
        programs = tiles
    elif kind == "streamk":
        programs = min(sms, tiles * cdiv(k, chosen.block_k))
    else:
        programs = min(sms, tiles)
    return GemmPlan(chosen._replace(block_m=bm, block_n=bn, kernel=kind), widen, programs, sms)


# ---------------------------------------------------------------------------- attention


class DecodePlan(NamedTuple):
    """A split-KV decode launch: grid (KV heads, ``splits``), then the combine kernel."""

    tile: DecodeTile
    block_m: int  # query rows per program: T * group, padded to a power of two >= 16
    splits: int  # context chunks per KV head
    combine_warps: int


class PrefillPlan(NamedTuple):
    """A prefill attention launch: grid (``programs`` row blocks, KV heads)."""

    tile: PrefillTile
    programs: int


def num_splits(max_positions: int, kv_heads: int, block_n: int, programs: int) -> int:
    """Context chunks of the split-KV kernel: about ``programs`` programs over the KV heads, at most
    one per key block. Depends only on static shapes (the block table's length, the KV heads), so a
    captured graph stays valid as the context grows."""
    return max(1, min(cdiv(max_positions, block_n), cdiv(programs, kv_heads)))


def plan_decode_attention(
    rows: int,
    group: int,
    kv_heads: int,
    max_positions: int,
    head_dim: int,
    *,
    int8: bool,
    sms: int,
    tuning: Tuning = TUNING,
) -> DecodePlan:
    """The split-KV decode launch for ``rows`` (1..16) query rows of ``group`` heads per KV head, over
    a block table of ``max_positions`` positions: the tile and ``programs per SM x sms`` programs
    (INT8 caches of at least ``tuning.decode_int8_long_positions``: their own tile and count)."""
    long_int8 = int8 and max_positions >= tuning.decode_int8_long_positions
    tile = tuning.decode_tile_int8_long if long_int8 else tuning.decode_tile
    per_sm = tuning.decode_programs_per_sm_int8_long if long_int8 else tuning.decode_programs_per_sm
    splits = num_splits(max_positions, kv_heads, tile.block_n, per_sm * sms)
    return DecodePlan(tile, max(16, next_pow2(rows * group)), splits, 4 if splits * head_dim >= 4096 else 2)


def plan_prefill_attention(rows: int, group: int, *, int8: bool, tuning: Tuning = TUNING) -> PrefillPlan:
    """The prefill launch for ``rows`` query rows of ``group`` heads per KV head: small tiles for at
    most ``tuning.prefill_small_rows`` rows x heads of a BF16 cache, else the large ones."""
    small = rows * group <= tuning.prefill_small_rows and not int8
    tile = tuning.prefill_tile_small if small else tuning.prefill_tile_large
    return PrefillPlan(tile, cdiv(rows * group, tile.block_m))
