"""Run the hand-written mutants: each is planted alone in a temporary copy of the checkout, its tests run,
and it must make them fail ("caught"); the copy is thrown away, the checkout is never touched.

    python -m tests.mutation.run                 # every mutant (README "Test": the time it takes)
    python -m tests.mutation.run -k rope -k gguf # those whose name contains any of the words
    python -m tests.mutation.run --list

First the union of the selected mutants' tests runs on the unmutated copy and must pass (a mutant
"caught" by a test that fails anyway proves nothing). Exit status 1 if a mutant survives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutation.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", "runs", "build", "mutants", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def copy_checkout(dest: Path) -> None:
    """The working tree without version control, run outputs and device scratch folders."""

    def ignore(folder, names):
        return [n for n in names if n in SKIP or n.startswith(".device") or n.endswith(".egg-info")]

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


def pytest(copy: Path, tests: list[str], timeout: float) -> tuple[int, float]:
    """Run ``tests`` in ``copy`` with its own sources first on the path; (exit status, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    t0 = time.monotonic()
    try:
        rc = subprocess.run(
            cmd, cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout
        )
        return rc.returncode, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - t0


def plant(copy: Path, m: Mutant) -> str:
    """Apply ``m`` in ``copy``; returns the original text to restore. The old text must occur exactly once."""
    path = copy / m.file
    text = path.read_text()
    assert text.count(m.old) == 1, f"{m.name}: {m.old!r} occurs {text.count(m.old)} times in {m.file}"
    path.write_text(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", action="append", default=[], help="run the mutants whose name contains this word")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant (a hang counts as caught)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.file}  ->  {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="tileinfer-mut-") as tmp:
        copy = Path(tmp) / "repo"
        copy_checkout(copy)
        tests = sorted({t for m in chosen for t in m.tests})
        rc, secs = pytest(copy, tests, args.timeout * 4)
        print(f"baseline: {len(tests)} test selections, exit {rc}, {secs:.0f} s", flush=True)
        if rc != 0:
            print("the unmutated copy fails its tests: fix that first")
            return 2
        survived = []
        for i, m in enumerate(chosen, 1):
            original = plant(copy, m)
            try:
                rc, secs = pytest(copy, list(m.tests), args.timeout)
            finally:
                (copy / m.file).write_text(original)
            verdict = "caught" if rc != 0 else "SURVIVED"
            if rc == 0:
                survived.append(m.name)
            print(f"[{i}/{len(chosen)}] {verdict:8s} {m.name} ({secs:.0f} s, exit {rc})", flush=True)
    print(
        f"{len(chosen) - len(survived)}/{len(chosen)} caught"
        + (f"; survived: {', '.join(survived)}" if survived else "")
    )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
