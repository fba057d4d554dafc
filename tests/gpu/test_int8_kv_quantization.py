"""The fused KV write of both fast backends quantizes exactly as ``reference.quantize_int8`` (GPU).

With RoPE at angle 0 (cos 1, sin 0) and no q/k norm the kernels store the input vectors
themselves, so their int8 codes and float32 scales must equal the reference's bit for bit: scale =
max|x| / 127 correctly rounded, codes = round-half-even(x / scale). A one-ulp difference in the scale
(torch on CUDA multiplies by the reciprocal when dividing by a Python scalar) flips codes at
near-ties, and with an INT8 cache such flips are as large as the quantization error itself.
"""

import pytest
import torch

from tests.numerics import assert_int8_kv_write_matches_quantize_int8
from tileinfer.ops import get_backend

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def poison_and_seed(poisoned_empty, fresh_seed):
    """Every torch.empty starts as NaN / garbage; every test draws its own inputs (tests/conftest.py)."""


@pytest.mark.parametrize("backend", ["triton", "cutile"])
@pytest.mark.parametrize("T,kvh,d", [(1, 8, 128), (300, 8, 128), (77, 3, 64)])
def test_int8_kv_write_quantizes_bitwise_like_the_reference(backend, T, kvh, d):
    assert_int8_kv_write_matches_quantize_int8(get_backend(backend), "cuda", T, kvh, d, page=64)
