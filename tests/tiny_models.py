"""Tiny random Hugging Face checkpoints of each supported architecture, written by the tests (and
the same models as GGUF files, see :func:`write_gguf`).

Norm weights are randomised too (transformers initialises them to ones, which would hide a norm
applied to the wrong axis).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0, head_dim=16)),
    "llama3-scaled": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500000.0,
            head_dim=16,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6)),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(rope_theta=1e6, head_dim=32, num_key_value_heads=1),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(rope_theta=1e6, sliding_window=None, head_dim=16),
    ),
    # attention_bias: biases on q, k, v and o_proj
    "llama-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_theta=10000.0, head_dim=16, attention_bias=True),
    ),
    "qwen3-bias": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(rope_theta=1e6, head_dim=32, num_key_value_heads=1, attention_bias=True),
    ),
}


def make_tiny(kind: str, folder, seed: int = 0, **overrides):
    """Write a random float32 checkpoint of architecture ``kind`` to ``folder``; return the HF model.

    ``overrides`` replace config fields of ``kind`` (e.g. ``rope_scaling=...``)."""
    cfg_cls, model_cls, extra = CONFIGS[kind]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


# transformers' name -> llama.cpp's (convert_hf_to_gguf.py's tensor map)
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd",
    "model.norm.weight": "output_norm",
    "lm_head.weight": "output",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a transformers parameter name."""
    stem, kind = hf_name.rsplit(".", 1)
    if hf_name in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[hf_name]}.{kind}"
    _, _, i, part = stem.split(".", 3)
    return f"blk.{i}.{_GGUF_LAYER[part]}.{kind}"


def write_gguf(hf_model, path, metadata=(), extra_tensors=None, qtypes=None):
    """Write ``hf_model`` (a tiny model of :func:`make_tiny`) as a float32 GGUF file the way
    llama.cpp's convert_hf_to_gguf.py does: its tensor names, q/k rows permuted for llama
    (``LlamaModel.permute``), its metadata keys. No rope scaling keys are written: pass them in
    ``metadata`` as ``(key, value)`` (``{arch}`` in a key is replaced; a key given there replaces
    the converter's). ``extra_tensors`` {gguf name: array} are added; ``qtypes`` {gguf name:
    GGMLQuantizationType} stores those tensors quantized. Returns ``path``."""
    import gguf
    from gguf.quants import quantize

    c = hf_model.config
    arch = c.model_type
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    keys = {
        "{arch}.block_count": c.num_hidden_layers,
        "{arch}.context_length": c.max_position_embeddings,
        "{arch}.embedding_length": c.hidden_size,
        "{arch}.feed_forward_length": c.intermediate_size,
        "{arch}.attention.head_count": heads,
        "{arch}.attention.head_count_kv": kv_heads,
        "{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        "{arch}.rope.freq_base": float(c.rope_parameters["rope_theta"]),
    }
    if head_dim != c.hidden_size // heads:
        keys |= {"{arch}.attention.key_length": head_dim, "{arch}.attention.value_length": head_dim}
    if arch == "llama":
        keys["{arch}.rope.dimension_count"] = head_dim
    keys |= dict(metadata)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)]
        add(key.format(arch=arch), value)
    tensors = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        tensors[gguf_name(name)] = np.ascontiguousarray(a)
    tensors |= extra_tensors or {}
    for name, a in tensors.items():
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_tokenizer(folder: Path):
    """A 96-token character tokenizer (tokenizer.json) matching the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models

    chars = [chr(i) for i in range(32, 126)] + ["\n"]  # 95 characters, '~' left out for <unk>
    vocab = {ch: i for i, ch in enumerate(chars)} | {"<unk>": 95}
    Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))


def make_tiny_with_tokenizer(kind: str, folder: Path) -> Path:
    """:func:`make_tiny` plus :func:`write_tiny_tokenizer`: a checkpoint folder the engine loads whole."""
    make_tiny(kind, folder)
    write_tiny_tokenizer(folder)
    return folder
