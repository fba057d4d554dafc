"""The typed configuration of every command: Hydra structured configs, checked once.

``conf/*.yaml`` give the values; the dataclasses here (and each evaluation's settings,
:data:`evals.registry.EVALUATIONS`) give the types, the defaults and the allowed ranges. Hydra
validates types while it composes (``speed.repeats=abc`` is refused before anything runs), and
:func:`load` turns the composed config into a :class:`Config` whose ``__post_init__`` checks ranges
and choices, so a job only ever sees checked settings. Every command (sweep, gate, record) composes
the same schema; ``gate`` is only set by conf/gate.yaml. Ranges live in field metadata
(:mod:`tileinfer.core.settings`) so the rule sits next to the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from evals.registry import EVALUATIONS
from evals.verdicts import SPEC_TIE_MARGIN
from quantize import DEFAULT_ALPHA, DEFAULT_CALIBRATION_TOKENS, NAMED, PRECISIONS, QuantScheme
from tileinfer.core import gpu_slots
from tileinfer.core.errors import UserError
from tileinfer.core.fetch import SOURCES
from tileinfer.core.settings import check_number, check_ranges
from tileinfer.core.settings import choice as _choice
from tileinfer.core.settings import number as _num
from tileinfer.ops import BACKENDS


@dataclass
class ModelGroup:
    """``conf/model/NAME.yaml`` (see tileinfer.core.registry), or a local checkpoint: ``model.path``.

    ``model.path=FILE_OR_FOLDER`` runs a local ``.gguf`` file or transformers folder in place of the
    group's model: the name becomes the path's stem and the group's source and config are dropped
    (they describe another checkpoint).
    """

    name: str = MISSING
    source: dict[str, Any] = MISSING
    config: Optional[dict[str, Any]] = None  # config.json fields; checked against the checkpoint
    path: Optional[str] = None  # a local checkpoint instead of the group's source

    def __post_init__(self):
        if self.path is not None:
            path = Path(self.path).expanduser()
            self.name = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
            self.source, self.config = {"path": str(path)}, None
        elif "/" in self.name or self.name.endswith(".gguf"):  # rows and caches are named by it
            raise UserError(f"model.name={self.name}: a local checkpoint is given as model.path={self.name}")
        sources = [k for k in SOURCES if k in self.source]
        if len(sources) > 1:  # e.g. +model.source.path=... on a registry model
            raise UserError(
                f"model {self.name} has {len(sources)} sources ({', '.join(sources)}); "
                "a local checkpoint is given as model.path=FILE"
            )


@dataclass
class QuantGroup:
    """``conf/quant/NAME.yaml``: a named :class:`quantize.QuantScheme`. A shipped name must match its
    weights and kv_cache (``quant=bf16 quant.weights=int8`` is ``quant=int8_weights``)."""

    name: str = MISSING
    weights: str = _choice(MISSING, *PRECISIONS)  # int8: symmetric, one float32 scale per output channel
    kv_cache: str = _choice(MISSING, *PRECISIONS)  # int8: symmetric, one float32 scale per cached vector
    smooth_keys: bool = True  # per-channel key scales folded into the query side (INT8 KV cache only)
    smooth_alpha: float = _num(DEFAULT_ALPHA, 0.0, 1.0)  # s = max|k|^alpha, rounded to a power of two
    calibration: Optional[str] = None  # text file for the key-smoothing calibration; None: built-in text
    calibration_tokens: int = _num(DEFAULT_CALIBRATION_TOKENS, 1)  # tokens of that text run to calibrate

    def __post_init__(self):
        want = NAMED.get(self.name)
        have = (self.weights, self.kv_cache)
        if want is not None and want != have and set(have) <= set(PRECISIONS):  # else the range check says it
            right = next((n for n, wk in NAMED.items() if wk == have), None)
            raise UserError(
                f"quant={self.name} means weights={want[0]} kv_cache={want[1]}, not weights={have[0]} "
                f"kv_cache={have[1]}" + (f": use quant={right}" if right else "")
            )

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


def ctx_label(tokens: int) -> str:
    """``1k`` for 1024 tokens, ``2k`` for 2048, ``3000`` for 3000: the ctx of rows and file names."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


@dataclass
class CtxGroup:
    """``conf/ctx/NAME.yaml``: positions before the scored window. ``name`` is derived from ``tokens``
    (``ctx.tokens=2048`` is ``2k``), so a row can never carry another length's label."""

    tokens: int = _num(MISSING, 1)
    name: Optional[str] = None  # derived; giving another value is an error

    def __post_init__(self):
        check_number("ctx.tokens", self.tokens, int, lo=1)
        label = ctx_label(self.tokens)
        if self.name not in (None, label):
            raise UserError(f"ctx.name={self.name}: the name follows ctx.tokens ({self.tokens} tokens is {label})")
        self.name = label


@dataclass
class BackendGroup:
    """``conf/backend/NAME.yaml``; ``auto``: the fast backend on CUDA, the reference on the CPU."""

    name: str = _choice(MISSING, "auto", *BACKENDS)


# The proposers (spec.name; none: plain decoding) and each one's settings with their defaults (k = 7 as
# TileInfer.jl; n-gram lengths as vLLM's; DFlash drafts a block of 16 less the anchor token).
# draft_model and dflash have no default.
SPEC_DEFAULTS = {
    "ngram": {"k": 7, "min_n": 5, "max_n": 5},
    "draft": {"k": 7, "draft_model": None, "draft_quant": "bf16"},
    "dflash": {"k": 15, "dflash": None},
}
PROPOSERS = ("none", *SPEC_DEFAULTS)


@dataclass
class SpecGroup:
    """Speculative decoding (``conf/spec/NAME.yaml``): the proposer and its settings.

    ``none``: plain decoding. ``ngram``: prompt lookup (``min_n``..``max_n``-token suffixes).
    ``draft``: the model ``draft_model`` (a conf/model name or a local checkpoint path) with the quant
    config ``draft_quant``. ``dflash``: the DFlash drafter at ``dflash`` (a folder or a Hugging Face
    repo id). ``k``: most tokens drafted per round. ``temperature`` 0 verifies greedily, above 0 by
    rejection sampling (seeded by ``seed``).
    """

    name: str = _choice("none", *PROPOSERS)
    # the proposer's own settings (null: the proposer's default, SPEC_DEFAULTS); another proposer's is refused
    k: Optional[int] = _num(None, 1)
    min_n: Optional[int] = _num(None, 1)
    max_n: Optional[int] = _num(None, 1)
    draft_model: Optional[str] = None
    draft_quant: Optional[str] = _choice(None, None, *NAMED)
    dflash: Optional[str] = None
    temperature: float = _num(0.0, 0.0)
    seed: int = 0

    def identity(self, draft_sha256: str | None) -> dict:
        """The row identity columns of these settings (tileinfer.jobs.identity.CONFIG): the proposer,
        k, its other settings that change its drafts (``spec_settings``: the draft checkpoint by hash,
        a DFlash drafter by path or repo), the temperature and, when verification samples, the seed;
        all None but ``spec`` for ``spec=none``."""
        if self.name == "none":
            return dict.fromkeys(("spec_k", "spec_settings", "spec_temperature", "spec_seed")) | {"spec": "none"}
        dflash = Path(self.dflash or ".").expanduser()
        settings = {
            "ngram": f"min_n={self.min_n},max_n={self.max_n}",
            "draft": f"draft={self.draft_model}@{(draft_sha256 or '')[:12]},quant={self.draft_quant}",
            "dflash": f"dflash={dflash if dflash.exists() else self.dflash}",
        }[self.name]
        seed = self.seed if self.temperature > 0 else None
        return dict(
            spec=self.name, spec_k=self.k, spec_settings=settings, spec_temperature=self.temperature, spec_seed=seed
        )

    def __post_init__(self):
        own = SPEC_DEFAULTS.get(self.name, {})
        for key in ("k", "min_n", "max_n", "draft_model", "draft_quant", "dflash"):
            if key not in own and getattr(self, key) is not None:
                users = "/".join(name for name, settings in SPEC_DEFAULTS.items() if key in settings)
                raise UserError(f"spec.{key} is a setting of spec={users}, not of spec={self.name}")
            if key in own and getattr(self, key) is None:
                setattr(self, key, own[key])
        for key in ("draft_model", "dflash"):  # a local path that is not there, refused before any work
            value = getattr(self, key)
            if value and value.startswith(("/", ".", "~")) and not Path(value).expanduser().exists():
                raise UserError(f"spec.{key}={value}: {Path(value).expanduser()} does not exist")
        if self.name == "none" and self.temperature > 0:
            raise UserError("spec.temperature applies to speculative verification: spec=none decodes greedily")
        if self.name == "ngram" and self.max_n < self.min_n:
            raise UserError(f"spec.max_n={self.max_n} is below spec.min_n={self.min_n}")
        if self.name == "draft" and not self.draft_model:
            raise UserError("spec=draft needs spec.draft_model=NAME (a conf/model name or a local checkpoint path)")
        if self.name == "dflash" and not self.dflash:
            raise UserError(
                "spec=dflash needs spec.dflash=FOLDER_OR_REPO (a DFlash drafter: a folder with config.json and "
                "model.safetensors, or a Hugging Face repo id such as z-lab/Qwen3-4B-DFlash-b16)"
            )


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
    repeats: int = _num(5, 1)  # timed repetitions of those steps: rows give the median tok/s and the min/max
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
    p999_min_positions: int = _num(2000, 1)  # fewer scored positions: 99.9% KL is not checked
    # logits per model dtype: a speculative mismatch within it is a near-tie (SPEC_TIE_MARGIN)
    spec_tie_margin: dict[str, float] = field(default_factory=lambda: dict(SPEC_TIE_MARGIN))

    def __post_init__(self):
        check_ranges(self, "gate.")
        if not isinstance(self.bounds, dict) or not self.bounds:
            raise UserError("gate.bounds: expected bounds per setup, e.g. gate.bounds.bfloat16.kl_mean=1e-3")
        get = lambda d, k: d.get(k) if isinstance(d, dict) else None  # noqa: E731
        for setup, b in self.bounds.items():
            for metric, hi in (("kl_mean", None), ("kl_p999", None), ("top1_agree", 1.0)):
                check_number(f"gate.bounds.{setup}.{metric}", get(b, metric), lo=0.0, hi=hi)
        for metric in ("kl_mean", "kl_p999"):
            check_number(f"gate.floor.{metric}", get(self.floor, metric), lo=0.0)
        for dtype, margin in self.spec_tie_margin.items():
            check_number(f"gate.spec_tie_margin.{dtype}", margin, lo=0.0)


@dataclass
class Config:
    """The whole configuration of a command (conf/config.yaml and its groups)."""

    model: ModelGroup = MISSING
    quant: QuantGroup = MISSING
    ctx: CtxGroup = MISSING
    backend: BackendGroup = MISSING
    spec: SpecGroup = field(default_factory=SpecGroup)
    eval: Any = MISSING  # an evaluation's settings (conf/eval/NAME.yaml, evals.registry)
    runs_dir: str = "runs"  # rows, caches and logs go here (relative to the current directory)
    # seconds of unsaved work after which a long pass (a 32k prefill on the CPU) saves a resume
    # snapshot of its KV cache under runs_dir/cache (also saved on Ctrl-C); 0: on Ctrl-C only
    snapshot_s: float = _num(300.0, 0.0)
    device: str = _choice("auto", "auto", "cpu", "cuda")  # auto: cuda when available
    dtype: str = _choice("bfloat16", "bfloat16", "float16", "float32")  # model dtype of the BF16 configuration
    kv: KVSettings = field(default_factory=KVSettings)
    base: BaseSettings = field(default_factory=BaseSettings)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    gate: Optional[GateSettings] = None  # set by conf/gate.yaml only

    def __post_init__(self):
        check_ranges(self)
        self.evaluation().positions(self.ctx.tokens, self.speed.decode_tokens)  # e.g. a window too short

    def evaluation(self):
        """The :class:`evals.evaluation.Evaluation` that ``eval`` names, built from its settings."""
        return EVALUATIONS[self.eval.name](self.eval)


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
    """Register the schema with Hydra (conf/config.yaml lists ``schema`` first in its defaults), each
    evaluation's settings as ``evaluation/NAME`` (its conf/eval file extends it), and the
    ``${gpu_slots:}`` and ``${pid:}`` resolvers. Log folders carry the process id, so two commands
    started in the same second never share one; it is cached in the configuration, which launchers
    hand to their workers: a worker resolves the sweep folder with the command's pid, not its own."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for name, evaluation in EVALUATIONS.items():
        cs.store(group="evaluation", name=name, node=evaluation.Settings)
    OmegaConf.register_new_resolver("pid", os.getpid, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("gpu_slots", gpu_slots.slot_count, replace=True)  # conf/hydra/launcher/gpus.yaml
