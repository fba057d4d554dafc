"""Nsight Compute profile of the ops benchmark cases: one ncu row per kernel of each (case, backend).

    python -m benchmarks.profile [--backends triton,cutile,torch] [--models qwen3-4b-random]
        [--cases decode:linear,decode:attention:int8kv:ctx=8192,...] [--out runs/profile]
        [--no-32k] [--timeout 480] [--ncu PATH]

The parent finds ncu and runs this module again (``--child``) under it. The child builds the selected
cases of :mod:`benchmarks.cases` (a filter is ``phase:op[:variant][:shape-substring]``; empty parts
match all), warms each (case, backend) up three times (compilation, autotuning), then profiles one
call between cudaProfilerStart/Stop, right after a one-program Triton kernel ``_ncu_case_marker``:
in ncu's kernel list every kernel after a marker belongs to that marker's case. The child writes
OUT/cases.json (one entry per marker); the parent exports OUT/ncu_raw.csv and writes OUT/profile.md
(per-kernel table and per-case totals) and OUT/profile.csv (the kernel rows).

Columns: ``us`` kernel duration; ``dram_GBps`` (DRAM bytes read + written) / duration; ``dram_pct``,
``mem_pct`` (busiest memory unit), ``sm_pct`` (busiest SM unit): % of peak; ``occupancy_pct`` achieved
and ``theo_occupancy_pct`` theoretical warps per SM, % of the maximum; ``regs`` per thread; ``grid``,
``block``; ``issue_pct`` cycles with an instruction issued, % of active cycles; ``top_pipe`` the
busiest execution pipe; ``stalls`` the top three stall reasons, in cycles per issued instruction
("selected", the issue itself, left out). Per (case, backend): ``kernels``, ``us`` their sum,
``eff_GBps`` the case's ideal bytes (``Case.nbytes``) / ``us``, ``longest`` kernel.
Reading them: dram_pct near 90 or more is bandwidth-bound (the goal for GEMV and decode attention);
low dram_pct and low sm_pct with long_scoreboard / wait stalls is latency-bound (too few bytes in
flight: more CTAs, deeper pipelining, wider loads); high issue_pct or a pipe near its peak is
instruction-bound (fewer instructions per byte: vectorize, hoist dequantization, use tensor cores).

ncu serialises kernels and replays each several times (restoring memory, flushing the caches before
each pass); ``--clock-control none`` leaves the clocks as they are (ncu locks the base clock by
default). So ``us`` is a single launch, without CUDA graph, from cold caches: not comparable 1:1 with
bench.ops times (graph replays, warm L2 for small operands), but the percentages and stalls say why.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from tileinfer.core.registry import shaped_models

MARKER = "_ncu_case_marker"
SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
)
EXTRA_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"  # in no section above (MemoryWorkloadAnalysis_Chart)
DEFAULT_CASES = "decode:linear,decode:swiglu,decode:lm_head,decode:attention,prefill:linear,prefill:attention"
CASE_FIELDS = ("model", "phase", "op", "shape", "variant")
_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_TO_BYTES = {
    "byte": 1.0,
    "B": 1.0,
    "Kbyte": 1e3,
    "KB": 1e3,
    "Mbyte": 1e6,
    "MB": 1e6,
    "Gbyte": 1e9,
    "GB": 1e9,
    "Tbyte": 1e12,
    "TB": 1e12,
}
# column -> metric names, first present wins (names differ between ncu versions and GPUs)
_PCT = {
    "dram_pct": (
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "mem_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "theo_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active",),
}
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
_PIPE = re.compile(r"sm__(?:inst_executed_pipe_(\w+)|pipe_(\w+)_cycles_active)\.avg\.pct_of_peak_sustained_active$")


# ---------------------------------------------------------------------------- parsing


def _num(text) -> float | None:
    try:
        return float(str(text).strip().replace(",", ""))
    except ValueError:
        return None


def _short(name: str) -> str:
    """``void ns::k<T, 4>(int, float*)`` -> ``k``; a CUTLASS wrapper (``Kernel2<gemm_cfg>``) -> its config."""
    base = name
    while (stripped := re.sub(r"<[^<>]*>", "", base)) != base:
        base = stripped
    words = base.split("(")[0].split()
    base = words[-1].split("::")[-1] if words else name
    if re.fullmatch(r"Kernel\d*|device_kernel", base) and (m := re.search(r"<\s*([\w:]+)", name)):
        base = m.group(1).split("::")[-1]
    return base[:40]


def _kernel_row(row: dict, units: dict) -> dict:
    def val(col, scale=None, nd=None):
        if isinstance(col, tuple):
            col = next((c for c in col if row.get(c) not in (None, "")), col[0])
        v = _num(row.get(col))
        if v is not None and scale is not None:
            v = None if (f := scale.get(units.get(col, "").strip())) is None else v * f
        return v if v is None or nd is None else round(v, nd)

    us = val("gpu__time_duration.sum", _TO_US)
    rd, wr = val("dram__bytes_read.sum", _TO_BYTES), val("dram__bytes_write.sum", _TO_BYTES)
    stalls = sorted(
        (
            (m.group(1), v)
            for c in row
            if (m := _STALL.match(c)) and m.group(1) != "selected" and (v := val(c)) is not None
        ),
        key=lambda kv: -kv[1],
    )
    pipes = [(m.group(1) or m.group(2), v) for c in row if (m := _PIPE.match(c)) and (v := val(c)) is not None]
    pipe = max(pipes, key=lambda kv: kv[1], default=None)
    regs = val("launch__registers_per_thread")
    pct = {k: val(c, nd=1) for k, c in _PCT.items()}
    if pct["issue_pct"] is None and (f := val("smsp__issue_active.avg.per_cycle_active")) is not None:
        pct["issue_pct"] = round(100 * f, 1)  # ncu 2025.3 reports the fraction of active cycles
    return dict(
        kernel=_short(row.get("Kernel Name", "")),
        us=None if us is None else round(us, 2),
        dram_GBps=round((rd + wr) / us / 1e3) if us and None not in (rd, wr) else None,
        **pct,
        regs=None if regs is None else int(regs),
        grid=row.get("Grid Size", "").replace(" ", "") or None,
        block=row.get("Block Size", "").replace(" ", "") or None,
        top_pipe=f"{pipe[0]} {pipe[1]:.1f}%" if pipe else None,
        stalls=", ".join(f"{r} {v:.1f}" for r, v in stalls[:3]) or None,
    )


def parse(raw_csv: str, manifest: list[dict]) -> tuple[list[dict], list[dict]]:
    """Split ncu's raw CSV (``--page raw --csv``: names row, units row, one row per kernel) into cases.

    Kernels are taken in ncu's ID order; those after the i-th ``_ncu_case_marker`` belong to
    ``manifest[i]`` (a case and backend). Returns (kernel rows, per-(case, backend) rows: number of
    kernels, total µs, effective GB/s of the case's ideal ``nbytes``, longest kernel). Raises
    ValueError when the markers and the manifest entries differ in number.
    """
    lines = raw_csv.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu raw CSV header (a line starting with "ID") in the export')
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    names = next(reader)
    units = dict(zip(names, next(reader, [])))
    rows = sorted((dict(zip(names, r)) for r in reader if r), key=lambda r: _num(r.get("ID")) or 0)
    if not isinstance(manifest, list) or not all(
        isinstance(m, dict) and isinstance(m.get("nbytes", 0), (int, float, type(None))) for m in manifest
    ):
        raise ValueError("cases.json is not a list of (case, backend) entries as the profiling run writes")
    n_markers = sum(MARKER in r.get("Kernel Name", "") for r in rows)
    if n_markers != len(manifest):
        raise ValueError(
            f"ncu report has {n_markers} case markers but the manifest lists {len(manifest)} "
            "(case, backend) entries: the run was cut short or the files are from different runs"
        )
    groups: list[tuple[dict, list]] = []
    for r in rows:
        if MARKER in r.get("Kernel Name", ""):
            groups.append((manifest[len(groups)], []))
        elif groups:  # (nothing runs between cudaProfilerStart and the first marker)
            groups[-1][1].append(_kernel_row(r, units))
    kernels, summary = [], []
    for m, ks in groups:
        key = {f: m.get(f) for f in (*CASE_FIELDS, "backend")}
        kernels += [{**key, **k} for k in ks]
        us = round(sum(k["us"] or 0.0 for k in ks), 2)
        summary.append(
            dict(
                key,
                kernels=len(ks),
                us=us,
                eff_GBps=round(m["nbytes"] / us / 1e3) if us and m.get("nbytes") else None,
                longest=max(ks, key=lambda k: k["us"] or 0.0)["kernel"] if ks else None,
            )
        )
    return kernels, summary


# ---------------------------------------------------------------------------- child (under ncu)


def select(cases: list, spec: str) -> list:
    """The cases matching any comma-separated ``phase:op[:variant][:shape-substring]`` filter."""
    filters = [(f.split(":", 3) + ["", "", ""])[:4] for f in spec.split(",") if f]
    return [
        c
        for c in cases
        if any(
            (not ph or c.phase == ph) and (not op or c.op == op) and (not va or c.variant == va) and sh in c.shape
            for ph, op, va, sh in filters
        )
    ]


def _child(a) -> int:
    import torch
    import triton
    import triton.language as tl

    from benchmarks.cases import model_cases
    from tileinfer.ops import get_backend

    @triton.jit
    def _ncu_case_marker(flag):
        tl.store(flag, tl.load(flag) + 1)

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    _ncu_case_marker[(1,)](flag)  # compiled before the first profiled range
    backends = {}
    for name in a.backends.split(","):
        try:
            backends[name] = "torch" if name == "torch" else get_backend(name)
        except Exception as e:
            print(f"[profile] backend {name} skipped: {e}", flush=True)
    cases = select([c for m in a.models.split(",") if m for c in model_cases(m, not a.no_32k)], a.cases)
    manifest: list[dict] = []
    for i, c in enumerate(cases):
        label = f"{c.model} {c.phase} {c.op} {c.shape} {c.variant}"
        try:
            args = c.make("cuda")
        except Exception as e:
            print(f"[profile] {label}: building the arguments failed: {type(e).__name__}: {e}", flush=True)
            continue
        for name, ops in backends.items():
            fn = c.fn(ops)
            try:
                for _ in range(3):
                    fn(args)
                torch.cuda.synchronize()
            except Exception as e:
                print(f"[profile] {label} {name} skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            torch.cuda.profiler.start()
            try:
                _ncu_case_marker[(1,)](flag)
                manifest.append(
                    dict({f: getattr(c, f) for f in CASE_FIELDS}, backend=name, nbytes=c.nbytes, flops=c.flops)
                )
                fn(args)
                torch.cuda.synchronize()
            except Exception as e:
                print(f"[profile] {label} {name} failed while profiled: {type(e).__name__}: {e}", flush=True)
            finally:
                torch.cuda.profiler.stop()
            with open(os.path.join(a.out, "cases.json"), "w") as f:  # kept in step with the markers
                json.dump(manifest, f, indent=1)
            print(f"[profile] {i + 1}/{len(cases)} {label} {name}", flush=True)
        del args
        torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------- parent


def find_ncu(override: str | None = None) -> str | None:
    """``override``, else ncu on PATH, in /usr/local/cuda/bin, /opt/nvidia/nsight-compute/*, /usr/local/cuda*/bin."""
    found = (
        [override]
        if override
        else [
            shutil.which("ncu"),
            "/usr/local/cuda/bin/ncu",
            *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")),
            *sorted(glob.glob("/usr/local/cuda*/bin/ncu")),
        ]
    )
    return next((p for p in found if p and os.path.isfile(p) and os.access(p, os.X_OK)), None)


def _stream(cmd: list[str], timeout: float) -> int:
    """Run ``cmd``, echoing its output except ncu's per-kernel lines; kill its process group on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            if not line.startswith('==PROF== Profiling "'):
                print(line, end="", flush=True)
        return proc.wait()
    finally:
        timer.cancel()


def main(argv=None) -> int:
    """Parent mode: profile the selection under ncu and write the tables; ``--child``: the profiled run."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,cutile,torch")
    p.add_argument("--models", default="qwen3-4b-random", help="registry names (conf/model), comma-separated")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated phase:op[:variant][:shape-substring]")
    p.add_argument("--out", default="runs/profile")
    p.add_argument("--no-32k", action="store_true", help="skip the 32k-context decode attention")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds for the ncu run")
    p.add_argument("--ncu", help="path of ncu (default: searched)")
    p.add_argument(
        "--parse-only",
        action="store_true",
        help="only rebuild the tables from OUT/ncu_raw.csv and OUT/cases.json (no GPU, no ncu)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out = os.path.abspath(a.out)
    if a.child:
        return _child(a)
    if a.parse_only:
        missing = [f for f in ("ncu_raw.csv", "cases.json") if not os.path.isfile(os.path.join(a.out, f))]
        if missing:
            print(f"--parse-only: {a.out} has no {' or '.join(missing)} (written by a profiling run)", file=sys.stderr)
            return 2
        return write_tables(a.out, "tables rebuilt from ncu_raw.csv")
    a.models = ",".join(m for m in a.models.split(",") if m)
    if not a.models:
        print(f"--models: name at least one of {', '.join(shaped_models())}", file=sys.stderr)
        return 2
    if unknown := [m for m in a.models.split(",") if m not in shaped_models()]:
        print(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(shaped_models())}", file=sys.stderr)
        return 2
    ncu = find_ncu(a.ncu)
    if not ncu:
        print(
            f"ncu: {a.ncu} is not an executable"
            if a.ncu
            else "ncu (Nsight Compute) not found on PATH, in "
            "/usr/local/cuda*/bin or /opt/nvidia/nsight-compute/*: pass --ncu PATH",
            file=sys.stderr,
        )
        return 2
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the profile needs a GPU (and ncu)", file=sys.stderr)
        return 2
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        print(f"--out {a.out}: {e.strerror}", file=sys.stderr)
        return 2
    rep, manifest = os.path.join(a.out, "profile"), os.path.join(a.out, "cases.json")
    for stale in (rep + ".ncu-rep", manifest):  # never parse an earlier run's files
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    cmd = [
        ncu,
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--target-processes",
        "all",
        *[x for s in SECTIONS for x in ("--section", s)],
        "--metrics",
        EXTRA_METRICS,
        "-o",
        rep,
        "-f",
        sys.executable,
        "-m",
        "benchmarks.profile",
        "--child",
        "--backends",
        a.backends,
        "--models",
        a.models,
        "--cases",
        a.cases,
        "--out",
        a.out,
        *(["--no-32k"] if a.no_32k else []),
    ]
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = _stream(cmd, a.timeout)
    if not os.path.exists(rep + ".ncu-rep") or not os.path.exists(manifest):
        print(
            f"ncu run exited {rc} after {time.perf_counter() - t0:.0f}s (limit {a.timeout:.0f}s) "
            "without a report and a manifest",
            file=sys.stderr,
        )
        return 1
    if rc:
        print(f"warning: ncu exited {rc}; parsing the report anyway", file=sys.stderr)
    exp = subprocess.run(
        [ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
        check=False,
        capture_output=True,
        text=True,
    )
    if exp.returncode:
        print(f"ncu --import failed ({exp.returncode}): {exp.stderr.strip()[:500]}", file=sys.stderr)
        return 1
    with open(os.path.join(a.out, "ncu_raw.csv"), "w") as f:
        f.write(exp.stdout)
    return write_tables(a.out, f"`{shlex.join(cmd)}`")


def write_tables(out: str, how: str) -> int:
    """Parse OUT/ncu_raw.csv with OUT/cases.json; write OUT/profile.md and OUT/profile.csv, print."""
    try:
        with open(os.path.join(out, "ncu_raw.csv")) as f, open(os.path.join(out, "cases.json")) as g:
            kernels, summary = parse(f.read(), json.load(g))
    except (ValueError, OSError) as e:  # a cut-short run, files of two runs, a damaged export
        print(f"cannot build the profile tables from {out}: {e}", file=sys.stderr)
        return 1
    import torch

    from benchmarks.ops import _markdown

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "(parsed without a GPU)"
    md = (
        f"Device {dev}; {time.strftime('%Y-%m-%d %H:%M')}; {how}\n\n"
        + (_markdown(kernels, list(kernels[0])) if kernels else "no kernels profiled\n")
        + "\n### Per case and backend\n\n"
        + (_markdown(summary, list(summary[0])) if summary else "")
    )
    try:
        with open(os.path.join(out, "profile.md"), "w") as f:
            f.write(md)
        with open(os.path.join(out, "profile.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(kernels[0]) if kernels else [])
            w.writeheader()
            w.writerows(kernels)
    except OSError as e:
        print(f"cannot write the profile tables: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
