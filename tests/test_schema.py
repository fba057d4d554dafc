"""The typed configuration (tileinfer.jobs.schema), the row identity and the model registry."""

import dataclasses

import polars as pl
import pytest
import torch
from hydra import compose, initialize_config_module

from tileinfer.core import registry
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.engine import runner
from tileinfer.jobs import identity, rows, schema
from tileinfer.jobs.schema import Config


def load(*overrides: str, config: str = "config") -> Config:
    schema.register()
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        return schema.load(compose(config, overrides=list(overrides)))


def test_every_command_composes_a_checked_config():
    cfg = load()
    assert isinstance(cfg, Config) and cfg.gate is None and cfg.backend.name == "auto"
    assert (cfg.quant.name, cfg.quant.weights, cfg.quant.kv_cache) == ("int8_both", "int8", "int8")
    assert cfg.quant.smooth_keys and cfg.quant.smooth_alpha == 0.5  # schema defaults, not repeated per file
    assert load(config="gate").gate.bounds["bfloat16"]["kl_mean"] > 0
    assert load(config="record").quant.name == "bf16"


@pytest.mark.parametrize("quant", ["bf16", "int8_weights", "int8_kv", "int8_both"])
def test_quant_files_give_their_precisions(quant):
    q = load(f"quant={quant}").quant
    assert (
        quant
        == {
            ("bf16", "bf16"): "bf16",
            ("int8", "bf16"): "int8_weights",
            ("bf16", "int8"): "int8_kv",
            ("int8", "int8"): "int8_both",
        }[(q.weights, q.kv_cache)]
    )


@pytest.mark.parametrize(
    "override,message",
    [
        ("eval.n_score=0", "eval.n_score=0: must be at least 1"),
        ("quant.smooth_alpha=1.5", "quant.smooth_alpha=1.5: must be between 0.0 and 1.0"),
        ("kv.page_size=-64", "kv.page_size=-64: must be at least 1"),
        ("quant.weights=int4", "quant.weights=int4: expected one of bf16, int8"),
        ("base.source=nowhere", "base.source=nowhere: expected one of live, stored"),
        ("base.quant=int8", "base.quant=int8: expected one of bf16, same"),
        ("device=tpu", "device=tpu: expected one of auto, cpu, cuda"),
        ("dtype=int8", "dtype=int8: expected one of bfloat16, float16, float32"),
        ("eval.prompt_sets=[]", "eval.prompt_sets must be a non-empty list"),
    ],
)
def test_bad_settings_are_refused_with_one_line(override, message):
    with pytest.raises(UserError) as e:
        load(override)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_wrong_types_are_refused_while_composing():
    with pytest.raises(Exception, match="n_score"):
        load("eval.n_score=abc")
    with pytest.raises(Exception, match="n_windows"):  # a setting of another evaluation
        load("eval.n_windows=4")
    with pytest.raises(Exception, match="n_score"):
        load("eval=corpus", "eval.n_score=4")
    with pytest.raises(Exception, match="kv.unknown_key"):
        load("kv.unknown_key=1")


@pytest.mark.parametrize("override,key", [("+kv.unknown_key=1", "kv.unknown_key"), ("+quantt=int8_both", "quantt")])
def test_added_settings_the_schema_lacks_are_refused(override, key):
    # Hydra lets '+' add a key to a typed node; OmegaConf.to_object would then drop it silently
    with pytest.raises(UserError, match=f"unknown setting {key}:"):
        load(override)


def identity_row(**kw) -> dict:
    row = {c: f"v-{c}" for c in identity.IDENTITY}
    return row | kw


def test_row_file_name_changes_with_every_identity_column():
    base = identity.row_file_name(identity_row(), "x")
    for c in identity.IDENTITY:
        assert identity.row_file_name(identity_row(**{c: "other"}), "x") != base, c
    assert identity.row_file_name(identity_row(kl_mean=1.0), "x") == base  # measurements are not identity


def test_identity_subsets_are_disjoint_and_the_gate_ignores_only_timing_machine_and_speculation():
    parts = [identity.CONFIG, identity.SCORING, identity.TIMING, identity.MACHINE]
    assert sum(map(len, parts)) == len(set(identity.IDENTITY)) == len(identity.IDENTITY)
    spec = {"spec", "spec_k", "spec_settings", "spec_temperature", "spec_seed"}
    assert set(identity.IDENTITY) - set(identity.DRIFT) == {*identity.TIMING, *identity.MACHINE, *spec}


def test_a_written_row_holds_every_identity_column():
    # the committed baseline was written by tileinfer.jobs.rows.make_row (python -m tileinfer.gate --update-baseline)
    row = pl.read_parquet("evals/baselines/smollm2-135m.parquet").row(0, named=True)
    assert set(identity.IDENTITY) <= set(row)


def test_old_rows_load_under_the_new_column_names(tmp_path):
    old = {
        "model": "m",
        "quant": "bf16",
        "reference": "live:reference/bf16-nosmooth",
        "ppl_ref": 3.0,
        "p_ref_mean": 0.5,
        "kl_mean": 0.0,
    }
    rows.atomic_parquet(pl.DataFrame([old]), tmp_path / "rows" / "old.parquet")
    df = rows.read(tmp_path)
    assert df["base"][0] == old["reference"] and df["ppl_base"][0] == 3.0 and df["p_base_mean"][0] == 0.5
    assert "reference" not in df.columns


def test_registry_is_the_one_shape_table():
    names = registry.shaped_models()
    assert set(names) == set(registry.known_models())  # every shipped model has its shapes
    for name in names:
        cfg = registry.model_config(name)
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim > 0
    assert registry.model_config("qwen3-4b-random", num_hidden_layers=1).num_hidden_layers == 1


def test_registry_config_matches_the_checkpoint_and_a_mismatch_is_refused(smollm2_gguf):
    ck = load_checkpoint(smollm2_gguf, dtype=torch.float32)
    want = registry.model_entry("smollm2-135m")["config"]
    registry.check_checkpoint_config("smollm2-135m", ck.config, want)
    wrong = dataclasses.replace(ck.config, num_key_value_heads=9)
    with pytest.raises(UserError, match="num_key_value_heads 9 .conf/model says 3."):
        registry.check_checkpoint_config("smollm2-135m", wrong, want)


@pytest.mark.parametrize(
    "device,installed,expected",
    [
        ("cpu", ("triton", "cutile"), "reference"),
        ("cuda", ("triton", "cutile"), "triton"),
        ("cuda", ("cutile",), "cutile"),
        ("cuda", (), "reference"),
    ],
)
def test_auto_backend_is_the_fast_path_where_there_is_one(monkeypatch, device, installed, expected):
    def get_backend(name):
        if name not in installed:
            raise UserError(f"backend {name!r} is not available here")

    monkeypatch.setattr(runner, "get_backend", get_backend)
    assert runner.resolve_backend("auto", torch.device(device)) == expected
    assert runner.resolve_backend("cutile", torch.device(device)) == "cutile"  # a named backend is kept
