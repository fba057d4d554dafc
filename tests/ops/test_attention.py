"""Paged attention of every backend against the reference, and the reference against dense attention.

Caches come from tests/numerics.py: positions 0..L-1 written, the last page partly filled, pages
scattered through a pool whose other slots are NaN (or NaN-scaled) poison, the block table one
page longer than the context. Small (interpreter): float32 and bf16 queries over BF16 and INT8
caches, GQA ratios 1 to 8, head_dim 16 to 64, pages of 8 to 32, decode (1 row), verify (5, 16) and
prefill chunks (33 to 70 rows), within ``TOL``; and Qwen3-8B's heads at 1200 and 2500 positions
(pages of 64, 19 and 40 decode splits). Model
(GPU): bf16 at every registered model's heads and the synthetic GQA shapes, pages of 64, contexts 1
to 32k (prefill chunks up to 8192 rows), within 1e-2; cuTile's INT8 decode with its word kernel
and without.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import ATTN_SHAPES, DTYPES, TOL, close, filled_cache, poisoned_cache
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.ops import DEFAULT_SMS
from tileinfer.ops import reference as R

CACHES = ("bf16cache", "int8cache")

SMALL = [  # (T, start, kv_heads, group, head_dim, page): decode, verify, prefill chunks
    (1, 0, 2, 4, 32, 16),
    (1, 37, 1, 8, 32, 16),
    (1, 100, 3, 2, 64, 16),
    (5, 60, 1, 3, 64, 16),
    (16, 9, 2, 2, 32, 8),
    (40, 23, 2, 2, 32, 16),
    (70, 0, 1, 8, 16, 32),
    (33, 50, 4, 1, 32, 16),
]
# (T, start) on the GPU: decode and verify steps at short to 12k contexts, prefill chunks
MODEL_STEPS = [
    (1, 0),
    (1, 36),
    (1, 777),
    (1, 8191),
    (5, 995),
    (7, 100),
    (16, 114),
    (16, 5000),
    (64, 12345),
    (300, 0),
    (300, 700),
    (512, 3000),
]
# and up to 32k positions for a few shapes (GQA ratios 4, 7 and 8; head_dim 128 and 64)
LONG_SHAPES = ("qwen3-4b-random", "qwen2.5-coder-0.5b", "gqa8-h64")
LONG_STEPS = [(1, 32767), (16, 32000), (16, 32745), (512, 7680), (512, 32256), (8192, 0)]
MODEL = [
    pytest.param("bf16", cache, T, start, kvh, heads // kvh, d, 64, id=f"{name}-{cache}-T{T}-at{start}")
    for name, (heads, kvh, d) in ATTN_SHAPES.items()
    for T, start in MODEL_STEPS + (LONG_STEPS if name in LONG_SHAPES else [])
    for cache in CACHES
]


# Qwen3-8B's attention (32 heads, 8 KV heads, head_dim 128, pages of 64) in the interpreter: a decode
# step at 2500 positions runs the shipped split-KV tiles with 40 splits (the small cases reach 3),
# ~5 s each (2026-12-01, 2 shared cores); the INT8 one at 1200 positions (19 splits)
REAL = [("bf16", "bf16cache", 1, 2499, 8, 4, 128, 64), ("bf16", "int8cache", 1, 1199, 8, 4, 128, 64)]


@pytest.mark.cases(
    "dt,cache,T,start,kvh,group,d,page",
    small=[(dt, cache, *c) for dt in DTYPES for cache in CACHES for c in SMALL] + REAL,
    model=MODEL,
)
def test_attention(target, dt, cache, T, start, kvh, group, d, page):
    dt = DTYPES[dt]
    dev = target.device
    H, L = kvh * group, start + T
    _, layer, bt = filled_cache(L, page, kvh, d, dt, cache == "int8cache", dev)
    q = torch.randn(T, H, d, device=dev).to(dt)
    pos = torch.arange(start, L, dtype=torch.int32, device=dev)
    close(target.ops.attention(q, layer, bt, pos, d**-0.5), R.attention(q, layer, bt, pos, d**-0.5), TOL[dt])


@pytest.mark.cases(
    "dt,L,heads,kvh,d,page,positions,scale",
    small=[("f32", 90, 4, 2, 32, 16, (89, 3, 64, 40), 0.2)],
    model=[("bf16", 2000, 32, 8, 128, 64, T, 0.1) for T in (5, 40)],
)
def test_attention_rows_at_unequal_positions(target, dt, L, heads, kvh, d, page, positions, scale):
    """Rows need not be consecutive (verify steps): each attends up to its own position, read on the
    device. ``positions``: the rows' positions, or how many to draw at random (the first at L - 1)."""
    dt = DTYPES[dt]
    dev = target.device
    _, layer, bt = filled_cache(L, page, kvh, d, dt, False, dev)
    if isinstance(positions, int):
        pos = torch.randint(0, L, (positions,), device=dev).to(torch.int32)
        pos[0] = L - 1
    else:
        pos = torch.tensor(positions, dtype=torch.int32, device=dev)
    q = torch.randn(pos.shape[0], heads, d, device=dev).to(dt)
    close(target.ops.attention(q, layer, bt, pos, scale), R.attention(q, layer, bt, pos, scale), TOL[dt])


@pytest.mark.cases(
    "cache,L,T,page",
    small=[("bf16cache", 300, 1, 16), ("int8cache", 300, 5, 16)],
    model=[(cache, L, T, 64) for cache in CACHES for L in (1000, 8192, 32768) for T in (1, 5)],
)
def test_attention_reads_every_position(target, cache, L, T, page):
    """One loud value (|v| ~ 4 sqrt(L) times the others) at the newest position, the oldest, and the
    first slot of a page in the middle, one at a time: a kernel that drops or misreads it is off by
    O(1), where the bound is ``TOL`` (bf16 1e-2). Without the loud value, dropping the newest of
    1000+ positions changes the output by ~1/sqrt(L), under the GPU bound at long context."""
    dt, dev = torch.bfloat16, target.device
    kvh, group, d = 2, 4, 64
    for loud in (L - 1, 0, (L // page // 2) * page):
        kv, layer, bt = filled_cache(L, page, kvh, d, dt, cache == "int8cache", dev, written=0)
        k = torch.randn(L, kvh, d, device=dev).to(dt)
        v = torch.randn(L, kvh, d, device=dev)
        v[loud] *= 4 * L**0.5
        R.write_kv(layer, k, v.to(dt), bt, torch.arange(L, device=dev))
        q = torch.randn(T, kvh * group, d, device=dev).to(dt)
        pos = torch.arange(L - T, L, dtype=torch.int32, device=dev)
        want = R.attention(q, layer, bt, pos, d**-0.5)
        close(target.ops.attention(q, layer, bt, pos, d**-0.5), want, TOL[dt], f"loud value at {loud}")


@pytest.mark.cases(
    "cache,L,programs", small=[("bf16cache", 700, 6), ("int8cache", 1000, 10)], targets=("triton-interpret",)
)
def test_decode_splits_of_unequal_length(target, cache, L, programs):
    """Triton's split-KV decode with fewer splits than key blocks (as past ~4k positions with the
    shipped program count), its plan given ``programs`` programs: 11 or 16 blocks of 64 keys over 3
    or 5 splits, so splits hold several blocks and the last one fewer. Catches a per-split block
    count rounded down (the last blocks dropped) or a combine that merges only some splits; the
    small cases have one block per split."""
    from tileinfer.ops.triton import plan as P

    dt, dev = torch.bfloat16, target.device
    _, layer, bt = filled_cache(L, 16, 2, 64, dt, cache == "int8cache", dev)
    positions = bt.shape[0] * 16
    plan = P.plan_decode_attention(3, 4, 2, positions, 64, int8=layer.int8, sms=DEFAULT_SMS)
    plan = plan._replace(splits=P.num_splits(positions, 2, plan.tile.block_n, programs))
    assert plan.splits < -(-positions // plan.tile.block_n)
    q = torch.randn(3, 8, 64, device=dev).to(dt)
    pos = torch.arange(L - 3, L, dtype=torch.int32, device=dev)
    got = target.ops.attention(q, layer, bt, pos, 0.125, plan=plan)
    close(got, R.attention(q, layer, bt, pos, 0.125), TOL[dt])


@pytest.mark.cases(
    "T,start,kvh,group,d,page",
    model=[
        pytest.param(T, start, kvh, group, d, 64, id=f"{name}-T{T}-at{start}")
        for name, (kvh, group, d) in {"qwen3-8b": (8, 4, 128), "qwen3-0.6b": (8, 2, 128), "h64": (2, 8, 64)}.items()
        for T, start in ((1, 0), (1, 777), (1, 32767), (4, 995), (16, 5000))
    ],
    targets=("cutile",),
)
def test_cutile_int8_decode_words_and_mma(target, T, start, kvh, group, d, page):
    """cuTile's split-KV decode over an INT8 cache read as int32 words (``Tuning.decode_int8_words``:
    one query row, head_dim 128) and through the mma path: both against the reference, and the
    switch changes the result exactly where the word kernel applies."""
    from tileinfer.ops.cutile import plan as P

    dt, dev = torch.bfloat16, target.device
    H, L = kvh * group, start + T
    _, layer, bt = filled_cache(L, page, kvh, d, dt, True, dev)
    q = torch.randn(T, H, d, device=dev).to(dt)
    pos = torch.arange(start, L, dtype=torch.int32, device=dev)
    want = R.attention(q, layer, bt, pos, d**-0.5)
    planned = P.plan_decode_attention(T, group, kvh, bt.shape[0], d, int8=True, bf16=True, sms=DEFAULT_SMS)
    applies = planned.int8_words  # with the switch as shipped (on)
    assert applies == (T == 1 and d == 128)
    got = {}
    for on in (True, False):
        tuning = replace(target.ops.tuning, decode_int8_words=on)
        got[on] = target.ops.attention(q, layer, bt, pos, d**-0.5, tuning=tuning)
        close(got[on], want, TOL[dt], f"decode_int8_words={on}")
    assert torch.equal(got[True], got[False]) != applies, (
        "the switch did not change the kernel exactly where it applies"
    )


# ---------------------------------------------------------------------------- the reference itself


def dense_causal(q, k, v, positions):
    """Plain SDPA over contiguous k, v [L, kv_heads, d] for queries at ``positions`` (float64)."""
    T, H, d = q.shape
    g = H // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1).double()
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1).double()
    mask = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), kk, vv, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,page", [(8, 2, 16), (4, 4, 8), (6, 1, 32)])
def test_reference_paged_attention_equals_dense(int8, heads, kv_heads, page):
    d, L, T = 32, 77, 13  # context not a multiple of the page: the last page is partly filled
    cache = poisoned_cache(16, page, kv_heads, d, torch.float32, int8, "cpu")
    layer = cache.layers[0]
    block_table = torch.randperm(16)[: -(-L // page)].int()  # pages scattered through the pool
    k, v = torch.randn(L, kv_heads, d), torch.randn(L, kv_heads, d)
    R.write_kv(layer, k, v, block_table, torch.arange(L))
    positions = torch.arange(L - T, L)
    q = torch.randn(T, heads, d)
    got = R.attention(q, layer, block_table, positions, d**-0.5)
    if int8:  # the INT8 path must equal dense attention over the dequantized cache
        kq, ks = R.quantize_int8(k)
        vq, vs = R.quantize_int8(v)
        k, v = kq.float() * ks[..., None], vq.float() * vs[..., None]
    want = dense_causal(q, k, v, positions)
    assert (got.double() - want).abs().max() < 2e-6  # float32 against float64: measured 4.1e-7


def test_reference_prefill_chunks_and_decode_agree_with_one_shot():
    """Attention for a chunk of queries equals attention computed for all positions at once."""
    cache = PagedKVCache(1, 8, 16, 2, 16, torch.float32)
    layer, bt = cache.layers[0], torch.arange(8).int()
    L = 50
    k, v, q = torch.randn(L, 2, 16), torch.randn(L, 2, 16), torch.randn(L, 4, 16)
    R.write_kv(layer, k, v, bt, torch.arange(L))
    whole = R.attention(q, layer, bt, torch.arange(L), 0.25)
    parts = [R.attention(q[s:e], layer, bt, torch.arange(s, e), 0.25) for s, e in ((0, 20), (20, 49), (49, 50))]
    assert torch.allclose(torch.cat(parts), whole, rtol=0, atol=1e-6)  # measured 1.5e-7
    # and both against plain SDPA (float64): an expectation that is not the reference itself; float32
    # against float64, measured 3.6e-7
    want = dense_causal(q * 0.25 * 16**0.5, k, v, torch.arange(L))  # SDPA scales by d**-0.5
    assert (whole.double() - want).abs().max() < 2e-6


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8, 16, 40, 132, 200])
def test_cutile_decode_splits_fill_one_wave(kv_heads):
    """cuTile's split count: a power of two, the most (KV head, split) blocks that fit one block
    per SM (doubling it would not), capped by the pages (to a power of two) and MAX_SPLITS."""
    pytest.importorskip("cuda.tile")
    from tileinfer.ops.cutile import plan as P

    for sms in (DEFAULT_SMS, 114, 108):
        s = P.decode_splits(kv_heads, 1 << 20, sms)
        assert s & (s - 1) == 0 and 1 <= s <= P.MAX_SPLITS
        assert kv_heads * s <= sms or s == 1
        assert kv_heads * 2 * s > sms or s == P.MAX_SPLITS
        for pages in (1, 3, 4, 5):
            assert P.decode_splits(kv_heads, pages, sms) == min(s, 1 << (pages - 1).bit_length())
    # another GPU's SM count moves the wave: 8 KV heads on 78 SMs fit 8 splits, on 170 still 16
    assert P.decode_splits(8, 1 << 20, sms=78) == 8 and P.decode_splits(8, 1 << 20, sms=170) == 16
