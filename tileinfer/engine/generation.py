"""Generation: turn a prompt into a reply, one token at a time (greedy or sampled)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileinfer.core.progress import progress_bar
from tileinfer.engine.runner import ModelRunner
from tileinfer.ops import reference


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    temperature 0 means greedy (argmax). Otherwise logits are divided by ``temperature``, then
    filtered to the ``top_k`` most likely tokens (0: all) and to the smallest set whose probability
    reaches ``top_p`` (1.0: all), and drawn with a generator seeded by ``seed`` (None: unseeded).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Reply:
    """A generated reply: the new token ids (the stop token included when one ended it)."""

    tokens: list[int]
    stop_reason: str  # "eos" or "length"


def generate(
    runner: ModelRunner,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids=frozenset(),
    progress: str | None = None,
) -> Reply:
    """Prefill ``prompt`` in a new sequence, then decode until a stop id or ``max_new_tokens``.

    Greedy decoding takes the backend's argmax (inside the captured decode graph where the runner
    has one); sampled decoding draws with the reference sampler (``reference.sample``) on the
    logits' device. The sequence's pages are released at the end. Raises UserError (from the
    runner) when prompt plus reply would exceed the runner's context.
    """
    ops = runner.ops
    gen = None
    if sampling.temperature > 0 and sampling.seed is not None:
        gen = torch.Generator(device=runner.device).manual_seed(sampling.seed)

    def choose(logits: torch.Tensor) -> int:
        if sampling.temperature <= 0:
            return int(ops.argmax(logits[None])[0])
        return int(reference.sample(logits[None], sampling.temperature, sampling.top_k, sampling.top_p, gen)[0])

    seq = runner.new_sequence()
    try:
        runner.check_length(seq, len(prompt) + max_new_tokens - 1)
        token = choose(runner.prefill(seq, prompt, progress=progress and f"{progress} prefill"))
        out = [token]
        bar = progress_bar(max_new_tokens, progress and f"{progress} decode", initial=1)
        while token not in stop_ids and len(out) < max_new_tokens:
            # greedy: the argmax runs in the captured decode graph and only the token comes back
            token = runner.decode_greedy(seq, token) if sampling.temperature <= 0 else choose(runner.decode(seq, token))
            out.append(token)
            bar.update(1)
        bar.close()
    finally:
        seq.release()
    return Reply(out, "eos" if out[-1] in stop_ids else "length")
