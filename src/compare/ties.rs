//! The reference's scores behind each selection ([`ScoreBook`]): kept by the comparison as the
//! score hooks pass, they judge a selection's flips and answer what the driver asks back about
//! near ties ([`NearTies`]: the alternatives of a selection, the rows where a candidate's
//! selection differs only by near ties). The driver reads them through a [`SharedScores`] it
//! is handed apart from the sink: the sink only receives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::floors::point_of;
use super::selection::{near_tie_rows, near_tie_swaps, Scores};
use crate::model::names::split_blk;
use crate::tensor::HostTensor;
use crate::trace::{Mode, NearTies, Swap};

/// The latest score hook of one kind in one mode, kept for the selection after it.
#[derive(Clone, Debug)]
struct KeptScores {
    /// Hook name.
    hook: String,
    /// The reference's scores.
    reference: HostTensor,
    /// The candidate's own scores, where it has them.
    candidate: Option<HostTensor>,
    /// The relative error the scores may carry (`comparison`'s module documentation, Margins).
    rel: f64,
}

/// The reference's latest scores per (mode, score point), with what a selection adds to them:
/// the selection bias per MoE layer and the expert groups.
#[derive(Clone, Debug, Default)]
pub struct ScoreBook {
    kept: HashMap<(Mode, &'static str), KeptScores>,
    selection_bias: HashMap<usize, Vec<f32>>,
    groups: Option<(usize, usize)>,
}

impl ScoreBook {
    /// An empty book for a model with `selection_bias` per MoE layer and expert `groups`.
    pub fn new(selection_bias: HashMap<usize, Vec<f32>>, groups: Option<(usize, usize)>) -> Self {
        ScoreBook {
            kept: HashMap::new(),
            selection_bias,
            groups,
        }
    }

    /// Keeps the reference's scores of score hook `name` (and the candidate's, when compared)
    /// for judging the selection after it, with the relative error `rel` they may carry.
    /// Hooks other than `moe_probs` and `indexer_scores` are not kept.
    pub fn keep(
        &mut self,
        name: &str,
        mode: Mode,
        reference: HostTensor,
        candidate: Option<HostTensor>,
        rel: f64,
    ) {
        let sp: &'static str = match point_of(name) {
            "moe_probs" => "moe_probs",
            "indexer_scores" => "indexer_scores",
            _ => return,
        };
        self.kept.insert(
            (mode, sp),
            KeptScores {
                hook: name.to_string(),
                reference,
                candidate,
                rel,
            },
        );
    }

    /// The reference's scores behind selection hook `name` in `mode`, if they were kept: the
    /// same layer's `indexer_scores` / `moe_probs`, or, for a shared DSA layer, the layer whose
    /// selection it reuses (the latest one kept).
    pub fn scores_for(&self, name: &str, mode: Mode) -> Option<Scores<'_>> {
        let (layer, point) = split_blk(name)?;
        let sp: &'static str = match point {
            "indexer_topk" => "indexer_scores",
            "moe_topk_ids" => "moe_probs",
            _ => return None,
        };
        let KeptScores {
            hook,
            reference: t,
            candidate,
            rel,
        } = self.kept.get(&(mode, sp))?;
        let src_layer = split_blk(hook).map(|(l, _)| l)?;
        if sp == "moe_probs" && src_layer != layer {
            return None;
        }
        let values = t.as_f32(hook).ok()?;
        let cols = *t.shape.last()?;
        let bias = if sp == "moe_probs" {
            self.selection_bias.get(&layer).map(Vec::as_slice)
        } else {
            None
        };
        Some(Scores {
            values,
            cols,
            bias,
            rel_tol: *rel,
            implied: None,
            groups: if sp == "moe_probs" { self.groups } else { None },
            candidate: candidate
                .as_ref()
                .filter(|c| c.shape == t.shape)
                .and_then(|c| c.as_f32(hook).ok()),
        })
    }
}

impl NearTies for ScoreBook {
    fn near_ties(
        &self,
        selection: &str,
        mode: Mode,
        chosen: &HostTensor,
        per_row: usize,
    ) -> Vec<Swap> {
        let Some(scores) = self.scores_for(selection, mode) else {
            return Vec::new();
        };
        let (Ok(ids), Some(&width)) = (chosen.as_i32(selection), chosen.shape.last()) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (t, row) in ids.chunks(width.max(1)).enumerate() {
            for s in near_tie_swaps(&scores, t, row, per_row) {
                out.push(Swap {
                    row: t,
                    left: s.left,
                    entered: s.entered,
                    margin: s.margin,
                    tolerance: s.tolerance,
                });
            }
        }
        out
    }

    fn near_tie_rows(
        &self,
        selection: &str,
        mode: Mode,
        reference: &HostTensor,
        candidate: &HostTensor,
    ) -> Vec<usize> {
        let (Ok(r), Ok(c), Some(&width)) = (
            reference.as_i32(selection),
            candidate.as_i32(selection),
            reference.shape.last(),
        ) else {
            return Vec::new();
        };
        if reference.shape != candidate.shape {
            return Vec::new();
        }
        let scores = self.scores_for(selection, mode);
        near_tie_rows(r, c, width, scores.as_ref())
    }
}

/// A [`ScoreBook`] the comparison writes and the driver reads ([`NearTies`]), shared between
/// the two (clones are the same book).
#[derive(Clone, Debug, Default)]
pub struct SharedScores(Arc<Mutex<ScoreBook>>);

impl SharedScores {
    /// Shares `book`.
    pub fn new(book: ScoreBook) -> Self {
        SharedScores(Arc::new(Mutex::new(book)))
    }

    /// Runs `f` on the book (a panic elsewhere while it was held leaves it as it was).
    fn with<T>(&self, f: impl FnOnce(&mut ScoreBook) -> T) -> T {
        let mut book = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut book)
    }

    /// [`ScoreBook::keep`].
    pub fn keep(
        &self,
        name: &str,
        mode: Mode,
        reference: HostTensor,
        candidate: Option<HostTensor>,
        rel: f64,
    ) {
        self.with(|b| b.keep(name, mode, reference, candidate, rel));
    }
}

impl NearTies for SharedScores {
    fn near_ties(
        &self,
        selection: &str,
        mode: Mode,
        chosen: &HostTensor,
        per_row: usize,
    ) -> Vec<Swap> {
        self.with(|b| b.near_ties(selection, mode, chosen, per_row))
    }

    fn near_tie_rows(
        &self,
        selection: &str,
        mode: Mode,
        reference: &HostTensor,
        candidate: &HostTensor,
    ) -> Vec<usize> {
        self.with(|b| b.near_tie_rows(selection, mode, reference, candidate))
    }
}
