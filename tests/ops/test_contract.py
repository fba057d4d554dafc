"""The backend contract (tileinfer.ops): every op of ``OPS`` present, and one fallback policy.

``get_backend`` returns a new Backend each time and refuses a module that lacks an op. Each input
outside a fast backend's kernels (the table below, one entry per fallback site and cause) returns
exactly the reference op's result and records one "backend.op: reason" entry in that Backend; the
reference itself never records one on the same inputs; an input the reference rejects too is an
error, not a fallback.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

import tileinfer.ops as ops_pkg
from tests.numerics import same_bits
from tileinfer.core.errors import UserError
from tileinfer.core.kv_cache import KVLayer, PagedKVCache
from tileinfer.ops import OPS, Backend, Int8Weight, Unsupported, get_backend
from tileinfer.ops import reference as R

# ---------------------------------------------------------------------------- get_backend


def test_get_backend_returns_a_new_backend_with_every_op():
    for name in ops_pkg.BACKENDS:
        try:
            backend = get_backend(name)
        except UserError:  # a toolchain this machine lacks (cuda.tile, triton)
            continue
        assert isinstance(backend, Backend) and backend.name == name
        assert all(callable(getattr(backend, op)) for op in OPS), name
        assert backend.cuda_graphs == (name != "reference")
        assert backend.fallbacks() == []
        other = get_backend(name)
        assert other is not backend and other.workspace is not backend.workspace


def test_a_module_without_every_op_is_refused():
    fake = types.ModuleType("fake_backend")
    for op in OPS:
        setattr(fake, op, getattr(R, op))
    del fake.attention
    fake.argmax = "not a function"
    with pytest.raises(NotImplementedError, match=r"'fake'.* lacks the ops attention, argmax"):
        Backend("fake", fake, R)


def test_get_backend_unknown_or_unavailable_is_a_user_error(monkeypatch):
    with pytest.raises(UserError, match="unknown backend"):
        get_backend("cuda")
    monkeypatch.setitem(sys.modules, "tileinfer.ops.cutile", None)  # its import fails as without cuda.tile
    with pytest.raises(UserError, match="not available here"):
        get_backend("cutile")


# ---------------------------------------------------------------------------- the record


def _refusing(**reasons) -> types.ModuleType:
    """A backend module whose ops are the reference's, except that the ops named in ``reasons``
    raise Unsupported(reason) (and take a ``tile`` keyword the reference does not have)."""
    fake = types.ModuleType("fake_backend")
    for op in OPS:
        setattr(fake, op, getattr(R, op))
    for op, reason in reasons.items():

        def refuse(*args, tile=None, reason=reason):
            raise Unsupported(reason)

        setattr(fake, op, refuse)
    return fake


def test_a_fallback_runs_the_reference_and_is_recorded_and_logged_once_per_entry(caplog):
    fake = _refusing(rms_norm="rows of 9000 > 8192 values", argmax="logits rows not contiguous")
    backend = Backend("cutile", fake, R)
    x, w = torch.randn(3, 16), torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="tileinfer.ops"):
        for _ in range(2):  # the op's own keyword is not passed on to the reference
            assert torch.equal(backend.rms_norm(x, w, 1e-6, tile=(1, 2)), R.rms_norm(x, w, 1e-6))
        assert torch.equal(backend.argmax(x), R.argmax(x))
    assert backend.fallbacks() == [
        "cutile.argmax: logits rows not contiguous",
        "cutile.rms_norm: rows of 9000 > 8192 values",
    ]
    assert [r.getMessage().count("cutile.rms_norm") for r in caplog.records] == [1, 0]
    # another instance keeps its own record, and logs its first entry again
    other = Backend("cutile", fake, R)
    assert other.fallbacks() == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tileinfer.ops"):
        other.rms_norm(x, w, 1e-6)
    assert other.fallbacks() == ["cutile.rms_norm: rows of 9000 > 8192 values"] and len(caplog.records) == 1
    backend.reset_fallbacks()
    assert backend.fallbacks() == [] and other.fallbacks() != []


# ---------------------------------------------------------------------------- each fallback site


def _pool(pages, page, kvh, d, dtype=torch.float32, int8=False, device="cpu") -> KVLayer:
    """A one-layer pool of random contents (every slot readable)."""
    kv = PagedKVCache(1, pages, page, kvh, d, dtype, int8=int8, device=device)
    if int8:
        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
        kv.k_scale.uniform_(0.01, 0.1), kv.v_scale.uniform_(0.01, 0.1)
    else:
        kv.k.normal_(), kv.v.normal_()
    return kv.layers[0]


def _attention(d=32, page=16, pos_dtype=torch.int32, layer=None):
    def make(dev):
        lay = layer(dev) if layer else _pool(4, page, 2, d, device=dev)
        q = torch.randn(3, 4, d, device=dev)
        pos = torch.tensor([2, 17, 30], dtype=pos_dtype, device=dev)
        return "attention", (q, lay, torch.randperm(4, device=dev).to(torch.int32), pos, d**-0.5)

    return make


def _rope_kv(d=32, q_norm=(), k_norm=(), pos_dtype=torch.int32):
    """``q_norm``/``k_norm``: weight shapes (``()``: none); a ``"t"`` first marks a transposed one."""

    def weight(shape, dev):
        if not shape:
            return None
        if shape[0] == "t":
            return torch.randn(*reversed(shape[1:]), device=dev).t()
        return torch.randn(*shape, device=dev)

    def make(dev):
        T = 3
        q, k, v = torch.randn(T, 4, d, device=dev), torch.randn(T, 2, d, device=dev), torch.randn(T, 2, d, device=dev)
        ang = torch.rand(64, d // 2, device=dev)
        pos = torch.tensor([5, 6, 7], dtype=pos_dtype, device=dev)
        return "qk_norm_rope_kv_write", (
            q,
            k,
            v,
            weight(q_norm, dev),
            weight(k_norm, dev),
            1e-6,
            ang.cos(),
            ang.sin(),
            _pool(3, 16, 2, d, device=dev),
            torch.randperm(3, device=dev).to(torch.int32),
            pos,
        )

    return make


def _matmul(op, x_shape=(3, 64), w_shape=(72, 64), w_t=False, bias_step=0, int8=False, q_cols=None):
    """x [x_shape] @ w.T; ``w_t``: the weight a transposed view; ``bias_step``: a bias of that
    stride; ``q_cols``: an INT8 weight whose rows are the first ``q_cols`` of wider ones."""

    def make(dev):
        x = torch.randn(*x_shape, device=dev)
        if int8:
            n, k = w_shape
            q = torch.randint(-127, 128, (n, q_cols or k), dtype=torch.int8, device=dev)[:, :k]
            w = Int8Weight(q, torch.rand(n, device=dev) * 0.01)
        else:
            w = torch.randn(*reversed(w_shape), device=dev).t() if w_t else torch.randn(*w_shape, device=dev)
        if op != "linear":
            return op, (x, w)
        bias = torch.randn(w_shape[0] * bias_step, device=dev)[::bias_step] if bias_step else None
        return op, (x, w, bias)

    return make


def _norm(op, x_shape, w_shape, strided=False):
    def make(dev):
        x = torch.randn(*x_shape, device=dev)
        if strided:  # the same shape, every other column of a wider tensor
            x = torch.randn(x_shape[0], x_shape[1] * 2, device=dev)[:, ::2]
        w = torch.randn(*w_shape, device=dev)
        if op == "add_rms_norm":
            return op, (x, torch.randn(*x.shape, device=dev), w, 1e-6)
        return op, (x, w, 1e-6)

    return make


def _embedding(dev):
    return "embedding", (torch.randint(0, 50, (9,), device=dev), torch.randn(72, 50, device=dev).t())


def _argmax(dev):
    return "argmax", (torch.randn(1000, 3, device=dev).t(),)


HEAD_DIM_24 = "head_dim 24 is not a power of two"
X_3D = "x is 3-D, not [T, in]"
# case: (inputs, {backend: the reason it records}); a backend not named takes the case in its kernels
FALLBACK_CASES = {
    "embedding-strided-table": (_embedding, {"triton": "table rows not contiguous"}),
    "rms_norm-strided-rows": (_norm("rms_norm", (7, 96), (96,), strided=True), {"triton": "rows not contiguous"}),
    "add_rms_norm-strided-rows": (
        _norm("add_rms_norm", (7, 96), (96,), strided=True),
        {"triton": "rows not contiguous"},
    ),
    "rms_norm-broadcast-weight": (
        _norm("rms_norm", (5, 3, 32), (5, 1, 32)),
        {"cutile": "weight (5, 1, 32) is neither [n] nor [heads, n]"},
    ),
    "rms_norm-wide-rows": (_norm("rms_norm", (2, 8200), (8200,)), {"cutile": "rows of 8200 > 8192 values"}),
    "add_rms_norm-two-row-weight": (_norm("add_rms_norm", (2, 32), (2, 32)), {"cutile": "weight (2, 32) is not [n]"}),
    "add_rms_norm-wide-rows": (_norm("add_rms_norm", (2, 8200), (8200,)), {"cutile": "rows of 8200 > 8192 values"}),
    "linear-3d": (_matmul("linear", x_shape=(2, 3, 64)), {"triton": X_3D, "cutile": X_3D}),
    "swiglu-3d": (_matmul("swiglu", x_shape=(2, 3, 64)), {"triton": X_3D, "cutile": X_3D}),
    "lm_head-3d": (_matmul("lm_head", x_shape=(2, 3, 64)), {"triton": X_3D, "cutile": X_3D}),
    "linear-strided-weight": (_matmul("linear", w_t=True), {"triton": "weight rows not contiguous"}),
    "swiglu-strided-weight": (_matmul("swiglu", w_t=True), {"triton": "weight rows not contiguous"}),
    "lm_head-strided-weight": (_matmul("lm_head", w_t=True), {"triton": "weight rows not contiguous"}),
    "linear-strided-bias": (_matmul("linear", bias_step=2), {"triton": "bias not contiguous"}),
    "linear-int8-gemv-odd-k": (
        _matmul("linear", x_shape=(1, 6), w_shape=(32800, 6), int8=True),
        {"triton": "INT8 weight not contiguous in whole int32 words"},
    ),
    "linear-int8-prefill-strided": (
        _matmul("linear", x_shape=(512, 64), int8=True, q_cols=128),
        {"triton": "INT8 weight not contiguous"},
    ),
    "rope_kv-head_dim-24": (_rope_kv(d=24), {"triton": HEAD_DIM_24, "cutile": HEAD_DIM_24 + " >= 16"}),
    "rope_kv-per-token-norm": (
        _rope_kv(q_norm=(3, 4, 32), k_norm=(3, 2, 32)),
        {
            "triton": "q/k norm weights (3, 4, 32) / (3, 2, 32) are not [d] or contiguous [heads, d]",
            "cutile": "q/k norm weights (3, 4, 32) / (3, 2, 32) are not [d] or [heads, d]",
        },
    ),
    "rope_kv-strided-norm": (
        _rope_kv(q_norm=("t", 4, 32), k_norm=("t", 2, 32)),
        {"triton": "q/k norm weights (4, 32) / (2, 32) are not [d] or contiguous [heads, d]"},
    ),
    "rope_kv-int64-positions": (
        _rope_kv(pos_dtype=torch.int64),
        {"cutile": "positions torch.int64 and block table torch.int32, not both int32"},
    ),
    "attention-head_dim-24": (_attention(d=24), {"triton": HEAD_DIM_24 + " >= 16", "cutile": HEAD_DIM_24 + " >= 16"}),
    "attention-head_dim-8": (
        _attention(d=8),
        {"triton": "head_dim 8 is not a power of two >= 16", "cutile": "head_dim 8 is not a power of two >= 16"},
    ),
    "attention-page-8": (_attention(page=8), {"cutile": "page size 8 is not a power of two >= 16"}),
    "attention-int64-positions": (
        _attention(pos_dtype=torch.int64),
        {"cutile": "positions torch.int64 and block table torch.int32, not both int32"},
    ),
    "attention-kv-layouts-differ": (
        _attention(
            layer=lambda dev: KVLayer(
                torch.randn(4, 2, 16, 32, device=dev), torch.randn(4, 16, 2, 32, device=dev).transpose(1, 2)
            )
        ),
        {"triton": "K and V pages of different layouts"},
    ),
    "argmax-strided-rows": (_argmax, {"triton": "logits rows not contiguous"}),
}


def _cases(backend: str) -> list[str]:
    return [name for name, (_, reasons) in FALLBACK_CASES.items() if backend in reasons]


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, KVLayer):
        return KVLayer(*(None if t is None else t.clone() for t in (a.k, a.v, a.k_scale, a.v_scale)))
    if isinstance(a, Int8Weight):
        return Int8Weight(a.q.clone(), a.scale.clone())
    return a


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, KVLayer):
        return all(
            _equal(x, y)
            for x, y in ((a.k, b.k), (a.v, b.v), (a.k_scale, b.k_scale), (a.v_scale, b.v_scale))
            if x is not None
        )
    return a.shape == b.shape and a.dtype == b.dtype and bool(same_bits(a, b).all())


@pytest.mark.cases(
    "case",
    targets=("reference", "triton-interpret", "triton", "cutile"),
    small={"reference": list(FALLBACK_CASES), "triton-interpret": _cases("triton")},
    model={"triton": _cases("triton"), "cutile": _cases("cutile")},
)
def test_fallback_returns_the_reference_result_and_records_why(target, case, fallback_expected):
    make, reasons = FALLBACK_CASES[case]
    op, args = make(target.device)
    ref_args = tuple(_clone(a) for a in args)
    got = getattr(target.ops, op)(*args)
    want = getattr(R, op)(*ref_args)
    assert _equal(got, want), "not the reference op's result"
    for a, b in zip(args, ref_args, strict=True):
        if isinstance(a, KVLayer):
            assert _equal(a, b), "not the reference op's cache writes"
    expected = [] if target.name == "reference" else [f"{target.backend}.{op}: {reasons[target.backend]}"]
    assert target.ops.fallbacks() == expected


@pytest.mark.cases(targets=("reference", "triton-interpret", "triton", "cutile"), small=[()], model=[()])
def test_inputs_the_reference_rejects_are_errors(target):
    """Query heads that are not a multiple of the KV heads, x and a weight of different widths: the
    fast backends raise ValueError (torch's RuntimeError in the reference), and record nothing."""
    dev = target.device
    error = RuntimeError if target.name == "reference" else ValueError
    layer = _pool(2, 16, 2, 32, device=dev)
    bt, pos = torch.arange(2, dtype=torch.int32, device=dev), torch.tensor([4], dtype=torch.int32, device=dev)
    with pytest.raises(error):
        target.ops.attention(torch.randn(1, 3, 32, device=dev), layer, bt, pos, 0.2)
    with pytest.raises(error):
        target.ops.linear(torch.randn(2, 64, device=dev), torch.randn(72, 48, device=dev))
