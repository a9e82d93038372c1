#!/usr/bin/env bash
# Every fixture run's outputs, timings left out, into OUTDIR: each committed trace against each
# model of its family in replay, chained and both (and both with --explain), the CPU engine with
# and without injected faults, `compare` of the committed traces, the regress suite and a `step`
# case. Two such folders from two builds are compared with `diff -r`: a change that should
# change no verdict shows no difference.
#
#   scripts/fixture-verdicts.sh OUTDIR [GLMDIFF]
set -uo pipefail
out=${1:?usage: scripts/fixture-verdicts.sh OUTDIR [GLMDIFF]}
bin=$(realpath "${2:-target/release/glmdiff}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(realpath "$out")
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
export GLMDIFF_CACHE_DIR=$cache

# JSON without timings; text with every duration (`0.02 s`, `12 ms`) blanked.
strip_json() { jq -S 'walk(if type == "object" then with_entries(select(.key | test("^(seconds|[a-z]+_s)$") | not)) else . end)' "$1" 2>/dev/null || cat "$1"; }
strip_text() { sed -E 's/[0-9]+(\.[0-9]+)?(e-?[0-9]+)? ?(ms|s)\b/T/g; s/[0-9.]+x the/Nx the/g; s/slowest: [^)]*/slowest/g' "$1"; }

one() { # name, then the command's arguments
  local name=$1; shift
  local j="$out/$name.json.raw"
  "$bin" "$@" --json "$j" >"$out/$name.txt.raw" 2>"$out/$name.err.raw"
  echo "exit $?" >"$out/$name.rc"
  [ -f "$j" ] && strip_json "$j" >"$out/$name.json" && rm -f "$j"
  strip_text "$out/$name.txt.raw" >"$out/$name.txt"
  strip_text "$out/$name.err.raw" >"$out/$name.err"
  rm -f "$out/$name.txt.raw" "$out/$name.err.raw"
}

n=0
for t in fixtures/{models,engines,engine-bugs,hooks,llama-cpp}/*/*.trace.safetensors; do
  fam=$(basename "$(dirname "$t")")
  for m in fixtures/models/"$fam"/*.gguf; do
    tag="$(echo "$t" | cut -d/ -f2)__$(basename "$t" .trace.safetensors)__$(basename "$m" .gguf)"
    for mode in replay chained both; do
      one "run__${tag}__$mode" run "$m" --against "trace:$t" --mode "$mode"
      n=$((n + 1))
    done
    one "run__${tag}__explain" run "$m" --against "trace:$t" --explain
    n=$((n + 1))
  done
done

for m in fixtures/models/*/*.gguf; do
  b=$(basename "$m" .gguf)
  for mode in replay chained both; do
    one "cpu__${b}__$mode" run "$m" --prompt "the quick fox sees every token." --against cpu --mode "$mode"
  done
  for f in softmax_scale:1.02 kv_b_concat expert_swap:0,1 rope_theta:20000 dsa_topk:3 \
    routed_scale:1.01 gate_up_swap topk_norm:off q4k_scale_bits "weight_scale:blk.1.attn_q_b.weight,1.02"; do
    one "inject__${b}__${f//[:,\/*]/_}" run "$m" --prompt "the quick fox sees every token." --against cpu --inject "$f" --explain
    n=$((n + 1))
  done
  one "cpu__${b}__layer1" run "$m" --prompt "the quick fox sees every token." --against cpu --layer 1 --hook 'blk.*.attn_*' --tol 'blk.*.attn_heads=1e-3' --precision 'blk.*.indexer_*=fp8'
done

for fam in glm5-tiny glm5-tiny-q dsv3-tiny dsv3-tiny-q; do
  for p in long short; do
    ref=fixtures/models/$fam/$fam.$p.trace.safetensors
    [ -f "$ref" ] || continue
    for c in fixtures/engines/$fam/$fam.$p.*.trace.safetensors fixtures/llama-cpp/$fam/*.$p.*.trace.safetensors; do
      [ -f "$c" ] || continue
      tag="${fam}__$(basename "$c" .trace.safetensors)"
      one "compare__$tag" compare "$ref" "$c"
      m=$(ls fixtures/models/$fam/*.gguf | head -1)
      one "compare_model__$tag" compare "$ref" "$c" --model "$m"
      n=$((n + 2))
    done
  done
done

"$bin" regress fixtures/regress/suite.toml --baseline fixtures/regress/baseline.jsonl >"$out/regress.txt.raw" 2>&1
echo "exit $?" >"$out/regress.rc"
strip_text "$out/regress.txt.raw" >"$out/regress.txt" && rm -f "$out/regress.txt.raw"

case=${TMPDIR:-/tmp}/glmdiff-fixture-verdicts-case
rm -rf "$case"
"$bin" run fixtures/models/glm5-tiny/glm5-tiny-f32.gguf --prompt "the quick fox sees every token." --against cpu --inject softmax_scale:1.02 --repro "$case/c" >/dev/null 2>&1
one "step__softmax" step "$case/c" --explain
rm -rf "$case"
echo "$n runs into $out"
