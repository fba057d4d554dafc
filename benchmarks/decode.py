"""Decode speed of whole models on the GPU, eager and from a CUDA graph: ``python -m benchmarks.decode``.

For random-weight models with the shapes of registered models (the ``config`` of
``conf/model/NAME.yaml``, :func:`tileinfer.core.registry.model_config`; decode speed does not depend
on the values), each quantization preset of conf/quant (``--quants`` of bf16, int8_weights,
int8_kv, int8_both), each fast backend and each context length: a prefill fills the cache with
``ctx`` tokens, then ``steps`` decode steps are timed twice on
the same runner, eager (one Python launch per op: ``ModelRunner.step``), replayed from the
runner's captured CUDA graph (``ModelRunner.decode``) with tokens fed from a fixed list, so no step
waits on the host, and from the graph that ends in the argmax (``ModelRunner.decode_greedy``), the
host reading each token before the next step as greedy generation does; the sequence is rolled
back in between.

The roofline of a step is the bytes it must read (every weight once, the lm_head included, the
embedding table not; plus the KV cache of ``ctx`` positions) over the copy bandwidth measured in
the same run (``benchmarks.ops.measure_ceilings``). Prints and saves a table (Markdown and
Parquet): ms per token, tok/s, the roofline's tok/s, the fraction of it reached, and graph / eager.
What cuTile's programmatic dependent launch gains: the same run with ``TILEINFER_CUTILE_PDL=0``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.ops import measure_ceilings, save
from quantize import NAMED, apply, named_scheme
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.errors import UserError
from tileinfer.core.registry import model_config, model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer


def bytes_per_step(runner: ModelRunner, ctx: int) -> int:
    """Bytes one decode step at context ``ctx`` must read: weights (not the embedding table, of which
    one row is read, unless it doubles as the lm_head) plus the cached keys and values."""
    m = runner.model
    embed = 0 if m.lm_head is m.embed else m.embed.numel() * m.embed.element_size()
    return m.weight_bytes() - embed + runner.kv.bytes_per_position() * ctx


# How a timed step runs: one Python launch per op; the captured graph fed from a fixed token list
# (no host read, so steps queue back to back); the graph ending in the argmax, whose token the host
# reads before the next step (greedy generation as ``generate`` runs it).
MODES = ("eager", "graph", "graph_greedy")


def time_steps(runner: ModelRunner, seq, tokens: list[int], mode: str) -> float:
    """Seconds per decode step over ``tokens`` (after two untimed steps) in ``mode`` (:data:`MODES`)."""
    start = seq.length

    def one(t):
        if mode == "graph_greedy":
            return runner.decode_greedy(seq, t)
        return runner.decode(seq, t) if mode == "graph" else runner.step(seq, torch.tensor([t]))[0]

    for t in tokens[:2]:
        one(t)
    runner.synchronize()
    t0 = time.perf_counter()
    for t in tokens[2:]:
        one(t)
    runner.synchronize()
    dt = (time.perf_counter() - t0) / (len(tokens) - 2)
    seq.truncate(start)
    return dt


def each_runner(name: str, backends: list, quants: list[str], contexts: list[int], steps: int, visit) -> list:
    """For one registered model's shape with random weights, calls ``visit(quant, backend, ctx,
    runner, seq, tokens)`` for each combination (``backends``: names, or Backends with a tuning of
    their own; ``backend`` is the name), the runner's cache prefilled with ``ctx`` tokens
    and ``tokens`` the ``steps + 2`` next ones to decode; returns what the calls returned, in order.
    Each runner and its cache are freed before the next is built, and each quant's weights before
    the next quant's (so ``visit`` must not keep them).

    Raises:
        UserError: a model without a registered config.
        RuntimeError: a backend whose runner cannot capture a CUDA graph.
    """
    config = model_config(name)  # raises UserError for a model without a config
    hf = model_entry(name)["config"]
    sd = random_state_dict(hf, seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (max(contexts) + steps + 2,), generator=g).tolist()
    results = []
    for quant in quants:
        scheme = named_scheme(quant)
        int8_kv = scheme.kv_cache == "int8"
        weights = sd if scheme.weights == "bf16" else apply(sd, config, scheme)[0]
        model = Transformer.from_state_dict(config, weights, device="cuda")
        del weights
        for backend in backends:
            for ctx in contexts:
                runner = ModelRunner(model, backend, kv_int8=int8_kv, max_seq_len=ctx + steps + 2, cuda_graph=True)
                backend_name = runner.ops.name
                if not runner.cuda_graph:
                    raise RuntimeError(f"backend {backend_name} is not capturable in a CUDA graph")
                seq = runner.new_sequence()
                try:
                    runner.prefill(seq, tokens[:ctx])
                    results.append(visit(quant, backend_name, ctx, runner, seq, tokens[ctx : ctx + steps + 2]))
                finally:
                    seq.release()
                del runner, seq
                torch.cuda.empty_cache()
        del model
    return results


def bench_model(
    name: str, backends: list, quants: list[str], contexts: list[int], steps: int, copy_GBps: float, log=print
) -> list[dict]:
    """Rows of one model (see the module docstring); ``backends`` as :func:`each_runner` takes them."""

    def rows_of(quant, backend, ctx, runner, seq, step_tokens) -> list[dict]:
        roof = copy_GBps * 1e9 / bytes_per_step(runner, ctx)
        dts = {mode: time_steps(runner, seq, step_tokens, mode) for mode in MODES}
        rows = []
        for mode, dt in dts.items():
            rows.append(
                dict(
                    model=name,
                    quant=quant,
                    backend=backend,
                    ctx=ctx,
                    mode=mode,
                    ms_per_tok=round(dt * 1e3, 3),
                    tok_s=round(1 / dt, 1),
                    roofline_tok_s=round(roof, 1),
                    frac_roofline=round(1 / dt / roof, 3),
                    graph_speedup=round(dts["eager"] / dts["graph"], 2),
                )
            )
            log(" ".join(f"{k}={v}" for k, v in rows[-1].items()))
        return rows

    return [row for rows in each_runner(name, backends, quants, contexts, steps, rows_of) for row in rows]


def contexts_arg(text: str) -> list[int]:
    """argparse type of ``--contexts``: comma-separated token counts, ``1k`` = 1024 as the sweep's
    ctx names. Raises argparse.ArgumentTypeError (one usage line) for anything else or below 1."""
    out = []
    for part in text.split(","):
        s = part.strip().lower()
        try:
            n = int(s[:-1]) * 1024 if s.endswith("k") else int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a token count (1024 or 1k)") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: a context holds at least 1 token")
        out.append(n)
    return out


def positive_int(text: str) -> int:
    """argparse type of a count that must be >= 1 (``--steps``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is below 1")
    return n


def refuse_names(p: argparse.ArgumentParser, option: str, names: str, known) -> None:
    """Exit with one usage line (code 2) for a name of the comma-separated ``names`` (the value of
    ``option``) not in ``known``."""
    unknown = set(names.split(",")) - set(known)
    if unknown:  # quoted, so an empty name (a stray comma) shows as ''
        p.error(f"{option}: unknown {', '.join(map(repr, sorted(unknown)))}; choose from {', '.join(known)}")


def refuse_unknown(p: argparse.ArgumentParser, quants: str, known, models: str) -> None:
    """Exit with one usage line (code 2) for a name of ``quants`` not in ``known`` or an
    unregistered model of ``models`` (both comma-separated), before any GPU work."""
    refuse_names(p, "--quants", quants, known)
    try:
        for m in models.split(","):
            model_config(m)
    except UserError as e:
        p.error(f"--models: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-0.6b-random,qwen3-4b-random,qwen3-8b-random")
    p.add_argument("--backends", default="triton,cutile")
    p.add_argument("--quants", default="bf16,int8_both", help=f"of {', '.join(NAMED)}")
    p.add_argument("--contexts", type=contexts_arg, default="1024,8192,32768", help="token counts (1024 or 1k)")
    p.add_argument("--steps", type=positive_int, default=64, help="timed decode steps per row")
    p.add_argument("--out", default="runs/bench", help="folder for decode.md and decode.parquet")
    a = p.parse_args(argv)
    refuse_unknown(p, a.quants, NAMED, a.models)
    if not torch.cuda.is_available():
        print("no CUDA device: the decode benchmark needs a GPU", file=sys.stderr)
        return 2
    ceil = measure_ceilings("cuda")
    print(f"copy bandwidth {ceil['copy_GBps']:.0f} GB/s")
    header = (
        f"Decode on {torch.cuda.get_device_name()}; copy bandwidth measured in this run: "
        f"{ceil['copy_GBps']:.0f} GB/s; {a.steps} timed steps per row.\n\n"
    )
    rows = []
    for name in a.models.split(","):
        rows += bench_model(
            name,
            a.backends.split(","),
            a.quants.split(","),
            a.contexts,
            a.steps,
            ceil["copy_GBps"],
        )
        save(rows, a.out, "decode", header)  # after each model, so a run cut short keeps what it measured
    print(header + open(f"{a.out}/decode.md").read().split("\n\n", 1)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
