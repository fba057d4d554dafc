"""Quantization of tileinfer models: INT8 weights, INT8 KV cache switch, smoothed keys, checkpoints.

- :mod:`quantize.weights`: weight-only INT8, one scale per output channel.
- :mod:`quantize.smoothing`: calibrated power-of-two key scales for an INT8 KV cache (QServe's
  SmoothAttention), folded into the q/k weights.
- :mod:`quantize.scheme`: :class:`QuantScheme` and :func:`apply`, the in-memory entry point.
- :mod:`quantize.checkpoint`: quantized checkpoint folders; ``python -m quantize`` writes one.

This package imports the engine (``tileinfer``); the engine never imports it.
"""

from quantize.checkpoint import kv_int8_of, quantization_config, write_checkpoint
from quantize.scheme import (
    DEFAULT_CALIBRATION_TOKENS,
    NAMED,
    PRECISIONS,
    QuantScheme,
    apply,
    calibration_text,
    named_scheme,
)
from quantize.smoothing import DEFAULT_ALPHA

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_CALIBRATION_TOKENS",
    "NAMED",
    "PRECISIONS",
    "QuantScheme",
    "apply",
    "calibration_text",
    "kv_int8_of",
    "named_scheme",
    "quantization_config",
    "write_checkpoint",
]
