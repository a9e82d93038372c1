#!/usr/bin/env bash
# The whole GPU check of glmdiff in one call.
#
#   scripts/gpu-test.sh prepare   here (no GPU): release build, test build, binaries into .gpu/
#                                 (GPU_BASE=REV also builds revision REV's glmdiff, .gpu/glmdiff-base, for bench-ab)
#   scripts/gpu-test.sh run       on the GPU machine, from the repository root, with .gpu carried:
#                                 GPU tests and the ignored unit tests, dequant-check on the quant fixtures and on a synthetic
#                                 GLM-5-dimension UD-Q4_K_XL model, the regression suite against the CUDA
#                                 engine, the dequant benchmark, `bench run` (GLM-5 dimensions, 16 tokens; then --candidate-ahead off
#                                 against on, bf16 with each thread's CPU time, scripts/thread-cpu.sh, and f32; run --json's
#                                 candidate_beyond_times and reference_times off against on, on with staged uploads, and bf16,
#                                 with each thread's system time, waits for a core and page faults, against `bench layer`, the
#                                 reference alone), the products' two paths on every thread and the upload probe, compute-sanitizer over the dequant and
#                                 forward kernels; logs in $OUT/gpu-logs.tgz (default ./gpu-out), a summary last.
#                                 GPU_STEPS="tests bench" runs only those parts (bench's pieces: bench-dequant,
#                                 bench-default, bench-ahead, bench-steps, bench-reuse, bench-f32, bench-probes (probe-beside: its
#                                 first probe, small work beside bulk uploads, alone); bench-ab, named alone,
#                                 times this binary against the base one, bf16 at 16 tokens, alternating).
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    set -e
    cargo build --release
    local built tests unit
    built=$(cargo test --release --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        if t.get("name") == "tests":
            print("tests", m["executable"])
        elif t.get("kind") == ["lib"]:
            print("unit", m["executable"])')
    tests=$(echo "$built" | awk '$1 == "tests" {print $2}' | tail -n 1)
    unit=$(echo "$built" | awk '$1 == "unit" {print $2}' | tail -n 1)
    [ -n "$tests" ] || { echo "no test binary found" >&2; exit 2; }
    [ -n "$unit" ] || { echo "no unit-test binary of the library found" >&2; exit 2; }
    mkdir -p .gpu
    cp target/release/glmdiff .gpu/glmdiff
    cp "$tests" .gpu/tests
    cp "$unit" .gpu/unit
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -f .gpu/glmdiff-base .gpu/glmdiff-base.rev
    if [ -n "${GPU_BASE:-}" ]; then
        # The binary of another revision, for bench-ab: built in a worktree of its own.
        local wt; wt=$(mktemp -d)
        git worktree add --detach "$wt/src" "$GPU_BASE" > /dev/null
        (cd "$wt/src" && CARGO_TARGET_DIR="$wt/target" cargo build --release) || { git worktree remove --force "$wt/src"; exit 2; }
        cp "$wt/target/release/glmdiff" .gpu/glmdiff-base
        git rev-parse --short "$GPU_BASE" > .gpu/glmdiff-base.rev
        git worktree remove --force "$wt/src"
        rm -rf "$wt"
        echo "base: .gpu/glmdiff-base ($(cat .gpu/glmdiff-base.rev))"
    fi
    # Symbols off, so that the binaries travel to the GPU machine within its carry limit (64 MiB).
    if command -v strip > /dev/null; then
        strip .gpu/glmdiff .gpu/tests .gpu/unit
        [ -x .gpu/glmdiff-base ] && strip .gpu/glmdiff-base
    fi
    echo "ready: .gpu/glmdiff .gpu/tests .gpu/unit ($(du -sh .gpu | cut -f1)); on the GPU machine run: bash scripts/gpu-test.sh run (carry .gpu)"
}

run() {
    local out=${OUT:-gpu-out} logs
    mkdir -p "$out"
    logs=$(mktemp -d)
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
    export NVIDIA_TF32_OVERRIDE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
    export GLMDIFF_REPO=$PWD GLMDIFF_BIN=$PWD/.gpu/glmdiff GLMDIFF_CACHE_DIR=$(mktemp -d)
    local bin=.gpu/glmdiff summary=()
    # The summary and the logs also when a signal stops the run (`timeout` signals the whole
    # process group: the step running ends, then this trap runs).
    finish() {
        echo
        echo "== summary"
        printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
        # At most 8 files come back from the GPU machine: pack the logs into one.
        tar -C "$logs" -czf "$out/gpu-logs.tgz" . && cp "$logs/summary.txt" "$out/summary.txt"
    }
    trap 'summary+=("stopped by a signal"); finish; exit 124' TERM INT
    # GPU_STEPS selects parts: tests fixtures synth regress bench sanitizer (default: all); bench's
    # pieces alone: bench-dequant bench-default bench-ahead bench-steps bench-reuse bench-f32 bench-probes
    # (probe-beside: its first probe alone, seconds);
    # bench-ab (named alone only): bf16 `bench run` against the base binary of `GPU_BASE=REV prepare`.
    local steps=" ${GPU_STEPS:-tests fixtures synth regress bench sanitizer} "
    want() { [[ "$steps" == *" $1 "* ]]; }
    nvidia-smi -L | tee "$logs/devices.txt"

    if want tests; then
    echo "== GPU tests"
    .gpu/tests gpu --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$logs/tests.log"
    summary+=("GPU tests: $(grep -E '^test result' "$logs/tests.log" | tail -n 1)")
    # The library's ignored unit tests (NVRTC compiles every kernel family).
    .gpu/unit --ignored --test-threads=1 2>&1 | tee "$logs/unit.log"
    summary+=("ignored unit tests: $(grep -E '^test result' "$logs/unit.log" | tail -n 1)")
    fi

    if want fixtures; then
    echo "== dequant-check: quant fixtures (every type), and the 3-shard split"
    "$bin" --wide dequant-check fixtures/quant/all_types.gguf --all --json "$logs/fixtures.json" 2>&1 | tee "$logs/fixtures.txt"
    summary+=("dequant-check fixtures: exit ${PIPESTATUS[0]}, $(grep -m1 ' elements: ' "$logs/fixtures.txt" | cut -c1-160)")
    "$bin" --wide dequant-check fixtures/quant/split/all_types-00002-of-00003.gguf --all > "$logs/split.txt" 2>&1
    summary+=("dequant-check split: exit $?, $(grep -m1 ' elements: ' "$logs/split.txt" | cut -c1-120)")
    "$bin" --wide dequant-check fixtures/quant/all_types.gguf --all --devices 0,0 > "$logs/spread.txt" 2>&1
    summary+=("dequant-check --devices 0,0: exit $?, $(grep -m1 -E 'devices:' "$logs/spread.txt" | cut -c1-80) $(grep -m1 ' elements: ' "$logs/spread.txt" | cut -c1-100)")
    fi

    if want synth; then
    echo "== dequant-check: synthetic GLM-5-dimension model, UD-Q4_K_XL mix"
    local tmp; tmp=$(mktemp -d)
    "$bin" synth --arch glm-dsa --dims glm5 --layers ${SYNTH_LAYERS:-4} --out "$tmp/glm5.gguf" 2>&1 | tail -n 2
    ls -la "$tmp/glm5.gguf"
    "$bin" --wide dequant-check "$tmp/glm5.gguf" --all --project glm5 --json "$logs/synth.json" > "$logs/synth.txt" 2>&1
    local rc=$?
    grep -E ' elements: |^staging|^rates|^projection' "$logs/synth.txt"
    summary+=("dequant-check synth GLM-5 ($(du -h "$tmp/glm5.gguf" | cut -f1)): exit $rc, $(grep -m1 ' elements: ' "$logs/synth.txt" | cut -c1-200)")
    summary+=("  $(grep -m1 '^rates' "$logs/synth.txt")" "  $(grep -m1 '^projection' "$logs/synth.txt")")
    # The same with pageable copies, to compare.
    GLMDIFF_DCHECK_PAGEABLE=1 "$bin" --wide dequant-check "$tmp/glm5.gguf" --all --project glm5 > "$logs/synth-pageable.txt" 2>&1
    rc=$?
    summary+=("dequant-check synth GLM-5, pageable: exit $rc, $(grep -m1 ' elements: ' "$logs/synth-pageable.txt" | cut -c1-200)")
    summary+=("  $(grep -m1 '^rates' "$logs/synth-pageable.txt")" "  $(grep -m1 '^projection' "$logs/synth-pageable.txt")")
    rm -rf "$tmp"
    fi

    if want regress; then
    echo "== regress: the fixture suite against the CUDA engine"
    "$bin" --wide regress fixtures/regress/suite-cuda.toml --jsonl "$logs/regress-cuda.jsonl" 2>&1 | tee "$logs/regress.txt"
    summary+=("regress suite-cuda: exit ${PIPESTATUS[0]}, $(tail -n 1 "$logs/regress.txt" | cut -c1-160)")
    fi

    # The bench part in pieces (GPU_STEPS may name them alone): bench-dequant, bench-default,
    # bench-ahead, bench-steps (the by-step runs and bench layer), bench-f32, bench-probes.
    wantb() { want bench || want "$1"; }
    if wantb bench-dequant; then
    echo "== bench dequant --device 0"
    "$bin" bench dequant --device 0 2>&1 | tee "$logs/bench.txt"
    summary+=("bench dequant --device 0: $(grep -E 'copy' "$logs/bench.txt" | head -n 1)")
    fi
    if wantb bench-default; then
    echo "== bench run --against cuda: GLM-5 dimensions (one dense and two MoE layers), 16 tokens"
    "$bin" --wide bench run --against cuda --tokens 16 --reps 2 --project glm5 2>&1 | tee "$logs/bench-run.txt"
    summary+=("bench run --against cuda, 16 tokens, GLM-5 projected: exit ${PIPESTATUS[0]}, $(grep -m1 -E '(reference|candidate) \([0-9.]+x\)' "$logs/bench-run.txt" | tr -s ' ')")
    fi
    local bm i=0; bm=$(mktemp -d)
    if wantb bench-ahead || wantb bench-steps || wantb bench-reuse; then
    "$bin" synth --arch glm-dsa --dims glm5 --layers 5 --out "$bm/glm5.gguf" > /dev/null 2>&1
    fi
    if wantb bench-ahead; then
    echo "== bench run, 16 tokens: the candidate's chain run ahead to its routing (--candidate-ahead) off against on, twice each, alternating; CPU time by thread"
    local a
    for a in off on off on; do
        i=$((i + 1))
        scripts/thread-cpu.sh "$logs/threads-$i-$a.txt" "$bin" --wide --candidate-ahead "$a" bench run --model "$bm/glm5.gguf" \
            --against cuda --dtype bf16 --tokens 16 --reps 2 --project glm5 > "$logs/bench-run-$i-$a.txt" 2>&1
        summary+=("bench run --candidate-ahead $a ($i): exit $?, $(grep -E '^\| 16 ' "$logs/bench-run-$i-$a.txt" | grep -E '4 MoE|x 0|\+' | tr -s ' -' | tr '\n' ' ' | cut -c1-330)")
        summary+=("  threads: $(sed -n '2,6p' "$logs/threads-$i-$a.txt" | tr -s ' ' | tr '\n' ';')")
    done
    fi
    if wantb bench-steps; then
    echo "== run --json, 16 tokens: where the candidate's side ends after the reference's, by step (candidate_beyond_times), --candidate-ahead off against on, on with staged uploads (f32), and off (bf16)"
    # on-staged: the routed uploads through pinned buffers (no page registration beside the steps).
    # `run --tokens` takes token ids: 16 fixed ids below the synthetic model's vocabulary.
    local ids=95771,124003,126955,75693,110301,60413,118115,2534,108352,68857,63353,59308,3655,78751,80178,88834
    # Each also under scripts/thread-cpu.sh, with the reference's steps (reference_times, the
    # layers together) and its threads' system time, waits for a core and page faults: against
    # the reference alone (`bench layer`, below), where the pipeline's reference loses its time.
    for a in off on on-staged off-bf16; do
        # `--upload-from` is run's own flag (after `run`), `--candidate-ahead` a global one.
        local how=(--candidate-ahead "${a%%-*}") dt=f32 from=()
        [ "$a" = on-staged ] && from=(--upload-from staged)
        [ "$a" = off-bf16 ] && dt=bf16
        scripts/thread-cpu.sh "$logs/threads-run-$a.txt" "$bin" --wide "${how[@]}" run "$bm/glm5.gguf" --against cuda --dtype "$dt" \
            "${from[@]}" --tokens "$ids" --no-cache --json "$logs/run-ahead-$a.json" > "$logs/run-ahead-$a.txt" 2>&1
        local rc=$?
        summary+=("run $dt ${how[*]} ${from[*]}: exit $rc, $(python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
top = lambda k, n: "; ".join(t["what"] + " " + format(t["seconds"] * 1e3, ".1f") + " ms" for t in j[k][:n])
print("by step:", top("candidate_beyond_times", 6), "| reference:", top("reference_times", 10))' "$logs/run-ahead-$a.json" 2>&1 | cut -c1-700)")
        summary+=("  threads: $(sed -n '2,6p' "$logs/threads-run-$a.txt" | tr -s ' ' | tr '\n' ';')")
    done
    echo "== bench layer, 16 tokens: the reference alone (no candidate, its page faults left to a warm-up run) on the same model"
    scripts/thread-cpu.sh "$logs/threads-layer.txt" "$bin" --wide bench layer --model "$bm/glm5.gguf" --tokens 16 > "$logs/bench-layer.txt" 2>&1
    summary+=("bench layer: exit $?, $(grep -E '^\| 16 ' "$logs/bench-layer.txt" | head -n 2 | tr -s ' -' | tr '\n' ' ' | cut -c1-400)")
    summary+=("  threads: $(sed -n '2,4p' "$logs/threads-layer.txt" | tr -s ' ' | tr '\n' ';')")
    fi
    if wantb bench-reuse; then
    echo "== bench run, 16 tokens, bf16: the reference's products from the candidate's routed experts on the device (--reference-reuse) off and on, with --candidate-ahead off and on"
    # The third word: run's --register-pause (microseconds the uploader sleeps after each
    # registration of the file's pages, letting other threads' driver calls through); the
    # fourth: run's --upload-from (staged: no registration at all).
    local r
    for r in "on off 0 mapped" "on on 0 mapped" "off off 0 mapped" "off on 0 mapped" "on on 50 mapped" "off on 50 mapped" \
        "on off 0 staged" "on on 0 staged"; do
        i=$((i + 1))
        set -- $r
        scripts/thread-cpu.sh "$logs/threads-reuse-$i-$1-$2.txt" "$bin" --wide --candidate-ahead "$1" --reference-reuse "$2" bench run \
            --model "$bm/glm5.gguf" --against cuda --dtype bf16 --tokens 16 --reps 2 --project glm5 --register-pause "$3" \
            --upload-from "$4" > "$logs/bench-reuse-$i-$1-$2.txt" 2>&1
        summary+=("bench run --candidate-ahead $1 --reference-reuse $2 --register-pause $3 --upload-from $4: exit $?, $(grep -E '^\| 16 ' "$logs/bench-reuse-$i-$1-$2.txt" | grep -E '4 MoE|x 0|\+' | tr -s ' -' | tr '\n' ' ' | cut -c1-330)")
        summary+=("  threads: $(sed -n '2,4p' "$logs/threads-reuse-$i-$1-$2.txt" | tr -s ' ' | tr '\n' ';')")
    done
    set --
    local ids=95771,124003,126955,75693,110301,60413,118115,2534,108352,68857,63353,59308,3655,78751,80178,88834
    for r in off on; do
        "$bin" --wide --candidate-ahead "$r" --reference-reuse on run "$bm/glm5.gguf" --against cuda --dtype bf16 --tokens "$ids" --no-cache \
            --json "$logs/run-reuse-$r.json" > "$logs/run-reuse-$r.txt" 2>&1
        local rc=$?
        summary+=("run bf16 --candidate-ahead $r --reference-reuse on: exit $rc, $(python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
top = lambda k, n: "; ".join(t["what"] + " " + format(t["seconds"] * 1e3, ".1f") + " ms" for t in j[k][:n])
dev = [n for n in j["notes"] if "device bytes" in n]
print("reference:", top("reference_times", 6), "|", (dev[0][:700] if dev else "none made from the candidate bytes"))' "$logs/run-reuse-$r.json" 2>&1 | cut -c1-1000)")
    done
    fi
    if want bench-ab && [ -x .gpu/glmdiff-base ]; then
    echo "== bench run, 16 tokens, bf16: this binary against the base revision's ($(cat .gpu/glmdiff-base.rev 2>/dev/null)), twice each, alternating"
    [ -s "$bm/glm5.gguf" ] || "$bin" synth --arch glm-dsa --dims glm5 --layers 5 --out "$bm/glm5.gguf" > /dev/null 2>&1
    local b
    for b in glmdiff glmdiff-base glmdiff glmdiff-base; do
        i=$((i + 1))
        scripts/thread-cpu.sh "$logs/threads-ab-$i-$b.txt" ".gpu/$b" --wide bench run --model "$bm/glm5.gguf" \
            --against cuda --dtype bf16 --tokens 16 --reps 2 --project glm5 > "$logs/bench-ab-$i-$b.txt" 2>&1
        summary+=("bench run $b ($i): exit $?, $(grep -E '^\| 16 ' "$logs/bench-ab-$i-$b.txt" | grep -E '4 MoE|x 0|\+' | tr -s ' -' | tr '\n' ' ' | cut -c1-330)")
        summary+=("  threads: $(sed -n '2,4p' "$logs/threads-ab-$i-$b.txt" | tr -s ' ' | tr '\n' ';')")
    done
    fi
    if wantb bench-f32; then
    echo "== bench run, 16 tokens, the default f32 candidate on bench run's own synthetic model: --candidate-ahead off against on"
    for a in off on; do
        "$bin" --wide --candidate-ahead "$a" bench run --against cuda --tokens 16 --reps 2 --project glm5 > "$logs/bench-run-f32-$a.txt" 2>&1
        summary+=("bench run f32 --candidate-ahead $a: exit $?, $(grep -E '^\| 16 ' "$logs/bench-run-f32-$a.txt" | grep -E 'MoE|x 0|\+' | tr -s ' -' | tr '\n' ' ' | cut -c1-400)")
    done
    fi
    rm -rf "$bm"
    if wantb bench-probes || want probe-beside; then
    echo "== small_work_beside_uploads: a small copy, a kernel and a mapped kernel copy on a stream of their own, alone, behind 6 GiB of copies queued on another stream, and beside an uploader registering 1.5 GiB"
    .gpu/unit small_work_beside_uploads --ignored --nocapture --test-threads=1 2>&1 | tee "$logs/beside.txt"
    summary+=("small_work_beside_uploads: $(grep -m1 -E '^test result' "$logs/beside.txt")")
    while read -r l; do summary+=("  $l"); done < <(grep -E '^(alone|behind|beside)' "$logs/beside.txt" | cut -c1-230)
    fi
    if wantb bench-probes; then
    echo "== small_tokens_parallel_speed: the products' direct and blocked paths around 32 tokens, every thread at once"
    .gpu/unit small_tokens_parallel_speed --ignored --nocapture --test-threads=1 2>&1 | tee "$logs/small-tokens.txt"
    summary+=("small_tokens_parallel_speed: $(grep -E ' t=(24|31|32|48|63):' "$logs/small-tokens.txt" | tr -s ' ' | tr '\n' ';')")
    echo "== registered_copy_speed: staged uploads against copies from registered pages (a 2 GiB file)"
    local reg; reg=$(mktemp -d)
    head -c $((2 << 30)) /dev/urandom > "$reg/bytes.bin"
    GLMDIFF_REGISTER_FILE="$reg/bytes.bin" .gpu/unit registered_copy_speed --ignored --nocapture --test-threads=1 2>&1 | tee "$logs/registered-copy.txt"
    summary+=("registered_copy_speed: $(grep -m1 -E '^test result' "$logs/registered-copy.txt"); $(grep -E '1536 MiB' "$logs/registered-copy.txt" | head -n 3 | tr -s ' ' | tr '\n' ';')")
    rm -rf "$reg"
    fi

    if ! want sanitizer; then
        :
    elif command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda-13.0/bin/compute-sanitizer ]; then
        local cs; cs=$(command -v compute-sanitizer || echo /usr/local/cuda-13.0/bin/compute-sanitizer)
        for tool in memcheck racecheck initcheck; do
            echo "== compute-sanitizer --tool $tool"
            "$cs" --tool "$tool" --error-exitcode 9 "$bin" dequant-check fixtures/quant/all_types.gguf --all > "$logs/sanitizer-$tool.txt" 2>&1
            local r=$?
            summary+=("compute-sanitizer $tool: exit $r, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/sanitizer-$tool.txt" | tail -n 1)")
        done
        # The forward kernels and cuBLAS calls of the CUDA engine, on the quantized GLM-5 fixture.
        "$cs" --tool memcheck --error-exitcode 9 "$bin" run fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf --prompt "The capital of France is" --against cuda --no-cache > "$logs/sanitizer-forward.txt" 2>&1
        summary+=("compute-sanitizer memcheck, run --against cuda: exit $?, $(grep -E 'ERROR SUMMARY' "$logs/sanitizer-forward.txt" | tail -n 1)")
        # Sources at every byte offset, tails and partial first/last words.
        "$cs" --tool memcheck --error-exitcode 9 .gpu/tests gpu_dequant_at_every_offset --include-ignored --test-threads=1 > "$logs/sanitizer-offsets.txt" 2>&1
        summary+=("compute-sanitizer memcheck, every offset: exit $?, $(grep -E 'ERROR SUMMARY' "$logs/sanitizer-offsets.txt" | tail -n 1)")
        # The attention past 6144 tokens (7000: the scores' row in the shared memory a block opts
        # in to), f32 and bf16; the test's glmdiff runs are child processes, which the sanitizer
        # follows.
        timeout 400 "$cs" --tool memcheck --error-exitcode 9 .gpu/tests gpu_attention_past_6144_tokens --include-ignored --test-threads=1 > "$logs/sanitizer-long.txt" 2>&1
        summary+=("compute-sanitizer memcheck, attention at 7000 tokens: exit $?, $(grep -E 'ERROR SUMMARY' "$logs/sanitizer-long.txt" | tail -n 2 | tr '\n' ' ')")
    else
        summary+=("compute-sanitizer: not found")
    fi

    finish
    trap - TERM INT
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: scripts/gpu-test.sh prepare|run" >&2; exit 2 ;;
esac
