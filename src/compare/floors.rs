//! Tolerance floors: how much relative L2 error a correct engine may show at each hook, from the
//! precision of both sides, the step's kind, its reduction length and the weight's quant type.
//!
//! # The formula
//! For a hook produced by a step of kind `k` (table in [`Kind::shape`]):
//!
//! ```text
//! floor = SAFETY * ( sqrt(n_k) * amp_k * u_store  +  u_acc * sqrt(K) )
//! ```
//!
//! - `u_store`: unit roundoff of the coarser storage precision of the two sides (f64 2^-53,
//!   f32 2^-24, f16 2^-11, bf16 2^-8, fp8 e4m3 2^-4). Rounding one tensor to nearest gives a
//!   relative L2 error of about `u/sqrt(3)` to `u`; a step that rounds `n_k` tensors (inputs,
//!   weights, intermediates, output) with independent errors adds them in quadrature: `sqrt(n_k)`.
//! - `amp_k`: how much the step's arithmetic amplifies relative errors of what it rounds: 1 for
//!   norms, projections, adds and RoPE (cos/sin are rounded like any other input: counted in
//!   `n_k`); 1.5 for attention (a logit error `e * |logit|` moves the softmax by about that
//!   much; logits `q.k / sqrt(d)` are O(1), and rows where the probability concentrates on a few
//!   keys pass errors on with little averaging); 2 for the DSA index score (a sum over heads of
//!   `w_h ReLU(q.k)` with weights of both signs cancels, so its relative error is larger than
//!   its terms').
//!
//!   Measured on real bf16 engines (transformers on an H200 and on the CPU, 24 clean dumps of
//!   `fixtures/engines/`), the replay error per unit roundoff is at most about 1.0 `u` for
//!   norms, projections and the embedding, 1.3 `u` for attention, 1.4 `u` for the index
//!   scores and 2.4 `u` for the experts (three projections and a SwiGLU): each floor sits 7-15x
//!   above that (the separation table of docs/comparing.md; `tests/engines.rs` prints it).
//! - `u_acc * sqrt(K)`: accumulation of `K` products in the accumulator precision (f32 for every
//!   low-precision engine, f64 for the reference): recursive summation of random-sign terms
//!   grows the relative error like `u * sqrt(K)` (blocked and pairwise sums, as cuBLAS does, are
//!   smaller, so this is an upper estimate).
//! - quant type: a candidate that quantizes activations to 8 bits per 32-value block when it
//!   multiplies a block-quantized weight, as llama.cpp's CUDA `mmq`/`mmvq` do (`q8_1`), says so
//!   in its dtype (`q8` anywhere in it, e.g. `f16, q8_1 activations`): the steps that multiply a
//!   quantized weight then get `u_store` of at least [`U_Q8_ACTIVATIONS`]. Engines that
//!   dequantize the weights and multiply in bf16 (transformers, vLLM's dequant path) get no quant
//!   term: dequantization itself is exact (bit-exact dequant is checked separately).
//! - `SAFETY = 4`: the estimates above are RMS-like; 4 keeps a correct engine's replay error
//!   under the floor with margin while an O(1e-1..1) layout bug stays far above it.
//!
//! In chained mode a hook also carries its inputs' accumulated error: it may show
//! `floor + CHAIN_AMP_k * max(chained error of its inputs)` ([`Kind::chain_amp`]) before it
//! counts as a jump.
//!
//! # Segments
//! A trace that lacks some hooks (a serving engine fuses RoPE into attention, the router into
//! one kernel) is replayed across them: the reference runs from the trace's nearest hooks
//! through the steps whose outputs the trace lacks to the next hook it has, and that *segment*
//! is judged as one. Its floor is composed from its steps ([`segment_floor`]), step by step in
//! the order they run, each hook inside the segment carrying the relative error `F` a correct
//! engine may have reached there (hooks taken from the trace carry none: both sides read the
//! same values):
//!
//! ```text
//! F(out)   = sqrt( floor(out)^2 + (max over inputs of gain_k(in) * F(in))^2 )
//! F(a + b) = sqrt( floor^2 + ((F(a) |a|)^2 + (F(b) |b|)^2) / |a + b|^2 )
//! ```
//!
//! - The step's own rounding is independent of what its inputs carry, so the two add in
//!   quadrature, as the roundings inside one step do in the floor itself; every term keeps the
//!   floors' `SAFETY`, so the sum does too.
//! - A step's inputs inside a segment mostly share their ancestry (attention reads `q_b` and
//!   the `q_pe_rope` made from it, SwiGLU a gate and an up projection of the same norm), so
//!   their errors are correlated: the largest one is carried on, as in the chained rule, not
//!   their sum in quadrature (which would count the shared part twice).
//! - `gain_k` ([`Kind::gain`]) is how much a relative error of the step's inputs shows in its
//!   output: a typical size, where [`Kind::chain_amp`] bounds what a drifting run may pass on.
//!   Measured on the 24 clean bf16 dumps of `fixtures/engines/` as the chained error of a hook
//!   over the largest chained error of its inputs (where that is at least 3x the hook's own
//!   replay error), median (largest): norms, projections and RoPE 1.0 (1.3), attention 1.6
//!   (3.9), the DSA index scores 1.7 (1.9), SwiGLU 1.6 (2.2), the shared expert 1.3 (2.6), the
//!   routed experts 2.2 (3.4), router probabilities 0.5 (0.8) and weights 0.2 (2.0), adds 0.7
//!   (1.0). The gains are 1 for norms, projections, RoPE and the router, 2 for attention, the
//!   index scores, SwiGLU and the shared expert, 2.5 for the routed experts (from their input;
//!   1 from their routing weights, which scale the experts' outputs linearly); 0 for selections
//!   (ids carry no float error; a selection that flips is handled apart, by its near-tie
//!   alternatives). The median, not the largest: the SAFETY of every floor in the sum covers
//!   the spread, and the clean dumps stay as far under the composed floors as under the
//!   floors of single steps (`tests/hook_subsets.rs` prints both).
//! - A residual add weighs its inputs' errors by their sizes (`|a|`, the L2 norm of the
//!   reference's value): a branch's error is diluted by the residual stream it joins, which is
//!   what a layer output shows.

use std::collections::HashMap;

use serde::Serialize;

use crate::model::steps::{Op, Step};
use crate::model::{names, Weights};
pub use crate::precision::{Dtype, Precision};

/// In replay a hook also fails when one token's relative error is above `TOKEN_FACTOR` times
/// the floor: a bug that touches few tokens (two swapped experts of 256 are used by a few
/// percent of the tokens) hardly moves the tensor's relative L2 but is O(1) on its tokens. One
/// row holds far fewer values than the tensor, so its rounding error fluctuates more: measured on
/// the clean bf16 dumps, the worst token reaches 0.32 of the floor where the whole tensor reaches
/// 0.14; 3 keeps the same 10x margin as the tensor criterion. A row far smaller than the
/// tensor's typical row (a sum that cancelled) is judged against [`super::metrics::SMALL_ROW`]
/// of that typical row.
pub const TOKEN_FACTOR: f64 = 3.0;

/// Safety factor over the estimated error (module documentation).
pub const SAFETY: f64 = 4.0;

/// Effective unit roundoff of 8-bit block activation quantization (`q8_1`: 32 values share
/// `scale = max|x| / 127`; the error is uniform in `±scale/2`, RMS `scale/sqrt(12)`; for
/// Gaussian blocks `max|x| ≈ 2.5 σ`, so the relative RMS error is `2.5 / 127 / sqrt(12) ≈ 5.7e-3`).
pub const U_Q8_ACTIVATIONS: f64 = 5.7e-3;

/// K used when a hook's reduction length is unknown (a trace compared without its model):
/// GLM-5's hidden size, rounded up.
pub const DEFAULT_K: usize = 8192;

/// What kind of step produced a hook (it decides the floor's shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Embedding rows (a gather of dequantized rows).
    Embed,
    /// RMSNorm.
    Norm,
    /// A projection `x W^T`.
    Linear,
    /// RoPE.
    Rope,
    /// DSA index scores.
    IndexerScores,
    /// A selection of indices (DSA keys, routed experts): compared as sets.
    Selection,
    /// MLA attention (heads or probabilities).
    Attention,
    /// `silu(a) * b`.
    SwiGlu,
    /// A residual add.
    Add,
    /// Router probabilities.
    RouterProbs,
    /// Router weights of the selected experts.
    RouterWeights,
    /// Routed experts (three projections and a SwiGLU per expert, weighted sum).
    Experts,
    /// The shared expert (three projections and a SwiGLU).
    Mlp,
    /// Zeros (no shared expert).
    Zeros,
}

impl Kind {
    /// `(n_k, amp_k)`: tensors rounded and error amplification (module documentation).
    pub fn shape(self) -> (f64, f64) {
        match self {
            Kind::Embed => (1.0, 1.0),
            Kind::Norm | Kind::Linear | Kind::Add | Kind::RouterWeights => (3.0, 1.0),
            Kind::Rope => (3.0, 1.0),
            Kind::IndexerScores => (6.0, 2.0),
            Kind::Attention => (6.0, 1.5),
            Kind::SwiGlu => (4.0, 1.0),
            Kind::RouterProbs => (2.0, 1.0),
            // Three projections (3 roundings each) and a SwiGLU.
            Kind::Experts | Kind::Mlp => (10.0, 1.0),
            Kind::Selection | Kind::Zeros => (1.0, 1.0),
        }
    }

    /// How much of its inputs' accumulated (chained) relative error a step may pass on
    /// amplified: 4 for most steps (norms and projections of random-like data keep a relative
    /// error about constant; residual adds with partial cancellation and SwiGLU's gate raise it
    /// by small factors), 16 where a softmax or a sigmoid turns logit errors into output errors
    /// scaled by the logits' magnitude.
    pub fn chain_amp(self) -> f64 {
        match self {
            Kind::Attention | Kind::IndexerScores | Kind::RouterProbs | Kind::RouterWeights => 16.0,
            _ => 4.0,
        }
    }

    /// How much a relative error of the step's inputs shows in its output, inside a segment
    /// (module documentation, Segments). Adds are composed by size ([`segment_floor`]).
    pub fn gain(self) -> f64 {
        match self {
            Kind::Embed | Kind::Selection | Kind::Zeros => 0.0,
            Kind::Norm
            | Kind::Linear
            | Kind::Rope
            | Kind::Add
            | Kind::RouterProbs
            | Kind::RouterWeights => 1.0,
            Kind::Attention | Kind::IndexerScores | Kind::SwiGlu | Kind::Mlp => 2.0,
            Kind::Experts => 2.5,
        }
    }

    /// [`Kind::gain`] of the input whose point is `input`: the routed experts pass on the
    /// error of their routing weights (`moe_weights`) once, as the factors of their sum.
    pub fn gain_from(self, input: &str) -> f64 {
        match (self, input) {
            (Kind::Experts, "moe_weights") => 1.0,
            _ => self.gain(),
        }
    }

    /// The kind of a hook from its point name alone (`blk.L.<point>` or a global name).
    pub fn of_point(point: &str) -> Kind {
        match point {
            "token_embd" => Kind::Embed,
            "attn_norm" | "q_a_norm" | "kv_a_norm" | "ffn_norm" | "result_norm" => Kind::Norm,
            "q_pe_rope" | "k_pe_rope" => Kind::Rope,
            "indexer_scores" => Kind::IndexerScores,
            "indexer_topk" | "moe_topk_ids" => Kind::Selection,
            "attn_heads" | "attn_probs" => Kind::Attention,
            "ffn_act" => Kind::SwiGlu,
            "ffn_inp" | "l_out" => Kind::Add,
            "moe_probs" => Kind::RouterProbs,
            "moe_weights" => Kind::RouterWeights,
            "moe_routed" => Kind::Experts,
            "ffn_shexp" => Kind::Mlp,
            p if p.starts_with("exp.") => Kind::Experts,
            // q_a, q_b, kv_a, attn_out, ffn_gate, ffn_up, moe_logits, ffn_out, logits, and
            // anything new: a projection.
            _ => Kind::Linear,
        }
    }
}

/// What the floor of one hook depends on besides the precisions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HookInfo {
    /// The step kind.
    pub kind: Kind,
    /// Reduction length (`None`: no sum, or unknown).
    pub k: Option<usize>,
    /// The step multiplies a block-quantized weight.
    pub quantized: bool,
}

impl HookInfo {
    /// From the point name alone (no model at hand): projections and sums get [`DEFAULT_K`].
    pub fn from_point(point: &str) -> HookInfo {
        let kind = Kind::of_point(point);
        let k = match kind {
            Kind::Embed | Kind::Selection | Kind::Zeros | Kind::Add | Kind::SwiGlu => None,
            _ => Some(DEFAULT_K),
        };
        HookInfo {
            kind,
            k,
            quantized: false,
        }
    }
}

/// The point of a hook name: `blk.3.q_b` -> `q_b`, `logits` -> `logits`.
pub fn point_of(name: &str) -> &str {
    names::split_blk(name).map_or(name, |(_, p)| p)
}

/// The floor of a hook (module documentation).
pub fn floor(info: &HookInfo, reference: Precision, candidate: Precision) -> f64 {
    let mut u = reference
        .storage
        .unit_roundoff()
        .max(candidate.storage.unit_roundoff());
    if info.quantized && candidate.q8_activations {
        u = u.max(U_Q8_ACTIVATIONS);
    }
    let u_acc = reference
        .accumulate
        .unit_roundoff()
        .max(candidate.accumulate.unit_roundoff());
    let (n, amp) = info.kind.shape();
    let k = info.k.unwrap_or(0) as f64;
    SAFETY * (n.sqrt() * amp * u + u_acc * k.sqrt())
}

/// What an input of a step inside a segment carries: the relative error a correct engine may
/// have reached there, and the L2 norm of the reference's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Carried {
    /// Relative L2 error allowed (0 for a hook taken from the trace).
    pub rel: f64,
    /// `|value|` (L2 over the whole tensor).
    pub norm: f64,
    /// How much of it the step passes on ([`Kind::gain_from`]; adds weigh by size instead).
    pub gain: f64,
}

/// The floor of a step's output inside a segment (module documentation, Segments): the
/// step's own `floor` and what its `inputs` carry, of a step of `kind` whose output has L2
/// norm `out_norm`.
pub fn segment_floor(kind: Kind, floor: f64, inputs: &[Carried], out_norm: f64) -> f64 {
    let carried = if kind == Kind::Add && out_norm > 0.0 {
        let sum: f64 = inputs.iter().map(|c| (c.rel * c.norm).powi(2)).sum();
        sum.sqrt() / out_norm
    } else {
        inputs.iter().map(|c| c.gain * c.rel).fold(0.0, f64::max)
    };
    (floor * floor + carried * carried).sqrt()
}

/// [`HookInfo`] of every hook a plan's steps produce (extras included), with reduction lengths
/// and quant types read from the model. Weights that cannot be read fall back to
/// [`HookInfo::from_point`].
pub fn hook_infos(steps: &[Step], weights: &Weights<'_>) -> HashMap<String, HookInfo> {
    let hp = weights.hparams();
    let quantized = |name: &str| {
        weights
            .model()
            .find(name)
            .is_some_and(|t| t.info.ty.block_size() > 1)
    };
    // A projection: its reduction length and quant type are its matrix's.
    let linear = |info: &mut HookInfo, weight: &str| {
        info.kind = Kind::Linear;
        info.k = weights.matrix_dims(weight).ok().map(|(_, c)| c);
        info.quantized = quantized(weight);
    };
    let mut out = HashMap::new();
    for s in steps {
        for o in &s.outputs {
            let mut info = HookInfo::from_point(point_of(o));
            match &s.op {
                Op::Linear { weight } => linear(&mut info, weight),
                Op::RouterLogits { layer } => {
                    linear(&mut info, &names::blk(*layer, names::blk::FFN_GATE_INP));
                }
                Op::RmsNorm { cols, .. } => {
                    info.k = Some(cols.as_ref().map_or(hp.hidden, |c| c.len()));
                }
                Op::Add => {
                    info.kind = Kind::Add;
                    info.k = None;
                }
                Op::ZerosLike => info.kind = Kind::Zeros,
                Op::Attention { layer } => {
                    info.k = Some(hp.qk_head().max(hp.kv_lora_rank));
                    info.quantized = quantized(&names::blk(*layer, names::blk::ATTN_K_B))
                        || quantized(&names::blk(*layer, names::blk::ATTN_KV_B));
                    out.insert(
                        crate::model::steps::hook(*layer, crate::model::steps::point::ATTN_PROBS),
                        info,
                    );
                }
                Op::IndexerScores { .. } => {
                    let ix = hp.indexer.as_ref().map_or(0, |i| i.head_dim);
                    info.k = Some(hp.hidden.max(hp.q_lora_rank.unwrap_or(0)).max(ix));
                }
                Op::MoeExperts { layer } => {
                    info.k = Some(hp.hidden.max(hp.n_ff_exp));
                    info.quantized = quantized(&names::blk(*layer, names::blk::FFN_DOWN_EXPS));
                    for e in 0..hp.n_expert {
                        out.insert(crate::model::steps::expert_hook(*layer, e), info);
                    }
                }
                Op::Mlp { down, .. } => {
                    info.k = Some(hp.hidden.max(hp.n_ff_exp * hp.n_expert_shared.max(1)));
                    info.quantized = quantized(down);
                }
                Op::MoeRoute { .. } => info.k = Some(hp.n_expert),
                _ => {}
            }
            out.insert(o.clone(), info);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_by_hand() {
        // A bf16 projection of K = 4096 against the f32/f64 reference, unquantized weight:
        // 4 * (sqrt(3) * 1 * 2^-8 + 2^-24 * 64) = 4 * (6.766e-3 + 3.815e-6) = 2.708e-2.
        let info = HookInfo {
            kind: Kind::Linear,
            k: Some(4096),
            quantized: false,
        };
        let cpu = Precision::parse("f32 storage, f64 accumulation").unwrap();
        let bf16 = Precision::parse("bf16").unwrap();
        let want = 4.0 * (3f64.sqrt() * 2f64.powi(-8) + 2f64.powi(-24) * 64.0);
        assert!((floor(&info, cpu, bf16) - want).abs() < 1e-15);
        // Quantized weight: no change for a bf16 engine; 8-bit activations declared: u = 5.7e-3.
        let q = HookInfo {
            quantized: true,
            ..info
        };
        assert_eq!(floor(&q, cpu, bf16), floor(&info, cpu, bf16));
        let q8 = Precision::parse("f16, q8_1 activations for quantized weights").unwrap();
        assert!(q8.q8_activations && !bf16.q8_activations);
        let want_q = 4.0 * (3f64.sqrt() * 5.7e-3 + 2f64.powi(-24) * 64.0);
        assert!((floor(&q, cpu, q8) - want_q).abs() < 1e-15);
        // An f32 candidate gets no quant term: 4 * (sqrt(3) * 2^-24 + 2^-24 * 64).
        let f32p = Precision::parse("f32").unwrap();
        let want_f = 4.0 * (3f64.sqrt() + 64.0) * 2f64.powi(-24);
        assert!((floor(&q, cpu, f32p) - want_f).abs() < 1e-20);
    }

    /// The router-logits step gets a projection's floor inputs: those of a plain projection
    /// by the same matrix (kind, reduction length over the hidden size, the matrix's quant type).
    #[test]
    fn router_logits_floor_is_its_matrix_projections() {
        use crate::model::steps::layer_steps;
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for f in [
            "fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "fixtures/models/dsv3-tiny/dsv3-tiny-f32.gguf",
        ] {
            let m = crate::gguf::Model::open(&root.join(f)).unwrap();
            let w = Weights::new(&m).unwrap();
            let hp = w.hparams();
            let l = (0..hp.n_layer).find(|&l| !hp.is_dense(l)).unwrap();
            let steps = layer_steps(hp, l);
            let router = steps
                .iter()
                .find(|s| s.op == Op::RouterLogits { layer: l })
                .unwrap();
            let as_linear = Step {
                op: Op::Linear {
                    weight: names::blk(l, names::blk::FFN_GATE_INP),
                },
                ..router.clone()
            };
            let hook = &router.outputs[0];
            let got = hook_infos(std::slice::from_ref(router), &w)[hook];
            assert_eq!(got, hook_infos(&[as_linear], &w)[hook], "{f}");
            assert_eq!((got.kind, got.k), (Kind::Linear, Some(hp.hidden)), "{f}");
        }
    }

    #[test]
    fn segment_floors_by_hand() {
        let c = |rel: f64, norm: f64, gain: f64| Carried { rel, norm, gain };
        // A projection of an input carrying 0.03: sqrt(0.04^2 + 0.03^2) = 0.05.
        let f = segment_floor(Kind::Linear, 0.04, &[c(0.03, 1.0, 1.0)], 1.0);
        assert!((f - 0.05).abs() < 1e-12);
        // The largest input, by its gain: max(0.03 * 1, 0.02 * 2) = 0.04 -> sqrt(0.03^2 + 0.04^2).
        let f = segment_floor(
            Kind::Attention,
            0.03,
            &[c(0.03, 1.0, 1.0), c(0.02, 1.0, 2.0)],
            1.0,
        );
        assert!((f - 0.05).abs() < 1e-12);
        // An add weighs by size: a carries 0.1 at |a| = 3, b (from the trace) nothing, |a + b| =
        // 5: 0.1 * 3 / 5 = 0.06, with its own 0.08: 0.1.
        let f = segment_floor(Kind::Add, 0.08, &[c(0.1, 3.0, 1.0), c(0.0, 4.0, 1.0)], 5.0);
        assert!((f - 0.1).abs() < 1e-12);
        // Nothing carried: the step's own floor.
        assert_eq!(segment_floor(Kind::Norm, 0.027, &[], 1.0), 0.027);
        // The experts pass on their routing weights' error once, their input's 2.5 times.
        assert_eq!(Kind::Experts.gain_from("moe_weights"), 1.0);
        assert_eq!(Kind::Experts.gain_from("ffn_norm"), 2.5);
        assert_eq!(Kind::Selection.gain(), 0.0);
    }

    #[test]
    fn kinds_from_point_names() {
        assert_eq!(Kind::of_point("q_b"), Kind::Linear);
        assert_eq!(Kind::of_point("exp.3.out"), Kind::Experts);
        assert_eq!(Kind::of_point("indexer_topk"), Kind::Selection);
        assert_eq!(point_of("blk.12.attn_heads"), "attn_heads");
        assert_eq!(point_of("logits"), "logits");
    }
}
