"""A gpt-fast style decoder for Llama/Qwen2/Qwen3 shapes, in plain torch: a peer to time against.

After pytorch-labs/gpt-fast (``model.py``, ``generate.py``, ``quantize.py`` at 32971d3): an
``nn.Module`` with a fused ``wqkv`` linear, a static KV cache per layer ([1, kv_heads, max_len,
head_dim] buffers written in place at ``input_pos``), K and V repeated to the query heads
(``repeat_interleave``) and ``F.scaled_dot_product_attention`` over the whole cache with a boolean
mask, and one decode step compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)``
(CUDA graphs) under the math SDPA backend, so that Inductor generates the attention, as
``decode_n_tokens`` does. INT8 weight-only is gpt-fast's ``WeightOnlyInt8Linear``:
``F.linear(x, w.to(x.dtype)) * scales``.

What differs from gpt-fast, and why: RoPE rotates halves (transformers' layout, so the weights load
unpermuted) from float32 tables (:func:`tileinfer.ops.rope.rope_tables`) where gpt-fast
interleaves pairs and keeps the tables in BF16; the mask row of each position is computed
(``arange(max_len) <= input_pos``) instead of indexed from a [max_len, max_len] boolean table
(1 GiB at 32k); Qwen3's per-head q/k RMSNorm before RoPE and the q/k/v/o biases of Qwen2/Llama are
added; decoding is greedy (argmax) where gpt-fast samples.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tileinfer.core.config import ModelConfig
from tileinfer.models.transformer import SCALE_SUFFIX
from tileinfer.ops.rope import rope_tables


class WeightOnlyInt8Linear(nn.Module):
    """gpt-fast's INT8 weight-only linear: ``F.linear(x, weight.to(x.dtype)) * scales``.

    weight: int8 [out, in]; scales: [out] in the activation dtype (gpt-fast keeps them in BF16).
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype)) * self.scales


def _linear(w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, dtype) -> nn.Module:
    """An ``nn.Linear`` holding ``w`` [out, in] itself (no copy), or an INT8 one when ``scale`` is given."""
    if scale is not None:
        return WeightOnlyInt8Linear(w, scale.to(dtype))
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class RMSNorm(nn.Module):
    """gpt-fast's RMSNorm: statistics in float32, rounded to x's dtype, then times the weight."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x [1, T, heads, d] by float32 cos/sin [T, d/2]; in float32, out in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


class KVCache(nn.Module):
    """Static keys and values of one layer: buffers [1, kv_heads, max_len, head_dim]."""

    def __init__(self, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        for name in ("k_cache", "v_cache"):
            buf = torch.zeros(1, kv_heads, max_len, head_dim, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(buf)  # mutated inside the CUDA graph, as transformers' StaticCache
            self.register_buffer(name, buf)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [1, kv_heads, T, d] at positions ``input_pos`` [T]; return the whole caches."""
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, wqkv: nn.Module, wo: nn.Module, q_norm, k_norm):
        super().__init__()
        self.wqkv, self.wo, self.q_norm, self.k_norm = wqkv, wo, q_norm, k_norm
        self.h, self.kvh, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        T = x.shape[1]
        q, k, v = self.wqkv(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(1, T, self.h, self.d), k.view(1, T, self.kvh, self.d), v.view(1, T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.h // self.kvh, dim=1)
        v = v.repeat_interleave(self.h // self.kvh, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(1, T, self.h * self.d))


class FeedForward(nn.Module):
    def __init__(self, w1: nn.Module, w3: nn.Module, w2: nn.Module):
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2  # gate, up, down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, attention: Attention, feed_forward: FeedForward, attention_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """gpt-fast's ``Transformer``. Build with :meth:`from_state_dict`, then :meth:`setup_caches`."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Block], norm: RMSNorm, output):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers, self.norm, self.output = nn.ModuleList(layers), norm, output
        cos, sin = rope_tables(config, config.max_position_embeddings, embed.device)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)
        self.max_len = 0

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: dict[str, torch.Tensor], dtype=torch.bfloat16) -> "Decoder":
        """Build from tensors under transformers' names, the checkpoints this engine loads: float ones
        (cast to ``dtype``; a tensor already in ``dtype`` is shared, not copied) or int8 ones with a
        float32 ``<name>_scale`` (:func:`quantize.apply`), which become :class:`WeightOnlyInt8Linear`.
        A tied model without ``lm_head.weight`` uses the embedding table as its output weight."""
        c = config

        def t(name):
            return sd[name] if sd[name].dtype == torch.int8 else sd[name].to(dtype)

        def linear(names: list[str], bias: list[str] | None = None) -> nn.Module:
            w = torch.cat([t(n) for n in names]) if len(names) > 1 else t(names[0])
            scale = torch.cat([sd[n + SCALE_SUFFIX] for n in names]) if w.dtype == torch.int8 else None
            b = torch.cat([t(n) for n in bias]) if bias else None
            return _linear(w, scale, b, dtype)

        layers = []
        for i in range(c.num_hidden_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            qkv = [a + f"{n}_proj.weight" for n in "qkv"]
            norms = [RMSNorm(t(a + f"{n}_norm.weight"), c.rms_norm_eps) for n in "qk"] if c.qk_norm else [None, None]
            attention = Attention(
                c,
                linear(qkv, [a + f"{n}_proj.bias" for n in "qkv"] if c.attention_bias else None),
                linear([a + "o_proj.weight"], [a + "o_proj.bias"] if c.o_proj_bias else None),
                *norms,
            )
            mlp = FeedForward(*(linear([p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up", "down")))
            layers.append(
                Block(
                    attention,
                    mlp,
                    RMSNorm(t(p + "input_layernorm.weight"), c.rms_norm_eps),
                    RMSNorm(t(p + "post_attention_layernorm.weight"), c.rms_norm_eps),
                )
            )
        head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
        norm = RMSNorm(t("model.norm.weight"), c.rms_norm_eps)
        return cls(c, t("model.embed_tokens.weight"), layers, norm, linear([head]))

    def setup_caches(self, max_len: int) -> None:
        """Fresh zero KV caches of ``max_len`` positions (rounded up to a multiple of 8, as gpt-fast)."""
        self.max_len = -(-max_len // 8) * 8
        dev, dtype = self.rope_cos.device, self.tok_embeddings.weight.dtype
        for b in self.layers:
            b.attention.kv_cache = None  # free the old cache first
            b.attention.kv_cache = KVCache(
                self.config.num_key_value_heads, self.max_len, self.config.head_dim, dtype, dev
            )

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Tokens idx [1, T] at positions input_pos [T] -> logits [1, T, vocab] in the model dtype."""
        mask = (torch.arange(self.max_len, device=idx.device) <= input_pos[:, None])[None, None]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))


def decode_one_token(model: Decoder, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One greedy decode step: token x [1, 1] at input_pos [1] -> next token [1, 1] (int64)."""
    return model(x, input_pos)[:, -1].argmax(-1, keepdim=True)


# gpt-fast's Inductor settings (generate.py); applied around its compilation, see bench.time_gptfast
INDUCTOR = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}


def decode_step(compile: bool) -> Callable[[Decoder, torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`decode_one_token` under the math SDPA backend, compiled as gpt-fast does when ``compile``."""
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True) if compile else decode_one_token

    def run(model, x, input_pos):
        with sdpa_kernel(SDPBackend.MATH):
            return step(model, x, input_pos)

    return run


@torch.no_grad()
def prefill(model: Decoder, tokens: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Fill the caches with tokens [n] (eager, default SDPA backend, ``chunk`` tokens per forward so
    the attention scores stay bounded); return the last position's logits [vocab]."""
    for s in range(0, tokens.shape[0], chunk):
        ids = tokens[s : s + chunk]
        logits = model(ids[None], torch.arange(s, s + ids.shape[0], device=ids.device))
    return logits[0, -1]
