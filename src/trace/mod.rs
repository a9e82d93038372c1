//! Hook selection, sinks and trace files.
//!
//! A [`Sink`] receives hook tensors from the driver. The driver asks [`Sink::wants`] *before* it
//! downloads a tensor from an engine, so unwatched tensors never leave the device.
//! [`HookFilter`] is the selection behind `--layers` and `--hook`; [`TraceSink`] keeps what the
//! filter wants and writes a safetensors trace ([`file`](mod@file)). A [`PairSink`] receives
//! (reference, candidate) pairs from the two-engine driver, in a [`Mode`]. [`cache`] keeps the
//! reference's residual stream on disk so that a run can start at any layer. [`check`] refuses a
//! trace that does not fit the model (or the other trace) it is compared with; [`digest`] says
//! which model file a trace was made from.

pub mod cache;
pub mod check;
pub mod digest;
pub mod file;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::model::names::split_blk;
use crate::model::steps::{point, Step};
use crate::tensor::{HostData, HostTensor};
use crate::util::glob::matches_any;

pub use file::{
    read_trace, write_trace, Trace, TraceFile, TraceMeta, TraceTensor, TraceValues,
    TRACE_FORMAT_VERSION,
};

/// How a candidate's hook was obtained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every step from the same inputs on both sides: the step's own error.
    Replay,
    /// Each side on its own earlier outputs: the error accumulated up to the hook.
    #[default]
    Chained,
}

impl Mode {
    /// The metadata / JSON word: `replay` or `chained`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Replay => "replay",
            Mode::Chained => "chained",
        }
    }

    /// Parses the metadata word; `isolated` (files written before the wording settled) means
    /// replay.
    pub fn parse(s: &str) -> Result<Mode> {
        match s.trim() {
            "replay" | "isolated" => Ok(Mode::Replay),
            "chained" => Ok(Mode::Chained),
            other => bail!("trace: mode {other:?} is neither replay nor chained"),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One hook of both sides, as the two-engine driver hands it over.
#[derive(Debug)]
pub struct Pair<'s> {
    /// Hook name.
    pub name: &'s str,
    /// How the candidate's value was obtained.
    pub mode: Mode,
    /// The hooks the step producing it read (its upstream).
    pub inputs: &'s [String],
    /// The reference's value.
    pub reference: HostTensor,
    /// The candidate's value.
    pub candidate: HostTensor,
    /// How the inputs were chosen, when not as the mode says (e.g. a selection a trace lacks,
    /// taken from the reference).
    pub note: Option<String>,
}

/// One near-tie alternative of a selection row: the ids `left` (selected by the reference)
/// replaced by `entered`, whose scores by the reference's own values differ by `margin`, within
/// `tolerance` (see `compare::selection`).
#[derive(Clone, Debug, PartialEq)]
pub struct Swap {
    /// Row (token).
    pub row: usize,
    /// The ids the reference selected that leave.
    pub left: Vec<i32>,
    /// The ids that enter in their place, as many.
    pub entered: Vec<i32>,
    /// The reference's score gap between the two.
    pub margin: f64,
    /// What the gap may be for a near tie.
    pub tolerance: f64,
}

/// A sink's answers to the driver's questions ([`PairSink::wants`] and the `wants_*` family),
/// given apart from the sink so that the sink can take its calls on a thread of its own while
/// the driver goes on ([`PairSink::answers`]). They may say yes where the sink itself would say
/// no (it is then handed values it would not have asked for, and its results are the same);
/// never no where it would say yes.
#[derive(Clone)]
pub struct Answers {
    /// [`PairSink::wants`].
    pub wants: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    /// [`PairSink::wants_replay_inputs`], for every step.
    pub replay_inputs: bool,
    /// [`PairSink::wants_reference_experts`], for every step.
    pub reference_experts: bool,
    /// [`PairSink::wants_chained_inputs`], for every step.
    pub chained_inputs: bool,
}

/// Receives (reference, candidate) pairs.
pub trait PairSink {
    /// The sink's answers to the driver's questions, for the whole pass, when they do not
    /// depend on what it has been handed (then the driver may hand it its calls on another
    /// thread, in order, and go on meanwhile). Default: none (every call is made on the
    /// driver's thread).
    fn answers(&self) -> Option<Answers> {
        None
    }
    /// Whether the sink compares hook `name` (asked before anything is downloaded).
    fn wants(&self, name: &str) -> bool;
    /// One pair (only for names [`PairSink::wants`] accepted).
    fn record(&mut self, pair: Pair<'_>) -> Result<()>;
    /// Hook `name` could not be compared in `mode`, and why.
    fn missing(&mut self, name: &str, mode: Mode, why: &str);
    /// Whether the sink takes the inputs of replayed steps ([`PairSink::replay_inputs`]): asked
    /// before each replayed step, so that nothing is copied for a sink that does not. Default: no.
    fn wants_replay_inputs(&self) -> bool {
        false
    }
    /// The host values replay fed both sides of `step` (one per `step.inputs`, in order), handed
    /// over before the step's pairs. Default: ignored.
    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        let _ = (step, inputs);
    }
    /// The reference's value of hook `name` in `mode`, computed by a step that read `inputs`,
    /// where the candidate has none (a hook a trace lacks): the reference's own scores for
    /// judging selections, and in replay a step inside a segment (the reference runs from the
    /// trace's nearest hooks through the ones it lacks). Handed over for every such hook, wanted
    /// or not, before any pair that reads it. Default: ignored.
    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        let _ = (name, mode, inputs, reference);
    }
    /// The reference's chain took the candidate's selection in `rows` of `selection` (its pair
    /// handed over before): what is computed from it on is compared with the candidate again,
    /// not excused as drift. Default: ignored.
    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        let _ = (selection, mode, rows);
    }
    /// Whether the sink takes the reference's own run of routed-experts step `step`
    /// ([`PairSink::reference_experts`]): asked before the reference runs it, so that the
    /// reference keeps each expert's outputs only for a sink that does. Default: no.
    fn wants_reference_experts(&self, step: &Step) -> bool {
        let _ = step;
        false
    }
    /// The reference's own run of routed-experts step `step`: the host values it read (one per
    /// `step.inputs`, in order) and each routed expert's unweighted outputs (`[n_e, hidden]`,
    /// its tokens in token order), by expert, whether or not their hooks are compared.
    /// Handed over after the reference ran the step, before its pairs. Default: ignored.
    fn reference_experts(
        &mut self,
        step: &Step,
        inputs: &[HostTensor],
        experts: Vec<(usize, HostTensor)>,
    ) {
        let _ = (step, inputs, experts);
    }
    /// Whether the sink takes the inputs of the reference chain's steps
    /// ([`PairSink::chained_inputs`]): asked before each chained step. Default: no.
    fn wants_chained_inputs(&self) -> bool {
        false
    }
    /// The host values the reference's chain (the one compared in chained mode) fed `step`
    /// (one per `step.inputs`, in order), handed over before the step's chained pairs.
    /// Default: ignored.
    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        let _ = (step, inputs);
    }
    /// Chained: the reference's own chain (its own selections everywhere) at hook `name`, where
    /// it differs from the chain that follows the candidate's near ties, whose pair was handed
    /// over before: what the user's output shows. Default: ignored.
    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        let _ = (name, reference, candidate);
    }
}

/// What the driver asks back about selections, from the reference's scores the comparison
/// keeps: handed to the driver apart from the [`PairSink`], which only receives.
pub trait NearTies {
    /// The near-tie alternatives of the reference's selection `chosen` at selection hook
    /// `selection` in `mode` (`[T, k]` ids): single swaps whose margin, by the reference's own
    /// scores handed over before, is within the tolerance of the score hook, best first, at
    /// most `per_row` per row.
    fn near_ties(
        &self,
        selection: &str,
        mode: Mode,
        chosen: &HostTensor,
        per_row: usize,
    ) -> Vec<Swap>;
    /// The rows of selection hook `selection` in `mode` where the candidate's set differs from
    /// the reference's only by near-tie flips, by the reference's own scores handed over before
    /// (the rows a chain that follows the candidate's near ties takes from it).
    fn near_tie_rows(
        &self,
        selection: &str,
        mode: Mode,
        reference: &HostTensor,
        candidate: &HostTensor,
    ) -> Vec<usize>;
}

/// Whether two rows of a selection (ids; negative ids pad a row) hold the same set of ids and
/// as many padding entries, in whatever order: a row no [`NearTies`] answer names, since
/// nothing in it flipped.
pub fn rows_agree(reference: &[i32], candidate: &[i32]) -> bool {
    let pads = |row: &[i32]| row.iter().filter(|&&x| x < 0).count();
    pads(reference) == pads(candidate) && row_set(reference) == row_set(candidate)
}

/// Sorted set of the non-negative entries of a row of a selection.
pub fn row_set(row: &[i32]) -> Vec<i32> {
    let mut s: Vec<i32> = row.iter().copied().filter(|&x| x >= 0).collect();
    s.sort_unstable();
    s.dedup();
    s
}

/// Whether two selections (`[T, k]` ids) of the same shape agree in every row
/// ([`rows_agree`], the rows compared on the threads); `false` where either holds floats or
/// the shapes differ.
pub fn selections_agree(reference: &HostTensor, candidate: &HostTensor) -> bool {
    use rayon::prelude::*;
    let (HostData::I32(r), HostData::I32(c), Some(&width)) =
        (&reference.data, &candidate.data, reference.shape.last())
    else {
        return false;
    };
    let w = width.max(1);
    reference.shape == candidate.shape
        && r.par_chunks(w)
            .zip(c.par_chunks(w))
            .all(|(rr, cr)| rows_agree(rr, cr))
}

/// No near ties: for a driver whose sink keeps no scores.
pub struct NoNearTies;

impl NearTies for NoNearTies {
    fn near_ties(&self, _: &str, _: Mode, _: &HostTensor, _: usize) -> Vec<Swap> {
        Vec::new()
    }

    fn near_tie_rows(&self, _: &str, _: Mode, _: &HostTensor, _: &HostTensor) -> Vec<usize> {
        Vec::new()
    }
}

/// Receives hook tensors.
pub trait Sink {
    /// Whether the sink keeps hook `name` (asked before the tensor is downloaded).
    fn wants(&self, name: &str) -> bool;
    /// Receives hook `name` (only called when [`Sink::wants`] said yes).
    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()>;
}

/// Points that are off unless a `--hook` pattern names them: `attn_probs` and `exp.{e}.out`.
pub fn is_optional_point(point_name: &str) -> bool {
    point_name == point::ATTN_PROBS || point_name.starts_with("exp.")
}

/// Which hooks to keep: `--layers A..B` and `--hook GLOB` (repeatable).
///
/// - Per-layer hooks `blk.{L}.*` are kept when `L` is in the layer range (all layers without
///   `--layers`) and the name matches a glob (any name without `--hook`).
/// - Optional points (`attn_probs`, `exp.{e}.out`) are kept only when a glob matches them.
/// - Global hooks (`token_embd`, `result_norm`, `logits`) are kept without `--layers` when they
///   match the globs; with `--layers` only when a `--hook` glob names them explicitly. Asking for
///   `result_norm` or `logits` makes the run go through every layer; otherwise it stops after
///   the last layer with a wanted hook.
#[derive(Clone, Debug, Default)]
pub struct HookFilter {
    /// `--layers A..B` (end exclusive).
    pub layers: Option<Range<usize>>,
    /// `--hook` globs (empty = every standard hook).
    pub globs: Vec<String>,
}

impl HookFilter {
    /// Whether hook `name` is kept.
    pub fn wants(&self, name: &str) -> bool {
        match split_blk(name) {
            Some((l, p)) => {
                if self.layers.as_ref().is_some_and(|r| !r.contains(&l)) {
                    return false;
                }
                if is_optional_point(p) {
                    return !self.globs.is_empty() && matches_any(&self.globs, name);
                }
                matches_any(&self.globs, name)
            }
            None => {
                if self.layers.is_some() {
                    !self.globs.is_empty() && matches_any(&self.globs, name)
                } else {
                    matches_any(&self.globs, name)
                }
            }
        }
    }
}

/// A sink that keeps the hooks its filter wants, in memory, for a trace file.
#[derive(Debug, Default)]
pub struct TraceSink {
    filter: HookFilter,
    tensors: BTreeMap<String, HostTensor>,
}

impl TraceSink {
    /// A sink keeping what `filter` wants.
    pub fn new(filter: HookFilter) -> TraceSink {
        TraceSink {
            filter,
            tensors: BTreeMap::new(),
        }
    }

    /// The kept tensors by hook name.
    pub fn tensors(&self) -> &BTreeMap<String, HostTensor> {
        &self.tensors
    }

    /// Takes the kept tensors.
    pub fn into_tensors(self) -> BTreeMap<String, HostTensor> {
        self.tensors
    }
}

impl Sink for TraceSink {
    fn wants(&self, name: &str) -> bool {
        self.filter.wants(name)
    }

    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()> {
        if let Some(nf) = tensor.non_finite(crate::model::steps::causally_masked(name)) {
            bail!(
                "trace: hook {name}: the forward pass computes {nf} from the model's weights, which are finite (checked at load): the model's values overflow f32 at this step; the model file is broken, no trace is written"
            );
        }
        if self.tensors.insert(name.to_string(), tensor).is_some() {
            bail!("trace: hook {name} recorded twice");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows agree by set and padding, whatever the order; selections of floats or of other
    /// shapes never agree.
    #[test]
    fn selections_agree_by_row_sets() {
        assert!(rows_agree(&[3, 1, 2, -1], &[2, 3, 1, -1]));
        assert!(!rows_agree(&[3, 1, 2, -1], &[2, 3, 4, -1]));
        assert!(!rows_agree(&[3, 1, -1, -1], &[3, 1, 1, -1]));
        let ids = |shape: Vec<usize>, v: Vec<i32>| HostTensor::i32(shape, v).unwrap();
        let a = ids(vec![2, 2], vec![0, 1, 5, 4]);
        assert!(selections_agree(&a, &ids(vec![2, 2], vec![1, 0, 4, 5])));
        assert!(!selections_agree(&a, &ids(vec![2, 2], vec![1, 0, 4, 6])));
        assert!(!selections_agree(&a, &ids(vec![4, 1], vec![0, 1, 5, 4])));
        let f = HostTensor::f32(vec![2, 2], vec![0.0; 4]).unwrap();
        assert!(!selections_agree(&f, &f));
    }

    #[test]
    fn filter_layers_globs_and_optional_points() {
        let all = HookFilter::default();
        assert!(all.wants("blk.0.attn_norm"));
        assert!(all.wants("logits"));
        assert!(!all.wants("blk.0.attn_probs"));
        assert!(!all.wants("blk.3.exp.7.out"));

        let layers = HookFilter {
            layers: Some(2..4),
            globs: vec![],
        };
        assert!(layers.wants("blk.3.l_out"));
        assert!(!layers.wants("blk.4.l_out"));
        assert!(!layers.wants("blk.1.l_out"));
        assert!(!layers.wants("logits"));

        let named = HookFilter {
            layers: Some(2..4),
            globs: vec!["logits".into(), "blk.*.exp.*".into()],
        };
        assert!(named.wants("logits"));
        assert!(!named.wants("blk.3.l_out"));
        assert!(named.wants("blk.3.exp.7.out"));
        assert!(!named.wants("blk.5.exp.7.out"));
    }
}
