"""The cuTile backend's decode GEMVs (one row, no tensor cores) in tileinfer/ops/cutile/gemm.py.

INT8: ``gemv_int8_unit_kernel`` / ``gemv_swiglu_int8_unit_kernel`` turn each int8 weight into the
float32 ``1 + (w + 128) * 2^-15`` by bit operations and remove the bias once per output. BF16:
``gemv_fma_kernel`` / ``gemv_swiglu_fma_kernel`` widen bf16 weights to float32 and accumulate
elementwise products, for K >= ``Tuning.fma_min_k`` and the outputs the mma path would not split along
K. CPU: the bit
identities the INT8 kernels rely on, checked for every byte value with the kernels' own integer
expressions, and the routing (which products take which path) on meta tensors. GPU (cutile target
only): linear with and without bias and swiglu at T == 1 against the reference, bf16, at Qwen3-4B/8B's
projections and Qwen2.5-0.5B's (896 in, 4864 inter: K and N that are not multiples of the tiles),
one fp16 case of each; tolerance 1e-2 relative in norm, as the other GPU GEMM tests (the unit form adds
~5e-5 to bf16's roundings).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.numerics import MODELS, close, q8, qkv_out
from tileinfer.ops import Int8Weight
from tileinfer.ops import reference as R

# (model, projection): (out features, in features, has bias); "gate_up" runs through swiglu
GPU_SHAPES = {
    (name, proj): shape
    for name in ("qwen3-4b-random", "qwen3-8b-random", "qwen2.5-coder-0.5b")
    for proj, shape in {
        "qkv": (qkv_out(MODELS[name]), MODELS[name].hidden_size, MODELS[name].attention_bias),
        "o": (MODELS[name].hidden_size, MODELS[name].num_attention_heads * MODELS[name].head_dim, False),
        "gate_up": (2 * MODELS[name].intermediate_size, MODELS[name].hidden_size, False),
        "down": (MODELS[name].hidden_size, MODELS[name].intermediate_size, False),
    }.items()
}


def _unit_bits(words: torch.Tensor, i: int) -> torch.Tensor:
    """Byte i of each int32 word as the kernel's unit float (``_unit_fma``'s integer expression)."""
    u = words << 8 if i == 0 else words if i == 1 else words >> (8 * i - 8)
    return ((u & 0xFF00) ^ 0x3F808000).view(torch.float32)


def test_unit_float_of_every_byte():
    """Each signed byte b in every byte position of a word gives exactly 1 + (b + 128) * 2^-15,
    and the bias removal gives back sum_k b_k x_k (exact here: small integers)."""
    b = torch.arange(-128, 128, dtype=torch.int8)
    for i in range(4):
        q = torch.zeros(256, 4, dtype=torch.int8)
        q[:, i] = b
        q[:, (i + 1) % 4] = -b  # a neighbour byte of the opposite sign must not leak in
        f = _unit_bits(q.view(torch.int32).flatten(), i)
        assert torch.equal(f.double(), 1 + (b.double() + 128) * 2**-15), i
    x = torch.tensor([3.0, -1.0, 2.0, 5.0])
    w = torch.tensor([[1, -2, 3, 5], [-128, 127, 0, -1]], dtype=torch.int8)
    words = w.view(torch.int32)
    acc = sum(_unit_bits(words, i)[:, 0] * x[i] for i in range(4))
    y = (acc - 1.00390625 * x.sum()) * 32768.0
    assert y.tolist() == (w.float() @ x).tolist() == [36.0, -516.0]


def _recorded(op, x, w, *args, **keywords) -> list[str]:
    """Names of the cuTile kernels ``op`` launches on meta tensors (nothing runs)."""
    pytest.importorskip("cuda.tile")
    from benchmarks.aot.cutile import recording
    from tileinfer.ops.cutile import gemm

    with recording() as launches:
        getattr(gemm, op)(x, w, *args, **keywords)
    return [kernel._pyfunc.__name__ for kernel, _grid, _args in launches]


def x(t, k, dt=torch.bfloat16):
    return torch.empty(t, k, dtype=dt, device="meta")


def w16(n, k, dt=torch.bfloat16):
    return torch.empty(n, k, dtype=dt, device="meta")


def test_routing():
    """T == 1 with an INT8 weight and bf16/fp16 x takes the unit-float kernels; float32 x, the
    float32 logits, more rows, a BF16 weight and K not a multiple of 4 keep the mma kernels."""

    def w8(n, k):
        return Int8Weight(
            torch.empty(n, k, dtype=torch.int8, device="meta"), torch.empty(n, dtype=torch.float32, device="meta")
        )

    bias = torch.empty(896, dtype=torch.bfloat16, device="meta")
    assert _recorded("linear", x(1, 4864), w8(896, 4864)) == ["gemv_int8_unit_kernel"]
    assert _recorded("linear", x(1, 4864), w8(896, 4864), bias) == ["gemv_int8_unit_kernel"]
    assert _recorded("linear", x(1, 4864, torch.float16), w8(896, 4864)) == ["gemv_int8_unit_kernel"]
    assert _recorded("swiglu", x(1, 896), w8(2 * 4864, 896)) == ["gemv_swiglu_int8_unit_kernel"]
    for kernels in (
        _recorded("linear", x(1, 4864, torch.float32), w8(896, 4864)),
        _recorded("lm_head", x(1, 896), w8(151936, 896)),
        _recorded("linear", x(2, 4864), w8(896, 4864)),
        _recorded("linear", x(1, 4864), w16(896, 4864)),
        _recorded("linear", x(1, 4862), w8(896, 4862)),
    ):
        assert kernels and not any("unit" in k or "fma" in k for k in kernels), kernels


def test_routing_bf16_fma():
    """T == 1 with a weight in x's dtype (bf16, fp16) and K >= fma_min_k takes the FMA kernels
    where the mma path would keep the output unsplit (Qwen3-8B qkv 6144 and gate_up 2 x 12288
    wide: enough 64-row blocks on 132 SMs); the narrow o (4096 wide) only with fma_split_shapes;
    never a shorter K (Qwen3-4B's 2560), the float32 logits, float32 x, more rows, a plan given
    (an mma plan, as the op benchmark's plan sweep passes), or with bf16_fma off."""
    pytest.importorskip("cuda.tile")
    from tileinfer.ops.cutile.plan import SkinnyPlan
    from tileinfer.ops.cutile.tuning import TUNING

    bias = torch.empty(6144, dtype=torch.bfloat16, device="meta")
    assert _recorded("linear", x(1, 4096), w16(6144, 4096)) == ["gemv_fma_kernel"]
    assert _recorded("linear", x(1, 4096), w16(6144, 4096), bias) == ["gemv_fma_kernel"]
    assert _recorded("linear", x(1, 4096, torch.float16), w16(6144, 4096, torch.float16)) == ["gemv_fma_kernel"]
    assert _recorded("swiglu", x(1, 4096), w16(2 * 12288, 4096)) == ["gemv_swiglu_fma_kernel"]
    others = [
        _recorded("linear", x(1, 4096), w16(4096, 4096)),
        _recorded("linear", x(1, 2560), w16(6144, 2560)),
        _recorded("linear", x(1, 4096, torch.float32), w16(6144, 4096, torch.float32)),
        _recorded("lm_head", x(1, 4096), w16(151936, 4096)),
        _recorded("linear", x(2, 4096), w16(6144, 4096)),
    ]
    split_too = replace(TUNING, fma_split_shapes=True)
    assert _recorded("linear", x(1, 4096), w16(4096, 4096), tuning=split_too) == ["gemv_fma_kernel"]
    shorter = replace(split_too, fma_min_k=2560)
    assert _recorded("linear", x(1, 2560), w16(6144, 2560), tuning=shorter) == ["gemv_fma_kernel"]
    others.append(_recorded("linear", x(1, 4096), w16(6144, 4096), plan=SkinnyPlan("mma", 64, 128, 1)))
    others.append(_recorded("swiglu", x(1, 4096), w16(2 * 12288, 4096), tuning=replace(TUNING, bf16_fma=False)))
    for kernels in others:
        assert kernels and not any("fma" in k for k in kernels), kernels


# the kernels a T == 1 product launches, per weight kind: (linear, swiglu)
GEMV_KERNELS = {
    "int8": ("gemv_int8_unit_kernel", "gemv_swiglu_int8_unit_kernel"),
    "bf16": ("gemv_fma_kernel", "gemv_swiglu_fma_kernel"),
}


@pytest.mark.cases(
    "weight,model,proj,dt",
    targets=("cutile",),
    model=[(wt, m, p, "bf16") for wt in GEMV_KERNELS for m, p in GPU_SHAPES]
    + [("int8", "qwen3-4b-random", "qkv", "f16"), ("bf16", "qwen3-4b-random", "gate_up", "f16")],
)
def test_decode_gemv(target, weight, model, proj, dt):
    """Each projection through the unit-float INT8 kernels, or (a weight in x's dtype) the FMA
    kernels, which here take every shape (a tuning with fma_split_shapes on and fma_min_k 0: o, down
    and the shorter K of 4B and 0.5B too)."""
    from benchmarks.aot.cutile import recording

    every_shape = replace(target.ops.tuning, fma_split_shapes=True, fma_min_k=0)
    n, k, has_bias = GPU_SHAPES[model, proj]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dt]
    linear, swiglu = GEMV_KERNELS[weight]
    x = torch.randn(1, k, device="cuda").to(dt)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dt)
    if weight == "int8":
        w = q8(w)
    with recording(run=True) as launches:
        if proj == "gate_up":
            close(target.ops.swiglu(x, w, tuning=every_shape), R.swiglu(x, w), 1e-2, f"{model} swiglu {n}x{k}")
        else:
            close(target.ops.linear(x, w, tuning=every_shape), R.linear(x, w), 1e-2, f"{model} {proj} {n}x{k}")
            b = torch.randn(n, device="cuda").to(dt)
            got = target.ops.linear(x, w, b, tuning=every_shape)
            close(got, R.linear(x, w, b), 1e-2, f"{model} {proj} {n}x{k} + bias")
    launched = [kernel._pyfunc.__name__ for kernel, _grid, _args in launches]
    assert launched == ([swiglu] if proj == "gate_up" else [linear] * 2)
