//! Dimension presets of synthetic models per [`Arch`], and the hyperparameter metadata they
//! carry. Values from shared spec `glm5-architecture.md` sections 1 and 3; key names from
//! [`crate::model::keys`].

use anyhow::{bail, Result};

use crate::gguf::GgufWriter;
use crate::model::hparams::GATING_SIGMOID;
use crate::model::{keys, Arch};

/// The DSA lightning indexer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    /// Indexer heads.
    pub n_head: u64,
    /// Indexer head dimension.
    pub head_dim: u64,
    /// Keys kept per query.
    pub top_k: u64,
}

/// YaRN RoPE scaling (DeepSeek-V3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`.
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub original_context: u32,
    /// `rope.scaling.yarn_log_multiplier` (0.1 * mscale_all_dim).
    pub log_multiplier: f32,
}

/// Every size of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    /// Preset name (`glm5`, `deepseek-v3`, `tiny`).
    pub name: &'static str,
    /// Residual width.
    pub hidden: u64,
    /// Attention heads.
    pub n_head: u64,
    /// Query LoRA rank.
    pub q_lora: u64,
    /// KV LoRA rank (latent width).
    pub kv_lora: u64,
    /// Per-head non-RoPE query/key width.
    pub qk_nope: u64,
    /// RoPE width (query per head, and the shared key).
    pub qk_rope: u64,
    /// Per-head value width.
    pub v_head: u64,
    /// Dense MLP width.
    pub dense_ff: u64,
    /// Expert (and shared expert) width.
    pub expert_ff: u64,
    /// Routed experts.
    pub n_expert: u64,
    /// Experts per token.
    pub n_expert_used: u64,
    /// Shared experts.
    pub n_shared: u64,
    /// Expert groups.
    pub n_group: u64,
    /// Groups kept per token.
    pub topk_group: u64,
    /// Layers run at inference.
    pub n_layer: u64,
    /// Leading dense layers.
    pub n_dense: u64,
    /// MTP layers stored after the others (not run).
    pub nextn: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Context length.
    pub context: u64,
    /// DSA indexer (GLM-5 only).
    pub indexer: Option<IndexerDims>,
    /// RoPE base.
    pub rope_theta: f32,
    /// YaRN scaling, if any.
    pub yarn: Option<Yarn>,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// `expert_weights_scale` (routed_scaling_factor).
    pub routed_scale: f32,
}

impl Dims {
    /// The preset `name` for `arch`: `glm5` (glm-dsa), `deepseek-v3` (deepseek2), `tiny` (both).
    pub fn preset(arch: Arch, name: &str) -> Result<Dims> {
        Ok(match (arch, name) {
            (Arch::GlmDsa, "glm5") => Dims {
                name: "glm5",
                hidden: 6144,
                n_head: 64,
                q_lora: 2048,
                kv_lora: 512,
                qk_nope: 192,
                qk_rope: 64,
                v_head: 256,
                dense_ff: 12288,
                expert_ff: 2048,
                n_expert: 256,
                n_expert_used: 8,
                n_shared: 1,
                n_group: 1,
                topk_group: 1,
                n_layer: 78,
                n_dense: 3,
                nextn: 1,
                vocab: 154_880,
                context: 202_752,
                indexer: Some(IndexerDims {
                    n_head: 32,
                    head_dim: 128,
                    top_k: 2048,
                }),
                rope_theta: 1.0e6,
                yarn: None,
                rms_eps: 1e-5,
                routed_scale: 2.5,
            },
            (Arch::Deepseek2, "deepseek-v3") => Dims {
                name: "deepseek-v3",
                hidden: 7168,
                n_head: 128,
                q_lora: 1536,
                kv_lora: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_head: 128,
                dense_ff: 18432,
                expert_ff: 2048,
                n_expert: 256,
                n_expert_used: 8,
                n_shared: 1,
                n_group: 8,
                topk_group: 4,
                n_layer: 61,
                n_dense: 3,
                nextn: 0,
                vocab: 129_280,
                context: 163_840,
                indexer: None,
                rope_theta: 10_000.0,
                yarn: Some(Yarn {
                    factor: 40.0,
                    original_context: 4096,
                    log_multiplier: 0.1,
                }),
                rms_eps: 1e-6,
                routed_scale: 2.5,
            },
            // Small sizes that keep every K-quant tensor's ne0 a multiple of 256, attn_k_b's
            // ne0 (qk_nope) a multiple of 32 but not of 256 as in the real models, and the
            // indexer head dim at 64 (llama.cpp's GLM-5 graph needs >= 64).
            (arch, "tiny") => {
                let glm = arch == Arch::GlmDsa;
                Dims {
                    name: "tiny",
                    hidden: 256,
                    n_head: 4,
                    q_lora: 256,
                    kv_lora: 128,
                    qk_nope: if glm { 96 } else { 64 },
                    qk_rope: 32,
                    v_head: 64,
                    dense_ff: 512,
                    expert_ff: 256,
                    n_expert: 8,
                    n_expert_used: 2,
                    n_shared: 1,
                    n_group: if glm { 1 } else { 4 },
                    topk_group: if glm { 1 } else { 2 },
                    n_layer: 3,
                    n_dense: 1,
                    nextn: u64::from(glm),
                    vocab: 512,
                    context: 4096,
                    indexer: glm.then_some(IndexerDims {
                        n_head: 4,
                        head_dim: 64,
                        top_k: 8,
                    }),
                    rope_theta: if glm { 1.0e6 } else { 10_000.0 },
                    yarn: (!glm).then_some(Yarn {
                        factor: 16.0,
                        original_context: 256,
                        log_multiplier: 0.1,
                    }),
                    rms_eps: if glm { 1e-5 } else { 1e-6 },
                    routed_scale: 2.5,
                }
            }
            (arch, other) => bail!(
                "synth: --dims {other:?} is not available for --arch {} (use {} or tiny)",
                arch.as_str(),
                match arch {
                    Arch::GlmDsa => "glm5",
                    Arch::Deepseek2 => "deepseek-v3",
                }
            ),
        })
    }

    /// Keeps only the first `n` layers (the leading dense ones first); the MTP layers stay.
    pub fn with_layers(mut self, n: u64) -> Result<Dims> {
        if n == 0 || n > self.n_layer {
            bail!(
                "synth: --layers {n} is outside 1..={} for --dims {}",
                self.n_layer,
                self.name
            );
        }
        self.n_layer = n;
        self.n_dense = self.n_dense.min(n);
        Ok(self)
    }

    /// Layers stored in the file (`block_count`): the layers run plus the MTP layers.
    pub fn block_count(&self) -> u64 {
        self.n_layer + self.nextn
    }

    /// Writes the `{arch}.*` hyperparameter keys.
    pub fn write_metadata(&self, arch: Arch, w: &mut GgufWriter) -> Result<()> {
        let a = arch.as_str();
        let u = |x: u64| -> Result<u32> {
            u32::try_from(x).map_err(|_| anyhow::anyhow!("synth: {x} does not fit u32"))
        };
        let mut put = |k: &str, v: crate::gguf::Value| w.add(&keys::arch_key(a, k), v);
        use crate::gguf::Value as V;
        put(keys::CONTEXT_LENGTH, V::U32(u(self.context)?))?;
        put(keys::EMBEDDING_LENGTH, V::U32(u(self.hidden)?))?;
        put(keys::BLOCK_COUNT, V::U32(u(self.block_count())?))?;
        if arch == Arch::GlmDsa {
            // DeepSeek GGUFs carry no MTP block and no key (absent means 0).
            put(keys::NEXTN_PREDICT_LAYERS, V::U32(u(self.nextn)?))?;
        }
        put(keys::FEED_FORWARD_LENGTH, V::U32(u(self.dense_ff)?))?;
        put(keys::VOCAB_SIZE, V::U32(u(self.vocab)?))?;
        put(keys::ATTN_HEAD_COUNT, V::U32(u(self.n_head)?))?;
        put(keys::ATTN_HEAD_COUNT_KV, V::U32(1))?;
        put(
            keys::ATTN_KEY_LENGTH,
            V::U32(u(self.kv_lora + self.qk_rope)?),
        )?;
        put(keys::ATTN_VALUE_LENGTH, V::U32(u(self.kv_lora)?))?;
        put(
            keys::ATTN_KEY_LENGTH_MLA,
            V::U32(u(self.qk_nope + self.qk_rope)?),
        )?;
        put(keys::ATTN_VALUE_LENGTH_MLA, V::U32(u(self.v_head)?))?;
        put(keys::ATTN_Q_LORA_RANK, V::U32(u(self.q_lora)?))?;
        put(keys::ATTN_KV_LORA_RANK, V::U32(u(self.kv_lora)?))?;
        put(keys::ATTN_LAYERNORM_RMS_EPS, V::F32(self.rms_eps))?;
        put(keys::ROPE_DIMENSION_COUNT, V::U32(u(self.qk_rope)?))?;
        put(keys::ROPE_FREQ_BASE, V::F32(self.rope_theta))?;
        if let Some(y) = self.yarn {
            put(keys::ROPE_SCALING_TYPE, V::String("yarn".into()))?;
            put(keys::ROPE_SCALING_FACTOR, V::F32(y.factor))?;
            put(keys::ROPE_SCALING_ORIG_CTX_LEN, V::U32(y.original_context))?;
            put(keys::ROPE_SCALING_YARN_LOG_MUL, V::F32(y.log_multiplier))?;
        }
        put(keys::LEADING_DENSE_BLOCK_COUNT, V::U32(u(self.n_dense)?))?;
        put(keys::EXPERT_COUNT, V::U32(u(self.n_expert)?))?;
        put(keys::EXPERT_USED_COUNT, V::U32(u(self.n_expert_used)?))?;
        put(keys::EXPERT_SHARED_COUNT, V::U32(u(self.n_shared)?))?;
        put(keys::EXPERT_GROUP_COUNT, V::U32(u(self.n_group)?))?;
        put(keys::EXPERT_GROUP_USED_COUNT, V::U32(u(self.topk_group)?))?;
        put(keys::EXPERT_FEED_FORWARD_LENGTH, V::U32(u(self.expert_ff)?))?;
        put(keys::EXPERT_WEIGHTS_SCALE, V::F32(self.routed_scale))?;
        put(keys::EXPERT_WEIGHTS_NORM, V::Bool(true))?;
        put(
            keys::EXPERT_GATING_FUNC,
            V::U32(u32::try_from(GATING_SIGMOID)?),
        )?;
        if let Some(ix) = self.indexer {
            put(keys::INDEXER_HEAD_COUNT, V::U32(u(ix.n_head)?))?;
            put(keys::INDEXER_KEY_LENGTH, V::U32(u(ix.head_dim)?))?;
            put(keys::INDEXER_TOP_K, V::U32(u(ix.top_k)?))?;
        }
        Ok(())
    }
}
