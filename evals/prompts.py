"""Evaluation prompts of an exact token length, built from bundled real source text.

Two built-in chat prompt sets, as in TileInfer.jl's evaluation, both about one real Python file
(``signal.py`` of the standard library, ~600-750 tokens):

- ``edit``: give the file and ask for it back with one identifier renamed. The reply mostly copies
  the input, so it stresses long-range copying through the KV cache.
- ``explain``: ask for an explanation of the same file: open-ended text.

A prompt must be exactly ``ctx_tokens`` long. Before the target file the user message carries
"other files from the same project, for context" (more standard-library modules, see
``evals/data/README.md``), cut at token level to the exact length. Only that padding depends on
``ctx_tokens``; the rest of the prompt (the *base prompt*) is token-for-token the same for every
ctx.

How the length is made exact: the chat template is rendered once with a placeholder where the
padding goes; the rendered string is split there, head and tail are encoded separately, and exactly
``ctx_tokens - len(head) - len(tail)`` padding token ids go between them. The padding text is
encoded one file at a time, so the token ids at the two seams are those of the pieces encoded
alone (they may differ from encoding the joined string, which no model cares about).

Also: texts from local files (:func:`load_dataset_prompts`, the one reader of local text records,
and :func:`load_text_prompts`, its prompt-file form)
and the calibration text (:func:`calibration_text`). Everything is deterministic: no randomness,
files are read in fixed order.

The tokenizer is any object with ``encode(text, add_special_tokens=False) -> list[int]`` (special
token strings such as ``<|im_start|>`` in the text map to their ids) and
``apply_chat_template(messages, add_generation_prompt=True) -> str``.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Protocol, Sequence

from tileinfer.core.errors import UserError

PROMPT_SETS = ("edit", "explain")

DATA_DIR = Path(__file__).resolve().parent / "data"
_STDLIB_DIR = DATA_DIR / "stdlib"

# The file the prompts are about, and the rename the ``edit`` set asks for.
TARGET_FILE = "signal.py"
RENAME_FROM = "_int_to_enum"
RENAME_TO = "_int_to_member"

# Padding files in the order they are used (a fixed tuple, not a directory listing, so the
# prompt never depends on file-system order). About 160 KB: >40k tokens with SmolLM2 and Qwen2.5.
PADDING_FILES = ("contextlib.py", "textwrap.py", "shlex.py", "heapq.py", "fractions.py", "statistics.py")

# Stands in for the padding while the chat template is rendered; must not occur in any text.
_PLACEHOLDER = "\ue000TILEINFER-PADDING\ue000"

_INSTRUCTIONS = {
    "edit": (
        f"Rename the function `{RENAME_FROM}` to `{RENAME_TO}` everywhere in `{TARGET_FILE}` "
        "(its definition and every call) and change nothing else. Reply with the complete "
        "updated file in a single ```python code block."
    ),
    "explain": (
        f"Explain what `{TARGET_FILE}` does: the purpose of the module, what each function "
        "and each top-level statement does, and why the code is written this way. Write "
        "for a Python programmer who has not seen this file before."
    ),
}


class Tokenizer(Protocol):
    """What the prompt builders need from a tokenizer (see the module docstring)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


def _read(path: Path) -> str:
    # newline="" keeps the bytes as shipped (no platform newline translation).
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def target_source() -> str:
    """The source text of the target file (``signal.py``) that both prompt sets are about."""
    return _read(_STDLIB_DIR / f"{TARGET_FILE}.txt")


def _padding_pieces() -> list[str]:
    """The padding text, one piece per file, each introduced by a comment naming the file."""
    return [f"# ===== file: {name} =====\n\n{_read(_STDLIB_DIR / f'{name}.txt')}\n\n" for name in PADDING_FILES]


def _user_message(prompt_set: str, padding: str) -> str:
    # Built by concatenation, not str.format: the source text contains braces.
    source = target_source().rstrip("\n")
    return (
        "The following files are from the same project, for context:\n\n"
        + padding
        + "\n\n(End of the context files.)\n\n"
        + f"Here is the file `{TARGET_FILE}`:\n\n```python\n{source}\n```\n\n"
        + _INSTRUCTIONS[prompt_set]
    )


def base_prompt_ids(tokenizer: Tokenizer, prompt_set: str) -> tuple[list[int], list[int]]:
    """Token ids of the prompt before and after the padding slot (the *base prompt*).

    Returns:
        ``(head, tail)``: ``head`` is the chat template up to the padding (system prompt, start of
        the user turn, the "for context" line); ``tail`` is everything after it (target file,
        instruction, end of turn, assistant generation prompt). ``len(head) + len(tail)`` is the
        smallest ``ctx_tokens`` :func:`build_prompt` accepts.

    Raises:
        UserError: unknown ``prompt_set``, or a chat template that does not carry the user message
            through exactly once.
    """
    if prompt_set not in PROMPT_SETS:
        raise UserError(f"unknown prompt set {prompt_set!r}; choose one of {', '.join(PROMPT_SETS)}")
    messages = [{"role": "user", "content": _user_message(prompt_set, _PLACEHOLDER)}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    parts = rendered.split(_PLACEHOLDER)
    if len(parts) != 2:
        raise UserError(
            f"the tokenizer's chat template rendered the user message {len(parts) - 1} "
            "times (expected once); cannot build the built-in prompts with it"
        )
    head, tail = parts
    return list(tokenizer.encode(head, add_special_tokens=False)), list(
        tokenizer.encode(tail, add_special_tokens=False)
    )


def _padding_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first ``n`` token ids of the padding text; encodes only as many files as needed."""
    ids: list[int] = []
    for piece in _padding_pieces():
        if len(ids) >= n:
            break
        ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    if len(ids) < n:
        raise UserError(
            f"the bundled padding text is only {len(ids)} tokens with this tokenizer, "
            f"but {n} are needed; use a smaller ctx or a text prompt file"
        )
    return ids[:n]


def build_prompt(tokenizer: Tokenizer, prompt_set: str, ctx_tokens: int) -> list[int]:
    """Chat prompt of the built-in set ``prompt_set`` ("edit" or "explain"), exactly ``ctx_tokens``.

    Args:
        tokenizer: see the module docstring; its chat template supplies the default system prompt.
        prompt_set: one of :data:`PROMPT_SETS`.
        ctx_tokens: the exact prompt length in tokens.

    Returns:
        ``ctx_tokens`` token ids (python ints): head of the base prompt, padding (the first
        ``ctx_tokens - base`` tokens of the bundled context files), tail of the base prompt, which
        ends with the assistant generation prompt. Same inputs always give the same ids.

    Raises:
        UserError: unknown set; ``ctx_tokens`` smaller than the base prompt (message gives the
            minimum); more padding needed than the bundled text has (about 40k tokens).
    """
    head, tail = base_prompt_ids(tokenizer, prompt_set)
    base = len(head) + len(tail)
    if ctx_tokens < base:
        raise UserError(
            f"ctx {ctx_tokens} is too small for the {prompt_set!r} prompt set, whose "
            f"prompt is {base} tokens without padding; use ctx >= {base}"
        )
    return head + _padding_ids(tokenizer, ctx_tokens - base) + tail


def load_text_prompts(path: str | os.PathLike) -> list[str]:
    """Plain-text prompts from one local ``.txt`` file (the whole file is one text) or ``.jsonl`` file
    (one JSON object per non-blank line, its ``"text"`` field, else its ``"prompt"`` field), in order:
    :func:`load_dataset_prompts` restricted to those two kinds of file.

    Raises:
        UserError: a missing file, a folder, another extension, or any error of :func:`load_dataset_prompts`.
    """
    p = Path(path)
    if p.is_dir():
        raise UserError(f"prompt file {str(p)!r} is a folder, not a .txt or .jsonl file")
    if not p.is_file():
        raise UserError(f"prompt file {str(p)!r} does not exist")
    if p.suffix.lower() not in (".txt", ".jsonl"):
        raise UserError(f"prompt file {str(p)!r}: expected a .txt or .jsonl file")
    return load_dataset_prompts(p)


def _text_field(row: object, where: str, field: str | None = None) -> str:
    """The prompt text of one record: ``field`` if given, else "text", else "prompt".

    A None value counts as absent: ``datasets`` fills fields missing from a record with None.
    """
    keys = (field,) if field else ("text", "prompt")
    if isinstance(row, dict):
        for k in keys:
            if row.get(k) is not None:
                if not isinstance(row[k], str):
                    raise UserError(f"{where}: field {k!r} is not a string")
                return row[k]
    raise UserError(f"{where}: record has no {' or '.join(repr(k) for k in keys)} field")


def build_text_prompt(tokenizer: Tokenizer, text: str, ctx_tokens: int) -> list[int]:
    """Plain text (no chat template, no special tokens added) as exactly ``ctx_tokens`` token ids.

    The text is encoded whole and its first ``ctx_tokens`` ids are kept; the model then continues
    the text. Models that expect a BOS token get none here; add it in the tokenizer adapter.

    Raises:
        UserError: the text encodes to fewer than ``ctx_tokens`` tokens (message gives both).
    """
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < ctx_tokens:
        raise UserError(
            f"the text prompt is only {len(ids)} tokens, shorter than ctx "
            f"{ctx_tokens}; use a longer text or a smaller ctx"
        )
    return ids[:ctx_tokens]


# Local file types read by hand (a whole text; JSON lines, whose errors name their line), and those
# read with datasets: file type -> (datasets builder, extra builder arguments).
_BY_HAND = (".txt", ".jsonl")
_DATASET_BUILDERS = {".json": ("json", {}), ".parquet": ("parquet", {}), ".csv": ("csv", {})}


def _resolve_data_files(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Local files named by a path, a directory (its files, sorted) or a glob (sorted matches)."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    files: list[str] = []
    for s in specs:
        s = os.fspath(s)
        if os.path.isdir(s):
            found = sorted(
                os.path.join(s, f)
                for f in os.listdir(s)
                if os.path.splitext(f)[1].lower() in (*_BY_HAND, *_DATASET_BUILDERS)
            )
        elif os.path.isfile(s):
            found = [s]
        else:
            found = sorted(f for f in glob.glob(s) if os.path.isfile(f))
        if not found:
            hint = (
                "; it looks like a Hugging Face Hub dataset id, but this toolkit has no Hub "
                "access: download the data and pass local files"
                if s.count("/") == 1 and not s.startswith((".", "/"))
                else ""
            )
            raise UserError(f"dataset {s!r} matches no local file{hint}")
        files.extend(found)
    return files


def _read_by_hand(path: str, field: str | None) -> list[str]:
    """A ``.txt`` file's whole text, or the texts of a ``.jsonl`` file's records (blank lines skipped;
    split on "\\n" only: str.splitlines would also split inside JSON strings at U+2028 and others)."""
    try:
        content = _read(Path(path))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.lower().endswith(".txt"):
        return [content]
    texts = []
    for lineno, line in enumerate(content.split("\n"), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            texts.append(_text_field(row, f"{path}:{lineno}", field))
    return texts


def _read_with_datasets(files: list[str], suffix: str, field: str | None, cache_dir) -> list[str]:
    """The texts of ``.json``/``.parquet``/``.csv`` files' records, read with ``datasets``."""
    import datasets  # deferred: importing datasets takes a second or two

    builder, kwargs = _DATASET_BUILDERS[suffix]
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # bars for reading a few local files are noise
    try:
        ds = datasets.load_dataset(
            builder,
            data_files={"train": files},
            split="train",
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            **kwargs,
        )
    except StopIteration:  # datasets' JSON reader on an empty file
        raise UserError(f"dataset {files[0]!r} contains no text") from None
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        # datasets wraps the informative error (bad JSON, schemas that differ between files).
        while e.__cause__ is not None:
            e = e.__cause__
        lines = str(e).strip().splitlines() or [type(e).__name__]
        # A schema mismatch reads "Couldn't cast ... because column names don't match".
        why = " ".join([lines[0]] + [ln for ln in lines[1:] if ln.startswith("because")])
        raise UserError(f"could not read dataset files starting with {files[0]!r}: {why}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if field is not None and field not in ds.column_names:
        raise UserError(f"dataset {files[0]!r} has no {field!r} field (its columns: {', '.join(ds.column_names)})")
    return [_text_field(row, f"{files[0]} record {i}", field) for i, row in enumerate(ds)]


def load_dataset_prompts(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    field: str | None = None,
    limit: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[str]:
    """The one reader of local text records (prompt files, corpora): texts from local files (no Hub access).

    Args:
        data_files: a file, a directory (its .txt/.jsonl/.json/.parquet/.csv files, sorted by name),
            a glob pattern, or a list of these. All must have the same file type: a ``.txt`` file is
            one text; the others one text per record (``.jsonl`` read line by line, so an error names
            its line; ``.json``/``.parquet``/``.csv`` read with the ``datasets`` library).
        field: the record field holding the text; default "text", else "prompt".
        limit: keep only the first ``limit`` texts.
        cache_dir: where ``datasets`` writes its Arrow cache (its default location if None).

    Returns:
        The texts, in file order then record order.

    Raises:
        UserError: nothing local matches (including Hub dataset ids), mixed or unsupported file
            types, text that is not UTF-8, a line that is not JSON, files without the column ``field``
            names, a record without the text field, or no texts.
    """
    files = _resolve_data_files(data_files)
    suffixes = sorted({os.path.splitext(f)[1].lower() for f in files})
    kinds = (*_BY_HAND, *_DATASET_BUILDERS)
    if len(suffixes) != 1 or suffixes[0] not in kinds:
        got = ", ".join(s or "(no extension)" for s in suffixes)
        raise UserError(f"text files must all be one of {', '.join(kinds)}; got {got}")
    if suffixes[0] in _BY_HAND:
        texts = [t for f in files for t in _read_by_hand(f, field)]
    else:
        texts = _read_with_datasets(files, suffixes[0], field, cache_dir)
    texts = texts[:limit] if limit is not None else texts
    if not any(t.strip() for t in texts):
        raise UserError(f"{files[0]!r} contains no text")
    return texts


def calibration_text() -> str:
    """Calibration text for key-smoothing scales (``pprint.py`` and ``queue.py``, ~36 KB).

    Disjoint from every text the prompt sets use, so calibrating on it does not tune the
    quantization to the evaluation data.
    """
    return _read(DATA_DIR / "calibration.txt")
