"""Text corpora scored the way llama.cpp's perplexity tool scores them (``--kl-divergence`` too).

A corpus is one text, tokenized whole and cut into non-overlapping windows of ``ctx`` tokens (a
last window shorter than ``ctx`` is dropped). When the model expects a BOS token, the text's tokens
start with one and every window's first token is replaced by it (not shifted in: the token it
replaces is not scored anyway). Only the second half of a window is scored: the logits at positions
``ctx // 2 .. ctx - 2`` predict tokens ``ctx // 2 + 1 .. ctx - 1``, ``ctx - 1 - ctx // 2`` positions,
so each prediction sees at least ``ctx / 2`` tokens of context. This is ``perplexity()`` and
``kl_divergence()`` of llama.cpp's ``tools/perplexity/perplexity.cpp`` (``first = n_ctx/2``,
``tokens[batch_start] = bos`` for the first batch of a chunk, ``n_chunk = tokens.size() / n_ctx``),
so a row's PPL(base) can be checked against ``llama-perplexity -f FILE -c CTX`` on the same text
(lm-eval's wikitext task windows the text otherwise and reports word perplexity).

Corpora (``eval.corpora``):

- built-in, shipped under ``evals/data/corpus`` (Python standard library text, PSF license, see
  ``evals/data/README.md``): ``pydoc`` (prose: help topics of ``pydoc_data/topics.py``),
  ``stdlib`` (code: ``functools.py`` and ``dataclasses.py``), both copied from CPython 3.11.7 so a row
  never depends on the interpreter that runs it;
- local files read with ``datasets`` (:func:`evals.prompts.load_dataset_prompts`): a ``.txt`` file
  is one text, records of ``.json``/``.jsonl``/``.parquet``/``.csv`` files are joined with a blank
  line (as the Hugging Face perplexity guide joins wikitext-2's records);
- a Hugging Face Hub dataset, ``hf:REPO[:CONFIG[:SPLIT]]`` (split ``test`` by default), e.g.
  ``hf:Salesforce/wikitext:wikitext-2-raw-v1``, for users with hub access; ``datasets`` caches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from evals.evaluation import Evaluation, Item, ScoredSet, bos_first, unique_names
from evals.prompts import DATA_DIR, Tokenizer, load_dataset_prompts
from tileinfer.core.errors import UserError
from tileinfer.core.settings import choice, number

BUILTIN = {"pydoc": "pydoc-topics.txt", "stdlib": "stdlib-code.txt"}
HUB_PREFIX = "hf:"


def prompt_len(ctx: int) -> int:
    """Positions of a ``ctx``-token window before its scored half: ``ctx // 2 + 1`` (the logits of the
    last of them predict the first scored token, ``ctx // 2 + 1``)."""
    return ctx // 2 + 1


def windows(tokens, ctx: int, bos: int | None = None, n_windows: int | None = None) -> list[list[int]]:
    """The non-overlapping ``ctx``-token windows of a tokenized text, as llama.cpp's perplexity tool
    cuts them.

    Args:
        tokens: the text's token ids, without BOS.
        ctx: window length in tokens, at least 2 (one context token and one scored).
        bos: the BOS token id when the model expects one (it goes before the text and replaces each
            window's first token), else None.
        n_windows: at most this many windows (the first ones); None: all.

    Returns:
        ``min(n_windows, (len(tokens) + (bos is not None)) // ctx)`` lists of ``ctx`` python ints; the
        text's tail that does not fill a window is left out.

    Raises:
        ValueError: ``ctx < 2``.
    """
    if ctx < 2:
        raise ValueError(f"a window needs at least 2 tokens, got ctx={ctx}")
    ids = ([bos] if bos is not None else []) + [int(t) for t in tokens]
    n = len(ids) // ctx if n_windows is None else min(n_windows, len(ids) // ctx)
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(n)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def corpus_name(spec: str) -> str:
    """The name rows carry for a corpus (their ``prompt_set``): a built-in's name, a hub dataset's
    ``REPO[:CONFIG]`` last part (``wikitext-2-raw-v1``), a file's or folder's stem."""
    if spec in BUILTIN:
        return spec
    if spec.startswith(HUB_PREFIX):
        repo, *rest = spec[len(HUB_PREFIX) :].split(":")
        return (rest[0] if rest and rest[0] else repo.rsplit("/", 1)[-1]) + (f"-{rest[1]}" if len(rest) > 1 else "")
    return Path(spec.rstrip("/")).stem


def load_text(spec: str, text_column: str = "text") -> str:
    """The text of corpus ``spec`` (see the module docstring).

    Raises:
        UserError: a missing file, files without ``text_column``, no text, or a hub dataset that cannot
            be loaded (no hub access and not in the ``datasets`` cache): one line each.
    """
    if spec in BUILTIN:
        with open(DATA_DIR / "corpus" / BUILTIN[spec], encoding="utf-8", newline="") as f:
            return f.read()
    if spec.startswith(HUB_PREFIX):
        texts = _hub_texts(spec, text_column)
    elif not Path(spec).suffix and not Path(spec).exists():
        raise UserError(
            f"unknown corpus {spec!r}: the built-in corpora are {', '.join(BUILTIN)}; others are local "
            f".txt/.json/.jsonl/.parquet/.csv files or {HUB_PREFIX}REPO[:CONFIG[:SPLIT]] hub datasets"
        )
    else:
        texts = load_dataset_prompts(spec, field=text_column)
    text = texts[0] if len(texts) == 1 else "\n\n".join(texts)
    if not text.strip():
        raise UserError(f"corpus {spec!r} contains no text")
    return text


def _hub_texts(spec: str, column: str) -> list[str]:
    """The ``column`` of a hub dataset's split, through ``datasets.load_dataset`` (cached as it caches)."""
    repo, config, split = ([*spec[len(HUB_PREFIX) :].split(":"), None, None])[:3]
    import datasets  # deferred: importing datasets takes a second or two

    try:
        ds = datasets.load_dataset(repo, config or None, split=split or "test")
    except Exception as e:  # noqa: BLE001 - offline, unknown repo or config, network: one line each
        why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(
            f"hub dataset {spec!r} could not be loaded ({why}); without hub access, download the text "
            "and pass it as a local file"
        ) from None
    if column not in ds.column_names:
        raise UserError(f"hub dataset {spec!r} has no {column!r} column (it has {', '.join(ds.column_names)})")
    return [t or "" for t in ds[column]]


def corpus_windows(
    tokenizer: Tokenizer, spec: str, ctx: int, bos: int | None, n_windows: int, text_column: str = "text"
) -> tuple[list[list[int]], int]:
    """Windows (:func:`windows`) of corpus ``spec`` and how many tokens the whole corpus has.

    Raises:
        UserError: as :func:`load_text`, or a corpus shorter than one window.
    """
    ids = tokenizer.encode(load_text(spec, text_column), add_special_tokens=False)
    out = windows(ids, ctx, bos, n_windows)
    if not out:
        raise UserError(
            f"corpus {spec!r} is {len(ids)} tokens, shorter than one window of ctx={ctx} tokens: "
            "use a longer text or a smaller ctx"
        )
    return out, len(ids) + (bos is not None)


@dataclass
class CorpusSettings:
    """``eval=corpus``: text corpora in llama.cpp's windows."""

    name: str = choice("corpus", "corpus")
    # built-in corpora (pydoc, stdlib), local text/json/jsonl/parquet/csv files, or hf:REPO[:CONFIG[:SPLIT]]
    corpora: list[str] = field(default_factory=lambda: ["pydoc", "stdlib"])
    n_windows: int = number(10, 1)  # at most this many ctx-token windows per corpus (the first ones)
    text_column: str = "text"  # the column of a corpus's records that holds the text
    add_bos: Optional[bool] = None  # BOS first in every window; null: the tokenizer's add_bos_token

    def __post_init__(self):
        if not self.corpora:
            raise UserError("eval.corpora must be a non-empty list, e.g. eval.corpora=[pydoc,stdlib]")


class CorpusDrift(Evaluation):
    """Corpus drift: a window's first half is its prompt, its second half the scored tokens; decode
    steps are timed after the first window of each corpus only."""

    name = "corpus"
    Settings = CorpusSettings
    IDENTITY = ("corpus", "n_windows", "add_bos")

    def positions(self, ctx_tokens: int, decode_tokens: int) -> tuple[int, int]:
        if ctx_tokens < 2:
            raise UserError(f"ctx.tokens={ctx_tokens}: a corpus window needs at least 2 tokens")
        return 0, max(ctx_tokens, prompt_len(ctx_tokens) + decode_tokens)

    def scored_sets(self, tokenizer: Tokenizer, ctx_tokens: int) -> list[ScoredSet]:
        s = self.settings
        unique_names([(corpus_name(c), f"corpus {c}") for c in s.corpora])
        add_bos = bos_first(s.add_bos, tokenizer)
        bos = tokenizer.bos_token_id if add_bos else None
        out, n = [], prompt_len(ctx_tokens)
        for entry in s.corpora:
            wins, tokens = corpus_windows(tokenizer, entry, ctx_tokens, bos, s.n_windows, s.text_column)
            items = tuple(Item(tuple(w[:n]), tuple(w[n:]), len(w) - n) for w in wins)
            identity = {"corpus": entry, "n_windows": len(wins), "add_bos": add_bos}
            out.append(ScoredSet(corpus_name(entry), items, "window", identity, 1, "window", {"corpus_tokens": tokens}))
        return out
