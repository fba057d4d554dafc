"""tileinfer.core.tokenizer against transformers' tokenizers built from the same GGUF files."""

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from tileinfer.core.checkpoint.gguf_file import gguf_metadata
from tileinfer.core.errors import UserError
from tileinfer.core.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "def f(x):\n\tif x:\n\t\treturn [i**2 for i in range(10)]\n    else:\n        pass  # done\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': 1, \"b\": [2, 3]}\n\n\n",
    "naïve café — 日本語のテキスト, emoji 🤖🎉👍🏽, Ελληνικά, русский, مرحبا",
    "1234567890 3.14159 1,000,000 x²+y³ 2024-01-31",
    "   leading and    long     runs\n\n\n\n      of whitespace\t\t\t \r\n end   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    'text<|endoftext|>more <repo_name>x <tool_call>{"a": 1}</tool_call> <|fim_prefix|>',
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT.",
    "",
    " ",
    "\n",
    "a\u00a0b\u200bc \ufeffd",
    "e\u0301 vs é, ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
    "x" * 300 + " " * 70 + "y",
]
CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write hello world in C."}],
    [{"role": "user", "content": "hi"}],
]


@pytest.fixture(scope="module", params=["smollm2_gguf", "qwen05_gguf"])
def pair(request):
    """(path, ours, transformers') for each test model; only metadata is read, nothing is dequantized."""
    from transformers import AutoTokenizer

    path = request.getfixturevalue(request.param)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, Tokenizer.from_gguf(path), ref


def _llama_cpp_split(ref, path):
    """transformers builds 'smollm' files with plain GPT-2 splitting; llama.cpp (and SmolLM2's own
    tokenizer.json) isolate every \\p{N} first. We follow llama.cpp, so compare on that split."""
    if gguf_metadata(path)["tokenizer.ggml.pre"] == "smollm":
        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return ref


def test_encode_matches_transformers(pair):
    path, ours, ref = pair
    ref = _llama_cpp_split(ref, path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), repr(text)


def test_decode_matches_transformers_and_round_trips(pair):
    _, ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text, repr(text)  # byte-level BPE, no normalizer: lossless
        assert ours.decode(np.array(ids, dtype=np.int64)) == text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), repr(text)


def test_special_tokens_in_text_map_to_their_ids(pair):
    path, ours, _ = pair
    tokens = gguf_metadata(path)["tokenizer.ggml.tokens"]
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert "<|im_start|>" not in ours.decode(ids, skip_special_tokens=True)


def test_special_ids_and_sizes(pair):
    path, ours, ref = pair
    md = gguf_metadata(path)
    assert ours.vocab_size == len(md["tokenizer.ggml.tokens"]) == len(ref)
    assert ours.bos_token_id == md["tokenizer.ggml.bos_token_id"] == ref.bos_token_id
    tokens = md["tokenizer.ggml.tokens"]
    assert ours.eos_token_ids == {
        md["tokenizer.ggml.eos_token_id"],
        tokens.index("<|im_end|>"),
        tokens.index("<|endoftext|>"),
    }


def test_chat_template_matches_transformers(pair):
    _, ours, ref = pair
    for chat in CHATS:
        for gen in (True, False):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want


def test_from_folder_matches_transformers(pair, tmp_path):
    _, _, ref = pair
    ref.save_pretrained(tmp_path)
    ours = Tokenizer.load(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ours.encode(text)) == text
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
    assert ours.bos_token_id == ref.bos_token_id and ref.eos_token_id in ours.eos_token_ids


def test_smollm_isolates_numerals_like_llama_cpp(smollm2_gguf):
    """llama.cpp's 'smollm' regex splits each \\p{N} off first, so a space never merges with '½'."""
    ours = Tokenizer.from_gguf(smollm2_gguf)
    vocab = {t: i for i, t in enumerate(gguf_metadata(smollm2_gguf)["tokenizer.ggml.tokens"])}
    assert ours.encode(" ½") == [vocab["Ġ"], vocab["Â½"]]


def test_template_helpers_match_transformers(smollm2_gguf):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    template = (
        "{% for m in messages %}{{ m | tojson }}{% if loop.index > 5 %}{% break %}{% endif %}\n"
        "{% endfor %}{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ strftime_now('%Y') }}"
    )
    chat = [{"role": "user", "content": "é <b>&</b>", "extra": [1, 2.5, None]}]
    ours = Tokenizer.from_gguf(smollm2_gguf)
    ours.chat_template = template
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(
        chat, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def test_template_errors_are_user_errors(smollm2_gguf):
    ours = Tokenizer.from_gguf(smollm2_gguf)
    ours.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(UserError, match="roles must alternate"):
        ours.apply_chat_template(CHATS[1])
    ours.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        ours.apply_chat_template(CHATS[1])


def test_bad_inputs_are_user_errors(tmp_path):
    import gguf

    with pytest.raises(UserError):
        Tokenizer.load(tmp_path / "missing")
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="tokenizer model 'llama' is not supported"):
        Tokenizer.load(path)
