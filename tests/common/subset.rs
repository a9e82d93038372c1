//! Traces with fewer hooks: what a serving engine hands over when it fuses steps, written from
//! a full trace by glmdiff's own trace writer.

use std::collections::BTreeMap;
use std::path::Path;

use glmdiff::trace::{read_trace, write_trace, Mode, TraceMeta};

/// Hook sets of engines that do not dump every hook, by name.
pub const SUBSETS: &[&str] = &["vllm", "llamacpp", "layers", "no_scores"];

/// The points of a layer each subset keeps out (`*`: every point not listed in `keep`).
///
/// - `vllm`: RoPE fused into attention (no `q_pe_rope`, `k_pe_rope`), the router's
///   softmax/top-k in one kernel (no `moe_probs`, `moe_topk_ids`, `moe_weights`), the experts
///   in one grouped GEMM (no `exp.E.out`), the DSA indexer fused (no `indexer_scores`,
///   `indexer_topk`).
/// - `llamacpp`: what llama.cpp's graph callbacks name in our layout: the norms (`attn_norm`,
///   `q_a_norm`, `kv_a_norm`, `ffn_norm`, `result_norm`), the projections (`q_a`, `q_b`,
///   `kv_a`, `ffn_gate`, `ffn_up`, the router logits `moe_logits`, `logits`), the attention
///   output `attn_out`, the FFN outputs (`moe_routed`, `ffn_shexp`, `ffn_out`) and the
///   residuals (`token_embd`, `ffn_inp`, `l_out`). Not: RoPE outputs and per-head attention
///   (llama.cpp's absorbed MLA has another layout), the indexer, the router's probabilities,
///   selection and weights, `ffn_act`, per-expert outputs.
/// - `layers`: layer outputs only: `token_embd`, `blk.L.l_out`, `result_norm`, `logits`.
/// - `no_scores`: every hook but the selection scores (`moe_probs`, `indexer_scores`).
pub fn keeps(subset: &str, name: &str) -> bool {
    let point = glmdiff::model::names::split_blk(name).map_or(name, |(_, p)| p);
    match subset {
        "vllm" => {
            !matches!(
                point,
                "q_pe_rope"
                    | "k_pe_rope"
                    | "moe_probs"
                    | "moe_topk_ids"
                    | "moe_weights"
                    | "indexer_scores"
                    | "indexer_topk"
            ) && !point.starts_with("exp.")
        }
        "llamacpp" => matches!(
            point,
            "token_embd"
                | "attn_norm"
                | "q_a"
                | "q_a_norm"
                | "q_b"
                | "kv_a"
                | "kv_a_norm"
                | "attn_out"
                | "ffn_inp"
                | "ffn_norm"
                | "ffn_gate"
                | "ffn_up"
                | "moe_logits"
                | "moe_routed"
                | "ffn_shexp"
                | "ffn_out"
                | "l_out"
                | "result_norm"
                | "logits"
        ),
        "layers" => matches!(point, "token_embd" | "l_out" | "result_norm" | "logits"),
        "no_scores" => !matches!(point, "moe_probs" | "indexer_scores"),
        other => panic!("no hook subset {other}"),
    }
}

/// Copies the trace `src` to `dst` keeping the hooks `keep` accepts and every metadata key, and
/// lists the points left out in `not_captured` (as `blk.*.POINT`) with `why`.
pub fn write_subset(src: &Path, dst: &Path, keep: &dyn Fn(&str) -> bool, why: &str) {
    let t = read_trace(src).unwrap();
    let all = super::host_tensors(&t);
    let mut left_out: Vec<String> = Vec::new();
    let mut kept = BTreeMap::new();
    for (name, v) in all {
        if keep(&name) {
            kept.insert(name, v);
        } else {
            let glob = match glmdiff::model::names::split_blk(&name) {
                Some((_, p)) => format!("blk.*.{p}"),
                None => name.clone(),
            };
            if !left_out.contains(&glob) {
                left_out.push(glob);
            }
        }
    }
    let m = &t.metadata;
    let mut extra = extra_metadata(m);
    if !left_out.is_empty() {
        let map: serde_json::Map<String, serde_json::Value> = left_out
            .into_iter()
            .map(|g| (g, serde_json::Value::from(why)))
            .collect();
        extra.insert(
            "not_captured".into(),
            serde_json::Value::Object(map).to_string(),
        );
    }
    let meta = TraceMeta {
        model: m["model"].clone(),
        architecture: m["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: m["engine"].clone(),
        dtype: m["dtype"].clone(),
        mode: Mode::parse(&m["mode"]).unwrap(),
        extra,
    };
    write_trace(dst, &kept, &meta).unwrap();
}

/// The metadata keys of a trace that `write_trace` does not write itself (everything but the
/// keys `TraceMeta` has fields for): what a copy carries over.
pub fn extra_metadata(m: &std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "glmdiff_trace"
                    | "glmdiff_version"
                    | "model"
                    | "architecture"
                    | "tokens"
                    | "engine"
                    | "dtype"
                    | "mode"
            )
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Writes a copy of trace `src` at `dst` with each tensor passed through `edit` (its name, its
/// values) and every metadata key kept: what a test does to plant a change in a committed trace.
pub fn write_edited(
    src: &Path,
    dst: &Path,
    edit: &dyn Fn(&str, glmdiff::engine::HostTensor) -> glmdiff::engine::HostTensor,
) {
    let t = read_trace(src).unwrap();
    let all: BTreeMap<_, _> = super::host_tensors(&t)
        .into_iter()
        .map(|(n, v)| {
            let v = edit(&n, v);
            (n, v)
        })
        .collect();
    let m = &t.metadata;
    let meta = TraceMeta {
        model: m["model"].clone(),
        architecture: m["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: m["engine"].clone(),
        dtype: m["dtype"].clone(),
        mode: Mode::parse(&m["mode"]).unwrap(),
        extra: extra_metadata(m),
    };
    write_trace(dst, &all, &meta).unwrap();
}
