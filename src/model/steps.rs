//! The ordered list of steps of a forward pass. Each step names its inputs and outputs by hook
//! name (`shared/spec/hooks.md`), so a driver can run them over any engine, chained (inputs from
//! the same engine) or replay (inputs taken from a reference run), and hand every output to a
//! trace sink. No arithmetic happens here; the step kinds are defined by the `Engine` trait.

use std::ops::Range;

use super::hparams::HParams;
use super::names::{self, blk};

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
}

/// `blk.{layer}.{point}`.
pub fn hook(layer: usize, point: &str) -> String {
    format!("blk.{layer}.{point}")
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
            lin(w(blk::FFN_GATE_INP)),
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
