#!/usr/bin/env bash
# glmdiff at GLM-5 dimensions on the GPU machine: a synthetic GLM-5 model (real shapes, the
# UD-Q4_K_XL type mix) of SYNTH_LAYERS blocks, `dequant-check --all` over it, and
# `run --against cuda` over all its layers in both modes on DEVICES (default 0), with the time
# of each part, the peak GPU memory per device (nvidia-smi, sampled every 0.5 s) and the host's
# peak RSS. Carry .gpu (scripts/gpu-test.sh prepare). Logs and summary in $OUT (default ./scale-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-scale-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export GLMDIFF_CACHE_DIR=$(mktemp -d)
bin=.gpu/glmdiff
layers=${SYNTH_LAYERS:-4}
devices=${DEVICES:-0}
tmp=$(mktemp -d)
summary=()
# t LOG CMD...: runs CMD with its output in LOG, prints "N s, exit RC".
t() { local log=$1; shift; local s=$SECONDS; "$@" > "$log" 2>&1; local rc=$?; echo "$((SECONDS - s)) s, exit $rc"; }

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/devices.txt"
echo "== synth: GLM-5 dimensions, $layers blocks"
r=$(t "$out/synth.txt" "$bin" synth --arch glm-dsa --dims glm5 --layers "$layers" --out "$tmp/glm5.gguf")
summary+=("synth $layers blocks ($(du -h "$tmp/glm5.gguf" | cut -f1)): $r")

# Pinned staging (the default), then pageable copies (GLMDIFF_DCHECK_PAGEABLE=1) to compare;
# each with its rates and its projection to the full GLM-5 (--project glm5).
for staging in pinned pageable; do
    echo "== dequant-check --all --devices $devices --project glm5 ($staging)"
    if [ "$staging" = pageable ]; then export GLMDIFF_DCHECK_PAGEABLE=1; else unset GLMDIFF_DCHECK_PAGEABLE; fi
    r=$(t "$out/dequant-check-$staging.txt" "$bin" --wide dequant-check "$tmp/glm5.gguf" --all --devices "$devices" --project glm5)
    grep -E ' elements: |^staging|^rates|^projection' "$out/dequant-check-$staging.txt"
    summary+=("dequant-check --all --devices $devices ($staging): $r; $(grep -m1 ' elements: ' "$out/dequant-check-$staging.txt" | cut -c1-220)")
    summary+=("  $(grep -m1 '^rates' "$out/dequant-check-$staging.txt")")
    summary+=("  $(grep -m1 '^projection' "$out/dequant-check-$staging.txt")")
done
unset GLMDIFF_DCHECK_PAGEABLE

for mode in both; do
    echo "== run --against cuda --devices $devices --mode $mode"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/gpu-mem-$mode.csv" &
    smi=$!
    r=$(t "$out/run-$mode.log" /usr/bin/time -v -o "$out/run-$mode.err" "$bin" --wide run "$tmp/glm5.gguf" --prompt "The capital of France is" \
        --against cuda --devices "$devices" --mode "$mode" --no-cache --json "$out/run-$mode.json")
    cp "$out/run-$mode.log" "$out/run-$mode.txt"
    kill $smi 2>/dev/null
    peak=$(awk -F', ' '{ if ($2 > m[$1]) m[$1] = $2 } END { for (d in m) printf "cuda:%s %d MiB; ", d, m[d] }' "$out/gpu-mem-$mode.csv")
    rss=$(grep 'Maximum resident' "$out/run-$mode.err" | awk '{print $NF}')
    summary+=("run --against cuda --devices $devices --mode $mode: $r; peak GPU memory $peak host RSS $((rss / 1024)) MiB; $(grep -E '^(OK|FAIL|DIFF)' "$out/run-$mode.txt" | head -n 1 | cut -c1-120)")
    grep -E '^time|^note' "$out/run-$mode.txt" | head -n 5
done
rm -rf "$tmp"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
