//! Known bugs, built in: faults that real engines have shipped (`shared/spec/glm5-architecture.md`
//! section 4, `shared/spec/quant-formats.md`), injected into a candidate engine on purpose.
//!
//! A [`Fault`] is a [`FaultKind`] and the layers it touches (`KIND[@LAYERS]` on the command
//! line, [`Fault::parse`]). [`FaultEngine`] wraps any [`Engine`](crate::engine::Engine) (the CPU
//! reference, the CUDA engine) and computes exactly the steps a fault concerns the faulty way, on
//! the host, from the inputs the wrapped engine holds; every other step, and every step of a
//! layer the fault does not touch, is the wrapped engine's own. The faulty arithmetic lives here
//! ([`host`]), never in the reference: a CPU engine without a fault is the reference, bit for
//! bit.
//!
//! Two uses: `glmdiff run --inject KIND` proves that a divergence is localised at the step the
//! bug lives in (the tests plant every kind and check the first divergence), and `--explain`
//! recomputes a failing step under each fault that applies to it and ranks the faults by how well
//! they reproduce the candidate's output.

pub mod attn;
mod engine;
pub mod host;
mod route;

use std::fmt;
use std::ops::Range;

use anyhow::{bail, Context, Result};

pub use engine::FaultEngine;

use crate::model::names::{self, blk};
use crate::model::steps;
use crate::model::{HParams, Weights};
use crate::quant::GgmlType;
use crate::util::glob::matches as glob_match;

/// The projection `layer_weights` takes from another layer when no glob is given: the attention
/// output, as in the planted dumps of `fixtures/engines/` (an off-by-one in a weight map).
pub const DEFAULT_LAYER_WEIGHTS: &str = blk::ATTN_OUTPUT;

/// What a fault does. The words are those of `--inject` (see [`Fault::parse`]).
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// `kv_b_concat`: kv_b rebuilt as all heads' K rows, then all heads' V rows, instead of per
    /// head (a converter/loader reassembly bug; spec 3.1).
    KvBConcat,
    /// `rope_neox`: MLA RoPE on half-split pairs `(i, i + d/2)` instead of interleaved `(2i, 2i+1)`.
    RopeNeox,
    /// `indexer_rope_neox`: the same in the DSA indexer (its selection changes only once a query
    /// sees more than `index_topk` keys).
    IndexerRopeNeox,
    /// `indexer_relu:off`: the DSA index score summed over heads without the ReLU on each head's
    /// `q.k` (`I = sum_h w_h q_h.k` instead of `sum_h w_h ReLU(q_h.k)`, DeepSeek-V3.2's
    /// `inference/model.py` `Indexer` and transformers' `glm_moe_dsa` apply it): an indexer
    /// kernel ported from a dense score path drops it, and negative head scores then cancel
    /// positive ones, changing which keys are kept.
    IndexerNoRelu,
    /// `scale_latent`: the attention softmax scale taken from the latent width
    /// (`1/sqrt(kv_lora + rope)`, the absorbed form's key width) instead of `1/sqrt(nope + rope)`.
    ScaleLatent,
    /// `softmax_gating`: router probabilities by softmax instead of sigmoid.
    SoftmaxGating,
    /// `bias_in_weights`: the selection bias `exp_probs_b` added into the expert weights too.
    BiasInWeights,
    /// `router_bf16`: router logits computed in bf16 (inputs and weights rounded to bf16, f32
    /// sums, output rounded to bf16).
    RouterBf16,
    /// `expert_swap:A,B` (or `expert_map:A=B,...`): expert `slot` computed with the weights of
    /// expert `from`, for each `(slot, from)`.
    ExpertMap(Vec<(usize, usize)>),
    /// `gate_up_swap`: every routed expert's gate and up projections exchanged.
    GateUpSwap,
    /// `layer_weights:L[,GLOB]`: the layer's tensors whose suffix matches `glob` (default
    /// [`DEFAULT_LAYER_WEIGHTS`]) read from layer `src` (an off-by-one weight map).
    LayerWeights {
        /// The layer the weights come from.
        src: usize,
        /// Tensor suffix glob (`attn_output.weight`, `ffn_*_exps.weight`, ...).
        glob: String,
    },
    /// `q4k_scale_bits`: Q4_K's `get_scale_min_k4` without the high bits of sub-blocks 4..7.
    Q4kScaleBits,
    /// `run_mtp`: the MTP block run as one more layer before the final norm.
    RunMtp,
    /// `tp_shard:N`: q_b, kv_b and attn_output emulated as `N` tensor-parallel shards of whole
    /// heads, the last shard loaded one head further (its head `h` gets head `h+1`'s rows,
    /// wrapping to head 0).
    TpShard(usize),
    /// `f32_accumulate`: projections accumulated in f32 (harmless: what precision explains).
    F32Accumulate,
    /// `norm_eps:X`: every RMSNorm's eps replaced by `X` (harmless at 1e-5 vs 1e-6: transformers
    /// and llama.cpp differ so in two MLA norms).
    NormEps(f64),
    /// `transposed:GLOB`: a matrix read in the transposed element order (`W'[r][c] =
    /// data[c*rows + r]`), for the layer's tensors matching `glob`.
    Transposed {
        /// Tensor suffix glob.
        glob: String,
    },
    // Routing and MoE faults (`--explain` fits the continuous ones: `explain::fit_route`).
    /// `routed_scale:X`, `routed_scaling_ignored` (X = 1), `routed_scaling_twice` (X = s^2): the
    /// routed experts' weights scaled by X instead of `expert_weights_scale` s. Engines apply
    /// `routed_scaling_factor` in several places (in the top-k kernel, or on the routed output:
    /// vLLM `vllm/model_executor/models/deepseek_v2.py` `DeepseekV2MoE`,
    /// `apply_routed_scale_to_output`; SGLang fuses it into the kernel,
    /// sgl-project/sglang#6710), so it is easily applied twice or not at all: sglang-jax skipped it
    /// whenever `norm_topk_prob` was false (sgl-project/sglang-jax#1282), and a DeepSeek-R1 accuracy
    /// fix set it to 1.0 (dphnAI/sonar#1492).
    RoutedScale(RoutedScale),
    /// `topk_norm:on|off`: the top-k weights normalised to sum 1 (`on`) or not (`off`), opposite
    /// to the model's `expert_weights_norm` (`norm_topk_prob`): torchtitan's DeepSeek-V3 lacked
    /// the normalisation (pytorch/torchtitan#1448); ROCm aiter's `topk_sigmoid` ignored
    /// `renormalize` (review of vllm-project/vllm#31246).
    TopkNorm(bool),
    /// `bias_unused`: the experts selected by the raw scores, the score-correction bias
    /// `exp_probs_b` ignored (vLLM's `deepseek_v2.py` reads `e_score_correction_bias` only when
    /// `topk_method == "noaux_tc"`; HabanaAI/vllm-fork#2246 added it where it was missing).
    BiasUnused,
    /// `group_limit:off`, `group_limit:N[,K]`: group-limited routing ignored, or done with `N`
    /// groups keeping `K` (default: the model's kept count) instead of the model's (vLLM's
    /// `deepseek_v2.py` defaults `n_group` and `topk_group` to 1 when the config lacks them;
    /// vllm-project/vllm#13474 and EricLBuehler/mistral.rs#1278 fixed the group scores and masks).
    GroupLimit(GroupLimit),
    /// `expert_scale:E,F`: expert `E`'s output scaled by `F`: a wrong block scale in one expert's
    /// down projection (block scales left at their initial ones, review of
    /// lightseekorg/tokenspeed#1097; per-block scales underflowing to 0 in the FP8 cast,
    /// NVIDIA/Model-Optimizer#1382).
    ExpertScale {
        /// The expert.
        expert: usize,
        /// The factor on its output.
        factor: f64,
    },
    /// `gate_up_swap:dense`, `gate_up_swap:shared`: gate and up exchanged in the dense layers'
    /// MLP or in the shared expert (a loader that assigns them by position: nntrainer/nntrainer#4194
    /// computed `silu(up) * gate`, coherent-looking output; the fused shared-expert gate/up split
    /// in the review of vllm-project/vllm#55686). `gate_up_swap` is the routed experts'.
    GateUpSwapMlp(MlpPart),
    /// `weight_scale:GLOB,F`: the layer's projections, RMSNorm weights and kv_b halves whose
    /// suffix matches `glob` (`attn_k_b.weight`/`attn_v_b.weight` scale the K/V rows of kv_b)
    /// multiplied by `factor`: a block scale read wrong or a constant dropped in a loader
    /// (FP8 `weight_scale_inv` rounded an octave off, huggingface/transformers#46763; a block
    /// scale silently not applied, wuwangzhang1216/abliterix#93). A projection's or norm's output
    /// is linear in `factor`: `--explain` fits it in closed form.
    WeightScale {
        /// Tensor suffix glob (a global tensor's full name: `output.weight`).
        glob: String,
        /// The factor.
        factor: f64,
    },
    /// `softmax_scale:F`: the MLA softmax scale multiplied by `F` (`--explain` fits `F` by a
    /// 1-D search and names the factors of known bugs: [`FaultKind::ScaleLatent`]'s,
    /// `yarn_mscale:none`'s `1/mscale^2`, `mscale^2` once more).
    SoftmaxScale(f64),
    /// `yarn_mscale:none|twice`: DeepSeek YaRN's magnitude correction `mscale = 0.1 *
    /// mscale_all_dim * ln(factor) + 1` (spec 2.1 step 7, `model::rope`) missing, or applied
    /// twice (see [`Mscale`]).
    YarnMscale(Mscale),
    /// `rope_theta:X`: RoPE (MLA and the DSA indexer) with frequency base `X` instead of the
    /// file's `rope.freq_base` (a converter or loader that does not read it and uses a default:
    /// ggml-org/llama.cpp#2768, CodeLlama's 1e6 read as 10000; ggml-org/llama.cpp#3401). With
    /// YaRN the correction range moves with the base, as `model::rope::inv_freq` computes it.
    /// `--explain` fits `X` by a 1-D search on a log scale.
    RopeTheta(f64),
    /// `yarn_factor:F`: YaRN with scaling factor `F` instead of the file's
    /// `rope.scaling.factor` (a config's `rope_scaling.factor` misread, or another model's: 4
    /// where the checkpoint says 40), in all three places it enters: the frequency ramp's
    /// interpolated frequencies (`inv_freq / factor`), the cos/sin attention factor when the file
    /// gives none (`0.1 ln(factor) + 1`) and the softmax scale's `mscale^2`. YaRN models only;
    /// `--explain` fits `F` by a 1-D search on a log scale.
    YarnFactor(f64),
    /// `dsa_topk:K`: the DSA indexer keeps `K` keys per query instead of `index_topk` (an
    /// off-by-one is `index_topk +- 1`). Only rows whose query sees more than `min(K,
    /// index_topk)` keys change. Top-k selection is where DSA engines have gone wrong silently
    /// (ml-explore/mlx-lm#1454: zeroed scores, selection of the last `index_topk` keys).
    DsaTopK(usize),
    /// `indexer_scale:F`: the DSA indexer's score scale `dI^-0.5` (transformers
    /// `glm_moe_dsa` `GlmMoeDsaIndexer.softmax_scale`, applied to `q.k` before the ReLU)
    /// multiplied by `F > 0`. The ReLU commutes with a positive factor, so every score is
    /// multiplied by `F`: the `indexer_scores` hook changes, the top-k selection does not (ties
    /// aside). Indistinguishable at that hook from [`FaultKind::IndexerWprojScale`].
    IndexerScale(f64),
    /// `indexer_wproj_scale:F`: the indexer's head weights `weights_proj(a) * nI^-0.5`
    /// (DeepSeek-V3.2 `inference/model.py` `Indexer.forward`, transformers `glm_moe_dsa`)
    /// multiplied by `F > 0` (`F = sqrt(nI)`: the `nI^-0.5` factor missing; `1/sqrt(nI)`: applied
    /// twice). The weights multiply the ReLU'd products linearly, so every score is again
    /// multiplied by `F`: same effect as [`FaultKind::IndexerScale`] (the selection is
    /// unchanged); `--explain` reports both with one fitted `F` and names the factors.
    IndexerWprojScale(f64),
    /// `norm_one_plus[:GLOB]`: RMSNorm computed as `x * (1 + w)` (Gemma's convention, where the
    /// checkpoint stores `w - 1`) for the norms whose suffix matches `glob` (default every
    /// norm): a Gemma-style norm or a `+1` fold applied to weights that already hold the real
    /// gamma (kekzl/imp#459, utensils/mold#1078: a GGUF whose converter baked in the `+1`).
    NormOnePlus {
        /// Norm weight suffix glob ([`DEFAULT_NORM_ONE_PLUS`]: every norm).
        glob: String,
    },
    /// `kv_b_split:kv`: a per-head kv_b (HF `kv_b_proj`, rows `[K_h | V_h]` per head) split into
    /// k_b and v_b as if it were all heads' K rows, then all V rows: the engine's head `h` K
    /// rows are rows `h*nope..` of the tensor and its V rows `H*nope + h*v..`. The inverse of
    /// [`FaultKind::KvBConcat`] (which builds the all-K-then-all-V tensor and reads it per
    /// head). llama.cpp's converter views `kv_b_proj` as `[H, nope + v, kv_lora]` before
    /// `torch.split(.., [nope, v], dim=1)` (`convert_hf_to_gguf.py`, `DeepseekV2Model.
    /// modify_tensors`), vLLM as `[kv_lora, H, nope + v]` before splitting the last axis
    /// (`vllm/attention/backends/mla/common.py`, `process_weights_after_loading`); a split of the
    /// flat tensor along its rows skips that view.
    KvBSplit,
    /// `experts_per_token:K`: each token routed to `K` experts instead of the model's
    /// `expert_used_count` (`num_experts_per_tok`), the weights normalised and scaled over those
    /// `K`: a config key read under another name or a default taken for it (an engine that
    /// routes the checkpoint's `moe_topk` of another variant). The selection hooks
    /// (`moe_topk_ids`, `moe_weights`) are `K` wide.
    ExpertsPerToken(usize),
}

/// The scale `routed_scale` puts on the routed experts' weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RoutedScale {
    /// `routed_scale:X`.
    Factor(f64),
    /// `routed_scaling_ignored`: 1.
    Ignored,
    /// `routed_scaling_twice`: the model's scale squared.
    Twice,
}

impl RoutedScale {
    /// The factor for a model whose `expert_weights_scale` is `s`.
    pub fn factor(self, s: f64) -> f64 {
        match self {
            RoutedScale::Factor(x) => x,
            RoutedScale::Ignored => 1.0,
            RoutedScale::Twice => s * s,
        }
    }
}

/// The group-limited routing of `group_limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupLimit {
    /// `group_limit:off`: no group limit.
    Off,
    /// `group_limit:N[,K]`: `groups` groups, `keep` of them kept (`None`: the model's count).
    Groups {
        /// Groups the experts are split into.
        groups: usize,
        /// Groups kept.
        keep: Option<usize>,
    },
}

impl GroupLimit {
    /// `(groups, kept)` as `route_token` reads them (`None`: no limit), for a model with
    /// `model` groups; `None` when `keep` is not given and the model has no groups.
    pub fn resolve(self, model: Option<(usize, usize)>) -> Option<Option<(usize, usize)>> {
        match self {
            GroupLimit::Off => Some(None),
            GroupLimit::Groups { groups, keep } => {
                keep.or(model.map(|(_, k)| k)).map(|k| Some((groups, k)))
            }
        }
    }
}

/// The MLP whose gate and up `gate_up_swap:dense|shared` exchanges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpPart {
    /// The dense layers' MLP (`ffn_gate`, `ffn_up`).
    Dense,
    /// The shared expert (`ffn_gate_shexp`, `ffn_up_shexp`).
    Shared,
}

/// A fitted or planted factor as the kind words print it: rounded to 4 decimals, shortest.
pub fn factor_words(x: f64) -> String {
    format!("{}", (x * 1e4).round() / 1e4)
}

/// How [`FaultKind::YarnMscale`] gets the YaRN magnitude wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mscale {
    /// `none`: the softmax scale without `mscale^2` (`1/sqrt(nope + rope)`) and cos/sin
    /// without the YaRN attention factor: the correction an engine skips when it applies YaRN
    /// only to the frequencies (onnxruntime/mobius#548, huggingface/transformers#47435,
    /// vllm-project/tpu-inference#521; vLLM computes it with `yarn_get_mscale` in
    /// `vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py` and
    /// `models/deepseek_v2.py`).
    Missing,
    /// `twice`: the softmax scale keeps `mscale^2` and cos/sin are multiplied by `1 + 0.1
    /// ln(factor)` as well: ggml's `rope_yarn` applies that magnitude itself, and llama.cpp's
    /// deepseek2 graph cancels it with `attn_factor = 1 / (1 + 0.1 ln(factor))` because
    /// `kq_scale` already holds `mscale^2` (`src/models/deepseek2.cpp`,
    /// `llama_hparams::yarn_attn_factor_adjust`, ggml-org/llama.cpp#17945; the difference found
    /// in ggml-org/llama.cpp#7118). Without the cancel the rotated part of every logit gets the
    /// magnitude twice (Avarok-Cybersecurity/atlas#342).
    Twice,
}

/// The norms `norm_one_plus` touches when no glob is given: every RMSNorm.
pub const DEFAULT_NORM_ONE_PLUS: &str = "*";

/// The `--inject` kinds with a one-line description, for help texts and errors.
pub const CATALOG: &[(&str, &str)] = &[
    (
        "kv_b_concat",
        "kv_b rebuilt as all K rows then all V rows instead of per head",
    ),
    ("rope_neox", "half-split (NeoX) RoPE in MLA"),
    ("indexer_rope_neox", "half-split RoPE in the DSA indexer"),
    (
        "indexer_relu:off",
        "DSA index scores without the ReLU per head",
    ),
    (
        "scale_latent",
        "attention softmax scale from the latent width",
    ),
    ("softmax_gating", "softmax instead of sigmoid router scores"),
    (
        "bias_in_weights",
        "the selection bias added into the expert weights",
    ),
    ("router_bf16", "router logits in bf16"),
    (
        "expert_swap:A,B",
        "experts A and B loaded with each other's weights",
    ),
    (
        "expert_map:A=B,..",
        "expert A loaded with expert B's weights",
    ),
    ("gate_up_swap", "expert gate and up projections exchanged"),
    (
        "layer_weights:L[,GLOB]",
        "a projection (default attn_output) read from layer L",
    ),
    (
        "q4k_scale_bits",
        "Q4_K scales of sub-blocks 4..7 without their high bits",
    ),
    ("run_mtp", "the MTP block run as one more layer"),
    (
        "tp_shard:N",
        "q_b/kv_b/attn_output as N shards, the last one head off",
    ),
    (
        "f32_accumulate",
        "projections accumulated in f32 (harmless)",
    ),
    ("norm_eps:X", "every RMSNorm eps replaced by X (harmless)"),
    ("transposed:GLOB", "a matrix read transposed"),
    (
        "routed_scale:X",
        "routed experts' weights scaled by X instead of expert_weights_scale",
    ),
    (
        "routed_scaling_ignored",
        "routed experts' weights not scaled (routed_scale:1)",
    ),
    (
        "routed_scaling_twice",
        "expert_weights_scale applied twice (routed_scale:s^2)",
    ),
    (
        "topk_norm:on|off",
        "top-k weights normalised or not, opposite to the model",
    ),
    (
        "bias_unused",
        "experts selected without the selection bias exp_probs_b",
    ),
    (
        "group_limit:off|N[,K]",
        "group-limited routing ignored, or N groups with K kept",
    ),
    (
        "expert_scale:E,F",
        "expert E's output scaled by F (a wrong block scale)",
    ),
    (
        "gate_up_swap:dense|shared",
        "gate and up exchanged in the dense MLP or the shared expert",
    ),
    (
        "weight_scale:GLOB,F",
        "a projection, norm weight or kv_b half scaled by F",
    ),
    ("softmax_scale:F", "the MLA softmax scale multiplied by F"),
    (
        "yarn_mscale:none|twice",
        "the YaRN mscale missing, or applied in cos/sin too",
    ),
    ("rope_theta:X", "RoPE frequency base X"),
    ("yarn_factor:F", "the YaRN scaling factor F"),
    ("dsa_topk:K", "the DSA indexer keeps K keys"),
    ("indexer_scale:F", "the indexer's q.k scale multiplied by F"),
    (
        "indexer_wproj_scale:F",
        "the indexer's head weights multiplied by F",
    ),
    ("norm_one_plus[:GLOB]", "RMSNorm as x * (1 + w)"),
    (
        "kv_b_split:kv",
        "a per-head kv_b split as all K rows then all V rows",
    ),
    (
        "experts_per_token:K",
        "each token routed to K experts instead of the model's count",
    ),
];

impl FaultKind {
    /// Whether the fault is one precision explains (reported within the floor).
    pub fn harmless(&self) -> bool {
        matches!(self, FaultKind::F32Accumulate | FaultKind::NormEps(_))
    }

    /// Parses `NAME[:ARGS]`.
    pub fn parse(s: &str) -> Result<FaultKind> {
        let words = KindWords::split(s);
        for family in [
            KindWords::attention,
            KindWords::routing,
            KindWords::weights_and_norms,
        ] {
            if let Some(kind) = family(&words)? {
                return Ok(kind);
            }
        }
        let kinds: Vec<&str> = CATALOG.iter().map(|(k, _)| *k).collect();
        bail!(
            "unknown fault {:?}; the kinds are {}",
            words.name,
            kinds.join(", ")
        )
    }
}

/// A kind's words `NAME[:ARGS]`, split at the first `:`, with the argument checks the kinds
/// share; each family of kinds parses its own names ([`FaultKind::parse`]).
struct KindWords<'a> {
    /// The kind's name, trimmed.
    name: &'a str,
    /// Its argument, trimmed (`None`: no `:`).
    arg: Option<&'a str>,
}

impl<'a> KindWords<'a> {
    /// Splits `NAME[:ARGS]` at the first `:`.
    fn split(s: &'a str) -> KindWords<'a> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (s.trim(), None),
        };
        KindWords { name, arg }
    }

    /// `k`, for a kind that takes no argument (an error when one is given).
    fn no_arg(&self, k: FaultKind) -> Result<FaultKind> {
        match self.arg {
            None => Ok(k),
            Some(a) => bail!("fault {} takes no argument, got {a:?}", self.name),
        }
    }

    /// The argument, which the kind needs (`what`: what it is, for the error), not empty.
    fn need(&self, what: &str) -> Result<&'a str> {
        let name = self.name;
        self.arg
            .filter(|a| !a.is_empty())
            .with_context(|| format!("fault {name} needs {what}, e.g. {name}:{}", example(name)))
    }

    /// A count `v` in the argument (`what`: what it counts, for the error).
    fn num(&self, v: &str, what: &str) -> Result<usize> {
        v.trim()
            .parse()
            .with_context(|| format!("fault {}: {what} {v:?} is not a number", self.name))
    }

    /// The attention's kinds (MLA, RoPE, the DSA indexer, the tensor-parallel heads); `None`
    /// for a name of another family.
    fn attention(&self) -> Result<Option<FaultKind>> {
        let name = self.name;
        Ok(Some(match name {
            "kv_b_concat" => self.no_arg(FaultKind::KvBConcat)?,
            "rope_neox" => self.no_arg(FaultKind::RopeNeox)?,
            "indexer_rope_neox" => self.no_arg(FaultKind::IndexerRopeNeox)?,
            "indexer_relu" => match self.arg {
                Some("off") => FaultKind::IndexerNoRelu,
                _ => bail!("fault indexer_relu needs off: indexer_relu:off (the ReLU left out)"),
            },
            "scale_latent" => self.no_arg(FaultKind::ScaleLatent)?,
            "tp_shard" => {
                let n = self.num(self.need("a shard count")?, "shard count")?;
                if n < 2 {
                    bail!("fault tp_shard:{n}: needs at least 2 shards");
                }
                FaultKind::TpShard(n)
            }
            "softmax_scale" => {
                FaultKind::SoftmaxScale(factor(name, self.need("a factor")?, true)?)
            }
            "yarn_mscale" => FaultKind::YarnMscale(match self.need("none or twice")? {
                "none" => Mscale::Missing,
                "twice" => Mscale::Twice,
                a => bail!("fault yarn_mscale:{a}: expected yarn_mscale:none or yarn_mscale:twice"),
            }),
            "rope_theta" => {
                let a = self.need("a frequency base")?;
                let x: f64 = a
                    .parse()
                    .with_context(|| format!("fault rope_theta:{a}: not a number"))?;
                if !x.is_finite() || x <= 1.0 {
                    bail!("fault rope_theta:{a}: the base must be finite and above 1");
                }
                FaultKind::RopeTheta(x)
            }
            "yarn_factor" => {
                let a = self.need("a scaling factor")?;
                let x: f64 = a
                    .parse()
                    .with_context(|| format!("fault yarn_factor:{a}: not a number"))?;
                if !x.is_finite() || x < 1.0 {
                    bail!("fault yarn_factor:{a}: the factor must be finite and at least 1");
                }
                FaultKind::YarnFactor(x)
            }
            "dsa_topk" => {
                let k = self.num(self.need("a key count")?, "key count")?;
                if k == 0 {
                    bail!("fault dsa_topk:0: the indexer keeps at least one key");
                }
                FaultKind::DsaTopK(k)
            }
            "indexer_scale" => {
                FaultKind::IndexerScale(factor(name, self.need("a factor")?, true)?)
            }
            "indexer_wproj_scale" => {
                FaultKind::IndexerWprojScale(factor(name, self.need("a factor")?, true)?)
            }
            "kv_b_split" => match self.arg {
                Some("kv") => FaultKind::KvBSplit,
                _ => bail!(
                    "fault kv_b_split needs the order the split assumes: kv_b_split:kv (all K rows, then all V rows)"
                ),
            },
            _ => return Ok(None),
        }))
    }

    /// The router's and the experts' kinds; `None` for a name of another family.
    fn routing(&self) -> Result<Option<FaultKind>> {
        let name = self.name;
        Ok(Some(match name {
            "softmax_gating" => self.no_arg(FaultKind::SoftmaxGating)?,
            "bias_in_weights" => self.no_arg(FaultKind::BiasInWeights)?,
            "router_bf16" => self.no_arg(FaultKind::RouterBf16)?,
            "gate_up_swap" => match self.arg {
                None | Some("routed") => FaultKind::GateUpSwap,
                Some("dense") => FaultKind::GateUpSwapMlp(MlpPart::Dense),
                Some("shared") => FaultKind::GateUpSwapMlp(MlpPart::Shared),
                Some(a) => bail!(
                    "fault gate_up_swap:{a}: expected gate_up_swap (routed experts), gate_up_swap:dense or gate_up_swap:shared"
                ),
            },
            "expert_swap" => self.expert_swap()?,
            "expert_map" => self.expert_map()?,
            "routed_scale" => {
                let a = self.need("a scale")?;
                FaultKind::RoutedScale(RoutedScale::Factor(route_factor(name, a, a)?))
            }
            "routed_scaling_ignored" => {
                self.no_arg(FaultKind::RoutedScale(RoutedScale::Ignored))?
            }
            "routed_scaling_twice" => self.no_arg(FaultKind::RoutedScale(RoutedScale::Twice))?,
            "topk_norm" => match self.need("on or off")? {
                "on" => FaultKind::TopkNorm(true),
                "off" => FaultKind::TopkNorm(false),
                a => bail!("fault topk_norm:{a}: expected topk_norm:on or topk_norm:off"),
            },
            "bias_unused" => self.no_arg(FaultKind::BiasUnused)?,
            "group_limit" => self.group_limit()?,
            "experts_per_token" => {
                let k = self.num(self.need("an expert count")?, "expert count")?;
                if k == 0 {
                    bail!("fault experts_per_token:0: each token is routed to at least one expert");
                }
                FaultKind::ExpertsPerToken(k)
            }
            "expert_scale" => {
                let a = self.need("an expert and a factor")?;
                let (e, f) = a
                    .split_once(',')
                    .with_context(|| format!("fault expert_scale:{a}: expected expert_scale:E,F"))?;
                let factor = route_factor(name, a, f)?;
                if factor == 1.0 {
                    bail!("fault expert_scale:{a}: a factor of 1 changes nothing");
                }
                FaultKind::ExpertScale {
                    expert: self.num(e, "expert")?,
                    factor,
                }
            }
            _ => return Ok(None),
        }))
    }

    /// `expert_swap:A,B`: the map of two experts exchanged.
    fn expert_swap(&self) -> Result<FaultKind> {
        let a = self.need("two expert ids")?;
        let (x, y) = a
            .split_once(',')
            .with_context(|| format!("fault expert_swap:{a}: expected expert_swap:A,B"))?;
        let (x, y) = (self.num(x, "expert")?, self.num(y, "expert")?);
        if x == y {
            bail!("fault expert_swap:{a}: the two experts are the same");
        }
        Ok(FaultKind::ExpertMap(vec![
            (x.min(y), x.max(y)),
            (x.max(y), x.min(y)),
        ]))
    }

    /// `expert_map:SLOT=FROM,...`: the slots not mapped to themselves, sorted.
    fn expert_map(&self) -> Result<FaultKind> {
        let a = self.need("pairs SLOT=FROM")?;
        let mut map = Vec::new();
        for p in a.split(',') {
            let (slot, from) = p
                .split_once('=')
                .with_context(|| format!("fault expert_map:{a}: {p:?} is not SLOT=FROM"))?;
            let (slot, from) = (self.num(slot, "expert")?, self.num(from, "expert")?);
            if map.iter().any(|&(s, _)| s == slot) {
                bail!("fault expert_map:{a}: expert {slot} is mapped twice");
            }
            if slot != from {
                map.push((slot, from));
            }
        }
        if map.is_empty() {
            bail!("fault expert_map:{a}: maps every expert to itself");
        }
        map.sort_unstable();
        Ok(FaultKind::ExpertMap(map))
    }

    /// `group_limit:off` or `group_limit:N[,K]`.
    fn group_limit(&self) -> Result<FaultKind> {
        let a = self.need("off or a group count")?;
        if a == "off" {
            return Ok(FaultKind::GroupLimit(GroupLimit::Off));
        }
        let (n, k) = match a.split_once(',') {
            Some((n, k)) => (n, Some(self.num(k, "kept group count")?)),
            None => (a, None),
        };
        let groups = self.num(n, "group count")?;
        if groups == 0 || k == Some(0) {
            bail!("fault group_limit:{a}: groups and kept groups must be at least 1");
        }
        Ok(FaultKind::GroupLimit(GroupLimit::Groups {
            groups,
            keep: k,
        }))
    }

    /// The kinds of a weight read wrong, of the norms and of the precision or the graph
    /// (`run_mtp`); `None` for a name of another family.
    fn weights_and_norms(&self) -> Result<Option<FaultKind>> {
        let name = self.name;
        Ok(Some(match name {
            "layer_weights" => {
                let a = self.need("a layer")?;
                let (l, glob) = match a.split_once(',') {
                    Some((l, g)) => (l, g.trim().to_string()),
                    None => (a, DEFAULT_LAYER_WEIGHTS.to_string()),
                };
                if glob.is_empty() {
                    bail!("fault layer_weights:{a}: empty tensor glob");
                }
                FaultKind::LayerWeights {
                    src: self.num(l, "layer")?,
                    glob,
                }
            }
            "transposed" => FaultKind::Transposed {
                glob: self.need("a tensor glob")?.to_string(),
            },
            "weight_scale" => {
                let a = self.need("a tensor glob and a factor")?;
                let (glob, f) = a.rsplit_once(',').with_context(|| {
                    format!("fault weight_scale:{a}: expected weight_scale:GLOB,F")
                })?;
                let glob = glob.trim();
                if glob.is_empty() {
                    bail!("fault weight_scale:{a}: empty tensor glob");
                }
                FaultKind::WeightScale {
                    glob: glob.to_string(),
                    factor: factor(name, f, false)?,
                }
            }
            "q4k_scale_bits" => self.no_arg(FaultKind::Q4kScaleBits)?,
            "run_mtp" => self.no_arg(FaultKind::RunMtp)?,
            "f32_accumulate" => self.no_arg(FaultKind::F32Accumulate)?,
            "norm_eps" => {
                let a = self.need("an epsilon")?;
                let x: f64 = a
                    .parse()
                    .with_context(|| format!("fault norm_eps:{a}: not a number"))?;
                if !x.is_finite() || x < 0.0 {
                    bail!("fault norm_eps:{a}: must be finite and not negative");
                }
                FaultKind::NormEps(x)
            }
            "norm_one_plus" => FaultKind::NormOnePlus {
                glob: match self.arg {
                    None => DEFAULT_NORM_ONE_PLUS.to_string(),
                    Some("") => bail!("fault norm_one_plus: empty norm glob"),
                    Some(g) => g.to_string(),
                },
            },
            _ => return Ok(None),
        }))
    }
}

/// A scale factor `v` of fault `name` (argument `arg`): finite and not negative.
fn route_factor(name: &str, arg: &str, v: &str) -> Result<f64> {
    let x: f64 = v
        .trim()
        .parse()
        .with_context(|| format!("fault {name}:{arg}: factor {v:?} is not a number"))?;
    if !x.is_finite() || x < 0.0 {
        bail!("fault {name}:{arg}: factor {x} must be finite and not negative");
    }
    Ok(x)
}

/// A factor of a scale fault: finite, not 1 (that changes nothing), and positive when
/// `positive` (else not 0).
fn factor(name: &str, v: &str, positive: bool) -> Result<f64> {
    let f: f64 = v
        .trim()
        .parse()
        .with_context(|| format!("fault {name}: factor {v:?} is not a number"))?;
    if !f.is_finite() || f == 0.0 || (positive && f < 0.0) {
        bail!(
            "fault {name}: factor {v} must be finite and {}",
            if positive { "above 0" } else { "not 0" }
        );
    }
    if f == 1.0 {
        bail!("fault {name}: factor 1 changes nothing");
    }
    Ok(f)
}

fn example(name: &str) -> &'static str {
    match name {
        "routed_scale" => "1.0",
        "topk_norm" => "off",
        "group_limit" => "off",
        "expert_scale" => "3,1.05",
        "expert_swap" => "2,5",
        "expert_map" => "4=5,5=6,6=4",
        "layer_weights" => "0",
        "tp_shard" => "2",
        "norm_eps" => "1e-6",
        "transposed" => "attn_output.weight",
        "weight_scale" => "attn_output.weight,1.01",
        "softmax_scale" | "indexer_scale" | "indexer_wproj_scale" => "1.05",
        "yarn_mscale" => "none",
        "rope_theta" => "1e6",
        "yarn_factor" => "4",
        "dsa_topk" => "2047",
        "experts_per_token" => "9",
        _ => "ARG",
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::KvBConcat => f.write_str("kv_b_concat"),
            FaultKind::RopeNeox => f.write_str("rope_neox"),
            FaultKind::IndexerRopeNeox => f.write_str("indexer_rope_neox"),
            FaultKind::IndexerNoRelu => f.write_str("indexer_relu:off"),
            FaultKind::ScaleLatent => f.write_str("scale_latent"),
            FaultKind::SoftmaxGating => f.write_str("softmax_gating"),
            FaultKind::BiasInWeights => f.write_str("bias_in_weights"),
            FaultKind::RouterBf16 => f.write_str("router_bf16"),
            FaultKind::ExpertMap(m) => {
                let swap = m.len() == 2 && m[0].0 == m[1].1 && m[0].1 == m[1].0;
                if swap {
                    write!(f, "expert_swap:{},{}", m[0].0, m[0].1)
                } else {
                    let p: Vec<String> = m.iter().map(|(s, x)| format!("{s}={x}")).collect();
                    write!(f, "expert_map:{}", p.join(","))
                }
            }
            FaultKind::GateUpSwap => f.write_str("gate_up_swap"),
            FaultKind::LayerWeights { src, glob } if glob == DEFAULT_LAYER_WEIGHTS => {
                write!(f, "layer_weights:{src}")
            }
            FaultKind::LayerWeights { src, glob } => write!(f, "layer_weights:{src},{glob}"),
            FaultKind::Q4kScaleBits => f.write_str("q4k_scale_bits"),
            FaultKind::RunMtp => f.write_str("run_mtp"),
            FaultKind::TpShard(n) => write!(f, "tp_shard:{n}"),
            FaultKind::F32Accumulate => f.write_str("f32_accumulate"),
            FaultKind::NormEps(x) => write!(f, "norm_eps:{x:e}"),
            FaultKind::Transposed { glob } => write!(f, "transposed:{glob}"),
            FaultKind::RoutedScale(RoutedScale::Factor(x)) => {
                write!(f, "routed_scale:{}", factor_words(*x))
            }
            FaultKind::RoutedScale(RoutedScale::Ignored) => f.write_str("routed_scaling_ignored"),
            FaultKind::RoutedScale(RoutedScale::Twice) => f.write_str("routed_scaling_twice"),
            FaultKind::TopkNorm(on) => write!(f, "topk_norm:{}", if *on { "on" } else { "off" }),
            FaultKind::BiasUnused => f.write_str("bias_unused"),
            FaultKind::GroupLimit(GroupLimit::Off) => f.write_str("group_limit:off"),
            FaultKind::GroupLimit(GroupLimit::Groups { groups, keep: None }) => {
                write!(f, "group_limit:{groups}")
            }
            FaultKind::GroupLimit(GroupLimit::Groups {
                groups,
                keep: Some(k),
            }) => write!(f, "group_limit:{groups},{k}"),
            FaultKind::ExpertScale { expert, factor } => {
                write!(f, "expert_scale:{expert},{}", factor_words(*factor))
            }
            FaultKind::GateUpSwapMlp(MlpPart::Dense) => f.write_str("gate_up_swap:dense"),
            FaultKind::GateUpSwapMlp(MlpPart::Shared) => f.write_str("gate_up_swap:shared"),
            FaultKind::WeightScale { glob, factor } => write!(f, "weight_scale:{glob},{factor}"),
            FaultKind::SoftmaxScale(x) => write!(f, "softmax_scale:{x}"),
            FaultKind::YarnMscale(Mscale::Missing) => f.write_str("yarn_mscale:none"),
            FaultKind::YarnMscale(Mscale::Twice) => f.write_str("yarn_mscale:twice"),
            FaultKind::RopeTheta(x) => write!(f, "rope_theta:{x}"),
            FaultKind::YarnFactor(x) => write!(f, "yarn_factor:{x}"),
            FaultKind::DsaTopK(k) => write!(f, "dsa_topk:{k}"),
            FaultKind::IndexerScale(x) => write!(f, "indexer_scale:{x}"),
            FaultKind::IndexerWprojScale(x) => write!(f, "indexer_wproj_scale:{x}"),
            FaultKind::NormOnePlus { glob } if glob == DEFAULT_NORM_ONE_PLUS => {
                f.write_str("norm_one_plus")
            }
            FaultKind::NormOnePlus { glob } => write!(f, "norm_one_plus:{glob}"),
            FaultKind::KvBSplit => f.write_str("kv_b_split:kv"),
            FaultKind::ExpertsPerToken(k) => write!(f, "experts_per_token:{k}"),
        }
    }
}

/// A fault and where it applies.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// What it does.
    pub kind: FaultKind,
    /// The layers it touches (`None`: every layer, and the global steps where the kind concerns
    /// them: the embedding and output projection for `q4k_scale_bits` and `f32_accumulate`, the
    /// final norm for `norm_eps` and `run_mtp`).
    pub layers: Option<Vec<usize>>,
}

impl Fault {
    /// Parses `KIND[@LAYERS]`: `LAYERS` is `N`, `A..B` (end exclusive) or `N,M,...`.
    /// `layer_weights:L` without layers touches layer `L+1`.
    pub fn parse(s: &str) -> Result<Fault> {
        let (kind, layers) = match s.rsplit_once('@') {
            Some((k, l)) => (
                k,
                Some(parse_layers(l).with_context(|| format!("--inject {s}"))?),
            ),
            None => (s, None),
        };
        let mut kind = FaultKind::parse(kind).with_context(|| format!("--inject {s}"))?;
        // A full GGUF name (`blk.1.attn_q_a.weight`, as `inspect` lists it) selects its layer:
        // the glob is matched without `blk.L.`, and `L` becomes the fault's layer.
        let mut named = None;
        if let FaultKind::Transposed { glob }
        | FaultKind::LayerWeights { glob, .. }
        | FaultKind::WeightScale { glob, .. }
        | FaultKind::NormOnePlus { glob } = &mut kind
        {
            if let Some((l, suffix)) = names::split_blk(glob) {
                let suffix = suffix.to_string();
                if suffix.is_empty() {
                    bail!("--inject {s}: {glob:?} names no tensor of layer {l}");
                }
                *glob = suffix;
                named = Some(l);
            }
        }
        let layers = match (named, layers, &kind) {
            (Some(l), Some(ls), _) if ls != [l] => bail!(
                "--inject {s}: the tensor name picks layer {l}, but @ picks layers {ls:?}; give one (names match with or without blk.L., @L picks the layer)"
            ),
            (Some(l), _, _) => Some(vec![l]),
            (None, None, FaultKind::LayerWeights { src, .. }) => Some(vec![src + 1]),
            (None, l, _) => l,
        };
        Ok(Fault { kind, layers })
    }

    /// The fault at `layers` (`None`: everywhere).
    pub fn new(kind: FaultKind, layers: Option<Vec<usize>>) -> Fault {
        Fault { kind, layers }
    }

    /// Whether the fault touches a step of `layer` (`None`: a global step).
    pub fn at(&self, layer: Option<usize>) -> bool {
        match (&self.layers, layer) {
            (None, _) => true,
            (Some(ls), Some(l)) => ls.contains(&l),
            (Some(_), None) => false,
        }
    }

    /// Whether a tensor `name` of `layer` (suffix) matches the kind's glob, for the kinds that
    /// name tensors (`layer_weights`, `transposed`).
    fn names_tensor(glob: &str, name: &str) -> bool {
        names::split_blk(name).is_some_and(|(_, suffix)| glob_match(glob, suffix))
    }

    /// Checks that the fault applies to `weights` over the layers `run` (and the tail when
    /// `tail`): clear errors for a kind that cannot apply (no MTP block for `run_mtp`, no Q4_K
    /// tensor for `q4k_scale_bits`, a dense layer for the router kinds, ...).
    pub fn check(&self, weights: &Weights<'_>, run: Range<usize>, tail: bool) -> Result<()> {
        let hp = weights.hparams();
        let me = self.to_string();
        self.check_layers(&me, hp, &run)?;
        let layers: Vec<usize> = run.clone().filter(|&l| self.at(Some(l))).collect();
        match &self.kind {
            FaultKind::IndexerRopeNeox | FaultKind::IndexerNoRelu => {
                need_indexer(&me, weights, &layers)?;
            }
            FaultKind::SoftmaxGating
            | FaultKind::BiasInWeights
            | FaultKind::RouterBf16
            | FaultKind::GateUpSwap
            | FaultKind::ExpertMap(_) => check_router(&self.kind, &me, weights, &layers)?,
            FaultKind::LayerWeights { src, glob } => {
                check_layer_weights(&me, weights, *src, glob, &layers)?
            }
            FaultKind::Transposed { glob } => check_transposed(&me, weights, glob, &layers)?,
            FaultKind::Q4kScaleBits => self.check_q4k(&me, weights, &layers, &run, tail)?,
            FaultKind::RunMtp => self.check_run_mtp(&me, weights, tail)?,
            FaultKind::TpShard(n) => {
                if hp.n_head % n != 0 {
                    bail!(
                        "--inject {me}: {} heads do not split into {n} shards",
                        hp.n_head
                    );
                }
            }
            FaultKind::RoutedScale(_)
            | FaultKind::TopkNorm(_)
            | FaultKind::BiasUnused
            | FaultKind::GroupLimit(_)
            | FaultKind::ExpertScale { .. }
            | FaultKind::GateUpSwapMlp(_)
            | FaultKind::ExpertsPerToken(_) => route::check(&self.kind, &me, weights, &layers)?,
            FaultKind::KvBConcat | FaultKind::RopeNeox | FaultKind::ScaleLatent => {}
            FaultKind::F32Accumulate | FaultKind::NormEps(_) => {}
            FaultKind::WeightScale { .. }
            | FaultKind::SoftmaxScale(_)
            | FaultKind::YarnMscale(_)
            | FaultKind::RopeTheta(_)
            | FaultKind::YarnFactor(_)
            | FaultKind::DsaTopK(_)
            | FaultKind::IndexerScale(_)
            | FaultKind::IndexerWprojScale(_)
            | FaultKind::NormOnePlus { .. }
            | FaultKind::KvBSplit => attn::check(
                &self.kind,
                &me,
                weights,
                &layers,
                self.layers.is_none() && tail,
            )?,
        }
        if layers.is_empty() && !matches!(self.kind, FaultKind::RunMtp) && self.layers.is_some() {
            bail!("--inject {me}: touches no layer of the run");
        }
        Ok(())
    }

    /// Checks the fault's layers (`me`: the fault as the user wrote it) against the model's and
    /// the run's `run`: a `layer_weights` source and targets the model has, layers it runs, one
    /// of them compared.
    fn check_layers(&self, me: &str, hp: &HParams, run: &Range<usize>) -> Result<()> {
        if let FaultKind::LayerWeights { src, .. } = &self.kind {
            // The layers of the fault are those reading layer `src`'s weights (`src + 1` by
            // default): name the source first, with the layers it can be for this run.
            let targets = self.layers.as_deref().unwrap_or(&[]);
            if *src >= hp.n_block || targets.iter().any(|&l| l >= hp.n_layer) {
                bail!(
                    "--inject {me}: reads layer {src}'s weights into layer{} {}, but the model has blocks 0..{} and runs layers 0..{} (layer_weights:L reads layer L into layer L+1, so L in 0..{}; layer_weights:L@N reads it into layer N)",
                    if targets.len() == 1 { "" } else { "s" },
                    targets
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    hp.n_block,
                    hp.n_layer,
                    hp.n_layer.saturating_sub(1)
                );
            }
        }
        if let Some(ls) = &self.layers {
            if let Some(&l) = ls.iter().find(|&&l| l >= hp.n_layer) {
                bail!(
                    "--inject {me}: layer {l} is not run: the model runs layers 0..{}",
                    hp.n_layer
                );
            }
            if !ls.iter().any(|l| run.contains(l)) {
                bail!(
                    "--inject {me}: the run compares layers {}..{}, none of the fault's layers {ls:?}",
                    run.start,
                    run.end
                );
            }
        }
        Ok(())
    }

    /// Checks a `q4k_scale_bits` fault (`me`): some tensor the run reads over `layers` (the
    /// run's layers it touches; the token embedding when `run` starts at layer 0 and the output
    /// projection when `tail`, for a fault on every layer) is Q4_K.
    fn check_q4k(
        &self,
        me: &str,
        weights: &Weights<'_>,
        layers: &[usize],
        run: &Range<usize>,
        tail: bool,
    ) -> Result<()> {
        let mut read: Vec<String> = Vec::new();
        for &l in layers {
            read.extend(plan_layer_weights(weights, l)?);
        }
        if self.layers.is_none() {
            if run.start == 0 {
                read.push(names::TOKEN_EMBD.to_string());
            }
            if tail {
                read.push(weights.output_name().to_string());
            }
        }
        let q4k = read.iter().any(|n| {
            weights
                .model()
                .find(n)
                .is_some_and(|t| t.info.ty == GgmlType::Q4_K)
        });
        if !q4k {
            bail!(
                "--inject {me}: no tensor the run reads is Q4_K ({} has none in these layers)",
                weights.model().file_name()
            );
        }
        Ok(())
    }

    /// Checks a `run_mtp` fault (`me`): the file has an MTP block to run as a layer, and the
    /// run compares every layer and the tail (`tail`).
    fn check_run_mtp(&self, me: &str, weights: &Weights<'_>, tail: bool) -> Result<()> {
        let hp = weights.hparams();
        if hp.n_nextn == 0 {
            bail!(
                "--inject {me}: {} has no MTP block (nextn_predict_layers = 0)",
                weights.model().file_name()
            );
        }
        if self.layers.is_some() {
            bail!("--inject {me}: run_mtp concerns the final norm; give no layers");
        }
        if !tail {
            bail!("--inject {me}: the MTP block runs before the final norm; compare every layer (no --layer/--layers)");
        }
        if !weights.has(&names::blk(hp.n_layer, blk::ATTN_NORM)) {
            bail!(
                "--inject {me}: the file has no blk.{}.attn_norm.weight: no MTP block to run as a layer",
                hp.n_layer
            );
        }
        Ok(())
    }
}

/// Checks a router or routed-experts fault of the original catalogue (`softmax_gating`,
/// `bias_in_weights`, `router_bf16`, `gate_up_swap`, `expert_swap`/`expert_map`; `me`: as the
/// user wrote it) against the model over `layers` (the run's layers it touches).
fn check_router(kind: &FaultKind, me: &str, weights: &Weights<'_>, layers: &[usize]) -> Result<()> {
    let hp = weights.hparams();
    let moe = moe_layers(weights, layers);
    let need_moe = || need_moe(me, weights, layers);
    match kind {
        FaultKind::SoftmaxGating => {
            need_moe()?;
            if hp.gating == crate::model::Gating::Softmax {
                bail!("--inject {me}: the model's router already uses softmax");
            }
        }
        FaultKind::BiasInWeights => {
            need_moe()?;
            if !moe
                .iter()
                .any(|&l| weights.has(&names::blk(l, blk::EXP_PROBS_B)))
            {
                bail!("--inject {me}: no layer among {moe:?} has a selection bias exp_probs_b");
            }
        }
        FaultKind::RouterBf16 | FaultKind::GateUpSwap => need_moe()?,
        FaultKind::ExpertMap(m) => {
            need_moe()?;
            if let Some(&(s, f)) = m
                .iter()
                .find(|&&(s, f)| s >= hp.n_expert || f >= hp.n_expert)
            {
                bail!(
                    "--inject {me}: expert {} is not one of the model's {} experts",
                    s.max(f),
                    hp.n_expert
                );
            }
        }
        _ => {}
    }
    Ok(())
}

/// Checks a `layer_weights` fault (`me`) reading layer `src`'s tensors matching `glob` into
/// `layers`: the source is in the file, no layer reads its own weights, and at least one tensor
/// matches, with a counterpart of the same shape in layer `src`.
fn check_layer_weights(
    me: &str,
    weights: &Weights<'_>,
    src: usize,
    glob: &str,
    layers: &[usize],
) -> Result<()> {
    let hp = weights.hparams();
    if src >= hp.n_block {
        bail!(
            "--inject {me}: layer {src} is not in the file ({} blocks)",
            hp.n_block
        );
    }
    let mut hit = 0;
    for &l in layers {
        if l == src {
            bail!("--inject {me}: layer {l} would read its own weights");
        }
        for name in plan_layer_weights(weights, l)? {
            if !Fault::names_tensor(glob, &name) {
                continue;
            }
            let (_, suffix) = names::split_blk(&name).unwrap_or((l, ""));
            let other = names::blk(src, suffix);
            let (a, b) = (weights.model().find(&name), weights.model().find(&other));
            match (a, b) {
                (Some(a), Some(b)) if a.info.ne == b.info.ne => hit += 1,
                (Some(a), Some(b)) => bail!(
                    "--inject {me}: {name} has ne={:?}, {other} has ne={:?}",
                    a.info.ne,
                    b.info.ne
                ),
                _ => bail!("--inject {me}: the file has no {other} for {name}"),
            }
        }
    }
    if hit == 0 {
        bail!("--inject {me}: no tensor of layers {layers:?} matches {glob:?} (matched against the name without blk.L., e.g. attn_q_a.weight; @L or a full name blk.L.NAME picks the layer)");
    }
    Ok(())
}

/// Checks a `transposed` fault (`me`): some matrix of `layers` matches `glob`.
fn check_transposed(me: &str, weights: &Weights<'_>, glob: &str, layers: &[usize]) -> Result<()> {
    let hit = layers.iter().try_fold(0, |n, &l| -> Result<usize> {
        Ok(n + plan_layer_weights(weights, l)?
            .iter()
            .filter(|w| Fault::names_tensor(glob, w) && weights.matrix_dims(w).is_ok())
            .count())
    })?;
    if hit == 0 {
        bail!("--inject {me}: no matrix of layers {layers:?} matches {glob:?} (matched against the name without blk.L., e.g. attn_q_a.weight; @L or a full name blk.L.NAME picks the layer)");
    }
    Ok(())
}

/// The MoE layers among `layers`.
fn moe_layers(weights: &Weights<'_>, layers: &[usize]) -> Vec<usize> {
    let hp = weights.hparams();
    layers
        .iter()
        .copied()
        .filter(|&l| !hp.is_dense(l))
        .collect()
}

/// Checks that fault `me` has an MoE layer among `layers` to apply to.
fn need_moe(me: &str, weights: &Weights<'_>, layers: &[usize]) -> Result<()> {
    if moe_layers(weights, layers).is_empty() {
        bail!(
            "--inject {me}: no MoE layer among {layers:?} (dense layers 0..{} have no router or routed experts)",
            weights.hparams().n_dense
        );
    }
    Ok(())
}

/// The model's DSA indexer, checked to run in one of `layers` for fault `me`.
fn need_indexer<'a>(
    me: &str,
    weights: &'a Weights<'_>,
    layers: &[usize],
) -> Result<&'a crate::model::hparams::IndexerParams> {
    let hp = weights.hparams();
    let Some(ix) = &hp.indexer else {
        bail!(
            "--inject {me}: the model ({}) has no DSA indexer",
            hp.arch.as_str()
        );
    };
    if !layers
        .iter()
        .any(|&l| ix.full.get(l).copied().unwrap_or(false))
    {
        bail!("--inject {me}: no layer among {layers:?} runs its own indexer");
    }
    Ok(ix)
}

/// The tensors layer `l`'s steps read.
fn plan_layer_weights(weights: &Weights<'_>, l: usize) -> Result<Vec<String>> {
    let hp = weights.hparams();
    if l >= hp.n_layer {
        bail!("layer {l} is not run");
    }
    Ok(steps::weights_of(&steps::layer_steps(hp, l), weights))
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        match (&self.kind, &self.layers) {
            (_, None) => Ok(()),
            (FaultKind::LayerWeights { src, .. }, Some(ls)) if *ls == [src + 1] => Ok(()),
            (_, Some(ls)) => {
                let v: Vec<String> = ls.iter().map(usize::to_string).collect();
                write!(f, "@{}", v.join(","))
            }
        }
    }
}

/// Parses `N`, `A..B` (end exclusive) or `N,M,...`.
fn parse_layers(s: &str) -> Result<Vec<usize>> {
    let s = s.trim();
    let num = |v: &str| -> Result<usize> {
        v.trim()
            .parse()
            .with_context(|| format!("layer {v:?} is not a number (layers: N, A..B or N,M)"))
    };
    let v: Vec<usize> = if let Some((a, b)) = s.split_once("..") {
        let (a, b) = (num(a)?, num(b)?);
        if a >= b {
            bail!("layers {a}..{b} are empty (the end is exclusive)");
        }
        (a..b).collect()
    } else {
        s.split(',').map(num).collect::<Result<_>>()?
    };
    if v.is_empty() {
        bail!("no layer given after @");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print_back() {
        for s in [
            "kv_b_concat",
            "rope_neox@1",
            "indexer_rope_neox@0,2",
            "indexer_relu:off@1",
            "expert_swap:2,5@1",
            "expert_map:4=5,5=6,6=4",
            "layer_weights:0",
            "layer_weights:1,ffn_*_exps.weight@3",
            "tp_shard:2",
            "norm_eps:1e-6",
            "q4k_scale_bits",
            "run_mtp",
            "routed_scale:1.05@1",
            "routed_scale:0",
            "routed_scaling_ignored@1",
            "routed_scaling_twice",
            "topk_norm:on@2",
            "topk_norm:off",
            "bias_unused@1",
            "group_limit:off",
            "group_limit:4@2",
            "group_limit:8,4",
            "expert_scale:3,1.05@1",
            "gate_up_swap:dense",
            "gate_up_swap:shared@1",
        ] {
            let f = Fault::parse(s).unwrap();
            assert_eq!(f.to_string(), s, "{s}");
        }
        // The routed experts' gate_up_swap keeps its spelling; `routed` names it too.
        assert_eq!(
            Fault::parse("gate_up_swap:routed").unwrap().to_string(),
            "gate_up_swap"
        );
        // Factors print rounded to 4 decimals (a fitted value in a kind).
        assert_eq!(
            Fault::parse("expert_scale:3,1.049999").unwrap().to_string(),
            "expert_scale:3,1.05"
        );
        assert_eq!(
            Fault::parse("routed_scaling_twice").unwrap().kind,
            FaultKind::RoutedScale(RoutedScale::Twice)
        );
        assert_eq!(RoutedScale::Twice.factor(2.5), 6.25);
        assert_eq!(
            GroupLimit::Groups {
                groups: 8,
                keep: None
            }
            .resolve(Some((4, 2))),
            Some(Some((8, 2)))
        );
        assert_eq!(
            GroupLimit::Groups {
                groups: 8,
                keep: None
            }
            .resolve(None),
            None
        );
        assert_eq!(
            Fault::parse("expert_swap:5,2").unwrap().to_string(),
            "expert_swap:2,5"
        );
        assert_eq!(
            Fault::parse("layer_weights:0").unwrap().layers,
            Some(vec![1])
        );
        // A full GGUF name picks its layer; the glob is matched without `blk.L.`.
        let f = Fault::parse("transposed:blk.1.attn_q_a.weight").unwrap();
        assert_eq!(f.to_string(), "transposed:attn_q_a.weight@1");
        assert_eq!(
            Fault::parse("layer_weights:0,blk.2.attn_q_a.weight")
                .unwrap()
                .layers,
            Some(vec![2])
        );
        assert_eq!(
            Fault::parse("rope_neox@1..3").unwrap().layers,
            Some(vec![1, 2])
        );
        let f = Fault::parse("experts_per_token:3@1").unwrap();
        assert_eq!(f.kind, FaultKind::ExpertsPerToken(3));
        assert_eq!(f.to_string(), "experts_per_token:3@1");
    }

    #[test]
    fn attention_kinds_parse_and_print_back() {
        for s in [
            "weight_scale:attn_output.weight,1.01@1",
            "weight_scale:output.weight,0.5",
            "softmax_scale:1.05",
            "yarn_mscale:none@2",
            "yarn_mscale:twice",
            "rope_theta:1000000@0",
            "yarn_factor:4@1",
            "dsa_topk:2047",
            "indexer_scale:0.25@1",
            "indexer_wproj_scale:8",
            "norm_one_plus",
            "norm_one_plus:attn_*norm.weight@1",
            "kv_b_split:kv@1",
        ] {
            let f = Fault::parse(s).unwrap();
            assert_eq!(f.to_string(), s, "{s}");
            assert_eq!(Fault::parse(&f.to_string()).unwrap(), f, "{s}");
        }
        assert_eq!(
            Fault::parse("rope_theta:1e6").unwrap().kind,
            FaultKind::RopeTheta(1e6)
        );
        // A full GGUF name picks its layer, as for transposed.
        let f = Fault::parse("weight_scale:blk.2.attn_kv_a_norm.weight,1.1").unwrap();
        assert_eq!(f.to_string(), "weight_scale:attn_kv_a_norm.weight,1.1@2");
        let f = Fault::parse("norm_one_plus:blk.0.ffn_norm.weight").unwrap();
        assert_eq!(f.to_string(), "norm_one_plus:ffn_norm.weight@0");
        for (s, want) in [
            (
                "weight_scale:attn_output.weight",
                "expected weight_scale:GLOB,F",
            ),
            ("weight_scale:,2", "empty tensor glob"),
            ("weight_scale:x,0", "must be finite and not 0"),
            ("softmax_scale:1", "factor 1 changes nothing"),
            ("softmax_scale:-1", "must be finite and above 0"),
            ("indexer_scale:nan", "must be finite"),
            ("softmax_scale", "needs a factor"),
            (
                "yarn_mscale:half",
                "expected yarn_mscale:none or yarn_mscale:twice",
            ),
            ("rope_theta:1", "above 1"),
            ("yarn_factor:0.5", "at least 1"),
            ("yarn_factor:x", "not a number"),
            ("dsa_topk:0", "at least one key"),
            ("dsa_topk:x", "is not a number"),
            ("experts_per_token:0", "at least one expert"),
            (
                "experts_per_token",
                "needs an expert count, e.g. experts_per_token:9",
            ),
            ("norm_one_plus:", "empty norm glob"),
            ("kv_b_split", "kv_b_split:kv"),
            ("kv_b_split:vk", "kv_b_split:kv"),
        ] {
            let e = format!("{:#}", Fault::parse(s).unwrap_err());
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn bad_kinds_are_named() {
        for (s, want) in [
            ("nope", "unknown fault \"nope\""),
            ("kv_b_concat:3", "takes no argument"),
            ("expert_swap", "needs two expert ids"),
            ("expert_swap:1,1", "the same"),
            ("tp_shard:1", "at least 2"),
            ("norm_eps:x", "not a number"),
            ("rope_neox@a", "is not a number"),
            ("rope_neox@3..1", "are empty"),
            ("routed_scale", "needs a scale, e.g. routed_scale:1.0"),
            ("routed_scale:-1", "must be finite and not negative"),
            ("routed_scale:x", "factor \"x\" is not a number"),
            ("routed_scaling_ignored:2", "takes no argument"),
            ("topk_norm:yes", "expected topk_norm:on or topk_norm:off"),
            ("group_limit:0", "must be at least 1"),
            ("group_limit:4,x", "kept group count \"x\" is not a number"),
            ("expert_scale:3", "expected expert_scale:E,F"),
            ("expert_scale:3,1", "a factor of 1 changes nothing"),
            ("expert_scale:3,inf", "must be finite"),
            ("gate_up_swap:up", "expected gate_up_swap (routed experts)"),
            (
                "transposed:blk.1.attn_q_a.weight@0,1",
                "the tensor name picks layer 1, but @ picks layers [0, 1]",
            ),
        ] {
            let e = format!("{:#}", Fault::parse(s).unwrap_err());
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
