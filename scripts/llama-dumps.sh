#!/bin/bash
# llama.cpp dumps of the fixture models (fixtures/llama-cpp/), CPU here or CUDA on the GPU machine.
#
#   bash scripts/llama-dumps.sh LLAMA_CPP_SRC BUILD_DIR OUT_DIR [--cuda [ARCH]]
#
# Builds llama.cpp and tools/llama-dump (tools/llama-dump/build.sh), then dumps every fixture GGUF's
# short and long prompt (the token ids of fixtures/models/*/*.trace.safetensors) with an F32 and an F16
# KV cache, flash attention off and on, and the override-planted bugs of
# PLANTS below. Writes OUT_DIR/*.safetensors and OUT_DIR/dumps.tsv (file, model, prompt, options).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
src=$1 build=$2 out=$3
shift 3
bash "$root/tools/llama-dump/build.sh" "$src" "$build" "$@"
dump=$(cd "$build" && pwd)/glmdiff-llama-dump
mkdir -p "$out"
out=$(cd "$out" && pwd)
gpu=()
fa_modes=(off on)
if [ "${1:-}" = "--cuda" ]; then gpu=(--gpu-layers -1); fi
cd "$root"
failed=0
tokens() {  # the token ids of a fixture trace, from its safetensors metadata
    python3 - "$1" <<'PY'
import json, struct, sys
with open(sys.argv[1], 'rb') as f:
    n = struct.unpack('<Q', f.read(8))[0]
    print(','.join(map(str, json.loads(json.loads(f.read(n))['__metadata__']['tokens']))))
PY
}
tsv=$out/dumps.tsv
: > "$tsv"
one() {  # name gguf prompt args...
    local name=$1 gguf=$2 prompt=$3
    shift 3
    local m
    m=$(basename "$(dirname "$gguf")")
    m=${m%-lq}  # llama-quantize's files (reference/fixtures/llama_quant_fixtures.sh) share their source's prompts
    "$dump" "$root/$gguf" --tokens "$(tokens "$root/fixtures/models/$m/$m.$prompt.trace.safetensors")" \
        --out "$out/$name.safetensors" "${gpu[@]}" "$@" 2> "$out/$name.log" \
        || { echo "FAILED: $name"; tail -5 "$out/$name.log"; failed=$((failed + 1)); return 0; }
    printf '%s\t%s\t%s\t%s\n' "$name.safetensors" "$gguf" "$prompt" "$*" >> "$tsv"
}
for g in fixtures/models/*/*.gguf; do
    for prompt in short long; do
        for kv in f32 f16; do
            for fa in "${fa_modes[@]}"; do
                sfx=""
                [ "$fa" = on ] && sfx=.fa
                one "$(basename "$g" .gguf).$prompt.kv$kv$sfx" "$g" "$prompt" --kv-type "$kv" --flash-attn "$fa"
            done
        done
    done
done
# Engine bugs planted through llama.cpp's own metadata overrides (its --override-kv): name, model,
# override. Each is a configuration mistake seen in the field (docs/known-bugs.md).
PLANTS="
routed_scaling_ignored glm5-tiny/glm5-tiny-f32.gguf glm-dsa.expert_weights_scale=float:1.0
routed_scale_1pct glm5-tiny/glm5-tiny-f32.gguf glm-dsa.expert_weights_scale=float:2.525
topk_norm_off glm5-tiny/glm5-tiny-f32.gguf glm-dsa.expert_weights_norm=bool:false
gating_softmax glm5-tiny/glm5-tiny-f32.gguf glm-dsa.expert_gating_func=int:1
rope_base glm5-tiny/glm5-tiny-f32.gguf glm-dsa.rope.freq_base=float:10000
dsa_topk glm5-tiny/glm5-tiny-f32.gguf glm-dsa.attention.indexer.top_k=int:4
group_limit_3 dsv3-tiny/dsv3-tiny-f32.gguf deepseek2.expert_group_used_count=int:3
yarn_log_mul_0 dsv3-tiny/dsv3-tiny-f32.gguf deepseek2.rope.scaling.yarn_log_multiplier=float:0
"
while read -r name gguf ov; do
    [ -n "$name" ] || continue
    one "plant.$name" "fixtures/models/$gguf" long --kv-type f32 --override-kv "$ov"
done <<< "$PLANTS"
echo "dumps: $(wc -l < "$tsv") in $out, $failed failed"
[ "$failed" = 0 ]
