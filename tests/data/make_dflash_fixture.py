"""Make ``tests/data/dflash_fixture.json``: a tiny random DFlash drafter run by the reference package.

tests/test_dflash.py checks tileinfer's drafter (tileinfer/models/dflash.py) against the logits stored
here, so CI needs no reference package. The reference is the ``dflash`` package (z-lab, PyPI 0.1.0,
``dflash/model.py``: ``DFlashDraftModel``), driven the way its ``dflash_generate`` drives it: two
rounds, each appending new context (target hidden states) to the draft cache, drafting one block
after it and cropping the cache back to the context.

Regenerate (needs torch, transformers and the reference package; its pinned dependencies are not
needed, so install it without them):

    pip install --no-deps dflash==0.1.0      # or put an unpacked wheel on PYTHONPATH
    python tests/data/make_dflash_fixture.py

The file (JSON: float32 values written in full, so they read back bit for bit) stores no
weights: ``config`` (the drafter's config.json, the published z-lab layout), the
``seed`` from which :func:`random_inputs` draws the drafter's state dict (the reference's tensor
names), the target's ``embed`` and ``lm_head`` and each round's context, and ``rounds``: per round the
block ``tokens`` and ``positions`` [B] and the reference's float32 ``logits`` [B - 1, vocab].
:func:`with_inputs` adds the drawn tensors back (``hidden`` [C, len(target_layer_ids) * hidden] per round).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

FIXTURE = Path(__file__).with_name("dflash_fixture.json")
ROUND_DTYPES = {"tokens": torch.int64, "positions": torch.int64, "logits": torch.float32}

# A drafter of the published shape family (Qwen3 layers, GQA, q/k norms), shrunk; the target it
# serves has 4 layers of hidden size 32 and a 64-token vocabulary whose last id is the mask token.
CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000.0,
    "max_position_embeddings": 128,
    "vocab_size": 64,
    "tie_word_embeddings": False,
    "block_size": 8,
    "num_target_layers": 4,
    "dflash_config": {"mask_token_id": 63, "target_layer_ids": [0, 2]},
}
# (new context positions, block length, pending token) per round; the second block is shorter, as
# dflash_generate's is near the end of a reply
ROUNDS = [(7, 8, 5), (3, 5, 11)]


def drafter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter of config ``cfg`` under the reference's names, with its shape."""
    hid, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    features = len(cfg["dflash_config"]["target_layer_ids"]) * hid
    shapes = {"fc.weight": (hid, features), "hidden_norm.weight": (hid,), "norm.weight": (hid,)}
    for i in range(cfg["num_hidden_layers"]):
        a = f"layers.{i}.self_attn."
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (hid,),
            f"layers.{i}.post_attention_layernorm.weight": (hid,),
            a + "q_proj.weight": (q, hid),
            a + "k_proj.weight": (kv, hid),
            a + "v_proj.weight": (kv, hid),
            a + "o_proj.weight": (hid, q),
            a + "q_norm.weight": (d,),
            a + "k_norm.weight": (d,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, hid),
            f"layers.{i}.mlp.up_proj.weight": (inter, hid),
            f"layers.{i}.mlp.down_proj.weight": (hid, inter),
        }
        if cfg.get("attention_bias"):
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
            shapes |= {a + "o_proj.bias": (hid,)}
    return shapes


def random_inputs(cfg: dict, seed: int) -> dict:
    """The drafter's weights (O(1) activations instead of the tiny training init, so every term shows
    in the logits), the target's ``embed`` and ``lm_head`` and each round's context ``hidden``, drawn
    from one seeded generator in a fixed order: the same on any machine, so the fixture file stores
    none of them."""
    g = torch.Generator().manual_seed(seed)

    def draw(name, shape):
        if name.endswith("norm.weight"):
            return 1 + 0.1 * torch.randn(shape, generator=g)
        if len(shape) == 1:
            return 0.1 * torch.randn(shape, generator=g)
        return torch.randn(shape, generator=g) / math.sqrt(shape[1])

    hid, vocab = cfg["hidden_size"], cfg["vocab_size"]
    features = len(cfg["dflash_config"]["target_layer_ids"]) * hid
    return dict(
        state_dict={n: draw(n, shape) for n, shape in sorted(drafter_shapes(cfg).items())},
        embed=torch.randn(vocab, hid, generator=g),
        lm_head=torch.randn(vocab, hid, generator=g) * (4 / math.sqrt(hid)),
        hidden=[torch.randn(n_ctx, features, generator=g) for n_ctx, _, _ in ROUNDS],
    )


def save(fx: dict, path: Path = FIXTURE) -> None:
    """Write a fixture (without its drawn tensors) as JSON; tensors become nested lists."""
    rounds = [{k: r[k].tolist() for k in ROUND_DTYPES} for r in fx["rounds"]]
    path.write_text(json.dumps(fx | {"rounds": rounds}, indent=1) + "\n")


def load(path: Path = FIXTURE) -> dict:
    """A fixture written by :func:`save`, its rounds' lists back as tensors of their dtypes."""
    fx = json.loads(path.read_text())
    fx["rounds"] = [{k: torch.tensor(r[k], dtype=dt) for k, dt in ROUND_DTYPES.items()} for r in fx["rounds"]]
    return fx


def with_inputs(fx: dict) -> dict:
    """A stored fixture with its drawn tensors (:func:`random_inputs`) added back."""
    inputs = random_inputs(fx["config"], fx["seed"])
    rounds = [r | {"hidden": h} for r, h in zip(fx["rounds"], inputs.pop("hidden"), strict=True)]
    return fx | inputs | {"rounds": rounds}


def make(seed: int = 0, **overrides) -> dict:
    """Run a random drafter of ``CONFIG | overrides`` as the reference does; return the fixture
    dictionary described in the module docstring (with its drawn tensors: :func:`with_inputs`)."""
    import transformers
    from dflash.model import DFlashDraftModel, _crop_to, _make_cache
    from transformers import Qwen3Config

    cfg = CONFIG | overrides
    model = DFlashDraftModel(Qwen3Config(**cfg)).eval()
    inputs = random_inputs(cfg, seed)
    missing, unexpected = model.load_state_dict(inputs["state_dict"], strict=False)
    assert not missing and not unexpected, (missing, unexpected)  # drafter_shapes names every tensor
    embed, lm_head = inputs["embed"], inputs["lm_head"]

    cache, start, rounds = _make_cache(model.config), 0, []
    with torch.no_grad():
        for (n_ctx, length, pending), hidden in zip(ROUNDS, inputs["hidden"], strict=True):
            start += n_ctx
            tokens = torch.tensor([[pending] + [model.mask_token_id] * (length - 1)])
            positions = torch.arange(start - n_ctx, start + length)[None]  # the new context, then the block
            out = model(
                target_hidden=hidden[None],
                noise_embedding=F.embedding(tokens, embed),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )[:, 1 - length :, :]
            _crop_to(cache, start)  # keep only the context, as dflash_generate does
            logits = model.compute_logits(out, lambda h: h @ lm_head.T)
            rounds.append(dict(tokens=tokens[0], positions=positions[0, n_ctx:], logits=logits[0].float()))
    stored = dict(
        config=cfg,
        seed=seed,
        rounds=rounds,
        versions={
            "torch": str(torch.__version__),
            "transformers": str(transformers.__version__),
            "dflash": _dflash_version(),
        },
    )
    return stored


def _dflash_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash")
    except PackageNotFoundError:
        return "unpacked"


if __name__ == "__main__":
    save(make())  # no weights: the test draws them again from the stored seed
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
