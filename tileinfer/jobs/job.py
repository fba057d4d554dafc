"""One evaluation job, shared by the sweep, the base-logits recorder and the drift gate.

A job is a candidate configuration (model, quant, ctx, backend) and a base configuration (the BF16
model on the same backend by default; see ``BaseSettings`` in tileinfer/jobs/schema.py). For every
prompt set it builds the base's token stream and distributions (computed in this process, or read
from stored top-k files) and scores the candidate against them. The loaded model and the live base
logits are kept in memory for the next job of a multirun.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from evals import base_logits, corpus
from evals.base_logits import FullLogits, TopKLogits
from evals.prompts import PROMPT_SETS, build_prompt, build_text_prompt, load_text_prompts
from quantize import QuantScheme, calibration_text
from quantize import apply as apply_quant
from tileinfer import ops
from tileinfer.core import gpu_slots, registry
from tileinfer.core.checkpoint import Checkpoint, load_checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.fetch import pull, pull_source
from tileinfer.core.files import locked
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.engine.runner import ModelRunner, uses_cuda_graph
from tileinfer.jobs import drift, identity, spec, tables
from tileinfer.jobs.resume import Snapshots
from tileinfer.jobs.schema import QUANT_NAMES, Config, ModelGroup
from tileinfer.models import Transformer

# The last loaded BF16 models {key: Loaded} and quantized models built from them {(model id, scheme):
# (Transformer, info)}: two of each, a target's and its draft model's.
_MODEL: OrderedDict = OrderedDict()
_QUANTIZED: OrderedDict = OrderedDict()
_KEEP = 2
_BASE_LOGITS: OrderedDict = OrderedDict()  # live base logits, LRU, bounded by _BASE_LOGITS_BYTES
_BASE_LOGITS_BYTES = 6 << 30


def resolve_device(name: str, backend: str) -> torch.device:
    """``auto`` picks CUDA when present. Raises UserError for a GPU backend without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UserError(f"device={name}: expected auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible")
    if backend not in ("reference", "auto") and name != "cuda":
        raise UserError(f"backend={backend} needs a CUDA GPU; use backend=reference on the CPU")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a job runs: ``name``, or for ``auto`` the fast path where there is one: Triton on
    CUDA (cuTile when Triton is not installed), the reference backend on the CPU."""
    if name != "auto":
        return name
    if device.type == "cuda":
        for fast in ("triton", "cutile"):
            try:
                ops.get_backend(fast)
                return fast
            except UserError:  # toolchain not installed
                continue
    return "reference"


def quant_label(name: str, scheme: QuantScheme) -> str:
    """``int8_kv-smooth`` / ``int8_kv-nosmooth``: the quant config name plus its smoothing."""
    return f"{name}-{'smooth' if scheme.smooth_keys else 'nosmooth'}"


def fit_ctx(cfg: Config, max_ctx: int) -> int:
    """Prompt length for ``cfg.ctx``: ctx.tokens, shortened so the scored window (and the timed
    decode steps) end inside the model's context.

    Raises:
        UserError: ctx larger than the model's context, or no room left for the scored window.
    """
    want = cfg.ctx.tokens
    # a corpus window is ctx tokens, its timed decode steps start in its middle; a prompt is followed by its reply
    tail = max(cfg.eval.n_score, cfg.speed.decode_tokens) if cfg.eval.prompt_sets else 0
    if want > max_ctx:
        raise UserError(
            f"ctx={cfg.ctx.name} ({want} tokens) exceeds the context of {cfg.model.name} ({max_ctx} tokens)"
        )
    if tail and tail >= max_ctx:
        key = "eval.n_score" if cfg.eval.n_score >= cfg.speed.decode_tokens else "speed.decode_tokens"
        raise UserError(f"{key}={tail} leaves no room for a prompt in the {max_ctx}-token context of {cfg.model.name}")
    return min(want, max_ctx - tail)


def model_fingerprint(cfg: Config, path: Path | None) -> str:
    """The checkpoint's sha256 when its source names one (checked by the pull), a hash of a random
    model's config and seed, else a sha256 of its files' contents (names and bytes; a local file
    edited in place, whatever its size and time stamp, is another model)."""
    sha = cfg.model.source.get("sha256")
    if sha:
        return str(sha)
    if path is None:
        drawn = cfg.model.source["random"] | {"config": cfg.model.config}
        return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()
    h = hashlib.sha256()
    for f in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" if f != path else b"")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return h.hexdigest()


@dataclass
class Loaded:
    """The BF16 model of a job and what describes it."""

    checkpoint: Checkpoint
    tokenizer: Tokenizer
    model: Transformer
    model_id: str
    device: torch.device


def load_model(cfg: Config, device: torch.device) -> Loaded:
    """Pull and load the BF16 model (kept in memory for the next job of a multirun)."""
    key = (cfg.model.name, json.dumps([cfg.model.source, cfg.model.config], sort_keys=True), cfg.dtype, str(device))
    if key in _MODEL:
        _MODEL.move_to_end(key)
    else:
        _evict(_MODEL)
        dtype = getattr(torch, cfg.dtype)
        rnd = cfg.model.source.get("random")
        if rnd is not None:  # random weights with a real model's shapes, drawn on the device
            hf, path = cfg.model.config, None
            tok_path = Path(rnd["tokenizer"]) if Path(rnd["tokenizer"]).is_dir() else pull(rnd["tokenizer"])
            ck = Checkpoint(
                Path(f"random:{cfg.model.name}"),
                ModelConfig.from_hf(hf),
                hf,
                random_state_dict(hf, int(rnd["seed"]), dtype, device),
            )
        else:
            path = tok_path = pull_source(cfg.model.name, cfg.model.source)
            ck = load_checkpoint(path, dtype=dtype)
            if ck.quantization is not None:  # its weights are int8 already: a bf16 row would mislabel them
                raise UserError(
                    f"{path} is a quantized checkpoint (written by python -m quantize); a sweep quantizes "
                    "in memory: run it on the BF16 checkpoint with the quant config to evaluate"
                )
            registry.check_checkpoint_config(cfg.model.name, ck.config, cfg.model.config)
        model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=dtype, device=device)
        _MODEL[key] = Loaded(ck, Tokenizer.load(tok_path), model, model_fingerprint(cfg, path), device)
    return _MODEL[key]


def model_for(loaded: Loaded, scheme: QuantScheme) -> tuple[Transformer, dict]:
    """The model of a quant scheme: the BF16 model itself, or a quantized copy (the last one is kept)."""
    if scheme.is_unquantized():
        return loaded.model, {}
    key = (loaded.model_id, scheme)
    if key in _QUANTIZED:
        _QUANTIZED.move_to_end(key)
    else:
        _evict(_QUANTIZED)
        sd, info = apply_quant(loaded.checkpoint, None, scheme, loaded.tokenizer, progress=True, device=loaded.device)
        model = Transformer.from_state_dict(
            loaded.checkpoint.config, sd, dtype=loaded.model.dtype, device=loaded.device
        )
        _QUANTIZED[key] = (model, info)
    return _QUANTIZED[key]


def _evict(cache: OrderedDict) -> None:
    """Make room for one more entry in a model cache of :data:`_KEEP` (least recently used first)."""
    while len(cache) >= _KEEP:
        cache.popitem(last=False)


def draft_model_group(name: str) -> ModelGroup:
    """The model group of ``spec.draft_model``: a local checkpoint path, or a conf/model name.

    Raises:
        UserError: neither an existing path nor a known model.
    """
    path = Path(name).expanduser()
    if path.exists():
        return ModelGroup(path=str(path))
    entry = registry.model_entry(name)
    return ModelGroup(name=name, source=entry["source"], config=entry.get("config"))


def draft_runner(cfg: Config, job: "Job") -> tuple[Tokenizer, ModelRunner]:
    """The draft model of ``spec=draft`` (its tokenizer and runner): loaded like the target (kept in
    memory for the next job), quantized as ``spec.draft_quant`` says, on the target's backend."""
    weights, kv_cache = QUANT_NAMES[cfg.spec.draft_quant]
    loaded = load_model(replace(cfg, model=draft_model_group(cfg.spec.draft_model)), job.loaded.device)
    model, _ = model_for(loaded, QuantScheme(weights, kv_cache).effective())
    limit = loaded.checkpoint.config.max_position_embeddings
    if limit < job.max_len:
        raise UserError(
            f"spec.draft_model={cfg.spec.draft_model} has a context of {limit} tokens, shorter than the "
            f"{job.max_len} positions of this job (ctx plus the scored window)"
        )
    runner = ModelRunner(
        model,
        backend=cfg.backend.name,
        kv_int8=kv_cache == "int8",
        max_seq_len=min(job.max_len + cfg.spec.k, limit),
        page_size=cfg.kv.page_size,
        prefill_chunk=cfg.kv.prefill_chunk,
        cuda_graph=cfg.speed.cuda_graph,
    )
    return loaded.tokenizer, runner


def add_bos(cfg: Config, tok: Tokenizer) -> bool:
    """Whether text prompt files start with BOS: ``eval.add_bos``, or the tokenizer's ``add_bos_token``.

    Raises:
        UserError: BOS asked for but the tokenizer has no BOS token.
    """
    want = tok.add_bos_token if cfg.eval.add_bos is None else cfg.eval.add_bos
    if want and tok.bos_token_id is None:
        raise UserError("eval.add_bos=true but the tokenizer has no BOS token")
    return bool(want)


def prompt_sets(cfg: Config, tok: Tokenizer, ctx_tokens: int) -> dict[str, list[list[int]]]:
    """Prompts (token ids, each exactly ctx_tokens long) of every configured prompt set, by name (a
    built-in set's, or a file's stem). Text files start with BOS when :func:`add_bos` says so.

    Raises:
        UserError: an unknown set, an unreadable file, or two sets of one name (rows, stored base
            logits and caches are named by prompt set).
    """
    out = {}
    files = [n for n in cfg.eval.prompt_sets if n not in PROMPT_SETS]
    if cfg.eval.add_bos is not None and not files and not cfg.eval.corpora:
        raise UserError(
            f"eval.add_bos={str(cfg.eval.add_bos).lower()} applies to prompt files; the built-in sets "
            f"{', '.join(cfg.eval.prompt_sets)} follow their chat template"
        )
    for name in cfg.eval.prompt_sets:
        key = name if name in PROMPT_SETS else Path(name).stem
        if name not in PROMPT_SETS and key in PROMPT_SETS:
            raise UserError(f"prompt file {name} has the name of the built-in prompt set {key!r}: rename the file")
        if key in out:
            raise UserError(f"prompt set {name} has the name {key!r} of another one: rename the file")
        if name in PROMPT_SETS:
            out[key] = [build_prompt(tok, name, ctx_tokens)]
        elif not Path(name).suffix and not Path(name).exists():
            raise UserError(
                f"unknown prompt set {name!r}: the built-in sets are {', '.join(PROMPT_SETS)}; "
                "other prompts come from a .txt or .jsonl file"
            )
        else:
            bos = [tok.bos_token_id] if add_bos(cfg, tok) else []
            out[key] = [bos + build_text_prompt(tok, t, ctx_tokens - len(bos)) for t in load_text_prompts(name)]
    return out


def corpus_sets(
    cfg: Config, tok: Tokenizer, ctx_tokens: int
) -> tuple[dict[str, list[list[int]]], dict[str, str], dict]:
    """The windows of every corpus of ``eval.corpora`` by name (:func:`evals.corpus.corpus_name`), what each
    name stands for, and how many tokens each corpus has. Windows start with BOS when :func:`add_bos` says so.

    Raises:
        UserError: a corpus that cannot be read or is shorter than one window, or two of one name (or of
            a prompt set's name: rows and caches are named by it).
    """
    windows, specs, tokens = {}, {}, {}
    bos = tok.bos_token_id if cfg.eval.corpora and add_bos(cfg, tok) else None
    taken = set(cfg.eval.prompt_sets) | {Path(n).stem for n in cfg.eval.prompt_sets}
    for entry in cfg.eval.corpora:
        name = corpus.corpus_name(entry)
        if name in specs or name in taken:
            raise UserError(f"corpus {entry} has the name {name!r} of another corpus or prompt set: rename the file")
        ids, n = corpus.corpus_windows(tok, entry, ctx_tokens, bos, cfg.eval.n_windows, cfg.eval.text_column)
        windows[name], specs[name], tokens[name] = ids, entry, n
    return windows, specs, tokens


@dataclass
class Job:
    """A resolved job: candidate and base configurations, and where its rows go."""

    cfg: Config
    loaded: Loaded
    scheme: QuantScheme
    base_backend: str
    base_scheme: QuantScheme
    ctx_tokens: int
    prompts: dict[str, list[list[int]]]  # prompt sets' prompts, and corpora's windows (evals.corpus)
    draft_sha: str | None = None  # the draft model's checkpoint hash (spec=draft)
    corpora: dict[str, str] = field(default_factory=dict)  # the corpora among ``prompts``: name -> eval.corpora entry
    corpus_tokens: dict[str, int] = field(default_factory=dict)  # tokens each corpus has (its windows may use fewer)
    device_workers: int | None = 1  # workers that may time on this job's device at once (run())

    @property
    def max_len(self) -> int:
        e, decode = self.cfg.eval, self.cfg.speed.decode_tokens
        prompts = self.ctx_tokens + max(e.n_score, decode) if e.prompt_sets else 0
        windows = max(self.ctx_tokens, corpus.prompt_len(self.ctx_tokens) + decode) if self.corpora else 0
        return max(prompts, windows)

    @property
    def cpu_threads(self) -> int | None:
        """torch's thread count on the CPU (None on CUDA): CPU decode rounds differently with another
        number of threads, so a greedy reply can differ."""
        return torch.get_num_threads() if self.loaded.device.type == "cpu" else None

    @property
    def device_label(self) -> str:
        """``cuda``, or ``cpu`` with the thread count (``cpu2t``)."""
        return f"cpu{self.cpu_threads}t" if self.cpu_threads else self.loaded.device.type

    @property
    def base_label(self) -> str:
        """``live:BACKEND/QUANT`` or ``stored:BACKEND/QUANT``."""
        return f"{self.cfg.base.source}:{self.base_backend}/{quant_label(self.base_quant_name, self.base_scheme)}"

    @property
    def base_quant_name(self) -> str:
        return "bf16" if self.cfg.base.quant == "bf16" else self.cfg.quant.name

    def runner(self, backend: str, scheme: QuantScheme) -> tuple[ModelRunner, dict]:
        model, info = model_for(self.loaded, scheme)
        kv = self.cfg.kv
        return ModelRunner(
            model,
            backend=backend,
            kv_int8=scheme.kv_cache == "int8",
            max_seq_len=self.max_len,
            page_size=kv.page_size,
            prefill_chunk=kv.prefill_chunk,
            cuda_graph=self.cfg.speed.cuda_graph,
        ), info

    def stored_stream(self, prompt_set: str, i: int) -> str:
        """What the stored base logits of prompt ``i`` of ``prompt_set`` hold (their file name without
        the backend): base quant config, prompt, prompt length and scored positions."""
        label = quant_label(self.base_quant_name, self.base_scheme)
        scored = "window" if prompt_set in self.corpora else f"n{self.cfg.eval.n_score}"
        return f"{label}-{prompt_set}{i}-ctx{self.ctx_tokens}-{scored}"

    def stored_base_path(self, prompt_set: str, i: int) -> Path:
        """File of the stored base logits recorded for this job's base configuration."""
        c = self.cfg
        return base_logits.stored_path(c.base.dir, c.model.name, self.base_backend, self.stored_stream(prompt_set, i))

    def identity(self, prompt_set: str) -> dict:
        """The identity columns of this job's row for ``prompt_set`` (tileinfer.jobs.identity)."""
        c, s = self.cfg, self.scheme
        return identity.key_of(
            dict(
                model=c.model.name,
                model_sha256=self.loaded.model_id,
                quant=c.quant.name,
                weights=s.weights,
                kv_cache=s.kv_cache,
                smooth_keys=s.smooth_keys,
                smooth_alpha=s.smooth_alpha if s.smooth_keys else None,
                calibration_tokens=s.calibration_tokens if s.smoothing else None,
                calibration_sha256=identity.content_hash(calibration_text(s.calibration)) if s.smoothing else None,
                dtype=c.dtype,
                backend=c.backend.name,
                **spec.identity_columns(c.spec, self.draft_sha),
                ctx=c.ctx.name,
                ctx_tokens=self.ctx_tokens,
                prompt_set=prompt_set,
                prompts_sha256=identity.content_hash(self.prompts[prompt_set]),
                corpus=self.corpora.get(prompt_set),
                n_windows=len(self.prompts[prompt_set]) if prompt_set in self.corpora else None,
                add_bos=None
                if prompt_set in PROMPT_SETS and prompt_set in c.eval.prompt_sets
                else add_bos(c, self.loaded.tokenizer),
                n_score=None if prompt_set in self.corpora else c.eval.n_score,
                base=self.base_label,
                top_k=c.base.top_k if c.base.source == "stored" else None,
                page_size=c.kv.page_size,
                prefill_chunk=c.kv.prefill_chunk,
                decode_tokens=c.speed.decode_tokens,
                decode_repeats=c.speed.repeats,
                device_workers=self.device_workers,
                warmup=c.speed.warmup,
                decode_cuda_graph=uses_cuda_graph(
                    c.speed.cuda_graph, self.loaded.device, ops.get_backend(c.backend.name)
                ),
                device=tables.device_name(self.loaded.device),
                cpu_threads=self.cpu_threads,
            )
        )

    def row_path(self, key: dict) -> Path:
        """Where the row of identity ``key`` (:meth:`identity`) lives: a readable label plus its hash."""
        c = self.cfg
        label = f"{quant_label(c.quant.name, self.scheme)}-{c.ctx.name}-{key['prompt_set']}"
        return Path(c.runs_dir) / "rows" / c.model.name / c.backend.name / identity.row_file_name(key, label)

    def snapshots(self, row: Path, i: int) -> Snapshots:
        """Resume snapshots of the candidate's pass over prompt ``i`` of the row at ``row``."""
        return Snapshots(Path(self.cfg.runs_dir) / "cache" / "resume" / f"{row.stem}-{i}.pt", self.cfg.snapshot_s)

    def base_logits(self, prompt_set: str, base_runner: ModelRunner | None) -> list:
        """The base logits of a prompt set's prompts: stored top-k files, or computed live."""
        c = self.cfg
        if c.base.source == "stored":
            base = [TopKLogits.load(self.stored_base_path(prompt_set, i)) for i in range(len(self.prompts[prompt_set]))]
            if any(b.k != c.base.top_k for b in base):
                raise UserError(
                    f"stored base logits for {prompt_set} keep the top {base[0].k} tokens, not "
                    f"base.top_k={c.base.top_k}: set base.top_k={base[0].k}"
                )
            window = prompt_set in self.corpora  # a corpus window holds the scored tokens too
            if any(b.prompt_len != (corpus.prompt_len(self.ctx_tokens) if window else self.ctx_tokens) for b in base):
                raise UserError(f"stored base logits for {prompt_set} have another ctx than {self.ctx_tokens}")
            for i, (b, prompt) in enumerate(zip(base, self.prompts[prompt_set], strict=True)):
                recorded = b.tokens if window else b.tokens[: b.prompt_len]
                if recorded.tolist() != list(prompt):  # an edited file, another tokenizer
                    raise UserError(
                        f"stored base logits {self.stored_base_path(prompt_set, i)} were recorded on another "
                        "prompt: record them again"
                    )
            return base
        return self.live_base(prompt_set, base_runner)

    def live_base(self, prompt_set: str, base_runner: ModelRunner) -> list[FullLogits]:
        """Streams (greedy replies, cached on disk) and full logits of the base configuration."""
        c, tok, ck = self.cfg, self.loaded.tokenizer, self.loaded.checkpoint
        key = (
            self.loaded.model_id,
            self.base_backend,
            repr(self.base_scheme),
            c.dtype,
            prompt_set,
            self.ctx_tokens,
            c.eval.n_score,
            identity.content_hash(self.prompts[prompt_set]),
        )
        if key in _BASE_LOGITS:
            _BASE_LOGITS.move_to_end(key)
            return _BASE_LOGITS[key]
        stop = set(tok.eos_token_ids) | set(ck.config.eos_token_id)
        cache = (
            Path(c.runs_dir)
            / "cache"
            / "streams"
            / f"{c.model.name}-{self.loaded.model_id[:12]}"
            / f"{self.base_backend}-{quant_label(self.base_quant_name, self.base_scheme)}-{c.dtype}-{self.device_label}"
        )
        base = []
        for i, prompt in enumerate(self.prompts[prompt_set]):
            if prompt_set in self.corpora:  # teacher-forced over the window's second half: nothing to generate
                n = corpus.prompt_len(len(prompt))
                snaps = Snapshots(
                    cache / f"{prompt_set}{i}-ctx{self.ctx_tokens}-window-c{c.kv.prefill_chunk}.resume.pt", c.snapshot_s
                )
                base.append(drift.base_pass(base_runner, prompt[:n], len(prompt) - n, set(), snaps, prompt[n:]))
                continue
            f = cache / f"{prompt_set}{i}-ctx{self.ctx_tokens}-n{c.eval.n_score}.json"
            stream = drift.load_stream(f, prompt, c.eval.n_score)
            snaps = Snapshots(f.with_name(f"{f.stem}-c{c.kv.prefill_chunk}.resume.pt"), c.snapshot_s)
            logits = None
            if stream is None:
                with locked(f):  # of jobs in several processes, one generates the reply; the others read it
                    stream = drift.load_stream(f, prompt, c.eval.n_score)
                    if stream is None:
                        logits = drift.base_pass(base_runner, list(prompt), c.eval.n_score, stop, snaps)
                        stream = drift.Stream(tuple(int(t) for t in logits.tokens), logits.prompt_len)
                        drift.save_stream(stream, c.eval.n_score, f)  # only now: its logits are finite
            if logits is None:  # teacher-forced over the stored reply
                logits = drift.base_pass(base_runner, list(prompt), c.eval.n_score, stop, snaps, list(stream.reply))
            base.append(logits)
        _BASE_LOGITS[key] = base
        while (
            len(_BASE_LOGITS) > 1
            and sum(b.logits.numel() * 4 for bs in _BASE_LOGITS.values() for b in bs) > _BASE_LOGITS_BYTES
        ):
            _BASE_LOGITS.popitem(last=False)
        return base


def resolve(cfg: Config) -> Job:
    """Load what a job needs (settings were checked by tileinfer.jobs.schema.load).

    ``backend=auto`` becomes the backend that runs (:func:`resolve_backend`) in the job's config. The
    base configuration is ``base.backend`` (None: the candidate's backend) with ``base.quant``
    (``bf16``: the BF16 model; ``same``: the candidate's quant config, for checking a backend's
    kernels against the reference backend's).

    Raises:
        UserError: bad device/backend, ctx too large, unknown prompt set.
    """
    device = resolve_device(cfg.device, cfg.backend.name)
    cfg = replace(cfg, backend=replace(cfg.backend, name=resolve_backend(cfg.backend.name, device)))
    base_backend = cfg.base.backend or cfg.backend.name
    if cfg.base.source == "live":  # a stored base runs nothing here
        resolve_device(cfg.device, base_backend)
    scheme = cfg.quant.scheme()
    base_scheme = scheme if cfg.base.quant == "same" else QuantScheme("bf16", "bf16").effective()
    loaded = load_model(cfg, device)
    ctx_tokens = fit_ctx(cfg, loaded.checkpoint.config.max_position_embeddings)
    windows, corpora, corpus_tokens = corpus_sets(cfg, loaded.tokenizer, ctx_tokens)
    prompts = prompt_sets(cfg, loaded.tokenizer, ctx_tokens) | windows
    job = Job(cfg, loaded, scheme, base_backend, base_scheme, ctx_tokens, prompts, None, corpora, corpus_tokens)
    room = job.max_len - ctx_tokens
    if cfg.spec.name != "none" and cfg.spec.k >= room:
        raise UserError(
            f"spec.k={cfg.spec.k} drafts do not fit the {room} positions after the prompt "
            "(eval.n_score / speed.decode_tokens): lower spec.k"
        )
    if cfg.spec.name == "draft":
        job.draft_sha = load_model(replace(cfg, model=draft_model_group(cfg.spec.draft_model)), device).model_id
    if cfg.base.source == "stored":  # portable: whichever backend recorded them (the reference backend first)
        streams = [job.stored_stream(s, i) for s, ps in job.prompts.items() for i in range(len(ps))]
        job.base_backend = base_logits.stored_backend(cfg.base.dir, cfg.model.name, streams, cfg.base.backend)
    return job


def run(cfg: Config, force: bool = False, cpu_workers: int | None = 1) -> list[Path]:
    """Compute every missing row of one job (every row with ``force``); return the paths of all its
    rows (done or reused).

    ``cpu_workers``: how many processes of the command may run jobs on this host's CPU at once (a
    launcher's workers; None: unknown). Rows record, as ``device_workers``, how many workers may
    time on their device at once: that number on the CPU, the workers of the claimed GPU slot's GPU
    on CUDA (tileinfer.core.gpu_slots). Above 1 their speeds are timed against each other.
    """
    job = resolve(cfg)
    slot = gpu_slots.held()
    job.device_workers = (slot.workers if slot else 1) if job.loaded.device.type == "cuda" else cpu_workers
    if job.device_workers != 1:
        print(
            f"warning: {job.device_workers or 'an unknown number of'} workers share this "
            f"{'GPU' if job.loaded.device.type == 'cuda' else 'CPU'}: the speed columns of these rows are timed "
            "against each other (device_workers says so)",
            file=sys.stderr,
        )
    keys = {s: job.identity(s) for s in job.prompts}  # once: the file name and the row hold the same key
    todo = {s: job.row_path(key) for s, key in keys.items()}
    missing = {s: p for s, p in todo.items() if force or not tables.is_complete_row(p)}
    if not missing:
        print(f"already done: {', '.join(str(p) for p in todo.values())}")
        return list(todo.values())
    cand_runner, _ = job.runner(job.cfg.backend.name, job.scheme)
    base_runner = None if cfg.base.source == "stored" else job.runner(job.base_backend, job.base_scheme)[0]
    draft = draft_runner(job.cfg, job) if cfg.spec.name == "draft" else None
    speculation = spec.speculation(job.cfg.spec, cand_runner, job.loaded.tokenizer, draft)
    for set_name, path in missing.items():
        with locked(path):  # two sweeps over one runs_dir: one computes a row, the other then finds it
            if not force and tables.is_complete_row(path):
                print(f"already done by another process: {path}")
                continue
            score_prompt_set(job, set_name, path, keys[set_name], cand_runner, base_runner, speculation)
    return list(todo.values())


def score_prompt_set(job: Job, set_name: str, path: Path, key: dict, cand_runner, base_runner, speculation) -> None:
    """Score one prompt set (or corpus) of ``job`` and write its row to ``path``."""
    cfg, device = job.cfg, job.loaded.device
    t0 = time.perf_counter()
    base = job.base_logits(set_name, base_runner)
    if cfg.speed.warmup:
        drift.warm_up(cand_runner, base[0], speculation)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ops.reset_fallbacks()
    # a proposer fed the target's hidden states needs the whole prefill: no resume snapshots
    hidden = speculation is not None and speculation.proposer.hidden_layers
    snaps = [Snapshots(None) if hidden else job.snapshots(path, i) for i in range(len(base))]
    passes: list[drift.PassResult] = []
    window = set_name in job.corpora  # a corpus times decoding (and speculation) after its first window only
    timed = [i == 0 or not window for i in range(len(base))]
    results = [
        drift.score(
            cand_runner,
            b,
            cfg.speed.decode_tokens if t else 0,
            s,
            speculation if t else None,
            passes if t else None,
            cfg.speed.repeats,
        )
        for b, s, t in zip(base, snaps, timed, strict=True)
    ]
    greedy = cfg.spec.temperature == 0
    spec_cols = spec.columns([spec.pass_columns(t, greedy) for t in passes] if speculation else None)
    corpus_cols = {"corpus_tokens": job.corpus_tokens[set_name]} if window else {}
    row = tables.make_row(
        key,
        results,
        device=device,
        weights_bytes=cand_runner.model.weight_bytes(),
        kv_bytes=cand_runner.kv.bytes_per_position() * job.max_len,
        wall_s=time.perf_counter() - t0,
        kl_estimate="exact" if isinstance(base[0], FullLogits) else f"topk{base[0].k}+tail",
        fallbacks=ops.fallbacks(),
        replies=[b.tokens[b.prompt_len :].tolist() for b in base],
        extra=spec_cols | corpus_cols,
        unit="window" if window else "prompt",
    )
    per_position = {k: torch.cat([r[1][k] for r in results]) for k in tables.POSITION_COLUMNS}
    tables.write_row(path, row, per_position | {"group": tables.position_groups(results)})
    if row["degenerate"]:
        print(
            f"warning: {set_name}: {row['reply_repeat_frac']:.0%} of the base reply repeats its own 4-grams "
            "(a loop): the scored window is trivially predictable and its KL understates the drift",
            file=sys.stderr,
        )
    for s in snaps:
        s.clear()
