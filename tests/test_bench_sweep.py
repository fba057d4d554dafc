"""benchmarks.ops --sweep: a config whose output differs from the reference backend's is never timed
or chosen (a Triton swap-AB tile once left NaN while timing fastest:
results/h200-2026-12-01-int8-prefill-gemm.md); configs reach the ops as arguments, and the winners
as a tuning."""

import math

import torch

from benchmarks.ops import output_error, sweep_families, sweep_winners, tuned
from tileinfer.ops.triton.tuning import TUNING, DecodeTile, GemvTile, RowMode


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


def test_configs_are_passed_as_op_arguments_and_winners_installed_as_a_tuning():
    """A GEMV config is the call's typed ``tile``; a decode-tile config a tuning with it; the winners
    go into a tuning: each shape's GEMV winner beside the shipped entries, the decode tile for all."""
    fams = {f.name: f for f in sweep_families()}
    gemv, decode = fams["gemv1 int8"], fams["decode attn tile"]
    assert gemv.keywords((8, 512, 4, 1, 4), TUNING) == {"tile": GemvTile(8, 512, 4, 1, RowMode.UNIT)}
    assert decode.keywords((128, 4, 3), TUNING)["tuning"].decode_tile == DecodeTile(128, 4, 3)
    winners = {
        "gemv1 int8": dict(family=gemv, config=(8, 512, 4, 1, 4), by_key={(2560, 9728): (16, 512, 4, 3, 4)}),
        "decode attn tile": dict(family=decode, config=(128, 4, 1), by_key={}),
    }
    t = tuned(TUNING, winners, "triton")
    assert t.gemv1_int8_shapes[(2560, 9728)] == GemvTile(16, 512, 4, 3, RowMode.UNIT)
    assert set(t.gemv1_int8_shapes) == set(TUNING.gemv1_int8_shapes) | {(2560, 9728)}
    assert t.decode_tile == t.decode_tile_int8_long == DecodeTile(128, 4, 1)
    assert tuned(TUNING, winners, "cutile") == TUNING
