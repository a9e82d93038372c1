//! llama.cpp as a candidate engine: its runs of the fixture models, dumped under glmdiff's hook
//! names by `tools/llama-dump` (`fixtures/llama-cpp/`, made by `scripts/llama-dumps.sh` and
//! `reference/fixtures/llama_cpp_fixtures.sh`; the CPU build here, the CUDA build on an H200).
//! A correct llama.cpp run (F32 and F16 KV cache, F32, F16 and mixed-quant weights, flash
//! attention on and off on CUDA) must come out clean with every hook it computed compared, each
//! judged at the precision the dump declares per step (`precision` metadata); the bugs planted
//! through llama.cpp's own metadata overrides (`--override-kv`, no change to its code) must be
//! named at the hook where they first change values, and `--explain` must name their class.

use std::path::{Path, PathBuf};

/// `(dump, GGUF)` of every dump under `fixtures/ROOT/*/`.
fn pairs_in(root: &str) -> Vec<(PathBuf, PathBuf)> {
    crate::common::trace_pairs(
        &crate::common::fixtures(root),
        &crate::common::fixtures("models"),
    )
}

fn pairs() -> Vec<(PathBuf, PathBuf)> {
    pairs_in("llama-cpp")
}

use crate::common::run_trace as run;

fn is_plant(trace: &Path) -> bool {
    trace
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("plant.")
}

/// Every clean dump exits 0 in replay and chained mode, with no hook of the trace left
/// uncompared and the trace's per-step precision applied.
#[test]
fn clean_llama_cpp_runs_pass_with_every_hook_compared() {
    let bad = clean_runs_failing(&pairs(), 12);
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

/// GGUFs quantized by llama.cpp's `llama-quantize` (Q8_0, Q4_K_M) from the converter's F32
/// files, run by llama.cpp on the CPU (`fixtures/llama-quant/`): the DSA indexer and the experts
/// multiply some matrices with 8-bit activations and keep others in F16 (rows of 16 or 24 values
/// stay unquantized), each product judged at its own precision. The DeepSeek-V3 half
/// (`dsv3-tiny-lq`) was held out while the floors were set on the GLM-5 half.
#[test]
fn llama_quantize_gguf_runs_pass_with_every_hook_compared() {
    let bad = clean_runs_failing(&pairs_in("llama-quant"), 12);
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

/// The override-planted bugs on the quantized GGUFs are named at their own hook, where the
/// index scores' 8-bit products once hid them behind a false alarm at `blk.0.indexer_scores`.
#[test]
fn planted_bugs_on_llama_quantize_ggufs_are_named_at_their_hook() {
    let bad = plants_misnamed(&pairs_in("llama-quant"), 10);
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

/// Each clean dump of `pairs` (at least `min` of them) that does not exit 0 in `--mode both`
/// with every hook it holds compared and its precision map applied, with why.
fn clean_runs_failing(pairs: &[(PathBuf, PathBuf)], min: usize) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    let mut n = 0;
    for (trace, gguf) in pairs.iter().filter(|(t, _)| !is_plant(t)) {
        n += 1;
        let name = trace.file_name().unwrap().to_string_lossy().into_owned();
        let (rc, j, text) = run(dir.path(), gguf, trace, &["--mode", "both"]);
        let t = glmdiff::trace::read_trace(trace).unwrap();
        let mut why = Vec::new();
        if rc != 0 {
            why.push(format!("exit {rc}"));
        }
        for r in j["records"].as_array().unwrap() {
            let hook = r["hook"].as_str().unwrap();
            if !t.tensors.contains_key(hook) {
                continue;
            }
            for mode in ["replay", "chained"] {
                if r[mode]["status"] == "missing" {
                    why.push(format!(
                        "{hook} not compared in {mode}: {}",
                        r[mode]["note"]
                    ));
                }
            }
        }
        let declared = t.metadata.contains_key("precision");
        let applied = j["overrides"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o["source"] == "the trace's precision" && o["hooks"].as_u64() > Some(0));
        if declared != applied {
            why.push(format!("precision declared {declared}, applied {applied}"));
        }
        if !why.is_empty() {
            bad.push(format!("{name}: {}\n{text}", why.join("; ")));
        }
    }
    assert!(n >= min, "only {n} clean llama.cpp dumps");
    bad
}

/// What each override plants, where it first changes values and how `--explain` names it. The
/// hooks follow from the override: the routing ones change the first MoE layer (layer 1 of the
/// tiny models; layer 0 is dense), the RoPE base and the YaRN magnitude every rotated q in
/// layer 0, the indexer's top-k layer 0's selection.
fn expected(plant: &str) -> (&'static str, &'static str) {
    match plant {
        // glm-dsa.expert_weights_scale 2.5 -> 1.0
        "routed_scaling_ignored" => ("blk.1.moe_weights", "routed_scaling_ignored"),
        // 2.5 -> 2.525: a 1% scale, named by its size above the f32 floor
        "routed_scale_1pct" => ("blk.1.moe_weights", "routed_scale:2.525"),
        // glm-dsa.expert_weights_norm true -> false
        "topk_norm_off" => ("blk.1.moe_weights", "topk_norm:off"),
        // glm-dsa.expert_gating_func 2 (sigmoid) -> 1 (softmax)
        "gating_softmax" => ("blk.1.moe_probs", "softmax_gating"),
        // glm-dsa.rope.freq_base 1e6 -> 1e4
        "rope_base" => ("blk.0.q_pe_rope", "rope_theta:10000"),
        // glm-dsa.attention.indexer.top_k 8 -> 4
        "dsa_topk" => ("blk.0.indexer_topk", "dsa_topk:4"),
        // deepseek2.expert_group_used_count 2 -> 3 (of 4 groups)
        "group_limit_3" => ("blk.1.moe_topk_ids", "group_limit:4,3"),
        // deepseek2.rope.scaling.yarn_log_multiplier 0.1 -> 0: the YaRN magnitude llama.cpp
        // folds into its RoPE
        "yarn_log_mul_0" => ("blk.0.q_pe_rope", "yarn_mscale:"),
        other => panic!("no expectation for planted {other}"),
    }
}

#[test]
fn override_planted_bugs_are_named_at_their_hook() {
    let bad = plants_misnamed(&pairs(), 8);
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

/// Each planted dump of `pairs` (at least `min` of them) not named as [`expected`] says, with
/// why.
fn plants_misnamed(pairs: &[(PathBuf, PathBuf)], min: usize) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    let mut n = 0;
    for (trace, gguf) in pairs.iter().filter(|(t, _)| is_plant(t)) {
        n += 1;
        let name = trace.file_name().unwrap().to_string_lossy().into_owned();
        let plant = name
            .trim_start_matches("plant.")
            .split('.')
            .next()
            .unwrap()
            .to_string();
        let t = glmdiff::trace::read_trace(trace).unwrap();
        assert!(
            t.metadata
                .get("llama_cpp_overrides")
                .is_some_and(|o| !o.is_empty()),
            "{name}: no override in its metadata"
        );
        let (hook, kind) = expected(&plant);
        let (rc, j, text) = run(dir.path(), gguf, trace, &["--mode", "replay", "--explain"]);
        let got = j["first_divergence"]["hook"].as_str().unwrap_or("");
        let best = &j["explanation"][0];
        let mut why = Vec::new();
        if rc != 1 || got != hook {
            why.push(format!("exit {rc} at {got:?}, expected 1 at {hook}"));
        }
        let k = best["kind"].as_str().unwrap_or("");
        if !k.starts_with(kind) || best["reproduces"] != true {
            why.push(format!(
                "explained first by {k:?} (reproduces {}), expected {kind}...",
                best["reproduces"]
            ));
        }
        let (rc_both, _, _) = run(dir.path(), gguf, trace, &["--mode", "both"]);
        if rc_both != 1 {
            why.push(format!("--mode both exits {rc_both}"));
        }
        if !why.is_empty() {
            bad.push(format!("{name}: {}\n{text}", why.join("; ")));
        }
    }
    assert!(n >= min, "only {n} planted llama.cpp dumps");
    bad
}

/// A copy of safetensors file `src` at `dst` with metadata key `key` set to `value` (the header
/// rewritten, the data as it was).
fn with_metadata(src: &Path, dst: &Path, key: &str, value: &str) {
    let b = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    h["__metadata__"][key] = serde_json::Value::String(value.to_string());
    let mut hb = serde_json::to_vec(&h).unwrap();
    while hb.len() % 8 != 0 {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

/// A `precision` map that is not an object of hook globs to dtypes decides nothing silently:
/// exit 2, naming the file and what is wrong.
#[test]
fn a_malformed_precision_map_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = pairs()
        .into_iter()
        .find(|(t, _)| {
            glmdiff::trace::read_trace(t)
                .unwrap()
                .metadata
                .contains_key("precision")
        })
        .expect("a dump with a precision map");
    for (value, says) in [
        ("[1, 2]", "is not a JSON object"),
        (r#"{"blk.*.q_a": 3}"#, "is not a string"),
        (r#"{"blk.*.q_a": "int4 storage"}"#, "names no precision"),
    ] {
        let bad = dir.path().join("bad.trace.safetensors");
        with_metadata(&trace, &bad, "precision", value);
        let (rc, _, text) = run(dir.path(), &gguf, &bad, &[]);
        assert_eq!(rc, 2, "{value}: {text}");
        assert!(
            text.contains("metadata precision")
                && text.contains(says)
                && text.contains("bad.trace"),
            "{value}: {text}"
        );
    }
}
