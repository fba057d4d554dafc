"""Paged KV cache: block manager, block tables, and paged attention against dense attention."""

import pytest
import torch
import torch.nn.functional as F

from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import BlockManager, PagedKVCache, Sequence
from tileinfer.ops import reference as ref


def dense_causal(q, k, v, positions):
    """Plain SDPA over contiguous k, v [L, kv_heads, d] for queries at ``positions`` (float64)."""
    T, H, d = q.shape
    g = H // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1).double()
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1).double()
    mask = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), kk, vv, attn_mask=mask)
    return out.transpose(0, 1)


def test_block_manager_allocates_and_frees():
    bm = BlockManager(8)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8)) and bm.num_free == 0
    with pytest.raises(UserError):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free == 3 and sorted(bm.allocate(3)) == sorted(a)


def test_sequence_reserves_pages_as_it_grows():
    bm = BlockManager(10)
    seq = Sequence(bm, page_size=4, max_pages=5)
    seq.reserve(5)
    assert len(seq.pages) == 2
    seq.length = 5
    seq.reserve(3)  # 8 positions fit in 2 pages
    assert len(seq.pages) == 2
    seq.reserve(4)
    assert len(seq.pages) == 3 and seq.block_table_tensor[:3].tolist() == seq.pages
    with pytest.raises(UserError):
        seq.reserve(100)
    seq.release()
    assert bm.num_free == 10 and seq.length == 0


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,page", [(8, 2, 16), (4, 4, 8), (6, 1, 32)])
def test_paged_attention_equals_dense(int8, heads, kv_heads, page):
    torch.manual_seed(heads * 100 + page + int8)
    d, L, T = 32, 77, 13  # context not a multiple of the page: the last page is partly filled
    cache = PagedKVCache(1, 16, page, kv_heads, d, torch.float32, int8=int8)
    # poison the pool: a read of any slot that was not written shows up as NaN
    (cache.k_scale if int8 else cache.k).fill_(float("nan"))
    (cache.v_scale if int8 else cache.v).fill_(float("nan"))
    layer = cache.layers[0]
    block_table = torch.randperm(16)[: -(-L // page)].int()  # pages scattered through the pool
    k, v = torch.randn(L, kv_heads, d), torch.randn(L, kv_heads, d)
    ref.write_kv(layer, k, v, block_table, torch.arange(L))
    positions = torch.arange(L - T, L)
    q = torch.randn(T, heads, d)
    got = ref.attention(q, layer, block_table, positions, d ** -0.5)
    if int8:  # the INT8 path must equal dense attention over the dequantized cache
        kq, ks = ref.quantize_int8(k)
        vq, vs = ref.quantize_int8(v)
        k, v = kq.float() * ks[..., None], vq.float() * vs[..., None]
    want = dense_causal(q, k, v, positions)
    assert (got.double() - want).abs().max() < 1e-5


def test_prefill_chunks_and_decode_agree_with_one_shot():
    """Attention for a chunk of queries equals attention computed for all positions at once."""
    torch.manual_seed(0)
    cache = PagedKVCache(1, 8, 16, 2, 16, torch.float32)
    layer, bt = cache.layers[0], torch.arange(8).int()
    L = 50
    k, v, q = torch.randn(L, 2, 16), torch.randn(L, 2, 16), torch.randn(L, 4, 16)
    ref.write_kv(layer, k, v, bt, torch.arange(L))
    whole = ref.attention(q, layer, bt, torch.arange(L), 0.25)
    parts = [ref.attention(q[s:e], layer, bt, torch.arange(s, e), 0.25) for s, e in ((0, 20), (20, 49), (49, 50))]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6)


def test_int8_round_trip_error_is_within_half_a_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 8, 128) * torch.logspace(-3, 2, 64)[:, None, None]
    q, s = ref.quantize_int8(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= s[..., None] / 2 + 1e-6 * x.abs()).all()
    z, zs = ref.quantize_int8(torch.zeros(3, 5))
    assert (z == 0).all() and (zs == 0).all()
