"""The worker: the object that owns what a process loads for its jobs.

A :class:`Worker` pulls and loads checkpoints, quantizes them, and builds runners and proposers.
It keeps the last few loaded models and quantized copies for the next job it runs (a multirun
under Hydra's basic launcher runs every job with one worker; a launcher's worker process gets the
worker with each job it is handed). Nothing of this lives at module level.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch

from evals.drift import Speculation
from quantize import QuantScheme, apply
from tileinfer.core import registry
from tileinfer.core.errors import UserError
from tileinfer.engine.dflash import load_dflash
from tileinfer.engine.generation import SamplingParams
from tileinfer.engine.proposers import DraftModelProposer, NgramProposer, check_same_vocab
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs.schema import NAMED, Config, ModelGroup
from tileinfer.models import Transformer
from tileinfer.models.loading import Loaded, load_model
from tileinfer.ops import Backend, get_backend


def draft_group(name: str) -> ModelGroup:
    """The model group of ``spec.draft_model``: a local checkpoint path, or a conf/model name.

    Raises:
        UserError: neither an existing path nor a known model.
    """
    path = Path(name).expanduser()
    if path.exists():
        return ModelGroup(path=str(path))
    entry = registry.model_entry(name)
    return ModelGroup(name=name, source=entry["source"], config=entry.get("config"))


class Worker:
    """Loads models for jobs and keeps the last ``keep`` float models and quantized copies (a
    target's and its draft model's) for the next job."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._models: OrderedDict = OrderedDict()
        self._quantized: OrderedDict = OrderedDict()
        # one Backend per name for every runner: its workspace (a float32 lm_head copy on the CPU) is
        # shared by the base and the candidate runners, and freed with the weights it copied
        self._backends: dict[str, Backend] = {}

    def _cached(self, cache: OrderedDict, key, make):
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= self.keep:
            cache.popitem(last=False)
        cache[key] = make()
        return cache[key]

    def load(self, group: ModelGroup, dtype: str, device: torch.device) -> Loaded:
        """Pull and load a model group's float checkpoint.

        Raises:
            UserError: a missing or corrupt checkpoint, a quantized one (a sweep quantizes in memory),
                or one whose shapes differ from its conf/model file.
        """
        key = (group.name, json.dumps([group.source, group.config], sort_keys=True), dtype, str(device))
        return self._cached(
            self._models, key, lambda: load_model(group.name, group.source, group.config, getattr(torch, dtype), device)
        )

    def model(self, loaded: Loaded, scheme: QuantScheme) -> Transformer:
        """The model of a quant scheme: the float model itself, or a quantized copy of it."""
        if scheme.is_unquantized():
            return loaded.model
        return self._cached(self._quantized, (loaded.sha256, scheme), lambda: self._quantize(loaded, scheme))

    @staticmethod
    def _quantize(loaded: Loaded, scheme: QuantScheme) -> Transformer:
        sd, _ = apply(loaded.checkpoint, None, scheme, loaded.tokenizer, progress=True, device=loaded.device)
        return Transformer.from_state_dict(loaded.checkpoint.config, sd, dtype=loaded.model.dtype, device=loaded.device)

    def runner(self, cfg: Config, loaded: Loaded, backend: str, scheme: QuantScheme, max_len: int) -> ModelRunner:
        """A runner of ``loaded`` under ``scheme`` on ``backend`` for sequences of up to ``max_len``."""
        if backend not in self._backends:
            self._backends[backend] = get_backend(backend)
        return ModelRunner(
            self.model(loaded, scheme),
            backend=self._backends[backend],
            kv_int8=scheme.kv_cache == "int8",
            max_seq_len=max_len,
            page_size=cfg.kv.page_size,
            prefill_chunk=cfg.kv.prefill_chunk,
            cuda_graph=cfg.speed.cuda_graph,
        )

    def speculation(self, cfg: Config, target: ModelRunner, loaded: Loaded, max_len: int) -> Speculation | None:
        """The :class:`evals.drift.Speculation` of the ``spec`` settings on the ``target`` runner, or
        None for ``spec=none``. ``spec=draft`` loads its draft model (quantized as
        ``spec.draft_quant`` says) on the target's backend.

        Raises:
            UserError: a draft model with another tokenizer or too short a context; a DFlash drafter
                that cannot be loaded or does not fit the target, or a k beyond its block.
        """
        spec = cfg.spec
        if spec.name == "none":
            return None
        if spec.name == "ngram":
            proposer = NgramProposer(spec.min_n, spec.max_n)
        elif spec.name == "draft":
            draft = self.load(draft_group(spec.draft_model), cfg.dtype, loaded.device)
            limit = draft.checkpoint.config.max_position_embeddings
            if limit < max_len:
                raise UserError(
                    f"spec.draft_model={spec.draft_model} has a context of {limit} tokens, shorter than the "
                    f"{max_len} positions of this job (ctx plus the scored window)"
                )
            weights, kv_cache = NAMED[spec.draft_quant]
            runner = self.runner(
                cfg, draft, cfg.backend.name, QuantScheme(weights, kv_cache).effective(), min(max_len + spec.k, limit)
            )
            check_same_vocab(
                loaded.tokenizer, draft.tokenizer, runner.model.config.vocab_size, target.model.config.vocab_size
            )
            proposer = DraftModelProposer(runner)
        else:
            proposer = load_dflash(spec.dflash, target.model, target.ops)
            block = proposer.drafter.config.block_size
            if spec.k >= block:
                raise UserError(
                    f"spec.k={spec.k}: the DFlash drafter drafts at most {block - 1} tokens (block of {block})"
                )
        return Speculation(proposer, spec.k, SamplingParams(spec.temperature, seed=spec.seed))
