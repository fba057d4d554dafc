"""tileinfer: an LLM inference engine with hand-written tile kernels, used as a batch evaluation
and quantization-quality toolkit (KL divergence and top-1 agreement against BF16, beside speed)."""

__version__ = "0.1.0"
