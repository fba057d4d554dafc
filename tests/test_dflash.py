"""The DFlash drafter and proposer: the reference package's logits, lossless speculative decoding, and
one-line refusals of bad drafter folders."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tileinfer.core.checkpoint.random_init import random_state_dict
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.engine.dflash import DFlashProposer, load_dflash
from tileinfer.engine.generation import generate
from tileinfer.engine.runner import ModelRunner
from tileinfer.engine.speculative import speculative_decode
from tileinfer.models import Transformer
from tileinfer.models.dflash import DFlashDrafter

DATA = Path(__file__).parent / "data"


def tiny_target(hidden: int, vocab: int, layers: int, seed: int = 0) -> Transformer:
    """A random Qwen3 target in float32."""
    hf = dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    sd = random_state_dict(hf, seed=seed, dtype=torch.float32)
    return Transformer.from_state_dict(ModelConfig.from_hf(hf), sd, dtype=torch.float32)


def write_drafter(folder: Path, config: dict, sd: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors")
    return folder


def assert_matches(fx: dict, drafter: DFlashDrafter) -> None:
    """Drive a proposer round by round as the fixture's reference run did; compare the draft logits."""
    c = fx["config"]
    target = tiny_target(c["hidden_size"], c["vocab_size"], c["num_target_layers"])
    target.embed, target.lm_head = fx["embed"], fx["lm_head"]  # the only target tensors a drafter reads
    proposer = DFlashProposer(drafter, target)
    for r in fx["rounds"]:
        proposer.observe(r["hidden"])
        assert int(r["positions"][0]) == proposer.length
        got = proposer.draft_logits(int(r["tokens"][0]), len(r["tokens"]) - 1)
        assert got.dtype == torch.float32 and got.shape == r["logits"].shape
        torch.testing.assert_close(got, r["logits"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- numerics


def fixture_module():
    spec = importlib.util.spec_from_file_location("make_dflash_fixture", DATA / "make_dflash_fixture.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return make


def test_drafter_matches_the_reference_fixture(tmp_path):
    make = fixture_module()
    fx = make.with_inputs(make.load())
    folder = write_drafter(tmp_path / "drafter", fx["config"], fx["state_dict"])
    assert_matches(fx, DFlashDrafter.load(folder, dtype=torch.float32))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "num_key_value_heads": 1, "num_hidden_layers": 3, "block_size": 16}],
    ids=["published-shape", "bias-gqa4-3layers"],
)
def test_drafter_matches_the_reference_package(overrides):
    """Against the ``dflash`` package itself, where it is installed (not a test dependency)."""
    pytest.importorskip("dflash.model")
    make = fixture_module()
    fx = make.with_inputs(make.make(seed=1, **overrides))
    assert_matches(fx, DFlashDrafter.from_state_dict(fx["config"], fx["state_dict"], torch.float32))


# ---------------------------------------------------------------------------- losslessness

DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 64,  # shorter than the target's: the RoPE tables must still cover it
    "block_size": 16,
    "num_target_layers": 3,
    "dflash_config": {"mask_token_id": 255, "target_layer_ids": [0, 1]},
}


def random_drafter(folder: Path) -> Path:
    """A drafter folder with random weights for a 3-layer, hidden-64 target."""
    gen = torch.Generator().manual_seed(1)
    names = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for i in range(2):
        p = f"layers.{i}."
        names |= {
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.o_proj.weight": (64, 64),
            p + "self_attn.q_norm.weight": (16,),
            p + "self_attn.k_norm.weight": (16,),
            p + "mlp.gate_proj.weight": (96, 64),
            p + "mlp.up_proj.weight": (96, 64),
            p + "mlp.down_proj.weight": (64, 96),
        }
    sd = {
        n: 1 + 0.1 * torch.randn(s, generator=gen) if len(s) == 1 else torch.randn(s, generator=gen) / s[1] ** 0.5
        for n, s in names.items()
    }
    return write_drafter(folder, DRAFTER, sd)


def start(runner: ModelRunner, proposer: DFlashProposer, prompt: list[int]):
    """Cache the prompt's first tokens in the target and show the drafter their hidden states."""
    seq = runner.new_sequence()
    _, hidden = runner.step(seq, torch.tensor(prompt[:-1]), capture=proposer.hidden_layers)
    proposer.observe(hidden)
    proposer.begin(prompt)
    return seq


class Oracle(DFlashProposer):
    """Drafts the known greedy reply for its first ``right`` tokens (after the drafter's own pass), so
    drafts get accepted and the context grows by several positions per round."""

    def __init__(self, *args, reply: list[int], prompt_len: int, right: int):
        super().__init__(*args)
        self.reply, self.prompt_len, self.right = reply, prompt_len, right

    def propose(self, tokens, k):
        drafts = super().propose(tokens, k)
        done = len(tokens) - self.prompt_len  # reply tokens already produced
        return self.reply[done : done + self.right] + drafts[self.right :]


@pytest.mark.parametrize("right", [0, 3])
def test_speculative_decode_with_dflash_is_lossless(tmp_path, right):
    target = tiny_target(64, 256, 3)
    runner = ModelRunner(target, "reference", max_seq_len=128, page_size=16, prefill_chunk=32)
    prompt = [(7 * i + 3) % 250 for i in range(40)]  # with the reply, past the first context buffer (64)
    want = generate(runner, prompt, 40).tokens
    folder = random_drafter(tmp_path / "drafter")
    proposer = load_dflash(str(folder), target)
    if right:
        proposer = Oracle(proposer.drafter, target, reply=want, prompt_len=len(prompt), right=right)
    full = prompt + want[:1]  # the first reply token is chosen by the prefill, pending for the loop
    seq = start(runner, proposer, full)
    reply = speculative_decode(runner, seq, full, 39, proposer, k=15)
    assert want[:1] + reply.tokens == want
    assert reply.stats.drafted_tokens > 0
    if right:
        assert reply.stats.accepted_tokens >= right * (reply.stats.drafts - 1)
    # the kept context is the target's hidden states of every cached position, as one pass computes them
    assert proposer.length == seq.length == len(full) + len(reply.tokens) - 1
    seq.release()  # the pool holds one sequence
    again = runner.new_sequence()
    tokens = torch.tensor(full + reply.tokens[:-1])
    _, hidden = runner.step(again, tokens, capture=proposer.hidden_layers)
    fresh = proposer.drafter.context_kv(proposer.ops, hidden, torch.arange(len(tokens)))
    for (k, v), kept_k, kept_v in zip(fresh, proposer._k, proposer._v, strict=True):
        torch.testing.assert_close(kept_k[: len(tokens)], k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept_v[: len(tokens)], v, rtol=1e-4, atol=1e-4)
    proposer.end()
    again.release()


def test_block_size_caps_the_drafts_and_positions_are_checked(tmp_path):
    target = tiny_target(64, 256, 3)
    runner = ModelRunner(target, "reference", max_seq_len=128, page_size=16, prefill_chunk=32)
    proposer = load_dflash(str(random_drafter(tmp_path / "d")), target)
    prompt = list(range(1, 9))
    start(runner, proposer, prompt)
    assert len(proposer.propose(prompt, 40)) == 15 and len(proposer.propose(prompt, 4)) == 4
    assert proposer.propose(prompt, 0) == []
    with pytest.raises(AssertionError, match="observed 7 positions"):
        proposer.propose(prompt + [3], 4)  # a token the proposer never saw the hidden state of


# ---------------------------------------------------------------------------- bad input


def one_line(e: pytest.ExceptionInfo, *words: str) -> bool:
    msg = str(e.value)
    return "\n" not in msg and all(w in msg for w in words)


def test_missing_folder_is_one_line(tmp_path):
    target = tiny_target(64, 256, 3)
    with pytest.raises(UserError) as e:
        load_dflash(str(tmp_path / "nowhere"), target)
    assert one_line(e, "nowhere", "does not exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        DFlashDrafter.load(tmp_path / "empty")
    assert one_line(e, "config.json")


def test_unreachable_hub_repo_is_one_line():
    # tests run with HF_HUB_OFFLINE=1 (conftest), so the hub path fails at once
    with pytest.raises(UserError) as e:
        load_dflash("z-lab/no-such-drafter", tiny_target(64, 256, 3))
    assert one_line(e, "z-lab/no-such-drafter", "Hugging Face hub")


def _drafter_files(tmp_path: Path) -> tuple[dict, dict]:
    folder = random_drafter(tmp_path / "good")
    from safetensors.torch import load_file

    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda c: c.pop("dflash_config"), ["dflash_config"]),
        (lambda c: c["dflash_config"].pop("mask_token_id"), ["mask_token_id"]),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), ["DFlash2DraftModel"]),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), ["sliding_attention"]),
        (lambda c: c["dflash_config"].update(output_multiplier=0.5), ["output_multiplier"]),
    ],
    ids=["plain-qwen3", "no-mask-token", "dflash2", "sliding", "output-multiplier"],
)
def test_config_it_does_not_implement_is_one_line(tmp_path, edit, words):
    config, sd = _drafter_files(tmp_path)
    edit(config)
    with pytest.raises(UserError) as e:
        DFlashDrafter.load(write_drafter(tmp_path / "bad", config, sd))
    assert one_line(e, *words)


@pytest.mark.parametrize(
    "name,change,words",
    [
        ("layers.1.self_attn.k_proj.weight", lambda t: t[:16], ["k_proj", "(16, 64)", "(32, 64)"]),
        ("fc.weight", lambda t: t[:, :64], ["fc.weight", "(64, 64)", "(64, 128)"]),
        ("layers.0.self_attn.q_norm.weight", None, ["no tensor", "q_norm"]),
        ("layers.0.attention_conv.base_kernel", lambda t: torch.zeros(2, 2, 64), ["attention_conv"]),
    ],
    ids=["k-proj-shape", "fc-shape", "missing", "unused"],
)
def test_wrong_tensors_are_one_line(tmp_path, name, change, words):
    config, sd = _drafter_files(tmp_path)
    if change is None:
        sd.pop(name)
    else:
        sd[name] = change(sd.get(name, torch.zeros(1))).contiguous()
    with pytest.raises(UserError) as e:
        DFlashDrafter.load(write_drafter(tmp_path / "bad", config, sd))
    assert one_line(e, *words)


def test_drafter_for_another_target_is_one_line(tmp_path):
    folder = random_drafter(tmp_path / "d")
    with pytest.raises(UserError) as e:
        load_dflash(str(folder), tiny_target(32, 256, 3))
    assert one_line(e, "hidden size 64", "32")
    with pytest.raises(UserError) as e:
        load_dflash(str(folder), tiny_target(64, 256, 5))
    assert one_line(e, "3 layers", "5")
