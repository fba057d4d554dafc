"""Benchmarks of the ops backends (``python -m tileinfer.bench.ops``) and the model shapes they use.

``MODELS`` holds the shapes of the checkpoints the engine ships configs for (hidden size, heads,
KV heads, head dim, intermediate size, vocabulary): kernels are benchmarked, tested and compiled
ahead of time at these shapes with random weights (decode speed does not depend on the values).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    qk_norm: bool = True
    qkv_bias: bool = False

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


MODELS = {m.name: m for m in [
    ModelShape("qwen3-0.6b", 1024, 16, 8, 128, 3072, 151936),
    ModelShape("qwen3-4b", 2560, 32, 8, 128, 9728, 151936),
    ModelShape("qwen3-8b", 4096, 32, 8, 128, 12288, 151936),
    ModelShape("qwen2.5-0.5b", 896, 14, 2, 64, 4864, 151936, qk_norm=False, qkv_bias=True),
    ModelShape("qwen2.5-1.5b", 1536, 12, 2, 128, 8960, 151936, qk_norm=False, qkv_bias=True),
    ModelShape("smollm2-135m", 576, 9, 3, 64, 1536, 49152, qk_norm=False),
]}
