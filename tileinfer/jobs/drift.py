"""Drift of a candidate configuration against the BF16 base, with speed from the same pass.

Both configurations read the identical token stream: a prompt of ``ctx`` tokens followed by the
base model's greedy reply. The candidate is run teacher-forced over the stream, so the logits
at every reply position are comparable one to one with the base's (the method of llama.cpp's
``--kl-divergence``, applied to a model-generated continuation as in TileInfer.jl's evaluation).
The prompt prefill of that same pass is timed, then the sequence is cut back to ``ctx`` positions
and decode steps are timed after them.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from evals.base_logits import FullLogits
from evals.metrics import MetricsAccumulator, greedy_agreement_length
from tileinfer.core import files
from tileinfer.core.errors import NonFiniteLogits
from tileinfer.core.progress import progress_bar
from tileinfer.engine.generation import SamplingParams
from tileinfer.engine.proposers import Proposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import SpecReply, speculative_decode
from tileinfer.jobs.resume import Restored, Snapshots


@dataclass(frozen=True)
class Stream:
    """The shared token stream: ``tokens[:prompt_len]`` is the prompt, the rest the base reply."""

    tokens: tuple[int, ...]
    prompt_len: int

    @property
    def reply(self) -> tuple[int, ...]:
        return self.tokens[self.prompt_len :]


def load_stream(cache_file: Path, prompt: list[int], n_reply: int) -> Stream | None:
    """The stream :func:`save_stream` left in ``cache_file`` for this prompt and reply length, or None
    (no file, another prompt, or a damaged file: the reply is then generated again)."""
    try:
        saved = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("prompt") != list(prompt) or saved.get("n_reply") != n_reply:
        return None
    return Stream(tuple(saved["prompt"] + saved["reply"]), len(prompt))


def save_stream(stream: Stream, n_reply: int, cache_file: Path) -> None:
    """Save a stream atomically for :func:`load_stream` (once its logits proved finite)."""
    prompt = list(stream.tokens[: stream.prompt_len])
    files.write_text(cache_file, json.dumps({"prompt": prompt, "reply": list(stream.reply), "n_reply": n_reply}))


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
class PassResult:
    """Timings of one teacher-forced pass (seconds, from a synchronized host clock); ``prefill_s`` is
    None when the prefill was resumed from a snapshot (not timed in one piece). ``decode_rep_s`` holds
    the seconds of each timed repetition of the ``decode_steps`` plain decode steps, ``decoded`` their
    greedy tokens (the first repetition's) and ``margins`` their top-1 minus top-2 logit (measured,
    untimed, only for greedy speculation; else empty); ``spec`` the speculative run over the same
    steps (None without a proposer)."""

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
class SpecResult:
    """A timed speculative run after the prompt: its reply (the same steps as the plain decode) and
    wall time in seconds (synchronized host clock; the median of the repetitions when repeated)."""

    reply: SpecReply
    seconds: float


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


def base_pass(
    runner: ModelRunner, prompt: list[int], n_reply: int, stop_ids, snaps: Snapshots, reply: list[int] | None = None
) -> FullLogits:
    """The base side of a prompt in one pass: the prompt is prefilled once, the greedy reply of at
    most ``n_reply`` tokens (ending at a stop id) is decoded after it (unless ``reply`` is given,
    e.g. from the stream cache), then the sequence is cut back to the prompt and the reply is run
    teacher-forced, exactly as :func:`teacher_forced` runs a candidate, for the float32 logits
    [len(reply), vocab] at every scored position (on the CPU). Resumable (:mod:`resume`).

    Raises:
        NonFiniteLogits: NaN or infinite logits anywhere.
        UserError: prompt plus reply exceed the runner's context.
    """
    seq = runner.new_sequence()
    try:
        runner.check_length(seq, len(prompt) + n_reply - 1)
        state, _ = prefill(runner, seq, prompt, snaps, "base prefill")
        if reply is None:
            reply = _greedy_reply(runner, seq, prompt, n_reply, stop_ids, snaps, state)
        seq.truncate(len(prompt))
        logits = [state.first[None].cpu()]
        # the last reply token is never an input: nothing after it is scored
        for _, lg in runner.chunks(seq, reply[:-1], logits_from=len(prompt), progress="base score"):
            logits.append(check_finite(lg).cpu())
        snaps.clear()
        return FullLogits(torch.tensor(prompt + list(reply)), len(prompt), torch.cat(logits))
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


def teacher_forced(
    runner: ModelRunner,
    stream,
    decode_steps: int = 0,
    timings: list | None = None,
    snaps: Snapshots | None = None,
    spec: Speculation | None = None,
    repeats: int = 1,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Run ``stream`` through ``runner``; yield ``(i, logits)`` chunks of the scored positions.

    ``stream`` is anything with ``tokens`` (prompt then reply) and ``prompt_len``: a :class:`Stream`
    or a stored base logits.

    Row ``j`` of a chunk starting at ``i`` holds float32 logits [vocab] predicting reply token
    ``i + j``. The prompt prefill is timed (resumed from ``snaps`` where a snapshot exists, and then
    not timed); after the last chunk the sequence is cut back to the prompt and ``decode_steps``
    greedy decode steps are timed, ``repeats`` times (cut back in between: one slow repetition, from a
    clock ramp or a first-use compile, moves the median no more than a fast one). With ``spec``, the
    same steps are decoded speculatively after the prompt, timed as often. The :class:`PassResult` is appended to
    ``timings`` when the generator finishes. Ctrl-C while scoring leaves a snapshot of the prefilled
    prompt.
    """
    snaps = snaps or Snapshots(None)
    seq = runner.new_sequence()
    try:
        tokens = [int(t) for t in stream.tokens]
        prompt, reply = tokens[: stream.prompt_len], tokens[stream.prompt_len :]
        runner.synchronize()
        t0 = time.perf_counter()
        state, resumed = prefill(runner, seq, prompt, snaps, "prefill", spec and spec.proposer)
        runner.synchronize()
        prefill_s = None if resumed else time.perf_counter() - t0
        yield 0, state.first[None]
        try:
            # the last reply token is never an input: nothing after it is scored
            for pos, logits in runner.chunks(seq, reply[:-1], logits_from=stream.prompt_len, progress="score"):
                yield pos - stream.prompt_len + 1, check_finite(logits)
        except KeyboardInterrupt:
            if not resumed:
                snaps.save(runner, seq, prompt, state.first, state.first)
            raise
        rep_s, decoded = [], []
        for _ in range(repeats if decode_steps else 0):
            seq.truncate(stream.prompt_len)
            token, decoded = reply[0], []
            runner.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode_steps):  # as greedy generation runs: the argmax inside the decode graph
                token = runner.decode_greedy(seq, token)
                decoded.append(token)
            runner.synchronize()
            rep_s.append(time.perf_counter() - t0)
        result = PassResult(prefill_s, rep_s or [0.0], decode_steps, decoded, [])
        if spec is not None:
            if spec.sampling.temperature == 0:  # margins where a speculative reply may part: untimed, same steps
                seq.truncate(stream.prompt_len)
                result.margins = top2_margins(runner, seq, [reply[0], *decoded[:-1]])
            runs = []
            for _ in range(repeats):
                seq.truncate(stream.prompt_len)
                runs.append(spec.run(runner, seq, prompt + reply[:1], decode_steps))
            result.spec = SpecResult(runs[0].reply, statistics.median(r.seconds for r in runs))
        if timings is not None:
            timings.append(result)
    finally:
        seq.release()


def top2_margins(runner: ModelRunner, seq, tokens: list[int]) -> list[float]:
    """Decode ``tokens`` one step each (the logits graph of the timed steps' path); the top-1 minus
    top-2 logit of every step."""
    top2 = torch.stack([runner.decode(seq, t) for t in tokens]).topk(2, dim=-1).values if tokens else None
    return [] if top2 is None else (top2[:, 0] - top2[:, 1]).tolist()


def full_logits(runner: ModelRunner, stream: Stream) -> FullLogits:
    """The base's float32 logits [len(reply), vocab] (on the CPU) at every scored position."""
    logits = torch.cat([lg.cpu() for _, lg in teacher_forced(runner, stream)])
    return FullLogits(torch.tensor(stream.tokens), stream.prompt_len, logits)


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


def score(
    runner: ModelRunner,
    base,
    decode_steps: int,
    snaps: Snapshots | None = None,
    spec: Speculation | None = None,
    passes: list | None = None,
    repeats: int = 1,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Compare ``runner`` with a base on the base's token stream; return metrics and speed.

    ``base`` is an :class:`evals.base_logits.FullLogits` (exact KL) or a stored
    :class:`evals.base_logits.TopKLogits` (top-k + tail KL estimate).

    Returns (summary, per_position): the :func:`evals.metrics.summarize` statistics plus
    ``greedy_agree_len`` (tokens), ``n_scored``, ``prefill_ms``, ``prefill_tok_s`` and
    ``decode_rep_tok_s`` (tok/s of each of the ``repeats`` timed repetitions of the decode steps;
    from a synchronized host clock on ``runner``'s device; :func:`tileinfer.jobs.tables.speed_columns` condenses them);
    and the per-position arrays of :func:`evals.metrics.position_metrics` [n_scored].
    With ``spec`` the timed decode steps are also run speculatively (:func:`teacher_forced`); the
    pass's :class:`PassResult` is appended to ``passes`` when given.
    """
    acc, timings = MetricsAccumulator(), []
    for i, logits in teacher_forced(runner, base, decode_steps, timings, snaps, spec, repeats):
        acc.extend(base.position_metrics(i, logits))
    per_pos = acc.per_position()
    t = timings[0]
    if passes is not None:
        passes.append(t)
    out = acc.summary()
    out.update(
        # against the base's own teacher-forced argmax, not the stream: the stream came from
        # decode steps, whose rounding can flip a near-tie the prefill path resolves the other way
        greedy_agree_len=greedy_agreement_length(per_pos["argmax_cand"], per_pos["argmax_base"]),
        n_scored=len(base.tokens) - base.prompt_len,
        prefill_ms=float("nan") if t.prefill_s is None else 1e3 * t.prefill_s,
        prefill_tok_s=float("nan") if t.prefill_s is None else base.prompt_len / t.prefill_s,
        decode_rep_tok_s=[t.decode_steps / s for s in t.decode_rep_s] if t.decode_steps else [],
    )
    return out, per_pos
