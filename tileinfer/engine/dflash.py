"""The DFlash proposer: a block-diffusion drafter (tileinfer.models.dflash) conditioned on the target's
hidden states drafts up to ``block_size - 1`` tokens in one forward pass.

The speculative loop (tileinfer.engine.speculative) captures the target's outputs of the drafter's
``target_layer_ids`` for every position it keeps and hands them to :meth:`DFlashProposer.observe`;
the proposer turns them into each drafter layer's context keys and values once and keeps them, so a
proposal costs one drafter pass over the block alone (the reference's draft cache, cropped back to
the context after each block, holds the same keys and values).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tileinfer.core.errors import UserError
from tileinfer.core.fetch import tileinfer_home
from tileinfer.engine.proposers import Proposer
from tileinfer.models import Transformer
from tileinfer.models.dflash import DFlashDrafter
from tileinfer.ops import get_backend


class DFlashProposer(Proposer):
    """Drafts with a :class:`DFlashDrafter` for ``target``.

    Args:
        drafter: the drafter's weights.
        target: the target model (its embeddings and lm_head are shared with the drafter).
        ops: the backend module (or its name) the drafter runs on.

    Raises:
        UserError: the drafter does not fit the target (hidden size, layer ids, layer count, mask token).
    """

    def __init__(self, drafter: DFlashDrafter, target: Transformer, ops="reference"):
        check_fits(drafter, target)
        self.drafter, self.target = drafter, target
        self.ops = get_backend(ops) if isinstance(ops, str) else ops
        self.hidden_layers = drafter.config.target_layer_ids
        self.end()

    def _buffers(self, capacity: int) -> list[torch.Tensor]:
        """One empty context buffer per drafter layer: [capacity, kv_heads, head_dim]."""
        c, d = self.drafter.config.model, self.drafter
        shape = (capacity, c.num_key_value_heads, c.head_dim)
        return [torch.empty(shape, dtype=d.dtype, device=d.device) for _ in d.layers]

    def observe(self, hidden: torch.Tensor) -> None:
        """Append the context of the next T positions: hidden [T, len(hidden_layers) * hidden_size]."""
        start, end = self.length, self.length + hidden.shape[0]
        kv = self.drafter.context_kv(self.ops, hidden, torch.arange(start, end, device=self.drafter.device))
        if end > self._k[0].shape[0]:  # doubling: each position is copied O(1) times on average
            capacity = max(end, 2 * self._k[0].shape[0])
            k, v = self._buffers(capacity), self._buffers(capacity)
            for new, old in zip(k + v, self._k + self._v, strict=True):
                new[:start] = old[:start]
            self._k, self._v = k, v
        for i, (k, v) in enumerate(kv):
            self._k[i][start:end] = k
            self._v[i][start:end] = v
        self.length = end

    def begin(self, prompt: list[int]) -> None:
        # the caller observed the prompt's cached positions (all but the pending last token) first
        assert self.length == len(prompt) - 1, f"observed {self.length} positions, the prompt caches {len(prompt) - 1}"

    def draft_logits(self, pending: int, m: int) -> torch.Tensor:
        """Float32 logits [m, vocab] of the m positions after ``pending`` (at position ``length``):
        one drafter pass over the block [pending, mask x m] (m <= block_size - 1)."""
        c = self.drafter.config
        assert 1 <= m < c.block_size, f"a block of {c.block_size} drafts 1..{c.block_size - 1} tokens, not {m}"
        device = self.drafter.device
        tokens = torch.tensor([pending] + [c.mask_token_id] * m, device=device)
        positions = torch.arange(self.length, self.length + m + 1, device=device)
        context = [(k[: self.length], v[: self.length]) for k, v in zip(self._k, self._v, strict=True)]
        return self.drafter.forward(self.ops, self.target, context, tokens, positions)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        # the reference shortens the block when fewer drafts are wanted (verify_size in dflash_generate),
        # so m drafts run a block of m + 1 positions
        m = min(k, self.drafter.config.block_size - 1)
        assert self.length == len(tokens) - 1, (
            f"observed {self.length} positions, the pending token is at {len(tokens) - 1}"
        )
        if m < 1 or self.length + m + 1 > self.drafter.max_positions:
            return []
        return self.ops.argmax(self.draft_logits(tokens[-1], m)).tolist()

    def end(self) -> None:
        self.length = 0  # context positions observed: 0..length-1
        self._k, self._v = self._buffers(64), self._buffers(64)  # per drafter layer, grown as observed


def check_fits(drafter: DFlashDrafter, target: Transformer) -> None:
    """Refuse a drafter trained for another target.

    Raises:
        UserError: another hidden size, a layer id outside the target, the target's last layer (the
            reference reads it after the final norm, which the target's capture does not give), a
            ``num_target_layers`` other than the target's, or a mask token outside the vocabulary.
    """
    c, t = drafter.config, target.config
    if c.model.hidden_size != t.hidden_size:
        raise UserError(f"the DFlash drafter has hidden size {c.model.hidden_size}, the target {t.hidden_size}")
    if c.num_target_layers is not None and c.num_target_layers != t.num_hidden_layers:
        raise UserError(
            f"the DFlash drafter was trained on a target of {c.num_target_layers} layers, "
            f"this one has {t.num_hidden_layers}"
        )
    if max(c.target_layer_ids) > t.num_hidden_layers - 2:
        raise UserError(
            f"DFlash target_layer_ids={list(c.target_layer_ids)}: the target's layers are 0..{t.num_hidden_layers - 1} "
            "and the last one is not supported (the reference reads it after the final norm)"
        )
    if not 0 <= c.mask_token_id < t.vocab_size:
        raise UserError(f"DFlash mask_token_id={c.mask_token_id} is outside the target's vocabulary of {t.vocab_size}")


def load_dflash(
    path_or_repo: str, target: Transformer, ops="reference", home: str | Path | None = None
) -> DFlashProposer:
    """A :class:`DFlashProposer` for ``target`` from a drafter folder or a Hugging Face repo id.

    ``path_or_repo``: an existing folder (config.json + model.safetensors, the published z-lab
    layout), else a repo id ``owner/name`` fetched with ``huggingface_hub.snapshot_download`` into
    ``HOME/drafters/owner--name`` (``home``: see :func:`tileinfer.core.fetch.tileinfer_home`). The
    drafter takes the target's dtype and device; its RoPE tables cover the target's positions.

    Raises:
        UserError: one line: no such folder, the hub unreachable or no such repo, a refused drafter
            (see :meth:`DFlashDrafter.load`), or a drafter that does not fit the target.
    """
    folder = Path(path_or_repo).expanduser()
    if not folder.exists():
        folder = _fetch(str(path_or_repo), home)
    drafter = DFlashDrafter.load(folder, target.dtype, target.device, max_positions=target.rope_cos.shape[0])
    return DFlashProposer(drafter, target, ops)


def _fetch(repo: str, home) -> Path:
    """Download a drafter repo's config and safetensors; a local-looking path that is missing is refused."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or repo.startswith((".", "~")):
        raise UserError(f"DFlash drafter folder {repo} does not exist (and it is not a Hugging Face repo id)")
    import huggingface_hub

    dest = tileinfer_home(home) / "drafters" / repo.replace("/", "--")
    try:
        return Path(huggingface_hub.snapshot_download(repo, local_dir=dest, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # noqa: BLE001 - network, auth, offline mode, missing repo: all the user's to fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"could not fetch DFlash drafter {repo} from the Hugging Face hub (not a local folder either): {first}"
        ) from None
