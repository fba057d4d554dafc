"""Corpus windows as llama.cpp's perplexity tool cuts them, the built-in corpora, and bad corpus input."""

import json
import subprocess
import sys

import polars as pl
import pytest

from evals import corpus
from tileinfer.core.errors import UserError


class CharTokenizer:
    """One token per character (its code point): lengths are easy to reason about."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_windows_drop_the_short_tail_and_put_bos_first():
    tokens = list(range(10, 21))  # 11 tokens
    assert corpus.windows(tokens, 4) == [[10, 11, 12, 13], [14, 15, 16, 17]]  # 18..20 do not fill a window
    # BOS goes before the text (12 tokens: 3 windows), then replaces each window's first token
    assert corpus.windows(tokens, 4, bos=1) == [[1, 10, 11, 12], [1, 14, 15, 16], [1, 18, 19, 20]]
    assert corpus.windows(tokens, 4, bos=1, n_windows=2) == [[1, 10, 11, 12], [1, 14, 15, 16]]
    assert corpus.windows(tokens, 12) == [] and corpus.windows(tokens, 12, bos=1) == [[1, *tokens]]
    with pytest.raises(ValueError):
        corpus.windows(tokens, 1)


@pytest.mark.parametrize("ctx,scored", [(4, [3]), (5, [3, 4]), (1024, list(range(513, 1024))), (7, [4, 5, 6])])
def test_the_second_half_is_scored_odd_and_even(ctx, scored):
    # logits at positions ctx//2 .. ctx-2 predict tokens ctx//2+1 .. ctx-1 (llama.cpp: first = n_ctx/2)
    assert list(range(corpus.prompt_len(ctx), ctx)) == scored
    assert len(scored) == ctx - 1 - ctx // 2


def test_builtin_corpora_are_shipped_prose_and_code():
    prose, code = corpus.load_text("pydoc"), corpus.load_text("stdlib")
    assert prose.startswith('The "assert" statement') and 70_000 < len(prose) <= 80_000
    assert code.startswith("# ===== file: functools.py =====") and "# ===== file: dataclasses.py =====" in code
    windows, total = corpus.corpus_windows(CharTokenizer(), "pydoc", 4096, None, 3)
    assert len(windows) == 3 and total == len(prose) and windows[1][0] == ord(prose[4096])


def test_names_of_corpora():
    assert corpus.corpus_name("pydoc") == "pydoc"
    assert corpus.corpus_name("hf:Salesforce/wikitext:wikitext-2-raw-v1") == "wikitext-2-raw-v1"
    assert corpus.corpus_name("hf:Salesforce/wikitext:wikitext-2-raw-v1:validation") == "wikitext-2-raw-v1-validation"
    assert corpus.corpus_name("hf:org/data") == "data"
    assert corpus.corpus_name("/data/wiki.test.raw.txt") == "wiki.test.raw"


def test_local_files_through_datasets(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ("first record", "second")))
    assert corpus.load_text(str(jsonl)) == "first record\n\nsecond"
    pq = tmp_path / "c.parquet"
    pl.DataFrame({"body": ["a b c"]}).write_parquet(pq)
    assert corpus.load_text(str(pq), text_column="body") == "a b c"


def test_bad_corpora_are_one_line_user_errors(tmp_path, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    (tmp_path / "empty.jsonl").write_text("")  # datasets' JSON reader raised StopIteration
    pq = tmp_path / "notext.parquet"
    pl.DataFrame({"body": ["a b c"]}).write_parquet(pq)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cases = [
        (lambda: corpus.load_text(str(empty)), "no text"),
        (lambda: corpus.load_text(str(tmp_path / "empty.jsonl")), "no text"),
        (lambda: corpus.corpus_windows(CharTokenizer(), str(short), 64, None, 4), "shorter than one window"),
        (lambda: corpus.load_text(str(tmp_path / "missing.txt")), "matches no local file"),
        (lambda: corpus.load_text("no_such_corpus"), "unknown corpus"),
        (lambda: corpus.load_text(str(pq)), "has no .text. field \\(its columns: body\\)"),
        (lambda: corpus.load_text("hf:no-such-org/no-such-set"), "could not be loaded"),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "corpora,message",
    [("[missing.txt]", "matches no local file"), ("[pydoc,pydoc]", "has the name 'pydoc' of corpus pydoc")],
)
def test_the_sweep_exits_2_on_a_bad_corpus(tmp_path, smollm2_gguf, corpora, message):
    out = subprocess.run(
        [sys.executable, "-m", "tileinfer.sweep", "model=smollm2-135m", "eval=corpus", f"eval.corpora={corpora}"]
        + [f"runs_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
