"""Inputs, shapes and comparisons shared by the op conformance suites (tests/ops/).

Comparisons: :func:`close` (shape, dtype, every element written and finite, relative error in
norm), :func:`same_bits`, :func:`filtered` (the distribution the reference sampler draws from).
Inputs: :func:`q8` (an INT8 weight), :func:`poisoned_cache` / :func:`filled_cache` (paged KV pools
whose unwritten slots are poison, pages scattered), :func:`clone_cache`. Shapes: :data:`MODELS`
(tileinfer.core.registry, the conf/model names) and :data:`ATTN_SHAPES` (those plus synthetic GQA
ratios 1 and 8).
"""

from __future__ import annotations

import torch

from tileinfer.core.config import ModelConfig
from tileinfer.core.kv_cache import PagedKVCache
from tileinfer.core.registry import model_config, shaped_models
from tileinfer.ops import Int8Weight
from tileinfer.ops import reference as R

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# Relative error in norm allowed for an op's output in its dtype against the reference.
# float32 (interpreter cases only): summation order; measured 2026-12-01 (CPU, seed 0) 8e-8 (norms,
# RoPE) to 3.2e-7 (attention), swiglu 4.8e-7 against 2 x TOL. bf16: about two roundings of the
# output (one is up to 2**-9 relative), wide on purpose: the same bound holds the GPU targets, whose
# tensor-core kernels round other intermediates (attention's probabilities, split-K partial sums) to
# bf16 and accumulate in another order; the interpreter runs the reference's float32 arithmetic and
# measures 0 to 4e-5 (attention), so on the CPU it only catches gross faults: the exact points are
# pinned by the bitwise INT8 write, the loud-value attention reads and the float32 cases.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}

# ---------------------------------------------------------------------------- shapes

MODELS: dict[str, ModelConfig] = {name: model_config(name) for name in shaped_models()}
# (heads, kv_heads, head_dim) of every registered model, plus synthetic GQA ratios 1 and 8
ATTN_SHAPES: dict[str, tuple[int, int, int]] = {
    name: (c.num_attention_heads, c.num_key_value_heads, c.head_dim) for name, c in MODELS.items()
} | {"gqa1-h8": (8, 8, 128), "gqa8-h32": (32, 4, 128), "gqa8-h64": (64, 8, 128)}


def qkv_out(c: ModelConfig) -> int:
    """Output features of the fused q/k/v projection."""
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim


# ---------------------------------------------------------------------------- comparisons


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; fails on NaN (an element no kernel wrote) or inf in ``a``."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "unwritten (NaN) or non-finite output"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def close(out: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    """Assert ``out`` has ``want``'s shape and dtype, no NaN/inf, and ``rel(out, want) < tol``."""
    assert out.shape == want.shape, (what, out.shape, want.shape)
    assert out.dtype == want.dtype, (what, out.dtype, want.dtype)
    e = rel(out, want)
    assert e < tol, f"{what}: relative error {e:.3g} >= {tol}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality that counts NaN (poison) equal to NaN."""
    if a.is_floating_point():
        return (a == b) | (torch.isnan(a) & torch.isnan(b))
    return a == b


def filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The reference sampler's filtering (temperature, then top-k, then top-p) of logits [..., vocab]:
    ``(keep, probs)``, the kept tokens (bool) and the float32 distribution a sampler must draw from."""
    x = logits.float() / max(temperature, 1e-6)
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        s, order = x.sort(dim=-1, descending=True)
        drop = s.softmax(-1).cumsum(-1) - s.softmax(-1) >= top_p
        x = torch.full_like(x, float("-inf")).scatter(-1, order, s.masked_fill(drop, float("-inf")))
    return x > float("-inf"), x.softmax(-1)


def chi2_bins(probs: torch.Tensor, min_expected: float, n: int) -> list[torch.Tensor]:
    """Token bins for a chi-square test of ``n`` draws from ``probs`` [vocab]: each token with an
    expected count >= ``min_expected`` alone, the others pooled from the least likely up until a bin
    reaches it (a last short bin joins the one before)."""
    order = probs.double().argsort(descending=True)
    bins, cur, mass = [], [], 0.0
    for t in order[probs[order] > 0].tolist():
        cur.append(t)
        mass += float(probs[t])
        if mass * n >= min_expected:
            bins.append(torch.tensor(cur)), cur.clear()
            mass = 0.0
    if cur:
        if bins:
            bins[-1] = torch.cat([bins[-1], torch.tensor(cur)])
        else:
            bins.append(torch.tensor(cur))
    return bins


def chi2_test(tokens: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4, alternatives=()) -> float:
    """Pearson's chi-square goodness of fit of draws ``tokens`` [n] to ``probs`` [vocab] (every
    expected count >= 5); fails when its p-value < ``alpha``. ``alternatives`` (distributions a buggy
    sampler would draw from) must each be rejected with probability >= 0.999 at this n (the test's
    power, from the noncentral chi-square), so a pass means something. Returns the p-value."""
    from scipy import stats

    n = tokens.numel()
    bins = chi2_bins(probs, 5.0, n)
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    p64 = probs.double().cpu()
    obs = torch.stack([counts[b].sum() for b in bins]).numpy()
    exp = torch.stack([p64[b].sum() for b in bins]).numpy() * n
    df = len(bins) - 1
    crit = stats.chi2.isf(alpha, df) if df else 0.0
    for alt in alternatives:
        a = alt.double().cpu()
        lam = n * sum(float((a[b].sum() - p64[b].sum()) ** 2 / p64[b].sum()) for b in bins)
        power = stats.ncx2.sf(crit, df, lam) if df else 1.0
        assert power >= 0.999, f"the test cannot tell this alternative apart (power {power:.3f})"
    p = float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue) if df else 1.0
    assert p >= alpha, f"draws do not follow the distribution: chi-square p = {p:.2g} over {df + 1} bins"
    return p


# ---------------------------------------------------------------------------- inputs


def q8(w: torch.Tensor) -> Int8Weight:
    """``w`` [out, in] as an INT8 weight (``reference.quantize_int8`` per output channel)."""
    q, s = R.quantize_int8(w.float())
    return Int8Weight(q, s)


def poisoned_cache(n_pages: int, page: int, kv_heads: int, d: int, dtype, int8: bool, device) -> PagedKVCache:
    """A one-layer page pool whose every slot is poison: NaN values (or random int8 codes and NaN
    scales), so a read of a slot nobody wrote yields NaN."""
    kv = PagedKVCache(1, n_pages, page, kv_heads, d, dtype, int8=int8, device=device)
    if int8:
        kv.k.random_(-127, 128), kv.v.random_(-127, 128)
        kv.k_scale.fill_(float("nan")), kv.v_scale.fill_(float("nan"))
    else:
        kv.k.fill_(float("nan")), kv.v.fill_(float("nan"))
    return kv


def filled_cache(
    L: int, page: int, kv_heads: int, d: int, dtype, int8: bool, device, written: int | None = None, spare: int = 3
):
    """A poisoned pool of ``ceil(L / page) + spare`` pages for a sequence of L positions, of which
    0..written-1 (default all L) hold random k and v written by ``reference.write_kv`` (the last
    page partly filled); the block table lists one page more than the sequence needs, all
    shuffled through the pool.

    Returns (pool, its layer, block table int32 [ceil(L / page) + 1]).
    """
    n = -(-L // page)
    written = L if written is None else written
    kv = poisoned_cache(n + spare, page, kv_heads, d, dtype, int8, device)
    bt = torch.randperm(n + spare, device=device)[: n + 1].to(torch.int32)
    k = torch.randn(written, kv_heads, d, device=device).to(dtype)
    v = torch.randn(written, kv_heads, d, device=device).to(dtype)
    R.write_kv(kv.layers[0], k, v, bt, torch.arange(written, device=device))
    return kv, kv.layers[0], bt


def clone_cache(kv: PagedKVCache) -> PagedKVCache:
    """A pool with the same contents, poison included, bit for bit."""
    c = PagedKVCache(
        1,
        kv.num_pages,
        kv.page_size,
        kv.k.shape[2],
        kv.k.shape[4],
        kv.k.dtype,
        int8=kv.k_scale is not None,
        device=kv.k.device,
    )
    for a, b in ((c.k, kv.k), (c.v, kv.v), (c.k_scale, kv.k_scale), (c.v_scale, kv.v_scale)):
        if a is not None:
            a.copy_(b)
    return c
