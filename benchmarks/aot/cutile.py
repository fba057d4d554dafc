"""cuTile: the kernel variants some launches need, predicted without a GPU, and their compilation.

A cuTile kernel is compiled once per *variant*: its constant parameters (tile sizes, flags) plus
what the JIT infers from each array argument (dtype, rank, unit strides, size-1 dimensions,
16-divisibility of shapes and strides, 16-byte alignment). The backend's launches are recorded
instead of run (:func:`recording`, on meta tensors) and each is turned
into the :class:`~cuda.tile.compilation.KernelSignature` the JIT would build (the inference rules
of cuTile 1.7's dispatcher, ``compute_array_specialization_bits``), then compiled with
``cuda.tile.compilation.export_kernel`` (tileiras, no GPU). The disk cache key is the kernel's
bytecode, the same when the predicted signature equals the one the JIT infers, so the JIT later
finds each cubin in ``CUDA_TILE_CACHE_DIR``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import time
import typing
from dataclasses import dataclass
from typing import Sequence

import cuda.tile as ct
import torch
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel

from benchmarks.aot import Call, cubin_resources, run_calls
from tileinfer.ops import DEFAULT_SMS, get_backend

_DTYPES = {
    torch.bfloat16: ct.bfloat16,
    torch.float16: ct.float16,
    torch.float32: ct.float32,
    torch.int8: ct.int8,
    torch.int32: ct.int32,
    torch.int64: ct.int64,
}


@dataclass(frozen=True)
class KernelVariant:
    """One kernel compilation: the kernel object and the signature the JIT would use."""

    kernel: object
    signature: KernelSignature

    @property
    def name(self) -> str:
        return self.kernel._pyfunc.__name__

    def constants(self) -> tuple:
        """The values of the kernel's constant parameters, in order."""
        return tuple(p.value for p in self.signature.parameters if type(p).__name__ == "ConstantConstraint")


def _array_constraint(t: torch.Tensor) -> ArrayConstraint:
    bits = t.element_size() * 8
    shape, stride = list(t.shape), list(t.stride())
    per16 = 128 // bits if 128 % bits == 0 else None
    stride_const = [1 if s == 1 else None for s in stride]
    stride_div = [per16 if (per16 and (s * bits // 8) % 16 == 0 and s != 1) else 1 for s in stride]
    shape_const = [1 if n == 1 else None for n in shape]
    shape_div = [16 if (n % 16 == 0 and n != 1) else 1 for n in shape]
    pairs = sorted(zip(stride, shape))
    disjoint = t.dim() == 0 or pairs[0][0] > 0
    for (ps, pn), (cs, _) in zip(pairs, pairs[1:]):
        disjoint = disjoint and cs > 0 and cs >= ps * pn
    aligned = (t.storage_offset() * t.element_size()) % 16 == 0
    return ArrayConstraint(
        _DTYPES[t.dtype],
        t.dim(),
        index_dtype=ct.int32,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=not disjoint,
        stride_constant=stride_const,
        shape_constant=shape_const,
        stride_divisible_by=stride_div,
        shape_divisible_by=shape_div,
        base_addr_divisible_by=16 if aligned else 1,
    )


def _is_constant(annotation) -> bool:
    meta = getattr(annotation, "__metadata__", ())
    return any(isinstance(m, ct.ConstantAnnotation) for m in meta)


def signature_of(kernel, args: tuple) -> KernelSignature:
    """The signature the JIT infers for launching ``kernel`` with ``args`` (tensors may be meta)."""
    params = inspect.signature(kernel._pyfunc).parameters
    hints = typing.get_type_hints(kernel._pyfunc, include_extras=True)
    out, shape_const = [], False
    for (name, _), a in zip(params.items(), args):
        if isinstance(a, torch.Tensor):
            c = _array_constraint(a)
            shape_const = shape_const or any(s is not None for s in c.shape_constant)
            out.append(c)
        elif _is_constant(hints.get(name)):
            out.append(a)
        elif isinstance(a, bool):
            out.append(a)
        elif isinstance(a, int):
            out.append(ScalarConstraint(ct.int32))
        elif isinstance(a, float):
            out.append(ScalarConstraint(ct.float32))
        else:
            raise TypeError(f"{kernel._pyfunc.__name__}: cannot describe argument {name}={a!r}")
    # size-1 dimensions become shape constants, which need calling convention v2 (as in the JIT)
    cconv = CallingConvention.cutile_python_v2() if shape_const else CallingConvention.cutile_python_v1()
    return KernelSignature(out, cconv)


def variants(launches: Sequence[tuple]) -> list[KernelVariant]:
    """Distinct variants of recorded ``(kernel, grid, args)`` launches, in first-seen order (the
    compiler hints count: ``replace_hints`` gives the same function other code)."""
    seen, out = set(), []
    for kernel, _grid, args in launches:
        sig = signature_of(kernel, args)
        key = (
            kernel._pyfunc.__name__,
            repr(kernel._compiler_options),
            repr(sig.parameters),
            sig.calling_convention.code,
        )
        if key not in seen:
            seen.add(key)
            out.append(KernelVariant(kernel, sig))
    return out


@contextlib.contextmanager
def recording(run: bool = False):
    """Collect ``(kernel, grid, args)`` of every ``cuda.tile.launch`` in the block instead of running
    it (meta tensors), or besides running it (``run``); yields the list. The backend launches
    through ``cuda.tile.launch`` (``tileinfer.ops.cutile._common.launch``), which this stands in for
    while the block runs."""
    launches: list[tuple] = []
    real = ct.launch

    def record(stream, grid, kernel, args, **kwargs):
        launches.append((kernel, tuple(grid), tuple(args)))
        if run:
            real(stream, grid, kernel, args, **kwargs)

    ct.launch = record
    try:
        yield launches
    finally:
        ct.launch = real


def record(calls: Sequence[Call], sms: int = DEFAULT_SMS) -> tuple[list[KernelVariant], list[dict]]:
    """The variants ``calls`` launch through the cuTile backend with its grids planned for ``sms``
    SMs, and failure records of the calls that raised (see :func:`benchmarks.aot.run_calls`)."""
    with recording() as launches:
        failed = run_calls(calls, get_backend("cutile").with_tuning(sms=sms))
    return variants(launches), failed


def compile_variant(v: KernelVariant, arch: str) -> bytes:
    """The cubin of variant ``v`` for ``arch`` ("sm_90"); raises what tileiras reports."""
    buf = io.BytesIO()
    export_kernel(v.kernel, [v.signature], buf, gpu_code=arch, output_format="cubin")
    return buf.getvalue()


def compile_share(
    calls: Sequence[Call], arch: str, share: tuple[int, int], sass: bool, sms: int = DEFAULT_SMS
) -> list[dict]:
    """Compile share ``(k, n)`` of the variants ``calls`` launch (every n-th, from the k-th) for
    ``arch``, their grids planned for ``sms`` SMs; records as :func:`benchmarks.aot.compile_calls`
    describes."""
    found, failed = record(calls, sms)
    k, n = share
    out = failed if k == 0 else []  # every process records every call: report a failure once
    for v in found[k::n]:
        rec = dict(kernel=v.name, variant=str(v.constants()), cubin_bytes=0, error=None)
        t0 = time.perf_counter()
        try:
            cubin = compile_variant(v, arch)
            rec["cubin_bytes"] = len(cubin)
            if sass:
                rec.update(cubin_resources(cubin))
        except Exception as e:  # recorded, so that every failing variant is reported
            rec["error"] = f"{type(e).__name__}: {e}"[:4000]
        rec["seconds"] = time.perf_counter() - t0
        out.append(rec)
    return out
