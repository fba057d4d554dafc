"""Model hyper-parameters, read from a Hugging Face ``config.json`` dictionary.

One :class:`ModelConfig` describes every supported decoder: Llama (Llama 3, SmolLM2), Mistral,
Qwen2/Qwen2.5 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k). The field names follow
transformers' configs so a reader can check them against ``config.json`` directly.

The engine computes what transformers' ``modeling_<arch>.py`` computes for the config's
``model_type``. A config.json field the engine ignored would give a silently wrong row, so every
field that changes the math is either implemented exactly (read as transformers reads it, with
its per-architecture default when absent) or refused: :meth:`ModelConfig.from_hf` raises a
:class:`UserError` naming the field and its value. The table below says which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tileinfer.core.errors import UserError

# config.json fields, as transformers v5's configuration_<arch>.py / modeling_<arch>.py and
# modeling_rope_utils.py read them (llama, mistral, qwen2, qwen3):
#
# implemented  vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
#              num_key_value_heads, head_dim, rms_norm_eps, max_position_embeddings,
#              tie_word_embeddings (a stored lm_head.weight is used, as transformers does when it
#              differs from the embeddings), attention_bias (see Arch), rope_theta, the rope
#              settings in rope_scaling (legacy, wins) or rope_parameters (v5), rope_type or its
#              legacy spelling type: default, linear, llama3, and dynamic (plain RoPE up to
#              max_position_embeddings, past which the engine never runs), partial_rotary_factor
#              giving the whole head_dim, sliding_window / use_sliding_window / max_window_layers /
#              layer_types (an active window is a limit: the runner refuses longer sequences, so
#              every row it computes is exact), hidden_act silu (or its alias swish),
#              quantization_config of this project's tileinfer-int8 checkpoints.
# refused      any rope type but those (yarn, longrope, ...: they also rescale attention), rope
#              settings nested per layer type, a partial rotary factor, another hidden_act,
#              mlp_bias true (the swiglu op of tileinfer.ops takes no bias), a bias key that
#              contradicts what the architecture's code does (Arch), another quant_method, and the
#              _FOREIGN fields below.
# no effect    attention_dropout (training only), pretraining_tp (splits the same products across
#              devices; transformers v5 no longer reads it), initializer_range, use_cache,
#              torch_dtype/dtype (the engine's dtype is a job setting), bos/eos/pad_token_id (the
#              tokenizer's), architectures, transformers_version and other bookkeeping.
# GGUF metadata gets the same treatment: GGUF_KEYS in tileinfer/core/checkpoint/gguf_file.py.

# Fields of other architectures (Gemma, Granite) that transformers' code for these four ignores
# although they change the math: set to anything but their neutral value, neither transformers
# nor this engine would compute the model they describe. field -> neutral value.
_FOREIGN = {
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "attention_multiplier": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
}
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
# quant_method of the checkpoints ``python -m quantize`` writes (quantize.checkpoint.QUANT_METHOD,
# which tileinfer.core may not import; a test keeps the two equal).
QUANT_METHOD = "tileinfer-int8"


@dataclass(frozen=True)
class Arch:
    """What transformers' code for one ``model_type`` does with the fields that differ by architecture.

    Attributes:
        qkv_bias, o_bias: the config key that switches the q/k/v (o_proj) biases on, or a bool when
            the architecture always (never) has them; a config that sets ``attention_bias`` to
            contradict a fixed bool is refused, since transformers would ignore the key.
        qk_norm: per-head RMSNorm of q and k before RoPE.
        window: ``"all"``: ``sliding_window`` covers every layer (Mistral; Llama's code ignores
            it, and the engine keeps it as a length limit, which is exact below it);
            ``"layers"``: only with ``use_sliding_window``, on the layers ``layer_types`` marks
            ``sliding_attention`` (by default those from ``max_window_layers`` on).
        defaults: transformers' defaults of the keys a config.json may omit, where they differ
            from the common ones (``num_key_value_heads``/``head_dim`` None: derived from the heads).
    """

    qkv_bias: str | bool
    o_bias: str | bool
    qk_norm: bool
    window: str
    defaults: dict


ARCHITECTURES = {
    "llama": Arch("attention_bias", "attention_bias", False, "all", dict(max_position_embeddings=2048)),
    "mistral": Arch(
        False, False, False, "all", dict(num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096)
    ),
    "qwen2": Arch(
        True, False, False, "layers", dict(num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096)
    ),
    "qwen3": Arch(
        "attention_bias",
        "attention_bias",
        True,
        "layers",
        dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, sliding_window=4096),
    ),
}
_COMMON_DEFAULTS = dict(
    num_key_value_heads=None,
    head_dim=None,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    sliding_window=None,
    use_sliding_window=False,
    max_window_layers=28,
)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer.

    Attributes mirror transformers' ``config.json`` keys, resolved as transformers resolves them
    (see :meth:`from_hf`). ``attention_bias``: biases on q/k/v; ``o_proj_bias``: a bias on o_proj.
    ``rope_scaling`` is None (plain RoPE) or ``{"rope_type": "linear", "factor"}`` or
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``. ``sliding_window`` is None when the model attends to its
    whole context, else the length past which the engine refuses to run.
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
    o_proj_bias: bool = False
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def tensor_names(self) -> list[str]:
        """transformers' names of every tensor this config needs (``lm_head.weight`` only when the
        embeddings are untied; a tied checkpoint may still carry one, see ``tie_word_embeddings``)."""
        per_layer = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{n}_proj.weight" for n in "qkvo"),
            *(f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
        ]
        if self.attention_bias:
            per_layer += [f"self_attn.{n}_proj.bias" for n in "qkv"]
        if self.o_proj_bias:
            per_layer.append("self_attn.o_proj.bias")
        if self.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        return names + [f"model.layers.{i}.{p}" for i in range(self.num_hidden_layers) for p in per_layer]

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a transformers ``config.json`` dictionary (see the table at the top of this
        module for every field that changes the math).

        Raises:
            UserError: one line naming the field: an unknown ``model_type``, a missing required
                key, a malformed value, or a refused setting.
        """
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise UserError(f"unknown architecture {mt!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        arch = ARCHITECTURES[mt]
        defaults = _COMMON_DEFAULTS | arch.defaults
        try:
            return cls._from_hf(d, mt, arch, lambda key: d[key] if key in d else defaults[key])
        except KeyError as e:
            raise UserError(f"config.json has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"config.json has a malformed value: {e}") from None

    @classmethod
    def _from_hf(cls, d: dict, mt: str, arch: Arch, get) -> "ModelConfig":
        for key, neutral in _FOREIGN.items():
            if d.get(key, neutral) != neutral:
                raise UserError(f"{key}={d[key]!r} is not supported (transformers' {mt} code ignores it too)")
        if get("hidden_act") not in ("silu", "swish"):
            raise UserError(f"hidden_act={d['hidden_act']!r} is not supported (the MLP is SwiGLU with silu)")
        if d.get("mlp_bias"):
            raise UserError(f"mlp_bias={d['mlp_bias']!r} is not supported (the swiglu op takes no bias)")
        qkv_bias, o_bias = (bool(d.get(r, False)) if isinstance(r, str) else r for r in (arch.qkv_bias, arch.o_bias))
        if not isinstance(arch.qkv_bias, str) and bool(d.get("attention_bias", qkv_bias)) != qkv_bias:
            raise UserError(
                f"attention_bias={d['attention_bias']!r} contradicts the {mt} architecture, whose q/k/v "
                f"projections {'always' if qkv_bias else 'never'} have a bias (transformers ignores the key)"
            )
        _check_quantization(d.get("quantization_config"))
        heads, hidden, layers = int(d["num_attention_heads"]), int(d["hidden_size"]), int(d["num_hidden_layers"])
        head_dim = int(get("head_dim") or hidden // heads)
        kv_heads = int(get("num_key_value_heads") or heads)
        if kv_heads < 1 or heads % kv_heads:
            # GQA shares each KV head among heads // kv_heads query heads; no model has a remainder
            raise UserError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
        max_pos = int(get("max_position_embeddings"))
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        theta, scaling = _rope(d, head_dim, max_pos)
        return cls(
            model_type=mt,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=qkv_bias,
            qk_norm=arch.qk_norm,
            o_proj_bias=o_bias,
            rope_scaling=scaling,
            sliding_window=_window(d, arch, get, layers),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )


def _rope(d: dict, head_dim: int, max_pos: int) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` as transformers' ``convert_rope_params_to_dict`` and
    ``standardize_rope_params`` resolve them: a legacy ``rope_scaling`` replaces ``rope_parameters``,
    and keys inside that dict win over the top-level ``rope_theta``/``partial_rotary_factor``."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    source = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UserError(f"{source}={params!r} is not supported (one set of rope settings for all layers only)")
    theta = float(params.get("rope_theta") or d.get("rope_theta") or _COMMON_DEFAULTS["rope_theta"])
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and int(head_dim * float(partial)) != head_dim:
        raise UserError(f"partial_rotary_factor={partial!r} is not supported (RoPE over the whole head_dim only)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source} rope_type={kind!r} is not supported (only {', '.join(ROPE_TYPES)})")
    if kind in ("linear", "llama3", "dynamic"):  # transformers' validation: a factor below 1 is an error
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
            raise UserError(f"{source} {kind} factor={factor!r}: expected a number >= 1")
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        return theta, {
            "rope_type": "llama3",
            **{k: float(params[k]) for k in keys},
            "original_max_position_embeddings": int(params.get("original_max_position_embeddings") or max_pos),
        }
    # "dynamic" (NTK) recomputes the frequencies only for sequences past max_position_embeddings;
    # up to it they are plain RoPE's, and the engine never runs past it (ModelRunner refuses).
    return theta, None


def _window(d: dict, arch: Arch, get, layers: int) -> int | None:
    """The sliding window some layer applies, as transformers' config and attention code decide."""
    types = d.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or len(types) != layers or set(types) - {"full_attention", "sliding_attention"}
    ):
        raise UserError(f"layer_types={types!r} is not supported (one of full_attention/sliding_attention per layer)")
    if arch.window == "all":
        window = get("sliding_window")
    else:  # Qwen2/Qwen3: the window exists only with use_sliding_window, on the layers marked sliding
        window = get("sliding_window") if get("use_sliding_window") else None
        first = int(get("max_window_layers"))
        types = types or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if "sliding_attention" not in types:
            window = None
    return int(window) if window else None


def _check_quantization(qc) -> None:
    """Only this project's own quantized checkpoints: another method (GPTQ, AWQ, FP8, ...) stores
    tensors the engine would read as plain weights."""
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise UserError(
            f"quantization_config quant_method={method!r} is not supported "
            f"(only {QUANT_METHOD} checkpoints written by python -m quantize)"
        )
