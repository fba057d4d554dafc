"""Every Triton kernel, at the specializations the shipped models need, compiles for sm_90 (no GPU).

The op tests of the Triton backend (in the interpreter on the CPU, compiled on the GPU) are the
conformance suites in tests/ops/; this is the compile check beside them, as tests/test_cutile_compile.py
is for cuTile. It runs ``python -m benchmarks.aot --backend triton`` in a subprocess, since
the interpreter flag that tests/conftest.py sets without a GPU must be off there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.aot", "--backend", "triton"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "kernels compiled for sm_90" in p.stdout
    print(p.stdout.splitlines()[-1], f"({time.perf_counter() - t0:.0f}s)")
