"""The cuTile backend's tuning: the switches and tile sizes its plans choose from, in one object.

:class:`Tuning` holds them, :data:`TUNING` is the shipped one. The ops take a tuning as an argument
(a :class:`tileinfer.ops.Backend` holds one; ``Backend.with_tuning`` makes another), so an A/B run
passes the alternative instead of patching this module. Values were chosen from sweeps and
whole-model A/B runs on the H200; the measurements are in the files each comment cites
(benchmarks/cutile-NOTES.md, benchmarks/results/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """The cuTile backend's switches and tiles. Every field has the shipped value as default."""

    # The SM count the grid rules plan for; None: the device's own (tileinfer.ops.sm_count).
    sms: int | None = None

    # Skinny products (2..16 rows, and one row where neither GEMV below applies) run on the tensor
    # cores; a grid shorter than this percentage of the SMs is split along K. About one block per SM
    # is the sweet spot: an unsplit narrow output left SMs idle, a split wide one paid for the
    # reduction (benchmarks/cutile-NOTES.md, "linear / swiglu / lm_head", version 2).
    split_k: bool = True
    split_k_busy_percent: int = 68

    # One row, INT8 weight, bf16/fp16 activations: the unit-float GEMV (no tensor cores, no bf16
    # conversion; float32 activations and logits keep the exact mma path). 16-channel blocks beat 8,
    # and 256-word tiles beat 128 and 512, in whole-model decode (results/h200-2026-12-01-decode-final.md).
    int8_unit: bool = True
    unit_tn: int = 16  # output channels per block
    unit_tkw: int = 256  # int32 words (4 weights each) per tile

    # One row, weight in x's dtype (bf16/fp16), K >= fma_min_k: the float32-FMA GEMV, only where the
    # mma path would not split K (fma_split_shapes: there too). It won the 8B model and lost the 4B
    # one, hence the K threshold; 4- and 16-channel and 1024-wide tiles lost
    # (results/h200-2026-12-03-cutile-fma-gemv.md).
    bf16_fma: bool = True
    fma_split_shapes: bool = False
    fma_tn: int = 8  # output channels per block
    fma_tk: int = 512  # weights of a row per tile (SwiGLU: half, for the same registers)
    fma_min_k: int = 4096

    # From this many rows an INT8 prefill GEMM widens its weight to an exact copy in x's dtype (one
    # pass, per call) and runs the BF16 tiles on it, the scales still in the epilogue: converting in
    # the k-loop repeats the conversion in every row block (results/h200-2026-12-03-final.md).
    int8_widen_rows: int = 512

    # Decode over an INT8 cache, one bf16 query row, head_dim 128, GQA group <= 16: the int32-word
    # kernel (benchmarks/cutile-NOTES.md, "attention"); False: the mma path.
    decode_int8_words: bool = True

    # Prefill attention: query rows per block and the kernel's compiler hints in place of its own
    # (cuda.tile ``replace_hints``; () keeps them) (benchmarks/cutile-NOTES.md, "attention").
    prefill_rows: int = 128
    prefill_hints: tuple[tuple[str, int | None], ...] = ()


TUNING = Tuning()
