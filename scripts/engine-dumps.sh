#!/usr/bin/env bash
# bf16 engine dumps of the tiny fixture models on the GPU machine (reference/fixtures/engine_dumps.py).
# Runs from the repository root; needs .whl/gguf-*.whl (gguf-py, pure Python) beside it and writes
#   $OUT/engines.tar  (engines/<model-dir>/*.trace.safetensors, engines/MANIFEST.json, engines/README.md)
#   $OUT/dumps.log
# Unpack into the repository with: tar -C fixtures -xf engines.tar
# XZ=1 writes $OUT/engines.tar.xz instead (the engine-bug sets make ~30 MB of traces, ~12 MB compressed).
# DEVICES (default "cuda cpu"; the first one also runs the fp8-indexer and planted variants), PYTHON, SITE.
# Extra arguments go to engine_dumps.py. Engine bugs (catalogue: python3 reference/fixtures/engine_bugs.py), every
# kind at its realistic and subtle size on every model it applies to, on the random prompts:
#   OUT=/tmp/bugs bash scripts/engine-dumps.sh --random-only --bug-set all
# or chosen ones: ... --random-only --bug o_proj_scale:1.01 --bug expert_scale:1.02@2 --bug dsa_topk:6 [--bug-long]
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
PY=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE" "$OUT"
shopt -s nullglob
wheels=(.whl/*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "no wheels under .whl/" >&2; exit 2; }
if ! "$PY" -m pip install -q --upgrade --no-index --no-deps --target "$SITE" "${wheels[@]}"; then
    # pure-Python wheels are zip files: unpack them directly when pip is not usable
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "${wheels[@]}"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONHASHSEED=0
"$PY" -c 'import torch, transformers, gguf.quants; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
work=$(mktemp -d)
start=$(date +%s)
set +e
devargs=()
for d in ${DEVICES:-cuda cpu}; do devargs+=(--device "$d"); done
"$PY" reference/fixtures/engine_dumps.py "${devargs[@]}" --out "$work/engines" \
    --made-on "scripts/engine-dumps.sh on $(hostname)" "$@" > "$OUT/dumps.log" 2>&1
rc=$?
set -e
if [ $rc -ne 0 ]; then
    tail -c 8000 "$OUT/dumps.log"
    echo "engine_dumps.py failed (rc $rc)"
    exit $rc
fi
tar -C "$work" -cf "$OUT/engines.tar" engines
tarball="$OUT/engines.tar"
if [ -n "${XZ:-}" ]; then
    if command -v xz >/dev/null; then
        xz -T0 -f "$OUT/engines.tar"
    else
        "$PY" -c 'import lzma, os, shutil, sys
with open(sys.argv[1], "rb") as i, lzma.open(sys.argv[1] + ".xz", "wb") as o:
    shutil.copyfileobj(i, o)
os.remove(sys.argv[1])' "$OUT/engines.tar"
    fi
    tarball="$OUT/engines.tar.xz"
fi
awk '/^== summary/{exit} /^(==|   )/' "$OUT/dumps.log" | tail -n 60
sed -n '/^== summary/,$p' "$OUT/dumps.log"
echo "$(basename "$tarball"): $(stat -c %s "$tarball") bytes; fixtures total $(du -sb "$work/engines" | cut -f1) bytes; $(( $(date +%s) - start )) s"
