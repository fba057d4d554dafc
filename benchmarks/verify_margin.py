"""How far a verify step's logits move from a decode step's: ``python -m benchmarks.verify_margin``.

Speculative decoding's exactness check (tileinfer.jobs.spec) calls a reply that parts from plain greedy
decoding a near-tie when the target's top-1 led its top-2 by less than what rounding between the two
paths can move (``schema.SPEC_TIE_MARGIN``). This measures that movement on the GPU: the greedy reply
of a prompt is decoded one token per step (the decode graph), then the same tokens are run again as
verify steps of ``T`` tokens (``ModelRunner.verify``); per position, |Δ(top-1 minus top-2)| of the
plain path's two leading tokens between the paths, and the positions where the argmax differs with the
plain margin there. SmolLM2-135M on the built-in prompts (real weights), and a random-weight
Qwen3-8B-shaped model at 8k positions. Prints one line per case.
"""

from __future__ import annotations

import torch

from evals.prompts import build_prompt
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.fetch import pull
from tileinfer.core.registry import model_entry
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer


def measure(name: str, model: Transformer, prompt: list[int], kv_int8: bool, n: int = 384, T: int = 8) -> str:
    """One line: the distribution of |Δ margin| (logits) over ``n`` reply positions, and the argmax flips."""
    r = ModelRunner(model, "triton", kv_int8=kv_int8, max_seq_len=len(prompt) + n + 16, cuda_graph=True)
    seq = r.new_sequence()
    tokens, plain = [int(r.prefill(seq, prompt).argmax())], []
    for _ in range(n):
        plain.append(r.decode(seq, tokens[-1]))
        tokens.append(int(plain[-1].argmax()))
    plain = torch.stack(plain)
    seq.truncate(len(prompt))
    verify = torch.cat([r.verify(seq, tokens[i : i + T]) for i in range(0, n, T)])[:n]
    top2 = plain.topk(2, dim=-1).indices
    a, b = plain.gather(1, top2), verify.gather(1, top2)
    d = ((a[:, 0] - a[:, 1]) - (b[:, 0] - b[:, 1])).abs()
    flips = (verify.argmax(-1) != plain.argmax(-1)).nonzero().flatten().tolist()
    margins = [round(float(a[i, 0] - a[i, 1]), 4) for i in flips]
    return (
        f"{name} kv_int8={kv_int8}: |Δ margin| max {d.max():.4f}, p99.9 {d.quantile(0.999):.4f}, "
        f"p99 {d.quantile(0.99):.4f}, median {d.median():.5f}; argmax differs at {flips}, plain margins {margins}"
    )


def main() -> None:
    path = pull("smollm2-135m")
    ck, tok = load_checkpoint(path), Tokenizer.load(path)
    model = Transformer.from_state_dict(ck.config, ck.state_dict, device="cuda")
    for prompt_set in ("edit", "explain"):
        for kv_int8 in (False, True):
            print(measure(f"smollm2-135m {prompt_set} 1k", model, build_prompt(tok, prompt_set, 1024), kv_int8))
    hf = model_entry("qwen3-8b-random")["config"]
    big = Transformer.from_state_dict(ModelConfig.from_hf(hf), random_state_dict(hf, 0, device="cuda"), device="cuda")
    prompt = torch.randint(0, hf["vocab_size"], (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    print(measure("qwen3-8b-random 8k", big, prompt, False, n=256))


if __name__ == "__main__":
    main()
