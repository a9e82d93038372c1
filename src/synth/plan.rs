//! The tensors of a synthetic model: real names and shapes (shared spec
//! `glm5-architecture.md` section 3, llama.cpp `src/llama-model.cpp` for `LLM_ARCH_DEEPSEEK2` /
//! `LLM_ARCH_GLM_DSA`), each with a storage type from the chosen mix and how to fill it.

use anyhow::{bail, Result};

use super::blocks::{is_supported, supported, Init};
use super::dims::Dims;
use crate::model::Arch;
use crate::quant::GgmlType;

/// Which types the weights get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeMix {
    /// A mix like unsloth's UD-Q4_K_XL files: Q4_K/Q5_K/Q6_K matrices, Q8_0 for the MLA
    /// projections and `attn_k_b`, F32 norms, router and biases.
    UdQ4KXl,
    /// Every matrix in one type (shape fallbacks apply); norms, router and biases stay F32.
    Single(GgmlType),
}

impl TypeMix {
    /// Parses `ud-q4_k_xl` or a GGML type name (`q8_0`, `f32`, `q4_k`, ...).
    pub fn parse(s: &str) -> Result<TypeMix> {
        if s.eq_ignore_ascii_case("ud-q4_k_xl") {
            return Ok(TypeMix::UdQ4KXl);
        }
        match GgmlType::from_name(s) {
            Some(t) if is_supported(t) => Ok(TypeMix::Single(t)),
            _ => {
                let names: Vec<String> = supported().map(|t| t.name().to_lowercase()).collect();
                bail!(
                    "synth: unknown --types {s:?} (expected ud-q4_k_xl or one of {})",
                    names.join(", ")
                )
            }
        }
    }
}

/// What a tensor is, for choosing its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    TokenEmbd,
    Output,
    /// 1-D: norms and biases; always F32.
    Vector,
    /// The MoE router; F32 (llama.cpp's quantizer never quantizes `ffn_gate_inp`).
    Router,
    AttnQA,
    AttnQB,
    AttnKvA,
    AttnKB,
    AttnVB,
    AttnOut,
    IndexerQB,
    IndexerK,
    IndexerProj,
    DenseGateUp,
    DenseDown,
    ExpGateUp,
    ExpDown {
        first_moe: bool,
    },
    ShexpGateUp,
    ShexpDown,
    EhProj,
}

/// One tensor to write.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    /// GGUF name.
    pub name: String,
    /// Dimensions, fastest first.
    pub ne: Vec<u64>,
    /// Storage type (after shape fallbacks).
    pub ty: GgmlType,
    /// How its values are drawn.
    pub init: Init,
}

/// The type for a tensor whose rows (`ne0`) do not fit `ty`'s block: the row's fallback in the
/// type table (llama.cpp `src/llama-quant.cpp`, `llama_tensor_get_type`, the `nx % QK_K != 0`
/// fallbacks; F16 for types without one), then F16 when even that block does not fit.
pub fn shape_fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    if ne0 % ty.block_size() as u64 == 0 {
        return ty;
    }
    match ty.info().fallback {
        Some(t) if ne0 % t.block_size() as u64 == 0 => t,
        _ => GgmlType::F16,
    }
}

fn mix_type(mix: TypeMix, role: Role) -> GgmlType {
    use GgmlType as T;
    match (mix, role) {
        (_, Role::Vector | Role::Router) => T::F32,
        (TypeMix::Single(t), _) => t,
        (TypeMix::UdQ4KXl, r) => match r {
            Role::TokenEmbd => T::Q4_K,
            Role::Output => T::Q6_K,
            Role::AttnQA => T::Q5_K,
            Role::AttnOut => T::Q4_K,
            Role::AttnQB | Role::AttnKvA | Role::AttnKB | Role::AttnVB => T::Q8_0,
            Role::IndexerQB | Role::IndexerK => T::Q8_0,
            Role::IndexerProj => T::F32,
            Role::DenseGateUp | Role::ExpGateUp => T::Q4_K,
            Role::DenseDown => T::Q6_K,
            Role::ExpDown { first_moe: true } => T::Q6_K,
            Role::ExpDown { first_moe: false } => T::Q5_K,
            Role::ShexpGateUp => T::Q6_K,
            Role::ShexpDown | Role::EhProj => T::Q8_0,
            Role::Vector | Role::Router => T::F32,
        },
    }
}

/// Collects tensors in file order.
struct Planner {
    mix: TypeMix,
    out: Vec<TensorPlan>,
}

impl Planner {
    fn add(&mut self, name: String, ne: &[u64], role: Role, init: Init) {
        let ty = shape_fallback(mix_type(self.mix, role), ne[0]);
        self.out.push(TensorPlan {
            name,
            ne: ne.to_vec(),
            ty,
            init,
        });
    }

    /// A matrix whose rows (`ne0` values) are dotted with an input: std `1/sqrt(ne0)`.
    fn weight(&mut self, name: String, ne: &[u64], role: Role) {
        let std = 1.0 / (ne[0] as f32).sqrt();
        self.add(name, ne, role, Init::Weight(std));
    }

    fn norm(&mut self, name: String, n: u64) {
        self.add(name, &[n], Role::Vector, Init::Norm);
    }
}

/// All tensors of a model with dimensions `d` (already cut to the layers to write).
pub fn plan(arch: Arch, d: &Dims, mix: TypeMix) -> Result<Vec<TensorPlan>> {
    if arch == Arch::GlmDsa && d.indexer.is_none() {
        bail!("synth: glm-dsa dimensions need an indexer");
    }
    let mut p = Planner {
        mix,
        out: Vec::new(),
    };
    let h = d.hidden;
    p.weight("token_embd.weight".into(), &[h, d.vocab], Role::TokenEmbd);
    p.norm("output_norm.weight".into(), h);
    p.weight("output.weight".into(), &[h, d.vocab], Role::Output);
    let first_moe = d.n_dense;
    for il in 0..d.block_count() {
        let b = |s: &str| format!("blk.{il}.{s}");
        p.norm(b("attn_norm.weight"), h);
        p.weight(b("attn_q_a.weight"), &[h, d.q_lora], Role::AttnQA);
        p.norm(b("attn_q_a_norm.weight"), d.q_lora);
        let q_width = d.n_head * (d.qk_nope + d.qk_rope);
        p.weight(b("attn_q_b.weight"), &[d.q_lora, q_width], Role::AttnQB);
        let kv_a = d.kv_lora + d.qk_rope;
        p.weight(b("attn_kv_a_mqa.weight"), &[h, kv_a], Role::AttnKvA);
        p.norm(b("attn_kv_a_norm.weight"), d.kv_lora);
        // [H, kv_lora, nope] and [H, v, kv_lora] in PyTorch order (spec 3.1).
        let k_b = [d.qk_nope, d.kv_lora, d.n_head];
        p.weight(b("attn_k_b.weight"), &k_b, Role::AttnKB);
        let v_b = [d.kv_lora, d.v_head, d.n_head];
        p.weight(b("attn_v_b.weight"), &v_b, Role::AttnVB);
        let o_in = d.n_head * d.v_head;
        p.weight(b("attn_output.weight"), &[o_in, h], Role::AttnOut);
        if let Some(ix) = d.indexer {
            let q_b = [d.q_lora, ix.n_head * ix.head_dim];
            p.weight(b("indexer.attn_q_b.weight"), &q_b, Role::IndexerQB);
            p.weight(
                b("indexer.attn_k.weight"),
                &[h, ix.head_dim],
                Role::IndexerK,
            );
            p.norm(b("indexer.k_norm.weight"), ix.head_dim);
            let bias = b("indexer.k_norm.bias");
            p.add(bias, &[ix.head_dim], Role::Vector, Init::Bias);
            p.weight(b("indexer.proj.weight"), &[h, ix.n_head], Role::IndexerProj);
        }
        p.norm(b("ffn_norm.weight"), h);
        if il < d.n_dense {
            let (f, r) = (d.dense_ff, Role::DenseGateUp);
            p.weight(b("ffn_gate.weight"), &[h, f], r);
            p.weight(b("ffn_up.weight"), &[h, f], r);
            p.weight(b("ffn_down.weight"), &[f, h], Role::DenseDown);
        } else {
            let (e, f) = (d.n_expert, d.expert_ff);
            p.weight(b("ffn_gate_inp.weight"), &[h, e], Role::Router);
            p.add(b("exp_probs_b.bias"), &[e], Role::Vector, Init::Bias);
            p.weight(b("ffn_gate_exps.weight"), &[h, f, e], Role::ExpGateUp);
            p.weight(b("ffn_up_exps.weight"), &[h, f, e], Role::ExpGateUp);
            let down = Role::ExpDown {
                first_moe: il == first_moe,
            };
            p.weight(b("ffn_down_exps.weight"), &[f, h, e], down);
            let fs = f * d.n_shared;
            p.weight(b("ffn_gate_shexp.weight"), &[h, fs], Role::ShexpGateUp);
            p.weight(b("ffn_up_shexp.weight"), &[h, fs], Role::ShexpGateUp);
            p.weight(b("ffn_down_shexp.weight"), &[fs, h], Role::ShexpDown);
        }
        if il >= d.n_layer {
            // MTP layer (llama.cpp loads these for `nextn_predict_layers`; not run).
            p.weight(b("nextn.eh_proj.weight"), &[2 * h, h], Role::EhProj);
            p.norm(b("nextn.enorm.weight"), h);
            p.norm(b("nextn.hnorm.weight"), h);
            p.norm(b("nextn.shared_head_norm.weight"), h);
        }
    }
    Ok(p.out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType as T;

    #[test]
    fn fallbacks_follow_llama_quant() {
        assert_eq!(shape_fallback(T::Q4_K, 192), T::Q5_0);
        assert_eq!(shape_fallback(T::Q5_K, 192), T::Q5_1);
        assert_eq!(shape_fallback(T::Q6_K, 192), T::Q8_0);
        assert_eq!(shape_fallback(T::Q3_K, 192), T::Q4_0);
        assert_eq!(shape_fallback(T::IQ2_XS, 192), T::IQ4_NL);
        assert_eq!(shape_fallback(T::Q4_K, 48), T::F16);
        assert_eq!(shape_fallback(T::Q8_0, 48), T::F16);
        assert_eq!(shape_fallback(T::Q4_K, 512), T::Q4_K);
    }

    #[test]
    fn type_names_parse() {
        assert_eq!(TypeMix::parse("UD-Q4_K_XL").unwrap(), TypeMix::UdQ4KXl);
        assert_eq!(TypeMix::parse("q8_0").unwrap(), TypeMix::Single(T::Q8_0));
        assert!(TypeMix::parse("q1_0").is_err());
    }
}
