//! Hyperparameters of a `glm-dsa` (GLM-5) or `deepseek2` (DeepSeek-V2/V3) GGUF, read from its
//! metadata as llama.cpp's loader reads them (`src/llama-model.cpp`, `src/models/glm-dsa.cpp`,
//! ggml-org/llama.cpp). Keys are `{arch}.{suffix}`; a required key that is missing is an error
//! naming the key. Defaults exist only where the architecture spec gives one.

use anyhow::{bail, Context, Result};

use super::{keys, names};
use crate::gguf::{Model, Value};

/// `general.architecture` of GLM-5 / 5.1 / 5.2.
pub const ARCH_GLM_DSA: &str = "glm-dsa";
/// `general.architecture` of DeepSeek-V2 / V3 / R1 (and Kimi K2).
pub const ARCH_DEEPSEEK2: &str = "deepseek2";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX`.
pub const GATING_SOFTMAX: i128 = 1;
/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`.
pub const GATING_SIGMOID: i128 = 2;

/// YaRN defaults of DeepSeek's reference (`beta_fast`, `beta_slow`), also transformers' defaults
/// (`modeling_rope_utils.py`, `_compute_yarn_parameters`).
pub const YARN_BETA_FAST_DEFAULT: f64 = 32.0;
/// See [`YARN_BETA_FAST_DEFAULT`].
pub const YARN_BETA_SLOW_DEFAULT: f64 = 1.0;
/// llama.cpp's converter stores `yarn_log_multiplier = 0.1 * mscale_all_dim` for deepseek2
/// (`convert_hf_to_gguf.py`, `[TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]`); the loader divides it back out.
pub const YARN_LOG_MUL_CONVERTER_FACTOR: f64 = 0.1;
/// Epsilon of the DSA indexer's key LayerNorm (transformers `GlmMoeDsaIndexer.k_norm`, eps 1e-6).
pub const INDEXER_K_NORM_EPS: f64 = 1e-6;

/// The two supported architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// GLM-5 (`glm-dsa`): MLA with a DSA lightning indexer.
    GlmDsa,
    /// DeepSeek-V2/V3 (`deepseek2`): MLA, optional YaRN, group-limited routing.
    Deepseek2,
}

impl Arch {
    /// The GGUF architecture string (`general.architecture`, the metadata key prefix).
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::GlmDsa => ARCH_GLM_DSA,
            Arch::Deepseek2 => ARCH_DEEPSEEK2,
        }
    }

    /// The architecture whose GGUF string is `s` (`glm-dsa`, `deepseek2`), if supported.
    pub fn from_name(s: &str) -> Option<Arch> {
        match s {
            ARCH_GLM_DSA => Some(Arch::GlmDsa),
            ARCH_DEEPSEEK2 => Some(Arch::Deepseek2),
            _ => None,
        }
    }

    /// `tokenizer.ggml.pre` of the real models of this architecture.
    pub fn tokenizer_pre(self) -> &'static str {
        match self {
            Arch::GlmDsa => "glm4",
            Arch::Deepseek2 => "deepseek-v3",
        }
    }
}

/// How router logits become expert probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// `softmax(logits)` over all experts (old DeepSeek-V2 files).
    Softmax,
    /// `sigmoid(logits)` per expert (DeepSeek-V3, GLM-5).
    Sigmoid,
}

/// YaRN context extension as DeepSeek-V3 uses it.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor` (40 for DeepSeek-V3).
    pub factor: f64,
    /// `rope.scaling.original_context_length` (4096).
    pub original_context: f64,
    /// `rope.scaling.yarn_beta_fast` (default 32).
    pub beta_fast: f64,
    /// `rope.scaling.yarn_beta_slow` (default 1).
    pub beta_slow: f64,
    /// HF `mscale_all_dim`: `yarn_log_multiplier / 0.1` when the key is present, else `None`.
    pub mscale_all_dim: Option<f64>,
    /// HF `attention_factor` when the file carries it: `rope.scaling.yarn_attn_factor`, the key
    /// llama.cpp's converter writes (gguf-py `add_rope_scaling_yarn_attn_factor`), else the generic
    /// `rope.scaling.attn_factor`.
    pub attn_factor: Option<f64>,
}

/// Rotary embedding parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    /// Rotated dimensions per head (`rope.dimension_count`, = qk_rope_head_dim).
    pub dim: usize,
    /// `rope.freq_base`.
    pub base: f64,
    /// YaRN scaling, or `None` (`rope.scaling.type` absent or `none`).
    pub yarn: Option<Yarn>,
}

/// The DSA lightning indexer (GLM-5 only).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerParams {
    /// `attention.indexer.head_count` (32).
    pub n_head: usize,
    /// `attention.indexer.key_length` (128).
    pub head_dim: usize,
    /// `attention.indexer.top_k` (2048).
    pub top_k: usize,
    /// Per run layer: `true` = the layer runs its own indexer ("full"), `false` = it reuses the
    /// previous full layer's selection ("shared", GLM-5.2). From `attention.indexer.types`;
    /// absent = every layer full (GLM-5, 5.1).
    pub full: Vec<bool>,
}

/// Everything the forward pass needs from the metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Architecture.
    pub arch: Arch,
    /// `embedding_length`.
    pub hidden: usize,
    /// `block_count` (MTP blocks included).
    pub n_block: usize,
    /// `nextn_predict_layers` (MTP blocks at the end, not run; absent = 0).
    pub n_nextn: usize,
    /// Layers run at inference: `n_block - n_nextn`.
    pub n_layer: usize,
    /// `leading_dense_block_count`: layers `0..n_dense` use the dense MLP.
    pub n_dense: usize,
    /// `feed_forward_length` (dense MLP width).
    pub n_ff: usize,
    /// `context_length` (training context), when present: the most tokens a run accepts.
    pub n_ctx: Option<usize>,
    /// `attention.head_count`.
    pub n_head: usize,
    /// `attention.q_lora_rank`; `None` when absent or 0 (plain `attn_q`, DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// `attention.kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// Non-rotated part of a query/key head (qk_nope_head_dim).
    pub qk_nope: usize,
    /// Rotated part of a query/key head (qk_rope_head_dim = `rope.dimension_count`).
    pub qk_rope: usize,
    /// Value head width (v_head_dim).
    pub v_head: usize,
    /// `attention.layer_norm_rms_epsilon`, used by every RMSNorm (q_a and kv_a norms included).
    pub rms_eps: f64,
    /// `expert_count`.
    pub n_expert: usize,
    /// `expert_used_count` (experts per token).
    pub n_expert_used: usize,
    /// `expert_shared_count`.
    pub n_expert_shared: usize,
    /// `expert_feed_forward_length` (width of each routed and shared expert).
    pub n_ff_exp: usize,
    /// `expert_group_count` / `expert_group_used_count` when both are present and the count > 1.
    pub groups: Option<(usize, usize)>,
    /// `expert_weights_scale` (routed_scaling_factor).
    pub expert_weights_scale: f64,
    /// `expert_weights_norm` (norm_topk_prob; absent = false).
    pub expert_weights_norm: bool,
    /// `expert_gating_func` (absent = sigmoid for glm-dsa; for deepseek2 sigmoid when the file has
    /// `exp_probs_b` selection biases (DeepSeek-V3), else softmax (DeepSeek-V2)).
    pub gating: Gating,
    /// RoPE.
    pub rope: RopeParams,
    /// DSA indexer (glm-dsa only).
    pub indexer: Option<IndexerParams>,
}

/// Reads `{arch}.*` keys of one model, naming the file and key in every error.
pub(super) struct Keys<'a> {
    pub(super) model: &'a Model,
    pub(super) arch: &'a str,
}

impl Keys<'_> {
    pub(super) fn key(&self, suffix: &str) -> String {
        keys::arch_key(self.arch, suffix)
    }

    pub(super) fn get(&self, suffix: &str) -> Option<&Value> {
        self.model.get(&self.key(suffix))
    }

    fn missing(&self, suffix: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "model: {}: metadata key {} is missing",
            self.model.path().display(),
            self.key(suffix)
        )
    }

    fn bad(&self, suffix: &str, v: &Value, want: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "model: {}: metadata key {} is {} {}, expected {want}",
            self.model.path().display(),
            self.key(suffix),
            v.value_type().name(),
            v.summary(4)
        )
    }

    pub(super) fn opt_usize(&self, suffix: &str) -> Result<Option<usize>> {
        match self.get(suffix) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(i) if (0..=u32::MAX as i128).contains(&i) => Ok(Some(i as usize)),
                _ => Err(self.bad(suffix, v, "a non-negative integer")),
            },
        }
    }

    fn usize(&self, suffix: &str) -> Result<usize> {
        self.opt_usize(suffix)?.ok_or_else(|| self.missing(suffix))
    }

    fn opt_f64(&self, suffix: &str) -> Result<Option<f64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.bad(suffix, v, "a finite number")),
            },
        }
    }

    fn f64(&self, suffix: &str) -> Result<f64> {
        self.opt_f64(suffix)?.ok_or_else(|| self.missing(suffix))
    }

    fn opt_bool(&self, suffix: &str) -> Result<Option<bool>> {
        match self.get(suffix) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => match v.as_int() {
                Some(0) => Ok(Some(false)),
                Some(1) => Ok(Some(true)),
                _ => Err(self.bad(suffix, v, "a bool")),
            },
        }
    }
}

/// How much of a model's tensors the hyperparameters are checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TensorCheck {
    /// A whole model: every run layer must be there, every tensor's shape must agree.
    Complete,
    /// Some of a model's tensors (a step case): the shapes of those present must agree.
    Partial,
    /// The metadata alone.
    None,
}

impl HParams {
    /// The hyperparameters from the metadata alone, not checked against the tensors (for
    /// `weights-check`, which diagnoses the tensors' shapes itself).
    pub fn from_metadata(model: &Model) -> Result<HParams> {
        Self::derive(model, TensorCheck::None)
    }

    /// The hyperparameters of `model`, with `block_count` checked against the blocks the file
    /// holds as `check` asks (the shapes are checked by `super::shapes`).
    pub(super) fn derive(model: &Model, check: TensorCheck) -> Result<HParams> {
        let arch_str = model.architecture().with_context(|| {
            match model.get("general.architecture") {
                Some(v) => format!(
                    "model: {}: metadata key general.architecture is a {} ({}), not a string (it names the architecture: {ARCH_GLM_DSA} or {ARCH_DEEPSEEK2})",
                    model.path().display(),
                    v.value_type().name(),
                    v.summary(4)
                ),
                None => format!(
                    "model: {}: metadata key general.architecture is missing",
                    model.path().display()
                ),
            }
        })?;
        let Some(arch) = Arch::from_name(arch_str) else {
            bail!(
                "model: {}: architecture {arch_str:?} is not supported (only {ARCH_GLM_DSA} and {ARCH_DEEPSEEK2})",
                model.path().display()
            );
        };
        let k = Keys {
            model,
            arch: arch_str,
        };
        let path = model.path().display();

        let n_block = k.usize(keys::BLOCK_COUNT)?;
        let n_nextn = k.opt_usize(keys::NEXTN_PREDICT_LAYERS)?.unwrap_or(0);
        if n_nextn >= n_block {
            bail!(
                "model: {path}: {} = {n_nextn} leaves no layer of {} = {n_block} to run",
                k.key(keys::NEXTN_PREDICT_LAYERS),
                keys::BLOCK_COUNT
            );
        }
        let n_layer = n_block - n_nextn;
        // Before anything is sized by the block count (the indexer's per-layer types).
        if check != TensorCheck::None {
            check_blocks(&k, n_block, n_nextn, check == TensorCheck::Complete)?;
        }
        let n_head = k.usize(keys::ATTN_HEAD_COUNT)?;
        if n_head == 0 {
            bail!(
                "model: {path}: {} = 0; attention needs at least one head",
                k.key(keys::ATTN_HEAD_COUNT)
            );
        }
        let rms_eps = k.f64(keys::ATTN_LAYERNORM_RMS_EPS)?;
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            bail!(
                "model: {path}: {} = {rms_eps} must be a finite positive number",
                k.key(keys::ATTN_LAYERNORM_RMS_EPS)
            );
        }
        let kv_lora_rank = k.usize(keys::ATTN_KV_LORA_RANK)?;
        let q_lora_raw = k.opt_usize(keys::ATTN_Q_LORA_RANK)?;
        let q_lora_rank = q_lora_raw.filter(|&r| r > 0);
        // Present but 0 (plain `attn_q`) while the file holds the low-rank query: the key is
        // wrong, said with its value and the tensor it disagrees with.
        let q_a = model
            .tensors()
            .find(|t| t.info.name.starts_with("blk.") && t.info.name.ends_with(".attn_q_a.weight"));
        if let (Some(0), Some(t)) = (q_lora_raw, q_a) {
            bail!(
                "model: {path}: metadata {} = 0 (a plain attn_q) disagrees with tensor {}: a low-rank query of rank {} (ne={:?})",
                k.key(keys::ATTN_Q_LORA_RANK),
                t.info.name,
                t.info.ne.get(1).copied().unwrap_or(0),
                t.info.ne
            );
        }
        let qk_rope = k.usize(keys::ROPE_DIMENSION_COUNT)?;
        if qk_rope % 2 != 0 {
            bail!(
                "model: {path}: {} = {qk_rope} is odd; RoPE rotates pairs",
                k.key(keys::ROPE_DIMENSION_COUNT)
            );
        }
        // Head widths: `key_length_mla`/`value_length_mla` in MLA-split files; files with the
        // legacy unsplit `attn_kv_b` store them as `key_length`/`value_length` instead
        // (llama.cpp `llama_hparams::n_embd_head_k_mla`).
        let k_len = k.opt_usize(keys::ATTN_KEY_LENGTH)?;
        let v_len = k.opt_usize(keys::ATTN_VALUE_LENGTH)?;
        let latent_k = kv_lora_rank + qk_rope;
        let k_mla = match k.opt_usize(keys::ATTN_KEY_LENGTH_MLA)? {
            Some(x) => x,
            None => match k_len {
                Some(x) if x != latent_k => x,
                _ => return Err(k.missing(keys::ATTN_KEY_LENGTH_MLA)),
            },
        };
        let v_head = match k.opt_usize(keys::ATTN_VALUE_LENGTH_MLA)? {
            Some(x) => x,
            None => match v_len {
                Some(x) if x != kv_lora_rank => x,
                _ => return Err(k.missing(keys::ATTN_VALUE_LENGTH_MLA)),
            },
        };
        if k_mla <= qk_rope {
            bail!("model: {path}: query/key head width {k_mla} is not larger than the rotated part {qk_rope}");
        }
        let qk_nope = k_mla - qk_rope;

        let n_expert = k.usize(keys::EXPERT_COUNT)?;
        let n_expert_used = k.usize(keys::EXPERT_USED_COUNT)?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            bail!(
                "model: {path}: {} = {n_expert_used} must be in 1..={n_expert} ({})",
                k.key(keys::EXPERT_USED_COUNT),
                keys::EXPERT_COUNT
            );
        }
        let groups = match (
            k.opt_usize(keys::EXPERT_GROUP_COUNT)?,
            k.opt_usize(keys::EXPERT_GROUP_USED_COUNT)?,
        ) {
            (Some(g), Some(u)) if g > 1 => {
                if n_expert % g != 0 || u == 0 || u > g {
                    bail!("model: {path}: expert groups {g} (used {u}) do not divide {n_expert} experts");
                }
                Some((g, u))
            }
            (Some(g), None) if g > 1 => return Err(k.missing(keys::EXPERT_GROUP_USED_COUNT)),
            _ => None,
        };
        let gating = match k.get(keys::EXPERT_GATING_FUNC) {
            None => match arch {
                Arch::GlmDsa => Gating::Sigmoid,
                // Absent in old DeepSeek-V2/V2.5 files (softmax; llama.cpp `llama-model.cpp`
                // defaults to it), but also in DeepSeek-V3 files converted from a config.json
                // without `scoring_func` (transformers 5 does not save it). V3's router always
                // has the selection bias `exp_probs_b` and is sigmoid (transformers
                // `deepseek_v3/modeling_deepseek_v3.py`, `DeepseekV3TopkRouter`); V2 has no bias.
                Arch::Deepseek2 if has_selection_bias(model) => Gating::Sigmoid,
                Arch::Deepseek2 => Gating::Softmax,
            },
            Some(v) => match v.as_int() {
                Some(GATING_SOFTMAX) => Gating::Softmax,
                Some(GATING_SIGMOID) => Gating::Sigmoid,
                _ => return Err(k.bad(keys::EXPERT_GATING_FUNC, v, "1 (softmax) or 2 (sigmoid)")),
            },
        };

        let rope = RopeParams {
            dim: qk_rope,
            base: k.f64(keys::ROPE_FREQ_BASE)?,
            yarn: read_yarn(&k)?,
        };
        // RoPE's frequencies are base^(-2i/d): a base of 1 or less turns none or runs backwards
        // (0 gives inf, a negative base NaN).
        if rope.base <= 1.0 {
            bail!(
                "model: {path}: {} = {} must be a number above 1 (RoPE's frequencies are base^(-2i/d); the models glmdiff knows use 1e4 to 1e6)",
                k.key(keys::ROPE_FREQ_BASE),
                rope.base
            );
        }
        let expert_weights_scale = k.f64(keys::EXPERT_WEIGHTS_SCALE)?;
        if expert_weights_scale <= 0.0 {
            bail!(
                "model: {path}: {} = {expert_weights_scale} must be positive (the routed experts' output is multiplied by it)",
                k.key(keys::EXPERT_WEIGHTS_SCALE)
            );
        }

        let indexer = match arch {
            Arch::Deepseek2 => None,
            Arch::GlmDsa => {
                let full = match k.get(keys::INDEXER_TYPES) {
                    None => vec![true; n_layer],
                    // One value for all layers (llama.cpp `get_key_or_arr`)
                    Some(v) if v.as_int().is_some() => vec![v.as_int() != Some(0); n_layer],
                    Some(v) => {
                        let a = v
                            .as_array()
                            .ok_or_else(|| k.bad(keys::INDEXER_TYPES, v, "an array of bools"))?;
                        if a.len() < n_layer {
                            bail!(
                                "model: {path}: {} has {} entries for {n_layer} layers",
                                k.key(keys::INDEXER_TYPES),
                                a.len()
                            );
                        }
                        let mut full = Vec::with_capacity(n_layer);
                        for x in &a[..n_layer] {
                            match x.as_int() {
                                Some(0) => full.push(false),
                                Some(1) => full.push(true),
                                _ => {
                                    return Err(k.bad(
                                        keys::INDEXER_TYPES,
                                        v,
                                        "bools (true = full)",
                                    ))
                                }
                            }
                        }
                        if full.first() == Some(&false) {
                            bail!(
                                "model: {path}: {}: layer 0 is shared but no earlier layer has an indexer",
                                k.key(keys::INDEXER_TYPES)
                            );
                        }
                        full
                    }
                };
                let p = IndexerParams {
                    n_head: k.usize(keys::INDEXER_HEAD_COUNT)?,
                    head_dim: k.usize(keys::INDEXER_KEY_LENGTH)?,
                    top_k: k.usize(keys::INDEXER_TOP_K)?,
                    full,
                };
                if p.head_dim < qk_rope || p.top_k == 0 || p.n_head == 0 {
                    bail!("model: {path}: indexer head width {} (rope {qk_rope}), top_k {} and {} heads are inconsistent", p.head_dim, p.top_k, p.n_head);
                }
                match q_lora_raw {
                    None => return Err(k.missing(keys::ATTN_Q_LORA_RANK)),
                    Some(0) => bail!(
                        "model: {path}: metadata {} = 0 (a plain attn_q), but the DSA indexer of {} reads the low-rank query (attn_q_a); no blk.L.attn_q_a.weight is in the file either",
                        k.key(keys::ATTN_Q_LORA_RANK),
                        arch.as_str()
                    ),
                    Some(_) => {}
                }
                Some(p)
            }
        };

        let hp = HParams {
            arch,
            hidden: k.usize(keys::EMBEDDING_LENGTH)?,
            n_block,
            n_nextn,
            n_layer,
            n_dense: k.usize(keys::LEADING_DENSE_BLOCK_COUNT)?,
            n_ff: k.usize(keys::FEED_FORWARD_LENGTH)?,
            n_ctx: k.opt_usize(keys::CONTEXT_LENGTH)?,
            n_head,
            q_lora_rank,
            kv_lora_rank,
            qk_nope,
            qk_rope,
            v_head,
            rms_eps,
            n_expert,
            n_expert_used,
            n_expert_shared: k.opt_usize(keys::EXPERT_SHARED_COUNT)?.unwrap_or(0),
            n_ff_exp: k.usize(keys::EXPERT_FEED_FORWARD_LENGTH)?,
            groups,
            expert_weights_scale,
            expert_weights_norm: k.opt_bool(keys::EXPERT_WEIGHTS_NORM)?.unwrap_or(false),
            gating,
            rope,
            indexer,
        };
        Ok(hp)
    }

    /// Query/key head width: `qk_nope + qk_rope`.
    pub fn qk_head(&self) -> usize {
        self.qk_nope + self.qk_rope
    }

    /// Whether layer `l` uses the dense MLP (else MoE).
    pub fn is_dense(&self, l: usize) -> bool {
        l < self.n_dense
    }
}

/// `block_count` against the blocks the file holds: no tensor of a block at or past the count,
/// and (`complete`) every run layer's `attn_norm`, so a count no tensor backs is refused before
/// anything is sized by it.
fn check_blocks(k: &Keys<'_>, n_block: usize, n_nextn: usize, complete: bool) -> Result<()> {
    let path = k.model.path().display();
    if let Some((l, name)) = k
        .model
        .tensors()
        .filter_map(|t| names::split_blk(&t.info.name).map(|(l, _)| (l, t.info.name.clone())))
        .find(|(l, _)| *l >= n_block)
    {
        bail!(
            "model: {path}: metadata {} = {n_block} disagrees with tensor {name}: the file holds block {l}",
            k.key(keys::BLOCK_COUNT)
        );
    }
    if complete {
        // Stops at the first missing layer: at most one more lookup than the file has tensors.
        for l in 0..n_block - n_nextn {
            let norm = names::blk(l, names::blk::ATTN_NORM);
            if k.model.find(&norm).is_none() {
                bail!(
                    "model: {path}: {} = {n_block} with nextn_predict_layers = {n_nextn} runs layers 0..{}, but the file has no {norm} \
                     (a file with only the NextN/MTP block, as the converter's --mtp writes, cannot run the model)",
                    k.key(keys::BLOCK_COUNT),
                    n_block - n_nextn
                );
            }
        }
    }
    Ok(())
}

/// Whether any layer of `model` has the router selection bias `blk.{L}.exp_probs_b.bias`
/// (DeepSeek-V3's `e_score_correction_bias`).
fn has_selection_bias(model: &Model) -> bool {
    model.tensors().any(|t| {
        names::split_blk(&t.info.name).is_some_and(|(_, suffix)| suffix == names::blk::EXP_PROBS_B)
    })
}

/// Reads `rope.scaling.*`: absent or `none` = no scaling; `yarn` = YaRN; anything else is refused.
fn read_yarn(k: &Keys<'_>) -> Result<Option<Yarn>> {
    let ty = match k.get(keys::ROPE_SCALING_TYPE) {
        None => return Ok(None),
        Some(v) => v
            .as_str()
            .ok_or_else(|| k.bad(keys::ROPE_SCALING_TYPE, v, "a string"))?,
    };
    match ty {
        "none" => Ok(None),
        "yarn" => {
            let factor = k.f64(keys::ROPE_SCALING_FACTOR)?;
            if factor <= 0.0 {
                bail!(
                    "model: {}: {} = {factor} must be positive",
                    k.model.path().display(),
                    k.key(keys::ROPE_SCALING_FACTOR)
                );
            }
            let log_mul = k.opt_f64(keys::ROPE_SCALING_YARN_LOG_MUL)?;
            Ok(Some(Yarn {
                factor,
                original_context: k.f64(keys::ROPE_SCALING_ORIG_CTX_LEN)?,
                beta_fast: k
                    .opt_f64("rope.scaling.yarn_beta_fast")?
                    .unwrap_or(YARN_BETA_FAST_DEFAULT),
                beta_slow: k
                    .opt_f64("rope.scaling.yarn_beta_slow")?
                    .unwrap_or(YARN_BETA_SLOW_DEFAULT),
                mscale_all_dim: log_mul
                    .filter(|&m| m != 0.0)
                    .map(|m| m / YARN_LOG_MUL_CONVERTER_FACTOR),
                attn_factor: match k.opt_f64(keys::ROPE_SCALING_YARN_ATTN_FACTOR)? {
                    Some(a) => Some(a),
                    None => k.opt_f64(keys::ROPE_SCALING_ATTN_FACTOR)?,
                },
            }))
        }
        other => bail!(
            "model: {}: {} = {other:?} is not supported (none or yarn)",
            k.model.path().display(),
            k.key(keys::ROPE_SCALING_TYPE)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::{build, metadata, tensor_names, tiny_hparams};

    fn parse(hp: &HParams, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Result<HParams> {
        let mut meta = metadata(hp);
        edit(&mut meta);
        HParams::from_metadata(&build(hp, &meta, &[], 32))
    }

    fn remove(meta: &mut Vec<(String, Value)>, key: &str) {
        meta.retain(|(k, _)| k != key);
    }

    #[test]
    fn reads_back_what_was_written() {
        for arch in [Arch::GlmDsa, Arch::Deepseek2] {
            let mut hp = tiny_hparams(arch);
            let got = parse(&hp, |_| {}).unwrap();
            hp.rms_eps = f64::from(hp.rms_eps as f32); // stored as F32
            assert_eq!(got, hp);
        }
    }

    #[test]
    fn absent_keys_take_the_spec_defaults() {
        for (arch, gating) in [
            (Arch::GlmDsa, Gating::Sigmoid),
            (Arch::Deepseek2, Gating::Softmax),
        ] {
            let a = arch.as_str();
            let got = parse(&tiny_hparams(arch), |m| {
                remove(m, &format!("{a}.expert_gating_func"));
                remove(m, &format!("{a}.expert_weights_norm"));
                remove(m, &format!("{a}.expert_shared_count"));
            })
            .unwrap();
            assert_eq!(got.gating, gating, "{a}");
            assert!(!got.expert_weights_norm);
            assert_eq!(
                (got.n_nextn, got.groups, got.rope.yarn.clone()),
                (0, None, None)
            );
        }
    }

    /// A DeepSeek-V3 file converted from a config.json without `scoring_func` has no
    /// `expert_gating_func`; its `exp_probs_b` biases make it sigmoid (transformers' V3 router).
    #[test]
    fn deepseek2_without_gating_key_is_sigmoid_when_it_has_selection_biases() {
        let hp = tiny_hparams(Arch::Deepseek2);
        let mut meta = metadata(&hp);
        remove(&mut meta, "deepseek2.expert_gating_func");
        let with_bias = build(&hp, &meta, &["blk.1.exp_probs_b.bias".to_string()], 32);
        assert_eq!(
            HParams::from_metadata(&with_bias).unwrap().gating,
            Gating::Sigmoid
        );
        let without = build(&hp, &meta, &["blk.1.ffn_gate_inp.weight".to_string()], 32);
        assert_eq!(
            HParams::from_metadata(&without).unwrap().gating,
            Gating::Softmax
        );
        // An explicit key wins over the inference.
        meta.push(("deepseek2.expert_gating_func".into(), Value::U32(1)));
        let explicit = build(&hp, &meta, &["blk.1.exp_probs_b.bias".to_string()], 32);
        assert_eq!(
            HParams::from_metadata(&explicit).unwrap().gating,
            Gating::Softmax
        );
    }

    #[test]
    fn mtp_layers_are_not_run() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        hp.n_block = 3;
        hp.n_nextn = 1;
        let got = parse(&hp, |_| {}).unwrap();
        assert_eq!((got.n_block, got.n_layer), (3, 2));
    }

    #[test]
    fn missing_keys_are_named() {
        let e = parse(&tiny_hparams(Arch::GlmDsa), |m| {
            remove(m, "glm-dsa.attention.kv_lora_rank")
        })
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("glm-dsa.attention.kv_lora_rank is missing"),
            "{e:#}"
        );
        let e = parse(&tiny_hparams(Arch::GlmDsa), |m| {
            remove(m, "glm-dsa.attention.q_lora_rank")
        })
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("glm-dsa.attention.q_lora_rank"),
            "{e:#}"
        );
        // Present with value 0 is not missing: the value is said, and why it is wrong.
        let e = parse(&tiny_hparams(Arch::GlmDsa), |m| {
            set(m, "glm-dsa.attention.q_lora_rank", 0)
        })
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("glm-dsa.attention.q_lora_rank = 0 (a plain attn_q), but the DSA indexer of glm-dsa reads the low-rank query")
                && !msg.contains("missing"),
            "{msg}"
        );
        let mut hp = tiny_hparams(Arch::Deepseek2);
        hp.q_lora_rank = None; // DeepSeek-V2-Lite: plain attn_q
        assert_eq!(parse(&hp, |_| {}).unwrap().q_lora_rank, None);
    }

    /// Regression: `head_count = 0` was accepted (and failed later on a tensor shape), and a
    /// negative or zero RMSNorm epsilon ran to NaN activations without a word.
    #[test]
    fn zero_heads_and_non_positive_eps_are_refused() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        hp.n_head = 0;
        let e = parse(&hp, |_| {}).unwrap_err();
        assert!(
            format!("{e:#}").contains("glm-dsa.attention.head_count = 0"),
            "{e:#}"
        );
        for eps in [0.0, -1.0, f64::NAN] {
            let mut hp = tiny_hparams(Arch::Deepseek2);
            hp.rms_eps = eps;
            let e = parse(&hp, |_| {}).unwrap_err();
            assert!(
                format!("{e:#}").contains("deepseek2.attention.layer_norm_rms_epsilon"),
                "{e:#}"
            );
        }
    }

    #[test]
    fn yarn_keys_and_defaults() {
        let got = parse(&tiny_hparams(Arch::Deepseek2), |m| {
            let k = |s: &str| format!("deepseek2.rope.scaling.{s}");
            m.push((k("type"), Value::String("yarn".into())));
            m.push((k("factor"), Value::F32(40.0)));
            m.push((k("original_context_length"), Value::U32(4096)));
            m.push((k("yarn_log_multiplier"), Value::F32(0.1)));
        })
        .unwrap();
        let y = got.rope.yarn.unwrap();
        assert_eq!((y.factor, y.original_context), (40.0, 4096.0));
        assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
        // 0.1 stored as f32, divided by 0.1: mscale_all_dim = 1 to f32 precision.
        assert!((y.mscale_all_dim.unwrap() - 1.0).abs() < 1e-7);
        let e = parse(&tiny_hparams(Arch::Deepseek2), |m| {
            m.push((
                "deepseek2.rope.scaling.type".into(),
                Value::String("longrope".into()),
            ))
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("not supported"), "{e:#}");
    }

    /// A config with an explicit YaRN `attention_factor` is converted to
    /// `rope.scaling.yarn_attn_factor` (llama.cpp `conversion/base.py`); that is the key read.
    #[test]
    fn yarn_attention_factor_from_the_converter_key() {
        let yarn = |m: &mut Vec<(String, Value)>| {
            let k = |s: &str| format!("deepseek2.rope.scaling.{s}");
            m.push((k("type"), Value::String("yarn".into())));
            m.push((k("factor"), Value::F32(40.0)));
            m.push((k("original_context_length"), Value::U32(256)));
        };
        let got = parse(&tiny_hparams(Arch::Deepseek2), |m| {
            yarn(m);
            m.push((
                "deepseek2.rope.scaling.yarn_attn_factor".into(),
                Value::F32(1.25),
            ));
        })
        .unwrap();
        assert_eq!(got.rope.yarn.unwrap().attn_factor, Some(1.25));
        let got = parse(&tiny_hparams(Arch::Deepseek2), |m| {
            yarn(m);
            m.push(("deepseek2.rope.scaling.attn_factor".into(), Value::F32(0.5)));
        })
        .unwrap();
        assert_eq!(got.rope.yarn.unwrap().attn_factor, Some(0.5));
        let got = parse(&tiny_hparams(Arch::Deepseek2), yarn).unwrap();
        assert_eq!(got.rope.yarn.unwrap().attn_factor, None);
    }

    #[test]
    fn shared_indexer_layers_from_types() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        if let Some(ix) = &mut hp.indexer {
            ix.full = vec![true, false];
        }
        let got = parse(&hp, |_| {}).unwrap();
        assert_eq!(got.indexer.unwrap().full, vec![true, false]);
    }

    /// The model of `hp`'s tensors with `hp`'s metadata edited by `edit`, through `from_model`.
    fn checked(hp: &HParams, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> String {
        let mut meta = metadata(hp);
        edit(&mut meta);
        match HParams::from_model(&build(hp, &meta, &tensor_names(hp), 32)) {
            Ok(_) => panic!("accepted"),
            Err(e) => format!("{e:#}"),
        }
    }

    fn set(meta: &mut [(String, Value)], key: &str, v: u32) {
        let slot = meta.iter_mut().find(|(k, _)| k == key).unwrap();
        slot.1 = Value::U32(v);
    }

    /// Regression: an `expert_count` of 4000000000 was accepted, and `run` grew its memory
    /// without end; every key that sizes a tensor is now checked against the tensors, naming the
    /// key, its value, the tensor and its shape.
    #[test]
    fn hyperparameters_disagreeing_with_tensor_shapes_are_named() {
        let hp = tiny_hparams(Arch::GlmDsa);
        assert!(HParams::from_model(&build(&hp, &metadata(&hp), &tensor_names(&hp), 32)).is_ok());
        for (key, value, want) in [
            (
                "glm-dsa.expert_count",
                4_000_000_000,
                "metadata glm-dsa.expert_count = 4000000000 disagrees with tensor blk.1.ffn_gate_inp.weight: its ne[1] is 4, not 4000000000",
            ),
            (
                "glm-dsa.embedding_length",
                17,
                "metadata glm-dsa.embedding_length = 17 disagrees with tensor token_embd.weight: its ne[0] is 16, not 17",
            ),
            (
                "glm-dsa.attention.kv_lora_rank",
                9,
                "metadata glm-dsa.attention.kv_lora_rank = 9, glm-dsa.rope.dimension_count = 4 (giving 13) disagree with tensor blk.0.attn_kv_a_mqa.weight: its ne[1] is 12, not 13",
            ),
            (
                "glm-dsa.attention.head_count",
                3,
                "metadata glm-dsa.attention.head_count = 3 disagrees with tensor blk.0.attn_k_b.weight: its ne[2] is 2, not 3",
            ),
            (
                "glm-dsa.feed_forward_length",
                25,
                "metadata glm-dsa.feed_forward_length = 25 disagrees with tensor blk.0.ffn_gate.weight",
            ),
            (
                "glm-dsa.expert_feed_forward_length",
                7,
                "glm-dsa.expert_feed_forward_length = 7",
            ),
            (
                "glm-dsa.attention.indexer.head_count",
                5,
                "glm-dsa.attention.indexer.head_count = 5",
            ),
            (
                "glm-dsa.attention.q_lora_rank",
                0,
                "metadata glm-dsa.attention.q_lora_rank = 0 (a plain attn_q) disagrees with tensor blk.0.attn_q_a.weight: a low-rank query of rank 12 (ne=[16, 12])",
            ),
            (
                "glm-dsa.vocab_size",
                33,
                "metadata glm-dsa.vocab_size = 33 disagrees with tensor token_embd.weight: it has 32 rows",
            ),
        ] {
            let msg = checked(&hp, |m| {
                if key.ends_with("vocab_size") {
                    m.push((key.into(), Value::U32(value)));
                } else {
                    set(m, key, value);
                }
            });
            assert!(msg.contains(want), "{key}: {msg}");
            assert!(msg.starts_with("model: tiny.gguf: "), "{msg}");
        }
    }

    /// A block count no tensor backs is refused before anything is sized by it (the indexer's
    /// per-layer types would be a vector of that many entries), and one below the blocks the
    /// file holds names the first tensor past it.
    #[test]
    fn block_count_is_checked_against_the_blocks_held() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let t0 = std::time::Instant::now();
        let msg = checked(&hp, |m| set(m, "glm-dsa.block_count", u32::MAX));
        assert!(t0.elapsed().as_secs() < 5);
        assert!(
            msg.contains("glm-dsa.block_count = 4294967295 with nextn_predict_layers = 0 runs layers 0..4294967295, but the file has no blk.2.attn_norm.weight"),
            "{msg}"
        );
        let msg = checked(&hp, |m| set(m, "glm-dsa.block_count", 1));
        assert!(
            msg.contains("metadata glm-dsa.block_count = 1 disagrees with tensor blk.1.")
                && msg.contains("the file holds block 1"),
            "{msg}"
        );
        // A step case holds one layer's tensors: nothing is required, what is there is checked.
        let names: Vec<String> = tensor_names(&hp)
            .into_iter()
            .filter(|n| n.starts_with("blk.1."))
            .collect();
        let part = build(&hp, &metadata(&hp), &names, 32);
        assert!(HParams::from_model(&part).is_err());
        assert_eq!(HParams::from_partial_model(&part).unwrap().n_layer, 2);
        let mut meta = metadata(&hp);
        set(&mut meta, "glm-dsa.expert_count", 5);
        let e = HParams::from_partial_model(&build(&hp, &meta, &names, 32)).unwrap_err();
        assert!(
            format!("{e:#}").contains("glm-dsa.expert_count = 5"),
            "{e:#}"
        );
    }
}
