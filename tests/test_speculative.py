"""Speculative decoding in the engine: proposers on hand-made sequences, exact greedy output on tiny
random models, KV rollback, and the rejection sampler's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from quantize.weights import quantize_weights
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.engine.generation import SamplingParams, generate
from tileinfer.engine.proposers import DraftModelProposer, NgramProposer, Proposer
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import accept_sampled, speculative_decode
from tileinfer.models import Transformer

TARGET = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
DRAFT = TARGET | dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, head_dim=8)


def model(hf: dict, seed: int, int8_weights: bool = False) -> Transformer:
    c = ModelConfig.from_hf(hf)
    sd = random_state_dict(hf, seed=seed, dtype=torch.float32)
    if int8_weights:
        sd, _ = quantize_weights(sd, c)
    return Transformer.from_state_dict(c, sd, dtype=torch.float32)


def runner(m: Transformer, max_seq_len=128, page_size=8, kv_int8=False) -> ModelRunner:
    return ModelRunner(m, "reference", kv_int8=kv_int8, max_seq_len=max_seq_len, page_size=page_size, prefill_chunk=16)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain(r: ModelRunner, p: list[int], n: int) -> list[int]:
    return generate(r, p, n).tokens


def speculate(r: ModelRunner, p: list[int], n: int, proposer: Proposer, k: int):
    """The plain run's first token from a prefill, then ``n - 1`` speculative tokens after it."""
    seq = r.new_sequence()
    try:
        first = int(r.prefill(seq, p).argmax())
        proposer.begin(p + [first])
        reply = speculative_decode(r, seq, p + [first], n - 1, proposer, k)
        proposer.end()
        return [first] + reply.tokens, reply.stats, seq.length
    finally:
        seq.release()


class Oracle(Proposer):
    """Proposes the known plain reply (full acceptance) or its tokens plus one (rejection at once)."""

    def __init__(self, reply: list[int], prompt_len: int, wrong: bool = False):
        self.reply, self.prompt_len, self.wrong = reply, prompt_len, wrong

    def propose(self, tokens, k):
        done = len(tokens) - self.prompt_len
        out = self.reply[done : done + k]
        return [(t + 1) % 64 for t in out] if self.wrong else out


# ---------------------------------------------------------------------------- n-gram proposer


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 5], 1, 3, 3, []),  # no repeated token: no match
        ([1, 2, 3, 9, 1, 2, 3], 2, 3, 3, [9, 1, 2]),  # the suffix 1 2 3 occurred at the start
        ([1, 2, 3, 9, 1, 2, 3], 4, 5, 3, []),  # shorter than min_n: no proposal
        ([1, 2, 3, 9, 1, 2, 3], 1, 3, 10, [9, 1, 2, 3]),  # k larger than what follows: all of it
        ([7, 7, 7, 7], 2, 2, 5, [7, 7]),  # overlapping occurrences: the earliest, overlapping the suffix
        ([5, 1, 2, 8, 3, 1, 2, 6, 1, 2], 2, 2, 1, [8]),  # two earlier occurrences: the earliest one
        ([4, 2, 3, 9, 1, 2, 3, 8, 2, 3], 1, 3, 2, [9, 1]),  # longest n wins over a later, shorter match
        ([3, 1, 2, 3, 1, 2], 3, 3, 2, [3, 1]),  # the match ends right before the suffix starts
        ([1, 2], 1, 5, 3, []),  # too short to hold an earlier occurrence
    ],
)
def test_ngram_proposer(tokens, min_n, max_n, k, expected):
    assert NgramProposer(min_n, max_n).propose(tokens, k) == expected


def test_ngram_proposer_prefers_the_longest_match():
    # suffix "2 3" occurs after 9 at index 1 (n=2); "1 2 3" occurs at index 4 (n=3) followed by 7
    tokens = [9, 2, 3, 5, 1, 2, 3, 7, 0, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 2) == [7, 0]
    assert NgramProposer(1, 2).propose(tokens, 2) == [5, 1]


def naive_ngram(tokens, min_n, max_n, k):
    """The rule written out by hand: longest n first, earliest earlier occurrence."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for p in range(total - n):
            if tokens[p : p + n] == tokens[total - n :]:
                return tokens[p + n : p + n + k]
    return []


def test_ngram_index_grown_token_by_token_equals_the_rule():
    """The proposer indexes n-grams as the sequence grows; at every length its proposal equals the
    rule applied afresh, and a sequence that is not an extension rebuilds the index."""
    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        tokens = torch.randint(0, 4, (300,), generator=g).tolist()  # a small alphabet: many matches
        p = NgramProposer(2, 4)
        for end in range(1, len(tokens)):
            assert p.propose(tokens[:end], 5) == naive_ngram(tokens[:end], 2, 4, 5), (trial, end)
        other = tokens[::-1][:50]
        assert p.propose(other, 5) == naive_ngram(other, 2, 4, 5)


def test_ngram_defaults_are_vllms():
    p = NgramProposer()
    assert (p.min_n, p.max_n) == (5, 5)


@pytest.mark.parametrize("min_n, max_n", [(0, 3), (3, 2)])
def test_ngram_bad_range_is_refused(min_n, max_n):
    with pytest.raises(UserError, match="min_n"):
        NgramProposer(min_n, max_n)


# ---------------------------------------------------------------------------- exact greedy output


@pytest.fixture(scope="module")
def target():
    return model(TARGET, seed=0)


@pytest.mark.parametrize("kind", ["ngram", "draft", "oracle", "wrong"])
@pytest.mark.parametrize("quant", ["bf16", "int8_weights", "int8_kv"])
def test_greedy_speculative_output_equals_plain_greedy(target, kind, quant):
    tgt = model(TARGET, seed=0, int8_weights=True) if quant == "int8_weights" else target
    r = runner(tgt, kv_int8=quant == "int8_kv")
    p = prompt(21)
    want = plain(r, p, 60)
    proposer = {
        "ngram": lambda: NgramProposer(1, 3),
        "draft": lambda: DraftModelProposer(runner(model(DRAFT, seed=5))),
        "oracle": lambda: Oracle(want[1:], len(p) + 1),
        "wrong": lambda: Oracle(want[1:], len(p) + 1, wrong=True),
    }[kind]()
    got, st, length = speculate(r, p, 60, proposer, k=5)
    assert got == want
    assert length == len(p) + len(want) - 1  # every token but the last produced one is cached
    assert st.new_tokens == 59 and st.target_forwards <= 59
    if kind == "oracle":  # every draft accepted: about k + 1 tokens per target step
        assert st.acceptance_rate == 1.0 and st.target_forwards <= -(-59 // 6) + 1
    if kind == "wrong":  # rejection at the first token every round: one token per step
        assert st.accepted_tokens == 0 and st.drafts == st.target_forwards - 1
        assert st.histogram[0] == st.drafts


def test_draft_model_proposer_tracks_the_accepted_prefix(target):
    """A draft model identical to the target proposes exactly the target's tokens: full acceptance,
    while its own cache is cut back and refilled every round."""
    r = runner(target)
    p = prompt(30, seed=3)
    want = plain(r, p, 40)
    got, st, _ = speculate(r, p, 40, DraftModelProposer(runner(model(TARGET, seed=0))), k=4)
    assert got == want and st.acceptance_rate == 1.0
    assert st.acceptance_length == pytest.approx(1 + st.accepted_tokens / st.drafts)


@pytest.mark.parametrize("max_seq_len", [40, 41, 45])
def test_context_limit_reached_mid_draft(target, max_seq_len):
    """Drafts shrink so a round never runs past the runner's context; the reply still matches."""
    r = runner(target, max_seq_len=max_seq_len)
    p = prompt(24)
    n = max_seq_len - len(p) + 1  # the reply fills the context exactly (the last token is not cached)
    want = plain(r, p, n)
    got, _, length = speculate(r, p, n, Oracle(want[1:], len(p) + 1), k=7)
    assert got == want and length == max_seq_len


@pytest.mark.parametrize("page_size", [4, 5, 16])
def test_kv_rollback_leaves_the_cache_of_a_plain_run(target, page_size):
    """After rejected drafts are cut off, the cached keys and values of every kept position equal a
    plain run's: rejected slots are overwritten before they are read. Equal up to float32 rounding
    (a verify step's k/v projections are a multi-row product, measured 7e-7 apart from a decode
    step's); a rejected token's k/v left in place would differ by O(1)."""
    r = runner(target, page_size=page_size)
    p = prompt(19)
    want = plain(r, p, 30)
    caches = []
    for proposer in (None, Oracle(want[1:], len(p) + 1, wrong=True), NgramProposer(1, 2)):
        seq = r.new_sequence()
        first = int(r.prefill(seq, p).argmax())
        if proposer is None:
            tok = first
            for t in want[1:]:
                r.decode(seq, tok)
                tok = t
        else:
            proposer.begin(p + [first])
            speculative_decode(r, seq, p + [first], 29, proposer, k=6)
        assert seq.length == len(p) + 29
        caches.append(r.kv.export(seq, seq.length))
        seq.release()
    last = (len(p) + 29 - 1) % page_size + 1  # slots of the last page that hold positions
    for other in caches[1:]:
        for name in ("k", "v"):
            a, b = caches[0][name], other[name]
            torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=1e-5)
            torch.testing.assert_close(a[:, -1, :, :last], b[:, -1, :, :last], rtol=0, atol=1e-5)


def test_stop_token_inside_an_accepted_draft_ends_the_reply(target):
    r = runner(target)
    p = prompt(21)
    want = plain(r, p, 40)
    stop = want[10]
    seq = r.new_sequence()
    first = int(r.prefill(seq, p).argmax())
    reply = speculative_decode(r, seq, p + [first], 39, Oracle(want[1:], len(p) + 1), k=7, stop_ids={stop})
    expected = want[1 : want.index(stop, 1) + 1]
    assert reply.tokens == expected and seq.length == len(p) + len(expected)


def test_k_below_one_is_refused(target):
    r = runner(target)
    with pytest.raises(ValueError, match="k=0"):
        speculative_decode(r, r.new_sequence(), [1, 2], 5, NgramProposer(), 0)


# ---------------------------------------------------------------------------- rejection sampling


def first_token_counts(logits, drafts, sampling, n, seed=0, rule=accept_sampled):
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(logits.shape[-1])
    for _ in range(n):
        accepted, nxt = rule(drafts, logits, sampling, gen)
        counts[drafts[0] if accepted else nxt] += 1
    return counts


@pytest.mark.parametrize(
    "sampling", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)]
)
def test_rejection_sampler_keeps_the_target_distribution(sampling):
    """The first token out of a verify step is distributed as the target's own sample at that position,
    whatever the (deterministic) draft: chi-square goodness of fit over 8000 draws. With 8000 draws the
    test rejects a sampler that always accepts the draft (checked below) with p < 1e-30."""
    from tileinfer.ops.reference import sampling_probs

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)[0].double().numpy()
    draft = int(np.argsort(p)[-2])  # a likely but not the likeliest token
    n = 8000
    counts = first_token_counts(logits, [draft, 1], sampling, n)
    keep = p > 0
    assert counts[~keep].sum() == 0  # nothing outside the top-k / top-p set
    assert stats.chisquare(counts[keep], p[keep] / p[keep].sum() * n).pvalue > 1e-3

    def always_accept(drafts, logits, sampling, gen):
        return len(drafts), 0

    bad = first_token_counts(logits, [draft, 1], sampling, n, rule=always_accept)
    assert stats.chisquare(bad[keep] + 1e-9, p[keep] / p[keep].sum() * n).pvalue < 1e-30


def test_sampled_speculative_reply_follows_the_target_distribution(target):
    """End to end: the second token of sampled speculative replies (after a fixed first token) has the
    target's distribution at that position (chi-square over 1500 replies with n-gram drafts that are
    often wrong; the sequence is cut back to the prompt between replies)."""
    from tileinfer.ops.reference import sampling_probs

    r = runner(target)
    p = prompt(12) * 2  # repeated, so the n-gram proposer drafts
    seq = r.new_sequence()
    first = int(r.prefill(seq, p).argmax())
    want = sampling_probs(r.decode(seq, first)[None], 1.0, 0, 1.0)[0].double().numpy()
    counts = np.zeros(64)
    n = 1500
    for i in range(n):
        seq.truncate(len(p))
        reply = speculative_decode(
            r, seq, p + [first], 2, NgramProposer(1, 3), k=3, sampling=SamplingParams(1.0, seed=i)
        )
        counts[reply.tokens[0]] += 1
    seq.release()
    keep = want * n >= 5  # chi-square needs expected counts >= 5: pool the rest
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(want[keep], want[~keep].sum())
    assert stats.chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3
