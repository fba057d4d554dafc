"""Token selection on the device: greedy argmax and temperature / top-k / top-p sampling.

Neither op synchronises with the host or branches on data in Python, so both run inside a captured
decode step (TileInfer.jl M8: sampling inside the graph made sampled decoding as fast as greedy).

* argmax: two kernels. Chunks of the vocabulary reduce to (max, lowest index at the max) in
  parallel, then one program per row merges the chunks (ties resolve to the lowest id, as torch).
* sample: three kernels, exact in distribution (same filtered distribution as the reference; the
  random stream differs).
  1. ``_cand_kernel``, one program per (row, 4096-token chunk): the chunk's max and softmax sum,
     and its 64 largest tokens (``tl.topk`` on value/id packed in an int64).
  2. ``_select_kernel``, one program per row: the 256 largest of all candidates, sorted; top-k
     (keys >= the k-th), then top-p on the renormalised top-k set (drop a token once the mass
     before it reaches p, the reference's rule), then an inverse-CDF draw among the kept tokens.
     Candidates are exact above ``tau``, the largest 64th value of any chunk; when the kept set
     (or the first token after it) reaches below ``tau`` - a flat distribution with a wide
     nucleus, or top_k > 256 - the row is flagged.
  3. ``_sample_kernel``, one program per row, returns at once unless flagged; then it makes
     several passes over the row: max and argmax; the k-th largest key by radix select (4 passes
     of ``tl.histogram``: slow, ~0.7 ms at 152k tokens, since float keys crowd a few bins); the
     top-k mass; and top-p by rejection (FlashInfer's pivot scheme: draw by inverse CDF, accept if
     the mass above the token is below top_p times the top-k mass, else drop it and everything
     below and draw again; after ``ROUNDS`` rejections, the most likely token).
  The uniforms come from ``torch.rand`` with the caller's generator, on the logits' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileinfer.ops import Unsupported
from tileinfer.ops.triton._common import cdiv, next_pow2, pdl_launch, pdl_prologue

ARGMAX_CHUNK = 4096
CAND_CHUNK = 4096  # vocabulary chunk of the candidate kernel (one program each)
CAND_K = 64  # candidates a chunk keeps
MERGE_K = 256  # candidates the select kernel keeps after merging
SAMPLE_BLOCK = 4096
ROUNDS = 32


@triton.jit
def _argmax_partial_kernel(x_ptr, pv_ptr, pi_ptr, V, S, stride_x, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
    m = tl.max(x, axis=0)
    i = tl.min(tl.where((x == m) & (offs < V), offs, 2147483647), axis=0)
    tl.store(pv_ptr + row * S + c, m)
    tl.store(pi_ptr + row * S + c, i)


@triton.jit
def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, S, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    v = tl.load(pv_ptr + row * S + s, mask=s < S, other=float("-inf"))
    i = tl.load(pi_ptr + row * S + s, mask=s < S, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token per row: logits float32 [T, vocab] -> int64 [T] (lowest id on ties).

    Raises:
        Unsupported: rows that are not contiguous.
    """
    if logits.stride(1) != 1:
        raise Unsupported("logits rows not contiguous")
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    S = cdiv(V, ARGMAX_CHUNK)
    pv = torch.empty((T, S), dtype=torch.float32, device=logits.device)
    pi = torch.empty((T, S), dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(T, S)](
        logits, pv, pi, V, S, logits.stride(0), CHUNK=ARGMAX_CHUNK, num_warps=8, **pdl_launch(logits)
    )
    _argmax_final_kernel[(T,)](pv, pi, out, S, BLOCK_S=next_pow2(S), num_warps=1, **pdl_launch(pv))
    return out


@triton.jit
def _key(x):
    """Order-preserving int32 key of a float32: a < b as floats iff key(a) < key(b) as int32."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _tempered(row_ptr, offs, V, temp):
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
    return tl.math.div_rn(x, temp)


@triton.jit(do_not_specialize=["top_k"])
def _sample_kernel(
    x_ptr, u_ptr, out_ptr, flag_ptr, V, stride_x, temp, top_k, top_p, BLOCK: tl.constexpr, ROUNDS: tl.constexpr
):
    """The exact multi-pass sampler, one program per row; runs only for rows flagged by
    ``_select_kernel`` (its candidates could not decide them), the others return at once."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(flag_ptr + row) == 0:
        return
    rp = x_ptr + row * stride_x
    ar = tl.arange(0, BLOCK)
    # 1. max and argmax of the tempered logits
    m = float("-inf")
    best = 0
    for b0 in range(0, V, BLOCK):
        x = _tempered(rp, b0 + ar, V, temp)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(x == bm, b0 + ar, 2147483647), axis=0)
        best = tl.where(bm > m, bi, best)
        m = tl.maximum(m, bm)
    # 2. top-k threshold: exact k-th largest key by radix select, 8 bits a pass from the top
    thr = -2147483648
    if (top_k > 0) & (top_k < V):
        sel = 0
        kk = top_k
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            hist = tl.zeros((256,), tl.int32)
            for b0 in range(0, V, BLOCK):
                key = _key(_tempered(rp, b0 + ar, V, temp))
                ok = (b0 + ar) < V
                if p > 0:
                    ok = ok & ((key >> ((24 - 8 * p) + 8)) == (sel >> ((24 - 8 * p) + 8)))
                digit = (key >> (24 - 8 * p)) & 0xFF
                if p == 0:
                    digit = digit ^ 0x80  # the top byte holds the sign: flip it to order bins
                hist += tl.histogram(digit, 256, mask=ok)
            ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count with digit >= bin
            d = tl.max(tl.where(ge >= kk, bins, -1), axis=0)
            kk -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
            if p == 0:
                d = d ^ 0x80
            sel = sel | (d << (24 - 8 * p))
        thr = sel
    # 3. softmax mass of the top-k set (unnormalised: exp(x - m))
    z = 0.0
    for b0 in range(0, V, BLOCK):
        x = _tempered(rp, b0 + ar, V, temp)
        z += tl.sum(tl.where(_key(x) >= thr, tl.math.exp(x - m), 0.0), axis=0)
    # 4. top-p by rejection: draw among keys >= cand, accept if the mass above < top_p * z
    limit = top_p * z
    cand = thr
    mass = z
    result = -1
    for r in range(ROUNDS):
        if result < 0:
            target = tl.load(u_ptr + row * ROUNDS + (r + 1) % ROUNDS) * mass
            run = 0.0
            pick = -1
            last = -1
            for b0 in range(0, V, BLOCK):
                if pick < 0:
                    x = _tempered(rp, b0 + ar, V, temp)
                    live = _key(x) >= cand
                    w = tl.where(live, tl.math.exp(x - m), 0.0)
                    c = tl.cumsum(w, axis=0) + run
                    first = tl.min(tl.where((c > target) & live, b0 + ar, 2147483647), axis=0)
                    pick = tl.where(first < 2147483647, first, -1)
                    last = tl.maximum(last, tl.max(tl.where(live, b0 + ar, -1), axis=0))
                    run += tl.sum(w, axis=0)
            if pick < 0:  # the target fell past the float sum (rounding): the last candidate
                pick = last
            ks = _key(tl.math.div_rn(tl.load(rp + pick), temp))
            if top_p < 1.0:
                above = 0.0
                for b0 in range(0, V, BLOCK):
                    x = _tempered(rp, b0 + ar, V, temp)
                    above += tl.sum(tl.where(_key(x) > ks, tl.math.exp(x - m), 0.0), axis=0)
                if above < limit:
                    result = pick
                else:
                    cand = ks + 1
                    mass = above
            else:
                result = pick
    result = tl.where(result < 0, best, result)
    tl.store(out_ptr + row, result.to(tl.int64))


@triton.jit
def _cand_kernel(x_ptr, cand_ptr, mz_ptr, V, S, stride_x, temp, CHUNK: tl.constexpr, KC: tl.constexpr):
    """One vocabulary chunk of one row: its max, its softmax sum, and its KC largest tokens.

    A candidate is packed in an int64 as (order-preserving key << 32) | (2^31 - 1 - id), so the
    integer order is the order by value, lower ids first among equal values.
    """
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.where(ok, _tempered(x_ptr + row * stride_x, offs, V, temp), float("-inf"))
    m = tl.max(x, axis=0)
    z = tl.sum(tl.where(ok, tl.math.exp(x - m), 0.0), axis=0)
    packed = (_key(x).to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
    packed = tl.where(ok, packed, -9223372036854775807 - 1)
    top = tl.topk(packed, KC)
    tl.store(cand_ptr + (row * S + c) * KC + tl.arange(0, KC), top)
    tl.store(mz_ptr + (row * S + c) * 2, m)
    tl.store(mz_ptr + (row * S + c) * 2 + 1, z)


@triton.jit(do_not_specialize=["top_k"])
def _select_kernel(
    cand_ptr,
    mz_ptr,
    u_ptr,
    out_ptr,
    flag_ptr,
    S,
    top_k,
    top_p,
    KC: tl.constexpr,
    NC: tl.constexpr,
    MK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    """Merge the chunks' candidates, apply top-k then top-p, draw; flag rows that need the full pass.

    Candidates are exact for every value above ``tau``, the largest KC-th value of any chunk (a
    token above it is among its chunk's KC largest). The draw is exact when the kept set and the
    first token after it lie above ``tau`` (or top-k alone decides the set); otherwise the row is
    flagged for ``_sample_kernel``.
    """
    INT64_MIN: tl.constexpr = -9223372036854775807 - 1
    INT32_MIN: tl.constexpr = -2147483648
    row = tl.program_id(0).to(tl.int64)
    total = S * KC
    j = tl.arange(0, NC)
    cand = tl.load(cand_ptr + row * total + j, mask=j < total, other=INT64_MIN)
    top = tl.topk(cand, MK)
    pos = tl.arange(0, MK)
    valid = top != INT64_MIN
    key = (top >> 32).to(tl.int32)
    tok = 2147483647 - (top & 0x7FFFFFFF).to(tl.int32)
    xb = key ^ ((key >> 31) & 0x7FFFFFFF)  # the key map is its own inverse
    x = xb.to(tl.float32, bitcast=True)
    # trust threshold: the largest last (KC-th) candidate of any chunk
    sc = tl.arange(0, BLOCK_S)
    last = tl.load(cand_ptr + row * total + sc * KC + KC - 1, mask=sc < S, other=INT64_MIN)
    tau = tl.max(tl.where(last == INT64_MIN, INT32_MIN, (last >> 32).to(tl.int32)), axis=0)
    trusted = valid & (key > tau)
    # global max and softmax sum from the chunk partials
    mc = tl.load(mz_ptr + (row * S + sc) * 2, mask=sc < S, other=float("-inf"))
    zc = tl.load(mz_ptr + (row * S + sc) * 2 + 1, mask=sc < S, other=0.0)
    m = tl.max(mc, axis=0)
    z_all = tl.sum(zc * tl.math.exp(mc - m), axis=0)
    w = tl.where(valid, tl.math.exp(x - m), 0.0)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    # top-k: keys >= the k-th largest (ties kept, as the reference's `logits < kth` mask)
    k_on = (top_k > 0) & (top_k < 2147483647)
    kth = tl.max(tl.where(pos == top_k - 1, key, INT32_MIN), axis=0)
    k_fits = top_k <= MK
    keep_k = tl.where(k_on & k_fits, valid & (key >= kth), valid)
    z_k = tl.where(k_on & k_fits, tl.sum(tl.where(keep_k, w, 0.0), axis=0), z_all)
    k_exact = (~k_on) | (k_fits & (kth > tau))
    # top-p over the top-k set: drop a token once the mass before it reaches top_p
    wk = tl.where(keep_k, w, 0.0)
    cum = tl.cumsum(wk, axis=0)
    kept = keep_k & ((cum - wk) < top_p * z_k)
    n_kept = tl.sum(kept.to(tl.int32), axis=0)
    all_trusted = tl.sum((kept & ~trusted).to(tl.int32), axis=0) == 0
    nxt_trusted = tl.sum((trusted & (pos == n_kept)).to(tl.int32), axis=0) > 0
    binding = k_on & k_fits & (n_kept == tl.sum(keep_k.to(tl.int32), axis=0))
    every_token = (tau == INT32_MIN) & (n_valid < MK)  # all V tokens are candidates
    exact = k_exact & all_trusted & (nxt_trusted | binding | every_token) & (n_kept > 0)
    # inverse CDF among the kept tokens
    wkept = tl.where(kept, w, 0.0)
    c2 = tl.cumsum(wkept, axis=0)
    target = tl.load(u_ptr + row * ROUNDS) * tl.sum(wkept, axis=0)
    pick = tl.min(tl.where(kept & (c2 > target), pos, MK), axis=0)
    pick = tl.where(pick == MK, n_kept - 1, pick)
    token = tl.sum(tl.where(pos == pick, tok, 0), axis=0)
    tl.store(out_ptr + row, tl.where(exact, token, -1).to(tl.int64))
    tl.store(flag_ptr + row, tl.where(exact, 0, 1).to(tl.int32))


def sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Sample one token per row with temperature, then top-k, then top-p (nucleus) filtering.

    logits: float32 [T, vocab]; top_k <= 0 keeps all; top_p >= 1 keeps all; the most likely token
    is always kept. Same distribution as the reference (vLLM/transformers order; Holtzman et al.,
    2020 for top-p); the random stream differs. ``generator`` must live on the logits' device for
    the step to be capturable in a CUDA graph (a CPU generator costs a host-to-device copy).
    Returns int64 [T].
    """
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    if T == 0:
        return out
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        logits = logits.float().contiguous()
    gdev = generator.device if generator is not None else logits.device
    u = torch.rand((T, ROUNDS), generator=generator, device=gdev)
    if u.device != logits.device:
        u = u.to(logits.device)
    temp = float(max(temperature, 1e-6))
    S = cdiv(V, CAND_CHUNK)
    cand = torch.empty((T, S, CAND_K), dtype=torch.int64, device=logits.device)
    mz = torch.empty((T, S, 2), dtype=torch.float32, device=logits.device)
    flag = torch.empty(T, dtype=torch.int32, device=logits.device)
    _cand_kernel[(T, S)](logits, cand, mz, V, S, logits.stride(0), temp, CHUNK=CAND_CHUNK, KC=CAND_K, num_warps=8)
    _select_kernel[(T,)](
        cand,
        mz,
        u,
        out,
        flag,
        S,
        int(top_k),
        float(top_p),
        KC=CAND_K,
        NC=max(next_pow2(S * CAND_K), MERGE_K),
        MK=MERGE_K,
        BLOCK_S=next_pow2(S),
        ROUNDS=ROUNDS,
        num_warps=8,
    )
    _sample_kernel[(T,)](
        logits,
        u,
        out,
        flag,
        V,
        logits.stride(0),
        temp,
        int(top_k),
        float(top_p),
        BLOCK=SAMPLE_BLOCK,
        ROUNDS=ROUNDS,
        num_warps=16,
    )
    return out
