"""Whole-model drift of each fast backend against the reference backend, checked by the gate (GPU).

A random-weight Qwen3-0.6B-shaped model (tileinfer/core/checkpoint/random_init.py), BF16 and INT8-both,
teacher-forced over a random token stream; mean KL and top-1 agreement must pass the gate's kernel
checks. The sweeps in benchmarks/h200.sh do the same on real prompts and on smollm2.
"""

import pytest
import torch
from omegaconf import OmegaConf

from evals import verdicts
from quantize import QuantScheme, apply
from tests.passes import drift, full_logits
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.registry import model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GATE = OmegaConf.load("conf/gate.yaml").gate
MODEL = model_entry("qwen3-0.6b-random")["config"]  # config.json fields (the registry's shape table)


@pytest.fixture(scope="module")
def checkpoint():
    sd = random_state_dict(MODEL, seed=0, device="cuda")
    return Checkpoint(None, ModelConfig.from_hf(MODEL), MODEL, sd)


def _gate_check(checkpoint, backend, quant, chunk):
    int8 = quant == "int8_both"
    sd = apply(checkpoint, None, QuantScheme("int8", "int8", smooth_keys=False))[0] if int8 else checkpoint.state_dict
    model = Transformer.from_state_dict(checkpoint.config, sd, device="cuda")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab_size"], (1280,), generator=g).tolist()
    ref = full_logits(ModelRunner(model, "reference", kv_int8=int8, max_seq_len=1280), tokens, 1024)
    runner = ModelRunner(model, backend, kv_int8=int8, max_seq_len=1280, prefill_chunk=chunk)
    stats, _ = drift(runner, ref, decode_steps=0)
    print(f"{backend} {quant} chunk {chunk}: mean KL {stats['kl_mean']:.2e}, top-1 {stats['top1_agree']:.4f}")
    row = dict(stats, prompt_set="random", dtype="bfloat16", kv_cache="int8" if int8 else "bf16")
    assert [v for v in verdicts.kernel_checks(row, GATE) if v["verdict"] == verdicts.FAIL] == []


@pytest.mark.parametrize("chunk", [512, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("quant", ["bf16", "int8_both"])
@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_backend_logits_pass_the_gate_against_the_reference_backend(checkpoint, backend, quant, chunk):
    """Scored in prefill chunks of 512 rows (the sweep's scoring), and one position a step (chunk 1:
    the decode kernels, T = 1: GEMV, split-KV attention, cuTile's INT8 word kernel)."""
    _gate_check(checkpoint, backend, quant, chunk)


@pytest.mark.parametrize("quant", ["bf16", "int8_both"])
def test_triton_streamk_prefill_passes_the_gate(checkpoint, quant):
    """Every plain prefill GEMM through Triton's stream-K kernel (the tables send only the 4B/8B
    shapes whose last wave is mostly idle there; this model's 512-row chunks have none): a tuning
    whose BF16 GEMM tables hold that one tile (SwiGLU takes it as "tma"; INT8 weights are widened
    first, then multiplied by it)."""
    from tileinfer.ops import get_backend
    from tileinfer.ops.triton.tuning import GemmTile

    streamk = GemmTile(128, 128, 64, 8, 8, 4, "streamk")
    backend = get_backend("triton").with_tuning(gemm_bf16=(streamk,), gemm_bf16_swiglu=(streamk,), gemm_bf16_shapes={})
    _gate_check(checkpoint, backend, quant, 512)


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_decode_replayed_from_cuda_graph_equals_eager_decode(checkpoint, backend, kv_int8):
    """One captured decode graph serves two sequences (different block tables) across page
    boundaries, with the logits of eager decode steps."""
    model = Transformer.from_state_dict(checkpoint.config, checkpoint.state_dict, device="cuda")
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, MODEL["vocab_size"], (n,), generator=g).tolist() for n in (150, 90))
    logits = {}
    for graph in (False, True):
        runner = ModelRunner(model, backend, kv_int8=kv_int8, max_seq_len=512, page_size=64, cuda_graph=graph)
        assert runner.cuda_graph == graph
        sa, sb = runner.new_sequence(), runner.new_sequence()
        runner.prefill(sa, a[:100])
        out = [runner.decode(sa, t) for t in a[100:140]]  # positions 100..139 cross a page end
        runner.prefill(sb, b[:50])
        out += [runner.decode(sb, t) for t in b[50:90]]  # another block table, same graph
        out += [runner.decode(sa, t) for t in a[140:150]]
        logits[graph] = torch.stack(out)
    err = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    assert torch.isfinite(logits[True]).all() and err < 1e-5, err


@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_greedy_steps_from_the_graph_are_the_argmax_of_its_logits(checkpoint, backend):
    """decode_greedy / verify_greedy (the argmax captured in the graph) return the argmax of the
    logits that decode / verify return for the same steps, across a page end."""
    model = Transformer.from_state_dict(checkpoint.config, checkpoint.state_dict, device="cuda")
    runner = ModelRunner(model, backend, max_seq_len=512, page_size=64, cuda_graph=True)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, MODEL["vocab_size"], (160,), generator=g).tolist()
    seq = runner.new_sequence()
    runner.prefill(seq, a[:100])
    logits = torch.stack([runner.decode(seq, t) for t in a[100:140]])
    logits = torch.cat([logits, runner.verify(seq, a[140:148])])
    seq.truncate(100)
    greedy = [runner.decode_greedy(seq, t) for t in a[100:140]] + runner.verify_greedy(seq, a[140:148])
    assert greedy == logits.argmax(-1).tolist()
