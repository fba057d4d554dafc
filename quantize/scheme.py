"""What to quantize (:class:`QuantScheme`) and :func:`apply`, which turns float weights into it.

One spec is one point of a quantization sweep: weight precision, KV-cache precision, and whether
the keys are smoothed for the INT8 cache (see quantize.smoothing). :func:`apply` works in memory on
a state dict, so a sweep can build every variant without writing checkpoints; quantize.checkpoint
writes the result to disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from quantize.smoothing import DEFAULT_ALPHA, fold_key_scales, key_absmax, smoothing_scales
from quantize.weights import quantize_weights
from tileinfer.core.checkpoint import Checkpoint
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError

PRECISIONS = ("bf16", "int8")
BUILTIN_CALIBRATION = "builtin"  # how the built-in calibration text is named in records
# Calibration tokens by default: enough for stable per-channel maxima (QServe calibrates on a few
# hundred thousand tokens of Pile for W4A8KV4; an INT8 cache is far less sensitive), and a few
# seconds for a 0.5B model on a CPU.
DEFAULT_CALIBRATION_TOKENS = 2048


@dataclass(frozen=True)
class QuantScheme:
    """A quantization configuration.

    Attributes:
        weights: "bf16", or "int8" (every linear layer and the lm_head; quantize.weights).
        kv_cache: "bf16", or "int8" (one float32 scale per cached vector; the engine's
            ``ModelRunner(kv_int8=True)``).
        smooth_keys: fold calibrated power-of-two key scales into the q/k path (quantize.smoothing).
            Only takes effect with an INT8 KV cache.
        smooth_alpha: migration strength of the key scales, ``s = max|k|^alpha``, in [0, 1].
        calibration: path of a UTF-8 calibration text, or None for the built-in text
            (``evals.prompts.calibration_text()``).
        calibration_tokens: how many tokens of the calibration text to run (the first ones).

    Raises:
        UserError: an unknown precision, alpha outside [0, 1], or calibration_tokens < 1.
    """

    weights: str
    kv_cache: str
    smooth_keys: bool = True
    smooth_alpha: float = DEFAULT_ALPHA
    calibration: str | None = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS

    def __post_init__(self):
        for name in ("weights", "kv_cache"):
            if getattr(self, name) not in PRECISIONS:
                raise UserError(f"{name} must be one of {', '.join(PRECISIONS)}, not {getattr(self, name)!r}")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise UserError(f"smooth_alpha must be in [0, 1], not {self.smooth_alpha}")
        if self.calibration_tokens < 1:
            raise UserError(f"calibration_tokens must be at least 1, not {self.calibration_tokens}")

    def is_unquantized(self) -> bool:
        """Whether nothing is quantized (BF16 weights and KV cache): the model as it comes."""
        return self.weights == "bf16" and self.kv_cache == "bf16"

    @property
    def smoothing(self) -> bool:
        """Whether keys are actually smoothed: asked for, and the KV cache is INT8."""
        return self.smooth_keys and self.kv_cache == "int8"

    def effective(self) -> "QuantScheme":
        """The spec with settings that have no effect reset to their defaults.

        Without smoothing (off, or a BF16 cache) ``smooth_keys`` becomes False and the alpha and
        calibration settings their defaults, so two specs that build the same model compare equal.
        """
        if self.smoothing:
            return self
        return replace(
            self,
            smooth_keys=False,
            smooth_alpha=DEFAULT_ALPHA,
            calibration=None,
            calibration_tokens=DEFAULT_CALIBRATION_TOKENS,
        )


# The presets of conf/quant/*.yaml by name, (weights, kv_cache): the sweep's check of a named config
# (tileinfer.jobs.schema) and the benchmarks' --quants lists, which name them without a Hydra config
# (tests/test_quantize.py checks they agree with the YAML files).
NAMED = {
    "bf16": ("bf16", "bf16"),
    "int8_weights": ("int8", "bf16"),
    "int8_kv": ("bf16", "int8"),
    "int8_both": ("int8", "int8"),
}


def named_scheme(name: str) -> QuantScheme:
    """The unsmoothed :class:`QuantScheme` of the preset ``name`` (:data:`NAMED`).

    Raises:
        UserError: ``name`` is not a preset.
    """
    if name not in NAMED:
        raise UserError(f"unknown quantization {name!r}; known: {', '.join(NAMED)}")
    weights, kv_cache = NAMED[name]
    return QuantScheme(weights, kv_cache, smooth_keys=False)


def calibration_text(path: str | None) -> str:
    """The calibration text: the file at ``path``, or the built-in one when None.

    Raises:
        UserError: the file does not exist or is not UTF-8 text.
    """
    if path is None:
        from evals.prompts import calibration_text as builtin

        return builtin()
    p = Path(path)
    if not p.is_file():
        raise UserError(f"calibration file {path} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"calibration file {path} is not UTF-8 text: {e}") from None


def apply(
    source: Checkpoint | dict[str, torch.Tensor],
    config: ModelConfig | None,
    spec: QuantScheme,
    tokenizer=None,
    progress: bool = False,
    device="cpu",
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize a float model in memory: smooth the keys (if effective), then quantize the weights.

    Args:
        source: a loaded :class:`~tileinfer.core.checkpoint.Checkpoint` or its state dict (float tensors
            under transformers' names; not modified).
        config: the model's shapes; None takes the checkpoint's.
        spec: what to do; its :meth:`QuantScheme.effective` form is applied.
        tokenizer: encodes the calibration text (``encode(text, add_special_tokens=False)``);
            needed only when keys are smoothed.
        progress: show tqdm bars.
        device: where the calibration run happens (the weights stay where they are). Another
            device rounds the BF16 run differently, so a key scale whose channel max sits at a
            rounding boundary can come out differently.

    Returns:
        ``(state_dict, info)``. ``state_dict`` is a new dict the engine's
        ``Transformer.from_state_dict`` builds: int8 ``X.weight`` with float32 ``X.weight_scale``;
        smoothed q/k weights or per-head q/k norm weights; ``model.layers.{i}.self_attn.k_smooth``
        scales. ``info`` is a dict:

        - ``spec``: the effective spec that was applied;
        - ``quantized``: names of the weights turned into int8 (empty with BF16 weights);
        - ``calibration_tokens``: tokens run to calibrate the key scales (0 without smoothing);
        - ``calibration_seconds``: wall time of that run (0.0 without smoothing);
        - ``key_scales``: float32 [num_layers, num_kv_heads, head_dim] powers of two, or None.

        The KV-cache precision is not in the weights: run the model with
        ``ModelRunner(kv_int8=spec.kv_cache == "int8")``.

    Raises:
        UserError: the source is already int8; smoothing without a tokenizer; an unreadable or
            empty calibration text, or one shorter than ``calibration_tokens``; a tensor missing.
    """
    if isinstance(source, Checkpoint):
        config = config or source.config
        source = source.state_dict
    if config is None:
        raise UserError("apply() needs the model config when given a bare state dict")
    if any(t.dtype == torch.int8 for t in source.values()):
        raise UserError("the checkpoint is already quantized (it has int8 tensors); start from a float one")
    spec = spec.effective()
    info = dict(spec=spec, quantized=[], calibration_tokens=0, calibration_seconds=0.0, key_scales=None)
    sd = dict(source)
    if spec.smoothing:
        if tokenizer is None:
            raise UserError("key smoothing needs a tokenizer to encode the calibration text")
        ids = list(tokenizer.encode(calibration_text(spec.calibration), add_special_tokens=False))
        if len(ids) < spec.calibration_tokens:  # rows record the setting: it must be what ran
            raise UserError(
                f"the calibration text {spec.calibration or '(built-in)'} is only {len(ids)} tokens, fewer than "
                f"calibration_tokens={spec.calibration_tokens}: use a longer text or fewer tokens"
            )
        ids = ids[: spec.calibration_tokens]
        start = time.perf_counter()
        scales = smoothing_scales(key_absmax(sd, config, ids, device=device, progress=progress), spec.smooth_alpha)
        info.update(calibration_seconds=time.perf_counter() - start, calibration_tokens=len(ids), key_scales=scales)
        sd = fold_key_scales(sd, config, scales)
    if spec.weights == "int8":
        sd, info["quantized"] = quantize_weights(sd, config, progress=progress)
    return sd, info
