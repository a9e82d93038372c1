"""llama.cpp's own quantizers (ggml `ggml_quantize_chunk`, the code `llama-quantize` runs) called
through ctypes on `libggml-base.so` built from the llama.cpp source the fixtures use.

Usage from other reference scripts:
    q = GgmlQuant(lib_path)
    raw = q.quantize(Q.Q4_K, values_f32_2d, imatrix=None)   # uint8 [rows, row_bytes]

`build_libggml(llama_dir)` builds the library with cmake (CPU only) when it is missing.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q


def build_libggml(llama_dir: Path) -> Path:
    """Path of libggml-base.so under llama_dir/build, building it (cmake, CPU only) if needed."""
    build = llama_dir / "build"
    lib = build / "bin" / "libggml-base.so"
    if lib.exists():
        return lib
    subprocess.run(["cmake", "-S", str(llama_dir), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_CUDA=OFF", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                    "-DGGML_OPENMP=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "ggml-base"], check=True)
    return lib


class GgmlQuant:
    """ctypes wrapper of ggml_quantize_init / ggml_quantize_chunk / ggml_quantize_requires_imatrix."""

    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p]
        self.lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool

    def requires_imatrix(self, qtype: Q) -> bool:
        return bool(self.lib.ggml_quantize_requires_imatrix(int(qtype)))

    def quantize(self, qtype: Q, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """Quantize rows of x ([rows, n_per_row] float32) to qtype; returns uint8 [rows, row_bytes].

        For a 3-D expert tensor pass one expert at a time (imatrix is per column of that expert).
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        block, size = GGML_QUANT_SIZES[qtype]
        if n % block:
            raise ValueError(f"row length {n} is not a multiple of the {qtype.name} block {block}")
        out = np.zeros((rows, n // block * size), dtype=np.uint8)
        im = None
        if imatrix is not None:
            im = np.ascontiguousarray(imatrix, dtype=np.float32)
            assert im.shape == (n,)
        self.lib.ggml_quantize_init(int(qtype))
        written = self.lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n,
                                               None if im is None else im.ctypes.data)
        if written != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
        return out
