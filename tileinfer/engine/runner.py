"""Model runner: owns the model, the op backend and the paged KV cache, and runs steps.

A step is one forward pass over some tokens of one sequence: a prefill chunk (many tokens) or a
decode step (one token). Long prompts are prefilled in chunks of ``prefill_chunk`` tokens so the
activations and attention scores of a step stay bounded whatever the prompt length (chunked prefill,
as in vLLM and Sarathi-Serve). On a backend whose launch paths are capturable (its ``cuda_graphs``,
:class:`tileinfer.ops.Backend`), decode steps replay one captured CUDA graph, as vLLM and llama.cpp do, so decode
speed shows the kernels rather than Python's launch overhead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import BlockManager, PagedKVCache, Sequence
from tileinfer.core.progress import progress_bar
from tileinfer.models import Transformer
from tileinfer.ops import BACKENDS, get_backend

# Most tokens of a step replayed from a CUDA graph: the fast backends' attention runs steps of up to 16
# tokens on the split-KV decode kernels, which read every position from the device (capturable).
GRAPH_MAX_TOKENS = 16


def resolve_device(name: str, backend: str) -> torch.device:
    """``auto`` picks CUDA when present. Raises UserError for a GPU backend without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible")
    if backend not in ("reference", "auto") and name != "cuda":
        raise UserError(f"backend={backend} needs a CUDA GPU; use backend=reference on the CPU")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a job runs: ``name``, or for ``auto`` the fast path where there is one: Triton on
    CUDA (cuTile when Triton is not installed), the reference backend on the CPU."""
    if name != "auto":
        return name
    if device.type == "cuda":
        for fast in (b for b in BACKENDS if b != "reference"):  # in order of preference
            try:
                get_backend(fast)
                return fast
            except UserError:  # toolchain not installed
                continue
    return "reference"


def uses_cuda_graph(requested: bool, device: torch.device, ops) -> bool:
    """Whether decode replays a CUDA graph: requested, on CUDA, and the backend ``ops`` is capturable
    (its ``cuda_graphs``; an object of op functions without that attribute is not)."""
    return bool(requested and device.type == "cuda" and getattr(ops, "cuda_graphs", False))


class ModelRunner:
    """Runs a :class:`Transformer` on one backend with a paged KV cache.

    Args:
        model: the weights.
        backend: ``reference``, ``triton`` or ``cutile`` (a new :class:`tileinfer.ops.Backend`, held
            as ``self.ops``), a Backend, or an object with the op functions (e.g. the reference ops
            with one op wrapped to record activations).
        kv_int8: keep the KV cache in INT8 (one float32 scale per cached vector).
        max_seq_len: positions the cache must hold for one sequence (default: the model's
            context); the page pool is sized for one sequence of that length.
        page_size: positions per KV page.
        prefill_chunk: most tokens per prefill step.
        cuda_graph: replay decode steps from a captured CUDA graph when the device is CUDA and the
            backend is capturable (``Backend.cuda_graphs``); ignored otherwise.
            ``self.cuda_graph`` says whether it is in use.

    Raises:
        UserError: ``max_seq_len`` larger than the model's context.
    """

    def __init__(
        self,
        model: Transformer,
        backend="reference",
        kv_int8: bool = False,
        max_seq_len: int | None = None,
        page_size: int = 64,
        prefill_chunk: int = 512,
        cuda_graph: bool = False,
    ):
        c = model.config
        self.model = model
        self.ops = get_backend(backend) if isinstance(backend, str) else backend
        self.max_seq_len = max_seq_len or c.max_position_embeddings
        if self.max_seq_len > c.max_position_embeddings:
            raise UserError(f"{self.max_seq_len} positions exceed the model's context of {c.max_position_embeddings}")
        self.page_size, self.prefill_chunk = page_size, prefill_chunk
        self.max_pages = -(-self.max_seq_len // page_size)
        self.kv = PagedKVCache(
            c.num_hidden_layers,
            self.max_pages,
            page_size,
            c.num_key_value_heads,
            c.head_dim,
            model.dtype,
            kv_int8,
            model.device,
        )
        self.blocks = BlockManager(self.max_pages)
        self.cuda_graph = uses_cuda_graph(cuda_graph, self.device, self.ops)
        # by (tokens per step: 1 decode, k + 1 verify; whether the graph ends in the argmax)
        self._graphs: dict[tuple[int, bool], StepGraph] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_sequence(self) -> Sequence:
        """An empty sequence whose pages come from this runner's pool."""
        return Sequence(self.blocks, self.page_size, self.max_pages, self.device)

    def check_length(self, seq: Sequence, n: int) -> None:
        """Raise UserError when ``n`` more tokens would not fit the context (or sliding window)."""
        end = seq.length + n
        if end > self.max_seq_len:
            raise UserError(
                f"sequence of {end} tokens exceeds the runner's limit of {self.max_seq_len} "
                f"(model context {self.model.config.max_position_embeddings})"
            )
        window = self.model.config.sliding_window
        if window and end > window:
            raise UserError(
                f"sequence of {end} tokens exceeds the model's sliding window of {window}, "
                "which this engine does not implement"
            )

    def step(self, seq: Sequence, tokens: torch.Tensor, logit_rows=None, capture: tuple[int, ...] = ()):
        """One forward pass over ``tokens`` [T] appended to ``seq``; float32 logits [R, vocab], or
        ``(logits, hidden)`` when ``capture`` names layers (see :meth:`Transformer.forward`)."""
        T = tokens.shape[0]
        self.check_length(seq, T)
        seq.reserve(T)
        positions = torch.arange(seq.length, seq.length + T, dtype=torch.int32, device=self.device)
        out = self.model.forward(
            self.ops, tokens.to(self.device), positions, self.kv, seq.block_table_tensor, logit_rows, capture
        )
        seq.length += T
        return out

    def chunks(
        self, seq: Sequence, tokens, logits_from: int | None = None, progress: str | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Prefill ``tokens`` in chunks; yield ``(position, logits)`` for scored rows.

        Rows at sequence positions >= ``logits_from`` get logits; each chunk yields the position of
        its first scored row and float32 logits [rows, vocab] (chunks with none yield nothing).
        With ``logits_from=None`` only the last position of the last chunk gets logits.
        ``progress`` names a progress bar (tileinfer.core.progress), or None for none.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        self.check_length(seq, tokens.shape[0])
        n = tokens.shape[0]
        bar = progress_bar(n, progress)
        for start in range(0, n, self.prefill_chunk):
            chunk = tokens[start : start + self.prefill_chunk]
            first = seq.length
            if logits_from is None:
                rows = slice(-1, None) if start + chunk.shape[0] == n else slice(0, 0)
                row_pos = first + chunk.shape[0] - 1
            else:
                skip = min(max(logits_from - first, 0), chunk.shape[0])
                rows, row_pos = slice(skip, None), first + skip
            logits = self.step(seq, chunk, rows)
            bar.update(chunk.shape[0])
            if logits.shape[0]:
                yield row_pos, logits
        bar.close()

    def prefill(self, seq: Sequence, tokens, progress: str | None = None) -> torch.Tensor:
        """Prefill a prompt; float32 logits [vocab] of its last position."""
        out = None
        for _, logits in self.chunks(seq, tokens, progress=progress):
            out = logits[-1]
        return out

    def decode(self, seq: Sequence, token: int) -> torch.Tensor:
        """One decode step for ``token``; float32 logits [vocab] of the next position."""
        return self.verify(seq, [token])[0]

    def decode_greedy(self, seq: Sequence, token: int) -> int:
        """One decode step for ``token``; the greedy next token (see :meth:`verify_greedy`)."""
        return self.verify_greedy(seq, [token])[0]

    def verify(self, seq: Sequence, tokens: list[int]) -> torch.Tensor:
        """One step over a few ``tokens`` (a decode step, or speculative decoding's verify step of the
        pending token plus the drafts); float32 logits [len(tokens), vocab]. Replays the captured CUDA
        graph of that many tokens when the runner uses graphs (one graph per token count up to
        :data:`GRAPH_MAX_TOKENS`, captured on first use); attention then runs the split-KV decode
        kernels, which read positions on the device. Longer runs of tokens take an eager step."""
        return self._step_from_graph(seq, tokens, greedy=False)

    def verify_greedy(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """:meth:`verify`, returning the argmax of each row's logits (lowest id on ties) instead of the
        logits: the argmax runs inside the captured graph, so a step costs one host read of
        ``len(tokens)`` integers and no copy of the logits (greedy decoding, greedy verification)."""
        return self._step_from_graph(seq, tokens, greedy=True)

    def _step_from_graph(self, seq: Sequence, tokens: list[int], greedy: bool):
        T = len(tokens)
        if not self.cuda_graph or T > GRAPH_MAX_TOKENS:
            logits = self.step(seq, torch.tensor(tokens))
            return self.ops.argmax(logits).tolist() if greedy else logits
        self.check_length(seq, T)
        seq.reserve(T)
        if (T, greedy) not in self._graphs:
            self._graphs[T, greedy] = StepGraph(self, seq, tokens, greedy)
        out = self._graphs[T, greedy](seq, tokens)
        seq.length += T
        return out

    def synchronize(self) -> None:
        """Wait for queued device work (before reading a host clock)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class StepGraph:
    """One step of ``T`` tokens of a runner, captured once as a CUDA graph and replayed for any of its
    sequences (T = 1: a decode step; T = k + 1: a speculative verify step).

    The tokens, their positions and the sequence's block table are copied into static device buffers
    before each replay; the kernels read the context length from those buffers on the device, so one
    graph serves every position (the split-KV grid depends only on the block table's size). Built
    on the first use: one eager step on the static buffers compiles the kernels and writes that
    step's keys and values (the replay writes the same ones again), then the capture.
    Follows PyTorch's ``torch.cuda.graph`` recipe (warm-up on a side stream, then capture). With
    ``greedy`` the graph ends in the backend's argmax and a replay returns the tokens, not the logits.

    Raises:
        RuntimeError: an op of the backend is not capturable (a host sync or read inside a step).
    """

    def __init__(self, runner: ModelRunner, seq: Sequence, tokens: list[int], greedy: bool = False):
        dev, T = runner.device, len(tokens)
        self.greedy = greedy
        self.tokens = torch.zeros(T, dtype=torch.long, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int32, device=dev)
        self.offsets = torch.arange(T, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros_like(seq.block_table_tensor)
        self._load(seq, tokens)

        def forward() -> torch.Tensor:
            logits = runner.model.forward(runner.ops, self.tokens, self.positions, runner.kv, self.block_table)
            return runner.ops.argmax(logits) if greedy else logits

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = forward()

    def _load(self, seq: Sequence, tokens: list[int]) -> None:
        self.tokens.copy_(torch.tensor(tokens), non_blocking=True)
        torch.add(self.offsets, seq.length, out=self.positions)
        self.block_table.copy_(seq.block_table_tensor)

    def __call__(self, seq: Sequence, tokens: list[int]) -> torch.Tensor | list[int]:
        """Replay for ``tokens`` at positions ``seq.length ...``; float32 logits [T, vocab] (a copy:
        the graph's output buffer is rewritten by the next replay), or the T greedy tokens."""
        self._load(seq, tokens)
        self.graph.replay()
        return self.out.tolist() if self.greedy else self.out.clone()
