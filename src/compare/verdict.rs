//! Verdicts: a [`Comparison`] receives (reference, candidate) pairs, computes their metrics at
//! once (tensors are dropped after), judges each hook against its floor and finds the first
//! divergence in each mode.
//!
//! # Rules
//! - **replay**: a float hook fails when its relative L2 error is above its floor, when one
//!   token's error is above `TOKEN_FACTOR` times the floor (a row far smaller than the tensor's
//!   typical row is judged against `SMALL_ROW` of that typical row), or when the candidate has NaN/Inf
//!   where the reference has a finite value (or the reverse). A selection
//!   hook (`indexer_topk`, `moe_topk_ids`) whose sets differ is judged by the margin of each flip
//!   ([`super::selection`]): near-tie flips are expected (status `near_tie`), a confident flip
//!   fails.
//! - **chained**: a float hook fails when its error jumps above what its inputs explain:
//!   `floor + chain_amp * max(chained error of its inputs)` (the error a correct step passes
//!   on); NaN/Inf always fails. Selections are judged by margin as in replay, with the score
//!   hook's chained error as the tolerance when it is larger than the floor. Everything computed
//!   after a selection that differs (near-tie or confident), in that layer and all later ones,
//!   carries that origin: a jump there, a float one or another selection change, is *drift*
//!   (other keys or experts were used, which is what the user's output shows), not a new
//!   divergence. Drift names where it started (hook, token, margin).
//! - The first divergence of a mode is the first hook, in the order of the forward pass, that
//!   fails in it. The outcome differs (exit 1) when replay has a failure, when chained has a
//!   confident flip or NaN/Inf, or when chained fails at a hook replay has no verdict on (replay
//!   did not run, compared nothing, or could not replay that hook's step).
//! - **Segments** (replay against a trace that lacks hooks): a hook whose step read hooks the
//!   trace lacks ends a segment (the reference ran from the trace's nearest hooks through the
//!   ones it lacks, [`PairSink::reference_only`]); it is judged against the floor composed over
//!   the segment's steps (`floors`, Segments), and its record names the segment.
//! - **Margins** come from the reference's own scores: when the candidate lacks the score hook
//!   its reference value is still handed over, and the tolerance is the one the scores would
//!   have had (replay: their floor, composed inside a segment; chained: their floor plus what
//!   their inputs carry, amplified).
//! - `--tol GLOB=VALUE` replaces the floor of matching hooks, not the tolerance of flips: a
//!   selection's flips are judged with the precision floor of its score hook, whatever `--tol`
//!   says there. `--precision GLOB=DTYPE` sets the candidate's precision for matching hooks (an
//!   FP8 indexer: `blk.*.indexer_*=fp8`), floors and flip tolerances alike. Both are listed by
//!   [`Comparison::overrides`] with the number of hooks each decides.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use super::floors::{
    flip_tolerance, floor, point_of, segment_floor, Carried, HookInfo, Precision, TOKEN_FACTOR,
};
use super::graph::order_key;
use super::logits::{analyse, LogitsReport};
use super::metrics::{compare, Metrics};
use super::selection::{judge_flips, near_tie_swaps, FlipStats, Scores};
use crate::model::names::split_blk;
use crate::tensor::HostTensor;
use crate::trace::{Mode, Pair, PairSink, Swap};
use crate::util::glob::matches as glob_match;

/// How one hook fared in one mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Within the allowed error.
    Pass,
    /// A selection that differs only in near-tie flips (expected of a lower precision).
    #[serde(rename = "near_tie")]
    NearTie,
    /// Above it (or NaN/Inf, or a confident selection change).
    Fail,
    /// Chained only: different because an earlier selection differed (expected downstream of a
    /// near-tie flip).
    Drift,
    /// Not compared (missing from a trace, incomparable inputs).
    Missing,
}

/// One mode's result at one hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModeResult {
    /// Metrics (absent when the hook was not compared or shapes disagree).
    pub metrics: Option<Metrics>,
    /// Headline error: relative L2 (floats), 1 - mean Jaccard (selections).
    pub error: f64,
    /// Error allowed here: the floor (replay), floor plus what the inputs explain (chained).
    pub allowed: f64,
    /// Verdict.
    pub status: Status,
    /// Why, when not a plain pass.
    pub note: Option<String>,
    /// Selections: the flips and their margins.
    pub flips: Option<FlipStats>,
    /// Chained: the selection difference upstream that explains this hook's drift.
    pub drift_from: Option<String>,
}

/// Steps the reference replayed as one: from hooks of the trace through hooks the trace lacks
/// to the compared hook (`floors`, Segments).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Segment {
    /// `FIRST..LAST`: the first hook the reference computed inside the segment and the
    /// compared hook (`blk.0.q_pe_rope..blk.0.attn_heads`).
    pub name: String,
    /// The hooks it starts from: taken from the trace (or the run's starting values).
    pub from: Vec<String>,
    /// The hooks the trace lacks that the reference computed on the way, in forward-pass order.
    pub through: Vec<String>,
}

/// Everything known about one hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HookRecord {
    /// Hook name.
    pub name: String,
    /// Layer (`None` for global hooks).
    pub layer: Option<usize>,
    /// Shape (the reference's).
    pub shape: Vec<usize>,
    /// Step kind and what the floor depends on.
    pub info: HookInfo,
    /// The floor (relative L2), after `--tol`; for a segment, composed over its steps.
    pub floor: f64,
    /// The hooks its step read.
    pub inputs: Vec<String>,
    /// Replay: the segment this hook ends, when its step read hooks the trace lacks.
    pub segment: Option<Segment>,
    /// Replay result.
    pub replay: Option<ModeResult>,
    /// Chained result.
    pub chained: Option<ModeResult>,
}

impl HookRecord {
    /// The result in `mode`.
    pub fn result(&self, mode: Mode) -> Option<&ModeResult> {
        match mode {
            Mode::Replay => self.replay.as_ref(),
            Mode::Chained => self.chained.as_ref(),
        }
    }

    fn slot(&mut self, mode: Mode) -> &mut Option<ModeResult> {
        match mode {
            Mode::Replay => &mut self.replay,
            Mode::Chained => &mut self.chained,
        }
    }

    /// Whether any mode failed.
    pub fn failed(&self) -> bool {
        [&self.replay, &self.chained]
            .iter()
            .any(|r| r.as_ref().is_some_and(|r| r.status == Status::Fail))
    }
}

/// The candidate's precision at the hooks a glob matches.
#[derive(Clone, Debug, PartialEq)]
pub struct PrecisionOverride {
    /// Hook glob.
    pub glob: String,
    /// The precision there.
    pub precision: Precision,
    /// The dtype as it was given (`fp8`).
    pub dtype: String,
    /// Who said it: `--precision`, or the trace's metadata key (`indexer_dtype`).
    pub source: String,
}

/// A `--tol` or precision override and how many compared hooks it decides (the first matching
/// glob of its kind wins).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Override {
    /// `tol` (a floor replaced) or `precision` (the candidate's precision set).
    pub kind: &'static str,
    /// Hook glob.
    pub glob: String,
    /// As given: a floor (`10`) or a dtype (`fp8`).
    pub value: String,
    /// Who said it: `--tol`, `--precision`, or a trace's metadata key (`indexer_dtype`).
    pub source: String,
    /// Compared hooks it decides.
    pub hooks: usize,
}

/// Settings of a comparison.
#[derive(Clone, Debug)]
pub struct Judge {
    /// The reference's precision.
    pub reference: Precision,
    /// The candidate's precision.
    pub candidate: Precision,
    /// Floor inputs per hook (from the model; hooks not listed use their point name).
    pub infos: HashMap<String, HookInfo>,
    /// `--tol` overrides, in order: the first matching glob wins.
    pub tol: Vec<(String, f64)>,
    /// Overrides of the candidate's precision (`--precision`, then what a trace declares), in
    /// order: the first matching glob wins.
    pub precision: Vec<PrecisionOverride>,
    /// Selection bias (`exp_probs_b`) per MoE layer, added to the router probabilities when
    /// judging expert flips.
    pub selection_bias: HashMap<usize, Vec<f32>>,
    /// Group-limited routing `(n_group, used)` of the model, if any (expert flips).
    pub groups: Option<(usize, usize)>,
}

impl Judge {
    /// The floor inputs of `name`.
    pub fn info(&self, name: &str) -> HookInfo {
        self.infos
            .get(name)
            .copied()
            .unwrap_or_else(|| HookInfo::from_point(point_of(name)))
    }

    /// The candidate's precision at `name` (a `--precision` override when one matches).
    pub fn candidate_precision(&self, name: &str) -> Precision {
        self.precision
            .iter()
            .find(|o| glob_match(&o.glob, name))
            .map_or(self.candidate, |o| o.precision)
    }

    /// The floor of `name` (a `--tol` override when one matches).
    pub fn floor(&self, name: &str) -> f64 {
        self.tol_override(name)
            .unwrap_or_else(|| self.precision_floor(name))
    }

    /// The `--tol` value for `name`, when a glob matches it.
    pub fn tol_override(&self, name: &str) -> Option<f64> {
        self.tol
            .iter()
            .find(|(g, _)| glob_match(g, name))
            .map(|(_, v)| *v)
    }

    /// [`Judge::precision_floor`] with a router hook judged at the storage precision, as
    /// every other hook: the chained tolerance of the router's flips (see `record`).
    pub fn storage_floor(&self, name: &str) -> f64 {
        let info = HookInfo {
            router: false,
            ..self.info(name)
        };
        flip_tolerance(&info, self.reference, self.candidate_precision(name))
    }

    /// The tolerance of the scores `name` in `mode` for the flips they decide: the precision
    /// floor in replay (both sides score the same inputs), the storage floor in chained mode
    /// (the router's scores carry what storage did to their inputs upstream, so a router finer
    /// than storage does not narrow their flips' tolerance there). Never a `--tol` override.
    pub fn score_floor(&self, name: &str, mode: Mode) -> f64 {
        match mode {
            Mode::Replay => flip_tolerance(
                &self.info(name),
                self.reference,
                self.candidate_precision(name),
            ),
            Mode::Chained => self.storage_floor(name),
        }
    }

    /// The floor of `name` from both sides' precisions (a `--precision` override included),
    /// whatever `--tol` says: the relative tolerance of the flips its scores decide.
    pub fn precision_floor(&self, name: &str) -> f64 {
        floor(
            &self.info(name),
            self.reference,
            self.candidate_precision(name),
        )
    }
}

/// Receives pairs, keeps their metrics and verdicts.
pub struct Comparison {
    judge: Judge,
    wants: Box<dyn Fn(&str) -> bool>,
    tokens: Vec<u32>,
    records: Vec<HookRecord>,
    index: HashMap<String, usize>,
    logits: Vec<(Mode, LogitsReport)>,
    /// The latest reference scores per (mode, score point): hook name, values, and the relative
    /// error allowed there (for judging flips).
    scores: HashMap<(Mode, &'static str), (String, HostTensor, f64)>,
    /// Replay: hooks the candidate lacks that the reference computed inside a segment.
    inside: HashMap<String, Inside>,
    /// Chained: hooks the candidate lacks, with what stands for their chained error (what
    /// their inputs carry, passed on by their step, plus its floor) and its drift origin.
    chained_missing: HashMap<String, (f64, Option<String>)>,
}

/// A hook inside a segment (replay): what it carries, and where its segment started.
#[derive(Clone, Debug)]
struct Inside {
    carried: Carried,
    from: Vec<String>,
    through: Vec<String>,
}

/// `|t|`, the L2 norm of a float tensor's finite values (0 for ids).
fn l2(t: &HostTensor) -> f64 {
    t.as_f32("")
        .map(|v| {
            v.iter()
                .filter(|x| x.is_finite())
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>()
                .sqrt()
        })
        .unwrap_or(0.0)
}

/// Names once each, in forward-pass order.
fn in_order(mut v: Vec<String>) -> Vec<String> {
    v.sort_by_key(|n| order_key(n));
    v.dedup();
    v
}

impl Comparison {
    /// A comparison judged by `judge`, of the hooks `wants` selects, for the prompt `tokens`.
    pub fn new(judge: Judge, wants: Box<dyn Fn(&str) -> bool>, tokens: &[u32]) -> Comparison {
        Comparison {
            judge,
            wants,
            tokens: tokens.to_vec(),
            records: Vec::new(),
            index: HashMap::new(),
            logits: Vec::new(),
            scores: HashMap::new(),
            inside: HashMap::new(),
            chained_missing: HashMap::new(),
        }
    }

    /// The records in forward-pass order.
    pub fn records(&self) -> &[HookRecord] {
        &self.records
    }

    /// The record of hook `name`, if it was compared.
    pub fn get(&self, name: &str) -> Option<&HookRecord> {
        self.index.get(name).map(|&i| &self.records[i])
    }

    /// The judge.
    pub fn judge(&self) -> &Judge {
        &self.judge
    }

    /// Output distributions per mode (when logits were compared).
    pub fn logits(&self) -> &[(Mode, LogitsReport)] {
        &self.logits
    }

    fn record_mut(&mut self, name: &str, shape: &[usize], inputs: &[String]) -> &mut HookRecord {
        let i = match self.index.get(name) {
            Some(&i) => i,
            None => {
                let info = self.judge.info(name);
                self.records.push(HookRecord {
                    name: name.to_string(),
                    layer: split_blk(name).map(|(l, _)| l),
                    shape: shape.to_vec(),
                    info,
                    floor: self.judge.floor(name),
                    inputs: inputs.to_vec(),
                    segment: None,
                    replay: None,
                    chained: None,
                });
                self.index.insert(name.to_string(), self.records.len() - 1);
                self.records.len() - 1
            }
        };
        &mut self.records[i]
    }

    /// The chained state of a step's inputs: the largest float error among them, and the
    /// selection difference upstream that explains drift, if any.
    fn upstream_chained(&self, inputs: &[String]) -> (f64, Option<String>) {
        let (mut err, mut origin) = (0f64, None);
        for n in inputs {
            let compared = self.index.get(n).map(|&i| &self.records[i]).filter(|r| {
                r.chained
                    .as_ref()
                    .is_some_and(|c| c.status != Status::Missing)
            });
            let Some(r) = compared else {
                // A hook the candidate lacks stands for its own inputs.
                if let Some((e, o)) = self.chained_missing.get(n) {
                    err = err.max(*e);
                    if origin.is_none() {
                        origin = o.clone();
                    }
                }
                continue;
            };
            let Some(c) = &r.chained else { continue };
            if origin.is_none() {
                origin = c.drift_from.clone();
            }
            match &c.metrics {
                Some(Metrics::Float(_)) => err = err.max(c.error),
                Some(Metrics::Ids(_)) if origin.is_none() => {
                    if let Some(f) = c.flips.as_ref().and_then(|f| f.first.as_ref()) {
                        origin = Some(format!(
                            "{} token {} (margin {:.2e}, tolerance {:.2e})",
                            r.name, f.token, f.margin, f.tolerance
                        ));
                    }
                }
                _ => {}
            }
        }
        (err, origin)
    }

    /// The reference's scores behind selection hook `name` in `mode`, if they were compared:
    /// the same layer's `indexer_scores` / `moe_probs`, or, for a shared DSA layer, the layer
    /// whose selection it reuses (the latest one kept).
    fn scores_for(&self, name: &str, mode: Mode) -> Option<Scores<'_>> {
        let (layer, point) = split_blk(name)?;
        let sp: &'static str = match point {
            "indexer_topk" => "indexer_scores",
            "moe_topk_ids" => "moe_probs",
            _ => return None,
        };
        let (hook, t, rel) = self.scores.get(&(mode, sp))?;
        let src_layer = split_blk(hook).map(|(l, _)| l)?;
        if sp == "moe_probs" && src_layer != layer {
            return None;
        }
        let values = t.as_f32(hook).ok()?;
        let cols = *t.shape.last()?;
        let bias = if sp == "moe_probs" {
            self.judge.selection_bias.get(&layer).map(Vec::as_slice)
        } else {
            None
        };
        Some(Scores {
            values,
            cols,
            bias,
            rel_tol: *rel,
            groups: if sp == "moe_probs" {
                self.judge.groups
            } else {
                None
            },
        })
    }

    /// What a step reading `inputs` in replay starts from: per input what it carries (hooks of
    /// the trace carry nothing), the segment's starting hooks and the hooks inside it so far;
    /// `None` when no input is inside a segment.
    fn segment_inputs(
        &self,
        name: &str,
        inputs: &[String],
    ) -> Option<(Vec<Carried>, Vec<String>, Vec<String>)> {
        if !inputs.iter().any(|n| self.inside.contains_key(n)) {
            return None;
        }
        let kind = self.judge.info(name).kind;
        let (mut carried, mut from, mut through) = (Vec::new(), Vec::new(), Vec::new());
        for n in inputs {
            match self.inside.get(n) {
                Some(x) => {
                    carried.push(Carried {
                        gain: kind.gain_from(point_of(n)),
                        ..x.carried
                    });
                    from.extend(x.from.iter().cloned());
                    through.extend(x.through.iter().cloned());
                }
                None => from.push(n.clone()),
            }
        }
        Some((carried, in_order(from), in_order(through)))
    }

    /// The floor of hook `name` at the end of a segment from `carried` inputs, its output
    /// `reference` (a `--tol` override when one matches).
    fn composed_floor(&self, name: &str, carried: &[Carried], reference: &HostTensor) -> f64 {
        self.judge.tol_override(name).unwrap_or_else(|| {
            segment_floor(
                self.judge.info(name).kind,
                self.judge.floor(name),
                carried,
                l2(reference),
            )
        })
    }

    /// Keeps the reference's scores of a score hook for judging the selection after it.
    fn keep_scores(&mut self, name: &str, mode: Mode, reference: HostTensor, rel: f64) {
        let sp: &'static str = match point_of(name) {
            "moe_probs" => "moe_probs",
            "indexer_scores" => "indexer_scores",
            _ => return,
        };
        self.scores
            .insert((mode, sp), (name.to_string(), reference, rel));
    }

    /// Judges one pair.
    fn judge_pair(&self, pair: &Pair<'_>, floor: f64) -> ModeResult {
        let with_note = |mut r: ModeResult| {
            if let Some(n) = &pair.note {
                r.note = Some(match r.note {
                    Some(x) => format!("{x}; {n}"),
                    None => n.clone(),
                });
            }
            r
        };
        let metrics = match compare(&pair.reference, &pair.candidate) {
            Ok(m) => m,
            Err(why) => {
                return with_note(ModeResult {
                    metrics: None,
                    error: f64::INFINITY,
                    allowed: floor,
                    status: Status::Fail,
                    note: Some(why),
                    flips: None,
                    drift_from: None,
                })
            }
        };
        let error = metrics.error();
        let (up_err, origin) = match pair.mode {
            Mode::Replay => (0.0, None),
            Mode::Chained => self.upstream_chained(pair.inputs),
        };
        let amp = self.judge.info(pair.name).kind.chain_amp();
        let allowed = match pair.mode {
            Mode::Replay => floor,
            Mode::Chained => floor + amp * up_err,
        };
        let mut r = ModeResult {
            metrics: None,
            error,
            allowed,
            status: Status::Pass,
            note: None,
            flips: None,
            drift_from: None,
        };
        match &metrics {
            Metrics::Float(m) if m.nonfinite_mismatch > 0 => {
                r.status = Status::Fail;
                r.note = Some(format!(
                    "{} NaN/Inf where the reference differs (candidate NaN {}, Inf {}; reference NaN {}, Inf {})",
                    m.nonfinite_mismatch, m.nan[1], m.inf[1], m.nan[0], m.inf[0]
                ));
            }
            // The tensor is within its floor but one token is far above it (replay only).
            Metrics::Float(m)
                if pair.mode == Mode::Replay
                    && error <= allowed
                    && m.worst_token_judged()
                        .is_some_and(|(_, e)| e > TOKEN_FACTOR * allowed) =>
            {
                let (t, e) = m.worst_token_judged().unwrap_or((0, f64::NAN));
                r.status = Status::Fail;
                r.note = Some(format!(
                    "token {t}: error {e:.3e} above {TOKEN_FACTOR} x the floor {allowed:.3e} (the whole tensor: {error:.3e})"
                ));
            }
            // Within what is allowed; downstream of a selection that differs the hook still
            // carries that origin, so that a later jump is told apart from a new divergence.
            Metrics::Float(_) if error <= allowed => r.drift_from = origin,
            Metrics::Float(_) if origin.is_some() => {
                r.status = Status::Drift;
                r.note = Some(format!(
                    "drift after a selection that differs upstream, from {}",
                    origin.as_deref().unwrap_or("?")
                ));
                r.drift_from = origin;
            }
            Metrics::Float(_) => {
                r.status = Status::Fail;
                r.note = Some(format!("error {error:.3e} above the allowed {allowed:.3e}"));
            }
            Metrics::Ids(m) if m.set_equal_rows == m.rows => r.drift_from = origin,
            Metrics::Ids(_) => {
                let (reference, candidate) = (
                    pair.reference.as_i32(pair.name).unwrap_or(&[]),
                    pair.candidate.as_i32(pair.name).unwrap_or(&[]),
                );
                let width = pair.reference.shape.last().copied().unwrap_or(1);
                let scores = self.scores_for(pair.name, pair.mode);
                let st = judge_flips(reference, candidate, width, scores.as_ref());
                let margins = st.margins.map_or(String::new(), |(a, b)| {
                    format!(", margins {a:.2e}..{b:.2e}")
                });
                let what = format!(
                    "{} of {} rows select another set: {} near-tie, {} confident{margins}{}",
                    st.differing,
                    st.rows,
                    st.near_tie,
                    st.confident,
                    if st.judged {
                        ""
                    } else {
                        " (the reference's scores were not compared: margins unknown)"
                    }
                );
                if pair.mode == Mode::Chained && origin.is_some() {
                    r.status = Status::Drift;
                    r.note = Some(format!(
                        "{what}; after drift from {}",
                        origin.as_deref().unwrap_or("?")
                    ));
                    r.drift_from = origin;
                } else if st.confident > 0 {
                    r.status = Status::Fail;
                    r.note = Some(match st.first_confident.as_ref() {
                        Some(c) => format!(
                            "{what}; first confident flip at token {}: {:?} in, {:?} out, margin {:.2e} > tolerance {:.2e}",
                            c.token, c.entered, c.left, c.margin, c.tolerance
                        ),
                        None => what,
                    });
                } else {
                    r.status = Status::NearTie;
                    r.note = Some(what);
                    if let Some(f) = &st.first {
                        r.drift_from = Some(format!(
                            "the near-tie flip at {} token {} (margin {:.2e} <= tolerance {:.2e})",
                            pair.name, f.token, f.margin, f.tolerance
                        ));
                    }
                }
                r.flips = Some(st);
            }
        }
        r.metrics = Some(metrics);
        with_note(r)
    }

    /// The first hook failing in `mode`.
    pub fn first_divergence(&self, mode: Mode) -> Option<&HookRecord> {
        self.records
            .iter()
            .find(|r| r.result(mode).is_some_and(|m| m.status == Status::Fail))
    }

    /// The `--tol` and precision overrides, each with the number of compared hooks it decides.
    pub fn overrides(&self) -> Vec<Override> {
        let j = &self.judge;
        let count = |pick: &dyn Fn(&str) -> Option<usize>, i: usize| {
            self.records
                .iter()
                .filter(|r| pick(&r.name) == Some(i))
                .count()
        };
        let tol_of = |n: &str| j.tol.iter().position(|(g, _)| glob_match(g, n));
        let prec_of = |n: &str| j.precision.iter().position(|o| glob_match(&o.glob, n));
        let tol = j.tol.iter().enumerate().map(|(i, (g, v))| Override {
            kind: "tol",
            glob: g.clone(),
            value: format!("{v}"),
            source: "--tol".to_string(),
            hooks: count(&tol_of, i),
        });
        let prec = j.precision.iter().enumerate().map(|(i, o)| Override {
            kind: "precision",
            glob: o.glob.clone(),
            value: o.dtype.clone(),
            source: o.source.clone(),
            hooks: count(&prec_of, i),
        });
        tol.chain(prec).collect()
    }

    /// Whether the comparison found a difference (module documentation).
    pub fn differs(&self) -> bool {
        let chained_hard = self.records.iter().any(|r| {
            r.chained.as_ref().is_some_and(|c| {
                let nonfinite =
                    matches!(&c.metrics, Some(Metrics::Float(m)) if m.nonfinite_mismatch > 0);
                let confident =
                    c.status == Status::Fail && c.flips.as_ref().is_some_and(|f| f.confident > 0);
                nonfinite || confident
            })
        });
        self.first_divergence(Mode::Replay).is_some()
            || chained_hard
            || self.records.iter().any(Self::chained_counts)
    }

    /// Whether `r`'s chained failure makes the outcome differ: replay has no verdict on it (it
    /// did not run, compared nothing, or could not replay the hook's step), so the chained one
    /// is all there is.
    fn chained_counts(r: &HookRecord) -> bool {
        let failed = r.chained.as_ref().is_some_and(|c| c.status == Status::Fail);
        let no_replay = r
            .replay
            .as_ref()
            .is_none_or(|x| x.status == Status::Missing);
        failed && no_replay
    }

    /// Per-layer summaries in order (global hooks are grouped under `None`).
    pub fn layers(&self) -> Vec<LayerSummary> {
        let mut out: Vec<LayerSummary> = Vec::new();
        for (i, r) in self.records.iter().enumerate() {
            let group = r.layer;
            let new = out
                .last()
                .is_none_or(|g| g.layer != group || r.name == "token_embd");
            if new {
                out.push(LayerSummary {
                    layer: group,
                    label: group.map_or_else(|| r.name.clone(), |l| l.to_string()),
                    records: Vec::new(),
                    worst: [None, None],
                    floor: 0.0,
                    failed: 0,
                    drift: 0,
                    missing: 0,
                    near_tie: [0, 0],
                    margins: [None, None],
                });
            }
            let Some(g) = out.last_mut() else { continue };
            if group.is_none() && !new {
                g.label = format!("{}, {}", g.label, r.name);
            }
            g.records.push(i);
            g.floor = g.floor.max(r.floor);
            for (slot, res) in [(0usize, &r.replay), (1, &r.chained)] {
                let Some(res) = res else { continue };
                match res.status {
                    Status::NearTie => {
                        if let Some(f) = &res.flips {
                            g.near_tie[slot] += f.near_tie;
                            if let Some((a, b)) = f.margins {
                                g.margins[slot] = Some(match g.margins[slot] {
                                    None => (a, b),
                                    Some((x, y)) => (x.min(a), y.max(b)),
                                });
                            }
                        }
                    }
                    Status::Fail => g.failed += 1,
                    Status::Drift => g.drift += 1,
                    Status::Missing => g.missing += 1,
                    Status::Pass => {}
                }
                if res.status != Status::Missing
                    && matches!(res.metrics, Some(Metrics::Float(_)) | None)
                    && g.worst[slot].as_ref().is_none_or(|(_, e)| res.error > *e)
                {
                    g.worst[slot] = Some((i, res.error));
                }
            }
        }
        out
    }
}

/// One layer's (or the global hooks') records, folded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerSummary {
    /// Layer (`None` for global hooks).
    pub layer: Option<usize>,
    /// `"3"`, or the global hooks' names.
    pub label: String,
    /// Indices into [`Comparison::records`].
    pub records: Vec<usize>,
    /// Worst float error per mode (replay, chained): record index and error.
    pub worst: [Option<(usize, f64)>; 2],
    /// Largest floor among the records.
    pub floor: f64,
    /// Results that failed (both modes counted).
    pub failed: usize,
    /// Results that drifted.
    pub drift: usize,
    /// Results missing.
    pub missing: usize,
    /// Rows with near-tie flips per mode (replay, chained).
    pub near_tie: [usize; 2],
    /// Smallest and largest near-tie margin per mode.
    pub margins: [Option<(f64, f64)>; 2],
}

impl PairSink for Comparison {
    fn wants(&self, name: &str) -> bool {
        (self.wants)(name)
    }

    fn record(&mut self, pair: Pair<'_>) -> Result<()> {
        let segment = match pair.mode {
            Mode::Replay => self.segment_inputs(pair.name, pair.inputs),
            Mode::Chained => None,
        };
        let floor = match &segment {
            Some((carried, _, _)) => self.composed_floor(pair.name, carried, &pair.reference),
            None => self.judge.floor(pair.name),
        };
        let shape = pair.reference.shape.clone();
        let result = self.judge_pair(&pair, floor);
        if pair.name == crate::model::steps::point::LOGITS {
            if let (Ok(r), Ok(c), &[_, vocab]) = (
                pair.reference.as_f32("logits"),
                pair.candidate.as_f32("logits"),
                &pair.reference.shape[..],
            ) {
                if pair.candidate.shape == pair.reference.shape {
                    let report = analyse(r, c, vocab, &self.tokens, 5);
                    self.logits.push((pair.mode, report));
                }
            }
        }
        // Score hooks are kept (the latest per mode) to judge the flips of the selection after.
        // The relative error the scores may carry: their precision floor (never a --tol
        // override; composed inside a segment), or what they really show in chained mode when
        // that is more.
        let score_floor = match &segment {
            Some(_) => floor,
            None => self.judge.score_floor(pair.name, pair.mode),
        };
        let rel = if pair.mode == Mode::Chained && result.error.is_finite() {
            score_floor.max(result.error)
        } else {
            score_floor
        };
        let (name, mode) = (pair.name, pair.mode);
        self.keep_scores(name, mode, pair.reference, rel);
        let rec = self.record_mut(name, &shape, pair.inputs);
        if let Some((_, from, through)) = segment {
            let first = through.first().cloned().unwrap_or_default();
            rec.floor = floor;
            rec.segment = Some(Segment {
                name: format!("{first}..{name}"),
                from,
                through,
            });
        }
        *rec.slot(mode) = Some(result);
        Ok(())
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        let own = if matches!(point_of(name), "moe_probs" | "indexer_scores") {
            self.judge.score_floor(name, mode)
        } else {
            self.judge.floor(name)
        };
        let rel = match mode {
            Mode::Replay => {
                let (carried, from, mut through) = self
                    .segment_inputs(name, inputs)
                    .unwrap_or_else(|| (Vec::new(), in_order(inputs.to_vec()), Vec::new()));
                let ids = reference.as_i32("").is_ok();
                let rel = if ids {
                    0.0
                } else {
                    self.composed_floor(name, &carried, reference)
                };
                through.push(name.to_string());
                self.inside.insert(
                    name.to_string(),
                    Inside {
                        carried: Carried {
                            rel,
                            norm: l2(reference),
                            gain: 1.0,
                        },
                        from,
                        through: in_order(through),
                    },
                );
                rel.max(own)
            }
            Mode::Chained => {
                // What stands for its chained error downstream: what its inputs carry, passed on
                // by its step (`Kind::gain`), plus the step's floor.
                let (up, origin) = self.upstream_chained(inputs);
                let kind = self.judge.info(name).kind;
                self.chained_missing
                    .insert(name.to_string(), (own + kind.gain() * up, origin));
                // What the scores would be allowed in chained mode: the floor plus what their
                // inputs carry, amplified.
                own + kind.chain_amp() * up
            }
        };
        if matches!(point_of(name), "moe_probs" | "indexer_scores") {
            self.keep_scores(name, mode, reference.clone(), rel);
        }
    }

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

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        let rec = self.record_mut(name, &[], &[]);
        *rec.slot(mode) = Some(ModeResult {
            metrics: None,
            error: f64::NAN,
            allowed: rec.floor,
            status: Status::Missing,
            note: Some(why.to_string()),
            flips: None,
            drift_from: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::HostTensor;

    fn judge() -> Judge {
        Judge {
            reference: Precision::parse("f32 storage, f64 accumulation").unwrap(),
            candidate: Precision::parse("bf16").unwrap(),
            infos: HashMap::new(),
            tol: vec![("blk.*.q_a".into(), 1e-9)],
            precision: Vec::new(),
            selection_bias: HashMap::new(),
            groups: None,
        }
    }

    fn f(v: Vec<f32>) -> HostTensor {
        HostTensor::f32(vec![1, v.len()], v).unwrap()
    }

    fn push(
        c: &mut Comparison,
        name: &str,
        mode: Mode,
        inputs: &[String],
        r: Vec<f32>,
        k: Vec<f32>,
    ) {
        c.record(Pair {
            name,
            mode,
            inputs,
            reference: f(r),
            candidate: f(k),
            note: None,
        })
        .unwrap();
    }

    #[test]
    fn replay_failures_name_the_first_divergence_and_tol_overrides() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        let none: Vec<String> = vec![];
        // attn_norm: rel error 1e-3, bf16 norm floor ~2.7e-2 -> pass.
        push(
            &mut c,
            "blk.0.attn_norm",
            Mode::Replay,
            &none,
            vec![1.0, 0.0],
            vec![1.001, 0.0],
        );
        // q_a: rel error 1e-3 against --tol 1e-9 -> fail.
        push(
            &mut c,
            "blk.0.q_a",
            Mode::Replay,
            &none,
            vec![1.0, 0.0],
            vec![1.001, 0.0],
        );
        assert_eq!(c.records()[1].floor, 1e-9);
        assert_eq!(c.first_divergence(Mode::Replay).unwrap().name, "blk.0.q_a");
        assert!(c.differs());
        assert!(c.first_divergence(Mode::Chained).is_none());
    }

    #[test]
    fn chained_jumps_are_judged_against_their_inputs() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        let none: Vec<String> = vec![];
        let up = vec!["blk.0.attn_norm".to_string()];
        // The input already carries 0.1 relative error (over its floor: a chained failure there).
        push(
            &mut c,
            "blk.0.attn_norm",
            Mode::Chained,
            &none,
            vec![1.0, 0.0],
            vec![1.1, 0.0],
        );
        // q_b has 0.2: allowed = floor + 4 * 0.1 > 0.2 -> pass (explained by its input).
        push(
            &mut c,
            "blk.0.q_b",
            Mode::Chained,
            &up,
            vec![1.0, 0.0],
            vec![1.2, 0.0],
        );
        assert_eq!(
            c.records()[1].chained.as_ref().unwrap().status,
            Status::Pass
        );
        assert_eq!(
            c.first_divergence(Mode::Chained).unwrap().name,
            "blk.0.attn_norm"
        );
        // Chained-only failures make the outcome differ.
        assert!(c.differs());
    }

    #[test]
    fn nan_always_fails_and_drift_follows_selection_changes() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        let none: Vec<String> = vec![];
        push(
            &mut c,
            "blk.0.q_b",
            Mode::Replay,
            &none,
            vec![1.0, 2.0],
            vec![f32::NAN, 2.0],
        );
        assert_eq!(c.records()[0].replay.as_ref().unwrap().status, Status::Fail);
        let ids = |v: Vec<i32>| HostTensor::i32(vec![1, 2], v).unwrap();
        c.record(Pair {
            name: "blk.1.moe_topk_ids",
            mode: Mode::Chained,
            inputs: &["blk.1.moe_logits".to_string()],
            reference: ids(vec![0, 1]),
            candidate: ids(vec![0, 2]),
            note: None,
        })
        .unwrap();
        // Inputs within their floors: a selection change is a failure.
        assert_eq!(
            c.records()[1].chained.as_ref().unwrap().status,
            Status::Fail
        );
        let up = vec!["blk.1.moe_topk_ids".to_string()];
        push(
            &mut c,
            "blk.1.moe_routed",
            Mode::Chained,
            &up,
            vec![1.0, 0.0],
            vec![0.0, 1.0],
        );
        assert_eq!(
            c.records()[2].chained.as_ref().unwrap().status,
            Status::Drift
        );
    }

    /// 400 tokens of [1, 1]; token 7 is 30% off: the tensor's error is sqrt(2 * 0.09 / 800) =
    /// 0.015, under the bf16 projection floor (0.027), but token 7's 0.3 is above 3x it.
    #[test]
    fn one_bad_token_fails_in_replay() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        let r = HostTensor::f32(vec![400, 2], vec![1.0; 800]).unwrap();
        let mut v = vec![1.0f32; 800];
        v[14] = 1.3;
        v[15] = 1.3;
        let k = HostTensor::f32(vec![400, 2], v).unwrap();
        for mode in [Mode::Replay, Mode::Chained] {
            c.record(Pair {
                name: "blk.0.q_b",
                mode,
                inputs: &[],
                reference: r.clone(),
                candidate: k.clone(),
                note: None,
            })
            .unwrap();
        }
        let rec = &c.records()[0];
        let replay = rec.replay.as_ref().unwrap();
        assert!((replay.error - 0.015).abs() < 1e-6 && replay.error < rec.floor);
        assert_eq!(replay.status, Status::Fail);
        assert!(replay.note.as_deref().unwrap().starts_with("token 7:"));
        // Chained judges the tensor only.
        assert_eq!(rec.chained.as_ref().unwrap().status, Status::Pass);
    }

    /// `--tol` replaces floors, never flip tolerances: a confident flip stays confident under
    /// `--tol '*=10'`, and the override is listed with the hooks it decides; a `--precision`
    /// override of the scores widens both, and is listed with its source.
    #[test]
    fn tol_never_widens_flips_and_overrides_are_listed() {
        let probs = || f(vec![0.9, 0.5, 0.4999, 0.1]);
        let ids = |v: Vec<i32>| HostTensor::i32(vec![1, 2], v).unwrap();
        let run = |judge: Judge| {
            let mut c = Comparison::new(judge, Box::new(|_| true), &[1]);
            for (name, r, k) in [
                ("blk.1.moe_probs", probs(), probs()),
                ("blk.1.moe_topk_ids", ids(vec![0, 1]), ids(vec![0, 3])),
            ] {
                c.record(Pair {
                    name,
                    mode: Mode::Replay,
                    inputs: &[],
                    reference: r,
                    candidate: k,
                    note: None,
                })
                .unwrap();
            }
            c
        };
        let tol = Judge {
            tol: vec![("*".into(), 10.0)],
            ..judge()
        };
        let c = run(tol);
        let sel = c.get("blk.1.moe_topk_ids").unwrap();
        assert_eq!(sel.floor, 10.0);
        let flips = sel.replay.as_ref().unwrap().flips.as_ref().unwrap();
        assert_eq!(flips.confident, 1);
        assert!(flips.first.as_ref().unwrap().tolerance < 0.1, "{flips:?}");
        assert!(c.differs());
        assert_eq!(
            c.overrides(),
            [Override {
                kind: "tol",
                glob: "*".into(),
                value: "10".into(),
                source: "--tol".into(),
                hooks: 2,
            }]
        );
        // A --precision override of the scores sets their floor and the flips' tolerance alike:
        // the tolerance is the scores' precision floor times the row's RMS score.
        let fp8 = Judge {
            precision: vec![PrecisionOverride {
                glob: "blk.*.moe_*".into(),
                precision: Precision::parse("fp8").unwrap(),
                dtype: "fp8".into(),
                source: "--precision".into(),
            }],
            ..judge()
        };
        let c = run(fp8);
        let t = c
            .get("blk.1.moe_topk_ids")
            .unwrap()
            .replay
            .as_ref()
            .unwrap();
        let tol = t.flips.as_ref().unwrap().first.as_ref().unwrap().tolerance;
        let rms = ((0.81f64 + 0.25 + 0.4999 * 0.4999 + 0.01) / 4.0).sqrt();
        let probs_floor = c.get("blk.1.moe_probs").unwrap().floor;
        assert!(
            (tol - probs_floor * rms).abs() < 1e-6,
            "{tol} vs {probs_floor} * {rms}"
        );
        let o = c.overrides();
        assert_eq!(o.len(), 2, "{o:?}"); // the judge's --tol blk.*.q_a, deciding no hook here
        assert_eq!((o[0].kind, o[0].hooks), ("tol", 0));
        assert_eq!(
            (o[1].kind, o[1].value.as_str(), o[1].hooks),
            ("precision", "fp8", 2)
        );
    }

    #[test]
    fn missing_hooks_are_listed_not_failed() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        c.missing("blk.0.q_a", Mode::Chained, "not in the trace");
        assert_eq!(
            c.records()[0].chained.as_ref().unwrap().status,
            Status::Missing
        );
        assert!(!c.differs());
    }

    /// A step whose input the trace lacks ends a segment: named from the first hook computed
    /// inside it to the compared hook, with the hooks it started from, and judged against the
    /// floor composed over its steps.
    #[test]
    fn segments_are_named_and_judged_by_their_composed_floor() {
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
        c.reference_only(
            "blk.0.q_pe_rope",
            Mode::Replay,
            &s(&["blk.0.q_b"]),
            &f(vec![1.0, 0.0]),
        );
        c.reference_only(
            "blk.0.k_pe_rope",
            Mode::Replay,
            &s(&["blk.0.kv_a"]),
            &f(vec![1.0, 0.0]),
        );
        let inputs = s(&[
            "blk.0.q_b",
            "blk.0.q_pe_rope",
            "blk.0.kv_a_norm",
            "blk.0.k_pe_rope",
        ]);
        push(
            &mut c,
            "blk.0.attn_heads",
            Mode::Replay,
            &inputs,
            vec![1.0, 0.0],
            vec![1.05, 0.0],
        );
        let rec = c.get("blk.0.attn_heads").unwrap();
        let seg = rec.segment.as_ref().unwrap();
        assert_eq!(seg.name, "blk.0.q_pe_rope..blk.0.attn_heads");
        assert_eq!(seg.from, s(&["blk.0.q_b", "blk.0.kv_a", "blk.0.kv_a_norm"]));
        assert_eq!(seg.through, s(&["blk.0.q_pe_rope", "blk.0.k_pe_rope"]));
        // Each RoPE carries its own floor, attention passes it on twice: sqrt(f_attn^2 +
        // (2 f_rope)^2).
        let (fa, fr) = (
            c.judge().floor("blk.0.attn_heads"),
            c.judge().floor("blk.0.q_pe_rope"),
        );
        let want = (fa * fa + 4.0 * fr * fr).sqrt();
        assert!((rec.floor - want).abs() < 1e-15, "{} vs {want}", rec.floor);
        let r = rec.replay.as_ref().unwrap();
        assert_eq!((r.allowed, r.status), (rec.floor, Status::Pass));
        // A step reading only the trace's hooks is no segment.
        push(
            &mut c,
            "blk.0.attn_out",
            Mode::Replay,
            &s(&["blk.0.attn_heads"]),
            vec![1.0, 0.0],
            vec![1.0, 0.0],
        );
        assert!(c.get("blk.0.attn_out").unwrap().segment.is_none());
    }

    /// The candidate lacks the router probabilities: its flips are still judged by margin, on
    /// the reference's own scores, and the near-tie alternatives of a selection come from them.
    #[test]
    fn margins_come_from_the_reference_when_the_candidate_lacks_the_scores() {
        let probs = f(vec![0.9, 0.5, 0.4999, 0.1]);
        let ids = |v: Vec<i32>| HostTensor::i32(vec![1, 2], v).unwrap();
        let logits = vec!["blk.1.moe_logits".to_string()];
        for mode in [Mode::Replay, Mode::Chained] {
            let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
            c.reference_only("blk.1.moe_probs", mode, &logits, &probs);
            let swaps = c.near_ties("blk.1.moe_topk_ids", mode, &ids(vec![0, 1]), 4);
            assert_eq!(swaps.len(), 1, "{mode}: {swaps:?}");
            assert_eq!(
                (swaps[0].row, &swaps[0].left[..], &swaps[0].entered[..]),
                (0, &[1][..], &[2][..])
            );
            c.record(Pair {
                name: "blk.1.moe_topk_ids",
                mode,
                inputs: &logits,
                reference: ids(vec![0, 1]),
                candidate: ids(vec![0, 2]),
                note: None,
            })
            .unwrap();
            let r = c.records()[0].result(mode).unwrap();
            assert_eq!(r.status, Status::NearTie, "{mode}: {r:?}");
            assert!(r.flips.as_ref().unwrap().judged);
            assert!(!c.differs());
        }
        // Without them (no reference value handed over) the flip is not judged: confident.
        let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
        c.record(Pair {
            name: "blk.1.moe_topk_ids",
            mode: Mode::Replay,
            inputs: &logits,
            reference: ids(vec![0, 1]),
            candidate: ids(vec![0, 2]),
            note: None,
        })
        .unwrap();
        assert!(c.records()[0]
            .replay
            .as_ref()
            .unwrap()
            .note
            .as_deref()
            .unwrap()
            .contains("margins unknown"));
    }

    /// A chained failure makes the outcome differ where replay has no verdict on the hook (it
    /// could not replay its step), not where replay passed it.
    #[test]
    fn chained_failures_count_where_replay_has_no_verdict() {
        let none: Vec<String> = vec![];
        for replay_missing in [false, true] {
            let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
            push(
                &mut c,
                "blk.0.q_b",
                Mode::Chained,
                &none,
                vec![1.0, 0.0],
                vec![2.0, 0.0],
            );
            if replay_missing {
                c.missing(
                    "blk.0.q_b",
                    Mode::Replay,
                    "input blk.0.q_a_norm is not in the trace",
                );
            } else {
                push(
                    &mut c,
                    "blk.0.q_b",
                    Mode::Replay,
                    &none,
                    vec![1.0, 0.0],
                    vec![1.0, 0.0],
                );
            }
            assert!(c.first_divergence(Mode::Chained).is_some());
            assert!(c.first_divergence(Mode::Replay).is_none());
            assert_eq!(c.differs(), replay_missing);
        }
    }

    /// Router probabilities [0.9, 0.5, 0.4999, 0.1] for one token, top-2: the reference picks
    /// {0, 1}; a candidate picking {0, 2} flips a near tie (gap 1e-4 against a bf16 tolerance
    /// of about 1e-2 * rms 0.58), one picking {0, 3} a confident one (gap 0.4).
    #[test]
    fn flips_are_judged_by_margin_and_drift_follows_near_ties() {
        let probs = || f(vec![0.9, 0.5, 0.4999, 0.1]);
        let ids = |v: Vec<i32>| HostTensor::i32(vec![1, 2], v).unwrap();
        let run = |cand: Vec<i32>| {
            let mut c = Comparison::new(judge(), Box::new(|_| true), &[1]);
            let none: Vec<String> = vec![];
            let logits = vec!["blk.1.moe_logits".to_string()];
            for mode in [Mode::Replay, Mode::Chained] {
                c.record(Pair {
                    name: "blk.1.moe_probs",
                    mode,
                    inputs: &none,
                    reference: probs(),
                    candidate: probs(),
                    note: None,
                })
                .unwrap();
                c.record(Pair {
                    name: "blk.1.moe_topk_ids",
                    mode,
                    inputs: &logits,
                    reference: ids(vec![0, 1]),
                    candidate: ids(cand.clone()),
                    note: None,
                })
                .unwrap();
            }
            let up = vec!["blk.1.moe_topk_ids".to_string()];
            push(
                &mut c,
                "blk.1.moe_routed",
                Mode::Chained,
                &up,
                vec![1.0, 0.0],
                vec![0.0, 1.0],
            );
            c
        };
        let c = run(vec![0, 2]);
        let sel = &c.records()[1];
        assert_eq!(sel.replay.as_ref().unwrap().status, Status::NearTie);
        assert_eq!(sel.chained.as_ref().unwrap().status, Status::NearTie);
        let f = sel.replay.as_ref().unwrap().flips.as_ref().unwrap();
        assert_eq!((f.near_tie, f.confident), (1, 0));
        assert!((f.margins.unwrap().0 - 1e-4).abs() < 1e-6);
        let routed = c.records()[2].chained.as_ref().unwrap();
        assert_eq!(routed.status, Status::Drift);
        assert!(routed
            .drift_from
            .as_deref()
            .unwrap()
            .contains("blk.1.moe_topk_ids token 0"));
        assert!(!c.differs());
        assert!(c.first_divergence(Mode::Chained).is_none());

        let c = run(vec![0, 3]);
        let sel = &c.records()[1];
        assert_eq!(sel.replay.as_ref().unwrap().status, Status::Fail);
        assert_eq!(
            c.first_divergence(Mode::Replay).unwrap().name,
            "blk.1.moe_topk_ids"
        );
        assert!(c.differs());
    }
}
