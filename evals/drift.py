"""Drift passes: the base side of an item, and a candidate teacher-forced over it, timed in the same pass.

The base pass prefills an item's prompt, takes its reply (the item's fixed tokens, or the greedy
reply it decodes), then runs that reply teacher-forced for the float32 logits at every scored
position. The candidate pass (:func:`score`) runs the same tokens teacher-forced and compares its
logits with the base's position by position (:mod:`evals.metrics`); its prompt prefill is timed,
then the sequence is cut back to the prompt and greedy decode steps (and, with a proposer, the
same steps decoded speculatively) are timed after it. Every pass returns its results as a value.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from evals.base_logits import FullLogits
from evals.evaluation import Item, ScoredSet
from evals.intervals import row_intervals
from evals.metrics import (
    DEGENERATE_REPEAT,
    MetricsAccumulator,
    greedy_agreement_length,
    repeated_ngram_fraction,
    summarize,
)
from tileinfer.core.errors import NonFiniteLogits
from tileinfer.core.progress import progress_bar
from tileinfer.engine.generation import SamplingParams
from tileinfer.engine.proposers import Proposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.snapshots import Restored, Snapshots
from tileinfer.engine.speculative import SpecReply, speculative_decode


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` unchanged, or NonFiniteLogits when any is NaN or infinite (a corrupt checkpoint or a
    broken kernel: every metric computed from them would be meaningless)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            "the model produced non-finite logits (NaN or inf): a corrupt checkpoint, "
            "a dtype that overflows, or a broken kernel; nothing was written"
        )
    return logits


@dataclass
class SpecResult:
    """A timed speculative run after the prompt: its reply (the same steps as the plain decode) and
    wall time in seconds (synchronized host clock; the median of the repetitions when repeated)."""

    reply: SpecReply
    seconds: float


@dataclass
class PassResult:
    """One candidate pass over an item.

    ``per_position`` holds :func:`evals.metrics.position_metrics` (on the CPU) at every scored
    position. Timings are seconds from a synchronized host clock: ``prefill_s`` is None when the
    prefill was resumed from a snapshot (not timed in one piece); ``decode_rep_s`` holds each timed
    repetition of the ``decode_steps`` plain greedy decode steps, ``decoded`` their tokens (the last
    repetition's) and ``margins`` their top-1 minus top-2 logit (measured untimed, only for greedy
    speculation; else empty); ``spec`` the speculative run over the same steps (None without a
    proposer).
    """

    per_position: dict[str, torch.Tensor]
    prefill_s: float | None
    decode_rep_s: list[float]
    decode_steps: int
    decoded: list[int]
    margins: list[float]
    spec: SpecResult | None = None

    @property
    def decode_s(self) -> float:
        """Median seconds of one repetition of the timed decode steps."""
        return statistics.median(self.decode_rep_s)


@dataclass
class Speculation:
    """What a pass speculates with: a proposer, at most ``k`` drafts per round, and the sampling
    (greedy unless ``sampling.temperature > 0``)."""

    proposer: Proposer
    k: int
    sampling: SamplingParams = SamplingParams()

    def run(self, runner: ModelRunner, seq, tokens: list[int], n: int) -> SpecResult:
        """``n`` tokens after ``tokens`` (``seq`` caches all but the last), timed."""
        self.proposer.begin(tokens)
        try:
            runner.synchronize()
            t0 = time.perf_counter()
            reply = speculative_decode(runner, seq, tokens, n, self.proposer, self.k, self.sampling)
            runner.synchronize()
            return SpecResult(reply, time.perf_counter() - t0)
        finally:
            self.proposer.end()


def prefill(
    runner: ModelRunner, seq, prompt: list[int], snaps: Snapshots, progress: str, proposer: Proposer | None = None
) -> tuple[Restored, bool]:
    """Prefill ``prompt`` into the empty ``seq`` chunk by chunk, from a snapshot where one exists.

    Returns (state, resumed): ``state.first`` holds the float32 logits [vocab] after the prompt, and
    ``state.fed`` may run past the prompt when the snapshot did (a base reply in progress).
    A snapshot is saved at a chunk boundary when due, and on Ctrl-C. A ``proposer`` conditioned on
    the target's hidden states observes them chunk by chunk (pass no snapshots then: a restored
    chunk has none).
    """
    state = snaps.restore(runner, seq, prompt)
    resumed = bool(state.fed)
    if len(state.fed) >= len(prompt):
        return state, resumed
    bar = progress_bar(len(prompt), progress, initial=len(state.fed))
    try:
        for start in range(len(state.fed), len(prompt), runner.prefill_chunk):
            chunk = prompt[start : start + runner.prefill_chunk]
            if proposer is not None and proposer.hidden_layers:
                logits, hidden = runner.step(seq, torch.tensor(chunk), slice(-1, None), proposer.hidden_layers)
                proposer.observe(hidden)
            else:
                logits = runner.prefill(seq, chunk)[None]
            state.last = check_finite(logits)[0]
            state.fed = prompt[: seq.length]
            bar.update(seq.length - start)
            if snaps.due() and seq.length < len(prompt):
                snaps.save(runner, seq, state.fed, None, state.last)
    except KeyboardInterrupt:
        snaps.save(runner, seq, state.fed, None, state.last)
        raise
    finally:
        bar.close()
    state.first = state.last
    return state, resumed


def base_pass(runner: ModelRunner, item: Item, stop_ids, snaps: Snapshots) -> FullLogits:
    """The base side of ``item`` in one pass: its prompt is prefilled once, its reply is the item's
    fixed tokens or the greedy reply of at most ``item.n_reply`` tokens decoded after the prompt
    (ending at a stop id, which is kept), then the sequence is cut back to the prompt and the reply
    is run teacher-forced, exactly as :func:`score` runs a candidate, for the float32 logits
    [len(reply), vocab] at every scored position (on the CPU). Resumable (:mod:`tileinfer.engine.snapshots`).

    Raises:
        NonFiniteLogits: NaN or infinite logits anywhere.
        UserError: prompt plus reply exceed the runner's context.
    """
    prompt = list(item.prompt)
    seq = runner.new_sequence()
    try:
        runner.check_length(seq, len(prompt) + item.n_reply - 1)
        state, _ = prefill(runner, seq, prompt, snaps, "base prefill")
        reply = list(item.reply) if item.reply is not None else None
        if reply is None:
            reply = _greedy_reply(runner, seq, prompt, item.n_reply, stop_ids, snaps, state)
        seq.truncate(len(prompt))
        logits = [state.first[None].cpu()]
        # the last reply token is never an input: nothing after it is scored
        for _, lg in runner.chunks(seq, reply[:-1], logits_from=len(prompt), progress="base score"):
            logits.append(check_finite(lg).cpu())
        snaps.clear()
        return FullLogits(torch.tensor(prompt + reply), len(prompt), torch.cat(logits))
    finally:
        seq.release()


def _greedy_reply(runner, seq, prompt, n_reply, stop_ids, snaps: Snapshots, state: Restored) -> list[int]:
    """Greedy decode after the prefilled prompt (continuing a snapshot's reply); the stop token that
    ends it is kept."""
    reply = state.fed[len(prompt) :]
    logits = state.last
    bar = progress_bar(n_reply, "base reply", initial=len(reply))
    try:
        while True:
            token = int(runner.ops.argmax(logits[None])[0])
            reply.append(token)
            bar.update(1)
            if token in stop_ids or len(reply) >= n_reply:
                return reply
            logits = check_finite(runner.decode(seq, token)[None])[0]
            if snaps.due():
                snaps.save(runner, seq, prompt + reply, state.first, logits)
    except KeyboardInterrupt:
        if seq.length > len(state.fed):  # tokens fed since the restore: only fully fed ones are kept
            snaps.save(runner, seq, prompt + reply[: seq.length - len(prompt)], state.first, logits)
        raise
    finally:
        bar.close()


def score(
    runner: ModelRunner,
    base,
    decode_steps: int = 0,
    repeats: int = 1,
    snaps: Snapshots | None = None,
    spec: Speculation | None = None,
) -> PassResult:
    """Run the candidate ``runner`` teacher-forced over the base's token stream and compare it with
    the base at every scored position.

    ``base`` is an :class:`evals.base_logits.FullLogits` (exact KL) or a stored
    :class:`evals.base_logits.TopKLogits` (top-k + tail KL estimate). The prompt prefill is timed
    (resumed from ``snaps`` where a snapshot exists, and then not timed); after the scored chunks the
    sequence is cut back to the prompt and ``decode_steps`` greedy decode steps are timed,
    ``repeats`` times (cut back in between: one slow repetition, from a clock ramp or a first-use
    compile, moves the median no more than a fast one). With ``spec`` the same steps are decoded
    speculatively after the prompt, timed as often. Ctrl-C while scoring leaves a snapshot of the
    prefilled prompt.
    """
    snaps = snaps or Snapshots(None)
    acc = MetricsAccumulator()
    seq = runner.new_sequence()
    try:
        tokens = [int(t) for t in base.tokens]
        prompt, reply = tokens[: base.prompt_len], tokens[base.prompt_len :]
        runner.synchronize()
        t0 = time.perf_counter()
        state, resumed = prefill(runner, seq, prompt, snaps, "prefill", spec and spec.proposer)
        runner.synchronize()
        prefill_s = None if resumed else time.perf_counter() - t0
        acc.extend(base.position_metrics(0, state.first[None]))
        try:
            # the last reply token is never an input: nothing after it is scored
            for pos, logits in runner.chunks(seq, reply[:-1], logits_from=base.prompt_len, progress="score"):
                acc.extend(base.position_metrics(pos - base.prompt_len + 1, check_finite(logits)))
        except KeyboardInterrupt:
            if not resumed:
                snaps.save(runner, seq, prompt, state.first, state.first)
            raise
        rep_s, decoded = [], []
        for _ in range(repeats if decode_steps else 0):
            seq.truncate(base.prompt_len)
            token, decoded = reply[0], []
            runner.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode_steps):  # as greedy generation runs: the argmax inside the decode graph
                token = runner.decode_greedy(seq, token)
                decoded.append(token)
            runner.synchronize()
            rep_s.append(time.perf_counter() - t0)
        result = PassResult(acc.per_position(), prefill_s, rep_s or [0.0], decode_steps, decoded, [])
        if spec is not None:
            if spec.sampling.temperature == 0:  # margins where a speculative reply may part: untimed, same steps
                seq.truncate(base.prompt_len)
                result.margins = top2_margins(runner, seq, [reply[0], *decoded[:-1]])
            runs = []
            for _ in range(repeats):
                seq.truncate(base.prompt_len)
                runs.append(spec.run(runner, seq, prompt + reply[:1], decode_steps))
            result.spec = SpecResult(runs[0].reply, statistics.median(r.seconds for r in runs))
        return result
    finally:
        seq.release()


def top2_margins(runner: ModelRunner, seq, tokens: list[int]) -> list[float]:
    """Decode ``tokens`` one step each (the logits graph of the timed steps' path); the top-1 minus
    top-2 logit of every step."""
    top2 = torch.stack([runner.decode(seq, t) for t in tokens]).topk(2, dim=-1).values if tokens else None
    return [] if top2 is None else (top2[:, 0] - top2[:, 1]).tolist()


def warm_up(runner: ModelRunner, stream, spec: Speculation | None = None) -> None:
    """One short prefill and a decode step (with ``spec``: a verify step of every length up to k + 1,
    whose CUDA graphs are captured then, and a short speculative run), so compilation, graph capture
    and allocation stay out of timings."""
    seq = runner.new_sequence()
    try:
        n = min(stream.prompt_len, 2 * runner.prefill_chunk)
        tokens = [int(t) for t in stream.tokens[: n + 1]]
        prefill(runner, seq, tokens[:n], Snapshots(None), None, spec and spec.proposer)
        for t in tokens[n:]:
            runner.decode_greedy(seq, t)  # the timed decode steps' graph
        if spec is not None:
            if not spec.proposer.hidden_layers:  # a verify graph per draft length, captured untimed
                verify = runner.verify if spec.sampling.temperature > 0 else runner.verify_greedy
                for T in range(2, spec.k + 2):
                    seq.truncate(n)
                    verify(seq, tokens[n:] * T)
            seq.truncate(n)
            spec.run(runner, seq, tokens, min(2 * spec.k + 2, runner.max_seq_len - n))
        runner.synchronize()
    finally:
        seq.release()


# Per-position values saved beside a row, with each position's item (``group``).
POSITION_COLUMNS = ("kl", "top1_agree", "dp", "logp_base", "logp_cand")


def speed_columns(rep_tok_s: list[float]) -> dict:
    """Decode speed from the tok/s of timed repetitions: ``decode_tok_s`` their median,
    ``decode_ms_per_tok`` its inverse, ``decode_tok_s_min`` / ``decode_tok_s_max`` the spread and
    ``decode_reps`` how many; NaN speeds without any."""
    if not rep_tok_s:
        nan = float("nan")
        return dict(decode_tok_s=nan, decode_ms_per_tok=nan, decode_tok_s_min=nan, decode_tok_s_max=nan, decode_reps=0)
    median = statistics.median(rep_tok_s)
    return dict(
        decode_tok_s=median,
        decode_ms_per_tok=1e3 / median,
        decode_tok_s_min=min(rep_tok_s),
        decode_tok_s_max=max(rep_tok_s),
        decode_reps=len(rep_tok_s),
    )


def _mean_finite(values: list[float]) -> float:
    timed = [v for v in values if math.isfinite(v)]
    return sum(timed) / len(timed) if timed else float("nan")


def set_statistics(scored: ScoredSet, passes: list[PassResult], replies: list[list[int]]) -> tuple[dict, dict]:
    """The statistics of a scored set from the candidate passes over its items, and its per-position table.

    Args:
        scored: the scored set (its items, unit and extra columns).
        passes: one :class:`PassResult` per item, in order.
        replies: the scored tokens of each item: ``reply_repeat_frac`` is the share of them that
            complete a 4-gram seen earlier in the same reply (:func:`evals.metrics.repeated_ngram_fraction`),
            and ``degenerate`` flags a set above :data:`evals.metrics.DEGENERATE_REPEAT` (a reply
            stuck in a loop is trivially predictable, so its KL understates the drift on real text).

    Returns:
        The statistics over the positions of all items together (:func:`evals.metrics.summarize`) with
        their 95% intervals resampling whole items (:func:`evals.intervals.row_intervals`);
        ``greedy_agree_len`` the mean over items, ``n_scored`` the positions, prefill speeds the means
        over the items that timed them, decode speeds (:func:`speed_columns`) pooling every timed
        repetition, the scored set's own columns and the reply's repetition. And the per-position
        table: :data:`POSITION_COLUMNS` plus each position's item (``group``).
    """
    per_pos = {k: torch.cat([p.per_position[k] for p in passes]) for k in passes[0].per_position}
    group = torch.cat([torch.full((len(p.per_position["kl"]),), i) for i, p in enumerate(passes)])
    agree = [greedy_agreement_length(p.per_position["argmax_cand"], p.per_position["argmax_base"]) for p in passes]
    prefill_s = [math.nan if p.prefill_s is None else p.prefill_s for p in passes]
    reps = [p.decode_steps / s for p in passes if p.decode_steps for s in p.decode_rep_s]
    repeat = sum(repeated_ngram_fraction(r) * len(r) for r in replies) / max(1, sum(map(len, replies)))
    stats = {
        "n_prompts": len(passes),
        **summarize(per_pos),
        "greedy_agree_len": sum(agree) / len(agree),
        "n_scored": len(group),
        "prefill_ms": _mean_finite([1e3 * s for s in prefill_s]),
        "prefill_tok_s": _mean_finite([len(i.prompt) / s for i, s in zip(scored.items, prefill_s, strict=True)]),
        **speed_columns(reps),
        **row_intervals(per_pos, group, scored.unit),
        **scored.columns,
        "reply_repeat_frac": repeat,
        "degenerate": repeat > DEGENERATE_REPEAT,
    }
    return stats, {k: per_pos[k] for k in POSITION_COLUMNS} | {"group": group}
