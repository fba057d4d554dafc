"""benchmarks/decode_timeline.py's kernel labels: which launch of a step is which (CPU, no profiler)."""

from __future__ import annotations

import pytest

from benchmarks import decode_timeline


def test_positions_split_a_step_into_before_layers_after():
    layer = ["norm", "gemv", "attn", "gemv", "gemv"]
    step = ["embed", "norm0"] + layer * 3 + ["norm", "gemv"]
    labels = decode_timeline.positions(step * 2, steps=2, layers=3)
    want = ["pre.0 embed", "pre.1 norm0"] + [f"L.{j} {k}" for j, k in enumerate(layer)] * 3
    want += ["post.0 norm", "post.1 gemv"]
    assert labels == want * 2


def test_positions_layer_with_a_repeated_launch():
    """A layer of two equal launches is one 2-launch period, not two layers of one."""
    step = ["g", "g"] * 4 + ["head"]
    assert decode_timeline.positions(step, steps=1, layers=4) == ["L.0 g", "L.1 g"] * 4 + ["post.0 head"]


def test_positions_refuse_unequal_steps():
    with pytest.raises(ValueError, match="equal steps"):
        decode_timeline.positions(["a", "b", "a", "c"], steps=2, layers=1)
    with pytest.raises(ValueError, match="repeats once per layer"):
        decode_timeline.positions(["a", "b", "c"], steps=1, layers=2)
