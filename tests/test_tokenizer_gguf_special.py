"""Special tokens, BOS and vocabulary styles of tileinfer.core.tokenizer, against llama.cpp's llama-vocab.cpp.

Tiny GGUF files are written here with the `gguf` package the way llama.cpp's convert_hf_to_gguf.py writes them:
normal tokens in GPT-2's byte alphabet, added tokens (control, user-defined) as their own text, e.g. DeepSeek's
full-width-bar ``<｜begin▁of▁sentence｜>``.
"""

import json

import gguf
import pytest
from tokenizers import AddedToken, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from tileinfer.core.checkpoint.gguf_file import gguf_metadata
from tileinfer.core.errors import UserError
from tileinfer.core.tokenizer import Tokenizer, _byte_alphabet

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType
BYTES = list(_byte_alphabet().values())  # token b is byte b
MERGES = ["h i", "Ġ t", "Ġt h", "Ġth e"]
WORDS = ["hi", "Ġt", "Ġth", "Ġthe"]
# DeepSeek-R1-Distill-Qwen's added tokens, typed as convert_hf_to_gguf.py types them (does_token_look_special).
DEEPSEEK = [
    ("<｜end▁of▁sentence｜>", CONTROL),
    ("<｜User｜>", CONTROL),
    ("<｜Assistant｜>", CONTROL),
    ("<｜begin▁of▁sentence｜>", CONTROL),
    ("<|EOT|>", CONTROL),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% else %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def write_gguf(path, tokens, types=None, merges=MERGES, *, model="gpt2", pre="deepseek-r1-qwen", **kv):
    """A GGUF holding only tokenizer metadata; ``kv`` calls ``GGUFWriter.add_<key>(value)`` (bos_token_id=...)."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def deepseek_gguf(path, **kv):
    """DeepSeek-R1-Distill-Qwen's layout on a tiny vocabulary; returns token -> id."""
    tokens = BYTES + WORDS + [t for t, _ in DEEPSEEK]
    types = [NORMAL] * (len(BYTES) + len(WORDS)) + [k for _, k in DEEPSEEK]
    ids = {"bos_token_id": tokens.index("<｜begin▁of▁sentence｜>"), "eos_token_id": tokens.index(DEEPSEEK[0][0])}
    write_gguf(path, tokens, types, chat_template=TEMPLATE, **ids, **kv)
    return {t: i for i, t in enumerate(tokens)}


@pytest.mark.parametrize("add_bos", [True, False])
def test_deepseek_style_gguf_special_tokens_are_one_id_each(tmp_path, add_bos):
    """The issue's file: with add_bos_token true from_gguf raised TypeError; with false the chat prompt gave one id
    per byte of each special token, and bos/eos were not found."""
    vocab = deepseek_gguf(tmp_path / "ds.gguf", add_bos_token=add_bos)
    tok = Tokenizer.from_gguf(tmp_path / "ds.gguf")
    bos, eos = vocab["<｜begin▁of▁sentence｜>"], vocab["<｜end▁of▁sentence｜>"]
    assert (tok.bos_token_id, tok.eos_token_ids) == (bos, {eos})
    chat = tok.apply_chat_template([{"role": "user", "content": "hi the"}])
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>hi the<｜Assistant｜><think>\n"
    want = [bos, vocab["<｜User｜>"], vocab["hi"], vocab["Ġthe"], vocab["<｜Assistant｜>"], vocab["<think>"], 10]
    assert tok.encode(chat) == want
    assert tok.decode(want) == chat
    # llama.cpp's token_to_piece(special=false) drops control tokens and prints user-defined ones.
    assert tok.decode(want, skip_special_tokens=True) == "hi the<think>\n"
    assert tok.vocab_size == len(vocab)
    assert tok.add_bos_token is add_bos
    assert tok.encode("hi the", add_special_tokens=True) == [bos] * add_bos + [vocab["hi"], vocab["Ġthe"]]


def test_deepseek_style_tokenizer_saved_to_a_folder_reloads_the_same(tmp_path):
    """A quantized checkpoint carries the tokenizer as a folder (Tokenizer.save): ids and BOS setting survive."""
    vocab = deepseek_gguf(tmp_path / "ds.gguf", add_bos_token=True)
    tok = Tokenizer.from_gguf(tmp_path / "ds.gguf")
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    chat = again.apply_chat_template([{"role": "user", "content": "hi the"}])
    assert chat == tok.apply_chat_template([{"role": "user", "content": "hi the"}])
    assert again.encode(chat) == tok.encode(chat)
    assert again.bos_token_id == vocab["<｜begin▁of▁sentence｜>"] and again.add_bos_token is True
    assert again.eos_token_ids == {vocab["<｜end▁of▁sentence｜>"]}


def test_parse_special_false_is_llama_cpp_plain_text(tmp_path):
    """llama_tokenize(parse_special=false): control tokens are plain text, user-defined ones still match whole."""
    vocab = deepseek_gguf(tmp_path / "ds.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "ds.gguf")
    text = "<｜User｜>hi<think>"
    plain = tok.encode(text, parse_special=False)
    assert vocab["<｜User｜>"] not in plain and plain[-2:] == [vocab["hi"], vocab["<think>"]]
    assert tok.decode(plain) == text
    assert tok.encode(text) == [vocab["<｜User｜>"], vocab["hi"], vocab["<think>"]]  # the flag is not left set


def test_added_tokens_outside_the_byte_alphabet(tmp_path):
    """A user-defined token the converter stored as raw text (two spaces), and an unknown-type token: llama.cpp
    matches both before BPE (the unknown one only as a special token)."""
    tokens = [*BYTES, *WORDS, "  ", "<unk>"]
    path = write_gguf(tmp_path / "t.gguf", tokens, [NORMAL] * (len(tokens) - 2) + [USER_DEFINED, UNKNOWN])
    tok = Tokenizer.from_gguf(path)
    two, unk = len(tokens) - 2, len(tokens) - 1
    assert tok.encode("hi  hi<unk>") == [len(BYTES), two, len(BYTES), unk]
    assert tok.encode("<unk>", parse_special=False) != [unk]
    assert tok.decode([two, unk], skip_special_tokens=True) == "  "


def test_real_vocab_deepseek_layout_matches_qwen(qwen05_gguf, tmp_path):
    """DeepSeek-R1-Distill-Qwen's GGUF is Qwen2.5's vocabulary with 151643-151649 renamed: normal text must encode
    as Qwen's does (transformers' tokenizer of the Qwen file is the reference), each special token to its id."""
    from transformers import AutoTokenizer

    md = gguf_metadata(qwen05_gguf)
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    for i, (t, k) in enumerate(DEEPSEEK):
        tokens[151643 + i], types[151643 + i] = t, k
    path = write_gguf(
        tmp_path / "r1.gguf",
        tokens,
        types,
        md["tokenizer.ggml.merges"],
        bos_token_id=151646,
        eos_token_id=151643,
        add_bos_token=True,
        add_eos_token=False,
        chat_template=TEMPLATE,
    )
    tok = Tokenizer.from_gguf(path)
    ref = AutoTokenizer.from_pretrained(qwen05_gguf.parent, gguf_file=qwen05_gguf.name)
    assert (tok.bos_token_id, tok.add_bos_token, tok.vocab_size) == (151646, True, len(tokens))
    assert 151643 in tok.eos_token_ids
    content = "def f(x):\n    return x  # naïve 日本語 🤖 1234"
    chat = tok.apply_chat_template([{"role": "user", "content": content}])
    body = ref.encode(content, add_special_tokens=False)
    assert tok.encode(chat) == [151646, 151644, *body, 151645, 151648, *ref.encode("\n", add_special_tokens=False)]
    assert tok.encode(content, add_special_tokens=True) == [151646, *body]
    assert tok.decode(tok.encode(chat)) == chat


def test_real_models_bos_settings(qwen05_gguf, smollm2_gguf):
    """Both files say add_bos_token false, and neither gets a BOS."""
    for path in (qwen05_gguf, smollm2_gguf):
        md = gguf_metadata(path)
        tok = Tokenizer.from_gguf(path)
        assert (tok.bos_token_id, tok.add_bos_token) == (md["tokenizer.ggml.bos_token_id"], False)
        assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_qwen_parse_special_false_matches_transformers_split_special_tokens(qwen05_gguf):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(qwen05_gguf.parent, gguf_file=qwen05_gguf.name)
    tok = Tokenizer.from_gguf(qwen05_gguf)
    text = "<|im_start|>user\nhi<|im_end|> <tool_call>{}</tool_call><|endoftext|>"
    want = ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok.encode(text, parse_special=False) == want
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)


# --- add_bos_token defaults, llama.cpp's per vocabulary -------------------------------------------------------------


@pytest.mark.parametrize(
    "pre, add_bos, want",
    [
        ("llama-bpe", None, True),  # llama.cpp: LLAMA3 pre-tokenizers add a BOS unless the file says not to
        ("llama-bpe", False, False),
        ("qwen2", None, False),  # other BPE vocabularies: no BOS unless the file says so
        ("qwen2", True, True),
        ("smollm", None, False),
        ("default", None, False),
    ],
)
def test_add_bos_token_follows_llama_cpp(tmp_path, pre, add_bos, want):
    tokens = [*BYTES, *WORDS, "<|begin_of_text|>"]
    flag = {} if add_bos is None else {"add_bos_token": add_bos}
    path = write_gguf(
        tmp_path / "t.gguf",
        tokens,
        [NORMAL] * (len(tokens) - 1) + [CONTROL],
        pre=pre,
        bos_token_id=len(tokens) - 1,
        **flag,
    )
    tok = Tokenizer.from_gguf(path)
    assert (tok.add_bos_token, tok.bos_token_id) == (want, len(tokens) - 1)
    assert tok.encode("hi", add_special_tokens=True) == [len(tokens) - 1] * want + [len(BYTES)]


@pytest.mark.parametrize("bos", [None, 10_000])
def test_add_bos_without_a_bos_token_is_refused(tmp_path, bos):
    """llama.cpp: "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"."""
    ids = {} if bos is None else {"bos_token_id": bos}
    path = write_gguf(tmp_path / "t.gguf", [*BYTES, *WORDS], add_bos_token=True, **ids)
    with pytest.raises(UserError, match="add_bos_token is true but the BOS token is not set") as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)


def test_llama3_vocab_takes_whole_words_first(tmp_path):
    """llama.cpp sets ignore_merges for LLAMA3 pre-tokenizers (as Llama 3's tokenizer.json does): a word that is a
    token is taken whole even when no merge leads to it."""
    tokens = [*BYTES, "hi", "Ġthere"]
    for pre, want in (("llama-bpe", [len(BYTES) + 1]), ("qwen2", [BYTES.index("Ġ"), *b"there"])):
        path = write_gguf(tmp_path / f"{pre}.gguf", tokens, merges=["h i"], pre=pre, add_bos_token=False)
        assert Tokenizer.from_gguf(path).encode(" there") == want, pre


# --- vocabularies llama.cpp would refuse or read otherwise: one line, never a wrong tokenization ------------------


def test_gpt2_pre_tokenizer_has_llama_cpps_name(tmp_path):
    """llama.cpp (and its converter) name GPT-2's pre-tokenizer 'gpt-2'."""
    path = write_gguf(tmp_path / "a.gguf", [*BYTES, *WORDS], pre="gpt-2")
    assert Tokenizer.from_gguf(path).encode(" the") == [len(BYTES) + 3]


@pytest.mark.parametrize("pre", ["gpt2", "tekken", "deepseek-llm", "kimi-k2"])  # 'gpt2' is unknown to llama.cpp
def test_unknown_pre_tokenizers_are_refused(tmp_path, pre):
    path = write_gguf(tmp_path / "b.gguf", [*BYTES, *WORDS], pre=pre)
    with pytest.raises(UserError, match=f"unknown pre-tokenizer '{pre}'"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("model", ["llama", "bert", "t5", "rwkv", "no_vocab"])
def test_other_tokenizer_models_are_refused(tmp_path, model):
    path = write_gguf(tmp_path / "m.gguf", ["<unk>", "<s>", "</s>", "a"], merges=None, model=model, pre=None)
    with pytest.raises(UserError, match=f"tokenizer model '{model}' is not supported"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    "kv, message",
    [
        ({"merges": None}, "needs tokenizer.ggml.tokens and tokenizer.ggml.merges"),  # llama.cpp refuses it too
        ({"types": [NORMAL] * 10}, "token_type has 10 entries for 260 tokens"),
        ({"tokens": [*BYTES, *WORDS, "hi"]}, r"token 'hi' is in the vocabulary twice \(ids 256 and 260\)"),
    ],
    ids=["no merges", "short types", "duplicate"],
)
def test_broken_vocabularies_are_refused(tmp_path, kv, message):
    path = write_gguf(tmp_path / "x.gguf", **({"tokens": [*BYTES, *WORDS]} | kv))
    with pytest.raises(UserError, match=message):
        Tokenizer.from_gguf(path)


# --- transformers folders -------------------------------------------------------------------------------------


def _folder(path, config, post_processor=None):
    """A tokenizer.json with <s>/</s> as special tokens, optional post-processor, and tokenizer_config.json."""
    backend = Backend(BPE(vocab={"<s>": 0, "</s>": 1, "h": 2, "i": 3, "hi": 4}, merges=[("h", "i")]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    if post_processor is not None:
        backend.post_processor = post_processor
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


LLAMA3_POST = processors.TemplateProcessing(single="<s> $A:0", pair="<s> $A:0 <s> $B:1", special_tokens=[("<s>", 0)])


@pytest.mark.parametrize(
    "config, post, want",
    [
        ({"bos_token": "<s>", "add_bos_token": True}, None, True),
        ({"bos_token": "<s>", "add_bos_token": False}, LLAMA3_POST, False),  # the config's flag wins
        ({"bos_token": "<s>"}, LLAMA3_POST, True),  # Llama 3: no flag, the post-processor adds the BOS
        ({"bos_token": "<s>"}, processors.ByteLevel(), False),  # Qwen2: no flag, nothing added
        ({"bos_token": None}, None, False),
    ],
)
def test_folder_add_bos_token_is_what_its_gguf_would_say(tmp_path, config, post, want):
    """The reference is llama.cpp's converter (gguf-py's SpecialVocab): tokenizer_config.json's add_bos_token, else
    tokenizer.json's TemplateProcessing, else llama.cpp's default (false for a BPE vocabulary). transformers 5
    differs: with a tokenizer.json it drops the config's flag and keeps the post-processor."""
    folder = _folder(tmp_path / "tok", config, post)
    tok = Tokenizer.from_folder(folder)
    assert gguf.SpecialVocab(folder, load_merges=False).add_special_token.get("bos", False) is want
    assert tok.add_bos_token is want
    assert tok.bos_token_id == (0 if config["bos_token"] else None)
    assert tok.encode("hi", add_special_tokens=True) == [0] * want + [4]


@pytest.mark.parametrize("bos", [None, "<|begin_of_text|>"])
def test_folder_add_bos_without_that_token_is_refused(tmp_path, bos):
    folder = _folder(tmp_path / "tok", {"bos_token": bos, "add_bos_token": True})
    with pytest.raises(UserError, match="add_bos_token is true but the BOS token"):
        Tokenizer.from_folder(folder)
