"""The peers of ``python -m benchmarks.peers`` compute this engine's model: logits on a tiny Qwen3
(qwen3-0.6b's config shrunk) in float32 against the reference backend, nothing compiled."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.peers import gptfast, hf
from benchmarks.peers.bench import add_ratios, main
from quantize import QuantScheme, apply
from tests.tiny_models import COMMON
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.registry import model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer
from tileinfer.ops.reference import quantize_int8

SHRINK = COMMON | dict(head_dim=16, eos_token_id=1)  # tie_word_embeddings: set per case below
PROMPT, DECODE = 40, 6


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request):
    hf_config = model_entry("qwen3-0.6b-random")["config"] | SHRINK | dict(tie_word_embeddings=request.param)
    sd = random_state_dict(hf_config, seed=0, dtype=torch.float32)
    ids = torch.randint(0, SHRINK["vocab_size"], (PROMPT + DECODE,), generator=torch.Generator().manual_seed(1))
    return hf_config, ModelConfig.from_hf(hf_config), sd, ids


def engine_logits(config, sd, ids) -> torch.Tensor:
    """This engine's float32 logits [len(ids) - PROMPT + 1, vocab]: the prompt's last, then each decode step's."""
    runner = ModelRunner(Transformer.from_state_dict(config, sd, dtype=torch.float32), page_size=16, prefill_chunk=16)
    seq = runner.new_sequence()
    rows = [runner.prefill(seq, ids[:PROMPT])]
    rows += [runner.decode(seq, int(t)) for t in ids[PROMPT:]]
    return torch.stack(rows)


@pytest.mark.parametrize("quant", ["bf16", "int8_weights"])
def test_gptfast_decoder_matches_engine(tiny, quant):
    _, config, sd, ids = tiny
    if quant == "int8_weights":  # the same INT8 values and scales in both
        sd = apply(sd, config, QuantScheme("int8", "bf16", smooth_keys=False))[0]
    ref = engine_logits(config, sd, ids)
    model = gptfast.Decoder.from_state_dict(config, sd, dtype=torch.float32)
    if quant == "int8_weights":
        assert isinstance(model.output, gptfast.WeightOnlyInt8Linear)
    model.setup_caches(PROMPT + DECODE)
    with torch.no_grad():
        rows = [gptfast.prefill(model, ids[:PROMPT], chunk=16)]  # three chunks
        step = gptfast.decode_step(compile=False)
        for i in range(PROMPT, PROMPT + DECODE):
            pos = torch.tensor([i])
            rows.append(model(ids[i].view(1, 1), pos)[0, -1])
            assert step(model, ids[i].view(1, 1), pos).item() == rows[-1].argmax().item()
    got = torch.stack(rows).float()
    # measured: 1.2e-7 tied, 3.3e-7 untied (bf16 and int8 alike), relative to the largest logit
    assert rel_err(got, ref) < 1e-5


def test_int8_linear_is_linear_on_dequantized_weights():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(3, 64, generator=g)
    q, scale = quantize_int8(w)
    got = gptfast.WeightOnlyInt8Linear(q, scale)(x)
    want = F.linear(x, q.float() * scale[:, None])
    assert rel_err(got, want) < 1e-6  # measured: 2.2e-7


def test_hf_model_matches_engine(tiny):
    hf_config, config, sd, ids = tiny
    model = hf.hf_model(hf_config, sd, dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    with torch.no_grad():
        got = model(ids[None]).logits[0, PROMPT - 1 :].float()
    # measured: 1.9e-7 tied, 4.1e-7 untied, relative to the largest logit
    assert rel_err(got, engine_logits(config, sd, ids)) < 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_hf_decode_seconds_times_the_steps(tiny, static):
    hf_config, _, sd, ids = tiny
    model = hf.hf_model(hf_config, sd, dtype=torch.float32)
    dt, setup = hf.decode_seconds(model, ids[:PROMPT], steps=3, warm=2, static=static)
    assert dt > 0 and setup > 0


def test_ratio_is_ours_over_the_fastest_peer():
    def row(peer, tok_s, ctx=1024):
        return dict(model="m", ctx=ctx, quant="bf16", peer=peer, tok_s=tok_s, ours_vs_best_peer=None)

    rows = [row("tileinfer-triton", 300.0), row("gptfast", 100.0), row("hf_eager", None), row("hf_static", 150.0)]
    rows += [row("tileinfer-triton", 200.0, ctx=32768), row("gptfast", None, ctx=32768)]
    add_ratios(rows)
    assert [r["ours_vs_best_peer"] for r in rows] == [2.0, None, None, None, None, None]


def test_refuses_unknown_peers_and_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        main(["--peers", "vllm"])
    if not torch.cuda.is_available():
        assert main([]) == 2
