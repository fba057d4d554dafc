"""A decode step's ops captured once in a CUDA graph replay correctly as the context grows (GPU).

The runner replays decode steps from one graph, so no op may read a device value on the host,
branch on one, or allocate outside the graph's pool: the context length reaches the kernels only
through ``positions``, updated in place on the device. Two steps at Qwen3-0.6B's shapes (pages of
64): one through the projections, the prologue, attention, an INT8 o-projection, the logits,
argmax and sampling (positions 250 to 299 of a 300-position cache); one through RMSNorm, the
prologue, split-KV attention, the o-projection and argmax with a fresh input each replay (at 705
and 740 of 764 positions, RoPE tables from the model's config).
"""

from __future__ import annotations

import pytest
import torch

from tests.numerics import MODELS, clone_cache, close, filled_cache, q8, qkv_out
from tileinfer.ops import reference as R
from tileinfer.ops.rope import rope_tables

C = MODELS["qwen3-0.6b-random"]
BF = torch.bfloat16


@pytest.mark.cases(model=[()])
def test_decode_step_with_sampling_replays_from_a_cuda_graph(target):
    H, KVH, d = C.num_attention_heads, C.num_key_value_heads, C.head_dim
    kv, layer, bt = filled_cache(300, 64, KVH, d, BF, False, "cuda")
    x = torch.randn(1, C.hidden_size, device="cuda").to(BF)
    w_qkv = (torch.randn(qkv_out(C), C.hidden_size, device="cuda") * 0.03).to(BF)
    w_o = q8((torch.randn(C.hidden_size, H * d, device="cuda") * 0.03).to(BF))
    w_head = (torch.randn(C.vocab_size, C.hidden_size, device="cuda") * 0.03).to(BF)
    norm = torch.randn(d, device="cuda").to(BF)
    ang = torch.rand(400, d // 2, device="cuda")
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([250], dtype=torch.int32, device="cuda")

    def step(ops, lay):
        q, k, v = ops.linear(x, w_qkv).split([H * d, KVH * d, KVH * d], dim=-1)
        q = ops.qk_norm_rope_kv_write(
            q.view(1, H, d), k.view(1, KVH, d), v.view(1, KVH, d), norm, norm, 1e-6, cos, sin, lay, bt, pos
        )
        o = ops.linear(ops.attention(q, lay, bt, pos, d**-0.5).reshape(1, -1), w_o)
        logits = ops.lm_head(o, w_head)
        return logits, ops.argmax(logits)

    step(target.ops, layer)  # compile, allocate workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(target.ops, layer)
    for p in (250, 251, 299):
        pos.fill_(p)
        ref_kv = clone_cache(kv)  # the cache as the replay finds it
        graph.replay()
        torch.cuda.synchronize()
        ref_logits, ref_tok = step(R, ref_kv.layers[0])
        close(out[0], ref_logits, 2e-2, f"logits at position {p}")
        assert torch.equal(out[1], ref_tok) or ref_logits[0, out[1]] >= ref_logits.max() - 1e-2


@pytest.mark.cases(model=[()])
def test_decode_step_with_fresh_inputs_replays_from_a_cuda_graph(target):
    H, KVH, d, hidden = C.num_attention_heads, C.num_key_value_heads, C.head_dim, C.hidden_size
    ctx0 = 700
    kv, layer, bt = filled_cache(ctx0 + 64, 64, KVH, d, BF, False, "cuda")
    cos, sin = rope_tables(C, 4096, "cuda")
    w_norm, w_o = torch.randn(hidden, device="cuda").to(BF), (torch.randn(hidden, H * d, device="cuda") * 0.05).to(BF)
    w_qkv = (torch.randn(qkv_out(C), hidden, device="cuda") * 0.05).to(BF)
    qn, kn = torch.randn(d, device="cuda").to(BF), torch.randn(d, device="cuda").to(BF)
    w_lm = (torch.randn(4096, hidden, device="cuda") * 0.05).to(BF)
    x = torch.randn(1, hidden, device="cuda").to(BF)
    positions = torch.tensor([ctx0], dtype=torch.int32, device="cuda")

    def step(o, lay):
        q, k, v = o.linear(o.rms_norm(x, w_norm, 1e-6), w_qkv).split([H * d, KVH * d, KVH * d], dim=-1)
        q = o.qk_norm_rope_kv_write(
            q.view(1, H, d), k.view(1, KVH, d), v.view(1, KVH, d), qn, kn, 1e-6, cos, sin, lay, bt, positions
        )
        y = o.linear(o.attention(q, lay, bt, positions, d**-0.5).reshape(1, H * d), w_o)
        return y, o.argmax(o.lm_head(y, w_lm))

    step(target.ops, layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, tok_g = step(target.ops, layer)
    for p in (ctx0 + 5, ctx0 + 40):
        positions.fill_(p)
        x.copy_(torch.randn(1, hidden, device="cuda").to(BF))
        graph.replay()
        torch.cuda.synchronize()
        # the reference on a copy of the cache after the replay (which wrote position p, rewritten
        # identically here): attention must see p + 1 keys
        y_r, _ = step(R, clone_cache(kv).layers[0])
        close(y_g, y_r, 2e-2, f"graph replay at position {p}")
        assert torch.equal(tok_g, R.argmax(R.lm_head(y_g, w_lm)))
