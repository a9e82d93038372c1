//! The [`Engine`] trait: one method per step kind of the forward pass, at hook granularity, and
//! its implementations ([`cpu`], the reference).
//!
//! # Contract
//! - An engine owns its tensors (`Engine::Tensor`: host memory for the CPU, device buffers for a
//!   GPU engine). The driver never looks inside one; it moves values across with
//!   [`Engine::upload`] / [`Engine::download`], which take and give a [`HostTensor`] (f32 or i32
//!   data, PyTorch-order shape). That is what makes both run modes possible with the same trait:
//!   *chained* (every step reads the engine's own earlier outputs) and *replay* (the
//!   driver downloads a step's inputs from the reference engine and uploads them to the
//!   candidate, so a difference is attributed to that step alone).
//! - Weights are named by their GGUF tensor name and fetched by the engine itself from the
//!   descriptions of [`crate::model::Weights`] (`matrix_desc`, `expert_desc`,
//!   `expert_gate_up_desc`, `vector_desc`, `embedding_rows_desc`, `kv_b_desc`: a tensor and a
//!   row range, with its raw GGUF bytes), each engine realising them its own way: the CPU
//!   engine dequantizes only what a step touches; a GPU engine may keep the quantized blocks on
//!   the device.
//! - Weight residency: the driver tells an engine which tensors are about to be read. In one walk
//!   of a plan it calls [`Engine::begin_model`] once before the engine's first step (with the
//!   global tensors of the plan: embedding, final norm, output), then per layer
//!   [`Engine::begin_layer`] before the layer's first step (with the layer's tensors, from
//!   `Step::weights`) and [`Engine::end_layer`] before the next layer begins or the tail runs,
//!   and [`Engine::end_model`] after the last step. Layers come in increasing order, one begun at
//!   a time, and every call that reads a layer's weights falls between that layer's begin and
//!   end. Right after beginning a layer, a walk calls [`Engine::prefetch_layer`] with the next
//!   layer it will begin (none after its last), so that an engine can start moving that layer's
//!   weights while the current one computes. A walk that fails stops without the end calls (an engine frees what it holds when
//!   dropped); an engine used by two walks at once (the same engine as reference and candidate)
//!   sees both walks' calls interleaved. The defaults do nothing.
//! - Every method takes inputs in the hook shapes of `docs/hooks.md` and returns its
//!   outputs in those shapes; element order is the GGUF's own (RoPE pairs rotated in place).
//! - Positions are `0..T` (one prompt, no KV cache); the causal mask is part of the step.
//! - Engines never print and never compare; they return errors that name the step and shapes.
//!
//! The methods' mathematical definitions are in `shared/spec/glm5-architecture.md`, section 2;
//! [`cpu`] is the living definition of each.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::ops::Range;

use anyhow::Result;

use crate::model::RopeSlice;
use crate::precision::Precision;
pub use crate::tensor::{HostData, HostTensor};

/// Inputs of the attention step (hooks of one layer).
pub struct MlaInputs<'a, T> {
    /// `q_b`, `[T, H*(nope+rope)]` (the nope part of each head is used).
    pub q_b: &'a T,
    /// `q_pe_rope`, `[T, H, rope]`.
    pub q_pe: &'a T,
    /// `kv_a_norm` (the latent c_kv), `[T, kv_lora]`.
    pub kv_norm: &'a T,
    /// `k_pe_rope`, `[T, rope]`.
    pub k_pe: &'a T,
    /// `indexer_topk`, `[T, k]` i32 (-1 ignored), on DSA models: the keys each query may see.
    pub selection: Option<&'a T>,
}

/// Inputs of the routed-experts step (hooks of one layer).
pub struct ExpertInputs<'a, T> {
    /// `ffn_norm`, `[T, hidden]`.
    pub x: &'a T,
    /// `moe_topk_ids`, `[T, K]` i32.
    pub ids: &'a T,
    /// `moe_weights`, `[T, K]`, same order as `ids`.
    pub weights: &'a T,
}

/// Outputs of the attention step: attn_heads, and the probabilities when asked for.
pub type AttentionOut<T> = (T, Option<T>);

/// Router outputs of one MoE layer (hooks `moe_probs`, `moe_topk_ids`, `moe_weights`).
pub struct Routing<T> {
    /// `[T, E]` probabilities (sigmoid or softmax of the logits).
    pub probs: T,
    /// `[T, K]` i32 selected experts, best selection score first.
    pub ids: T,
    /// `[T, K]` normalised and scaled weights, same order as `ids`.
    pub weights: T,
}

/// Routed-expert outputs of one MoE layer.
pub struct ExpertsOut<T> {
    /// `[T, hidden]` weighted sum of the selected experts' outputs (hook `moe_routed`).
    pub routed: T,
    /// Per expert asked for: its id and its unweighted outputs `[n_e, hidden]`, token order.
    pub experts: Vec<(usize, T)>,
}

/// What [`Engine::moe_experts_joint`] gives.
pub struct JointExperts<T> {
    /// The whole step from the first inputs.
    pub own: ExpertsOut<T>,
    /// Per further inputs, their rows' outputs (`None` when the engine computes only whole
    /// steps).
    pub more: Vec<Option<ExpertsOut<T>>>,
}

/// What an engine did to put weights where its steps read them, since it was last asked
/// ([`Engine::take_upload_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UploadStats {
    /// Seconds its steps spent on weights before computing: uploading them on demand, waiting
    /// for a prefetched tensor to arrive, issuing a prefetch.
    pub wait: f64,
    /// Bytes of weights its steps took into use (uploaded on demand or prefetched).
    pub bytes: u64,
}

impl std::ops::AddAssign for UploadStats {
    fn add_assign(&mut self, o: UploadStats) {
        self.wait += o.wait;
        self.bytes += o.bytes;
    }
}

/// One step kind per method. See the module documentation for the contract.
pub trait Engine {
    /// The engine's tensor (host memory, device buffer, ...).
    type Tensor;

    /// Describes the engine for trace metadata, e.g. `cpu` or `cuda:0 NVIDIA H200 sm_90`.
    fn describe(&self) -> String;
    /// Compute precision: it decides the tolerance floors, and its prose is the `dtype` of
    /// trace metadata and reports (e.g. `f32 storage, f64 accumulation`).
    fn precision(&self) -> Precision;

    /// Before the engine's first step of a walk: the GGUF tensors the plan's global steps read
    /// (`token_embd.weight`, `output_norm.weight`, `output.weight`, as far as the plan runs the
    /// embedding and the tail; empty for a plan of middle layers), in first-use order. An engine
    /// may make them resident until [`Engine::end_model`]. Default: nothing.
    fn begin_model(&self, weights: &[String]) -> Result<()> {
        let _ = weights;
        Ok(())
    }
    /// After the last step of a walk (and after the last [`Engine::end_layer`]). Default: nothing.
    fn end_model(&self) -> Result<()> {
        Ok(())
    }
    /// Before the first step of layer `layer`: the GGUF tensors its steps read (the union of
    /// `Step::weights`, in first-use order; whole tensors, of which the stacked expert tensors
    /// are read only in the selected experts' rows). An engine may upload them here and free
    /// them at [`Engine::end_layer`]. Default: nothing.
    fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        let _ = (layer, weights);
        Ok(())
    }
    /// After the last step of layer `layer` (before the next layer begins or the tail runs).
    /// Default: nothing.
    fn end_layer(&self, layer: usize) -> Result<()> {
        let _ = layer;
        Ok(())
    }
    /// Right after [`Engine::begin_layer`]: layer `layer` is the next one the walk begins, and
    /// `weights` are its tensors (as `begin_layer` will be given them). An engine may start
    /// moving them (say, to a device) while the current layer's steps run, and must still
    /// accept a walk that never begins `layer` (it fails first). A failure to prefetch is the
    /// engine's to absorb (it loads the weights when they are read instead), not an error.
    /// Default: nothing.
    fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        let _ = (layer, weights);
        Ok(())
    }
    /// What the engine did to put weights in place since the last call (drained): the driver
    /// calls it after each of the engine's steps to split a layer's time into weight uploads
    /// and compute. Default: nothing (an engine that reads its weights where they lie).
    fn take_upload_stats(&self) -> UploadStats {
        UploadStats::default()
    }
    /// Offers the reference the weights whose uploads have finished since the last call
    /// (`--reference-reuse`: `gpu::resident`), without waiting for any; returns whether uploads
    /// it would offer are still under way. The pass calls it while it waits for the
    /// reference's side of a step, so that an offer follows its copies, not this engine's
    /// steps. Default: nothing to offer.
    fn offer_uploads(&self) -> bool {
        false
    }

    /// Copies a host tensor into the engine.
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    /// Copies an engine tensor to the host (called only for hooks a sink wants, and for replay).
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;

    /// Embedding rows of `ids`: `[T, hidden]`. Ids outside the vocabulary are an error.
    fn embed(&self, ids: &[u32]) -> Result<Self::Tensor>;
    /// `w * v / sqrt(mean(v^2) + eps)` over columns `cols` (all when `None`) of each row of `x`;
    /// `weight` is the GGUF norm weight. Out: `[T, cols.len()]`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<Self::Tensor>;
    /// `x · W^T` for the GGUF matrix `weight` (`[out, in]`): `[T, in]` -> `[T, out]`, in the
    /// engine's precision (the router's projection is [`Engine::router_logits`]).
    fn linear(&self, x: &Self::Tensor, weight: &str) -> Result<Self::Tensor>;
    /// Interleaved RoPE (pairs `2i, 2i+1`) at positions `0..T` on the slice `s` of every head of
    /// `x` (`[T, heads*stride]`), with the model's frequencies and cos/sin factor
    /// (`model::rope`). Out: `[T, heads, rope]`, or `[T, rope]` when `!s.keep_head_axis`.
    fn rope(&self, x: &Self::Tensor, s: &RopeSlice) -> Result<Self::Tensor>;
    /// DSA lightning-indexer scores of layer `layer` from `a` (attn_norm, `[T, hidden]`) and
    /// `cq` (q_a_norm, `[T, q_lora]`): `[T, T]`, `-inf` where `s > t`.
    fn indexer_scores(
        &self,
        layer: usize,
        a: &Self::Tensor,
        cq: &Self::Tensor,
    ) -> Result<Self::Tensor>;
    /// Per row `t`, the `min(k, t+1)` causal positions with the highest scores, highest first,
    /// ties to the lower position; padded with -1 to `[T, min(k, T)]` (i32).
    fn top_k(&self, scores: &Self::Tensor, k: usize) -> Result<Self::Tensor>;
    /// Naive (non-absorbed) MLA of layer `layer`: keys `[W_UK c | k_pe]`, values `W_UV c` from
    /// kv_b, causal mask, optional DSA selection, softmax scale from
    /// `model::rope::softmax_scale`. Out: attn_heads `[T, H*v]`, and the probabilities
    /// `[H, T, T]` when `want_probs`.
    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, Self::Tensor>,
        want_probs: bool,
    ) -> Result<(Self::Tensor, Option<Self::Tensor>)>;
    /// [`Engine::mla_attention`] for the query rows `rows` only (ascending, distinct, each
    /// `< T`) against all `T` keys: attn_heads `[rows.len(), H*v]` and, when `want_probs`, the
    /// probabilities `[H, rows.len(), T]`, row `i` bit for bit row `rows[i]` of the whole step
    /// from the same inputs. `None` when the engine computes only whole steps (the default):
    /// the caller then runs the whole step.
    fn mla_attention_rows(
        &self,
        layer: usize,
        x: MlaInputs<'_, Self::Tensor>,
        rows: &[usize],
        want_probs: bool,
    ) -> Result<Option<AttentionOut<Self::Tensor>>> {
        let _ = (layer, x, rows, want_probs);
        Ok(None)
    }
    /// Whether a row-wise step (a norm, a projection, the router's logits and routing, the
    /// shared MLP, SwiGLU, a sum) gives each output row the same bits from the same input row
    /// whatever other rows it is given: the driver then recomputes such a step only in the rows
    /// whose inputs changed. `false` (the default) for an engine whose kernels or products may
    /// depend on the number of rows (cuBLAS picks its algorithm by shape).
    fn rows_independent(&self) -> bool {
        false
    }
    /// Router logits of MoE layer `layer`: `x · W^T` with its router matrix `ffn_gate_inp`
    /// (`[E, hidden]`), `[T, hidden]` -> `[T, E]`.
    ///
    /// Precision rule: the logits are computed in f32 (f32 inputs, f32 weights, at least f32
    /// accumulation) whatever the engine's storage precision, as transformers
    /// (`DeepseekV3TopkRouter`, GLM-5) and vLLM compute them; an engine with bf16 storage
    /// keeps this step in f32 (bf16 router logits are the known bug `router_bf16`).
    fn router_logits(&self, layer: usize, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// Router of layer `layer` from its logits `[T, E]`: gating (sigmoid/softmax), selection on
    /// probs + `exp_probs_b` (bias for selection only), group-limited top-k, normalisation and
    /// scaling.
    fn moe_route(&self, layer: usize, logits: &Self::Tensor) -> Result<Routing<Self::Tensor>>;
    /// Routed experts of layer `layer`: `sum_k w_k * down_k(silu(gate_k x) * up_k x)`, `[T, hidden]`.
    /// For every expert `e` with `want_expert(e)`, also its outputs for the tokens routed to it
    /// (`[n_e, hidden]`, token order, before weighting).
    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, Self::Tensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<Self::Tensor>>;
    /// [`Engine::moe_experts`] for the token rows `rows` only (ascending, distinct, each `< T`):
    /// `routed` `[rows.len(), hidden]` and, per expert `e` with `want_expert(e)` that a token of
    /// `rows` selects, its outputs for those tokens (`[n_e, hidden]`, token order), bit for bit
    /// the same rows of the whole step from the same inputs. `None` when the engine computes
    /// only whole steps (the default): the caller then runs the whole step.
    fn moe_experts_rows(
        &self,
        layer: usize,
        x: ExpertInputs<'_, Self::Tensor>,
        rows: &[usize],
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<Option<ExpertsOut<Self::Tensor>>> {
        let _ = (layer, x, rows, want_expert);
        Ok(None)
    }
    /// [`Engine::moe_experts`] of `x`, and [`Engine::moe_experts_rows`] of every
    /// `(inputs, rows)` of `more` (the same layer's step from other inputs: a chain that
    /// follows other selections, a replay with the candidate's), in one pass over the experts'
    /// weights where the engine can: each result bit for bit what its own call gives, a `more`
    /// result `None` where that call's is. The default makes every call on its own.
    #[allow(clippy::type_complexity)]
    fn moe_experts_joint(
        &self,
        layer: usize,
        x: ExpertInputs<'_, Self::Tensor>,
        more: &[(ExpertInputs<'_, Self::Tensor>, &[usize])],
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<JointExperts<Self::Tensor>> {
        let own = self.moe_experts(layer, x, want_expert)?;
        let more = more
            .iter()
            .map(|(m, rows)| {
                let m = ExpertInputs {
                    x: m.x,
                    ids: m.ids,
                    weights: m.weights,
                };
                self.moe_experts_rows(layer, m, rows, want_expert)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(JointExperts { own, more })
    }
    /// SwiGLU MLP `down(silu(gate x) * up x)` with three GGUF matrices (shared expert).
    fn mlp(&self, x: &Self::Tensor, gate: &str, up: &str, down: &str) -> Result<Self::Tensor>;
    /// `silu(a) * b`, elementwise.
    fn swiglu(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// `a + b`, elementwise.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// Zeros of `x`'s shape (f32): the shared-expert output of a model without shared experts.
    /// The default goes through the host; an engine may create them in place.
    fn zeros_like(&self, x: &Self::Tensor) -> Result<Self::Tensor> {
        let h = self.download(x)?;
        let n = h.shape.iter().product();
        self.upload(&HostTensor::f32(h.shape, vec![0.0; n])?)
    }
}
