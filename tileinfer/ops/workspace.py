"""Memory that one backend instance's ops keep from call to call, owned by that instance."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")


class Workspace:
    """What one :class:`~tileinfer.ops.Backend`'s ops keep between calls, so that a step allocates
    little besides its outputs:

    - scratch objects under a key (:meth:`get`): the cuTile backend's split-K and split-KV partials
      per shape, the Triton backend's stream-K partial tiles and flags per (device, stream). Reuse
      by the next call is safe because a backend's kernels run in stream order, and a CUDA graph
      captured after a shape's first call keeps pointing at the same memory;
    - float32 copies of weights (:meth:`float_copy`), each kept while its weight lives.

    An op called without one (``workspace=None``) makes a fresh one for that call: correct, only
    allocating more. Nothing here is shared between two Backends. Not thread-safe.
    """

    def __init__(self) -> None:
        self._held: dict[Hashable, object] = {}
        self._float_copies: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The object held under ``key``; made by ``make()`` and kept on the first call with it."""
        if key not in self._held:
            self._held[key] = make()
        return self._held[key]  # type: ignore[return-value]

    def entries(self) -> dict[Hashable, object]:
        """A copy of the key -> object table of :meth:`get` (for tests and memory accounting)."""
        return dict(self._held)

    def float_copy(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` in float32: ``w`` itself when it is float32, else a copy made on the first call with
        this tensor and kept until the tensor is freed (converting a 150k-row lm_head on every decode
        step would take most of the step on the CPU)."""
        if w.dtype == torch.float32:
            return w
        hit = self._float_copies.get(id(w))
        if hit is None or hit[0]() is not w:
            copies = self._float_copies
            ref = weakref.ref(w, lambda _, key=id(w): copies.pop(key, None))
            hit = copies[id(w)] = (ref, w.float())
        return hit[1]
