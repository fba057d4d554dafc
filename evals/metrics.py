"""Drift statistics of a candidate model (INT8 weights / INT8 KV cache) against its BF16 base.

Both models read the identical token stream; at every scored position this module compares the
base next-token distribution P (from the BF16 logits) with the candidate's Q over the full
vocabulary, in float32. The statistics and their names follow llama.cpp's perplexity tool run with
``--kl-divergence`` (``tools/perplexity/perplexity.cpp``), so numbers can be read side by side:

=================  =============================  ==========================================
key                llama.cpp label                meaning
=================  =============================  ==========================================
kl_mean            Mean    KLD                    mean of KL(P||Q) over positions, nats
kl_max             Maximum KLD
kl_p999            99.9%   KLD                    percentiles, see :func:`percentile`
kl_p99             99.0%   KLD
kl_p90             90.0%   KLD
kl_median          Median  KLD
rkl_mean           (none)                         mean of KL(Q||P), nats
top1_agree         Same top p                     fraction; llama.cpp prints percent
ppl_base            Mean PPL(base)                 exp(mean NLL of the stream's next tokens)
ppl_cand           Mean PPL(Q)
ln_ppl_ratio       Mean ln(PPL(Q)/PPL(base))
p_base_mean         (none)                         mean probability of the next token under P
p_cand_mean        (none)                         ... under Q
dp_mean            Mean    Δp                     mean of p_cand - p_base; llama.cpp: percent
rms_dp             RMS Δp                         sqrt(mean((p_cand - p_base)^2)); percent there
n_positions        (none)                         number of scored positions
=================  =============================  ==========================================

Differences from llama.cpp, all in the direction of exactness: llama.cpp stores the base model's
log-probabilities as 16-bit integers and skips vocabulary entries with log P <= -16 in the KL sum;
here both distributions are used exactly in float32. llama.cpp also prints standard errors; they
treat neighbouring positions of one reply as independent, which they are not, so rows carry them
only labelled as llama.cpp's (``*_sigma``) beside intervals that resample whole windows, prompts or
blocks of positions (:mod:`evals.intervals`).

Memory: logits arrive in chunks of positions (e.g. 256 x 151,936 float32 = 156 MB per model);
:func:`position_metrics` reduces each chunk to a few floats per position, and
:class:`MetricsAccumulator` keeps only those.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch

# Summary key -> the label llama.cpp's perplexity tool prints for the same statistic.
LLAMA_CPP_LABELS = {
    "kl_mean": "Mean    KLD",
    "kl_max": "Maximum KLD",
    "kl_p999": "99.9%   KLD",
    "kl_p99": "99.0%   KLD",
    "kl_p90": "90.0%   KLD",
    "kl_median": "Median  KLD",
    "top1_agree": "Same top p",
    "ppl_base": "Mean PPL(base)",
    "ppl_cand": "Mean PPL(Q)",
    "ln_ppl_ratio": "Mean ln(PPL(Q)/PPL(base))",
    "dp_mean": "Mean    Δp",
    "rms_dp": "RMS Δp",
}

# Per-position arrays returned by position_metrics, in a fixed order.
POSITION_KEYS = (
    "kl",
    "rkl",
    "top1_agree",
    "p_base",
    "p_cand",
    "dp",
    "logp_base",
    "logp_cand",
    "entropy_base",
    "entropy_cand",
    "argmax_base",
    "argmax_cand",
)


def _log_partition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities (float32) and log-sum-exp (float64) of each row of float32 logits.

    The log-sum-exp is finished in float64: it enters KL as the difference logZ_P - logZ_Q of two
    numbers of size ~10-30, and a float32 rounding there (~2e-6) would put a noise floor under
    small KL values. The sum over the vocabulary itself stays float32.
    """
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)  # -inf logits (masked vocabulary entries) give 0
    s = e.sum(dim=-1, keepdim=True)
    p = e / s
    log_z = m.squeeze(-1).double() + s.squeeze(-1).double().log()
    return p, log_z


def _weighted_sum(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Row sums of p * v where terms with p == 0 count 0 (they would be 0 * inf = nan otherwise)."""
    return torch.where(p > 0, p * v, torch.zeros((), dtype=p.dtype, device=p.device)).sum(dim=-1)


def position_metrics(
    base_logits: torch.Tensor, cand_logits: torch.Tensor, next_tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-position comparison of the base (P) and candidate (Q) next-token distributions.

    Args:
        base_logits: ``[N, V]`` logits of the BF16 base model, any float dtype, any device.
        cand_logits: ``[N, V]`` logits of the candidate at the same positions.
        next_tokens: ``[N]`` int64, the token that follows each position in the shared stream
            (row ``i`` of the logits predicts ``next_tokens[i]``).

    Returns:
        A dict of ``[N]`` tensors on the logits' device (keys in :data:`POSITION_KEYS`):

        - ``kl``: KL(P||Q) = sum_v P log(P/Q) in nats, float32, clamped at 0 (float rounding can
          make a true value of ~0 come out as -1e-9). Exactly 0 when the logits are identical.
        - ``rkl``: reverse KL(Q||P), nats, float32, clamped at 0.
        - ``top1_agree``: bool, argmax P == argmax Q (llama.cpp "Same top p"). Ties resolve to the
          lowest token id, as in ``torch.argmax``.
        - ``p_base``, ``p_cand``: probability of ``next_tokens`` under P and Q, float32.
        - ``dp``: ``p_cand - p_base`` (llama.cpp's Δp), float32.
        - ``logp_base``, ``logp_cand``: natural-log probability of ``next_tokens`` (the negative is
          the NLL that perplexity averages), float32.
        - ``entropy_base``, ``entropy_cand``: entropy of P and Q in nats, float32.
        - ``argmax_base``, ``argmax_cand``: int64 greedy tokens (see
          :func:`greedy_agreement_length`).

        KL is computed as ``sum_v P (x_v - y_v) - (logZ_P - logZ_Q)`` with x, y the float32 logits,
        which is log_softmax(x) - log_softmax(y) rearranged so the two partition functions
        (finished in float64) do not each carry a float32 rounding into the result. A logit of
        -inf in Q where P > 0 gives KL = inf, as it should.

    Raises:
        ValueError: on mismatched shapes.
    """
    if base_logits.dim() != 2 or base_logits.shape != cand_logits.shape:
        raise ValueError(f"logits must both be [N, V]; got {tuple(base_logits.shape)} and {tuple(cand_logits.shape)}")
    next_tokens = torch.as_tensor(next_tokens, device=base_logits.device).long()
    if next_tokens.shape != base_logits.shape[:1]:
        raise ValueError(f"next_tokens must be [{base_logits.shape[0]}]; got {tuple(next_tokens.shape)}")

    x = base_logits.float()
    y = cand_logits.to(device=x.device, dtype=torch.float32)
    p, log_zp = _log_partition(x)
    q, log_zq = _log_partition(y)
    d = x - y  # log(P/Q) up to the per-row constant logZ_Q - logZ_P

    kl = _weighted_sum(p, d).double() - (log_zp - log_zq)
    rkl = (log_zp - log_zq) - _weighted_sum(q, d).double()
    # H(P) = logZ_P - sum_v P x_v
    ent_p = log_zp - _weighted_sum(p, x).double()
    ent_q = log_zq - _weighted_sum(q, y).double()
    del d

    idx = next_tokens.unsqueeze(-1)
    logp_base = x.gather(-1, idx).squeeze(-1).double() - log_zp
    logp_cand = y.gather(-1, idx).squeeze(-1).double() - log_zq
    p_base = logp_base.exp()
    p_cand = logp_cand.exp()
    argmax_base = x.argmax(dim=-1)
    argmax_cand = y.argmax(dim=-1)

    return {
        "kl": kl.clamp_min(0).float(),
        "rkl": rkl.clamp_min(0).float(),
        "top1_agree": argmax_base == argmax_cand,
        "p_base": p_base.float(),
        "p_cand": p_cand.float(),
        "dp": (p_cand - p_base).float(),
        "logp_base": logp_base.float(),
        "logp_cand": logp_cand.float(),
        "entropy_base": ent_p.clamp_min(0).float(),
        "entropy_cand": ent_q.clamp_min(0).float(),
        "argmax_base": argmax_base,
        "argmax_cand": argmax_cand,
    }


def percentile(values, fraction: float) -> float:
    """The ``fraction`` quantile (0..1) of ``values``, defined as llama.cpp's perplexity tool does.

    Sort the n values; with ``r = fraction * (n - 1)``, interpolate linearly between the sorted
    values at ``floor(r)`` and ``floor(r) + 1``. This is ``numpy.quantile(values, fraction,
    method="linear")`` (numpy's default) and gives the midpoint-of-two median for even n, like
    llama.cpp's "Median KLD". Computed in float64 (llama.cpp uses float32).

    Raises:
        ValueError: if ``values`` is empty.
    """
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if v.size == 0:
        raise ValueError("percentile of an empty array")
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    r = fraction * (v.size - 1)
    i = int(math.floor(r))
    frac = r - i
    j = min(i + 1, v.size - 1)
    return float((1.0 - frac) * v[i] + frac * v[j])


def _to_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return a.numpy() if a.dtype == torch.bool else a.double().numpy()
    return np.asarray(a)


def summarize(per_position: Mapping[str, object]) -> dict[str, float]:
    """Reduce per-position arrays (as from :func:`position_metrics`, concatenated over chunks and
    prompts) to the scalar statistics of llama.cpp's ``--kl-divergence`` report.

    Args:
        per_position: mapping with at least ``kl``, ``rkl``, ``top1_agree``, ``p_base``,
            ``p_cand``, ``logp_base``, ``logp_cand`` (``dp`` is recomputed from the p's); each a
            1-D torch tensor or numpy array of the same length N.

    Returns:
        ``kl_mean, kl_median, kl_p90, kl_p99, kl_p999, kl_max`` (nats; percentiles as
        :func:`percentile`), ``rkl_mean`` (nats), ``top1_agree`` (fraction 0..1),
        ``ppl_base, ppl_cand`` (exp of the mean NLL of the next tokens), ``ln_ppl_ratio``
        (``ln(ppl_cand / ppl_base)``), ``p_base_mean, p_cand_mean, dp_mean`` (probabilities 0..1),
        ``rms_dp`` (root mean square of ``p_cand - p_base``, 0..1) and ``n_positions``. All float,
        computed in float64. llama.cpp prints top-1 agreement and the Δp statistics in percent.

    Raises:
        ValueError: if there are no positions or the arrays differ in length.
    """
    a = {
        k: _to_numpy(per_position[k]).ravel()
        for k in ("kl", "rkl", "top1_agree", "p_base", "p_cand", "logp_base", "logp_cand")
    }
    n = a["kl"].size
    if n == 0:
        raise ValueError("no scored positions to summarize")
    if any(v.size != n for v in a.values()):
        sizes = {k: v.size for k, v in a.items()}
        raise ValueError(f"per-position arrays differ in length: {sizes}")
    kl = a["kl"].astype(np.float64)
    p_base = a["p_base"].astype(np.float64)
    p_cand = a["p_cand"].astype(np.float64)
    dp = p_cand - p_base
    nll_base = -float(np.mean(a["logp_base"], dtype=np.float64))
    nll_cand = -float(np.mean(a["logp_cand"], dtype=np.float64))
    return {
        "kl_mean": float(kl.mean()),
        "kl_median": percentile(kl, 0.5),
        "kl_p90": percentile(kl, 0.90),
        "kl_p99": percentile(kl, 0.99),
        "kl_p999": percentile(kl, 0.999),
        "kl_max": float(kl.max()),
        "rkl_mean": float(np.mean(a["rkl"], dtype=np.float64)),
        "top1_agree": float(np.mean(a["top1_agree"].astype(np.float64))),
        "ppl_base": math.exp(nll_base),
        "ppl_cand": math.exp(nll_cand),
        "ln_ppl_ratio": nll_cand - nll_base,
        "p_base_mean": float(p_base.mean()),
        "p_cand_mean": float(p_cand.mean()),
        "dp_mean": float(dp.mean()),
        "rms_dp": float(np.sqrt(np.mean(dp * dp))),
        "n_positions": n,
    }


class MetricsAccumulator:
    """Collects :func:`position_metrics` chunk by chunk on the CPU, then summarizes.

    Only the per-position values are kept (a few floats per position), never the logits, so a
    caller can stream ``[chunk, V]`` logit blocks through :meth:`add` and free them right after.
    """

    def __init__(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = {k: [] for k in POSITION_KEYS}

    def add(
        self, base_logits: torch.Tensor, cand_logits: torch.Tensor, next_tokens: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Score one chunk (shapes as :func:`position_metrics`); returns its per-position dict
        (on the logits' device) and keeps a CPU copy."""
        m = position_metrics(base_logits, cand_logits, next_tokens)
        self.extend(m)
        return m

    def extend(self, m: Mapping[str, torch.Tensor]) -> None:
        """Keep a CPU copy of per-position values computed elsewhere (same keys as position_metrics)."""
        for k in POSITION_KEYS:
            self._parts[k].append(m[k].detach().cpu())

    def per_position(self) -> dict[str, torch.Tensor]:
        """All positions added so far, concatenated in order of :meth:`add` calls."""
        return {k: torch.cat(v) if v else torch.empty(0) for k, v in self._parts.items()}

    def summary(self) -> dict[str, float]:
        """:func:`summarize` of everything added so far; ValueError if nothing was added."""
        return summarize(self.per_position())


def greedy_agreement_length(cand_logits_argmax, reply_tokens) -> int:
    """Number of leading reply tokens that the candidate's own greedy reply would reproduce.

    Args:
        cand_logits_argmax: ``[N]`` int, argmax of the candidate's logits at the N positions that
            predict the reply tokens, teacher-forced on the base stream (prompt + BF16
            greedy reply): element ``i`` comes from the position just before ``reply_tokens[i]``,
            i.e. the ``argmax_cand`` of :func:`position_metrics` over the scored positions.
        reply_tokens: ``[N]`` int, the BF16 model's greedy reply.

    Returns:
        The length of the common prefix, 0..N (N when the candidate agrees everywhere).

    Why no second generation is needed: the candidate's free-running greedy decode emits
    ``argmax`` of its logits given the prompt plus its own earlier tokens. As long as those earlier
    tokens equal the base reply, its input is exactly the teacher-forced input, so its next
    token is exactly ``cand_logits_argmax[i]``. The first index where that differs from
    ``reply_tokens[i]`` is therefore where the free-running candidate reply diverges. This holds
    when the candidate's logits do not depend on how the positions are batched (prefill vs. one
    token at a time); with kernels that round differently per path a near-tie could flip, so the
    value is exact for a deterministic engine and a close estimate otherwise. Ties are broken the
    same way as the argmax that produced ``cand_logits_argmax``.

    Raises:
        ValueError: if the two sequences have different lengths.
    """
    a = _to_int_array(cand_logits_argmax)
    b = _to_int_array(reply_tokens)
    if a.shape != b.shape:
        raise ValueError(f"argmax has {a.size} positions but the reply has {b.size} tokens")
    mismatch = np.flatnonzero(a != b)
    return int(mismatch[0]) if mismatch.size else int(a.size)


def _to_int_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).ravel()


# A reply with more than this share of repeated 4-grams is stuck in a loop (tileinfer.jobs.tables).
DEGENERATE_REPEAT = 0.5


def repeated_ngram_fraction(tokens, n: int = 4) -> float:
    """Share of ``tokens`` (a reply's ids) that complete an ``n``-gram already seen earlier in it.

    A greedy reply that falls into a repeated sentence scores near 1 (every token after the first
    cycle is predictable from the reply itself); prose and code copied once score low. The first
    ``n - 1`` tokens cannot complete an n-gram and count as new. 0.0 for an empty reply.
    """
    tokens = [int(t) for t in tokens]
    seen, repeated = set(), 0
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1 : i + 1])
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(tokens) if tokens else 0.0
