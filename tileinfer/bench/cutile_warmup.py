"""Compile every specialization the shipped models need, in parallel, into cuTile's disk cache.

``python -m tileinfer.bench.cutile_warmup [--jobs N] [--arch sm_90]``

The JIT compiles a kernel on its first launch with a given specialization, one at a time, in the
launching process. Compiling the list of ``specializations.py`` ahead, one process per core,
fills cuTile's disk cache (``CUDA_TILE_CACHE_DIR``, default ~/.cache/cutile-python), and the JIT
then finds each cubin there: the cache key is the kernel's bytecode, which is the same when the
predicted signature equals the one the JIT infers.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor

from tileinfer.bench import cutile_variants as S

_SPECS: list = []
_ARCH = "sm_90"


def _one(i: int):
    from cuda.tile.compilation import export_kernel

    t0 = time.perf_counter()
    try:
        export_kernel(_SPECS[i].kernel, [_SPECS[i].signature], io.BytesIO(), gpu_code=_ARCH,
                      output_format="cubin")
        return i, None, time.perf_counter() - t0
    except Exception as e:
        return i, f"{type(e).__name__}: {e}"[:2000], time.perf_counter() - t0


def main(argv=None) -> int:
    global _SPECS, _ARCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--bench", action="store_true", help="also the bench's tile sweep")
    a = ap.parse_args(argv)
    _ARCH = a.arch
    _SPECS = S.specializations()
    if a.bench:
        from tileinfer.bench.cutile_ops import sweep_launches

        seen = {(x.name, repr(x.signature.parameters)) for x in _SPECS}
        for kernel, _, args in sweep_launches():
            sig = S.signature_of(kernel, args)
            key = (kernel._pyfunc.__name__, repr(sig.parameters))
            if key not in seen:
                seen.add(key)
                _SPECS.append(S.Specialization(kernel, sig))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=mp.get_context("fork")) as pool:
        res = list(pool.map(_one, range(len(_SPECS))))
    bad = [(i, e) for i, e, _ in res if e]
    print(f"warmup: {len(_SPECS)} specializations in {time.perf_counter() - t0:.1f} s "
          f"({a.jobs} jobs), {len(bad)} failed")
    for i, e in bad:
        print("FAILED", _SPECS[i].describe(), e)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
