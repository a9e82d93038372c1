//! `--explain`: which known bug reproduces the candidate's numbers at the first failing step.
//!
//! [`Capture`] sits between the two-engine driver and a [`Comparison`]: it keeps the inputs
//! replay fed the step whose hook fails first ([`CapturedStep`]: the step, its inputs, the
//! reference's and the candidate's output). [`explain`] then recomputes that step on the CPU from
//! those same inputs under every fault of [`fault`] that concerns it, and under
//! the structural searches of [`search`] (an expert permutation matched on the experts' own
//! outputs, a head permutation), and ranks them by the relative L2 distance of their output to
//! the candidate's (the *residual*). A hypothesis *reproduces* the candidate when its residual is
//! within the floor the failing hook was judged by: the candidate is then that bug, up to what
//! precision explains. Because the step is recomputed from the replay inputs, this works as well
//! for a trace of an engine glmdiff cannot run.
//!
//! [`case`] writes the captured step as a self-contained case for `glmdiff step` (`--repro`).

pub mod case;
pub mod directions;
pub mod fault;
pub mod fit_attn;
pub mod fit_route;
pub mod search;

use std::collections::HashMap;

use anyhow::{Context, Result};
use serde::Serialize;

use self::fault::{Fault, FaultEngine, FaultKind, Mscale};
use crate::compare::systematic::Part;
use crate::compare::{compare, Comparison, ModeResult, Status};
use crate::driver::exec_step;
use crate::driver::pair::Modes;
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, HostTensor};
use crate::model::names::{self, blk};
use crate::model::steps::{point, Op, Step};
use crate::model::{Gating, Weights};
use crate::quant::GgmlType;
use crate::trace::{Answers, Mode, Pair, PairSink};
use crate::util::progress::Progress;
use directions::Own;

/// The noise a hook that failed on a systematic component within its floor leaves once the
/// component is removed ([`CapturedStep::noise`]); `None` for any other result.
pub fn noise(r: &ModeResult) -> Option<f64> {
    r.systematic
        .as_ref()
        .filter(|s| s.finding.is_some() && r.error <= r.allowed)
        .and_then(|s| s.residual)
}

/// How much closer than the noise a hypothesis must come to reproduce a candidate whose hook
/// failed on a systematic component within the floor ([`CapturedStep::noise`]): the right
/// fault, fitted, leaves the noise (up to its own fit's error); a wrong one leaves most of the
/// component.
pub const NOISE_SLACK: f64 = 1.25;

/// The step behind the first failing replay hook, with everything needed to recompute it.
#[derive(Clone, Debug)]
pub struct CapturedStep {
    /// The step.
    pub step: Step,
    /// The failing hook (one of the step's outputs, or an optional hook it produces).
    pub hook: String,
    /// The inputs replay fed both sides, by hook name, in the step's order.
    pub inputs: Vec<(String, HostTensor)>,
    /// The reference's output at `hook` (from `inputs`).
    pub reference: HostTensor,
    /// The candidate's output at `hook`.
    pub candidate: HostTensor,
    /// The replay error of the candidate there.
    pub error: f64,
    /// The error allowed there (the floor).
    pub allowed: f64,
    /// When the hook failed on a systematic component within the floor
    /// (`compare::systematic`): the error left once that component is removed, what rounding
    /// leaves. A hypothesis then reproduces the candidate only as closely as that.
    pub noise: Option<f64>,
    /// Where the hook ends a segment (the candidate lacks the hooks of steps before it, which
    /// the reference ran from the candidate's hooks upstream): those steps, upstream first,
    /// with the inputs replay fed them. A hypothesis re-runs them before the step, so that a
    /// fault acting inside the segment (RoPE's base where RoPE is fused into attention) is
    /// tested where it acts.
    pub inside: Vec<(Step, Vec<(String, HostTensor)>)>,
}

/// The reference's own run of a routed-experts step: the step's outputs (its key), the inputs
/// it read and each expert's outputs.
type OwnExperts = (Vec<String>, Vec<HostTensor>, HashMap<usize, HostTensor>);

/// A [`PairSink`] in front of a [`Comparison`] that keeps the first failing replay step
/// ([`Capture::captured`]) and, with [`Capture::with_directions`], hands the comparison the
/// directions of the bug families of each replayed step ([`directions`]). Until it has a failing
/// step it copies each replayed step's inputs (one step at a time) and each replay pair's
/// tensors; afterwards it only passes pairs on (and copies inputs for the directions).
pub struct Capture<'c, 'w> {
    inner: &'c mut Comparison,
    enabled: bool,
    directions: Option<CpuEngine<'w>>,
    pending: Option<(Step, Vec<HostTensor>)>,
    pending_chained: Option<(Step, Vec<HostTensor>)>,
    captured: Option<CapturedStep>,
    /// The reference's own run of the last routed-experts step: its outputs (first output
    /// name), inputs and each expert's outputs.
    own_experts: Option<OwnExperts>,
    /// The last directions computed: the hook, the inputs they were computed from, and the
    /// parts (chained and replay read the same inputs until the chains part).
    last: Option<(String, Vec<HostTensor>, Vec<Part>)>,
    /// See [`Capture::with_directions`].
    exact_replay: bool,
    /// See [`Capture::with_directions`].
    chained_directions: bool,
    /// Replay runs (a chained pair's directions are kept for its replay pair).
    replay: bool,
    /// The replayed steps whose hooks the candidate lacks (their outputs only the reference
    /// has), by output hook: the steps inside a segment, with the inputs replay fed them.
    inside: HashMap<String, (Step, Vec<HostTensor>)>,
}

impl<'c, 'w> Capture<'c, 'w> {
    /// A capture in front of `inner`; when not `enabled` it only passes pairs on.
    pub fn new(inner: &'c mut Comparison, enabled: bool) -> Capture<'c, 'w> {
        Capture {
            inner,
            enabled,
            directions: None,
            pending: None,
            pending_chained: None,
            captured: None,
            own_experts: None,
            last: None,
            exact_replay: false,
            chained_directions: false,
            replay: false,
            inside: HashMap::new(),
        }
    }

    /// Also computes the bug families' directions of each replayed step on the CPU reference
    /// of `weights` and hands them to the comparison before the step's pairs (its large
    /// products on `device`, the reference's, when it has one).
    ///
    /// `exact_replay`: the reference side of every replay pair is the reference's output from
    /// exactly the inputs handed over before it (an engine candidate: true; against a trace a
    /// segment may take a row from another selection's round), so the directions take it as
    /// their base instead of computing it again. `modes`: the pass's. Chained pairs get
    /// directions too, except against an engine with replay on: a chained pair is then still
    /// tested for its overall and head gains, and the families' components where a step's own
    /// error shows them first (an engine candidate replays every step it runs).
    pub fn with_directions(
        mut self,
        weights: &'w Weights<'w>,
        exact_replay: bool,
        modes: Modes,
        device: Option<std::sync::Arc<crate::engine::cpu::device::Device>>,
    ) -> Capture<'c, 'w> {
        let engine = CpuEngine::new(weights);
        self.directions = Some(match device {
            Some(d) => engine.with_device(d),
            None => engine,
        });
        self.exact_replay = exact_replay;
        self.chained_directions = modes.chained && !(exact_replay && modes.replay);
        self.replay = modes.replay;
        self
    }

    /// The first failing replay step, if any.
    pub fn captured(self) -> Option<CapturedStep> {
        self.captured
    }
}

impl PairSink for Capture<'_, '_> {
    fn wants(&self, name: &str) -> bool {
        self.inner.wants(name)
    }

    /// The inputs of replayed steps are asked for even after a step was captured (then they
    /// are kept, and not used: nothing more is captured).
    fn answers(&self) -> Option<Answers> {
        let inner = self.inner.answers()?;
        Some(Answers {
            replay_inputs: self.enabled || self.directions.is_some(),
            reference_experts: self.directions.is_some(),
            chained_inputs: self.directions.is_some() && self.chained_directions,
            ..inner
        })
    }

    fn record(&mut self, pair: Pair<'_>) -> Result<()> {
        let inputs = match pair.mode {
            Mode::Replay => &self.pending,
            Mode::Chained => &self.pending_chained,
        };
        if let (Some(cpu), Some((step, values))) = (&self.directions, inputs) {
            // The same hook from inputs of the same bits (chained, then replay, before the
            // chains part) has the same directions: the chained pair's are kept for the replay
            // pair that comes next, and taken by it.
            let same = match pair.mode {
                Mode::Replay => self.last.take().filter(|(hook, from, _)| {
                    hook == pair.name
                        && from.len() == values.len()
                        && from.iter().zip(values).all(|(a, b)| a.same_bits(b))
                }),
                Mode::Chained => None,
            };
            let parts = match same {
                Some((_, _, parts)) => Ok(parts),
                None => {
                    let own = Own {
                        output: (self.exact_replay && pair.mode == Mode::Replay)
                            .then_some(&pair.reference),
                        experts: self
                            .own_experts
                            .as_ref()
                            .filter(|(outputs, _, _)| *outputs == step.outputs)
                            .map(|(_, inputs, experts)| (inputs.as_slice(), experts)),
                    };
                    directions::parts(cpu, step, values, pair.name, own)
                }
            };
            // A direction that cannot be computed leaves the hook to the other tests.
            if let Ok(parts) = parts {
                if !parts.is_empty() {
                    if pair.mode == Mode::Chained && self.replay {
                        self.last = Some((pair.name.to_string(), values.clone(), parts.clone()));
                    }
                    self.inner.components(pair.name, pair.mode, parts);
                }
            }
        }
        let keep = self.enabled
            && pair.mode == Mode::Replay
            && self.captured.is_none()
            && self.pending.is_some();
        let kept = keep.then(|| {
            (
                pair.name.to_string(),
                pair.reference.clone(),
                pair.candidate.clone(),
            )
        });
        // Steps inside a segment are kept until a pair of a later layer passes by.
        if pair.mode == Mode::Replay && !self.inside.is_empty() {
            let layer = names::split_blk(pair.name).map(|(l, _)| l);
            if self.captured.is_some() {
                self.inside.clear();
            } else if let Some(l) = layer {
                self.inside
                    .retain(|n, _| names::split_blk(n).is_none_or(|(k, _)| k >= l));
            }
        }
        self.inner.record(pair)?;
        if let Some((name, reference, candidate)) = kept {
            let failed = self
                .inner
                .get(&name)
                .and_then(|r| r.replay.as_ref())
                .filter(|r| r.status == Status::Fail);
            if let (Some(res), Some((step, values))) = (failed, &self.pending) {
                let inside = steps_inside(&self.inside, &step.inputs);
                self.captured = Some(CapturedStep {
                    inputs: step.inputs.iter().cloned().zip(values.clone()).collect(),
                    step: step.clone(),
                    hook: name,
                    reference,
                    candidate,
                    error: res.error,
                    allowed: res.allowed,
                    noise: noise(res),
                    inside,
                });
                self.pending = None;
            }
        }
        Ok(())
    }

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        self.inner.missing(name, mode, why);
    }

    fn wants_replay_inputs(&self) -> bool {
        (self.enabled && self.captured.is_none()) || self.directions.is_some()
    }

    fn wants_chained_inputs(&self) -> bool {
        self.directions.is_some() && self.chained_directions
    }

    fn wants_reference_experts(&self, _step: &Step) -> bool {
        self.directions.is_some()
    }

    fn reference_experts(
        &mut self,
        step: &Step,
        inputs: &[HostTensor],
        experts: Vec<(usize, HostTensor)>,
    ) {
        self.own_experts = Some((
            step.outputs.clone(),
            inputs.to_vec(),
            experts.into_iter().collect(),
        ));
    }

    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.pending_chained = Some((step.clone(), inputs.to_vec()));
    }

    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.pending = Some((step.clone(), inputs.to_vec()));
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        // A replayed step the candidate lacks the output of: a step inside a segment.
        if mode == Mode::Replay && self.enabled && self.captured.is_none() {
            if let Some((step, values)) = &self.pending {
                if step.outputs.iter().any(|o| o == name) {
                    self.inside
                        .insert(name.to_string(), (step.clone(), values.clone()));
                }
            }
        }
        self.inner.reference_only(name, mode, inputs, reference);
    }

    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        self.inner.followed(selection, mode, rows);
    }

    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        self.inner.plain_chain(name, reference, candidate);
    }
}

/// The steps of `inside` that produce `inputs`, and recursively theirs, upstream first, each
/// once, with their inputs by name.
fn steps_inside(
    inside: &HashMap<String, (Step, Vec<HostTensor>)>,
    inputs: &[String],
) -> Vec<(Step, Vec<(String, HostTensor)>)> {
    let mut out: Vec<(Step, Vec<(String, HostTensor)>)> = Vec::new();
    let mut visit: Vec<&String> = inputs.iter().collect();
    while let Some(n) = visit.pop() {
        let Some((step, values)) = inside.get(n) else {
            continue;
        };
        if out.iter().any(|(s, _)| s.outputs == step.outputs) {
            continue;
        }
        out.push((
            step.clone(),
            step.inputs.iter().cloned().zip(values.clone()).collect(),
        ));
        visit.extend(step.inputs.iter());
    }
    out.reverse();
    out
}

/// One hypothesis tested at the failing hook.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tested {
    /// The fault, in `--inject` words (`expert_swap:2,5`, `kv_b_concat@1`, `head_map:0,1,3,0`).
    pub kind: String,
    /// The hook it was tested at.
    pub hook: String,
    /// Relative L2 distance of its output to the candidate's: `|h - c| / |c|` (selections:
    /// `1 - mean Jaccard`).
    pub residual: f64,
    /// Within the floor the hook was judged by (and closer than the reference): it reproduces
    /// the candidate.
    pub reproduces: bool,
    /// The fitted parameter's name, for a continuous family (`factor`, `theta`, `eps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    /// The parameter's fitted value (the one `kind` shows, at full precision).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fitted: Option<f64>,
    /// The model's value of the parameter (what no fault gives).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nominal: Option<f64>,
}

/// What `--explain` found.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Explanation {
    /// No hook fails in replay: nothing to explain.
    NothingWrong,
    /// A hook fails, but its step's inputs were not at hand (a trace without them).
    NotCaptured {
        /// Why.
        note: String,
    },
    /// The hypotheses tested at the first failing hook, best first.
    Tested {
        /// The failing hook.
        hook: String,
        /// The step kind (`linear`, `moe_experts`, ...).
        step: String,
        /// The candidate's replay error there and the floor.
        error: f64,
        /// The floor.
        allowed: f64,
        /// The reference's own distance to the candidate (what no fault gives).
        reference_residual: f64,
        /// Every hypothesis that changes the step, best first.
        hypotheses: Vec<Tested>,
        /// Faults that apply to the step but leave its output exactly as the reference's (an
        /// expert swap of experts no token uses), and hypotheses that could not be computed.
        notes: Vec<String>,
    },
}

impl Explanation {
    /// The hypotheses that reproduce the candidate, best first.
    pub fn reproduced(&self) -> Vec<&Tested> {
        match self {
            Explanation::Tested { hypotheses, .. } => {
                hypotheses.iter().filter(|h| h.reproduces).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Every tested hypothesis, best first (empty unless tested).
    pub fn hypotheses(&self) -> &[Tested] {
        match self {
            Explanation::Tested { hypotheses, .. } => hypotheses,
            _ => &[],
        }
    }
}

/// The faults of the catalogue that concern `step`, each applied to the step's own layer, in
/// the order they are listed when two reproduce equally well.
pub fn hypotheses(step: &Step, weights: &Weights<'_>) -> Vec<Fault> {
    hypotheses_and_untestable(step, weights).0
}

/// [`hypotheses`], and the faults that concern the step but cannot be tested because the file
/// lacks a tensor they read (a step case holds only its step's tensors: the MTP block of
/// `run_mtp`, a neighbouring layer's weights), with the reason.
pub fn hypotheses_and_untestable(step: &Step, weights: &Weights<'_>) -> (Vec<Fault>, Vec<String>) {
    let faults = StepFaults {
        weights,
        layer: step.layer,
    };
    let mut v = faults.of_op(&step.op);
    // The routing and MoE families (the continuous ones at a seed that `explain` fits).
    v.extend(fit_route::hypotheses(step, weights));
    let untestable = keep_applicable(&mut v, weights, step.layer);
    // Fitted, on every model (the model's own base fails `check`, which `--inject` wants).
    if let Op::Rope(_) = step.op {
        let rope = &weights.hparams().rope;
        v.push(faults.at(FaultKind::RopeTheta(rope.base)));
        if let Some(y) = &rope.yarn {
            v.push(faults.at(FaultKind::YarnFactor(y.factor)));
        }
    }
    (v, untestable)
}

/// Keeps the faults of `v` that apply to this model and `layer` (`None`: a global step): a
/// neighbour that exists with the same shapes, an MoE layer for the router kinds, ... Returns
/// the faults dropped because the file lacks a tensor they read, with the reason.
fn keep_applicable(v: &mut Vec<Fault>, weights: &Weights<'_>, layer: Option<usize>) -> Vec<String> {
    let hp = weights.hparams();
    let run = layer.map_or(0..hp.n_layer, |l| l..l + 1);
    let global = layer.is_none();
    let mut untestable = Vec::new();
    v.retain(|f| match f.check(weights, run.clone(), global) {
        Ok(()) => true,
        Err(e) => {
            let why = format!("{e:#}");
            if why.contains("the file has no") {
                untestable.push(format!(
                    "{f} ({})",
                    why.trim_start_matches(&format!("--inject {f}: "))
                ));
            }
            false
        }
    });
    untestable
}

/// The catalogue's faults that concern one step, built at the step's layer
/// ([`hypotheses_and_untestable`]), before the model's check of each.
struct StepFaults<'a, 'w> {
    /// The model.
    weights: &'a Weights<'w>,
    /// The step's layer (`None`: a global step).
    layer: Option<usize>,
}

impl StepFaults<'_, '_> {
    /// Fault `k` at the step's layer.
    fn at(&self, k: FaultKind) -> Fault {
        Fault::new(k, self.layer.map(|l| vec![l]))
    }

    /// Whether the file's tensor `n` is Q4_K.
    fn is_q4k(&self, n: &str) -> bool {
        self.weights
            .model()
            .find(n)
            .is_some_and(|t| t.info.ty == GgmlType::Q4_K)
    }

    /// Weights from a neighbouring layer, for the tensors matching `glob`.
    fn neighbours(&self, glob: &str) -> Vec<Fault> {
        let Some(l) = self.layer else {
            return Vec::new();
        };
        [l.checked_sub(1), Some(l + 1)]
            .into_iter()
            .flatten()
            .map(|src| {
                self.at(FaultKind::LayerWeights {
                    src,
                    glob: glob.to_string(),
                })
            })
            .collect()
    }

    /// Every tensor-parallel split of whole heads the model's head count allows.
    fn shards(&self) -> Vec<Fault> {
        let hp = self.weights.hparams();
        (2..=hp.n_head)
            .filter(|n| hp.n_head % n == 0)
            .map(|n| self.at(FaultKind::TpShard(n)))
            .collect()
    }

    /// Any projection's: its matrix from a neighbouring layer or transposed, Q4_K scale bits,
    /// f32 sums.
    fn projection(&self, weight: &str) -> Vec<Fault> {
        let mut v = Vec::new();
        if let Some((_, s)) = names::split_blk(weight) {
            v.extend(self.neighbours(s));
            v.push(self.at(FaultKind::Transposed {
                glob: s.to_string(),
            }));
        }
        if self.is_q4k(weight) {
            v.push(self.at(FaultKind::Q4kScaleBits));
        }
        v.push(self.at(FaultKind::F32Accumulate));
        v
    }

    /// The faults that concern a step of `op`, in the catalogue's order.
    fn of_op(&self, op: &Op) -> Vec<Fault> {
        let mut v = Vec::new();
        match op {
            Op::Embed => {
                if self.is_q4k(names::TOKEN_EMBD) {
                    v.push(Fault::new(FaultKind::Q4kScaleBits, None));
                }
            }
            Op::RmsNorm { weight, eps, .. } => v.extend(self.norm(weight, *eps)),
            Op::Linear { weight } => v.extend(self.linear(weight)),
            Op::RouterLogits { layer: l } => {
                v.push(self.at(FaultKind::RouterBf16));
                v.extend(self.projection(&names::blk(*l, blk::FFN_GATE_INP)));
            }
            Op::Rope(_) => {
                v.push(self.at(FaultKind::RopeNeox));
                v.push(self.at(FaultKind::YarnMscale(Mscale::Missing)));
                v.push(self.at(FaultKind::YarnMscale(Mscale::Twice)));
            }
            Op::IndexerScores { .. } => {
                v.push(self.at(FaultKind::IndexerRopeNeox));
                v.push(self.at(FaultKind::IndexerNoRelu));
                // Fitted (one factor: both multiply every score).
                v.push(self.at(FaultKind::IndexerScale(1.0)));
                v.push(self.at(FaultKind::IndexerWprojScale(1.0)));
            }
            Op::TopK { k } => {
                v.extend(
                    [k.checked_sub(1), Some(k + 1)]
                        .into_iter()
                        .flatten()
                        .filter(|&n| n > 0)
                        .map(|n| self.at(FaultKind::DsaTopK(n))),
                );
            }
            Op::Attention { layer: l } => v.extend(self.attention(*l)),
            Op::MoeRoute { .. } => {
                if self.weights.hparams().gating == Gating::Sigmoid {
                    v.push(self.at(FaultKind::SoftmaxGating));
                }
                v.push(self.at(FaultKind::BiasInWeights));
            }
            Op::MoeExperts { layer: l } => v.extend(self.experts(*l)),
            Op::Mlp { gate, up, down } => {
                v.extend(self.neighbours("ffn_*_shexp.weight"));
                // Fitted: the output times a constant (the MLP is linear in its down matrix),
                // such as the routed scaling factor applied to the shared expert too.
                v.push(
                    self.at(FaultKind::WeightScale {
                        glob: names::split_blk(down)
                            .map_or(down.as_str(), |(_, s)| s)
                            .to_string(),
                        factor: 1.0,
                    }),
                );
                if [gate, up, down].iter().any(|n| self.is_q4k(n)) {
                    v.push(self.at(FaultKind::Q4kScaleBits));
                }
                v.push(self.at(FaultKind::F32Accumulate));
            }
            Op::SwiGlu | Op::Add | Op::Alias | Op::ZerosLike => {}
        }
        v
    }

    /// An RMSNorm's, of norm weight `weight` and epsilon `eps`: `run_mtp` before the final
    /// norm; fitted: the eps, the weight's scale; the (1 + w) convention, for every norm of the
    /// layer (the final norm's alone); the weight from a neighbouring layer.
    fn norm(&self, weight: &str, eps: f64) -> Vec<Fault> {
        let mut v = Vec::new();
        if weight == names::OUTPUT_NORM {
            v.push(Fault::new(FaultKind::RunMtp, None));
        }
        v.push(self.at(FaultKind::NormEps(eps)));
        let name = names::split_blk(weight).map_or(weight, |(_, s)| s);
        v.push(self.at(FaultKind::WeightScale {
            glob: name.to_string(),
            factor: 1.0,
        }));
        v.push(self.at(FaultKind::NormOnePlus {
            glob: match self.layer {
                Some(_) => fault::DEFAULT_NORM_ONE_PLUS.to_string(),
                None => weight.to_string(),
            },
        }));
        if let Some((_, suffix)) = names::split_blk(weight) {
            v.extend(self.neighbours(suffix));
        }
        v
    }

    /// A projection's by `weight`: the tensor-parallel shards for q_b and the attention
    /// output, [`StepFaults::projection`]'s, and, fitted, the matrix's scale.
    fn linear(&self, weight: &str) -> Vec<Fault> {
        let mut v = Vec::new();
        let suffix = names::split_blk(weight).map(|(_, s)| s);
        if suffix == Some(blk::ATTN_Q_B) || suffix == Some(blk::ATTN_OUTPUT) {
            v.extend(self.shards());
        }
        v.extend(self.projection(weight));
        v.push(self.at(FaultKind::WeightScale {
            glob: suffix.unwrap_or(weight).to_string(),
            factor: 1.0,
        }));
        v
    }

    /// Layer `l`'s attention's: kv_b's layout, the softmax scale's known bugs; fitted, the
    /// softmax scale and each kv_b tensor's scale; the tensor-parallel shards.
    fn attention(&self, l: usize) -> Vec<Fault> {
        let mut v = vec![
            self.at(FaultKind::KvBConcat),
            self.at(FaultKind::KvBSplit),
            self.at(FaultKind::ScaleLatent),
            self.at(FaultKind::YarnMscale(Mscale::Missing)),
            self.at(FaultKind::SoftmaxScale(1.0)),
        ];
        for n in self.weights.kv_b_names(l) {
            let glob = names::split_blk(&n).map_or(n.as_str(), |(_, s)| s);
            v.push(self.at(FaultKind::WeightScale {
                glob: glob.to_string(),
                factor: 1.0,
            }));
        }
        v.extend(self.shards());
        v
    }

    /// Layer `l`'s routed experts': gate and up exchanged, Q4_K scale bits when an expert
    /// tensor is Q4_K, the experts' weights from a neighbouring layer.
    fn experts(&self, l: usize) -> Vec<Fault> {
        let mut v = vec![self.at(FaultKind::GateUpSwap)];
        let mut names = self.weights.expert_gate_up_names(l);
        names.push(names::blk(l, blk::FFN_DOWN_EXPS));
        if names.iter().any(|n| self.is_q4k(n)) {
            v.push(self.at(FaultKind::Q4kScaleBits));
        }
        v.extend(self.neighbours("ffn_*_exps.weight"));
        v
    }
}

/// Recomputes `step` from `inputs` on `engine` and returns its output at `hook`.
fn output_at<E: Engine<Tensor = HostTensor>>(
    engine: &E,
    step: &Step,
    inputs: &[(String, HostTensor)],
    tokens: &[u32],
    hook: &str,
) -> Result<HostTensor> {
    let refs: Vec<&HostTensor> = inputs.iter().map(|(_, t)| t).collect();
    let wants = |n: &str| n == hook;
    let out = exec_step(engine, step, &refs, tokens, &wants)?;
    if let Some(i) = step.outputs.iter().position(|o| o == hook) {
        return out
            .outputs
            .into_iter()
            .nth(i)
            .with_context(|| format!("explain: the step did not produce {hook}"));
    }
    out.extra
        .into_iter()
        .find(|(n, _)| n == hook)
        .map(|(_, t)| t)
        .with_context(|| format!("explain: the step did not produce {hook}"))
}

/// [`residual`] for a candidate selection of another width than the reference's: two
/// selections of ids of the same rows but other widths are compared with the narrower one
/// padded with -1 (a selection that keeps fewer keys or experts keeps no more than its ids).
pub fn residual_of_width(candidate: &HostTensor, hypothesis: &HostTensor) -> f64 {
    match pad_to_same_width(candidate, hypothesis) {
        Some((c, h)) => residual(&c, &h),
        None => residual(candidate, hypothesis),
    }
}

/// `|h - c| / |c|` (floats) or `1 - mean Jaccard` (selections); infinite when not comparable.
pub fn residual(candidate: &HostTensor, hypothesis: &HostTensor) -> f64 {
    compare(candidate, hypothesis).map_or(f64::INFINITY, |m| {
        let e = m.error();
        if e.is_nan() {
            f64::INFINITY
        } else {
            e
        }
    })
}

/// Two id selections `[T, a]` and `[T, b]` with `a != b`, the narrower padded with -1 to the
/// wider's width; `None` for anything else.
fn pad_to_same_width(a: &HostTensor, b: &HostTensor) -> Option<(HostTensor, HostTensor)> {
    let (&[ra, wa], &[rb, wb]) = (&a.shape[..], &b.shape[..]) else {
        return None;
    };
    let (va, vb) = (a.as_i32("").ok()?, b.as_i32("").ok()?);
    if ra != rb || wa == wb || wa == 0 || wb == 0 {
        return None;
    }
    let w = wa.max(wb);
    let pad = |v: &[i32], have: usize| -> Option<HostTensor> {
        let mut out = Vec::with_capacity(ra * w);
        for row in v.chunks(have) {
            out.extend_from_slice(row);
            out.extend(std::iter::repeat_n(-1, w - have));
        }
        HostTensor::i32(vec![ra, w], out).ok()
    };
    Some((pad(va, wa)?, pad(vb, wb)?))
}

/// The most ids any row of a selection keeps (-1 is padding); `None` for a tensor of no ids.
fn kept_per_row(ids: &HostTensor) -> Option<usize> {
    let v = ids.as_i32("").ok()?;
    let w = *ids.shape.last()?;
    v.chunks(w.max(1))
        .map(|r| r.iter().filter(|&&x| x >= 0).count())
        .max()
        .filter(|&k| k > 0)
}

/// Tests every hypothesis that concerns the captured step (module documentation), reporting
/// each one tested to `progress`.
pub fn explain(
    captured: &CapturedStep,
    weights: &Weights<'_>,
    tokens: &[u32],
    progress: &dyn Progress,
) -> Result<Explanation> {
    let mut run = Explaining::new(captured, weights, tokens);
    let faults = run.faults();
    // The known bugs, then a search for the expert or head map.
    progress.start("explain: hypotheses", faults.len() as u64 + 1);
    for fault in faults {
        if fit_attn::param(&fault.kind, &captured.step, weights.hparams()).is_some() {
            run.test_fitted(&fault);
        } else {
            run.test_routed(&fault);
        }
        progress.inc(1);
    }
    progress.phase("explain: expert and head maps");
    run.search_maps();
    progress.finish();
    Ok(run.finish())
}

/// An explanation under way ([`explain`]): the captured step and what recomputes it, the
/// hypotheses tested so far and the notes they leave.
struct Explaining<'a> {
    /// The failing step.
    captured: &'a CapturedStep,
    /// The model.
    weights: &'a Weights<'a>,
    /// The prompt's tokens.
    tokens: &'a [u32],
    /// The CPU reference the step is recomputed on.
    cpu: CpuEngine<'a>,
    /// The reference's own distance to the candidate (what no fault gives).
    reference_residual: f64,
    /// The hypotheses that change the step, in the order tested.
    tested: Vec<Tested>,
    /// Fits, searches and hypotheses that could not be computed, in words.
    notes: Vec<String>,
    /// The hypotheses that leave the step's output exactly as the reference's.
    unchanged: Vec<String>,
    /// The routing families' fits, whose parameters the tested hypotheses report.
    fits: Vec<fit_route::Fit>,
    /// Where the candidate's selection is of another width than the model's: the known bug of
    /// that width (`dsa_topk:K`, `experts_per_token:K` at the step's layer), ranked first.
    width_kind: Option<String>,
}

impl<'a> Explaining<'a> {
    /// An explanation of `captured` on `weights` and `tokens`, nothing tested yet.
    fn new(captured: &'a CapturedStep, weights: &'a Weights<'a>, tokens: &'a [u32]) -> Self {
        Explaining {
            captured,
            weights,
            tokens,
            cpu: CpuEngine::new(weights),
            reference_residual: residual(&captured.candidate, &captured.reference),
            tested: Vec::new(),
            notes: Vec::new(),
            unchanged: Vec::new(),
            fits: Vec::new(),
            width_kind: None,
        }
    }

    /// The faults to test: the step's hypotheses and, for a selection that keeps another
    /// number of keys than the model's, that number read off the candidate (its fullest row),
    /// besides the model's neighbours. Notes the faults the weights cannot test.
    fn faults(&mut self) -> Vec<Fault> {
        let step = &self.captured.step;
        let (mut faults, mut untestable) = hypotheses_and_untestable(step, self.weights);
        // Inside a segment: the hypotheses of its steps too (each re-run by `eval`).
        for (inner, _) in &self.captured.inside {
            let (more, why) = hypotheses_and_untestable(inner, self.weights);
            for f in more {
                if !faults
                    .iter()
                    .any(|x| x.kind == f.kind && x.layers == f.layers)
                {
                    faults.push(f);
                }
            }
            for w in why {
                if !untestable.contains(&w) {
                    untestable.push(w);
                }
            }
        }
        if let (Op::TopK { k: model }, Some(k)) = (&step.op, kept_per_row(&self.captured.candidate))
        {
            let f = Fault::new(FaultKind::DsaTopK(k), step.layer.map(|l| vec![l]));
            if self.captured.candidate.shape != self.captured.reference.shape {
                self.width_kind = Some(f.to_string());
            }
            if k != *model && !faults.iter().any(|x| x.kind == f.kind) {
                faults.push(f);
            }
        }
        // Experts routed per token: the candidate's selection (or weights) of another width
        // than the model's names its count, tested first.
        let used = self.weights.hparams().n_expert_used;
        let selection = matches!(
            crate::compare::floors::point_of(&self.captured.hook),
            point::MOE_TOPK_IDS | point::MOE_WEIGHTS
        );
        if let (Op::MoeRoute { .. }, [_, k], true) =
            (&step.op, &self.captured.candidate.shape[..], selection)
        {
            if *k != used
                && *k > 0
                && self.captured.candidate.shape != self.captured.reference.shape
            {
                let f = Fault::new(FaultKind::ExpertsPerToken(*k), step.layer.map(|l| vec![l]));
                self.width_kind = Some(f.to_string());
                faults.insert(0, f);
            }
        }
        if !untestable.is_empty() {
            self.notes.push(format!(
                "not testable with these weights: {}",
                untestable.join("; ")
            ));
        }
        faults
    }

    /// The step's output at the failing hook, recomputed on the CPU reference under `fault`.
    fn eval(&self, fault: &Fault) -> Result<HostTensor> {
        let captured = self.captured;
        let engine = FaultEngine::new(&self.cpu, self.weights, vec![fault.clone()]);
        if let Some(l) = captured.step.layer {
            engine.begin_layer(l, &[])?;
        }
        if captured.inside.is_empty() {
            return output_at(
                &engine,
                &captured.step,
                &captured.inputs,
                self.tokens,
                &captured.hook,
            );
        }
        // A segment: its steps first, under the fault too, their outputs in place of the
        // values replay fed on.
        let mut computed: HashMap<String, HostTensor> = HashMap::new();
        let substitute = |inputs: &[(String, HostTensor)],
                          computed: &HashMap<String, HostTensor>| {
            inputs
                .iter()
                .map(|(n, t)| (n.clone(), computed.get(n).unwrap_or(t).clone()))
                .collect::<Vec<_>>()
        };
        for (step, inputs) in &captured.inside {
            let inputs = substitute(inputs, &computed);
            for out in &step.outputs {
                let t = output_at(&engine, step, &inputs, self.tokens, out)?;
                computed.insert(out.clone(), t);
            }
        }
        let inputs = substitute(&captured.inputs, &computed);
        output_at(
            &engine,
            &captured.step,
            &inputs,
            self.tokens,
            &captured.hook,
        )
    }

    /// Records hypothesis `kind`, whose output at the hook is `out` (with its fitted
    /// parameter, for a continuous family): tested, or unchanged when `out` is the reference's.
    fn push(&mut self, kind: String, out: &HostTensor, fit: Option<&fit_attn::Fit>) {
        let captured = self.captured;
        if *out == captured.reference {
            self.unchanged.push(kind);
            return;
        }
        // A candidate selection of another width than the model's is compared as sets with
        // what each hypothesis keeps (the known bugs of that width keep as many).
        let r = if captured.candidate.shape == captured.reference.shape {
            residual(&captured.candidate, out)
        } else {
            residual_of_width(&captured.candidate, out)
        };
        self.tested.push(Tested {
            kind,
            hook: captured.hook.clone(),
            residual: r,
            reproduces: r <= captured.allowed
                && r < self.reference_residual
                && captured.noise.is_none_or(|n| r <= NOISE_SLACK * n),
            param: fit.map(|f| f.param.to_string()),
            fitted: fit.map(|f| f.fitted),
            nominal: fit.map(|f| f.nominal),
        });
    }

    /// Tests a continuous family's `fault` with its fitted parameter.
    fn test_fitted(&mut self, fault: &Fault) {
        let captured = self.captured;
        let cand = &captured.candidate;
        let r = |out: &HostTensor| residual(cand, out);
        let eval = |f: &Fault| self.eval(f);
        let fitted = fit_attn::fit(
            fault,
            &captured.step,
            self.weights,
            &captured.reference,
            cand,
            &eval,
            &r,
        );
        match fitted {
            Ok(fit) => {
                self.push(fit.fault.to_string(), &fit.output, Some(&fit));
                if let Some(n) = &fit.note {
                    self.notes.push(format!("{}: {n}", fit.fault));
                }
            }
            Err(e) => self.notes.push(format!("{fault}: not fitted: {e:#}")),
        }
    }

    /// Tests `fault`, a routing family's with its parameter fitted first, or a known bug's as
    /// it is: the step recomputed with it.
    fn test_routed(&mut self, fault: &Fault) {
        let (fault, kind) = match fit_route::fit(fault, self.captured, self.weights, self.tokens) {
            Ok(Some(f)) => {
                let named = (f.fault.clone(), f.kind.clone());
                self.fits.push(f);
                named
            }
            Ok(None) => (fault.clone(), fault.to_string()),
            Err(e) => {
                self.notes.push(format!("{fault}: not fitted: {e:#}"));
                return;
            }
        };
        match self.eval(&fault) {
            Ok(out) => self.push(kind, &out, None),
            Err(e) => self.notes.push(format!("{fault}: not computed: {e:#}")),
        }
    }

    /// The structural searches the step's op or hook allows: the expert map of a
    /// routed-experts step, the dense MLP's gate and up exchanged after their projections, the
    /// head map of a per-head hook.
    fn search_maps(&mut self) {
        let captured = self.captured;
        let (step, hook) = (&captured.step, captured.hook.as_str());
        let cand = &captured.candidate;
        let input = |name: &str| {
            captured
                .inputs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
        };
        match &step.op {
            Op::MoeExperts { layer } => {
                let (x, ids, w) = (
                    input(&step.inputs[0]),
                    input(&step.inputs[1]),
                    input(&step.inputs[2]),
                );
                if let (Some(x), Some(ids), Some(w)) = (x, ids, w) {
                    if step.outputs.first().map(String::as_str) == Some(hook) {
                        match search::expert_map(&self.cpu, *layer, x, ids, w, cand) {
                            Ok(Some((map, out))) => {
                                let f = Fault::new(FaultKind::ExpertMap(map), Some(vec![*layer]));
                                self.push(f.to_string(), &out, None);
                            }
                            Ok(None) => {}
                            Err(e) => self.notes.push(format!("expert search: {e:#}")),
                        }
                    }
                }
            }
            // A dense MLP whose gate and up were exchanged after their projections (the
            // projections' hooks agree, `silu(up) * gate` does not): the SwiGLU of its inputs
            // exchanged.
            Op::SwiGlu if step.inputs.len() == 2 => {
                if let (Some(g), Some(u)) = (input(&step.inputs[0]), input(&step.inputs[1])) {
                    match self.cpu.swiglu(u, g) {
                        Ok(out) => {
                            let f = Fault::new(
                                FaultKind::GateUpSwapMlp(fault::MlpPart::Dense),
                                step.layer.map(|l| vec![l]),
                            );
                            self.push(f.to_string(), &out, None);
                        }
                        Err(e) => self.notes.push(format!("gate/up exchange: {e:#}")),
                    }
                }
            }
            _ if [point::Q_B, point::Q_PE_ROPE, point::ATTN_HEADS]
                .contains(&crate::compare::floors::point_of(hook)) =>
            {
                if let Some((map, out)) =
                    search::head_map(&captured.reference, cand, self.weights.hparams().n_head)
                {
                    self.push(search::head_map_name(&map, step.layer), &out, None);
                }
            }
            _ => {}
        }
    }

    /// The explanation: the routing fits' parameters on their hypotheses, the notes (the
    /// unchanged hypotheses first), the hypotheses best first.
    fn finish(self) -> Explanation {
        let Explaining {
            captured,
            reference_residual,
            mut tested,
            mut notes,
            unchanged,
            fits,
            width_kind,
            ..
        } = self;
        for t in &mut tested {
            if let Some(f) = fits.iter().find(|f| f.kind == t.kind) {
                (t.param, t.fitted, t.nominal) =
                    (Some(f.param.clone()), Some(f.fitted), Some(f.nominal));
            }
        }
        let indexer =
            |k: &str| k.starts_with("indexer_scale:") || k.starts_with("indexer_wproj_scale:");
        if tested.iter().filter(|t| indexer(&t.kind)).count() == 2 {
            notes.push(
                "indexer_scale and indexer_wproj_scale multiply every index score alike: this hook cannot tell them apart (the fitted factor's note may)"
                    .to_string(),
            );
        }
        if !unchanged.is_empty() {
            notes.insert(
                0,
                format!(
                    "leave this step's output exactly as the reference's: {}",
                    unchanged.join(", ")
                ),
            );
        }
        // Best first; equal residuals keep the catalogue's order (stable sort). A selection of
        // another width than the model's is that width's known bug before anything of the
        // model's width, whatever the residuals (no hypothesis of the model's width keeps as
        // many).
        let width_first = |t: &Tested| width_kind.as_deref() != Some(t.kind.as_str());
        tested.sort_by(|a, b| {
            width_first(a)
                .cmp(&width_first(b))
                .then(a.residual.total_cmp(&b.residual))
        });
        if let Some(k) = &width_kind {
            let (c, r) = (&captured.candidate.shape, &captured.reference.shape);
            notes.push(format!(
                "the candidate keeps {}, the model says {}: {k} is ranked first, named from the candidate's width",
                c.last().copied().unwrap_or(0),
                r.last().copied().unwrap_or(0)
            ));
        }
        Explanation::Tested {
            hook: captured.hook.clone(),
            step: crate::driver::op_name(&captured.step.op).to_string(),
            error: captured.error,
            allowed: captured.allowed,
            reference_residual,
            hypotheses: tested,
            notes,
        }
    }
}
