#!/usr/bin/env python3
"""Correct bf16 engines over prompt lengths: transformers in bf16 (eager and SDPA attention, on the GPU
and on the CPU, and with an FP8 DSA indexer on GLM-5 on the first device) on the tiny fixture models, on seeded random
prompts of 12 to 4096 tokens, each dump judged by `glmdiff run --against trace: --mode both`.

A correct engine must come out clean at every length: DeepSeek-V3 tiny ships YaRN RoPE (original
context 256, factor 40), so its long prompts run past the original context, where the RoPE tables'
rounding, shared by every head and (through the single `k_pe` head) by every query, is largest;
GLM-5 tiny's DSA indexer prunes past its top-k, so long prompts flip near-tie keys. None of these
prompts or lengths were used to set any floor or tolerance (a held-out check).

Uses reference/fixtures/engine_dumps.py's model loading, bf16 engine and hook recording (the code of
the committed engine dumps). Prints one line per dump and a summary; with --keep DIR, copies the dumps
of the lengths given by --keep-lengths there.

Usage: python3 reference/checks/length_sweep.py --glmdiff BIN [--lengths 12,48,...]
    [--models glm5-tiny,dsv3-tiny] [--devices cuda,cpu] [--attn eager,sdpa] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(REPO / "reference" / "fixtures"), str(REPO / "reference" / "oracles")]

import engine_dumps as ed  # noqa: E402

#: First seed of each model's prompts; a prompt of length n uses seed + n (other seeds than the
#: committed dumps': 7100..7400 plus their scans).
SEED = {"glm5-tiny": 91_000, "dsv3-tiny": 92_000}


def judge(glmdiff: str, model: Path, trace: Path, js: Path) -> tuple[int, str, float]:
    t0 = time.time()
    p = subprocess.run([glmdiff, "run", str(model), "--against", f"trace:{trace}", "--mode", "both",
                        "--json", str(js), "--wide"], capture_output=True, text=True)
    dt = time.time() - t0
    what = ""
    if js.exists():
        try:
            j = json.loads(js.read_text())
            what = json.dumps({"replay": j.get("first_divergence"),
                               "chained": j.get("first_divergence_chained")})[:600]
        except Exception as e:  # noqa: BLE001
            what = f"json unreadable: {e!r}"
    if p.returncode != 0:
        lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
        keep = [l for l in lines if any(w in l for w in ("FAIL", "systematic", "first divergence", "error",
                                                          "flip", "sub-floor"))]
        what += " | " + " // ".join((keep or lines)[-6:])[:900]
    return p.returncode, what, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--glmdiff", required=True)
    ap.add_argument("--lengths", default="12,24,48,96,200,300,512,1024,2048,4096")
    ap.add_argument("--models", default="dsv3-tiny,glm5-tiny")
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--work", default="/tmp/length-sweep")
    ap.add_argument("--keep", default=None, help="copy the dumps of --keep-lengths here")
    ap.add_argument("--keep-lengths", default="")
    args = ap.parse_args()
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    keep_lengths = {int(x) for x in args.keep_lengths.split(",") if x}
    rows = []
    t_start = time.time()
    for mdir in args.models.split(","):
        gname = ed.MODELS[mdir]
        gpath = ed.FIXTURES / mdir / gname
        model32, meta, _ = ed.model_from_gguf(gpath)
        arch_g = meta["general.architecture"]
        arch = ed.HF_ARCH[arch_g]
        pool = ed.normal_ids(meta)
        for attn in args.attn.split(","):
            ed.ATTN_IMPL = attn
            for dev in args.devices.split(","):
                if dev.startswith("cuda") and not torch.cuda.is_available():
                    continue
                eng = ed.bf16_model(model32, dev, None)
                first = dev == args.devices.split(",")[0]
                variants = [False] + ([True] if arch == "glm_moe_dsa" and first else [])
                for n in lengths:
                    ids = ed.random_prompt(pool, SEED[mdir] + n, n)
                    for fp8 in variants:
                        rec = ed.bf16_trace(eng, arch, ids, indexer_fp8=fp8)
                        tag = f"{mdir}.len{n}.{dev.split(':')[0]}-bf16-{attn}" + (".fp8idx" if fp8 else "")
                        md = {"glmdiff_trace": "1", "model": gname, "architecture": arch_g,
                              "tokens": json.dumps(ids),
                              "engine": f"transformers {dev} bf16 attn {attn} ({ed.device_name(dev)}; torch "
                                        f"{torch.__version__})",
                              "dtype": "bf16 weights and activations (router and indexer scores f32 as "
                                       "transformers computes them)",
                              "mode": "chained", "made_by": "reference/checks/length_sweep.py",
                              "prompt_seed": str(SEED[mdir] + n)}
                        if fp8:
                            md["indexer_dtype"] = "fp8"
                        p = work / f"{tag}.trace.safetensors"
                        ed.write_trace(p, rec.t, md)
                        rc, what, dt = judge(args.glmdiff, gpath, p, work / f"{tag}.json")
                        rows.append({"dump": tag, "tokens": n, "rc": rc, "what": what, "judge_s": round(dt, 1)})
                        print(f"{tag}: rc {rc} ({dt:.1f} s) {what if rc else ''}", flush=True)
                        if args.keep and n in keep_lengths:
                            Path(args.keep).mkdir(parents=True, exist_ok=True)
                            shutil.copy(p, Path(args.keep) / p.name)
                        if rc == 0:
                            p.unlink()
                del eng
    (work / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    by = {}
    for r in rows:
        by[r["rc"]] = by.get(r["rc"], 0) + 1
    print(f"SUMMARY: {len(rows)} dumps, " + ", ".join(f"rc{k}: {v}" for k, v in sorted(by.items()))
          + f"; {time.time() - t_start:.0f} s")
    for r in rows:
        if r["rc"]:
            print(f"  NOT CLEAN {r['dump']}: rc {r['rc']} {r['what']}")


if __name__ == "__main__":
    main()
