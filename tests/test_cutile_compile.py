"""Every cuTile kernel, at every variant the registered models need, compiles for sm_90 (CPU).

The variants come from running the model code on meta tensors with the backend's launches
recorded, and each compiles with ``cuda.tile.compilation.export_kernel(..., gpu_code="sm_90",
output_format="cubin")``, which needs the ``cuda-tile[tileiras]`` package but no GPU: the path of
``python -m benchmarks.aot --backend cutile`` (benchmarks/aot). Compiles run in
CUTILE_COMPILE_JOBS processes (default: one per core); tileiras runs as a subprocess, so they scale
with the cores. Skipped where cuda.tile or tileiras is missing.
"""

from __future__ import annotations

import os
import time

import pytest

ct = pytest.importorskip("cuda.tile")

from benchmarks import aot  # noqa: E402
from benchmarks.aot import cutile as aot_cutile  # noqa: E402
from tileinfer.core.registry import shaped_models  # noqa: E402


def _have_tileiras() -> bool:
    try:
        from cuda.tile._compile import _find_compiler_bin

        _find_compiler_bin()
        return True
    except Exception:
        return False


def test_variants_cover_every_kernel():
    """Each kernel of the backend appears among the recorded variants (nothing left untested)."""
    found, failed = aot_cutile.record(aot.model_calls(shaped_models()))
    assert failed == []
    expected = {
        "embedding_kernel",
        "rms_norm_kernel",
        "add_rms_norm_kernel",
        "qk_norm_rope_kv_kernel",
        "gemv_kernel",
        "gemv_swiglu_kernel",
        "gemv_int8_unit_kernel",
        "gemv_swiglu_int8_unit_kernel",
        "gemv_fma_kernel",
        "gemv_swiglu_fma_kernel",
        "gemv_partial_kernel",
        "gemv_reduce_kernel",
        "gemm_kernel",
        "gemm_swiglu_kernel",
        "widen_kernel",
        "prefill_attention_kernel",
        "decode_split_kernel",
        "decode_split_int8_kernel",
        "decode_combine_kernel",
        "argmax_partial_kernel",
        "argmax_final_kernel",
    }
    assert expected <= {v.name for v in found}, f"missing: {expected - {v.name for v in found}}"


def test_every_variant_compiles_for_sm90():
    if not _have_tileiras():
        pytest.skip("tileiras (cuda-tile[tileiras]) is not installed")
    jobs = int(os.environ.get("CUTILE_COMPILE_JOBS", os.cpu_count() or 1))
    t0 = time.perf_counter()
    recs = aot.compile_calls("cutile", aot.model_calls, (shaped_models(),), "sm_90", jobs)
    slowest = sorted(recs, key=lambda r: -r["seconds"])[:3]
    print(
        f"\n{len(recs)} variants compiled in {time.perf_counter() - t0:.1f} s with {jobs} processes; slowest: "
        + ", ".join(f"{r['kernel']}{r['variant']} {r['seconds']:.1f}s" for r in slowest)
    )
    failures = [f"{r['kernel']}{r['variant']}:\n{r['error']}" for r in recs if r["error"]]
    assert not failures, "\n\n".join(failures)
    assert all(r["cubin_bytes"] > 0 for r in recs)
