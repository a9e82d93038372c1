#!/usr/bin/env python3
"""Optional cross-check of the model fixtures against llama.cpp itself (CPU, F32 KV cache).

  python3 reference/checks/llama_check.py prepare [--sdist PATH]      # source subset + command files
  bash reference/checks/llama_check.sh                                # build libllama + llama_check.c, run
  python3 reference/checks/llama_check.py compare OUTDIR [--record]   # compare; --record: into MANIFEST.json

`prepare` unpacks the llama.cpp sources needed for libllama from the llama-cpp-python sdist into
reference/work/llamacpp-src and writes one command file per GGUF into reference/work/llama_check/
(tokenize every tokenizer test text, evaluate both prompts). `compare` checks llama.cpp's token ids
against the transformers ids in tokenizer_tests.json and its logits against the traces.
llama.cpp quantizes activations for quantized matmuls, so on the mixed files only agreement of the
top token and a small KL is expected (spec section 5).
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORK = REPO / "reference" / "work"
FIX = REPO / "fixtures" / "models"
SRC = WORK / "llamacpp-src"
CMDS = WORK / "llama_check"
KEEP = ("CMakeLists.txt", "cmake/", "ggml/", "src/", "include/", "common/", "vendor/", "licenses/", "LICENSE")


def ggufs():
    for d in sorted(p for p in FIX.iterdir() if p.is_dir()):
        for g in sorted(d.glob("*.gguf")):
            yield d, g


def prepare(sdist: Path) -> None:
    top = None
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            if m.name.endswith("/vendor/llama.cpp/CMakeLists.txt"):
                top = m.name[: -len("CMakeLists.txt")]
                break
        members = []
        for m in tf.getmembers():
            if m.name.startswith(top) and m.name[len(top):].startswith(KEEP):
                m.name = m.name[len(top):]
                members.append(m)
        SRC.mkdir(parents=True, exist_ok=True)
        tf.extractall(SRC, members=members, filter="data")
    CMDS.mkdir(parents=True, exist_ok=True)
    for d, g in ggufs():
        tok = json.loads((d / "tokenizer_tests.json").read_text())
        lines = [f"T {p['text'].encode('utf-8').hex()}" for p in tok["pairs"]]
        lines += [f"T {p['text'].encode('utf-8').hex()}" for p in tok["prompts"].values()]
        for name, p in tok["prompts"].items():
            lines.append(f"E {','.join(map(str, p['ids']))} @OUT@/{g.stem}.{name}.f32")
        (CMDS / f"{g.name}.cmds").write_text("\n".join(lines) + "\n")
    print(f"sources in {SRC}, commands in {CMDS}")


def compare(outdir: Path, record: dict | None = None) -> int:
    from safetensors.numpy import load_file

    bad = 0
    for d, g in ggufs():
        out = outdir / f"{g.name}.out"
        if not out.exists():
            print(f"{g.name}: no output ({(outdir / (g.name + '.err')).read_text()[-500:] if (outdir / (g.name + '.err')).exists() else ''})")
            bad += 1
            continue
        tok = json.loads((d / "tokenizer_tests.json").read_text())
        want = [p["ids"] for p in tok["pairs"]] + [p["ids"] for p in tok["prompts"].values()]
        texts = [p["text"] for p in tok["pairs"]] + [p["text"] for p in tok["prompts"].values()]
        got = [[int(x) for x in ln[2:].split(",") if x] for ln in out.read_text().splitlines() if ln.startswith("T")]
        mism = [(t, w, gg) for t, w, gg in zip(texts, want, got) if w != gg]
        print(f"{g.name}: tokenizer {len(got) - len(mism)}/{len(want)} texts equal")
        rec = {"tokenizer_texts_equal": f"{len(got) - len(mism)}/{len(want)}", "gguf_sha256": sha256(g)}
        if record is not None:
            record[g.name] = rec
        for t, w, gg in mism:
            print(f"   {t!r}: hf {w} llama.cpp {gg}")
        bad += len(mism) + (len(got) != len(want))
        for name, p in tok["prompts"].items():
            tr = load_file(str(d / f"{d.name}.{name}.trace.safetensors"))["logits"]
            f = outdir / f"{g.stem}.{name}.f32"
            if not f.exists():
                print(f"   {name}: no logits")
                bad += 1
                continue
            lg = np.fromfile(f, dtype="<f4").astype(np.float64).reshape(tr.shape)
            ls_t = tr - np.log(np.exp(tr - tr.max(-1, keepdims=True)).sum(-1, keepdims=True)) - tr.max(-1, keepdims=True)
            ls_l = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
            kl = float((np.exp(ls_t) * (ls_t - ls_l)).sum(-1).max())
            top = float((tr.argmax(-1) == lg.argmax(-1)).mean())
            rel = float(np.abs(tr - lg).max() / np.abs(tr).max())
            print(f"   {name}: max|dlogit|/max|logit| {rel:.3g}  max KL {kl:.3g}  top-1 agreement {top:.3f}")
            rec[name] = {"max_rel_logit_diff": rel, "max_kl": kl, "top1_agreement": top}
    return bad


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "prepare":
        sdist = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--sdist" else \
            next((WORK / "dl").glob("llama_cpp_python-*.tar.gz"))
        prepare(sdist)
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "compare":
        record: dict = {}
        bad = compare(Path(sys.argv[2]), record)
        if sys.argv[3:] == ["--record"]:
            mpath = FIX / "MANIFEST.json"
            manifest = json.loads(mpath.read_text())
            manifest["llama_cpp_cpu_check"] = {
                "what": "reference/checks/llama_check.{py,sh,c}: libllama from the same llama.cpp source, CPU backend, "
                        "F32 KV cache, no repacked weight buffers; logits of both prompts vs the float64 traces, "
                        "llama_tokenize(add_special=false) vs the transformers ids",
                "results": record,
            }
            mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        sys.exit(1 if bad else 0)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
