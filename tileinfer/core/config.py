"""Model hyper-parameters, read from a Hugging Face ``config.json`` dictionary.

One :class:`ModelConfig` describes every supported decoder: Llama (Llama 3, SmolLM2), Mistral,
Qwen2/Qwen2.5 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k, no bias). The field names
follow transformers' configs so a reader can check them against ``config.json`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tileinfer.core.errors import UserError

# model_type -> (attention bias on q/k/v, per-head q/k RMSNorm)
ARCHITECTURES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer.

    Attributes mirror transformers' ``config.json`` keys. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``. ``rope_scaling`` is None or the ``rope_scaling`` dict of
    the config (only ``rope_type == "llama3"`` changes the frequencies; ``"default"`` is plain RoPE).
    ``sliding_window`` is None when the model attends to its whole context.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a transformers ``config.json`` dictionary.

        Raises:
            UserError: unknown ``model_type`` or a missing required key.
        """
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise UserError(f"unknown architecture {mt!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        bias, qk_norm = ARCHITECTURES[mt]
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            scaling = d.get("rope_scaling") or None
            rope_params = d.get("rope_parameters")  # transformers >= 5 nests rope settings here
            theta = d.get("rope_theta")
            if isinstance(rope_params, dict):
                theta = theta or rope_params.get("rope_theta")
                if rope_params.get("rope_type", "default") != "default":
                    scaling = scaling or rope_params
            window = d.get("sliding_window") if d.get("use_sliding_window", mt == "mistral") else None
            return cls(
                model_type=mt,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta or 10000.0),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", bias)),
                qk_norm=qk_norm,
                rope_scaling=scaling
                if scaling and scaling.get("rope_type", scaling.get("type")) != "default"
                else None,
                sliding_window=int(window) if window else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos,
            )
        except KeyError as e:
            raise UserError(f"config.json has no {e.args[0]!r}") from None
