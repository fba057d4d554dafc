"""Hugging Face checkpoint folders: ``config.json`` plus safetensors weights.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json`` naming the shard
of every tensor) layouts, as written by transformers' ``save_pretrained``. Tensors are loaded as
stored ([out, in] for linear layers), without transposes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tileinfer.core.checkpoint.checks import all_finite
from tileinfer.core.errors import UserError


def load_hf_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every safetensors tensor of a checkpoint folder.

    Returns (config dict, {name: tensor in its stored dtype}).

    Raises:
        UserError: no config.json, no safetensors file, a shard named by the index is missing, a
        file is truncated/corrupt, or a tensor holds NaN or infinity (naming it and its file).
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{folder} has no config.json (not a Hugging Face checkpoint folder)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path} is not valid JSON: {e}") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise UserError(f"{folder} has no .safetensors weights")
    state = {}
    for name in shards:
        path = folder / name
        if not path.is_file():
            raise UserError(f"shard {name} named in {index.name} is missing from {folder}")
        try:
            shard = load_file(path)
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {path}: {e} (truncated or corrupt?)") from None
        # found here, a NaN weight costs nothing; found as non-finite logits, a whole run
        if bad := next((n for n, t in shard.items() if not all_finite(t)), None):
            raise UserError(f"{path}: tensor {bad} holds NaN or infinite values; the checkpoint is corrupt")
        state.update(shard)
    return config, state
