"""Triton: compile each kernel launch for a target GPU instead of running it (no GPU needed).

Inside :func:`compiling`, launching a ``@triton.jit`` kernel goes through the binder and
specialization path of ``JITFunction.run`` (so the specializations, and the on-disk cache keys,
are those a real launch at these shapes produces) and then compiles for the target with
``triton.compile`` instead of launching. Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from benchmarks.aot import Call, cubin_resources, run_calls
from tileinfer.ops import DEFAULT_SMS, get_backend

# Shared memory one block may use, in bytes (227 KB on sm_90). The compiler does not check it; a
# launch past it fails with OutOfResources, so the check here catches that without a GPU.
SHARED_MEMORY = {90: 232448}


@contextlib.contextmanager
def compiling(target: GPUTarget, share: tuple[int, int] = (0, 1)):
    """Make kernel launches compile for ``target`` instead of running; yields {key: record}.

    Distinct specializations are numbered in launch order; only those with number % n == k
    compile, for ``share = (k, n)``. Each record: dict(name, kernel (CompiledKernel, None on
    failure), error, seconds, constexprs, num_warps, num_stages).
    """
    backend = make_backend(target)
    order: dict = {}
    seen: dict = {}
    orig = JITFunction.run
    k, n = share

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (self.fn.__qualname__, str(specialization), str(options))
        if key in order:
            return None
        order[key] = len(order)
        if order[key] % n != k:
            return None
        opts, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        names = {(i,): name for i, name in enumerate(self.arg_names)}
        rec = dict(
            name=self.fn.__name__,
            kernel=None,
            error=None,
            num_warps=opts.num_warps,
            num_stages=opts.num_stages,
            constexprs={names.get(c, c): v for c, v in constexprs.items()},
        )
        t0 = time.perf_counter()
        try:
            rec["kernel"] = triton.compile(
                ASTSource(self, signature, constexprs, attrs), target=target, options=opts.__dict__
            )
        except Exception as e:  # recorded, so that every failing kernel is reported
            rec["error"] = f"{type(e).__name__}: {e}"[:4000]
        rec["seconds"] = time.perf_counter() - t0
        seen[key] = rec
        return None

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


def compile_share(
    calls: Sequence[Call], arch: str, share: tuple[int, int], sass: bool, sms: int = DEFAULT_SMS
) -> list[dict]:
    """Compile share ``(k, n)`` of the distinct kernels ``calls`` launch for ``arch`` ("sm_90"), their
    grids planned for ``sms`` SMs; records as :func:`benchmarks.aot.compile_calls` describes (a
    kernel over the target's shared memory is a failure)."""
    ops = get_backend("triton").with_tuning(sms=sms)
    cap = int(arch.removeprefix("sm_"))
    with compiling(GPUTarget("cuda", cap, 32), share) as seen:
        failed = run_calls(calls, ops)
    out = failed if share[0] == 0 else []  # every process runs every call: report a failure once
    limit = SHARED_MEMORY.get(cap)
    for r in seen.values():
        kernel, error = r["kernel"], r["error"]
        constants = {name: getattr(v, "name", v) for name, v in r["constexprs"].items()}
        rec = dict(
            kernel=r["name"],
            variant=f"w{r['num_warps']} s{r['num_stages']} {constants}",
            seconds=r["seconds"],
            cubin_bytes=0,
            error=error,
        )
        if kernel is not None:
            rec.update(cubin_bytes=len(kernel.asm["cubin"]), smem_dyn=kernel.metadata.shared)
            if limit is not None and kernel.metadata.shared > limit:
                rec["error"] = f"needs {kernel.metadata.shared} bytes of shared memory, more than {arch}'s {limit}"
            if sass:
                rec.update(cubin_resources(kernel.asm["cubin"]))
        out.append(rec)
    return out
