"""Every setting either names the identity column that records it or says why it changes no number of
a row (tileinfer.jobs.identity.SETTINGS), and changing a recorded setting changes that column and the
row's file: a setting missing from the identity would let a run reuse rows of other settings
(issue 31, part 6). The plans are resolved on SmolLM2 without running the model."""

import json
import shutil
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from evals.registry import EVALUATIONS
from tileinfer.jobs import identity, plan, schema
from tileinfer.jobs.schema import Config
from tileinfer.jobs.worker import Worker

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "evals" / "data" / "stdlib" / "statistics.py.txt"
REPLY = ["model=smollm2-135m", "quant=int8_kv", "ctx.tokens=1000", "eval.prompt_sets=[edit]", "eval.n_score=8"]
CORPUS = [
    "model=smollm2-135m",
    "quant=int8_kv",
    "ctx.tokens=256",
    "eval=corpus",
    "eval.corpora=[pydoc]",
    "eval.n_windows=2",
]
NGRAM, SAMPLED = [*REPLY, "spec=ngram"], [*REPLY, "spec=ngram", "spec.temperature=0.5"]
DRAFT = [*REPLY, "spec=draft", "spec.draft_model=smollm2-135m"]
STORED = [*REPLY, "base.source=stored"]
# Recorded settings that cannot take another value on a CPU host: the only backend and device there are
# the reference backend and the CPU, and decode never replays a CUDA graph.
CPU_FIXED = {"backend.name", "base.backend", "device", "speed.cuda_graph"}


def setting_paths(node_type, prefix="") -> list[str]:
    out = []
    for f in fields(node_type):
        t = (
            f.type
            if isinstance(f.type, type)
            else getattr(schema, str(f.type).removeprefix("Optional[").rstrip("]"), None)
        )
        out += setting_paths(t, f"{prefix}{f.name}.") if is_dataclass(t) and f.name != "gate" else [prefix + f.name]
    return out


def test_every_setting_is_recorded_or_says_why_it_changes_no_number():
    paths = [p for p in setting_paths(Config) if p != "eval"]
    paths += sorted({f"eval.{f.name}" for e in EVALUATIONS.values() for f in fields(e.Settings)})
    assert sorted(paths) == sorted(identity.SETTINGS), set(paths) ^ set(identity.SETTINGS)
    for setting, column in identity.SETTINGS.items():
        assert column in identity.IDENTITY or column.startswith(identity.SAME_NUMBERS), setting


@pytest.fixture(scope="module")
def resolved(tmp_path_factory, smollm2_gguf):
    """The identity of the first scored set of a job with these overrides (one Worker: loads once)."""
    schema.register()
    worker, tmp = Worker(), tmp_path_factory.mktemp("identity")
    cache = {}

    def key(*overrides) -> dict:
        if overrides not in cache:
            with initialize_config_module("tileinfer.conf", version_base="1.3"):
                cfg = schema.load(compose("config", [*overrides, f"runs_dir={tmp}"]))
            p = plan.resolve(cfg, worker)
            cache[overrides] = p.identity(p.sets[0])
        return cache[overrides]

    return key, tmp


def changes(tmp: Path, smollm2_gguf) -> dict[str, tuple[list, list]]:
    """For each recorded setting: the overrides of a job, and of the same job with that setting changed."""
    copy, jsonl = tmp / "other.gguf", tmp / "records.jsonl"
    if not copy.exists():
        shutil.copy(smollm2_gguf, copy)
        text = (REPO / "evals" / "data" / "corpus" / "stdlib-code.txt").read_text()
        jsonl.write_text(json.dumps({"text": text[:4000], "body": text[4000:8000]}) + "\n")
    return {
        "model.name": (REPLY, [*REPLY, f"model.path={copy}"]),
        "model.path": (REPLY, [*REPLY, f"model.path={copy}"]),
        "quant.name": (REPLY, [*REPLY, "quant=int8_both"]),
        "quant.weights": (REPLY, [*REPLY, "quant=int8_both"]),
        "quant.kv_cache": (REPLY, [*REPLY, "quant=bf16"]),
        "quant.smooth_keys": (REPLY, [*REPLY, "quant.smooth_keys=false"]),
        "quant.smooth_alpha": (REPLY, [*REPLY, "quant.smooth_alpha=0.25"]),
        "quant.calibration": (REPLY, [*REPLY, f"quant.calibration={TEXT}"]),
        "quant.calibration_tokens": (REPLY, [*REPLY, "quant.calibration_tokens=256"]),
        "ctx.tokens": (REPLY, [*REPLY, "ctx.tokens=1024"]),
        "spec.name": (REPLY, NGRAM),
        "spec.k": (NGRAM, [*NGRAM, "spec.k=3"]),
        "spec.min_n": (NGRAM, [*NGRAM, "spec.min_n=2"]),
        "spec.max_n": (NGRAM, [*NGRAM, "spec.max_n=6"]),
        "spec.draft_model": (DRAFT, [*REPLY, "spec=draft", f"spec.draft_model={copy}"]),
        "spec.draft_quant": (DRAFT, [*DRAFT, "spec.draft_quant=int8_weights"]),
        "spec.dflash": ([*REPLY, "spec=dflash", "spec.dflash=org/a"], [*REPLY, "spec=dflash", "spec.dflash=org/b"]),
        "spec.temperature": (NGRAM, SAMPLED),
        "spec.seed": (SAMPLED, [*SAMPLED, "spec.seed=1"]),
        "eval.name": (REPLY, CORPUS),
        "eval.prompt_sets": (REPLY, [*REPLY, "eval.prompt_sets=[explain]"]),
        "eval.n_score": (REPLY, [*REPLY, "eval.n_score=9"]),
        "eval.add_bos": (
            [*REPLY, f"eval.prompt_sets=[{TEXT}]", "eval.add_bos=false"],
            [*REPLY, f"eval.prompt_sets=[{TEXT}]", "eval.add_bos=true"],
        ),
        "eval.corpora": (CORPUS, [*CORPUS, "eval.corpora=[stdlib]"]),
        "eval.n_windows": (CORPUS, [*CORPUS, "eval.n_windows=3"]),
        "eval.text_column": (
            [*CORPUS, f"eval.corpora=[{jsonl}]"],
            [*CORPUS, f"eval.corpora=[{jsonl}]", "eval.text_column=body"],
        ),
        "dtype": (REPLY, [*REPLY, "dtype=float32"]),
        "kv.page_size": (REPLY, [*REPLY, "kv.page_size=32"]),
        "kv.prefill_chunk": (REPLY, [*REPLY, "kv.prefill_chunk=256"]),
        "base.source": (REPLY, STORED),
        "base.quant": (REPLY, [*REPLY, "base.quant=same"]),
        "base.top_k": (STORED, [*STORED, "base.top_k=32"]),
        "speed.decode_tokens": (REPLY, [*REPLY, "speed.decode_tokens=64"]),
        "speed.repeats": (REPLY, [*REPLY, "speed.repeats=2"]),
        "speed.warmup": (REPLY, [*REPLY, "speed.warmup=false"]),
    }


def test_changing_a_recorded_setting_changes_its_column_and_the_row_file(resolved, smollm2_gguf):
    key, tmp = resolved
    table = changes(tmp, smollm2_gguf)
    recorded = {s for s, c in identity.SETTINGS.items() if not c.startswith(identity.SAME_NUMBERS)}
    # model.source: the checkpoint's content hash, changed by its bytes (test_job_settings.py)
    assert recorded - set(table) == CPU_FIXED | {"model.source"}
    for setting, (before, after) in table.items():
        a, b = key(*before), key(*after)
        column = identity.SETTINGS[setting]
        assert a[column] != b[column], (setting, a[column])
        assert identity.row_file_name(a, "x") != identity.row_file_name(b, "x"), setting
