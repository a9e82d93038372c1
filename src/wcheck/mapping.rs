//! GGUF tensor names to their source in a Hugging Face checkpoint (or in another GGUF of the
//! same model), and back.
//!
//! The layout is llama.cpp's converter's (`conversion/deepseek.py` `DeepseekV2Model`,
//! `conversion/glm.py` `GlmMoeDsaModel`, gguf-py `tensor_mapping.py`), as the architecture spec's
//! section 3 lists it: one HF tensor per GGUF tensor, except
//! - `ffn_{gate,up,down}_exps`: the per-expert `mlp.experts.{e}.{gate,up,down}_proj` stacked on a
//!   new slowest dimension (or the fused `mlp.experts.gate_up_proj` `[E, 2I, H]` / `down_proj`
//!   `[E, H, I]` of checkpoints that keep them fused);
//! - `attn_k_b` / `attn_v_b`: `kv_b_proj` `[H * (nope + v), kv_lora]` viewed as `[H, nope + v,
//!   kv_lora]`, split per head into its first `nope` rows, transposed (`attn_k_b` `[H, kv_lora,
//!   nope]`), and its last `v` rows (`attn_v_b` `[H, v, kv_lora]`);
//! - the MTP block `blk.{N}` (N = trunk layers): a full layer plus `nextn.{eh_proj, enorm, hnorm,
//!   shared_head_norm, shared_head_head, embed_tokens}` from `model.layers.{N}.{eh_proj, enorm,
//!   hnorm, shared_head.norm, shared_head.head, embed_tokens}`.

use super::gather::Gather;
use super::store::Store;
use crate::model::names::split_blk;

/// The MLA dimensions that split `kv_b_proj`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Dims {
    /// Attention heads.
    pub n_head: u64,
    /// Non-RoPE query/key width per head (`qk_nope_head_dim`).
    pub nope: u64,
    /// Value width per head (`v_head_dim`).
    pub v: u64,
    /// KV latent width (`kv_lora_rank`).
    pub kv_lora: u64,
}

/// A GGUF tensor's reference values: how to read them and what to call them.
#[derive(Clone, Debug, PartialEq)]
pub struct Source {
    /// The reading.
    pub gather: Gather,
    /// The reference tensor(s), for reports.
    pub desc: String,
}

/// What the mapping found for one GGUF tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolved {
    /// The reference values.
    Found(Source),
    /// The reference tensor it maps to is absent (its name).
    Missing(String),
    /// The reference tensor exists with a shape that does not fit.
    Shape {
        /// The reference tensor(s).
        desc: String,
        /// Its shape.
        reference: Vec<u64>,
        /// The shape the GGUF tensor needs there.
        expected: Vec<u64>,
    },
    /// No mapping rule knows this name.
    Unknown,
}

/// Which kind of store the reference is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefKind {
    /// A Hugging Face checkpoint.
    Hf,
    /// Another GGUF of the same model.
    Gguf,
}

/// Per-layer GGUF suffixes and their HF names under `model.layers.{L}.`.
pub const LAYER_MAP: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
    ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    (
        "attn_kv_a_mqa.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    ),
    ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("indexer.attn_q_b.weight", "self_attn.indexer.wq_b.weight"),
    ("indexer.attn_k.weight", "self_attn.indexer.wk.weight"),
    ("indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    ("indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    (
        "indexer.proj.weight",
        "self_attn.indexer.weights_proj.weight",
    ),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("ffn_gate_inp.weight", "mlp.gate.weight"),
    ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias"),
    (
        "ffn_gate_shexp.weight",
        "mlp.shared_experts.gate_proj.weight",
    ),
    ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
    (
        "ffn_down_shexp.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    ("nextn.eh_proj.weight", "eh_proj.weight"),
    ("nextn.enorm.weight", "enorm.weight"),
    ("nextn.hnorm.weight", "hnorm.weight"),
    ("nextn.shared_head_norm.weight", "shared_head.norm.weight"),
    ("nextn.shared_head_head.weight", "shared_head.head.weight"),
    ("nextn.embed_tokens.weight", "embed_tokens.weight"),
];

/// Global GGUF names and their HF names.
pub const GLOBAL_MAP: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// Stacked-expert GGUF suffixes and the per-expert HF projection they stack.
pub const EXPERT_MAP: &[(&str, &str)] = &[
    ("ffn_gate_exps.weight", "gate_proj"),
    ("ffn_up_exps.weight", "up_proj"),
    ("ffn_down_exps.weight", "down_proj"),
];

/// GGUF suffix of the K part of `kv_b`.
pub const K_B: &str = "attn_k_b.weight";
/// GGUF suffix of the V part of `kv_b`.
pub const V_B: &str = "attn_v_b.weight";
/// GGUF suffix of the unsplit `kv_b` (older files).
pub const KV_B: &str = "attn_kv_b.weight";
/// GGUF suffix of fused expert gate+up.
pub const GATE_UP_EXPS: &str = "ffn_gate_up_exps.weight";

/// HF prefix of layer `l`.
pub fn hf_layer(l: usize) -> String {
    format!("model.layers.{l}.")
}

/// HF name of the per-expert projection `proj` of expert `e` in layer `l`.
pub fn hf_expert(l: usize, e: u64, proj: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight")
}

/// The GGUF tensor(s) an HF tensor becomes (empty when no rule knows it). `kv_b_proj` becomes
/// both `attn_k_b` and `attn_v_b`.
pub fn gguf_names_for_hf(hf: &str) -> Vec<String> {
    for (g, h) in GLOBAL_MAP {
        if hf == *h {
            return vec![g.to_string()];
        }
    }
    let Some(rest) = hf.strip_prefix("model.layers.") else {
        return vec![];
    };
    let Some((l, rest)) = rest.split_once('.') else {
        return vec![];
    };
    let Ok(l) = l.parse::<usize>() else {
        return vec![];
    };
    if rest == "self_attn.kv_b_proj.weight" {
        return vec![format!("blk.{l}.{K_B}"), format!("blk.{l}.{V_B}")];
    }
    for (g, h) in LAYER_MAP {
        if rest == *h {
            return vec![format!("blk.{l}.{g}")];
        }
    }
    if let Some(e) = rest.strip_prefix("mlp.experts.") {
        if let Some((idx, proj)) = e.split_once('.') {
            if idx.parse::<u64>().is_ok() {
                for (g, p) in EXPERT_MAP {
                    if proj == format!("{p}.weight") {
                        return vec![format!("blk.{l}.{g}")];
                    }
                }
            }
        }
        match e {
            "gate_up_proj" => {
                return vec![
                    format!("blk.{l}.ffn_gate_exps.weight"),
                    format!("blk.{l}.ffn_up_exps.weight"),
                ]
            }
            "down_proj" => return vec![format!("blk.{l}.ffn_down_exps.weight")],
            _ => {}
        }
    }
    vec![]
}

/// Finds the reference values of GGUF tensor `name` (PyTorch shape `left`) in `refs`.
pub fn resolve(
    name: &str,
    left: &[u64],
    refs: &dyn Store,
    kind: RefKind,
    dims: Option<&Dims>,
) -> Resolved {
    match kind {
        RefKind::Hf => resolve_hf(name, left, refs, dims),
        RefKind::Gguf => resolve_gguf(name, left, refs, dims),
    }
}

/// One reference tensor whose shape must equal `want`.
fn whole(refs: &dyn Store, hf: &str, want: &[u64]) -> Resolved {
    match refs.meta(hf) {
        None => Resolved::Missing(hf.to_string()),
        Some(m) if m.shape == want => Resolved::Found(Source {
            gather: Gather::Rows {
                name: hf.to_string(),
                start: 0,
            },
            desc: hf.to_string(),
        }),
        Some(m) => Resolved::Shape {
            desc: hf.to_string(),
            reference: m.shape,
            expected: want.to_vec(),
        },
    }
}

/// The K or V part of a `kv_b` tensor `kvb` (PyTorch `[H * (nope + v), kv_lora]`).
fn kv_part(refs: &dyn Store, kvb: &str, k: bool, left: &[u64], dims: Option<&Dims>) -> Resolved {
    let Some(m) = refs.meta(kvb) else {
        return Resolved::Missing(kvb.to_string());
    };
    let d = match dims {
        Some(d) => *d,
        // Without a config: the GGUF tensor's own shape ([H, kv_lora, nope] or [H, v, kv_lora])
        // and the reference's row count give the rest.
        None => match (left, m.shape.as_slice()) {
            ([h, a, b], [rows, _]) if *h > 0 => {
                let (kvl, w) = if k { (*a, *b) } else { (*b, *a) };
                let other = (rows / h).saturating_sub(w);
                let (nope, v) = if k { (w, other) } else { (other, w) };
                Dims {
                    n_head: *h,
                    nope,
                    v,
                    kv_lora: kvl,
                }
            }
            _ => {
                return Resolved::Shape {
                    desc: kvb.to_string(),
                    reference: m.shape,
                    expected: vec![],
                }
            }
        },
    };
    let per = d.nope + d.v;
    let want_ref = vec![d.n_head * per, d.kv_lora];
    let want_left = if k {
        vec![d.n_head, d.kv_lora, d.nope]
    } else {
        vec![d.n_head, d.v, d.kv_lora]
    };
    if m.shape != want_ref || left != want_left.as_slice() {
        let expected = if m.shape != want_ref {
            want_ref
        } else {
            want_left
        };
        return Resolved::Shape {
            desc: kvb.to_string(),
            reference: m.shape,
            expected,
        };
    }
    let (gather, what) = if k {
        (
            Gather::Transposed {
                name: kvb.to_string(),
                width: d.kv_lora,
                len: d.nope,
                stride: per,
                offset: 0,
            },
            "K rows of each head, transposed",
        )
    } else {
        (
            Gather::Strided {
                name: kvb.to_string(),
                group: d.v,
                stride: per,
                offset: d.nope,
            },
            "V rows of each head",
        )
    };
    Resolved::Found(Source {
        gather,
        desc: format!("{kvb} ({what})"),
    })
}

fn resolve_hf(name: &str, left: &[u64], refs: &dyn Store, dims: Option<&Dims>) -> Resolved {
    for (g, h) in GLOBAL_MAP {
        if name == *g {
            return whole(refs, h, left);
        }
    }
    let Some((l, suffix)) = split_blk(name) else {
        return Resolved::Unknown;
    };
    let pre = hf_layer(l);
    for (g, h) in LAYER_MAP {
        if suffix == *g {
            return whole(refs, &format!("{pre}{h}"), left);
        }
    }
    let kvb = format!("{pre}self_attn.kv_b_proj.weight");
    if suffix == K_B || suffix == V_B {
        return kv_part(refs, &kvb, suffix == K_B, left, dims);
    }
    let projs: Vec<&str> = if suffix == GATE_UP_EXPS {
        vec!["gate_proj", "up_proj"]
    } else if let Some((_, p)) = EXPERT_MAP.iter().find(|(g, _)| *g == suffix) {
        vec![p]
    } else {
        return Resolved::Unknown;
    };
    let [e, rows, cols] = left[..] else {
        return Resolved::Shape {
            desc: hf_expert(l, 0, projs[0]),
            reference: vec![],
            expected: left.to_vec(),
        };
    };
    let per_proj = rows / projs.len() as u64;
    if refs.meta(&hf_expert(l, 0, projs[0])).is_some() {
        let mut pieces = Vec::new();
        for x in 0..e {
            for (k, p) in projs.iter().enumerate() {
                let hf = hf_expert(l, x, p);
                match whole(refs, &hf, &[per_proj, cols]) {
                    Resolved::Found(s) => {
                        pieces.push((x * rows + k as u64 * per_proj, per_proj, s.gather))
                    }
                    other => return other,
                }
            }
        }
        return Resolved::Found(Source {
            gather: Gather::Pieces(pieces),
            desc: format!(
                "{pre}mlp.experts.{{0..{}}}.{}.weight",
                e.saturating_sub(1),
                projs.join("+")
            ),
        });
    }
    // Fused experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    let fused_gu = format!("{pre}mlp.experts.gate_up_proj");
    let fused_d = format!("{pre}mlp.experts.down_proj");
    let (fname, group, stride, offset) = match suffix {
        "ffn_gate_exps.weight" => (&fused_gu, rows, 2 * rows, 0),
        "ffn_up_exps.weight" => (&fused_gu, rows, 2 * rows, rows),
        GATE_UP_EXPS => (&fused_gu, rows, rows, 0),
        _ => (&fused_d, rows, rows, 0),
    };
    match refs.meta(fname) {
        None => Resolved::Missing(hf_expert(l, 0, projs[0])),
        Some(m) if m.shape == [e, stride, cols] => Resolved::Found(Source {
            gather: Gather::Strided {
                name: fname.clone(),
                group,
                stride,
                offset,
            },
            desc: if stride == group {
                fname.clone()
            } else {
                format!(
                    "{fname} ({} rows of each expert)",
                    if offset == 0 { "gate" } else { "up" }
                )
            },
        }),
        Some(m) => Resolved::Shape {
            desc: fname.clone(),
            reference: m.shape,
            expected: vec![e, stride, cols],
        },
    }
}

fn resolve_gguf(name: &str, left: &[u64], refs: &dyn Store, dims: Option<&Dims>) -> Resolved {
    if refs.meta(name).is_some() {
        return whole(refs, name, left);
    }
    let Some((l, suffix)) = split_blk(name) else {
        return Resolved::Missing(name.to_string());
    };
    let kvb = format!("blk.{l}.{KV_B}");
    if (suffix == K_B || suffix == V_B) && refs.meta(&kvb).is_some() {
        return kv_part(refs, &kvb, suffix == K_B, left, dims);
    }
    let (kb, vb) = (format!("blk.{l}.{K_B}"), format!("blk.{l}.{V_B}"));
    if suffix == KV_B {
        if let (Some(k), Some(v)) = (refs.meta(&kb), refs.meta(&vb)) {
            // kv_b rows per head: nope K rows (columns of k_b's head block), then v V rows.
            if let ([h, kvl, nope], [h2, vv, kvl2], [rows, cols]) =
                (&k.shape[..], &v.shape[..], left)
            {
                if h == h2 && kvl == kvl2 && *cols == *kvl && *rows == h * (nope + vv) {
                    let mut pieces = Vec::new();
                    for x in 0..*h {
                        let base = x * (nope + vv);
                        pieces.push((
                            base,
                            *nope,
                            Gather::Transposed {
                                name: kb.clone(),
                                width: *nope,
                                len: *kvl,
                                stride: 0,
                                offset: x * kvl,
                            },
                        ));
                        pieces.push((
                            base + nope,
                            *vv,
                            Gather::Rows {
                                name: vb.clone(),
                                start: x * vv,
                            },
                        ));
                    }
                    return Resolved::Found(Source {
                        gather: Gather::Pieces(pieces),
                        desc: format!("{kb} + {vb} (kv_b reassembled)"),
                    });
                }
            }
            return Resolved::Shape {
                desc: format!("{kb} + {vb}"),
                reference: k.shape,
                expected: left.to_vec(),
            };
        }
    }
    let fused = format!("blk.{l}.{GATE_UP_EXPS}");
    if let ("ffn_gate_exps.weight" | "ffn_up_exps.weight", Some(m), [e, rows, cols]) =
        (suffix, refs.meta(&fused), left)
    {
        let off = if suffix == "ffn_up_exps.weight" {
            *rows
        } else {
            0
        };
        if m.shape == [*e, 2 * rows, *cols] {
            return Resolved::Found(Source {
                gather: Gather::Strided {
                    name: fused.clone(),
                    group: *rows,
                    stride: 2 * rows,
                    offset: off,
                },
                desc: format!("{fused} ({} rows)", if off == 0 { "gate" } else { "up" }),
            });
        }
    }
    Resolved::Missing(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_map_back() {
        assert_eq!(
            gguf_names_for_hf("model.layers.3.mlp.experts.17.down_proj.weight"),
            vec!["blk.3.ffn_down_exps.weight"]
        );
        assert_eq!(
            gguf_names_for_hf("model.layers.0.self_attn.kv_b_proj.weight"),
            vec!["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"]
        );
        assert_eq!(
            gguf_names_for_hf("model.layers.78.shared_head.norm.weight"),
            vec!["blk.78.nextn.shared_head_norm.weight"]
        );
        assert_eq!(gguf_names_for_hf("lm_head.weight"), vec!["output.weight"]);
        assert!(gguf_names_for_hf("model.layers.1.mlp.gate.weight_scale_inv").is_empty());
    }
}
