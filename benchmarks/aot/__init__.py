"""Ahead-of-time compilation of the kernels the models launch, for a GPU that need not be present.

    python -m benchmarks.aot --backend triton|cutile [--models a,b] [--jobs N] [--arch sm_90]
                             [--sms N] [--sass] [--filter NAME]

One enumeration serves both backends: :func:`model_calls` runs the real model code (one layer of
:class:`~tileinfer.models.Transformer`, then the lm_head and argmax) on ``meta`` tensors
(shapes and dtypes, no storage) for each model of the registry (``conf/model``, shapes from
:func:`tileinfer.core.registry.model_config`), each step of :data:`STEPS`, BF16 or INT8 weights, a
BF16 or INT8 KV cache, a short and a long cache (:data:`CONTEXTS`). A backend module turns the
launches into compilations: :mod:`.triton` compiles in place of each ``@triton.jit`` launch;
:mod:`.cutile` records the launches, predicts the specialization the JIT will infer for each
(:class:`~.cutile.KernelVariant`) and compiles it with ``cuda.tile.compilation.export_kernel``.
:func:`compile_calls` spreads the distinct kernels over processes; the op benchmark precompiles its
own cases through it too (``python -m benchmarks.ops --precompile N``).

On the CPU, compiling for sm_90 is the CI check that every kernel builds at every shipped shape
(tests/test_triton_compile.py, tests/test_cutile_compile.py). On the GPU, the compiled kernels
land in each backend's disk cache (Triton's ~/.triton/cache, cuTile's ``CUDA_TILE_CACHE_DIR``)
under the keys a real launch looks up, so the first launches do not compile. Grids are planned for
``--sms`` SMs (default ``tileinfer.ops.DEFAULT_SMS``, the H200's), passed to the backend's tuning:
for another GPU give its count, or some kernels (those taking it as a constant) compile for a count
its launches never use.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from benchmarks import qkv_out
from tileinfer.core.config import ModelConfig
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.core.registry import model_config
from tileinfer.models.transformer import Layer, Transformer
from tileinfer.ops import DEFAULT_SMS, Backend, Int8Weight

BACKENDS = ("triton", "cutile")
# (rows, logits of every row) of the steps the engine runs: decode (1 row); speculative verify (5,
# 16); prefill chunks, whose last row alone gets logits (512 = the runner's default prefill_chunk,
# 300 = a shorter last chunk); teacher-forced scored chunks, every row scored (127, 512, 1023: a
# 127-row Triton lm_head once needed more shared memory than sm_90 has).
STEPS = ((1, True), (5, True), (16, True), (127, True), (300, False), (512, False), (512, True), (1023, True))
# Positions of the KV cache (the block table's length): decode attention picks its tiles and split
# count by it (Triton: other tiles for INT8 caches of >= 16k positions), so a short and a long one.
CONTEXTS = (2048, 32768)
PAGE_SIZE = 64


@dataclass(frozen=True)
class Call:
    """Some op launches: ``run(ops)`` calls them through the :class:`~tileinfer.ops.Backend` ``ops`` on
    meta tensors."""

    label: str
    run: Callable[[Backend], object]


def meta_model(c: ModelConfig, int8_weights: bool) -> Transformer:
    """A :class:`Transformer` of ``c``'s shapes on the meta device (its layer count as ``c`` says).

    Weights are BF16, or :class:`Int8Weight` (int8 [out, in] + float32 [out] scales) for every
    linear layer and the lm_head when ``int8_weights`` (a tied lm_head is quantized apart from the
    embedding, as quantize/ does).
    """

    def w(out, inp):
        if int8_weights:
            return Int8Weight(
                torch.empty(out, inp, dtype=torch.int8, device="meta"),
                torch.empty(out, dtype=torch.float32, device="meta"),
            )
        return torch.empty(out, inp, dtype=torch.bfloat16, device="meta")

    def v(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    h, d, hid, inter = c.num_attention_heads, c.head_dim, c.hidden_size, c.intermediate_size
    qkv = qkv_out(c)
    layers = [
        Layer(
            input_norm=v(hid),
            qkv_proj=w(qkv, hid),
            qkv_bias=v(qkv) if c.attention_bias else None,
            q_norm=v(d) if c.qk_norm else None,
            k_norm=v(d) if c.qk_norm else None,
            o_proj=w(hid, h * d),
            post_norm=v(hid),
            gate_up_proj=w(2 * inter, hid),
            down_proj=w(hid, inter),
        )
        for _ in range(c.num_hidden_layers)
    ]
    embed = v(c.vocab_size, hid)
    lm_head = w(c.vocab_size, hid) if (int8_weights or not c.tie_word_embeddings) else embed
    return Transformer(c, embed, layers, v(hid), lm_head, max(CONTEXTS))


def _step(model: Transformer, context: int, rows: int, every_row: bool, int8_kv: bool, greedy: bool, ops) -> None:
    """One forward step of ``rows`` tokens through a cache of ``context`` positions (the logits of
    every row or of the last); then the argmax of the logits when ``greedy``."""
    c = model.config
    pages = context // PAGE_SIZE
    kv = PagedKVCache(
        c.num_hidden_layers, pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim, torch.bfloat16, int8_kv, "meta"
    )
    block_table = torch.empty(pages, dtype=torch.int32, device="meta")
    tokens = torch.empty(rows, dtype=torch.int64, device="meta")
    positions = torch.empty(rows, dtype=torch.int32, device="meta")
    logits = model.forward(ops, tokens, positions, kv, block_table, None if every_row else slice(-1, None))
    if greedy:
        ops.argmax(logits)


def model_calls(names: Sequence[str], steps=STEPS) -> list[Call]:
    """The launches of one layer of each model in ``names`` (registry names), plus lm_head and argmax:
    every step of ``steps`` with BF16 and INT8 weights, BF16 and INT8 KV caches, each cache length of
    :data:`CONTEXTS`. The argmax runs once per (model, step) of at most 16 rows (its logits are
    float32 whatever the weights and the cache)."""
    calls = []
    for name in names:
        c = model_config(name, num_hidden_layers=1)
        for int8_w in (False, True):
            model = meta_model(c, int8_w)
            for int8_kv in (False, True):
                for context in CONTEXTS:
                    for rows, every_row in steps:
                        greedy = rows <= 16 and not int8_w and not int8_kv and context == CONTEXTS[0]
                        label = (
                            f"{name} {rows} rows ({'every' if every_row else 'last'} row scored), "
                            f"{'int8' if int8_w else 'bf16'} weights, {'int8' if int8_kv else 'bf16'} "
                            f"KV of {context} positions"
                        )
                        calls.append(
                            Call(label, functools.partial(_step, model, context, rows, every_row, int8_kv, greedy))
                        )
    return calls


def run_calls(calls: Sequence[Call], ops: Backend) -> list[dict]:
    """Run every call through ``ops``; one failure record (see :func:`compile_calls`) per call that
    raised, so that one bad shape does not hide the others."""
    failed = []
    for call in calls:
        try:
            call.run(ops)
        except Exception as e:
            failed.append(
                dict(kernel=call.label, variant="", seconds=0.0, cubin_bytes=0, error=f"{type(e).__name__}: {e}"[:4000])
            )
    return failed


def _compile_share(
    backend: str,
    make_calls: Callable[..., list[Call]],
    args: tuple,
    arch: str,
    share: tuple[int, int],
    sass: bool,
    sms: int,
) -> list[dict]:
    module = importlib.import_module(f"benchmarks.aot.{backend}")
    return module.compile_share(make_calls(*args), arch, share, sass, sms)


def compile_calls(
    backend: str,
    make_calls: Callable[..., list[Call]],
    args: tuple = (),
    arch: str = "sm_90",
    jobs: int = 1,
    sass: bool = False,
    sms: int = DEFAULT_SMS,
) -> list[dict]:
    """Compile for ``arch`` every distinct kernel the calls ``make_calls(*args)`` launch, their grids
    planned for ``sms`` SMs (the target GPU's count: some kernels take it as a constant, e.g. the
    persistent Triton GEMM's program stride, so a compile for another count is another kernel).

    ``jobs`` processes (spawned: the parent may hold a CUDA context) each enumerate the calls and
    compile every ``jobs``-th distinct kernel, in first-launch order. ``make_calls`` must be a
    module-level function and ``args`` picklable. Returns one record per compiled kernel: kernel
    (name), variant (its constants), seconds, cubin_bytes, error (None, or the message); with
    ``sass``, the counts of :func:`cubin_resources` too. Calls that raised give records with the
    call's label as kernel.
    """
    if jobs <= 1:
        return _compile_share(backend, make_calls, args, arch, (0, 1), sass, sms)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        parts = [
            pool.submit(_compile_share, backend, make_calls, args, arch, (k, jobs), sass, sms) for k in range(jobs)
        ]
        return [r for part in parts for r in part.result()]


SASS_OPS = ("HGMMA", "HMMA", "I2F", "F2FP", "LDG.E.128", "LDGSTS", "UTMALDG", "LDL", "STL", "MUFU.EX2")


def cubin_resources(cubin: bytes) -> dict:
    """Registers per thread, stack bytes (spills), static shared memory bytes, and the count of each
    SASS instruction of ``SASS_OPS`` in a cubin, from the cuobjdump shipped with Triton."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    out = {}
    if m := re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res):
        out.update(regs=int(m[1]), stack=int(m[2]), smem=int(m[3]))
    for op in SASS_OPS:
        out[op] = len(re.findall(r"\b" + re.escape(op) + r"\b", sass))
    return out
