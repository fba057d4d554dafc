"""The main job: accuracy against BF16 beside speed, one row per (model, quant, ctx, prompt set).

    python -m tileinfer.sweep                                   # defaults (conf/config.yaml)
    python -m tileinfer.sweep quant=int8_both ctx=32k
    python -m tileinfer.sweep -m quant=bf16,int8_weights,int8_kv,int8_both ctx=1k,8k

Each job loads the model (pulling it if needed), builds the BF16 reference stream of every prompt
set, runs the candidate configuration teacher-forced over it and writes one Parquet row per prompt
set under ``runs_dir/rows`` (atomically). A row that already exists is not computed again, so an
interrupted sweep restarted with the same command keeps what finished. The BF16 model, its streams
and its logits are kept in memory across the jobs of a multirun.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from pathlib import Path

import hydra
import polars as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from evals.prompts import PROMPT_SETS, build_prompt, build_text_prompt, load_text_prompts
from quantize import QuantSpec, apply as apply_quant
from tileinfer import drift, tables
from tileinfer.checkpoint import load_checkpoint
from tileinfer.errors import UserError, exit_on_user_error
from tileinfer.models import Transformer
from tileinfer.pull import pull
from tileinfer.runner import ModelRunner
from tileinfer.tokenizer import Tokenizer

_MODEL: dict = {}  # the last loaded BF16 model: {key: (checkpoint, tokenizer, Transformer)}
_REFERENCES: OrderedDict = OrderedDict()  # (stream key) -> (Stream, float32 logits), LRU by bytes
_REFERENCE_BYTES = 6 << 30
ROWS_LIST = "rows.json"  # in each job's Hydra output folder: the row files the job produced


def resolve_device(name: str, backend: str) -> torch.device:
    """``auto`` picks CUDA when present. Raises UserError for a GPU backend without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible")
    if backend != "reference" and name != "cuda":
        raise UserError(f"backend={backend} needs a CUDA GPU; use backend=reference on the CPU")
    return torch.device(name)


def fit_ctx(cfg: DictConfig, max_ctx: int) -> int:
    """Prompt length for ``cfg.ctx``: ctx.tokens, shortened so the scored window ends inside the
    model's context.

    Raises:
        UserError: ctx larger than the model's context, or no room left for the scored window.
    """
    want, tail = int(cfg.ctx.tokens), max(int(cfg.eval.n_score), int(cfg.speed.decode_tokens))
    if want > max_ctx:
        raise UserError(f"ctx={cfg.ctx.name} ({want} tokens) exceeds the context of "
                        f"{cfg.model.name} ({max_ctx} tokens)")
    if tail >= max_ctx:
        raise UserError(f"eval.n_score={cfg.eval.n_score} leaves no room for a prompt in the "
                        f"{max_ctx}-token context of {cfg.model.name}")
    return min(want, max_ctx - tail)


def load_model(cfg: DictConfig, device: torch.device):
    """Pull and load the BF16 reference model (kept in memory for the next job of a multirun)."""
    key = (cfg.model.name, cfg.dtype, str(device))
    if key not in _MODEL:
        _MODEL.clear()
        path = pull(cfg.model.name)
        ck = load_checkpoint(path, dtype=getattr(torch, cfg.dtype))
        tok = Tokenizer.load(path)
        model = Transformer.from_state_dict(ck.config, ck.state_dict, dtype=getattr(torch, cfg.dtype),
                                            device=device)
        _MODEL[key] = (ck, tok, model)
    return _MODEL[key]


def model_fingerprint(cfg: DictConfig, path: Path) -> str:
    """The checkpoint's sha256 when its source names one, else a hash of its files' paths, sizes and
    modification times (cheap, and changes when the files do)."""
    sha = OmegaConf.select(cfg, "model.source.sha256")
    if sha:
        return str(sha)
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()


def prompt_sets(cfg: DictConfig, tok: Tokenizer, ctx_tokens: int) -> dict[str, list[list[int]]]:
    """Prompts (token ids, each exactly ctx_tokens long) of every configured prompt set."""
    out = {}
    for name in cfg.eval.prompt_sets:
        if name in PROMPT_SETS:
            out[name] = [build_prompt(tok, name, ctx_tokens)]
        else:
            texts = load_text_prompts(name)
            out[Path(name).stem] = [build_text_prompt(tok, t, ctx_tokens) for t in texts]
    return out


def quant_spec(cfg: DictConfig) -> QuantSpec:
    q = cfg.quant
    return QuantSpec(weights=q.weights, kv_cache=q.kv_cache, smooth_keys=bool(q.smooth_keys),
                     smooth_alpha=float(q.smooth_alpha), calibration=q.calibration,
                     calibration_tokens=int(q.calibration_tokens)).effective()


def row_path(cfg: DictConfig, spec: QuantSpec, ctx_tokens: int, prompt_set: str, model_id: str) -> Path:
    """Where the row of one (model, quant, ctx, prompt set, backend) lives; the name is readable and
    a hash of everything that changes the numbers makes it unique."""
    key = dict(model=model_id, spec=repr(spec), ctx=ctx_tokens, n=int(cfg.eval.n_score),
               set=prompt_set, backend=cfg.backend.name, dtype=cfg.dtype,
               decode=int(cfg.speed.decode_tokens), sets=str(cfg.eval.prompt_sets))
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    smooth = "smooth" if spec.smooth_keys else "nosmooth"
    name = f"{cfg.quant.name}-{smooth}-{cfg.ctx.name}-{prompt_set}-{h}.parquet"
    return Path(cfg.runs_dir) / "rows" / cfg.model.name / cfg.backend.name / name


def reference_for(cfg, ref_runner, tok, ck, prompts, set_name, ctx_tokens, model_id):
    """The BF16 streams and their logits for one prompt set (cached in memory and on disk)."""
    key = (model_id, cfg.backend.name, cfg.dtype, set_name, ctx_tokens, int(cfg.eval.n_score))
    if key in _REFERENCES:
        _REFERENCES.move_to_end(key)
        return _REFERENCES[key]
    stop = set(tok.eos_token_ids) | set(ck.config.eos_token_id)
    cache_dir = Path(cfg.runs_dir) / "cache" / "streams" / f"{cfg.model.name}-{model_id[:12]}-{cfg.backend.name}-{cfg.dtype}"
    refs = []
    for i, prompt in enumerate(prompts):
        f = cache_dir / f"{set_name}-{i}-ctx{ctx_tokens}-n{cfg.eval.n_score}.json"
        stream = drift.reference_stream(ref_runner, prompt, int(cfg.eval.n_score), stop, f)
        refs.append((stream, drift.reference_logits(ref_runner, stream)))
    _REFERENCES[key] = refs
    while sum(lg.numel() * 4 for r in _REFERENCES.values() for _, lg in r) > _REFERENCE_BYTES and len(_REFERENCES) > 1:
        _REFERENCES.popitem(last=False)
    return refs


def run_job(cfg: DictConfig) -> pl.DataFrame:
    """Compute (or reuse) every row of one job and return them as a table."""
    device = resolve_device(cfg.device, cfg.backend.name)
    spec = quant_spec(cfg)
    ck, tok, bf16 = load_model(cfg, device)
    model_id = model_fingerprint(cfg, ck.path)
    ctx_tokens = fit_ctx(cfg, ck.config.max_position_embeddings)
    sets = prompt_sets(cfg, tok, ctx_tokens)
    todo = {s: row_path(cfg, spec, ctx_tokens, s, model_id) for s in sets}
    done = [p for p in todo.values() if p.exists()]
    if len(done) == len(todo):
        print(f"already done: {', '.join(str(p) for p in done)}")
        return _finish(list(todo.values()))

    max_len = ctx_tokens + max(int(cfg.eval.n_score), int(cfg.speed.decode_tokens))
    kw = dict(backend=cfg.backend.name, max_seq_len=max_len, page_size=int(cfg.kv.page_size),
              prefill_chunk=int(cfg.kv.prefill_chunk))
    ref_runner = ModelRunner(bf16, **kw)
    if spec.is_reference():
        cand, info = bf16, {}
    else:
        sd, info = apply_quant(ck, None, spec, tok, progress=True)
        cand = Transformer.from_state_dict(ck.config, sd, dtype=bf16.dtype, device=device)
    cand_runner = ModelRunner(cand, kv_int8=spec.kv_cache == "int8", **kw)

    for set_name, path in todo.items():
        if path.exists():
            continue
        t0 = time.perf_counter()
        refs = reference_for(cfg, ref_runner, tok, ck, sets[set_name], set_name, ctx_tokens, model_id)
        if cfg.speed.warmup:
            drift.warm_up(cand_runner, refs[0][0])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results = [drift.score(cand_runner, stream, logits, int(cfg.speed.decode_tokens))
                   for stream, logits in refs]
        row = tables.make_row(cfg, spec, info, results, ctx_tokens=ctx_tokens, prompt_set=set_name,
                              model_id=model_id, device=device, weights_bytes=cand.weight_bytes(),
                              kv_bytes=cand_runner.kv.bytes_per_position() * max_len,
                              wall_s=time.perf_counter() - t0)
        tables.write_row(path, row, {k: torch.cat([r[1][k] for r in results]) for k in ("kl", "top1_agree", "dp")})
    return _finish(list(todo.values()))


def _finish(paths: list[Path]) -> pl.DataFrame:
    """Print the job's rows and list them in its Hydra output folder (for the multirun summary)."""
    rows = pl.concat([pl.read_parquet(p) for p in paths], how="diagonal_relaxed")
    tables.print_table(rows)
    (Path(HydraConfig.get().runtime.output_dir) / ROWS_LIST).write_text(json.dumps([str(p) for p in paths]))
    return rows


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: one job of a run or multirun."""
    with exit_on_user_error("tileinfer.sweep"):
        run_job(cfg)


class PrintSummary(Callback):
    """After a multirun: print every row it produced as one table and save it beside the logs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        out = Path(config.hydra.sweep.dir)
        paths = [p for f in sorted(out.glob(f"*/{ROWS_LIST}")) for p in json.loads(f.read_text())]
        if not paths:
            return
        df = pl.concat([pl.read_parquet(p) for p in dict.fromkeys(paths)], how="diagonal_relaxed")
        tables.write_summary(df, out)
        print(f"\n=== sweep summary ({len(df)} rows; {out}/summary.md) ===")
        tables.print_table(df)


if __name__ == "__main__":
    main()
