"""Model definitions: one plain-tensor decoder for the supported architectures."""

from tileinfer.models.transformer import Layer, Transformer

__all__ = ["Layer", "Transformer"]
