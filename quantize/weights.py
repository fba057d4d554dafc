"""Weight-only INT8: every linear layer and the lm_head, symmetric, one scale per output channel.

The scheme is the per-channel absmax quantization of LLM.int8() (Dettmers et al., 2022) and
SmoothQuant (Xiao et al., 2023), as TileInfer.jl stores it: ``w ≈ q * scale[:, None]`` with
``scale = max|w_row| / 127`` (:func:`tileinfer.ops.reference.quantize_int8`, so the engine and this
package round the same way). The embedding table and all norms stay in their float dtype.
"""

from __future__ import annotations

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.progress import progress_bar
from tileinfer.models.transformer import SCALE_SUFFIX
from tileinfer.ops.reference import quantize_int8

# The linear layers of one transformer block, under transformers' module names.
BLOCK_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def linear_weight_names(config: ModelConfig) -> list[str]:
    """Names of the weights INT8 quantization replaces: every block's linears, then ``lm_head.weight``."""
    return [f"model.layers.{i}.{m}.weight" for i in range(config.num_hidden_layers) for m in BLOCK_LINEARS] + [LM_HEAD]


def quantize_weights(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, progress: bool = False
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantize every linear weight and the lm_head to INT8 with per-output-channel scales.

    Args:
        state_dict: float tensors under transformers' names (not modified).
        config: the model's shapes (says how many layers, and whether the lm_head is tied).
        progress: show a tqdm bar.

    Returns:
        ``(new_state_dict, names)``: a new dict in which each quantized ``X.weight`` is int8
        [out, in] (values in [-127, 127]) with a float32 [out] ``X.weight_scale`` beside it; every
        other tensor is the same object as in ``state_dict``. A tied lm_head (no ``lm_head.weight``
        and ``tie_word_embeddings``) becomes its own int8 ``lm_head.weight``, quantized from the
        embedding, which stays in its float dtype for the lookup. ``names`` lists the quantized
        weights in order.

    Raises:
        UserError: a weight is missing (an untied model without ``lm_head.weight``), or already int8.
    """
    out = dict(state_dict)
    names = linear_weight_names(config)
    bar = progress_bar(len(names), "int8 weights" if progress else None, unit="tensor")
    for name in names:
        source = name
        if name == LM_HEAD and name not in state_dict and config.tie_word_embeddings:
            source = EMBED
        if source not in state_dict:
            raise UserError(f"checkpoint has no tensor {source!r}")
        w = state_dict[source]
        if w.dtype == torch.int8:
            raise UserError(f"tensor {source!r} is already int8; quantize a float checkpoint")
        out[name], out[name + SCALE_SUFFIX] = quantize_int8(w)
        bar.update(1)
    bar.close()
    return out, names
