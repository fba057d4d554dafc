"""Make ``tests/data/dflash_fixture.pt``: a tiny random DFlash drafter run by the reference package.

tests/test_dflash.py checks tileinfer's drafter (tileinfer/models/dflash.py) against the logits stored
here, so CI needs no reference package. The reference is the ``dflash`` package (z-lab, PyPI 0.1.0,
``dflash/model.py``: ``DFlashDraftModel``), driven the way its ``dflash_generate`` drives it: two
rounds, each appending new context (target hidden states) to the draft cache, drafting one block
after it and cropping the cache back to the context.

Regenerate (needs torch, transformers and the reference package; its pinned dependencies are not
needed, so install it without them):

    pip install --no-deps dflash==0.1.0      # or put an unpacked wheel on PYTHONPATH
    python tests/data/make_dflash_fixture.py

The file stores: ``config`` (the drafter's config.json, the published z-lab layout), ``state_dict``
(float32, the reference's tensor names), the target's ``embed`` and ``lm_head`` [vocab, hidden], and
``rounds``: per round the new context ``hidden`` [C, len(target_layer_ids) * hidden], the block
``tokens`` and ``positions`` [B] and the reference's float32 ``logits`` [B - 1, vocab].
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

FIXTURE = Path(__file__).with_name("dflash_fixture.pt")

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


def make(seed: int = 0, **overrides) -> dict:
    """Build a random drafter from ``CONFIG | overrides``, run it as the reference does, return the
    fixture dictionary described in the module docstring."""
    import transformers
    from dflash.model import DFlashDraftModel, _crop_to, _make_cache
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    cfg = CONFIG | overrides
    model = DFlashDraftModel(Qwen3Config(**cfg)).eval()
    # weights of O(1) activations instead of the tiny training init, so every term shows in the logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    hid, vocab = cfg["hidden_size"], cfg["vocab_size"]
    embed = torch.randn(vocab, hid)
    lm_head = torch.randn(vocab, hid) * (4 / math.sqrt(hid))
    n_features = len(model.target_layer_ids) * hid

    cache, start, rounds = _make_cache(model.config), 0, []
    with torch.no_grad():
        for n_ctx, length, pending in ROUNDS:
            hidden = torch.randn(1, n_ctx, n_features)
            start += n_ctx
            tokens = torch.tensor([[pending] + [model.mask_token_id] * (length - 1)])
            positions = torch.arange(start - n_ctx, start + length)[None]  # the new context, then the block
            out = model(
                target_hidden=hidden,
                noise_embedding=F.embedding(tokens, embed),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )[:, 1 - length :, :]
            _crop_to(cache, start)  # keep only the context, as dflash_generate does
            logits = model.compute_logits(out, lambda h: h @ lm_head.T)
            rounds.append(
                dict(hidden=hidden[0], tokens=tokens[0], positions=positions[0, n_ctx:], logits=logits[0].float())
            )
    return dict(
        config=cfg,
        state_dict={k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        embed=embed,
        lm_head=lm_head,
        rounds=rounds,
        versions={
            "torch": str(torch.__version__),
            "transformers": str(transformers.__version__),
            "dflash": _dflash_version(),
        },
    )


def _dflash_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash")
    except PackageNotFoundError:
        return "unpacked"


if __name__ == "__main__":
    torch.save(make(), FIXTURE)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
