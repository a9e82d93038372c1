"""The safetensors writer of traces: numpy arrays in, a file glmdiff (and the `safetensors` package) reads.

Needs numpy only. Keys are sorted and the header is compact JSON, so identical traces give identical bytes.
Floats are stored as F32 or F64, ids as I32 (docs/hooks.md); anything else is refused rather than converted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

#: numpy dtype -> safetensors dtype of the values a trace may hold.
DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}


def encode_safetensors(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
    """The bytes of a safetensors file: an 8-byte little-endian header length, the JSON header (`__metadata__`
    first, then the tensors in sorted order, space-padded to a multiple of 8 bytes), then the little-endian
    row-major data in the same order."""
    header: dict = {"__metadata__": {str(k): str(meta[k]) for k in sorted(meta)}}
    blobs, off = [], 0
    for k in sorted(tensors):
        v = np.asarray(tensors[k])
        st = DTYPES.get(v.dtype.newbyteorder("="))
        if st is None:
            raise ValueError(f"glmdiff_hooks: tensor {k}: dtype {v.dtype} is not float64, float32 or int32")
        raw = np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("<")).tobytes()
        header[k] = {"dtype": st, "shape": [int(d) for d in v.shape], "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    return len(hb).to_bytes(8, "little") + hb + b"".join(blobs)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> Path:
    """Writes encode_safetensors(tensors, meta) to `path` atomically (a temporary file beside it, renamed)."""
    path = Path(path)
    data = encode_safetensors(tensors, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
