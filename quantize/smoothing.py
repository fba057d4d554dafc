"""Smoothed keys for an INT8 KV cache: per-channel key scales folded into the query/key path.

A few key channels carry outliers, and an INT8 cache stores each key vector with one scale
``max|k| / 127``, so those channels set the scale and the small channels lose their precision.
SmoothAttention (QServe: Lin et al., 2024, "QServe: W4A8KV4 Quantization and System Co-design for
Efficient LLM Serving", §4.2; code: mit-han-lab/qserve and its quantization toolkit
mit-han-lab/deepcompressor) moves the outliers from keys to
queries, which are never quantized here, the way SmoothQuant (Xiao et al., 2023) moves activation
outliers into weights: keys are divided by a per-channel scale ``s`` and queries multiplied by it,
so ``q · k`` is unchanged in exact arithmetic.

Choices, after QServe:

* ``s`` is taken on the keys *before* RoPE (after the k bias, and after k_norm for Qwen3), with one
  scale per (layer, KV head, channel), and channels ``i`` and ``i + d/2`` share it: RoPE rotates
  that pair together (transformers' rotate-half convention), so with equal scales it commutes with
  the scaling. The query heads of a KV head's GQA group get that KV head's scales.
* ``s_c = max|k_c|^alpha`` (``alpha = 0.5`` by default, QServe's value; SmoothQuant's migration
  strength), the max over the calibration tokens and over the channel pair.

Our additions: ``s`` is normalised by its geometric mean per head (keeps the overall magnitudes of
q and k where they were) and rounded to a power of two. Multiplying by 2^n is exact in BF16 and
float32 (barring overflow and underflow), so the folded weights, the rotated queries and keys and the
products ``q_c * k_c`` are exactly the unsmoothed ones rescaled: with a BF16 cache, attention
scores and logits are unchanged bit for bit. Only the INT8 rounding of the cached keys changes.
"""

from __future__ import annotations

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import KVLayer
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer
from tileinfer.ops import reference

DEFAULT_ALPHA = 0.5
K_SMOOTH = "model.layers.{}.self_attn.k_smooth"  # where the scales are recorded in a state dict
# A channel whose max is below this fraction of its head's max counts as this small: a dead channel
# (max 0) would otherwise put -inf into the geometric mean.
_FLOOR = 2.0**-20


class _KeyTap:
    """The reference ops, with ``qk_norm_rope_kv_write`` also handing each layer's keys to a hook.

    The hook gets ``(layer, k, q_rot, cos, sin)``: the KV layer written, the keys after their norm and
    before RoPE [T, kv_heads, d], the rotated queries the op returns [T, heads, d], and the RoPE
    cos/sin of the chunk's positions [T, d/2].
    """

    def __init__(self, hook):
        self.hook = hook

    def __getattr__(self, name):
        return getattr(reference, name)

    def qk_norm_rope_kv_write(
        self, q, k, v, q_norm, k_norm, eps, cos_table, sin_table, layer: KVLayer, block_table, positions
    ):
        # The same call the reference op makes first (it normalises iff norms are given), so the
        # hook sees exactly the keys the op rotates.
        kn = reference.rms_norm(k, k_norm, eps) if q_norm is not None else k
        q_rot = reference.qk_norm_rope_kv_write(
            q, k, v, q_norm, k_norm, eps, cos_table, sin_table, layer, block_table, positions
        )
        pos = positions.long()
        self.hook(layer, kn, q_rot, cos_table[pos], sin_table[pos])
        return q_rot


def key_absmax(
    state_dict: dict[str, torch.Tensor],
    config: ModelConfig,
    token_ids: list[int],
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Run the model on ``token_ids`` and return max |k| of the pre-RoPE keys per channel.

    The tokens run through the engine (reference ops) in sequences of at most the model's context;
    no logits are computed. Keys are taken after the k projection and bias and, for Qwen3, after
    k_norm: exactly what RoPE receives.

    Args:
        state_dict: float weights under transformers' names.
        config: the model's shapes.
        token_ids: calibration tokens (at least one).
        dtype: dtype the model runs in (BF16, as it is served).
        device: where it runs (the reference ops run on the CPU or CUDA).
        progress: show a tqdm bar.

    Returns:
        float32 [num_layers, num_kv_heads, head_dim], on the CPU.

    Raises:
        UserError: no tokens, or a tensor the model needs is missing.
    """
    if not token_ids:
        raise UserError("the calibration text encodes to no tokens")
    n = len(token_ids)
    window = min(n, config.max_position_embeddings, config.sliding_window or n)
    model = Transformer.from_state_dict(config, state_dict, dtype=dtype, device=device, max_positions=window)
    absmax: dict[int, torch.Tensor] = {}  # id(KVLayer) -> float32 [kv_heads, d]

    def record(layer, k, q_rot, cos, sin):
        m = k.float().abs().amax(dim=0)
        absmax[id(layer)] = torch.maximum(absmax[id(layer)], m) if id(layer) in absmax else m

    runner = ModelRunner(model, backend=_KeyTap(record), max_seq_len=window)
    with torch.inference_mode():
        for start in range(0, len(token_ids), window):
            seq = runner.new_sequence()
            for _ in runner.chunks(
                seq, token_ids[start : start + window], logits_from=window, progress="calibrate" if progress else None
            ):
                pass  # logits_from past the end: no lm_head, keys only
            seq.release()
    return torch.stack([absmax[id(layer)] for layer in runner.kv.layers]).cpu()


def smoothing_scales(absmax: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """Key scales ``s`` from per-channel key maxima: power-of-two, shared by RoPE pairs.

    ``s_c = 2^round(alpha * log2(m_c) - mean_c(alpha * log2(m_c)))`` per head, where ``m_c`` is the
    larger max of channels c and c + d/2, floored at 2^-20 of the head's largest (QServe's
    SmoothAttention with the RoPE pairing, normalised by the geometric mean and rounded to a power
    of two, see the module docstring).

    Args:
        absmax: float [..., head_dim] of max |k| >= 0 per channel (e.g. [layers, kv_heads, d]).
        alpha: migration strength in [0, 1]; 0 gives s = 1, 1 flattens the channel maxima.

    Returns:
        float32, same shape, every entry a power of two, ``s[..., i] == s[..., i + d/2]``.
    """
    half = absmax.shape[-1] // 2
    m = torch.maximum(absmax[..., :half], absmax[..., half:]).float()
    m = torch.maximum(m, m.amax(-1, keepdim=True) * _FLOOR).clamp_min(torch.finfo(torch.float32).tiny)
    log_s = alpha * m.log2()
    exp = torch.round(log_s - log_s.mean(-1, keepdim=True))
    s = torch.exp2(exp)
    return torch.cat([s, s], dim=-1)


def _scaled(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t * s`` in float32, back in t's dtype (exact for power-of-two s)."""
    if t.dtype == torch.int8:
        raise UserError("key smoothing must be folded before the weights are quantized to int8")
    return (t.float() * s.to(t.device)).to(t.dtype)


def fold_key_scales(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Fold key scales into the weights: keys divided by ``s``, queries multiplied by it.

    With q/k norms (Qwen3) the scales go into the norm weights, which become per-head: q_norm
    [num_heads, d] and k_norm [num_kv_heads, d] (the engine's rms_norm broadcasts them). Otherwise
    they scale the rows of q_proj and k_proj (and of the q/k biases, Qwen2). Query head j takes the
    scales of KV head ``j // gqa_group``. The scales are also stored under
    ``model.layers.{i}.self_attn.k_smooth`` (float32 [kv_heads, d]) for the record; the engine
    ignores them.

    Args:
        state_dict: float weights under transformers' names (not modified).
        config: the model's shapes.
        scales: float32 [num_layers, num_kv_heads, head_dim], e.g. from :func:`smoothing_scales`.

    Returns:
        A new dict; untouched tensors are shared with ``state_dict``.

    Raises:
        UserError: a weight is missing or already int8.
    """
    c = config
    h, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    out = dict(state_dict)

    def get(name):
        if name not in state_dict:
            raise UserError(f"checkpoint has no tensor {name!r}")
        return state_dict[name]

    for i in range(c.num_hidden_layers):
        s_k = scales[i].float()  # [kvh, d]
        s_q = s_k.repeat_interleave(c.gqa_group, dim=0)  # [h, d]
        a = f"model.layers.{i}.self_attn."
        if c.qk_norm:
            out[a + "q_norm.weight"] = _scaled(get(a + "q_norm.weight"), s_q)
            out[a + "k_norm.weight"] = _scaled(get(a + "k_norm.weight"), 1.0 / s_k)
        else:
            for proj, s, heads in (("q_proj", s_q, h), ("k_proj", 1.0 / s_k, kvh)):
                w = get(a + proj + ".weight")
                out[a + proj + ".weight"] = _scaled(w.view(heads, d, -1), s[..., None]).view(w.shape)
                if c.attention_bias:
                    out[a + proj + ".bias"] = _scaled(get(a + proj + ".bias"), s.reshape(-1))
        out[K_SMOOTH.format(i)] = s_k.clone()
    return out


def key_score_error(model: Transformer, token_ids: list[int], prefill_chunk: int = 512) -> float:
    """Relative error that INT8 keys cause in attention scores: ``||S_int8 - S||_F / ||S||_F``.

    Runs the model (its own dtype, BF16 cache) on ``token_ids``; in every layer and KV head, ``S`` are
    the causal scores ``q · k`` of the rotated queries and keys of one prefill chunk, and ``S_int8``
    the same with the keys quantized as the INT8 cache stores them (one scale per vector). Sums of
    squares are pooled over layers, heads and chunks. This isolates the key rounding (values and the
    softmax left out) to measure what key smoothing buys.

    Args:
        model: the (possibly smoothed) model.
        token_ids: at most the model's context.
        prefill_chunk: tokens per chunk; scores are taken within a chunk.

    Returns:
        The relative error, a float >= 0.
    """
    err = ref = 0.0

    def measure(layer, k, q_rot, cos, sin):
        nonlocal err, ref
        k_rot = reference.rope(k, cos, sin)  # the keys the op wrote, computed the way it computes them
        kq, ks = reference.quantize_int8(k_rot)
        k_deq = kq.float() * ks[..., None]
        T, kv_heads, d = k_rot.shape
        qf = q_rot.float().view(T, kv_heads, -1, d)
        causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
        for h in range(kv_heads):
            s = torch.einsum("tgd,ud->gtu", qf[:, h], k_rot[:, h].float())[:, causal].double()
            s8 = torch.einsum("tgd,ud->gtu", qf[:, h], k_deq[:, h])[:, causal].double()
            err += ((s8 - s) ** 2).sum().item()
            ref += (s**2).sum().item()

    n = len(token_ids)
    runner = ModelRunner(model, backend=_KeyTap(measure), max_seq_len=n, prefill_chunk=prefill_chunk)
    with torch.inference_mode():
        for _ in runner.chunks(runner.new_sequence(), token_ids, logits_from=n):
            pass  # logits_from past the end: no lm_head
    return (err / ref) ** 0.5
