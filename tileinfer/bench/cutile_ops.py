"""Timing of the cuTile kernels against the H200's measured ceilings (run on the GPU).

``python -m tileinfer.bench.cutile_ops [--quick] [--json PATH]``

Each op is captured N times in a CUDA graph (inputs rotated over enough copies to exceed the
50 MB L2 where the op is memory-bound) and the graph replayed; the median per-op time is
reported. Ceilings measured in the same run: device-to-device copy bandwidth (read + write) and
cuBLAS through torch for the same GEMM shapes. The end-to-end rows run the model's decode step
(Qwen3-0.6B/4B shapes, random weights) from a captured graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.ops import Int8Weight
from tileinfer.ops import reference as ref

ROWS: list[dict] = []


def log(**row):
    ROWS.append(row)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)


def timed(fns, reps: int = 7, graph: bool = True) -> float:
    """Median microseconds per call of the callables ``fns`` (run in sequence), via graph replay."""
    fns[0]()
    torch.cuda.synchronize()
    g = None
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for f in fns:
                    f()
        except Exception as e:  # report and fall back to plain launches
            print("graph capture failed:", type(e).__name__, str(e)[:200])
            g = None
    run = g.replay if g is not None else (lambda: [f() for f in fns])
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / len(fns))
    return statistics.median(ts)


def copies(make, nbytes_each: int, min_total: int = 400 << 20, cap: int = 64):
    n = max(2, min(cap, -(-min_total // max(nbytes_each, 1))))
    return [make() for _ in range(n)]


def ceilings():
    n = 1 << 29
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = timed([lambda: b.copy_(a)] * 10, graph=False)
    bw = 2 * a.numel() * 2 / (t * 1e-6) / 1e12
    log(what="copy 1 GiB d2d", us=t, TBps=bw)
    del a, b
    return bw


def bench_gemv(ops, bw, quick):
    from tileinfer.ops.cutile import gemm as L

    shapes = [("0.6b qkv", 4096, 1024, "linear"), ("0.6b o", 1024, 2048, "linear"),
              ("0.6b gate_up", 6144, 1024, "swiglu"), ("0.6b down", 1024, 3072, "linear"),
              ("4b qkv", 6144, 2560, "linear"), ("4b o", 2560, 4096, "linear"),
              ("4b gate_up", 19456, 2560, "swiglu"), ("4b down", 2560, 9728, "linear"),
              ("4b lm_head", 151936, 2560, "lm_head"), ("8b gate_up", 24576, 4096, "swiglu"),
              ("8b down", 4096, 12288, "linear")]
    if quick:
        shapes = shapes[:9]
    for name, n, k, kind in shapes:
        for T in ((1, 16) if name.startswith("4b") else (1,)):
            x = (torch.randn(T, k, device="cuda")).to(torch.bfloat16)
            for int8 in (False, True):
                if int8:
                    ws = copies(lambda: Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8,
                                                                 device="cuda"),
                                                   torch.rand(n, device="cuda") * 1e-3), n * k)
                    nbytes = n * k + 4 * n
                else:
                    ws = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16),
                                2 * n * k)
                    nbytes = 2 * n * k
                fn = getattr(ops, kind)
                t = timed([lambda w=w: fn(x, w) for w in ws])
                log(what=f"gemv {name}", T=T, w="int8" if int8 else "bf16", plan=str(
                    L.skinny_plan(n // 2 if kind == "swiglu" else n, n, k, 1 if int8 else 2,
                                  kind == "swiglu")), us=t,
                    TBps=nbytes / (t * 1e-6) / 1e12, of_copy=nbytes / (t * 1e-6) / 1e12 / bw)
                if not int8:   # cuBLAS reading the same bytes (bf16 out): the GEMV ceiling
                    tf = lambda w: F.linear(x, w)  # noqa: E731
                    t = timed([lambda w=w: tf(w) for w in ws])
                    log(what=f"cublas {name}", T=T, w="bf16", us=t,
                        TBps=nbytes / (t * 1e-6) / 1e12, of_copy=nbytes / (t * 1e-6) / 1e12 / bw)
                del ws


SWEEP_SHAPES = (("4b down", 2560, 9728), ("4b qkv", 6144, 2560), ("0.6b o", 1024, 2048))
SWEEP_PLANS = [dict(TN=tn, TK=tk, S=sp) for tn in (64, 128) for tk in (64, 128, 256) for sp in (1, 4)]


def sweep_launches():
    """The sweep's launches on meta tensors (for warmup.py to compile them ahead)."""
    from tileinfer.ops import cutile as ops
    from tileinfer.ops.cutile import _common
    from tileinfer.ops.cutile import gemm as L

    out = []
    for _, n, k in SWEEP_SHAPES:
        x = torch.empty(1, k, dtype=torch.bfloat16, device="meta")
        w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        for plan in SWEEP_PLANS:
            L.PLAN_OVERRIDE = plan
            try:
                with _common.recording() as rec:
                    ops.linear(x, w)
                out += rec
            finally:
                L.PLAN_OVERRIDE = {}
    return out


def bench_gemv_sweep(ops, bw):
    """Skinny-kernel tiles and split-K factors on three shapes (decode, bf16, T = 1)."""
    from tileinfer.ops.cutile import gemm as L

    for name, n, k in SWEEP_SHAPES:
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ws = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), 2 * n * k)
        for plan in SWEEP_PLANS:
            L.PLAN_OVERRIDE = plan
            try:
                t = timed([lambda w=w: ops.linear(x, w) for w in ws])
                log(what=f"sweep {name}", **plan, us=t, of_copy=2 * n * k / (t * 1e-6) / 1e12 / bw)
            finally:
                L.PLAN_OVERRIDE = {}
        del ws


def bench_prefill_attn_variants(ops):
    """Prefill attention: 128-row tiles with 8 worker warps (default) vs 64-row tiles at 2 blocks/SM."""
    from tileinfer.ops.cutile import paged_attention as A

    base_k, base_tm = A.prefill_attention_kernel, A.PREFILL_TM
    h, kvh, d, T, ctx = 32, 8, 128, 512, 8192
    L, bt, _ = _layer_cache(ctx, kvh, d, False)
    q = torch.randn(T, h, d, device="cuda").to(torch.bfloat16)
    pos = torch.arange(ctx - T, ctx, dtype=torch.int32, device="cuda")
    fl = 4 * d * h * float((pos.double() + 1).sum())
    for tm, hints in ((128, None), (64, dict(occupancy=2, num_worker_warps=None)),
                      (64, None)):
        A.PREFILL_TM = tm
        A.prefill_attention_kernel = base_k.replace_hints(**hints) if hints else base_k
        try:
            t = timed([lambda: ops.attention(q, L, bt, pos, d ** -0.5)] * 5)
            log(what="attn prefill variant", TM=tm, hints=str(hints), us=t, TFLOPs=fl / t / 1e6)
        finally:
            A.prefill_attention_kernel, A.PREFILL_TM = base_k, base_tm


def bench_gemm(ops, quick):
    shapes = [("4b qkv", 6144, 2560, "linear"), ("4b gate_up", 19456, 2560, "swiglu"),
              ("4b down", 2560, 9728, "linear"), ("8b o", 4096, 4096, "linear")]
    for T in ((512,) if quick else (512, 4096)):
        for name, n, k, kind in shapes:
            x = torch.randn(T, k, device="cuda").to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            fl = 2 * T * n * k
            t = timed([lambda: getattr(ops, kind)(x, w)] * 10)
            tb = timed([lambda: F.linear(x, w)] * 10)
            log(what=f"gemm {name}", T=T, w="bf16", us=t, TFLOPs=fl / t / 1e6, cublas_us=tb,
                cublas_TFLOPs=fl / tb / 1e6, vs_cublas=tb / t)
            wq = Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda"),
                            torch.rand(n, device="cuda") * 1e-3)
            t = timed([lambda: getattr(ops, kind)(x, wq)] * 10)
            log(what=f"gemm {name}", T=T, w="int8", us=t, TFLOPs=fl / t / 1e6, vs_cublas_bf16=tb / t)


def _layer_cache(ctx, kvh, d, int8, page=64):
    n_pages = -(-ctx // page) + 1
    kv = PagedKVCache(1, n_pages, page, kvh, d, torch.bfloat16, int8, "cuda")
    if int8:
        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
        kv.k_scale.uniform_(1e-3, 2e-2), kv.v_scale.uniform_(1e-3, 2e-2)
    else:
        kv.k.normal_(), kv.v.normal_()
    bt = torch.randperm(n_pages, device="cuda").to(torch.int32)
    return kv.layers[0], bt, kv.nbytes


def bench_attention(ops, bw, quick):
    h, kvh, d = 32, 8, 128
    cases = [(1, 8192), (1, 32768), (16, 8192), (1, 1024)]
    for T, ctx in cases:
        for int8 in (False, True):
            per_layer = 2 * ctx * kvh * d * (1 if int8 else 2) + (2 * ctx * kvh * 4 if int8 else 0)
            layers = [_layer_cache(ctx, kvh, d, int8) for _ in range(max(2, min(8, -(-400 << 20) // per_layer)))]
            q = torch.randn(T, h, d, device="cuda").to(torch.bfloat16)
            pos = torch.arange(ctx - T, ctx, dtype=torch.int32, device="cuda")
            t = timed([lambda L=L: ops.attention(q, L[0], L[1], pos, d ** -0.5) for L in layers])
            log(what="attn decode split-KV", T=T, ctx=ctx, kv="int8" if int8 else "bf16", us=t,
                TBps=per_layer / (t * 1e-6) / 1e12, of_copy=per_layer / (t * 1e-6) / 1e12 / bw)
            del layers
    for T, ctx in ((512, 512), (512, 8192)) if not quick else ((512, 8192),):
        for int8 in (False, True):
            L, bt, _ = _layer_cache(ctx, kvh, d, int8)
            q = torch.randn(T, h, d, device="cuda").to(torch.bfloat16)
            pos = torch.arange(ctx - T, ctx, dtype=torch.int32, device="cuda")
            # causal FLOPs: each query row sees (pos + 1) keys; 4 * d FLOPs per (row, key, head)
            fl = 4 * d * h * float((pos.double() + 1).sum())
            t = timed([lambda: ops.attention(q, L, bt, pos, d ** -0.5)] * 5)
            row = dict(what="attn prefill", T=T, ctx=ctx, kv="int8" if int8 else "bf16", us=t,
                       TFLOPs=fl / t / 1e6)
            if ctx == T and not int8:
                qq = q.transpose(0, 1)[None]
                kk = torch.randn(1, kvh, T, d, device="cuda").to(torch.bfloat16)
                vv = torch.randn(1, kvh, T, d, device="cuda").to(torch.bfloat16)
                ts = timed([lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                   enable_gqa=True)] * 5)
                row.update(sdpa_us=ts, vs_sdpa=ts / t)
            log(**row)


def bench_small(ops):
    hidden, h, kvh, d, vocab = 2560, 32, 8, 128, 151936
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    r = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    w = torch.randn(hidden, device="cuda").to(torch.bfloat16)
    log(what="rms_norm", T=1, us=timed([lambda: ops.rms_norm(x, w, 1e-6)] * 50))
    log(what="add_rms_norm", T=1, us=timed([lambda: ops.add_rms_norm(x, r, w, 1e-6)] * 50))
    table = torch.randn(vocab, hidden, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1,), device="cuda")
    log(what="embedding", T=1, us=timed([lambda: ops.embedding(ids, table)] * 50))
    L, bt, _ = _layer_cache(4096, kvh, d, False)
    qkv = torch.randn(1, (h + 2 * kvh) * d, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    cos = torch.randn(8192, d // 2, device="cuda")
    sin = torch.randn(8192, d // 2, device="cuda")
    pos = torch.tensor([1000], dtype=torch.int32, device="cuda")
    qn, kn = w[:d].clone(), w[d:2 * d].clone()
    log(what="qk_norm_rope_kv_write", T=1, us=timed([lambda: ops.qk_norm_rope_kv_write(
        q.view(1, h, d), k.view(1, kvh, d), v.view(1, kvh, d), qn, kn, 1e-6, cos, sin, L, bt,
        pos)] * 50))
    logits = torch.randn(1, vocab, device="cuda") * 3
    log(what="argmax", T=1, us=timed([lambda: ops.argmax(logits)] * 50),
        torch_us=timed([lambda: logits.argmax(-1)] * 50))
    log(what="sample k20 p0.9", T=1, us=timed([lambda: ops.sample(logits, 0.7, 20, 0.9, None)] * 20),
        torch_ref_us=timed([lambda: ref.sample(logits, 0.7, 20, 0.9, None)] * 5, graph=False))
    log(what="sample p0.95", T=1, us=timed([lambda: ops.sample(logits, 0.7, 0, 0.95, None)] * 20))


def bench_decode_step(ops, bw, quick):
    """Whole decode steps of random-weight models from a captured graph: tok/s vs the roofline."""
    from tileinfer.core.config import ModelConfig
    from tileinfer.models.transformer import Layer, Transformer
    from tileinfer.ops.cutile import _common
    from tileinfer.ops.cutile import gemm as L

    cfgs = [("qwen3-0.6b", 1024, 16, 8, 128, 3072, 28), ("qwen3-4b", 2560, 32, 8, 128, 9728, 36)]
    for name, hid, h, kvh, d, inter, nl in cfgs:
        c = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=hid,
                        intermediate_size=inter, num_hidden_layers=nl, num_attention_heads=h,
                        num_key_value_heads=kvh, head_dim=d, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=40960, tie_word_embeddings=True,
                        attention_bias=False, qk_norm=True)
        for int8_w in (False, True):
            def W(n, k):
                if int8_w:
                    return Int8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda"),
                                      torch.rand(n, device="cuda") * 1e-3)
                return (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)

            def V(*s):
                return (1 + 0.1 * torch.randn(*s, device="cuda")).to(torch.bfloat16)
            layers = [Layer(V(hid), W((h + 2 * kvh) * d, hid), None, V(d), V(d), W(hid, h * d), V(hid),
                            W(2 * inter, hid), W(hid, inter)) for _ in range(nl)]
            embed = (torch.randn(151936, hid, device="cuda") * 0.02).to(torch.bfloat16)
            lm = W(151936, hid) if int8_w else embed
            model = Transformer(c, embed, layers, V(hid), lm, 40960)
            wbytes = model.weight_bytes() - embed.numel() * 2 * (0 if not int8_w else 1)
            for ctx in ((1024,) if quick or name != "qwen3-4b" or int8_w else (1024, 32768)):
                for int8_kv in (False, True):
                    pages = -(-(ctx + 64) // 64)
                    kv = PagedKVCache(nl, pages, 64, kvh, d, torch.bfloat16, int8_kv, "cuda")
                    if int8_kv:
                        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
                        kv.k_scale.uniform_(1e-3, 2e-2), kv.v_scale.uniform_(1e-3, 2e-2)
                    else:
                        kv.k.normal_(), kv.v.normal_()
                    bt = torch.arange(pages, dtype=torch.int32, device="cuda")
                    tok = torch.randint(0, 151936, (1,), device="cuda")
                    pos = torch.tensor([ctx], dtype=torch.int32, device="cuda")

                    def step():
                        ops.argmax(model.forward(ops, tok, pos, kv, bt))
                    kvb = kv.bytes_per_position() * ctx
                    roof = (wbytes + kvb) / (bw * 1e12)
                    variants = [(True, True)]
                    if not (int8_w or int8_kv):
                        variants += [(False, True), (True, False)]
                    for pdl, split in variants:
                        _common.PDL, L.SPLIT_K = pdl, split
                        try:
                            t = timed([step] * 4, reps=5)
                        finally:
                            _common.PDL, L.SPLIT_K = True, True
                        log(what=f"decode step {name}", w="int8" if int8_w else "bf16",
                            kv="int8" if int8_kv else "bf16", ctx=ctx, pdl=pdl, split=split,
                            us=t, tok_s=1e6 / t, roofline_tok_s=1 / roof,
                            of_roofline=roof / (t * 1e-6))
                    del kv
            if not int8_w:
                kv = PagedKVCache(nl, 64, 64, kvh, d, torch.bfloat16, False, "cuda")
                bt = torch.arange(64, dtype=torch.int32, device="cuda")
                toks = torch.randint(0, 151936, (512,), device="cuda")
                pos = torch.arange(512, dtype=torch.int32, device="cuda")
                t = timed([lambda: model.forward(ops, toks, pos, kv, bt, slice(-1, None))] * 2,
                          reps=5)
                log(what=f"prefill 512 {name}", w="bf16", us=t, tok_s=512e6 / t)
                del kv
            del model, layers, embed, lm
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", default="ceil,gemv,attn,step,sweep,small,gemm,pattn")
    a = ap.parse_args(argv)
    from tileinfer.ops import cutile as ops

    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    only = set(a.only.split(","))
    t0 = time.time()
    bw = ceilings() if "ceil" in only else 4.15
    import cuda.tile._compile as _c

    compiles = [0]
    _orig = _c.compile_cubin

    def _counting(*args, **kw):   # tileiras runs only on a disk-cache miss
        compiles[0] += 1
        return _orig(*args, **kw)
    _c.compile_cubin = _counting
    for part, fn in (("gemv", lambda: bench_gemv(ops, bw, a.quick)),
                     ("attn", lambda: bench_attention(ops, bw, a.quick)),
                     ("step", lambda: bench_decode_step(ops, bw, a.quick)),
                     ("sweep", lambda: bench_gemv_sweep(ops, bw)),
                     ("small", lambda: bench_small(ops)),
                     ("gemm", lambda: bench_gemm(ops, a.quick)),
                     ("pattn", lambda: bench_prefill_attn_variants(ops))):
        if part in only:
            try:
                fn()
            except Exception as e:
                import traceback

                traceback.print_exc()
                log(what=f"{part} FAILED", error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"-- {part} done at {time.time() - t0:.0f} s, {compiles[0]} JIT compiles so far",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
