"""Loading a model as a job names it: a checkpoint source (tileinfer.core.fetch), its conf/model
shape table, a dtype and a device, to a :class:`Loaded` model with its tokenizer and content hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tileinfer.core import registry
from tileinfer.core.checkpoint import Checkpoint, load_checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.fetch import pull, pull_source
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.models.transformer import Transformer


@dataclass
class Loaded:
    """A loaded float model: its checkpoint, tokenizer, weights on the device and content hash."""

    checkpoint: Checkpoint
    tokenizer: Tokenizer
    model: Transformer
    sha256: str
    device: torch.device


def content_sha256(source: dict, config: dict | None, path: Path | None) -> str:
    """The checkpoint's sha256 when its source names one (checked by the pull), a hash of a random
    model's config and seed, else a sha256 of its files' contents (names and bytes; a local file
    edited in place, whatever its size and time stamp, is another model)."""
    sha = source.get("sha256")
    if sha:
        return str(sha)
    if path is None:
        drawn = source["random"] | {"config": config}
        return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()
    h = hashlib.sha256()
    for f in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" if f != path else b"")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def load_model(name: str, source: dict, config: dict | None, dtype: torch.dtype, device: torch.device) -> Loaded:
    """Pull and load model ``name`` from its ``source`` (a conf/model file's), checked against its shape
    table ``config`` (None: not checked); random weights (``source.random``) are drawn on the device.

    Raises:
        UserError: a missing or corrupt checkpoint, a quantized one (written by ``python -m quantize``:
            its weights are int8 already, so a bf16 row would mislabel them), or one whose shapes
            differ from ``config``.
    """
    rnd = source.get("random")
    if rnd is not None:
        path, hf = None, config
        tok_path = Path(rnd["tokenizer"]) if Path(rnd["tokenizer"]).is_dir() else pull(rnd["tokenizer"])
        ck = Checkpoint(
            Path(f"random:{name}"), ModelConfig.from_hf(hf), hf, random_state_dict(hf, int(rnd["seed"]), dtype, device)
        )
    else:
        path = tok_path = pull_source(name, source)
        ck = load_checkpoint(path, dtype=dtype)
        if ck.quantization is not None:
            raise UserError(
                f"{path} is a quantized checkpoint (written by python -m quantize); a sweep quantizes "
                "in memory: run it on the BF16 checkpoint with the quant config to evaluate"
            )
        registry.check_checkpoint_config(name, ck.config, config)
    model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=dtype, device=device)
    return Loaded(ck, Tokenizer.load(tok_path), model, content_sha256(source, config, path), device)
