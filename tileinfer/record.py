"""Record stored references: the configured model's top-k distributions on every prompt set.

    python -m tileinfer.record model=smollm2-135m ctx=1k eval.n_score=128   # BF16 (conf/reference.yaml)
    python -m tileinfer.record quant=int8_both reference.top_k=128

The configuration recorded is the job's candidate (``backend`` and ``quant``), so a later run with
``reference.source=stored`` (and ``reference.backend`` / ``reference.quant`` naming this
configuration) compares against it instead of recomputing it, on another machine or backend. Files
go to ``reference.dir/MODEL/`` (see :class:`evals.references.TopKReference`); the manifest records
the model checksum, backend, device, dtype, git commit and library versions.
"""

from __future__ import annotations

import platform
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from tileinfer.jobs import job, tables
from tileinfer.core.errors import check_runs_dir, exit_on_user_error


def record(cfg: DictConfig) -> list:
    """Compute and save the references of ``cfg``'s candidate configuration; return their paths."""
    cfg = OmegaConf.merge(cfg, {"reference": {"source": "live", "backend": None, "quant": "same"}})
    j = job.resolve(cfg)
    runner, _ = j.runner(cfg.backend.name, j.spec)
    manifest = {
        "model": cfg.model.name, "model_sha256": j.loaded.model_id, "backend": cfg.backend.name,
        "quant": job.quant_label(cfg.quant.name, j.spec), "spec": repr(j.spec), "dtype": cfg.dtype,
        "device": tables.device_name(j.loaded.device), "git_commit": tables.git_commit(),
        "torch": torch.__version__, "python": platform.python_version(), "ctx_tokens": j.ctx_tokens,
        "n_score": int(cfg.eval.n_score), "top_k": int(cfg.reference.top_k),
    }
    paths = []
    for set_name in j.prompts:
        for i, ref in enumerate(j.live_references(set_name, runner)):
            path = j.stored_reference_path(set_name, i)
            ref.to_topk(int(cfg.reference.top_k), manifest | {"prompt_set": set_name}).save(path)
            paths.append(path)
            print(f"wrote {path} ({len(ref.tokens) - ref.prompt_len} scored positions, "
                  f"{path.stat().st_size / 1024:.0f} KiB)")
    return paths


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="reference")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error("tileinfer.record"):
        record(cfg)


if __name__ == "__main__":
    check_runs_dir("tileinfer.record", sys.argv[1:])
    main()
