//! GGUF tensor names of glm-dsa / deepseek2 and their expected dimensions (`ne`, fastest first),
//! as in the architecture spec's section 3 table and llama.cpp's `load_arch_tensors`
//! (`src/models/glm-dsa.cpp`, `src/llama-model.cpp` for deepseek2).

use super::hparams::HParams;

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

/// One expected dimension of a tensor: its size and the metadata keys (`{arch}.` suffixes of
/// [`super::keys`]) it is made of. No key: the vocabulary (the rows of `token_embd.weight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpectedDim {
    /// The size the hyperparameters give.
    pub size: u64,
    /// The keys it comes from (a product or sum of them when more than one).
    pub keys: &'static [&'static str],
}

/// Expected `ne` of tensor `name`, each dimension with the metadata keys it comes from, for a
/// model with `hp` and `n_vocab` tokens; `None` when the name is not one the forward pass reads
/// (nothing to check).
pub fn expected_dims(hp: &HParams, n_vocab: usize, name: &str) -> Option<Vec<ExpectedDim>> {
    use super::keys::*;
    let u = |x: usize| x as u64;
    let d = |size: u64, keys: &'static [&'static str]| ExpectedDim { size, keys };
    let hidden = d(u(hp.hidden), &[EMBEDDING_LENGTH]);
    let vocab = d(u(n_vocab), &[]);
    let h = u(hp.n_head);
    let q_lora = d(hp.q_lora_rank.map(u).unwrap_or(0), &[ATTN_Q_LORA_RANK]);
    let kv_lora = d(u(hp.kv_lora_rank), &[ATTN_KV_LORA_RANK]);
    let (nope, rope, v) = (u(hp.qk_nope), u(hp.qk_rope), u(hp.v_head));
    let (e, ff, ff_exp) = (
        d(u(hp.n_expert), &[EXPERT_COUNT]),
        d(u(hp.n_ff), &[FEED_FORWARD_LENGTH]),
        d(u(hp.n_ff_exp), &[EXPERT_FEED_FORWARD_LENGTH]),
    );
    let ff_sh = d(
        ff_exp.size * u(hp.n_expert_shared),
        &[EXPERT_FEED_FORWARD_LENGTH, EXPERT_SHARED_COUNT],
    );
    match name {
        TOKEN_EMBD | OUTPUT => return Some(vec![hidden, vocab]),
        OUTPUT_NORM => return Some(vec![hidden]),
        _ => {}
    }
    let (_, suffix) = split_blk(name)?;
    let (ni, di) = hp
        .indexer
        .as_ref()
        .map_or((0, 0), |p| (u(p.n_head), u(p.head_dim)));
    let (ni, di) = (d(ni, &[INDEXER_HEAD_COUNT]), d(di, &[INDEXER_KEY_LENGTH]));
    let q_heads = d(h * (nope + rope), &[ATTN_HEAD_COUNT, ATTN_KEY_LENGTH_MLA]);
    use blk::*;
    Some(match suffix {
        ATTN_NORM | FFN_NORM => vec![hidden],
        ATTN_Q_A => vec![hidden, q_lora],
        ATTN_Q_A_NORM => vec![q_lora],
        ATTN_Q_B => vec![q_lora, q_heads],
        ATTN_Q => vec![hidden, q_heads],
        ATTN_KV_A_MQA => vec![
            hidden,
            d(
                kv_lora.size + rope,
                &[ATTN_KV_LORA_RANK, ROPE_DIMENSION_COUNT],
            ),
        ],
        ATTN_KV_A_NORM => vec![kv_lora],
        ATTN_K_B => vec![
            d(nope, &[ATTN_KEY_LENGTH_MLA, ROPE_DIMENSION_COUNT]),
            kv_lora,
            d(h, &[ATTN_HEAD_COUNT]),
        ],
        ATTN_V_B => vec![
            kv_lora,
            d(v, &[ATTN_VALUE_LENGTH_MLA]),
            d(h, &[ATTN_HEAD_COUNT]),
        ],
        ATTN_KV_B => vec![
            kv_lora,
            d(
                h * (nope + v),
                &[
                    ATTN_HEAD_COUNT,
                    ATTN_KEY_LENGTH_MLA,
                    ROPE_DIMENSION_COUNT,
                    ATTN_VALUE_LENGTH_MLA,
                ],
            ),
        ],
        ATTN_OUTPUT => vec![d(h * v, &[ATTN_HEAD_COUNT, ATTN_VALUE_LENGTH_MLA]), hidden],
        INDEXER_Q_B => vec![
            q_lora,
            d(ni.size * di.size, &[INDEXER_HEAD_COUNT, INDEXER_KEY_LENGTH]),
        ],
        INDEXER_K => vec![hidden, di],
        INDEXER_K_NORM | INDEXER_K_NORM_B => vec![di],
        INDEXER_PROJ => vec![hidden, ni],
        FFN_GATE | FFN_UP => vec![hidden, ff],
        FFN_DOWN => vec![ff, hidden],
        FFN_GATE_INP => vec![hidden, e],
        EXP_PROBS_B => vec![e],
        FFN_GATE_EXPS | FFN_UP_EXPS => vec![hidden, ff_exp, e],
        FFN_GATE_UP_EXPS => vec![hidden, d(2 * ff_exp.size, &[EXPERT_FEED_FORWARD_LENGTH]), e],
        FFN_DOWN_EXPS => vec![ff_exp, hidden, e],
        FFN_GATE_SHEXP | FFN_UP_SHEXP => vec![hidden, ff_sh],
        FFN_DOWN_SHEXP => vec![ff_sh, hidden],
        _ => return None,
    })
}

/// Expected `ne` of tensor `name` for a model with `hp` and `n_vocab` tokens, or `None` when the
/// name is not one the forward pass reads (nothing to check).
pub fn expected_ne(hp: &HParams, n_vocab: usize, name: &str) -> Option<Vec<u64>> {
    expected_dims(hp, n_vocab, name).map(|d| d.iter().map(|x| x.size).collect())
}

/// The first of `names` that is a tensor of a run layer (`blk.{L}.*`, `L < n_layer`) the forward
/// pass does not read, e.g. the projection biases the converter writes for a transformers config
/// with `attention_bias = true` (`attn_q_a.bias`, `attn_kv_a_mqa.bias`, `attn_output.bias`).
/// Ignoring one would silently compute a different function. MTP blocks (`L >= n_layer`) are not
/// run, so their tensors (`nextn.*`) are not looked at.
pub fn unknown_layer_tensor<'a>(
    hp: &HParams,
    mut names: impl Iterator<Item = &'a str>,
) -> Option<&'a str> {
    names.find(|name| {
        split_blk(name).is_some_and(|(l, _)| l < hp.n_layer) && expected_ne(hp, 0, name).is_none()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::{tensor_names, tiny_hparams};
    use crate::model::Arch;

    #[test]
    fn unknown_tensors_of_run_layers_are_found() {
        let mut hp = tiny_hparams(Arch::Deepseek2);
        hp.n_block = 3;
        hp.n_nextn = 1; // blk.2 is an MTP block: not run, not checked
        let mut all = tensor_names(&hp);
        all.push("blk.2.nextn.eh_proj.weight".into());
        all.push("blk.2.attn_q_a.bias".into());
        assert_eq!(
            unknown_layer_tensor(&hp, all.iter().map(String::as_str)),
            None
        );
        all.push("blk.1.attn_kv_a_mqa.bias".into());
        assert_eq!(
            unknown_layer_tensor(&hp, all.iter().map(String::as_str)),
            Some("blk.1.attn_kv_a_mqa.bias")
        );
    }

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
