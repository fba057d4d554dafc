"""Token choice on the device: argmax, and temperature / top-k / top-p sampling.

argmax: chunks of the vocabulary are reduced in parallel (one block per (row, 4096 logits)), then
one block per row merges the chunk winners. No NaN checks (logits are never NaN; TileInfer.jl
measured the NaN-propagating argmax 1.2x slower), ties go to the lowest id as torch.argmax.

sample: exact filtering without a sort, one block per row. The top-k set is ``{x >= t_k}`` and the
top-p (nucleus, Holtzman et al. 2020) set ``{x >= t_p}``, so each reduces to finding a threshold
value, found by bisection over the (temperature-scaled) logits, each step one pass over the row
(which sits in L2). Bisection stops as soon as the candidate set is exactly the wanted set. Then
one pass draws the token by inverse CDF over the kept tokens in id order with one uniform number
per row, drawn from ``generator`` by torch. Kept sets match the reference's (vLLM/transformers
order: temperature, top-k, then top-p on the renormalised top-k distribution, the most likely token
always kept) up to float rounding at the set boundary.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import torch

from tileinfer.ops.cutile._common import ConstInt, cdiv, launch, next_pow2, pdl_prologue, workspace

CHUNK = 4096  # logits per block in argmax, per step of the sampling passes
MAX_BISECT = 64
_INF = math.inf


# ------------------------------------------------------------------------------------- argmax


@ct.kernel
def argmax_partial_kernel(logits, vals, idxs, CH: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    c = ct.bid(1)
    x = ct.reshape(ct.load(logits, (t, c), shape=(1, CH), padding_mode=ct.PaddingMode.NEG_INF), (CH,))
    ct.store(vals, (t, c), ct.max(x))
    ct.store(idxs, (t, c), ct.argmax(x) + c * CH)


@ct.kernel
def argmax_final_kernel(vals, idxs, out, CP: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    v = ct.reshape(ct.load(vals, (t, 0), shape=(1, CP), padding_mode=ct.PaddingMode.NEG_INF), (CP,))
    ix = ct.reshape(ct.load(idxs, (t, 0), shape=(1, CP), padding_mode=ct.PaddingMode.ZERO), (CP,))
    j = ct.argmax(v)  # lowest chunk among equal maxima -> lowest id overall
    sel = ct.sum(ct.where(ct.arange(CP, dtype=ct.int32) == j, ix, 0))
    ct.store(out, (t,), ct.astype(sel, ct.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token per row: logits float32 [T, vocab] -> int64 [T] (lowest id on ties)."""
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    nc = cdiv(V, CHUNK)
    vals = workspace("argmax_v", (T, nc), torch.float32, logits.device)
    idxs = workspace("argmax_i", (T, nc), torch.int32, logits.device)
    launch(argmax_partial_kernel, (T, nc, 1), (logits, vals, idxs, CHUNK))
    launch(argmax_final_kernel, (T, 1, 1), (vals, idxs, out, next_pow2(nc)))
    return out


# ------------------------------------------------------------------------------------- sample


def _chunk(logits, t, c, temp, CH):
    x = ct.reshape(ct.load(logits, (t, c), shape=(1, CH), padding_mode=ct.PaddingMode.NEG_INF), (CH,))
    return x / temp


def _count_ge(logits, t, nc, temp, thr, CH):
    """Number of scaled logits >= thr."""
    n = ct.full((), 0, ct.int32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        n = n + ct.sum(ct.astype(x >= thr, ct.int32))
    return n


def _mass_ge(logits, t, nc, temp, thr, mx, CH):
    """sum of exp(x - max) over scaled logits x >= thr."""
    z = ct.full((), 0.0, ct.float32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        z = z + ct.sum(ct.where(x >= thr, ct.exp(x - mx), 0.0))
    return z


def _set_stats(logits, t, nc, temp, thr, mx, CH):
    """Over the set {x >= thr}: its mass, and the mass of its smallest value (ties included)."""
    z = ct.full((), 0.0, ct.float32)
    vmin = ct.full((), _INF, ct.float32)
    zmin = ct.full((), 0.0, ct.float32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        e = ct.where(x >= thr, ct.exp(x - mx), 0.0)
        z = z + ct.sum(e)
        cmin = ct.min(ct.where(x >= thr, x, _INF))
        cz = ct.sum(ct.where(x == cmin, e, 0.0))
        zmin = ct.where(cmin < vmin, cz, ct.where(cmin == vmin, zmin + cz, zmin))
        vmin = ct.minimum(vmin, cmin)
    return z, zmin


@ct.kernel
def sample_kernel(logits, u, out, temp: float, top_k: int, top_p: float, CH: ConstInt):
    pdl_prologue()
    t = ct.bid(0)
    V = logits.shape[1]
    nc = ct.cdiv(V, CH)

    # pass 1: max (and its lowest id), smallest finite value
    mx = ct.full((), -_INF, ct.float32)
    am = ct.full((), 0, ct.int32)
    mn = ct.full((), _INF, ct.float32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        cm = ct.max(x)
        ci = ct.argmax(x) + c * CH
        am = ct.where(cm > mx, ci, am)
        mx = ct.maximum(mx, cm)
        mn = ct.minimum(mn, ct.min(ct.where(x == -_INF, _INF, x)))

    # top-k threshold: the k-th largest value (ties kept, as the reference's `logits < kth`)
    tk = ct.full((), -_INF, ct.float32)
    if top_k > 0 and top_k < V:
        if _count_ge(logits, t, nc, temp, mx, CH) >= top_k:
            tk = mx
        elif _count_ge(logits, t, nc, temp, mn, CH) >= top_k:
            lo = mn
            hi = mx
            it = 0
            done = False
            while it < MAX_BISECT and not done:
                mid = lo + (hi - lo) * 0.5
                if mid <= lo or mid >= hi:
                    done = True
                else:
                    cnt = _count_ge(logits, t, nc, temp, mid, CH)
                    if cnt >= top_k:
                        lo = mid
                        done = cnt == top_k
                    else:
                        hi = mid
                it += 1
            tk = lo

    # top-p threshold within the top-k set: keep x iff the mass strictly above x < p * Z_k
    tau = tk
    if top_p < 1.0:
        target = top_p * _mass_ge(logits, t, nc, temp, tk, mx, CH)
        if _mass_ge(logits, t, nc, temp, mx, mx, CH) >= target:
            tau = mx
        else:
            lo = ct.maximum(tk, mn)  # S(lo) is the whole top-k set (mn: smallest finite logit)
            hi = mx
            it = 0
            done = False
            while it < MAX_BISECT and not done:
                mid = lo + (hi - lo) * 0.5
                if mid <= lo or mid >= hi:
                    done = True
                else:
                    z, zmin = _set_stats(logits, t, nc, temp, mid, mx, CH)
                    if z < target:
                        hi = mid  # too few kept: lower the threshold
                    else:
                        lo = mid
                        done = z - zmin < target  # its smallest member is kept: exact set
                it += 1
            tau = lo

    # draw: inverse CDF over kept tokens in id order
    z = ct.full((), 0.0, ct.float32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        z = z + ct.sum(ct.where(x >= tau, ct.exp(x - mx), 0.0))
    target = ct.load(u, (t,), shape=()) * z
    run = ct.full((), 0.0, ct.float32)
    idx = ct.full((), 0, ct.int32)
    for c in range(nc):
        x = _chunk(logits, t, c, temp, CH)
        e = ct.where(x >= tau, ct.exp(x - mx), 0.0)
        cs = ct.cumsum(e, axis=0) + run
        idx = idx + ct.sum(ct.astype(cs <= target, ct.int32))
        run = run + ct.sum(e)
    idx = ct.where(idx >= V, am, idx)  # u * z rounded up to z: fall back to the most likely
    ct.store(out, (t,), ct.astype(idx, ct.int64))


def sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Sample one token per row with temperature, then top-k, then top-p filtering.

    logits: float32 [T, vocab]; top_k <= 0 keeps all; top_p >= 1 keeps all; the most likely token
    is always kept. One uniform number per row comes from ``generator`` (torch.rand), so a seeded
    generator reproduces the draws; inside a CUDA graph the generator must be registered with the
    graph (torch's rule for RNG in graphs). Returns int64 [T].
    """
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    u = torch.rand(T, generator=generator, device=logits.device, dtype=torch.float32)
    launch(sample_kernel, (T, 1, 1), (logits, u, out, float(max(temperature, 1e-6)), int(top_k), float(top_p), CHUNK))
    return out
