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

import itertools
import math
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from quantize import DEFAULT_ALPHA, DEFAULT_CALIBRATION_TOKENS, NAMED, PRECISIONS, QuantScheme
from tileinfer.core.errors import USAGE_ERROR, UserError
from tileinfer.ops import BACKENDS


def _num(default, lo=None, hi=None):
    return field(default=default, metadata={"lo": lo, "hi": hi})


def _choice(default, *choices):
    return field(default=default, metadata={"choices": choices})


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
        sources = [k for k in ("pypi", "path", "hf_repo") if k in self.source]
        if len(sources) > 1:  # e.g. +model.source.path=... on a registry model
            raise UserError(
                f"model {self.name} has {len(sources)} sources ({', '.join(sources)}); "
                "a local checkpoint is given as model.path=FILE"
            )


# The shipped quant configs (conf/quant/NAME.yaml): name -> (weights, kv_cache). Rows, file names and
# tables are labelled by the name, so a name must say what the weights and the cache are.
QUANT_NAMES = NAMED


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
        want = QUANT_NAMES.get(self.name)
        have = (self.weights, self.kv_cache)
        if want is not None and want != have and set(have) <= set(PRECISIONS):  # else the range check says it
            right = next((n for n, wk in QUANT_NAMES.items() if wk == have), None)
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


# Each proposer's settings and their defaults (k = 7 as TileInfer.jl; n-gram lengths as vLLM's; DFlash
# drafts a block of 16 less the anchor token). draft_model and dflash have no default.
SPEC_DEFAULTS = {
    "ngram": {"k": 7, "min_n": 5, "max_n": 5},
    "draft": {"k": 7, "draft_model": None, "draft_quant": "bf16"},
    "dflash": {"k": 15, "dflash": None},
}


@dataclass
class SpecGroup:
    """Speculative decoding (``conf/spec/NAME.yaml``): the proposer and its settings.

    ``none``: plain decoding. ``ngram``: prompt lookup (``min_n``..``max_n``-token suffixes).
    ``draft``: the model ``draft_model`` (a conf/model name or a local checkpoint path) with the quant
    config ``draft_quant``. ``dflash``: the DFlash drafter at ``dflash`` (a folder or a Hugging Face
    repo id). ``k``: most tokens drafted per round. ``temperature`` 0 verifies greedily, above 0 by
    rejection sampling (seeded by ``seed``).
    """

    name: str = _choice("none", "none", "ngram", "draft", "dflash")
    # the proposer's own settings (null: the proposer's default, SPEC_DEFAULTS); another proposer's is refused
    k: Optional[int] = _num(None, 1)
    min_n: Optional[int] = _num(None, 1)
    max_n: Optional[int] = _num(None, 1)
    draft_model: Optional[str] = None
    draft_quant: Optional[str] = _choice(None, None, *QUANT_NAMES)
    dflash: Optional[str] = None
    temperature: float = _num(0.0, 0.0)
    seed: int = 0

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
class EvalGroup:
    """``conf/eval/NAME.yaml``: what is scored. ``default``: prompt sets, each followed by the base
    model's greedy reply; ``corpus``: text corpora in llama.cpp's windows (evals/corpus.py)."""

    prompt_sets: list[str] = field(default_factory=lambda: ["edit", "explain"])  # built-in names or file paths
    n_score: int = _num(1024, 1)  # scored positions: the base model's greedy reply after the prompt
    # built-in corpora (pydoc, stdlib), local text/json/jsonl/parquet/csv files, or hf:REPO[:CONFIG[:SPLIT]]
    corpora: list[str] = field(default_factory=list)
    n_windows: int = _num(10, 1)  # at most this many ctx-token windows per corpus (the first ones)
    text_column: str = "text"  # the column of a corpus's records that holds the text
    # BOS before a text prompt file's tokens (llama.cpp's perplexity/KL does); null: the tokenizer's
    # add_bos_token. The built-in chat prompts follow their chat template instead.
    add_bos: Optional[bool] = None


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


# Logits, per model dtype: a greedy speculative reply that parts from the plain one where the
# target's top-1 led its top-2 by at most this is a near-tie (a verify step rounds differently from a
# decode step), beyond it a bug. BF16 on the H200 moved the top-1 minus top-2 margin by up to 0.75
# logits between the two paths (benchmarks/results/h200-2026-11-30-verify-margin.md); float32 by
# rounding only. The gate's default (gate.spec_tie_margin); the report and printed tables use it too.
SPEC_TIE_MARGIN = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.01}


def tie_margin(dtype: str | None, margins: dict | None = None) -> float:
    """The near-tie margin (logits) of a model dtype (:data:`SPEC_TIE_MARGIN`, or ``margins``); the
    widest one for a dtype it does not list."""
    margins = SPEC_TIE_MARGIN if margins is None else margins
    return float(margins.get(dtype, max(margins.values())))


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
        for setup, b in self.bounds.items():
            for metric, hi in (("kl_mean", None), ("kl_p999", None), ("top1_agree", 1.0)):
                check_number(
                    f"gate.bounds.{setup}.{metric}", b.get(metric) if isinstance(b, dict) else None, lo=0.0, hi=hi
                )
        for metric in ("kl_mean", "kl_p999"):
            check_number(
                f"gate.floor.{metric}", self.floor.get(metric) if isinstance(self.floor, dict) else None, lo=0.0
            )
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
    eval: EvalGroup = field(default_factory=EvalGroup)
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
        if not self.eval.prompt_sets and not self.eval.corpora:
            raise UserError(
                "eval.prompt_sets must be a non-empty list, e.g. eval.prompt_sets=[edit,explain], unless "
                "eval.corpora names corpora (eval=corpus)"
            )
        if self.eval.corpora and self.ctx.tokens < 2:
            raise UserError(f"ctx.tokens={self.ctx.tokens}: a corpus window needs at least 2 tokens")


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
        elif "lo" in f.metadata and value is not None:
            check_number(key, value, int if "int" in f.type else float, f.metadata["lo"], f.metadata["hi"])


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


def check_argv(prog: str, argv: list[str]) -> None:
    """Exit with one line for a command-line mistake Hydra would answer with several lines that do
    not say what to write: a renamed setting (``reference.source=...``) or a checkpoint path given as
    ``model=PATH`` (the model group takes names; a local checkpoint is ``model.path=PATH``)."""
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        group = key.split(".", 1)[0]
        if group in RENAMED_SETTINGS and "=" in arg:
            new = arg.lstrip("+~").replace(group, RENAMED_SETTINGS[group], 1)
            print(f"{prog}: error: {group}.* is now {RENAMED_SETTINGS[group]}.*: write {new}", file=sys.stderr)
            sys.exit(USAGE_ERROR)
        if key == "model" and ("/" in value or value.endswith(".gguf") or Path(value).expanduser().exists()):
            print(f"{prog}: error: model={value}: a local checkpoint is given as model.path={value}", file=sys.stderr)
            sys.exit(USAGE_ERROR)


# Hydra flags that print something instead of running a job (--cfg job, --info, --help, ...).
_NO_JOB = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--shell-completion", "-sc", "--version"}


def check_jobs(prog: str, argv: list[str], config_name: str = "config") -> int:
    """Compose and check every job of the command line before any runs; return how many there are.

    A multirun (``-m a=1,2 b=x,y``) is expanded the way Hydra's basic sweeper expands it, and each
    job's configuration is composed and :func:`load`-ed, so a bad value in the last job is refused
    before the first one computes anything, and before Hydra makes a log folder. Any failure exits
    with one line (Hydra's own composition errors run to several). Settings under ``hydra.`` and
    runs with ``--config-dir``/``-cd`` (another search path) are left to Hydra.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    flags = [a.split("=", 1)[0] for a in argv if a.startswith("-")]
    if set(flags) & {"--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn"} or set(flags) & _NO_JOB:
        return 1
    # a flag's value (--package P, --experimental-rerun F) is not an override
    valued = {i + 1 for i, a in enumerate(argv) if a in ("--package", "-p", "--experimental-rerun")}
    overrides = [
        a
        for i, a in enumerate(argv)
        if i not in valued and not a.startswith("-") and not a.lstrip("+~").startswith("hydra")
    ]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        choices = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if multirun and o.is_sweep_override()
            else [o.input_line]
            for o in parsed
        ]
        jobs = list(itertools.product(*choices))
        with initialize_config_module("tileinfer.conf", version_base="1.3"):
            for job in jobs:
                load(compose(config_name, list(job)))
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except Exception as e:  # noqa: BLE001 - Hydra's parse/composition/type errors, in one line
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    return len(jobs)


def _one_line(e: Exception) -> str:
    """A Hydra error in one line: its first line, the cause's first line (the type error behind
    "Error merging override"), and the options of a missing config group option."""
    first = lambda x: next((ln.strip() for ln in str(x).splitlines() if ln.strip()), type(x).__name__)  # noqa: E731
    parts = [first(e)]
    if e.__cause__ is not None:
        parts.append(first(e.__cause__))
    if getattr(e, "options", None):
        parts.append(f"available: {', '.join(e.options)}")
    return ": ".join(parts)


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
    """Register the schema with Hydra (conf/config.yaml lists ``schema`` first in its defaults), and
    the ``${pid:}`` resolver: log folders carry the process id, so two commands started in the same
    second never share a folder (and a multirun's summary never mixes another run's jobs). Its value
    is cached in the configuration, which Hydra's launchers hand to their worker processes: a worker
    resolves the sweep folder with the command's pid, not its own."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    OmegaConf.register_new_resolver("pid", os.getpid, replace=True, use_cache=True)
