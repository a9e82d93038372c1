//! Writes a Hugging Face checkpoint (safetensors shards, an index, a config.json) holding a
//! GGUF's dequantized weights (BF16 where the GGUF tensor is block-quantized, whose rounding error
//! is far above BF16's; F32 where it is a float type, so those stay exact) in the HF layout: the inverse of the converter's mapping (per-expert
//! tensors from stacked experts, `kv_b_proj` reassembled from `attn_k_b`/`attn_v_b`). Streamed:
//! headers first, then the data in chunks, so a synthetic model of GLM-5 dimensions never sits in
//! memory. Used to give `weights-check` a checkpoint of any size for memory tests; it reuses
//! glmdiff's own dequantization and name tables, so it says nothing about their correctness (the
//! fixtures of `reference/fixtures/make_wcheck_fixtures.py` do that).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result};
use glmdiff::gguf::Model;
use glmdiff::model::names::split_blk;
use glmdiff::model::HParams;
use glmdiff::wcheck::mapping::{EXPERT_MAP, GLOBAL_MAP, K_B, LAYER_MAP, V_B};
use serde_json::json;

/// Values converted per write.
const CHUNK: u64 = 1 << 20;

/// Where one HF tensor's values come from.
enum Src {
    /// Rows of a GGUF tensor (its matrix view), in order.
    Rows(String, Range<u64>),
    /// `kv_b_proj` per head: `nope` rows from `attn_k_b` (transposed), then `v` from `attn_v_b`.
    KvB {
        k_b: String,
        v_b: String,
        h: u64,
        nope: u64,
        v: u64,
        kvl: u64,
    },
}

struct Entry {
    name: String,
    shape: Vec<u64>,
    src: Src,
    /// Written as BF16 (else F32).
    bf16: bool,
}

impl Entry {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * if self.bf16 { 2 } else { 4 }
    }
}

/// Whether GGUF tensor `name` is block-quantized.
fn quantized(model: &Model, name: &str) -> Result<bool> {
    Ok(model.tensor(name)?.info.ty.block_size() > 1)
}

/// The HF tensors of `model`, in GGUF order.
fn plan(model: &Model) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    for t in model.tensors() {
        let name = &t.info.name;
        let shape = t.info.shape();
        let bf16 = t.info.ty.block_size() > 1;
        let all = Src::Rows(name.clone(), 0..t.info.n_rows());
        if let Some((_, hf)) = GLOBAL_MAP.iter().find(|(g, _)| g == name) {
            out.push(Entry {
                name: hf.to_string(),
                shape,
                src: all,
                bf16,
            });
            continue;
        }
        let (l, suffix) = split_blk(name).with_context(|| format!("no HF name for {name}"))?;
        let pre = format!("model.layers.{l}.");
        if let Some((_, hf)) = LAYER_MAP.iter().find(|(g, _)| *g == suffix) {
            out.push(Entry {
                name: format!("{pre}{hf}"),
                shape,
                src: all,
                bf16,
            });
        } else if let Some((_, proj)) = EXPERT_MAP.iter().find(|(g, _)| *g == suffix) {
            let (e, per, c) = (shape[0], shape[1], shape[2]);
            for x in 0..e {
                out.push(Entry {
                    name: format!("{pre}mlp.experts.{x}.{proj}.weight"),
                    shape: vec![per, c],
                    src: Src::Rows(name.clone(), x * per..(x + 1) * per),
                    bf16,
                });
            }
        } else if suffix == K_B {
            let vb = format!("blk.{l}.{V_B}");
            let vt = model.tensor(&vb)?;
            let (h, kvl, nope) = (shape[0], shape[1], shape[2]);
            let v = vt.info.shape()[1];
            let both_quantized = bf16 && quantized(model, &vb)?;
            out.push(Entry {
                name: format!("{pre}self_attn.kv_b_proj.weight"),
                shape: vec![h * (nope + v), kvl],
                src: Src::KvB {
                    k_b: name.clone(),
                    v_b: vb,
                    h,
                    nope,
                    v,
                    kvl,
                },
                bf16: both_quantized,
            });
        } else if suffix != V_B {
            anyhow::bail!("no HF name for {name}");
        }
    }
    Ok(out)
}

fn to_bytes(v: &[f32], bf16: bool, out: &mut Vec<u8>) {
    out.clear();
    if bf16 {
        out.extend(
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()),
        );
    } else {
        out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    }
}

fn rows(model: &Model, name: &str, r: Range<u64>) -> Result<Vec<f32>> {
    let t = model.tensor(name)?;
    let v = model.dequantize_rows(t, r.clone())?;
    model.release_rows(t, r);
    Ok(v)
}

fn write_entry(model: &Model, e: &Entry, w: &mut dyn Write) -> Result<()> {
    let mut buf = Vec::new();
    match &e.src {
        Src::Rows(name, r) => {
            let row_len = model.tensor(name)?.info.row_len();
            let step = (CHUNK / row_len).max(1);
            let mut i = r.start;
            while i < r.end {
                let j = (i + step).min(r.end);
                to_bytes(&rows(model, name, i..j)?, e.bf16, &mut buf);
                w.write_all(&buf)?;
                i = j;
            }
        }
        Src::KvB {
            k_b,
            v_b,
            h,
            nope,
            v,
            kvl,
        } => {
            for x in 0..*h {
                // attn_k_b head x: [kvl, nope] -> kv_b rows [nope, kvl]
                let k = rows(model, k_b, x * kvl..(x + 1) * kvl)?;
                let (kl, n) = (*kvl as usize, *nope as usize);
                let mut t = vec![0f32; k.len()];
                for c in 0..kl {
                    for d in 0..n {
                        t[d * kl + c] = k[c * n + d];
                    }
                }
                to_bytes(&t, e.bf16, &mut buf);
                w.write_all(&buf)?;
                to_bytes(&rows(model, v_b, x * v..(x + 1) * v)?, e.bf16, &mut buf);
                w.write_all(&buf)?;
            }
        }
    }
    Ok(())
}

/// Writes `dir` (created) with shards of at most about `shard_bytes` bytes each.
pub fn write(model: &Model, dir: &Path, shard_bytes: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let hp = HParams::from_model(model)?;
    let config = json!({
        "model_type": if model.architecture() == Some("glm-dsa") { "glm_moe_dsa" } else { "deepseek_v3" },
        "num_hidden_layers": hp.n_layer,
        "num_nextn_predict_layers": hp.n_nextn,
        "hidden_size": hp.hidden,
        "num_attention_heads": hp.n_head,
        "q_lora_rank": hp.q_lora_rank,
        "kv_lora_rank": hp.kv_lora_rank,
        "qk_nope_head_dim": hp.qk_nope,
        "qk_rope_head_dim": hp.qk_rope,
        "v_head_dim": hp.v_head,
        "n_routed_experts": hp.n_expert,
        "moe_intermediate_size": hp.n_ff_exp,
        "index_n_heads": hp.indexer.as_ref().map(|i| i.n_head),
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let entries = plan(model)?;
    let mut shards: Vec<Vec<&Entry>> = vec![vec![]];
    let mut size = 0;
    for e in &entries {
        let b = e.bytes();
        if size > 0 && size + b > shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += b;
        shards.last_mut().unwrap().push(e);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let mut header = serde_json::Map::new();
        let mut off = 0u64;
        for e in shard {
            let b = e.bytes();
            let dtype = if e.bf16 { "BF16" } else { "F32" };
            header.insert(
                e.name.clone(),
                json!({"dtype": dtype, "shape": e.shape, "data_offsets": [off, off + b]}),
            );
            off += b;
            weight_map.insert(e.name.clone(), file.clone());
        }
        let mut text = serde_json::to_string(&header)?;
        text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
        let mut w = BufWriter::with_capacity(1 << 22, File::create(dir.join(&file))?);
        w.write_all(&(text.len() as u64).to_le_bytes())?;
        w.write_all(text.as_bytes())?;
        for e in shard {
            write_entry(model, e, &mut w)?;
        }
        w.flush()?;
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&json!({"metadata": {}, "weight_map": weight_map}))?,
    )?;
    Ok(())
}
