"""Reference backend: every op in plain torch, on the CPU or CUDA. The ground truth for the kernels.

Numerics every backend follows: activations in the model dtype (BF16, or float32 in tests);
reductions (RMSNorm statistics, attention scores and softmax, SwiGLU, logits) in float32, rounded once
to the model dtype at the end; INT8 values multiplied in as exact small integers, scales applied
to the float32 result. Tensors of one token stream are 2-D/3-D with the token axis first (one
sequence per call: the engine runs a single sequence, as TileInfer.jl does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tileinfer.core.kv_cache import KVLayer
from tileinfer.ops import Int8Weight
from tileinfer.ops.workspace import Workspace

# ---------------------------------------------------------------------------- elementwise, norms


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather rows: ids int [T] -> [T, hidden] in the table's dtype."""
    return table[ids]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) over the last axis: ``x / sqrt(mean(x²) + eps) * weight``.

    x: [..., n]; weight: [n], or any shape broadcastable to x (per-head q/k norms may carry one
    row per head after key smoothing). Statistics in float32; output in x's dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add followed by RMSNorm: returns ``(rms_norm(x + residual), x + residual)``.

    x, residual: [T, hidden] in the model dtype; the sum is rounded to that dtype (as transformers
    does) before it is normalised and carried on as the next residual.
    """
    s = x + residual
    return rms_norm(s, weight, eps), s


# ---------------------------------------------------------------------------- linear layers


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias``: x [T, in] -> [T, out] in x's dtype.

    w: [out, in] in x's dtype, or an :class:`Int8Weight`, whose int8 values are multiplied in
    exactly and whose per-output-channel scale is applied to the product.
    """
    if isinstance(w, Int8Weight):
        y = (F.linear(x, w.q.to(x.dtype)).float() * w.scale).to(x.dtype)
    else:
        y = F.linear(x, w)
    return y if bias is None else y + bias


def swiglu(x: torch.Tensor, w_gate_up) -> torch.Tensor:
    """SwiGLU MLP input (Shazeer, 2020): ``silu(x @ Wg.T) * (x @ Wu.T)``.

    x: [T, hidden]; w_gate_up: the gate and up projections stacked, [2 * inter, hidden] (or an
    :class:`Int8Weight` of that shape). Returns [T, inter] in x's dtype; the product in float32.
    """
    gu = linear(x, w_gate_up).float()
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def lm_head(x: torch.Tensor, w, *, workspace: Workspace | None = None) -> torch.Tensor:
    """Logits in float32: x [T, hidden] @ w.T -> [T, vocab] float32, accumulated in float32.

    A BF16 product rounded to BF16 would quantise logits to ~0.1 and swamp the KL divergences this
    toolkit measures, so the float32 result of the product is kept. w: [vocab, hidden] (model dtype
    or float32) or an :class:`Int8Weight`. ``workspace`` keeps the float32 copy of the weight between
    calls (:meth:`Workspace.float_copy`); without one the weight is converted on every call.
    """
    xf = x.float()
    wq = w.q if isinstance(w, Int8Weight) else w
    wf = workspace.float_copy(wq) if workspace is not None else wq.float()
    y = F.linear(xf, wf)
    return y * w.scale if isinstance(w, Int8Weight) else y


# ---------------------------------------------------------------------------- RoPE + KV write


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of x [T, heads, d] by the angles whose cos/sin are [T, d/2].

    Computed in float32, output in x's dtype (see tileinfer.ops.rope for the convention).
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 over the last axis: ``x ≈ q * scale``, ``scale = max|x| / 127``.

    x: [..., n] any float dtype. Returns q int8 [..., n] (round half to even, |q| <= 127) and scale
    float32 [...]. An all-zero vector gets scale 0 and q 0. The rounding error of each entry is at
    most scale / 2.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a tensor divisor: torch on CUDA turns a division by a Python scalar into a multiply by its
    # float32 reciprocal, one ulp off the correctly rounded quotient for some values (the CPU
    # divides); this way the scale is the correctly rounded max|x| / 127 on every device, as the
    # kernels compute it
    scale = amax / torch.full_like(amax, 127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def write_kv(
    layer: KVLayer, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
) -> None:
    """Store k, v [T, kv_heads, d] at ``positions`` [T] of the sequence whose pages are ``block_table``.

    An INT8 layer stores each vector (one KV head at one position) as int8 with its own scale.
    """
    pos = positions.long()
    pages = block_table.long()[pos // layer.page_size]
    slots = pos % layer.page_size
    if layer.int8:
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        layer.k[pages, :, slots] = kq
        layer.v[pages, :, slots] = vq
        layer.k_scale[pages, :, slots] = ks
        layer.v_scale[pages, :, slots] = vs
    else:
        layer.k[pages, :, slots] = k.to(layer.k.dtype)
        layer.v[pages, :, slots] = v.to(layer.v.dtype)


def qk_norm_rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    layer: KVLayer,
    block_table: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Attention prologue: per-head q/k RMSNorm (Qwen3, when the norms are given), RoPE, KV write.

    q: [T, heads, d]; k, v: [T, kv_heads, d]; q_norm/k_norm: [d] or [heads|kv_heads, d] or None;
    cos_table/sin_table: float32 [max_positions, d/2]; positions: int [T]. Writes the rotated k and
    v into the cache and returns the rotated q [T, heads, d] in q's dtype.
    """
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = cos_table[positions.long()], sin_table[positions.long()]
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    write_kv(layer, k, v, block_table, positions)
    return q


# ---------------------------------------------------------------------------- attention


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Read a sequence's first ``length`` positions out of its pages: [kv_heads, length, ...]."""
    x = cache[pages].transpose(0, 1)  # [kv_heads, n_pages, page_size, ...]
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def attention(
    q: torch.Tensor, layer: KVLayer, block_table: torch.Tensor, positions: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Causal paged attention with GQA for queries at ``positions`` over the cached sequence.

    q: [T, heads, d] (already rotated; the keys and values of these positions already written);
    the query at position p attends to cached positions 0..p, read through ``block_table``. Serves
    both prefill chunks (T > 1) and decode (T = 1). Scores and softmax in float32. With an INT8
    cache, each key's scale multiplies its column of scores and each value's scale its probability
    (no dequantized copy of the cache). Works one KV head at a time, so the score matrix is at most
    [gqa_group, T, context]: a chunked 32k prefill never holds a 32k x 32k matrix.
    Returns [T, heads, d] in q's dtype.
    """
    T, n_heads, d = q.shape
    length = int(positions.max()) + 1
    n_pages = -(-length // layer.page_size)
    pages = block_table[:n_pages].long()
    keys, values = _gather(layer.k, pages, length), _gather(layer.v, pages, length)
    if layer.int8:
        k_scale, v_scale = _gather(layer.k_scale, pages, length), _gather(layer.v_scale, pages, length)
    kv_heads = keys.shape[0]
    group = n_heads // kv_heads
    qf = q.float().view(T, kv_heads, group, d).permute(1, 2, 0, 3)  # [kv_heads, group, T, d]
    visible = torch.arange(length, device=q.device)[None, :] <= positions.long()[:, None]  # [T, L]
    out = torch.empty(kv_heads, group, T, d, dtype=torch.float32, device=q.device)
    for h in range(kv_heads):
        s = qf[h] @ keys[h].float().T  # [group, T, L]
        if layer.int8:
            s *= k_scale[h]
        s = (s * sm_scale).masked_fill_(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        if layer.int8:
            p *= v_scale[h]
        out[h] = p @ values[h].float()
    return out.permute(2, 0, 1, 3).reshape(T, n_heads, d).to(q.dtype)


# ---------------------------------------------------------------------------- sampling


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token per row: logits float32 [T, vocab] -> int64 [T] (lowest id on ties)."""
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Sample one token per row with temperature, then top-k, then top-p (nucleus) filtering.

    logits: float32 [T, vocab]; top_k <= 0 keeps all; top_p >= 1 keeps all; the most likely token is
    always kept. ``generator`` seeds the draw. Returns int64 [T]. Follows the order of vLLM's and
    transformers' samplers (Holtzman et al., 2020 for top-p).
    """
    return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution :func:`sample` draws from: float32 [T, vocab] probabilities (zero outside the
    top-k / top-p set) for logits [T, vocab]; what speculative decoding's rejection sampler must
    reproduce."""
    logits = logits.float() / max(temperature, 1e-6)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)
