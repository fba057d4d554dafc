"""One evaluation job, shared by the sweep, the reference recorder and the drift gate.

A job is a candidate configuration (model, quant, ctx, backend) and a reference configuration
(the BF16 model on the same backend by default; see ``reference`` in conf/config.yaml). For every
prompt set it builds the reference's token stream and distributions (computed in this process, or
read from a stored top-k file) and scores the candidate against them. The loaded model and the
live references are kept in memory for the next job of a multirun.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from evals.prompts import PROMPT_SETS, build_prompt, build_text_prompt, load_text_prompts
from evals.references import FullReference, TopKReference
from quantize import QuantSpec, apply as apply_quant
from tileinfer.jobs import drift, tables
from tileinfer.core.checkpoint import Checkpoint, load_checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.models import Transformer
from tileinfer.core.fetch import pull
from tileinfer.core.registry import check_checkpoint_config
from tileinfer.engine.runner import ModelRunner
from tileinfer.core.tokenizer import Tokenizer

_MODEL: dict = {}  # the last loaded BF16 model: {key: (checkpoint, tokenizer, Transformer)}
_QUANTIZED: dict = {}  # the last quantized model built from it: {(model key, spec): Transformer}
_REFERENCES: OrderedDict = OrderedDict()  # live references, LRU, bounded by _REFERENCE_BYTES
_REFERENCE_BYTES = 6 << 30


def resolve_device(name: str, backend: str) -> torch.device:
    """``auto`` picks CUDA when present. Raises UserError for a GPU backend without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UserError(f"device={name}: expected auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible")
    if backend != "reference" and name != "cuda":
        raise UserError(f"backend={backend} needs a CUDA GPU; use backend=reference on the CPU")
    return torch.device(name)


# Numeric settings: (key, type, smallest, largest); checked before anything runs.
_SETTINGS = [("eval.n_score", int, 1, None), ("speed.decode_tokens", int, 1, None),
             ("kv.page_size", int, 1, None), ("kv.prefill_chunk", int, 1, None),
             ("reference.top_k", int, 1, None), ("quant.smooth_alpha", float, 0.0, 1.0),
             ("quant.calibration_tokens", int, 1, None)]


def check_number(key: str, v, kind=float, lo=None, hi=None) -> None:
    """Raise UserError unless setting ``key``'s value ``v`` is a ``kind`` (int or float) in [lo, hi]
    (None: unbounded on that side)."""
    try:
        ok = not isinstance(v, bool) and float(v) == kind(v)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise UserError(f"{key}={v!r}: expected {'an integer' if kind is int else 'a number'}")
    if (lo is not None and kind(v) < lo) or (hi is not None and kind(v) > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise UserError(f"{key}={v}: must be {rng}")


def check_settings(cfg: DictConfig) -> None:
    """Raise UserError naming the first numeric setting that is not a number in its range, or an
    unknown ``reference.source``."""
    for key, kind, lo, hi in _SETTINGS:
        check_number(key, OmegaConf.select(cfg, key), kind, lo, hi)
    if cfg.reference.source not in ("live", "stored"):
        raise UserError(f"reference.source must be live or stored, not {cfg.reference.source!r}")


def quant_spec(q: DictConfig) -> QuantSpec:
    """The effective :class:`quantize.QuantSpec` of a ``quant`` config group entry."""
    return QuantSpec(weights=q.weights, kv_cache=q.kv_cache, smooth_keys=bool(q.smooth_keys),
                     smooth_alpha=float(q.smooth_alpha), calibration=q.calibration,
                     calibration_tokens=int(q.calibration_tokens)).effective()


def quant_label(name: str, spec: QuantSpec) -> str:
    """``int8_kv-smooth`` / ``int8_kv-nosmooth``: the quant config name plus its smoothing."""
    return f"{name}-{'smooth' if spec.smooth_keys else 'nosmooth'}"


def fit_ctx(cfg: DictConfig, max_ctx: int) -> int:
    """Prompt length for ``cfg.ctx``: ctx.tokens, shortened so the scored window (and the timed
    decode steps) end inside the model's context.

    Raises:
        UserError: ctx larger than the model's context, or no room left for the scored window.
    """
    want, tail = int(cfg.ctx.tokens), max(int(cfg.eval.n_score), int(cfg.speed.decode_tokens))
    if want > max_ctx:
        raise UserError(f"ctx={cfg.ctx.name} ({want} tokens) exceeds the context of "
                        f"{cfg.model.name} ({max_ctx} tokens)")
    if tail >= max_ctx:
        raise UserError(f"eval.n_score={cfg.eval.n_score} leaves no room for a prompt in the "
                        f"{max_ctx}-token context of {cfg.model.name}")
    return min(want, max_ctx - tail)


def model_fingerprint(cfg: DictConfig, path: Path | None) -> str:
    """The checkpoint's sha256 when its source names one, a hash of a random model's config and seed,
    else a hash of its files' paths, sizes and modification times (cheap, and changes with them)."""
    sha = OmegaConf.select(cfg, "model.source.sha256")
    if sha:
        return str(sha)
    if path is None:
        drawn = OmegaConf.to_container(cfg.model.source.random) | {"config": OmegaConf.to_container(cfg.model.config)}
        return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()


@dataclass
class Loaded:
    """The BF16 model of a job and what describes it."""

    checkpoint: Checkpoint
    tokenizer: Tokenizer
    model: Transformer
    model_id: str
    device: torch.device


def load_model(cfg: DictConfig, device: torch.device) -> Loaded:
    """Pull and load the BF16 model (kept in memory for the next job of a multirun)."""
    key = (cfg.model.name, cfg.dtype, str(device))
    if key not in _MODEL:
        _MODEL.clear()
        _QUANTIZED.clear()
        dtype = getattr(torch, cfg.dtype)
        rnd = OmegaConf.select(cfg, "model.source.random")
        if rnd is not None:  # random weights with a real model's shapes, drawn on the device
            hf = OmegaConf.to_container(cfg.model.config)
            path = None
            tok_path = Path(rnd.tokenizer) if Path(rnd.tokenizer).is_dir() else pull(rnd.tokenizer)
            ck = Checkpoint(Path(f"random:{cfg.model.name}"), ModelConfig.from_hf(hf), hf,
                            random_state_dict(hf, int(rnd.seed), dtype, device))
        else:
            path = tok_path = pull(cfg.model.name)
            ck = load_checkpoint(path, dtype=dtype)
            if OmegaConf.select(cfg, "model.config") is not None:
                check_checkpoint_config(cfg.model.name, ck.config)
        model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=dtype, device=device)
        _MODEL[key] = Loaded(ck, Tokenizer.load(tok_path), model, model_fingerprint(cfg, path), device)
    return _MODEL[key]


def model_for(loaded: Loaded, spec: QuantSpec) -> tuple[Transformer, dict]:
    """The model of a quant spec: the BF16 model itself, or a quantized copy (the last one is kept)."""
    if spec.is_reference():
        return loaded.model, {}
    key = (loaded.model_id, spec)
    if key not in _QUANTIZED:
        _QUANTIZED.clear()
        sd, info = apply_quant(loaded.checkpoint, None, spec, loaded.tokenizer, progress=True, device=loaded.device)
        model = Transformer.from_state_dict(loaded.checkpoint.config, sd, dtype=loaded.model.dtype,
                                            device=loaded.device)
        _QUANTIZED[key] = (model, info)
    return _QUANTIZED[key]


def prompt_sets(cfg: DictConfig, tok: Tokenizer, ctx_tokens: int) -> dict[str, list[list[int]]]:
    """Prompts (token ids, each exactly ctx_tokens long) of every configured prompt set."""
    out = {}
    for name in cfg.eval.prompt_sets:
        if name in PROMPT_SETS:
            out[name] = [build_prompt(tok, name, ctx_tokens)]
        elif not Path(name).suffix and not Path(name).exists():
            raise UserError(f"unknown prompt set {name!r}: the built-in sets are {', '.join(PROMPT_SETS)}; "
                            "other prompts come from a .txt or .jsonl file")
        else:
            out[Path(name).stem] = [build_text_prompt(tok, t, ctx_tokens) for t in load_text_prompts(name)]
    return out


@dataclass
class Job:
    """A resolved job: candidate and reference configurations, and where its rows go."""

    cfg: DictConfig
    loaded: Loaded
    spec: QuantSpec
    ref_backend: str
    ref_spec: QuantSpec
    ctx_tokens: int
    prompts: dict[str, list[list[int]]]

    @property
    def max_len(self) -> int:
        return self.ctx_tokens + max(int(self.cfg.eval.n_score), int(self.cfg.speed.decode_tokens))

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
    def reference_label(self) -> str:
        """``live:BACKEND/QUANT`` or ``stored:BACKEND/QUANT``."""
        return f"{self.cfg.reference.source}:{self.ref_backend}/{quant_label(self.ref_quant_name, self.ref_spec)}"

    @property
    def ref_quant_name(self) -> str:
        return "bf16" if self.cfg.reference.quant == "bf16" else self.cfg.quant.name

    def runner(self, backend: str, spec: QuantSpec) -> tuple[ModelRunner, dict]:
        model, info = model_for(self.loaded, spec)
        kv = self.cfg.kv
        return ModelRunner(model, backend=backend, kv_int8=spec.kv_cache == "int8", max_seq_len=self.max_len,
                           page_size=int(kv.page_size), prefill_chunk=int(kv.prefill_chunk),
                           cuda_graph=bool(self.cfg.speed.cuda_graph)), info

    def stored_reference_path(self, prompt_set: str, i: int) -> Path:
        """File of a stored reference recorded for this job's reference configuration."""
        c = self.cfg
        name = (f"{self.ref_backend}-{quant_label(self.ref_quant_name, self.ref_spec)}-{prompt_set}{i}"
                f"-ctx{self.ctx_tokens}-n{c.eval.n_score}.topk")
        return Path(c.reference.dir) / c.model.name / name

    def row_path(self, prompt_set: str) -> Path:
        """Where the row of one prompt set lives: a readable name plus a hash of everything that
        changes the numbers."""
        c = self.cfg
        key = dict(model=self.loaded.model_id, spec=repr(self.spec), ctx=self.ctx_tokens, n=int(c.eval.n_score),
                   set=prompt_set, backend=c.backend.name, dtype=c.dtype, decode=int(c.speed.decode_tokens),
                   cuda_graph=bool(c.speed.cuda_graph), page_size=int(c.kv.page_size),
                   prefill_chunk=int(c.kv.prefill_chunk), device=self.device_label,
                   reference=self.reference_label, ref_spec=repr(self.ref_spec), top_k=int(c.reference.top_k))
        h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{quant_label(c.quant.name, self.spec)}-{c.ctx.name}-{prompt_set}-{h}.parquet"
        return Path(c.runs_dir) / "rows" / c.model.name / c.backend.name / name

    def references(self, prompt_set: str, ref_runner: ModelRunner | None) -> list:
        """The references of a prompt set's prompts: stored top-k files, or computed live."""
        c = self.cfg
        if c.reference.source == "stored":
            refs = [TopKReference.load(self.stored_reference_path(prompt_set, i))
                    for i in range(len(self.prompts[prompt_set]))]
            if any(r.prompt_len != self.ctx_tokens for r in refs):
                raise UserError(f"stored reference for {prompt_set} has another ctx than {self.ctx_tokens}")
            return refs
        return self.live_references(prompt_set, ref_runner)

    def live_references(self, prompt_set: str, ref_runner: ModelRunner) -> list[FullReference]:
        """Streams (greedy replies, cached on disk) and full logits of the reference configuration."""
        c, tok, ck = self.cfg, self.loaded.tokenizer, self.loaded.checkpoint
        key = (self.loaded.model_id, self.ref_backend, repr(self.ref_spec), c.dtype, prompt_set,
               self.ctx_tokens, int(c.eval.n_score))
        if key in _REFERENCES:
            _REFERENCES.move_to_end(key)
            return _REFERENCES[key]
        stop = set(tok.eos_token_ids) | set(ck.config.eos_token_id)
        cache = (Path(c.runs_dir) / "cache" / "streams" / f"{c.model.name}-{self.loaded.model_id[:12]}"
                 / f"{self.ref_backend}-{quant_label(self.ref_quant_name, self.ref_spec)}-{c.dtype}-{self.device_label}")
        refs = []
        for i, prompt in enumerate(self.prompts[prompt_set]):
            f = cache / f"{prompt_set}{i}-ctx{self.ctx_tokens}-n{c.eval.n_score}.json"
            stream = drift.load_stream(f, prompt, int(c.eval.n_score))
            fresh = stream is None
            if fresh:
                stream = drift.reference_stream(ref_runner, prompt, int(c.eval.n_score), stop)
            refs.append(drift.reference_logits(ref_runner, stream))
            if fresh:
                drift.save_stream(stream, int(c.eval.n_score), f)  # only now: its logits are finite
        _REFERENCES[key] = refs
        while len(_REFERENCES) > 1 and sum(
                r.logits.numel() * 4 for rs in _REFERENCES.values() for r in rs) > _REFERENCE_BYTES:
            _REFERENCES.popitem(last=False)
        return refs


def resolve(cfg: DictConfig) -> Job:
    """Load what a job needs and check its settings.

    The reference configuration is ``reference.backend`` (null: the candidate's backend) with
    ``reference.quant`` (``bf16``: the BF16 model; ``same``: the candidate's quant config, for
    checking a backend's kernels against the reference backend's).

    Raises:
        UserError: bad device/backend, ctx too large, bad reference settings.
    """
    check_settings(cfg)
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        raise UserError(f"dtype={cfg.dtype}: expected bfloat16, float16 or float32")
    if isinstance(cfg.eval.prompt_sets, str) or not cfg.eval.prompt_sets:
        raise UserError("eval.prompt_sets must be a non-empty list, e.g. eval.prompt_sets=[edit,explain]")
    device = resolve_device(cfg.device, cfg.backend.name)
    ref_backend = cfg.reference.backend or cfg.backend.name
    resolve_device(cfg.device, ref_backend)
    if cfg.reference.quant not in ("bf16", "same"):
        raise UserError(f"reference.quant must be bf16 or same, not {cfg.reference.quant!r}")
    spec = quant_spec(cfg.quant)
    ref_spec = quant_spec(cfg.quant) if cfg.reference.quant == "same" else QuantSpec("bf16", "bf16").effective()
    loaded = load_model(cfg, device)
    ctx_tokens = fit_ctx(cfg, loaded.checkpoint.config.max_position_embeddings)
    return Job(cfg, loaded, spec, ref_backend, ref_spec, ctx_tokens, prompt_sets(cfg, loaded.tokenizer, ctx_tokens))


def run(cfg: DictConfig, force: bool = False) -> list[Path]:
    """Compute every missing row of one job (every row with ``force``); return the paths of all its
    rows (done or reused)."""
    job = resolve(cfg)
    todo = {s: job.row_path(s) for s in job.prompts}
    missing = {s: p for s, p in todo.items() if force or not tables.is_complete_row(p)}
    if not missing:
        print(f"already done: {', '.join(str(p) for p in todo.values())}")
        return list(todo.values())
    device = job.loaded.device
    cand_runner, info = job.runner(cfg.backend.name, job.spec)
    ref_runner = None if cfg.reference.source == "stored" else job.runner(job.ref_backend, job.ref_spec)[0]
    for set_name, path in missing.items():
        t0 = time.perf_counter()
        refs = job.references(set_name, ref_runner)
        if cfg.speed.warmup:
            drift.warm_up(cand_runner, refs[0])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results = [drift.score(cand_runner, ref, int(cfg.speed.decode_tokens)) for ref in refs]
        row = tables.make_row(cfg, job.spec, info, results, ctx_tokens=job.ctx_tokens, prompt_set=set_name,
                              model_id=job.loaded.model_id, device=device,
                              weights_bytes=cand_runner.model.weight_bytes(),
                              kv_bytes=cand_runner.kv.bytes_per_position() * job.max_len,
                              wall_s=time.perf_counter() - t0)
        row.update(reference=job.reference_label, decode_cuda_graph=cand_runner.cuda_graph,
                   n_score=int(cfg.eval.n_score), page_size=int(cfg.kv.page_size),
                   prefill_chunk=int(cfg.kv.prefill_chunk),
                   cpu_threads=job.cpu_threads,
                   kl_estimate="exact" if isinstance(refs[0], FullReference) else f"topk{refs[0].k}+tail")
        tables.write_row(path, row, {k: torch.cat([r[1][k] for r in results]) for k in ("kl", "top1_agree", "dp")})
    return list(todo.values())
