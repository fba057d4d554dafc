"""Measure the gate's kernel checks on planted faults over corpus windows (the data behind conf/gate.yaml's bounds).

    OMP_NUM_THREADS=1 python -m benchmarks.gate_refit --windows 4 --out benchmarks/results/cpu-DATE-gate-refit.md

SmolLM2-135M (BF16) on the CPU, reference backend. For each setup of ``gate.bounds`` (bfloat16: BF16 KV
cache against the BF16 base; bfloat16-int8kv: INT8 KV cache against the INT8-KV base) and each change
(the planted faults of tests/faults.py, and a harmless reordering of sums), the change is scored
teacher-forced over the built-in corpora's windows (evals/corpus.py, ctx 1024: 511 positions per
window), its 95% intervals computed as rows get them (evals/intervals.py), and judged by the gate's
kernel checks with the bounds of conf/gate.yaml (tileinfer.gate.kernel_checks). Prints and writes one
Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from evals import corpus
from evals.intervals import row_intervals
from evals.metrics import summarize
from tests import faults
from tileinfer import gate
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.fetch import pull
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs import drift
from tileinfer.models import Transformer

CTX = 1024
# (setup, KV cache, change, ops): the bounds' two BF16 setups, harmless change first.
CHANGES = [
    ("bfloat16", "bf16", "valid reordering of the linear layers' sums", faults.reordered_linear_sum),
    ("bfloat16", "bf16", "GEMM accumulator rounded to BF16 every 16 inputs", faults.bf16_gemm_accumulator),
    ("bfloat16", "bf16", "GEMM accumulator rounded to BF16 every 64 inputs", lambda: faults.bf16_gemm_accumulator(64)),
    ("bfloat16", "bf16", "keys rotated with the next position's angle", faults.rope_key_off_by_one),
    ("bfloat16", "bf16", "attention skips the partly filled last page", faults.dropped_last_page),
    ("bfloat16-int8kv", "int8", "valid reordering of the linear layers' sums", faults.reordered_linear_sum),
    ("bfloat16-int8kv", "int8", "V scale of one KV head (of 3) 8% too large", lambda: faults.wrong_value_scale(1.08)),
    ("bfloat16-int8kv", "int8", "same, 4% too large", lambda: faults.wrong_value_scale(1.04)),
]


def cell(row: dict, metric: str, fmt: str) -> str:
    return f"{row[metric]:{fmt}} [{row[metric + '_lo']:{fmt}}, {row[metric + '_hi']:{fmt}}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4, help="windows per corpus (511 scored positions each)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bounds = OmegaConf.to_container(OmegaConf.load("conf/gate.yaml").gate)
    path = pull("smollm2-135m")
    ck, tok = load_checkpoint(path), Tokenizer.load(path)
    model = Transformer.from_state_dict(ck.config, ck.state_dict)
    bos = tok.bos_token_id if tok.add_bos_token else None
    streams = {
        name: [
            drift.Stream(tuple(w), corpus.prompt_len(CTX))
            for w in corpus.corpus_windows(tok, name, CTX, bos, args.windows)[0]
        ]
        for name in corpus.BUILTIN
    }
    bases: dict[str, dict] = {}
    lines = [
        "| setup | change | corpus | positions | mean KL [95%] | 99.9% KL [95%] | top-1 [95%] | kernel checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    t0 = time.time()
    for setup, kv, change, make_ops in CHANGES:
        if kv not in bases:
            runner = ModelRunner(model, kv_int8=kv == "int8", max_seq_len=CTX)
            bases[kv] = {c: [drift.full_logits(runner, s) for s in ss] for c, ss in streams.items()}
        for name, base in bases[kv].items():
            runner = ModelRunner(model, backend=make_ops(), kv_int8=kv == "int8", max_seq_len=CTX)
            results = [drift.score(runner, b, decode_steps=0) for b in base]
            per_pos = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}
            group = torch.cat([torch.full((len(r[1]["kl"]),), i) for i, r in enumerate(results)])
            row = summarize(per_pos) | row_intervals(per_pos, group, "window")
            row |= dict(prompt_set=name, dtype="bfloat16", kv_cache=kv, n_scored=len(group))
            verdicts = gate.kernel_checks(row, bounds)
            checks = ", ".join(f"{v['metric']} {v['verdict']}" for v in verdicts)
            line = (
                f"| {setup} | {change} | {name} | {len(group)} | {cell(row, 'kl_mean', '.2e')} | "
                f"{cell(row, 'kl_p999', '.2e')} | {cell(row, 'top1_agree', '.4f')} | {checks} |"
            )
            print(line, f"({time.time() - t0:.0f} s)", flush=True)
            lines.append(line)
    head = [
        f"# Gate kernel checks on planted faults, corpus windows (CPU, {time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `OMP_NUM_THREADS=1 python -m benchmarks.gate_refit --windows {args.windows} --out {args.out}`",
        "",
        f"SmolLM2-135M (BF16, reference backend, {platform.machine()}, torch {torch.__version__}); built-in "
        f"corpora pydoc and stdlib, {args.windows} windows of {CTX} tokens each (second halves scored). "
        "Intervals: mean and 99.9% KL BCa over blocks of positions or windows, top-1 Wilson (evals/intervals.py). "
        f"Verdicts: tileinfer.gate.kernel_checks with the bounds of conf/gate.yaml at the time: {bounds['bounds']}, "
        f"99.9% KL checked from {bounds['p999_min_positions']} positions. {time.time() - t0:.0f} s in all.",
        "",
    ]
    args.out.write_text("\n".join(head + lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
