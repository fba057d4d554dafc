"""bench.ops --sweep: a config whose output differs from the reference backend's is never timed or
chosen (a Triton swap-AB tile once left NaN while timing fastest: results/h200-2026-12-01-int8-prefill-gemm.md)."""

import math

import torch

from benchmarks.ops import output_error, sweep_families, sweep_winners


def test_output_error_flags_non_finite_and_far_outputs_only():
    want = torch.randn(64, 96).to(torch.bfloat16)
    assert output_error(want.clone(), want) == ""
    nan = want.clone()
    nan[3, 5] = float("nan")
    nan[7, 1] = float("inf")
    assert output_error(nan, want) == "2 non-finite elements"
    # one bf16 step on every element is within the bound; 3% off is not
    assert output_error((want.float() * (1 + 2**-8)).to(torch.bfloat16), want) == ""
    assert output_error((want.float() * 1.03).to(torch.bfloat16), want).startswith("relative error 3.0e-02")
    logits = torch.randn(4, 1000)
    assert output_error(logits * (1 + 1e-3), logits).startswith("relative error 1.0e-03")  # float32 logits: tighter
    assert output_error(logits * (1 + 1e-6), logits) == ""
    tokens = torch.tensor([1, 2, 3])
    assert output_error(tokens, tokens + 1) == ""  # sampled ids: not comparable


def _row(config, us, wrong="", shape="down 1x9728->2560"):
    return dict(
        family="gemv1 int8", config=str(config), cfg_key="None", us=us, wrong=wrong,
        model="qwen3-4b-random", shape=shape, variant="int8w",
    )  # fmt: skip


def test_a_wrong_config_never_wins_though_fastest():
    fam = next(f for f in sweep_families() if f.name == "gemv1 int8")
    cfgs = fam.configs
    rows = [_row(c, 10.0 + i, shape=s) for s in ("a", "b") for i, c in enumerate(cfgs)]
    rows[0] = _row(cfgs[0], math.nan, "5 non-finite elements", shape="a")  # fastest everywhere else
    rows[len(cfgs)]["us"] = 1.0  # config 0 on shape b: right and fastest, still out
    best = sweep_winners(rows)["gemv1 int8"]
    assert str(cfgs[0]) not in best["score"]
    assert best["config"] == cfgs[1]
    assert set(best["per_shape"].values()) == {str(cfgs[1])}
