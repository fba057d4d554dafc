"""Random-weight checkpoints with a real model's shapes, made in memory on the target device.

Decode and prefill speed do not depend on weight values, and a kernel's drift against the reference
backend can be measured on any weights, so GPU work on models too large to carry to the device uses
these. The initialisation keeps activations O(1) through depth (weights ~ N(0, 1/fan_in), residual
outputs scaled by 1/sqrt(2 * layers), as in GPT-2) and makes next-token distributions peaked like
a trained model's (logit standard deviation ~4), so top-1 agreement is meaningful.
"""

from __future__ import annotations

import math

import torch

from tileinfer.core.config import ModelConfig

LOGIT_STD = 4.0


def random_state_dict(hf_config: dict, seed: int = 0, dtype=torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """A state dict under transformers' names for ``hf_config`` (a config.json dictionary).

    Tensors are drawn on ``device`` from a generator seeded with ``seed`` and stored in ``dtype``;
    the same seed on the same device type gives the same weights.
    """
    c = ModelConfig.from_hf(hf_config)
    gen = torch.Generator(device=device).manual_seed(seed)
    d, h, kvh, hid, inter = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.intermediate_size
    depth = 1 / math.sqrt(2 * c.num_hidden_layers)

    def normal(shape, std):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)

    sd = {
        "model.embed_tokens.weight": normal((c.vocab_size, hid), LOGIT_STD / math.sqrt(hid)),
        "model.norm.weight": norm(hid),
    }
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = normal((c.vocab_size, hid), LOGIT_STD / math.sqrt(hid))
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd |= {
            p + "input_layernorm.weight": norm(hid),
            p + "post_attention_layernorm.weight": norm(hid),
            a + "q_proj.weight": normal((h * d, hid), hid**-0.5),
            a + "k_proj.weight": normal((kvh * d, hid), hid**-0.5),
            a + "v_proj.weight": normal((kvh * d, hid), hid**-0.5),
            a + "o_proj.weight": normal((hid, h * d), depth * (h * d) ** -0.5),
            p + "mlp.gate_proj.weight": normal((inter, hid), hid**-0.5),
            p + "mlp.up_proj.weight": normal((inter, hid), hid**-0.5),
            p + "mlp.down_proj.weight": normal((hid, inter), depth * inter**-0.5),
        }
        if c.attention_bias:
            sd |= {a + f"{n}_proj.bias": normal((w,), 0.1) for n, w in (("q", h * d), ("k", kvh * d), ("v", kvh * d))}
        if c.o_proj_bias:
            sd[a + "o_proj.bias"] = normal((hid,), 0.1 * depth)
        if c.qk_norm:
            sd |= {a + "q_norm.weight": norm(d), a + "k_norm.weight": norm(d)}
    return sd
