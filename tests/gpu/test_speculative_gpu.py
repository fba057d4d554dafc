"""Speculative decoding on the fast backends (GPU): verify steps replayed from CUDA graphs give the
eager step's logits, and greedy speculative replies match plain greedy decoding (or part at a
near-tie, as a verify step rounds differently from a decode step in BF16)."""

import pytest
import torch

from evals.verdicts import tie_margin
from quantize import QuantScheme, apply
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.registry import model_entry
from tileinfer.engine.generation import generate
from tileinfer.engine.proposers import DraftModelProposer, NgramProposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import speculative_decode
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
        assert float(top2[0] - top2[1]) <= tie_margin("bfloat16")


def random_drafter(target_config: dict, layers: tuple[int, ...]):
    """A DFlash drafter with random weights for ``target_config`` (two Qwen3 layers, BF16, on the GPU)."""
    from tileinfer.models.dflash import DFlashDrafter

    hid, d, heads, kvh = target_config["hidden_size"], 128, 8, 2
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hid,
        "intermediate_size": 2 * hid,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "head_dim": d,
        "vocab_size": target_config["vocab_size"],
        "max_position_embeddings": 4096,
        "block_size": 16,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": 151665, "target_layer_ids": list(layers)},
    }
    g = torch.Generator().manual_seed(5)
    shapes = {"fc.weight": (hid, hid * len(layers)), "hidden_norm.weight": (hid,), "norm.weight": (hid,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hid,),
            p + "post_attention_layernorm.weight": (hid,),
            p + "self_attn.q_proj.weight": (heads * d, hid),
            p + "self_attn.k_proj.weight": (kvh * d, hid),
            p + "self_attn.v_proj.weight": (kvh * d, hid),
            p + "self_attn.o_proj.weight": (hid, heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (2 * hid, hid),
            p + "mlp.up_proj.weight": (2 * hid, hid),
            p + "mlp.down_proj.weight": (hid, 2 * hid),
        }
    sd = {n: 1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
          for n, s in shapes.items()}  # fmt: skip
    return DFlashDrafter.from_state_dict(config, sd, torch.bfloat16, "cuda")


@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_dflash_on_a_fast_backend_is_lossless(checkpoint, backend):
    """A random DFlash drafter on the target's backend: the reply equals plain greedy decoding (or parts
    at a near-tie), with the prompt's hidden states observed in prefill chunks as a job feeds them."""
    from evals import drift
    from tileinfer.engine.dflash import DFlashProposer
    from tileinfer.engine.snapshots import Snapshots

    model = model_of(checkpoint, "bf16")
    runner = ModelRunner(model, backend, max_seq_len=1024, prefill_chunk=128, cuda_graph=True)
    proposer = DFlashProposer(random_drafter(MODEL, (1, 9, 17, 25)), model, runner.ops)
    prompt = torch.randint(0, MODEL["vocab_size"], (300,), generator=torch.Generator().manual_seed(6)).tolist()
    plain = generate(runner, prompt, 64).tokens
    seq = runner.new_sequence()
    state, _ = drift.prefill(runner, seq, prompt, Snapshots(None), None, proposer)
    first = int(state.first.argmax())
    spec = drift.Speculation(proposer, 15)
    got = [first] + spec.run(runner, seq, prompt + [first], 63).reply.tokens
    seq.release()
    assert got[0] == plain[0]
    if got != plain:
        i = next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)
        logits = runner.prefill(runner.new_sequence(), prompt + plain[:i])
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) <= tie_margin("bfloat16")
