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


def test_variant_is_parsed_into_typed_tuning_fields():
    from tileinfer.ops.cutile.plan import DECODE_ROWS  # noqa: F401  (cuTile importable: its tuning is checked)
    from tileinfer.ops.triton.tuning import DecodeTile, GemmTile, GemvTile, RowMode

    ab = _script("decode_ab")
    name, changes = ab.parse_variant(
        "v=triton.decode_tile=(128, 4, 2);triton.gemv1_int8=((4096, (4, 1024, 4, 3, 4)), (None, (16, 512, 4, 3, 2)));"
        "triton.gemm_bf16_shapes={(1024, 6144, 2560): (128, 128, 64, 8, 8, 4, 'tma_ws')};cutile.int8_unit=False;"
        "triton.sms=None"
    )
    assert name == "v" and changes == {
        "triton": {
            "decode_tile": DecodeTile(128, 4, 2),
            "gemv1_int8": (
                (4096, GemvTile(4, 1024, 4, 3, RowMode.UNIT)),
                (None, GemvTile(16, 512, 4, 3, RowMode.WORDS)),
            ),
            "gemm_bf16_shapes": {(1024, 6144, 2560): GemmTile(128, 128, 64, 8, 8, 4, "tma_ws")},
            "sms": None,
        },
        "cutile": {"int8_unit": False},
    }
    assert type(changes["triton"]["gemv1_int8"][0][1].row_mode) is RowMode
    backend = ab.variant_backend("triton", changes)
    assert backend.tuning.decode_tile == DecodeTile(128, 4, 2) and backend.tuning.gemv16_bf16 == GemvTile(32, 256, 4, 4)


@pytest.mark.parametrize(
    "text, why",
    [
        ("bogus", "expected NAME"),
        ("triton.sms=1", "expected NAME"),  # no name
        ("v=triton.sms=", "is not BACKEND.FIELD=LITERAL"),
        ("v=triton.sms=1;", "is not BACKEND.FIELD=LITERAL"),
        ("v=triton.sms=many", "not a Python literal"),
        ("v=triton.nope=1", "has no field nope"),
        ("v=cuda.sms=1", "'cuda' is not one of triton, cutile"),
        ("v=triton.sms='132'", "is not a int"),
        ("v=triton.decode_tile=(128, 4)", "DecodeTile"),
        ("v=triton.gemm_bf16=((128, 128, 64, 8, 8, 4, 'fast'),)", "triton.gemm_bf16"),
        ("v=cutile.int8_unit=1", "is not a bool"),
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
        ["shipped=triton.sms=100"],
        ["a=triton.sms=100", "a=triton.sms=120"],
    ],
)
def test_variant_names_unique_and_not_the_baseline(script, variants, capsys, monkeypatch):
    mod = _script(script)
    argv = [x for v in variants for x in ("--variant", v)]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        mod.main(argv) if script == "decode_ab" else mod.main()
    assert e.value.code == 2 and "names must be unique and not 'shipped'" in capsys.readouterr().err
