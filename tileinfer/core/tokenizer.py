"""Tokenizer and chat template, from a transformers folder or from a GGUF file's metadata.

Token ids come from the Hugging Face ``tokenizers`` library. A folder brings its ``tokenizer.json``;
a GGUF brings only a vocabulary, merges and token types (``tokenizer.ggml.*``), so the byte-level
BPE tokenizer is rebuilt here the way transformers does it (``integrations/gguf/
gguf_tokenizer_mapping.py``), with the pre-tokenizer split regex chosen by ``tokenizer.ggml.pre``
as llama.cpp does (``llama-vocab.cpp``). Chat templates are rendered with jinja2 in the same
sandboxed environment as transformers' ``apply_chat_template`` (``utils/chat_template_utils.py``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from tileinfer.core.errors import UserError

# Pre-tokenizer split regexes, from llama.cpp's llama-vocab.cpp and transformers' tokenizer classes.
_GPT2_SPLIT = None  # ByteLevel(use_regex=True) applies GPT-2's own regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp splits "\p{N}" first, then GPT-2's regex, as SmolLM2's own tokenizer.json does (Digits, ByteLevel).
# transformers builds 'smollm' files with GPT-2's regex alone; the two differ only when a space precedes a
# non-ASCII numeral (" ½"), and there we follow llama.cpp and the original tokenizer.
_DIGITS_THEN_GPT2 = "digits"
# 'default' follows transformers (GPT-2's regex), not llama.cpp's legacy default regex.
PRE_TOKENIZERS = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}
# Tokens that end a turn besides the declared EOS (llama.cpp's end-of-generation list, llama-vocab.cpp).
TURN_END_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode`` in transformers/tokenizers)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Attributes:
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: ids that end generation: the declared EOS plus turn enders such as ``<|im_end|>``,
            ``<|endoftext|>``, ``<|eot_id|>`` that exist in the vocabulary.
        vocab_size: number of ids the tokenizer knows (added tokens included); can be smaller than
            the model's embedding rows (Qwen pads those).
        chat_template: jinja source or None.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_ids=(),
        unk_token: str | None = None,
        pad_token: str | None = None,
    ):
        self.backend = backend
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = {backend.token_to_id(t) for t in (eos_token, *TURN_END_TOKENS) if t}
        self.eos_token_ids = frozenset(i for i in ids | set(extra_eos_ids) if i is not None)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # --- construction ---------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path) -> "Tokenizer":
        """:meth:`from_gguf` for a ``.gguf`` file, :meth:`from_folder` for a folder."""
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir():
            return cls.from_folder(path)
        raise UserError(f"no tokenizer at {path}: expected a .gguf file or a folder with tokenizer.json")

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        """From a transformers folder: ``tokenizer.json`` plus, when present, ``tokenizer_config.json``
        (bos/eos/unk/pad tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``),
        ``chat_template.jinja`` (preferred, as in transformers >= 4.43) and ``generation_config.json``
        (extra EOS ids, e.g. Llama 3's ``<|eot_id|>``).

        Raises:
            UserError: no or unreadable ``tokenizer.json``.
        """
        folder = Path(folder)
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - missing file or bad JSON are both the user's to fix
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(f"cannot read {folder / 'tokenizer.json'}: {first}") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        names = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            # transformers rebuilds the post-processor when the config states these flags explicitly.
            _set_post_processor(
                backend,
                names["bos_token"] if cfg.get("add_bos_token") else None,
                names["eos_token"] if cfg.get("add_eos_token") else None,
            )
        eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return cls(backend, chat_template=template, extra_eos_ids=extra, **names)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """From the ``tokenizer.ggml.*`` metadata of a GGUF file (byte-level BPE, ``model == "gpt2"``).

        Vocabulary, merges, control tokens (special) and user-defined tokens (added, not special)
        follow transformers' ``byte_level_tokenizer``/``add_gguf_special_tokens``; the split regex is
        chosen by ``tokenizer.ggml.pre`` (see ``PRE_TOKENIZERS``); BOS/EOS are added when
        ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say so; the chat template is
        ``tokenizer.chat_template``.

        Raises:
            UserError: naming the file, for a non-BPE tokenizer model or an unknown pre-tokenizer.
        """
        from tileinfer.core.checkpoint.gguf_file import gguf_metadata

        md = gguf_metadata(path)
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UserError(
                f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's transformers folder instead"
            )
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise UserError(f"{path}: unknown pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = set(_byte_alphabet().values())
        spelling = _byte_alphabet()
        # A token stored with characters outside the byte alphabet is respelled byte by byte (transformers does too).
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
        backend = Backend(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        split = PRE_TOKENIZERS[pre]
        gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex, then bytes
        if split is None:
            backend.pre_tokenizer = gpt2
        elif split == _DIGITS_THEN_GPT2:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>...) must match whole in text, and are skipped by decode(skip_special_tokens).
        # One spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips those too.
        backend.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, types)
                if k == _CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, types)
                if k == _USER_DEFINED and t in vocab
            ]
        )

        def token(key):
            i = md.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        names = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
        }
        _set_post_processor(
            backend,
            names["bos_token"] if md.get("tokenizer.ggml.add_bos_token") else None,
            names["eos_token"] if md.get("tokenizer.ggml.add_eos_token") else None,
        )
        extra = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
        return cls(backend, chat_template=md.get("tokenizer.chat_template"), extra_eos_ids=extra, **names)

    def save(self, folder) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and
        ``generation_config.json`` (the EOS ids) so that :meth:`from_folder` gives this tokenizer back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            k: v
            for k, v in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
                ("chat_template", self.chat_template),
            )
            if v is not None
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(self.eos_token_ids)}))

    # --- use ------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their ids.
        ``add_special_tokens`` adds BOS/EOS where the tokenizer is configured to (none for SmolLM2/Qwen2.5)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list of ints, or anything with ``tolist()``); invalid UTF-8 becomes U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        Same variables as transformers: ``messages``, ``add_generation_prompt``, ``tools`` (None),
        ``documents`` (None), ``bos_token``/``eos_token``/``unk_token``/``pad_token``; ``kwargs`` adds more.

        Raises:
            UserError: the model has no chat template, or the template raised (``raise_exception``).
        """
        if not self.chat_template:
            raise UserError("this model has no chat template; pass a plain prompt instead")
        special = {
            k: v
            for k, v in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if v is not None
        }
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**special, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise UserError(f"chat template error: {e}") from None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ..., ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _set_post_processor(backend: Backend, bos: str | None, eos: str | None) -> None:
    """BOS/EOS around each sequence, like transformers' ``TokenizersBackend.update_post_processor``."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it for masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's own tojson, which escapes HTML characters; same options as transformers'.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from None
