"""Numerical comparison helper shared by the kernel tests."""

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; fails on NaN (an element no kernel wrote) or inf in ``a``."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "unwritten (NaN) or non-finite output"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
