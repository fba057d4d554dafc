"""The plan of a job: every decision about it, made once from the config, as one frozen value.

:func:`resolve` reads the checked :class:`~tileinfer.jobs.schema.Config` and the model's
checkpoint (through the :class:`~tileinfer.jobs.worker.Worker`, which loads it) and decides the
device and backend, both sides of the comparison, the prompt length, the scored sets, whether decode
replays a CUDA graph, each row's identity and file, and where the base side comes from. The job
(:mod:`tileinfer.jobs.job`) then only carries the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from evals import base_logits
from evals.base_store import LiveBase, StoredBase, stop_ids
from evals.evaluation import ScoredSet
from quantize import QuantScheme, calibration_text
from tileinfer import ops
from tileinfer.core import gpu_slots
from tileinfer.core.errors import UserError
from tileinfer.core.provenance import device_name
from tileinfer.engine.runner import resolve_backend, resolve_device, uses_cuda_graph
from tileinfer.engine.snapshots import Snapshots
from tileinfer.jobs import identity
from tileinfer.jobs.schema import Config
from tileinfer.jobs.worker import Worker, draft_group


def quant_label(name: str, scheme: QuantScheme) -> str:
    """``int8_kv-smooth`` / ``int8_kv-nosmooth``: the quant config name plus its smoothing."""
    return f"{name}-{'smooth' if scheme.smooth_keys else 'nosmooth'}"


@dataclass(frozen=True)
class Side:
    """One side of the comparison: the backend it runs on, its quant config's name and scheme."""

    backend: str
    quant: str
    scheme: QuantScheme

    @property
    def label(self) -> str:
        return quant_label(self.quant, self.scheme)


@dataclass(frozen=True)
class Plan:
    """A resolved job. ``cfg`` has its backend resolved (``auto`` replaced by the one that runs)."""

    cfg: Config
    device: torch.device
    candidate: Side
    base: Side
    model_sha256: str
    draft_sha256: str | None
    ctx_tokens: int  # positions before the scored window (ctx.tokens fitted into the model's context)
    max_len: int  # the longest sequence a pass runs (prompt, scored window, decode steps)
    sets: tuple[ScoredSet, ...]
    device_workers: int | None  # workers timing on this device at once (None: unknown)

    @property
    def kernel_check(self) -> bool:
        """Whether both sides share the quant scheme, so only the backend or the code differs."""
        return self.candidate.scheme == self.base.scheme

    @property
    def cpu_threads(self) -> int | None:
        """torch's thread count on the CPU (None on CUDA): CPU decode rounds differently with another
        number of threads, so a greedy reply can differ."""
        return torch.get_num_threads() if self.device.type == "cpu" else None

    def identity(self, s: ScoredSet) -> dict:
        """The identity columns of ``s``'s row (tileinfer.jobs.identity)."""
        c, q = self.cfg, self.candidate.scheme
        return identity.key_of(
            dict.fromkeys(identity.EVALUATION)
            | s.identity
            | dict(
                model=c.model.name,
                model_sha256=self.model_sha256,
                quant=c.quant.name,
                weights=q.weights,
                kv_cache=q.kv_cache,
                smooth_keys=q.smooth_keys,
                smooth_alpha=q.smooth_alpha if q.smooth_keys else None,
                calibration_tokens=q.calibration_tokens if q.smoothing else None,
                calibration_sha256=identity.content_hash(calibration_text(q.calibration)) if q.smoothing else None,
                dtype=c.dtype,
                backend=c.backend.name,
                **c.spec.identity(self.draft_sha256),
                ctx=c.ctx.name,
                ctx_tokens=self.ctx_tokens,
                prompt_set=s.name,
                prompts_sha256=identity.content_hash([[*i.prompt, *(i.reply or ())] for i in s.items]),
                base=f"{c.base.source}:{self.base.backend}/{self.base.label}",
                top_k=c.base.top_k if c.base.source == "stored" else None,
                page_size=c.kv.page_size,
                prefill_chunk=c.kv.prefill_chunk,
                decode_tokens=c.speed.decode_tokens,
                decode_repeats=c.speed.repeats,
                device_workers=self.device_workers,
                warmup=c.speed.warmup,
                decode_cuda_graph=uses_cuda_graph(c.speed.cuda_graph, self.device, ops.get_backend(c.backend.name)),
                device=device_name(self.device),
                cpu_threads=self.cpu_threads,
            )
        )

    def row_path(self, key: dict) -> Path:
        """Where the row of identity ``key`` lives: a readable label plus its hash."""
        c = self.cfg
        label = f"{self.candidate.label}-{c.ctx.name}-{key['prompt_set']}"
        return Path(c.runs_dir) / "rows" / c.model.name / c.backend.name / identity.row_file_name(key, label)

    def snapshots(self, row: Path, i: int) -> Snapshots:
        """Resume snapshots of the candidate's pass over item ``i`` of the row at ``row``."""
        return Snapshots(Path(self.cfg.runs_dir) / "cache" / "resume" / f"{row.stem}-{i}.pt", self.cfg.snapshot_s)

    def base_store(self, worker: Worker) -> LiveBase | StoredBase:
        """Where the base side comes from: stored top-k files, or full logits recorded on first use."""
        c = self.cfg
        if c.base.source == "stored":
            return StoredBase(
                c.base.dir,
                c.model.name,
                self.model_sha256,
                self.base.backend,
                self.base.label,
                self.ctx_tokens,
                c.base.top_k,
            )
        loaded = worker.load(c.model, c.dtype, self.device)
        threads = f"{self.cpu_threads}t" if self.cpu_threads else ""
        key = dict(
            backend=self.base.backend,
            scheme=repr(self.base.scheme),
            dtype=c.dtype,
            device=f"{self.device.type}{threads}",
            page_size=c.kv.page_size,
            prefill_chunk=c.kv.prefill_chunk,
            cuda_graph=c.speed.cuda_graph,
        )
        folder = Path(c.runs_dir) / "cache" / "base" / f"{c.model.name}-{self.model_sha256[:12]}"
        return LiveBase(
            folder,
            key,
            lambda: worker.runner(c, loaded, self.base.backend, self.base.scheme, self.max_len),
            stop_ids(loaded.tokenizer, loaded.checkpoint.config),
            c.snapshot_s,
        )


def fit_ctx(cfg: Config, tail: int, max_ctx: int) -> int:
    """Prompt length for ``cfg.ctx``: ctx.tokens, shortened so the ``tail`` positions after it (a
    scored reply, the timed decode steps) end inside the model's context.

    Raises:
        UserError: ctx larger than the model's context, or no room left for the tail.
    """
    if cfg.ctx.tokens > max_ctx:
        raise UserError(
            f"ctx={cfg.ctx.name} ({cfg.ctx.tokens} tokens) exceeds the context of {cfg.model.name} ({max_ctx} tokens)"
        )
    if tail and tail >= max_ctx:
        raise UserError(
            f"the {tail} positions after the prompt (eval.n_score or speed.decode_tokens) leave no room for a "
            f"prompt in the {max_ctx}-token context of {cfg.model.name}"
        )
    return min(cfg.ctx.tokens, max_ctx - tail)


def resolve(cfg: Config, worker: Worker, cpu_workers: int | None = 1) -> Plan:
    """The plan of ``cfg``: loads the model (through ``worker``) and builds the scored sets.

    The base side is ``base.backend`` (None: the candidate's backend) with ``base.quant`` (``bf16``:
    the BF16 model; ``same``: the candidate's quant config, for checking a backend's kernels
    against the reference backend's). ``cpu_workers``: how many processes of the command may run
    jobs on this host's CPU at once (a launcher's workers; None: unknown); rows record how many
    time on their device at once (on CUDA, the workers of the claimed GPU slot's GPU).

    Raises:
        UserError: bad device or backend, ctx too large, a scored set that cannot be built, drafts
            that do not fit after the prompt.
    """
    device = resolve_device(cfg.device, cfg.backend.name)
    cfg = replace(cfg, backend=replace(cfg.backend, name=resolve_backend(cfg.backend.name, device)))
    base_backend = cfg.base.backend or cfg.backend.name
    if cfg.base.source == "live":  # a stored base runs nothing here
        resolve_device(cfg.device, base_backend)
    scheme = cfg.quant.scheme()
    base_quant = cfg.quant.name if cfg.base.quant == "same" else "bf16"
    base_scheme = scheme if cfg.base.quant == "same" else QuantScheme("bf16", "bf16").effective()
    loaded = worker.load(cfg.model, cfg.dtype, device)
    evaluation = cfg.evaluation()
    tail, _ = evaluation.positions(cfg.ctx.tokens, cfg.speed.decode_tokens)
    ctx_tokens = fit_ctx(cfg, tail, loaded.checkpoint.config.max_position_embeddings)
    _, max_len = evaluation.positions(ctx_tokens, cfg.speed.decode_tokens)
    sets = tuple(evaluation.scored_sets(loaded.tokenizer, ctx_tokens))
    if cfg.spec.name != "none" and cfg.spec.k >= max_len - ctx_tokens:
        raise UserError(
            f"spec.k={cfg.spec.k} drafts do not fit the {max_len - ctx_tokens} positions after the prompt "
            "(eval.n_score / speed.decode_tokens): lower spec.k"
        )
    draft = worker.load(draft_group(cfg.spec.draft_model), cfg.dtype, device) if cfg.spec.name == "draft" else None
    base = Side(base_backend, base_quant, base_scheme)
    if cfg.base.source == "stored":  # portable: whichever backend recorded them (the reference backend first)
        probe = StoredBase(cfg.base.dir, cfg.model.name, "", "", base.label, ctx_tokens, cfg.base.top_k)
        streams = [probe.stream(s, i) for s in sets for i in range(len(s.items))]
        base = replace(
            base, backend=base_logits.stored_backend(cfg.base.dir, cfg.model.name, streams, cfg.base.backend)
        )
    slot = gpu_slots.held()
    workers = (slot.workers if slot else 1) if device.type == "cuda" else cpu_workers
    return Plan(
        cfg,
        device,
        Side(cfg.backend.name, cfg.quant.name, scheme),
        base,
        loaded.sha256,
        draft and draft.sha256,
        ctx_tokens,
        max_len,
        sets,
        workers,
    )
