"""The launch plans of both fast backends (tileinfer/ops/*/plan.py), without a GPU: at every shipped
model's shapes (tileinfer.core.registry.model_config) and on 132, 114 and 108 SMs (H200/H100 SXM,
H100 PCIe, A100), each plan keeps the promises its rule makes: grids of whole waves or at most one
program per SM where it says so, split counts within their bounds, tiles that cover the output,
the kernel each input needs. That the shipped plans equal the tables' choices on the H200 is the
GPU tests' and benchmarks' business; these check the rules, whatever the SM count.
"""

from __future__ import annotations

import pytest

from tests.numerics import qkv_out
from tileinfer.core.registry import model_config, shaped_models
from tileinfer.ops.triton import plan as T
from tileinfer.ops.triton.tuning import TUNING, RowMode

SMS = (132, 114, 108)
MODELS = {name: model_config(name) for name in shaped_models()}
GEMM_ROWS = (17, 127, 300, 512, 1000, 1024, 2048, 8192)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def projections(c) -> list[tuple[str, int, int, int, bool, bool]]:
    """(name, weight rows, outputs, K, swiglu, logits) of one layer's products and the lm_head."""
    h = c.hidden_size
    return [
        ("qkv", qkv_out(c), qkv_out(c), h, False, False),
        ("o", h, h, c.num_attention_heads * c.head_dim, False, False),
        ("gate_up", 2 * c.intermediate_size, c.intermediate_size, h, True, False),
        ("down", h, h, c.intermediate_size, False, False),
        ("lm_head", c.vocab_size, c.vocab_size, h, False, True),
    ]


SHAPES = [(m, *p) for m, c in MODELS.items() for p in projections(c)]


# ---------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("model,proj,n_rows,n_out,k,swiglu,logits", SHAPES)
def test_triton_gemv_plan(model, proj, n_rows, n_out, k, swiglu, logits):
    """1 to 16 rows: the programs cover every output once; one row takes its table's row mode (INT8:
    unit floats unless the output or x is float32, int32 words on the lm_head's vocabulary), more
    rows the padded dot path; no SM count enters the plan."""
    for rows in range(1, 17):
        for int8 in (False, True):
            for f32 in (False, True):
                plans = {T.plan_gemv(rows, n_rows, k, int8=int8, swiglu=swiglu, float32=f32 or logits) for _ in SMS}
                assert len(plans) == 1
                p = plans.pop()
                cols = p.block_n // 2 if swiglu else p.block_n
                assert (p.programs - 1) * cols < n_out <= p.programs * cols
                assert p.dot == (rows > 1 or T.gemv_tile(1, n_rows, k, int8).row_mode == RowMode.DOT)
                if p.dot or not int8:
                    assert p.w_int8 == int(int8) and (p.pipe == 1 or not p.dot)
                else:
                    assert p.w_int8 in (RowMode.SIGN_EXTEND, RowMode.WORDS, RowMode.UNIT)
                    assert p.w_int8 != RowMode.UNIT or not (f32 or logits), "unit floats on a float32 product"
                    if n_rows > 32768:  # the vocabulary: the exact int32-word conversion
                        assert p.w_int8 == RowMode.WORDS


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("model,proj,n_rows,n_out,k,swiglu,logits", SHAPES)
def test_triton_gemm_plan(model, proj, n_rows, n_out, k, swiglu, logits, sms):
    """More than 16 rows: a tile from the rule makes at least half a wave of programs on ``sms`` SMs
    (or is its list's last); persistent kernels run at most one program per SM; stream-K never
    takes SwiGLU or a remainder under sms / 8 tiles; SwiGLU and float32 outputs keep tiles at 128
    columns; INT8 weights are widened from int8_dequant_rows rows unless swapped; the tiles cover
    the output."""
    for rows in GEMM_ROWS:
        for int8 in (False, True):
            for tma in (True, False):
                kw = dict(int8=int8, swiglu=swiglu, float32_out=logits, x_bytes=2, tma_x=tma, tma_w=tma, sms=sms)
                p = T.plan_gemm(rows, n_out, k, **kw)
                t = p.tile
                tiles = cdiv(rows, t.block_m) * cdiv(n_out, t.block_n)
                assert p.sms == sms
                assert t.kernel == "ptr" or tma, "a TMA kernel on tensors TMA cannot read"
                if t.kernel == "ptr":
                    assert p.programs == tiles
                else:
                    assert 1 <= p.programs <= sms
                if t.kernel == "streamk":
                    assert not swiglu and not T.streamk_remainder_small(tiles, sms)
                    assert p.programs == min(sms, tiles * cdiv(k, t.block_k))
                elif t.kernel != "ptr":
                    assert p.programs == min(sms, tiles)
                if swiglu or logits:
                    assert t.block_n <= 128
                assert p.widen == (int8 and rows >= TUNING.int8_dequant_rows and t.kernel != "swap")
                weight = int8 and not p.widen
                shaped = (TUNING.gemm_int8_shapes if weight else TUNING.gemm_bf16_shapes).get((rows, n_out, k))
                rule = T.gemm_rule_tile(rows, n_out, weight, swiglu, sms)
                if shaped is None and tma and rule.kernel == t.kernel:
                    listed = getattr(TUNING, ("gemm_int8" if weight else "gemm_bf16") + ("_swiglu" if swiglu else ""))
                    wave = cdiv(rows, rule.block_m) * cdiv(n_out, rule.block_n)
                    assert wave >= sms // 2 or rule == listed[-1]


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("model", MODELS)
def test_triton_attention_plans(model, sms):
    """Split-KV decode: about ``programs per SM x sms`` programs over the KV heads, at most one split
    per key block, so splits * kv_heads lies within one KV head's worth of the target unless the
    blocks run out; query rows padded to a power of two >= 16. Prefill: the row blocks cover every
    (token, group head) row."""
    c = MODELS[model]
    kvh, group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    for int8 in (False, True):
        for positions in (64, 1024, 4096, 16384, 32768, c.max_position_embeddings):
            for rows in (1, 5, 16):
                p = T.plan_decode_attention(rows, group, kvh, positions, d, int8=int8, sms=sms)
                long = int8 and positions >= TUNING.decode_int8_long_positions
                per_sm = TUNING.decode_programs_per_sm_int8_long if long else TUNING.decode_programs_per_sm
                blocks = cdiv(positions, p.tile.block_n)
                assert 1 <= p.splits <= blocks
                assert p.splits * kvh < per_sm * sms + kvh
                assert p.splits == blocks or p.splits * kvh >= per_sm * sms
                assert p.block_m >= max(16, rows * group) and p.block_m & (p.block_m - 1) == 0
        for rows in (17, 512, 1024, 8192):
            p = T.plan_prefill_attention(rows, group, int8=int8)
            assert (p.programs - 1) * p.tile.block_m < rows * group <= p.programs * p.tile.block_m


# ---------------------------------------------------------------------------- cuTile


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("model,proj,n_rows,n_out,k,swiglu,logits", SHAPES)
def test_cutile_skinny_plan(model, proj, n_rows, n_out, k, swiglu, logits, sms):
    """1 to 16 rows: one bf16 row with an INT8 weight in int32 words takes the unit-float GEMV; the
    tensor-core product splits K only while its grid is under split_k_busy_percent of the SMs, by
    the smallest power of two that reaches it (at most MAX_SPLIT, each slice >= MIN_K_TILES K
    tiles); the FMA GEMV only where that product would not split and K >= fma_min_k."""
    pytest.importorskip("cuda.tile")
    from tileinfer.ops.cutile import plan as C
    from tileinfer.ops.cutile.tuning import TUNING as CT

    busy = cdiv(sms * CT.split_k_busy_percent, 100)
    for rows in (1, 2, 5, 16):
        for int8 in (False, True):
            half = rows == 1 and not logits
            kw = dict(int8=int8, swiglu=swiglu, half_row=half, words=int8, w_like_x=not int8, sms=sms)
            p = C.plan_skinny(rows, n_out, n_rows, k, w_bytes=1 if int8 else 2, **kw)
            mma = C.mma_plan(n_out, n_rows, k, 1 if int8 else 2, swiglu, sms)
            assert mma.tk == (256 if int8 else 128) and mma.tn == C.SKINNY_TN
            blocks = cdiv(n_out if swiglu else n_rows, C.SKINNY_TN)
            s, nk = mma.splits, cdiv(k, mma.tk)
            assert s & (s - 1) == 0 and 1 <= s <= C.MAX_SPLIT
            if blocks >= busy:
                assert s == 1
            elif s > 1:
                assert s * C.MIN_K_TILES <= nk
                assert cdiv(n_rows, C.SKINNY_TN) * (s // 2) < busy or s == 2
                assert cdiv(n_rows, C.SKINNY_TN) * s >= busy or s == C.MAX_SPLIT or 2 * s * C.MIN_K_TILES > nk
            if int8 and half:
                assert p == C.SkinnyPlan("unit", CT.unit_tn, CT.unit_tkw, 1)
            elif half and k >= CT.fma_min_k and s == 1:
                assert p.kernel == "fma" and p.splits == 1
            else:
                assert p == mma


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("model", MODELS)
def test_cutile_attention_and_gemm_plans(model, sms):
    """Split-KV decode: the most power-of-two splits whose (KV head, split) blocks fit one wave of
    one block per SM, capped by the pages and MAX_SPLITS; tiles of >= 16 rows; the word kernel for
    one bf16 row at head_dim 128 of an INT8 cache only. Prefill GEMM: INT8 widened from
    int8_widen_rows rows; prefill attention: the tuning's rows."""
    pytest.importorskip("cuda.tile")
    from tileinfer.ops.cutile import plan as C

    c = MODELS[model]
    kvh, group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    for pages in (1, 5, 16, 64, 512, c.max_position_embeddings // 64):
        for rows in (1, 3, 16):
            for int8 in (False, True):
                p = C.plan_decode_attention(rows, group, kvh, pages, d, int8=int8, bf16=True, sms=sms)
                s = p.splits
                assert s & (s - 1) == 0 and 1 <= s <= min(C.MAX_SPLITS, 1 << (pages - 1).bit_length())
                assert kvh * s <= sms or s == 1
                assert kvh * 2 * s > sms or s in (C.MAX_SPLITS, 1 << (pages - 1).bit_length())
                assert p.tp * p.gp >= 16 and p.tp >= rows and p.gp >= group
                assert p.int8_words == (int8 and rows == 1 and d == 128 and p.tp * p.gp <= 16)
    for rows in (17, 64, 65, 511, 512, 1024):
        for int8 in (False, True):
            g = C.plan_gemm(rows, int8=int8, swiglu=False)
            assert g.widen == (int8 and rows >= 512) and g.tm == (128 if rows > 64 else 64)
    assert C.plan_prefill_attention().rows == 128
