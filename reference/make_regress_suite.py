#!/usr/bin/env python3
"""Writes the fixture regression suites of `glmdiff regress`: fixtures/regress/suite.toml (CPU candidates and
traces, run by .ci/run and the tests) and suite-cuda.toml (the same cases against the CUDA engine).

The pinned top-5 token ids (`expect_top5`) come from the committed float64 transformers traces
(fixtures/models/*/*.trace.safetensors, reference/golden.py): per position the five most likely next tokens of
log_softmax(logits) in float64, most likely first. Each pin is kept only where every gap between consecutive
ranks 1..6 is above MIN_GAP nats, so that an engine computing in float32 cannot reorder them by rounding; the
smallest gap per case is recorded in MANIFEST.json with the sha256 of every source trace.

Usage: python3 reference/make_regress_suite.py   (deterministic: the same inputs give the same bytes)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "fixtures" / "regress"
MIN_GAP = 1e-6

#: (name, model dir, GGUF, prompt: "short"/"long", how the prompt is given, candidate, extra TOML lines, pin).
#: candidate "golden" is the model's float64 trace of that prompt; "hooks" the committed glmdiff_hooks trace;
#: a string starting with "trace:" is taken as is (relative to fixtures/regress/). In the CUDA suite every
#: candidate is "cuda" and cases marked cpu_only are left out.
CASES = [
    dict(name="glm5-f32-prompt", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt="short", given="prompt",
         against="cpu", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="glm5-f16-golden", dir="glm5-tiny", gguf="glm5-tiny-f16.gguf", prompt="long", given="tokens",
         against="golden", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="glm5-q-layer1", dir="glm5-tiny-q", gguf="glm5-tiny-q-mixed.gguf", prompt="short", given="tokens",
         against="cpu", extra=["layer = 1", "max_kl = 1e-6"], pin=True),
    dict(name="glm5-q-golden-replay", dir="glm5-tiny-q", gguf="glm5-tiny-q-mixed.gguf", prompt="long",
         given="trace", against="golden", extra=['mode = "replay"', "top1_agreement = 1.0"], pin=False),
    dict(name="dsv3-f32-layers", dir="dsv3-tiny", gguf="dsv3-tiny-f32.gguf", prompt="long", given="tokens",
         against="cpu", extra=['layers = "1..3"', 'hook = ["blk.*.attn_*", "blk.*.moe_*", "blk.*.l_out", "logits"]',
                               "max_kl = 1e-6", "[case.tol]", '"blk.*.moe_*" = 1e-5'], pin=True),
    dict(name="dsv3-f16-golden", dir="dsv3-tiny", gguf="dsv3-tiny-f16.gguf", prompt="short", given="tokens",
         against="golden", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="dsv3-q-golden", dir="dsv3-tiny-q", gguf="dsv3-tiny-q-mixed.gguf", prompt="long", given="trace",
         against="golden", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="glm5-hooks-f32", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt="short", given="trace",
         against="hooks", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="dsv3-q-hooks-f32", dir="dsv3-tiny-q", gguf="dsv3-tiny-q-mixed.gguf", prompt="short",
         given="trace", against="hooks", extra=["max_kl = 1e-6", "top1_agreement = 1.0"], pin=True),
    dict(name="glm5-planted-kv_b_concat", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt=None, given="trace",
         against="trace:../engines/glm5-tiny/glm5-tiny.dsa.cuda-bf16.kv_b_concat.trace.safetensors",
         extra=['expect_divergence = "blk.1.attn_heads"'], pin=False, cpu_only=True),
]


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def golden(mdir: str, prompt: str) -> Path:
    return REPO / "fixtures" / "models" / mdir / f"{mdir}.{prompt}.trace.safetensors"


def hooks_trace(mdir: str, prompt: str) -> Path:
    return REPO / "fixtures" / "hooks" / mdir / f"{mdir}.{prompt}.hooks-f32.trace.safetensors"


def top5(path: Path) -> tuple[list[list[int]], float]:
    """Per position the 5 most likely ids of the float64 logits, and the smallest gap between ranks 1..6."""
    logits = load_file(str(path))["logits"].astype(np.float64)  # [T, vocab]
    lp = logits - logits.max(axis=1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))
    pins, gap = [], float("inf")
    for row in lp:
        order = np.argsort(-row, kind="stable")
        top6 = row[order[:6]]
        gap = min(gap, float(np.min(top6[:-1] - top6[1:])))
        pins.append([int(i) for i in order[:5]])
    return pins, gap


def meta(path: Path) -> dict:
    with safe_open(str(path), "np") as f:
        return f.metadata()


def toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def write_suite(path: Path, cuda: bool, manifest: dict) -> None:
    lines = [
        "# Generated by reference/make_regress_suite.py: do not edit by hand.",
        "# The regression suite of the fixture models" + (" against the CUDA engine" if cuda else "") + ":",
        "# `glmdiff regress fixtures/regress/" + path.name + "`. Pinned top-5 ids: the float64 transformers traces.",
        "",
    ]
    for c in CASES:
        if cuda and c.get("cpu_only"):
            continue
        src = golden(c["dir"], c["prompt"]) if c["prompt"] else None
        m = meta(src) if src else None
        lines += ["[[case]]", f"name = {toml_str(c['name'])}", "model = " + toml_str("../models/" + c["dir"] + "/" + c["gguf"])]
        ids = json.loads(m["tokens"]) if m else None
        if c["given"] == "prompt":
            lines.append(f"prompt = {toml_str(m['prompt'])}")
        elif c["given"] == "tokens":
            lines.append(f"tokens = {json.dumps(ids)}")
        elif cuda and ids is not None:  # the CUDA engine needs the tokens a trace brought
            lines.append(f"tokens = {json.dumps(ids)}")
        if cuda:
            against = "cuda"
        elif c["against"] == "golden":
            against = f"trace:../models/{c['dir']}/{src.name}"
        elif c["against"] == "hooks":
            against = f"trace:../hooks/{c['dir']}/{hooks_trace(c['dir'], c['prompt']).name}"
        else:
            against = c["against"]
        lines.append(f"against = {toml_str(against)}")
        tables = []
        for e in c["extra"]:
            (tables if tables or e.startswith("[") else lines).append(e)
        entry = {"source_trace": str(src.relative_to(REPO)) if src else None,
                 "source_sha256": sha256(src) if src else None}
        if c["pin"]:
            pins, gap = top5(src)
            if gap <= MIN_GAP:
                raise SystemExit(f"{c['name']}: top-5 gap {gap:.3g} <= {MIN_GAP}: choose another prompt")
            lines.append("expect_top5 = [" + ", ".join(json.dumps(p) for p in pins) + "]")
            entry["expect_top5_min_gap_nats"] = gap
        lines += tables
        lines.append("")
        manifest["cases"].setdefault(c["name"], entry)
    path.write_text("\n".join(lines))
    manifest["files"][path.name] = sha256(path)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    import numpy
    import safetensors

    manifest = {"script": "reference/make_regress_suite.py", "command": "python3 reference/make_regress_suite.py",
                "versions": {"python": sys.version.split()[0], "numpy": numpy.__version__,
                             "safetensors": safetensors.__version__},
                "min_gap_nats": MIN_GAP, "cases": {}, "files": {}}
    write_suite(OUT / "suite.toml", False, manifest)
    write_suite(OUT / "suite-cuda.toml", True, manifest)
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}/suite.toml, suite-cuda.toml, MANIFEST.json")


if __name__ == "__main__":
    main()
