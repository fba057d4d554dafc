"""Settings that used to be ignored or mislabelled (issue 10, A and D), checked where they are read:
each one now changes what runs and what the row says, or is refused in one line before any work."""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from evals.drift import PassResult, set_statistics
from evals.evaluation import Item, ScoredSet
from evals.metrics import DEGENERATE_REPEAT, repeated_ngram_fraction
from quantize import QuantScheme, apply, quantization_config, write_checkpoint
from tests.tiny_models import make_tiny
from tileinfer.core import progress
from tileinfer.core.checkpoint import load_checkpoint
from tileinfer.core.errors import UserError
from tileinfer.core.tokenizer import Tokenizer
from tileinfer.jobs import rows, schema
from tileinfer.models.loading import content_sha256, load_model

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "evals" / "data" / "stdlib" / "statistics.py.txt"
schema.register()


def load(*overrides, config_name="config"):
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        return schema.load(compose(config_name, list(overrides)))


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize("tokens,label", [(2048, "2k"), (1024, "1k"), (3000, "3000"), (32768, "32k")])
def test_the_ctx_label_follows_the_tokens(tokens, label):
    assert load(f"ctx.tokens={tokens}").ctx.name == label
    with pytest.raises(UserError, match="the name follows ctx.tokens"):
        load("ctx.tokens=2048", "ctx.name=1k")


def test_a_second_source_on_a_registry_model_is_refused():
    with pytest.raises(UserError, match="a local checkpoint is given as model.path=FILE"):
        load("+model.source.path=/some/file.gguf")


@pytest.mark.parametrize("name", ["/some/file.gguf", "sub/model", "file.gguf"])
def test_a_path_as_model_name_is_refused(name):
    with pytest.raises(UserError, match=f"model.name={name}: a local checkpoint is given as model.path"):
        load(f"model.name={name}")


def test_model_path_replaces_the_registry_model(tmp_path):
    cfg = load(f"model.path={tmp_path}/my-model.gguf")
    assert cfg.model.name == "my-model" and cfg.model.source == {"path": f"{tmp_path}/my-model.gguf"}
    assert cfg.model.config is None  # the registry's shapes describe another checkpoint


def test_model_equals_a_path_says_what_to_write(tmp_path):
    out = run("tileinfer.sweep", f"model={tmp_path}/x.gguf", f"runs_dir={tmp_path}/runs")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"tileinfer.sweep: error: model={tmp_path}/x.gguf: a local checkpoint is given as model.path={tmp_path}/x.gguf"
    ]


# one short BF16 job: a ctx the edit prompt fits in, a few scored positions
TINY_JOB = ["quant=bf16", "ctx.tokens=1000", "eval.n_score=8", "eval.prompt_sets=[edit]", "speed.decode_tokens=2"]
TINY_JOB += ["speed.warmup=false"]


def test_a_local_model_runs_under_its_own_name(tmp_path, smollm2_gguf):
    local = tmp_path / "mine.gguf"
    shutil.copy(smollm2_gguf, local)
    out = run(
        "tileinfer.sweep",
        f"model.path={local}",
        *TINY_JOB,
        f"runs_dir={tmp_path}/runs",
    )
    assert out.returncode == 0, out.stderr
    df = rows.read(tmp_path / "runs" / "rows")
    assert df["model"].to_list() == ["mine"] and df["ctx"].to_list() == ["1000"]
    assert not list(local.parent.glob("*.json"))  # no cache beside the model file


def test_a_model_of_ones_own_config_dir_runs(tmp_path, smollm2_gguf):
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "mine.yaml").write_text(f"name: mine\nsource:\n  path: {smollm2_gguf}\n")
    out = run(
        "tileinfer.sweep",
        "--config-dir",
        str(tmp_path / "myconf"),
        "model=mine",
        *TINY_JOB,
        f"runs_dir={tmp_path}/runs",
    )
    assert out.returncode == 0, out.stderr
    assert rows.read(tmp_path / "runs" / "rows")["model"].to_list() == ["mine"]


def test_a_quantized_checkpoint_is_refused_before_any_work(tmp_path):
    make_tiny("llama", tmp_path / "bf16")
    ck = load_checkpoint(tmp_path / "bf16", dtype=torch.float32)
    sd, info = apply(ck, None, QuantScheme("int8", "bf16"))
    write_checkpoint(tmp_path / "q8", sd, ck.hf_config, quantization_config(info))
    cfg = load(f"model.path={tmp_path / 'q8'}", "quant=bf16")
    with pytest.raises(UserError, match="is a quantized checkpoint"):
        load_model(cfg.model.name, cfg.model.source, cfg.model.config, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf):
    return Tokenizer.load(smollm2_gguf)


@pytest.mark.parametrize(
    "setting,tokenizer_says,expect",
    [("null", True, True), ("null", False, False), ("false", True, False), ("true", False, True)],
)
def test_text_prompts_get_a_bos_as_the_tokenizer_or_the_setting_says(
    smollm2_tok, monkeypatch, setting, tokenizer_says, expect
):
    monkeypatch.setattr(smollm2_tok, "add_bos_token", tokenizer_says, raising=False)
    cfg = load(f"eval.add_bos={setting}", f"eval.prompt_sets=[{TEXT}]")
    (scored,) = cfg.evaluation().scored_sets(smollm2_tok, 64)
    (item,) = scored.items
    assert scored.name == "statistics.py" and len(item.prompt) == 64 and item.reply is None
    assert (item.prompt[0] == smollm2_tok.bos_token_id) == expect
    assert scored.identity["add_bos"] == expect


def test_the_log_folders_of_two_commands_never_collide():
    with initialize_config_module("tileinfer.conf", version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    assert f"-{os.getpid()}" in str(cfg.hydra.sweep.dir) and f"-{os.getpid()}" in str(cfg.hydra.run.dir)


def test_a_bad_value_in_any_job_of_a_multirun_is_refused_before_the_first_runs(tmp_path):
    out = run("tileinfer.sweep", "-m", "quant=bf16,int8_kv", "ctx.tokens=1024,0", f"runs_dir={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "tileinfer.sweep: error: ctx.tokens=0: must be at least 1"
    ]
    assert not (tmp_path / "logs").exists() and not list(tmp_path.rglob("*.parquet"))


@pytest.mark.parametrize(
    "override,message",
    [
        ("eval.n_score=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("quant=int9", "Could not find 'quant/int9': available: bf16, int8_both, int8_kv, int8_weights"),
    ],
)
def test_hydra_composition_errors_are_one_line(tmp_path, override, message):
    out = run("tileinfer.sweep", override, f"runs_dir={tmp_path}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


def test_repetition_measure():
    loop = [1, 2, 3, 4, 5, 6] * 10
    assert repeated_ngram_fraction(loop) == pytest.approx((60 - 3 - 6) / 60)  # 3 too short, 6 distinct grams
    assert repeated_ngram_fraction(list(range(50))) == 0.0 and repeated_ngram_fraction([]) == 0.0
    assert repeated_ngram_fraction([7, 7, 7, 7, 7]) == pytest.approx(1 / 5)  # (7,7,7,7) twice: the 2nd repeats


def test_rows_record_repetition_and_flag_a_degenerate_window():
    per_pos = {k: torch.zeros(60) for k in ("kl", "rkl", "dp", "p_base", "p_cand", "logp_base", "logp_cand")}
    per_pos |= {"top1_agree": torch.ones(60, dtype=torch.bool), "argmax_base": torch.zeros(60, dtype=torch.long)}
    per_pos |= {"argmax_cand": torch.zeros(60, dtype=torch.long)}
    passes = [PassResult(per_pos, 1.0, [1.0], 2, [0, 0], [])]
    scored = ScoredSet("s", (Item((1,) * 8, None, 60),), "prompt", {}, 1, "n60")
    looped, _ = set_statistics(scored, passes, [[1, 2, 3, 4, 5, 6] * 10])
    prose, _ = set_statistics(scored, passes, [list(range(60))])
    assert looped["degenerate"] and looped["reply_repeat_frac"] > DEGENERATE_REPEAT
    assert not prose["degenerate"] and prose["reply_repeat_frac"] == 0.0


def test_progress_in_a_log_file_is_lines_not_frames(monkeypatch):
    log = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress.progress_bar(10_000, "prefill")
    for _ in range(10_000):
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("prefill: 100%")


def test_a_calibration_text_shorter_than_calibration_tokens_is_refused(tmp_path):
    make_tiny("llama", tmp_path / "bf16")
    ck = load_checkpoint(tmp_path / "bf16", dtype=torch.float32)
    text = tmp_path / "calib.txt"
    text.write_text("a short calibration text")

    class Chars:  # one token per character
        def encode(self, s, add_special_tokens=False):
            return [ord(c) % 96 for c in s]

    scheme = QuantScheme("bf16", "int8", calibration=str(text), calibration_tokens=100)
    with pytest.raises(UserError, match="is only 24 tokens, fewer than calibration_tokens=100"):
        apply(ck, None, scheme, Chars())
    _, info = apply(ck, None, QuantScheme("bf16", "int8", calibration=str(text), calibration_tokens=24), Chars())
    assert info["calibration_tokens"] == 24


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant=bf16", "quant.name=int8_both"], "quant=int8_both means weights=int8 kv_cache=int8"),
        (["quant=bf16", "quant.weights=int8"], "use quant=int8_weights"),
        (["quant=int8_both", "quant.kv_cache=bf16"], "use quant=int8_weights"),
    ],
)
def test_a_quant_name_must_say_what_the_weights_and_cache_are(overrides, message):
    with pytest.raises(UserError, match=message):
        load(*overrides)


def test_a_prompt_file_named_like_a_built_in_set_is_refused(tmp_path, smollm2_tok):
    f = tmp_path / "edit.txt"
    f.write_text(TEXT.read_text())
    with pytest.raises(UserError, match="name of the built-in prompt set 'edit'"):
        load(f"eval.prompt_sets=[{f}]").evaluation().scored_sets(smollm2_tok, 64)


def test_add_bos_without_a_prompt_file_is_refused():
    with pytest.raises(UserError, match="eval.add_bos=true applies to prompt files"):
        load("eval.add_bos=true")


def test_a_local_model_edited_in_place_is_another_model(tmp_path):
    """Same size, same time stamps, other bytes: another fingerprint (the row identity's model_sha256)."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 4096)
    source = load(f"model.path={f}").model.source
    before, stat = content_sha256(source, None, f), f.stat()
    f.write_bytes(b"a" * 4095 + b"b")
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_sha256(source, None, f) != before
    f.write_bytes(b"a" * 4096)
    assert content_sha256(source, None, f) == before
