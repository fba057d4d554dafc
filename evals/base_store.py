"""The base store: the base side of every comparison, recorded once and read by every candidate.

llama.cpp's ``--kl-divergence-base`` idea: the base model's distributions over a scored item are
computed once and kept in a file that every candidate configuration, job and worker process
reads. Two formats:

- :class:`LiveBase`, the full float32 logits (exact KL), recorded on first use under
  ``runs_dir/cache/base`` by whichever process gets the file lock first (the others wait, then
  read it). A file holds the item's token ids (prompt, then the base's reply) and the logits at
  its scored positions; its name hashes everything that decides them (model content, base backend
  and quant scheme, dtype, device and thread count, runner settings, the item's tokens).
- :class:`StoredBase`, top-k files (:class:`evals.base_logits.TopKLogits`) written by
  ``python -m tileinfer.record`` under ``base.dir``: small enough to ship (the gate's base), and
  portable across backends and devices; KL against them is the top-k + tail estimate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from evals import base_logits
from evals.base_logits import FullLogits, TopKLogits
from evals.drift import base_pass
from evals.evaluation import Item, ScoredSet
from tileinfer.core import files
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.snapshots import Snapshots

FORMAT = "tileinfer-base-logits/1"


class LiveBase:
    """Full base logits, computed here on first use and recorded under ``folder``.

    Args:
        folder: where the files go (``runs_dir/cache/base/MODEL-SHA``).
        key: what decides the base logits besides an item's tokens (model hash, base side, dtype,
            device, runner settings); hashed into every file name.
        runner: makes the base runner, called at most once, on the first item not yet recorded.
        stop_ids: token ids that end a greedy base reply.
        snapshot_s: seconds of unsaved work after which a long base pass saves a resume snapshot.
    """

    def __init__(self, folder: Path, key: dict, runner: Callable[[], ModelRunner], stop_ids, snapshot_s: float):
        self.folder, self.key, self.stop_ids, self.snapshot_s = folder, key, set(stop_ids), snapshot_s
        self._make_runner, self._runner = runner, None

    def path(self, scored: ScoredSet, i: int) -> Path:
        item = scored.items[i]
        what = self.key | {"prompt": item.prompt, "reply": item.reply, "n_reply": item.n_reply}
        h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return self.folder / f"{scored.name}{i}-{h}.safetensors"

    def prepare(self, scored: ScoredSet) -> None:
        """Record every item of ``scored`` that no process recorded yet."""
        for i in range(len(scored.items)):
            self._record(scored, i)

    def logits(self, scored: ScoredSet, i: int) -> FullLogits:
        """The base logits of item ``i`` of ``scored``, recorded now if no process did before."""
        return _read_full(self._record(scored, i), load=True)

    def _record(self, scored: ScoredSet, i: int) -> Path:
        path = self.path(scored, i)
        if _read_full(path) is None:
            with files.locked(path):  # of processes needing it at once, one computes, the others read
                if _read_full(path) is None:
                    self._compute(scored.items[i], path)
        return path

    def _compute(self, item: Item, path: Path) -> None:
        if self._runner is None:
            self._runner = self._make_runner()
        snaps = Snapshots(path.with_suffix(".resume.pt"), self.snapshot_s)
        full = base_pass(self._runner, item, self.stop_ids, snaps)
        with files.atomic_path(path) as tmp:
            save_file(
                {"tokens": full.tokens.contiguous(), "logits": full.logits.contiguous()},
                str(tmp),
                metadata={"format": FORMAT, "prompt_len": str(full.prompt_len)},
            )


def _read_full(path: Path, load: bool = False) -> FullLogits | bool | None:
    """The recorded :class:`FullLogits` at ``path`` (``load``), or only whether it is there (True);
    None when the file is missing or unreadable (then it is recorded again)."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                return None
            if not load:
                return True
            return FullLogits(f.get_tensor("tokens"), int(meta["prompt_len"]), f.get_tensor("logits"))
    except Exception:  # noqa: BLE001 - a damaged file costs only its recomputation
        return None


class StoredBase:
    """Top-k base logits recorded by ``python -m tileinfer.record`` (read-only here).

    Args:
        folder: ``base.dir`` as set (:func:`evals.base_logits.base_logits_dir`).
        model: the model's registry name; ``model_sha256`` its content hash, which every file's
            manifest must name.
        backend: the backend whose recordings are read (:func:`evals.base_logits.stored_backend`).
        quant: the base's quant label (``bf16-nosmooth``), ``ctx_tokens`` the prompt length, and
            ``top_k`` the ``base.top_k`` setting the files must match.
    """

    def __init__(
        self, folder: str, model: str, model_sha256: str, backend: str, quant: str, ctx_tokens: int, top_k: int
    ):
        self.folder, self.model, self.model_sha256 = folder, model, model_sha256
        self.backend, self.quant, self.ctx_tokens, self.top_k = backend, quant, ctx_tokens, top_k

    def stream(self, scored: ScoredSet, i: int) -> str:
        """What a file holds, its name without the backend: quant, item, prompt length, scored window."""
        return f"{self.quant}-{scored.name}{i}-ctx{self.ctx_tokens}-{scored.stream}"

    def path(self, scored: ScoredSet, i: int) -> Path:
        return base_logits.stored_path(self.folder, self.model, self.backend, self.stream(scored, i))

    def prepare(self, scored: ScoredSet) -> None:
        """Check every item's file before any scoring (usage errors first)."""
        for i in range(len(scored.items)):
            self.logits(scored, i)

    def logits(self, scored: ScoredSet, i: int) -> TopKLogits:
        """The stored base logits of item ``i`` of ``scored``.

        Raises:
            UserError: no file, or one recorded with another k, on another prompt or another checkpoint.
        """
        path, item = self.path(scored, i), scored.items[i]
        base = TopKLogits.load(path)
        if base.k != self.top_k:
            raise UserError(
                f"stored base logits {path} keep the top {base.k} tokens, not base.top_k={self.top_k}: "
                f"set base.top_k={base.k}"
            )
        recorded = base.manifest.get("model_sha256")
        if recorded is not None and recorded != self.model_sha256:
            raise UserError(
                f"stored base logits {path} were recorded from another checkpoint (sha256 {recorded[:12]}, "
                f"this one is {self.model_sha256[:12]}): record them again"
            )
        if base.prompt_len != len(item.prompt):
            raise UserError(f"stored base logits {path} have another ctx than {len(item.prompt)} prompt tokens")
        tokens = base.tokens.tolist()
        if tokens[: base.prompt_len] != list(item.prompt) or (
            item.reply is not None and tokens[base.prompt_len :] != list(item.reply)
        ):
            raise UserError(f"stored base logits {path} were recorded on another prompt: record them again")
        return base


def stop_ids(tokenizer, config) -> set[int]:
    """Token ids that end a greedy reply: the tokenizer's and the model config's EOS ids."""
    return set(tokenizer.eos_token_ids) | set(config.eos_token_id)
