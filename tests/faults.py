"""Small, realistic kernel bugs planted in copies of the reference ops, to show the gate catches them.

Each function returns an ops namespace: the reference backend with one op replaced. The runner
accepts such an object as its backend.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tileinfer.ops import OPS
from tileinfer.ops import reference as ref


def patched(**ops) -> SimpleNamespace:
    return SimpleNamespace(**({name: getattr(ref, name) for name in OPS} | ops))


def rope_key_off_by_one() -> SimpleNamespace:
    """Keys rotated with the angle of the next position (queries right): a wrong index in the KV
    write. (Shifting queries and keys together would be harmless: RoPE only sees p - j.)"""

    def qk_norm_rope_kv_write(q, k, v, q_norm, k_norm, eps, cos, sin, layer, block_table, positions):
        if q_norm is not None:
            q, k = ref.rms_norm(q, q_norm, eps), ref.rms_norm(k, k_norm, eps)
        p = positions.long()
        q = ref.rope(q, cos[p], sin[p])
        k = ref.rope(k, cos[p + 1], sin[p + 1])
        ref.write_kv(layer, k, v, block_table, positions)
        return q

    return patched(qk_norm_rope_kv_write=qk_norm_rope_kv_write)


def wrong_value_scale(factor: float, head: int = 0) -> SimpleNamespace:
    """INT8 cache: the value scale of one KV head stored ``factor`` times too large, in every layer."""

    def write_kv_then_skew(q, k, v, q_norm, k_norm, eps, cos, sin, layer, block_table, positions):
        out = ref.qk_norm_rope_kv_write(q, k, v, q_norm, k_norm, eps, cos, sin, layer, block_table, positions)
        pos = positions.long()
        pages = block_table.long()[pos // layer.page_size]
        layer.v_scale[pages, head, pos % layer.page_size] *= factor
        return out

    return patched(qk_norm_rope_kv_write=write_kv_then_skew)


def bf16_gemm_accumulator(block: int = 16) -> SimpleNamespace:
    """Linear layers that accumulate over the input features in BF16: each ``block``-wide slice's
    product is float32, but the running sum is rounded to BF16 after every slice (a GEMV kernel whose
    accumulator dtype follows its inputs instead of being float32)."""

    def linear(x, w, bias=None):
        if not isinstance(w, torch.Tensor):
            return ref.linear(x, w, bias)
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        for k in range(0, x.shape[1], block):
            acc = (acc.float() + F.linear(x[:, k : k + block].float(), w[:, k : k + block].float())).to(torch.bfloat16)
        y = acc.to(x.dtype)
        return y if bias is None else y + bias

    return patched(linear=linear)


def dropped_last_page() -> SimpleNamespace:
    """Attention reads floor(length / page_size) pages instead of the ceiling: the partly filled
    last page (where the newest keys are) is skipped."""

    def attention(q, layer, block_table, positions, sm_scale):
        length = int(positions.max()) + 1
        full_pages = length // layer.page_size * layer.page_size
        if full_pages == length or full_pages == 0:
            return ref.attention(q, layer, block_table, positions, sm_scale)
        visible = torch.clamp(positions, max=full_pages - 1)
        return ref.attention(q, layer, block_table, visible, sm_scale)

    return patched(attention=attention)


def reordered_linear_sum() -> SimpleNamespace:
    """Harmless: each linear layer accumulates in float32 over the two halves of its inputs, second
    half first (a valid split-K order), then rounds once, as a new GEMM kernel might."""

    def linear(x, w, bias=None):
        if not isinstance(w, torch.Tensor):
            return ref.linear(x, w, bias)
        h = x.shape[-1] // 2
        xf, wf = x.float(), w.float()
        y = (F.linear(xf[:, h:], wf[:, h:]) + F.linear(xf[:, :h], wf[:, :h])).to(x.dtype)
        return y if bias is None else y + bias

    return patched(linear=linear)
