"""Speculative decoding in the sweep: rows with acceptance, speed-up and exactness; the gate's check;
bad settings refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from evals import speculation, verdicts
from evals.drift import PassResult, SpecResult
from tests.tiny_models import make_tiny_with_tokenizer
from tileinfer.core.errors import UserError
from tileinfer.engine.proposers import check_same_vocab
from tileinfer.jobs import identity, job, plan, schema
from tileinfer.jobs.worker import Worker

schema.register()
WORKER = Worker()  # the loaded models, kept for the next job as a sweep's process keeps them
GATE = OmegaConf.load("conf/gate.yaml").gate
SMALL = [
    "model=smollm2-135m",
    "quant=bf16",
    "ctx.tokens=192",
    "eval.n_score=24",
    "speed.decode_tokens=40",
    f"eval.prompt_sets=[{Path(__file__).resolve().parents[1] / 'evals/data/stdlib/statistics.py.txt'}]",
    "speed.warmup=false",
]


def load(*overrides):
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        return schema.load(compose("config", list(overrides)))


def one_row(tmp_path, *overrides) -> dict:
    cfg = load(*SMALL, f"runs_dir={tmp_path}", *overrides)
    (path,) = job.run(plan.resolve(cfg, WORKER), WORKER).paths
    return pl.read_parquet(path).row(0, named=True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["spec=ngram", "spec.min_n=2", "spec.max_n=4", "dtype=float32"],
        ["spec=draft", "spec.draft_model=smollm2-135m", "spec.draft_quant=int8_weights", "spec.k=4", "dtype=float32"],
        ["spec=ngram", "spec.min_n=2", "spec.max_n=4"],
    ],
    ids=["ngram-float32", "draft-float32", "ngram-bfloat16"],
)
def test_a_speculative_row_has_acceptance_speedup_and_is_exact(tmp_path, smollm2_gguf, overrides):
    """In float32 the speculative reply equals the plain one token for token. In BF16 a verify step
    rounds differently from a decode step: the reply may part at a near-tie (measured: step 17 of 40,
    top-1/top-2 margin 0.018 logits), which the gate accepts within gate.spec_tie_margin."""
    r = one_row(tmp_path, *overrides)
    assert r["spec"] == overrides[0].split("=")[1] and r["spec_k"] == load(*overrides).spec.k
    if "dtype=float32" in overrides:
        assert r["spec_exact"] is True and r["spec_first_mismatch"] is None
    else:
        assert r["spec_exact"] or r["spec_mismatch_margin"] <= verdicts.tie_margin("bfloat16")
    assert r["spec_drafts"] > 0 and 0 < r["spec_accepted_tokens"] <= r["spec_drafted_tokens"]
    assert r["spec_acceptance_rate"] == pytest.approx(r["spec_accepted_tokens"] / r["spec_drafted_tokens"])
    assert r["spec_acceptance_length"] == pytest.approx(1 + r["spec_accepted_tokens"] / r["spec_drafts"])
    assert len(r["spec_acceptance_at"]) == r["spec_k"] and len(r["spec_histogram"]) == r["spec_k"] + 1
    assert sum(r["spec_histogram"]) == r["spec_drafts"]
    assert r["spec_decode_tok_s"] > 0 and r["spec_speedup"] == pytest.approx(
        r["spec_decode_tok_s"] / r["decode_tok_s"], rel=1e-6
    )
    if overrides[0] == "spec=draft":  # the model drafting for itself (INT8 weights): nearly all accepted
        assert r["spec_acceptance_rate"] > 0.7 and "draft=smollm2-135m@" in r["spec_settings"]
    plain = one_row(tmp_path)  # the same job without speculation: another row, no spec columns
    assert plain["spec"] == "none" and plain["spec_k"] is None and plain["spec_exact"] is None


def test_the_gate_fails_a_wide_margin_mismatch_only():
    base = dict(prompt_set="edit", dtype="bfloat16", spec_exact=True, spec_mismatch_margin=None)
    (ok,) = verdicts.spec_checks(base, GATE)
    assert ok["verdict"] == verdicts.PASS and ok["candidate"] == 0.0
    tie = verdicts.spec_checks(
        base | dict(spec_exact=False, spec_mismatch_margin=verdicts.tie_margin("bfloat16")), GATE
    )
    assert tie[0]["verdict"] == verdicts.PASS  # on the bound: a near-tie
    wide = verdicts.spec_checks(base | dict(spec_exact=False, spec_mismatch_margin=2.5), GATE)
    assert wide[0]["verdict"] == verdicts.FAIL
    f32 = verdicts.spec_checks(base | dict(dtype="float32", spec_exact=False, spec_mismatch_margin=0.5), GATE)
    assert f32[0]["verdict"] == verdicts.FAIL  # float32 rounds a thousand times finer
    assert verdicts.spec_checks(dict(prompt_set="edit"), GATE) == []  # rows without speculation
    assert verdicts.spec_checks(base | dict(spec_exact=None), GATE) == []  # sampled: no exactness check


def test_a_speculative_row_is_checked_against_the_plain_baseline_row(tmp_path):
    """Speculation runs only in the speed pass, so the drift baseline of a spec row is the plain row of
    its configuration (it used to find none: "row present" failed); its own check is evaluated too."""
    plain = one_row(tmp_path)
    spec_row = plain | dict(spec="ngram", spec_k=7, spec_settings="min_n=5,max_n=5", spec_exact=False)
    spec_row |= dict(spec_mismatch_margin=2.5)
    base, stand_in = verdicts.baseline_row(spec_row, pl.DataFrame([plain]), identity.DRIFT)
    assert base is not None and base["spec"] == "none" and not stand_in
    checks = verdicts.evaluate(pl.DataFrame([spec_row | {"kernel": False}]), None, GATE, identity.DRIFT)
    assert checks.filter(pl.col("check") == "spec")["verdict"].to_list() == [verdicts.FAIL]


def test_a_negative_tie_margin_is_refused():
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        cfg = compose("gate", ["gate.spec_tie_margin.bfloat16=-1"])
    with pytest.raises(UserError, match="gate.spec_tie_margin.bfloat16=-1"):
        schema.load(cfg)


def test_the_gate_keeps_the_speculative_check_without_a_baseline_table(tmp_path, smollm2_gguf):
    """gate.baseline=null (a fast backend against the reference, before any baseline) still checks the
    speculative reply; it used to print the kernel checks only."""
    args = [*SMALL, "spec=ngram", "spec.min_n=2", "spec.max_n=4", "gate.baseline=null", "base.quant=same"]
    out = subprocess.run(
        [sys.executable, "-m", "tileinfer.gate", *args, f"runs_dir={tmp_path}"], capture_output=True, text=True
    )
    spec_lines = [line for line in out.stdout.splitlines() if "mismatch margin" in line]
    assert out.returncode == 0 and len(spec_lines) == 1 and "PASS" in spec_lines[0], out.stdout + out.stderr


def test_the_widest_mismatch_of_any_prompt_reaches_the_row():
    """Each prompt's first divergence is its own event: a wide one in a later prompt is not hidden
    behind a near-tie in an earlier one."""

    def one(margin, step):
        return dict(stats=None, spec_s=1.0, plain_s=1.0, steps=4, exact=False, mismatch=step, margin=margin)

    stats = SimpleNamespace(
        k=1, drafts=1, drafted_tokens=1, accepted_tokens=1, target_forwards=1, new_tokens=2,
        drafted_at=[1], accepted_at=[1], histogram=[0, 1], draft_s=0.0, verify_s=0.0,
    )  # fmt: skip
    passes = [one(0.01, 5) | {"stats": stats}, one(25.0, 2) | {"stats": stats}]
    cols = speculation.columns(passes)
    assert cols["spec_mismatch_margin"] == 25.0 and cols["spec_first_mismatch"] == 2
    (check,) = verdicts.spec_checks(dict(prompt_set="p", dtype="bfloat16", **cols), GATE)
    assert check["verdict"] == verdicts.FAIL


def test_every_spec_setting_is_in_the_row_identity():
    def cols(*overrides):
        return load(*overrides).spec.identity("abc")

    assert set(cols()) <= set(identity.CONFIG)
    assert cols() == dict(spec="none", spec_k=None, spec_settings=None, spec_temperature=None, spec_seed=None)
    greedy = cols("spec=ngram")
    assert greedy["spec_k"] == 7 and greedy["spec_settings"] == "min_n=5,max_n=5" and greedy["spec_seed"] is None
    assert cols("spec=ngram", "spec.seed=3") == greedy  # greedy verification draws nothing
    a, b = cols("spec=ngram", "spec.temperature=0.8"), cols("spec=ngram", "spec.temperature=0.8", "spec.seed=1")
    assert a != b and (a["spec_seed"], b["spec_seed"]) == (0, 1)
    assert cols("spec=ngram", "spec.min_n=3") != greedy and cols("spec=ngram", "spec.k=3") != greedy


def test_pass_columns_find_the_first_mismatch_and_its_margin():
    stats = SimpleNamespace(
        k=2, drafts=1, drafted_tokens=2, accepted_tokens=1, target_forwards=3, new_tokens=4,
        drafted_at=[1, 1], accepted_at=[1, 0], histogram=[0, 1, 0], draft_s=0.001, verify_s=0.002,
    )  # fmt: skip
    t = PassResult(
        per_position={},
        prefill_s=0.1,
        decode_rep_s=[1.0],
        decode_steps=4,
        decoded=[5, 6, 7, 8],
        margins=[3.0, 2.0, 0.04, 1.0],
        spec=SpecResult(SimpleNamespace(tokens=[5, 6, 9, 8], stats=stats), 0.5),
    )
    cols = speculation.columns([speculation.pass_columns(t, greedy=True)])
    assert cols["spec_exact"] is False and cols["spec_first_mismatch"] == 2
    assert cols["spec_mismatch_margin"] == 0.04 and cols["spec_speedup"] == 2.0
    assert cols["spec_acceptance_at"] == [1.0, 0.0] and cols["spec_tokens_per_forward"] == pytest.approx(4 / 3)
    assert speculation.columns(None) == dict.fromkeys(speculation.COLUMNS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["spec=none", "spec.k=3"], "spec.k is a setting of spec=ngram/draft/dflash, not of spec=none"),
        (["spec=ngram", "spec.draft_model=smollm2-135m"], "spec.draft_model is a setting of spec=draft, not of"),
        (["spec=draft", "spec.draft_model=smollm2-135m", "spec.min_n=2"], "spec.min_n is a setting of spec=ngram"),
        (
            ["spec=dflash", "spec.dflash=z-lab/x", "spec.draft_quant=bf16"],
            "spec.draft_quant is a setting of spec=draft",
        ),
        (["spec=none", "spec.temperature=0.5"], "spec=none decodes greedily"),
        (["spec=dflash", "spec.dflash=/nonexistent/drafter"], "/nonexistent/drafter does not exist"),
        (["spec=draft", "spec.draft_model=./no/such/model"], "no/such/model does not exist"),
    ],
)
def test_a_setting_of_another_proposer_is_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load(*overrides)


def test_a_proposer_gets_its_defaults():
    assert (load("spec=ngram").spec.k, load("spec=ngram").spec.min_n) == (7, 5)
    assert (load("spec=dflash", "spec.dflash=z-lab/x").spec.k, load("spec=none").spec.k) == (15, None)
    assert load("spec=draft", "spec.draft_model=m").spec.draft_quant == "bf16"


def test_a_draft_with_another_vocabulary_is_refused():
    def tok(vocab):
        return SimpleNamespace(backend=SimpleNamespace(get_vocab=lambda with_added_tokens: vocab))

    check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 0, "b": 1}), 2, 4)
    with pytest.raises(UserError, match="'b' is id 1 in the target's and None in the draft's"):
        check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 0, "c": 1}), 2, 4)
    with pytest.raises(UserError, match="'a' is id 0 in the target's and 1 in the draft's"):
        check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 1, "b": 0}), 2, 4)
    with pytest.raises(UserError, match="has 1 logits"):
        check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 0, "b": 1}), 1, 4)
    with pytest.raises(UserError, match="has 8 logits"):  # padded ids the target could not embed
        check_same_vocab(tok({"a": 0, "b": 1}), tok({"a": 0, "b": 1}), 8, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["spec=draft"], "spec=draft needs spec.draft_model"),
        (["spec=dflash"], "spec=dflash needs spec.dflash"),
        (["spec=ngram", "spec.min_n=4", "spec.max_n=2"], "spec.max_n=2 is below spec.min_n=4"),
        (["spec=ngram", "spec.k=0"], "spec.k"),
    ],
)
def test_bad_spec_settings_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load(*overrides)


def sweep(*args):
    return subprocess.run([sys.executable, "-m", "tileinfer.sweep", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory):
    """A tiny draft checkpoint whose 96-character tokenizer is not smollm2's."""
    return make_tiny_with_tokenizer("llama", tmp_path_factory.mktemp("draft"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["spec=eagle"], "spec"),
        (["spec=ngram", "spec.k=0"], "spec.k=0"),
        (["spec=ngram", "spec.k=100000"], "spec.k=100000 drafts do not fit"),
        (["spec=dflash"], "spec.dflash"),
        (["spec=dflash", "spec.dflash=/nonexistent/drafter"], "does not exist"),
        (["spec=draft", "spec.draft_model=no-such-model"], "unknown model 'no-such-model'"),
        (["spec=draft", "spec.draft_model={other}"], "tokenizer"),
    ],
)
def test_bad_spec_input_is_one_line_and_exits_2(tmp_path, smollm2_gguf, other_tokenizer_draft, args, message):
    out = sweep(*SMALL, f"runs_dir={tmp_path}", *[a.format(other=other_tokenizer_draft) for a in args])
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if "error" in line.lower()]) == 1
