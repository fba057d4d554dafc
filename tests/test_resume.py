"""One-pass base logits and resumable passes: a pass stopped by Ctrl-C continues where it stopped and
gives the same numbers as one that was never stopped."""

import pytest
import torch

from evals.drift import base_pass as drift_base_pass
from evals.drift import score, set_statistics
from evals.evaluation import Item, ScoredSet
from tests.passes import full_logits
from tests.test_drift import TINY as DRIFT_TINY
from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.engine.generation import generate
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.snapshots import Snapshots
from tileinfer.models import Transformer

TINY = {**DRIFT_TINY, "max_position_embeddings": 512}
PROMPT = [int(t) for t in torch.randint(1, 256, (150,), generator=torch.Generator().manual_seed(1))]
N_REPLY = 40


class CountingRunner(ModelRunner):
    """Counts the tokens each forward step runs, and raises KeyboardInterrupt (as Ctrl-C would)
    when the ``stop_at``-th step starts."""

    def __init__(self, *a, stop_at: int | None = None, **kw):
        super().__init__(*a, **kw)
        self.steps, self.tokens, self.stop_at = 0, 0, stop_at

    def step(self, seq, tokens, logit_rows=None):
        self.steps += 1
        if self.stop_at is not None and self.steps == self.stop_at:
            raise KeyboardInterrupt
        self.tokens += tokens.shape[0]
        return super().step(seq, tokens, logit_rows)


def base_pass(runner, prompt, n_reply, stop_ids, snaps):
    """The base side of ``prompt`` followed by its greedy reply of at most ``n_reply`` tokens."""
    return drift_base_pass(runner, Item(tuple(prompt), None, n_reply), stop_ids, snaps)


def make_runner(int8: bool = False, stop_at: int | None = None) -> CountingRunner:
    sd = random_state_dict(TINY, seed=0, dtype=torch.float32)
    model = Transformer.from_state_dict(ModelConfig.from_hf(TINY), sd, dtype=torch.float32)
    return CountingRunner(
        model, "reference", kv_int8=int8, max_seq_len=256, page_size=16, prefill_chunk=32, stop_at=stop_at
    )


def test_base_pass_prefills_the_prompt_once_and_equals_the_two_pass_result():
    r = make_runner()
    base = base_pass(r, PROMPT, N_REPLY, set(), Snapshots(None))
    reply = generate(make_runner(), PROMPT, N_REPLY).tokens
    assert base.tokens.tolist() == PROMPT + reply
    # prompt once, then the reply decoded (n - 1 steps) and run teacher-forced (n - 1 tokens)
    assert r.tokens == len(PROMPT) + 2 * (N_REPLY - 1)
    two_pass = full_logits(make_runner(), PROMPT + reply, len(PROMPT))
    assert torch.equal(base.logits, two_pass.logits)


@pytest.mark.parametrize("stop_at", [3, 5, 7 + 10])  # inside the prompt prefill (5 chunks), and the reply
def test_a_stopped_base_pass_resumes_with_identical_logits(tmp_path, stop_at):
    want = base_pass(make_runner(), PROMPT, N_REPLY, set(), Snapshots(None))
    snaps = Snapshots(tmp_path / "base.resume.pt", every_s=0)
    with pytest.raises(KeyboardInterrupt):
        base_pass(make_runner(stop_at=stop_at), PROMPT, N_REPLY, set(), snaps)
    assert snaps.path.is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    again = make_runner()
    got = base_pass(again, PROMPT, N_REPLY, set(), snaps)
    assert got.tokens.tolist() == want.tokens.tolist() and torch.equal(got.logits, want.logits)
    done = stop_at - 1  # steps finished before Ctrl-C: not run again
    assert again.steps == (len(PROMPT) + 31) // 32 + (N_REPLY - 1) + 2 - done
    assert not snaps.path.exists()  # a finished pass deletes its snapshot


def test_periodic_snapshots_are_taken_when_due(tmp_path, monkeypatch):
    snaps = Snapshots(tmp_path / "s.pt", every_s=1e9)
    saved = []
    monkeypatch.setattr(Snapshots, "save", lambda self, runner, seq, fed, *a: saved.append(len(fed)))
    base_pass(make_runner(), PROMPT, N_REPLY, set(), snaps)
    assert saved == []  # never due
    snaps.every_s = 1e-9
    base_pass(make_runner(), PROMPT, N_REPLY, set(), snaps)
    assert saved[:4] == [32, 64, 96, 128]  # every chunk boundary but the prompt's end, then decode steps
    assert saved[4] == len(PROMPT) + 1


@pytest.mark.parametrize("int8", [False, True])
def test_a_stopped_candidate_pass_resumes_without_prefilling_again(tmp_path, int8):
    base = base_pass(make_runner(), PROMPT, N_REPLY, set(), Snapshots(None))
    first = score(make_runner(int8), base, decode_steps=4)
    snaps = Snapshots(tmp_path / "cand.pt", every_s=1e9)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while scoring the reply, after the prompt prefill
        score(make_runner(int8, stop_at=6), base, 4, snaps=snaps)
    again = make_runner(int8)
    resumed = score(again, base, 4, snaps=snaps)
    assert again.tokens == (N_REPLY - 1) + 4  # the reply and the timed decode steps only
    # the row's statistics (as jobs.job.score_set makes them) of each pass
    scored = ScoredSet("p", (Item(tuple(PROMPT), None, N_REPLY),), "prompt", {}, 1, f"n{N_REPLY}")
    reply = [base.tokens[len(PROMPT) :].tolist()]
    (want, _), (got, _) = (set_statistics(scored, [p], reply) for p in (first, resumed))
    for k in ("kl_mean", "kl_max", "top1_agree", "greedy_agree_len"):
        assert got[k] == want[k]
    assert want["prefill_ms"] == want["prefill_ms"]  # timed: a prefill run in one piece
    assert got["prefill_ms"] != got["prefill_ms"]  # NaN: a resumed prefill is not timed in one piece


def test_a_foreign_or_damaged_snapshot_is_ignored(tmp_path):
    snaps = Snapshots(tmp_path / "s.pt", every_s=0)
    with pytest.raises(KeyboardInterrupt):
        base_pass(make_runner(stop_at=3), PROMPT, N_REPLY, set(), snaps)
    want = base_pass(make_runner(), PROMPT, N_REPLY, set(), Snapshots(None))
    other = [t % 200 + 1 for t in PROMPT]  # another prompt: the snapshot is not used
    r = make_runner()
    base_pass(r, other, N_REPLY, set(), Snapshots(snaps.path, every_s=1e9))
    assert r.tokens == len(other) + 2 * (N_REPLY - 1)
    snaps.path.write_bytes(b"not a snapshot")
    got = base_pass(make_runner(), PROMPT, N_REPLY, set(), Snapshots(snaps.path, every_s=1e9))
    assert torch.equal(got.logits, want.logits)
