"""One job, shared by the sweep and the drift gate: carry out a plan, one row per scored set.

For every scored set whose row is not done yet (every one with ``force``), the base side of each
item comes from the plan's base store (recorded once on disk, or stored top-k files), the
candidate runs teacher-forced over the same tokens with its speed timed in the same pass
(:func:`evals.drift.score`), and the row is built from those values only and written atomically.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from evals import speculation
from evals.base_logits import FullLogits
from evals.drift import score, set_statistics, warm_up
from evals.evaluation import ScoredSet
from tileinfer.core import files
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs import rows
from tileinfer.jobs.plan import Plan
from tileinfer.jobs.worker import Worker


@dataclass(frozen=True)
class JobResult:
    """What a job returns: its rows (as read back from their files, computed now or earlier), their
    files, and how many it computed now."""

    rows: tuple[dict, ...]
    paths: tuple[Path, ...]
    computed: int


def run(plan: Plan, worker: Worker, force: bool = False) -> JobResult:
    """Compute every missing row of ``plan`` (every row with ``force``).

    Raises:
        UserError: a base that cannot be read or recorded, a prompt longer than the runner's context.
        NonFiniteLogits: a model produced NaN or infinite logits.
    """
    c = plan.cfg
    if plan.device_workers != 1:
        print(
            f"warning: {plan.device_workers or 'an unknown number of'} workers share this "
            f"{'GPU' if plan.device.type == 'cuda' else 'CPU'}: the speed columns of these rows are timed "
            "against each other (device_workers says so)",
            file=sys.stderr,
        )
    keys = [plan.identity(s) for s in plan.sets]  # once: the file name and the row hold the same key
    paths = [plan.row_path(k) for k in keys]
    todo = [i for i, p in enumerate(paths) if force or not rows.is_complete(p)]
    computed = 0
    if todo:
        loaded = worker.load(c.model, c.dtype, plan.device)
        runner = worker.runner(c, loaded, plan.candidate.backend, plan.candidate.scheme, plan.max_len)
        store = plan.base_store(worker)
        spec = worker.speculation(c, runner, loaded, plan.max_len)
        for i in todo:
            with files.locked(paths[i]):  # two sweeps over one runs_dir: one computes a row, the other finds it
                if not force and rows.is_complete(paths[i]):
                    print(f"already done by another process: {paths[i]}")
                    continue
                score_set(plan, plan.sets[i], keys[i], paths[i], runner, store, spec)
                computed += 1
    if not computed:
        print(f"already done: {', '.join(map(str, paths))}")
    return JobResult(tuple(rows.read(paths).drop("row_file").to_dicts()), tuple(paths), computed)


def score_set(plan: Plan, s: ScoredSet, key: dict, path: Path, runner: ModelRunner, store, spec) -> None:
    """Score the items of ``s`` against their base and write the row to ``path``."""
    c = plan.cfg
    t0 = time.perf_counter()
    store.prepare(s)  # every base recorded (or checked) first: the peak memory is the candidate's
    base = store.logits(s, 0)
    if c.speed.warmup:
        warm_up(runner, base, spec)
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    runner.ops.reset_fallbacks()
    # a proposer fed the target's hidden states needs the whole prefill: no resume snapshots
    hidden = spec is not None and spec.proposer.hidden_layers
    snaps = [plan.snapshots(path, i) for i in range(len(s.items))]
    passes, replies = [], []
    for i, snap in enumerate(snaps):
        base = base if i == 0 else store.logits(s, i)
        timed = i < s.timed
        passes.append(
            score(
                runner,
                base,
                c.speed.decode_tokens if timed else 0,
                c.speed.repeats,
                None if hidden else snap,
                spec if timed else None,
            )
        )
        replies.append(base.tokens[base.prompt_len :].tolist())
    greedy = c.spec.temperature == 0
    measured = dict(
        weights_bytes=runner.model.weight_bytes(),
        kv_cache_bytes=runner.kv.bytes_per_position() * plan.max_len,
        peak_mem_bytes=torch.cuda.max_memory_allocated(plan.device) if plan.device.type == "cuda" else None,
        kl_estimate="exact" if isinstance(base, FullLogits) else f"topk{base.k}+tail",
        fallbacks="; ".join(runner.ops.fallbacks()),
    )
    spec_passes = [speculation.pass_columns(p, greedy) for p in passes[: s.timed]] if spec else None
    stats, per_position = set_statistics(s, passes, replies)
    row = rows.make_row(key, stats, measured | speculation.columns(spec_passes), time.perf_counter() - t0)
    rows.write_row(path, row, per_position)
    if row["degenerate"]:
        print(
            f"warning: {s.name}: {row['reply_repeat_frac']:.0%} of the base reply repeats its own 4-grams "
            "(a loop): the scored window is trivially predictable and its KL understates the drift",
            file=sys.stderr,
        )
    for snap in snaps:
        snap.clear()
