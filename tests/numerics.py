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
