"""The compiled Triton backend against the reference on the GPU, at the shipped models' real shapes.

Run on the H200: ``pytest -m gpu tests/gpu/test_triton_gpu.py``. Every ``torch.empty`` (op outputs,
workspaces, KV pools) is poisoned with NaN before use, so an element no kernel wrote fails. Shapes:
Qwen3-0.6B/4B/8B, Qwen2.5-0.5B/1.5B, SmolLM2-135M (GQA ratios 2, 4, 4, 7, 6, 3, plus synthetic 1
and 8); contexts 1 to 32k with the last page partly filled and pages scattered through the pool;
1, 7, 16 and 300+ rows; BF16 and INT8 weights and caches. A last test captures a decode step's ops
in a CUDA graph and replays it as the context grows (positions updated in place on the device).
"""

from __future__ import annotations

import pytest
import torch

from tests.numerics import filtered_probs, rel  # noqa: E402
from tileinfer.bench import MODELS, ModelShape
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.ops import Int8Weight
from tileinfer.ops import reference as R

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

DEV = "cuda"
BF = torch.bfloat16
SHAPES = dict(MODELS)
SHAPES["gqa1"] = ModelShape("gqa1", 1024, 8, 8, 128, 2048, 32000)
SHAPES["gqa8"] = ModelShape("gqa8", 4096, 32, 4, 128, 4096, 32000)
MODEL_NAMES = list(MODELS)


@pytest.fixture(scope="module")
def TR():
    import tileinfer.ops.triton as m
    from tileinfer.ops.triton._common import INTERPRET

    assert not INTERPRET, "TRITON_INTERPRET is set: run the GPU tests in their own pytest process"
    return m


@pytest.fixture(autouse=True)
def poison_and_seed(poisoned_empty, fresh_seed):
    """Every torch.empty starts as NaN / garbage; every test draws its own inputs (tests/conftest.py)."""


def q8(w):
    q, s = R.quantize_int8(w.float())
    return Int8Weight(q, s)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_norms_embedding(TR, name):
    m = MODELS[name]
    for T in (1, 333):
        x, r = torch.randn(T, m.hidden, device=DEV).to(BF), torch.randn(T, m.hidden, device=DEV).to(BF)
        w = torch.randn(m.hidden, device=DEV).to(BF)
        assert rel(TR.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6)) < 1e-2
        y, s = TR.add_rms_norm(x, r, w, 1e-6)
        y2, s2 = R.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, s2) and rel(y, y2) < 1e-2
        table = torch.randn(m.vocab, m.hidden, device=DEV).to(BF)
        ids = torch.randint(0, m.vocab, (T,), device=DEV)
        assert torch.equal(TR.embedding(ids, table), R.embedding(ids, table))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_linear_swiglu_lm_head(TR, name):
    m = MODELS[name]
    mats = dict(qkv=(m.qkv_out, m.hidden), o=(m.hidden, m.heads * m.head_dim),
                gate_up=(2 * m.inter, m.hidden), down=(m.hidden, m.inter))
    for T in (1, 7, 16, 300):
        for wname, (n, k) in mats.items():
            x = torch.randn(T, k, device=DEV).to(BF)
            w = (torch.randn(n, k, device=DEV) * k**-0.5).to(BF)
            for ww in (w, q8(w)):
                if wname == "gate_up":
                    assert rel(TR.swiglu(x, ww), R.swiglu(x, ww)) < 2e-2, (T, wname)
                else:
                    b = torch.randn(n, device=DEV).to(BF) if (wname == "qkv" and m.qkv_bias) else None
                    assert rel(TR.linear(x, ww, b), R.linear(x, ww, b)) < 1e-2, (T, wname)
    w = (torch.randn(m.vocab, m.hidden, device=DEV) * m.hidden**-0.5).to(BF)
    for T in (1, 16, 5):
        x = torch.randn(T, m.hidden, device=DEV).to(BF)
        for ww in (w, q8(w)):
            out = TR.lm_head(x, ww)
            assert out.dtype == torch.float32 and rel(out, R.lm_head(x, ww)) < 1e-4


VARIANTS = {  # kernel variants forced through the tile tables' override hook
    "ptr": {"gemm_bf16": (128, 128, 64, 8, 8, 3, "ptr"), "gemm_int8": (128, 128, 64, 8, 8, 3, "ptr")},
    "tma": {"gemm_bf16": (128, 128, 64, 8, 8, 4, "tma"), "gemm_int8": (128, 64, 64, 8, 4, 4, "tma"),
            "gemv1_int8": (16, 512, 4, 2, 2)},
    "tma_ws": {"gemm_bf16": (128, 256, 64, 8, 8, 3, "tma_ws"),  # SwiGLU clamps to 128 columns
               "gemm_int8": (128, 128, 64, 8, 8, 4, "tma_ws"), "gemv1_int8": (16, 512, 4, 1, 1)},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemm_gemv_variants(TR, monkeypatch, variant):
    """The GEMM kernels (pointer, TMA, TMA warp-specialised) and both INT8 GEMV modes."""
    from tileinfer.ops.triton import gemm

    for key, cfg in VARIANTS[variant].items():
        monkeypatch.setitem(gemm._OVERRIDE, key, cfg)
    m = MODELS["qwen2.5-0.5b"]  # odd sizes: 896 in, 4864 inter
    for T in (1, 300, 600):  # 600: INT8 weights widened to bf16 first
        for n, k, sw in ((m.qkv_out, m.hidden, False), (2 * m.inter, m.hidden, True), (m.hidden, m.inter, False)):
            x = torch.randn(T, k, device=DEV).to(BF)
            w = (torch.randn(n, k, device=DEV) * k**-0.5).to(BF)
            for ww in (w, q8(w)):
                f, r = (TR.swiglu, R.swiglu) if sw else (TR.linear, R.linear)
                assert rel(f(x, ww), r(x, ww)) < 2e-2, (variant, T, n, k)


def _pool(m: ModelShape, L: int, int8: bool, page: int = 64, spare: int = 3):
    """A page pool with L random positions written (last page partly filled), pages scattered."""
    n = -(-L // page)
    kv = PagedKVCache(1, n + spare, page, m.kv_heads, m.head_dim, BF, int8, DEV)
    if int8:
        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
    bt = torch.randperm(n + spare, device=DEV)[: n + 1].to(torch.int32)
    layer = kv.layers[0]
    k = torch.randn(L, m.kv_heads, m.head_dim, device=DEV).to(BF)
    v = torch.randn(L, m.kv_heads, m.head_dim, device=DEV).to(BF)
    R.write_kv(layer, k, v, bt, torch.arange(L, device=DEV))
    return kv, layer, bt


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16cache", "int8cache"])
def test_qk_norm_rope_kv_write(TR, name, int8):
    m = MODELS[name]
    d = m.head_dim
    for T, start in ((1, 0), (1, 4159), (16, 1000), (300, 64 * 7 + 5)):
        L = start + T
        kv1, l1, bt = _pool(m, L, int8)
        kv2 = PagedKVCache(1, kv1.num_pages, 64, m.kv_heads, d, BF, int8, DEV)
        kv2.k.copy_(kv1.k), kv2.v.copy_(kv1.v)
        if int8:
            kv2.k_scale.copy_(kv1.k_scale), kv2.v_scale.copy_(kv1.v_scale)
        qkv = torch.randn(T, m.qkv_out, device=DEV).to(BF)
        q, k, v = qkv.split([m.heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
        q, k, v = q.view(T, m.heads, d), k.view(T, m.kv_heads, d), v.view(T, m.kv_heads, d)
        qn = torch.randn(d, device=DEV).to(BF) if m.qk_norm else None
        kn = torch.randn(d, device=DEV).to(BF) if m.qk_norm else None
        ang = torch.rand(L + 10, d // 2, device=DEV) * 30
        cos, sin = ang.cos(), ang.sin()
        pos = torch.arange(start, L, dtype=torch.int32, device=DEV)
        qa = TR.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, l1, bt, pos)
        qb = R.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, kv2.layers[0], bt, pos)
        assert rel(qa, qb) < 1e-2
        # pools: the same slots written (never-written slots hold the same NaN poison in both)
        pairs = [(kv1.k, kv2.k, kv1.k_scale, kv2.k_scale), (kv1.v, kv2.v, kv1.v_scale, kv2.v_scale)]
        for a, b, sa, sb in pairs:
            if int8:
                assert torch.equal(torch.isnan(sa), torch.isnan(sb))
                ok = ~torch.isnan(sb)
                da, db = a[ok].float() * sa[ok][:, None], b[ok].float() * sb[ok][:, None]
                assert ((da - db).abs() <= 1.01 * sb[ok][:, None] + 1e-2 * db.abs()).all()
            else:
                assert torch.equal(torch.isnan(a), torch.isnan(b))
                ok = ~torch.isnan(b)
                assert rel(a[ok], b[ok]) < 1e-2


ATTN = [(1, 0), (1, 777), (1, 8191), (7, 100), (16, 5000), (300, 0), (512, 3000), (64, 12345)]


@pytest.mark.parametrize("name", MODEL_NAMES + ["gqa1", "gqa8"])
@pytest.mark.parametrize("int8", [False, True], ids=["bf16cache", "int8cache"])
def test_attention(TR, name, int8):
    m = SHAPES[name]
    cases = list(ATTN)
    if name in ("qwen3-4b", "qwen2.5-0.5b"):
        cases += [(1, 32767), (16, 32000), (8192, 0)]
    for T, start in cases:
        L = start + T
        _, layer, bt = _pool(m, L, int8)
        q = torch.randn(T, m.heads, m.head_dim, device=DEV).to(BF)
        pos = torch.arange(start, L, dtype=torch.int32, device=DEV)
        got = TR.attention(q, layer, bt, pos, m.head_dim**-0.5)
        ref = R.attention(q, layer, bt, pos, m.head_dim**-0.5)
        assert rel(got, ref) < 2e-2, (T, start)


def test_argmax(TR):
    for V in (151936, 49152):
        x = torch.randn(16, V, device=DEV) * 4
        x[3, 100] = x[3, V - 1] = x[3, 5000] = 99.0
        assert torch.equal(TR.argmax(x), R.argmax(x))


@pytest.mark.parametrize("t,k,p", [(0.7, 20, 0.95), (1.0, 0, 0.9), (1.0, 50, 1.0), (0.6, 0, 1.0)])
def test_sample(TR, t, k, p):
    V, N = 151936, 8192
    x = torch.randn(1, V, device=DEV) * 2.5
    s = TR.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator(DEV).manual_seed(1))
    pr = filtered_probs(x, t, k, p)[0]
    assert (pr[s] > 0).all()
    hist = torch.bincount(s, minlength=V).double() / N
    kept = int((pr > 0).sum())
    tv = 0.5 * (hist - pr.double()).abs().sum().item()
    assert tv < 0.05 + 0.6 * (min(kept, N) / N) ** 0.5, (tv, kept)


def test_decode_step_in_cuda_graph(TR):
    """A decode step's ops captured once replay correctly as the context grows (no host reads)."""
    m = MODELS["qwen3-0.6b"]
    d = m.head_dim
    kv, layer, bt = _pool(m, 300, False)
    kv2 = PagedKVCache(1, kv.num_pages, 64, m.kv_heads, d, BF, False, DEV)
    x = torch.randn(1, m.hidden, device=DEV).to(BF)
    w_qkv = (torch.randn(m.qkv_out, m.hidden, device=DEV) * 0.03).to(BF)
    w_o = q8((torch.randn(m.hidden, m.heads * d, device=DEV) * 0.03).to(BF))
    w_head = (torch.randn(m.vocab, m.hidden, device=DEV) * 0.03).to(BF)
    norm = torch.randn(d, device=DEV).to(BF)
    ang = torch.rand(400, d // 2, device=DEV)
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([250], dtype=torch.int32, device=DEV)

    def step(ops, lay):
        qkv = ops.linear(x, w_qkv)
        q, k, v = qkv.split([m.heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
        q = ops.qk_norm_rope_kv_write(q.view(1, m.heads, d), k.view(1, m.kv_heads, d),
                                      v.view(1, m.kv_heads, d), norm, norm, 1e-6, cos, sin, lay, bt, pos)
        o = ops.linear(ops.attention(q, lay, bt, pos, d**-0.5).reshape(1, -1), w_o)
        logits = ops.lm_head(o, w_head)
        return logits, ops.argmax(logits), ops.sample(logits, 0.8, 20, 0.9, None)

    step(TR, layer)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(TR, layer)
    for p in (250, 251, 299, 300 - 1):
        pos.fill_(p)
        kv2.k.copy_(kv.k), kv2.v.copy_(kv.v)
        g.replay()
        torch.cuda.synchronize()
        ref_logits, ref_tok, _ = step(R, kv2.layers[0])
        assert rel(out[0], ref_logits) < 2e-2
        assert torch.equal(out[1], ref_tok) or ref_logits[0, out[1]] >= ref_logits.max() - 1e-2
        assert 0 <= int(out[2]) < m.vocab
