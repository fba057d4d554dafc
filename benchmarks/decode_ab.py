"""Whole-model decode with the backends' tuning as shipped and with alternatives, in one process (H200).

    python -m benchmarks.decode_ab --models qwen3-8b-random --quants int8_both --contexts 1024,32768 \
        --variant 'unit=triton.gemv1_int8=((4096, (4, 1024, 4, 1, 4)), (None, (16, 512, 4, 1, 4)))' \
        --out runs/bench-ab

Each ``--variant NAME=BACKEND.FIELD=LITERAL`` (repeatable; several fields of one variant joined by
``;``) runs the models again on backends whose tuning (``tileinfer/ops/BACKEND/tuning.py``) has
those fields replaced (``Backend.with_tuning``): the literal is a Python literal, read as the
field's type (tiles from tuples, e.g. ``triton.decode_tile=(128, 4, 2)``, ``cutile.int8_unit=False``,
``triton.gemm_bf16_shapes={(1024, 6144, 2560): (128, 128, 64, 8, 8, 4, "tma_ws")}``). Nothing is
patched: the shipped tuning runs first as ``shipped``. ``--sweep FAMILIES`` first runs the op
benchmark's tile sweep of those Triton families on the models and adds the variant ``sweep``: a
tuning with each shape's winner (``benchmarks.ops.tuned``, as ``benchmarks.ops --apply-sweep``). A
table entry chosen from ``benchmarks.ops`` alone can lose in the whole model
(results/h200-2026-12-01-gemv-dot-ab.md), so entries are decided here. Writes OUT/decode-ab.md and
.parquet (the rows of every variant, ``variant`` column) and prints tok/s per variant and its ratio
to the shipped tuning.
"""

from __future__ import annotations

import argparse
import ast
import collections.abc
import dataclasses
import enum
import sys
import types
import typing
from functools import partial

import torch

from benchmarks.decode import bench_model, contexts_arg, positive_int, refuse_unknown
from benchmarks.ops import measure_ceilings, run_sweep, save, sweep_winners, tuned
from quantize import NAMED
from tileinfer.core.errors import UserError
from tileinfer.ops import Backend, get_backend

TUNED_BACKENDS = ("triton", "cutile")


def coerce(hint, value):
    """``value`` (a Python literal) as the type ``hint`` describes: NamedTuples (tiles) from tuples,
    enums from their values, tuples and mappings element by element.

    Raises:
        TypeError: a value that does not fit the type.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return coerce(a, value)
                except (TypeError, ValueError):
                    pass
        raise TypeError(f"{value!r} is not a {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise TypeError(f"{value!r} is not one of {args}")
        return value
    if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):  # a NamedTuple
        if not isinstance(value, (tuple, list)) or len(value) > len(hint._fields):
            raise TypeError(f"{value!r} is not a {hint.__name__} {hint._fields}")
        hints = typing.get_type_hints(hint)
        return hint(*(coerce(hints[f], v) for f, v in zip(hint._fields, value)))
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{value!r} is not a tuple")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(args[0], v) for v in value)
        if len(args) != len(value):
            raise TypeError(f"{value!r} does not have {len(args)} items")
        return tuple(coerce(a, v) for a, v in zip(args, value))
    if origin in (collections.abc.Mapping, dict):
        if not isinstance(value, dict):
            raise TypeError(f"{value!r} is not a mapping")
        return {coerce(args[0], k): coerce(args[1], v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise TypeError(f"{value!r} is not a {hint.__name__}")
    return value


def parse_variant(text: str) -> tuple[str, dict[str, dict]]:
    """argparse type of ``--variant``: ``NAME=BACKEND.FIELD=LITERAL;BACKEND.FIELD=LITERAL`` -> (NAME,
    {backend: {field: value}}), each backend loaded and each value read as its field's type here,
    before any GPU work.

    Raises:
        argparse.ArgumentTypeError: a malformed text, a backend that is not tuned or not installed, a
            field its tuning lacks, or a value that is not a Python literal of the field's type (one
            usage line).
    """
    name, _, rest = text.partition("=")
    if not name.strip() or "." in name or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=BACKEND.FIELD=LITERAL[;...]")
    changes: dict[str, dict] = {}
    for part in rest.split(";"):
        target, _, literal = part.partition("=")
        backend, _, field = target.strip().partition(".")
        if not backend or not field or not literal.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: {part!r} is not BACKEND.FIELD=LITERAL")
        if backend not in TUNED_BACKENDS:
            raise argparse.ArgumentTypeError(f"{text!r}: {backend!r} is not one of {', '.join(TUNED_BACKENDS)}")
        try:
            tuning = get_backend(backend).tuning
        except UserError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
        hints = typing.get_type_hints(type(tuning))
        if field not in {f.name for f in dataclasses.fields(tuning)}:
            raise argparse.ArgumentTypeError(f"{text!r}: the {backend} tuning has no field {field}")
        try:
            value = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{text!r}: {literal.strip()!r} is not a Python literal") from None
        try:
            changes.setdefault(backend, {})[field] = coerce(hints[field], value)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {backend}.{field}: {e}") from None
    return name.strip(), changes


def variant_backend(name: str, changes: dict[str, dict]) -> Backend:
    """A new Backend ``name`` whose tuning has the variant's ``changes`` for it."""
    backend = get_backend(name)
    return backend.with_tuning(**changes[name]) if changes.get(name) else backend


def refuse_variant_names(p: argparse.ArgumentParser, variants: list[tuple[str, list]]) -> None:
    """Exit with one usage line for a variant named ``shipped`` (the baseline's name) or twice."""
    names = [n for n, _ in variants]
    dup = sorted({n for n in names if names.count(n) > 1 or n == "shipped"})
    if dup:
        p.error(f"--variant: names must be unique and not 'shipped': {', '.join(dup)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random,qwen3-8b-random")
    p.add_argument("--backends", default="triton")
    p.add_argument("--quants", default="int8_both")
    p.add_argument("--contexts", type=contexts_arg, default="1024,32768", help="token counts (1024 or 1k)")
    p.add_argument("--steps", type=positive_int, default=128)
    p.add_argument(
        "--variant", type=parse_variant, action="append", default=[], help="NAME=BACKEND.FIELD=LITERAL[;...]"
    )
    p.add_argument("--sweep", default="", help="Triton sweep families to time first (comma-separated)")
    p.add_argument("--sweep-budget", type=float, default=150.0)
    p.add_argument("--out", default="runs/bench-ab")
    a = p.parse_args(argv)
    refuse_variant_names(p, a.variant)
    refuse_unknown(p, a.quants, NAMED, a.models)
    if not torch.cuda.is_available():
        print("no CUDA device: the decode A/B needs a GPU", file=sys.stderr)
        return 2
    # (name, a function giving the Backend of a backend name for the variant's runs)
    variants = [("shipped", get_backend)] + [(n, partial(variant_backend, changes=c)) for n, c in a.variant]
    ceil = measure_ceilings("cuda")
    header = (
        f"Decode A/B on {torch.cuda.get_device_name()}; copy bandwidth {ceil['copy_GBps']:.0f} GB/s; "
        f"{a.steps} steps.\n\n"
    )
    if a.sweep:
        srows = run_sweep(a.models.split(","), {"triton": get_backend("triton")}, ceil, "cuda", a.sweep_budget, a.sweep)
        save(srows, a.out, "sweep", header)
        winners = sweep_winners(srows)
        for fam, w in winners.items():
            print(f"sweep winners {fam}: {w['by_key'] or w['config']}")
        variants.append(("sweep", lambda b: get_backend(b, tuned(get_backend(b).tuning, winners, b))))
    rows = []
    for name in a.models.split(","):
        for vname, backend_of in variants:
            got = bench_model(
                name,
                [backend_of(b) for b in a.backends.split(",")],
                a.quants.split(","),
                a.contexts,
                a.steps,
                ceil["copy_GBps"],
            )
            rows += [dict(variant=vname, **r) for r in got]
            save(rows, a.out, "decode-ab", header)
    base = {
        (r["model"], r["quant"], r["backend"], r["ctx"], r["mode"]): r["tok_s"]
        for r in rows
        if r["variant"] == "shipped"
    }
    print(header.strip())
    for r in rows:
        if r["mode"] != "eager":
            ratio = r["tok_s"] / base[(r["model"], r["quant"], r["backend"], r["ctx"], r["mode"])]
            what = (
                f"{r['variant']:10s} {r['model']:18s} {r['quant']:9s} {r['backend']:7s} {r['ctx']:6d} {r['mode']:12s}"
            )
            print(f"{what} {r['tok_s']:8.1f} tok/s  x{ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
