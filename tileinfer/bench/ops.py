"""Ops benchmark: every op of every requested backend, and torch (cuBLAS / SDPA), at model shapes.

    python -m tileinfer.bench.ops [--backends triton,cutile] [--models qwen3-0.6b,qwen3-4b,qwen3-8b]
                                  [--out DIR] [--sweep] [--precompile N]

For each model: the decode step's ops (one token; attention after 1k, 8k and 32k cached positions),
a 16-row verify step's GEMVs and attention, and a 1,024-token prefill chunk's ops (plus prefill
attention over 8,192 tokens), with BF16 and INT8 weights and KV caches. Random weights with the
real shapes: speed does not depend on the values.

Timing (METHOD.md): each op is captured ``n`` times into a CUDA graph, cycling over several argument
sets whose bytes exceed the 60 MB L2 (so the weights come from HBM, as in a real step), and the
graph is replayed; the median over replays of (replay time / n) is reported, so launch gaps are
those of a graph replay, as in the engine. Ops that cannot be captured are timed eagerly with CUDA
events (column ``graph`` False). Ceilings are measured in the same run: device-to-device copy of
1 GiB (bytes read + written) and a bf16 8192^3 cuBLAS GEMM. Each row gets the achieved GB/s or
TFLOP/s, its fraction of the ceiling, and ``vs_torch`` = torch time / backend time (> 1: faster).

``--sweep`` first times alternative tile configurations of the Triton kernels (the table in
tileinfer/ops/triton/*.py was chosen this way). ``--precompile N`` compiles the Triton kernels in N
processes first (compilation dominates a cold run otherwise). Results: DIR/ops.parquet, DIR/ops.md
(and DIR/sweep.* with --sweep), written with polars, or pyarrow/pandas where polars is missing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from tileinfer.bench import MODELS, ModelShape

L2_BYTES = 60 * 2**20
PAGE = 64


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
    t_mm = _eager_us(lambda: a @ b)
    del a, b
    x = torch.empty(2**30, dtype=torch.uint8, device=dev).random_(0, 255)
    y = torch.empty_like(x)
    t_copy = _eager_us(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return dict(copy_GBps=2 * 2**30 / t_copy / 1e3, gemm_TFLOPs=2 * 8192**3 / t_mm / 1e6)


# ---------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One op at one shape. ``make(device)`` builds an argument set (a dict)."""

    model: str
    phase: str  # decode / verify / prefill
    op: str
    shape: str
    variant: str  # bf16 / int8w / int8kv ...
    make: Callable[[str], dict]
    call: Callable  # call(ops, args)
    torch_call: Callable | None  # torch_call(args)
    nbytes: int = 0
    flops: int = 0
    tags: dict = field(default_factory=dict)

    def fn(self, ops) -> Callable:
        """The op as ``fn(args)``: through a backend module, or torch's path when ``ops == "torch"``."""
        return self.torch_call if ops == "torch" else (lambda a: self.call(ops, a))

    @property
    def metric(self) -> str:
        return "TFLOP/s" if self.flops and self.phase == "prefill" and self.op in (
            "linear", "swiglu", "attention") else "GB/s"


def _rand_w(n, k, dev, int8):
    from tileinfer.ops import Int8Weight

    if int8:
        return Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev),
                          torch.rand(n, device=dev) * 1e-3 + 1e-4)
    return torch.randn(n, k, device=dev).to(torch.bfloat16) * k**-0.5


def _wbytes(n, k, int8):
    return n * k * (1 if int8 else 2) + (4 * n if int8 else 0)


def _torch_linear(a):
    from tileinfer.ops import Int8Weight

    w = a["w"]
    if isinstance(w, Int8Weight):  # the torch path for weight-only INT8: dequantize, cuBLAS, scale
        return (F.linear(a["x"], w.q.to(a["x"].dtype)).float() * w.scale).to(a["x"].dtype)
    return F.linear(a["x"], w, a.get("b"))


def _torch_swiglu(a):
    from tileinfer.ops import reference

    return reference.swiglu(a["x"], a["w"])


def _torch_lm_head(a):
    from tileinfer.ops import Int8Weight

    w = a["w"]
    if isinstance(w, Int8Weight):
        return F.linear(a["x"], w.q.to(a["x"].dtype)).float() * w.scale
    try:  # cuBLAS bf16 product with float32 output
        return torch.mm(a["x"], w.t(), out_dtype=torch.float32)
    except Exception:
        return F.linear(a["x"], w).float()


def linear_cases(m: ModelShape, phase: str, T: int, dev_hint="cuda") -> list[Case]:
    """GEMV (T <= 16) or GEMM cases of one model: qkv, o, gate_up (SwiGLU), down, lm_head."""
    out = []
    shapes = [("qkv", m.qkv_out, m.hidden, "linear"), ("o", m.hidden, m.heads * m.head_dim, "linear"),
              ("gate_up", 2 * m.inter, m.hidden, "swiglu"), ("down", m.hidden, m.inter, "linear")]
    if phase == "prefill" and m.name == "qwen3-4b":  # the gate/up GEMM without the SwiGLU epilogue
        shapes.append(("gate_up_plain", 2 * m.inter, m.hidden, "linear"))
    if phase == "decode":
        shapes.append(("lm_head", m.vocab, m.hidden, "lm_head"))
    for int8 in (False, True):
        for name, n, k, op in shapes:
            def make(dev, n=n, k=k, int8=int8, T=T, name=name):
                a = dict(x=torch.randn(T, k, device=dev).to(torch.bfloat16), w=_rand_w(n, k, dev, int8))
                if name == "qkv" and m.qkv_bias:
                    a["b"] = torch.randn(n, device=dev).to(torch.bfloat16)
                return a
            call = {"linear": lambda ops, a: ops.linear(a["x"], a["w"], a.get("b")),
                    "swiglu": lambda ops, a: ops.swiglu(a["x"], a["w"]),
                    "lm_head": lambda ops, a: ops.lm_head(a["x"], a["w"])}[op]
            tcall = {"linear": _torch_linear, "swiglu": _torch_swiglu, "lm_head": _torch_lm_head}[op]
            n_out = n // 2 if op == "swiglu" else n
            obytes = T * n_out * (4 if op == "lm_head" else 2)
            # the key the backend's tile table uses for this shape (GEMV: weight rows, K; GEMM: M, N, K)
            cfg_key = (n, k) if T <= 16 else (T, n_out, k)
            out.append(Case(m.name, phase, op, f"{name} {T}x{k}->{n}", "int8w" if int8 else "bf16",
                            make, call, tcall, nbytes=_wbytes(n, k, int8) + 2 * T * k + obytes,
                            flops=2 * T * n * k, tags=dict(weight=name, n=n, k=k, T=T, cfg_key=cfg_key)))
    return out


def _kv(m: ModelShape, L: int, int8: bool, dev, extra_pages: int = 0):
    """A one-layer page pool holding L random positions, pages scattered, and its block table."""
    from tileinfer.core.kv_cache import PagedKVCache

    n_pages = -(-L // PAGE) + extra_pages
    kv = PagedKVCache(1, n_pages, PAGE, m.kv_heads, m.head_dim, torch.bfloat16, int8, dev)
    if int8:
        kv.k.random_(-127, 128)
        kv.v.random_(-127, 128)
        kv.k_scale.uniform_(0.005, 0.02)
        kv.v_scale.uniform_(0.005, 0.02)
    else:
        kv.k.normal_()
        kv.v.normal_()
    bt = torch.randperm(n_pages, device=dev).to(torch.int32)
    return kv.layers[0], bt


def _kv_bytes(m: ModelShape, L: int, int8: bool) -> int:
    per = m.kv_heads * m.head_dim * (1 if int8 else 2) + (m.kv_heads * 4 if int8 else 0)
    return 2 * L * per


def _sdpa(a):
    """torch's path: SDPA over a contiguous cache (flash for prefill; GQA without copies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if a.get("flash"):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a["tq"], a["tk"], a["tv"], is_causal=True)
    return F.scaled_dot_product_attention(a["tq"], a["tk"], a["tv"], enable_gqa=True)


def attention_cases(m: ModelShape, phase: str, T: int, contexts) -> list[Case]:
    out = []
    for L in contexts:
        for int8 in (False, True):
            def make(dev, L=L, int8=int8, T=T):
                layer, bt = _kv(m, L, int8, dev)
                a = dict(q=torch.randn(T, m.heads, m.head_dim, device=dev).to(torch.bfloat16),
                         layer=layer, bt=bt,
                         pos=torch.arange(L - T, L, dtype=torch.int32, device=dev))
                if dev != "meta":  # torch's inputs: contiguous [1, heads, L, d]
                    kvh = m.kv_heads if phase != "prefill" else m.heads
                    a["tq"] = a["q"].transpose(0, 1)[None]
                    a["tk"] = torch.randn(1, kvh, L, m.head_dim, device=dev).to(torch.bfloat16)
                    a["tv"] = torch.randn(1, kvh, L, m.head_dim, device=dev).to(torch.bfloat16)
                    a["flash"] = phase == "prefill"
                return a
            causal = T * (L - T) + T * (T + 1) // 2  # visible (query, key) pairs
            out.append(Case(m.name, phase, "attention", f"T={T} ctx={L}", "int8kv" if int8 else "bf16",
                            make, lambda ops, a: ops.attention(a["q"], a["layer"], a["bt"], a["pos"],
                                                               m.head_dim ** -0.5),
                            _sdpa, nbytes=_kv_bytes(m, L, int8), flops=4 * causal * m.heads * m.head_dim,
                            tags=dict(ctx=L, T=T)))
    return out


def small_cases(m: ModelShape, phase: str, T: int) -> list[Case]:
    from tileinfer.ops import reference

    bf = torch.bfloat16
    H, d = m.hidden, m.head_dim
    out = [
        Case(m.name, phase, "embedding", f"T={T} H={H}", "bf16",
             lambda dev: dict(ids=torch.randint(0, m.vocab, (T,), device=dev),
                              table=torch.randn(m.vocab, H, device=dev).to(bf)),
             lambda ops, a: ops.embedding(a["ids"], a["table"]),
             lambda a: F.embedding(a["ids"], a["table"]), nbytes=2 * 2 * T * H),
        Case(m.name, phase, "rms_norm", f"T={T} H={H}", "bf16",
             lambda dev: dict(x=torch.randn(T, H, device=dev).to(bf), w=torch.randn(H, device=dev).to(bf)),
             lambda ops, a: ops.rms_norm(a["x"], a["w"], 1e-6),
             lambda a: F.rms_norm(a["x"], (H,), a["w"], 1e-6), nbytes=2 * 2 * T * H),
        Case(m.name, phase, "add_rms_norm", f"T={T} H={H}", "bf16",
             lambda dev: dict(x=torch.randn(T, H, device=dev).to(bf), r=torch.randn(T, H, device=dev).to(bf),
                              w=torch.randn(H, device=dev).to(bf)),
             lambda ops, a: ops.add_rms_norm(a["x"], a["r"], a["w"], 1e-6),
             lambda a: (lambda s: (F.rms_norm(s, (H,), a["w"], 1e-6), s))(a["x"] + a["r"]),
             nbytes=4 * 2 * T * H),
    ]
    for int8 in (False, True):
        def make(dev, int8=int8):
            L = 4096
            layer, bt = _kv(m, L, int8, dev)
            qkv = torch.randn(T, m.qkv_out, device=dev).to(bf)
            q, k, v = qkv.split([m.heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
            ang = torch.rand(L, d // 2, device=dev)
            return dict(q=q.view(T, m.heads, d), k=k.view(T, m.kv_heads, d), v=v.view(T, m.kv_heads, d),
                        qn=torch.randn(d, device=dev).to(bf) if m.qk_norm else None,
                        kn=torch.randn(d, device=dev).to(bf) if m.qk_norm else None,
                        cos=ang.cos(), sin=ang.sin(), layer=layer, bt=bt,
                        pos=torch.arange(L - T - 7, L - 7, dtype=torch.int32, device=dev))
        call = lambda ops, a: ops.qk_norm_rope_kv_write(a["q"], a["k"], a["v"], a["qn"], a["kn"], 1e-6,  # noqa: E731
                                                         a["cos"], a["sin"], a["layer"], a["bt"], a["pos"])
        out.append(Case(m.name, phase, "qk_norm_rope_kv_write", f"T={T}", "int8kv" if int8 else "bf16",
                        make, call, lambda a: call(reference, a),
                        nbytes=2 * T * (m.qkv_out + m.heads * d) + T * _kv_bytes(m, 1, int8)))
    if phase == "decode":
        def mk(dev):
            return dict(x=torch.randn(T, m.vocab, device=dev) * 3)
        out.append(Case(m.name, phase, "argmax", f"T={T} V={m.vocab}", "f32", mk,
                        lambda ops, a: ops.argmax(a["x"]), lambda a: a["x"].argmax(-1),
                        nbytes=4 * T * m.vocab))
        out.append(Case(m.name, phase, "sample", f"T={T} V={m.vocab} t=0.7 k=20 p=0.95", "f32", mk,
                        lambda ops, a: ops.sample(a["x"], 0.7, 20, 0.95, None),
                        lambda a: reference.sample(a["x"], 0.7, 20, 0.95, None),
                        nbytes=4 * T * m.vocab))
        # top-p alone on flat random logits: a nucleus of thousands of tokens (the slow exact path)
        out.append(Case(m.name, phase, "sample", f"T={T} V={m.vocab} t=1 k=0 p=0.9 flat", "f32", mk,
                        lambda ops, a: ops.sample(a["x"], 1.0, 0, 0.9, None),
                        lambda a: reference.sample(a["x"], 1.0, 0, 0.9, None),
                        nbytes=4 * T * m.vocab))
    return out


def model_cases(m: ModelShape, long_ctx: bool = True) -> list[Case]:
    cs = []
    cs += small_cases(m, "decode", 1)
    cs += linear_cases(m, "decode", 1)
    cs += attention_cases(m, "decode", 1, [1024, 8192, 32768] if long_ctx else [1024, 8192])
    cs += linear_cases(m, "verify", 16)
    cs += attention_cases(m, "verify", 16, [8192])
    cs += small_cases(m, "prefill", 1024)
    cs += linear_cases(m, "prefill", 1024)
    cs += attention_cases(m, "prefill", 1024, [1024])
    cs += attention_cases(m, "prefill", 8192, [8192])
    return cs


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


# ---------------------------------------------------------------------------- sweep (triton)


def sweep_specs():
    """(kernel family, module, override key, configs, case filter) for the Triton tile sweep."""
    dec = lambda v: (lambda c: c.phase == "decode" and c.op in ("linear", "swiglu", "lm_head")  # noqa: E731
                     and c.variant == v)
    ver = lambda v: (lambda c: c.phase == "verify" and c.op in ("linear", "swiglu") and c.variant == v)  # noqa: E731
    pre = lambda v: (lambda c: c.phase == "prefill" and c.op in ("linear", "swiglu") and c.variant == v)  # noqa: E731
    gemm_cfgs = [(128, 128, 64, 8, 8, 3, "ptr"), (128, 128, 64, 8, 8, 4, "tma"),
                 (128, 128, 64, 8, 8, 4, "tma_ws"), (128, 256, 64, 8, 8, 3, "tma"),
                 (128, 256, 64, 8, 8, 3, "tma_ws"), (128, 64, 64, 8, 4, 4, "tma"),
                 (256, 128, 64, 8, 8, 3, "ptr")]
    return [
        ("gemv1 bf16", "gemm", "gemv1_bf16", [(4, 1024, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1)],
         dec("bf16")),
        ("gemv1 int8", "gemm", "gemv1_int8",
         [(8, 1024, 4, 1, 1), (16, 512, 4, 1, 1), (16, 1024, 4, 1, 1), (32, 256, 4, 1, 1),
          (32, 512, 8, 1, 1), (16, 512, 4, 2, 2), (16, 512, 4, 1, 2), (16, 1024, 8, 1, 2),
          (32, 512, 8, 1, 2), (16, 2048, 8, 1, 1), (8, 2048, 4, 1, 2), (4, 2048, 4, 1, 1),
          (4, 1024, 4, 1, 1), (4, 2048, 4, 1, 2), (8, 512, 4, 1, 1)], dec("int8w")),
        ("gemv16 bf16", "gemm", "gemv16_bf16", [(32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4)],
         ver("bf16")),
        ("gemv16 int8", "gemm", "gemv16_int8", [(32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4)],
         ver("int8w")),
        ("gemm bf16", "gemm", "gemm_bf16", gemm_cfgs, pre("bf16")),
        ("gemm int8", "gemm", "gemm_int8", gemm_cfgs, pre("int8w")),
        ("decode attn tile", "paged_attention", "decode_tile", [(64, 4, 2), (64, 4, 1), (128, 4, 3), (128, 4, 1)],
         lambda c: c.phase == "decode" and c.op == "attention" and c.tags["ctx"] >= 8192),
        ("decode attn programs", "paged_attention", "programs", [264, 528, 1056],
         lambda c: c.phase == "decode" and c.op == "attention" and c.tags["ctx"] >= 8192),
        ("prefill attn tile", "paged_attention", "prefill_tile",
         [(128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
         lambda c: c.phase == "prefill" and c.op == "attention"),
    ]


PER_SHAPE = ("gemv1_bf16", "gemv1_int8", "gemv16_bf16", "gemv16_int8", "gemm_bf16", "gemm_int8")


# ---------------------------------------------------------------------------- precompile


def _precompile_worker(args):
    """Compile (no launch) the Triton kernels of some cases, for the current GPU, into the cache."""
    model_names, sweep_idx, sweep_cfg, long_ctx, cap = args
    import importlib

    from triton.backends.compiler import GPUTarget

    from tileinfer.bench import aot_triton as aot

    ops = importlib.import_module("tileinfer.ops.triton")
    mod = key = None
    n, errors = 0, []
    with aot.compiling(GPUTarget("cuda", cap, 32)):
        if sweep_idx is not None:
            _, modname, key, _, filt = sweep_specs()[sweep_idx]
            mod = importlib.import_module(f"tileinfer.ops.triton.{modname}")
            mod._OVERRIDE[key] = sweep_cfg
        for name in model_names:
            for c in model_cases(MODELS[name], long_ctx):
                if sweep_idx is not None and not filt(c):
                    continue
                try:
                    c.call(ops, c.make("meta"))
                    n += 1
                except Exception as e:  # reported; the timed run reports it again
                    errors.append(f"{c.model} {c.op} {c.shape} {c.variant} {sweep_cfg}: "
                                  f"{type(e).__name__}: {str(e)[:300]}")
    if mod is not None:
        mod._OVERRIDE.pop(key, None)
    return n, errors


def _families(names: str) -> list[int]:
    specs = sweep_specs()
    want = [f.strip() for f in names.split(",") if f.strip()]
    return [i for i, sp in enumerate(specs) if not want or sp[0] in want]


def precompile(models, nproc: int, sweep: bool, long_ctx: bool, cap: int = 90,
               families: str = "") -> float:
    """Compile, in ``nproc`` processes, every Triton kernel the benchmark will launch (cap: sm_XY)."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    jobs = [([m], None, None, long_ctx, cap) for m in models]
    if sweep:
        for i, (_, _, _, cfgs, _) in enumerate(sweep_specs()):
            if i not in _families(families):
                continue
            for cfg in cfgs:
                jobs.append((["qwen3-4b", "qwen3-8b"], i, cfg, long_ctx, cap))
    ctx = mp.get_context("spawn")
    with ctx.Pool(nproc) as pool:
        for _, errors in pool.imap_unordered(_precompile_worker, jobs):
            for e in errors:
                print("precompile:", e, flush=True)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- run


def _table_rows(case: Case, backend: str, us: float, graph: bool, ceil: dict, torch_us) -> dict:
    if case.metric == "TFLOP/s":
        rate = case.flops / us / 1e6
        frac = rate / ceil["gemm_TFLOPs"]
    else:
        rate = case.nbytes / us / 1e3
        frac = rate / ceil["copy_GBps"]
    return dict(model=case.model, phase=case.phase, op=case.op, shape=case.shape, variant=case.variant,
                backend=backend, us=round(us, 2), rate=round(rate, 1), unit=case.metric,
                frac_ceiling=round(frac, 3),
                vs_torch=round(torch_us / us, 3) if torch_us else None, graph=graph)


def run_cases(cases, backends: dict, ceil: dict, dev, budget_s: float, log=print,
              target_ms: float = 2.0, reps: int = 7) -> list[dict]:
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
            log(f"{r['model']:11s} {r['phase']:7s} {r['op']:21s} {r['shape']:28s} {r['variant']:6s} "
                f"{name:7s} {us:9.2f} us {r['rate']:8.1f} {r['unit']:7s} {100 * r['frac_ceiling']:5.1f}% "
                f"x{r['vs_torch'] if r['vs_torch'] else float('nan'):.2f}{'' if graph else ' (eager)'}")
        del sets, a0
        torch.cuda.empty_cache()
    return rows


_CFG: dict = {}  # config string -> config (the sweep's rows hold strings)
_KEY: dict = {}


def sweep_winners(srows: list[dict]) -> dict:
    """Per family: the config with the lowest geometric-mean time over the family's cases
    (only cases every config finished), and the per-shape winners for the notes."""
    best = {}
    for fam, modname, key, cfgs, _ in sweep_specs():
        rs = [r for r in srows if r["family"] == fam]
        shapes = {(r["model"], r["shape"], r["variant"]) for r in rs}
        full = [sh for sh in shapes if len({r["config"] for r in rs if (r["model"], r["shape"], r["variant"]) == sh}) == len(cfgs)]
        if not full:
            continue
        score = {}
        for cfg in cfgs:
            ts = [r["us"] for r in rs if r["config"] == str(cfg) and (r["model"], r["shape"], r["variant"]) in full]
            score[cfg] = math.exp(sum(math.log(t) for t in ts) / len(ts))
        win = min(score, key=score.get)
        per_shape, by_key = {}, {}
        for sh in full:
            cand = [r for r in rs if (r["model"], r["shape"], r["variant"]) == sh]
            bestr = min(cand, key=lambda r: r["us"])
            per_shape[sh] = bestr["config"]
            if bestr.get("cfg_key") in _KEY and _KEY[bestr["cfg_key"]] is not None:
                by_key[_KEY[bestr["cfg_key"]]] = _CFG.get(bestr["config"], bestr["config"])
        best[fam] = dict(module=modname, key=key, config=win, score=score, per_shape=per_shape,
                         by_key=by_key)
    return best


def run_sweep(models, ceil, dev, budget_s, log=print, families: str = "") -> list[dict]:
    import importlib

    import tileinfer.ops.triton as ops

    rows = []
    t0 = time.perf_counter()
    keep = _families(families)
    for i, (fam, modname, key, cfgs, filt) in enumerate(sweep_specs()):
        if i not in keep:
            continue
        mod = importlib.import_module(f"tileinfer.ops.triton.{modname}")
        cases = [c for name in models for c in model_cases(MODELS[name]) if filt(c)]
        if fam.startswith("gemv") or fam.startswith("gemm"):  # 4B all weights, 8B only its own shapes
            cases = [c for c in cases if c.model == "qwen3-4b" or c.tags.get("weight") in ("down", "gate_up")]
        for c in cases:
            if time.perf_counter() - t0 > budget_s:
                break
            try:
                a0 = c.make(dev)
                sets = [a0] + [c.make(dev) for _ in range(_n_sets(a0) - 1)]
            except torch.cuda.OutOfMemoryError:
                continue
            for cfg in cfgs:
                mod._OVERRIDE[key] = cfg
                try:
                    us, _ = _median_graph_us(c.fn(ops), sets, 1.0, 5)
                    r = _table_rows(c, "triton", us, True, ceil, None)
                    r.update(family=fam, config=str(cfg), cfg_key=str(c.tags.get("cfg_key")))
                    _CFG[str(cfg)] = cfg
                    _KEY[str(c.tags.get("cfg_key"))] = c.tags.get("cfg_key")
                    rows.append(r)
                    log(f"sweep {fam:20s} {str(cfg):24s} {c.model:9s} {c.op:9s} {c.shape:26s} {c.variant:6s} "
                        f"{us:9.2f} us {100 * r['frac_ceiling']:5.1f}%")
                except Exception as e:
                    log(f"sweep {fam} {cfg} {c.shape}: {type(e).__name__}: {str(e)[:300]}")
                finally:
                    mod._OVERRIDE.pop(key, None)
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
        if r["phase"] == "decode" and r["op"] in ("linear", "swiglu", "lm_head") and r["variant"] == "bf16" \
                and r["model"] in ("qwen3-4b", "qwen3-8b"):
            line(f"{r['model']} GEMV {r['shape']}: fraction of copy bandwidth", r["frac_ceiling"], 0.85)
            line(f"{r['model']} GEMV {r['shape']}: x cuBLAS", r["vs_torch"], 1.1)
            q = get(r["model"], "decode", r["op"], r["shape"], "int8w", backend)
            if q:
                line(f"{r['model']} INT8 GEMV {r['shape']}: x BF16 GEMV", r["us"] / q["us"], 1.8)
        if r["phase"] == "decode" and r["op"] == "attention" and r["model"] in ("qwen3-4b", "qwen3-8b") \
                and r["shape"].split("ctx=")[-1] in ("8192", "32768"):
            line(f"{r['model']} split-KV decode {r['shape']} {r['variant']}: fraction of copy BW",
                 r["frac_ceiling"], 0.75)
        if r["phase"] == "prefill" and r["op"] in ("linear", "swiglu") and r["model"] == "qwen3-4b":
            if r["variant"] == "bf16":
                line(f"4B prefill GEMM {r['shape']}: x cuBLAS", r["vs_torch"], 0.95)
            else:
                b = get(r["model"], "prefill", r["op"], r["shape"], "bf16", backend)
                if b:
                    line(f"4B INT8 prefill GEMM {r['shape']}: x BF16", b["us"] / r["us"], 0.95)
        if r["phase"] == "prefill" and r["op"] == "attention" and "T=8192" in r["shape"]:
            line(f"{r['model']} prefill attention {r['shape']} {r['variant']}: x SDPA flash",
                 r["vs_torch"], 0.9)
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

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,cutile")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--sweep", action="store_true", help="time the Triton tile alternatives first")
    p.add_argument("--sweep-budget", type=float, default=60.0, help="seconds for the sweep")
    p.add_argument("--sweep-families", default="", help="only these sweep families (comma-separated)")
    p.add_argument("--apply-sweep", action="store_true",
                   help="run the main table with each family's sweep winner (to copy into the table)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the main table")
    p.add_argument("--precompile", type=int, default=0, help="compile Triton kernels in N processes first")
    p.add_argument("--no-32k", action="store_true", help="skip the 32k-context decode attention")
    p.add_argument("--ops", default="", help="only these ops (comma-separated)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the ops benchmark needs a GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    models = [m for m in a.models.split(",") if m]
    t0 = time.perf_counter()
    backends: dict = {}
    for name in [b for b in a.backends.split(",") if b]:
        try:
            backends[name] = get_backend(name)
        except Exception as e:
            print(f"backend {name} skipped: {e}")
    backends["torch"] = "torch"
    if a.precompile and "triton" in backends:
        major, minor = torch.cuda.get_device_capability()
        secs = precompile(models, a.precompile, a.sweep, not a.no_32k, major * 10 + minor, a.sweep_families)
        print(f"precompiled Triton kernels in {secs:.1f}s", flush=True)
    torch.manual_seed(0)
    ceil = measure_ceilings(dev)
    ceil0 = dict(ceil)
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read+write), bf16 GEMM {ceil['gemm_TFLOPs']:.0f} "
          f"TFLOP/s; device {torch.cuda.get_device_name()}", flush=True)
    header = (f"Device {torch.cuda.get_device_name()}; ceilings measured in this run: copy "
              f"{ceil['copy_GBps']:.0f} GB/s (read+write), bf16 GEMM 8192^3 {ceil['gemm_TFLOPs']:.0f} TFLOP/s.\n\n")
    if a.sweep and "triton" in backends:
        import importlib

        srows = run_sweep([m for m in models if m in ("qwen3-4b", "qwen3-8b")], ceil, dev, a.sweep_budget,
                          families=a.sweep_families)
        save(srows, a.out, "sweep", header)
        for fam, w in sweep_winners(srows).items():
            print(f"sweep winner {fam:20s} {w['config']}  (geomean us: "
                  + ", ".join(f"{c}={v:.1f}" for c, v in sorted(w["score"].items(), key=lambda kv: kv[1])) + ")")
            for sh, cfg in sorted(w["per_shape"].items()):
                print(f"    best for {' '.join(sh)}: {cfg}")
            if a.apply_sweep:
                mod = importlib.import_module(f"tileinfer.ops.triton.{w['module']}")
                if w["key"] in PER_SHAPE and w["by_key"]:  # per-shape winners; others use the table
                    mod._OVERRIDE[w["key"]] = dict(w["by_key"])
                    print(f"    applied per shape: {w['by_key']}")
                else:
                    mod._OVERRIDE[w["key"]] = w["config"]
        sys.stdout.flush()
    cases = [c for name in models for c in model_cases(MODELS[name], not a.no_32k)]
    if a.ops:
        cases = [c for c in cases if c.op in a.ops.split(",")]
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
    header = (f"Device {torch.cuda.get_device_name()}; ceilings measured in this run (max of start/end): "
              f"copy {ceil['copy_GBps']:.0f} GB/s (read+write; start {ceil0['copy_GBps']:.0f}, end "
              f"{ceil1['copy_GBps']:.0f}), bf16 GEMM 8192^3 {ceil['gemm_TFLOPs']:.0f} TFLOP/s (start "
              f"{ceil0['gemm_TFLOPs']:.0f}, end {ceil1['gemm_TFLOPs']:.0f}).\n\n")
    tl = []
    for name in backends:
        if name != "torch":
            tl += [f"\n### Targets: {name}\n", "| target | value | goal | |", "|---|---|---|---|"]
            tl += targets(rows, name)
    save(rows, a.out, "ops", header)
    with open(os.path.join(a.out, "targets.md"), "w") as f:
        f.write(header + "\n".join(tl) + "\n")
    print("\n".join(tl))
    print(f"benchmark done in {time.perf_counter() - t0:.0f}s; tables in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
