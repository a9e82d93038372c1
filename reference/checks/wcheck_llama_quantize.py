#!/usr/bin/env python3
"""End-to-end check of `weights-check` on pairs made the way users make them: llama.cpp's
converter (`--outtype f16 / bf16 / q8_0`) and `llama-quantize` (whole-file types, so its own
per-tensor type choices and fallbacks apply) on the tiny checkpoints of make_wcheck_fixtures.py.
Every pair must pass. Not part of CI (needs llama.cpp built: cmake --build ... --target
llama-quantize); the results are quoted in the README.

Usage: python3 reference/checks/wcheck_llama_quantize.py [--llama-cpp DIR] [--glmdiff BIN]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))  # make_model_fixtures
import make_model_fixtures as mmf  # noqa: E402

WORK = HERE.parent / "work" / "wcheck"
FIX = HERE.parent.parent / "fixtures" / "wcheck"
#: (converter work dir made by make_wcheck_fixtures.py, the fixture checkpoint, tokenizer pre)
SOURCES = [
    ("glm5-tiny", "glm5-tiny-hf", "glm4"),
    ("glm5-tiny-q-bf16", "glm5-tiny-q-bf16-hf", "glm4"),
    ("dsv3-tiny-q-fp8", "dsv3-tiny-q-fp8-hf", "deepseek-v3"),
]
OUTTYPES = ["f16", "bf16", "q8_0"]
FTYPES = ["Q4_K_M", "Q5_K_S", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "Q4_0", "Q5_1", "IQ4_NL"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", default=str(WORK.parent / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"))
    ap.add_argument("--glmdiff", default="target/release/glmdiff")
    args = ap.parse_args()
    llama = Path(args.llama_cpp)
    quantize = llama / "build" / "bin" / "llama-quantize"
    out = WORK / "unseen"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for work, ckpt, pre in SOURCES:
        for ot in OUTTYPES:
            g = out / f"{work}-{ot}.gguf"
            mmf.run_converter(llama, pre, WORK / "hf" / work, ot, g)
            pairs = [(g, ot)]
            if ot == "bf16":
                for ft in FTYPES:
                    q = out / f"{work}-{ft}.gguf"
                    r = subprocess.run([str(quantize), str(g), str(q), ft], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise SystemExit(r.stderr[-2000:])
                    pairs.append((q, ft))
            for path, label in pairs:
                js = out / (path.stem + ".json")
                r = subprocess.run([args.glmdiff, "weights-check", str(path), "--hf", str(FIX / ckpt),
                                    "--json", str(js)], capture_output=True, text=True)
                doc = json.loads(js.read_text())
                types = sorted({t["type"] for t in doc["tensors"]})
                worst = max((t["nmse"] / t["expected_nmse"], t["name"]) for t in doc["tensors"]
                            if t["expected_nmse"] and t["nmse"] is not None)
                rows.append((work, label, r.returncode, worst, types))
                print(f"{work:18} {label:7} exit {r.returncode}  worst {worst[0]:.2f}x ({worst[1]})  {','.join(types)}",
                      flush=True)
    bad = [r for r in rows if r[2] != 0]
    print(f"{len(rows)} pairs, {len(bad)} not clean")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
