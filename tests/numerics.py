"""Numerical comparison helpers shared by the kernel tests."""

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; fails on NaN (an element no kernel wrote) or inf in ``a``."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "unwritten (NaN) or non-finite output"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution the reference sampler draws from (temperature, then top-k, then top-p), float32
    [..., vocab]: what a device sampler's histogram is compared with."""
    x = logits.float() / max(temperature, 1e-6)
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        s, order = x.sort(dim=-1, descending=True)
        drop = s.softmax(-1).cumsum(-1) - s.softmax(-1) >= top_p
        x = torch.full_like(x, float("-inf")).scatter(-1, order, s.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def assert_int8_kv_write_matches_quantize_int8(ops, device, T: int, kvh: int, d: int, page: int) -> None:
    """``ops.qk_norm_rope_kv_write`` into an INT8 cache at RoPE angle 0 without q/k norm stores its
    inputs themselves, so their codes and scales must equal ``reference.quantize_int8`` bit for bit.
    K spans many binades of scale (random magnitudes); the pages are scattered."""
    from tileinfer.core.kv_cache import PagedKVCache
    from tileinfer.ops import reference as R

    n_pages = -(-T // page) + 2
    kv = PagedKVCache(1, n_pages, page, kvh, d, torch.bfloat16, int8=True, device=device)
    bt = torch.randperm(n_pages, device=device).to(torch.int32)
    pos = torch.arange(T, dtype=torch.int32, device=device)
    k = (torch.randn(T, kvh, d, device=device) * torch.rand(T, kvh, 1, device=device).exp2() * 8).to(torch.bfloat16)
    v = (torch.randn(T, kvh, d, device=device) * torch.rand(T, kvh, 1, device=device).exp2()).to(torch.bfloat16)
    q = torch.randn(T, 2 * kvh, d, device=device).to(torch.bfloat16)
    cos, sin = torch.ones(T, d // 2, device=device), torch.zeros(T, d // 2, device=device)
    ops.qk_norm_rope_kv_write(q, k, v, None, None, 1e-6, cos, sin, kv.layers[0], bt, pos)
    pages, slots = bt[pos.long() // page].long(), pos.long() % page
    for x, codes, scales in ((k, kv.k[0], kv.k_scale[0]), (v, kv.v[0], kv.v_scale[0])):
        want_q, want_s = R.quantize_int8(x)
        got_q, got_s = codes[pages, :, slots], scales[pages, :, slots]
        assert torch.equal(got_s, want_s), f"{(got_s != want_s).sum().item()} scales differ"
        assert torch.equal(got_q, want_q), f"{(got_q != want_q).sum().item()} codes differ"
