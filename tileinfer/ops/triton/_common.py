"""Shared helpers of the Triton backend: interpreter detection, dot operand types, small launch math.

``INTERPRET`` is read once, when this package is imported: ``TRITON_INTERPRET=1`` must be set before
that (Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted). Under the
interpreter, ``tl.dot`` on bf16 operands gives wrong results (triton 3.6), so every kernel takes its
dot operand type as a constexpr and runs the dot in float32 when interpreting.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while its
# predecessor's last blocks run, so its launch latency overlaps them, also inside a CUDA graph. Each
# decode-path kernel first lets its successor launch, then waits for its predecessor to complete
# (its writes visible) before any load or store, as the cuTile backend does: completion is then
# transitive. TILEINFER_TRITON_PDL=0 turns it off (to measure what it gains).
PDL = not INTERPRET and os.environ.get("TILEINFER_TRITON_PDL", "1") != "0"


def dot_dtype(dt: torch.dtype):
    """Operand type for ``tl.dot`` given the activations' dtype.

    bf16/f16 run on the tensor cores as they are; float32 activations (tests, tiny models) run in
    float32 with ``input_precision="ieee"`` (no tf32, so 1e-5 tolerances hold); under the interpreter
    every dot runs in float32 (its bf16 dot is wrong).
    """
    if INTERPRET or dt == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dt]


def dot_precision(dt: torch.dtype) -> str:
    """``input_precision`` for tl.dot: exact IEEE float32 products when the operands are float32."""
    return "ieee" if (INTERPRET or dt == torch.float32) else "tf32"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def i8x4_byte_to_f32(w, SHIFT: tl.constexpr):
    """One signed byte of each int32 word of ``w``, as float32, without an I2F instruction.

    ``((w >> SHIFT) & 0xFF) ^ 0x80`` is the byte plus 128 as an unsigned value u; OR-ing it into the
    mantissa of 2^23 gives the float 2^23 + u exactly, and subtracting 2^23 + 128 leaves the signed
    byte. Integer ops and one FADD run at full rate, where I2F runs at a quarter or less (the same
    "magic number" trick FasterTransformer/Marlin use to dequantize INT8/INT4 weights).
    """
    u = ((w >> SHIFT) & 0xFF) ^ 0x80
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


# Signed int8 -> float32 1 + (w + 128) * 2^-15 (see ``i8_to_unit_f32``): four bytes of one register
# flipped to w + 128 by one XOR, then each byte PRMT-ed into bits 8-15 of 0x3F800000 (1.0f).
_UNIT_F32_ASM = tl.constexpr(
    "{ .reg .b32 u; xor.b32 u, $4, 0x80808080; "
    "prmt.b32 $0, u, 0x3F800000, 0x7604; prmt.b32 $1, u, 0x3F800000, 0x7614; "
    "prmt.b32 $2, u, 0x3F800000, 0x7624; prmt.b32 $3, u, 0x3F800000, 0x7634; }"
)
_ASM_OK: tl.constexpr = tl.constexpr(not INTERPRET)


@triton.jit
def i8_to_unit_f32(w):
    """int8 tile -> float32 ``1 + (w + 128) * 2^-15``, exact, in about 1.25 instructions a weight.

    The weight's byte goes into bits 8-15 of the mantissa of 1.0 by one PRMT (byte permute) per
    weight after one XOR per four: no I2F (quarter rate) and no FADD. The caller removes the bias
    once per output, not per weight: ``sum_k f(w_k) x_k = (1 + 2^-8) sum_k x_k + 2^-15 sum_k w_k x_k``.
    The price is precision: each float32 product carries the bias, so the weight's part of a
    product keeps about 15 of its 24 bits (relative error ~5e-5 of the row's largest output,
    against bf16's half-ulp of 2e-3). The byte-into-a-magic-exponent trick is FasterTransformer's
    ``FastInterleavedAndBiasedNumericArrayConverter`` (PRMT into 0x4B000000, then a subtraction per
    weight), here with the subtraction moved out of the loop. The interpreter, which has no
    inline PTX, computes the same bits with shifts and masks.
    """
    if _ASM_OK:
        return tl.inline_asm_elementwise(_UNIT_F32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)
    u = (w.to(tl.int32) & 0xFF) ^ 0x80
    return ((u << 8) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def rint_f32(y):
    """Round float32 to the nearest integer, ties to even, for |y| <= 2^22.

    Adding and subtracting 1.5 * 2^23 pushes the fraction out of the mantissa under IEEE
    round-to-nearest-even (as torch.round does). Used instead of libdevice's rint, which the
    Triton interpreter lacks.
    """
    return (y + 12582912.0) - 12582912.0


# The interpreter converts float32 to bf16 by truncation (triton 3.6); the GPU rounds to nearest
# even. Kernels convert through ``cast`` so both round the same way.
_FIX_BF16: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _round_bf16(y):
    """Float32 rounded (nearest, ties to even) to a value bf16 holds exactly, with integer ops."""
    b = y.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def cast(y, dt: tl.constexpr):
    """``y.to(dt)`` with round-to-nearest-even for bf16 also under the interpreter."""
    if _FIX_BF16:
        if dt == tl.bfloat16:
            y = _round_bf16(y.to(tl.float32))
    return y.to(dt)


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords of a decode-path kernel whose tensors live on ``t``'s device: programmatic
    dependent launch (the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``) on Hopper and
    later when :data:`PDL` is on, else none."""
    if PDL and t.is_cuda and _has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a decode-path kernel (see :data:`PDL`); nothing when PDL is off."""
    if PDL:
        # PTX griddepcontrol with a memory clobber, so no load or store is moved above the wait
        # (triton.language.extra.cuda's gdc_wait declares none)
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r,~{memory}", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r,~{memory}", [], dtype=tl.int32, is_pure=False, pack=1
        )
