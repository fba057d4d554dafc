"""DFlash: a block-diffusion drafter for speculative decoding, as plain tensors.

DFlash (Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036;
reference code: the ``dflash`` package, ``dflash/model.py``, class ``DFlashDraftModel``) drafts a whole
block of tokens in one forward pass of a few Qwen3-style decoder layers:

* context: the target's outputs of a few spread-out layers (``target_layer_ids``), concatenated per
  position, projected by ``fc`` to the hidden size and RMS-normalised (``hidden_norm``). Every drafter
  layer projects these features with its own ``k_proj``/``v_proj`` (then ``k_norm`` and RoPE at the
  context positions) into keys and values that come before the block's own.
* block: the pending token followed by ``block_size - 1`` copies of ``mask_token_id``, embedded with
  the target's embedding table, at the positions right after the context.
* attention: every block position sees every context position and every block position (no causal
  mask); q/k RMSNorm per head and RoPE as in Qwen3.
* output: the drafter's final norm, then the target's lm_head; block positions 1.. give the drafts.

The context keys and values of a position never change once computed (fc, hidden_norm, k_proj,
v_proj and RoPE act on each position alone), so a caller computes them once per position
(:meth:`DFlashDrafter.context_kv`) and keeps them, as the reference keeps its draft cache cropped to
the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tileinfer.core.checkpoint.safetensors_hf import load_hf_folder
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.ops.reference import rope
from tileinfer.ops.rope import rope_tables

ARCHITECTURE = "DFlashDraftModel"
# Scalars the reference reads from dflash_config (or the top level) that only other drafter kinds
# (DFlash 2) set; at these neutral values the math is the one implemented here.
_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # a RoPE table older transformers saved; recomputed


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's settings, read from its ``config.json`` as the reference reads them.

    Attributes:
        model: the decoder layers' shapes (a Qwen3 config: q/k norms, RoPE, SwiGLU).
        block_size: positions per drafted block (the pending token + ``block_size - 1`` drafts).
        mask_token_id: the token id that fills the block after the pending token.
        target_layer_ids: target layers whose outputs make the context, in concatenation order.
        num_target_layers: the target's layer count the drafter was trained for (None: not given).
    """

    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None

    @classmethod
    def from_hf(cls, d: dict) -> "DFlashConfig":
        """Parse a published z-lab drafter config.json (``dflash_config`` holding ``mask_token_id`` and
        ``target_layer_ids``, ``block_size`` at the top level or in ``dflash_config``).

        Raises:
            UserError: one line: not a DFlash drafter config, another drafter kind (DFlash 2, a causal
                or sliding-window drafter), or a malformed value.
        """
        if not isinstance(d, dict):
            raise UserError("DFlash drafter config.json is not a JSON object")
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise UserError("config.json has no dflash_config: not a DFlash drafter")

        def value(key, default=None):  # the reference's lookup: dflash_config, then the top level
            return dc.get(key, d.get(key, default))

        archs = d.get("architectures") or [ARCHITECTURE]
        if archs != [ARCHITECTURE]:
            raise UserError(f"drafter architectures={archs!r} is not supported (only {ARCHITECTURE}, DFlash 1)")
        for key, neutral in _NEUTRAL.items():
            if value(key, neutral) != neutral:
                raise UserError(f"drafter {key}={value(key)!r} is not supported (only {neutral!r})")
        if d.get("model_type", "qwen3") != "qwen3":
            raise UserError(f"drafter model_type={d['model_type']!r} is not supported (DFlash layers are Qwen3's)")
        # the reference makes a "sliding_attention" layer causal and windowed; published drafters
        # use full non-causal attention on every layer, the only kind implemented here
        model = ModelConfig.from_hf({**d, "model_type": "qwen3"})
        types = d.get("layer_types") or []
        if "sliding_attention" in types or model.sliding_window or d.get("is_causal"):
            raise UserError(
                f"drafter layer_types={types!r}, use_sliding_window={d.get('use_sliding_window')!r}, "
                f"is_causal={d.get('is_causal')!r} is not supported (only non-causal full attention)"
            )
        try:
            mask = value("mask_token_id")
            if mask is None:
                raise UserError("drafter config.json has no mask_token_id (in dflash_config or at the top level)")
            n_target = value("num_target_layers")
            ids = value("target_layer_ids")
            if ids is None:
                if n_target is None:
                    raise UserError("drafter config.json has neither target_layer_ids nor num_target_layers")
                ids = default_target_layer_ids(int(n_target), model.num_hidden_layers)
            block = int(value("block_size", 16))
            cfg = cls(model, block, int(mask), tuple(int(i) for i in ids), None if n_target is None else int(n_target))
        except (TypeError, ValueError) as e:
            raise UserError(f"drafter config.json has a malformed DFlash value: {e}") from None
        if cfg.block_size < 2 or not cfg.target_layer_ids or min(cfg.target_layer_ids) < 0:
            raise UserError(
                f"drafter block_size={cfg.block_size}, target_layer_ids={list(cfg.target_layer_ids)}: "
                "need block_size >= 2 and at least one layer id >= 0"
            )
        return cfg


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a config without ``target_layer_ids`` uses (the reference's
    ``build_target_layer_ids``): one per drafter layer, evenly from layer 1 to layer
    ``num_target_layers - 3``, rounded; the middle layer for a one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashLayer:
    """One drafter layer; linear weights are [out, in] tensors in the drafter's dtype.

    ``kv_proj`` stacks k_proj and v_proj ([2 * kv_heads * head_dim, hidden]) so the context and the
    block get their keys and values from one GEMM each; biases are None without ``attention_bias``.
    """

    input_norm: torch.Tensor
    q_proj: torch.Tensor
    q_bias: torch.Tensor | None
    kv_proj: torch.Tensor
    kv_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


class DFlashDrafter:
    """Weights and forward pass of a DFlash drafter. Build with :meth:`load` or :meth:`from_state_dict`."""

    def __init__(
        self,
        config: DFlashConfig,
        fc: torch.Tensor,
        hidden_norm: torch.Tensor,
        layers: list[DFlashLayer],
        norm: torch.Tensor,
        max_positions: int,
    ):
        self.config, self.fc, self.hidden_norm, self.layers, self.norm = config, fc, hidden_norm, layers, norm
        self.rope_cos, self.rope_sin = rope_tables(config.model, max_positions, fc.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover (context and block positions must stay below it)."""
        return self.rope_cos.shape[0]

    @classmethod
    def load(cls, folder, dtype=torch.bfloat16, device="cpu", max_positions: int | None = None) -> "DFlashDrafter":
        """Load a published drafter folder: ``config.json`` and ``model.safetensors`` (or shards).

        Raises:
            UserError: one line: no such folder, a missing or corrupt file, a config this drafter does
                not implement, missing, unused or wrongly shaped tensors.
        """
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise UserError(f"DFlash drafter folder {folder} does not exist")
        config, sd = load_hf_folder(folder)
        return cls.from_state_dict(config, sd, dtype, device, max_positions)

    @classmethod
    def from_state_dict(
        cls, config: dict, sd: dict[str, torch.Tensor], dtype=torch.bfloat16, device="cpu", max_positions=None
    ) -> "DFlashDrafter":
        """Build from a config.json dictionary and tensors under the reference's names (``fc.weight``,
        ``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...q_norm.weight``,
        ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ...), cast to ``dtype`` on
        ``device``. The RoPE tables cover ``max(max_positions, max_position_embeddings)`` positions
        (plain RoPE goes on past the drafter's own context when the target's is longer).

        Raises:
            UserError: a refused config (see :meth:`DFlashConfig.from_hf`), a missing tensor, a
                tensor the drafter would not use, or a tensor of the wrong shape.
        """
        cfg = DFlashConfig.from_hf(config)
        c = cfg.model
        h, kvh, d, hid, inter = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
        )
        used = set(_IGNORED_TENSORS)

        def get(name, shape):
            if name not in sd:
                raise UserError(f"DFlash drafter checkpoint has no tensor {name!r}")
            used.add(name)
            t = sd[name]
            if tuple(t.shape) != tuple(shape):
                raise UserError(f"DFlash drafter tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            return t.to(device=device, dtype=dtype)

        def bias(name, n):
            return get(name, (n,)) if c.attention_bias else None

        def cat(*ts):
            return None if ts[0] is None else torch.cat(ts)

        layers = []
        for i in range(c.num_hidden_layers):
            p, a = f"layers.{i}.", f"layers.{i}.self_attn."
            layers.append(
                DFlashLayer(
                    input_norm=get(p + "input_layernorm.weight", (hid,)),
                    q_proj=get(a + "q_proj.weight", (h * d, hid)),
                    q_bias=bias(a + "q_proj.bias", h * d),
                    kv_proj=cat(get(a + "k_proj.weight", (kvh * d, hid)), get(a + "v_proj.weight", (kvh * d, hid))),
                    kv_bias=cat(bias(a + "k_proj.bias", kvh * d), bias(a + "v_proj.bias", kvh * d)),
                    q_norm=get(a + "q_norm.weight", (d,)),
                    k_norm=get(a + "k_norm.weight", (d,)),
                    o_proj=get(a + "o_proj.weight", (hid, h * d)),
                    o_bias=bias(a + "o_proj.bias", hid),
                    post_norm=get(p + "post_attention_layernorm.weight", (hid,)),
                    gate_up_proj=torch.cat(
                        [get(p + "mlp.gate_proj.weight", (inter, hid)), get(p + "mlp.up_proj.weight", (inter, hid))]
                    ),
                    down_proj=get(p + "mlp.down_proj.weight", (hid, inter)),
                )
            )
        fc = get("fc.weight", (hid, len(cfg.target_layer_ids) * hid))
        hidden_norm, norm = get("hidden_norm.weight", (hid,)), get("norm.weight", (hid,))
        # a tensor nothing reads means another drafter kind (DFlash 2's convolutions, a selector)
        if unused := sorted(set(sd) - used):
            raise UserError(
                f"DFlash drafter checkpoint has tensor {unused[0]!r}, which a DFlash 1 drafter does not use"
            )
        return cls(cfg, fc, hidden_norm, layers, norm, max(max_positions or 0, c.max_position_embeddings))

    # ------------------------------------------------------------------------------------------ forward

    def _keys_values(self, ops, L: DFlashLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (k_norm, then RoPE) and values [T, kv_heads, head_dim] of hidden rows x [T, hidden]."""
        c = self.config.model
        kv = ops.linear(x, L.kv_proj, L.kv_bias).view(x.shape[0], 2 * c.num_key_value_heads, c.head_dim)
        k, v = kv.split(c.num_key_value_heads, dim=1)
        return rope(ops.rms_norm(k, L.k_norm, c.rms_norm_eps), cos, sin), v

    def context_kv(self, ops, hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values for target hidden states.

        hidden: [T, len(target_layer_ids) * hidden] (the target's captured layer outputs, concatenated
        in ``target_layer_ids`` order); positions: int [T], the positions those states belong to.
        Returns one ``(k, v)`` per layer, each [T, kv_heads, head_dim] in the drafter's dtype, keys
        rotated to their positions (reference: ``fc``/``hidden_norm`` in ``DFlashDraftModel.forward``,
        ``k_ctx``/``v_ctx`` in ``Qwen3DFlashAttention.forward``).
        """
        c = self.config.model
        ctx = ops.rms_norm(ops.linear(hidden.to(self.dtype), self.fc), self.hidden_norm, c.rms_norm_eps)
        cos, sin = self.rope_cos[positions.long()], self.rope_sin[positions.long()]
        return [self._keys_values(ops, L, ctx, cos, sin) for L in self.layers]

    def forward(
        self,
        ops,
        target,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        tokens: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of one drafted block: float32 [B - 1, vocab] for block positions 1..B-1.

        Args:
            ops: a backend module (tileinfer.ops.*).
            target: the target :class:`~tileinfer.models.Transformer`; its ``embed`` embeds the block
                and its ``lm_head`` gives the logits (only these two are read).
            context: per drafter layer ``(k, v)`` [C, kv_heads, head_dim] of the C context positions
                (:meth:`context_kv`; C may be 0).
            tokens: int [B], the pending token then ``mask_token_id`` x (B - 1).
            positions: int [B], the block's positions (the ones right after the context).
        """
        c = self.config.model
        h, d, eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
        B = tokens.shape[0]
        cos, sin = self.rope_cos[positions.long()], self.rope_sin[positions.long()]
        x = ops.embedding(tokens, target.embed).to(self.dtype)
        residual = None
        for L, (ctx_k, ctx_v) in zip(self.layers, context, strict=True):
            if residual is None:
                hs, residual = ops.rms_norm(x, L.input_norm, eps), x
            else:
                hs, residual = ops.add_rms_norm(x, residual, L.input_norm, eps)
            q = rope(ops.rms_norm(ops.linear(hs, L.q_proj, L.q_bias).view(B, h, d), L.q_norm, eps), cos, sin)
            k, v = self._keys_values(ops, L, hs, cos, sin)
            o = block_attention(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), d**-0.5)
            x = ops.linear(o.reshape(B, h * d), L.o_proj, L.o_bias)
            hs, residual = ops.add_rms_norm(x, residual, L.post_norm, eps)
            x = ops.linear(ops.swiglu(hs, L.gate_up_proj), L.down_proj)
        # position 0 holds the pending token, whose prediction the target makes itself
        hs, _ = ops.add_rms_norm(x[1:], residual[1:], self.norm, eps)
        return ops.lm_head(hs, target.lm_head)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Non-causal GQA attention of a block over [context + block] keys: every query sees every key.

    q: [B, heads, d]; k, v: [N, kv_heads, d]; query head j reads kv head ``j // (heads / kv_heads)``
    (transformers' ``repeat_kv``). Scores and softmax in float32; returns [B, heads, d] in q's dtype.
    """
    B, heads, d = q.shape
    kv_heads = k.shape[1]
    qf = q.float().view(B, kv_heads, heads // kv_heads, d).permute(1, 2, 0, 3)  # [kv_heads, group, B, d]
    kf, vf = k.float().permute(1, 0, 2)[:, None], v.float().permute(1, 0, 2)[:, None]  # [kv_heads, 1, N, d]
    p = torch.softmax((qf @ kf.transpose(-1, -2)) * sm_scale, dim=-1)
    return (p @ vf).permute(2, 0, 1, 3).reshape(B, heads, d).to(q.dtype)
