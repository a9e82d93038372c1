#!/usr/bin/env bash
# GLM-5 layers at long prompts on the GPU machine, with the DSA indexer pruning (index_topk 2048):
# a synthetic GLM-5-dimension UD-Q4_K_XL model of LONG_LAYERS layers (default 5: layers 0-2 dense
# as GLM-5's leading dense blocks, 3-4 MoE, so that layer 3 is a MoE layer with a layer after it
# and no tail), then for each token count in LONG_TOKENS (default 4096) and each layer in
# LONG_RUN_LAYERS (default "0 3"): `run --layer N --against cuda --dtype bf16 --mode both` (a
# correct candidate: must exit 0), with the wall time, the host's peak RSS (/usr/bin/time -v),
# each side's time per layer and the DSA selection's flips against its noise; then the planted
# indexer bugs of LONG_PLANTS on layer 0 (must exit 1, named at the indexer).
# Carry .gpu (scripts/gpu-test.sh prepare); LONG_BIN names another binary. Each result is
# printed as it comes; logs and the summary in $OUT (default ./long-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-long-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export GLMDIFF_CACHE_DIR=${GLMDIFF_CACHE_DIR:-$(mktemp -d)}
bin=${LONG_BIN:-.gpu/glmdiff}
scratch=${SCRATCH:-/tmp/glmdiff-long}
mkdir -p "$scratch"
model=${MODEL:-$scratch/glm5-long.gguf}
layers=${LONG_LAYERS:-5}
summary=()
# say LINE: keeps LINE for the summary and prints it at once (a run cut short still shows it).
say() { summary+=("$1"); echo "$1"; }

if [ ! -f "$model" ]; then
    s=$SECONDS
    "$bin" synth --arch glm-dsa --dims glm5 --layers "$layers" --out "$model" > "$out/synth.txt" 2>&1
    say "synth $layers layers: $((SECONDS - s)) s, $(du -h "$model" | cut -f1)"
fi
vocab=$("$bin" --wide inspect "$model" 2>/dev/null | awk -F'|' '$2 ~ /^ *vocab_size *$/ {gsub(/ /, "", $3); print $3}')
vocab=${vocab:-154880}

# tokens N: N pseudo-random ids in [0, vocab), the same each call and with every awk (a
# Park-Miller generator: its products stay exact in awk's doubles; awk's own rand() after srand()
# is not the same sequence under every awk).
tokens() { awk -v n="$1" -v v="$vocab" 'BEGIN { x = 23; for (i = 0; i < n; i++) { x = (x * 48271) % 2147483647; printf "%s%d", (i ? "," : ""), x % v } }'; }

# one LABEL EXPECT ARGS...: one `run`, its exit code against EXPECT, its time and peak RSS, the
# first divergence and the DSA flips line.
one() {
    local label=$1 expect=$2; shift 2
    local log="$out/$label.txt" s=$SECONDS
    /usr/bin/time -v -o "$out/$label.time" "$bin" --wide run "$model" "$@" --json "$out/$label.json" > "$log" 2>&1
    local rc=$? rss
    rss=$(awk '/Maximum resident/ {print int($NF / 1024)}' "$out/$label.time")
    local verdict=ok
    [ "$rc" = "$expect" ] || verdict=UNEXPECTED
    say "$label: exit $rc (expected $expect: $verdict), $((SECONDS - s)) s wall, peak host RSS ${rss} MiB"
    say "  $(grep -m1 -E '^(OK|FAIL|DIFF)' "$log" | cut -c1-160)"
    say "  $(grep -m1 'first divergence' "$log" | cut -c1-200)"
    python3 - "$out/$label.json" <<'PY' >> "$out/$label.flips" 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
for t in d.get("layer_times") or []:
    print("time", json.dumps(t))
for r in d.get("records", []):
    if not r.get("hook", "").endswith("indexer_topk"):
        continue
    for m in ("replay", "chained"):
        x = (r.get(m) or {})
        f = x.get("flips") or {}
        c = f.get("count")
        if f:
            print(r["hook"], m, x.get("status"), "differing", f.get("differing"), "of", f.get("rows"),
                  "near_tie", f.get("near_tie"), "confident", f.get("confident"), "margins", f.get("margins"),
                  "count", json.dumps(c))
PY
    while read -r l; do say "  $l"; done < <(cut -c1-400 "$out/$label.flips")
}

for n in ${LONG_TOKENS:-4096}; do
    toks=$(tokens "$n")
    for l in ${LONG_RUN_LAYERS:-0 3}; do
        one "layer$l-t$n-clean" 0 --layer "$l" --tokens "$toks" --against "${AGAINST:-cuda}" ${DTYPE_ARGS---dtype bf16} --mode "${LONG_MODE:-both}"
    done
    for p in ${LONG_PLANTS-indexer_scale:1.02 indexer_wproj_scale:1.02 dsa_topk:2047}; do
        one "layer0-t$n-$(echo "$p" | tr ':' '_')" 1 --layer 0 --tokens "$toks" --against "${AGAINST:-cuda}" ${DTYPE_ARGS---dtype bf16} \
            --mode "${PLANT_MODE:-replay}" --inject "$p"
    done
done
printf '%s\n' "${summary[@]}" > "$out/summary.txt"
