"""The kernel specializations the shipped model configs need, derived without a GPU.

A cuTile kernel is compiled once per *specialization*: its constant parameters (tile sizes,
flags) plus what the JIT infers from each array argument (dtype, rank, unit strides, size-1
dimensions, 16-divisibility of shapes and strides, 16-byte alignment). This module runs the real
model code (one layer of :class:`~tileinfer.models.Transformer`, the lm_head, argmax and sample) on
``meta`` tensors with the backend's launches recorded instead of run
(:func:`tileinfer.ops.cutile._common.recording`), and turns each recorded launch into the
:class:`~cuda.tile.compilation.KernelSignature` the JIT would build (the inference rules of
cuTile 1.7's dispatcher, ``compute_array_specialization_bits``). ``tests/test_cutile_compile.py``
compiles every one for sm_90, so a kernel that does not compile for a shipped shape fails CI.

Models: the shipped configs (conf/model: SmolLM2-135M, Qwen2.5-Coder-0.5B/1.5B) and the Qwen3
0.6B/4B/8B shapes. Steps: decode (1 row), verify (5 and 16 rows), prefill chunks (512 rows and a
short last chunk of 300), each with BF16 or INT8 weights and a BF16 or INT8 KV cache.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass

import torch

import cuda.tile as ct
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                   ScalarConstraint)
from tileinfer.core.config import ModelConfig
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.models.transformer import Layer, Transformer
from tileinfer.ops import Int8Weight
from tileinfer.ops.cutile import _common

# name: (model_type, hidden, heads, kv_heads, head_dim, inter, vocab, tied)
MODELS = {
    "smollm2-135m": ("llama", 576, 9, 3, 64, 1536, 49152, True),
    "qwen2.5-coder-0.5b": ("qwen2", 896, 14, 2, 64, 4864, 151936, True),
    "qwen2.5-coder-1.5b": ("qwen2", 1536, 12, 2, 128, 8960, 151936, True),
    "qwen3-0.6b": ("qwen3", 1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-4b": ("qwen3", 2560, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": ("qwen3", 4096, 32, 8, 128, 12288, 151936, False),
}

STEPS = (1, 5, 16, 300, 512)      # rows per step: decode, verify, verify, last prefill chunk, chunk
PAGE_SIZE = 64
MAX_POSITIONS = 32768

_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32,
           torch.int8: ct.int8, torch.int32: ct.int32, torch.int64: ct.int64}


def model_config(name: str) -> ModelConfig:
    mt, hidden, heads, kvh, hd, inter, vocab, tied = MODELS[name]
    return ModelConfig(model_type=mt, vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kvh, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=tied,
                       attention_bias=mt == "qwen2", qk_norm=mt == "qwen3")


def _meta_model(c: ModelConfig, int8_weights: bool) -> Transformer:
    meta = "meta"

    def w(out, inp):
        if int8_weights:
            return Int8Weight(torch.empty(out, inp, dtype=torch.int8, device=meta),
                              torch.empty(out, dtype=torch.float32, device=meta))
        return torch.empty(out, inp, dtype=torch.bfloat16, device=meta)

    def v(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=meta)

    h, kvh, d, hid, inter = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                             c.hidden_size, c.intermediate_size)
    layer = Layer(input_norm=v(hid), qkv_proj=w((h + 2 * kvh) * d, hid),
                  qkv_bias=v((h + 2 * kvh) * d) if c.attention_bias else None,
                  q_norm=v(d) if c.qk_norm else None, k_norm=v(d) if c.qk_norm else None,
                  o_proj=w(hid, h * d), post_norm=v(hid), gate_up_proj=w(2 * inter, hid),
                  down_proj=w(hid, inter))
    embed = v(c.vocab_size, hid)
    lm = w(c.vocab_size, hid) if (int8_weights or not c.tie_word_embeddings) else embed
    model = Transformer.__new__(Transformer)
    model.config, model.embed, model.layers = c, embed, [layer]
    model.norm, model.lm_head = v(hid), lm
    model.rope_cos = torch.empty(MAX_POSITIONS, d // 2, dtype=torch.float32, device=meta)
    model.rope_sin = torch.empty(MAX_POSITIONS, d // 2, dtype=torch.float32, device=meta)
    return model


def record_model(name: str, steps=STEPS) -> list:
    """Every ``(kernel, grid, args)`` the cutile backend launches for one layer of ``name`` (plus
    lm_head, argmax and sample), over the steps and the four weight/cache quantizations."""
    from tileinfer.ops import cutile as backend

    c = model_config(name)
    launches = []
    max_pages = MAX_POSITIONS // PAGE_SIZE
    for int8_w in (False, True):
        model = _meta_model(c, int8_w)
        for int8_kv in (False, True):
            kv = PagedKVCache(1, max_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim,
                              torch.bfloat16, int8_kv, "meta")
            bt = torch.empty(max_pages, dtype=torch.int32, device="meta")
            for T in steps:
                tokens = torch.empty(T, dtype=torch.int64, device="meta")
                positions = torch.empty(T, dtype=torch.int32, device="meta")
                rows = slice(-1, None) if T > 16 else None
                with _common.recording() as rec:
                    logits = model.forward(backend, tokens, positions, kv, bt, rows)
                    if not int8_kv:
                        backend.argmax(logits)
                        backend.sample(logits, 0.7, 20, 0.9, None)
                launches += rec
    return launches


# --------------------------------------------------------------- JIT signature inference mimic


def _array_constraint(t: torch.Tensor) -> ArrayConstraint:
    bits = t.element_size() * 8
    shape, stride = list(t.shape), list(t.stride())
    per16 = 128 // bits if 128 % bits == 0 else None
    stride_const = [1 if s == 1 else None for s in stride]
    stride_div = [per16 if (per16 and (s * bits // 8) % 16 == 0 and s != 1) else 1 for s in stride]
    shape_const = [1 if n == 1 else None for n in shape]
    shape_div = [16 if (n % 16 == 0 and n != 1) else 1 for n in shape]
    pairs = sorted(zip(stride, shape))
    disjoint = t.dim() == 0 or pairs[0][0] > 0
    for (ps, pn), (cs, _) in zip(pairs, pairs[1:]):
        disjoint = disjoint and cs > 0 and cs >= ps * pn
    aligned = (t.storage_offset() * t.element_size()) % 16 == 0
    return ArrayConstraint(_DTYPES[t.dtype], t.dim(), index_dtype=ct.int32,
                           stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=not disjoint, stride_constant=stride_const,
                           shape_constant=shape_const, stride_divisible_by=stride_div,
                           shape_divisible_by=shape_div,
                           base_addr_divisible_by=16 if aligned else 1)


def _is_constant(annotation) -> bool:
    meta = getattr(annotation, "__metadata__", ())
    return any(isinstance(m, ct.ConstantAnnotation) for m in meta)


@dataclass(frozen=True)
class Specialization:
    """One kernel compilation: the kernel object and the signature the JIT would use."""

    kernel: object
    signature: KernelSignature

    @property
    def name(self) -> str:
        return self.kernel._pyfunc.__name__

    def describe(self) -> str:
        consts = [p.value for p in self.signature.parameters
                  if type(p).__name__ == "ConstantConstraint"]
        return f"{self.name}{tuple(consts)}"


def signature_of(kernel, args: tuple) -> KernelSignature:
    params = inspect.signature(kernel._pyfunc).parameters
    hints = typing.get_type_hints(kernel._pyfunc, include_extras=True)
    out, shape_const = [], False
    for (name, _), a in zip(params.items(), args):
        if isinstance(a, torch.Tensor):
            c = _array_constraint(a)
            shape_const = shape_const or any(s is not None for s in c.shape_constant)
            out.append(c)
        elif _is_constant(hints.get(name)):
            out.append(a)
        elif isinstance(a, bool):
            out.append(a)
        elif isinstance(a, int):
            out.append(ScalarConstraint(ct.int32))
        elif isinstance(a, float):
            out.append(ScalarConstraint(ct.float32))
        else:
            raise TypeError(f"{kernel._pyfunc.__name__}: cannot describe argument {name}={a!r}")
    # size-1 dimensions become shape constants, which need calling convention v2 (as in the JIT)
    cconv = (CallingConvention.cutile_python_v2() if shape_const
             else CallingConvention.cutile_python_v1())
    return KernelSignature(out, cconv)


def specializations(models=tuple(MODELS), steps=STEPS) -> list[Specialization]:
    """Distinct (kernel, signature) pairs over the models and steps, in first-seen order."""
    seen, out = set(), []
    for m in models:
        for kernel, _grid, args in record_model(m, steps):
            sig = signature_of(kernel, args)
            key = (kernel._pyfunc.__name__, repr(sig.parameters), sig.calling_convention.code)
            if key not in seen:
                seen.add(key)
                out.append(Specialization(kernel, sig))
    return out


if __name__ == "__main__":
    specs = specializations()
    for s in specs:
        print(s.describe())
    print(len(specs), "specializations")
