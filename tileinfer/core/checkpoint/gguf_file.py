"""GGUF checkpoints (llama.cpp's file format) as a transformers-style config dict and state dict.

The header is parsed here, following the spec in ggml's ``docs/gguf.md`` (little-endian, version 2
and 3), because ``gguf.GGUFReader`` builds a numpy view per token string and takes ~6 s on a
Qwen-sized vocabulary; this parser takes a fraction of a second and is checked against
``GGUFReader`` in the tests. Tensor bytes are dequantized with ``gguf.quants.dequantize``.

Tensor names are mapped back to transformers' names, undoing what llama.cpp's
``convert_hf_to_gguf.py`` did: it renames (``blk.N.attn_q`` <- ``model.layers.N.self_attn.q_proj``)
and, for llama-architecture files only, permutes the rows of ``attn_q``/``attn_k``
(``LlamaModel.permute``). Qwen2/Qwen3 files are not permuted.

Dequantizing a 0.5B model takes ~5 s in numpy, so files above ``CACHE_MIN_BYTES`` are dequantized
once and kept as safetensors under ``$TILEINFER_HOME/dequant/``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tileinfer.core.errors import UserError

CACHE_FORMAT = 1  # bump when the cached tensors would change (names, permutation, rounding)
CACHE_MIN_BYTES = 256 << 20  # below this, dequantizing (~1 s) is cheaper than a cache on disk

# GGUF metadata value types (gguf.md: gguf_metadata_value_type) -> struct format
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# general.architecture -> (transformers model_type, llama.cpp permuted attn_q/attn_k rows)
ARCHITECTURES = {
    "llama": ("llama", True),
    "mistral": ("mistral", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ``shape`` in numpy/torch order (GGUF stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:  # numeric arrays in one go: token_type/scores hold ~150k entries
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=n, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALAR:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALAR[vtype])


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read).

    Raises:
        UserError: not a GGUF file, big-endian or unknown version, truncated or corrupt header, a
            tensor type the ``gguf`` package does not know, or tensor data past the end of the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file cannot be mapped
        raise UserError(f"cannot read GGUF file {path}: {e}") from None
    with buf:
        if buf[:4] != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (bad magic bytes)")
        cur = _Cursor(buf)
        cur.pos = 4
        try:
            version = cur.scalar("<I")
            if version not in (2, 3):
                raise UserError(f"{path}: unsupported GGUF version {version} (big-endian files are not supported)")
            n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
            metadata = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar("<I"))
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
                raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        except (struct.error, ValueError, UnicodeDecodeError, MemoryError) as e:
            raise UserError(f"{path}: truncated or corrupt GGUF header ({e})") from None
        size = len(buf)
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, dims, type_id, rel in raw:
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise UserError(f"{path}: tensor {name} has unknown ggml type {type_id}") from None
        if dims and dims[0] % block:
            raise UserError(f"{path}: tensor {name} rows ({dims[0]}) are not whole {qtype.name} blocks of {block}")
        n = int(np.prod(dims, dtype=np.int64))
        info = TensorInfo(name, tuple(reversed(dims)), qtype, data_start + rel, n // block * type_size)
        if info.offset + info.nbytes > size:
            raise UserError(
                f"{path}: truncated GGUF file (tensor {name} ends at byte {info.offset + info.nbytes}, "
                f"the file has {size})"
            )
        tensors[name] = info
    return GGUFHeader(path, metadata, tensors)


def gguf_metadata(path: str | os.PathLike) -> dict:
    """All key/value metadata of a GGUF file (``general.*``, ``{arch}.*``, ``tokenizer.ggml.*``...).

    Arrays come back as Python lists, strings as ``str``. Raises :class:`UserError` like :func:`read_header`.
    """
    return read_header(path).metadata


def gguf_config(header: GGUFHeader) -> dict:
    """A transformers ``config.json`` dict from GGUF metadata, as ``ModelConfig.from_hf`` reads it.

    Key mapping follows transformers' ``GGUF_CONFIG_MAPPING`` (integrations/ggml.py) and llama.cpp's
    ``LLM_KV_*`` names. ``tie_word_embeddings`` is True iff the file has no ``output.weight``.

    Raises:
        UserError: unsupported architecture, a required key missing, or per-frequency RoPE factors
            (``rope_freqs.weight``, Llama 3.1 style), whose llama3 scaling parameters the file does not state.
    """
    md, path = header.metadata, header.path
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if "rope_freqs.weight" in header.tensors:
        raise UserError(
            f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported; "
            "load the model's transformers folder instead"
        )

    def get(key, default=KeyError):
        if f"{arch}.{key}" in md:
            return md[f"{arch}.{key}"]
        if default is KeyError:
            raise UserError(f"{path}: GGUF metadata has no {arch}.{key}")
        return default

    heads = int(get("attention.head_count"))
    cfg = {
        "model_type": ARCHITECTURES[arch][0],
        "vocab_size": header.tensors["token_embd.weight"].shape[0]
        if "token_embd.weight" in header.tensors
        else int(get("vocab_size")),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    # head_dim: key_length when stated; llama's rope dimension equals head_dim (not so for every arch).
    head_dim = get("attention.key_length", None)
    if head_dim is None and ARCHITECTURES[arch][1]:
        head_dim = get("rope.dimension_count", None)
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    scaling = get("rope.scaling.type", None)
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        if (orig := get("rope.scaling.original_context_length", None)) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """transformers' parameter name for a GGUF tensor name, or None if it is not one we know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``LlamaModel.permute`` in llama.cpp's convert_hf_to_gguf.py.

    HF orders each head's rows as [first halves of the rotary pairs, second halves]; llama.cpp
    interleaves them (pair i at rows 2i, 2i+1) for its "normal" RoPE. Works on weights and biases.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize_all(header: GGUFHeader, cfg: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = {n: hf_name(n) for n in header.tensors}
    if unknown := [n for n, hf in names.items() if hf is None]:
        raise UserError(f"{header.path}: unexpected tensor {unknown[0]} for a {cfg['model_type']} model")
    _check_complete(header.path, cfg, set(names.values()))  # before the slow part
    permuted = ARCHITECTURES[cfg["model_type"]][1]
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    out = {}
    for info in header.tensors.values():
        name = names[info.name]
        try:
            w = dequantize(data[info.offset : info.offset + info.nbytes], info.ggml_type)
        except NotImplementedError:
            raise UserError(
                f"{header.path}: tensor {info.name} has type {info.ggml_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        w = w.reshape(info.shape)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            w = _unpermute(w, cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"])
        # F32 tensors are still views of the read-only map: copy those, so no tensor aliases the file.
        out[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"])).to(dtype)
    return out


def _check_complete(path: Path, cfg: dict, names: set[str]) -> None:
    per_layer = [v for k, v in _LAYER_NAMES.items() if k not in ("attn_q_norm", "attn_k_norm")]
    if cfg["model_type"] == "qwen3":
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    need = ["model.embed_tokens.weight", "model.norm.weight"] + (
        [] if cfg["tie_word_embeddings"] else ["lm_head.weight"]
    )
    need += [f"model.layers.{i}.{p}.weight" for i in range(cfg["num_hidden_layers"]) for p in per_layer]
    missing = [n for n in need if n not in names]
    if missing:
        raise UserError(f"{path}: GGUF file lacks {len(missing)} tensors, e.g. {missing[0]}")


def _cache_file(path: Path, dtype: torch.dtype, home) -> Path:
    from tileinfer.core.fetch import tileinfer_home  # late: pull imports nothing from here, but keep it one-way

    st = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return tileinfer_home(home) / "dequant" / f"{path.stem}.{key}.{str(dtype).removeprefix('torch.')}.safetensors"


def load_gguf(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    cache: bool | None = None,
    home: str | os.PathLike | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load a GGUF checkpoint as ``(config_dict, state_dict)`` with transformers' names and shapes.

    Args:
        path: the ``.gguf`` file.
        dtype: dtype of every returned tensor; tensors are dequantized to float32 first, then cast.
        cache: keep/use a dequantized safetensors copy under ``$TILEINFER_HOME/dequant`` keyed by the
            file's path, size, mtime and ``dtype``; a cache modified after it was written is
            rebuilt. None: only for files over ``CACHE_MIN_BYTES``.
        home: cache folder (default ``$TILEINFER_HOME`` or ``~/.cache/tileinfer``).

    Returns:
        ``config_dict`` (see :func:`gguf_config`) and a state dict: ``model.embed_tokens.weight``
        [vocab, hidden], ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` [out, in] (+ ``.bias``
        for Qwen2), ``...self_attn.{q,k}_norm.weight`` [head_dim] (Qwen3), ``...mlp.{gate,up,down}_proj.weight``,
        ``...{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and ``lm_head.weight``
        [vocab, hidden] only when the embeddings are untied. Equal in float32 to what
        ``transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` loads.

    Raises:
        UserError: naming the file, for a truncated/corrupt GGUF, an unsupported architecture or
            tensor type, or missing tensors.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    if cache is None:
        cache = path.stat().st_size > CACHE_MIN_BYTES
    cached = _cache_file(path, dtype, home) if cache else None
    if cached is not None and cached.is_file():
        try:
            if _stamp(cached).read_text() != _stamp_text(cached):
                raise ValueError("modified since it was written")
            with safe_open(str(cached), "pt") as f:
                cfg = json.loads(f.metadata()["config"])
            return cfg, load_file(str(cached))
        except Exception:  # noqa: BLE001 - a damaged or modified cache is rebuilt, never fatal
            cached.unlink(missing_ok=True)
    header = read_header(path)
    cfg = gguf_config(header)
    sd = _dequantize_all(header, cfg, dtype)
    if cached is not None:
        _write_cache(cached, sd, cfg, path)
    return cfg, sd


def _stamp(cached: Path) -> Path:
    return cached.with_name(cached.name + ".stamp")


def _stamp_text(cached: Path) -> str:
    """Size and mtime of a cache file: a write into it after it was made changes the mtime, and the
    cache is then rebuilt rather than trusted."""
    st = cached.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _write_cache(cached: Path, sd: dict, cfg: dict, source: Path) -> None:
    """Write atomically (temp file + rename), then drop older caches of the same file and dtype:
    a re-downloaded GGUF has a new mtime, hence a new key, and the old copy would sit there (GBs)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=".", suffix=".tmp")
    os.close(fd)
    try:
        save_file(sd, tmp, metadata={"config": json.dumps(cfg), "source": str(source.resolve())})
        os.chmod(tmp, 0o644)
        os.replace(tmp, cached)
        _stamp(cached).write_text(_stamp_text(cached))
    finally:
        Path(tmp).unlink(missing_ok=True)
    dtype_suffix = cached.name.rsplit(".", 2)[-2]
    for other in cached.parent.glob(f"{source.stem}.*.{dtype_suffix}.safetensors"):
        if other == cached:
            continue
        try:
            with safe_open(str(other), "pt") as f:
                stale = f.metadata().get("source") == str(source.resolve())
        except Exception:  # noqa: BLE001 - unreadable: leave it to the user
            stale = False
        if stale:
            other.unlink(missing_ok=True)
            _stamp(other).unlink(missing_ok=True)
