"""The typed configuration of every command: Hydra structured configs, checked once.

``conf/*.yaml`` give the values; the dataclasses here give the types, the defaults and the allowed
ranges. Hydra validates types while it composes (``eval.n_score=abc`` is refused, in Hydra's own
few-line message, before anything runs), and :func:`load` turns the composed config into a
:class:`Config` whose ``__post_init__`` checks ranges and choices, so a job only ever sees checked
settings. Every command
(sweep, gate, record) composes the same schema; ``gate`` is only set by conf/gate.yaml.

Ranges live in field metadata (``lo``/``hi``/``choices``) so the rule sits next to the field.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from quantize import DEFAULT_ALPHA, DEFAULT_CALIBRATION_TOKENS, PRECISIONS, QuantScheme
from tileinfer.core.errors import UserError
from tileinfer.ops import BACKENDS


def _num(default, lo=None, hi=None):
    return field(default=default, metadata={"lo": lo, "hi": hi})


def _choice(default, *choices):
    return field(default=default, metadata={"choices": choices})


@dataclass
class ModelGroup:
    """``conf/model/NAME.yaml``: see tileinfer.core.registry."""

    name: str = MISSING
    source: dict[str, Any] = MISSING
    config: Optional[dict[str, Any]] = None  # config.json fields; checked against the checkpoint


@dataclass
class QuantGroup:
    """``conf/quant/NAME.yaml``: a named :class:`quantize.QuantScheme`."""

    name: str = MISSING
    weights: str = _choice(MISSING, *PRECISIONS)  # int8: symmetric, one float32 scale per output channel
    kv_cache: str = _choice(MISSING, *PRECISIONS)  # int8: symmetric, one float32 scale per cached vector
    smooth_keys: bool = True  # per-channel key scales folded into the query side (INT8 KV cache only)
    smooth_alpha: float = _num(DEFAULT_ALPHA, 0.0, 1.0)  # s = max|k|^alpha, rounded to a power of two
    calibration: Optional[str] = None  # text file for the key-smoothing calibration; None: built-in text
    calibration_tokens: int = _num(DEFAULT_CALIBRATION_TOKENS, 1)  # tokens of that text run to calibrate

    def scheme(self) -> QuantScheme:
        """The effective scheme (smoothing dropped where it cannot act)."""
        return QuantScheme(
            weights=self.weights,
            kv_cache=self.kv_cache,
            smooth_keys=self.smooth_keys,
            smooth_alpha=self.smooth_alpha,
            calibration=self.calibration,
            calibration_tokens=self.calibration_tokens,
        ).effective()


@dataclass
class CtxGroup:
    """``conf/ctx/NAME.yaml``: positions before the scored window."""

    name: str = MISSING
    tokens: int = _num(MISSING, 1)


@dataclass
class BackendGroup:
    """``conf/backend/NAME.yaml``; ``auto``: the fast backend on CUDA, the reference on the CPU."""

    name: str = _choice(MISSING, "auto", *BACKENDS)


@dataclass
class SpecGroup:
    """Speculative decoding (``conf/spec``): only ``none`` (plain decoding) so far."""

    name: str = _choice("none", "none")


@dataclass
class EvalGroup:
    prompt_sets: list[str] = field(default_factory=lambda: ["edit", "explain"])  # built-in names or file paths
    n_score: int = _num(1024, 1)  # scored positions: the base model's greedy reply after the prompt


@dataclass
class KVSettings:
    page_size: int = _num(64, 1)  # positions per KV page
    prefill_chunk: int = _num(512, 1)  # most tokens per prefill step (bounds activation memory)


@dataclass
class BaseSettings:
    """The base side of a job: what the candidate is compared with (llama.cpp's "base" logits)."""

    source: str = _choice("live", "live", "stored")  # live: computed here; stored: top-k files under dir
    backend: Optional[str] = _choice(None, None, *BACKENDS)  # None: the candidate's backend
    quant: str = _choice("bf16", "bf16", "same")  # bf16: the BF16 model; same: the candidate's quant config
    dir: str = "evals/base_logits"  # stored base logits (written by python -m tileinfer.record)
    top_k: int = _num(64, 1)  # tokens kept per position in stored base logits


@dataclass
class SpeedSettings:
    decode_tokens: int = _num(128, 1)  # decode steps timed after ctx cached positions
    warmup: bool = True  # one short prefill + decode first (kernel compilation, allocator)
    cuda_graph: bool = True  # decode steps replay a captured CUDA graph (triton/cutile on CUDA only)


@dataclass
class GateSettings:
    """``conf/gate.yaml``'s ``gate``: see tileinfer.gate."""

    baseline: Optional[str] = MISSING  # None: kernel checks only
    update_baseline: bool = False
    bounds: dict[str, dict[str, Any]] = MISSING  # {setup: {kl_mean, kl_p999, top1_agree}}
    max_increase: Any = _num(MISSING, -1.0)  # < 0 demands an improvement
    floor: dict[str, Any] = MISSING  # {kl_mean, kl_p999}
    max_top1_drop: Any = _num(MISSING, 0.0, 1.0)

    def __post_init__(self):
        check_ranges(self, "gate.")
        if not isinstance(self.bounds, dict) or not self.bounds:
            raise UserError("gate.bounds: expected bounds per setup, e.g. gate.bounds.bfloat16.kl_mean=1e-3")
        for setup, b in self.bounds.items():
            for metric, hi in (("kl_mean", None), ("kl_p999", None), ("top1_agree", 1.0)):
                check_number(
                    f"gate.bounds.{setup}.{metric}", b.get(metric) if isinstance(b, dict) else None, lo=0.0, hi=hi
                )
        for metric in ("kl_mean", "kl_p999"):
            check_number(
                f"gate.floor.{metric}", self.floor.get(metric) if isinstance(self.floor, dict) else None, lo=0.0
            )


@dataclass
class Config:
    """The whole configuration of a command (conf/config.yaml and its groups)."""

    model: ModelGroup = MISSING
    quant: QuantGroup = MISSING
    ctx: CtxGroup = MISSING
    backend: BackendGroup = MISSING
    spec: SpecGroup = field(default_factory=SpecGroup)
    eval: EvalGroup = field(default_factory=EvalGroup)
    runs_dir: str = "runs"  # rows, caches and logs go here (relative to the current directory)
    device: str = _choice("auto", "auto", "cpu", "cuda")  # auto: cuda when available
    dtype: str = _choice("bfloat16", "bfloat16", "float16", "float32")  # model dtype of the BF16 configuration
    kv: KVSettings = field(default_factory=KVSettings)
    base: BaseSettings = field(default_factory=BaseSettings)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    gate: Optional[GateSettings] = None  # set by conf/gate.yaml only

    def __post_init__(self):
        check_ranges(self)
        if not self.eval.prompt_sets:
            raise UserError("eval.prompt_sets must be a non-empty list, e.g. eval.prompt_sets=[edit,explain]")


def check_number(key: str, v, kind=float, lo=None, hi=None) -> None:
    """Raise UserError unless setting ``key``'s value ``v`` is a finite ``kind`` (int or float) in
    [lo, hi] (None: unbounded on that side)."""
    try:
        ok = not isinstance(v, bool) and math.isfinite(float(v)) and float(v) == kind(v)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise UserError(f"{key}={v!r}: expected {'an integer' if kind is int else 'a number'}")
    if (lo is not None and kind(v) < lo) or (hi is not None and kind(v) > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise UserError(f"{key}={v}: must be {rng}")


def check_ranges(node, prefix: str = "") -> None:
    """Check every field of dataclass ``node`` (recursively) against its ``lo``/``hi``/``choices``
    metadata. Raises UserError naming the first setting out of range."""
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_ranges(value, key + ".")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            shown = ", ".join("null" if c is None else str(c) for c in f.metadata["choices"])
            raise UserError(f"{key}={value}: expected one of {shown}")
        elif "lo" in f.metadata:
            check_number(key, value, int if f.type == "int" else float, f.metadata["lo"], f.metadata["hi"])


def unknown_keys(node: DictConfig, schema_type: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` that ``schema_type`` (a dataclass) has no field for, recursively. Hydra lets
    ``+key=value`` add them to a typed node and ``OmegaConf.to_object`` then drops them silently."""
    names = {f.name: f for f in fields(schema_type)}
    out = []
    for key in node.keys():
        if key not in names:
            out.append(f"{prefix}{key}")
        elif isinstance(node[key], DictConfig) and is_dataclass(OmegaConf.get_type(node[key])):
            out += unknown_keys(node[key], OmegaConf.get_type(node[key]), f"{prefix}{key}.")
    return out


# Settings renamed since earlier releases: old group -> new group (an old name gets this hint).
RENAMED_SETTINGS = {"reference": "base"}


def check_renamed(prog: str, argv: list[str], exit_code: int = 1) -> None:
    """Exit with one line when the command line uses a renamed setting (``reference.source=...``):
    Hydra would answer with several lines that do not name the new one."""
    for arg in argv:
        group = arg.lstrip("+~").split("=", 1)[0].split(".", 1)[0]
        if group in RENAMED_SETTINGS and "=" in arg:
            new = arg.lstrip("+~").replace(group, RENAMED_SETTINGS[group], 1)
            print(f"{prog}: error: {group}.* is now {RENAMED_SETTINGS[group]}.*: write {new}", file=sys.stderr)
            sys.exit(exit_code)


def load(cfg: DictConfig) -> Config:
    """The checked :class:`Config` of a composed Hydra config.

    Raises:
        UserError: a setting the schema does not have (e.g. ``+quantt=int8_both``), out of its range
            or not one of its choices (one line naming it).
    """
    unknown = unknown_keys(cfg, Config)
    if unknown:
        raise UserError(f"unknown setting {unknown[0]}: see tileinfer/jobs/schema.py for the settings")
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:  # e.g. a conf/model file without a source
        raise UserError(f"setting {e.full_key} has no value") from None


def register() -> None:
    """Register the schema with Hydra (conf/config.yaml lists ``schema`` first in its defaults)."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
