"""Hugging Face transformers as a peer: ``generate`` on a causal LM built from our config and weights.

The model is transformers' class for the config's ``model_type`` (``Qwen3ForCausalLM`` for Qwen3)
built from the registry's config.json dictionary, with the engine's tensors assigned in place:
:func:`tileinfer.core.checkpoint.random_init.random_state_dict` already uses transformers' names,
so the mapping is the identity (a tied lm_head is pointed at the embedding table).

Decode timing: one greedy ``generate`` of ``warm + steps`` tokens after a ``ctx``-token prompt
(``min_new_tokens = max_new_tokens``, so an end-of-sequence token cannot stop it early). A streamer
records the host time each time ``generate`` hands it tokens (the prompt, then every new token;
transformers copies each token to the host before the next step starts, and the streamer
synchronizes the device too), so the prefill and the first ``warm`` steps (compilation, CUDA-graph
recording) fall outside the timed window: seconds per token = (last stamp - stamp ``steps`` tokens
earlier) / ``steps``. ``static=True``: ``cache_implementation="static"``, with which ``generate``
compiles the decode forward (``torch.compile``, mode reduce-overhead) on CUDA; otherwise the
dynamic cache, eager.
"""

from __future__ import annotations

import time

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_model(hf_config: dict, sd: dict[str, torch.Tensor], dtype=torch.bfloat16, device="cpu"):
    """transformers' causal LM for ``hf_config`` (a config.json dictionary) holding the tensors of
    ``sd`` (transformers' names, float, any dtype: cast to ``dtype``; tensors already in ``dtype`` on
    ``device`` are shared, not copied), in eval mode with SDPA attention.

    Raises:
        ValueError: a tensor of ``sd`` the model has no place for, or a weight of the model missing
            from ``sd`` (other than a tied ``lm_head.weight``).
    """
    config = transformers.AutoConfig.for_model(**hf_config)
    cls = getattr(transformers, CAUSAL_LM[config.model_type])
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    tensors = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = config.tie_word_embeddings and "lm_head.weight" not in sd
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"weights do not fit {cls.__name__}: missing {missing}, unexpected {unexpected}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


class _Stamps(BaseStreamer):
    """Host time (``time.perf_counter``) at each ``put``, after the device has finished its work."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.no_grad()
def decode_seconds(model, prompt: torch.Tensor, steps: int, warm: int, static: bool) -> tuple[float, float]:
    """``(seconds per decode step, seconds before the timed steps)`` of greedy ``generate`` after
    prompt [ctx] (token ids on the model's device); see the module docstring."""
    stamps = _Stamps(prompt.device)
    n = warm + steps
    t0 = time.perf_counter()
    model.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        streamer=stamps,
        cache_implementation="static" if static else None,
        disable_compile=not static,
        pad_token_id=0,
    )
    t = stamps.times
    if len(t) != n + 1:  # the prompt, then one stamp per new token
        raise RuntimeError(f"generate streamed {len(t) - 1} tokens, expected {n}")
    return (t[-1] - t[-1 - steps]) / steps, t[-1 - steps] - t0
