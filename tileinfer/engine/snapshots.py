"""Resume snapshots: a long pass (a 32k prefill on the CPU takes most of an hour) keeps its progress.

A snapshot is the KV cache of the positions fed so far, the token ids fed, and the logits of the
prompt's last position and of the last position fed. It is written (atomically) at a chunk or
decode-step boundary once ``every_s`` seconds of work went unsaved, and when Ctrl-C stops the pass;
the next run of the same command restores it and continues from that boundary. Chunk boundaries
stay where an uninterrupted run puts them, so a resumed pass computes the same numbers. A pass
that finishes deletes its snapshot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tileinfer.core import files
from tileinfer.core.kv_cache import Sequence
from tileinfer.engine.runner import ModelRunner


@dataclass
class Restored:
    """What a snapshot gave back: ``fed`` token ids are cached in the sequence; ``first`` are the
    float32 logits [vocab] after the prompt's last position (None if the prompt was not finished);
    ``last`` the logits after ``fed``'s last token."""

    fed: list[int]
    first: torch.Tensor | None
    last: torch.Tensor | None


@dataclass
class Snapshots:
    """The snapshot file of one pass (``path=None``: none are kept)."""

    path: Path | None
    every_s: float = 300.0
    _since: float = field(default_factory=time.monotonic)

    def restore(self, runner: ModelRunner, seq: Sequence, prompt: list[int]) -> Restored:
        """Restore the saved positions into the empty ``seq`` when the snapshot starts with
        ``prompt`` (or is a prefix of it); otherwise (none, another prompt or cache layout, an
        unreadable file) start from nothing."""
        self._since = time.monotonic()
        empty = Restored([], None, None)
        if self.path is None or not self.path.is_file():
            return empty
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
            fed = [int(t) for t in saved["fed"]]
            n = min(len(fed), len(prompt))
            if not fed or fed[:n] != prompt[:n]:
                return empty
            runner.kv.restore(seq, saved["kv"], len(fed))
        except Exception:  # noqa: BLE001 - a damaged or foreign snapshot only costs the work it held
            seq.release()
            return empty
        dev = runner.device
        first = saved.get("first")
        return Restored(fed, None if first is None else first.to(dev), saved["last"].to(dev))

    def due(self) -> bool:
        """Whether ``every_s`` seconds of work went unsaved."""
        return self.path is not None and self.every_s > 0 and time.monotonic() - self._since >= self.every_s

    def save(self, runner: ModelRunner, seq: Sequence, fed: list[int], first, last) -> None:
        """Snapshot the first ``len(fed)`` positions of ``seq`` (see :class:`Restored`)."""
        if self.path is None or not fed:
            return
        state = {
            "fed": torch.tensor(fed, dtype=torch.long),
            "kv": runner.kv.export(seq, len(fed)),
            "first": None if first is None else first.float().cpu(),
            "last": last.float().cpu(),
        }
        with files.atomic_path(self.path) as tmp, open(tmp, "wb") as f:
            torch.save(state, f)
        self._since = time.monotonic()

    def clear(self) -> None:
        """Delete the snapshot (its pass finished)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
