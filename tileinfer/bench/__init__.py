"""Benchmark, profiling and ahead-of-time compile tooling for the ops backends (no kernels here).

* :mod:`.ops` - the op benchmark (``python -m tileinfer.bench.ops``): every op of each backend and
  torch, timed from CUDA graphs against measured ceilings, with tile sweeps of both backends;
  its cases live in :mod:`.cases`;
* :mod:`.profile` - Nsight Compute profile of those cases;
* :mod:`.decode` - whole-model decode speed, eager and from a CUDA graph;
* :mod:`.aot` - every kernel the models launch compiled ahead of time, Triton or cuTile
  (``python -m tileinfer.bench.aot``; on the CPU for sm_90 it is the CI compile check).

Shapes come from the model registry (:func:`tileinfer.core.registry.model_config`: the ``config``
of ``conf/model/NAME.yaml``), with random weights (speed does not depend on the values). Results and
kernel notes are kept outside the package, in the top-level ``benchmarks/`` folder.
"""

from __future__ import annotations

from tileinfer.core.config import ModelConfig


def qkv_out(c: ModelConfig) -> int:
    """Rows of the stacked q/k/v projection: (heads + 2 * KV heads) * head_dim."""
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
