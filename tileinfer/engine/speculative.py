"""Speculative decoding: a proposer drafts tokens, the target verifies them all in one forward pass.

Each round the target runs the pending token plus the ``m <= k`` drafted tokens as one step
(``ModelRunner.verify``: ``m + 1`` positions, causal; on the GPU replayed from a CUDA graph captured
per token count, on the split-KV decode kernels), keeps the longest accepted prefix of the draft plus
one token of its own (the bonus token), and cuts its KV cache back to the kept positions (pages stay
reserved; later steps overwrite the rejected slots). Greedy: a draft token is accepted
while it equals the target's argmax, so the reply is the target's plain greedy reply. Sampled:
the rejection rule of Leviathan et al. (2023) and Chen et al. (2023), as vLLM's rejection sampler
implements it, so the reply is distributed as the target's own samples. Drafts here come from
deterministic proposers (a point-mass draft distribution q): draft token d is accepted with
probability p(d); on rejection the replacement is drawn from p with d removed, renormalized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tileinfer.engine.generation import SamplingParams
from tileinfer.engine.proposers import Proposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.ops.reference import sampling_probs


@dataclass
class SpecStats:
    """Counts of one speculative run (vLLM's and DFlash's names).

    Attributes:
        k: most tokens drafted per round.
        drafts: verify steps that checked at least one drafted token.
        drafted_tokens, accepted_tokens: over all drafts.
        drafted_at, accepted_at: [k] per position in the draft (0 = the first drafted token): how many
            drafts reached that position, and how many of those had it accepted.
        histogram: [k + 1] drafts by number of accepted tokens.
        target_forwards: target steps (verify steps plus plain decode steps of rounds with no draft).
        new_tokens: tokens produced by the target steps (accepted + bonus).
        draft_s, verify_s: seconds spent proposing and verifying (synchronized host clock).
    """

    k: int
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    target_forwards: int = 0
    new_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self):
        self.drafted_at = self.drafted_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k
        self.histogram = self.histogram or [0] * (self.k + 1)

    def record(self, drafted: int, accepted: int) -> None:
        """One verify step that checked ``drafted`` tokens and accepted ``accepted`` of them."""
        self.target_forwards += 1
        self.new_tokens += accepted + 1
        if drafted == 0:
            return
        self.drafts += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.histogram[accepted] += 1
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (NaN without drafts)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan")

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a draft's verify step yields: 1 + accepted / drafts (vLLM's mean acceptance
        length; the 1 is the bonus token). NaN without drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward pass over all rounds, drafted or not."""
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    @property
    def acceptance_at(self) -> list[float]:
        """[k] acceptance rate per draft position, among the drafts that reached it (NaN: none did)."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]


@dataclass
class SpecReply:
    """The tokens a speculative run produced after the pending token (stop token included when one
    ended it) and its :class:`SpecStats`."""

    tokens: list[int]
    stats: SpecStats


def accept_greedy(drafts: list[int], target: list[int]) -> tuple[int, int]:
    """Greedy verification: (accepted, next token). ``target`` [len(drafts) + 1] are the target's
    argmax tokens after the pending token and each draft; a draft is accepted while it equals the
    target's token, and the next token is the target's after the last accepted one."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, int(target[n])


def accept_sampled(
    drafts: list[int], logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling for point-mass drafts: (accepted, next token).

    Draft token d_i is accepted with probability p_i(d_i), where p_i is the target's sampling
    distribution (temperature, top-k, top-p of ``sampling``) at that position; at the first rejection
    the next token is drawn from p_i with d_i removed and renormalized (max(p - q, 0) for a point mass
    q); after full acceptance it is drawn from p after the last draft (the bonus token).
    """
    p = sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    u = torch.rand(len(drafts), generator=gen, device=p.device).tolist()
    for i, d in enumerate(drafts):
        if u[i] < float(p[i, d]):
            continue
        residual = p[i].clone()
        residual[d] = 0.0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen)[0])
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen)[0])


def speculative_decode(
    runner: ModelRunner,
    seq,
    tokens: list[int],
    max_new_tokens: int,
    proposer: Proposer,
    k: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids=frozenset(),
) -> SpecReply:
    """Continue ``seq`` speculatively for up to ``max_new_tokens`` tokens.

    ``seq`` holds the target's KV cache of ``tokens[:-1]``; ``tokens[-1]`` is the pending token (chosen,
    not yet run). Each round drafts ``m = min(k, tokens still wanted - 1, positions left - 1)``
    tokens, so a round never runs past ``max_new_tokens`` or the runner's context. A round whose
    proposal is empty is a plain decode step. ``proposer.begin`` must have been called for this
    sequence. On return ``seq`` holds the KV cache of every token but the last produced one.

    Returns the new tokens (stop token included when one ended the run) and the run's statistics;
    greedy (``sampling.temperature == 0``) the tokens equal :func:`generation.generate`'s for the
    same target, up to rounding differences between a verify step and a decode step.

    Raises:
        ValueError: k < 1.
        UserError: the sequence is already at the runner's context.
    """
    if k < 1:
        raise ValueError(f"k={k}: a speculative round drafts at least one token")
    gen = None
    if sampling.temperature > 0 and sampling.seed is not None:
        gen = torch.Generator(device=runner.device).manual_seed(sampling.seed)
    ops, stats = runner.ops, SpecStats(k)
    tokens = list(tokens)
    out: list[int] = []
    while len(out) < max_new_tokens and (not out or out[-1] not in stop_ids):
        runner.check_length(seq, 1)
        m = min(k, max_new_tokens - len(out) - 1, runner.max_seq_len - seq.length - 1)
        runner.synchronize()
        t0 = time.perf_counter()
        drafts = proposer.propose(tokens, m)[:m] if m > 0 else []
        t1 = time.perf_counter()
        start = seq.length
        feed, hidden = tokens[-1:] + drafts, None
        if proposer.hidden_layers:
            logits, hidden = runner.step(seq, torch.tensor(feed), capture=proposer.hidden_layers)
            target = ops.argmax(logits).tolist()
        elif sampling.temperature > 0:  # the captured graph of this many tokens where the runner uses graphs
            logits = runner.verify(seq, feed)
        else:  # the same, ending in the argmax: no logits leave the graph
            target = runner.verify_greedy(seq, feed)
        if sampling.temperature > 0:
            n, nxt = accept_sampled(drafts, logits, sampling, gen)
        else:
            n, nxt = accept_greedy(drafts, target)
        if hidden is not None:
            proposer.observe(hidden[: n + 1])
        proposer.accept(n)
        runner.synchronize()
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.record(len(drafts), n)
        new = drafts[:n] + [nxt]
        for i, t in enumerate(new):  # a stop token ends the reply even inside an accepted draft
            if t in stop_ids:
                new = new[: i + 1]
                break
        seq.truncate(start + len(new))  # the pending token and the kept drafts; the last new one is pending
        out += new
        tokens += new
    return SpecReply(out, stats)
