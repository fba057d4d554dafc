"""The op benchmark's cases: each op of a forward pass at the shapes of a registered model.

A :class:`Case` is one op at one shape (decode, verify or prefill step; BF16 or INT8 weights or KV
cache): how to build random arguments on a device (``make``; ``meta`` for ahead-of-time compiles),
how to call the op through a backend module, torch's path for the same work (cuBLAS, SDPA, the
reference op), and the bytes and FLOPs the op must move and compute (for GB/s, TFLOP/s). Shapes come
from :func:`tileinfer.core.registry.model_config`. Used by the benchmark (:mod:`benchmarks.ops`),
its tile sweeps and precompile, and the Nsight Compute profile (:mod:`benchmarks.profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks import qkv_out
from tileinfer.core.config import ModelConfig
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.core.registry import model_config
from tileinfer.ops import Int8Weight, reference

PAGE = 64  # KV cache page size, positions
# The models the speed targets and the tile sweeps are about (Qwen3-4B and -8B shapes); the first
# also times its prefill gate/up GEMM without the SwiGLU epilogue.
TARGET_MODELS = ("qwen3-4b-random", "qwen3-8b-random")


@dataclass
class Case:
    """One op at one shape. ``make(device)`` builds an argument set (a dict)."""

    model: str
    phase: str  # decode / verify / prefill
    op: str
    shape: str
    variant: str  # bf16 / int8w / int8kv ...
    make: Callable[[str], dict]
    call: Callable  # call(ops, args, **keywords): keywords of the op (a tile, plan or tuning)
    torch_call: Callable | None  # torch_call(args)
    nbytes: int = 0
    flops: int = 0
    tags: dict = field(default_factory=dict)

    def fn(self, ops, **keywords) -> Callable:
        """The op as ``fn(args)``: through a backend (with the op's ``keywords``), or torch's path when
        ``ops == "torch"``."""
        return self.torch_call if ops == "torch" else (lambda a: self.call(ops, a, **keywords))

    @property
    def metric(self) -> str:
        return (
            "TFLOP/s"
            if self.flops and self.phase == "prefill" and self.op in ("linear", "swiglu", "attention")
            else "GB/s"
        )


def _rand_w(n, k, dev, int8):
    if int8:
        return Int8Weight(
            torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev), torch.rand(n, device=dev) * 1e-3 + 1e-4
        )
    return torch.randn(n, k, device=dev).to(torch.bfloat16) * k**-0.5


def _wbytes(n, k, int8):
    return n * k * (1 if int8 else 2) + (4 * n if int8 else 0)


def _torch_linear(a):
    w = a["w"]
    if isinstance(w, Int8Weight):  # the torch path for weight-only INT8: dequantize, cuBLAS, scale
        return (F.linear(a["x"], w.q.to(a["x"].dtype)).float() * w.scale).to(a["x"].dtype)
    return F.linear(a["x"], w, a.get("b"))


def _torch_swiglu(a):
    return reference.swiglu(a["x"], a["w"])


def _torch_lm_head(a):
    w = a["w"]
    if isinstance(w, Int8Weight):
        return F.linear(a["x"], w.q.to(a["x"].dtype)).float() * w.scale
    try:  # cuBLAS bf16 product with float32 output
        return torch.mm(a["x"], w.t(), out_dtype=torch.float32)
    except Exception:
        return F.linear(a["x"], w).float()


def linear_cases(name: str, phase: str, T: int) -> list[Case]:
    """GEMV (T <= 16) or GEMM cases of one model: qkv, o, gate_up (SwiGLU), down, lm_head."""
    m = model_config(name)
    hid, inter = m.hidden_size, m.intermediate_size
    out = []
    shapes = [
        ("qkv", qkv_out(m), hid, "linear"),
        ("o", hid, m.num_attention_heads * m.head_dim, "linear"),
        ("gate_up", 2 * inter, hid, "swiglu"),
        ("down", hid, inter, "linear"),
    ]
    if phase == "prefill" and name == TARGET_MODELS[0]:  # the gate/up GEMM without the SwiGLU epilogue
        shapes.append(("gate_up_plain", 2 * inter, hid, "linear"))
    if phase == "decode":
        shapes.append(("lm_head", m.vocab_size, hid, "lm_head"))
    for int8 in (False, True):
        for weight, n, k, op in shapes:

            def make(dev, n=n, k=k, int8=int8, T=T, weight=weight):
                a = dict(x=torch.randn(T, k, device=dev).to(torch.bfloat16), w=_rand_w(n, k, dev, int8))
                if weight == "qkv" and m.attention_bias:
                    a["b"] = torch.randn(n, device=dev).to(torch.bfloat16)
                return a

            call = {
                "linear": lambda ops, a, **kw: ops.linear(a["x"], a["w"], a.get("b"), **kw),
                "swiglu": lambda ops, a, **kw: ops.swiglu(a["x"], a["w"], **kw),
                "lm_head": lambda ops, a, **kw: ops.lm_head(a["x"], a["w"], **kw),
            }[op]
            tcall = {"linear": _torch_linear, "swiglu": _torch_swiglu, "lm_head": _torch_lm_head}[op]
            n_out = n // 2 if op == "swiglu" else n
            obytes = T * n_out * (4 if op == "lm_head" else 2)
            # the key the backend's tile table uses for this shape (GEMV: weight rows, K; GEMM: M, N, K)
            cfg_key = (n, k) if T <= 16 else (T, n_out, k)
            out.append(
                Case(
                    name,
                    phase,
                    op,
                    f"{weight} {T}x{k}->{n}",
                    "int8w" if int8 else "bf16",
                    make,
                    call,
                    tcall,
                    nbytes=_wbytes(n, k, int8) + 2 * T * k + obytes,
                    flops=2 * T * n * k,
                    tags=dict(weight=weight, n=n, k=k, T=T, cfg_key=cfg_key),
                )
            )
    return out


def _kv(m: ModelConfig, L: int, int8: bool, dev):
    """A one-layer page pool holding L random positions, pages scattered, and its block table."""
    n_pages = -(-L // PAGE)
    kv = PagedKVCache(1, n_pages, PAGE, m.num_key_value_heads, m.head_dim, torch.bfloat16, int8, dev)
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


def _kv_bytes(m: ModelConfig, L: int, int8: bool) -> int:
    """Bytes of the keys and values of L positions (INT8: plus a float32 scale per head vector)."""
    kvh = m.num_key_value_heads
    return 2 * L * (kvh * m.head_dim * (1 if int8 else 2) + (kvh * 4 if int8 else 0))


def _sdpa(a):
    """torch's path: SDPA over a contiguous cache (flash for prefill; GQA without copies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if a.get("flash"):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a["tq"], a["tk"], a["tv"], is_causal=True)
    return F.scaled_dot_product_attention(a["tq"], a["tk"], a["tv"], enable_gqa=True)


def attention_cases(name: str, phase: str, T: int, contexts) -> list[Case]:
    """Attention of T queries at the end of each context length, BF16 and INT8 caches."""
    m = model_config(name)
    heads, d = m.num_attention_heads, m.head_dim
    out = []
    for L in contexts:
        for int8 in (False, True):

            def make(dev, L=L, int8=int8, T=T):
                layer, bt = _kv(m, L, int8, dev)
                a = dict(
                    q=torch.randn(T, heads, d, device=dev).to(torch.bfloat16),
                    layer=layer,
                    bt=bt,
                    pos=torch.arange(L - T, L, dtype=torch.int32, device=dev),
                )
                if dev != "meta":  # torch's inputs: contiguous [1, heads, L, d]
                    kvh = m.num_key_value_heads if phase != "prefill" else heads
                    a["tq"] = a["q"].transpose(0, 1)[None]
                    a["tk"] = torch.randn(1, kvh, L, d, device=dev).to(torch.bfloat16)
                    a["tv"] = torch.randn(1, kvh, L, d, device=dev).to(torch.bfloat16)
                    a["flash"] = phase == "prefill"
                return a

            causal = T * (L - T) + T * (T + 1) // 2  # visible (query, key) pairs
            out.append(
                Case(
                    name,
                    phase,
                    "attention",
                    f"T={T} ctx={L}",
                    "int8kv" if int8 else "bf16",
                    make,
                    lambda ops, a, **kw: ops.attention(a["q"], a["layer"], a["bt"], a["pos"], d**-0.5, **kw),
                    _sdpa,
                    nbytes=_kv_bytes(m, L, int8),
                    flops=4 * causal * heads * d,
                    tags=dict(ctx=L, T=T),
                )
            )
    return out


def small_cases(name: str, phase: str, T: int) -> list[Case]:
    """Embedding, the norms and the q/k norm + RoPE + KV write; the argmax at decode."""
    m = model_config(name)
    bf = torch.bfloat16
    H, d, V = m.hidden_size, m.head_dim, m.vocab_size
    heads, kvh = m.num_attention_heads, m.num_key_value_heads
    out = [
        Case(
            name,
            phase,
            "embedding",
            f"T={T} H={H}",
            "bf16",
            lambda dev: dict(ids=torch.randint(0, V, (T,), device=dev), table=torch.randn(V, H, device=dev).to(bf)),
            lambda ops, a: ops.embedding(a["ids"], a["table"]),
            lambda a: F.embedding(a["ids"], a["table"]),
            nbytes=2 * 2 * T * H,
        ),
        Case(
            name,
            phase,
            "rms_norm",
            f"T={T} H={H}",
            "bf16",
            lambda dev: dict(x=torch.randn(T, H, device=dev).to(bf), w=torch.randn(H, device=dev).to(bf)),
            lambda ops, a: ops.rms_norm(a["x"], a["w"], 1e-6),
            lambda a: F.rms_norm(a["x"], (H,), a["w"], 1e-6),
            nbytes=2 * 2 * T * H,
        ),
        Case(
            name,
            phase,
            "add_rms_norm",
            f"T={T} H={H}",
            "bf16",
            lambda dev: dict(
                x=torch.randn(T, H, device=dev).to(bf),
                r=torch.randn(T, H, device=dev).to(bf),
                w=torch.randn(H, device=dev).to(bf),
            ),
            lambda ops, a: ops.add_rms_norm(a["x"], a["r"], a["w"], 1e-6),
            lambda a: (lambda s: (F.rms_norm(s, (H,), a["w"], 1e-6), s))(a["x"] + a["r"]),
            nbytes=4 * 2 * T * H,
        ),
    ]
    for int8 in (False, True):

        def make(dev, int8=int8):
            L = 4096
            layer, bt = _kv(m, L, int8, dev)
            qkv = torch.randn(T, qkv_out(m), device=dev).to(bf)
            q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
            ang = torch.rand(L, d // 2, device=dev)
            return dict(
                q=q.view(T, heads, d),
                k=k.view(T, kvh, d),
                v=v.view(T, kvh, d),
                qn=torch.randn(d, device=dev).to(bf) if m.qk_norm else None,
                kn=torch.randn(d, device=dev).to(bf) if m.qk_norm else None,
                cos=ang.cos(),
                sin=ang.sin(),
                layer=layer,
                bt=bt,
                pos=torch.arange(L - T - 7, L - 7, dtype=torch.int32, device=dev),
            )

        def call(ops, a):
            return ops.qk_norm_rope_kv_write(
                a["q"], a["k"], a["v"], a["qn"], a["kn"], 1e-6, a["cos"], a["sin"], a["layer"], a["bt"], a["pos"]
            )

        out.append(
            Case(
                name,
                phase,
                "qk_norm_rope_kv_write",
                f"T={T}",
                "int8kv" if int8 else "bf16",
                make,
                call,
                lambda a: call(reference, a),
                nbytes=2 * T * (qkv_out(m) + heads * d) + T * _kv_bytes(m, 1, int8),
            )
        )
    if phase == "decode":

        def mk(dev):
            return dict(x=torch.randn(T, V, device=dev) * 3)

        out.append(
            Case(
                name,
                phase,
                "argmax",
                f"T={T} V={V}",
                "f32",
                mk,
                lambda ops, a: ops.argmax(a["x"]),
                lambda a: a["x"].argmax(-1),
                nbytes=4 * T * V,
            )
        )
    return out


def model_cases(name: str, long_ctx: bool = True) -> list[Case]:
    """Every case of registered model ``name``: a decode step (attention after 1k, 8k and, with
    ``long_ctx``, 32k positions), a 16-row verify step, a 1,024-token prefill chunk (and prefill
    attention over 8,192 tokens), and the GEMMs of a 512-token chunk (the runner's default
    ``prefill_chunk``, so the size the jobs run)."""
    cs = []
    cs += small_cases(name, "decode", 1)
    cs += linear_cases(name, "decode", 1)
    cs += attention_cases(name, "decode", 1, [1024, 8192, 32768] if long_ctx else [1024, 8192])
    cs += linear_cases(name, "verify", 16)
    cs += attention_cases(name, "verify", 16, [8192])
    cs += small_cases(name, "prefill", 1024)
    cs += linear_cases(name, "prefill", 1024)
    cs += linear_cases(name, "prefill", 512)
    cs += attention_cases(name, "prefill", 1024, [1024])
    cs += attention_cases(name, "prefill", 8192, [8192])
    return cs
