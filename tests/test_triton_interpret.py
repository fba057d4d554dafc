"""The Triton backend against the reference, on the CPU under ``TRITON_INTERPRET=1`` (CI).

Every op on small shapes with fresh random inputs: 1 and several rows, GQA ratios 1..8, BF16 and
INT8 KV caches with pages partly filled and scattered through the pool, BF16 and INT8 weights.
Every tensor the code allocates with ``torch.empty`` (outputs, workspaces, the KV pool) is poisoned
with NaN first, so an element nobody wrote fails the comparison. Interpreter limits (triton 3.6):
bf16 ``tl.dot`` is wrong (the backend runs dots in float32 when interpreting) and numpy >= 2.4
breaks loops over runtime ints. The last test compiles every kernel for sm_90 at the shipped
models' shapes, without a GPU, in a subprocess (the interpreter flag must be off there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

if torch.cuda.is_available():  # on the GPU machine the compiled backend is tested in tests/gpu
    pytest.skip("interpreter tests are for machines without a GPU", allow_module_level=True)
assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"

pytest.importorskip("triton")

from tests.numerics import assert_int8_kv_write_matches_quantize_int8, filtered_probs, rel  # noqa: E402
from tileinfer.core.kv_cache import PagedKVCache  # noqa: E402
from tileinfer.ops import Int8Weight  # noqa: E402
from tileinfer.ops import reference as R  # noqa: E402
from tileinfer.ops import triton as TR  # noqa: E402
from tileinfer.ops.triton import gemm, sampling  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
@pytest.fixture(autouse=True)
def poison_and_seed(poisoned_empty, fresh_seed):
    """Every torch.empty starts as NaN / garbage; every test draws its own inputs (tests/conftest.py)."""


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def q8(w: torch.Tensor) -> Int8Weight:
    q, s = R.quantize_int8(w.float())
    return Int8Weight(q, s)


# ---------------------------------------------------------------------------- norms, embedding


@pytest.mark.parametrize("dt", DTYPES)
def test_embedding(dt):
    table = torch.randn(50, 72).to(dt)
    ids = torch.randint(0, 50, (9,))
    assert torch.equal(TR.embedding(ids, table), R.embedding(ids, table))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (3, 1000)])
def test_rms_norm_and_add(dt, rows, n):
    x, r = torch.randn(rows, n).to(dt), torch.randn(rows, n).to(dt)
    w = torch.randn(n)
    assert rel(TR.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6)) < TOL[dt]
    y, s = TR.add_rms_norm(x, r, w.to(dt), 1e-5)
    y2, s2 = R.add_rms_norm(x, r, w.to(dt), 1e-5)
    assert torch.equal(s, s2)
    assert rel(y, y2) < TOL[dt]


def test_rms_norm_per_head_weight():
    x, w = torch.randn(5, 3, 32), torch.randn(3, 32)
    assert rel(TR.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6)) < 1e-5


# ---------------------------------------------------------------------------- linear layers


GEMM_KINDS = {  # kernel variants forced through the tile table's override hook
    "table": {},
    "ptr": {"gemm_bf16": (32, 32, 32, 8, 4, 2, "ptr"), "gemm_int8": (32, 32, 32, 8, 4, 2, "ptr")},
    "tma": {"gemm_bf16": (32, 32, 32, 8, 4, 2, "tma"), "gemm_int8": (32, 32, 32, 8, 4, 2, "tma"),
            "gemv1_int8": (4, 64, 4, 2, 2)},  # and the int32-word INT8 GEMV with prefetch
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 16, 40])
@pytest.mark.parametrize("K", [64, 200])
@pytest.mark.parametrize("kind", list(GEMM_KINDS))
def test_linear_swiglu_lm_head(monkeypatch, dt, T, K, kind):
    if kind != "table" and T not in (1, 40):
        pytest.skip("the variants differ only in the GEMM and the one-row GEMV")
    for key, cfg in GEMM_KINDS[kind].items():
        monkeypatch.setitem(gemm._OVERRIDE, key, cfg)
    if kind == "tma":  # and the INT8 prefill path that widens the weight to bf16 first
        monkeypatch.setattr(gemm, "INT8_DEQUANT_ROWS", 32)
    N = 72
    x = torch.randn(T, K).to(dt)
    w = (torch.randn(N, K) / K**0.5).to(dt)
    b = torch.randn(N).to(dt)
    wq = q8(w)
    assert rel(TR.linear(x, w), R.linear(x, w)) < TOL[dt]
    assert rel(TR.linear(x, w, b), R.linear(x, w, b)) < TOL[dt]
    assert rel(TR.linear(x, wq), R.linear(x, wq)) < TOL[dt]
    assert rel(TR.linear(x, wq, b), R.linear(x, wq, b)) < TOL[dt]
    assert rel(TR.swiglu(x, w), R.swiglu(x, w)) < 2 * TOL[dt]
    assert rel(TR.swiglu(x, wq), R.swiglu(x, wq)) < 2 * TOL[dt]
    for ww in (w, wq, w.float()):
        out = TR.lm_head(x, ww)
        assert out.dtype == torch.float32
        assert rel(out, R.lm_head(x, ww)) < 1e-5


# ---------------------------------------------------------------------------- prologue: norm + rope + kv write


def _cache(dt, int8, pages, page, kvh, d):
    return PagedKVCache(1, pages, page, kvh, d, dt, int8=int8)


def _nan_equal(a, b) -> bool:
    """Equal where written; NaN (never written) in exactly the same places."""
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    return torch.equal(na, nb) and torch.equal(a.float()[~na], b.float()[~nb])


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16cache", "int8cache"])
@pytest.mark.parametrize("norm", [None, "vec", "per_head"])
@pytest.mark.parametrize("T,start,kvh,group", [(1, 37, 2, 4), (7, 12, 1, 3), (20, 0, 3, 1)])
def test_qk_norm_rope_kv_write(dt, int8, norm, T, start, kvh, group):
    H, d, page = kvh * group, 32, 8
    pages = (start + T) // page + 3
    qkv = torch.randn(T, (H + 2 * kvh) * d).to(dt)
    q, k, v = qkv.split([H * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(T, H, d), k.view(T, kvh, d), v.view(T, kvh, d)
    qn = kn = None
    if norm == "vec":
        qn, kn = torch.randn(d).to(dt), torch.randn(d).to(dt)
    elif norm == "per_head":
        qn, kn = torch.randn(H, d).to(dt), torch.randn(kvh, d).to(dt)
    ang = torch.rand(start + T + 5, d // 2) * 6
    cos, sin = ang.cos(), ang.sin()
    bt = torch.randperm(pages + 2)[:pages].to(torch.int32)
    pos = torch.arange(start, start + T, dtype=torch.int32)
    c1, c2 = _cache(dt, int8, pages + 2, page, kvh, d), _cache(dt, int8, pages + 2, page, kvh, d)
    for a, b in ((c1.k, c2.k), (c1.v, c2.v)):  # identical poison in both pools
        b.copy_(a)
    if int8:
        c1.k_scale.fill_(float("nan")), c1.v_scale.fill_(float("nan"))
        c2.k_scale.fill_(float("nan")), c2.v_scale.fill_(float("nan"))
    qa = TR.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, c1.layers[0], bt, pos)
    qb = R.qk_norm_rope_kv_write(q, k, v, qn, kn, 1e-6, cos, sin, c2.layers[0], bt, pos)
    assert rel(qa, qb) < TOL[dt]
    if not int8:
        for a, b in ((c1.k, c2.k), (c1.v, c2.v)):
            if dt == torch.float32:
                assert (torch.isnan(a) == torch.isnan(b)).all()
                assert rel(torch.nan_to_num(a), torch.nan_to_num(b)) < 1e-5
            else:  # bit-exact but for a rounding flip where rsqrt differs in the last bit
                assert (torch.isnan(a) == torch.isnan(b)).all()
                assert rel(torch.nan_to_num(a), torch.nan_to_num(b)) < 1e-2
    else:
        assert _nan_equal(torch.isnan(c1.k_scale), torch.isnan(c2.k_scale))
        for (a, sa), (b, sb) in (((c1.k, c1.k_scale), (c2.k, c2.k_scale)),
                                 ((c1.v, c1.v_scale), (c2.v, c2.v_scale))):
            written = ~torch.isnan(sb)
            assert torch.equal(~torch.isnan(sa), written), "scales written at other slots"
            assert torch.equal(a[~written], b[~written]), "values written at other slots"
            da = a[written].float() * sa[written][:, None]
            db = b[written].float() * sb[written][:, None]
            # the same vector up to one quantisation step (the inputs may differ in the last bf16 bit)
            step = sb[written][:, None].clamp_min(1e-12)
            assert ((da - db).abs() <= 1.01 * step + 1e-2 * db.abs()).all()
            if dt == torch.float32:
                assert (a[written] != b[written]).float().mean() < 0.01


def test_int8_kv_write_quantizes_bitwise_like_the_reference():
    """Codes and scales of the fused KV write equal ``reference.quantize_int8`` bit for bit
    (tests/gpu/test_int8_kv_quantization.py on the GPU)."""
    assert_int8_kv_write_matches_quantize_int8(TR, "cpu", T=37, kvh=3, d=64, page=16)


# ---------------------------------------------------------------------------- attention


def _filled_cache(dt, int8, L, page, kvh, d, spare=3):
    n_pages = -(-L // page)
    kv = _cache(dt, int8, n_pages + spare, page, kvh, d)
    if int8:  # poison: random ints, NaN scales
        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
        kv.k_scale.fill_(float("nan")), kv.v_scale.fill_(float("nan"))
    bt = torch.randperm(n_pages + spare)[: n_pages + 1].to(torch.int32)  # one page to spare
    layer = kv.layers[0]
    R.write_kv(layer, torch.randn(L, kvh, d).to(dt), torch.randn(L, kvh, d).to(dt), bt, torch.arange(L))
    return layer, bt


ATTN_CASES = [  # (T, start, kv_heads, group, head_dim, page): decode, verify, prefill chunks
    (1, 0, 2, 4, 32, 16), (1, 37, 1, 8, 32, 16), (1, 100, 3, 2, 64, 16),
    (5, 60, 1, 3, 64, 16), (16, 9, 2, 2, 32, 8),
    (40, 23, 2, 2, 32, 16), (70, 0, 1, 8, 16, 32), (33, 50, 4, 1, 32, 16),
]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("int8", [False, True], ids=["bf16cache", "int8cache"])
@pytest.mark.parametrize("T,start,kvh,group,d,page", ATTN_CASES)
def test_attention(dt, int8, T, start, kvh, group, d, page):
    H, L = kvh * group, start + T
    layer, bt = _filled_cache(dt, int8, L, page, kvh, d)
    q = torch.randn(T, H, d).to(dt)
    pos = torch.arange(start, L, dtype=torch.int32)
    got = TR.attention(q, layer, bt, pos, d**-0.5)
    ref = R.attention(q, layer, bt, pos, d**-0.5)
    assert rel(got, ref) < TOL[dt]


def test_attention_verify_rows_of_unequal_positions():
    """Rows need not be consecutive: each attends up to its own position (positions on device)."""
    layer, bt = _filled_cache(torch.float32, False, 90, 16, 2, 32)
    q = torch.randn(4, 4, 32)
    pos = torch.tensor([89, 3, 64, 40], dtype=torch.int32)
    assert rel(TR.attention(q, layer, bt, pos, 0.2), R.attention(q, layer, bt, pos, 0.2)) < 1e-5


# ---------------------------------------------------------------------------- sampling


def test_argmax_ties_lowest_id():
    x = torch.randn(3, 10000)
    x[1, 7000] = x[1, 9000] = x[1, 5] = 50.0
    x[2, :] = 1.0
    assert torch.equal(TR.argmax(x), R.argmax(x))


@pytest.mark.parametrize("V,t,k,p", [(150, 1.0, 0, 1.0), (150, 0.7, 12, 0.9), (300, 1.0, 0, 0.6),
                                     (300, 1.3, 5, 1.0), (300, 0.5, 1, 1.0)])
def test_sample_distribution(monkeypatch, V, t, k, p):
    """Small candidate settings so that both the candidate path and the full-pass fallback run."""
    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", 64)  # several blocks per row at a small vocab
    monkeypatch.setattr(sampling, "CAND_CHUNK", 64)
    monkeypatch.setattr(sampling, "CAND_K", 8)
    monkeypatch.setattr(sampling, "MERGE_K", 16)
    N = 32
    x = torch.randn(1, V) * 2
    x[0, 3] = x[0, 77] = x[0].max() + 0.5  # a tie at the top
    s = TR.sample(x.expand(N, V).contiguous(), t, k, p, torch.Generator().manual_seed(3))
    pr = filtered_probs(x, t, k, p)[0]
    assert s.dtype == torch.int64 and s.shape == (N,)
    assert (pr[s] > 0).all(), "a token outside the top-k / top-p set"
    kept = int((pr > 0).sum())
    hist = torch.bincount(s, minlength=V).double() / N
    tv = 0.5 * (hist - pr.double()).abs().sum().item()
    assert tv < 0.15 + 0.5 * (kept / N) ** 0.5  # loose: N is small under the interpreter


# ---------------------------------------------------------------------------- sm_90 compile


def test_every_kernel_compiles_for_sm90():
    """Every kernel at the shipped models' specialisations compiles for sm_90 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tileinfer.bench.aot_triton"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "kernels compiled for sm_90" in p.stdout
    print(p.stdout.splitlines()[-1], f"({time.perf_counter() - t0:.0f}s)")
