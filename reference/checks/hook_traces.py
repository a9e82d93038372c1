#!/usr/bin/env python3
"""Checks the glmdiff_hooks package (python/) on the fixture models with transformers, through glmdiff itself.

For every fixture GGUF of engine_dumps.MODELS: the transformers model holding exactly the GGUF's weights
(engine_dumps.model_from_gguf: gguf-py dequantization, the inverse of llama.cpp's converter layout) runs the
golden traces' prompts in each --dtype as transformers runs it (no patched arithmetic); glmdiff_hooks records
the trace; then `glmdiff run GGUF --against trace:T --mode both --json J` must exit 0 with every compared hook
passing and nothing missing but what the trace lists in `not_captured`.

Only the q_a / kv_a RMSNorm eps is set to rms_norm_eps, as in the GGUF (transformers builds them with 1e-6;
shared/spec/glm5-architecture.md section 5) unless --transformers-eps keeps transformers' value (then glmdiff
names the q_a_norm / kv_a_norm step in float32 and float64: a real spec deviation).

--commit DIR also writes the float32 short-prompt traces of two models (a GLM-5 and a quantized DeepSeek-V3)
with a MANIFEST.json into DIR (fixtures/hooks): CI then checks the hook script's format and `not_captured`
handling without Python.

Usage: python3 reference/checks/hook_traces.py [--glmdiff target/release/glmdiff] [--dtype float32 ...] [--commit fixtures/hooks]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "fixtures"))  # engine_dumps
sys.path.insert(0, str(REPO / "python"))  # the glmdiff_hooks package of this checkout, installed or not

import engine_dumps as ed  # noqa: E402
import glmdiff_hooks  # noqa: E402

#: model dir -> prompt whose float32 trace is committed with --commit.
COMMIT = {"glm5-tiny": "short", "dsv3-tiny-q": "short"}


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def trace_model(model, ids: list[int]) -> glmdiff_hooks.Trace:
    dev = next(model.parameters()).device
    with glmdiff_hooks.capture_transformers(model) as rec, torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=dev), use_cache=False)
    if not torch.equal(out.logits[0].cpu(), rec.t["logits"]):
        raise SystemExit("the recorded logits are not the model's output")
    return rec


def run_glmdiff(glmdiff: str, gguf: Path, trace: Path, tmp: Path) -> dict:
    j = tmp / "r.json"
    p = subprocess.run([glmdiff, "run", str(gguf), "--against", f"trace:{trace}", "--mode", "both",
                        "--json", str(j), "--no-cache"], capture_output=True, text=True)
    res = {"exit": p.returncode}
    if p.returncode not in (0, 1):
        res["error"] = p.stderr.strip()
        return res
    d = json.loads(j.read_text())
    worst = (0.0, "")
    statuses: dict[str, int] = {}
    for r in d["records"]:
        for m in ("replay", "chained"):
            x = r[m]
            if x is None:
                continue
            statuses[x["status"]] = statuses.get(x["status"], 0) + 1
            if x["status"] in ("pass", "fail") and x["error"] and x["allowed"]:
                ratio = x["error"] / x["allowed"]
                if ratio > worst[0]:
                    worst = (ratio, f"{r['hook']} {m} {x['error']:.3g} / {x['allowed']:.3g}")
    res.update(verdict=d["verdict"], statuses=statuses, worst_error_over_allowed=worst[1] or "0",
               worst_ratio=worst[0], first_divergence=(d["first_divergence"] or {}).get("hook"),
               top1=(d["logits"] or {}).get("chained", {}).get("top1_agreement"),
               max_kl=(d["logits"] or {}).get("chained", {}).get("max_kl"))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--glmdiff", default=str(REPO / "target" / "release" / "glmdiff"))
    ap.add_argument("--dtype", action="append", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--transformers-eps", action="store_true")
    ap.add_argument("--commit", default=None, help="write the committed float32 traces and MANIFEST.json here")
    args = ap.parse_args()
    dtypes = args.dtype or ["float32", "float64", "bfloat16"]
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    results: dict = {}
    failed = []
    committed = {}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for mdir, gname in ed.MODELS.items():
            if args.only and mdir not in args.only:
                continue
            gguf = ed.FIXTURES / mdir / gname
            model32, meta, _ = ed.model_from_gguf(gguf)
            goldens = ed.golden_traces(mdir, gname)
            for dt in dtypes:
                if dt == "bfloat16":
                    model = ed.bf16_model(model32, "cpu", None)  # transformers' own bf16 load
                else:
                    import copy

                    model = copy.deepcopy(model32).to(getattr(torch, dt))
                if not args.transformers_eps:
                    ed.golden.fix_mla_norm_eps(model)
                for pname, gpath in goldens.items():
                    gmeta, _ = ed.load_trace(gpath)
                    ids = json.loads(gmeta["tokens"])
                    rec = trace_model(model, ids)
                    out = tmp / f"{mdir}.{pname}.{dt}.trace.safetensors"
                    rec.save(out, model_file=gname, models=json.loads(gmeta["models"]), tokens=ids,
                             prompt=gmeta.get("prompt"))
                    r = run_glmdiff(args.glmdiff, gguf, out, tmp)
                    r["not_captured"] = rec.missing()
                    key = f"{mdir}/{pname}/{dt}"
                    results[key] = r
                    # near-tie flips and the drift after them are a correct low-precision engine's
                    ok = r["exit"] == 0 and set(r.get("statuses", {})) <= {"pass", "near_tie", "drift"} | (
                        {"missing"} if r["not_captured"] else set())
                    print(f"{key}: exit {r['exit']} {r.get('verdict')} statuses {r.get('statuses')} worst "
                          f"{r.get('worst_error_over_allowed')} top1 {r.get('top1')} max_kl {r.get('max_kl')}"
                          f"{'' if ok else '  <-- FAIL'}{' ' + r['error'] if 'error' in r else ''}", flush=True)
                    if not ok:
                        failed.append(key)
                    if args.commit and dt == "float32" and COMMIT.get(mdir) == pname:
                        dst = Path(args.commit) / mdir / f"{mdir}.{pname}.hooks-f32.trace.safetensors"
                        rec.save(dst, model_file=gname, models=json.loads(gmeta["models"]), tokens=ids,
                                 prompt=gmeta.get("prompt"))
                        committed[str(dst.relative_to(args.commit))] = {
                            "sha256": sha256(dst), "gguf": gname, "gguf_sha256": sha256(gguf),
                            "tokens": ids, "glmdiff_run": r}
    if args.commit:
        import safetensors
        import transformers

        manifest = {
            "script": "reference/checks/hook_traces.py", "command": " ".join(["python3", "reference/checks/hook_traces.py"] + sys.argv[1:]),
            "hook_module": f"python/glmdiff_hooks {glmdiff_hooks.__version__}",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "safetensors": safetensors.__version__},
            "seeds": {"torch.manual_seed": 0},
            "notes": [
                "transformers runs the fixture GGUF's weights (reference/fixtures/engine_dumps.py model_from_gguf) in float32 "
                "as it builds the model (eager attention and experts), only q_a/kv_a RMSNorm eps set to the GGUF's "
                "rms_norm_eps; glmdiff_hooks records every hook with forward hooks (no patched arithmetic)",
                "glmdiff_run: `glmdiff run GGUF --against trace:FILE --mode both` when the trace was made",
            ],
            "files": committed,
            "all_checks": results,
        }
        (Path(args.commit) / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if failed:
        raise SystemExit(f"FAILED: {failed}")
    print(f"all {len(results)} traces pass `glmdiff run --against trace: --mode both`")


if __name__ == "__main__":
    main()
