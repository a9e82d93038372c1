//! GGUF metadata keys of the supported architectures, as `{arch}.{suffix}` suffixes (gguf-py
//! `gguf/constants.py`: `Keys.LLM`, `Keys.Attention`, `Keys.Attention.Indexer`, `Keys.Rope`).
//! The one spelling of each key: [`super::hparams`] reads them and `crate::synth` writes them.

/// `{arch}.context_length`.
pub const CONTEXT_LENGTH: &str = "context_length";
/// `{arch}.embedding_length`.
pub const EMBEDDING_LENGTH: &str = "embedding_length";
/// `{arch}.block_count` (MTP blocks included).
pub const BLOCK_COUNT: &str = "block_count";
/// `{arch}.nextn_predict_layers` (MTP blocks at the end).
pub const NEXTN_PREDICT_LAYERS: &str = "nextn_predict_layers";
/// `{arch}.feed_forward_length`.
pub const FEED_FORWARD_LENGTH: &str = "feed_forward_length";
/// `{arch}.vocab_size`.
pub const VOCAB_SIZE: &str = "vocab_size";
/// `{arch}.leading_dense_block_count`.
pub const LEADING_DENSE_BLOCK_COUNT: &str = "leading_dense_block_count";

/// `{arch}.attention.head_count`.
pub const ATTN_HEAD_COUNT: &str = "attention.head_count";
/// `{arch}.attention.head_count_kv`.
pub const ATTN_HEAD_COUNT_KV: &str = "attention.head_count_kv";
/// `{arch}.attention.key_length` (the latent width in MLA-split files).
pub const ATTN_KEY_LENGTH: &str = "attention.key_length";
/// `{arch}.attention.value_length` (the latent width in MLA-split files).
pub const ATTN_VALUE_LENGTH: &str = "attention.value_length";
/// `{arch}.attention.key_length_mla` (query/key head width).
pub const ATTN_KEY_LENGTH_MLA: &str = "attention.key_length_mla";
/// `{arch}.attention.value_length_mla` (value head width).
pub const ATTN_VALUE_LENGTH_MLA: &str = "attention.value_length_mla";
/// `{arch}.attention.q_lora_rank`.
pub const ATTN_Q_LORA_RANK: &str = "attention.q_lora_rank";
/// `{arch}.attention.kv_lora_rank`.
pub const ATTN_KV_LORA_RANK: &str = "attention.kv_lora_rank";
/// `{arch}.attention.layer_norm_rms_epsilon`.
pub const ATTN_LAYERNORM_RMS_EPS: &str = "attention.layer_norm_rms_epsilon";

/// `{arch}.attention.indexer.head_count`.
pub const INDEXER_HEAD_COUNT: &str = "attention.indexer.head_count";
/// `{arch}.attention.indexer.key_length`.
pub const INDEXER_KEY_LENGTH: &str = "attention.indexer.key_length";
/// `{arch}.attention.indexer.top_k`.
pub const INDEXER_TOP_K: &str = "attention.indexer.top_k";
/// `{arch}.attention.indexer.types` (per layer: true = full, false = shared).
pub const INDEXER_TYPES: &str = "attention.indexer.types";

/// `{arch}.rope.dimension_count`.
pub const ROPE_DIMENSION_COUNT: &str = "rope.dimension_count";
/// `{arch}.rope.freq_base`.
pub const ROPE_FREQ_BASE: &str = "rope.freq_base";
/// `{arch}.rope.scaling.type` (`none` or `yarn`).
pub const ROPE_SCALING_TYPE: &str = "rope.scaling.type";
/// `{arch}.rope.scaling.factor`.
pub const ROPE_SCALING_FACTOR: &str = "rope.scaling.factor";
/// `{arch}.rope.scaling.original_context_length`.
pub const ROPE_SCALING_ORIG_CTX_LEN: &str = "rope.scaling.original_context_length";
/// `{arch}.rope.scaling.yarn_log_multiplier` (0.1 * mscale_all_dim).
pub const ROPE_SCALING_YARN_LOG_MUL: &str = "rope.scaling.yarn_log_multiplier";
/// `{arch}.rope.scaling.yarn_beta_fast`.
pub const ROPE_SCALING_YARN_BETA_FAST: &str = "rope.scaling.yarn_beta_fast";
/// `{arch}.rope.scaling.yarn_beta_slow`.
pub const ROPE_SCALING_YARN_BETA_SLOW: &str = "rope.scaling.yarn_beta_slow";
/// `{arch}.rope.scaling.yarn_attn_factor` (the key llama.cpp's converter writes).
pub const ROPE_SCALING_YARN_ATTN_FACTOR: &str = "rope.scaling.yarn_attn_factor";
/// `{arch}.rope.scaling.attn_factor` (the generic spelling).
pub const ROPE_SCALING_ATTN_FACTOR: &str = "rope.scaling.attn_factor";

/// `{arch}.expert_count`.
pub const EXPERT_COUNT: &str = "expert_count";
/// `{arch}.expert_used_count`.
pub const EXPERT_USED_COUNT: &str = "expert_used_count";
/// `{arch}.expert_shared_count`.
pub const EXPERT_SHARED_COUNT: &str = "expert_shared_count";
/// `{arch}.expert_group_count`.
pub const EXPERT_GROUP_COUNT: &str = "expert_group_count";
/// `{arch}.expert_group_used_count`.
pub const EXPERT_GROUP_USED_COUNT: &str = "expert_group_used_count";
/// `{arch}.expert_feed_forward_length`.
pub const EXPERT_FEED_FORWARD_LENGTH: &str = "expert_feed_forward_length";
/// `{arch}.expert_weights_scale` (routed_scaling_factor).
pub const EXPERT_WEIGHTS_SCALE: &str = "expert_weights_scale";
/// `{arch}.expert_weights_norm` (norm_topk_prob).
pub const EXPERT_WEIGHTS_NORM: &str = "expert_weights_norm";
/// `{arch}.expert_gating_func` (1 softmax, 2 sigmoid).
pub const EXPERT_GATING_FUNC: &str = "expert_gating_func";

/// The full key `{arch}.{suffix}`.
pub fn arch_key(arch: &str, suffix: &str) -> String {
    format!("{arch}.{suffix}")
}
