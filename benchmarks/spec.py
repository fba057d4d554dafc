"""Step costs of speculative decoding, measured and modelled: ``python -m benchmarks.spec``.

Random-weight models with registered shapes (step speed does not depend on the values), BF16 and INT8
(weights + KV cache), per backend and context: a prefill caches ``ctx`` random tokens, then on that
runner (ms, host clock, device synchronized around each call, median of ``reps`` after ``warmup``
untimed calls, the sequence rolled back with ``seq.truncate`` after each) are timed:
``decode_ms``, a plain decode step (``ModelRunner.decode``: CUDA-graph replay on CUDA), and
``decode_eager_ms`` (``ModelRunner.step``, one token); ``verify_ms``, a verify step of k + 1 tokens
(``ModelRunner.verify``, as the loop runs it: a CUDA graph per token count on CUDA; target: verify(8)
<= 1.3 x decode on Qwen3-4B) and ``verify_eager_ms`` (``ModelRunner.step``, no graph);
``ngram_ms``, host time of ``NgramProposer(5, 5).propose`` on the ctx-token list (random tokens
rarely repeat a 5-gram: the full scan); ``draft_ms`` (``--draft-model``), ``DraftModelProposer``'s
k greedy tokens at steady state (one eager step, k - 1 graph decode steps; same quant).

Synthetic acceptance (as vLLM's speculative-decoding benchmark offers): for L tokens per verify step
(accepted + bonus, 1 <= L <= k + 1), tok/s = L / (verify_ms + proposer_ms) * 1000 and speed-up =
tok/s / (1000 / decode_ms), with proposer_ms = draft_ms, else ngram_ms. This is the walltime model
of Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding":
E[L] / (gamma c + 1), expected tokens per round over the round's cost in target steps, with the
measured verify cost instead of their assumption that verifying costs one decode step. Columns
``tok_s_L{2,4,5}``/``speedup_L*`` (empty where L > k + 1) and ``*_full`` (L = k + 1), in tok/s.

Consistency check: :class:`ForcedProposer` drafts the target's own greedy continuation (computed by
plain decoding, ``plain_tok_s``), so every draft is accepted; ``speculative_decode`` runs ~``--forced-tokens``
tokens with it. ``forced_tok_s`` (measured) vs ``forced_model_tok_s`` = (k + 1) * 1000 / verify_ms
(the model at L = k + 1 with this ~free proposer): ``forced/model`` < 1 is the loop's overhead.
``forced_L``: mean acceptance length (k + 1 when all accepted); ``forced_match``: same tokens as plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from benchmarks.ops import save
from quantize import QuantScheme, apply
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.registry import model_entry
from tileinfer.engine.proposers import DraftModelProposer, NgramProposer, Proposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import SpecStats, speculative_decode
from tileinfer.models import Transformer

QUANTS = ("bf16", "int8_both")
L_COLUMNS = (2, 4, 5)  # acceptance lengths reported besides L = k + 1
# --cpu-smoke: a tiny shape over every model's config (the reference backend on the CPU)
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
SMOKE |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@dataclass(frozen=True)
class Plan:
    """What one run measures (see the module docstring); ``overrides`` replace config.json fields of
    every model (``--cpu-smoke``: :data:`SMOKE`); BF16 on CUDA, float32 on the CPU."""

    quants: tuple[str, ...] = QUANTS
    backends: tuple[str, ...] = ("triton",)
    contexts: tuple[int, ...] = (1024, 8192)
    ks: tuple[int, ...] = (2, 7, 15)
    reps: int = 20
    warmup: int = 3
    forced_tokens: int = 64
    draft: str | None = None
    overrides: dict = field(default_factory=dict)
    device: str = "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32


def median_ms(fn, reps: int, warmup: int, sync=lambda: None) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones (host clock,
    ``sync()`` before and after each call)."""
    times = []
    for i in range(warmup + reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def synthetic(decode_ms: float, verify_ms: float, proposer_ms: float, k: int) -> list[dict]:
    """For L = 1 .. k + 1 tokens per verify step: ``tok_s`` = L / (verify_ms + proposer_ms) * 1000 and
    ``speedup`` = tok_s / (1000 / decode_ms) (Leviathan et al. 2023; vLLM's synthetic acceptance)."""
    round_ms = verify_ms + proposer_ms
    return [dict(L=L, tok_s=L * 1e3 / round_ms, speedup=L * decode_ms / round_ms) for L in range(1, k + 2)]


class ForcedProposer(Proposer):
    """Drafts ``reply``, the target's greedy continuation of a ``prompt_len``-token prompt computed
    beforehand (its first token is the pending one), so every draft is accepted (L = k + 1)."""

    def __init__(self, reply: list[int], prompt_len: int):
        self.reply, self.prompt_len = reply, prompt_len

    def propose(self, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - self.prompt_len  # reply tokens already in ``tokens``
        return self.reply[done : done + k]


def greedy(runner: ModelRunner, seq, logits: torch.Tensor, n: int) -> tuple[list[int], float]:
    """``n`` greedy tokens after ``seq`` (the first from its last ``logits``, then ``n - 1`` plain decode
    steps) and the seconds of those steps; ``seq`` is rolled back."""
    start, argmax = seq.length, runner.ops.argmax
    out = [int(argmax(logits[None])[0])]
    runner.synchronize()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        out.append(int(argmax(runner.decode(seq, out[-1])[None])[0]))
    runner.synchronize()
    dt = time.perf_counter() - t0
    seq.truncate(start)
    return out, dt


def forced_len(k: int, tokens: int) -> int:
    """Tokens of the forced run: whole rounds of k + 1 (so every round drafts k), about ``tokens``."""
    return max(1, tokens // (k + 1)) * (k + 1)


def forced_run(
    runner: ModelRunner, seq, prompt: list[int], plain: list[int], k: int, n: int
) -> tuple[list[int], SpecStats, float]:
    """``speculative_decode`` of ``n`` tokens after ``plain[0]`` with :class:`ForcedProposer`; ``seq`` holds
    ``prompt``. Returns (``plain[0]`` + the new tokens, :class:`SpecStats`, seconds); ``seq`` is rolled back."""
    start = seq.length
    runner.synchronize()
    t0 = time.perf_counter()
    reply = speculative_decode(runner, seq, prompt + plain[:1], n, ForcedProposer(plain, len(prompt)), k)
    runner.synchronize()
    dt = time.perf_counter() - t0
    seq.truncate(start)
    return plain[:1] + reply.tokens, reply.stats, dt


def weights(name: str, plan: Plan) -> tuple[ModelConfig, dict]:
    """Config and random state dict (seed 0) of registered model ``name`` with ``plan.overrides``."""
    hf = model_entry(name)["config"] | plan.overrides
    return ModelConfig.from_hf(hf), random_state_dict(hf, seed=0, dtype=plan.dtype, device=plan.device)


def build(config: ModelConfig, sd: dict, quant: str, plan: Plan) -> Transformer:
    """The model of ``sd`` in ``quant`` (int8_both: INT8 weights; the runner keeps the INT8 KV cache)."""
    if quant == "int8_both":
        sd = apply(sd, config, QuantScheme("int8", "int8", smooth_keys=False))[0]
    return Transformer.from_state_dict(config, sd, dtype=plan.dtype, device=plan.device)


def draft_costs(model: Transformer, backend: str, quant: str, prompt: list[int], plan: Plan) -> dict[int, float]:
    """{k: ms of ``DraftModelProposer.propose`` of k tokens after ``prompt``} (steady state: its cache
    holds all but the last prompt token)."""
    runner = ModelRunner(
        model, backend, kv_int8=quant == "int8_both", max_seq_len=len(prompt) + max(plan.ks) + 2, cuda_graph=True
    )
    p = DraftModelProposer(runner)
    p.begin(prompt)
    try:
        return {k: median_ms(lambda: p.propose(prompt, k), plan.reps, plan.warmup, runner.synchronize) for k in plan.ks}
    finally:
        p.end()


def bench_ctx(name, quant, backend, ctx, model, draft, tokens, plan: Plan, log=print) -> list[dict]:
    """Rows of one (model, quant, backend, ctx), one per k (see the module docstring)."""
    prompt, extra = tokens[:ctx], tokens[ctx:]
    n_plain = max(forced_len(k, plan.forced_tokens) for k in plan.ks) + 1
    runner = ModelRunner(
        model, backend, kv_int8=quant == "int8_both", max_seq_len=ctx + n_plain + max(plan.ks) + 2, cuda_graph=True
    )
    if plan.device == "cuda" and not runner.cuda_graph:
        raise RuntimeError(f"backend {backend} is not capturable in a CUDA graph")
    seq, sync, reps = runner.new_sequence(), runner.synchronize, (plan.reps, plan.warmup)
    last = runner.prefill(seq, prompt)
    decode_ms = median_ms(lambda: (runner.decode(seq, extra[0]), seq.truncate(ctx)), *reps, sync)
    eager_ms = median_ms(lambda: (runner.step(seq, torch.tensor(extra[:1])), seq.truncate(ctx)), *reps, sync)
    plain, plain_s = greedy(runner, seq, last, n_plain)
    dcost = draft_costs(draft, backend, quant, prompt, plan) if draft is not None else {}
    rows = []
    for k in plan.ks:
        feed = extra[: k + 1]
        verify_ms = median_ms(lambda: (runner.verify(seq, feed), seq.truncate(ctx)), *reps, sync)
        verify_eager_ms = median_ms(lambda: (runner.step(seq, torch.tensor(feed)), seq.truncate(ctx)), *reps, sync)
        ngram = NgramProposer(5, 5)
        ngram_ms = median_ms(lambda: ngram.propose(prompt, k), *reps)
        n = forced_len(k, plan.forced_tokens)
        forced_run(runner, seq, prompt, plain, k, n)  # warm-up (kernels of the loop's shapes)
        got, stats, secs = forced_run(runner, seq, prompt, plain, k, n)
        row = dict(model=name, quant=quant, backend=backend, ctx=ctx, k=k, graph=runner.cuda_graph)
        row |= dict(decode_ms=round(decode_ms, 3), decode_eager_ms=round(eager_ms, 3), verify_ms=round(verify_ms, 3))
        row["verify_eager_ms"] = round(verify_eager_ms, 3)
        row |= {"verify/decode": round(verify_ms / decode_ms, 3), "ngram_ms": round(ngram_ms, 4)}
        if draft is not None:
            row["draft_ms"] = round(dcost[k], 3)
        row["proposer"] = plan.draft or "ngram"
        curve = synthetic(decode_ms, verify_ms, dcost.get(k, ngram_ms), k)
        for L in (*L_COLUMNS, "full"):
            c = curve[-1] if L == "full" else curve[L - 1] if L <= k + 1 else None
            at = "full" if L == "full" else f"L{L}"
            row[f"tok_s_{at}"] = round(c["tok_s"], 1) if c else None
            row[f"speedup_{at}"] = round(c["speedup"], 2) if c else None
        forced_tok_s, model_tok_s = n / secs, (k + 1) * 1e3 / verify_ms
        row |= dict(plain_tok_s=round((n_plain - 1) / plain_s, 1), forced_tok_s=round(forced_tok_s, 1))
        row |= {"forced_model_tok_s": round(model_tok_s, 1), "forced/model": round(forced_tok_s / model_tok_s, 3)}
        row |= dict(forced_L=round(stats.acceptance_length, 2), forced_match=got == plain[: n + 1])
        rows.append(row)
        log(" ".join(f"{key}={v}" for key, v in row.items()))
    seq.release()
    return rows


def bench_model(name: str, plan: Plan, log=print) -> list[dict]:
    """Rows of one registered model (and ``plan.draft``, same quant) over quants, backends, contexts, k."""
    config, sd = weights(name, plan)
    dconfig, dsd = weights(plan.draft, plan) if plan.draft else (None, None)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (max(plan.contexts) + max(plan.ks) + 1,), generator=g).tolist()
    rows = []
    for quant in plan.quants:
        model = build(config, sd, quant, plan)
        draft = build(dconfig, dsd, quant, plan) if plan.draft else None
        for backend in plan.backends:
            for ctx in plan.contexts:
                rows += bench_ctx(name, quant, backend, ctx, model, draft, tokens, plan, log)
                if plan.device == "cuda":
                    torch.cuda.empty_cache()
        del model, draft
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b-random", help="registered models, comma-separated")
    p.add_argument("--quant", default="bf16,int8_both", help="bf16 and/or int8_both (INT8 weights + KV)")
    p.add_argument("--backends", default=None, help="default triton (reference with --cpu-smoke)")
    p.add_argument("--ctx", default=None, help="cached tokens, comma-separated (default 1024,8192; smoke 32,64)")
    p.add_argument("--k", default="2,7,15", help="drafted tokens per round, comma-separated")
    p.add_argument("--reps", type=int, default=20, help="timed calls per median")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    p.add_argument("--forced-tokens", type=int, default=64, help="tokens of the forced full-acceptance run")
    p.add_argument("--draft-model", default=None, help="a registered draft model (e.g. qwen3-0.6b-random)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU with the reference backend")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file name (default DEVICE-DATE-spec-steps)")
    a = p.parse_args(argv)
    quants = tuple(a.quant.split(","))
    if not set(quants) <= set(QUANTS):
        p.error(f"--quant: choose from {', '.join(QUANTS)}")
    device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
    backends = tuple((a.backends or ("reference" if a.cpu_smoke else "triton")).split(","))
    if device == "cpu" and set(backends) != {"reference"}:
        print("no CUDA device (or --cpu-smoke): only --backends reference runs on the CPU", file=sys.stderr)
        return 2
    plan = Plan(
        quants=quants,
        backends=backends,
        contexts=tuple(int(c) for c in (a.ctx or ("32,64" if a.cpu_smoke else "1024,8192")).split(",")),
        ks=tuple(int(k) for k in a.k.split(",")),
        reps=a.reps,
        warmup=a.warmup,
        forced_tokens=a.forced_tokens,
        draft=a.draft_model,
        overrides=SMOKE if a.cpu_smoke else {},
        device=device,
    )
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    slug = (where.lower().replace("nvidia", "").split() or ["cuda"])[0]  # "NVIDIA H200" -> h200, cpu
    name = a.name or f"{slug}-{time.strftime('%Y-%m-%d')}-spec-steps"  # as benchmarks/results names files
    header = (
        f"`python -m benchmarks.spec {' '.join(argv)}`\n\nSpeculative-decoding step costs on {where}"
        f"{' (tiny --cpu-smoke shapes)' if a.cpu_smoke else ''}: ms are medians of {a.reps} calls after "
        f"{a.warmup} warm-up calls; tok_s_L* / speedup_L* are modelled from them (L tokens per verify step, "
        "full: L = k + 1), forced_* measured with full acceptance (see benchmarks/spec.py).\n\n"
    )
    rows = []
    for model in a.models.split(","):
        rows += bench_model(model, plan)
        save(rows, a.out, name, header)  # after each model, so a run cut short keeps what it measured
    print(open(f"{a.out}/{name}.md").read())
    print(f"saved {a.out}/{name}.md and .parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
