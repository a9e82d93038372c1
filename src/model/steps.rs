//! The ordered list of steps of a forward pass. Each step names its inputs and outputs by hook
//! name (`docs/hooks.md`), so a driver can run them over any engine, chained (inputs from
//! the same engine) or replay (inputs taken from a reference run), and hand every output to a
//! trace sink. No arithmetic happens here; the step kinds are defined by the `Engine` trait.
//!
//! Each step also says which GGUF tensors it reads ([`Step::weights`]), so that an engine can be
//! told a layer's weights before its first step ([`weights_of`] gathers them for a list of steps).

use std::ops::Range;

use super::hparams::HParams;
use super::names::{self, blk};
use super::weights::Weights;

/// Hook point names (the part after `blk.{L}.`), one per step output. Never rename or reuse one.
pub mod point {
    /// RMSNorm(h; attn_norm), `[T, hidden]`.
    pub const ATTN_NORM: &str = "attn_norm";
    /// a · attn_q_a, `[T, q_lora]`.
    pub const Q_A: &str = "q_a";
    /// RMSNorm(q_a; attn_q_a_norm), `[T, q_lora]`.
    pub const Q_A_NORM: &str = "q_a_norm";
    /// Queries before RoPE, `[T, H*(nope+rope)]`.
    pub const Q_B: &str = "q_b";
    /// Every head's q_pe after RoPE, `[T, H, rope]`.
    pub const Q_PE_ROPE: &str = "q_pe_rope";
    /// a · attn_kv_a_mqa = `[c_kv | k_pe]`, `[T, kv_lora+rope]`.
    pub const KV_A: &str = "kv_a";
    /// RMSNorm(c_kv; attn_kv_a_norm), `[T, kv_lora]`.
    pub const KV_A_NORM: &str = "kv_a_norm";
    /// k_pe after RoPE, `[T, rope]`.
    pub const K_PE_ROPE: &str = "k_pe_rope";
    /// DSA index scores, `[T, T]` (-inf above the diagonal).
    pub const INDEXER_SCORES: &str = "indexer_scores";
    /// DSA selected key positions, `[T, min(top_k, T)]` i32, -1 padded.
    pub const INDEXER_TOPK: &str = "indexer_topk";
    /// Per-head attention outputs, `[T, H*v]`.
    pub const ATTN_HEADS: &str = "attn_heads";
    /// attn_heads · attn_output, `[T, hidden]`.
    pub const ATTN_OUT: &str = "attn_out";
    /// Residual after attention, `[T, hidden]`.
    pub const FFN_INP: &str = "ffn_inp";
    /// RMSNorm(ffn_inp; ffn_norm), `[T, hidden]`.
    pub const FFN_NORM: &str = "ffn_norm";
    /// Dense gate projection, `[T, inter]`.
    pub const FFN_GATE: &str = "ffn_gate";
    /// Dense up projection, `[T, inter]`.
    pub const FFN_UP: &str = "ffn_up";
    /// silu(ffn_gate) * ffn_up, `[T, inter]`.
    pub const FFN_ACT: &str = "ffn_act";
    /// Router logits, `[T, E]`.
    pub const MOE_LOGITS: &str = "moe_logits";
    /// Router probabilities (sigmoid or softmax of the logits), `[T, E]`.
    pub const MOE_PROBS: &str = "moe_probs";
    /// Selected experts sorted by selection score, `[T, K]` i32.
    pub const MOE_TOPK_IDS: &str = "moe_topk_ids";
    /// Normalised, scaled weights of the selected experts, `[T, K]`.
    pub const MOE_WEIGHTS: &str = "moe_weights";
    /// Weighted sum of the selected experts' outputs, `[T, hidden]`.
    pub const MOE_ROUTED: &str = "moe_routed";
    /// Shared expert output, `[T, hidden]`.
    pub const FFN_SHEXP: &str = "ffn_shexp";
    /// Dense MLP output, or moe_routed + ffn_shexp, `[T, hidden]`.
    pub const FFN_OUT: &str = "ffn_out";
    /// Layer output (residual stream), `[T, hidden]`.
    pub const L_OUT: &str = "l_out";
    /// Optional: attention probabilities `[H, T, T]`.
    pub const ATTN_PROBS: &str = "attn_probs";
    /// Global: embedding rows, `[T, hidden]`.
    pub const TOKEN_EMBD: &str = "token_embd";
    /// Global: final norm, `[T, hidden]`.
    pub const RESULT_NORM: &str = "result_norm";
    /// Global: logits, `[T, vocab]`.
    pub const LOGITS: &str = "logits";

    /// The standard points of a layer in forward-pass order: every one is `[T, ...]` (the
    /// optional [`ATTN_PROBS`] and per-expert outputs are not listed).
    pub const LAYER: &[&str] = &[
        ATTN_NORM,
        Q_A,
        Q_A_NORM,
        Q_B,
        Q_PE_ROPE,
        KV_A,
        KV_A_NORM,
        K_PE_ROPE,
        INDEXER_SCORES,
        INDEXER_TOPK,
        ATTN_HEADS,
        ATTN_OUT,
        FFN_INP,
        FFN_NORM,
        FFN_GATE,
        FFN_UP,
        FFN_ACT,
        MOE_LOGITS,
        MOE_PROBS,
        MOE_TOPK_IDS,
        MOE_WEIGHTS,
        MOE_ROUTED,
        FFN_SHEXP,
        FFN_OUT,
        L_OUT,
    ];
}

/// `blk.{layer}.{point}`.
pub fn hook(layer: usize, point: &str) -> String {
    format!("blk.{layer}.{point}")
}

/// Whether hook `name` holds `-inf` after each row's own column by definition (the DSA index
/// scores' causal mask, `[T, T]`): those are not non-finite results.
pub fn causally_masked(name: &str) -> bool {
    super::names::split_blk(name).map_or(name, |(_, p)| p) == point::INDEXER_SCORES
}

/// Optional hook of expert `e`'s output in layer `layer`: `blk.{L}.exp.{e}.out`, `[n_e, hidden]`.
pub fn expert_hook(layer: usize, e: usize) -> String {
    format!("blk.{layer}.exp.{e}.out")
}

/// Which columns of each head of a `[T, heads*stride]` tensor a RoPE step rotates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RopeSlice {
    /// Heads in the input row.
    pub heads: usize,
    /// Values per head in the input row.
    pub stride: usize,
    /// First rotated column within a head.
    pub offset: usize,
    /// Output keeps the head axis (`[T, heads, rope]`) or drops it (`[T, rope]`, one head).
    pub keep_head_axis: bool,
}

/// What a step computes. Inputs and outputs are listed in [`Step`], in the order given here.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Embedding rows of the prompt tokens. In: none. Out: `[T, hidden]`.
    Embed,
    /// `RMSNorm(x[:, cols]; weight, eps)`. In: x. Out: `[T, cols]`.
    RmsNorm {
        /// GGUF weight name.
        weight: String,
        /// Epsilon.
        eps: f64,
        /// Column range of the input to normalise (`None` = all).
        cols: Option<Range<usize>>,
    },
    /// `x · W^T` with W the GGUF matrix `weight` (`[out, in]`). In: x `[T, in]`. Out: `[T, out]`.
    Linear {
        /// GGUF weight name.
        weight: String,
    },
    /// Interleaved RoPE (pairs 2i, 2i+1) at positions 0..T of one slice of every head.
    /// In: x `[T, heads*stride]`. Out: rotated slice.
    Rope(RopeSlice),
    /// DSA index scores of layer `layer`. In: attn_norm `[T, hidden]`, q_a_norm `[T, q_lora]`.
    /// Out: `[T, T]`, -inf at non-causal positions.
    IndexerScores {
        /// Layer index (selects the `indexer.*` weights).
        layer: usize,
    },
    /// Causal top-k over each score row. In: scores `[T, T]`. Out: `[T, min(k, T)]` i32.
    TopK {
        /// k (`attention.indexer.top_k`).
        k: usize,
    },
    /// Naive MLA of layer `layer`. In: q_b, q_pe_rope, kv_a_norm, k_pe_rope, and the DSA
    /// selection `[T, k]` when present. Out: attn_heads `[T, H*v]`.
    Attention {
        /// Layer index (selects kv_b).
        layer: usize,
    },
    /// Router logits of MoE layer `layer`: `x · W^T` with its router matrix `ffn_gate_inp`,
    /// always in f32 (the precision rule of `Engine::router_logits`). In: x `[T, hidden]`.
    /// Out: `[T, E]`.
    RouterLogits {
        /// Layer index (selects `ffn_gate_inp`).
        layer: usize,
    },
    /// Router of layer `layer`. In: logits `[T, E]`. Out: probs `[T, E]`, ids `[T, K]` i32, weights `[T, K]`.
    MoeRoute {
        /// Layer index (selects `exp_probs_b`).
        layer: usize,
    },
    /// Routed experts of layer `layer`. In: x `[T, hidden]`, ids, weights. Out: `[T, hidden]`.
    MoeExperts {
        /// Layer index (selects the `ffn_*_exps` tensors).
        layer: usize,
    },
    /// SwiGLU MLP `down(silu(gate x) * up x)`. In: x. Out: `[T, hidden]`.
    Mlp {
        /// Gate weight name.
        gate: String,
        /// Up weight name.
        up: String,
        /// Down weight name.
        down: String,
    },
    /// `silu(a) * b`. In: a, b. Out: same shape.
    SwiGlu,
    /// `a + b`. In: a, b. Out: same shape.
    Add,
    /// The output is the input (a second name for the same values).
    Alias,
    /// Zeros of the input's shape. In: x. Out: zeros like x.
    ZerosLike,
}

/// One step: an operation, the hook names it reads and the hook names it produces.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// What to compute.
    pub op: Op,
    /// Input hook names.
    pub inputs: Vec<String>,
    /// Output hook names.
    pub outputs: Vec<String>,
    /// Layer of the step (`None` for global steps).
    pub layer: Option<usize>,
}

impl Step {
    /// The GGUF tensors this step reads, in the order it reads them (none for steps without
    /// weights: RoPE, top-k, SwiGLU, add, alias, zeros):
    ///
    /// - embedding: `token_embd.weight`; norms, linears and the shared-expert MLP: their named
    ///   weights (the logits' linear reads `output.weight`, or `token_embd.weight` when tied);
    /// - DSA indexer: `indexer.attn_q_b`, `indexer.attn_k`, `indexer.proj`, `indexer.k_norm`
    ///   weight and bias;
    /// - attention: kv_b as the file holds it, `attn_k_b` + `attn_v_b` or the legacy
    ///   `attn_kv_b` ([`Weights::kv_b_names`]);
    /// - router logits: the router matrix `ffn_gate_inp`;
    /// - router: the selection bias `exp_probs_b.bias` when the file has one;
    /// - routed experts: the stacked `ffn_gate_exps` + `ffn_up_exps` (or the fused
    ///   `ffn_gate_up_exps`) and `ffn_down_exps`, whole tensors, of which an engine reads only
    ///   the selected experts' rows ([`Weights::expert_desc`]).
    ///
    /// Over the steps of a run layer `L` these are exactly the file's `blk.{L}.*` tensors, with
    /// one exception: a legacy `attn_kv_b` beside the split `attn_k_b`/`attn_v_b` (converter
    /// versions that wrote all three) is not read. The blocks of MTP layers (`L >= n_layer`,
    /// `nextn.*` and a full layer's tensors) are never run, so never read.
    pub fn weights(&self, w: &Weights<'_>) -> Vec<String> {
        match &self.op {
            Op::Embed => vec![names::TOKEN_EMBD.to_string()],
            Op::RmsNorm { weight, .. } | Op::Linear { weight } => vec![weight.clone()],
            Op::IndexerScores { layer } => [
                blk::INDEXER_Q_B,
                blk::INDEXER_K,
                blk::INDEXER_PROJ,
                blk::INDEXER_K_NORM,
                blk::INDEXER_K_NORM_B,
            ]
            .iter()
            .map(|s| names::blk(*layer, s))
            .collect(),
            Op::Attention { layer } => w.kv_b_names(*layer),
            Op::RouterLogits { layer } => vec![names::blk(*layer, blk::FFN_GATE_INP)],
            Op::MoeRoute { layer } => {
                let bias = names::blk(*layer, blk::EXP_PROBS_B);
                if w.has(&bias) {
                    vec![bias]
                } else {
                    Vec::new()
                }
            }
            Op::MoeExperts { layer } => {
                let mut v = w.expert_gate_up_names(*layer);
                v.push(names::blk(*layer, blk::FFN_DOWN_EXPS));
                v
            }
            Op::Mlp { gate, up, down } => vec![gate.clone(), up.clone(), down.clone()],
            Op::Rope(_) | Op::TopK { .. } | Op::SwiGlu | Op::Add | Op::Alias | Op::ZerosLike => {
                Vec::new()
            }
        }
    }
}

/// The union of [`Step::weights`] over `steps`, each name once, in first-use order.
pub fn weights_of<'s>(steps: impl IntoIterator<Item = &'s Step>, w: &Weights<'_>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in steps {
        for name in s.weights(w) {
            if !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

fn step(layer: Option<usize>, op: Op, inputs: &[&str], outputs: &[&str]) -> Step {
    Step {
        op,
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        outputs: outputs.iter().map(|s| s.to_string()).collect(),
        layer,
    }
}

/// The embedding step (`token_embd`).
pub fn embed_steps() -> Vec<Step> {
    vec![step(None, Op::Embed, &[], &[point::TOKEN_EMBD])]
}

/// Name of the residual stream entering layer `l` (`token_embd` or `blk.{l-1}.l_out`).
pub fn layer_input(l: usize) -> String {
    if l == 0 {
        point::TOKEN_EMBD.to_string()
    } else {
        hook(l - 1, point::L_OUT)
    }
}

/// The steps of layer `l`, in order.
pub fn layer_steps(hp: &HParams, l: usize) -> Vec<Step> {
    let h = |p: &str| hook(l, p);
    let w = |s: &str| names::blk(l, s);
    let eps = hp.rms_eps;
    let x_in = layer_input(l);
    let lay = Some(l);
    let mut v = Vec::new();
    let norm = |weight: String, cols: Option<Range<usize>>| Op::RmsNorm { weight, eps, cols };
    let lin = |weight: String| Op::Linear { weight };

    v.push(step(
        lay,
        norm(w(blk::ATTN_NORM), None),
        &[&x_in],
        &[&h(point::ATTN_NORM)],
    ));
    if hp.q_lora_rank.is_some() {
        v.push(step(
            lay,
            lin(w(blk::ATTN_Q_A)),
            &[&h(point::ATTN_NORM)],
            &[&h(point::Q_A)],
        ));
        v.push(step(
            lay,
            norm(w(blk::ATTN_Q_A_NORM), None),
            &[&h(point::Q_A)],
            &[&h(point::Q_A_NORM)],
        ));
        v.push(step(
            lay,
            lin(w(blk::ATTN_Q_B)),
            &[&h(point::Q_A_NORM)],
            &[&h(point::Q_B)],
        ));
    } else {
        v.push(step(
            lay,
            lin(w(blk::ATTN_Q)),
            &[&h(point::ATTN_NORM)],
            &[&h(point::Q_B)],
        ));
    }
    let q_rope = RopeSlice {
        heads: hp.n_head,
        stride: hp.qk_head(),
        offset: hp.qk_nope,
        keep_head_axis: true,
    };
    v.push(step(
        lay,
        Op::Rope(q_rope),
        &[&h(point::Q_B)],
        &[&h(point::Q_PE_ROPE)],
    ));
    v.push(step(
        lay,
        lin(w(blk::ATTN_KV_A_MQA)),
        &[&h(point::ATTN_NORM)],
        &[&h(point::KV_A)],
    ));
    let c_kv = Some(0..hp.kv_lora_rank);
    v.push(step(
        lay,
        norm(w(blk::ATTN_KV_A_NORM), c_kv),
        &[&h(point::KV_A)],
        &[&h(point::KV_A_NORM)],
    ));
    let k_rope = RopeSlice {
        heads: 1,
        stride: hp.kv_lora_rank + hp.qk_rope,
        offset: hp.kv_lora_rank,
        keep_head_axis: false,
    };
    v.push(step(
        lay,
        Op::Rope(k_rope),
        &[&h(point::KV_A)],
        &[&h(point::K_PE_ROPE)],
    ));

    let mut attn_in = vec![
        h(point::Q_B),
        h(point::Q_PE_ROPE),
        h(point::KV_A_NORM),
        h(point::K_PE_ROPE),
    ];
    if let Some(ix) = &hp.indexer {
        if ix.full[l] {
            let scores = h(point::INDEXER_SCORES);
            v.push(step(
                lay,
                Op::IndexerScores { layer: l },
                &[&h(point::ATTN_NORM), &h(point::Q_A_NORM)],
                &[&scores],
            ));
            v.push(step(
                lay,
                Op::TopK { k: ix.top_k },
                &[&scores],
                &[&h(point::INDEXER_TOPK)],
            ));
        } else {
            // Shared layer (GLM-5.2): reuse the selection of the closest earlier full layer
            // (llama.cpp `glm-dsa.cpp` `prev_top_k`; transformers `prev_topk_indices`).
            let src = (0..l).rev().find(|&j| ix.full[j]).unwrap_or(0);
            v.push(step(
                lay,
                Op::Alias,
                &[&hook(src, point::INDEXER_TOPK)],
                &[&h(point::INDEXER_TOPK)],
            ));
        }
        attn_in.push(h(point::INDEXER_TOPK));
    }
    let attn_in: Vec<&str> = attn_in.iter().map(String::as_str).collect();
    v.push(step(
        lay,
        Op::Attention { layer: l },
        &attn_in,
        &[&h(point::ATTN_HEADS)],
    ));
    v.push(step(
        lay,
        lin(w(blk::ATTN_OUTPUT)),
        &[&h(point::ATTN_HEADS)],
        &[&h(point::ATTN_OUT)],
    ));
    v.push(step(
        lay,
        Op::Add,
        &[&x_in, &h(point::ATTN_OUT)],
        &[&h(point::FFN_INP)],
    ));
    v.push(step(
        lay,
        norm(w(blk::FFN_NORM), None),
        &[&h(point::FFN_INP)],
        &[&h(point::FFN_NORM)],
    ));

    let f = h(point::FFN_NORM);
    if hp.is_dense(l) {
        v.push(step(
            lay,
            lin(w(blk::FFN_GATE)),
            &[&f],
            &[&h(point::FFN_GATE)],
        ));
        v.push(step(lay, lin(w(blk::FFN_UP)), &[&f], &[&h(point::FFN_UP)]));
        v.push(step(
            lay,
            Op::SwiGlu,
            &[&h(point::FFN_GATE), &h(point::FFN_UP)],
            &[&h(point::FFN_ACT)],
        ));
        v.push(step(
            lay,
            lin(w(blk::FFN_DOWN)),
            &[&h(point::FFN_ACT)],
            &[&h(point::FFN_OUT)],
        ));
    } else {
        let route_out = [
            h(point::MOE_PROBS),
            h(point::MOE_TOPK_IDS),
            h(point::MOE_WEIGHTS),
        ];
        v.push(step(
            lay,
            Op::RouterLogits { layer: l },
            &[&f],
            &[&h(point::MOE_LOGITS)],
        ));
        v.push(step(
            lay,
            Op::MoeRoute { layer: l },
            &[&h(point::MOE_LOGITS)],
            &[&route_out[0], &route_out[1], &route_out[2]],
        ));
        v.push(step(
            lay,
            Op::MoeExperts { layer: l },
            &[&f, &route_out[1], &route_out[2]],
            &[&h(point::MOE_ROUTED)],
        ));
        if hp.n_expert_shared > 0 {
            let mlp = Op::Mlp {
                gate: w(blk::FFN_GATE_SHEXP),
                up: w(blk::FFN_UP_SHEXP),
                down: w(blk::FFN_DOWN_SHEXP),
            };
            v.push(step(lay, mlp, &[&f], &[&h(point::FFN_SHEXP)]));
        } else {
            // No shared expert: ffn_shexp is zeros, so every MoE layer has the same hooks
            // (transformers' shared-expert hook also gives zeros) and ffn_out = moe_routed + 0.
            v.push(step(
                lay,
                Op::ZerosLike,
                &[&h(point::MOE_ROUTED)],
                &[&h(point::FFN_SHEXP)],
            ));
        }
        v.push(step(
            lay,
            Op::Add,
            &[&h(point::MOE_ROUTED), &h(point::FFN_SHEXP)],
            &[&h(point::FFN_OUT)],
        ));
    }
    v.push(step(
        lay,
        Op::Add,
        &[&h(point::FFN_INP), &h(point::FFN_OUT)],
        &[&h(point::L_OUT)],
    ));
    v
}

/// Final norm and logits after `n_layers` layers; `output` is the output projection's name.
pub fn tail_steps(hp: &HParams, n_layers: usize, output: &str) -> Vec<Step> {
    let last = layer_input(n_layers);
    vec![
        step(
            None,
            Op::RmsNorm {
                weight: names::OUTPUT_NORM.to_string(),
                eps: hp.rms_eps,
                cols: None,
            },
            &[&last],
            &[point::RESULT_NORM],
        ),
        step(
            None,
            Op::Linear {
                weight: output.to_string(),
            },
            &[point::RESULT_NORM],
            &[point::LOGITS],
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};
    use std::path::Path;

    use super::*;
    use crate::gguf::Model;
    use crate::model::testutil::{build_with, metadata, tensor_names, tiny_hparams};
    use crate::model::Arch;

    /// Tensors of `w`'s file that no step of a full run reads, after checking that the steps of
    /// every run layer read only that layer's tensors and the global steps only the file's
    /// tensors outside `blk.*`, all of them present.
    fn unread(w: &Weights<'_>) -> BTreeSet<String> {
        let hp = w.hparams();
        let file: BTreeSet<String> = w.model().tensors().map(|t| t.info.name.clone()).collect();
        let mut read = BTreeSet::new();
        for l in 0..hp.n_layer {
            let names: BTreeSet<String> = weights_of(&layer_steps(hp, l), w).into_iter().collect();
            let theirs = names
                .iter()
                .all(|n| names::split_blk(n).is_some_and(|(nl, _)| nl == l));
            assert!(theirs, "layer {l} reads {names:?}");
            read.extend(names);
        }
        let global = embed_steps()
            .into_iter()
            .chain(tail_steps(hp, hp.n_layer, w.output_name()));
        let global: Vec<Step> = global.collect();
        let names = weights_of(&global, w);
        assert!(names.iter().all(|n| names::split_blk(n).is_none()));
        read.extend(names);
        let missing: Vec<&String> = read.difference(&file).collect();
        assert!(
            missing.is_empty(),
            "steps read tensors the file lacks: {missing:?}"
        );
        file.difference(&read).cloned().collect()
    }

    /// Only the model knows which projection is the router: every MoE layer of both
    /// architectures has one router-logits step, `ffn_norm` -> `moe_logits` reading
    /// `ffn_gate_inp`, right before the router; no plain projection reads `ffn_gate_inp`, and
    /// dense layers have no router step.
    #[test]
    fn router_logits_are_their_own_step() {
        for arch in [Arch::GlmDsa, Arch::Deepseek2] {
            let hp = tiny_hparams(arch);
            let model = crate::model::testutil::tiny_model(&hp);
            let w = Weights::new(&model).unwrap();
            let mut moe = 0;
            for l in 0..hp.n_layer {
                let steps = layer_steps(&hp, l);
                let routers: Vec<usize> = (0..steps.len())
                    .filter(|&i| matches!(steps[i].op, Op::RouterLogits { .. }))
                    .collect();
                assert!(steps.iter().all(|s| match &s.op {
                    Op::Linear { weight } => !weight.contains("ffn_gate_inp"),
                    _ => true,
                }));
                if hp.is_dense(l) {
                    assert!(routers.is_empty(), "{arch:?} layer {l}");
                    continue;
                }
                assert_eq!(routers.len(), 1, "{arch:?} layer {l}");
                let (s, next) = (&steps[routers[0]], &steps[routers[0] + 1]);
                assert_eq!(s.op, Op::RouterLogits { layer: l });
                assert_eq!(s.inputs, [hook(l, point::FFN_NORM)]);
                assert_eq!(s.outputs, [hook(l, point::MOE_LOGITS)]);
                assert_eq!(s.weights(&w), [format!("blk.{l}.ffn_gate_inp.weight")]);
                assert_eq!(next.op, Op::MoeRoute { layer: l });
                assert_eq!(next.inputs, s.outputs);
                moe += 1;
            }
            assert!(moe > 0, "{arch:?}: no MoE layer");
        }
    }

    /// Both fixture architectures, plain and quantized: every tensor of every run layer and
    /// every global tensor is read by some step; only the MTP block (GLM-5 fixtures: `blk.3`,
    /// `nextn_predict_layers = 1`) is left.
    #[test]
    fn step_weights_are_exactly_the_tensors_of_the_fixtures() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models");
        let files = [
            "glm5-tiny/glm5-tiny-f32.gguf",
            "glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "dsv3-tiny/dsv3-tiny-f32.gguf",
            "dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ];
        let mut archs = BTreeSet::new();
        for f in files {
            let model = Model::open(&dir.join(f)).unwrap();
            let w = Weights::new(&model).unwrap();
            let hp = w.hparams();
            archs.insert(hp.arch.as_str());
            let left = unread(&w);
            let mtp = left
                .iter()
                .all(|n| names::split_blk(n).is_some_and(|(l, _)| l >= hp.n_layer));
            assert!(mtp, "{f}: tensors of run layers no step reads: {left:?}");
            assert_eq!(left.is_empty(), hp.n_nextn == 0, "{f}: {left:?}");
        }
        assert_eq!(archs.len(), 2);
    }

    /// The file-dependent choices: fused expert gate/up, legacy kv_b, no q_lora (`attn_q`), no
    /// shared experts, no selection bias; and a file with kv_b both split and unsplit, where the
    /// documented exception `attn_kv_b` is the only tensor left unread.
    #[test]
    fn step_weights_follow_the_file() {
        let model = |hp: &HParams, names: &[String]| {
            build_with(hp, &metadata(hp), names, 32, &HashMap::new())
        };
        // Layer 0 is dense, layer 1 MoE.
        let glm = tiny_hparams(Arch::GlmDsa);
        let split = [
            blk::ATTN_K_B,
            blk::ATTN_V_B,
            blk::FFN_GATE_EXPS,
            blk::FFN_UP_EXPS,
        ];
        let mut fused: Vec<String> = tensor_names(&glm)
            .into_iter()
            .filter(|n| !names::split_blk(n).is_some_and(|(_, s)| split.contains(&s)))
            .collect();
        fused.extend([
            names::blk(0, blk::ATTN_KV_B),
            names::blk(1, blk::ATTN_KV_B),
            names::blk(1, blk::FFN_GATE_UP_EXPS),
        ]);
        let m = model(&glm, &fused);
        let w = Weights::new(&m).unwrap();
        assert!(unread(&w).is_empty());
        let experts = layer_steps(&glm, 1)
            .into_iter()
            .find(|s| s.op == Op::MoeExperts { layer: 1 })
            .unwrap();
        assert_eq!(
            experts.weights(&w),
            [
                "blk.1.ffn_gate_up_exps.weight",
                "blk.1.ffn_down_exps.weight"
            ]
        );
        assert_eq!(w.kv_b_names(0), ["blk.0.attn_kv_b.weight"]);

        let mut ds = tiny_hparams(Arch::Deepseek2);
        ds.q_lora_rank = None;
        ds.n_expert_shared = 0;
        let names: Vec<String> = tensor_names(&ds)
            .into_iter()
            .filter(|n| !n.ends_with(blk::EXP_PROBS_B))
            .collect();
        let m = model(&ds, &names);
        let w = Weights::new(&m).unwrap();
        assert!(unread(&w).is_empty());
        let route = layer_steps(&ds, 1)
            .into_iter()
            .find(|s| s.op == Op::MoeRoute { layer: 1 })
            .unwrap();
        assert!(route.weights(&w).is_empty());

        let mut both = tensor_names(&glm);
        both.extend((0..2).map(|l| names::blk(l, blk::ATTN_KV_B)));
        let m = model(&glm, &both);
        let w = Weights::new(&m).unwrap();
        let left: Vec<String> = unread(&w).into_iter().collect();
        assert_eq!(left, ["blk.0.attn_kv_b.weight", "blk.1.attn_kv_b.weight"]);
    }
}
