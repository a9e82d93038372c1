#!/usr/bin/env bash
# The whole GPU check of glmdiff in one call.
#
#   scripts/gpu-test.sh prepare   here (no GPU): release build, test build, binaries into .gpu/
#   scripts/gpu-test.sh run       on the GPU machine, from the repository root, with .gpu carried:
#                                 GPU tests, dequant-check on the quant fixtures and on a synthetic
#                                 GLM-5-dimension UD-Q4_K_XL model, compute-sanitizer over the dequant
#                                 kernels; logs under $OUT (default ./gpu-out), a summary last.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    set -e
    cargo build --release
    local tests
    tests=$(cargo test --release --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "tests" and m.get("executable"):
        print(m["executable"])' | tail -n 1)
    [ -n "$tests" ] || { echo "no test binary found" >&2; exit 2; }
    mkdir -p .gpu
    cp target/release/glmdiff .gpu/glmdiff
    cp "$tests" .gpu/tests
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    echo "ready: .gpu/glmdiff .gpu/tests; on the GPU machine run: bash scripts/gpu-test.sh run (carry .gpu)"
}

run() {
    local out=${OUT:-gpu-out}
    mkdir -p "$out"
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
    export NVIDIA_TF32_OVERRIDE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
    export GLMDIFF_REPO=$PWD GLMDIFF_BIN=$PWD/.gpu/glmdiff GLMDIFF_CACHE_DIR=$(mktemp -d)
    local bin=.gpu/glmdiff summary=()
    nvidia-smi -L | tee "$out/devices.txt"

    echo "== GPU tests"
    .gpu/tests gpu --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$out/tests.log"
    summary+=("GPU tests: $(grep -E '^test result' "$out/tests.log" | tail -n 1)")

    echo "== dequant-check: quant fixtures (every type), and the 3-shard split"
    "$bin" dequant-check fixtures/quant/all_types.gguf --all --json "$out/fixtures.json" 2>&1 | tee "$out/fixtures.txt"
    summary+=("dequant-check fixtures: exit ${PIPESTATUS[0]}, $(tail -n 1 "$out/fixtures.txt" | cut -c1-160)")
    "$bin" dequant-check fixtures/quant/split/all_types-00002-of-00003.gguf --all > "$out/split.txt" 2>&1
    summary+=("dequant-check split: exit $?, $(tail -n 1 "$out/split.txt" | cut -c1-120)")

    echo "== dequant-check: synthetic GLM-5-dimension model, UD-Q4_K_XL mix"
    local tmp; tmp=$(mktemp -d)
    "$bin" synth --arch glm-dsa --dims glm5 --layers ${SYNTH_LAYERS:-4} --out "$tmp/glm5.gguf" 2>&1 | tail -n 2
    ls -la "$tmp/glm5.gguf"
    "$bin" dequant-check "$tmp/glm5.gguf" --all --json "$out/synth.json" > "$out/synth.txt" 2>&1
    local rc=$?
    tail -n 3 "$out/synth.txt"
    summary+=("dequant-check synth GLM-5 ($(du -h "$tmp/glm5.gguf" | cut -f1)): exit $rc, $(tail -n 1 "$out/synth.txt" | cut -c1-200)")
    rm -rf "$tmp"

    echo "== bench dequant --device 0"
    "$bin" bench dequant --device 0 2>&1 | tee "$out/bench.txt"
    summary+=("bench dequant --device 0: $(grep -E 'copy' "$out/bench.txt" | head -n 1)")

    if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda-13.0/bin/compute-sanitizer ]; then
        local cs; cs=$(command -v compute-sanitizer || echo /usr/local/cuda-13.0/bin/compute-sanitizer)
        for tool in memcheck racecheck initcheck; do
            echo "== compute-sanitizer --tool $tool"
            "$cs" --tool "$tool" --error-exitcode 9 "$bin" dequant-check fixtures/quant/all_types.gguf --all > "$out/sanitizer-$tool.txt" 2>&1
            local r=$?
            summary+=("compute-sanitizer $tool: exit $r, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-$tool.txt" | tail -n 1)")
        done
    else
        summary+=("compute-sanitizer: not found")
    fi

    echo
    echo "== summary"
    printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: scripts/gpu-test.sh prepare|run" >&2; exit 2 ;;
esac
