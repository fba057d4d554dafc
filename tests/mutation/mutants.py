"""Hand-written mutants: small realistic bugs of the kinds issue 15 names, each with the tests that
must catch it (run by ``python -m tests.mutation.run``). Kinds: shapes smaller than the bug (GQA
ratios, decode splits, shipped block sizes), tolerances wider than the error (rounding points,
eps placement, sampler distribution, dropped positions), self-comparisons (an expectation built with
the function under test), and the Triton kernels, which mutmut cannot mutate (they are compiled from
source text), run through the interpreter.

Each entry: a name, the file, an exact text occurring once in it, its replacement, and pytest node
ids (keep them few: each mutant pays for its tests).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


REF = "tileinfer/ops/reference.py"
GGUF = "tileinfer/core/checkpoint/gguf_file.py"
ATT = "tileinfer/ops/triton/paged_attention.py"
ROPE = "tileinfer/ops/triton/rope_kv.py"
NORMS = "tileinfer/ops/triton/norms.py"
SMOOTH = "quantize/smoothing.py"
METRICS = "evals/metrics.py"
RUNNER = "tileinfer/engine/runner.py"
GATE = "evals/verdicts.py"

T_GGUF = ("tests/test_gguf_permute.py",)
T_LOGITS = ("tests/test_model_vs_transformers.py",)
T_ATT = ("tests/ops/test_attention.py::test_attention",)
T_NORMS = ("tests/ops/test_norms.py::test_rms_norm_where_eps_matters",)
T_SMOOTH = ("tests/test_smoothing.py",)
T_METRICS = ("tests/test_metrics_exact.py",)
T_PROBS = ("tests/ops/test_sampling.py::test_reference_sampling_probs_by_hand",)
T_GATE = ("tests/test_gate_decisions.py",)
T_KV = ("tests/test_kv_cache.py", "tests/ops/test_attention.py::test_reference_paged_attention_equals_dense")

MUTANTS: list[Mutant] = [
    # --- GGUF un-permute (shapes smaller than the bug)
    Mutant(
        "gguf-skip-unpermute-mha",
        GGUF,
        'if permuted and (".q_proj." in name or ".k_proj." in name):',
        'if permuted and cfg["num_key_value_heads"] != cfg["num_attention_heads"] and '
        '(".q_proj." in name or ".k_proj." in name):',
        T_GGUF,
    ),
    Mutant(
        "gguf-k-with-query-heads",
        GGUF,
        'cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]',
        'cfg["num_attention_heads"]',
        T_GGUF,
    ),
    Mutant(
        "gguf-q-with-kv-heads",
        GGUF,
        'cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]',
        'cfg["num_key_value_heads"]',
        T_GGUF,
    ),
    Mutant(
        "gguf-unpermute-axes",
        GGUF,
        "w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])",
        "w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])",
        T_GGUF,
    ),
    Mutant(
        "gguf-only-q",
        GGUF,
        'if permuted and (".q_proj." in name or ".k_proj." in name):',
        'if permuted and ".q_proj." in name:',
        T_GGUF,
    ),
    # --- reference numerics (tolerances wider than the error)
    Mutant(
        "rmsnorm-eps-after-sqrt",
        REF,
        "y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
        "y = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)",
        T_LOGITS,
    ),
    Mutant(
        "rmsnorm-eps-times-10",
        REF,
        "y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
        "y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 10 * eps)",
        T_LOGITS,
    ),
    Mutant(
        "add-rmsnorm-unrounded-sum",
        REF,
        "    s = x + residual\n    return rms_norm(s, weight, eps), s",
        "    s = x + residual\n    return rms_norm(x.float() + residual.float(), weight, eps), s",
        ("tests/ops/test_norms.py::test_rms_norm_and_add",),
    ),
    Mutant(
        "quant-scale-128",
        REF,
        "scale = amax / torch.full_like(amax, 127.0)",
        "scale = amax / torch.full_like(amax, 128.0)",
        ("tests/ops/test_rope_kv.py::test_reference_quantize_int8_hand_computed",),
    ),
    Mutant(
        "quant-round-half-away",
        REF,
        "q = torch.round(xf / safe[..., None]).clamp_(-127, 127)",
        "q = torch.trunc(xf / safe[..., None] + 0.5 * torch.sign(xf)).clamp_(-127, 127)",
        ("tests/ops/test_rope_kv.py::test_reference_quantize_int8_hand_computed",),
    ),
    Mutant(
        "quant-amax-no-abs",
        REF,
        "amax = xf.abs().amax(dim=-1)",
        "amax = xf.amax(dim=-1)",
        ("tests/ops/test_rope_kv.py::test_reference_quantize_int8_hand_computed",),
    ),
    Mutant(
        "quant-scale-by-reciprocal",
        REF,
        "scale = amax / torch.full_like(amax, 127.0)",
        "scale = amax * (1.0 / 127.0)",
        ("tests/ops/test_rope_kv.py::test_reference_quantize_int8_hand_computed",),
    ),
    Mutant(
        "write-kv-int8-v-scale-from-k",
        REF,
        "        layer.v_scale[pages, :, slots] = vs",
        "        layer.v_scale[pages, :, slots] = ks",
        T_KV,
    ),
    Mutant(
        "rope-sign",
        REF,
        "torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)",
        "torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1)",
        T_LOGITS,
    ),
    Mutant(
        "ref-attention-drop-newest",
        REF,
        "visible = torch.arange(length, device=q.device)[None, :] <= positions.long()[:, None]",
        "visible = torch.arange(length, device=q.device)[None, :] < positions.long()[:, None].clamp_min(1)",
        ("tests/ops/test_attention.py::test_reference_paged_attention_equals_dense",),
    ),
    Mutant(
        "ref-attention-int8-no-v-scale",
        REF,
        "            p *= v_scale[h]\n",
        "            p = p * v_scale[h].mean()\n",
        ("tests/ops/test_attention.py::test_reference_paged_attention_equals_dense",),
    ),
    Mutant(
        "ref-sampler-temperature-squared",
        REF,
        "logits = logits.float() / max(temperature, 1e-6)\n    if 0 < top_k",
        "logits = logits.float() / max(temperature * temperature, 1e-6)\n    if 0 < top_k",
        ("tests/ops/test_sampling.py::test_reference_sampler_passes_chi_square",),
    ),
    Mutant(
        "ref-sampler-top-p-strict",
        REF,
        "drop = cum - sorted_logits.softmax(-1) >= top_p",
        "drop = cum >= top_p",
        ("tests/ops/test_sampling.py::test_reference_sampler_passes_chi_square",),
    ),
    Mutant(
        "ref-sampler-argmax",
        REF,
        "return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), 1, generator=generator)",
        "return sampling_probs(logits, temperature, top_k, top_p).argmax(-1, keepdim=True)",
        ("tests/ops/test_sampling.py::test_reference_sampler_passes_chi_square",),
    ),
    Mutant(
        "ref-sampler-top-k-one-ignored",
        REF,
        "if 0 < top_k < logits.shape[-1]:",
        "if 1 < top_k < logits.shape[-1]:",
        T_PROBS,
    ),
    Mutant(
        "ref-sampler-top-k-drops-kth",
        REF,
        'logits = logits.masked_fill(logits < kth, float("-inf"))',
        'logits = logits.masked_fill(logits <= kth, float("-inf"))',
        T_PROBS,
    ),
    Mutant(
        "ref-sampler-top-p-mass-strict",
        REF,
        "drop = cum - sorted_logits.softmax(-1) >= top_p",
        "drop = cum - sorted_logits.softmax(-1) > top_p",
        T_PROBS,
    ),
    Mutant(
        "ref-sampler-temperature-floor",
        REF,
        "logits = logits.float() / max(temperature, 1e-6)\n    if 0 < top_k",
        "logits = logits.float() / max(temperature, 1e-5)\n    if 0 < top_k",
        T_PROBS,
    ),
    # --- Triton kernels in the interpreter
    Mutant(
        "triton-combine-two-splits",
        ATT,
        "    ok = s < n_splits\n",
        "    ok = s < tl.minimum(n_splits, 2)\n",
        ("tests/ops/test_attention.py::test_attention",),
    ),
    Mutant(
        "triton-combine-natural-exp",  # the split maxima are in log2 units
        ATT,
        "w = tl.math.exp2(m - tl.max(m, axis=0))",
        "w = tl.math.exp(m - tl.max(m, axis=0))",
        ("tests/ops/test_attention.py::test_attention",),
    ),
    Mutant(
        "triton-decode-drop-last-block",
        ATT,
        "    end = tl.minimum(start + per, n_blocks)\n",
        "    end = tl.minimum(start + per, tl.maximum(n_blocks - 1, 1))\n",
        T_ATT,
    ),
    Mutant(
        "triton-decode-split-per-floor",
        ATT,
        "    per = tl.cdiv(n_blocks, n_splits)\n",
        "    per = tl.maximum(n_blocks // n_splits, 1)\n",
        ("tests/ops/test_attention.py::test_decode_splits_of_unequal_length",),
    ),
    Mutant(
        "triton-attention-no-rescale",
        ATT,
        "    acc = acc * alpha[:, None]\n",
        "    acc = acc\n",
        ("tests/ops/test_attention.py::test_attention",),
    ),
    Mutant(
        "triton-attention-mask-strict",
        ATT,
        's = tl.where(n[None, :] <= pos_r[:, None], s, float("-inf"))',
        's = tl.where(n[None, :] < pos_r[:, None], s, float("-inf"))',
        ("tests/ops/test_attention.py::test_attention_reads_every_position",),
    ),
    Mutant(
        "triton-attention-int8-no-k-scale",
        ATT,
        "        s = s * tl.load(ks_ptr + s_off)[None, :]\n",
        "        s = s * tl.max(tl.load(ks_ptr + s_off), axis=0)\n",
        ("tests/ops/test_attention.py::test_attention",),
    ),
    Mutant(
        "triton-rope-quantize-before-bf16",
        ROPE,
        "        k1 = cast(k1, kdt).to(tl.float32)\n        k2 = cast(k2, kdt).to(tl.float32)\n",
        "",
        ("tests/ops/test_rope_kv.py::test_int8_kv_write_quantizes_bitwise_like_the_reference",),
    ),
    Mutant(
        "triton-rope-norm-unrounded",
        ROPE,
        "        x1 = cast(x1 * rstd * w1, dt).to(tl.float32)\n        x2 = cast(x2 * rstd * w2, dt).to(tl.float32)\n",
        "        x1 = x1 * rstd * w1\n        x2 = x2 * rstd * w2\n",
        ("tests/ops/test_rope_kv.py::test_int8_kv_write_quantizes_bitwise_like_the_reference",),
    ),
    Mutant(
        "triton-quant-scale-reciprocal",
        ROPE,
        "scale = tl.math.div_rn(amax, 127.0)",
        "scale = amax * (1.0 / 127.0)",
        ("tests/ops/test_rope_kv.py::test_int8_kv_write_quantizes_bitwise_like_the_reference",),
    ),
    Mutant(
        "triton-quant-round-half-up",
        ROPE,
        "q1 = tl.clamp(rint_f32(tl.math.div_rn(x1, safe)), -127.0, 127.0)",
        "q1 = tl.clamp(tl.floor(tl.math.div_rn(x1, safe) + 0.5), -127.0, 127.0)",
        ("tests/ops/test_rope_kv.py::test_int8_kv_write_quantizes_bitwise_like_the_reference",),
    ),
    Mutant(
        "triton-rope-sign",
        ROPE,
        "return x1 * cos - x2 * sin, x2 * cos + x1 * sin",
        "return x1 * cos + x2 * sin, x2 * cos - x1 * sin",
        ("tests/ops/test_rope_kv.py::test_qk_norm_rope_kv_write",),
    ),
    Mutant(
        "triton-norm-eps-after-sqrt",
        NORMS,
        "rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)",
        "rstd = 1.0 / (tl.sqrt(tl.sum(xf * xf, axis=0) / n) + eps)",
        T_NORMS,
    ),
    # --- key smoothing
    Mutant(
        "smooth-no-mean-normalisation",
        SMOOTH,
        "exp = torch.round(log_s - log_s.mean(-1, keepdim=True))",
        "exp = torch.round(log_s)",
        T_SMOOTH,
    ),
    Mutant(
        "smooth-k-multiplied",
        SMOOTH,
        '("k_proj", 1.0 / s_k, kvh)',
        '("k_proj", s_k, kvh)',
        T_SMOOTH,
    ),
    Mutant(
        "smooth-q-group-order",
        SMOOTH,
        "s_q = s_k.repeat_interleave(c.gqa_group, dim=0)",
        "s_q = s_k.repeat(c.gqa_group, 1)",
        T_SMOOTH,
    ),
    Mutant(
        "smooth-norm-k-multiplied",
        SMOOTH,
        '_scaled(get(a + "k_norm.weight"), 1.0 / s_k)',
        '_scaled(get(a + "k_norm.weight"), s_k)',
        T_SMOOTH,
    ),
    # --- metrics (exact expectations: tests/test_metrics_exact.py)
    Mutant(
        "metrics-kl-sign-of-partition",
        METRICS,
        "kl = _weighted_sum(p, d).double() - (log_zp - log_zq)",
        "kl = _weighted_sum(p, d).double() + (log_zp - log_zq)",
        T_METRICS,
    ),
    Mutant(
        "metrics-rkl-as-kl",
        METRICS,
        "rkl = (log_zp - log_zq) - _weighted_sum(q, d).double()",
        "rkl = _weighted_sum(p, d).double() - (log_zp - log_zq)",
        T_METRICS,
    ),
    Mutant(
        "metrics-entropy-of-q-from-p",
        METRICS,
        "ent_q = log_zq - _weighted_sum(q, y).double()",
        "ent_q = log_zq - _weighted_sum(p, y).double()",
        T_METRICS,
    ),
    Mutant(
        "metrics-percentile-nearest",
        METRICS,
        "return float((1.0 - frac) * v[i] + frac * v[j])",
        "return float(v[i])",
        T_METRICS,
    ),
    Mutant(
        "metrics-agreement-off-by-one",
        METRICS,
        "return int(mismatch[0]) if mismatch.size else int(a.size)",
        "return int(mismatch[0]) + 1 if mismatch.size else int(a.size)",
        T_METRICS,
    ),
    Mutant(
        "metrics-rms-dp-no-sqrt",
        METRICS,
        '"rms_dp": float(np.sqrt(np.mean(dp * dp))),',
        '"rms_dp": float(np.mean(np.abs(dp))),',
        T_METRICS,
    ),
    Mutant(
        "metrics-p99-at-p90",
        METRICS,
        '"kl_p99": percentile(kl, 0.99),',
        '"kl_p99": percentile(kl, 0.90),',
        T_METRICS,
    ),
    Mutant(
        "metrics-max-as-last",
        METRICS,
        '"kl_max": float(kl.max()),',
        '"kl_max": float(kl[-1]),',
        T_METRICS,
    ),
    # --- the gate's decisions (boundaries: values exactly on each bound, each bound's own number)
    Mutant(
        "gate-pass-strict",
        GATE,
        "PASS if value <= bound else NOISE",
        "PASS if value < bound else NOISE",
        T_GATE,
    ),
    Mutant(
        "gate-pass-strict-top1",
        GATE,
        "PASS if value >= bound else NOISE",
        "PASS if value > bound else NOISE",
        T_GATE,
    ),
    Mutant(
        "gate-fail-inclusive",
        GATE,
        "return FAIL if lo > bound else",
        "return FAIL if lo >= bound else",
        T_GATE,
    ),
    Mutant(
        "gate-fail-inclusive-top1",
        GATE,
        "return FAIL if hi < bound else",
        "return FAIL if hi <= bound else",
        T_GATE,
    ),
    Mutant(
        "gate-fail-on-far-end",
        GATE,
        "return FAIL if lo > bound else",
        "return FAIL if hi > bound else",
        T_GATE,
    ),
    Mutant(
        "gate-fail-on-far-end-top1",
        GATE,
        "return FAIL if hi < bound else",
        "return FAIL if lo < bound else",
        T_GATE,
    ),
    Mutant(
        "gate-interval-ends-swapped",
        GATE,
        "if lo is None or hi is None else (lo, hi)",
        "if lo is None or hi is None else (hi, lo)",
        T_GATE,
    ),
    Mutant(
        "gate-interval-half-present",
        GATE,
        "if lo is None or hi is None else (lo, hi)",
        "if lo is None and hi is None else (lo, hi)",
        T_GATE,
    ),
    Mutant(
        "gate-verdict-point-estimate-only",
        GATE,
        "    lo, hi = interval(row, metric)\n",
        "    lo, hi = row[metric], row[metric]\n",
        T_GATE,
    ),
    Mutant(
        "gate-p999-strict",
        GATE,
        '(row.get("n_scored") or 0) >= gate["p999_min_positions"]',
        '(row.get("n_scored") or 0) > gate["p999_min_positions"]',
        T_GATE,
    ),
    Mutant(
        "gate-p999-off-by-one",
        GATE,
        '(row.get("n_scored") or 0) >= gate["p999_min_positions"]',
        '(row.get("n_scored") or 0) + 1 >= gate["p999_min_positions"]',
        T_GATE,
    ),
    Mutant(
        "gate-p999-skips-mean-too",
        GATE,
        'verdict=None if m == "kl_mean" or p999_checked(row, gate) else SKIP',
        "verdict=None if p999_checked(row, gate) else SKIP",
        T_GATE,
    ),
    Mutant(
        "gate-baseline-p999-mean-floor",
        GATE,
        'gate["floor"][m] + extra.get(m, 0.0)',
        'gate["floor"]["kl_mean"] + extra.get(m, 0.0)',
        T_GATE,
    ),
    Mutant(
        "gate-baseline-increase-on-floor",
        GATE,
        'base[m] * (1 + gate["max_increase"]) + gate["floor"][m]',
        '(base[m] + gate["floor"][m]) * (1 + gate["max_increase"])',
        T_GATE,
    ),
    Mutant(
        "gate-baseline-top1-no-margin",
        GATE,
        'base["top1_agree"] - gate["max_top1_drop"] - extra.get("top1_agree", 0.0)',
        'base["top1_agree"] - gate["max_top1_drop"]',
        T_GATE,
    ),
    Mutant(
        "gate-fallback-top1-margin-not-complemented",
        GATE,
        '"top1_agree": 1 - b["top1_agree"]}',
        '"top1_agree": b["top1_agree"]}',
        T_GATE,
    ),
    Mutant(
        "gate-fallback-p999-margin-mean",
        GATE,
        '{"kl_mean": b["kl_mean"], "kl_p999": b["kl_p999"],',
        '{"kl_mean": b["kl_mean"], "kl_p999": b["kl_mean"],',
        T_GATE,
    ),
    Mutant(
        "gate-kernel-p999-mean-bound",
        GATE,
        '_verdict("kernel", row, "kl_p999", None, b["kl_p999"]',
        '_verdict("kernel", row, "kl_p999", None, b["kl_mean"]',
        T_GATE,
    ),
    Mutant(
        "gate-kernel-top1-lower-is-better",
        GATE,
        '_verdict("kernel", row, "top1_agree", None, b["top1_agree"], higher_is_better=True)',
        '_verdict("kernel", row, "top1_agree", None, b["top1_agree"])',
        T_GATE,
    ),
    Mutant(
        "gate-setup-ignores-int8-cache",
        GATE,
        '("-int8kv" if row["kv_cache"] == "int8" else "")',
        '("-int8kv" if row["kv_cache"] == "int8kv" else "")',
        T_GATE,
    ),
    Mutant(
        "gate-spec-tie-margin-narrowest",
        GATE,
        "margins.get(dtype, max(margins.values()))",
        "margins.get(dtype, min(margins.values()))",
        T_GATE,
    ),
    # --- the runner's chunking
    Mutant(
        "runner-logits-from-off-by-one",
        RUNNER,
        "skip = min(max(logits_from - first, 0), chunk.shape[0])",
        "skip = min(max(logits_from - first + 1, 0), chunk.shape[0])",
        T_LOGITS,
    ),
    Mutant(
        "runner-row-pos-last",
        RUNNER,
        "rows, row_pos = slice(skip, None), first + skip",
        "rows, row_pos = slice(skip, None), first",
        ("tests/test_runner_chunks.py",),
    ),
    Mutant(
        "runner-context-limit-strict",
        RUNNER,
        "        if end > self.max_seq_len:\n",
        "        if end >= self.max_seq_len:\n",
        ("tests/test_runner_chunks.py",),
    ),
    Mutant(
        "runner-window-limit-strict",
        RUNNER,
        "if window and end > window:",
        "if window and end >= window:",
        ("tests/test_runner_chunks.py",),
    ),
]
