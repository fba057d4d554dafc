"""Paged KV cache: a pool of fixed-size pages, a block manager, and a block table per sequence.

The layout follows PagedAttention (Kwon et al., 2023, vLLM): keys and values of every layer live in
one pool of pages; a sequence owns a list of page ids (its block table), and position ``p`` of the
sequence is slot ``p % page_size`` of page ``block_table[p // page_size]``. Attention reads pages in
place through the block table, so a sequence never needs contiguous memory.

Per layer, a page holds ``[num_kv_heads, page_size, head_dim]`` so one (page, KV head) tile is
contiguous for the tile kernels. An INT8 cache stores int8 values plus one float32 scale per cached
vector (one KV head at one position): ``x ≈ q * scale`` with ``scale = max|x| / 127``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileinfer.core.errors import UserError


@dataclass
class KVLayer:
    """One layer's view of the page pool.

    Attributes:
        k, v: [num_pages, num_kv_heads, page_size, head_dim], the model dtype or int8.
        k_scale, v_scale: float32 [num_pages, num_kv_heads, page_size] for an INT8 cache, else None.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def int8(self) -> bool:
        return self.k_scale is not None


class PagedKVCache:
    """The page pool of all layers.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_pages: pages in the pool (shared by all sequences).
        page_size: positions per page.
        dtype: dtype of a BF16/float32 cache; ignored when ``int8`` is set.
        int8: store int8 values with one float32 scale per vector.
        device: where the pool lives.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        int8: bool = False,
        device="cpu",
    ):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        vdtype = torch.int8 if int8 else dtype
        # torch.empty: pages are written before they are read; tests poison them to prove it.
        self.k = torch.empty(shape, dtype=vdtype, device=device)
        self.v = torch.empty(shape, dtype=vdtype, device=device)
        self.k_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device) if int8 else None
        self.v_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device) if int8 else None
        self.layers = [
            KVLayer(self.k[i], self.v[i], self.k_scale[i] if int8 else None, self.v_scale[i] if int8 else None)
            for i in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool, scales included."""
        scales = 0 if self.k_scale is None else 2 * self.k_scale.numel() * 4
        return 2 * self.k.numel() * self.k.element_size() + scales

    def bytes_per_position(self) -> int:
        """Bytes one cached position takes over all layers and KV heads (keys + values + scales)."""
        return self.nbytes // (self.num_pages * self.page_size)

    def export(self, seq: "Sequence", length: int) -> dict[str, torch.Tensor]:
        """The pages holding positions [0, length) of ``seq`` as CPU tensors (a resume snapshot):
        ``k``/``v`` [layers, pages, kv_heads, page_size, head_dim] plus ``k_scale``/``v_scale``
        [layers, pages, kv_heads, page_size] for an INT8 cache. Slots past ``length`` in the last
        page are copied too and mean nothing."""
        idx = torch.tensor(seq.pages[: -(-length // self.page_size)], dtype=torch.long, device=self.k.device)
        names = ("k", "v") if self.k_scale is None else ("k", "v", "k_scale", "v_scale")
        return {n: getattr(self, n).index_select(1, idx).cpu() for n in names}

    def restore(self, seq: "Sequence", saved: dict[str, torch.Tensor], length: int) -> None:
        """Write :meth:`export`'s tensors back into freshly reserved pages of the empty ``seq`` and
        mark ``length`` positions cached.

        Raises:
            ValueError: tensors of another shape or dtype than this cache's (another model, page
                size or cache precision), or fewer pages than ``length`` positions need.
        """
        names = ("k", "v") if self.k_scale is None else ("k", "v", "k_scale", "v_scale")
        if set(saved) != set(names) or -(-length // self.page_size) != saved["k"].shape[1]:
            raise ValueError("snapshot of another KV cache layout")
        for n in names:
            mine = getattr(self, n)
            if saved[n].dtype != mine.dtype or (saved[n].shape[:1], saved[n].shape[2:]) != (
                mine.shape[:1],
                mine.shape[2:],
            ):
                raise ValueError(f"snapshot {n} {tuple(saved[n].shape)} {saved[n].dtype} does not fit this cache")
        seq.reserve(length)
        idx = torch.tensor(seq.pages, dtype=torch.long, device=self.k.device)
        for n in names:
            getattr(self, n).index_copy_(1, idx, saved[n].to(self.k.device))
        seq.length = length


class BlockManager:
    """Hands out and takes back pages of a pool of ``num_pages`` (free-list allocator)."""

    def __init__(self, num_pages: int):
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages.

        Raises:
            UserError: the pool has fewer than ``n`` free pages (the cache is sized too small).
        """
        if n > len(self._free):
            raise UserError(
                f"KV cache out of pages: need {n}, {len(self._free)} free; the pool holds "
                "the sequences the runner was sized for (max_seq_len): lower ctx"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class Sequence:
    """One sequence in the cache: its block table and how many positions are cached.

    ``block_table_tensor`` is a fixed-size int32 buffer on the cache's device (unused entries 0), so a
    step reads it without reallocation (needed for CUDA-graph capture).
    """

    def __init__(self, manager: BlockManager, page_size: int, max_pages: int, device="cpu"):
        self.manager, self.page_size = manager, page_size
        self.pages: list[int] = []
        self.length = 0
        self.block_table_tensor = torch.zeros(max_pages, dtype=torch.int32, device=device)

    def reserve(self, n_tokens: int) -> None:
        """Make room for ``n_tokens`` more positions, taking pages as needed.

        Raises:
            UserError: no free pages left, or the block table is full.
        """
        need = -(-(self.length + n_tokens) // self.page_size) - len(self.pages)
        if need <= 0:
            return
        if len(self.pages) + need > self.block_table_tensor.numel():
            raise UserError(
                f"sequence of {self.length + n_tokens} positions exceeds the block table "
                f"({self.block_table_tensor.numel()} pages of {self.page_size})"
            )
        new = self.manager.allocate(need)
        start = len(self.pages)
        self.pages.extend(new)
        self.block_table_tensor[start : start + need] = torch.tensor(new, dtype=torch.int32)

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (e.g. rejected draft tokens); pages are kept."""
        self.length = min(self.length, length)

    def release(self) -> None:
        """Give every page back to the block manager."""
        self.manager.free(self.pages)
        self.pages = []
        self.length = 0
        self.block_table_tensor.zero_()
