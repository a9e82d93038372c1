"""The trace metadata `model_digest` (docs/hooks.md): which GGUF file a trace was made from, by content.

    {"algorithm": "sha256", "prefix_bytes": 1048576, "tensors": {"token_embd.weight": "<64 hex digits>", ...}}

Each entry is the SHA-256 of the tensor's name (UTF-8), one 0 byte, its GGML type id (u32 LE), its number of
dimensions (u32 LE), each dimension in GGUF order (ne[0], the row length, first; u64 LE each), its data size in
bytes (ggml_nbytes, u64 LE) and the first min(size, prefix_bytes) bytes of its data as stored in the file (the
raw blocks). Listed: `token_embd.weight`, `output_norm.weight`, `output.weight` when present, every tensor of
block 0 and of the first block with a router (`blk.N.ffn_gate_inp.weight`). A split model
(NAME-00001-of-0000N.gguf ...) has every shard opened and each tensor read from the shard that holds it.
glmdiff (`run --against trace:`, `compare --model`) recomputes the digests on the model it is given.

The GGUF headers are read with gguf-py (`pip install gguf`, imported on first use: an optional dependency);
each tensor's data prefix is read from the file itself and hashed with hashlib.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: The metadata key.
KEY = "model_digest"
#: Bytes of each tensor's data a digest covers (the first MiB), for every producer.
PREFIX_BYTES = 1 << 20

_SPLIT_NAME = re.compile(r"^(.*)-([0-9]{5})-of-([0-9]{5})\.gguf$")
_FIRST_MOE = re.compile(r"^blk\.([0-9]+)\.ffn_gate_inp\.weight$")
_ALWAYS = ("token_embd.weight", "output_norm.weight", "output.weight")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF model: what its digest lays out, and where its data lies."""

    name: str
    type_id: int  # GGML type id
    ne: tuple[int, ...]  # the dimensions as the file stores them, ne[0] first
    nbytes: int  # ggml_nbytes
    path: Path  # the shard that holds it
    offset: int  # of its data in that file: the data section start + the tensor's offset


def split_name(path: str | os.PathLike) -> tuple[str, int, int] | None:
    """(NAME, K, N) of a shard file name NAME-0000K-of-0000N.gguf (5 digits each, as llama.cpp's
    `llama_split_path` writes them); None for any other name."""
    m = _SPLIT_NAME.match(Path(path).name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """Every file of the model `path` names: all N shards NAME-0000K-of-0000N.gguf (K = 1..N) beside it when its
    name is one of them, else `path` alone. Nothing is opened."""
    path = Path(path)
    s = split_name(path)
    if s is None or s[2] < 1:
        return [path]
    prefix, _, count = s
    return [path.with_name(f"{prefix}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def tensor_layout(name: str, type_id: int, ne: Iterable[int], nbytes: int) -> bytes:
    """The bytes a tensor's digest covers before its data: name, 0, type id (u32 LE), n_dims (u32 LE), each
    dimension (u64 LE), data size (u64 LE)."""
    ne = [int(d) for d in ne]
    return (name.encode("utf-8") + b"\0" + struct.pack("<II", type_id, len(ne))
            + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<Q", nbytes))


def tensor_digest(t: TensorEntry, prefix_bytes: int = PREFIX_BYTES) -> str:
    """The lowercase hex SHA-256 of `t`'s layout and the first min(size, prefix_bytes) bytes of its data, read
    from its file."""
    n = min(t.nbytes, prefix_bytes)
    with open(t.path, "rb") as f:
        f.seek(t.offset)
        data = f.read(n)
    if len(data) != n:
        raise ValueError(f"glmdiff_hooks: model digest: {t.path}: tensor {t.name}: its data ({t.nbytes} bytes at "
                         f"offset {t.offset}) runs past the end of the file (truncated?)")
    h = hashlib.sha256(tensor_layout(t.name, t.type_id, t.ne, t.nbytes))
    h.update(data)
    return h.hexdigest()


def select_tensors(names: Iterable[str]) -> list[str]:
    """The tensors a producer lists, in the given order: token_embd.weight, output_norm.weight, output.weight
    (those present), every tensor of block 0 and of the first block with a router (the smallest N with a tensor
    blk.N.ffn_gate_inp.weight), when there is one."""
    names = list(names)
    moe = [int(m.group(1)) for m in map(_FIRST_MOE.match, names) if m]
    blocks = ["blk.0."] + ([f"blk.{min(moe)}."] if moe else [])
    return [n for n in names if n in _ALWAYS or any(n.startswith(b) for b in blocks)]


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("glmdiff_hooks: the model digest reads GGUF headers with gguf-py, which is not "
                          "installed: pip install gguf") from e
    return gguf


def _int_field(gguf, reader, key: str, path: Path) -> int | None:
    field = reader.get_field(key)
    if field is None:
        return None
    T = gguf.GGUFValueType
    ints = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
    if len(field.types) != 1 or field.types[0] not in ints or len(field.data) != 1:
        raise ValueError(f"glmdiff_hooks: model digest: {path}: {key} is not an integer")
    return int(field.parts[field.data[0]][0])


def _read_shard(gguf, path: Path) -> tuple[object, list[TensorEntry]]:
    if not path.exists():
        raise FileNotFoundError(f"glmdiff_hooks: model digest: {path} does not exist")
    if not path.is_file():
        raise IsADirectoryError(f"glmdiff_hooks: model digest: {path} is not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"glmdiff_hooks: model digest: {path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001  (gguf-py raises ValueError, KeyError, IndexError ... on a bad header)
        raise ValueError(f"glmdiff_hooks: model digest: {path} is not a GGUF file gguf-py can read (truncated or "
                         f"damaged?): {e}") from e
    size = path.stat().st_size
    entries = []
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        ne = tuple(int(d) for d in t.shape)  # the dims record as stored: n_dims of them, ne[0] first
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (KeyError, ValueError):
            raise ValueError(f"glmdiff_hooks: model digest: {path}: tensor {t.name} has GGML type {type_id}, "
                             "unknown to gguf-py") from None
        if not ne or ne[0] % block:
            raise ValueError(f"glmdiff_hooks: model digest: {path}: tensor {t.name}: shape {list(ne)} is not whole "
                             f"blocks of {block} of its type {t.tensor_type.name}")
        rows = 1
        for d in ne[1:]:
            rows *= d
        nbytes = rows * (ne[0] // block) * block_bytes  # ggml_nbytes
        offset = int(reader.data_offset) + int(t.field.parts[-1][0])  # the data section start + the tensor's offset
        if offset + nbytes > size:
            raise ValueError(f"glmdiff_hooks: model digest: {path}: tensor {t.name}: its data ({nbytes} bytes at "
                             f"offset {offset}) runs past the end of the file ({size} bytes; truncated?)")
        entries.append(TensorEntry(t.name, type_id, ne, nbytes, path, offset))
    return reader, entries


def model_tensors(gguf_path: str | os.PathLike) -> list[TensorEntry]:
    """Every tensor of the model `gguf_path` names, in shard order then file order: one GGUF file, or all shards
    of a split model NAME-0000K-of-0000N.gguf (any shard's name; every shard must be beside it, carry split.no =
    K-1 and split.count = N, and no tensor may be in two shards)."""
    gguf = _gguf()
    path = Path(gguf_path)
    paths = shard_paths(path)
    s = split_name(path)
    if s is not None and not 1 <= s[1] <= s[2]:
        raise ValueError(f"glmdiff_hooks: model digest: {path}: shard number {s[1]} in the file name is outside "
                         f"1..{s[2]}")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"glmdiff_hooks: model digest: {p} does not exist" + (
                f" (shard of the {len(paths)}-shard model {path})" if s is not None else ""))
    out: list[TensorEntry] = []
    where: dict[str, Path] = {}
    for k, p in enumerate(paths):
        reader, entries = _read_shard(gguf, p)
        count = _int_field(gguf, reader, "split.count", p)
        if s is None:
            if count is not None and count > 1:
                raise ValueError(f"glmdiff_hooks: model digest: {p}: the file says it is one of {count} shards "
                                 f"(split.count = {count}), but its name does not follow NAME-0000K-of-{count:05d}"
                                 ".gguf, so the other shards cannot be found")
        elif len(paths) > 1 or count is not None:
            if count != len(paths):
                raise ValueError(f"glmdiff_hooks: model digest: {p}: split.count is {count}, but the model has "
                                 f"{len(paths)} shards: this file belongs to another model")
            no = _int_field(gguf, reader, "split.no", p)
            if no != k:
                raise ValueError(f"glmdiff_hooks: model digest: {p}: split.no is {no}, expected {k} for shard "
                                 f"{k + 1} of {len(paths)}")
        for e in entries:
            if e.name in where:
                raise ValueError(f"glmdiff_hooks: model digest: tensor {e.name} is in both {where[e.name]} and {p}")
            where[e.name] = p
            out.append(e)
    return out


def digest_object(gguf_path: str | os.PathLike, prefix_bytes: int = PREFIX_BYTES) -> dict:
    """The `model_digest` of the model `gguf_path` names, as a dict (tensors sorted by name)."""
    tensors = model_tensors(gguf_path)
    by_name = {t.name: t for t in tensors}
    listed = select_tensors(t.name for t in tensors)
    if not listed:
        raise ValueError(f"glmdiff_hooks: model digest: {gguf_path}: none of the tensors a digest lists "
                         f"(token_embd.weight, output_norm.weight, output.weight, blk.0.*) is in the model")
    return {"algorithm": "sha256", "prefix_bytes": prefix_bytes,
            "tensors": {n: tensor_digest(by_name[n], prefix_bytes) for n in sorted(listed)}}


def encode(obj: dict) -> str:
    """A digest object as its metadata text: compact JSON with sorted keys (as glmdiff writes it)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def model_digest(gguf_path: str | os.PathLike) -> str:
    """The `model_digest` metadata value (JSON text) of the model `gguf_path` names (a GGUF file, or any shard of
    a split model). Raises FileNotFoundError, ValueError (not a GGUF, a broken split) or ImportError (no gguf-py)."""
    return encode(digest_object(gguf_path))
