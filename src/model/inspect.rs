//! The facts about a GGUF that `glmdiff inspect` shows, for any architecture: files, metadata
//! split into hyperparameters, tokenizer and the rest, a type histogram, the tensor list, and
//! (for `glm-dsa` and `deepseek2`) the forward pass the reference derives from the metadata.
//! Only data here; `crate::report::inspect` formats it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::hparams::{Gating, ARCH_DEEPSEEK2, ARCH_GLM_DSA};
use crate::gguf::{Model, Value};
use crate::util::glob;

/// Everything `inspect` reports, in a form both the table and the JSON printer use.
#[derive(Debug, Serialize)]
pub struct InspectReport {
    /// Files of the model (one per shard).
    pub files: Vec<String>,
    /// GGUF version of the first shard.
    pub gguf_version: u32,
    /// `general.architecture`, or "unknown".
    pub architecture: String,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Metadata keys under the architecture prefix (`glm-dsa.block_count` -> `block_count`).
    pub hyperparameters: BTreeMap<String, serde_json::Value>,
    /// What the forward pass will use, defaults applied (glm-dsa and deepseek2 only): the
    /// values glmdiff's reference runs with, or the error that stops it.
    pub forward_pass: Option<Result<BTreeMap<String, String>, String>>,
    /// Tokenizer summary.
    pub tokenizer: TokenizerSummary,
    /// Other metadata keys (general.*, split.*, quantize.*...), long arrays summarized.
    pub other_metadata: BTreeMap<String, String>,
    /// Number of tensors in the model (all shards).
    pub tensor_count: usize,
    /// Per type: tensor count, elements, bytes.
    pub types: Vec<TypeRow>,
    /// Total tensor bytes.
    pub total_bytes: u64,
    /// The tensors matching `--tensors` (all by default).
    pub tensors: Vec<TensorRow>,
}

/// Tokenizer facts from `tokenizer.ggml.*`.
#[derive(Debug, Default, Serialize)]
pub struct TokenizerSummary {
    /// `tokenizer.ggml.model` (gpt2, llama, ...).
    pub model: Option<String>,
    /// `tokenizer.ggml.pre` (glm4, deepseek-v3, ...).
    pub pre: Option<String>,
    /// Number of tokens.
    pub tokens: usize,
    /// Number of BPE merges.
    pub merges: usize,
    /// Special token ids (bos, eos, pad, ...).
    pub special: BTreeMap<String, i128>,
    /// Whether a chat template is present.
    pub chat_template: bool,
}

/// One row of the type histogram.
#[derive(Debug, Serialize)]
pub struct TypeRow {
    /// Type name.
    pub ty: String,
    /// Tensors of this type.
    pub tensors: usize,
    /// Elements of this type.
    pub elements: u64,
    /// Bytes of this type.
    pub bytes: u64,
}

/// One tensor.
#[derive(Debug, Serialize)]
pub struct TensorRow {
    /// GGUF name.
    pub name: String,
    /// Type name.
    pub ty: String,
    /// Shape in PyTorch order (slowest first).
    pub shape: Vec<u64>,
    /// Bytes of data.
    pub bytes: u64,
    /// 1-based shard number.
    pub shard: usize,
}

/// Builds the report for `model`, listing tensors that match `pattern`.
pub fn build(model: &Model, pattern: Option<&str>) -> InspectReport {
    let arch = model.architecture().unwrap_or("unknown").to_string();
    let prefix = format!("{arch}.");
    let mut hyper = BTreeMap::new();
    let mut other = BTreeMap::new();
    let mut tok = TokenizerSummary::default();
    for (k, v) in model.metadata() {
        if let Some(short) = k.strip_prefix(&prefix) {
            hyper.insert(short.to_string(), v.to_json());
        } else if let Some(t) = k.strip_prefix("tokenizer.") {
            match t {
                "ggml.model" => tok.model = v.as_str().map(str::to_string),
                "ggml.pre" => tok.pre = v.as_str().map(str::to_string),
                "ggml.tokens" => tok.tokens = v.as_array().map_or(0, <[Value]>::len),
                "ggml.merges" => tok.merges = v.as_array().map_or(0, <[Value]>::len),
                "chat_template" => tok.chat_template = true,
                _ => {
                    if let (Some(id), Some(name)) = (
                        v.as_int(),
                        t.strip_prefix("ggml.")
                            .and_then(|s| s.strip_suffix("_token_id")),
                    ) {
                        tok.special.insert(name.to_string(), id);
                    }
                }
            }
        } else {
            other.insert(k.clone(), v.summary(6));
        }
    }
    let mut hist: BTreeMap<(u32, &str), (usize, u64, u64)> = BTreeMap::new();
    let mut tensors = Vec::new();
    let mut total = 0;
    for t in model.tensors() {
        let e = hist.entry((t.info.ty.id(), t.info.ty.name())).or_default();
        e.0 += 1;
        e.1 += t.info.n_elements();
        e.2 += t.info.nbytes;
        total += t.info.nbytes;
        if pattern.is_none_or(|p| glob::matches(p, &t.info.name)) {
            tensors.push(TensorRow {
                name: t.info.name.clone(),
                ty: t.info.ty.name().to_string(),
                shape: t.info.shape(),
                bytes: t.info.nbytes,
                shard: t.shard + 1,
            });
        }
    }
    InspectReport {
        files: model
            .shards()
            .iter()
            .map(|s| s.path().display().to_string())
            .collect(),
        gguf_version: model.shards()[0].version(),
        architecture: arch,
        name: model
            .get("general.name")
            .and_then(Value::as_str)
            .map(str::to_string),
        hyperparameters: hyper,
        forward_pass: forward_pass(model),
        tokenizer: tok,
        other_metadata: other,
        tensor_count: model.n_tensors(),
        types: hist
            .into_iter()
            .map(|((_, name), (n, el, b))| TypeRow {
                ty: name.to_string(),
                tensors: n,
                elements: el,
                bytes: b,
            })
            .collect(),
        total_bytes: total,
        tensors,
    }
}

/// The hyperparameters the reference forward pass derives from the metadata (defaults applied),
/// for the architectures it supports; `None` for other architectures.
fn forward_pass(model: &Model) -> Option<Result<BTreeMap<String, String>, String>> {
    let arch = model.architecture()?;
    if arch != ARCH_GLM_DSA && arch != ARCH_DEEPSEEK2 {
        return None;
    }
    // The load checks of a run (tensors present, embedding and output), not only the metadata.
    let hp = match crate::model::Weights::new(model) {
        Ok(w) => w.hparams().clone(),
        Err(e) => return Some(Err(format!("{e:#}"))),
    };
    let mut m = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    put(
        "layers run",
        format!(
            "{} of {} blocks ({} MTP not run); dense 0..{}, MoE {}..{}",
            hp.n_layer, hp.n_block, hp.n_nextn, hp.n_dense, hp.n_dense, hp.n_layer
        ),
    );
    put(
        "attention",
        format!(
            "MLA, {} heads, q_lora {}, kv_lora {}, head nope {} + rope {}, v {}",
            hp.n_head,
            hp.q_lora_rank
                .map_or("none (attn_q)".to_string(), |r| r.to_string()),
            hp.kv_lora_rank,
            hp.qk_nope,
            hp.qk_rope,
            hp.v_head
        ),
    );
    put("rms_norm eps", format!("{:e}", hp.rms_eps));
    put(
        "rope",
        match &hp.rope.yarn {
            None => format!("interleaved, base {}, dim {}, no scaling", hp.rope.base, hp.rope.dim),
            Some(y) => format!(
                "interleaved, base {}, dim {}, YaRN factor {} orig ctx {} beta {}/{} mscale_all_dim {}",
                hp.rope.base, hp.rope.dim, y.factor, y.original_context, y.beta_fast, y.beta_slow, y.mscale_all_dim.map_or("none".to_string(), |m| format!("{m:.4}"))
            ),
        },
    );
    put(
        "routing",
        format!(
            "{} experts, {} per token, {} shared, width {}; gating {}; groups {}; weights norm {}, scale {}",
            hp.n_expert,
            hp.n_expert_used,
            hp.n_expert_shared,
            hp.n_ff_exp,
            match hp.gating {
                Gating::Sigmoid => "sigmoid",
                Gating::Softmax => "softmax",
            },
            hp.groups
                .map_or("none".to_string(), |(g, u)| format!("{u} of {g}")),
            hp.expert_weights_norm,
            hp.expert_weights_scale
        ),
    );
    if let Some(ix) = &hp.indexer {
        put(
            "indexer (DSA)",
            format!(
                "{} heads x {}, top_k {}, {} of {} layers with their own indexer",
                ix.n_head,
                ix.head_dim,
                ix.top_k,
                ix.full.iter().filter(|&&f| f).count(),
                ix.full.len()
            ),
        );
    }
    Some(Ok(m))
}
