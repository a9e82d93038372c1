//! Which model file a trace was made from, by content: the metadata `model_digest` (a JSON
//! object `{"algorithm": "sha256", "prefix_bytes": N, "tensors": {name: hex}}`, docs/hooks.md)
//! written by `glmdiff trace`, the hook package and the llama.cpp dump tool, and checked against
//! the model a trace is run or compared with: a trace of another model file (another seed of the
//! same dimensions, another quantization) is an input error naming both sides, never a list of
//! differences. The digests themselves are [`crate::gguf::tensor_digest`].

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::gguf::{tensor_digest, Model, DIGEST_PREFIX_BYTES};

/// The metadata key.
pub const KEY_MODEL_DIGEST: &str = "model_digest";

/// The tensors a producer lists: `token_embd.weight`, `output_norm.weight`, `output.weight`
/// when present, every tensor of block 0 and of the first block with a router
/// (`blk.N.ffn_gate_inp.weight`, the first MoE layer), in the model's order.
pub fn digest_tensors(model: &Model) -> Vec<String> {
    let names: Vec<&str> = model.tensors().map(|t| t.info.name.as_str()).collect();
    let first_moe = names
        .iter()
        .filter_map(|n| {
            n.strip_prefix("blk.")?
                .strip_suffix(".ffn_gate_inp.weight")?
                .parse::<u64>()
                .ok()
        })
        .min();
    let blocks: Vec<String> = std::iter::once(0)
        .chain(first_moe)
        .map(|b| format!("blk.{b}."))
        .collect();
    names
        .into_iter()
        .filter(|n| {
            matches!(
                *n,
                "token_embd.weight" | "output_norm.weight" | "output.weight"
            ) || blocks.iter().any(|b| n.starts_with(b.as_str()))
        })
        .map(str::to_string)
        .collect()
}

/// The `model_digest` metadata value of `model` (its [`digest_tensors`], each over its first
/// [`DIGEST_PREFIX_BYTES`]).
pub fn model_digest(model: &Model) -> Result<String> {
    let mut tensors = serde_json::Map::new();
    for name in digest_tensors(model) {
        let t = model.tensor(&name)?;
        tensors.insert(
            name,
            Value::String(tensor_digest(model, t, DIGEST_PREFIX_BYTES)?),
        );
    }
    Ok(
        json!({"algorithm": "sha256", "prefix_bytes": DIGEST_PREFIX_BYTES, "tensors": tensors})
            .to_string(),
    )
}

/// A parsed `model_digest`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDigest {
    /// Bytes of each tensor's data covered.
    pub prefix_bytes: u64,
    /// Tensor name to lowercase hex SHA-256.
    pub tensors: BTreeMap<String, String>,
}

impl ModelDigest {
    /// Parses the metadata value `text` of trace `path`.
    pub fn parse(path: &Path, text: &str) -> Result<ModelDigest> {
        let bad = |why: String| {
            anyhow::anyhow!(
                "trace: {}: metadata {KEY_MODEL_DIGEST} is malformed: {why} (expected {{\"algorithm\": \"sha256\", \"prefix_bytes\": N, \"tensors\": {{name: hex}}}}; docs/hooks.md)",
                path.display()
            )
        };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let algorithm = v.get("algorithm").and_then(Value::as_str);
        if algorithm != Some("sha256") {
            return Err(bad(format!(
                "algorithm is {:?}, not \"sha256\"",
                algorithm.unwrap_or("missing")
            )));
        }
        let prefix_bytes = v
            .get("prefix_bytes")
            .and_then(Value::as_u64)
            .filter(|&p| p > 0)
            .ok_or_else(|| bad("prefix_bytes is not a positive integer".to_string()))?;
        let obj = v
            .get("tensors")
            .and_then(Value::as_object)
            .filter(|o| !o.is_empty())
            .ok_or_else(|| bad("tensors is not a non-empty object".to_string()))?;
        let mut tensors = BTreeMap::new();
        for (name, hex) in obj {
            let hex = hex
                .as_str()
                .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                .ok_or_else(|| bad(format!("tensor {name:?}: {hex} is not 64 hex digits")))?;
            tensors.insert(name.clone(), hex.to_ascii_lowercase());
        }
        Ok(ModelDigest {
            prefix_bytes,
            tensors,
        })
    }
}

/// Checks the `model_digest` in `metadata` of trace `path` (none: nothing to check) against
/// `model`: every tensor it lists must be in the model with the same digest. A difference is an
/// error naming the trace, the model file the trace names, the first tensor that differs (with
/// both digests) and how many do.
pub fn check_model_digest(
    path: &Path,
    metadata: &std::collections::HashMap<String, String>,
    model: &Model,
) -> Result<()> {
    let Some(text) = metadata.get(KEY_MODEL_DIGEST) else {
        return Ok(());
    };
    let d = ModelDigest::parse(path, text)?;
    let mut differ: Vec<(String, String, String)> = Vec::new();
    for (name, want) in &d.tensors {
        let got = match model.find(name) {
            Some(t) => tensor_digest(model, t, d.prefix_bytes).with_context(|| {
                format!("trace: {}: checking its {KEY_MODEL_DIGEST}", path.display())
            })?,
            None => "absent".to_string(),
        };
        if &got != want {
            differ.push((name.clone(), want.clone(), got));
        }
    }
    let Some((name, want, got)) = differ.first() else {
        return Ok(());
    };
    let named = metadata
        .get("model")
        .map_or(String::new(), |m| format!(" (the trace names {m})"));
    let prefix = if d.prefix_bytes % (1 << 20) == 0 {
        format!("{} MiB", d.prefix_bytes >> 20)
    } else {
        format!("{} bytes", d.prefix_bytes)
    };
    let short = |h: &str| h.get(..16).map_or(h.to_string(), |s| format!("{s}…"));
    let theirs = if got == "absent" {
        format!("{} has no tensor {name}", model.file_name())
    } else {
        format!("{} gives {}", model.file_name(), short(got))
    };
    bail!(
        "trace: {}: made from another model file than {}{named}: its {KEY_MODEL_DIGEST} of {name} (sha256 of type, shape and first {prefix}) is {}, {theirs}; {} of its {} tensors differ. Run it with the model it was made from",
        path.display(),
        model.path().display(),
        short(want),
        differ.len(),
        d.tensors.len()
    )
}

/// Whether a trace's `models` metadata (a JSON list), or else its `model`, names `file`;
/// `None` when it names no file at all.
pub fn names_model_file(
    metadata: &std::collections::HashMap<String, String>,
    file: &str,
) -> Option<bool> {
    let listed: Vec<String> = metadata
        .get("models")
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_else(|| metadata.get("model").cloned().into_iter().collect());
    let listed: Vec<&String> = listed.iter().filter(|m| !m.is_empty()).collect();
    (!listed.is_empty()).then(|| listed.iter().any(|m| *m == file))
}

/// A note for a trace without `model_digest` whose `model`/`models` metadata does not name
/// `model`'s file: what it names, and that belonging is not checked. `None` when it names the
/// file, carries a digest (checked instead) or names nothing.
pub fn name_note(
    path: &Path,
    metadata: &std::collections::HashMap<String, String>,
    model: &Model,
) -> Option<String> {
    let file = model.file_name();
    let named = metadata.get("model").filter(|m| !m.is_empty())?;
    if metadata.contains_key(KEY_MODEL_DIGEST)
        || named == &file
        || names_model_file(metadata, &file) == Some(true)
    {
        return None;
    }
    Some(format!(
        "trace {} names model {named} (metadata model), not {file}; it carries no {KEY_MODEL_DIGEST}, so that it was made from this model is not checked",
        path.display()
    ))
}
