"""Speculative decoding statistics of a scored set: the row columns of its speculative runs.

A job with ``spec`` other than ``none`` times, after each timed item, the plain greedy decode steps
and then the same steps decoded speculatively (:func:`evals.drift.score`), so the speed-up is
measured in one process on one cache. With greedy verification the speculative tokens must equal
the plain ones; a mismatch is recorded with the target's top-1/top-2 logit margin at that step
(a near-tie is rounding between the verify and the decode path; a wide margin is a bug).
Column names follow vLLM's and DFlash's (drafts, acceptance rate, mean acceptance length).
"""

from __future__ import annotations

import math

from evals.drift import PassResult

# Columns every row carries (null without speculation), in table order.
COLUMNS = (
    "spec_drafts",
    "spec_drafted_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_acceptance_length",
    "spec_tokens_per_forward",
    "spec_acceptance_at",
    "spec_histogram",
    "spec_draft_ms",
    "spec_verify_ms",
    "spec_decode_tok_s",
    "spec_speedup",
    "spec_exact",
    "spec_first_mismatch",
    "spec_mismatch_margin",
)


def pass_columns(t: PassResult, greedy: bool) -> dict:
    """Raw counts of one prompt's speculative run (summed over prompts by :func:`columns`)."""
    s = t.spec.reply.stats
    mismatch = next((i for i, (a, b) in enumerate(zip(t.spec.reply.tokens, t.decoded)) if a != b), None)
    if mismatch is None and len(t.spec.reply.tokens) != len(t.decoded):  # one stopped early
        mismatch = min(len(t.spec.reply.tokens), len(t.decoded))
    return dict(
        stats=s,
        spec_s=t.spec.seconds,
        plain_s=t.decode_s,
        steps=t.decode_steps,
        exact=None if not greedy else mismatch is None,
        mismatch=mismatch if greedy else None,
        margin=t.margins[mismatch] if greedy and mismatch is not None and mismatch < len(t.margins) else None,
    )


def columns(passes: list[dict] | None) -> dict:
    """The row's speculation columns (:data:`COLUMNS`) over a prompt set's runs (:func:`pass_columns`);
    all None without speculation. Rates are pooled over the prompts' drafts; speeds are total tokens
    over total seconds (``spec_speedup`` is plain over speculative seconds); ``spec_first_mismatch``
    / ``spec_mismatch_margin`` describe the prompt whose reply parted at the widest margin (a step
    index within its timed steps; margin None when unknown, e.g. a reply that stopped early)."""
    if not passes:
        return dict.fromkeys(COLUMNS)
    stats = [p["stats"] for p in passes]
    k = stats[0].k
    drafts, drafted, accepted = (
        sum(getattr(s, f) for s in stats) for f in ("drafts", "drafted_tokens", "accepted_tokens")
    )
    forwards, new = sum(s.target_forwards for s in stats), sum(s.new_tokens for s in stats)
    drafted_at = [sum(s.drafted_at[i] for s in stats) for i in range(k)]
    accepted_at = [sum(s.accepted_at[i] for s in stats) for i in range(k)]
    steps, spec_s, plain_s = (sum(p[f] for p in passes) for f in ("steps", "spec_s", "plain_s"))
    # every prompt's first divergence is its own event: the row keeps the widest (a bug shows there)
    parted = [p for p in passes if p["mismatch"] is not None]
    first = max(parted, key=lambda p: math.inf if p["margin"] is None else p["margin"], default=None)
    exact = None if passes[0]["exact"] is None else all(p["exact"] for p in passes)
    return dict(
        spec_drafts=drafts,
        spec_drafted_tokens=drafted,
        spec_accepted_tokens=accepted,
        spec_acceptance_rate=accepted / drafted if drafted else math.nan,
        spec_acceptance_length=1 + accepted / drafts if drafts else math.nan,
        spec_tokens_per_forward=new / forwards if forwards else math.nan,
        spec_acceptance_at=[a / d if d else math.nan for a, d in zip(accepted_at, drafted_at, strict=True)],
        spec_histogram=[sum(s.histogram[i] for s in stats) for i in range(k + 1)],
        spec_draft_ms=1e3 * sum(s.draft_s for s in stats) / forwards if forwards else math.nan,
        spec_verify_ms=1e3 * sum(s.verify_s for s in stats) / forwards if forwards else math.nan,
        spec_decode_tok_s=steps / spec_s if spec_s else math.nan,
        spec_speedup=plain_s / spec_s if spec_s else math.nan,
        spec_exact=exact,
        spec_first_mismatch=None if first is None else first["mismatch"],
        spec_mismatch_margin=None if first is None else first["margin"],
    )
