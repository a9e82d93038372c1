#!/usr/bin/env bash
# dequant-check's pipeline measured on the GPU machine: a synthetic GLM-5-dimension model of
# N blocks (the UD-Q4_K_XL type mix) under /tmp, `dequant-check --all --project glm5` over it
# with pinned staging (the default) on an empty kernel cache, with pageable copies
# (GLMDIFF_DCHECK_PAGEABLE=1), and pinned again on the now warm cache; each run's wall time, its
# time split, staging, rates and projection lines. The model is deleted at the end.
#
#   bash scripts/dcheck-measure.sh [N]    from the repository root, .gpu/glmdiff carried
#                                         (scripts/gpu-test.sh prepare); N defaults to 4
#                                         (8 blocks are 37 GB). RUNS="pinned pageable" picks runs;
#                                         DEVICES=0,1 spreads the check.
#
# What to read: on each run's `rates:` line the GPU rate (hundreds of G values/s: the kernels
# alone) and `kernels loaded in X s before` (the NVRTC compile, ~15 s on the first run, a
# fraction of a second on the warm cache, in no rate); the `projection:` lines for GLM-5, pinned
# against pageable (pinned should be bound by the CPU hash or the file reads, not the GPU, and
# take no longer than pageable); the three runs bit-exact.
set -uo pipefail
cd "$(dirname "$0")/.."
layers=${1:-${SYNTH_LAYERS:-4}}
runs=${RUNS:-pinned pageable pinned}
devices=${DEVICES:-0}
bin=.gpu/glmdiff
[ -x "$bin" ] || { echo "no $bin: run scripts/gpu-test.sh prepare and carry .gpu" >&2; exit 2; }
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
tmp=$(mktemp -d /tmp/dcheck-measure.XXXXXX)
# An empty kernel cache: the first run compiles the kernels (reported apart from the rates).
export GLMDIFF_CACHE_DIR=$tmp/cache
trap 'rm -rf "$tmp"' EXIT
model=$tmp/glm5.gguf
worst=0

echo "== synth: GLM-5 dimensions, $layers blocks"
s=$SECONDS
"$bin" synth --arch glm-dsa --dims glm5 --layers "$layers" --out "$model" > "$tmp/synth.txt" 2>&1 ||
    { tail -n 5 "$tmp/synth.txt"; echo "synth failed" >&2; exit 2; }
echo "synth: $((SECONDS - s)) s, $(du -h "$model" | cut -f1)"
# The page cache warm for every run alike.
s=$SECONDS
cat "$model" > /dev/null
echo "page cache warmed in $((SECONDS - s)) s"

k=0
for staging in $runs; do
    k=$((k + 1))
    log=$tmp/run-$k-$staging.txt
    if [ "$staging" = pageable ]; then export GLMDIFF_DCHECK_PAGEABLE=1; else unset GLMDIFF_DCHECK_PAGEABLE; fi
    echo "== run $k: dequant-check --all --devices $devices --project glm5 ($staging)"
    t0=$(date +%s%N)
    "$bin" --wide dequant-check "$model" --all --devices "$devices" --project glm5 > "$log" 2>&1
    rc=$?
    t1=$(date +%s%N)
    ms=$(((t1 - t0) / 1000000))
    echo "wall $((ms / 1000)).$(printf %03d $((ms % 1000))) s, exit $rc"
    grep -E ' elements: |^staging|^rates|^projection' "$log" || tail -n 5 "$log"
    [ "$rc" -gt "$worst" ] && worst=$rc
done
unset GLMDIFF_DCHECK_PAGEABLE
exit "$worst"
