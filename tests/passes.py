"""Drift passes in tests: a base teacher-forced over given tokens, and a candidate's statistics."""

from __future__ import annotations

from evals.base_logits import FullLogits
from evals.drift import PassResult, base_pass, score
from evals.evaluation import Item
from evals.metrics import summarize
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.snapshots import Snapshots


def full_logits(runner: ModelRunner, tokens, prompt_len: int) -> FullLogits:
    """The base's float32 logits at every position after ``prompt_len`` of ``tokens``, teacher-forced."""
    tokens = tuple(int(t) for t in tokens)
    item = Item(tokens[:prompt_len], tokens[prompt_len:], len(tokens) - prompt_len)
    return base_pass(runner, item, set(), Snapshots(None))


def drift(runner: ModelRunner, base, **kw) -> tuple[dict, PassResult]:
    """:func:`evals.drift.score` of ``runner`` against ``base``, and the statistics of its positions
    (:func:`evals.metrics.summarize`)."""
    result = score(runner, base, **kw)
    return summarize(result.per_position), result
