"""Rotary position embedding (RoPE) tables.

RoPE (Su et al., 2021, "RoFormer") rotates channel pairs ``(i, i + head_dim/2)`` of each query and
key head by the angle ``position * inv_freq[i]`` (the "rotate half" convention of transformers'
Llama/Qwen code, which every backend here uses). Llama-3 style rope scaling stretches the low
frequencies (transformers ``_compute_llama3_parameters``); ``linear`` scaling divides them all.
"""

from __future__ import annotations

import math

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim / 2], after the config's rope scaling.

    Raises:
        UserError: a rope scaling type other than ``llama3`` or ``linear``.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind != "llama3":
        raise UserError(f"rope scaling {kind!r} is not supported (only llama3 and linear)")
    factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_positions: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), each float32 [max_positions, head_dim / 2]."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_frequencies(cfg)[None, :]
    return angles.cos().to(device), angles.sin().to(device)
