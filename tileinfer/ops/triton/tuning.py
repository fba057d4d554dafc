"""The Triton backend's tuning: every tile table and switch its plans choose from, in one object.

Tiles are typed (:class:`GemvTile`, :class:`GemmTile`, :class:`DecodeTile`, :class:`PrefillTile`);
:class:`Tuning` holds the tables, and :data:`TUNING` is the shipped one. The ops take a tuning as an
argument (a :class:`tileinfer.ops.Backend` holds one; ``Backend.with_tuning`` makes another), so a
benchmark times an alternative by passing it, never by patching this module. Entries were chosen
from sweeps and whole-model A/B runs on the H200; the measurements are in the files each comment
cites (benchmarks/NOTES.md, benchmarks/results/).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Literal, NamedTuple


class RowMode(IntEnum):
    """How the one-row GEMV handles its weight (the kernel's ``W_INT8`` value, or the dot path).

    The INT8 conversions avoid I2F, a quarter-rate instruction that would cap the kernel below the
    roofline (``tileinfer.ops.triton._common``)."""

    SIGN_EXTEND = 1  # int8 sign-extended into the mantissa of 2^23 + 128: exact
    WORDS = 2  # int32 words of four weights, each byte through the 2^23 magic number: exact
    DOT = 3  # not a conversion: the 2..16-row tensor-core path with the row padded to 16
    UNIT = 4  # biased unit floats (``i8_to_unit_f32``): each product keeps ~15 bits of the weight


class GemvTile(NamedTuple):
    """A tile of the GEMV kernel (1 to 16 rows of x)."""

    block_n: int  # weight rows per program (SwiGLU: gate and up rows interleaved, half as many outputs)
    block_k: int  # weights of a row per loop step
    warps: int
    stages: int  # one row: depth of its cp.async ring (1: none); 2..16 rows: num_stages of the dot loop
    row_mode: RowMode | None = None  # one row with an INT8 weight: the conversion (DOT: either weight)


GemmKernel = Literal["ptr", "tma", "tma_ws", "swap", "streamk"]


class GemmTile(NamedTuple):
    """A tile of the prefill GEMMs (more than 16 rows).

    ``kernel``: "ptr" the pointer-based tiled GEMM (the only one that reads misaligned tensors),
    "tma" the persistent TMA kernel, "tma_ws" the same warp-specialised, "swap" the TMA kernel
    computing the transposed tile (weight rows as wgmma's M, 64 a warpgroup; INT8 weights convert in
    registers and skip the widening pass), "streamk" the stream-K TMA kernel (plain GEMMs; SwiGLU
    takes "tma" instead).
    """

    block_m: int  # tokens per tile
    block_n: int  # output columns per tile (SwiGLU: of gate and of up; the kernels read both)
    block_k: int
    group_m: int  # row blocks that share each weight column block while it is in L2 (grouped order)
    warps: int
    stages: int
    kernel: GemmKernel


class DecodeTile(NamedTuple):
    """A tile of the split-KV decode kernel; its query rows come from the step (T * group, padded)."""

    block_n: int  # keys per loop step
    warps: int
    stages: int


class PrefillTile(NamedTuple):
    """A tile of the causal prefill attention kernel."""

    block_m: int  # query rows per program (token-major, a GQA group's heads side by side)
    block_n: int  # keys per loop step
    warps: int
    stages: int


def _frozen(entries: dict) -> Mapping:
    return MappingProxyType(entries)


@dataclass(frozen=True)
class Tuning:
    """The Triton backend's tile tables and switches. Every field has the shipped value as default.

    GEMV tables by weight rows are ``((most rows, tile), ...)``, the first entry whose bound holds
    wins (None: any size). ``*_shapes`` fields name tiles for single shapes, keyed as the op
    benchmark's sweep keys them: GEMV (weight rows, K), GEMM (rows of x, output columns, K); they win
    over the tables. A GEMM list's entries are tried in order (the first that makes half a wave of
    programs wins) and it ends with a pointer tile, which takes tensors TMA cannot read.
    """

    # The SM count the grid rules plan for; None: the device's own (tileinfer.ops.sm_count).
    sms: int | None = None

    # GEMV, one row. BF16: 4-row tiles up to ~4k weight rows, 8-row tiles above (benchmarks/NOTES.md,
    # "GEMV (decode, 1 row)"); pipelined tiles won some shapes alone but not the whole model
    # (results/h200-2026-12-01-gemv-pipeline.md), so none here.
    gemv1_bf16: tuple[tuple[int | None, GemvTile], ...] = (
        (4096, GemvTile(4, 1024, 4, 1)),
        (None, GemvTile(8, 512, 4, 1)),
    )
    # INT8: unit floats, pipelined, at every size but the lm_head's (float32 logits need an exact
    # conversion: int32 words); chosen by whole-model decode (results/h200-2026-12-01-gemv-pipeline.md).
    gemv1_int8: tuple[tuple[int | None, GemvTile], ...] = (
        (4096, GemvTile(4, 1024, 4, 3, RowMode.UNIT)),
        (8192, GemvTile(8, 512, 4, 4, RowMode.UNIT)),
        (32768, GemvTile(16, 512, 4, 3, RowMode.UNIT)),
        (None, GemvTile(16, 512, 4, 3, RowMode.WORDS)),
    )
    # 2..16 rows (tl.dot, rows padded to 16): few programs, so deep pipelining; 32-row tiles won every
    # shape of the sweep (benchmarks/NOTES.md, "GEMV 2-16 rows").
    gemv16_bf16: GemvTile = GemvTile(32, 256, 4, 4)
    gemv16_int8: GemvTile = GemvTile(32, 256, 4, 4)
    gemv1_bf16_shapes: Mapping[tuple[int, int], GemvTile] = field(default_factory=lambda: _frozen({}))
    # Qwen3-8B o and down: 8-row tiles, decided by whole-model decode (results/h200-2026-12-01-decode-final.md,
    # "8B INT8 GEMV entries"). No shape takes RowMode.DOT: it won the 8B gate_up alone
    # (results/h200-2026-12-01-gemv-dot.md) and lost in the model (results/h200-2026-12-01-gemv-dot-ab.md).
    gemv1_int8_shapes: Mapping[tuple[int, int], GemvTile] = field(
        default_factory=lambda: _frozen(
            {
                (4096, 4096): GemvTile(8, 1024, 4, 3, RowMode.UNIT),
                (4096, 12288): GemvTile(8, 1024, 4, 3, RowMode.UNIT),
            }
        )
    )
    gemv16_bf16_shapes: Mapping[tuple[int, int], GemvTile] = field(default_factory=lambda: _frozen({}))
    gemv16_int8_shapes: Mapping[tuple[int, int], GemvTile] = field(default_factory=lambda: _frozen({}))

    # GEMM. Plain BF16: 128 x 256 TMA tiles won every plain shape of the sweep but the 4B qkv, even
    # where 80 tiles leave SMs idle, as smaller tiles lose more per tile (benchmarks/NOTES.md, "GEMM").
    gemm_bf16: tuple[GemmTile, ...] = (
        GemmTile(128, 256, 64, 8, 8, 3, "tma"),
        GemmTile(128, 128, 64, 8, 8, 4, "tma_ws"),
        GemmTile(64, 128, 64, 8, 4, 4, "ptr"),
    )
    # SwiGLU keeps two accumulators: 128 x 128 output tiles (256 weight rows); 256 columns would spill.
    gemm_bf16_swiglu: tuple[GemmTile, ...] = (
        GemmTile(128, 128, 64, 8, 8, 4, "tma_ws"),
        GemmTile(64, 128, 64, 8, 4, 4, "ptr"),
    )
    # INT8 converted in the kernel (plain GEMMs below int8_dequant_rows; the pointer kernel beat TMA).
    gemm_int8: tuple[GemmTile, ...] = (
        GemmTile(128, 128, 64, 8, 8, 3, "ptr"),
        GemmTile(64, 128, 64, 8, 4, 4, "ptr"),
    )
    # INT8 SwiGLU takes swap AB at any row count (256 tokens x 64 gate + 64 up rows, one dot): it beat
    # both the BF16 SwiGLU kernel and the widening pass on the 4B/8B gate_up, while on the plain
    # shapes swap lost to widening (results/h200-2026-12-01-int8-prefill-gemm.md).
    gemm_int8_swiglu: tuple[GemmTile, ...] = (
        GemmTile(256, 64, 64, 8, 8, 3, "swap"),
        GemmTile(128, 128, 64, 8, 8, 4, "tma"),
        GemmTile(64, 128, 64, 8, 4, 4, "ptr"),
    )
    # At 1k tokens: the 4B qkv takes 128 x 128 tiles (128 x 256 leave its last wave part-empty); the 4B down
    # (80 tiles of 128 x 256) and the 8B qkv take stream-K, as does the 4B down at 512 tokens (the
    # runner's chunk); the 4B o (K 4096) stays tiled (results/h200-2026-12-02-streamk.md).
    gemm_bf16_shapes: Mapping[tuple[int, int, int], GemmTile] = field(
        default_factory=lambda: _frozen(
            {
                (1024, 6144, 2560): GemmTile(128, 128, 64, 8, 8, 4, "tma_ws"),
                (1024, 2560, 9728): GemmTile(128, 256, 64, 8, 8, 4, "streamk"),
                (1024, 6144, 4096): GemmTile(128, 256, 64, 8, 8, 3, "streamk"),
                (512, 2560, 9728): GemmTile(128, 128, 64, 8, 8, 4, "streamk"),
            }
        )
    )
    gemm_int8_shapes: Mapping[tuple[int, int, int], GemmTile] = field(default_factory=lambda: _frozen({}))
    # From this many rows on, an INT8 weight is first widened to an exact bf16 copy (one pass) and
    # multiplied by the BF16 kernels, the scales still in the epilogue: converting in the GEMM repeats
    # the conversion once per row block and ran well below the BF16 GEMM (benchmarks/NOTES.md, "GEMM INT8
    # weights"). A "swap" tile converts in registers and skips the widening.
    int8_dequant_rows: int = 512

    # Split-KV decode. One stage (no cp.async ring; many resident programs hide the latency) and
    # 64-key tiles, except INT8 caches of >= decode_int8_long_positions, which prefer 128-key tiles,
    # 2 stages and more programs per SM (results/h200-2026-12-01-attn-int8-tiles.md).
    decode_tile: DecodeTile = DecodeTile(64, 4, 1)
    decode_tile_int8_long: DecodeTile = DecodeTile(128, 4, 2)
    decode_int8_long_positions: int = 16384
    # Split-kernel programs per SM at long context: 2 and 8 per SM were slower (benchmarks/NOTES.md,
    # "Split-KV decode attention").
    decode_programs_per_sm: int = 4
    decode_programs_per_sm_int8_long: int = 6

    # Prefill attention: 128 x 128 tiles for long chunks and INT8 caches, 64 x 64 for chunks of at most
    # prefill_small_rows query rows (T * group) (benchmarks/NOTES.md, "Prefill attention").
    prefill_tile_large: PrefillTile = PrefillTile(128, 128, 8, 2)
    prefill_tile_small: PrefillTile = PrefillTile(64, 64, 4, 3)
    prefill_small_rows: int = 4096


TUNING = Tuning()
