"""Speculative decoding proposers: what guesses the next tokens for the target model to verify.

A proposer sees the whole token sequence and proposes up to ``k`` tokens to follow it; the target
checks them in one forward pass (tileinfer.engine.speculative). Proposers here are deterministic
(a point-mass draft distribution), which the rejection sampler handles exactly. The names follow
vLLM's: proposer, draft, acceptance.
"""

from __future__ import annotations

import torch

from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner


class Proposer:
    """The interface the speculative loop drives, once per sequence:

    1. :meth:`begin` with the prompt, once the target has cached it;
    2. per round, :meth:`propose` given every token so far (the last one not yet run by the target),
       then :meth:`accept` with how many of the proposed tokens the target accepted;
    3. :meth:`end` when the sequence is done.

    A proposer conditioned on the target's hidden states (DFlash) names the target layers in
    ``hidden_layers``; the loop then passes the target's captured outputs of those layers, for every
    position the target keeps, in order, to :meth:`observe` (the prompt's first, before :meth:`begin`).
    """

    hidden_layers: tuple[int, ...] = ()

    def observe(self, hidden: torch.Tensor) -> None:
        """Target hidden states [T, len(hidden_layers) * hidden_size] of the next T kept positions."""

    def begin(self, prompt: list[int]) -> None:
        """A new sequence whose first ``len(prompt)`` tokens the target has cached."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (possibly none)."""
        raise NotImplementedError

    def accept(self, n: int) -> None:
        """The target accepted the first ``n`` tokens of the last proposal."""

    def end(self) -> None:
        """The sequence is done: free what it held."""


class NgramProposer(Proposer):
    """Prompt-lookup decoding (Saxena, 2023), as vLLM's n-gram proposer does it: the longest suffix
    of the sequence with length in [min_n, max_n] that also occurs earlier proposes the up to ``k``
    tokens that followed that earlier occurrence (the earliest occurrence when there are several;
    an occurrence may overlap the suffix). No match of at least ``min_n`` tokens: no proposal.

    Raises:
        UserError: min_n < 1 or max_n < min_n.
    """

    def __init__(self, min_n: int = 5, max_n: int = 5):
        if min_n < 1 or max_n < min_n:
            raise UserError(f"spec.min_n={min_n}, spec.max_n={max_n}: need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        # n-gram -> its earliest start, for every n-gram with a token after it: a proposal then costs
        # one lookup per n, not a scan of the context (0.2 ms at 8k tokens, 5-8% of a Qwen3-4B step)
        self._seen: list[int] = []
        self._first: dict[tuple[int, ...], int] = {}

    def _index(self, tokens: list[int]) -> None:
        """Extend the index to ``tokens`` (rebuilt when they do not extend the tokens seen so far)."""
        if tokens[: len(self._seen)] != self._seen:
            self.begin([])
        old, total = len(self._seen), len(tokens)
        for end in range(max(old, 1), total):  # n-grams ending at end - 1: a token follows them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._first.setdefault(tuple(tokens[end - n : end]), end - n)
        self._seen = list(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._index(tokens)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            p = self._first.get(tuple(tokens[total - n :]))
            if p is not None:
                return list(tokens[p + n : p + n + k])
        return []


class DraftModelProposer(Proposer):
    """A smaller model with the same tokenizer proposes ``k`` tokens by ``k`` greedy steps (its
    decode steps replay its captured CUDA graph where the runner has one). Its paged KV cache is kept
    in step with the target's accepted prefix: before each proposal it is cut back to the longest
    prefix it shares with the sequence and the missing tokens are run in one step.

    Args:
        runner: the draft model's runner (its own KV cache, quant config and backend).
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seq = None
        self.fed: list[int] = []  # tokens in the draft's KV cache, in order

    def begin(self, prompt: list[int]) -> None:
        self.end()
        self.seq = self.runner.new_sequence()
        self.runner.prefill(self.seq, prompt[:-1])  # the last prompt token is fed with the first proposal
        self.fed = list(prompt[:-1])

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        # k drafts run k positions: the unfed tokens, then k - 1 drafts; the draft's context may be
        # shorter than the target's room (a draft with a smaller max_position_embeddings)
        same = 0
        for a, b in zip(self.fed, tokens, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)
        room = self.runner.max_seq_len - same - (len(tokens) - same)
        k = min(k, room + 1)
        if k < 1:
            return []
        self.seq.truncate(same)
        out = [self.runner.verify_greedy(self.seq, tokens[same:])[-1]]  # a captured graph for a short catch-up
        for _ in range(k - 1):
            out.append(self.runner.decode_greedy(self.seq, out[-1]))
        self.fed = list(tokens) + out[:-1]
        return out

    def end(self) -> None:
        if self.seq is not None:
            self.seq.release()
            self.seq = None
        self.fed = []


def check_same_vocab(target_tok, draft_tok, draft_vocab: int, target_vocab: int) -> None:
    """Refuse a draft model whose token ids mean other things than the target's.

    ``target_tok``/``draft_tok`` are :class:`tileinfer.core.tokenizer.Tokenizer`s; their vocabularies
    (token text to id, added tokens included) must be equal; the draft's ``draft_vocab`` logits must
    cover every id of them and no more than the target's ``target_vocab`` embedding rows (a drafted
    padding id past them could not be verified).

    Raises:
        UserError: another vocabulary, or a draft embedding smaller than the tokenizer or larger than
            the target's.
    """
    a = target_tok.backend.get_vocab(with_added_tokens=True)
    b = draft_tok.backend.get_vocab(with_added_tokens=True)
    if a != b:
        token = next((t for t in sorted(a.keys() | b.keys()) if a.get(t) != b.get(t)), None)
        raise UserError(
            f"the draft model's tokenizer ({len(b)} tokens) is not the target's ({len(a)} tokens; e.g. "
            f"{token!r} is id {a.get(token)} in the target's and {b.get(token)} in the draft's): "
            "speculative decoding needs the same tokenizer"
        )
    if not max(a.values()) < draft_vocab <= target_vocab:
        raise UserError(
            f"the draft model has {draft_vocab} logits: the tokenizer has ids up to {max(a.values())} and the "
            f"target {target_vocab} logits"
        )
