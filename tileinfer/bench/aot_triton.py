"""Compile the Triton backend's kernels for sm_90 with no GPU (the CI check), and report them.

Inside :func:`compiling`, launching any ``@triton.jit`` kernel compiles it for the target instead
of running it, through the same binder/specialisation path ``JITFunction.run`` takes (so the
specialisations, and the on-disk cache keys, are those a real launch at these shapes produces).
The ops are called on ``meta`` tensors, which have shapes and dtypes but no storage.

``python -m tileinfer.bench.aot_triton [--models ...] [--sass]`` compiles every kernel the shipped
models need (decode, verify and prefill shapes, BF16/INT8 weights and cache) and prints registers,
spills, shared memory and, with --sass, counts of the instructions that matter (HGMMA, I2F, LDG.128).
It must run without ``TRITON_INTERPRET`` (tests start it in a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def compiling(target: GPUTarget = SM90):
    """Make kernel launches compile for ``target`` instead of running; yields {key: record}.

    Each record: dict(name, kernel (CompiledKernel), seconds, constexprs, num_warps, num_stages).
    """
    backend = make_backend(target)
    seen: dict = {}
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (self.fn.__qualname__, str(specialization), str(options))
        if key not in seen:
            opts, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                                 specialization, options)
            t0 = time.perf_counter()
            kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                    options=opts.__dict__)
            names = {(i,): n for i, n in enumerate(self.arg_names)}
            seen[key] = dict(name=self.fn.__name__, kernel=kernel, seconds=time.perf_counter() - t0,
                             constexprs={names.get(k, k): v for k, v in constexprs.items()},
                             num_warps=opts.num_warps, num_stages=opts.num_stages)
        return None

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(kernel) -> dict:
    """Registers, spills (stack bytes), shared memory and SASS instruction counts of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    out = {}
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    if m:
        out.update(regs=int(m[1]), stack=int(m[2]), smem=int(m[3]))
    out["smem_dyn"] = kernel.metadata.shared
    for op in ("HGMMA", "HMMA", "I2F", "F2FP", "LDG.E.128", "LDGSTS", "UTMALDG", "LDL", "STL", "MUFU.EX2"):
        out[op] = len(re.findall(r"\b" + re.escape(op) + r"\b", sass))
    return out


def model_calls(shape, rows=(1, 16, 127, 512, 1023), context: int = 2048, page_size: int = 64):
    """Call every op of the backend on meta tensors at one model's shapes.

    rows: token counts per step (decode, verify, scored chunks of 127/1023 rows, prefill). Both weight
    kinds, both cache kinds.
    """
    from tileinfer.core.kv_cache import PagedKVCache
    from tileinfer.ops import Int8Weight
    from tileinfer.ops import triton as ops

    dev, bf = "meta", torch.bfloat16
    s = shape
    e = lambda *sz, dt=bf: torch.empty(*sz, dtype=dt, device=dev)  # noqa: E731
    weights = {
        "bf16": dict(qkv=e(s.qkv_out, s.hidden), o=e(s.hidden, s.heads * s.head_dim),
                     gu=e(2 * s.inter, s.hidden), down=e(s.hidden, s.inter), head=e(s.vocab, s.hidden)),
    }
    q8 = lambda w: Int8Weight(torch.empty(w.shape, dtype=torch.int8, device=dev),  # noqa: E731
                              torch.empty(w.shape[0], dtype=torch.float32, device=dev))
    weights["int8"] = {k: q8(w) for k, w in weights["bf16"].items()}
    max_pages = -(-context // page_size)
    cos = e(context, s.head_dim // 2, dt=torch.float32)
    bt = e(max_pages, dt=torch.int32)
    norm = e(s.head_dim) if s.qk_norm else None
    bias = e(s.qkv_out) if s.qkv_bias else None
    for T in rows:
        x = e(T, s.hidden)
        pos = e(T, dt=torch.int32)
        ops.embedding(e(T, dt=torch.int64), e(s.vocab, s.hidden))
        ops.rms_norm(x, e(s.hidden), 1e-6)
        ops.add_rms_norm(x, x, e(s.hidden), 1e-6)
        for w in weights.values():
            ops.linear(x, w["qkv"], bias)
            ops.linear(e(T, s.heads * s.head_dim), w["o"])
            ops.swiglu(x, w["gu"])
            ops.linear(e(T, s.inter), w["down"])
            ops.lm_head(x, w["head"])
        qkv = e(T, s.qkv_out)
        q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                             s.kv_heads * s.head_dim], dim=-1)
        for int8 in (False, True):
            kv = PagedKVCache(1, max_pages, page_size, s.kv_heads, s.head_dim, bf, int8, dev)
            qr = ops.qk_norm_rope_kv_write(q.view(T, s.heads, s.head_dim), k.view(T, s.kv_heads, s.head_dim),
                                           v.view(T, s.kv_heads, s.head_dim), norm, norm, 1e-6, cos, cos,
                                           kv.layers[0], bt, pos)
            ops.attention(qr, kv.layers[0], bt, pos, s.head_dim ** -0.5)
        if T <= 16:
            logits = e(T, s.vocab, dt=torch.float32)
            ops.argmax(logits)
            ops.sample(logits, 0.7, 20, 0.95, None)
            ops.sample(logits, 1.0, 0, 0.9, None)


SM90_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KB)


def compile_models(names, sass: bool = False, rows=(1, 16, 127, 512, 1023)) -> list[dict]:
    """Compile every kernel the named models need for sm_90; return one record per specialisation."""
    from tileinfer.bench import MODELS

    with compiling() as seen:
        for n in names:
            model_calls(MODELS[n], rows=rows)
    recs = list(seen.values())
    if sass:
        for r in recs:
            r.update(resources(r["kernel"]))
    return recs


def main(argv=None) -> int:
    from tileinfer.bench import MODELS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--sass", action="store_true", help="report registers, spills and SASS counts")
    p.add_argument("--filter", default="", help="only print kernels whose name contains this")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    recs = compile_models(a.models.split(","), sass=a.sass)
    for r in recs:
        if a.filter and a.filter not in r["name"]:
            continue
        cx = {k: (v.name if hasattr(v, "name") else v) for k, v in r["constexprs"].items()}
        line = f"{r['name']:28s} w{r['num_warps']} s{r['num_stages']} {r['seconds']:5.2f}s {cx}"
        if a.sass:
            line += " | " + " ".join(f"{k}={v}" for k, v in r.items()
                                     if k in ("regs", "stack", "smem_dyn", "HGMMA", "HMMA", "I2F",
                                              "F2FP", "LDG.E.128", "LDGSTS", "LDL", "STL") and v)
        print(line)
    print(f"{len(recs)} kernels compiled for sm_90 in {time.perf_counter() - t0:.1f}s")
    # a launch fails with OutOfResources past the per-block shared memory of the chip, which the
    # compiler does not check; catch it here, without a GPU
    over = [r for r in recs if r["kernel"].metadata.shared > SM90_SHARED_MEMORY]
    for r in over:
        print(f"too much shared memory: {r['name']} {r['kernel'].metadata.shared} > {SM90_SHARED_MEMORY} bytes "
              f"({ {k: getattr(v, 'name', v) for k, v in r['constexprs'].items()} })")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
