//! GGUF tensor names of glm-dsa / deepseek2 and their expected dimensions (`ne`, fastest first),
//! as in the architecture spec's section 3 table and llama.cpp's `load_arch_tensors`
//! (`src/models/glm-dsa.cpp`, `src/llama-model.cpp` for deepseek2).

/// Token embedding `[hidden, vocab]`.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Final norm `[hidden]`.
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// Output projection `[hidden, vocab]` (absent: tied to [`TOKEN_EMBD`]).
pub const OUTPUT: &str = "output.weight";

/// Per-layer tensor suffixes (`blk.{L}.{suffix}`).
pub mod blk {
    /// Attention input RMSNorm.
    pub const ATTN_NORM: &str = "attn_norm.weight";
    /// Query down-projection (q_lora).
    pub const ATTN_Q_A: &str = "attn_q_a.weight";
    /// Query latent RMSNorm.
    pub const ATTN_Q_A_NORM: &str = "attn_q_a_norm.weight";
    /// Query up-projection.
    pub const ATTN_Q_B: &str = "attn_q_b.weight";
    /// Plain query projection of models without q_lora (DeepSeek-V2-Lite).
    pub const ATTN_Q: &str = "attn_q.weight";
    /// KV down-projection `[c_kv | k_pe]`.
    pub const ATTN_KV_A_MQA: &str = "attn_kv_a_mqa.weight";
    /// KV latent RMSNorm.
    pub const ATTN_KV_A_NORM: &str = "attn_kv_a_norm.weight";
    /// K part of kv_b, per head transposed.
    pub const ATTN_K_B: &str = "attn_k_b.weight";
    /// V part of kv_b.
    pub const ATTN_V_B: &str = "attn_v_b.weight";
    /// Unsplit kv_b of older files.
    pub const ATTN_KV_B: &str = "attn_kv_b.weight";
    /// Attention output projection.
    pub const ATTN_OUTPUT: &str = "attn_output.weight";
    /// DSA indexer query projection.
    pub const INDEXER_Q_B: &str = "indexer.attn_q_b.weight";
    /// DSA indexer key projection.
    pub const INDEXER_K: &str = "indexer.attn_k.weight";
    /// DSA indexer key LayerNorm weight.
    pub const INDEXER_K_NORM: &str = "indexer.k_norm.weight";
    /// DSA indexer key LayerNorm bias.
    pub const INDEXER_K_NORM_B: &str = "indexer.k_norm.bias";
    /// DSA indexer head weights projection.
    pub const INDEXER_PROJ: &str = "indexer.proj.weight";
    /// FFN input RMSNorm.
    pub const FFN_NORM: &str = "ffn_norm.weight";
    /// Dense MLP gate.
    pub const FFN_GATE: &str = "ffn_gate.weight";
    /// Dense MLP up.
    pub const FFN_UP: &str = "ffn_up.weight";
    /// Dense MLP down.
    pub const FFN_DOWN: &str = "ffn_down.weight";
    /// Router.
    pub const FFN_GATE_INP: &str = "ffn_gate_inp.weight";
    /// Expert selection bias (e_score_correction_bias).
    pub const EXP_PROBS_B: &str = "exp_probs_b.bias";
    /// Stacked expert gates.
    pub const FFN_GATE_EXPS: &str = "ffn_gate_exps.weight";
    /// Stacked expert ups.
    pub const FFN_UP_EXPS: &str = "ffn_up_exps.weight";
    /// Stacked expert gates and ups fused (`--fuse-gate-up-exps`): per expert, gate rows then up rows.
    pub const FFN_GATE_UP_EXPS: &str = "ffn_gate_up_exps.weight";
    /// Stacked expert downs.
    pub const FFN_DOWN_EXPS: &str = "ffn_down_exps.weight";
    /// Shared expert gate.
    pub const FFN_GATE_SHEXP: &str = "ffn_gate_shexp.weight";
    /// Shared expert up.
    pub const FFN_UP_SHEXP: &str = "ffn_up_shexp.weight";
    /// Shared expert down.
    pub const FFN_DOWN_SHEXP: &str = "ffn_down_shexp.weight";
}

/// `blk.{layer}.{suffix}`.
pub fn blk(layer: usize, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

/// Splits `blk.{L}.{suffix}` into `(L, suffix)`.
pub fn split_blk(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (l, suffix) = rest.split_once('.')?;
    Some((l.parse().ok()?, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_names_split() {
        assert_eq!(blk(12, blk::ATTN_Q_B), "blk.12.attn_q_b.weight");
        assert_eq!(
            split_blk("blk.3.indexer.k_norm.bias"),
            Some((3, "indexer.k_norm.bias"))
        );
        assert_eq!(split_blk("output.weight"), None);
        assert_eq!(split_blk("blk.x.attn_norm.weight"), None);
    }
}
