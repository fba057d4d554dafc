"""Every cuTile kernel, at every specialization the shipped models need, compiles for sm_90 (CPU).

The specializations come from running the model code on meta tensors with the backend's launches
recorded (tileinfer/bench/cutile_variants.py); each is compiled with
``cuda.tile.compilation.export_kernel(..., gpu_code="sm_90", output_format="cubin")``, which needs
the ``cuda-tile[tileiras]`` package but no GPU. Compiles run in a process pool (one per core);
tileiras runs as a subprocess, so the pool scales with the cores. Skipped where cuda.tile or
tileiras is missing.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

ct = pytest.importorskip("cuda.tile")

from tileinfer.bench import cutile_variants as S  # noqa: E402

_SPECS = None


def _specs():
    global _SPECS
    if _SPECS is None:
        _SPECS = S.specializations()
    return _SPECS


def _compile_one(i: int):
    """Compile spec i (forked worker): (i, error text or None, cubin size, seconds)."""
    from cuda.tile.compilation import export_kernel

    spec = _specs()[i]
    t0 = time.perf_counter()
    buf = io.BytesIO()
    try:
        export_kernel(spec.kernel, [spec.signature], buf, gpu_code="sm_90", output_format="cubin")
    except Exception as e:  # report every failure, not just the first
        return i, f"{type(e).__name__}: {e}"[:4000], 0, time.perf_counter() - t0
    return i, None, len(buf.getvalue()), time.perf_counter() - t0


def _have_tileiras() -> bool:
    try:
        from cuda.tile._compile import _find_compiler_bin

        _find_compiler_bin()
        return True
    except Exception:
        return False


def test_specializations_cover_every_kernel():
    """Each kernel of the backend appears in the specialization list (nothing left untested)."""
    names = {s.name for s in _specs()}
    expected = {"embedding_kernel", "rms_norm_kernel", "add_rms_norm_kernel",
                "qk_norm_rope_kv_kernel", "gemv_kernel", "gemv_swiglu_kernel",
                "gemv_partial_kernel", "gemv_reduce_kernel", "gemm_kernel", "gemm_swiglu_kernel",
                "prefill_attention_kernel", "decode_split_kernel", "decode_combine_kernel",
                "argmax_partial_kernel", "argmax_final_kernel", "sample_kernel"}
    assert expected <= names, f"missing: {expected - names}"


def test_every_specialization_compiles_for_sm90():
    if not _have_tileiras():
        pytest.skip("tileiras (cuda-tile[tileiras]) is not installed")
    specs = _specs()
    workers = int(os.environ.get("CUTILE_COMPILE_JOBS", os.cpu_count() or 1))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as pool:
        results = list(pool.map(_compile_one, range(len(specs))))
    wall = time.perf_counter() - t0
    failures = [(specs[i].describe(), err) for i, err, _, _ in results if err]
    slowest = sorted(results, key=lambda r: -r[3])[:3]
    print(f"\n{len(specs)} specializations compiled in {wall:.1f} s with {workers} workers; "
          "slowest: "
          + ", ".join(f"{specs[i].describe()} {t:.1f}s" for i, _, _, t in slowest))
    assert not failures, "\n\n".join(f"{d}:\n{e}" for d, e in failures)
    assert all(n > 0 for _, err, n, _ in results if not err)
