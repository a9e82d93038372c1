//! Tiny synthetic glm-dsa / deepseek2 models built in memory for unit tests: metadata from a
//! small set of dimensions and F32 weights from a seeded generator, every tensor named and shaped
//! by [`shapes::expected_ne`].

use std::collections::HashMap;

use crate::gguf::{GgufFile, GgufWriter, Model, Value, ValueType};
use crate::model::names::{self, blk};
use crate::model::shapes;
use crate::model::{keys, Arch, Gating, HParams, IndexerParams, RopeParams};
use crate::quant::GgmlType;
use crate::util::rng::SplitMix64;

/// Dimensions of a tiny test model (a small [`HParams`]).
pub fn tiny_hparams(arch: Arch) -> HParams {
    HParams {
        arch,
        hidden: 16,
        n_block: 2,
        n_nextn: 0,
        n_layer: 2,
        n_dense: 1,
        n_ff: 24,
        n_ctx: None,
        n_head: 2,
        q_lora_rank: Some(12),
        kv_lora_rank: 8,
        qk_nope: 6,
        qk_rope: 4,
        v_head: 5,
        rms_eps: 1e-6,
        n_expert: 4,
        n_expert_used: 2,
        n_expert_shared: 1,
        n_ff_exp: 8,
        groups: None,
        expert_weights_scale: 2.5,
        expert_weights_norm: true,
        gating: Gating::Sigmoid,
        rope: RopeParams {
            dim: 4,
            base: 10000.0,
            yarn: None,
        },
        indexer: match arch {
            Arch::GlmDsa => Some(IndexerParams {
                n_head: 2,
                head_dim: 8,
                top_k: 3,
                full: vec![true, true],
            }),
            Arch::Deepseek2 => None,
        },
    }
}

/// Metadata keys of `hp` (all written; tests remove or add keys through `edit`).
pub fn metadata(hp: &HParams) -> Vec<(String, Value)> {
    let a = hp.arch.as_str();
    let u = |k: &str, v: usize| (keys::arch_key(a, k), Value::U32(v as u32));
    let f = |k: &str, v: f64| (keys::arch_key(a, k), Value::F32(v as f32));
    let mut m = vec![
        (
            "general.architecture".to_string(),
            Value::String(a.to_string()),
        ),
        u(keys::BLOCK_COUNT, hp.n_block),
        u(keys::EMBEDDING_LENGTH, hp.hidden),
        u(keys::FEED_FORWARD_LENGTH, hp.n_ff),
        u(keys::LEADING_DENSE_BLOCK_COUNT, hp.n_dense),
        u(keys::ATTN_HEAD_COUNT, hp.n_head),
        u(keys::ATTN_KV_LORA_RANK, hp.kv_lora_rank),
        u(keys::ATTN_KEY_LENGTH_MLA, hp.qk_nope + hp.qk_rope),
        u(keys::ATTN_VALUE_LENGTH_MLA, hp.v_head),
        u(keys::ROPE_DIMENSION_COUNT, hp.qk_rope),
        f(keys::ROPE_FREQ_BASE, hp.rope.base),
        f(keys::ATTN_LAYERNORM_RMS_EPS, hp.rms_eps),
        u(keys::EXPERT_COUNT, hp.n_expert),
        u(keys::EXPERT_USED_COUNT, hp.n_expert_used),
        u(keys::EXPERT_SHARED_COUNT, hp.n_expert_shared),
        u(keys::EXPERT_FEED_FORWARD_LENGTH, hp.n_ff_exp),
        f(keys::EXPERT_WEIGHTS_SCALE, hp.expert_weights_scale),
        (
            keys::arch_key(a, keys::EXPERT_WEIGHTS_NORM),
            Value::Bool(hp.expert_weights_norm),
        ),
        u(
            keys::EXPERT_GATING_FUNC,
            match hp.gating {
                Gating::Softmax => 1,
                Gating::Sigmoid => 2,
            },
        ),
    ];
    if hp.n_nextn > 0 {
        m.push(u(keys::NEXTN_PREDICT_LAYERS, hp.n_nextn));
    }
    if let Some(q) = hp.q_lora_rank {
        m.push(u(keys::ATTN_Q_LORA_RANK, q));
    }
    if let Some(c) = hp.n_ctx {
        m.push(u(keys::CONTEXT_LENGTH, c));
    }
    if let Some(ix) = &hp.indexer {
        m.push(u(keys::INDEXER_HEAD_COUNT, ix.n_head));
        m.push(u(keys::INDEXER_KEY_LENGTH, ix.head_dim));
        m.push(u(keys::INDEXER_TOP_K, ix.top_k));
        if ix.full.iter().any(|&f| !f) {
            let v = ix.full.iter().map(|&b| Value::Bool(b)).collect();
            m.push((
                keys::arch_key(a, keys::INDEXER_TYPES),
                Value::Array(ValueType::Bool, v),
            ));
        }
    }
    m
}

/// Tensor names of a model with `hp` (run layers only).
pub fn tensor_names(hp: &HParams) -> Vec<String> {
    let mut v = vec![
        names::TOKEN_EMBD.to_string(),
        names::OUTPUT_NORM.to_string(),
        names::OUTPUT.to_string(),
    ];
    for l in 0..hp.n_layer {
        let mut s = vec![
            blk::ATTN_NORM,
            blk::ATTN_KV_A_MQA,
            blk::ATTN_KV_A_NORM,
            blk::ATTN_K_B,
            blk::ATTN_V_B,
            blk::ATTN_OUTPUT,
            blk::FFN_NORM,
        ];
        if hp.q_lora_rank.is_some() {
            s.extend([blk::ATTN_Q_A, blk::ATTN_Q_A_NORM, blk::ATTN_Q_B]);
        } else {
            s.push(blk::ATTN_Q);
        }
        if hp.indexer.as_ref().is_some_and(|ix| ix.full[l]) {
            s.extend([
                blk::INDEXER_Q_B,
                blk::INDEXER_K,
                blk::INDEXER_K_NORM,
                blk::INDEXER_K_NORM_B,
                blk::INDEXER_PROJ,
            ]);
        }
        if hp.is_dense(l) {
            s.extend([blk::FFN_GATE, blk::FFN_UP, blk::FFN_DOWN]);
        } else {
            s.extend([
                blk::FFN_GATE_INP,
                blk::EXP_PROBS_B,
                blk::FFN_GATE_EXPS,
                blk::FFN_UP_EXPS,
                blk::FFN_DOWN_EXPS,
            ]);
            if hp.n_expert_shared > 0 {
                s.extend([blk::FFN_GATE_SHEXP, blk::FFN_UP_SHEXP, blk::FFN_DOWN_SHEXP]);
            }
        }
        v.extend(s.iter().map(|x| names::blk(l, x)));
    }
    v
}

/// A model with metadata `meta` and F32 weights for `tensors` shaped for `hp` (norm weights near 1).
pub fn build(hp: &HParams, meta: &[(String, Value)], tensors: &[String], n_vocab: usize) -> Model {
    build_with(hp, meta, tensors, n_vocab, &HashMap::new())
}

/// [`build`] with the values of some tensors given (`overrides`, name -> values in GGUF order).
pub fn build_with(
    hp: &HParams,
    meta: &[(String, Value)],
    tensors: &[String],
    n_vocab: usize,
    overrides: &HashMap<String, Vec<f32>>,
) -> Model {
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add(k, v.clone()).unwrap();
    }
    for name in tensors {
        let ne = shapes::expected_ne(hp, n_vocab, name)
            .unwrap_or_else(|| panic!("no expected shape for {name}"));
        w.add_tensor(name, &ne, GgmlType::F32).unwrap();
    }
    let mut rng = SplitMix64::new(7);
    let bytes = w
        .to_bytes(&mut |info, out| {
            let n = info.n_elements() as usize;
            let norm = info.name.ends_with("norm.weight");
            let mut buf = Vec::with_capacity(n * 4);
            for i in 0..n {
                let x = match overrides.get(&info.name) {
                    Some(v) => v[i],
                    // Uniform in [-0.5, 0.5), norm weights shifted to around 1.
                    None => rng.uniform() - 0.5 + if norm { 1.0 } else { 0.0 },
                };
                buf.extend_from_slice(&x.to_le_bytes());
            }
            out.write_all(&buf)?;
            Ok(())
        })
        .unwrap();
    Model::from_shards(vec![GgufFile::from_bytes("tiny.gguf", bytes).unwrap()]).unwrap()
}

/// The model of `hp` with every tensor, 32 tokens of vocabulary.
pub fn tiny_model(hp: &HParams) -> Model {
    build(hp, &metadata(hp), &tensor_names(hp), 32)
}
