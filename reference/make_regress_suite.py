#!/usr/bin/env python3
"""Writes the fixture regression suites of `glmdiff regress`: fixtures/regress/suite.toml (CPU candidates and
traces, run by .ci/run and the tests) and suite-cuda.toml (the same cases against the CUDA engine).

The pinned top-5 token ids (`expect_top5`) come from the committed float64 transformers traces
(fixtures/models/*/*.trace.safetensors, reference/golden.py): per position the five most likely next tokens of
log_softmax(logits) in float64, most likely first. Each pin is kept only where every gap between consecutive
ranks 1..6 is above MIN_GAP nats, so that an engine computing in float32 cannot reorder them by rounding; the
smallest gap per case is recorded in MANIFEST.json with the sha256 of every source trace.

Candidates: `cpu` (a second CPU reference: plumbing, every hook error is 0 by construction; only the pins and the run
machinery can fail), the float64 transformers traces and the glmdiff_hooks.py traces (independent of glmdiff, clean
within the f32 floors), and the transformers bf16 dumps of fixtures/engines/ (reference/engine_dumps.py): clean ones
must pass within the bf16 floors (their `max_kl` is KL_MARGIN x KL(float64 golden || dump), computed here from the two
traces, and their `top1_agreement` the share of positions whose float64 and bf16 top-1 agree), planted ones must
differ with their first divergence at the hook the dump's metadata names (`expect_first_divergence`). Each case of
suite.toml carries a comment saying which of these it is.

Usage: python3 reference/make_regress_suite.py   (deterministic: the same inputs give the same bytes)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "fixtures" / "regress"
MIN_GAP = 1e-6
#: A clean dump's `max_kl` is this times KL(float64 golden || dump) at its worst position (the f32 CPU reference is
#: within 1e-12 of the float64 golden in KL, so the run sees the dump's own KL).
KL_MARGIN = 2.0

#: (name, model dir, GGUF, prompt: "short"/"long"/None, how the prompt is given, candidate, extra TOML lines, pin).
#: candidate "golden" is the model's float64 trace of that prompt; "hooks" the committed glmdiff_hooks trace;
#: "dump:STEM" the engine dump fixtures/engines/<dir>/STEM.trace.safetensors (a planted one, metadata `planted`, gets
#: its `expect_divergence` from the metadata; a clean one with a prompt gets `max_kl` and `top1_agreement` from the
#: float64 golden trace of that prompt); a string starting with "trace:" is taken as is (relative to
#: fixtures/regress/). In the CUDA suite every candidate is "cuda" and cases marked cpu_only are left out.
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
         against="dump:glm5-tiny.dsa.cuda-bf16.kv_b_concat", extra=[], pin=False, cpu_only=True),
    dict(name="glm5-bf16-dump", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt="long", given="trace",
         against="dump:glm5-tiny.long.cuda-bf16", extra=[], pin=True, cpu_only=True),
    dict(name="glm5-dsa-bf16-dump", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt=None, given="trace",
         against="dump:glm5-tiny.dsa.cuda-bf16", extra=[], pin=False, cpu_only=True),
    dict(name="glm5-planted-layer_weight", dir="glm5-tiny", gguf="glm5-tiny-f32.gguf", prompt=None, given="trace",
         against="dump:glm5-tiny.dsa.cuda-bf16.layer_weight", extra=[], pin=False, cpu_only=True),
    dict(name="dsv3-bf16-dump", dir="dsv3-tiny", gguf="dsv3-tiny-f32.gguf", prompt="short", given="trace",
         against="dump:dsv3-tiny.short.cuda-bf16", extra=[], pin=True, cpu_only=True),
    dict(name="dsv3-q-bf16-dump-cpu", dir="dsv3-tiny-q", gguf="dsv3-tiny-q-mixed.gguf", prompt="long", given="trace",
         against="dump:dsv3-tiny-q.long.cpu-bf16", extra=[], pin=True, cpu_only=True),
    dict(name="dsv3-q-planted-expert_swap", dir="dsv3-tiny-q", gguf="dsv3-tiny-q-mixed.gguf", prompt=None,
         given="trace", against="dump:dsv3-tiny-q.long.cuda-bf16.expert_swap", extra=[], pin=False, cpu_only=True),
]


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def golden(mdir: str, prompt: str) -> Path:
    return REPO / "fixtures" / "models" / mdir / f"{mdir}.{prompt}.trace.safetensors"


def hooks_trace(mdir: str, prompt: str) -> Path:
    return REPO / "fixtures" / "hooks" / mdir / f"{mdir}.{prompt}.hooks-f32.trace.safetensors"


def dump(mdir: str, stem: str) -> Path:
    return REPO / "fixtures" / "engines" / mdir / f"{stem}.trace.safetensors"


def read_floats(path: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file as float64 (F64, F32, F16 or BF16, which numpy cannot load itself)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(n))[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        raw = f.read(end - start)
    kinds = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
    if info["dtype"] == "BF16":
        v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        v = np.frombuffer(raw, dtype=kinds[info["dtype"]])
    return v.astype(np.float64).reshape(info["shape"])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def kl_and_top1(golden_path: Path, dump_path: Path) -> tuple[float, float]:
    """KL(golden || dump) at the worst position, and the share of positions whose top-1 ids agree."""
    a, b = read_floats(golden_path, "logits"), read_floats(dump_path, "logits")
    if a.shape != b.shape:
        raise SystemExit(f"{dump_path}: logits {b.shape} vs the golden {a.shape}")
    la, lb = log_softmax(a), log_softmax(b)
    kl = float((np.exp(la) * (la - lb)).sum(axis=1).max())
    top1 = float((a.argmax(axis=1) == b.argmax(axis=1)).mean())
    return kl, top1


def round_up(x: float, digits: int = 2) -> float:
    """x rounded up to `digits` significant digits."""
    e = math.floor(math.log10(x)) - digits + 1
    return math.ceil(x / 10.0**e) * 10.0**e


def note(c: dict, planted: bool) -> str:
    """The comment above a case of suite.toml: what its candidate is and what can fail."""
    a = c["against"]
    if a == "cpu":
        return ("# Plumbing: a second CPU reference is the same deterministic engine, every hook error is 0 by "
                "construction;\n# what can fail is the run machinery and the pins (the reference against transformers' "
                "float64 logits).")
    if a == "golden":
        return "# The float64 transformers trace (independent of glmdiff): clean within the f32 floors."
    if a == "hooks":
        return "# A reference/glmdiff_hooks.py trace (transformers float32, forward hooks): clean within the f32 floors."
    if a.startswith("dump:") and planted:
        return ("# A transformers bf16 dump with a bug planted in its weights (reference/engine_dumps.py): must differ, "
                "first at\n# the hook its metadata names.")
    if a.startswith("dump:") and c["prompt"]:
        return ("# A transformers bf16 dump (reference/engine_dumps.py): a real engine's rounding, clean within the bf16 "
                "floors;\n# max_kl and top1_agreement from its logits against the float64 golden trace.")
    if a.startswith("dump:"):
        return ("# A transformers bf16 dump (reference/engine_dumps.py): a real engine's rounding, clean within the bf16 "
                "floors;\n# its prompt has no float64 trace: the verdict only (the DSA indexer prunes, bf16 flips "
                "some selections).")
    return "# A committed trace."


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
        cand = dump(c["dir"], c["against"][len("dump:"):]) if c["against"].startswith("dump:") else None
        cm = meta(cand) if cand else None
        if cm and m and json.loads(cm["tokens"]) != json.loads(m["tokens"]):
            raise SystemExit(f"{c['name']}: {cand.name} was not run on the tokens of {src.name}")
        planted = bool(cm and "planted" in cm)
        if not cuda:
            lines.append(note(c, planted))
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
        elif cand:
            against = f"trace:../engines/{c['dir']}/{cand.name}"
        else:
            against = c["against"]
        lines.append(f"against = {toml_str(against)}")
        tables = []
        entry = {"source_trace": str(src.relative_to(REPO)) if src else None,
                 "source_sha256": sha256(src) if src else None}
        extra = list(c["extra"])
        if cand and not cuda:
            entry["candidate_trace"] = str(cand.relative_to(REPO))
            entry["candidate_sha256"] = sha256(cand)
            if planted:
                extra.append(f"expect_divergence = {toml_str(cm['expect_first_divergence'])}")
            elif src:
                kl, top1 = kl_and_top1(src, cand)
                extra += [f"max_kl = {round_up(KL_MARGIN * kl):.2g}", f"top1_agreement = {top1!r}"]
                entry["kl_max_vs_golden"], entry["top1_vs_golden"] = kl, top1
        for e in extra:
            (tables if tables or e.startswith("[") else lines).append(e)
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
