//! The shape and kind (floats or integer ids) of each hook of `docs/hooks.md` for one
//! model and one prompt length: what a trace made for the model must hold, so that a trace of
//! another architecture, another model's dimensions or another prompt is refused before a run
//! rather than compared. The shapes are those the step list ([`super::steps`]) documents for
//! each point and the engines produce.

use super::hparams::HParams;
use super::names::split_blk;
use super::steps::point;

/// One dimension of a hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookDim {
    /// The number of prompt tokens.
    Tokens,
    /// A size the model gives.
    Size(usize),
    /// Any size (the rows of one expert's output: the tokens routed to it).
    Any,
}

/// What hook `name` holds for a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookShape {
    /// Dimensions, PyTorch order.
    pub dims: Vec<HookDim>,
    /// Integer ids (`indexer_topk`, `moe_topk_ids`) rather than floats.
    pub ids: bool,
}

impl HookShape {
    /// Whether `shape` fits for `t` tokens.
    pub fn fits(&self, shape: &[usize], t: usize) -> bool {
        shape.len() == self.dims.len()
            && self.dims.iter().zip(shape).all(|(d, &n)| match d {
                HookDim::Tokens => n == t,
                HookDim::Size(s) => n == *s,
                HookDim::Any => true,
            })
    }

    /// Whether `shape` would fit if only the token dimensions were allowed any size (so the
    /// difference is the number of tokens, not the model).
    pub fn fits_but_tokens(&self, shape: &[usize]) -> bool {
        shape.len() == self.dims.len()
            && self.dims.iter().zip(shape).all(|(d, &n)| match d {
                HookDim::Size(s) => n == *s,
                HookDim::Tokens | HookDim::Any => true,
            })
    }

    /// The shape for `t` tokens, `?` for a free dimension, e.g. `[5, 64]` or `[?, 64]`.
    pub fn show(&self, t: usize) -> String {
        let d: Vec<String> = self
            .dims
            .iter()
            .map(|d| match d {
                HookDim::Tokens => t.to_string(),
                HookDim::Size(s) => s.to_string(),
                HookDim::Any => "?".to_string(),
            })
            .collect();
        format!("[{}]", d.join(", "))
    }
}

/// The points of the selection hooks: what a step keeps (the DSA keys, the routed experts) and
/// the expert weights that go with the experts kept. Their last axis is how many it keeps.
pub const SELECTION_POINTS: [&str; 3] =
    [point::INDEXER_TOPK, point::MOE_TOPK_IDS, point::MOE_WEIGHTS];

/// For a selection hook `name` (one of [`SELECTION_POINTS`]) of `shape`, whose shape the model
/// gives as `want` for `t` tokens and which differs from it only in its last axis: `(the width
/// it has, the model's width)`. An engine that keeps another number of keys or experts than the
/// model says writes such a hook: a finding to judge at the hook, not a trace written wrong.
/// `None` for any other hook or difference.
pub fn other_selection_width(
    name: &str,
    want: &HookShape,
    shape: &[usize],
    t: usize,
) -> Option<(usize, usize)> {
    let (_, p) = split_blk(name)?;
    if !SELECTION_POINTS.contains(&p) {
        return None;
    }
    let (&[rows, have], [first, last]) = (shape, want.dims.as_slice()) else {
        return None;
    };
    let model = match last {
        HookDim::Tokens => t,
        HookDim::Size(s) => *s,
        HookDim::Any => return None,
    };
    let rows_fit = match first {
        HookDim::Tokens => rows == t,
        HookDim::Size(s) => rows == *s,
        HookDim::Any => true,
    };
    (rows_fit && have != model && have > 0).then_some((have, model))
}

/// The shape of hook `name` in a model with `hp` and `n_vocab` tokens of vocabulary, for a
/// prompt of `t` tokens; `None` for a name that is not a hook of this model (an unknown point,
/// a dense layer's point in a MoE layer or the reverse, the indexer's points without an
/// indexer, the query latent without `q_lora`, an expert past the count). The layer number is
/// not checked here.
pub fn hook_shape(hp: &HParams, n_vocab: usize, t: usize, name: &str) -> Option<HookShape> {
    use HookDim::{Any, Size, Tokens};
    let f = |dims: Vec<HookDim>| Some(HookShape { dims, ids: false });
    let hidden = Size(hp.hidden);
    match name {
        point::TOKEN_EMBD | point::RESULT_NORM => return f(vec![Tokens, hidden]),
        point::LOGITS => return f(vec![Tokens, Size(n_vocab)]),
        _ => {}
    }
    let (l, p) = split_blk(name)?;
    let h = hp.n_head;
    if let Some(rest) = p.strip_prefix("exp.") {
        let e: usize = rest.strip_suffix(".out")?.parse().ok()?;
        return (!hp.is_dense(l) && e < hp.n_expert).then(|| HookShape {
            dims: vec![Any, hidden],
            ids: false,
        });
    }
    let dense = hp.is_dense(l);
    match p {
        point::ATTN_NORM
        | point::ATTN_OUT
        | point::FFN_INP
        | point::FFN_NORM
        | point::FFN_OUT
        | point::L_OUT => f(vec![Tokens, hidden]),
        point::Q_A | point::Q_A_NORM => f(vec![Tokens, Size(hp.q_lora_rank?)]),
        point::Q_B => f(vec![Tokens, Size(h * hp.qk_head())]),
        point::Q_PE_ROPE => f(vec![Tokens, Size(h), Size(hp.qk_rope)]),
        point::KV_A => f(vec![Tokens, Size(hp.kv_lora_rank + hp.qk_rope)]),
        point::KV_A_NORM => f(vec![Tokens, Size(hp.kv_lora_rank)]),
        point::K_PE_ROPE => f(vec![Tokens, Size(hp.qk_rope)]),
        point::INDEXER_SCORES => {
            hp.indexer.as_ref()?;
            f(vec![Tokens, Tokens])
        }
        point::INDEXER_TOPK => {
            let k = hp.indexer.as_ref()?.top_k;
            Some(HookShape {
                dims: vec![Tokens, if k >= t { Tokens } else { Size(k) }],
                ids: true,
            })
        }
        point::ATTN_HEADS => f(vec![Tokens, Size(h * hp.v_head)]),
        point::ATTN_PROBS => f(vec![Size(h), Tokens, Tokens]),
        point::FFN_GATE | point::FFN_UP | point::FFN_ACT if dense => f(vec![Tokens, Size(hp.n_ff)]),
        point::MOE_LOGITS | point::MOE_PROBS if !dense => f(vec![Tokens, Size(hp.n_expert)]),
        point::MOE_TOPK_IDS if !dense => Some(HookShape {
            dims: vec![Tokens, Size(hp.n_expert_used)],
            ids: true,
        }),
        point::MOE_WEIGHTS if !dense => f(vec![Tokens, Size(hp.n_expert_used)]),
        point::MOE_ROUTED | point::FFN_SHEXP if !dense => f(vec![Tokens, hidden]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::tiny_hparams;
    use crate::model::Arch;

    /// The tiny model (hidden 16, 2 heads of 6 + 4, v 5, kv_lora 8, 4 experts, 2 used, top_k 3,
    /// layer 0 dense): shapes worked out by hand from those numbers.
    #[test]
    fn shapes_of_the_tiny_model() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let s = |name: &str, t: usize| hook_shape(&hp, 32, t, name).map(|s| s.show(t));
        assert_eq!(s("token_embd", 5).as_deref(), Some("[5, 16]"));
        assert_eq!(s("logits", 5).as_deref(), Some("[5, 32]"));
        assert_eq!(s("blk.0.q_b", 5).as_deref(), Some("[5, 20]"));
        assert_eq!(s("blk.0.q_pe_rope", 5).as_deref(), Some("[5, 2, 4]"));
        assert_eq!(s("blk.0.kv_a", 5).as_deref(), Some("[5, 12]"));
        assert_eq!(s("blk.0.attn_heads", 5).as_deref(), Some("[5, 10]"));
        assert_eq!(s("blk.0.indexer_topk", 5).as_deref(), Some("[5, 3]"));
        assert_eq!(s("blk.0.indexer_topk", 2).as_deref(), Some("[2, 2]"));
        assert_eq!(s("blk.0.attn_probs", 5).as_deref(), Some("[2, 5, 5]"));
        assert_eq!(s("blk.0.ffn_gate", 5).as_deref(), Some("[5, 24]"));
        assert_eq!(s("blk.1.ffn_gate", 5), None);
        assert_eq!(s("blk.1.moe_probs", 5).as_deref(), Some("[5, 4]"));
        assert_eq!(s("blk.1.moe_topk_ids", 5).as_deref(), Some("[5, 2]"));
        assert_eq!(s("blk.1.exp.3.out", 5).as_deref(), Some("[?, 16]"));
        assert_eq!(s("blk.1.exp.4.out", 5), None);
        assert_eq!(s("blk.0.moe_probs", 5), None);
        assert_eq!(s("blk.0.unknown", 5), None);
        assert!(hook_shape(&hp, 32, 5, "blk.1.moe_topk_ids").unwrap().ids);
        let ds = tiny_hparams(Arch::Deepseek2);
        assert_eq!(hook_shape(&ds, 32, 5, "blk.0.indexer_scores"), None);
        let shape = hook_shape(&hp, 32, 3, "blk.0.q_b").unwrap();
        assert!(shape.fits(&[3, 20], 3));
        assert!(!shape.fits(&[12, 20], 3) && shape.fits_but_tokens(&[12, 20]));
        assert!(!shape.fits_but_tokens(&[3, 40]));
    }
}
