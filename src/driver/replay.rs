//! What both ways of replaying share: one step run on an engine from host inputs, which steps a
//! sink wants, which hooks are selections, and what a pass did.

use anyhow::Result;

use super::exec_step;
use super::timed::point_of;
use crate::engine::{Engine, HostTensor, UploadStats};
use crate::model::steps::{expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::PairSink;

/// What a pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PairSummary {
    /// Steps run.
    pub steps: usize,
    /// Pairs handed to the sink.
    pub pairs: usize,
    /// Hooks reported missing.
    pub missing: usize,
    /// Wall time of each side's steps per layer (global steps under `None`), in order.
    pub layer_times: Vec<LayerTime>,
    /// What the reference computed, by cause.
    pub reference_work: ReferenceWork,
    /// The comparison's seconds by what it was handed (a hook's point and mode, its layers
    /// together, or the call), the largest first.
    pub compare_times: Vec<(String, f64)>,
    /// The reference's seconds by step and cause (`attn_heads own`, `ffn_moe followed`,
    /// `indexer_topk replay`: a step's first output's point with its layers together), the
    /// largest first once the pass is done; they add up to the layers' `reference`.
    pub reference_times: Vec<(String, f64)>,
    /// The candidate engine's seconds by step and mode (`attn_heads chained`, `q_b replay`),
    /// kept as [`PairSummary::reference_times`]; they add up to the layers' `chained` and
    /// `replay`.
    pub candidate_times: Vec<(String, f64)>,
    /// The wall by which the candidate engine's side of a step ended after the reference's, by
    /// step (`q_b beyond`, named as [`PairSummary::reference_times`]), the largest first; they
    /// add up to the layers' `candidate_beyond`.
    pub candidate_beyond_times: Vec<(String, f64)>,
    /// The seconds the driver waited for the comparison's thread, by cause (`waited for the
    /// comparison's end`, `... near ties`, `... queue`), where it waited.
    pub compare_waits: Vec<(String, f64)>,
    /// Steps of the candidate's chain run ahead of the pass (`--candidate-ahead`), while the
    /// reference's side of an earlier step ran.
    pub candidate_ahead_steps: usize,
}

/// The steps the reference engine computed in a pass, by cause (every cause's time is also in
/// [`LayerTime::reference`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReferenceWork {
    /// Its own chain: every step of the plan once.
    pub plain: Work,
    /// Replayed steps recomputed whole with the candidate's selection.
    pub replay_whole: Work,
    /// Replayed steps recomputed only in the rows the candidate's selection reaches.
    pub replay_rows: Work,
    /// Steps of the chain that follows the candidate's near ties, computed whole once it left
    /// the reference's own chain.
    pub followed_whole: Work,
    /// Steps of that chain computed only in the rows where its inputs differ from the own
    /// chain's.
    pub followed_rows: Work,
    /// Steps of that chain whose inputs are the own chain's bit for bit: its outputs taken,
    /// nothing computed.
    pub followed_reused: Work,
    /// Steps of its own chain (routed experts) that also computed the rows a replay or the
    /// followed chain recomputes, in the same pass over the experts' weights: the further
    /// rows, and the steps' whole time (also in `plain`; those rows count again, with the
    /// time their outputs took to splice in, in `replay_rows` or `followed_rows`).
    pub joint: Work,
}

/// Steps computed, the rows they computed and the time they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Steps.
    pub steps: usize,
    /// Rows of the first axis computed, summed over the steps.
    pub rows: usize,
    /// Seconds.
    pub seconds: f64,
}

impl Work {
    /// Adds one step of `rows` rows that took `seconds`.
    pub(super) fn add(&mut self, rows: usize, seconds: f64) {
        self.steps += 1;
        self.rows += rows;
        self.seconds += seconds;
    }
}

/// Wall time of one layer's steps on each side, seconds: a step's time includes the downloads
/// of its wanted outputs (which wait for a GPU's work) and, in replay, the uploads of its inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerTime {
    /// The layer (`None`: the embedding and the tail).
    pub layer: Option<usize>,
    /// The reference's steps.
    pub reference: f64,
    /// The candidate engine's own chain (0 without one).
    pub chained: f64,
    /// The candidate engine's replayed steps (0 without them).
    pub replay: f64,
    /// The part of `chained + replay` the candidate engine spent on its weights before computing
    /// (on-demand uploads, waits for a prefetch, issuing the next layer's prefetch:
    /// `Engine::take_upload_stats`); its compute is the rest.
    pub upload: f64,
    /// Bytes of weights the candidate engine's steps of the layer took into use.
    pub upload_bytes: u64,
    /// The comparison of the layer's pairs (metrics, verdicts, the bug families' directions):
    /// its own seconds, on its thread beside later steps or on the driver's; not part of
    /// `reference`.
    pub compare: f64,
    /// The seconds the driver waited for the comparison in the layer's steps (for room in its
    /// queue, or for the near ties' answers; the last layer's also for the end of the
    /// comparison): the part of `compare` that the steps did not hide.
    pub compare_wait: f64,
    /// The part of the layer's time the driver waited for the candidate engine's side of a
    /// step after the reference's side of it was done (summed over the steps; 0 without an
    /// engine candidate): what the candidate added to the wall beyond the reference.
    pub candidate_beyond: f64,
}

impl LayerTime {
    /// Adds an engine's upload figures.
    pub(super) fn add_upload(&mut self, u: UploadStats) {
        self.upload += u.wait;
        self.upload_bytes += u.bytes;
    }
}

/// Adds `seconds` to `times` under `step`'s first output's point and `cause`.
fn add_time(times: &mut Vec<(String, f64)>, step: &Step, cause: &str, seconds: f64) {
    let point = step.outputs.first().map_or("-", |o| point_of(o));
    let what = format!("{point} {cause}");
    match times.iter_mut().find(|(w, _)| *w == what) {
        Some((_, s)) => *s += seconds,
        None => times.push((what, seconds)),
    }
}

impl PairSummary {
    /// Adds `seconds` of the reference's `step` for `cause` (`own`, `replay`, `followed`) to its
    /// layer's time and to [`PairSummary::reference_times`].
    pub(super) fn reference_time(&mut self, step: &Step, cause: &str, seconds: f64) {
        self.time(step.layer).reference += seconds;
        add_time(&mut self.reference_times, step, cause, seconds);
    }

    /// Adds the candidate engine's seconds of `step` in its chain and in replay to its layer's
    /// times and to [`PairSummary::candidate_times`].
    pub(super) fn candidate_time(&mut self, step: &Step, chained: f64, replay: f64) {
        let t = self.time(step.layer);
        t.chained += chained;
        t.replay += replay;
        for (mode, s) in [("chained", chained), ("replay", replay)] {
            if s > 0.0 {
                add_time(&mut self.candidate_times, step, mode, s);
            }
        }
    }

    /// Adds `seconds` by which the candidate engine's side of `step` ended after the reference's
    /// to its layer's `candidate_beyond` and to [`PairSummary::candidate_beyond_times`].
    pub(super) fn candidate_beyond(&mut self, step: &Step, seconds: f64) {
        self.time(step.layer).candidate_beyond += seconds;
        if seconds > 0.0 {
            add_time(&mut self.candidate_beyond_times, step, "beyond", seconds);
        }
    }

    pub(super) fn time(&mut self, layer: Option<usize>) -> &mut LayerTime {
        match self.layer_times.iter().position(|t| t.layer == layer) {
            Some(i) => &mut self.layer_times[i],
            None => {
                self.layer_times.push(LayerTime {
                    layer,
                    ..LayerTime::default()
                });
                let n = self.layer_times.len() - 1;
                &mut self.layer_times[n]
            }
        }
    }
}

/// Whether `sink` wants any hook `step` produces, optional ones included.
pub(super) fn step_wanted(step: &Step, sink: &dyn PairSink, weights: &Weights<'_>) -> bool {
    step.outputs.iter().any(|o| sink.wants(o))
        || match step.op {
            Op::Attention { layer } => sink.wants(&hook(layer, point::ATTN_PROBS)),
            Op::MoeExperts { layer } => {
                (0..weights.hparams().n_expert).any(|e| sink.wants(&expert_hook(layer, e)))
            }
            _ => false,
        }
}

/// Whether hook `name` is a selection a later step reads (DSA keys, routed experts and their
/// weights).
pub fn is_selection(name: &str) -> bool {
    let p = crate::model::names::split_blk(name).map_or(name, |(_, p)| p);
    p == point::INDEXER_TOPK || p == point::MOE_TOPK_IDS || p == point::MOE_WEIGHTS
}

/// Runs `step` on `engine` from host `inputs` and returns every output `wants` asks for, as host
/// tensors (an alias returns its input).
pub(super) fn replay_step<E: Engine>(
    engine: &E,
    step: &Step,
    inputs: &[HostTensor],
    tokens: &[u32],
    wants: &dyn Fn(&str) -> bool,
) -> Result<Vec<(String, HostTensor)>> {
    if step.op == Op::Alias {
        return Ok(step
            .outputs
            .iter()
            .zip(inputs)
            .filter(|(n, _)| wants(n))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect());
    }
    let up = inputs
        .iter()
        .map(|t| engine.upload(t))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&E::Tensor> = up.iter().collect();
    let out = exec_step(engine, step, &refs, tokens, wants)?;
    let mut v = Vec::new();
    for (n, t) in step.outputs.iter().zip(&out.outputs) {
        if wants(n) {
            v.push((n.clone(), engine.download(t)?));
        }
    }
    for (n, t) in &out.extra {
        if wants(n) {
            v.push((n.clone(), engine.download(t)?));
        }
    }
    Ok(v)
}
