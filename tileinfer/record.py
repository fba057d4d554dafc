"""Record stored base logits: the configured model's top-k distributions on every prompt set.

    python -m tileinfer.record model=smollm2-135m ctx=1k eval.n_score=128   # BF16 (conf/record.yaml)
    python -m tileinfer.record quant=int8_both base.top_k=128

The configuration recorded is the job's candidate (``backend`` and ``quant``), so a later run with
``base.source=stored`` (and ``base.quant=same`` for a quantized recording) compares against it
instead of recomputing it, on any backend and device: a recorded distribution is the ground truth
of its configuration, whichever backend recorded it (the reference backend's recording is read
first; ``base.backend`` picks another, see :func:`evals.base_logits.stored_backend`). Files go to
``base.dir/MODEL/BACKEND-...topk`` (the default ``base.dir`` is the ``evals`` package's
``base_logits/``, whatever the current folder; see :class:`evals.base_logits.TopKLogits`); the
manifest records the model checksum, backend, device, dtype, git commit and library versions.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import replace

import hydra
import torch
from omegaconf import DictConfig

from tileinfer.core.errors import check_runs_dir, exit_on_user_error
from tileinfer.jobs import job, schema, tables
from tileinfer.jobs.schema import Config


def record(cfg: Config) -> list:
    """Compute and save the base logits of ``cfg``'s candidate configuration; return their paths."""
    cfg = replace(cfg, base=replace(cfg.base, source="live", backend=None, quant="same"))
    j = job.resolve(cfg)
    runner, _ = j.runner(j.cfg.backend.name, j.scheme)
    manifest = {
        "model": cfg.model.name,
        "model_sha256": j.loaded.model_id,
        "backend": j.cfg.backend.name,
        "quant": job.quant_label(cfg.quant.name, j.scheme),
        "quant_scheme": repr(j.scheme),
        "dtype": cfg.dtype,
        "device": tables.device_name(j.loaded.device),
        "git_commit": tables.git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ctx_tokens": j.ctx_tokens,
        "n_score": int(cfg.eval.n_score),
        "top_k": int(cfg.base.top_k),
    }
    paths = []
    for set_name in j.prompts:
        for i, logits in enumerate(j.live_base(set_name, runner)):
            path = j.stored_base_path(set_name, i)
            logits.to_topk(cfg.base.top_k, manifest | {"prompt_set": set_name}).save(path)
            paths.append(path)
            print(
                f"wrote {path} ({len(logits.tokens) - logits.prompt_len} scored positions, "
                f"{path.stat().st_size / 1024:.0f} KiB)"
            )
    return paths


schema.register()


@hydra.main(version_base="1.3", config_path="pkg://tileinfer.conf", config_name="record")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error("tileinfer.record"):
        record(schema.load(cfg))


if __name__ == "__main__":
    schema.check_argv("tileinfer.record", sys.argv[1:])
    check_runs_dir("tileinfer.record", sys.argv[1:])
    schema.check_jobs("tileinfer.record", sys.argv[1:], config_name="record")
    main()
