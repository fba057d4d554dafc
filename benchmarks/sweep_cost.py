"""How long one sweep job takes, per ctx, before starting it: ``python -m benchmarks.sweep_cost``.

A job's work per prompt (tileinfer.jobs.drift) is: the base prefill of ``ctx`` tokens, its greedy
reply (``n_score`` decode steps), the reply run teacher-forced, then the same prefill and
teacher-forced pass on the candidate, and ``decode_tokens`` decode steps timed ``speed.repeats`` times. This times one
prefill chunk and one decode step of each configuration at a few positions of each ctx, on a
random-weight model of a registered model's shapes (the time does not depend on the values; the
KV cache is filled with zeros), and adds them up over the positions a job visits (a chunk's cost
is interpolated linearly in its position; attention makes it grow with it). The estimate is for the
default two prompt sets, a reply of the full ``n_score`` and the warm-up; a cached base reply or
base logits shortens it. Prints and saves a table (Markdown and Parquet).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from benchmarks.ops import save
from quantize import NAMED, apply, named_scheme
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.registry import model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer


def _time(fn, reps: int) -> float:
    if torch.cuda.is_available():
        fn()  # first call: kernel compilation, allocator
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def step_seconds(runner: ModelRunner, pos: int, n: int, reps: int) -> float:
    """Seconds of one forward step of ``n`` tokens at positions [pos, pos + n)."""
    seq = runner.new_sequence()
    seq.reserve(pos + n)
    tokens = torch.ones(n, dtype=torch.long)

    def one():
        seq.length = pos
        runner.step(seq, tokens, slice(-1, None))

    try:
        return _time(one, reps)
    finally:
        seq.release()


def pass_seconds(runner: ModelRunner, start: int, n_tokens: int, chunk: int, probes: int = 2) -> float:
    """Seconds to run ``n_tokens`` tokens from position ``start`` in steps of ``chunk`` tokens."""
    if n_tokens <= 0:
        return 0.0
    starts = np.arange(start, start + n_tokens, chunk)
    at = np.unique(np.linspace(starts[0], starts[-1], probes).astype(int))
    cost = [step_seconds(runner, int(p), min(chunk, start + n_tokens - int(p)), reps=1) for p in at]
    return float(np.interp(starts, at, cost).sum())


def job_seconds(
    base: ModelRunner, cand: ModelRunner, ctx: int, n_score: int, decode_tokens: int, repeats: int = 5
) -> dict:
    """Seconds of each stage of one prompt of a job (see the module docstring); the decode steps are
    timed ``repeats`` times (``speed.repeats``)."""
    chunk = base.prefill_chunk
    return {
        "base_prefill_s": pass_seconds(base, 0, ctx, chunk),
        "base_reply_s": pass_seconds(base, ctx, n_score - 1, 1),
        "base_score_s": pass_seconds(base, ctx, n_score - 1, chunk),
        "cand_prefill_s": pass_seconds(cand, 0, ctx, chunk),
        "cand_score_s": pass_seconds(cand, ctx, n_score - 1, chunk),
        "cand_decode_s": repeats * pass_seconds(cand, ctx, decode_tokens, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a registered model (its shapes)")
    p.add_argument("--ctx", default="1024,8192,32768", help="comma-separated prompt lengths")
    p.add_argument("--quant", default="int8_both", choices=list(NAMED), help="the candidate's preset")
    p.add_argument("--n-score", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=5, help="speed.repeats")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prompt-sets", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results", help="folder for the table")
    p.add_argument("--name", default=None, help="file name of the table (default sweep-cost-MODEL-DEVICE)")
    args = p.parse_args(argv)
    try:
        hf = model_entry(args.model)["config"]
    except UserError as e:
        p.error(f"--model: {e}")
    cfg = ModelConfig.from_hf(hf)
    sd = random_state_dict(hf, seed=0, dtype=torch.bfloat16)
    tail = max(args.n_score, args.decode_tokens)
    # as the sweep does (tileinfer.jobs.job.fit_ctx): the prompt is shortened so the window fits
    ctxs = [min(int(c), cfg.max_position_embeddings - tail) for c in args.ctx.split(",")]
    max_len = max(ctxs) + tail
    kw = dict(max_seq_len=max_len, prefill_chunk=args.prefill_chunk)
    base_model = Transformer.from_state_dict(cfg, sd, dtype=torch.bfloat16)
    scheme = named_scheme(args.quant)
    cand_sd, _ = apply(sd, cfg, scheme)
    cand_model = Transformer.from_state_dict(cfg, cand_sd, dtype=torch.bfloat16)
    base = ModelRunner(base_model, "reference", **kw)
    cand = ModelRunner(cand_model, "reference", kv_int8=scheme.kv_cache == "int8", **kw)
    rows = []
    for ctx in ctxs:
        stages = job_seconds(base, cand, ctx, args.n_score, args.decode_tokens, args.decode_repeats)
        total = args.prompt_sets * sum(stages.values())
        kv_bytes = (base.kv.bytes_per_position() + cand.kv.bytes_per_position()) * (ctx + args.n_score)
        rows.append(
            {
                "model": args.model,
                "quant": args.quant,
                "ctx": ctx,
                "threads": torch.get_num_threads(),
                **{k: round(v, 1) for k, v in stages.items()},
                "job_min": round(total / 60, 1),
                "kv_cache_gib": round(kv_bytes / 2**30, 2),
                "snapshot_gib": round(base.kv.bytes_per_position() * (ctx + args.n_score) / 2**30, 2),
            }
        )
        print(rows[-1], flush=True)
    device = "cpu" if not torch.cuda.is_available() else "cuda"
    name = args.name or f"sweep-cost-{args.model}-{device}{torch.get_num_threads()}t"
    save(rows, args.out, name, header=f"`python -m benchmarks.sweep_cost {' '.join(sys.argv[1:])}`\n\n")
    print(f"saved {args.out}/{name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
