"""Benchmarks, profiling and the ahead-of-time compile of the ops backends, outside the package.

Every tool here runs as a module from the checkout's root, ``python -m benchmarks.NAME`` (tests
import them with the root on ``sys.path``, pytest's ``pythonpath``); the installed ``tileinfer``
never imports this folder (an import-linter contract).

* :mod:`.ops` - the op benchmark (``python -m benchmarks.ops``): every op of each backend and
  torch, timed from CUDA graphs against measured ceilings, with tile sweeps of both backends;
  its cases live in :mod:`.cases`;
* :mod:`.profile` - Nsight Compute profile of those cases;
* :mod:`.decode` - whole-model decode speed, eager and from a CUDA graph;
* :mod:`.aot` - every kernel the models launch compiled ahead of time, Triton or cuTile
  (``python -m benchmarks.aot``; on the CPU for sm_90 it is the CI compile check).

Shapes come from the model registry (:func:`tileinfer.core.registry.model_config`: the ``config``
of ``conf/model/NAME.yaml``), with random weights (speed does not depend on the values). Results
are in ``results/`` beside this file, kernel notes in ``NOTES.md`` and ``cutile-NOTES.md``.
"""

from __future__ import annotations

from tileinfer.core.config import ModelConfig


def qkv_out(c: ModelConfig) -> int:
    """Rows of the stacked q/k/v projection: (heads + 2 * KV heads) * head_dim."""
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
