"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3, as plain tensors.

No nn framework: a model is a list of layers holding weight tensors, and ``forward`` calls one op
per step so every kernel launch is visible (TileInfer.jl's design). The math is transformers'
``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model``: pre-norm blocks with RMSNorm, GQA attention with
RoPE (bias on q/k/v for Qwen2, on q/k/v/o for Llama/Qwen3 with ``attention_bias``, per-head q/k
RMSNorm for Qwen3), and a SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.ops import Int8Weight
from tileinfer.ops.rope import rope_tables

SCALE_SUFFIX = "_scale"  # an INT8 tensor "x.weight" has its per-channel scales in "x.weight_scale"


@dataclass
class Layer:
    """One transformer block. Linear weights are [out, in] tensors or :class:`Int8Weight`.

    ``qkv_proj`` stacks the q, k and v projections ([(heads + 2 kv_heads) * head_dim, hidden]) and
    ``gate_up_proj`` the gate and up projections ([2 * intermediate, hidden]) so each is one GEMM.
    ``qkv_bias`` ([(heads + 2 kv_heads) * head_dim]) and ``o_bias`` ([hidden]) are None without biases.
    """

    input_norm: torch.Tensor
    qkv_proj: torch.Tensor | Int8Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor | Int8Weight
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor | Int8Weight
    down_proj: torch.Tensor | Int8Weight
    o_bias: torch.Tensor | None = None


def _cat(ws: list) -> torch.Tensor | Int8Weight:
    if isinstance(ws[0], Int8Weight):
        return Int8Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]))
    return torch.cat(ws)


class Transformer:
    """Weights and forward pass of one model.

    Build with :meth:`from_state_dict`. ``forward`` runs a chunk of one sequence's tokens through
    every layer, writing their keys and values into the paged cache, and returns float32 logits.
    """

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[Layer],
        norm: torch.Tensor,
        lm_head: torch.Tensor | Int8Weight,
        max_positions: int,
    ):
        self.config, self.embed, self.layers, self.norm, self.lm_head = config, embed, layers, norm, lm_head
        self.rope_cos, self.rope_sin = rope_tables(config, max_positions, embed.device)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        sd: dict[str, torch.Tensor],
        dtype=torch.bfloat16,
        device="cpu",
        max_positions: int | None = None,
    ) -> "Transformer":
        """Build from tensors with transformers' parameter names.

        ``sd`` values may be any float dtype (cast to ``dtype``) or int8 with a float32
        ``<name>_scale`` beside them (INT8 weights, see quantize/). Norm weights and scales are
        kept in float32-compatible form; everything else moves to ``device``.

        Raises:
            UserError: a tensor the architecture needs is missing or has the wrong shape.
        """
        c = config

        def get(name, shape=None):
            if name not in sd:
                raise UserError(f"checkpoint has no tensor {name!r}")
            t = sd[name]
            if t.dtype == torch.int8:
                w = Int8Weight(t.to(device), sd[name + SCALE_SUFFIX].float().to(device))
            else:
                w = t.to(device=device, dtype=dtype)
            if shape is not None and tuple(w.shape) != tuple(shape):
                raise UserError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
            return w

        d, h, kvh, hid, inter = (
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.hidden_size,
            c.intermediate_size,
        )
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [
                get(a + "q_proj.weight", (h * d, hid)),
                get(a + "k_proj.weight", (kvh * d, hid)),
                get(a + "v_proj.weight", (kvh * d, hid)),
            ]
            bias = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if c.attention_bias else None
            layers.append(
                Layer(
                    input_norm=get(p + "input_layernorm.weight", (hid,)),
                    qkv_proj=_cat(qkv),
                    qkv_bias=bias,
                    q_norm=get(a + "q_norm.weight") if c.qk_norm else None,
                    k_norm=get(a + "k_norm.weight") if c.qk_norm else None,
                    o_proj=get(a + "o_proj.weight", (hid, h * d)),
                    post_norm=get(p + "post_attention_layernorm.weight", (hid,)),
                    gate_up_proj=_cat(
                        [get(p + "mlp.gate_proj.weight", (inter, hid)), get(p + "mlp.up_proj.weight", (inter, hid))]
                    ),
                    down_proj=get(p + "mlp.down_proj.weight", (hid, inter)),
                    o_bias=get(a + "o_proj.bias", (hid,)) if c.o_proj_bias else None,
                )
            )
        embed = get("model.embed_tokens.weight", (c.vocab_size, hid))
        lm_head = (
            embed
            if "lm_head.weight" not in sd and c.tie_word_embeddings
            else get("lm_head.weight", (c.vocab_size, hid))
        )
        return cls(
            c, embed, layers, get("model.norm.weight", (hid,)), lm_head, max_positions or c.max_position_embeddings
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def weight_bytes(self) -> int:
        """Bytes of all weights (a tied lm_head counted once)."""
        seen, total = set(), 0
        tensors = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            tensors += [
                L.input_norm,
                L.qkv_proj,
                L.qkv_bias,
                L.q_norm,
                L.k_norm,
                L.o_proj,
                L.o_bias,
                L.post_norm,
                L.gate_up_proj,
                L.down_proj,
            ]
        for t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            total += t.nbytes if isinstance(t, Int8Weight) else t.numel() * t.element_size()
        return total

    def forward(
        self,
        ops,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKVCache,
        block_table: torch.Tensor,
        logit_rows: torch.Tensor | slice | None = None,
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run tokens [T] at positions [T] of one sequence; return float32 logits [R, vocab].

        ``ops`` is a backend module (tileinfer.ops.*). Keys and values of the T positions are written
        to ``kv`` through ``block_table`` before attention reads them. ``logit_rows`` picks which of
        the T rows get logits (all when None) so prefill can skip the lm_head for unscored rows.

        ``capture`` names layers whose outputs (the residual stream after the layer, transformers'
        ``hidden_states[i + 1]``) are returned too, concatenated in that order: the call then returns
        ``(logits, hidden)`` with hidden [T, len(capture) * hidden_size] in the model dtype, for a
        drafter conditioned on the target's hidden states (DFlash).
        """
        c = self.config
        T = tokens.shape[0]
        h, kvh, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        sm_scale = d**-0.5
        x = ops.embedding(tokens, self.embed)
        residual = None
        captured = {}
        for i, L in enumerate(self.layers):
            if residual is None:
                hs, residual = ops.rms_norm(x, L.input_norm, eps), x
            else:
                hs, residual = ops.add_rms_norm(x, residual, L.input_norm, eps)
            qkv = ops.linear(hs, L.qkv_proj, L.qkv_bias)
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q = ops.qk_norm_rope_kv_write(
                q.view(T, h, d),
                k.view(T, kvh, d),
                v.view(T, kvh, d),
                L.q_norm,
                L.k_norm,
                eps,
                self.rope_cos,
                self.rope_sin,
                kv.layers[i],
                block_table,
                positions,
            )
            o = ops.attention(q, kv.layers[i], block_table, positions, sm_scale)
            x = ops.linear(o.reshape(T, h * d), L.o_proj, L.o_bias)
            hs, residual = ops.add_rms_norm(x, residual, L.post_norm, eps)
            x = ops.linear(ops.swiglu(hs, L.gate_up_proj), L.down_proj)
            if i in capture:  # the sum the next add_rms_norm forms, rounded the same way
                captured[i] = x + residual
        hs, _ = ops.add_rms_norm(x, residual, self.norm, eps)
        if logit_rows is not None:
            hs = hs[logit_rows]
        logits = ops.lm_head(hs, self.lm_head)
        if not capture:
            return logits
        return logits, torch.cat([captured[i] for i in capture], dim=-1)
