"""Decode tok/s of this engine against peers on the same weights, shapes and contexts.

For random-weight models with registered shapes (as :mod:`benchmarks.decode`), each context
``ctx`` and quantization (``bf16``; ``int8_weights``: INT8 weights with a BF16 KV cache, so that it
matches the peers' weight-only INT8; bench.decode's ``int8_both`` also has an INT8 cache):

- this engine (``tileinfer-<backend>``): a prefill of ``ctx`` tokens, then bench.decode's
  measurement (:func:`benchmarks.decode.time_steps`, replayed from the CUDA graph);
- ``gptfast``: the gpt-fast style decoder of :mod:`benchmarks.peers.gptfast` (BF16, or
  gpt-fast's INT8 weight-only linear on the same INT8 values as this engine's), chunked eager
  prefill, then ``warm`` decode steps (compilation, CUDA-graph recording) and ``steps`` timed ones,
  each feeding back the previous step's greedy token (no host sync);
- ``torchao`` (int8_weights): the same decoder in BF16 quantized by torchao's
  ``quantize_(model, Int8WeightOnlyConfig())`` (its own per-row INT8 rounding), timed the same way;
  needs torchao (``--torchao-wheel`` installs one with ``pip install --no-deps --target``), else
  the row says why it was skipped;
- ``hf_eager``, ``hf_static`` (bf16): transformers' ``generate``, see :mod:`benchmarks.peers.hf`.

Every model is built from one ``random_state_dict(hf_config, seed=0)`` on the GPU. The roofline of
every row is this engine's: the bytes a step must read (weights of the row's quantization, lm_head
included, embedding table not, plus a BF16 KV cache of ``ctx`` positions:
:func:`benchmarks.decode.bytes_per_step`) over the copy bandwidth measured in this run, whatever
the peer actually reads (gpt-fast reads the whole static cache and copies K/V to every query head).
``ours_vs_best_peer``, on this engine's rows: its tok/s over the fastest peer's of the same model,
ctx and quantization. ``setup_s``: seconds of a row outside its timed steps (prefill, compilation,
warm-up). A peer that fails gets a row with its error and no speed; this engine failing stops the
run. Rows are saved (Markdown and Parquet, :func:`benchmarks.ops.save`) after each one.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.decode import (
    bytes_per_step,
    contexts_arg,
    positive_int,
    refuse_names,
    refuse_unknown,
    time_steps,
)
from benchmarks.ops import measure_ceilings, save
from benchmarks.peers import gptfast, hf
from quantize import apply, named_scheme
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.registry import model_config, model_entry
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer

PEERS = ("gptfast", "torchao", "hf_eager", "hf_static")
QUANTS = {"bf16": ("gptfast", "hf_eager", "hf_static"), "int8_weights": ("gptfast", "torchao")}
OURS = "tileinfer-"
# What torchao's Int8WeightOnlyConfig sets process-wide (recommended_inductor_config_setter) beyond
# gpt-fast's settings; here only while the torchao rows compile, so the other peers do not inherit it.
TORCHAO_INDUCTOR = {"coordinate_descent_check_all_directions": True, "force_fuse_int_mm_with_mul": True}


def find_torchao(wheel: str | None) -> str | None:
    """None when torchao imports, if need be after installing ``wheel`` (``pip install --no-deps``
    into a fresh folder put first on ``sys.path``); else why not."""
    if importlib.util.find_spec("torchao") is None and wheel:
        target = tempfile.mkdtemp(prefix="torchao-")
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", target, wheel]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode:
            return f"pip install {wheel} failed: {done.stderr.strip()[-300:]}"
        sys.path.insert(0, target)
    try:
        import torchao  # noqa: F401
    except Exception as e:
        return f"torchao does not import ({type(e).__name__}: {e}); pass --torchao-wheel PATH"
    return None


def time_ours(model: Transformer, backend: str, tokens: list[int], ctx: int, steps: int) -> tuple[float, float, int]:
    """``(seconds per decode step, setup seconds, bytes per step)`` of this engine, BF16 KV cache."""
    t0 = time.perf_counter()
    runner = ModelRunner(model, backend, kv_int8=False, max_seq_len=ctx + steps + 2, cuda_graph=True)
    if not runner.cuda_graph:
        raise RuntimeError(f"backend {backend} is not capturable in a CUDA graph")
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:ctx])
    dt = time_steps(runner, seq, tokens[ctx : ctx + steps + 2], "graph")
    nbytes = bytes_per_step(runner, ctx)
    seq.release()
    return dt, time.perf_counter() - t0 - steps * dt, nbytes


@torch.no_grad()
def time_gptfast(model: gptfast.Decoder, tokens: torch.Tensor, ctx: int, steps: int, warm: int, inductor: dict):
    """``(seconds per decode step, setup seconds)``: prefill tokens[:ctx], then ``warm`` untimed and
    ``steps`` timed greedy steps of the compiled :func:`gptfast.decode_step`, each feeding the previous
    step's token back, as gpt-fast's ``decode_n_tokens``. Compiled with gpt-fast's Inductor settings
    and ``inductor`` (torchao's), for these steps only."""
    t0 = time.perf_counter()
    torch._dynamo.reset()  # a fresh compilation for these shapes, and no stale CUDA graphs
    try:
        model.setup_caches(ctx + warm + steps)
        gptfast.prefill(model, tokens[:ctx])
        step = gptfast.decode_step(compile=True)
        cur, input_pos = tokens[ctx].view(1, 1), torch.tensor([ctx], device=tokens.device)
        with torch._inductor.config.patch({**gptfast.INDUCTOR, **inductor}):
            for i in range(warm + steps):
                if i == warm:
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                cur = step(model, cur, input_pos).clone()
                input_pos += 1
            torch.cuda.synchronize()
        return (time.perf_counter() - t1) / steps, t1 - t0
    finally:
        model.setup_caches(0)
        torch._dynamo.reset()


def peer_rows(name: str, sd: dict, weights: dict, quant: str, tokens: torch.Tensor, a, torchao_skip, log):
    """Yield ``(peer, ctx, seconds per step or None, setup seconds or None, error text)`` for the
    peers of ``quant`` asked for in ``a.peers``; a peer's exception becomes its row's error. ``sd``:
    the BF16 weights; ``weights``: those of ``quant``; ``tokens``: the token stream on the GPU."""
    hf_config, config = model_entry(name)["config"], model_config(name)
    contexts, steps, warm = a.contexts, a.steps, a.warmup
    for peer in (p for p in QUANTS[quant] if p in a.peers.split(",")):
        if peer == "torchao" and torchao_skip:
            for ctx in contexts:
                yield peer, ctx, None, None, f"skipped: {torchao_skip}"
            continue
        try:
            if peer == "gptfast":
                model = gptfast.Decoder.from_state_dict(config, weights)
            elif peer == "torchao":
                from torchao.quantization import Int8WeightOnlyConfig, quantize_

                model = gptfast.Decoder.from_state_dict(config, sd)
                quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))  # set below, for its rows only
            else:
                model = hf.hf_model(hf_config, sd, device="cuda")
            error = ""
        except Exception as e:
            model, error = None, f"{type(e).__name__}: {e}"[:500]
        for ctx in contexts:
            if model is None:
                yield peer, ctx, None, None, error
                continue
            log(f"{name} {quant} {peer} ctx={ctx} ...")
            try:
                if peer.startswith("hf_"):
                    try:
                        dt, setup = hf.decode_seconds(model, tokens[:ctx], steps, warm, static=peer == "hf_static")
                    finally:
                        torch._dynamo.reset()
                else:
                    inductor = TORCHAO_INDUCTOR if peer == "torchao" else {}
                    dt, setup = time_gptfast(model, tokens, ctx, steps, warm, inductor)
                result = dt, setup, ""
            except Exception as e:  # outside this block the traceback, and the tensors it holds, are freed
                result = None, None, f"{type(e).__name__}: {e}"[:500]
            torch.cuda.empty_cache()
            yield peer, ctx, *result
        del model
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """Set ``ours_vs_best_peer`` on this engine's rows (None where no peer of its group has a speed)."""
    for r in rows:
        if r["peer"].startswith(OURS):
            key = (r["model"], r["ctx"], r["quant"])
            best = [
                p["tok_s"]
                for p in rows
                if not p["peer"].startswith(OURS) and p["tok_s"] and (p["model"], p["ctx"], p["quant"]) == key
            ]
            r["ours_vs_best_peer"] = round(r["tok_s"] / max(best), 2) if best else None


def bench_model(name: str, a, copy_GBps: float, torchao_skip: str | None, rows: list[dict], commit, log=print) -> None:
    """Append the rows of one model to ``rows``, calling ``commit()`` after each."""
    config = model_config(name)
    sd = random_state_dict(model_entry(name)["config"], seed=0, device="cuda")
    contexts = a.contexts
    g = torch.Generator().manual_seed(0)  # bench.decode's token stream
    tokens = torch.randint(0, config.vocab_size, (max(contexts) + a.steps + a.warmup + 2,), generator=g)
    for quant in a.quants.split(","):
        if quant not in QUANTS:
            raise ValueError(f"unknown quant {quant!r}; known: {', '.join(QUANTS)}")
        weights = sd if quant == "bf16" else apply(sd, config, named_scheme(quant))[0]
        roof = {}

        def add(peer, ctx, dt, setup, error):
            rows.append(
                dict(
                    model=name,
                    ctx=ctx,
                    quant=quant,
                    peer=peer,
                    tok_s=round(1 / dt, 1) if dt else None,
                    roofline_tok_s=round(roof[ctx], 1),
                    frac_roofline=round(1 / dt / roof[ctx], 3) if dt else None,
                    ours_vs_best_peer=None,
                    setup_s=round(setup, 1) if setup is not None else None,
                    error=error,
                )
            )
            add_ratios(rows)
            log(" ".join(f"{k}={v}" for k, v in rows[-1].items()))
            commit()

        model = Transformer.from_state_dict(config, weights, device="cuda")
        for backend in a.backends.split(","):
            for ctx in contexts:
                dt, setup, nbytes = time_ours(model, backend, tokens.tolist(), ctx, a.steps)
                roof[ctx] = copy_GBps * 1e9 / nbytes
                add(OURS + backend, ctx, dt, setup, "")
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
        for row in peer_rows(name, sd, weights, quant, tokens.to("cuda"), a, torchao_skip, log):
            add(*row)
        del weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random,qwen3-8b-random")
    p.add_argument("--contexts", type=contexts_arg, default="1024,32768", help="token counts (1024 or 1k)")
    p.add_argument("--quants", default="bf16,int8_weights", help=f"of {', '.join(QUANTS)}")
    p.add_argument("--backends", default="triton", help="this engine's backends")
    p.add_argument("--peers", default=",".join(PEERS), help=f"of {', '.join(PEERS)}")
    p.add_argument("--steps", type=positive_int, default=64, help="timed decode steps per row")
    p.add_argument(
        "--warmup", type=positive_int, default=8, help="untimed decode steps of a peer (compilation, graphs)"
    )
    p.add_argument("--torchao-wheel", help="a torchao wheel to install (pip --no-deps) when torchao is missing")
    p.add_argument("--out", default="runs/bench", help="folder for peers.md and peers.parquet")
    a = p.parse_args(argv)
    refuse_names(p, "--peers", a.peers, PEERS)
    refuse_unknown(p, a.quants, QUANTS, a.models)
    if not torch.cuda.is_available():
        print("no CUDA device: the peers benchmark needs a GPU", file=sys.stderr)
        return 2
    torchao_skip = find_torchao(a.torchao_wheel) if "torchao" in a.peers.split(",") else None
    if torchao_skip:
        print(f"torchao peer skipped: {torchao_skip}")
    ceil = measure_ceilings("cuda")
    print(f"copy bandwidth {ceil['copy_GBps']:.0f} GB/s")
    header = (
        f"Decode against peers on {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
        f"measured in this run: {ceil['copy_GBps']:.0f} GB/s; {a.steps} timed steps per row (peers: after "
        f"{a.warmup} untimed). Roofline: this engine's bytes per step (weights + BF16 KV cache) for every peer.\n\n"
    )
    rows: list[dict] = []
    for name in a.models.split(","):
        bench_model(name, a, ceil["copy_GBps"], torchao_skip, rows, lambda: save(rows, a.out, "peers", header))
    print(header + open(f"{a.out}/peers.md").read().split("\n\n", 1)[1])
    return 0
