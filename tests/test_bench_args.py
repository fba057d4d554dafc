"""The benchmark commands' arguments: bad values stop at parsing with one usage line (exit 2),
before any model is built or GPU time spent (CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tileinfer.bench import decode

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """benchmarks/NAME.py as a module (its folder on sys.path: prefill_chunks imports decode_ab)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_contexts_take_token_counts_and_the_sweeps_k_names():
    assert decode.contexts_arg("1024, 1k,32K,5") == [1024, 1024, 32768, 5]


@pytest.mark.parametrize("text", ["", "1k,", "x", "1.5k", "0", "-3"])
def test_contexts_refuse_what_is_not_a_positive_count(text):
    with pytest.raises(Exception, match="token count|at least 1"):
        decode.contexts_arg(text)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--contexts", "1k,x"], ["--quants", "int4"]])
def test_bench_decode_refuses_bad_values_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m tileinfer.bench.decode: error:") and "Traceback" not in "".join(err)


def test_variant_is_parsed_and_its_targets_checked():
    ab = _script("decode_ab")
    name, sets = ab.parse_variant("v=tileinfer.bench.decode.MODES=('graph',);tileinfer.bench.ops.save=None")
    assert name == "v" and sets == [
        ("tileinfer.bench.decode", "MODES", ("graph",)),
        ("tileinfer.bench.ops", "save", None),
    ]


@pytest.mark.parametrize(
    "text, why",
    [
        ("bogus", "expected NAME"),
        ("tileinfer.bench.decode.MODES=1", "expected NAME"),  # no name
        ("v=tileinfer.bench.decode.MODES=", "is not MODULE.ATTR=LITERAL"),
        ("v=tileinfer.bench.decode.MODES=1;", "is not MODULE.ATTR=LITERAL"),
        ("v=tileinfer.bench.decode.MODES=graph", "not a Python literal"),
        ("v=tileinfer.bench.decode.NOPE=1", "has no attribute NOPE"),
        ("v=no_such_module.A=1", "cannot import no_such_module"),
    ],
)
def test_variant_refuses_before_any_run(text, why):
    ab = _script("decode_ab")
    with pytest.raises(Exception, match=why):
        ab.parse_variant(text)


@pytest.mark.parametrize("script", ["decode_ab", "prefill_chunks"])
@pytest.mark.parametrize(
    "variants",
    [
        ["shipped=tileinfer.bench.decode.MODES=()"],
        ["a=tileinfer.bench.decode.MODES=()", "a=tileinfer.bench.decode.MODES=(1,)"],
    ],
)
def test_variant_names_unique_and_not_the_baseline(script, variants, capsys, monkeypatch):
    mod = _script(script)
    argv = [x for v in variants for x in ("--variant", v)]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        mod.main(argv) if script == "decode_ab" else mod.main()
    assert e.value.code == 2 and "names must be unique and not 'shipped'" in capsys.readouterr().err
