"""The model registry: the models ``conf/model/*.yaml`` declares, and their shapes.

Each file is one Hydra config-group option (``model=NAME``) with a ``name``, a ``source`` (see
:mod:`tileinfer.core.fetch`) and, for every shipped model, a ``config`` (the architecture as
config.json fields). ``config`` is the one model-shape table of the project: benchmarks,
ahead-of-time compilation and the kernel tests take their shapes from :func:`model_config`, and a
job checks a loaded checkpoint against it (:func:`check_checkpoint_config`), so the table cannot
drift from the real files. Random-weight models (``source.random``) are drawn with exactly these
shapes.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError

MODEL_CONF_DIR = Path(str(resources.files("tileinfer.conf") / "model"))  # conf/model, installed as tileinfer.conf
# Fields of ``config`` a loaded checkpoint must agree with (the ones that set kernel shapes, and
# the biases, which set which GEMM variants the benchmarks and ahead-of-time compilation build).
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "o_proj_bias",
)


def known_models() -> list[str]:
    """Names of the models in ``conf/model/*.yaml``, sorted."""
    return sorted(p.stem for p in MODEL_CONF_DIR.glob("*.yaml"))


def model_entry(name: str) -> dict:
    """The parsed ``conf/model/NAME.yaml``.

    Raises:
        UserError: no such model (the message lists the known ones), or a file without a ``source``
            mapping.
    """
    path = MODEL_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown model {name!r}; known models: {', '.join(known_models()) or 'none'}")
    entry = yaml.safe_load(path.read_text())
    if not isinstance(entry, dict) or not isinstance(entry.get("source"), dict):
        raise UserError(f"{path}: expected a mapping with a 'source'")
    return entry


def shaped_models() -> list[str]:
    """The registered models with a ``config`` (all shipped ones; optional for a user's own)."""
    return [n for n in known_models() if isinstance(model_entry(n).get("config"), dict)]


def model_config(name: str, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of registered model ``name`` (``overrides`` replace config.json
    fields, e.g. ``num_hidden_layers=1`` for a one-layer kernel test).

    Raises:
        UserError: unknown model, or one whose file has no ``config``.
    """
    entry = model_entry(name)
    if not isinstance(entry.get("config"), dict):
        raise UserError(f"conf/model/{name}.yaml has no 'config' (the architecture as config.json fields)")
    return ModelConfig.from_hf(model_entry(name)["config"] | overrides)


def check_checkpoint_config(name: str, config: ModelConfig, want: dict | None) -> None:
    """Raise UserError when a loaded checkpoint's shapes differ from ``want``, the ``config`` of model
    ``name``'s conf file (a wrong file behind a name, or a stale table); ``want=None`` is not checked."""
    if want is None:
        return
    want = ModelConfig.from_hf(want)
    bad = [
        f"{k} {getattr(config, k)} (conf/model says {getattr(want, k)})"
        for k in SHAPE_FIELDS
        if getattr(config, k) != getattr(want, k)
    ]
    if bad:
        raise UserError(f"checkpoint of {name} does not match its conf/model file's config: {'; '.join(bad)}")
