"""Checks every checkpoint reader applies to the tensors it loads, before any work is done with them."""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity (True for integer tensors).

    The sum is a fast screen (a few ms for 100M BF16 values, ~50x faster than ``isfinite``): any NaN
    or infinity makes it non-finite. Only a non-finite sum, which huge finite values can also give,
    is confirmed element by element.
    """
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
