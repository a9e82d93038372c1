//! Tolerance floors: how much relative L2 error a correct engine may show at each hook, from the
//! precision of both sides, the step's kind, its reduction length and the weight's quant type.
//!
//! # The formula
//! For a hook produced by a step of kind `k` (table in [`Kind::shape`]):
//!
//! ```text
//! floor = min( MAX_FLOOR,
//!              SAFETY * ( amp_k * sqrt( m_k * u_op^2 + (n_k - m_k) * u_store^2 )  +  u_acc * sqrt(K) ) )
//! ```
//!
//! - `u_store`: unit roundoff of the coarser storage precision of the two sides (f64 2^-53,
//!   f32 2^-24, f16 2^-11, bf16 2^-8). Rounding one tensor to nearest gives a
//!   relative L2 error of about `u/sqrt(3)` to `u`; a step that rounds `n_k` tensors (inputs,
//!   weights, intermediates, output) with independent errors adds them in quadrature.
//! - `u_op`: of those, the `m_k` operands of the step's matrix products ([`Kind::operands`]:
//!   the input and the matrix of a projection, q and k of the index scores, ...) are rounded
//!   to the precision's operand format when it is coarser than storage (`Precision::operands`):
//!   tf32 (tensor cores on f32 data: 10-bit mantissa, `u = 2^-11`, sums in f32) or fp8 e4m3
//!   (`u = 2^-4`; FP8 GEMMs and FP8 indexers, outputs in bf16 or f32). Otherwise
//!   `u_op = u_store`, and the formula is `sqrt(n_k) * amp_k * u_store`.
//! - The router (`moe_logits`, `moe_probs`, `moe_weights`) of a side whose precision has a
//!   router finer than its storage (`Precision::router`: the CUDA engine's bf16 mode keeps it
//!   in f32 by the rule of `Engine::router_logits`; transformers in bf16 computes it in f32 from
//!   its bf16 matrix) is judged at that precision: `u_store = u_op` of its compute format, and
//!   the router matrix (one of the logits' two operands) at its matrix format.
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
//!   quantized weight then get `u_store` of at least [`U_Q8_ACTIVATIONS`]. A step with several
//!   matrices counts each product at its own precision ([`HookInfo::q8_split`]): an expert's
//!   gate, up and down projections each bring two operand roundings (input, matrix) and one
//!   output rounding at 8 bits when their matrix is quantized, the others staying at the
//!   products' format; the index score's q, k and head weights each come out of their own matrix
//!   (`indexer.attn_q_b`, `indexer.attn_k`, `indexer.proj`). llama-quantize leaves a matrix whose
//!   rows do not fill its blocks in F16, so a Q8_0 or Q4_K_M file mixes both inside one step
//!   (`fixtures/llama-quant/`: 8-bit `attn_k` and `proj` with an F16 `attn_q_b` score 7.1e-3 to
//!   7.4e-3 at `indexer_scores`, against 6.5e-2 composed; the experts 8.6e-3 against 5.6e-2). Engines that
//!   dequantize the weights and multiply in bf16 (transformers, vLLM's dequant path) get no quant
//!   term: dequantization itself is exact (bit-exact dequant is checked separately).
//! - `SAFETY = 4`: the estimates above are RMS-like; 4 keeps a correct engine's replay error
//!   under the floor with margin while an O(1e-1..1) layout bug stays far above it.
//! - [`MAX_FLOOR`] caps the result: a floor must stay well below what a layout bug scores
//!   (reasoning at the constant); it binds only for fp8 operands.
//!
//! # RoPE angles
//! A step that turns RoPE angles (a RoPE step; the DSA index score, which rotates its q and k
//! inside) carries the rounding of the angles themselves: an engine computes `theta = t * f`
//! (position times frequency) in f32 (ggml's rope cache, transformers' and vLLM's cos/sin
//! caches; the reference in f64), and an angle rounded by a relative `u` turns the pair by
//! `theta * u`: an error that grows with the position, shared by every head at a position (the
//! RoPE tables) and, through the one rotated key head, by every query that reads that key. It
//! adds `n * (u_angle / sqrt(3) * theta_rms)^2` under the square root, `theta_rms` the RMS
//! angle over the prompt's positions and the step's frequencies (the model's; 1 rad/position,
//! the fastest pair's, without the model), `n` the tensors rotated (1, or q and k), `u_angle`
//! each side's accumulation precision, at most f32's. llama.cpp's CPU backend on the
//! converter's F32 GLM-5 file at 4096 tokens: the index score's error grows from 8e-7 (first
//! 512 positions) to 3.6e-6 (last 512), its whole-tensor error 2.97e-6 against a floor of
//! 3.08e-6 without this term (a token at position 3489 at 4x the floor); with it the floor is
//! 3.3e-4, the index score's other roundings and its cancellation (`amp = 2`) counted as
//! before, and every pair's angle taken as rounded (the fastest pair's, `t * 1`, is exact in
//! f32). For bf16 engines the term stays beneath their own rounding until about 64K
//! positions.
//!
//! # The FP8 indexer
//! An FP8 DSA indexer (`--precision 'blk.*.indexer_*=fp8'`, trace metadata `indexer_dtype:
//! fp8`; DeepSeek's `fp8_mqa_logits`) rounds q and k to e4m3 with a scale per row (`amax /
//! 448`) and computes everything else as the engine does: `m = 2` of the index score's `n = 6`
//! roundings at fp8, the other four at bf16. What that rounding does to the scores:
//!
//! - with a scale per row every value is a normal e4m3 number, so its relative error is
//!   uniform within half a spacing, `2^-4` of the binade's bottom: over mantissas spread
//!   log-uniformly in a binade its RMS is `2^-4 / sqrt(3) * sqrt(E[1/t^2]) = 0.036 * 0.736 =
//!   0.027` (`t` in [1, 2));
//! - `q . k` sums products of two independently rounded factors: the product matrix carries
//!   `sqrt(2) * 0.027 = 0.038` relative L2; the ReLU and the head-weighted sum keep it about
//!   there (measured on the committed fp8idx dumps: 0.033 to 0.040 at `indexer_scores`, the
//!   bf16 roundings adding `sqrt(4) * 2^-8 = 0.008` in quadrature);
//! - the formula above, with the unit roundoff as its bound and the index score's `amp = 2` and
//!   `SAFETY = 4`, gives `4 * 2 * sqrt(2 * 2^-8 + 4 * 2^-16) = 0.71`: above the error of a real
//!   indexer bug (half-split RoPE in the indexer: 0.29 to 0.44 at `indexer_scores` on the
//!   fixture models, `--inject indexer_rope_neox`). FP8's own error (0.038) is within 8x of that
//!   bug, so the usual 4x safety times 2x amplification cannot hold on both sides: the floor is
//!   [`MAX_FLOOR`] = 0.1, 2.6x over FP8's estimated error (2.5x to 3x over the measured one)
//!   and 2.9x under the bug.
//!
//! The flips of an FP8 indexer's selection are judged with the uncapped estimate as the score's
//! relative tolerance ([`flip_tolerance`], module `selection`): one score gap moves by about the
//! precision's own per-value error, not by a whole tensor's relative L2. The largest margin of a
//! near-tie flip in the committed fp8idx dumps is 0.086 of the row's RMS score with the scores
//! dumped, 0.13 where the dump lacks them and the reference scores in bf16 from the dump's inputs.
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

/// The largest floor a hook gets from precision (a `--tol` may set any): a floor must stay
/// well below what a layout bug scores there. An output unrelated to the reference's, of the
/// same norm, scores `sqrt(2)` (orthogonal) to about 1; a weight from the wrong layer 1.4, `kv_b`
/// split the wrong way 1.3, two swapped experts of eight 0.5; the subtlest bug measured, the DSA
/// indexer's RoPE half-split instead of interleaved, touches only the RoPE part of q and k and
/// scores 0.29 at `indexer_scores` (fixture models). 0.1 keeps every floor 3x under that; it
/// binds only where the formula reaches it, fp8 operands (an FP8 indexer: module
/// documentation; FP8 projections: `4 * sqrt(2 * 2^-8 + 2^-16) = 0.36` uncapped), whose own
/// error (0.04 per rounded product) then still sits 2.5x under the cap. bf16 floors stay at or
/// under 0.077, f16's and q8_1's under 0.08.
pub const MAX_FLOOR: f64 = 0.1;

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

    /// `m_k`: how many of the `n_k` roundings are operands of matrix products (rounded to an
    /// operand format such as tf32 or fp8 where the engine uses one): a projection's input and
    /// matrix; q and k of the index scores (the FP8 indexer's two); attention's queries, keys,
    /// probabilities and values; the three projections' inputs and matrices of an expert; none
    /// for norms, adds, RoPE, SwiGLU and the router's gating.
    pub fn operands(self) -> f64 {
        match self {
            Kind::Linear | Kind::IndexerScores => 2.0,
            Kind::Attention => 4.0,
            Kind::Experts | Kind::Mlp => 6.0,
            _ => 0.0,
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

    /// Whether the step rotates by RoPE angles it computes: a RoPE step, and the DSA index
    /// score (q and k rotated inside it).
    pub fn turns_rope(self) -> bool {
        matches!(self, Kind::Rope | Kind::IndexerScores)
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
    /// Where only some of the step's products multiply a block-quantized weight (the DSA index
    /// score: `q` from `indexer.attn_q_b`, `k` from `indexer.attn_k`, the head weights from
    /// `indexer.proj`): how many of its operand and of its other roundings come out of such a
    /// product, `(operands, stored)`. `None`: every rounding does when [`Self::quantized`]
    /// (a step with one matrix).
    pub q8_split: Option<(u8, u8)>,
    /// The hook is the router's (`moe_logits`, `moe_probs`, `moe_weights`): judged at the
    /// router's precision where a side has one (module documentation).
    pub router: bool,
    /// Where the step turns RoPE angles (a RoPE step; the DSA index score, which rotates its q
    /// and k inside): the RMS of its frequencies in radians per position (module
    /// documentation, RoPE angles). `None`: no rotation.
    pub rope_freq_rms: Option<f64>,
    /// Positions of the prompt (the judge's), for the RoPE angles' term; 0 when unknown.
    pub positions: usize,
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
            q8_split: None,
            router: matches!(point, "moe_logits" | "moe_probs" | "moe_weights"),
            // Without the model: every pair turning as fast as the fastest (1 rad/position).
            rope_freq_rms: kind.turns_rope().then_some(1.0),
            positions: 0,
        }
    }
}

/// The point of a hook name: `blk.3.q_b` -> `q_b`, `logits` -> `logits`.
pub fn point_of(name: &str) -> &str {
    names::split_blk(name).map_or(name, |(_, p)| p)
}

/// The floor of a hook (module documentation).
pub fn floor(info: &HookInfo, reference: Precision, candidate: Precision) -> f64 {
    estimate(info, reference, candidate).min(MAX_FLOOR)
}

/// The error a correct engine may show at a hook before [`MAX_FLOOR`] caps it: the relative
/// tolerance of the scores behind a selection's flips. The cap is for whole tensors, where a
/// layout bug scores O(0.3..1); a flip is decided by one score gap, whose share of a row's RMS
/// score the precision's rounding moves by its own estimate (an FP8 indexer's q and k: 0.71 of
/// the row's RMS, uncapped, where the capped 0.1 calls the near ties of correct FP8 indexers
/// confident, as dumps without their index scores show: margins to 0.13 of the row's RMS).
pub fn flip_tolerance(info: &HookInfo, reference: Precision, candidate: Precision) -> f64 {
    estimate(info, reference, candidate)
}

/// The floor formula without its cap.
fn estimate(info: &HookInfo, reference: Precision, candidate: Precision) -> f64 {
    // (u_store, u_op, u_matrix) of one side at this hook.
    let side = |p: Precision| -> (f64, f64, f64) {
        match p.router.filter(|_| info.router) {
            Some(r) => {
                let u = r.compute.unit_roundoff();
                (u, u, r.matrix.unit_roundoff().max(u))
            }
            None => {
                let s = p.storage.unit_roundoff();
                let o = p.operands.map_or(s, |o| o.unit_roundoff().max(s));
                (s, o, o)
            }
        }
    };
    let (r, c) = (side(reference), side(candidate));
    let (mut u_store, mut u_op, mut u_matrix) = (r.0.max(c.0), r.1.max(c.1), r.2.max(c.2));
    // Of the operand and the other roundings, how many come out of a product with 8-bit
    // activations (module documentation, quant type); a step with one matrix has all of them.
    let (mut q8_op, mut q8_store) = (0.0, 0.0);
    if info.quantized && candidate.q8_activations {
        match info.q8_split {
            None => {
                u_store = u_store.max(U_Q8_ACTIVATIONS);
                u_op = u_op.max(U_Q8_ACTIVATIONS);
                u_matrix = u_matrix.max(U_Q8_ACTIVATIONS);
            }
            Some((o, s)) => (q8_op, q8_store) = (f64::from(o), f64::from(s)),
        }
    }
    let u_acc = reference
        .accumulate
        .unit_roundoff()
        .max(candidate.accumulate.unit_roundoff());
    let (n, amp) = info.kind.shape();
    let m = info.kind.operands().min(n);
    // A projection's matrix is one of its two operands.
    let w = if info.kind == Kind::Linear { 1.0 } else { 0.0 };
    let (q8_op, q8_store) = (q8_op.min(m - w), q8_store.min(n - m));
    let q8 = |u: f64| u.max(U_Q8_ACTIVATIONS).powi(2);
    let sum = w * u_matrix * u_matrix
        + (m - w - q8_op) * u_op * u_op
        + q8_op * q8(u_op)
        + (n - m - q8_store) * u_store * u_store
        + q8_store * q8(u_store);
    let k = info.k.unwrap_or(0) as f64;
    let sum = sum + rope_angles(info, reference, candidate);
    SAFETY * (amp * sum.sqrt() + u_acc * k.sqrt())
}

/// The squared relative error that rounding the RoPE angles leaves in a step that turns them
/// (module documentation, RoPE angles): `n * (u_angle / sqrt(3) * theta_rms)^2`, `n` the
/// tensors rotated (q and k in the index score), `theta_rms` the RMS angle over the prompt's
/// positions and the step's frequencies, `u_angle` the coarser of the two sides' angle
/// precisions (each side's accumulation precision, at most f32's: engines compute angles in f32
/// or finer whatever they store).
fn rope_angles(info: &HookInfo, reference: Precision, candidate: Precision) -> f64 {
    let Some(f) = info.rope_freq_rms.filter(|_| info.positions > 1) else {
        return 0.0;
    };
    let angle = |p: Precision| p.accumulate.unit_roundoff().min(Dtype::F32.unit_roundoff());
    let u = angle(reference).max(angle(candidate));
    // RMS of t over positions 0..T: sqrt((T - 1)(2T - 1) / 6).
    let t = info.positions as f64;
    let theta_rms = f * ((t - 1.0) * (2.0 * t - 1.0) / 6.0).sqrt();
    let n = if info.kind == Kind::IndexerScores {
        2.0
    } else {
        1.0
    };
    n * (u / 3f64.sqrt() * theta_rms).powi(2)
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

/// The quant split of a step of three projections (gate, up, down: the experts, the shared
/// expert), `quantized[i]` whether the i-th multiplies a block-quantized matrix: each such
/// projection's input and matrix (two operands) and output (one other rounding) at the
/// activations' 8 bits, as a one-matrix step has all three ([`HookInfo::q8_split`]).
fn three_products(info: &mut HookInfo, quantized: [bool; 3]) {
    let n = quantized.iter().filter(|&&q| q).count() as u8;
    info.quantized = n > 0;
    info.q8_split = Some((2 * n, n));
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
    // The RMS of the model's RoPE frequencies (radians per position).
    let freqs = crate::model::rope::inv_freq(&hp.rope);
    let freq_rms = (!freqs.is_empty())
        .then(|| (freqs.iter().map(|f| f * f).sum::<f64>() / freqs.len() as f64).sqrt());
    let mut out = HashMap::new();
    for s in steps {
        for o in &s.outputs {
            let mut info = HookInfo::from_point(point_of(o));
            if info.kind.turns_rope() {
                info.rope_freq_rms = freq_rms.or(info.rope_freq_rms);
            }
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
                Op::IndexerScores { layer } => {
                    let ix = hp.indexer.as_ref().map_or(0, |i| i.head_dim);
                    info.k = Some(hp.hidden.max(hp.q_lora_rank.unwrap_or(0)).max(ix));
                    // q and k (the score product's operands) and the head weights (one of the
                    // other roundings), each the output of its own matrix.
                    let q8 = |w: &str| u8::from(quantized(&names::blk(*layer, w)));
                    let operands = q8(names::blk::INDEXER_Q_B) + q8(names::blk::INDEXER_K);
                    let stored = q8(names::blk::INDEXER_PROJ);
                    info.quantized = operands + stored > 0;
                    info.q8_split = Some((operands, stored));
                }
                Op::MoeExperts { layer } => {
                    info.k = Some(hp.hidden.max(hp.n_ff_exp));
                    let w = |n: &str| names::blk(*layer, n);
                    let fused = quantized(&w(names::blk::FFN_GATE_UP_EXPS));
                    three_products(
                        &mut info,
                        [
                            fused || quantized(&w(names::blk::FFN_GATE_EXPS)),
                            fused || quantized(&w(names::blk::FFN_UP_EXPS)),
                            quantized(&w(names::blk::FFN_DOWN_EXPS)),
                        ],
                    );
                    for e in 0..hp.n_expert {
                        out.insert(crate::model::steps::expert_hook(*layer, e), info);
                    }
                }
                Op::Mlp { gate, up, down } => {
                    info.k = Some(hp.hidden.max(hp.n_ff_exp * hp.n_expert_shared.max(1)));
                    three_products(&mut info, [quantized(gate), quantized(up), quantized(down)]);
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
            q8_split: None,
            router: false,
            rope_freq_rms: None,
            positions: 0,
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

    /// The DSA index score of an engine with 8-bit activations whose indexer multiplies
    /// quantized `attn_k` and `proj` but an F16 `attn_q_b` (llama-quantize keeps a matrix whose
    /// rows are not a multiple of 32 values): k and the head weights round at q8_1, q at f16,
    /// the other three roundings at f32. By hand, K = 64, f32 sums:
    /// 4 * (2 * sqrt(5.7e-3^2 + 2^-22 + 5.7e-3^2 + 3 * 2^-48) + 2^-24 * 8).
    #[test]
    fn index_scores_count_only_their_quantized_products() {
        let cand = Precision::parse("f32 storage, f32 accumulation, f16 products, q8 activations")
            .unwrap();
        let cpu = Precision::parse("f32 storage, f64 accumulation").unwrap();
        let mut info = HookInfo {
            kind: Kind::IndexerScores,
            k: Some(64),
            quantized: true,
            q8_split: Some((1, 1)),
            router: false,
            rope_freq_rms: None,
            positions: 0,
        };
        let (u8q, u16, u32) = (5.7e-3f64, 2f64.powi(-11), 2f64.powi(-24));
        let sum = u8q * u8q + u16 * u16 + u8q * u8q + 3.0 * u32 * u32;
        let want = 4.0 * (2.0 * sum.sqrt() + u32 * 8.0);
        assert!(
            (floor(&info, cpu, cand) - want).abs() < 1e-15,
            "{}",
            floor(&info, cpu, cand)
        );
        // No quantized product: the f16 products alone, as a plain f16 indexer.
        info.q8_split = Some((0, 0));
        info.quantized = false;
        let plain = 4.0 * (2.0 * (2.0 * u16 * u16 + 4.0 * u32 * u32).sqrt() + u32 * 8.0);
        assert!((floor(&info, cpu, cand) - plain).abs() < 1e-15);
        // Every product quantized stays under the all-roundings bound of a one-matrix step.
        info.q8_split = Some((2, 1));
        info.quantized = true;
        let all = HookInfo {
            q8_split: None,
            ..info
        };
        assert!(floor(&info, cpu, cand) < floor(&all, cpu, cand));
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

    const ALL_KINDS: [Kind; 14] = [
        Kind::Embed,
        Kind::Norm,
        Kind::Linear,
        Kind::Rope,
        Kind::IndexerScores,
        Kind::Selection,
        Kind::Attention,
        Kind::SwiGlu,
        Kind::Add,
        Kind::RouterProbs,
        Kind::RouterWeights,
        Kind::Experts,
        Kind::Mlp,
        Kind::Zeros,
    ];

    /// No precision, however coarse, gives a floor a layout bug could hide under: every floor
    /// is at most MAX_FLOOR, under the 0.29 of the subtlest bug measured and far under the
    /// sqrt(2) of an unrelated output.
    #[test]
    fn no_floor_reaches_what_a_layout_bug_scores() {
        const { assert!(MAX_FLOOR <= 0.1) };
        let words = ["f64", "f32", "tf32", "f16", "bf16", "fp8"];
        let mut coarse = Precision::parse("fp8").unwrap();
        coarse.q8_activations = true;
        let storage_fp8 = Precision::new(Dtype::Fp8, Dtype::F32);
        let precisions: Vec<Precision> = words
            .iter()
            .map(|w| Precision::parse(w).unwrap())
            .chain([coarse, storage_fp8])
            .collect();
        for kind in ALL_KINDS {
            for k in [None, Some(64), Some(1 << 20)] {
                for (quantized, q8_split) in [
                    (false, None),
                    (true, None),
                    (true, Some((1, 0))),
                    (true, Some((6, 3))),
                ] {
                    let info = HookInfo {
                        kind,
                        k,
                        quantized,
                        q8_split,
                        router: false,
                        rope_freq_rms: kind.turns_rope().then_some(1.0),
                        positions: 1 << 17,
                    };
                    for &p in &precisions {
                        let f = floor(&info, Precision::REFERENCE, p);
                        assert!(f > 0.0 && f <= MAX_FLOOR, "{kind:?} {k:?} {p}: {f}");
                    }
                }
            }
        }
    }

    /// The RoPE angles' term, by hand: an f32 engine (angles in f32) against the reference
    /// (angles in f64) at 4096 positions, frequencies of RMS 0.4 rad/position: `theta_rms =
    /// 0.4 * sqrt(4095 * 8191 / 6) = 946.0`, the index score's two rotated tensors add
    /// `2 * (2^-24 / sqrt(3) * 946.0)^2`; a RoPE step one. None at one position, and the term
    /// is beneath a bf16 engine's own rounding at 4096 positions (its floor moves by under 1%).
    #[test]
    fn rope_angles_round_at_the_engines_precision() {
        let cpu = Precision::parse("f32 storage, f64 accumulation").unwrap();
        let f32p = Precision::parse("f32 storage, f32 accumulation").unwrap();
        let info = HookInfo {
            kind: Kind::IndexerScores,
            k: Some(64),
            quantized: false,
            q8_split: None,
            router: false,
            rope_freq_rms: Some(0.4),
            positions: 4096,
        };
        let u = 2f64.powi(-24);
        let theta: f64 = 0.4 * (4095.0f64 * 8191.0 / 6.0).sqrt();
        assert!((theta - 946.0).abs() < 0.5, "{theta}");
        let angles = 2.0 * (u / 3f64.sqrt() * theta).powi(2);
        let want = 4.0 * (2.0 * (6.0 * u * u + angles).sqrt() + u * 8.0);
        assert!(
            (floor(&info, cpu, f32p) - want).abs() < 1e-15,
            "{}",
            floor(&info, cpu, f32p)
        );
        let none = HookInfo {
            positions: 1,
            ..info
        };
        let plain = 4.0 * (2.0 * 6f64.sqrt() * u + u * 8.0);
        assert!((floor(&none, cpu, f32p) - plain).abs() < 1e-18);
        // A RoPE step rotates one tensor.
        let rope = HookInfo {
            kind: Kind::Rope,
            k: None,
            ..info
        };
        let want = 4.0 * (3.0 * u * u + angles / 2.0).sqrt();
        assert!((floor(&rope, cpu, f32p) - want).abs() < 1e-15);
        // bf16: the angles still in f32, beneath bf16's own rounding.
        let bf16 = Precision::parse("bf16").unwrap();
        let (with, without) = (floor(&info, cpu, bf16), floor(&none, cpu, bf16));
        assert!(with > without && with < without * 1.01, "{with} {without}");
        // Two f64 sides: the angles at f64.
        let f64s = Precision::parse("f64").unwrap();
        assert!(floor(&info, f64s, f64s) < 1e-12);
    }

    /// The FP8 indexer's floor counts the two tensors it rounds to fp8 (q and k) and the four
    /// others at bf16, by hand: 4 * (2 * sqrt(2 * 2^-8 + 4 * 2^-16) + 2^-24 * sqrt(64)) = 0.709,
    /// capped at 0.1; the whole step at fp8 would be 4 * 2 * sqrt(6) * 2^-4 = 1.22. The bf16
    /// indexer keeps its floor: 4 * (2 * sqrt(6) * 2^-8 + 2^-24 * 8) = 0.0765.
    #[test]
    fn fp8_indexer_floor_from_q_and_k() {
        let info = HookInfo {
            kind: Kind::IndexerScores,
            k: Some(64),
            quantized: false,
            q8_split: None,
            router: false,
            rope_freq_rms: None,
            positions: 0,
        };
        let fp8 = Precision::parse("fp8").unwrap();
        let uncapped = 4.0
            * (2.0 * (2.0 * 2f64.powi(-8) + 4.0 * 2f64.powi(-16)).sqrt() + 2f64.powi(-24) * 8.0);
        assert!((uncapped - 0.709).abs() < 1e-3, "{uncapped}");
        assert_eq!(floor(&info, Precision::REFERENCE, fp8), MAX_FLOOR);
        let bf16 = Precision::parse("bf16").unwrap();
        let want = 4.0 * (2.0 * 6f64.sqrt() * 2f64.powi(-8) + 2f64.powi(-24) * 8.0);
        assert!((floor(&info, Precision::REFERENCE, bf16) - want).abs() < 1e-15);
        // A norm is not a product: an FP8 engine's norms keep bf16's floor.
        let norm = HookInfo::from_point("attn_norm");
        assert_eq!(
            floor(&norm, Precision::REFERENCE, fp8),
            floor(&norm, Precision::REFERENCE, bf16)
        );
    }

    /// tf32 rounds the operands of products to a 10-bit mantissa (u = 2^-11) and keeps f32
    /// elsewhere: a projection of K = 4096 gets 4 * (sqrt(2 * 2^-22 + 2^-48) + 2^-24 * 64),
    /// 2.77e-3, neither f32's 1.6e-5 nor f16's (whose output is f16 too); an add gets f32's.
    #[test]
    fn tf32_has_its_own_floor() {
        let tf32 = Precision::parse("tf32").unwrap();
        let f32p = Precision::parse("f32").unwrap();
        let f16 = Precision::parse("f16").unwrap();
        let lin = HookInfo {
            kind: Kind::Linear,
            k: Some(4096),
            quantized: false,
            q8_split: None,
            router: false,
            rope_freq_rms: None,
            positions: 0,
        };
        let want = 4.0 * ((2.0 * 2f64.powi(-22) + 2f64.powi(-48)).sqrt() + 2f64.powi(-24) * 64.0);
        let got = floor(&lin, Precision::REFERENCE, tf32);
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
        assert!(got > 100.0 * floor(&lin, Precision::REFERENCE, f32p));
        assert!(got < floor(&lin, Precision::REFERENCE, f16));
        let add = HookInfo::from_point("l_out");
        assert_eq!(
            floor(&add, Precision::REFERENCE, tf32),
            floor(&add, Precision::REFERENCE, f32p)
        );
    }

    /// The router's hooks follow the router's precision: the CUDA engine's bf16 mode (router
    /// and matrix f32) gets f32 floors there, transformers' (f32 from a bf16 matrix) f32 but for
    /// the matrix, one of the logits' three roundings: 4 * (sqrt(2^-16 + 2 * 2^-48) + 2^-24 * 8)
    /// for K = 64; every other hook keeps bf16's.
    #[test]
    fn router_hooks_follow_the_router_precision() {
        let cuda = Precision::new(Dtype::Bf16, Dtype::F32).with_router(Dtype::F32, Dtype::F32);
        let hf = Precision::new(Dtype::Bf16, Dtype::F32).with_router(Dtype::F32, Dtype::Bf16);
        let bf16 = Precision::new(Dtype::Bf16, Dtype::F32);
        let f32p = Precision::new(Dtype::F32, Dtype::F32);
        let r = Precision::REFERENCE;
        let logits = HookInfo {
            k: Some(64),
            ..HookInfo::from_point("moe_logits")
        };
        let probs = HookInfo {
            k: Some(8),
            ..HookInfo::from_point("moe_probs")
        };
        assert!(logits.router && probs.router && !HookInfo::from_point("ffn_norm").router);
        let plain = |i: &HookInfo| HookInfo {
            router: false,
            ..*i
        };
        for i in [&logits, &probs, &HookInfo::from_point("moe_weights")] {
            assert_eq!(floor(i, r, cuda), floor(&plain(i), r, f32p), "{i:?}");
            assert_eq!(
                floor(&plain(i), r, cuda),
                floor(&plain(i), r, bf16),
                "{i:?}"
            );
        }
        let want = 4.0 * ((2f64.powi(-16) + 2.0 * 2f64.powi(-48)).sqrt() + 2f64.powi(-24) * 8.0);
        assert!((floor(&logits, r, hf) - want).abs() < 1e-15);
        assert_eq!(floor(&probs, r, hf), floor(&plain(&probs), r, f32p));
        let norm = HookInfo::from_point("ffn_norm");
        assert_eq!(floor(&norm, r, cuda), floor(&norm, r, bf16));
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
