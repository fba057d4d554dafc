"""A non-editable install works away from the checkout: conf/ ships as tileinfer.conf."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_every_conf_group_is_packaged():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = [d for d in (REPO / "conf").rglob("*") if d.is_dir() and d.name != "__pycache__"]
    name = {d: ".".join(("tileinfer.conf", *d.relative_to(REPO / "conf").parts)) for d in folders}
    assert set(name.values()) <= set(setuptools["packages"])  # e.g. tileinfer.conf.hydra.launcher and its parent
    assert {name[d] for d in folders if any(d.glob("*.yaml"))} <= set(setuptools["package-data"])


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A non-editable install of the checkout into a folder of its own (no dependencies)."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return site


def test_installed_copy_composes_its_config_from_another_folder(tmp_path, site):
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run(
        [sys.executable, "-c", "import tileinfer.conf; print(tileinfer.conf.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(site))  # the installed copy, not the checkout
    out = subprocess.run(
        [sys.executable, "-m", "tileinfer.sweep", "--cfg", "job", "quant=int8_kv"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "kv_cache: int8" in out.stdout and "name: qwen2.5-coder-0.5b" in out.stdout


def test_installed_copy_ships_the_gates_stored_base_logits_and_baselines(tmp_path, site):
    shipped = [
        p.relative_to(REPO)
        for d in ("base_logits", "baselines")
        for p in (REPO / "evals" / d).rglob("*")
        if p.is_file()
    ]
    assert {p.suffix for p in shipped} == {".topk", ".parquet"}
    assert [p for p in shipped if not (site / p).is_file()] == []
    # the gate's defaults name the installed copies, whatever the current folder
    code = (
        "from omegaconf import OmegaConf; from evals import base_logits as b; from tileinfer import gate; "
        "print(b.base_logits_dir(b.DEFAULT_DIR)); "
        "print(gate.baseline_path(OmegaConf.create({'gate': {'baseline': 'evals/baselines/smollm2-135m.parquet'}, "
        "'model': {'name': 'smollm2-135m'}})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [str(site / "evals" / "base_logits"), str(site / "evals" / "baselines" / "smollm2-135m.parquet")]
