"""cuTile backend against the reference ops on a CUDA GPU, at the real model shapes.

Run on the H200: ``pytest -m gpu tests/gpu/test_cutile_gpu.py``. Every case draws fresh random
inputs, poisons the outputs (NaN, or a sentinel for integer outputs) so an unwritten element
fails, and compares with ``tileinfer.ops.reference`` run on the same device. Tolerances follow the
dtype: float32 results (logits) to ~1e-5 relative, BF16 results to 1e-2 relative in norm
(``||out - ref|| / ||ref||``; one BF16 rounding is 2**-9), INT8 codes to one step.
"""

from __future__ import annotations

import pytest
import torch

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Int8Weight
from tileinfer.ops import reference as ref

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# name: (hidden, heads, kv_heads, head_dim, inter, vocab, qkv bias, qk norm)
MODELS = {
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152, False, False),
    "qwen2.5-0.5b": (896, 14, 2, 64, 4864, 151936, True, False),
    "qwen2.5-1.5b": (1536, 12, 2, 128, 8960, 151936, True, False),
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936, False, True),
    "qwen3-4b": (2560, 32, 8, 128, 9728, 151936, False, True),
    "qwen3-8b": (4096, 32, 8, 128, 12288, 151936, False, True),
}
# extra GQA shapes (ratio 1 and 8) for the attention kernels
ATTN_SHAPES = {name: (m[1], m[2], m[3]) for name, m in MODELS.items()}
ATTN_SHAPES.update({"gqa1": (8, 8, 128), "gqa8": (64, 8, 128)})
STEPS = (1, 5, 16, 300, 512)
PAGE = 64


@pytest.fixture(scope="module")
def ops():
    ct_ops = pytest.importorskip("tileinfer.ops.cutile")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return ct_ops


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    o, w = out.double(), want.double()
    return float((o - w).norm() / w.norm().clamp_min(1e-30))


def check(out: torch.Tensor, want: torch.Tensor, tol: float, what: str = ""):
    assert out.shape == want.shape, (what, out.shape, want.shape)
    assert out.dtype == want.dtype, (what, out.dtype, want.dtype)
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or wrong masking)"
    e = rel_err(out, want)
    assert e < tol, f"{what}: relative error {e:.3g} >= {tol}"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if t.is_floating_point() else torch.full_like(t, -77)


def int8_weight(n: int, k: int, dev) -> Int8Weight:
    q, s = ref.quantize_int8(torch.randn(n, k, device=dev) * 0.05)
    return Int8Weight(q, s)


def bf16(*shape, scale=1.0, dev="cuda"):
    return (torch.randn(*shape, device=dev) * scale).to(torch.bfloat16)


# ---------------------------------------------------------------------------- norms, embedding


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b", "qwen3-8b"])
@pytest.mark.parametrize("T", [1, 5, 512])
def test_embedding(ops, model, T):
    hidden, vocab = MODELS[model][0], MODELS[model][5]
    table = bf16(vocab, hidden)
    ids = torch.randint(0, vocab, (T,), device="cuda")
    ids[0] = vocab - 1
    assert torch.equal(ops.embedding(ids, table), ref.embedding(ids, table))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", [1, 300])
def test_rms_norm_and_add(ops, model, T):
    hidden = MODELS[model][0]
    x, r, w = bf16(T, hidden, scale=3.0), bf16(T, hidden), bf16(hidden)
    check(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), 1e-2, "rms_norm")
    out, s = ops.add_rms_norm(x, r, w, 1e-6)
    want, want_s = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, want_s), "add_rms_norm: the rounded sum must match exactly"
    check(out, want, 1e-2, "add_rms_norm")


def test_rms_norm_per_head_weight(ops):
    x, w = bf16(5, 16, 128), bf16(16, 128)
    check(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), 1e-2, "per-head rms_norm")


# ------------------------------------------------------------------------------ linear layers


def _mats(model):
    hidden, h, kvh, d, inter, vocab, bias, _ = MODELS[model]
    return {"qkv": ((h + 2 * kvh) * d, hidden, bias), "o": (hidden, h * d, False),
            "down": (hidden, inter, False)}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", STEPS)
@pytest.mark.parametrize("int8", [False, True])
def test_linear(ops, model, T, int8):
    for name, (n, k, has_bias) in _mats(model).items():
        x = bf16(T, k)
        w = int8_weight(n, k, "cuda") if int8 else bf16(n, k, scale=0.05)
        b = bf16(n) if has_bias else None
        check(ops.linear(x, w, b), ref.linear(x, w, b), 1e-2, f"{model} {name} T={T} int8={int8}")


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", STEPS)
@pytest.mark.parametrize("int8", [False, True])
def test_swiglu(ops, model, T, int8):
    hidden, inter = MODELS[model][0], MODELS[model][4]
    x = bf16(T, hidden)
    w = int8_weight(2 * inter, hidden, "cuda") if int8 else bf16(2 * inter, hidden, scale=0.05)
    check(ops.swiglu(x, w), ref.swiglu(x, w), 1e-2, f"{model} swiglu T={T} int8={int8}")


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b", "qwen3-8b"])
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("int8", [False, True])
def test_lm_head(ops, model, T, int8):
    hidden, vocab = MODELS[model][0], MODELS[model][5]
    x = bf16(T, hidden)
    w = int8_weight(vocab, hidden, "cuda") if int8 else bf16(vocab, hidden, scale=0.05)
    out = ops.lm_head(x, w)
    check(out, ref.lm_head(x, w), 1e-4, f"{model} lm_head T={T} int8={int8}")


def test_linear_split_k_matches_single_pass(ops):
    from tileinfer.ops.cutile import gemm as L

    x, w = bf16(3, 9728), bf16(2560, 9728, scale=0.05)
    split = ops.linear(x, w)
    L.SPLIT_K = False
    try:
        single = ops.linear(x, w)
    finally:
        L.SPLIT_K = True
    check(split, ref.linear(x, w), 1e-2, "split-K")
    check(single, ref.linear(x, w), 1e-2, "single pass")


# ------------------------------------------------------------------------ KV cache, attention


def make_layer(num_pages, kvh, d, int8, dev="cuda"):
    """A cache layer poisoned everywhere (NaN values / NaN scales / int8 sentinel)."""
    if int8:
        return KVLayer(torch.full((num_pages, kvh, PAGE, d), -128, dtype=torch.int8, device=dev),
                       torch.full((num_pages, kvh, PAGE, d), -128, dtype=torch.int8, device=dev),
                       torch.full((num_pages, kvh, PAGE), float("nan"), device=dev),
                       torch.full((num_pages, kvh, PAGE), float("nan"), device=dev))
    return KVLayer(torch.full((num_pages, kvh, PAGE, d), float("nan"), dtype=torch.bfloat16,
                              device=dev),
                   torch.full((num_pages, kvh, PAGE, d), float("nan"), dtype=torch.bfloat16,
                              device=dev))


def clone_layer(L: KVLayer) -> KVLayer:
    return KVLayer(L.k.clone(), L.v.clone(), None if L.k_scale is None else L.k_scale.clone(),
                   None if L.v_scale is None else L.v_scale.clone())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bitwise equality (NaN poison equal to itself)."""
    if a.is_floating_point():
        return (a == b) | (torch.isnan(a) & torch.isnan(b))
    return a == b


def rope_tables(max_pos, d, dev="cuda"):
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dev), ang.sin().to(dev)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("int8", [False, True])
def test_qk_norm_rope_kv_write(ops, model, T, int8):
    hidden, h, kvh, d, _, _, _, qk_norm = MODELS[model]
    max_pos, num_pages = 4096, 4096 // PAGE
    cos, sin = rope_tables(max_pos, d)
    start = int(torch.randint(0, max_pos - T, ()).item())
    positions = torch.arange(start, start + T, dtype=torch.int32, device="cuda")
    bt = torch.randperm(num_pages, device="cuda").to(torch.int32)
    qkv = bf16(T, (h + 2 * kvh) * d, scale=2.0)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(T, h, d), k.view(T, kvh, d), v.view(T, kvh, d)
    if qk_norm:
        qn, kn = bf16(d), bf16(d)
    else:
        qn = kn = None
    L_ref = make_layer(num_pages, kvh, d, int8)
    L_out = clone_layer(L_ref)
    want = ref.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, L_ref, bt, positions)
    got = ops.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, L_out, bt, positions)
    check(got, want, 1e-2, "rotated q")
    pages = bt.long()[positions.long() // PAGE]
    slots = positions.long() % PAGE
    written = torch.zeros(num_pages, PAGE, dtype=torch.bool, device="cuda")
    written[pages, slots] = True
    for name in ("k", "v") + (("k_scale", "v_scale") if int8 else ()):
        a, b = getattr(L_out, name), getattr(L_ref, name)
        untouched = ~written[:, None, :]
        if a.dim() == 4:
            untouched = untouched[..., None]
        assert bool(same_bits(a, b).masked_select(untouched.expand_as(a)).all()), \
            f"{name}: a slot outside positions was written"
    wk = L_ref.k[pages, :, slots]
    gk = L_out.k[pages, :, slots]
    wv, gv = L_ref.v[pages, :, slots], L_out.v[pages, :, slots]
    if not int8:
        check(gk, wk, 1e-2, "k cache")
        assert torch.equal(gv, wv), "v cache must be copied exactly"
        return
    ks_w, ks_g = L_ref.k_scale[pages, :, slots], L_out.k_scale[pages, :, slots]
    vs_w, vs_g = L_ref.v_scale[pages, :, slots], L_out.v_scale[pages, :, slots]
    # v goes in unchanged, so its scales match to float32 rounding and its codes up to a rare
    # one-step flip where x / scale lands within an ulp of a .5 tie
    check(vs_g, vs_w, 1e-6, "v scale")
    assert int((gv.int() - wv.int()).abs().max()) <= 1
    assert float((gv != wv).float().mean()) < 1e-3, "int8 v codes differ too often"
    check(ks_g, ks_w, 1e-2, "k scale")
    check(gk.float() * ks_g[..., None], wk.float() * ks_w[..., None], 1e-2, "dequantized k")
    assert int((gk.int() - wk.int()).abs().max()) <= 1


def test_qk_norm_per_head_weights(ops):
    h, kvh, d, T = 16, 8, 128, 5
    cos, sin = rope_tables(1024, d)
    positions = torch.arange(100, 100 + T, dtype=torch.int32, device="cuda")
    bt = torch.randperm(16, device="cuda").to(torch.int32)
    q, k, v = bf16(T, h, d), bf16(T, kvh, d), bf16(T, kvh, d)
    qn, kn = bf16(h, d), bf16(kvh, d)
    L_ref, L_out = make_layer(16, kvh, d, False), make_layer(16, kvh, d, False)
    want = ref.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, L_ref, bt, positions)
    got = ops.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, L_out, bt, positions)
    check(got, want, 1e-2, "q with per-head norm")
    assert bool(same_bits(L_out.k, L_ref.k).float().mean() > 0.99)


def filled_layer(ctx, kvh, d, int8, extra_pages=3):
    """A layer whose first ``ctx`` positions (through a shuffled block table) hold random data and
    every other slot is poison; returns (layer, block_table)."""
    n_pages = -(-ctx // PAGE) + extra_pages
    L = make_layer(n_pages, kvh, d, int8)
    bt = torch.randperm(n_pages, device="cuda").to(torch.int32)
    pos = torch.arange(ctx, device="cuda")
    pages, slots = bt.long()[pos // PAGE], pos % PAGE
    k, v = bf16(ctx, kvh, d), bf16(ctx, kvh, d)
    if int8:
        kq, ks = ref.quantize_int8(k)
        vq, vs = ref.quantize_int8(v)
        L.k[pages, :, slots], L.v[pages, :, slots] = kq, vq
        L.k_scale[pages, :, slots], L.v_scale[pages, :, slots] = ks, vs
    else:
        L.k[pages, :, slots], L.v[pages, :, slots] = k, v
    return L, bt


ATTN_CASES = []
for _name in ATTN_SHAPES:
    for _int8 in (False, True):
        for _T, _ctx in ((1, 1), (1, 37), (5, 1000), (16, 130), (300, 300), (300, 1000)):
            ATTN_CASES.append((_name, _int8, _T, _ctx))
for _name in ("qwen3-4b", "gqa8", "qwen2.5-0.5b"):
    for _int8 in (False, True):
        for _T, _ctx in ((1, 8192), (1, 32768), (16, 32768 - 7), (512, 8192)):
            ATTN_CASES.append((_name, _int8, _T, _ctx))
ATTN_CASES.append(("qwen3-4b", False, 512, 32768))


@pytest.mark.parametrize("name,int8,T,ctx", ATTN_CASES)
def test_attention(ops, name, int8, T, ctx):
    h, kvh, d = ATTN_SHAPES[name]
    L, bt = filled_layer(ctx, kvh, d, int8)
    positions = torch.arange(ctx - T, ctx, dtype=torch.int32, device="cuda")
    q = bf16(T, h, d)
    sm = d ** -0.5
    got = ops.attention(q, L, bt, positions, sm)
    want = ref.attention(q, L, bt, positions, sm)
    check(got, want, 1e-2, f"attention {name} int8={int8} T={T} ctx={ctx}")


def test_attention_positions_not_contiguous(ops):
    """Rows at arbitrary positions (each sees keys 0..its own position)."""
    h, kvh, d = 32, 8, 128
    L, bt = filled_layer(2000, kvh, d, False)
    for T in (5, 40):
        positions = torch.randint(0, 2000, (T,), device="cuda").to(torch.int32)
        positions[0] = 1999
        q = bf16(T, h, d)
        check(ops.attention(q, L, bt, positions, 0.1), ref.attention(q, L, bt, positions, 0.1),
              1e-2, f"scattered positions T={T}")


# ------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("V", [49152, 151936])
@pytest.mark.parametrize("T", [1, 5])
def test_argmax(ops, V, T):
    logits = torch.randn(T, V, device="cuda") * 4
    assert torch.equal(ops.argmax(logits), ref.argmax(logits))
    logits[:, 7] = 100.0
    logits[:, V - 3] = 100.0      # tie: the lowest id wins
    logits[-1, :] = 0.0           # all equal
    assert torch.equal(ops.argmax(logits), ref.argmax(logits))


def _kept_sets(logits, temperature, top_k, top_p):
    """Boolean [T, V]: tokens the reference's filtering keeps."""
    x = logits.float() / max(temperature, 1e-6)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    xm = x.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sx, order = xm.sort(dim=-1, descending=True)
        p = sx.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p
        keep_sorted = ~drop
        k2 = torch.zeros_like(keep)
        k2.scatter_(-1, order, keep_sorted)
        keep &= k2
    return keep, x.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.9), (50, 0.8), (1, 1.0)])
def test_sample_stays_in_kept_set(ops, top_k, top_p):
    T, V = 64, 151936
    logits = torch.randn(T, V, device="cuda") * 3
    keep, _ = _kept_sets(logits, 0.7, top_k, top_p)
    tok = ops.sample(logits, 0.7, top_k, top_p, None)
    assert tok.dtype == torch.int64 and tok.shape == (T,)
    assert bool(keep.gather(1, tok[:, None]).all()), "sampled a token the filters drop"
    if top_k == 1:
        assert torch.equal(tok, ref.argmax(logits))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 1.0), (0, 0.7), (10, 0.6)])
def test_sample_distribution(ops, top_k, top_p):
    """Empirical frequencies over many rows of the same logits match the filtered softmax."""
    V, N = 40, 20000
    base = torch.randn(V, device="cuda") * 1.5
    logits = base.expand(N, V).contiguous()
    keep, xm = _kept_sets(logits[:1], 0.8, top_k, top_p)
    probs = xm.softmax(-1)[0]
    g = torch.Generator(device="cuda").manual_seed(1234)
    tok = ops.sample(logits, 0.8, top_k, top_p, g)
    freq = torch.bincount(tok, minlength=V).double() / N
    assert float((freq - probs.double()).abs().max()) < 0.015
    assert bool(keep[0][tok].all())
    g2 = torch.Generator(device="cuda").manual_seed(1234)
    assert torch.equal(tok, ops.sample(logits, 0.8, top_k, top_p, g2)), "seeded draws reproduce"


# ------------------------------------------------------------------------------- CUDA graphs


def test_decode_step_replays_from_cuda_graph(ops):
    """A decode step (norm, qkv GEMV, prologue, split-KV attention, o_proj, argmax) captured once
    and replayed at a later position: the context length comes from `positions` on the device."""
    hidden, h, kvh, d = 1024, 16, 8, 128
    ctx0 = 700
    L, bt = filled_layer(ctx0 + 64, kvh, d, False)
    cos, sin = rope_tables(4096, d)
    w_norm, w_o = bf16(hidden), bf16(hidden, h * d, scale=0.05)
    w_qkv = bf16((h + 2 * kvh) * d, hidden, scale=0.05)
    qn, kn = bf16(d), bf16(d)
    w_lm = bf16(4096, hidden, scale=0.05)
    x = bf16(1, hidden)
    positions = torch.tensor([ctx0], dtype=torch.int32, device="cuda")

    def step(o):
        hs = o.rms_norm(x, w_norm, 1e-6)
        qkv = o.linear(hs, w_qkv)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = o.qk_norm_rope_kv_write(q.view(1, h, d), k.view(1, kvh, d), v.view(1, kvh, d), qn, kn,
                                    1e-6, cos, sin, L, bt, positions)
        a = o.attention(q, L, bt, positions, d ** -0.5)
        y = o.linear(a.reshape(1, h * d), w_o)
        return y, o.argmax(o.lm_head(y, w_lm))

    step(ops)                       # compile + allocate workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, tok_g = step(ops)
    for pos in (ctx0 + 5, ctx0 + 40):
        positions.fill_(pos)
        x.copy_(bf16(1, hidden))
        graph.replay()
        torch.cuda.synchronize()
        # reference on a copy of the state after the replay: attention must see pos + 1 keys
        L_ref = clone_layer(L)
        hs = ref.rms_norm(x, w_norm, 1e-6)
        qkv = ref.linear(hs, w_qkv)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = ref.qk_norm_rope_kv_write(q.view(1, h, d), k.view(1, kvh, d), v.view(1, kvh, d), qn,
                                      kn, 1e-6, cos, sin, L_ref, bt, positions)
        a = ref.attention(q, L_ref, bt, positions, d ** -0.5)
        y_r = ref.linear(a.reshape(1, h * d), w_o)
        check(y_g, y_r, 2e-2, f"graph replay at position {pos}")
        assert torch.equal(tok_g, ref.argmax(ref.lm_head(y_g, w_lm)))
