"""Command line: ``python -m quantize MODEL --out DIR`` writes a quantized checkpoint folder.

MODEL is a registered model name (``conf/model/NAME.yaml``, fetched with ``tileinfer.pull``) or a
path to a .gguf file or Hugging Face folder. See quantize.checkpoint for what the folder holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from quantize.checkpoint import WEIGHTS_FILE, check_out, quantization_config, write_checkpoint
from quantize.scheme import DEFAULT_CALIBRATION_TOKENS, PRECISIONS, QuantScheme, apply
from quantize.smoothing import DEFAULT_ALPHA
from tileinfer.core import files
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.fetch import pull

PROG = "python -m quantize"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description="Write an INT8-quantized checkpoint folder.")
    p.add_argument("model", help="registered model name, .gguf file or Hugging Face folder")
    p.add_argument("--out", required=True, type=Path, help="folder to write (must not exist or be empty)")
    p.add_argument("--weights", choices=PRECISIONS, default="int8", help="linear weights (default int8)")
    p.add_argument("--kv-cache", choices=PRECISIONS, default="int8", help="KV cache (default int8)")
    p.add_argument(
        "--smooth-keys",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fold calibrated key scales into q/k (only with an INT8 KV cache; default on)",
    )
    p.add_argument(
        "--smooth-alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help=f"migration strength, s = max|k|^alpha (default {DEFAULT_ALPHA})",
    )
    p.add_argument("--calibration", help="calibration text file (default: the built-in text)")
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_CALIBRATION_TOKENS,
        help=f"calibration tokens to run (default {DEFAULT_CALIBRATION_TOKENS})",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p.parse_args(argv)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run(args: argparse.Namespace) -> None:
    """Quantize and write; raises UserError for the user's mistakes."""
    start = time.perf_counter()
    spec = QuantScheme(
        args.weights, args.kv_cache, args.smooth_keys, args.smooth_alpha, args.calibration, args.calibration_tokens
    )
    out = args.out
    check_out(out, args.force)  # before any work
    files.check_writable(out.resolve().parent)  # a read-only or forbidden place, before minutes of work
    from tileinfer.core.tokenizer import Tokenizer  # deferred: only the CLI needs it

    path = pull(args.model)
    checkpoint = load_checkpoint(path)
    tokenizer = Tokenizer.load(path)
    before = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in checkpoint.state_dict.values())
    state_dict, info = apply(checkpoint, None, spec, tokenizer, progress=True)
    write_checkpoint(
        out, state_dict, checkpoint.hf_config, quantization_config(info, path), tokenizer, force=args.force
    )
    after = (out / WEIGHTS_FILE).stat().st_size
    s = info["spec"]
    print(f"wrote {out}: weights {s.weights}, KV cache {s.kv_cache}, smoothed keys {'on' if s.smoothing else 'off'}")
    print(f"  {_mb(before)} as BF16 -> {_mb(after)} ({WEIGHTS_FILE}); {len(info['quantized'])} tensors quantized")
    if s.smoothing:
        print(
            f"  calibration: {info['calibration_tokens']} tokens in {info['calibration_seconds']:.1f} s "
            f"(alpha {s.smooth_alpha})"
        )
    print(f"  total {time.perf_counter() - start:.1f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    from tileinfer.cli import exit_on_error  # the command layer's errors and exit codes (pyproject: ignore_imports)

    with exit_on_error(PROG):
        run(args)


if __name__ == "__main__":
    sys.exit(main())
