"""Whole-model decode with a kernel table as shipped and with alternatives, in one process (H200).

    python -m benchmarks.decode_ab --models qwen3-8b-random --quants int8_both --contexts 1024,32768 \
        --variant 'unit=tileinfer.ops.triton.gemm.GEMV1_INT8=[(4096, (4, 1024, 4, 1, 4)), (None, (16, 512, 4, 1, 4))]' \
        --out runs/bench-ab

``--sweep FAMILIES`` first runs ``bench.ops``'s tile sweep of those Triton families on the models and
adds the variant ``sweep``: each shape's winner installed, as ``bench.ops --apply-sweep`` does.
Each ``--variant NAME=MODULE.ATTR=LITERAL`` (repeatable; several assignments of one variant joined
by ``;``) sets module attributes to Python literals for its run and restores them after; the
shipped tables run first as ``shipped``. A table entry chosen from ``bench.ops`` alone can lose in
the whole model (results/h200-2026-12-01-gemv-dot-ab.md), so entries are decided here.
Writes OUT/decode-ab.md and .parquet (the rows of every variant, ``variant`` column) and prints
tok/s per variant and its ratio to the shipped tables.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import sys
from functools import partial

import torch

from benchmarks.decode import bench_model, contexts_arg, positive_int, refuse_unknown
from benchmarks.ops import measure_ceilings, run_sweep, save, sweep_winners
from quantize import NAMED


def parse_variant(text: str) -> tuple[str, list[tuple[str, str, object]]]:
    """argparse type of ``--variant``: ``NAME=MOD.ATTR=LITERAL;MOD.ATTR=LITERAL`` -> (NAME, [(module,
    attribute, value)]), each module imported and each attribute checked here, before any GPU work.

    Raises:
        argparse.ArgumentTypeError: a malformed text, a module that does not import, an attribute
            it lacks, or a value that is not a Python literal (one usage line).
    """
    name, _, rest = text.partition("=")
    if not name.strip() or "." in name or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=MODULE.ATTR=LITERAL[;...]")
    sets = []
    for part in rest.split(";"):
        target, _, literal = part.partition("=")
        module, _, attr = target.strip().rpartition(".")
        if not module or not attr or not literal.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: {part!r} is not MODULE.ATTR=LITERAL")
        try:
            value = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{text!r}: {literal.strip()!r} is not a Python literal") from None
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: cannot import {module}: {e}") from None
        if not hasattr(mod, attr):
            raise argparse.ArgumentTypeError(f"{text!r}: {module} has no attribute {attr}")
        sets.append((module, attr, value))
    return name.strip(), sets


def refuse_variant_names(p: argparse.ArgumentParser, variants: list[tuple[str, list]]) -> None:
    """Exit with one usage line for a variant named ``shipped`` (the baseline's name) or twice."""
    names = [n for n, _ in variants]
    dup = sorted({n for n in names if names.count(n) > 1 or n == "shipped"})
    if dup:
        p.error(f"--variant: names must be unique and not 'shipped': {', '.join(dup)}")


@contextlib.contextmanager
def patched(sets):
    """Module attributes set for the duration; the compiled-kernel caches are keyed by constexprs, so
    a table change takes effect without clearing anything."""
    old = []
    for module, attr, value in sets:
        mod = importlib.import_module(module)
        old.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, value)
    try:
        yield
    finally:
        for mod, attr, value in reversed(old):
            setattr(mod, attr, value)


@contextlib.contextmanager
def installed(winners):
    """Each sweep family's per-shape winners installed for the duration (other shapes: the tables)."""
    undo = [w["family"].install(dict(w["by_key"])) for w in winners if w["by_key"]]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random,qwen3-8b-random")
    p.add_argument("--backends", default="triton")
    p.add_argument("--quants", default="int8_both")
    p.add_argument("--contexts", type=contexts_arg, default="1024,32768", help="token counts (1024 or 1k)")
    p.add_argument("--steps", type=positive_int, default=128)
    p.add_argument("--variant", type=parse_variant, action="append", default=[], help="NAME=MODULE.ATTR=LITERAL[;...]")
    p.add_argument("--sweep", default="", help="Triton sweep families to time first (comma-separated)")
    p.add_argument("--sweep-budget", type=float, default=150.0)
    p.add_argument("--out", default="runs/bench-ab")
    a = p.parse_args(argv)
    refuse_variant_names(p, a.variant)
    refuse_unknown(p, a.quants, NAMED, a.models)
    if not torch.cuda.is_available():
        print("no CUDA device: the decode A/B needs a GPU", file=sys.stderr)
        return 2
    # (name, a function giving the context that installs the variant for one run)
    variants = [("shipped", partial(patched, []))] + [(n, partial(patched, sets)) for n, sets in a.variant]
    ceil = measure_ceilings("cuda")
    header = (
        f"Decode A/B on {torch.cuda.get_device_name()}; copy bandwidth {ceil['copy_GBps']:.0f} GB/s; "
        f"{a.steps} steps.\n\n"
    )
    if a.sweep:
        from tileinfer.ops import get_backend

        srows = run_sweep(a.models.split(","), {"triton": get_backend("triton")}, ceil, "cuda", a.sweep_budget, a.sweep)
        save(srows, a.out, "sweep", header)
        winners = sweep_winners(srows)
        for fam, w in winners.items():
            print(f"sweep winners {fam}: {w['by_key']}")
        variants.append(("sweep", partial(installed, list(winners.values()))))
    rows = []
    for name in a.models.split(","):
        for vname, context in variants:
            with context():
                got = bench_model(
                    name,
                    a.backends.split(","),
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
