"""Speculative decoding on the fast backends (GPU): verify steps replayed from CUDA graphs give the
eager step's logits, and greedy speculative replies match plain greedy decoding (or part at a
near-tie, as a verify step rounds differently from a decode step in BF16)."""

import pytest
import torch

from quantize import QuantScheme, apply
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.registry import model_entry
from tileinfer.engine.generation import generate
from tileinfer.engine.proposers import DraftModelProposer, NgramProposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import speculative_decode
from tileinfer.jobs import schema
from tileinfer.models import Transformer

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MODEL = model_entry("qwen3-0.6b-random")["config"]


@pytest.fixture(scope="module")
def checkpoint():
    sd = random_state_dict(MODEL, seed=0, device="cuda")
    return Checkpoint(None, ModelConfig.from_hf(MODEL), MODEL, sd)


def model_of(checkpoint, quant):
    sd = checkpoint.state_dict
    if quant == "int8_both":
        sd = apply(checkpoint, None, QuantScheme("int8", "int8", smooth_keys=False))[0]
    return Transformer.from_state_dict(checkpoint.config, sd, device="cuda")


@pytest.mark.parametrize("quant", ["bf16", "int8_both"])
@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_verify_graph_equals_the_eager_step(checkpoint, backend, quant):
    """Graphs of 2, 8 and 16 tokens, replayed at two positions across a page boundary, against the
    eager step on the same cache."""
    model = model_of(checkpoint, quant)
    runner = ModelRunner(model, backend, kv_int8=quant == "int8_both", max_seq_len=512, cuda_graph=True)
    assert runner.cuda_graph
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, MODEL["vocab_size"], (300,), generator=g).tolist()
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:120])
    for T in (2, 8, 16):
        for start in (120, 60):  # 120..136 crosses the page boundary at 128
            seq.truncate(start)
            if seq.length < start:
                runner.prefill(seq, tokens[seq.length : start])
            eager = runner.step(seq, torch.tensor(tokens[start : start + T]))
            seq.truncate(start)
            graph = runner.verify(seq, tokens[start : start + T])
            assert seq.length == start + T
            torch.testing.assert_close(graph, eager, rtol=0, atol=0)


@pytest.mark.parametrize("quant", ["bf16", "int8_both"])
@pytest.mark.parametrize("backend", ["triton", "cutile"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculative_reply_equals_plain_or_parts_at_a_near_tie(checkpoint, backend, quant, proposer):
    model = model_of(checkpoint, quant)
    runner = ModelRunner(model, backend, kv_int8=quant == "int8_both", max_seq_len=1024, cuda_graph=True)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, MODEL["vocab_size"], (200,), generator=g).tolist() * 2  # repeats: n-gram drafts
    plain = generate(runner, prompt, 96).tokens
    seq = runner.new_sequence()
    first = int(runner.prefill(seq, prompt).argmax())
    p = (
        NgramProposer(2, 4)
        if proposer == "ngram"
        else DraftModelProposer(ModelRunner(model, backend, kv_int8=quant == "int8_both", max_seq_len=1100))
    )
    p.begin(prompt + [first])
    reply = speculative_decode(runner, seq, prompt + [first], 95, p, k=7)
    got = [first] + reply.tokens
    if proposer == "draft":  # the target drafting for itself: every draft accepted
        assert reply.stats.acceptance_rate > 0.9
    if got != plain:
        i = next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)
        seq2 = runner.new_sequence()
        logits = runner.prefill(seq2, prompt + plain[:i])
        top2 = logits.topk(2).values
        print(f"{backend} {quant} {proposer}: parts at step {i}, margin {float(top2[0] - top2[1]):.4f}")
        assert float(top2[0] - top2[1]) <= schema.tie_margin("bfloat16")
