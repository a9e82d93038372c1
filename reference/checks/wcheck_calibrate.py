#!/usr/bin/env python3
"""Measure how well `quant::noise` (the expected rounding error of each GGML type, read from its
block scales) predicts the real error of llama.cpp's quantizers.

For every type, tensors of several distributions (Gaussian, Laplace, Student-t(4), Gaussian with a
log-normal scale per row, each with and without a log-normal importance matrix of sigma 1 or 2) are quantized
with ggml's own `ggml_quantize_chunk` (reference/oracles/ggml_quant.py) and written twice with gguf-py: as
F32 (`ref.gguf`) and quantized (`q.gguf`). Then
`glmdiff weights-check q.gguf --gguf ref.gguf --json out.json` measures NMSE / expected per tensor,
and this script prints the ratio per type (min, max). Not part of CI; the numbers are quoted in
src/quant/noise.rs.

Usage: python3 reference/checks/wcheck_calibrate.py [--llama-cpp DIR] [--glmdiff BIN] [--rows R --cols C]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf import quants as gq

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / "work"
sys.path.insert(0, str(HERE.parent / "oracles"))  # ggml_quant
from ggml_quant import GgmlQuant, build_libggml  # noqa: E402

TYPES = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
         Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL,
         Q.IQ4_XS, Q.MXFP4, Q.TQ1_0, Q.TQ2_0]
SEED = 20240601


def data(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    if kind == "gauss":
        x = rng.standard_normal((rows, cols))
    elif kind == "laplace":
        x = rng.laplace(size=(rows, cols))
    elif kind == "t4":
        x = rng.standard_t(4, size=(rows, cols))
    elif kind == "rowscale":
        x = rng.standard_normal((rows, cols)) * np.exp(rng.normal(0, 1.0, (rows, 1)))
    else:
        raise ValueError(kind)
    return (0.02 * x).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", default=str(WORK / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"))
    ap.add_argument("--glmdiff", default="target/release/glmdiff")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--out", default=str(WORK / "calib"))
    args = ap.parse_args()
    q = GgmlQuant(build_libggml(Path(args.llama_cpp)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    wr = GGUFWriter(str(out / "ref.gguf"), "calib")
    wq = GGUFWriter(str(out / "q.gguf"), "calib")
    for t in TYPES:
        for kind in ("gauss", "laplace", "t4", "rowscale"):
            for imat in ("none", "imatrix1", "imatrix2"):
                x = data(kind, args.rows, args.cols, rng)
                sigma = {"none": 0.0, "imatrix1": 1.0, "imatrix2": 2.0}[imat]
                im = np.exp(rng.normal(0, sigma, args.cols)).astype(np.float32) if sigma else None
                if im is None and t in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S):
                    im = np.ones(args.cols, np.float32)  # ggml needs one; uniform weights
                name = f"cal.{t.name}.{kind}.{imat}"
                wr.add_tensor(name, x)
                if t == Q.F16:
                    wq.add_tensor(name, x.astype(np.float16))
                elif t == Q.BF16:
                    wq.add_tensor(name, gq.quantize(x, Q.BF16), raw_dtype=Q.BF16)
                else:
                    wq.add_tensor(name, q.quantize(t, x, im), raw_dtype=t)
    for w in (wr, wq):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    js = out / "out.json"
    subprocess.run([args.glmdiff, "weights-check", str(out / "q.gguf"), "--gguf", str(out / "ref.gguf"),
                    "--json", str(js)], stdout=subprocess.DEVNULL)
    doc = json.loads(js.read_text())
    by_type: dict[str, list] = {}
    for r in doc["tensors"]:
        t = r["name"].split(".")[1]
        ratio = r["nmse"] / r["expected_nmse"] if r["expected_nmse"] else float("nan")
        by_type.setdefault(t, []).append((ratio, r["nmse"], r["name"].split(".", 2)[2]))
    print(f"{'type':8} {'min ratio':>9} {'max ratio':>9}  {'NMSE range':>22}  worst case")
    for t, v in by_type.items():
        lo, hi = min(v), max(v)
        print(f"{t:8} {lo[0]:9.3f} {hi[0]:9.3f}  {min(x[1] for x in v):10.3e}..{max(x[1] for x in v):10.3e}  {hi[2]}")


if __name__ == "__main__":
    main()
