"""Record stored base logits: the configured model's top-k distributions on every scored set.

    python -m tileinfer.record model=smollm2-135m ctx=1k eval.n_score=128   # BF16 (conf/record.yaml)
    python -m tileinfer.record quant=int8_both base.top_k=128

The configuration recorded is the job's candidate (``backend`` and ``quant``), so a later run with
``base.source=stored`` (and ``base.quant=same`` for a quantized recording) compares against it
instead of recomputing it, on any backend and device: a recorded distribution is the ground truth
of its configuration, whichever backend recorded it (the reference backend's recording is read
first; ``base.backend`` picks another, see :func:`evals.base_logits.stored_backend`). The full logits
come from the live base store (tileinfer.jobs.base_store); files go to
``base.dir/MODEL/BACKEND-...topk`` (the default ``base.dir`` is the ``evals`` package's
``base_logits/``, whatever the current folder); the manifest records the model checksum, backend,
device, dtype, git commit and library versions.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import replace

import torch

from evals.base_store import StoredBase
from tileinfer import cli
from tileinfer.core.provenance import device_name, git_commit
from tileinfer.jobs import plan
from tileinfer.jobs.schema import Config


def record(cfg: Config, worker, context=None) -> tuple[list, int]:
    """Compute and save the base logits of ``cfg``'s candidate configuration; return their paths."""
    cfg = replace(cfg, base=replace(cfg.base, source="live", backend=None, quant="same"))
    p = plan.resolve(cfg, worker)
    manifest = {
        "model": cfg.model.name,
        "model_sha256": p.model_sha256,
        "backend": p.candidate.backend,
        "quant": p.candidate.label,
        "quant_scheme": repr(p.candidate.scheme),
        "dtype": cfg.dtype,
        "device": device_name(p.device),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ctx_tokens": p.ctx_tokens,
        "top_k": int(cfg.base.top_k),
    }
    live = p.base_store(worker)
    stored = StoredBase(cfg.base.dir, cfg.model.name, p.model_sha256, p.base.backend, p.base.label, p.ctx_tokens, 0)
    paths = []
    for s in p.sets:
        for i in range(len(s.items)):
            logits = live.logits(s, i)
            path = stored.path(s, i)
            logits.to_topk(cfg.base.top_k, manifest | s.identity | {"prompt_set": s.name}).save(path)
            paths.append(path)
            n = len(logits.tokens) - logits.prompt_len
            print(f"wrote {path} ({n} scored positions, {path.stat().st_size / 1024:.0f} KiB)")
    return paths, 0


def main(argv: list[str] | None = None) -> int:
    return cli.main("tileinfer.record", sys.argv[1:] if argv is None else argv, "record", record)


if __name__ == "__main__":
    sys.exit(main())
