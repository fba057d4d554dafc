"""What identifies a configuration: one list of row columns, used everywhere a row is matched.

The row file's name hashes these columns (:func:`row_file_name`), the row holds them, the gate
matches baseline rows on :data:`DRIFT` and the report groups rows by them. A setting that changes
the numbers and is missing here would make two configurations share a row: add it here and to
:meth:`tileinfer.jobs.plan.Plan.identity` together.
"""

from __future__ import annotations

import hashlib
import json
from types import MappingProxyType

from evals.registry import EVALUATIONS

# The configuration under test: model file, quantization, dtype, backend, speculative decoding.
CONFIG = (
    *("model", "model_sha256", "quant", "weights", "kv_cache", "dtype", "backend"),
    *("smooth_keys", "smooth_alpha", "calibration_tokens", "calibration_sha256"),
    *("spec", "spec_k", "spec_settings", "spec_temperature", "spec_seed"),
)
# How it is scored: the scored set (prompts_sha256 hashes its token ids) and the columns each
# evaluation adds (evals.registry: a corpus and its windows, the scored reply's length, BOS), the base
# side, and the runner settings that reorder sums. A row sets the columns of its own evaluation; the
# others are null.
EVALUATION = tuple(dict.fromkeys(c for name in sorted(EVALUATIONS) for c in EVALUATIONS[name].IDENTITY))
SCORING = (
    "ctx",
    "ctx_tokens",
    "prompt_set",
    "prompts_sha256",
    *EVALUATION,
    "base",
    "top_k",
    "page_size",
    "prefill_chunk",
)
# How speed is timed (no effect on drift), and how many workers timed on the same device at once.
TIMING = ("decode_tokens", "decode_repeats", "decode_cuda_graph", "warmup", "device_workers")
# Where it ran: CPU decode rounds differently with another thread count (greedy replies can differ).
MACHINE = ("device", "cpu_threads")

IDENTITY = CONFIG + SCORING + TIMING + MACHINE
# The gate compares drift across machines and timing settings: a baseline row recorded on one CPU
# certifies the same configuration on another (its margins absorb the rounding differences); and
# across speculative decoding, which only the speed pass runs (the scored logits are teacher-forced),
# so a speculative row is checked against the plain row of its configuration.
DRIFT = tuple(c for c in CONFIG if not c.startswith("spec")) + SCORING

# Every setting of the schema (tileinfer.jobs.schema, and each evaluation's settings as ``eval.*``) and
# the identity column that records it, or (a sentence) why it changes no number of a row.
# tests/test_identity_fields.py fails for a setting of neither kind and changes each recorded one.
SAME_NUMBERS = "changes no number of a row: "
SETTINGS = MappingProxyType(
    {f"model.{k}": v for k, v in (("name", "model"), ("source", "model_sha256"), ("path", "model"))}
    | {"model.config": SAME_NUMBERS + "the shapes a checkpoint is checked against"}
    | {f"quant.{k}": k for k in ("weights", "kv_cache", "smooth_keys", "smooth_alpha", "calibration_tokens")}
    | {"quant.name": "quant", "quant.calibration": "calibration_sha256"}
    | {"ctx.tokens": "ctx_tokens", "ctx.name": SAME_NUMBERS + "derived from ctx.tokens", "backend.name": "backend"}
    | {f"spec.{k}": "spec_settings" for k in ("min_n", "max_n", "draft_model", "draft_quant", "dflash")}
    | {"spec.name": "spec", "spec.k": "spec_k", "spec.temperature": "spec_temperature", "spec.seed": "spec_seed"}
    | {f"eval.{k}": k for k in ("n_score", "add_bos", "n_windows")}
    | {"eval.name": "prompts_sha256", "eval.text_column": "prompts_sha256", "eval.prompt_sets": "prompt_set"}
    | {"eval.corpora": "corpus", "device": "device", "dtype": "dtype", "base.top_k": "top_k"}
    | {f"kv.{k}": k for k in ("page_size", "prefill_chunk")}
    | {f"base.{k}": "base" for k in ("source", "backend", "quant")}
    | {"speed.decode_tokens": "decode_tokens", "speed.repeats": "decode_repeats", "speed.warmup": "warmup"}
    | {"speed.cuda_graph": "decode_cuda_graph"}
    | {"runs_dir": SAME_NUMBERS + "where the rows go", "snapshot_s": SAME_NUMBERS + "a resumed pass is the same"}
    | {"base.dir": SAME_NUMBERS + "where stored base logits are read (checked against the model and prompt)"}
    | {"gate": SAME_NUMBERS + "the gate's checks of the rows"}
)

# Columns renamed since rows were first written: old name -> new name (old rows still load).
RENAMED = MappingProxyType({"reference": "base", "ppl_ref": "ppl_base", "p_ref_mean": "p_base_mean"})
# Identity columns added since: the value that means what rows written before them did (add_bos:
# null, "not a setting", as for the built-in chat prompts; text files got no BOS then; the spec
# settings: null, as for spec=none, the only proposer then; corpus, n_windows: null, prompt sets only;
# decode_repeats: 1, the decode steps were timed once; device_workers: 1, jobs ran one at a time).
ADDED = MappingProxyType(
    {"decode_repeats": 1, "device_workers": 1}
    | dict.fromkeys(("add_bos", "spec_k", "spec_settings", "spec_temperature", "spec_seed", "corpus", "n_windows"))
)


def content_hash(value) -> str:
    """sha256 of a text or of a JSON-able value (prompt token ids): rows over other inputs never match."""
    text = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(text.encode()).hexdigest()


def key_of(row: dict, columns=IDENTITY) -> dict:
    """The identity columns of ``row``.

    Raises:
        KeyError: a column of ``columns`` the row lacks (a row builder out of step with this list).
    """
    return {c: row[c] for c in columns}


def row_file_name(row: dict, label: str) -> str:
    """``LABEL-HASH.parquet``: a readable label plus a hash of the row's identity columns."""
    h = hashlib.sha256(json.dumps(key_of(row), sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{label}-{h}.parquet"
