"""Quantized checkpoints on disk: a Hugging Face style folder the engine loads back as it is.

Layout of a folder written by :func:`write_checkpoint`:

* ``model.safetensors``: int8 weights with float32 ``<name>_scale`` tensors beside them, the key
  smoothing scales ``model.layers.{i}.self_attn.k_smooth`` (float32 [kv_heads, head_dim], for the
  record: they are already folded into the q/k weights), every other tensor in BF16.
* ``config.json``: the source model's config plus a ``quantization_config`` section
  (:func:`quantization_config`), which says among other things whether to run an INT8 KV cache.
* the tokenizer files (``tokenizer.save(folder)``).

``tileinfer.core.checkpoint.load_checkpoint`` + ``Transformer.from_state_dict`` load it; pass
``kv_int8=kv_int8_of(checkpoint)`` to the ``ModelRunner``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantize.scheme import BUILTIN_CALIBRATION, calibration_text
from tileinfer.core import files
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.errors import UserError
from tileinfer.models.transformer import SCALE_SUFFIX

QUANT_METHOD = "tileinfer-int8"
WEIGHTS_FILE = "model.safetensors"
_FLOAT32_SUFFIXES = (SCALE_SUFFIX, ".k_smooth")  # kept in float32; every other float goes to BF16


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def source_sha256(path: str | os.PathLike) -> dict[str, str]:
    """sha256 of a source checkpoint's files: the .gguf file, or a folder's config.json and weights.

    Returns {file name: hex digest}.
    """
    path = Path(path)
    if path.is_file():
        return {path.name: _sha256(path)}
    files = [path / "config.json", *sorted(path.glob("*.safetensors")), *sorted(path.glob("*.safetensors.index.json"))]
    return {p.name: _sha256(p) for p in files if p.is_file()}


def quantization_config(info: dict, source: str | os.PathLike | None = None) -> dict:
    """The ``quantization_config`` section of config.json for what :func:`quantize.apply` did.

    Args:
        info: the info dict of the apply() call (its spec is the effective one).
        source: the source checkpoint's path, recorded with its files' sha256; None records nothing.

    Returns:
        A JSON-serialisable dict: ``quant_method`` ("tileinfer-int8"), ``weights`` and ``kv_cache``
        ("bf16"/"int8"), ``smooth_keys``; when keys are smoothed also ``smooth_alpha``,
        ``calibration`` ("builtin" or the text's path), ``calibration_sha256`` (of its UTF-8
        bytes), ``calibration_tokens``; ``source`` and ``source_sha256`` when given.
    """
    spec = info["spec"]
    qc = {
        "quant_method": QUANT_METHOD,
        "weights": spec.weights,
        "kv_cache": spec.kv_cache,
        "smooth_keys": spec.smoothing,
    }
    if spec.smoothing:
        text = calibration_text(spec.calibration)
        qc.update(
            smooth_alpha=spec.smooth_alpha,
            calibration=spec.calibration or BUILTIN_CALIBRATION,
            calibration_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            calibration_tokens=info["calibration_tokens"],
        )
    if source is not None:
        qc.update(source=str(source), source_sha256=source_sha256(source))
    return qc


def kv_int8_of(checkpoint: Checkpoint) -> bool:
    """Whether a checkpoint asks for an INT8 KV cache (a tileinfer-int8 one with ``kv_cache: int8``)."""
    qc = checkpoint.quantization or {}
    return qc.get("quant_method") == QUANT_METHOD and qc.get("kv_cache") == "int8"


def _stored(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as written: int8 and scales as they are, other floats in BF16, contiguous, unshared."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        if t.is_floating_point():
            t = t.float() if name.endswith(_FLOAT32_SUFFIXES) else t.to(torch.bfloat16)
        t = t.contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage (e.g. a tied lm_head kept in BF16)
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def _publish_modes(folder: Path) -> None:
    """Give the folder and its files the usual modes under the umask (mkdtemp makes the folder 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.rglob("*"):
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)


def _is_quantized_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint this tool wrote (its quant_method), not another's."""
    try:
        qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def check_out(out: str | os.PathLike, force: bool) -> None:
    """Raise UserError unless ``out`` is absent, an empty folder, or (with ``force``) a quantized
    checkpoint written earlier: ``force`` never deletes a folder of anything else."""
    out = Path(out)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not (out.is_dir() and _is_quantized_checkpoint(out)):
        raise UserError(f"{out} exists and is not a quantized checkpoint written by this tool; choose another --out")
    if not force:
        raise UserError(f"{out} holds a quantized checkpoint; pass --force to replace it")


def write_checkpoint(
    out: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    hf_config: dict,
    quant_config: dict,
    tokenizer=None,
    force: bool = False,
) -> Path:
    """Write a quantized checkpoint folder, atomically.

    Everything is written into a temporary folder beside ``out``, which is then renamed to ``out``:
    a crash leaves no half-written checkpoint under the target name.

    Args:
        out: the folder to create.
        state_dict: from :func:`quantize.apply`.
        hf_config: the source model's config.json dictionary (a ``quantization_config`` in it is
            replaced).
        quant_config: from :func:`quantization_config`.
        tokenizer: saved with ``tokenizer.save(folder)``; None writes no tokenizer files.
        force: replace ``out`` if it holds a quantized checkpoint written earlier.

    Returns:
        ``out`` as a Path.

    Raises:
        UserError: ``out`` exists and is neither an empty folder nor (with ``force``) a quantized
            checkpoint; an OS failure (full disk, read-only or forbidden folder), naming ``out``. The
            temporary folder is removed and an earlier checkpoint at ``out`` is kept.
    """
    out = Path(out)
    check_out(out, force)
    # the temporary folder becomes out (an earlier one is moved aside first, rename cannot replace a
    # non-empty folder, and put back if that fails); OS failures are one line (tileinfer.core.files)
    with files.atomic_path(out, folder=True) as tmp:
        save_file(_stored(state_dict), tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        config = {**hf_config, "quantization_config": quant_config}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        _publish_modes(tmp)
    return out
