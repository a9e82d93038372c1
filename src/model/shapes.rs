//! Tensor shapes from the hyperparameters: what each tensor the forward pass reads must measure
//! (every dimension with the metadata keys it comes from), and the hyperparameters of a model
//! checked against its tensors before anything is sized from them.

use anyhow::{bail, Result};

use super::hparams::{HParams, Keys, TensorCheck};
use super::keys;
use super::names::{self, blk, split_blk, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use crate::gguf::Model;

impl HParams {
    /// Reads the hyperparameters of `model` and checks them against its tensors before anything
    /// is sized from them: `block_count` against the layers the file holds (every run layer
    /// there, no tensor of a block past the count), `vocab_size` against `token_embd.weight`,
    /// and every tensor the forward pass reads against the shape the hyperparameters give it.
    /// An error names the key, its value, and the tensor and shape it disagrees with. Fails for
    /// any architecture but glm-dsa and deepseek2.
    pub fn from_model(model: &Model) -> Result<HParams> {
        let hp = Self::derive(model, TensorCheck::Complete)?;
        check_shapes(model, &hp)?;
        Ok(hp)
    }

    /// [`HParams::from_model`] for a file that holds only some of a model's tensors with its
    /// metadata (a step case): the tensors present are checked, none is required.
    pub fn from_partial_model(model: &Model) -> Result<HParams> {
        let hp = Self::derive(model, TensorCheck::Partial)?;
        check_shapes(model, &hp)?;
        Ok(hp)
    }
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

/// Every tensor the forward pass reads against the shape `hp` gives it, and `vocab_size` (when
/// present) against the rows of `token_embd.weight`.
fn check_shapes(model: &Model, hp: &HParams) -> Result<()> {
    let k = &Keys {
        model,
        arch: hp.arch.as_str(),
    };
    let path = model.path().display();
    let rows = |name: &str| {
        model
            .find(name)
            .filter(|t| t.info.ne.len() == 2)
            .map(|t| t.info.ne[1])
    };
    let n_vocab = rows(names::TOKEN_EMBD).or_else(|| rows(names::OUTPUT));
    if let (Some(v), Some(n)) = (k.opt_usize(keys::VOCAB_SIZE)?, rows(names::TOKEN_EMBD)) {
        if v as u64 != n {
            bail!(
                "model: {path}: metadata {} = {v} disagrees with tensor {}: it has {n} rows (ne[1])",
                k.key(keys::VOCAB_SIZE),
                names::TOKEN_EMBD
            );
        }
    }
    let n_vocab = n_vocab.unwrap_or(0) as usize;
    for t in model.tensors() {
        let name = &t.info.name;
        let Some(want) = expected_dims(hp, n_vocab, name) else {
            continue;
        };
        let ne = &t.info.ne;
        let torch = |ne: &[u64]| ne.iter().rev().copied().collect::<Vec<_>>();
        let want_ne: Vec<u64> = want.iter().map(|d| d.size).collect();
        if ne.len() != want.len() {
            bail!(
                "model: {path}: tensor {name} has ne={ne:?} (PyTorch {:?}), but the {} metadata gives it ne={want_ne:?} (PyTorch {:?})",
                torch(ne),
                hp.arch.as_str(),
                torch(&want_ne)
            );
        }
        let Some(i) = (0..ne.len()).find(|&i| ne[i] != want[i].size) else {
            continue;
        };
        let d = want[i];
        if d.keys.is_empty() {
            bail!(
                "model: {path}: tensor {name} has ne={ne:?} (PyTorch {:?}): its ne[{i}] = {} is not the vocabulary of {} ({})",
                torch(ne),
                ne[i],
                names::TOKEN_EMBD,
                d.size
            );
        }
        let shown: Vec<String> = d.keys.iter().map(|s| key_and_value(k, s)).collect();
        let (what, verb) = if shown.len() == 1 {
            (shown[0].clone(), "disagrees")
        } else {
            (
                format!("{} (giving {})", shown.join(", "), d.size),
                "disagree",
            )
        };
        bail!(
            "model: {path}: metadata {what} {verb} with tensor {name}: its ne[{i}] is {}, not {} (ne={ne:?}, PyTorch {:?}; the metadata gives ne={want_ne:?})",
            ne[i],
            d.size,
            torch(ne)
        );
    }
    Ok(())
}

/// `{arch}.{suffix} = value` as the file holds it; a head width read from the legacy
/// `key_length`/`value_length` when the `_mla` key is absent.
fn key_and_value(k: &Keys<'_>, suffix: &str) -> String {
    let legacy = match suffix {
        keys::ATTN_KEY_LENGTH_MLA => Some(keys::ATTN_KEY_LENGTH),
        keys::ATTN_VALUE_LENGTH_MLA => Some(keys::ATTN_VALUE_LENGTH),
        _ => None,
    };
    let suffix = match legacy {
        Some(l) if k.get(suffix).is_none() && k.get(l).is_some() => l,
        _ => suffix,
    };
    match k.get(suffix) {
        Some(v) => format!("{} = {}", k.key(suffix), v.summary(4)),
        None => format!("{} (absent)", k.key(suffix)),
    }
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
}
