"""The Triton backend against the reference backend on a whole (tiny) model, judged by the gate's
kernel checks: CI's stand-in for the GPU sweeps, run in Triton's interpreter on the CPU (real
models are far too slow there: one 64-token SmolLM2 prefill takes over 10 minutes)."""

import pytest
import torch
from omegaconf import OmegaConf

from evals import verdicts
from quantize import QuantScheme, apply
from tests.passes import drift, full_logits
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer

pytest.importorskip("triton")
GATE = OmegaConf.load("conf/gate.yaml").gate
TINY = dict(
    model_type="qwen3",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "dtype,quant", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"), (torch.bfloat16, "int8_both")]
)
def test_triton_model_passes_the_gate_against_the_reference_backend(dtype, quant):
    int8 = quant == "int8_both"
    ck = Checkpoint(None, ModelConfig.from_hf(TINY), TINY, random_state_dict(TINY, seed=0, dtype=dtype))
    sd = apply(ck, None, QuantScheme("int8", "int8", smooth_keys=False))[0] if int8 else ck.state_dict
    model = Transformer.from_state_dict(ck.config, sd, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY["vocab_size"], (96,), generator=g).tolist()
    kw = dict(kv_int8=int8, max_seq_len=128, page_size=16, prefill_chunk=48)  # chunks across pages
    ref = full_logits(ModelRunner(model, "reference", **kw), tokens, 64)
    stats, _ = drift(ModelRunner(model, "triton", **kw), ref, decode_steps=2)
    row = dict(stats, prompt_set="random", dtype=str(dtype).removeprefix("torch."), kv_cache="int8" if int8 else "bf16")
    assert [v for v in verdicts.kernel_checks(row, GATE) if v["verdict"] == verdicts.FAIL] == [], stats
