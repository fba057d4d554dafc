"""Key smoothing (quantize.smoothing): exact with a BF16 cache, smaller key error with an INT8 cache.

Tiny random Llama, Qwen2 (q/k bias) and Qwen3 (q/k norm, one KV head for 4 query heads) models,
with a few key channels inflated 16x so there are outliers for the smoothing to act on.
"""

import pytest
import torch

from quantize import QuantScheme, apply
from quantize.smoothing import K_SMOOTH, fold_key_scales, key_absmax, key_score_error, smoothing_scales
from tests.tiny_models import make_tiny
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.engine.runner import ModelRunner
from tileinfer.models import Transformer
from tileinfer.ops import reference

KINDS = ("llama", "qwen2", "qwen3")
OUTLIER = 16.0


class ByteTokenizer:
    """Stands in for a real tokenizer: one id per UTF-8 byte, folded into the tiny vocabulary."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=False):
        return [b % self.vocab_size for b in text.encode("utf-8")]


def with_outliers(sd, config):
    """Inflate key channels 1 and 5 (and head 1's channel 3): k_norm weights with q/k norms, else k_proj rows."""
    sd = dict(sd)
    d = config.head_dim
    for i in range(config.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        name, rows = (a + "k_norm.weight", [1, 5]) if config.qk_norm else (a + "k_proj.weight", [1, 5, d + 3])
        w = sd[name].clone()
        w[rows] *= OUTLIER
        sd[name] = w
    return sd


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(request.param, folder)
    ck = load_checkpoint(folder)
    sd = with_outliers(ck.state_dict, ck.config)
    smoothed, info = apply(sd, ck.config, QuantScheme("bf16", "int8"), ByteTokenizer(ck.config.vocab_size))
    return hf, ck.config, sd, smoothed, info


def run(model, ids, kv_int8=False):
    """Logits of every position, and per layer the rotated queries and the cached keys [kv_heads, T, d]."""
    queries = []

    class Tap:
        def __getattr__(self, name):
            return getattr(reference, name)

        def qk_norm_rope_kv_write(self, *args):
            q = reference.qk_norm_rope_kv_write(*args)
            queries.append(q)
            return q

    runner = ModelRunner(model, backend=Tap(), kv_int8=kv_int8, max_seq_len=len(ids), page_size=16)
    seq = runner.new_sequence()
    logits = runner.step(seq, torch.as_tensor(ids))  # one chunk: one query capture per layer
    pages = seq.block_table_tensor.long()[: -(-len(ids) // 16)]
    keys = [k[pages].transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])[:, : len(ids)] for k in runner.kv.k]
    return logits, queries, keys


def scores(q, k):
    """q·k of every query head with its KV head's keys, in float32 as the attention op computes them."""
    T, h, d = q.shape
    group = h // k.shape[0]
    return torch.stack([q[:, j].float() @ k[j // group].float().T for j in range(h)])


def test_scales_are_pair_shared_powers_of_two(tiny):
    _, config, _, smoothed, info = tiny
    s = info["key_scales"]
    half = config.head_dim // 2
    assert s.shape == (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    assert torch.equal(s.log2(), s.log2().round())
    assert torch.equal(s[..., :half], s[..., half:])
    assert (s != 1).any(), "outliers should give non-trivial scales"
    assert s[:, 0, 1].min() > s[:, 0, 0].max(), "an outlier channel should get a larger scale"
    for i in range(config.num_hidden_layers):
        assert torch.equal(smoothed[K_SMOOTH.format(i)], s[i])


def test_smoothing_scales_formula():
    absmax = torch.tensor([[1.0, 64.0, 0.0, 4.0, 2.0, 1.0, 0.0, 4.0]])
    s = smoothing_scales(absmax, alpha=0.5)
    # pair maxima [2, 64, 0 -> floor, 4]; alpha 0.5 -> log2 [0.5, 3, tiny, 1], minus their mean, rounded
    m = torch.tensor([2.0, 64.0, 64.0 * 2.0**-20, 4.0])
    log_s = 0.5 * m.log2()
    expected = torch.exp2(torch.round(log_s - log_s.mean()))
    assert torch.equal(s, torch.cat([expected, expected])[None])
    assert torch.equal(smoothing_scales(absmax, alpha=0.0), torch.ones_like(absmax))
    assert torch.isfinite(smoothing_scales(torch.zeros(2, 8))).all()


def test_smoothing_scales_are_per_head():
    """The floor (2^-20 of the largest) and the geometric-mean normalisation are each head's own, on
    [layers, kv_heads, d] maxima; by hand with alpha 1 (pair maxima of d = 4, log2 then minus its mean):
    head 0 [1, 4] -> log2 [0, 2] -> [-1, 1]; head 1 [2^10, 2^14] -> [-2, 2]; head 2 [2^-30, 1], floored to
    [2^-20, 1] -> [-10, 10]. Catches a floor or mean taken over all heads or along the head axis."""
    absmax = torch.tensor([[[1.0, 4.0, 0.5, 0.0], [2.0**10, 2.0**14, 0.0, 2.0**13], [2.0**-30, 1.0, 0.0, 0.5]]])
    want = torch.exp2(torch.tensor([[[-1.0, 1.0], [-2.0, 2.0], [-10.0, 10.0]]]))
    assert torch.equal(smoothing_scales(absmax, alpha=1.0), torch.cat([want, want], dim=-1))


@pytest.mark.parametrize("n", [100, 300])
def test_calibration_records_pre_rope_keys(tiny, n):
    """key_absmax against transformers: the output of k_proj (bias included), or of k_norm for Qwen3.
    300 tokens exceed the tiny models' 256-position context: they run as two sequences (256 and 44
    tokens, each from position 0), and the maxima are over both (not the last sequence's)."""
    hf, config, sd, _, _ = tiny
    hf.load_state_dict(sd)
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    seen = []
    for layer in hf.model.layers:
        module = layer.self_attn.k_norm if config.qk_norm else layer.self_attn.k_proj
        module.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    ctx = config.max_position_embeddings
    with torch.no_grad():
        for start in range(0, n, ctx):
            hf(ids[None, start : start + ctx])
    per_layer = [seen[i :: config.num_hidden_layers] for i in range(config.num_hidden_layers)]
    expected = torch.stack(
        [torch.cat(ks, dim=1).reshape(n, config.num_key_value_heads, config.head_dim).abs().amax(0) for ks in per_layer]
    )
    got = key_absmax(sd, config, ids.tolist(), dtype=torch.float32)
    # float32 both ways, summed in other orders: measured 5.7e-6 absolute on keys up to ~10
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scores_and_logits_unchanged_bitwise(tiny, dtype):
    _, config, sd, smoothed, _ = tiny
    ids = torch.randint(0, config.vocab_size, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = run(Transformer.from_state_dict(config, sd, dtype=dtype), ids)
    smooth = run(Transformer.from_state_dict(config, smoothed, dtype=dtype), ids)
    for i in range(config.num_hidden_layers):
        assert not torch.equal(plain[2][i], smooth[2][i]), "smoothing should change the cached keys"
        assert torch.equal(scores(plain[1][i], plain[2][i]), scores(smooth[1][i], smooth[2][i]))
    assert torch.equal(plain[0], smooth[0])


def test_scales_fold_into_qk_norms_or_projections(tiny):
    _, config, sd, smoothed, info = tiny
    a = "model.layers.0.self_attn."
    if config.qk_norm:  # shared norm weights become per head; projections untouched
        assert smoothed[a + "q_norm.weight"].shape == (config.num_attention_heads, config.head_dim)
        assert smoothed[a + "k_norm.weight"].shape == (config.num_key_value_heads, config.head_dim)
        assert sd[a + "k_norm.weight"].shape == (config.head_dim,)
        assert torch.equal(smoothed[a + "k_proj.weight"], sd[a + "k_proj.weight"])
    else:  # no norms: the q/k projection rows carry the scales
        assert a + "q_norm.weight" not in smoothed
        assert not torch.equal(smoothed[a + "k_proj.weight"], sd[a + "k_proj.weight"])
        assert not torch.equal(smoothed[a + "q_proj.weight"], sd[a + "q_proj.weight"])
    # folded tensors keep their dtype (a BF16 checkpoint stays BF16; power-of-two scales are exact in it)
    bf16 = {n: t.bfloat16() for n, t in sd.items()}
    folded = fold_key_scales(bf16, config, info["key_scales"])
    assert {n: t.dtype for n, t in folded.items() if n in sd} == dict.fromkeys(sd, torch.bfloat16)


def test_key_score_error_equals_a_direct_computation(tiny):
    """key_score_error (what the next test compares) against the scores computed here from one
    prefill's rotated queries and cached keys: sqrt(sum (S8 - S)^2 / sum S^2) over the causal scores
    of every layer and query head, S8 with the keys INT8-quantized per vector as the cache stores them.
    Catches a missing causal mask, sums not pooled over layers and heads, a missing square root.
    The scores are the same float32 products both ways, summed in float64 in other orders: measured
    agreement 2e-16 relative (2026-12-01); bound 1e-12."""
    _, config, sd, _, _ = tiny
    model = Transformer.from_state_dict(config, sd)
    ids = torch.randint(0, config.vocab_size, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    _, queries, keys = run(model, ids)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    err = ref = 0.0
    for q, k in zip(queries, keys):
        kq, ks = reference.quantize_int8(k)
        s, s8 = scores(q, k)[:, causal].double(), scores(q, kq.float() * ks[..., None])[:, causal].double()
        err += float(((s8 - s) ** 2).sum())
        ref += float((s**2).sum())
    assert key_score_error(model, ids) == pytest.approx((err / ref) ** 0.5, rel=1e-12)


def test_calibration_and_folding_refuse_what_they_cannot_do(tiny):
    """No calibration tokens, a weight already INT8 (smoothing must come first) and a missing tensor
    are UserErrors that say so and name the tensor."""
    _, config, sd, _, info = tiny
    name = "model.layers.0.self_attn." + ("k_norm.weight" if config.qk_norm else "k_proj.weight")
    with pytest.raises(UserError, match="the calibration text encodes to no tokens"):
        key_absmax(sd, config, [])
    with pytest.raises(UserError, match="key smoothing must be folded before the weights are quantized to int8"):
        fold_key_scales(sd | {name: sd[name].to(torch.int8)}, config, info["key_scales"])
    with pytest.raises(UserError, match=f"checkpoint has no tensor '{name}'"):
        fold_key_scales({n: t for n, t in sd.items() if n != name}, config, info["key_scales"])


def test_int8_cache_key_error_reduced(tiny):
    _, config, sd, smoothed, _ = tiny
    ids = torch.randint(0, config.vocab_size, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, smooth = (Transformer.from_state_dict(config, x) for x in (sd, smoothed))
    e_plain, e_smooth = key_score_error(plain, ids), key_score_error(smooth, ids)
    assert e_smooth < 0.8 * e_plain
    ref = run(plain, ids)[0]
    assert (run(smooth, ids, kv_int8=True)[0] - ref).abs().mean() < (
        run(plain, ids, kv_int8=True)[0] - ref
    ).abs().mean()


def test_smoothing_commutes_with_int8_weights(tiny):
    """Scaling rows by 2^n before quantizing gives the same int8 values and scales / 2^n: still exact."""
    _, config, sd, _, _ = tiny
    tok = ByteTokenizer(config.vocab_size)
    a, _ = apply(sd, config, QuantScheme("int8", "int8"), tok)
    b, _ = apply(sd, config, QuantScheme("int8", "int8", smooth_keys=False), tok)
    ids = torch.randint(0, config.vocab_size, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    assert torch.equal(
        run(Transformer.from_state_dict(config, a), ids)[0], run(Transformer.from_state_dict(config, b), ids)[0]
    )


def test_nothing_folded_without_int8_cache(tiny):
    _, config, sd, _, _ = tiny
    for spec in (
        QuantScheme("bf16", "bf16"),
        QuantScheme("int8", "bf16", smooth_keys=True),
        QuantScheme("bf16", "int8", smooth_keys=False),
    ):
        out, info = apply(sd, config, spec, tokenizer=None)
        assert info["key_scales"] is None and info["calibration_tokens"] == 0
        assert not any(name.endswith("k_smooth") for name in out)
        assert all(out[n] is sd[n] for n in sd if out[n].dtype != torch.int8)


def test_spec_effective_and_errors():
    assert QuantScheme("int8", "bf16", smooth_alpha=0.9).effective() == QuantScheme("int8", "bf16", smooth_keys=False)
    assert QuantScheme("int8", "int8", smooth_alpha=0.9).effective().smooth_alpha == 0.9
    assert QuantScheme("bf16", "bf16").is_unquantized() and not QuantScheme("bf16", "int8").is_unquantized()
    for bad in (
        dict(weights="int4", kv_cache="bf16"),
        dict(weights="int8", kv_cache="fp8"),
        dict(weights="int8", kv_cache="int8", smooth_alpha=1.5),
        dict(weights="int8", kv_cache="int8", calibration_tokens=0),
    ):
        with pytest.raises(UserError):
            QuantScheme(**bad)


def test_smoothing_needs_tokenizer_and_calibration_file(tiny, tmp_path):
    _, config, sd, _, _ = tiny
    with pytest.raises(UserError, match="tokenizer"):
        apply(sd, config, QuantScheme("bf16", "int8"), tokenizer=None)
    with pytest.raises(UserError, match="does not exist"):
        apply(
            sd,
            config,
            QuantScheme("bf16", "int8", calibration=str(tmp_path / "nope.txt")),
            ByteTokenizer(config.vocab_size),
        )
