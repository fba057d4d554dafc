"""Typed settings: dataclass fields that carry their allowed range or choices, checked in one pass.

A settings dataclass (the job schema, an evaluation's settings) declares ``n: int = number(8, lo=1)``
or ``mode: str = choice("a", "a", "b")``; :func:`check_ranges` then checks every such field of a
built instance, recursively, and names the first setting out of range in one line.
"""

from __future__ import annotations

import math
from dataclasses import field, fields, is_dataclass

from tileinfer.core.errors import UserError


def number(default, lo=None, hi=None):
    """A numeric field with bounds ``[lo, hi]`` (None: unbounded on that side)."""
    return field(default=default, metadata={"lo": lo, "hi": hi})


def choice(default, *choices):
    """A field whose value must be one of ``choices``."""
    return field(default=default, metadata={"choices": choices})


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
            kind = int if "int" in str(f.type) else float
            check_number(key, value, kind, f.metadata["lo"], f.metadata["hi"])
