"""Tokenizer and chat template, from a transformers folder or from a GGUF file's metadata.

Token ids come from the Hugging Face ``tokenizers`` library. A folder brings its ``tokenizer.json``;
a GGUF brings only a vocabulary, merges and token types (``tokenizer.ggml.*``), so the byte-level
BPE tokenizer is rebuilt here the way transformers does it (``integrations/gguf/
gguf_tokenizer_mapping.py``), with the pre-tokenizer split regex chosen by ``tokenizer.ggml.pre``
as llama.cpp does (``llama-vocab.cpp``), and special tokens, BOS and vocabulary checks as llama.cpp
has them where transformers differs (see :meth:`Tokenizer.from_gguf`). Chat templates are rendered
with jinja2 in the same sandboxed environment as transformers' ``apply_chat_template``
(``utils/chat_template_utils.py``).
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

from tileinfer.core import files
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
    "gpt-2": _GPT2_SPLIT,
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
# Llama 3's vocabulary: llama.cpp takes a word that is itself a token whole, before any merge (``ignore_merges``, as
# Llama 3's tokenizer.json does), and adds a BOS when the file does not say (``add_bos``).
_LLAMA3_VOCABS = frozenset({"llama3", "llama-v3", "llama-bpe"})
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
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # llama.cpp token types (gguf.TokenType)


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
        bos_token_id: ``int | None``; id of the beginning-of-sequence token (GGUF ``tokenizer.ggml.bos_token_id``,
            or the ``bos_token`` of tokenizer_config.json), None when the tokenizer declares none.
        add_bos_token: ``bool``; whether the model's prompts start with ``bos_token_id``, i.e. whether
            ``encode(text, add_special_tokens=True)`` puts it first. From a GGUF, ``tokenizer.ggml.add_bos_token``,
            or where the file does not say, llama.cpp's default for its vocabulary (``llama-vocab.cpp``): true for
            Llama 3's (``tokenizer.ggml.pre`` ``llama-bpe``, ``llama3``, ``llama-v3``), false for the other
            byte-level BPE vocabularies. From a folder, tokenizer_config.json's ``add_bos_token``, or where it does
            not say, what tokenizer.json's post-processor does (Llama 3's ``TemplateProcessing`` adds
            ``<|begin_of_text|>``: true). Never true without a ``bos_token_id``.
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
        first = backend.encode("", add_special_tokens=True).ids[:1]
        self.add_bos_token = self.bos_token_id is not None and first == [self.bos_token_id]
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
            UserError: no or unreadable ``tokenizer.json``; ``add_bos_token``/``add_eos_token`` true without that
                token in the vocabulary (llama.cpp refuses the GGUF converted from such a folder).
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
                folder / "tokenizer_config.json",
                add_bos=bool(cfg.get("add_bos_token")),
                bos=names["bos_token"],
                add_eos=bool(cfg.get("add_eos_token")),
                eos=names["eos_token"],
            )
        eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return cls(backend, chat_template=template, extra_eos_ids=extra, **names)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """From the ``tokenizer.ggml.*`` metadata of a GGUF file (byte-level BPE, ``model == "gpt2"``), tokenizing
        as llama.cpp does (``llama-vocab.cpp``).

        Normal tokens are spelled in GPT-2's byte alphabet (one stored otherwise is respelled byte by byte, as
        transformers' ``byte_level_tokenizer`` does). Control, unknown and user-defined tokens are stored as the text
        they stand for (convert_hf_to_gguf.py writes added tokens as their content, e.g. DeepSeek's
        ``<｜begin▁of▁sentence｜>``); like llama.cpp's ``tokenizer_st_partition``, that text is matched before BPE
        and gives the token's own id: control and unknown tokens as special tokens (see :meth:`encode`),
        user-defined ones (``<think>``) always. The split regex is chosen by ``tokenizer.ggml.pre`` (see
        ``PRE_TOKENIZERS``); Llama 3's vocabulary takes a word that is a token whole (``ignore_merges``). BOS/EOS
        are added by ``encode(..., add_special_tokens=True)`` as ``tokenizer.ggml.add_bos_token``/``add_eos_token``
        say, or where the file does not say, by llama.cpp's defaults (see ``add_bos_token``). The chat template is
        ``tokenizer.chat_template``.

        Raises:
            UserError: naming the file, for a tokenizer model other than ``gpt2`` (llama.cpp's SPM ``llama``,
                ``bert``, ``t5``...), a pre-tokenizer not in ``PRE_TOKENIZERS``, missing tokens or merges, fewer
                token types than tokens, a token listed twice, or ``add_bos_token``/``add_eos_token`` true without
                a valid BOS/EOS id.
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
        tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise UserError(f"{path}: a 'gpt2' tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
        types = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) < len(tokens):
            raise UserError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        whole = {i for i, k in enumerate(types[: len(tokens)]) if k in (_UNKNOWN, _CONTROL, _USER_DEFINED)}
        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if i in whole or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            if vocab.setdefault(key, i) != i:  # llama.cpp refuses these too ("duplicate token in vocabulary")
                raise UserError(f"{path}: token {t!r} is in the vocabulary twice (ids {vocab[key]} and {i})")
        backend = Backend(
            BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ")) for m in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _LLAMA3_VOCABS,
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
        # Their text is in the vocabulary under their own ids, so the added tokens keep those ids.
        backend.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(whole) if types[i] != _USER_DEFINED]
        )
        backend.add_tokens(
            [AddedToken(tokens[i], normalized=False, special=False) for i in sorted(whole) if types[i] == _USER_DEFINED]
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
            path,
            add_bos=md.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_VOCABS),
            bos=names["bos_token"],
            add_eos=md.get("tokenizer.ggml.add_eos_token", False),
            eos=names["eos_token"],
        )
        extra = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
        return cls(backend, chat_template=md.get("tokenizer.chat_template"), extra_eos_ids=extra, **names)

    def save(self, folder) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and
        ``generation_config.json`` (the EOS ids) so that :meth:`from_folder` gives this tokenizer back.
        Each file is written atomically; an OS failure is a one-line UserError naming it."""
        folder = Path(folder)
        files.write_text(folder / "tokenizer.json", self.backend.to_str(pretty=True))
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
        files.write_text(folder / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False))
        files.write_text(folder / "generation_config.json", json.dumps({"eos_token_id": sorted(self.eos_token_ids)}))

    # --- use ------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = True) -> list[int]:
        """Token ids (``list[int]``) of ``text``.

        Args:
            text: the text.
            add_special_tokens: add BOS (see ``add_bos_token``) and EOS where the tokenizer is configured to
                (llama.cpp's ``add_special``); neither for SmolLM2/Qwen2.5.
            parse_special: special-token text in ``text`` (``<|im_start|>``, ``<｜User｜>``) becomes that token's one
                id, as a rendered chat template needs and as transformers does. False tokenizes it as plain text,
                like llama.cpp's ``llama_tokenize(..., parse_special=false)`` (its perplexity tool reads text files
                so); user-defined added tokens (``<think>``, not special) still match whole either way, as in
                llama.cpp and transformers. Not thread-safe when False (it flips a flag of the shared backend).
        """
        if parse_special:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        self.backend.encode_special_tokens = True
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self.backend.encode_special_tokens = False

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


def _set_post_processor(
    backend: Backend, source: Path, *, add_bos: bool, bos: str | None, add_eos: bool, eos: str | None
) -> None:
    """BOS/EOS around each sequence, like transformers' ``TokenizersBackend.update_post_processor``.

    Raises:
        UserError: naming ``source``, ``add_bos``/``add_eos`` with no such token or one the vocabulary lacks
            (llama.cpp's ``check_add_special_token`` refuses such a GGUF).
    """
    for add, token, name in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if add and (token is None or backend.token_to_id(token) is None):
            raise UserError(
                f"{source}: add_{name}_token is true but the {name.upper()} token "
                f"{'is not set' if token is None else f'{token!r} is not in the vocabulary'}"
            )
    bos, eos = bos if add_bos else None, eos if add_eos else None
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
