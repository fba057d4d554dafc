"""Op benchmark: every op of every requested backend, and torch (cuBLAS / SDPA), at model shapes.

    python -m benchmarks.ops [--backends triton,cutile] [--models qwen3-0.6b-random,...]
                                  [--out DIR] [--ops OP,...] [--phases P,...] [--no-32k] [--precompile N]
                                  [--sweep [--sweep-families F,...] [--apply-sweep]]

For each model (registry names, conf/model): the cases of :mod:`benchmarks.cases` - the decode
step's ops (one token; attention after 1k, 8k and 32k cached positions), a 16-row verify step's
GEMVs and attention, and a 1,024-token prefill chunk's ops (plus prefill attention over 8,192
tokens, and the GEMMs of a 512-token chunk, the runner's default), with BF16 and INT8 weights and
KV caches. Random weights with the real shapes: speed does not depend on the values.

Timing: each op is captured ``n`` times into a CUDA graph, cycling over several argument sets whose
bytes exceed the 60 MB L2 (so the weights come from HBM, as in a real step), and the graph is
replayed; the median over replays of (replay time / n) is reported, so launch gaps are those of a
graph replay, as in the engine. Ops that cannot be captured are timed eagerly with CUDA events
(column ``graph`` False). Ceilings are measured in the same run: device-to-device copy of 1 GiB
(bytes read + written) and a bf16 8192^3 cuBLAS GEMM. Each row gets the achieved GB/s or TFLOP/s,
its fraction of the ceiling, and ``vs_torch`` = torch time / backend time (> 1: faster).

``--sweep`` first times the alternative configurations of each backend's kernel families on the
Qwen3-4B/8B shapes (:func:`sweep_families`: Triton's GEMV, GEMM and attention tiles, from which the
tables in tileinfer/ops/triton/tuning.py were chosen; cuTile's skinny-GEMM plans and prefill-attention
tiles), each passed to the op as its ``tile``/``plan`` or in its ``tuning``; ``--apply-sweep`` runs
the main table with a tuning holding the winners (:func:`tuned`). Each sweep config's output is
first compared with the reference backend's on the same inputs: a wrong one (non-finite, or past
the op tests' error bound) is logged as WRONG OUTPUT, not timed, and never chosen.
``--precompile N`` first compiles every kernel the run launches, sweep configurations included, in
N processes per backend through :mod:`benchmarks.aot` (compilation dominates a cold run otherwise);
the run then reports how many cuTile JIT compiles still happened (0 when the precompile predicted
every launch). Results: DIR/ops.parquet, DIR/ops.md, DIR/targets.md (and DIR/sweep.* with
--sweep), written with polars, or pyarrow where polars is missing.
"""

from __future__ import annotations

import argparse
import ast
import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from benchmarks.aot import BACKENDS as AOT_BACKENDS
from benchmarks.aot import Call, compile_calls
from benchmarks.cases import TARGET_MODELS, Case, model_cases
from tileinfer.core.errors import UserError
from tileinfer.core.registry import model_config
from tileinfer.ops import reference as ref
from tileinfer.ops import sm_count

L2_BYTES = 60 * 2**20
LINEAR_OPS = ("linear", "swiglu", "lm_head")


# ---------------------------------------------------------------------------- timing


def _median_graph_us(fn: Callable, sets: list, target_ms: float, reps: int) -> tuple[float, bool]:
    """Median µs per call of ``fn(args)`` cycling over ``sets``: CUDA-graph replay, else events."""
    for a in sets:  # warm-up: compile, allocate, create handles
        fn(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for a in sets:
        fn(a)
    e.record()
    e.synchronize()
    est_ms = max(s.elapsed_time(e) / len(sets), 1e-4)
    n = max(len(sets), min(400, int(target_ms / est_ms)))
    n = -(-n // len(sets)) * len(sets)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(sets[0])
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fn(sets[i % len(sets)])
        g.replay()
        g.replay()
        times = []
        for _ in range(reps):
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / n)
        del g
        return statistics.median(times), True
    except Exception:  # not capturable: eager, events around a batch of calls
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s.record()
            for i in range(n):
                fn(sets[i % len(sets)])
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / n)
        return statistics.median(times), False


def _eager_us(fn, reps: int = 10) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def measure_ceilings(dev, warm_s: float = 1.5) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM rate, measured now.

    Eager, one large operation per event pair (a memcpy captured in a graph can run on the copy
    engines, slower than the SM copy a kernel gets); after ``warm_s`` seconds of GEMMs so that the
    clocks have left their idle state. Called at the start and at the end of a run; the larger
    value of each is used.
    """
    a = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        a @ b
        torch.cuda.synchronize()
    t_mm = _eager_us(lambda a=a, b=b: a @ b)  # defaults, not closures: the del below frees them
    del a, b
    x = torch.empty(2**30, dtype=torch.uint8, device=dev).random_(0, 255)
    y = torch.empty_like(x)
    t_copy = _eager_us(lambda x=x, y=y: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return dict(copy_GBps=2 * 2**30 / t_copy / 1e3, gemm_TFLOPs=2 * 8192**3 / t_mm / 1e6)


def _arg_bytes(v) -> int:
    """Bytes of the tensors in one argument (weights, KV layers and plain tensors)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if hasattr(v, "scale") and hasattr(v, "q"):  # Int8Weight
        return _arg_bytes(v.q) + _arg_bytes(v.scale)
    if hasattr(v, "page_size"):  # KVLayer
        return sum(_arg_bytes(t) for t in (v.k, v.v, v.k_scale, v.v_scale) if t is not None)
    return 0


def _n_sets(args: dict) -> int:
    """Argument sets to rotate over so that together they are about 3x the L2 (at least 2)."""
    nb = sum(_arg_bytes(v) for v in args.values())
    return max(2, min(16, math.ceil(3 * L2_BYTES / max(nb, 1))))


# ---------------------------------------------------------------------------- tile sweeps


@dataclass(frozen=True)
class Family:
    """Alternative configurations of one kernel family of one backend, timed by ``--sweep``.

    A config runs by passing :meth:`keywords` to the op: the tile or plan ``make(cfg)`` builds, as
    the op's ``keyword`` argument, or (a family without ``make``) a tuning changed by ``tune(tuning,
    cfg)``. ``shapes_field``: the tuning field of per-shape entries, keyed as ``Case.tags["cfg_key"]``,
    where :func:`tuned` installs each shape's winner; a ``tune`` family's overall winner is installed
    for every shape; a family with neither is timed only.
    """

    backend: str
    name: str
    configs: list
    keep: Callable[[Case], bool]
    make: Callable[[object], object] | None = None
    keyword: str = "tile"
    shapes_field: str | None = None
    tune: Callable[[object, object], object] | None = None

    def keywords(self, cfg, tuning) -> dict:
        """The op keywords that run ``cfg`` on a backend whose tuning is ``tuning``."""
        if self.make is not None:
            return {self.keyword: self.make(cfg)}
        return {"tuning": self.tune(tuning, cfg)}


def tuned(tuning, winners: dict, backend: str):
    """``tuning`` with the sweep winners (:func:`sweep_winners`) of ``backend``'s families installed:
    each shape's winner into a per-shape family's field, the overall winner of a ``tune`` family."""
    for w in winners.values():
        fam = w["family"]
        if fam.backend != backend:
            continue
        if fam.shapes_field and w["by_key"]:
            entries = {k: fam.make(cfg) for k, cfg in w["by_key"].items()}
            tuning = replace(tuning, **{fam.shapes_field: {**getattr(tuning, fam.shapes_field), **entries}})
        elif fam.tune is not None:
            tuning = fam.tune(tuning, w["config"])
    return tuning


def sweep_families() -> list[Family]:
    """Every tile sweep: Triton's table entries (GEMV at 1 and 16 rows, GEMM, decode and prefill
    attention), cuTile's skinny-GEMM plans and prefill-attention tiles (128-row tiles with the
    default hints, 64-row tiles at two blocks per SM, 64-row tiles with the default hints)."""
    from tileinfer.ops.cutile.plan import SkinnyPlan
    from tileinfer.ops.triton.tuning import DecodeTile, GemmTile, GemvTile, PrefillTile, RowMode

    def linear(phase, variant):
        return lambda c: c.phase == phase and c.op in LINEAR_OPS and c.variant == variant

    def long_decode(c):
        return c.phase == "decode" and c.op == "attention" and c.tags["ctx"] >= 8192

    def prefill_attention(c):
        return c.phase == "prefill" and c.op == "attention"

    def gemv(field):
        return dict(make=lambda c: GemvTile(*c[:4], RowMode(c[4]) if len(c) > 4 else None), shapes_field=field)

    def gemm(field):
        return dict(make=lambda c: GemmTile(*c), shapes_field=field)

    def decode_tile(t, c):
        return replace(t, decode_tile=DecodeTile(*c), decode_tile_int8_long=DecodeTile(*c))

    def decode_programs(t, per_sm):
        return replace(t, decode_programs_per_sm=per_sm, decode_programs_per_sm_int8_long=per_sm)

    def prefill_tile(t, c):
        return replace(t, prefill_tile_large=PrefillTile(*c), prefill_tile_small=PrefillTile(*c))

    def cutile_prefill(t, c):
        rows, hints = c
        return replace(t, prefill_rows=rows, prefill_hints=tuple(sorted(hints.items())) if hints else ())

    gemv16 = [(32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4)]
    # one row through the 16-row tensor-core path (RowMode.DOT): fewer instructions a weight than FMAs
    gemv1_dot = [(16, 256, 4, 4, 3), (32, 256, 4, 4, 3), (32, 512, 4, 3, 3), (64, 128, 4, 4, 3), (64, 256, 8, 3, 3)]
    # INT8 weights: the swap-AB TMA kernel (BLOCK_M tokens x BLOCK_N weight rows; 64 rows a warpgroup).
    # Not 256 x 128 tiles: non-finite outputs on the plain 4B/8B shapes (h200-2026-12-01-int8-prefill-gemm.md)
    gemm_int8_cfgs = [
        (128, 256, 64, 8, 8, 3, "swap"),
        (128, 128, 64, 8, 8, 4, "swap"),
        (128, 128, 128, 8, 8, 3, "swap"),
        (256, 64, 64, 8, 8, 3, "swap"),
        (128, 64, 64, 8, 8, 4, "swap"),
        (256, 64, 64, 8, 4, 4, "swap"),
        (128, 64, 64, 8, 4, 4, "swap"),
        (128, 128, 64, 8, 8, 3, "ptr"),  # from int8_dequant_rows rows a non-swap tile runs on the widened weight
    ]
    gemm_cfgs = [
        (128, 128, 64, 8, 8, 3, "ptr"),
        (128, 128, 64, 8, 8, 4, "tma"),
        (128, 128, 64, 8, 8, 4, "tma_ws"),
        (128, 256, 64, 8, 8, 3, "tma"),
        (128, 256, 64, 8, 8, 3, "tma_ws"),
        (128, 64, 64, 8, 4, 4, "tma"),
        (256, 128, 64, 8, 8, 3, "ptr"),
        # stream-K: the same tiles, the k-steps split evenly over the SMs (no idle last wave)
        (128, 256, 64, 8, 8, 3, "streamk"),
        (128, 256, 64, 8, 8, 4, "streamk"),
        (128, 128, 64, 8, 8, 4, "streamk"),
        (128, 128, 64, 8, 4, 4, "streamk"),
    ]
    return [
        Family(
            "triton",
            "gemv1 bf16",
            [
                (4, 1024, 4, 1),
                (8, 512, 4, 1),
                (8, 1024, 4, 1),
                (4, 1024, 4, 3),
                (8, 512, 4, 3),
                (8, 512, 4, 4),
                (16, 512, 4, 3),
                *gemv1_dot,
            ],
            linear("decode", "bf16"),
            **gemv("gemv1_bf16_shapes"),
        ),
        Family(
            "triton",
            "gemv1 int8",
            [
                (4, 1024, 4, 1, 1),
                (8, 512, 4, 1, 1),
                (8, 1024, 4, 1, 1),
                (16, 512, 4, 1, 2),
                (4, 2048, 4, 1, 1),
                (8, 2048, 4, 1, 2),
                # RowMode.UNIT: int8 as biased floats, fewer instructions a weight in the loop
                (4, 1024, 4, 1, 4),
                (8, 512, 4, 1, 4),
                (8, 1024, 4, 1, 4),
                (32, 512, 8, 1, 4),
                # stages >= 2: the weight tiles pipelined through shared memory (cp.async)
                (16, 512, 4, 2, 2),
                (4, 1024, 4, 3, 1),
                (8, 1024, 4, 3, 1),
                (16, 512, 4, 3, 2),
                (4, 1024, 4, 3, 4),
                (8, 1024, 4, 3, 4),
                (8, 512, 4, 4, 4),
                (16, 512, 4, 3, 4),
                *gemv1_dot,
            ],
            linear("decode", "int8w"),
            **gemv("gemv1_int8_shapes"),
        ),
        Family("triton", "gemv16 bf16", gemv16, linear("verify", "bf16"), **gemv("gemv16_bf16_shapes")),
        Family("triton", "gemv16 int8", gemv16, linear("verify", "int8w"), **gemv("gemv16_int8_shapes")),
        Family("triton", "gemm bf16", gemm_cfgs, linear("prefill", "bf16"), **gemm("gemm_bf16_shapes")),
        Family("triton", "gemm int8", gemm_int8_cfgs, linear("prefill", "int8w"), **gemm("gemm_int8_shapes")),
        Family(
            "triton",
            "decode attn tile",
            [(64, 4, 2), (64, 4, 1), (128, 4, 3), (128, 4, 1)],
            long_decode,
            tune=decode_tile,
        ),
        # split-kernel programs per SM
        Family("triton", "decode attn programs", [2, 4, 6, 8], long_decode, tune=decode_programs),
        Family(
            "triton",
            "prefill attn tile",
            [(128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
            prefill_attention,
            tune=prefill_tile,
        ),
        # (TN, TK, S) of the tensor-core skinny product, timed only (there is no per-shape plan table)
        Family(
            "cutile",
            "cutile gemv plan",
            [(tn, tk, s) for tn in (64, 128) for tk in (64, 128, 256) for s in (1, 4)],
            lambda c: c.phase == "decode" and c.op == "linear" and c.variant == "bf16",
            make=lambda c: SkinnyPlan("mma", *c),
            keyword="plan",
        ),
        Family(
            "cutile",
            "cutile prefill attn",
            [(128, None), (64, {"occupancy": 2, "num_worker_warps": None}), (64, None)],
            prefill_attention,
            tune=cutile_prefill,
        ),
    ]


def select_families(names: str, backends) -> list[Family]:
    """The families of ``backends`` named in comma-separated ``names`` (all of them when empty)."""
    want = {f.strip() for f in names.split(",") if f.strip()}
    return [f for f in sweep_families() if f.backend in backends and (not want or f.name in want)]


def sweep_cases(fam: Family, models, long_ctx: bool = True) -> list[Case]:
    """The cases ``fam`` is timed on: its cases of ``models``, of which GEMV/GEMM families keep every
    weight of Qwen3-4B and only down and gate_up of the others (the shapes 4B does not have)."""
    cases = [c for name in models for c in model_cases(name, long_ctx) if fam.keep(c)]
    return [
        c
        for c in cases
        if c.op not in LINEAR_OPS or c.model == TARGET_MODELS[0] or c.tags.get("weight") in ("down", "gate_up")
    ]


# Relative error (Frobenius) past which a sweep config's output is wrong, by output dtype: the op
# tests' bounds (a kernel that drops or garbles a tile is off by O(1); NaN and inf always fail).
SWEEP_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def output_error(out, want) -> str:
    """Why a sweep config's output is not the reference's, or "" when it is: non-finite elements,
    or a relative error past :data:`SWEEP_TOL`. Outputs that are not floating tensors (token
    ids) are not checked. Seen: Triton swap-AB tiles of 256 tokens that left NaN or 3-7% errors
    while timing well (results/h200-2026-12-01-int8-prefill-gemm.md)."""
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and isinstance(want, torch.Tensor)):
        return ""
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return f"{bad} non-finite elements"
    err = float((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    tol = SWEEP_TOL.get(out.dtype, 1e-2)
    return f"relative error {err:.1e} > {tol:g}" if err > tol else ""


def run_sweep(
    models, backends: dict, ceil: dict, dev, budget_s: float, families: str = "", long_ctx: bool = True, log=print
) -> list[dict]:
    """Time every config of the selected families of ``backends`` ({name: module}) on their cases;
    one row per (case, config), as the main table's plus family, config, cfg_key (strings) and
    ``wrong``: each config's output is first compared with the reference backend's on the same
    inputs (:func:`output_error`); a wrong one is logged, not timed (``us`` NaN), and never wins."""
    rows = []
    t0 = time.perf_counter()
    for fam in select_families(families, backends):
        ops = backends[fam.backend]
        for c in sweep_cases(fam, models, long_ctx):
            if time.perf_counter() - t0 > budget_s:
                break
            try:
                a0 = c.make(dev)
                sets = [a0] + [c.make(dev) for _ in range(_n_sets(a0) - 1)]
                want = c.call(ref, a0)
            except torch.cuda.OutOfMemoryError:
                continue
            for cfg in fam.configs:
                try:
                    kw = fam.keywords(cfg, ops.tuning)
                    wrong = output_error(c.call(ops, a0, **kw), want)
                    us = math.nan if wrong else _median_graph_us(c.fn(ops, **kw), sets, 1.0, 5)[0]
                    r = _table_rows(c, fam.backend, us, True, ceil, None)
                    r.update(family=fam.name, config=str(cfg), cfg_key=str(c.tags.get("cfg_key")), wrong=wrong)
                    rows.append(r)
                    log(
                        f"sweep {fam.name:20s} {str(cfg):24s} {c.model:15s} {c.op:9s} {c.shape:26s} {c.variant:6s} "
                        + (
                            f"WRONG OUTPUT ({wrong}), not timed"
                            if wrong
                            else f"{us:9.2f} us {100 * r['frac_ceiling']:5.1f}%"
                        )
                    )
                except Exception as e:
                    log(f"sweep {fam.name} {cfg} {c.shape}: {type(e).__name__}: {str(e)[:300]}")
            del sets, a0
            torch.cuda.empty_cache()
    return rows


def sweep_winners(srows: list[dict]) -> dict:
    """Per family: the config with the lowest geometric-mean time over the family's cases (only
    cases every config finished), its score per config, and the per-shape winners (for the notes,
    and by cfg_key for ``--apply-sweep``). A config whose output was wrong on any case is out."""
    best = {}
    for fam in sweep_families():
        rs = [r for r in srows if r["family"] == fam.name]
        wrong = {r["config"] for r in rs if r.get("wrong")}
        rs = [r for r in rs if r["config"] not in wrong]
        configs = {str(cfg): cfg for cfg in fam.configs if str(cfg) not in wrong}

        def shape(r):
            return r["model"], r["shape"], r["variant"]

        full = {sh for sh in map(shape, rs) if len({r["config"] for r in rs if shape(r) == sh}) == len(configs)}
        if not full:
            continue
        score = {}
        for cs in configs:
            ts = [r["us"] for r in rs if r["config"] == cs and shape(r) in full]
            score[cs] = math.exp(sum(math.log(t) for t in ts) / len(ts))
        per_shape, by_key = {}, {}
        for sh in full:
            win = min((r for r in rs if shape(r) == sh), key=lambda r: r["us"])
            per_shape[sh] = win["config"]
            if win["cfg_key"] != "None":
                by_key[ast.literal_eval(win["cfg_key"])] = configs[win["config"]]
        best[fam.name] = dict(
            family=fam, config=configs[min(score, key=score.get)], score=score, per_shape=per_shape, by_key=by_key
        )
    return best


# ---------------------------------------------------------------------------- precompile


def _launch_case(c: Case, ops) -> None:
    c.call(ops, c.make("meta"))


def _launch_case_with(fam: Family, cfg, c: Case, ops) -> None:
    c.call(ops, c.make("meta"), **fam.keywords(cfg, ops.tuning))


def table_cases(models, long_ctx: bool, ops: str = "", phases: str = "") -> list[Case]:
    """The main table's cases of ``models``: only the comma-separated ``ops`` and ``phases`` if given."""
    cases = [c for name in models for c in model_cases(name, long_ctx)]
    if ops:
        cases = [c for c in cases if c.op in ops.split(",")]
    if phases:
        cases = [c for c in cases if c.phase in phases.split(",")]
    return cases


def bench_calls(
    backend: str, models, long_ctx: bool, sweep_models, families: str, ops: str = "", phases: str = ""
) -> list[Call]:
    """The run's launches as ahead-of-time calls (:mod:`benchmarks.aot`): every case of the
    main table (:func:`table_cases`), and every config of the selected sweep families of
    ``backend`` on their cases of ``sweep_models``."""

    def label(c):
        return f"{c.model} {c.phase} {c.op} {c.shape} {c.variant}"

    calls = [Call(label(c), functools.partial(_launch_case, c)) for c in table_cases(models, long_ctx, ops, phases)]
    for fam in select_families(families, (backend,)):
        for cfg in fam.configs:
            calls += [
                Call(f"{label(c)} {fam.name} {cfg}", functools.partial(_launch_case_with, fam, cfg, c))
                for c in sweep_cases(fam, sweep_models, long_ctx)
            ]
    return calls


def precompile(
    backends,
    models,
    jobs: int,
    long_ctx: bool,
    sweep_models,
    families: str,
    arch: str,
    sms: int,
    ops: str = "",
    phases: str = "",
) -> float:
    """Compile every kernel of :func:`bench_calls` for ``arch`` and ``sms`` SMs (the GPU the run
    times) in ``jobs`` processes per backend, so that the timed run finds them in the disk caches;
    print the failures. Returns seconds taken."""
    t0 = time.perf_counter()
    for backend in backends:
        args = (backend, models, long_ctx, sweep_models, families, ops, phases)
        recs = compile_calls(backend, bench_calls, args, arch, jobs, sms=sms)
        failed = [r for r in recs if r["error"]]
        print(f"precompile {backend}: {len(recs) - len(failed)} kernels for {arch}, {len(failed)} failed", flush=True)
        for r in failed:  # the timed run reports these cases again
            print(f"precompile {backend}: {r['kernel']} {r['variant']}: {r['error'][:300]}", flush=True)
    return time.perf_counter() - t0


def _count_cutile_compiles() -> list[int]:
    """Count tileiras runs from now on (cuTile's JIT runs it on a disk-cache miss only); returns a
    one-element list that holds the count."""
    import cuda.tile._compile as jit

    count, compile_cubin = [0], jit.compile_cubin

    def counting(*args, **kwargs):
        count[0] += 1
        return compile_cubin(*args, **kwargs)

    jit.compile_cubin = counting
    return count


# ---------------------------------------------------------------------------- run


def _table_rows(case: Case, backend: str, us: float, graph: bool, ceil: dict, torch_us) -> dict:
    if case.metric == "TFLOP/s":
        rate = case.flops / us / 1e6
        frac = rate / ceil["gemm_TFLOPs"]
    else:
        rate = case.nbytes / us / 1e3
        frac = rate / ceil["copy_GBps"]
    return dict(
        model=case.model,
        phase=case.phase,
        op=case.op,
        shape=case.shape,
        variant=case.variant,
        backend=backend,
        us=round(us, 2),
        rate=round(rate, 1),
        unit=case.metric,
        frac_ceiling=round(frac, 3),
        vs_torch=round(torch_us / us, 3) if torch_us else None,
        graph=graph,
    )


def run_cases(
    cases, backends: dict, ceil: dict, dev, budget_s: float, log=print, target_ms: float = 2.0, reps: int = 7
) -> list[dict]:
    rows = []
    t_start = time.perf_counter()
    for c in cases:
        if time.perf_counter() - t_start > budget_s:
            log(f"budget of {budget_s:.0f}s spent: skipping {c.model} {c.phase} {c.op} {c.shape}")
            continue
        try:
            a0 = c.make(dev)
            sets = [a0] + [c.make(dev) for _ in range(_n_sets(a0) - 1)]
        except torch.cuda.OutOfMemoryError:
            log(f"OOM building {c.model} {c.op} {c.shape}")
            continue
        results = {}
        for name, ops in backends.items():
            try:
                results[name] = _median_graph_us(c.fn(ops), sets, target_ms, reps)
            except Exception as e:
                log(f"{name} {c.model} {c.phase} {c.op} {c.shape} {c.variant}: {type(e).__name__}: {str(e)[:200]}")
        t_torch = results.get("torch", (None,))[0]
        for name, (us, graph) in results.items():
            rows.append(_table_rows(c, name, us, graph, ceil, t_torch))
            r = rows[-1]
            log(
                f"{r['model']:11s} {r['phase']:7s} {r['op']:21s} {r['shape']:28s} {r['variant']:6s} "
                f"{name:7s} {us:9.2f} us {r['rate']:8.1f} {r['unit']:7s} {100 * r['frac_ceiling']:5.1f}% "
                f"x{r['vs_torch'] if r['vs_torch'] else float('nan'):.2f}{'' if graph else ' (eager)'}"
            )
        del sets, a0
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- targets


def targets(rows: list[dict], backend: str) -> list[str]:
    """The project's speed targets, each met or missed and by how much."""
    idx = {(r["model"], r["phase"], r["op"], r["shape"], r["variant"], r["backend"]): r for r in rows}
    out = []

    def get(model, phase, op, shape, variant, be):
        return idx.get((model, phase, op, shape, variant, be))

    def line(name, value, goal, fmt="{:.2f}"):
        ok = value is not None and value >= goal
        v = "n/a" if value is None else fmt.format(value)
        out.append(f"| {name} | {v} | {fmt.format(goal)} | {'met' if ok else 'MISSED'} |")

    for r in rows:
        if r["backend"] != backend:
            continue
        if r["phase"] == "decode" and r["op"] in LINEAR_OPS and r["variant"] == "bf16" and r["model"] in TARGET_MODELS:
            line(f"{r['model']} GEMV {r['shape']}: fraction of copy bandwidth", r["frac_ceiling"], 0.85)
            line(f"{r['model']} GEMV {r['shape']}: x cuBLAS", r["vs_torch"], 1.1)
            q = get(r["model"], "decode", r["op"], r["shape"], "int8w", backend)
            if q:
                line(f"{r['model']} INT8 GEMV {r['shape']}: x BF16 GEMV", r["us"] / q["us"], 1.8)
        if (
            r["phase"] == "decode"
            and r["op"] == "attention"
            and r["model"] in TARGET_MODELS
            and r["shape"].split("ctx=")[-1] in ("8192", "32768")
        ):
            line(
                f"{r['model']} split-KV decode {r['shape']} {r['variant']}: fraction of copy BW",
                r["frac_ceiling"],
                0.75,
            )
        if r["phase"] == "prefill" and r["op"] in ("linear", "swiglu") and r["model"] == TARGET_MODELS[0]:
            if r["variant"] == "bf16":
                line(f"4B prefill GEMM {r['shape']}: x cuBLAS", r["vs_torch"], 0.95)
            else:
                b = get(r["model"], "prefill", r["op"], r["shape"], "bf16", backend)
                if b:
                    line(f"4B INT8 prefill GEMM {r['shape']}: x BF16", b["us"] / r["us"], 0.95)
        if r["phase"] == "prefill" and r["op"] == "attention" and "T=8192" in r["shape"]:
            line(f"{r['model']} prefill attention {r['shape']} {r['variant']}: x SDPA flash", r["vs_torch"], 0.9)
    return out


# ---------------------------------------------------------------------------- output


def _markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def save(rows: list[dict], out_dir: str, name: str, header: str = "") -> None:
    os.makedirs(out_dir, exist_ok=True)
    if not rows:
        return
    cols = list(rows[0].keys())
    try:
        import polars as pl

        df = pl.DataFrame(rows)
        df.write_parquet(os.path.join(out_dir, f"{name}.parquet"))
    except ImportError:  # the GPU machine has pyarrow but no polars
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out_dir, f"{name}.parquet"))
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(header + _markdown(rows, cols))


def main(argv=None) -> int:
    from tileinfer.ops import get_backend

    p = argparse.ArgumentParser(prog="python -m benchmarks.ops", description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,cutile")
    p.add_argument(
        "--models",
        default=",".join(("qwen3-0.6b-random", *TARGET_MODELS)),
        help="registry names (conf/model), comma-separated",
    )
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--sweep", action="store_true", help="time the tile alternatives of each backend first")
    p.add_argument("--sweep-budget", type=float, default=60.0, help="seconds for the sweep")
    p.add_argument(
        "--sweep-families",
        default="",
        help="only these sweep families (comma-separated): " + ", ".join(f.name for f in sweep_families()),
    )
    p.add_argument(
        "--apply-sweep",
        action="store_true",
        help="run the main table with each family's sweep winner (to copy into the table)",
    )
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the main table")
    p.add_argument(
        "--precompile",
        type=int,
        default=0,
        metavar="N",
        help="compile every kernel of the run in N processes per backend first",
    )
    p.add_argument("--no-32k", action="store_true", help="skip the 32k-context decode attention")
    p.add_argument("--ops", default="", help="only these ops (comma-separated)")
    p.add_argument("--phases", default="", help="only these phases (comma-separated: decode, verify, prefill)")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    try:
        for m in models:
            model_config(m)
    except UserError as e:
        print(f"--models: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: the ops benchmark needs a GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    sweep_models = [m for m in models if m in TARGET_MODELS] if a.sweep else []
    t0 = time.perf_counter()
    backends: dict = {}
    for name in [b for b in a.backends.split(",") if b]:
        try:
            backends[name] = get_backend(name)
        except Exception as e:
            print(f"backend {name} skipped: {e}")
    if a.precompile:
        major, minor = torch.cuda.get_device_capability()
        secs = precompile(
            [b for b in backends if b in AOT_BACKENDS],
            models,
            a.precompile,
            not a.no_32k,
            sweep_models,
            a.sweep_families,
            f"sm_{major}{minor}",
            sm_count(torch.device("cuda")),
            a.ops,
            a.phases,
        )
        print(f"precompiled in {secs:.1f}s", flush=True)
    jit_compiles = _count_cutile_compiles() if "cutile" in backends else None
    backends["torch"] = "torch"
    torch.manual_seed(0)
    ceil = measure_ceilings(dev)
    ceil0 = dict(ceil)
    print(
        f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read+write), bf16 GEMM {ceil['gemm_TFLOPs']:.0f} "
        f"TFLOP/s; device {torch.cuda.get_device_name()}",
        flush=True,
    )
    header = (
        f"Device {torch.cuda.get_device_name()}; ceilings measured in this run: copy "
        f"{ceil['copy_GBps']:.0f} GB/s (read+write), bf16 GEMM 8192^3 {ceil['gemm_TFLOPs']:.0f} TFLOP/s.\n\n"
    )
    if sweep_models:
        srows = run_sweep(sweep_models, backends, ceil, dev, a.sweep_budget, a.sweep_families, not a.no_32k)
        save(srows, a.out, "sweep", header)
        for fam, w in sweep_winners(srows).items():
            print(
                f"sweep winner {fam:20s} {w['config']}  (geomean us: "
                + ", ".join(f"{c}={v:.1f}" for c, v in sorted(w["score"].items(), key=lambda kv: kv[1]))
                + ")"
            )
            for sh, cfg in sorted(w["per_shape"].items()):
                print(f"    best for {' '.join(sh)}: {cfg}")
        if a.apply_sweep:  # per-shape winners into the shape tables; a tuning family's winner everywhere
            winners = sweep_winners(srows)
            for name, backend in backends.items():
                if name != "torch" and backend.tuning is not None:
                    backends[name] = get_backend(name, tuned(backend.tuning, winners, name))
                    print(f"    applied to {name}: {backends[name].tuning}")
        sys.stdout.flush()
    cases = table_cases(models, not a.no_32k, a.ops, a.phases)
    rows = run_cases(cases, backends, ceil, dev, a.budget)
    ceil1 = measure_ceilings(dev, warm_s=0.2)
    print(f"ceilings at the end: copy {ceil1['copy_GBps']:.0f} GB/s, GEMM {ceil1['gemm_TFLOPs']:.0f} TFLOP/s")
    if ceil1["copy_GBps"] > ceil["copy_GBps"] * 1.01 or ceil1["gemm_TFLOPs"] > ceil["gemm_TFLOPs"] * 1.01:
        ceil = {k: max(ceil[k], ceil1[k]) for k in ceil}  # re-derive the fractions against the larger
        for r in rows:
            if r["unit"] == "TFLOP/s":
                r["frac_ceiling"] = round(r["rate"] / ceil["gemm_TFLOPs"], 3)
            else:
                r["frac_ceiling"] = round(r["rate"] / ceil["copy_GBps"], 3)
    header = (
        f"Device {torch.cuda.get_device_name()}; ceilings measured in this run (max of start/end): "
        f"copy {ceil['copy_GBps']:.0f} GB/s (read+write; start {ceil0['copy_GBps']:.0f}, end "
        f"{ceil1['copy_GBps']:.0f}), bf16 GEMM 8192^3 {ceil['gemm_TFLOPs']:.0f} TFLOP/s (start "
        f"{ceil0['gemm_TFLOPs']:.0f}, end {ceil1['gemm_TFLOPs']:.0f}).\n\n"
    )
    tl = []
    for name in backends:
        if name != "torch":
            tl += [f"\n### Targets: {name}\n", "| target | value | goal | |", "|---|---|---|---|"]
            tl += targets(rows, name)
    save(rows, a.out, "ops", header)
    with open(os.path.join(a.out, "targets.md"), "w") as f:
        f.write(header + "\n".join(tl) + "\n")
    print("\n".join(tl))
    if jit_compiles is not None:
        print(f"cuTile JIT compiles during the run: {jit_compiles[0]}")
    print(f"benchmark done in {time.perf_counter() - t0:.0f}s; tables in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
