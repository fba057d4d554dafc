"""A job's rows describe what the engine was fed: every input column checked against the token ids a
recording runner received (issue 31, part 4), for corpus windows and for prompt files with and
without BOS, on SmolLM2 through the job itself (plan, worker, base store, candidate pass)."""

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from evals import corpus
from tileinfer.engine.runner import ModelRunner
from tileinfer.jobs import identity, job, plan, schema
from tileinfer.jobs.worker import Worker

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "evals" / "data" / "stdlib" / "statistics.py.txt"
FAST = ["model=smollm2-135m", "quant=bf16", "speed.decode_tokens=2", "speed.repeats=1", "speed.warmup=false"]


class RecordingRunner(ModelRunner):
    """A runner that logs every forward step: (pass, first position, token ids, rows of logits)."""

    def __init__(self, *args, log: list, tags, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.tags = log, tags

    def new_sequence(self):
        seq = super().new_sequence()
        seq.tag = next(self.tags)
        return seq

    def step(self, seq, tokens, logit_rows=None, capture=()):
        start = seq.length
        out = super().step(seq, tokens, logit_rows, capture)
        rows = out[0] if capture else out
        self.log.append((seq.tag, start, tokens.tolist(), rows.shape[0]))
        return out


class RecordingWorker(Worker):
    def __init__(self):
        super().__init__()
        self.log, self.tags, self.runners = [], itertools.count(), []

    def runner(self, cfg, loaded, backend, scheme, max_len):
        r = super().runner(cfg, loaded, backend, scheme, max_len)
        rec = RecordingRunner(
            r.model, backend, scheme.kv_cache == "int8", max_len, cfg.kv.page_size, cfg.kv.prefill_chunk,
            cfg.speed.cuda_graph, log=self.log, tags=self.tags,
        )  # fmt: skip
        self.runners.append(rec)
        return rec


def passes(log: list) -> list[tuple[list[int], int]]:
    """Each pass's teacher-forced stream (the tokens fed from position 0 until the sequence is cut back)
    and the rows of logits it produced, in the order the passes began."""
    out = {}
    for tag, start, tokens, rows in log:
        fed, n, done = out.setdefault(tag, ([], [0], [False]))
        if done[0] or start != len(fed):  # cut back: decode steps after the scored stream
            done[0] = True
            continue
        fed += tokens
        n[0] += rows
    return [(fed, n[0]) for fed, n, _ in out.values()]


def run(tmp_path, *overrides):
    schema.register()
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        cfg = schema.load(compose("config", [*FAST, *overrides, f"runs_dir={tmp_path}"]))
    worker = RecordingWorker()
    p = plan.resolve(cfg, worker)
    result = job.run(p, worker)
    return p, worker, result


def test_a_corpus_row_describes_the_windows_the_engine_scored(tmp_path, smollm2_gguf):
    ctx, n_windows = 96, 3
    p, worker, result = run(
        tmp_path, "eval=corpus", "eval.corpora=[pydoc]", f"eval.n_windows={n_windows}", f"ctx.tokens={ctx}"
    )
    (row,) = result.rows
    tok = worker.load(p.cfg.model, p.cfg.dtype, p.device).tokenizer
    bos = tok.bos_token_id if tok.add_bos_token else None
    windows, _ = corpus.corpus_windows(tok, "pydoc", ctx, bos, n_windows)
    fed = passes(worker.log)
    base, cand = fed[:n_windows], fed[n_windows:]  # the base store records every window first
    per_window = ctx - 1 - ctx // 2  # the logits at ctx/2 .. ctx-2: llama.cpp's scored half
    for w, (tokens, rows) in zip(windows, base + cand, strict=False):
        assert tokens == w[:-1] and rows == per_window  # the last token is never an input
    assert [t for t, _ in cand] == [w[:-1] for w in windows]
    assert row["ctx_tokens"] == ctx and row["n_windows"] == n_windows and row["n_prompts"] == n_windows
    assert row["n_scored"] == n_windows * per_window and row["corpus"] == "pydoc" and row["prompt_set"] == "pydoc"
    assert row["add_bos"] == (bos is not None) and all((w[0] == tok.bos_token_id) == row["add_bos"] for w in windows)
    assert row["prompts_sha256"] == identity.content_hash(windows) and row["n_score"] is None


@pytest.mark.parametrize("add_bos", ["true", "false"])
def test_a_prompt_file_row_describes_the_prompt_and_reply_the_engine_scored(tmp_path, smollm2_gguf, add_bos):
    ctx, n_score = 80, 6
    p, worker, result = run(
        tmp_path,
        f"eval.prompt_sets=[{TEXT}]",
        f"eval.add_bos={add_bos}",
        f"ctx.tokens={ctx}",
        f"eval.n_score={n_score}",
    )
    (row,) = result.rows
    tok = worker.load(p.cfg.model, p.cfg.dtype, p.device).tokenizer
    (base, n_base), (cand, n_cand) = passes(worker.log)[-2:]  # the base's scoring pass, then the candidate's
    prompt = cand[:ctx]
    assert base == cand and n_base == n_cand == row["n_scored"] == len(cand) - ctx + 1
    assert (prompt[0] == tok.bos_token_id) == (add_bos == "true") == row["add_bos"]
    want = ([tok.bos_token_id] if add_bos == "true" else []) + tok.encode(TEXT.read_text(), add_special_tokens=False)
    assert prompt == want[:ctx]
    assert row["ctx_tokens"] == ctx and row["n_score"] == n_score and row["n_scored"] <= n_score
    assert row["prompt_set"] == "statistics.py" and row["corpus"] is None and row["n_windows"] is None
    assert row["prompts_sha256"] == identity.content_hash([prompt])
