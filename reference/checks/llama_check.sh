#!/bin/bash
# Build libllama (CPU only) and reference/checks/llama_check.c, then run every command file written by
# `python3 reference/checks/llama_check.py prepare`. Outputs go to $OUT (default /tmp/llama_check_out).
set -euo pipefail
ROOT=$(pwd)
SRC=$ROOT/reference/work/llamacpp-src
OUTD=${OUT:-/tmp/llama_check_out}
mkdir -p "$OUTD"
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_BUILD_COMMON=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF > "$OUTD/cmake.log" 2>&1
cmake --build "$SRC/build" -j"$(nproc)" --target llama > "$OUTD/build.log" 2>&1
LIB=$(dirname "$(find "$SRC/build" -name 'libllama.so*' | head -1)")
cc -O2 -I"$SRC/include" -I"$SRC/ggml/include" "$ROOT/reference/checks/llama_check.c" -L"$LIB" -lllama \
    -Wl,-rpath,"$LIB" -o "$SRC/build/llama_check"
for f in "$ROOT"/reference/work/llama_check/*.cmds; do
    name=$(basename "$f" .cmds)
    model=$(ls "$ROOT"/fixtures/models/*/"$name")
    rc=0
    sed "s#@OUT@#$OUTD#g" "$f" | "$SRC/build/llama_check" "$model" > "$OUTD/$name.out" 2> "$OUTD/$name.err" || rc=$?
    echo "$name exit $rc" >> "$OUTD/status.txt"
done
ls -la "$OUTD"
