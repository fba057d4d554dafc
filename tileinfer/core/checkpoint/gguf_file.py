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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tileinfer.core.checkpoint.checks import all_finite
from tileinfer.core.config import ModelConfig
from tileinfer.core.errors import UserError
from tileinfer.core.files import atomic_path, locked, write_text

# bump when the cached tensors or config would change (names, permutation, rounding, config fields);
# 2: configs state every field (rope.scale_linear, o_proj biases), tensors checked finite before caching
CACHE_FORMAT = 2
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


# The {arch}.* metadata keys, as llama.cpp's loader (llama-model.cpp, load_hparams) reads them, and
# what gguf_config does with each. That namespace holds only hyper-parameters, so a key outside
# this table is refused as well: llama.cpp may use it in the math, and ignoring it could give a
# silently wrong row. READ: turned into config.json fields by gguf_config (which refuses the values
# it cannot compute, e.g. rope.scaling.type yarn); ANY: no effect on the logits; a tuple: no effect
# at those values, refused at any other.
READ, ANY = "read", "any"
GGUF_KEYS = {
    "context_length": READ,
    "embedding_length": READ,
    "block_count": READ,
    "feed_forward_length": READ,
    "vocab_size": READ,
    "attention.head_count": READ,
    "attention.head_count_kv": READ,
    "attention.layer_norm_rms_epsilon": READ,
    "attention.key_length": READ,  # head_dim (default embedding_length / head_count)
    "attention.value_length": READ,  # must equal head_dim
    "attention.sliding_window": READ,  # kept as a length limit (see tileinfer.core.config)
    "rope.dimension_count": READ,  # must equal head_dim: RoPE over part of a head is not implemented
    "rope.freq_base": READ,
    "rope.scaling.type": READ,  # none, linear (llama.cpp's default when absent); others refused
    "rope.scaling.factor": READ,
    "rope.scale_linear": READ,  # the factor's key before rope.scaling.factor (older converters)
    "rope.scaling.finetuned": ANY,
    "rope.scaling.original_context_length": ANY,  # read by yarn only, which is refused
    "rope.scaling.attn_factor": (1.0,),  # llama.cpp multiplies the rotated q and k by it
    "expert_count": (0,),
    "expert_used_count": (0,),
    "attention.causal": (True,),
}


def gguf_config(header: GGUFHeader) -> dict:
    """A transformers ``config.json`` dict from GGUF metadata, as ``ModelConfig.from_hf`` reads it.

    Key mapping follows transformers' ``GGUF_CONFIG_MAPPING`` (integrations/ggml.py) and llama.cpp's
    ``LLM_KV_*`` names and defaults; every ``{arch}.*`` key is handled as ``GGUF_KEYS`` says. Every
    field is written out, so none falls back to a transformers default that llama.cpp does not
    share. ``tie_word_embeddings`` is True iff the file has no ``output.weight``;
    ``attention_bias`` (llama, qwen3) iff it has attention biases.

    Raises:
        UserError: naming the file and the key: unsupported architecture, a required key missing,
            an ``{arch}.*`` key the table refuses, a rope scaling type other than none/linear,
            RoPE over part of a head, value heads of another size than key heads, or per-frequency
            RoPE factors (``rope_freqs.weight``, Llama 3.1 style), whose llama3 scaling parameters
            the file does not state.
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
    for key, value in md.items():
        rule = GGUF_KEYS.get(key.removeprefix(f"{arch}.")) if key.startswith(f"{arch}.") else ANY
        if rule is None or (isinstance(rule, tuple) and value not in rule):
            raise UserError(f"{path}: GGUF metadata {key}={value!r} is not supported (it changes the model's math)")

    def get(key, default=KeyError):
        if f"{arch}.{key}" in md:
            return md[f"{arch}.{key}"]
        if default is KeyError:
            raise UserError(f"{path}: GGUF metadata has no {arch}.{key}")
        return default

    model_type = ARCHITECTURES[arch][0]
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(get(key, head_dim)) != head_dim:
            raise UserError(
                f"{path}: GGUF metadata {arch}.{key}={get(key)} differs from the head size {head_dim} (not supported)"
            )
    cfg = {
        "model_type": model_type,
        "vocab_size": header.tensors["token_embd.weight"].shape[0]
        if "token_embd.weight" in header.tensors
        else int(get("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "sliding_window": get("attention.sliding_window", None),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if cfg["sliding_window"] is not None and model_type in ("qwen2", "qwen3"):
        cfg |= {"use_sliding_window": True, "max_window_layers": 0}  # a window on every layer
    if model_type in ("llama", "qwen3"):  # transformers' attention_bias: q, k, v and o together
        cfg["attention_bias"] = any(
            f"blk.0.{t}.bias" in header.tensors for t in ("attn_q", "attn_k", "attn_v", "attn_output")
        )
    # llama.cpp: the type defaults to linear, the factor to rope.scale_linear, then to 1 (0 means unset)
    kind = get("rope.scaling.type", "linear")
    factor = get("rope.scaling.factor", None)
    factor = float(get("rope.scale_linear", 0.0) if factor is None else factor) or 1.0
    if kind not in ("none", "linear"):
        raise UserError(f"{path}: GGUF metadata {arch}.rope.scaling.type={kind!r} is not supported (only none, linear)")
    if kind == "linear" and factor != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    try:
        ModelConfig.from_hf(cfg)  # refuse what the engine cannot run before any tensor is read
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
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
    _check_complete(header.path, cfg, names)  # before the slow part
    permuted = ARCHITECTURES[cfg["model_type"]][1]
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    out = {}
    for info in header.tensors.values():
        name = names[info.name]
        try:
            with np.errstate(all="ignore"):  # a NaN is reported below, in one line, not as numpy warnings
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
        # A NaN weight (e.g. a tensor whose type field was damaged) would otherwise surface only as
        # non-finite logits after minutes of work, and be kept in the dequantized cache.
        if not all_finite(out[name]):
            raise UserError(
                f"{header.path}: tensor {info.name} ({info.ggml_type.name}) holds NaN or infinite values "
                "after dequantization; the file is corrupt"
            )
    return out


def _check_complete(path: Path, cfg: dict, names: dict[str, str]) -> None:
    """Raise UserError unless the file's tensors (GGUF name -> transformers name) are exactly those
    the config needs: a missing one cannot be computed, an extra one (say an o_proj bias of a qwen2
    file) would be silently ignored."""
    config = ModelConfig.from_hf(cfg)
    need, have = config.tensor_names(), set(names.values())
    if missing := [n for n in need if n not in have]:
        raise UserError(f"{path}: GGUF file lacks {len(missing)} tensors, e.g. {missing[0]}")
    need = set(need)
    if extra := [g for g, hf in names.items() if hf not in need]:
        raise UserError(
            f"{path}: tensor {extra[0]} is not supported in a {config.model_type} model "
            "(the architecture has no such tensor, or the engine does not implement it)"
        )


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
        [out] for q/k/v of Qwen2, q/k/v/o of a Llama/Qwen3 file with attention biases),
        ``...self_attn.{q,k}_norm.weight`` [head_dim] (Qwen3), ``...mlp.{gate,up,down}_proj.weight``,
        ``...{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and ``lm_head.weight``
        [vocab, hidden] only when the embeddings are untied. Equal in float32 to what
        ``transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` loads.

    Raises:
        UserError: naming the file, for a truncated/corrupt GGUF, an unsupported architecture,
            metadata or tensor type, missing or unsupported tensors, a tensor that dequantizes to
            NaN or infinity (naming the tensor; nothing is cached then), or an OS failure writing
            the cache (naming its path).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    if cache is None:
        cache = path.stat().st_size > CACHE_MIN_BYTES
    if not cache:
        return _dequantize(path, dtype)
    cached = _cache_file(path, dtype, home)
    hit = _read_cache(cached)  # no lock: a cache is whole once its stamp is written
    if hit is None:
        with locked(cached):  # of several jobs loading this file, one dequantizes, the others read its cache
            hit = _read_cache(cached, drop_bad=True)
            if hit is None:
                hit = _dequantize(path, dtype)
                _write_cache(cached, hit[1], hit[0], path)
    return hit


def _dequantize(path: Path, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    header = read_header(path)
    cfg = gguf_config(header)
    return cfg, _dequantize_all(header, cfg, dtype)


def _read_cache(cached: Path, drop_bad: bool = False) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """The config and tensors of a cache file, or None when it is missing, damaged or modified since
    it was written (deleted then with ``drop_bad``: only under the lock, as another process may be
    between writing the file and its stamp)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not cached.is_file():
        return None
    try:
        if _stamp(cached).read_text() != _stamp_text(cached):
            raise ValueError("modified since it was written")
        with safe_open(str(cached), "pt") as f:
            cfg = json.loads(f.metadata()["config"])
        return cfg, load_file(str(cached))
    except Exception:  # noqa: BLE001 - a damaged or modified cache is rebuilt, never fatal
        if drop_bad:
            cached.unlink(missing_ok=True)
            _stamp(cached).unlink(missing_ok=True)
        return None


def _stamp(cached: Path) -> Path:
    return cached.with_name(cached.name + ".stamp")


def _stamp_text(cached: Path) -> str:
    """Size and mtime of a cache file: a write into it after it was made changes the mtime, and the
    cache is then rebuilt rather than trusted."""
    st = cached.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _write_cache(cached: Path, sd: dict, cfg: dict, source: Path) -> None:
    """Write atomically (temp file + rename; an OS failure such as a full disk is a one-line
    UserError and leaves no temporary file), then drop older caches of the same file and dtype: a
    re-downloaded GGUF has a new mtime, hence a new key, and the old copy would sit there (GBs)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with atomic_path(cached) as tmp:
        save_file(sd, str(tmp), metadata={"config": json.dumps(cfg), "source": str(source.resolve())})
    write_text(_stamp(cached), _stamp_text(cached))
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
