"""Checkpoint loading: a Hugging Face folder (safetensors) or a GGUF file, into config + tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError

# Tensors a checkpoint may hold beyond the ones its config needs: a stored lm_head of tied
# embeddings (transformers uses it when it differs), the float32 scales beside INT8 weights and the
# recorded key-smoothing scales of a quantized checkpoint (quantize/checkpoint.py), and the RoPE
# tables older transformers versions saved (recomputed, as transformers does).
_SCALE_SUFFIX = "_scale"
_RECORDS = (".k_smooth", ".rotary_emb.inv_freq")


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
        """The ``quantization_config`` of a pre-quantized checkpoint (one ``python -m quantize``
        wrote, with ``quant_method`` ``tileinfer-int8``; ``weights``: ``"int8"``/``"bf16"``,
        ``kv_cache``, ...), or None for a float checkpoint. :func:`load_checkpoint` refuses int8
        tensors without one, so None means no weight is quantized."""
        return self.hf_config.get("quantization_config")


def load_checkpoint(path, dtype: torch.dtype = torch.bfloat16) -> Checkpoint:
    """Load a checkpoint folder or GGUF file. GGUF tensors are dequantized to ``dtype``; a folder's
    tensors keep their stored dtype.

    Every config.json / GGUF metadata field that changes the math is implemented or refused (see
    :mod:`tileinfer.core.config`), and the tensors must be exactly the ones the config needs: a
    tensor the model would not use (say an o_proj bias that ``attention_bias`` does not switch on)
    is refused rather than silently dropped.

    Raises:
        UserError: the path does not exist, is neither a folder nor a .gguf file, or is corrupt; a
            refused config field (naming it); missing or unused tensors; a tensor holding NaN or
            infinity; int8 tensors without a ``quantization_config``.
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
    try:
        config = ModelConfig.from_hf(hf_config)
    except UserError as e:
        raise UserError(f"{path / 'config.json' if path.is_dir() else path}: {e}") from None
    _check_tensors(path, config, sd, hf_config)
    return Checkpoint(path, config, hf_config, sd)


def _check_tensors(path: Path, config: ModelConfig, sd: dict[str, torch.Tensor], hf_config: dict) -> None:
    need = config.tensor_names()
    if missing := [n for n in need if n not in sd]:
        raise UserError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    allowed = {*need, "lm_head.weight"}
    allowed |= {n + _SCALE_SUFFIX for n in allowed}
    if extra := [n for n in sd if n not in allowed and not n.endswith(_RECORDS)]:
        raise UserError(
            f"{path}: tensor {extra[0]} is not used by a {config.model_type} model as its config describes it "
            "(a bias its attention_bias does not switch on, an MLP bias, or another architecture's tensor)"
        )
    if "quantization_config" not in hf_config and (
        q := next((n for n, t in sd.items() if t.dtype == torch.int8), None)
    ):
        raise UserError(f"{path}: tensor {q} is int8 but config.json has no quantization_config")
