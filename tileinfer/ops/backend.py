"""The op backends behind one interface: :func:`get_backend` returns a :class:`Backend` whose ops fall
back to the reference op, recorded, wherever a fast backend's kernels cannot take an input."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from types import ModuleType

from tileinfer.core.errors import UserError
from tileinfer.ops.workspace import Workspace

BACKENDS = ("reference", "triton", "cutile")

# The op signatures every backend implements (see tileinfer.ops.reference for the contracts).
OPS = (
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "swiglu",
    "lm_head",
    "qk_norm_rope_kv_write",
    "attention",
    "argmax",
)

_log = logging.getLogger("tileinfer.ops")


class Unsupported(Exception):
    """Raised by a fast backend's op, before it launches anything, for an input its kernels do not
    take. ``reason`` names a fixed property of the input (a head_dim, a dtype, a layout), never a
    per-call value, so that a run records one entry per cause."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Backend:
    """One instance of an op backend: every op of :data:`OPS` as an attribute, with the signature of
    the backend module's function (that of :mod:`tileinfer.ops.reference` plus the module's
    optional keywords, e.g. a ``tile`` or ``plan`` that overrides the planned one).

    A call runs the module's op with this instance's :attr:`tuning` and :attr:`workspace` (for the
    ops that take them; a keyword given to the call wins). When the op raises :class:`Unsupported`
    (before launching anything), the reference op runs instead on the same arguments and its
    result is returned; the entry "name.op: reason" is recorded (:meth:`fallbacks`) and logged as a
    warning on the ``tileinfer.ops`` logger, once per distinct entry of this instance. Any other
    error propagates (an input the reference rejects too is a ``ValueError``, not a fallback).

    Attributes:
        name: the backend's name (an entry of :data:`BACKENDS`).
        cuda_graphs: whether its decode step can be captured in a CUDA graph (the module's
            ``CUDA_GRAPHS``).
        tuning: the tile tables and switches its ops plan with (the module's ``TUNING`` unless
            given; None for the reference backend, which has none).
        workspace: the memory its ops keep between calls (:class:`~tileinfer.ops.Workspace`).

    Raises:
        NotImplementedError: ``module`` lacks some op of :data:`OPS` (or has a non-callable in its
            place); the message names them.
    """

    def __init__(self, name: str, module: ModuleType, reference: ModuleType, tuning=None):
        missing = [op for op in OPS if not callable(getattr(module, op, None))]
        if missing:
            raise NotImplementedError(
                f"backend {name!r} ({module.__name__}) lacks the ops {', '.join(missing)} "
                "that tileinfer.ops.OPS requires of every backend"
            )
        self.name = name
        self.cuda_graphs = bool(getattr(module, "CUDA_GRAPHS", False))
        self.tuning = tuning if tuning is not None else getattr(module, "TUNING", None)
        self.workspace = Workspace()
        self._module, self._reference = module, reference
        self._fallbacks: set[str] = set()
        for op in OPS:
            setattr(self, op, self._dispatch(op))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def with_tuning(self, **changes) -> Backend:
        """A new instance of this backend whose tuning has ``changes`` (fields of its tuning class,
        e.g. ``sms=DEFAULT_SMS``); its own workspace and fallback record.

        Raises:
            ValueError: the backend has no tuning (the reference).
            TypeError: a field its tuning does not have.
        """
        if self.tuning is None:
            raise ValueError(f"backend {self.name!r} has no tuning")
        return Backend(self.name, self._module, self._reference, dataclasses.replace(self.tuning, **changes))

    def fallbacks(self) -> list[str]:
        """The fallbacks recorded since this instance was made or :meth:`reset_fallbacks`, sorted:
        "backend.op: reason"."""
        return sorted(self._fallbacks)

    def reset_fallbacks(self) -> None:
        """Forget the recorded fallbacks (a job calls this before the run it reports on); an entry
        seen again is logged again."""
        self._fallbacks.clear()

    def _record(self, op: str, reason: str) -> None:
        entry = f"{self.name}.{op}: {reason}"
        if entry not in self._fallbacks:
            _log.warning("fallback to the reference op: %s", entry)
            self._fallbacks.add(entry)

    def _dispatch(self, op: str):
        kernel, ref = getattr(self._module, op), getattr(self._reference, op)
        kernel_kw = _taken(kernel, tuning=self.tuning, workspace=self.workspace)
        ref_kw = _taken(ref, workspace=self.workspace)
        if kernel is ref:  # the reference backend: nothing falls back

            @functools.wraps(ref)
            def run_reference(*args, **kwargs):
                return ref(*args, **{**ref_kw, **kwargs})

            return run_reference
        ref_params = inspect.signature(ref).parameters

        @functools.wraps(kernel)
        def run(*args, **kwargs):
            try:
                return kernel(*args, **{**kernel_kw, **kwargs})
            except Unsupported as e:
                self._record(op, e.reason)
                return ref(*args, **{**ref_kw, **{k: v for k, v in kwargs.items() if k in ref_params}})

        return run


def _taken(fn, **keywords) -> dict:
    """The ``keywords`` that ``fn`` has parameters for."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in keywords.items() if k in params}


def get_backend(name: str, tuning=None) -> Backend:
    """A new :class:`Backend` for the module ``tileinfer.ops.<name>`` (with ``tuning`` in place of the
    module's own, when given): its own workspace and fallback record.

    Raises:
        UserError: unknown backend name, or a fast backend whose toolchain is missing.
        NotImplementedError: the module lacks some op of :data:`OPS`; the message names them.
    """
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        module = importlib.import_module(f"tileinfer.ops.{name}")
    except ImportError as e:
        raise UserError(f"backend {name!r} is not available here: {e}") from None
    return Backend(name, module, importlib.import_module("tileinfer.ops.reference"), tuning)
