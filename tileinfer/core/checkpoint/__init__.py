"""Checkpoint loading: a Hugging Face folder (safetensors) or a GGUF file, into config + tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError


@dataclass
class Checkpoint:
    """What a checkpoint holds.

    Attributes:
        path: the folder or .gguf file it came from.
        config: the model's hyper-parameters.
        hf_config: the raw config.json dictionary (a quantized checkpoint's ``quantization_config``
            lives here).
        state_dict: tensors under transformers' names; INT8 weights are int8 with a float32
            ``<name>_scale`` beside them.
    """

    path: Path
    config: ModelConfig
    hf_config: dict
    state_dict: dict[str, torch.Tensor]

    @property
    def quantization(self) -> dict | None:
        return self.hf_config.get("quantization_config")


def load_checkpoint(path, dtype: torch.dtype = torch.bfloat16) -> Checkpoint:
    """Load a checkpoint folder or GGUF file. GGUF tensors are dequantized to ``dtype``.

    Raises:
        UserError: the path does not exist, is neither a folder nor a .gguf file, or is corrupt.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from tileinfer.core.checkpoint.gguf_file import load_gguf

        hf_config, sd = load_gguf(path, dtype=dtype)
    elif path.is_dir():
        from tileinfer.core.checkpoint.safetensors_hf import load_hf_folder

        hf_config, sd = load_hf_folder(path)
    else:
        raise UserError(f"{path} is neither a checkpoint folder nor a .gguf file")
    return Checkpoint(path, ModelConfig.from_hf(hf_config), hf_config, sd)
