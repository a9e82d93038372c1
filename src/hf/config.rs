//! The parts of a Hugging Face `config.json` that say where a GLM-5 (`glm_moe_dsa`) or
//! DeepSeek-V3 (`deepseek_v3`) checkpoint keeps its weights: layer counts, the MLA dimensions that
//! split `kv_b_proj`, expert counts, and the FP8 block quantization (`quantization_config`).
//! Key names: transformers `models/glm_moe_dsa/configuration_glm_moe_dsa.py` and
//! `models/deepseek_v3/configuration_deepseek_v3.py`; DeepSeek's and GLM's FP8 releases add
//! `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// What glmdiff reads from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The file, for messages.
    pub path: PathBuf,
    /// `model_type` (`glm_moe_dsa`, `deepseek_v3`, ...), empty when absent.
    pub model_type: String,
    /// `num_hidden_layers`: the trunk layers `model.layers.0 .. N-1`.
    pub n_layers: usize,
    /// `num_nextn_predict_layers` (absent: 0): MTP layers `model.layers.N ..`.
    pub n_nextn: usize,
    /// `hidden_size`.
    pub hidden: Option<usize>,
    /// `q_lora_rank` (null or absent: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// `num_attention_heads`.
    pub n_head: Option<usize>,
    /// `qk_nope_head_dim`.
    pub qk_nope: Option<usize>,
    /// `v_head_dim`.
    pub v_head: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: Option<usize>,
    /// `n_routed_experts`.
    pub n_expert: Option<usize>,
    /// `moe_intermediate_size`.
    pub n_ff_exp: Option<usize>,
    /// `index_n_heads` (GLM-5's DSA indexer).
    pub index_n_heads: Option<usize>,
    /// `weight_block_size` of an FP8 `quantization_config` (rows, columns), if any.
    pub fp8_block: Option<[u64; 2]>,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<HfConfig> {
        let path = dir.join("config.json");
        if !path.is_file() {
            bail!(
                "hf: {}: no config.json (a Hugging Face checkpoint directory holds config.json and model.safetensors or model.safetensors.index.json)",
                dir.display()
            );
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("hf: cannot read {}", path.display()))?;
        Self::parse(&path, &text)
    }

    /// Parses the text of a `config.json` found at `path`.
    pub fn parse(path: &Path, text: &str) -> Result<HfConfig> {
        let v: Value = serde_json::from_str(text)
            .with_context(|| format!("hf: {}: not valid JSON", path.display()))?;
        let obj = v
            .as_object()
            .with_context(|| format!("hf: {}: not a JSON object", path.display()))?;
        let opt = |key: &str| -> Result<Option<usize>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => match x.as_u64() {
                    Some(n) => Ok(Some(n as usize)),
                    None => bail!(
                        "hf: {}: {key} is {x}, expected a non-negative integer",
                        path.display()
                    ),
                },
            }
        };
        let n_layers = opt("num_hidden_layers")?
            .with_context(|| format!("hf: {}: key num_hidden_layers is missing", path.display()))?;
        let fp8_block = match obj.get("quantization_config") {
            None | Some(Value::Null) => None,
            Some(q) => fp8_block(path, q)?,
        };
        Ok(HfConfig {
            path: path.to_path_buf(),
            model_type: obj
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            n_layers,
            n_nextn: opt("num_nextn_predict_layers")?.unwrap_or(0),
            hidden: opt("hidden_size")?,
            q_lora_rank: opt("q_lora_rank")?,
            n_head: opt("num_attention_heads")?,
            qk_nope: opt("qk_nope_head_dim")?,
            v_head: opt("v_head_dim")?,
            kv_lora_rank: opt("kv_lora_rank")?,
            n_expert: opt("n_routed_experts")?,
            n_ff_exp: opt("moe_intermediate_size")?,
            index_n_heads: opt("index_n_heads")?,
            fp8_block,
        })
    }
}

/// The FP8 block size of a `quantization_config`, `None` for another method.
fn fp8_block(path: &Path, q: &Value) -> Result<Option<[u64; 2]>> {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method != "fp8" {
        bail!(
            "hf: {}: quantization_config.quant_method {:?} is not supported (glmdiff reads unquantized checkpoints and fp8 with block scales)",
            path.display(),
            method
        );
    }
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
        if fmt != "e4m3" {
            bail!(
                "hf: {}: quantization_config.fmt {fmt:?} is not supported (only e4m3)",
                path.display()
            );
        }
    }
    let Some(bs) = q.get("weight_block_size") else {
        bail!(
            "hf: {}: quantization_config has no weight_block_size (per-tensor FP8 scales are not supported)",
            path.display()
        );
    };
    let dims: Option<Vec<u64>> = bs
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect());
    match dims.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 && bs.as_array().is_some_and(|a| a.len() == 2) => {
            Ok(Some([r, c]))
        }
        _ => bail!(
            "hf: {}: quantization_config.weight_block_size is {bs}, expected two positive integers",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_config_parses_and_bad_keys_are_named() {
        let p = Path::new("/m/config.json");
        let c = HfConfig::parse(
            p,
            r#"{"model_type":"deepseek_v3","num_hidden_layers":61,"num_nextn_predict_layers":1,
                "quantization_config":{"quant_method":"fp8","fmt":"e4m3","weight_block_size":[128,128]}}"#,
        )
        .unwrap();
        assert_eq!((c.n_layers, c.n_nextn), (61, 1));
        assert_eq!(c.fp8_block, Some([128, 128]));
        let e = HfConfig::parse(p, r#"{"hidden_size":8}"#).unwrap_err();
        assert!(format!("{e:#}").contains("num_hidden_layers is missing"));
        let e = HfConfig::parse(p, r#"{"num_hidden_layers":"x"}"#).unwrap_err();
        assert!(format!("{e:#}").contains("num_hidden_layers is \"x\""));
        let e = HfConfig::parse(
            p,
            r#"{"num_hidden_layers":2,"quantization_config":{"quant_method":"gptq"}}"#,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("gptq"));
    }
}
