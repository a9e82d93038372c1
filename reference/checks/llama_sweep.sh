#!/bin/bash
# A held-out check of glmdiff's verdicts on llama.cpp's CPU backend: random prompts of lengths and
# seeds that no floor or tolerance was set on, through every llama.cpp-made GGUF of the tiny fixture
# models (the converter's F32 and F16 files, llama-quantize's Q8_0 and Q4_K_M) with an F32 and an F16
# KV cache, each dump judged by `glmdiff run --against trace: --mode both`. A correct engine must come
# out clean (exit 0) on every one; the summary counts exit codes and lists every dump that is not.
#
#   bash reference/checks/llama_sweep.sh DUMP_TOOL GLMDIFF [LENGTHS] [SEEDS]
#
# DUMP_TOOL: a built glmdiff-llama-dump (tools/llama-dump/build.sh), with its libraries beside it or
# on LD_LIBRARY_PATH. LENGTHS (default 5,9,17,33,64,130,260) and SEEDS (default 1,2): comma lists.
# Work files under ${WORK:-/tmp/llama-sweep}; dumps of clean runs are deleted, the others kept.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
dump=$1 glmdiff=$2
lengths=${3:-5,9,17,33,64,130,260}
seeds=${4:-1,2}
work=${WORK:-/tmp/llama-sweep}
mkdir -p "$work"
d=$(cd "$(dirname "$dump")" && pwd)
export LD_LIBRARY_PATH=$d:$d/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ids() {  # model seed n: n ids drawn (seeded) from the token ids of the model's committed golden prompts
    python3 - "$root/fixtures/models/$1-tiny" "$2" "$3" <<'PY'
import glob, json, random, struct, sys
pool = set()
for p in glob.glob(sys.argv[1] + '/*.trace.safetensors'):
    with open(p, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        pool.update(json.loads(json.loads(f.read(n))['__metadata__']['tokens']))
pool = sorted(pool)
rng = random.Random(7_000_000 + 1000 * int(sys.argv[2]) + int(sys.argv[3]))
print(','.join(str(rng.choice(pool)) for _ in range(int(sys.argv[3]))))
PY
}
total=0
declare -A rc_count=()
bad=()
for m in glm5 dsv3; do
    for gguf in "$root"/fixtures/models/$m-tiny/$m-tiny-f32.gguf "$root"/fixtures/models/$m-tiny/$m-tiny-f16.gguf \
                "$root"/fixtures/models/$m-tiny-lq/$m-tiny-Q8_0.gguf "$root"/fixtures/models/$m-tiny-lq/$m-tiny-Q4_K_M.gguf; do
        [ -f "$gguf" ] || continue
        stem=$(basename "$gguf" .gguf)
        for seed in ${seeds//,/ }; do
            for n in ${lengths//,/ }; do
                toks=$(ids "$m" "$seed" "$n")
                for kv in f32 f16; do
                    name=$stem.s$seed.len$n.kv$kv
                    t=$work/$name.trace.safetensors
                    if ! "$dump" "$gguf" --tokens "$toks" --kv-type "$kv" --out "$t" > "$work/$name.dump.log" 2>&1; then
                        echo "$name: DUMP FAILED: $(tail -2 "$work/$name.dump.log" | tr '\n' ' ')"
                        rc_count[dumpfail]=$(( ${rc_count[dumpfail]:-0} + 1 ))
                        continue
                    fi
                    set +e
                    "$glmdiff" run "$gguf" --against "trace:$t" --mode both --wide > "$work/$name.out" 2>&1
                    rc=$?
                    set -e
                    total=$((total + 1))
                    rc_count[$rc]=$(( ${rc_count[$rc]:-0} + 1 ))
                    if [ $rc -eq 0 ]; then
                        rm -f "$t"
                    else
                        bad+=("$name rc$rc: $(grep -m3 -E 'first divergence|systematic|error' "$work/$name.out" | tr '\n' ' ' | cut -c1-400)")
                    fi
                    echo "$name: rc $rc"
                done
            done
        done
    done
done
summary="SUMMARY: $total judged:"
for k in "${!rc_count[@]}"; do summary+=" rc$k ${rc_count[$k]}"; done
echo "$summary"
for b in "${bad[@]}"; do echo "  NOT CLEAN $b"; done
