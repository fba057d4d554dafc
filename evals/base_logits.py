"""Stored base distributions: top-k log-probabilities plus the tail, in a small file.

The files (``*.topk``) are safetensors containers (tensors plus a JSON manifest in the header); the
suffix keeps them apart from model weights.

A full-vocabulary base is too large to keep (1,024 positions x 151,936 float32 = 622 MB per
prompt), so a recorded base keeps, at every scored position, the k most likely tokens with
their exact log-probabilities, the exact log-mass of everything else (the tail), and the exact
log-probability of the stream's next token, beside the token stream and a manifest (model
checksum, backend, dtype, git commit, library versions). k = 64 costs 512 bytes per position.

Comparing a candidate's full distribution Q with a stored P uses the KL divergence between the two
distributions coarsened to k + 1 outcomes (the top-k tokens of P, and "any other token"):

    KL_k(P||Q) = sum_{i in topk} p_i log(p_i / q_i) + t_P log(t_P / t_Q)

with t_P, t_Q the tail masses. By the log-sum inequality (data processing) it never exceeds the
exact KL, and the gap is exactly ``t_P * KL(P_tail || Q_tail)`` of the renormalised tails, so it is
tight when little mass is outside the top k or when the candidate distorts the tail in proportion.
tests/test_base_logits.py measures the gap on real model distributions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from evals.metrics import position_metrics
from tileinfer.core import files
from tileinfer.core.errors import UserError

FORMAT = "tileinfer-topk-reference/1"  # the files' format tag, kept so recorded files still load


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 log-probabilities, the normaliser finished in float64 (as evals.metrics does)."""
    x = x.float()
    m = x.amax(-1, keepdim=True)
    log_z = m.double() + torch.exp(x - m).sum(-1, keepdim=True).double().log()
    return (x.double() - log_z).float()


def _tail_logmass(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability outside ``ids`` per row, summed directly (no 1 - sum cancellation)."""
    rest = logp.scatter(-1, ids.long(), float("-inf"))
    return torch.logsumexp(rest.double(), dim=-1).float()


@dataclass
class FullLogits:
    """The base's full float32 logits [N, V] at the N scored positions of ``tokens`` (exact KL).

    ``tokens`` int [L] is the prompt followed by the reply; row i predicts ``tokens[prompt_len + i]``.
    """

    tokens: torch.Tensor
    prompt_len: int
    logits: torch.Tensor

    def position_metrics(self, start: int, cand_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """:func:`evals.metrics.position_metrics` of rows ``start:start+n`` against candidate logits [n, V]."""
        n = cand_logits.shape[0]
        nxt = torch.as_tensor(self.tokens[self.prompt_len + start : self.prompt_len + start + n])
        return position_metrics(self.logits[start : start + n].to(cand_logits.device), cand_logits, nxt)

    def to_topk(self, k: int = 64, manifest: dict | None = None) -> "TopKLogits":
        """The compact stored form of these base logits."""
        return TopKLogits.from_logits(self.logits, self.tokens, self.prompt_len, k, manifest)


@dataclass
class TopKLogits:
    """One stored base logits stream.

    Attributes:
        tokens: int32 [L], the prompt followed by the base reply.
        prompt_len: positions before the scored window.
        topk_ids: int32 [N, k], N = L - prompt_len scored positions, most likely token first;
            row i is the distribution predicting ``tokens[prompt_len + i]``.
        topk_logprobs: float32 [N, k], natural-log probabilities of those tokens.
        tail_logmass: float32 [N], log of the probability of all other tokens (-inf if none).
        next_logprob: float32 [N], log-probability of the stream's actual next token.
        manifest: strings describing how it was recorded (model sha256, backend, dtype, commit...).
    """

    tokens: torch.Tensor
    prompt_len: int
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    tail_logmass: torch.Tensor
    next_logprob: torch.Tensor
    manifest: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    @classmethod
    def from_logits(
        cls, logits: torch.Tensor, tokens, prompt_len: int, k: int = 64, manifest: dict | None = None
    ) -> "TopKLogits":
        """Record from full logits [N, V] of the N scored positions of ``tokens`` (L = prompt_len + N)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int32)
        nxt = tokens[prompt_len:].long()
        if logits.shape[0] != nxt.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows for {nxt.shape[0]} scored positions")
        logp = _log_softmax(logits)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return cls(
            tokens,
            prompt_len,
            top.indices.int(),
            top.values,
            _tail_logmass(logp, top.indices),
            logp.gather(-1, nxt[:, None])[:, 0],
            dict(manifest or {}),
        )

    def save(self, path) -> None:
        """Write atomically as safetensors (tensors + manifest in the header metadata); an OS failure
        (full disk, read-only folder) is a one-line UserError naming ``path``."""
        meta = {"format": FORMAT, "prompt_len": str(self.prompt_len), "manifest": json.dumps(self.manifest)}
        tensors = {
            "tokens": self.tokens,
            "topk_ids": self.topk_ids,
            "topk_logprobs": self.topk_logprobs,
            "tail_logmass": self.tail_logmass,
            "next_logprob": self.next_logprob,
        }
        # small (a few hundred KiB): serialized in memory, then written readable by all (0o644), as a
        # committed base-logits file must be
        files.write_bytes(path, safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))

    @classmethod
    def load(cls, path) -> "TopKLogits":
        """Read a file written by :meth:`save`.

        Raises:
            UserError: missing, unreadable, or not a base-logits file.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise UserError(f"stored base logits {path} does not exist; record it with python -m tileinfer.record")
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            t = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - any decoding failure means a corrupt file
            raise UserError(f"cannot read stored base logits {path}: {e}") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"{path} is not a tileinfer base-logits file (format {meta.get('format')!r})")
        return cls(
            t["tokens"],
            int(meta["prompt_len"]),
            t["topk_ids"],
            t["topk_logprobs"],
            t["tail_logmass"],
            t["next_logprob"],
            json.loads(meta["manifest"]),
        )

    def position_metrics(self, start: int, cand_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-position comparison of rows ``start:start+n`` with candidate logits [n, V].

        Same keys as :func:`evals.metrics.position_metrics`; ``kl`` and ``rkl`` are the top-k + tail
        estimates (lower bounds of the exact values, see the module docstring); top-1 agreement,
        the next-token probabilities and log-probabilities are exact; ``entropy_base`` is NaN (the
        tail's shape is not stored).
        """
        n = cand_logits.shape[0]
        dev = cand_logits.device
        ids = self.topk_ids[start : start + n].to(dev).long()
        lp = self.topk_logprobs[start : start + n].to(dev)
        lt = self.tail_logmass[start : start + n].to(dev)
        lq_all = _log_softmax(cand_logits)
        lq = lq_all.gather(-1, ids)
        lqt = _tail_logmass(lq_all, ids)
        p, q = lp.double().exp(), lq.double().exp()
        pt, qt = lt.double().exp(), lqt.double().exp()

        def term(w, a, b):  # w * (a - b) with 0 * anything = 0
            return torch.where(w > 0, w * (a.double() - b.double()), torch.zeros_like(w))

        kl = term(p, lp, lq).sum(-1) + term(pt, lt, lqt)
        rkl = term(q, lq, lp).sum(-1) + term(qt, lqt, lt)
        nxt = self.tokens[self.prompt_len + start : self.prompt_len + start + n].to(dev).long()
        logp_base = self.next_logprob[start : start + n].to(dev)
        logp_cand = lq_all.gather(-1, nxt[:, None])[:, 0]
        argmax_cand = cand_logits.argmax(-1)
        ent_q = -(lq_all.exp() * torch.nan_to_num(lq_all, neginf=0.0)).double().sum(-1)
        return {
            "kl": kl.clamp_min(0).float(),
            "rkl": rkl.clamp_min(0).float(),
            "top1_agree": ids[:, 0] == argmax_cand,
            "p_base": logp_base.exp(),
            "p_cand": logp_cand.exp(),
            "dp": logp_cand.exp() - logp_base.exp(),
            "logp_base": logp_base,
            "logp_cand": logp_cand,
            "entropy_base": torch.full((n,), float("nan"), device=dev),
            "entropy_cand": ent_q.float(),
            "argmax_base": ids[:, 0],
            "argmax_cand": argmax_cand,
        }


# The default of ``base.dir`` (tileinfer/jobs/schema.py): the files shipped in this package, found
# from any current folder; any other setting is a folder relative to the current one.
DEFAULT_DIR = "evals/base_logits"
SHIPPED_DIR = Path(__file__).resolve().parent / "base_logits"
REFERENCE_BACKEND = "reference"  # the ground truth; its recordings are preferred


def base_logits_dir(setting: str) -> Path:
    """The folder of stored base logits that the ``base.dir`` setting names: :data:`SHIPPED_DIR` for
    the default spelling, else the path as given (relative to the current folder)."""
    return SHIPPED_DIR if setting == DEFAULT_DIR else Path(setting)


def stored_path(setting: str, model: str, backend: str, stream: str) -> Path:
    """File of one stored base logits stream: ``DIR/MODEL/BACKEND-STREAM.topk``.

    Args:
        setting: the ``base.dir`` setting (:func:`base_logits_dir`).
        model: the model's registry name.
        backend: the backend that recorded the file.
        stream: what was recorded, e.g. ``bf16-nosmooth-edit0-ctx1024-n128`` (quant config, prompt
            set and index, prompt length, scored positions).
    """
    return base_logits_dir(setting) / model / f"{backend}-{stream}.topk"


def stored_backend(setting: str, model: str, streams: list[str], backend: str | None = None) -> str:
    """The backend whose recordings of ``streams`` a job reads: ``backend`` when given (``base.backend``);
    else the reference backend's when it recorded every stream, else the first other backend (by
    name) that did. A recorded distribution is the ground truth of its configuration whichever
    backend ran it, so stored base logits serve any backend on any device. When no backend recorded
    them all, the reference backend (loading then names its missing file)."""
    if backend is not None:
        return backend
    folder = base_logits_dir(setting) / model
    recorded = sorted({p.name.split("-", 1)[0] for p in folder.glob("*.topk")}) if folder.is_dir() else []
    for b in dict.fromkeys([REFERENCE_BACKEND, *recorded]):
        if all(stored_path(setting, model, b, s).is_file() for s in streams):
            return b
    return REFERENCE_BACKEND
