"""The speculative step-cost benchmark on the CPU: tiny shapes over the registered Qwen3 configs, the
reference backend (no GPU): the synthetic-acceptance model, the forced full-acceptance run against
plain greedy decoding, and the table the command writes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.spec import (
    SMOKE,
    Plan,
    bench_model,
    build,
    forced_len,
    forced_run,
    greedy,
    main,
    synthetic,
    weights,
)
from tileinfer.engine.generation import generate
from tileinfer.engine.runner import ModelRunner

PLAN = Plan(
    backends=("reference",),
    contexts=(24,),
    ks=(2, 5),
    reps=2,
    warmup=1,
    forced_tokens=12,
    overrides=SMOKE,
    device="cpu",
)


def test_synthetic_acceptance_model():
    curve = synthetic(decode_ms=10.0, verify_ms=12.0, proposer_ms=3.0, k=3)
    assert [c["L"] for c in curve] == [1, 2, 3, 4]
    assert curve[-1]["tok_s"] == pytest.approx(4 / 15 * 1000)  # L / (verify + proposer) ms
    assert curve[-1]["speedup"] == pytest.approx(4 * 10 / 15)  # over plain decoding's 1000 / 10 ms
    assert curve[0]["speedup"] < 1  # one token per round costs more than a decode step


def test_forced_len_is_whole_rounds():
    assert [forced_len(k, 64) for k in (2, 7, 15)] == [63, 64, 64]
    assert forced_len(15, 8) == 16


@pytest.mark.parametrize("quant", ["bf16", "int8_both"])
@pytest.mark.parametrize("k", [2, 5])
def test_forced_run_equals_plain_greedy(quant, k):
    config, sd = weights("qwen3-4b-random", PLAN)
    model = build(config, sd, quant, PLAN)
    prompt = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    n = forced_len(k, 12)
    runner = ModelRunner(model, "reference", kv_int8=quant == "int8_both", max_seq_len=64)
    expected = generate(runner, prompt, n + 1).tokens
    seq = runner.new_sequence()
    plain, _ = greedy(runner, seq, runner.prefill(seq, prompt), n + 1)
    assert plain == expected and seq.length == len(prompt)
    got, stats, secs = forced_run(runner, seq, prompt, plain, k, n)
    assert got == expected and seq.length == len(prompt) and secs > 0
    assert stats.acceptance_length == k + 1 and stats.drafts == n // (k + 1)  # every draft accepted


def test_bench_model_rows():
    rows = bench_model("qwen3-4b-random", PLAN, log=lambda *_: None)
    assert [(r["quant"], r["ctx"], r["k"]) for r in rows] == [(q, 24, k) for q in ("bf16", "int8_both") for k in (2, 5)]
    for r in rows:
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["verify/decode"] > 0 and r["ngram_ms"] > 0
        assert r["forced_match"] and r["forced_L"] == r["k"] + 1 and r["forced_tok_s"] > 0
        assert r["forced/model"] > 0 and r["proposer"] == "ngram" and "draft_ms" not in r
        assert r["tok_s_full"] == pytest.approx((r["k"] + 1) * 1000 / (r["verify_ms"] + r["ngram_ms"]), rel=1e-2)
        assert (r["tok_s_L4"] is None) == (r["k"] < 3) and r["tok_s_L2"] > 0


def test_cli_writes_the_table(tmp_path, capsys):
    args = ["--cpu-smoke", "--ctx", "16,32", "--k", "2,7", "--reps", "2", "--warmup", "1", "--forced-tokens", "8"]
    assert main([*args, "--draft-model", "qwen3-0.6b-random", "--out", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("cpu-*-spec-steps.md")
    (pq,) = tmp_path.glob("cpu-*-spec-steps.parquet")
    assert md.stem == pq.stem and md.read_text().startswith("`python -m benchmarks.spec --cpu-smoke")
    import pyarrow.parquet as parquet

    rows = parquet.read_table(pq).to_pylist()
    assert [(r["quant"], r["backend"], r["ctx"], r["k"]) for r in rows] == [
        (q, "reference", c, k) for q in ("bf16", "int8_both") for c in (16, 32) for k in (2, 7)
    ]
    want = {"model", "quant", "backend", "ctx", "k", "decode_ms", "verify_ms", "verify/decode", "ngram_ms"}
    want |= {"draft_ms", "forced_tok_s", "forced_match"}
    want |= {f"{m}_{at}" for m in ("tok_s", "speedup") for at in ("L2", "L4", "L5", "full")}
    assert want <= set(rows[0])
    for r in rows:
        assert r["model"] == "qwen3-4b-random" and r["proposer"] == "qwen3-0.6b-random"
        assert min(r["verify/decode"], r["draft_ms"], r["speedup_full"], r["forced_tok_s"]) > 0
        assert r["forced_match"] and r["forced_L"] == r["k"] + 1
    assert "| qwen3-4b-random | int8_both | reference | 32 | 7 |" in capsys.readouterr().out


def test_cli_refuses_a_gpu_backend_without_cuda(capsys):
    assert main(["--cpu-smoke", "--backends", "triton"]) == 2
    assert "only --backends reference" in capsys.readouterr().err
