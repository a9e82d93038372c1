//! Architectures and dimension presets of synthetic models, and the hyperparameter metadata
//! they carry. Values from shared spec `glm5-architecture.md` sections 1 and 3; key names from
//! gguf-py `gguf/constants.py` (`Keys.LLM`, `Keys.Attention`, `Keys.Attention.Indexer`,
//! `Keys.Rope`).

use anyhow::{bail, Result};

use crate::gguf::GgufWriter;

/// The two architectures glmdiff models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// GLM-5 (`glm-dsa`): MLA with split `attn_k_b`/`attn_v_b`, DSA indexer, one MTP layer.
    GlmDsa,
    /// DeepSeek-V3 (`deepseek2`): MLA, group-limited routing, YaRN, no indexer, no MTP layer.
    Deepseek2,
}

impl Arch {
    /// Parses `glm-dsa` or `deepseek2`.
    pub fn parse(s: &str) -> Result<Arch> {
        match s {
            "glm-dsa" => Ok(Arch::GlmDsa),
            "deepseek2" => Ok(Arch::Deepseek2),
            other => bail!("synth: unknown --arch {other:?} (expected glm-dsa or deepseek2)"),
        }
    }

    /// `general.architecture` and the metadata key prefix.
    pub fn name(self) -> &'static str {
        match self {
            Arch::GlmDsa => "glm-dsa",
            Arch::Deepseek2 => "deepseek2",
        }
    }

    /// `tokenizer.ggml.pre` of the real models.
    pub fn tokenizer_pre(self) -> &'static str {
        match self {
            Arch::GlmDsa => "glm4",
            Arch::Deepseek2 => "deepseek-v3",
        }
    }
}

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

/// `expert_gating_func` value for sigmoid (llama.cpp `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`).
pub const GATING_SIGMOID: u32 = 2;

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
                arch.name(),
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
        let a = arch.name();
        let u = |x: u64| -> Result<u32> {
            u32::try_from(x).map_err(|_| anyhow::anyhow!("synth: {x} does not fit u32"))
        };
        let mut put = |k: &str, v: crate::gguf::Value| w.add(&format!("{a}.{k}"), v);
        use crate::gguf::Value as V;
        put("context_length", V::U32(u(self.context)?))?;
        put("embedding_length", V::U32(u(self.hidden)?))?;
        put("block_count", V::U32(u(self.block_count())?))?;
        if arch == Arch::GlmDsa {
            // DeepSeek GGUFs carry no MTP block and no key (absent means 0).
            put("nextn_predict_layers", V::U32(u(self.nextn)?))?;
        }
        put("feed_forward_length", V::U32(u(self.dense_ff)?))?;
        put("vocab_size", V::U32(u(self.vocab)?))?;
        put("attention.head_count", V::U32(u(self.n_head)?))?;
        put("attention.head_count_kv", V::U32(1))?;
        put(
            "attention.key_length",
            V::U32(u(self.kv_lora + self.qk_rope)?),
        )?;
        put("attention.value_length", V::U32(u(self.kv_lora)?))?;
        put(
            "attention.key_length_mla",
            V::U32(u(self.qk_nope + self.qk_rope)?),
        )?;
        put("attention.value_length_mla", V::U32(u(self.v_head)?))?;
        put("attention.q_lora_rank", V::U32(u(self.q_lora)?))?;
        put("attention.kv_lora_rank", V::U32(u(self.kv_lora)?))?;
        put("attention.layer_norm_rms_epsilon", V::F32(self.rms_eps))?;
        put("rope.dimension_count", V::U32(u(self.qk_rope)?))?;
        put("rope.freq_base", V::F32(self.rope_theta))?;
        if let Some(y) = self.yarn {
            put("rope.scaling.type", V::String("yarn".into()))?;
            put("rope.scaling.factor", V::F32(y.factor))?;
            put(
                "rope.scaling.original_context_length",
                V::U32(y.original_context),
            )?;
            put("rope.scaling.yarn_log_multiplier", V::F32(y.log_multiplier))?;
        }
        put("leading_dense_block_count", V::U32(u(self.n_dense)?))?;
        put("expert_count", V::U32(u(self.n_expert)?))?;
        put("expert_used_count", V::U32(u(self.n_expert_used)?))?;
        put("expert_shared_count", V::U32(u(self.n_shared)?))?;
        put("expert_group_count", V::U32(u(self.n_group)?))?;
        put("expert_group_used_count", V::U32(u(self.topk_group)?))?;
        put("expert_feed_forward_length", V::U32(u(self.expert_ff)?))?;
        put("expert_weights_scale", V::F32(self.routed_scale))?;
        put("expert_weights_norm", V::Bool(true))?;
        put("expert_gating_func", V::U32(GATING_SIGMOID))?;
        if let Some(ix) = self.indexer {
            put("attention.indexer.head_count", V::U32(u(ix.n_head)?))?;
            put("attention.indexer.key_length", V::U32(u(ix.head_dim)?))?;
            put("attention.indexer.top_k", V::U32(u(ix.top_k)?))?;
        }
        Ok(())
    }
}
