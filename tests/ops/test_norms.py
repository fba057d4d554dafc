"""Embedding gather, RMSNorm and residual add + RMSNorm of every backend against the reference.

Small (interpreter): float32 and bf16, 1 to 7 rows of 64 to 1000 values. Model (GPU): bf16 at
every registered model's hidden size and vocabulary, 1 to 512 rows. The gather and the rounded
residual sum are exact; the norms within ``TOL`` (float32 1e-5, bf16 1e-2, relative in norm), with
the weight in the model dtype and in float32.
"""

from __future__ import annotations

import pytest
import torch

from tests.numerics import DTYPES, MODELS, TOL, close
from tileinfer.ops import reference as R


@pytest.mark.cases(
    "dt,vocab,hidden,T",
    small=[(dt, 50, 72, 9) for dt in DTYPES],
    model=[("bf16", c.vocab_size, c.hidden_size, T) for c in MODELS.values() for T in (1, 5, 333, 512)],
)
def test_embedding(target, dt, vocab, hidden, T):
    table = torch.randn(vocab, hidden, device=target.device).to(DTYPES[dt])
    ids = torch.randint(0, vocab, (T,), device=target.device)
    ids[0] = vocab - 1
    assert torch.equal(target.ops.embedding(ids, table), R.embedding(ids, table))


@pytest.mark.cases(
    "dt,rows,n",
    small=[(dt, rows, n) for dt in DTYPES for rows, n in ((1, 64), (7, 96), (3, 1000))],
    model=[("bf16", T, c.hidden_size) for c in MODELS.values() for T in (1, 300, 333)],
)
def test_rms_norm_and_add(target, dt, rows, n):
    dt = DTYPES[dt]
    dev = target.device
    x, r = (torch.randn(rows, n, device=dev) * 3).to(dt), torch.randn(rows, n, device=dev).to(dt)
    w = torch.randn(n, device=dev)
    for ww in (w.to(dt), w):
        close(target.ops.rms_norm(x, ww, 1e-6), R.rms_norm(x, ww, 1e-6), TOL[dt], f"rms_norm, {ww.dtype} weight")
    y, s = target.ops.add_rms_norm(x, r, w.to(dt), 1e-5)
    y2, s2 = R.add_rms_norm(x, r, w.to(dt), 1e-5)
    assert torch.equal(s, s2), "the rounded sum must match exactly"
    close(y, y2, TOL[dt], "add_rms_norm")


@pytest.mark.cases("dt,T,heads,d", small=[("f32", 5, 3, 32)], model=[("bf16", 5, 16, 128)])
def test_rms_norm_per_head_weight(target, dt, T, heads, d):
    """One weight row per head (per-head q/k norms after key smoothing)."""
    dt = DTYPES[dt]
    x = torch.randn(T, heads, d, device=target.device).to(dt)
    w = torch.randn(heads, d, device=target.device).to(dt)
    close(target.ops.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), TOL[dt])


@pytest.mark.cases("dt,rows,n", small=[("f32", 3, 256), ("bf16", 2, 1000)], model=[("bf16", 5, 4096)])
def test_rms_norm_where_eps_matters(target, dt, rows, n):
    """Rows of magnitude ~1e-3, whose mean square is eps itself: an eps added after the square root,
    dropped, or scaled changes the result by tens of percent (at magnitude 1 by ~1e-7, inside any
    float32 bound)."""
    dt = DTYPES[dt]
    x = (torch.randn(rows, n, device=target.device) * 1e-3).to(dt)
    w = torch.randn(n, device=target.device).to(dt)
    close(target.ops.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), TOL[dt])
    y, _ = target.ops.add_rms_norm(x, x, w, 1e-6)
    close(y, R.add_rms_norm(x, x, w, 1e-6)[0], TOL[dt], "add_rms_norm")
