"""Whole-prompt prefill speed against the runner's chunk size (``prefill_chunk``), in one process (H200).

    python -m benchmarks.prefill_chunks --models qwen3-4b-random,qwen3-8b-random --chunks 512,1024,2048 \
        --tokens 8192 --out runs/bench

Random weights with the registered shapes; one sequence of ``--tokens`` prompt tokens prefilled
in chunks, after one untimed prefill (compilation). Reports the median of ``--reps`` prefills in
ms and tok/s and the ratio to the first chunk size; writes OUT/prefill-chunks.md and .parquet.
``--variant NAME=BACKEND.FIELD=LITERAL[;...]`` (repeatable, as in ``benchmarks.decode_ab``) runs every
row again on backends whose tuning has those fields; the shipped tuning runs first as ``shipped``,
and each row also gives its ratio to the shipped row of the same model, quant, backend and chunk.
The jobs prefill with the runner's default chunk (512): the GEMM tables were tuned at 1,024.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.decode import contexts_arg, positive_int, refuse_unknown
from benchmarks.decode_ab import parse_variant, refuse_variant_names, variant_backend
from benchmarks.ops import save
from quantize import NAMED, apply, named_scheme
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.registry import model_config, model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer


def prefill_ms(runner: ModelRunner, tokens: list[int], reps: int) -> float:
    """Median wall time of prefilling ``tokens`` into a fresh sequence, ms (one untimed run first)."""
    times = []
    for i in range(reps + 1):
        seq = runner.new_sequence()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(seq, tokens)
        torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        seq.release()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random,qwen3-8b-random")
    p.add_argument("--backends", default="triton")
    p.add_argument("--quants", default="bf16,int8_both")
    p.add_argument("--chunks", type=contexts_arg, default="512,1024,2048", help="token counts (512 or 1k)")
    p.add_argument("--tokens", type=positive_int, default=8192)
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument(
        "--variant", type=parse_variant, action="append", default=[], help="NAME=BACKEND.FIELD=LITERAL[;...]"
    )
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args()
    refuse_variant_names(p, a.variant)
    refuse_unknown(p, a.quants, NAMED, a.models)
    if not torch.cuda.is_available():
        print("no CUDA device: the prefill benchmark needs a GPU", file=sys.stderr)
        raise SystemExit(2)
    variants = [("shipped", {})] + a.variant
    tokens = torch.randint(0, 1000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    header = f"Device {torch.cuda.get_device_name()}.\n\n"
    rows = []
    for name in a.models.split(","):
        config = model_config(name)
        sd = random_state_dict(model_entry(name)["config"], seed=0, device="cuda")
        for quant in a.quants.split(","):
            scheme = named_scheme(quant)
            weights = sd if scheme.weights == "bf16" else apply(sd, config, scheme)[0]
            model = Transformer.from_state_dict(config, weights, device="cuda")
            for backend in a.backends.split(","):
                shipped = {}
                for variant, changes in variants:
                    base = None
                    for chunk in a.chunks:
                        runner = ModelRunner(
                            model,
                            variant_backend(backend, changes),
                            kv_int8=scheme.kv_cache == "int8",
                            max_seq_len=a.tokens + 2,
                            prefill_chunk=chunk,
                        )
                        ms = prefill_ms(runner, tokens, a.reps)
                        base = base or ms
                        shipped.setdefault(chunk, ms)
                        row = dict(
                            model=name, quant=quant, backend=backend, variant=variant, tokens=a.tokens, chunk=chunk
                        )
                        row |= dict(
                            ms=round(ms, 2), tok_s=round(a.tokens / ms * 1e3), vs_first_chunk=round(base / ms, 3)
                        )
                        row |= dict(vs_shipped=round(shipped[chunk] / ms, 3))
                        rows.append(row)
                        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                        del runner
            del model, weights
            torch.cuda.empty_cache()
            save(rows, a.out, "prefill-chunks", header)  # after each quant, so a run cut short keeps what it measured


if __name__ == "__main__":
    main()
