"""The drift gate: planted kernel faults fail it, a harmless change passes, exit codes and verdicts."""

import subprocess
import sys

import polars as pl
import pytest
import torch
from omegaconf import OmegaConf

from evals import verdicts
from evals.base_logits import TopKLogits
from evals.intervals import row_intervals
from tests import faults
from tests.passes import drift, full_logits
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs.identity import DRIFT
from tileinfer.jobs.schema import GateSettings
from tileinfer.models import Transformer

GATE = OmegaConf.load("conf/gate.yaml").gate
STORED = "evals/base_logits/smollm2-135m/reference-bf16-nosmooth-{}0-ctx1024-n128.topk"
SETS = ("edit", "explain")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    ck = load_checkpoint(smollm2_gguf)
    return Transformer.from_state_dict(ck.config, ck.state_dict)


def kernel_verdicts(model, ops, refs, kv_cache="bf16"):
    """Kernel checks of ``ops`` against one reference per prompt set, judged by the intervals a row gets;
    returns the verdict rows."""
    out = []
    for name, ref in refs.items():
        runner = ModelRunner(model, backend=ops, kv_int8=kv_cache == "int8", max_seq_len=1152)
        stats, result = drift(runner, ref, decode_steps=0)
        per_pos = result.per_position
        stats |= row_intervals(per_pos, torch.zeros(len(per_pos["kl"])), "prompt")
        out += verdicts.kernel_checks(dict(stats, prompt_set=name, dtype="bfloat16", kv_cache=kv_cache), GATE)
    return out


def failed(checks):
    return [(v["prompt_set"], v["metric"]) for v in checks if v["verdict"] == verdicts.FAIL]


@pytest.fixture(scope="module")
def stored():
    return {s: TopKLogits.load(STORED.format(s)) for s in SETS}


@pytest.fixture(scope="module")
def int8_kv_refs(smollm2, stored):
    """Live base logits of the INT8-KV configuration on the stored streams (the scale fault needs them)."""
    runner = ModelRunner(smollm2, kv_int8=True, max_seq_len=1152)
    return {s: full_logits(runner, r.tokens, r.prompt_len) for s, r in stored.items()}


def test_reference_backend_passes_against_its_stored_reference(smollm2, stored):
    assert failed(kernel_verdicts(smollm2, "reference", stored)) == []


def test_harmless_reordering_of_sums_passes(smollm2, stored):
    assert failed(kernel_verdicts(smollm2, faults.reordered_linear_sum(), stored)) == []


@pytest.mark.parametrize("fault", ["rope_key_off_by_one", "bf16_gemm_accumulator", "dropped_last_page"])
def test_planted_faults_fail_the_gate(smollm2, stored, fault):
    assert failed(kernel_verdicts(smollm2, getattr(faults, fault)(), stored))


def test_wrong_kv_scale_on_one_head_fails_the_gate(smollm2, int8_kv_refs):
    # 8% on one KV head of three: the smallest value-scale fault caught with the INT8-cache bounds
    assert failed(kernel_verdicts(smollm2, faults.wrong_value_scale(1.08), int8_kv_refs, kv_cache="int8"))
    assert not failed(kernel_verdicts(smollm2, faults.wrong_value_scale(1.0), int8_kv_refs, kv_cache="int8"))


def row(**kw):
    base = dict(
        model="m",
        model_sha256="s",
        quant="int8_both",
        weights="int8",
        kv_cache="int8",
        smooth_keys=True,
        smooth_alpha=0.5,
        calibration_tokens=2048,
        dtype="bfloat16",
        backend="reference",
        spec="none",
        spec_k=None,
        spec_settings=None,
        spec_temperature=None,
        spec_seed=None,
        calibration_sha256="c",
        ctx="1k",
        ctx_tokens=1024,
        prompt_set="edit",
        prompts_sha256="p",
        corpus=None,
        n_windows=None,
        add_bos=None,
        n_score=128,
        base="stored:reference/bf16-nosmooth",
        top_k=64,
        page_size=64,
        prefill_chunk=512,
        n_scored=128,
        kl_mean=3.8e-3,
        kl_p999=3.7e-2,
        top1_agree=0.97,
        kernel=False,
    )
    return base | kw


@pytest.mark.parametrize(
    "value,lo,hi,bound,higher_is_better,verdict",
    [
        (0.9e-3, 0.5e-3, 1.5e-3, 1e-3, False, verdicts.PASS),  # estimate within the bound
        (1.1e-3, 0.8e-3, 1.5e-3, 1e-3, False, verdicts.NOISE),  # beyond it, but the interval reaches it
        (1.1e-3, 1e-3, 1.5e-3, 1e-3, False, verdicts.NOISE),  # the interval touches it: not shown worse
        (1.2e-3, 1.0001e-3, 1.5e-3, 1e-3, False, verdicts.FAIL),  # the whole interval beyond it
        (0.97, 0.95, 0.99, 0.98, True, verdicts.NOISE),
        (0.97, 0.95, 0.98, 0.98, True, verdicts.NOISE),
        (0.97, 0.95, 0.9799, 0.98, True, verdicts.FAIL),
        (0.985, 0.95, 0.99, 0.98, True, verdicts.PASS),
    ],
)
def test_a_check_fails_only_when_its_interval_lies_beyond_the_bound(value, lo, hi, bound, higher_is_better, verdict):
    assert verdicts.judge(value, lo, hi, bound, higher_is_better) == verdict


def test_kernel_checks_use_the_row_intervals_and_skip_p999_on_few_positions():
    r = row(kernel=True, kv_cache="bf16", kl_mean=1.2e-3, kl_mean_lo=0.9e-3, kl_mean_hi=1.6e-3, kl_p999=0.5)
    r |= dict(top1_agree=0.965, top1_agree_lo=0.95, top1_agree_hi=0.975)
    checks = {v["metric"]: v for v in verdicts.kernel_checks(r, GATE)}
    assert checks["kl_mean"]["verdict"] == verdicts.NOISE and checks["kl_mean"]["lo"] == 0.9e-3
    assert checks["top1_agree"]["verdict"] == verdicts.NOISE
    assert checks["kl_p999"]["verdict"] == verdicts.SKIP  # 128 positions: the 99.9% point is the maximum
    many = {v["metric"]: v["verdict"] for v in verdicts.kernel_checks(r | dict(n_scored=GATE.p999_min_positions), GATE)}
    assert many["kl_p999"] == verdicts.FAIL  # no interval columns: judged by the point estimate
    worse = verdicts.kernel_checks(r | dict(kl_mean_lo=1.01e-3), GATE)
    assert [v["verdict"] for v in worse if v["metric"] == "kl_mean"] == [verdicts.FAIL]


def test_baseline_checks_and_verdict_table():
    baseline = pl.DataFrame([row()])
    ok = verdicts.evaluate(pl.DataFrame([row(kl_mean=4.0e-3)]), baseline, GATE, DRIFT)
    assert (
        list(ok["verdict"]) == [verdicts.PASS, verdicts.SKIP, verdicts.PASS] and list(ok["check"]) == ["baseline"] * 3
    )
    worse = verdicts.evaluate(pl.DataFrame([row(kl_mean=5.0e-3, top1_agree=0.95)]), baseline, GATE, DRIFT)
    bad = worse.filter(pl.col("verdict") == verdicts.FAIL)
    assert sorted(bad["metric"]) == ["kl_mean", "top1_agree"]
    assert bad.filter(pl.col("metric") == "kl_mean")["bound"][0] == pytest.approx(3.8e-3 * 1.1 + 5e-4)
    missing = verdicts.evaluate(pl.DataFrame([row(quant="int8_kv")]), baseline, GATE, DRIFT)
    assert missing["metric"].to_list() == ["row present"] and missing["verdict"][0] == verdicts.FAIL


def run_gate(*args, flags=()):
    cmd = [
        sys.executable,
        "-m",
        "tileinfer.gate",
        *flags,  # Hydra's flags (-m) come before the overrides
        "model=smollm2-135m",
        "ctx=1k",
        "eval.n_score=128",
        "base.source=stored",
        "speed.decode_tokens=4",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_cli_exit_codes(tmp_path, smollm2_gguf):
    runs = f"runs_dir={tmp_path}"
    ok = run_gate("quant=bf16", runs)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "gate: PASS" in ok.stdout
    # a baseline bound tightened below today's numbers must fail, and say what moved
    bad = run_gate("quant=int8_both", "gate.max_increase=-0.5", runs)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout and "kl_mean" in bad.stdout
    assert run_gate("quant=no_such_quant", runs).returncode == 2
    assert run_gate("base.source=nowhere", runs).returncode == 2
    bad_bound = run_gate("gate.bounds.bfloat16.kl_mean=abc", runs)
    assert bad_bound.returncode == 2 and "Traceback" not in bad_bound.stderr, bad_bound.stderr
    renamed = run_gate("reference.source=stored", runs)  # the old name of base.source
    assert renamed.returncode == 2 and "write base.source=stored" in renamed.stderr, renamed.stderr
    other_k = run_gate("quant=bf16", "base.top_k=32", runs)  # the stored files keep the top 64
    assert other_k.returncode == 2 and "set base.top_k=64" in other_k.stderr, other_k.stderr


def test_a_multirun_fails_when_any_job_fails(tmp_path, smollm2_gguf):
    # bound = baseline * (1 + max_increase) + floor = 1e-3 (the BF16 kernel bound): BF16 passes (KL 0
    # against the stored BF16 base on the CPU that recorded it, 4.2e-4 on an AVX2-only one: torch's
    # bf16 matmul differs by instruction set), INT8 (3.6e-3) fails
    tight = ["gate.max_increase=-1", "gate.floor.kl_mean=1e-3", "gate.floor.kl_p999=0", f"runs_dir={tmp_path}"]
    out = run_gate("quant=bf16,int8_both", *tight, flags=["-m"])
    assert "gate: PASS" in out.stdout and "gate: FAIL" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1


@pytest.mark.parametrize(
    "key,value",
    [
        ("bounds.bfloat16.kl_mean", "abc"),
        ("bounds.float32.top1_agree", 2),
        ("max_increase", "abc"),
        ("max_top1_drop", -0.1),
        ("floor", None),
        ("floor.kl_p999", "x"),
        ("bounds", {}),
    ],
)
def test_bad_gate_settings_are_usage_errors(key, value):
    g = OmegaConf.load("conf/gate.yaml").gate
    OmegaConf.update(g, key, value, force_add=True, merge=False)
    with pytest.raises(UserError, match="gate."):
        GateSettings(**OmegaConf.to_container(g))
    GateSettings(**OmegaConf.to_container(OmegaConf.load("conf/gate.yaml").gate))  # the shipped settings are valid


def test_update_baseline_writes_only_when_asked(tmp_path, smollm2_gguf):
    base = tmp_path / "base.parquet"
    args = ("quant=bf16", f"runs_dir={tmp_path}", f"gate.baseline={base}")
    first = run_gate(*args)
    assert first.returncode == 2 and "no baseline table" in first.stderr and not base.exists()
    assert run_gate(*args, "--update-baseline").returncode == 0 and base.exists()
    assert run_gate(*args).returncode == 0
    # a configuration the baseline has no row of fails, and says how to record one
    other = ("quant=int8_both", f"runs_dir={tmp_path}", f"gate.baseline={base}")
    missing_row = run_gate(*other)
    assert missing_row.returncode == 1 and "row present" in missing_row.stdout
    # its row joins the bf16 one (smooth_alpha null there, a number here); the bf16 row stays
    assert run_gate(*other, "--update-baseline").returncode == 0
    assert pl.read_parquet(base)["quant"].sort().to_list() == ["bf16", "bf16", "int8_both", "int8_both"]
    base.write_bytes(b"not parquet")
    assert run_gate(*args).returncode == 2
    # kernel checks only, but the candidate's quant config is not the base's
    mixed = run_gate("quant=int8_both", "gate.baseline=null", f"runs_dir={tmp_path}")
    assert mixed.returncode == 2 and "base.quant=same" in mixed.stderr
