"""Tiny random Hugging Face checkpoints of each supported architecture, written by the tests.

Norm weights are randomised too (transformers initialises them to ones, which would hide a norm
applied to the wrong axis).
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0, head_dim=16)),
    "llama3-scaled": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            head_dim=16,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6)),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(rope_theta=1e6, head_dim=32, num_key_value_heads=1),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(rope_theta=1e6, sliding_window=None, head_dim=16),
    ),
}


def make_tiny(kind: str, folder, seed: int = 0):
    """Write a random float32 checkpoint of architecture ``kind`` to ``folder``; return the HF model."""
    cfg_cls, model_cls, extra = CONFIGS[kind]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **extra})
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model
