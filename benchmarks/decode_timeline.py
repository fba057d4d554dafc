"""Where a decode step's time goes: each kernel's share of the replayed decode graph's timeline (GPU).

    python -m benchmarks.decode_timeline --models qwen3-4b-random --quants bf16,int8_weights \
        --contexts 1024,32768 --steps 16 --out runs/timeline

Builds the runners of ``python -m benchmarks.decode`` (random weights, cache prefilled with
``ctx`` tokens), replays ``steps`` decode steps from the captured graph under ``torch.profiler``
(CUPTI records each kernel of a graph), and attributes the timeline to kernels by their *exclusive*
time: a kernel's end minus the previous kernel's end. Under programmatic dependent launch a kernel
starts before its predecessor ends, so durations overlap and do not add up; exclusive times add up to
the step. A kernel is named by its position in the step: ``L.j name`` for the j-th launch of a
transformer layer (summed over the layers), ``pre`` / ``post`` for the launches before the first and
after the last layer, so the GEMVs of one layer (one Triton kernel name) stay apart.
Writes OUT/timeline.md and .parquet: per model, quant, backend, context and kernel position, the
launches per step, exclusive us per step and per launch, and the share of the step; prints the table.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import polars as pl
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode import contexts_arg, each_runner, positive_int
from benchmarks.ops import save


def kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel the profiler recorded, in start order."""
    out = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))
    ]
    return sorted(out, key=lambda k: k[1])


def positions(names: list[str], steps: int, layers: int) -> list[str]:
    """The position label of each kernel of ``steps`` equal steps (see the module docstring).

    Raises:
        ValueError: the kernels do not split into ``steps`` equal steps of ``layers`` equal layers
            plus the same launches before and after.
    """
    n = len(names) // steps
    if n * steps != len(names) or names[:n] * steps != names:
        raise ValueError(f"{len(names)} kernels do not form {steps} equal steps")
    step = names[:n]
    # the layer pattern: the longest period that repeats `layers` times (a layer with two equal
    # launches in a row also repeats a half-length period); what is left goes before/after
    for per in range(n // layers, 0, -1):
        for pre in range(0, n - per * layers + 1):
            body = step[pre : pre + per * layers]
            if body == step[pre : pre + per] * layers:
                post = n - pre - per * layers
                labels = [f"pre.{i} {step[i]}" for i in range(pre)]
                labels += [f"L.{i % per} {step[pre + i % per]}" for i in range(per * layers)]
                labels += [f"post.{i} {step[pre + per * layers + i]}" for i in range(post)]
                return labels * steps
    raise ValueError("no kernel pattern repeats once per layer")


def timeline(runner, seq, step_tokens: list[int]) -> pl.DataFrame:
    """Exclusive time per kernel position over the replayed steps (first two untimed)."""
    for t in step_tokens[:2]:
        runner.decode(seq, t)
    runner.synchronize()
    start = seq.length
    steps = len(step_tokens) - 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in step_tokens[2:]:
            runner.decode(seq, t)
        runner.synchronize()
    seq.truncate(start)
    ks = kernels(prof)
    names = [k[0] for k in ks]
    try:
        labels = positions(names, steps, runner.model.config.num_hidden_layers)
    except ValueError as e:  # an irregular step: kernels by name alone
        print(f"kernel positions not labelled ({e})", file=sys.stderr)
        labels = names
    # the first kernel's exclusive time has no predecessor in the trace: its own duration
    excl = [ks[0][2] - ks[0][1]] + [ks[i][2] - ks[i - 1][2] for i in range(1, len(ks))]
    df = pl.DataFrame({"kernel": labels, "us": excl})
    return (
        df.group_by("kernel", maintain_order=True)
        .agg(launches=pl.len() / steps, us_per_step=pl.col("us").sum() / steps, us_per_launch=pl.col("us").mean())
        .with_columns(share=pl.col("us_per_step") / pl.col("us_per_step").sum())
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random")
    p.add_argument("--backends", default="triton")
    p.add_argument("--quants", default="bf16")
    p.add_argument("--contexts", type=contexts_arg, default="1024", help="token counts (1024 or 1k)")
    p.add_argument("--steps", type=positive_int, default=16, help="profiled decode steps")
    p.add_argument("--out", default="runs/timeline")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the decode timeline needs a GPU", file=sys.stderr)
        return 2
    frames = []

    def record(name, quant, backend, ctx, runner, seq, step_tokens):
        df = timeline(runner, seq, step_tokens)
        print(f"{name} {quant} {backend} ctx={ctx}: {df['us_per_step'].sum():.1f} us per step")
        print(df.sort("us_per_step", descending=True))
        frames.append(df.with_columns(model=pl.lit(name), quant=pl.lit(quant), backend=pl.lit(backend), ctx=ctx))
        rows = pl.concat(frames).select(
            "model", "quant", "backend", "ctx", pl.exclude("model", "quant", "backend", "ctx")
        )
        save(rows.with_columns(pl.col(pl.Float64).round(3)).to_dicts(), a.out, "timeline", "")

    for name in a.models.split(","):
        each_runner(name, a.backends.split(","), a.quants.split(","), a.contexts, a.steps, partial(record, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
