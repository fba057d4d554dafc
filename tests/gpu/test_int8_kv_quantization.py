"""The fused KV write of both fast backends quantizes exactly as ``reference.quantize_int8`` (GPU).

With RoPE at angle 0 (cos 1, sin 0) and no q/k norm the kernels store the input vectors
themselves, so their int8 codes and float32 scales must equal the reference's bit for bit: scale =
max|x| / 127 correctly rounded, codes = round-half-even(x / scale). A one-ulp difference in the scale
(torch on CUDA multiplies by the reciprocal when dividing by a Python scalar) flips codes at
near-ties, and with an INT8 cache such flips are as large as the quantization error itself.
"""

import pytest
import torch

from tileinfer.kv_cache import PagedKVCache
from tileinfer.ops import get_backend
from tileinfer.ops import reference as R

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def poison_and_seed(poisoned_empty, fresh_seed):
    """Every torch.empty starts as NaN / garbage; every test draws its own inputs (tests/conftest.py)."""


@pytest.mark.parametrize("backend", ["triton", "cutile"])
@pytest.mark.parametrize("T,kvh,d", [(1, 8, 128), (300, 8, 128), (77, 3, 64)])
def test_int8_kv_write_quantizes_bitwise_like_the_reference(backend, T, kvh, d):
    ops = get_backend(backend)
    dev, page = "cuda", 64
    n_pages = -(-T // page) + 2
    kv = PagedKVCache(1, n_pages, page, kvh, d, torch.bfloat16, int8=True, device=dev)
    bt = torch.randperm(n_pages, device=dev).to(torch.int32)
    pos = torch.arange(T, dtype=torch.int32, device=dev)
    # bf16 vectors over a wide range of magnitudes, so the scales cover many binades
    k = (torch.randn(T, kvh, d, device=dev) * torch.rand(T, kvh, 1, device=dev).exp2() * 8).to(torch.bfloat16)
    v = (torch.randn(T, kvh, d, device=dev) * torch.rand(T, kvh, 1, device=dev).exp2()).to(torch.bfloat16)
    q = torch.randn(T, 2 * kvh, d, device=dev).to(torch.bfloat16)
    cos = torch.ones(T, d // 2, device=dev)
    sin = torch.zeros(T, d // 2, device=dev)
    ops.qk_norm_rope_kv_write(q, k, v, None, None, 1e-6, cos, sin, kv.layers[0], bt, pos)
    pages, slots = bt[pos.long() // page].long(), pos.long() % page
    for x, codes, scales in ((k, kv.k[0], kv.k_scale[0]), (v, kv.v[0], kv.v_scale[0])):
        want_q, want_s = R.quantize_int8(x)
        got_q = codes[pages, :, slots]  # [T, kvh, d]
        got_s = scales[pages, :, slots]
        assert torch.equal(got_s, want_s), f"{(got_s != want_s).sum().item()} scales differ"
        assert torch.equal(got_q, want_q), f"{(got_q != want_q).sum().item()} codes differ"
