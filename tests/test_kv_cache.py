"""Paged KV cache (tileinfer.core.kv_cache): the page pool's layout, the block manager, block tables.

Attention over the pages and the INT8 KV format are op tests: tests/ops/test_attention.py and
tests/ops/test_rope_kv.py.
"""

import pytest
import torch

from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import BlockManager, PagedKVCache, Sequence


@pytest.mark.parametrize("int8", [False, True])
def test_pool_layout(int8):
    """Each layer is a view of the one pool, [pages, kv_heads, page_size, head_dim], INT8 with one
    float32 scale per vector; sizes count keys, values and scales."""
    kv = PagedKVCache(3, 5, 16, 2, 32, torch.bfloat16, int8=int8)
    for i, layer in enumerate(kv.layers):
        assert layer.k.shape == layer.v.shape == (5, 2, 16, 32) and layer.page_size == 16
        assert layer.k.data_ptr() == kv.k[i].data_ptr() and layer.v.data_ptr() == kv.v[i].data_ptr()
        assert layer.int8 == int8
        if int8:
            assert layer.k.dtype == torch.int8 and layer.k_scale.shape == (5, 2, 16)
            assert layer.k_scale.dtype == layer.v_scale.dtype == torch.float32
    per_vector = 32 + 4 if int8 else 32 * 2
    assert kv.bytes_per_position() == 3 * 2 * 2 * per_vector  # layers x (k, v) x kv_heads
    assert kv.nbytes == kv.bytes_per_position() * 5 * 16


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


def test_int8_write_stores_hand_computed_codes_in_the_right_slot():
    """reference.write_kv into an INT8 pool, against codes and scales worked out by hand (not with
    ``quantize_int8``): position 5 of a sequence on pages [2, 0] with pages of 4 lands on page 0,
    slot 1; k = (254, -127, 1, 3) has scale 2 and codes (127, -64, 0, 2) (63.5 and 1.5 round to
    even), v = (0.5, -1, 0, 0.25) scale 1/127 and codes (64, -127, 0, 32). Catches a value scale
    taken from the key, a wrong page or slot, round half away from zero."""
    from tileinfer.ops import reference as R

    kv = PagedKVCache(1, 3, 4, 1, 4, torch.bfloat16, int8=True)
    layer = kv.layers[0]
    layer.k.zero_(), layer.v.zero_(), layer.k_scale.fill_(-1.0), layer.v_scale.fill_(-1.0)
    k = torch.tensor([[[254.0, -127.0, 1.0, 3.0]]])
    v = torch.tensor([[[0.5, -1.0, 0.0, 0.25]]])
    R.write_kv(layer, k, v, torch.tensor([2, 0], dtype=torch.int32), torch.tensor([5]))
    assert layer.k[0, 0, 1].tolist() == [127, -64, 0, 2] and layer.k_scale[0, 0, 1].item() == 2.0
    assert layer.v[0, 0, 1].tolist() == [64, -127, 0, 32]
    assert layer.v_scale[0, 0, 1].item() == torch.tensor(1 / 127, dtype=torch.float32).item()
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[0, 1] = True
    assert (layer.k_scale[:, 0][~written] == -1).all() and (layer.v[:, 0][~written] == 0).all()
