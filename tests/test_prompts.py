"""evals.prompts with the real SmolLM2 tokenizer (read by transformers from the GGUF file)."""

import json
from pathlib import Path

import pytest

from evals import prompts
from evals.prompts import (
    PROMPT_SETS,
    base_prompt_ids,
    build_prompt,
    build_text_prompt,
    calibration_text,
    load_dataset_prompts,
    load_text_prompts,
    target_source,
)
from tileinfer.core.errors import UserError

CTXS = (1024, 8192, 32768)


class HFTokenizer:
    """The two methods evals.prompts needs, on top of a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=False):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def decode(self, ids):
        return self.tok.decode(ids)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tileinfer.core.fetch import pull

    path = Path(pull("smollm2-135m"))
    return HFTokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))


@pytest.fixture(scope="module")
def built(tok):
    return {(s, c): build_prompt(tok, s, c) for s in PROMPT_SETS for c in CTXS}


@pytest.mark.parametrize("prompt_set", PROMPT_SETS)
@pytest.mark.parametrize("ctx", CTXS)
def test_exact_length_and_structure(tok, built, prompt_set, ctx):
    ids = built[prompt_set, ctx]
    assert len(ids) == ctx
    assert all(isinstance(i, int) for i in ids)
    gen_prompt = tok.encode("<|im_start|>assistant\n")
    assert ids[-len(gen_prompt) :] == gen_prompt
    text = tok.decode(ids)
    assert target_source().rstrip("\n") in text
    assert prompts._INSTRUCTIONS[prompt_set] in text
    assert text.startswith("<|im_start|>system\n")
    assert "# ===== file: contextlib.py =====" in text  # padding comes first
    assert text.index("contextlib.py") < text.index(target_source()[:40])
    if ctx == 32768:
        assert "# ===== file: statistics.py =====" in text  # deep into the padding files


def test_base_prompt_identical_across_ctx(tok, built):
    for s in PROMPT_SETS:
        head, tail = base_prompt_ids(tok, s)
        assert 600 < len(head) + len(tail) <= 1024  # target + instructions + template fit 1024
        pads = []
        for c in CTXS:
            ids = built[s, c]
            assert ids[: len(head)] == head and ids[len(ids) - len(tail) :] == tail
            pads.append(ids[len(head) : len(ids) - len(tail)])
        # only the amount of padding differs: the shorter padding is a prefix of the longer
        assert pads[1][: len(pads[0])] == pads[0] and pads[2][: len(pads[1])] == pads[1]
    assert base_prompt_ids(tok, "edit")[0] == base_prompt_ids(tok, "explain")[0]
    assert base_prompt_ids(tok, "edit")[1] != base_prompt_ids(tok, "explain")[1]


def test_target_file_size(tok):
    assert 600 <= len(tok.encode(target_source())) <= 750
    assert prompts.RENAME_FROM in target_source() and prompts.RENAME_TO not in target_source()


def test_deterministic(tok, built):
    again = HFTokenizer(tok.tok)
    for s in PROMPT_SETS:
        assert build_prompt(again, s, 8192) == built[s, 8192]


def test_smallest_ctx_and_errors(tok):
    head, tail = base_prompt_ids(tok, "edit")
    base = len(head) + len(tail)
    assert build_prompt(tok, "edit", base) == head + tail
    assert len(build_prompt(tok, "edit", base + 1)) == base + 1
    with pytest.raises(UserError, match=f"ctx >= {base}"):
        build_prompt(tok, "edit", base - 1)
    with pytest.raises(UserError):
        build_prompt(tok, "explain", 512)
    with pytest.raises(UserError, match="unknown prompt set"):
        build_prompt(tok, "summarize", 4096)
    with pytest.raises(UserError, match="padding text is only"):
        build_prompt(tok, "edit", 200_000)


class _OddTemplate:
    """A chat template that repeats the user message, which the placeholder split must catch."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return messages[0]["content"] * 2


def test_template_must_carry_message_once():
    with pytest.raises(UserError, match="2 times"):
        build_prompt(_OddTemplate(), "edit", 100_000)


def test_text_prompts(tok, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("line one\n\nline two\n")
    assert load_text_prompts(text) == ["line one\n\nline two\n"]

    jl = tmp_path / "p.jsonl"
    # a raw U+2028 inside a JSON string is valid JSON and must not split the line
    jl.write_text(
        json.dumps({"text": "first {x}\u2028more"}, ensure_ascii=False)
        + "\n\n"
        + json.dumps({"prompt": "second", "id": 2})
        + "\n",
        encoding="utf-8",
    )
    assert load_text_prompts(jl) == ["first {x}\u2028more", "second"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no field"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        load_text_prompts(bad)
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        load_text_prompts(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_text_prompts(tmp_path / "missing.txt")
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(UserError, match=".txt or .jsonl"):
        load_text_prompts(tmp_path / "x.csv")

    long_text = calibration_text()
    ids = build_text_prompt(tok, long_text, 2048)
    assert len(ids) == 2048 and ids == tok.encode(long_text)[:2048]
    with pytest.raises(UserError, match="only"):
        build_text_prompt(tok, "too short", 64)


def test_dataset_prompts(tmp_path):
    cache = tmp_path / "cache"
    d = tmp_path / "data"
    d.mkdir()
    (d / "b.jsonl").write_text(json.dumps({"text": "b1"}) + "\n" + json.dumps({"text": "b2"}))
    (d / "a.jsonl").write_text(json.dumps({"text": "a1"}) + "\n")
    (d / "notes.md").write_text("ignored: not a dataset file type")
    assert load_dataset_prompts(d, cache_dir=cache) == ["a1", "b1", "b2"]  # sorted by file name
    assert load_dataset_prompts(d / "b.jsonl", cache_dir=cache, limit=1) == ["b1"]
    (tmp_path / "doc.txt").write_text("para one\n\npara two\n")
    assert load_dataset_prompts(tmp_path / "doc.txt", cache_dir=cache) == ["para one\n\npara two\n"]
    with pytest.raises(UserError, match="no Hub access"):
        load_dataset_prompts("wikitext/wikitext-2-raw-v1")
    with pytest.raises(UserError, match="no 'body' field"):
        load_dataset_prompts(d / "a.jsonl", field="body", cache_dir=cache)


def test_bundled_data():
    data = prompts.DATA_DIR
    files = [p for p in data.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 400_000
    assert (data / "README.md").is_file() and (data / "PSF-LICENSE.txt").is_file()
    for p in files:  # a special-token string in the text would turn into a control token
        assert "<|" not in p.read_text(encoding="utf-8"), p

    calib = calibration_text()
    assert 20_000 <= len(calib.encode()) <= 40_000
    eval_text = target_source() + "".join(prompts._padding_pieces())
    eval_lines = {ln.strip() for ln in eval_text.splitlines() if len(ln.strip()) > 30}
    calib_lines = {ln.strip() for ln in calib.splitlines() if len(ln.strip()) > 30}
    assert len(calib_lines) > 200 and not (eval_lines & calib_lines)


def test_a_folder_given_as_prompt_file_says_so(tmp_path):
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(UserError, match="is a folder"):
        load_text_prompts(tmp_path / "dir.txt")
