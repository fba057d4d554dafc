"""Compile every kernel the models need, ahead of time: ``python -m benchmarks.aot --backend ...``.

Prints one line per compiled kernel (name, time, constants; with --sass: registers, spills, shared
memory and SASS counts), then ``N kernels compiled for ARCH in S s`` and every failure. Exit status
1 when any kernel failed to compile (or, for Triton, needs more shared memory than the target has).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

from benchmarks.aot import BACKENDS, SASS_OPS, compile_calls, model_calls
from tileinfer.core.registry import shaped_models
from tileinfer.ops import DEFAULT_SMS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.aot",
        description="Compile every kernel the models launch, for a GPU that need not be here.",
    )
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--models", default=",".join(shaped_models()), help="registry names (conf/model), comma-separated")
    p.add_argument("--arch", default="sm_90", help="target GPU architecture")
    p.add_argument("--sms", type=int, default=DEFAULT_SMS, help="the target GPU's SM count (grids are planned for it)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    p.add_argument("--sass", action="store_true", help="report registers, spills, shared memory and SASS counts")
    p.add_argument("--filter", default="", help="only print kernels whose name contains this")
    a = p.parse_args(argv)
    toolchain = {"triton": "triton", "cutile": "cuda.tile"}[a.backend]
    if importlib.util.find_spec(toolchain.split(".")[0]) is None:
        print(
            f"benchmarks.aot: error: {toolchain} is not installed: pip install -e '.[{a.backend}]'",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    models = [m for m in a.models.split(",") if m]
    recs = compile_calls(a.backend, model_calls, (models,), a.arch, a.jobs, a.sass, a.sms)
    for r in recs:
        if a.filter in r["kernel"] and not r["error"]:
            counts = " ".join(f"{k}={r[k]}" for k in ("regs", "stack", "smem", "smem_dyn", *SASS_OPS) if r.get(k))
            print(f"{r['kernel']:28s} {r['seconds']:5.2f}s {r['variant']}" + (f" | {counts}" if a.sass else ""))
    failed = [r for r in recs if r["error"]]
    print(
        f"{len(recs) - len(failed)} kernels compiled for {a.arch} in {time.perf_counter() - t0:.1f}s "
        f"({a.backend}, {a.jobs} processes), {len(failed)} failed"
    )
    for r in failed:
        print(f"FAILED {r['kernel']} {r['variant']}: {r['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
