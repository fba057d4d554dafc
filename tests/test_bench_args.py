"""The benchmark commands' arguments: bad values stop at parsing with one usage line (exit 2),
before any model is built or GPU time spent (CPU)."""

from __future__ import annotations

import importlib
import sys

import pytest

from benchmarks import decode


def _script(name: str):
    """benchmarks/NAME.py as a module (``python -m benchmarks.NAME``)."""
    return importlib.import_module(f"benchmarks.{name}")


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
    assert err[-1].startswith("python -m benchmarks.decode: error:") and "Traceback" not in "".join(err)


def test_variant_is_parsed_and_its_targets_checked():
    ab = _script("decode_ab")
    name, sets = ab.parse_variant("v=benchmarks.decode.MODES=('graph',);benchmarks.ops.save=None")
    assert name == "v" and sets == [
        ("benchmarks.decode", "MODES", ("graph",)),
        ("benchmarks.ops", "save", None),
    ]


@pytest.mark.parametrize(
    "text, why",
    [
        ("bogus", "expected NAME"),
        ("benchmarks.decode.MODES=1", "expected NAME"),  # no name
        ("v=benchmarks.decode.MODES=", "is not MODULE.ATTR=LITERAL"),
        ("v=benchmarks.decode.MODES=1;", "is not MODULE.ATTR=LITERAL"),
        ("v=benchmarks.decode.MODES=graph", "not a Python literal"),
        ("v=benchmarks.decode.NOPE=1", "has no attribute NOPE"),
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
        ["shipped=benchmarks.decode.MODES=()"],
        ["a=benchmarks.decode.MODES=()", "a=benchmarks.decode.MODES=(1,)"],
    ],
)
def test_variant_names_unique_and_not_the_baseline(script, variants, capsys, monkeypatch):
    mod = _script(script)
    argv = [x for v in variants for x in ("--variant", v)]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        mod.main(argv) if script == "decode_ab" else mod.main()
    assert e.value.code == 2 and "names must be unique and not 'shipped'" in capsys.readouterr().err
