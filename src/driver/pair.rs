//! Two engines over one plan, in one pass: a reference and a candidate, compared hook by hook.
//!
//! Modes (both can run in the same pass):
//! - **chained**: each side runs on its own earlier outputs, so a hook shows the error accumulated
//!   up to it. The reference's chain follows the candidate's near-tie selections
//!   ([`super::follow`]); the reference's own chain (what a user's output shows) is handed over
//!   where it differs.
//! - **replay**: each step is run by both sides *from the same inputs*, so a hook shows that
//!   step's own error, and the first bad step is named even when everything after it is garbage.
//!   With an engine as candidate the inputs are the reference's (`upload(download(..))`); with a
//!   trace as candidate (an engine glmdiff cannot run) the reference runs the step from the
//!   trace's own inputs and is compared with the trace's output.
//!
//! Selections are step inputs: the attention step reads the DSA key selection (`indexer_topk`),
//! the expert step the routing (`moe_topk_ids`, `moe_weights`). In replay they come from the
//! candidate (its own selection from the reference's scores), so that attention and expert
//! arithmetic are checked on the keys and experts the candidate really used; when that differs
//! from the reference's selection the reference recomputes the step with the candidate's
//! selection, so both sides still start from the same inputs (only in the rows the changed
//! selection reaches, spliced into its own outputs: [`super::rows`]). The selection step itself
//! is judged on its own.
//!
//! Against a trace, replay runs in [`super::segment`]: where the trace lacks a step's input,
//! the reference computes it from the trace's nearest hooks upstream, so a segment of steps is
//! compared as one at the next hook the trace has; a selection the trace lacks is the
//! reference's own, with its near-tie alternatives tried against the candidate's output.
//!
//! Both engines are told the weights of the layers they run (`Engine::begin_layer` and the other
//! residency hooks, see [`super`]); a candidate engine that only replays is told only of the
//! layers whose steps it replays (and of the next of those as the one to prefetch). After each
//! of its steps the candidate engine is asked what it spent on weight uploads
//! (`Engine::take_upload_stats`), which the layer's time records apart.
//!
//! Every output the sink wants is downloaded, handed to the sink as a (reference, candidate) pair
//! and dropped: nothing accumulates here, so memory stays bounded by a layer's activations.
//! Hooks that cannot be compared (missing from a trace, or a step whose inputs are missing) are
//! reported to the sink as missing, not as errors; the reference's value of a hook a trace
//! lacks is handed to the sink on its own ([`PairSink::reference_only`]: its scores judge a
//! selection's flips, its steps compose a segment's floor).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

use anyhow::{Context, Result};

use super::follow::{Follow, FollowStep};
pub use super::replay::{is_selection, LayerTime, PairSummary, ReferenceWork, Work};
use super::replay::{replay_step, step_wanted};
use super::rows::{self, Prepared};
use super::segment::TraceReplay;
use super::timed::Timed;
use super::{check_tokens, Plan, Progress, Residency, Runner, StepProgress};
use crate::engine::{Engine, ExpertsOut, HostTensor, UploadStats};
use crate::model::steps::{expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, Pair, PairSink, TraceFile};

pub use crate::words::Modes;

/// The candidate side of a pass.
pub enum Candidate<'a, C: Engine> {
    /// An engine glmdiff runs.
    Engine(&'a C),
    /// A trace dumped by another engine (hooks of `docs/hooks.md`).
    Trace(&'a TraceFile),
}

/// Runs `plan` on `reference` and `candidate` for `tokens`, starting from `start` (the plan's
/// free inputs, given to both sides), in `modes`; hands every wanted hook to `sink`.
#[allow(clippy::too_many_arguments)]
pub fn run_pair<R: Engine + Sync, C: Engine>(
    reference: &R,
    candidate: Candidate<'_, C>,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    start: &[(String, HostTensor)],
    modes: Modes,
    sink: &mut dyn PairSink,
    progress: &dyn Progress,
) -> Result<PairSummary>
where
    R::Tensor: Send,
{
    run_pair_with(
        reference, candidate, weights, tokens, plan, start, modes, sink, progress, true,
    )
}

/// [`run_pair`], where the reference recomputes a replayed step with the candidate's selection
/// and runs the followed chain only where they change ([`super::rows`]) when `only_changed`, and
/// whole otherwise (what tests compare it with: the results are the same bit for bit).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_pair_with<R: Engine + Sync, C: Engine>(
    reference: &R,
    candidate: Candidate<'_, C>,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    start: &[(String, HostTensor)],
    modes: Modes,
    sink: &mut dyn PairSink,
    progress: &dyn Progress,
    only_changed: bool,
) -> Result<PairSummary>
where
    R::Tensor: Send,
{
    check_tokens(weights, tokens)?;
    // The sink's own time (the comparison), kept apart from either side's.
    let spent = Cell::new(0.0);
    let mut timed = Timed {
        inner: sink,
        spent: &spent,
    };
    let sink: &mut dyn PairSink = &mut timed;
    let mut refr = Runner::new(reference, plan, tokens, start, &[])?;
    let mut cand = match (&candidate, modes.chained) {
        (Candidate::Engine(c), true) => Some(Runner::new(*c, plan, tokens, start, &[])?),
        _ => None,
    };
    let mut summary = PairSummary::default();
    // The weight hooks of a candidate engine that only replays (no runner of its own): it
    // begins the layers with a step it replays.
    let mut cand_residency = Residency::only(
        plan.steps
            .iter()
            .filter(|s| s.op != Op::Alias && step_wanted(s, &*sink, weights))
            .filter_map(|s| s.layer)
            .collect(),
    );
    // The candidate's replayed selections (engine candidates), by hook name.
    let mut cand_sel: HashMap<String, HostTensor> = HashMap::new();
    // Replay against a trace: across the hooks it lacks.
    let mut trace_replay = match (&candidate, modes.replay) {
        (Candidate::Trace(tr), true) => Some(TraceReplay::new(tr, plan)),
        _ => None,
    };
    // Chained: the reference's chain that follows the candidate's near-tie selections.
    let mut follow = Follow::new(plan, only_changed);
    let mut steps = StepProgress::start(progress, plan);
    while let Some(step) = refr.peek() {
        steps.before(step);
        let compared_before = spent.get();
        // Replay inputs are taken before the reference moves on (its step may drop them), and
        // only for steps with a wanted hook: nothing else leaves the reference.
        let replay_inputs = match &candidate {
            Candidate::Engine(_) if modes.replay && step_wanted(step, &*sink, weights) => {
                Some(replay_inputs(&refr, step, &cand_sel)?)
            }
            _ => None,
        };
        let layer = step.layer;
        // The reference's own per-expert outputs, for a sink that takes them (with the inputs
        // they were computed from).
        let own_experts = match step.op {
            Op::MoeExperts { layer } if sink.wants_reference_experts(step) => {
                Some((layer, own_inputs(&refr, reference, step)?))
            }
            _ => None,
        };
        // The names the reference's step hands out, asked of the sink here (it stays on this
        // thread while the reference runs on another).
        let ref_wants: HashSet<String> = step_names(step, weights)
            .into_iter()
            .filter(|n| {
                sink.wants(n)
                    || own_experts
                        .as_ref()
                        .is_some_and(|(l, _)| expert_of(*l, n).is_some())
            })
            .collect();
        // The rows of a routed-experts step that the followed chain and the replay recompute,
        // computed in the reference's own pass over the experts' weights.
        let joint = experts_requests(
            reference,
            &refr,
            step,
            start,
            &follow,
            replay_inputs.as_ref().and_then(|r| r.as_ref().ok()),
            JointFor {
                follow: modes.chained && only_changed,
                replay: only_changed,
            },
        )?;
        let joint_rows: Vec<Vec<usize>> = joint.more.iter().map(|(_, r)| r.clone()).collect();
        // The candidate's replay of the step, from the inputs taken above.
        let replay_now = match (&candidate, &replay_inputs) {
            (Candidate::Engine(c), Some(Ok(inputs))) if step.op != Op::Alias => Some((*c, inputs)),
            _ => None,
        };
        // The reference's step (CPU threads) and the candidate's (its device) at the same time:
        // neither reads the other's values until both are done.
        let (ref_done, cand_done) = std::thread::scope(|scope| {
            let refr = &mut refr;
            let ref_wants = &ref_wants;
            let more = joint.more;
            let ref_side = scope.spawn(move || -> Result<RefStep<R::Tensor>> {
                let t0 = Instant::now();
                let (extra, joint) = refr.step_joint(&|n: &str| ref_wants.contains(n), &more)?;
                let mut out = Vec::new();
                for n in step.outputs.iter().filter(|n| ref_wants.contains(*n)) {
                    let t = refr.get(n).with_context(|| {
                        format!("driver: output {n} of the step just run is gone")
                    })?;
                    out.push((n.clone(), reference.download(t)?));
                }
                let extra = extra
                    .into_iter()
                    .filter(|(n, _)| ref_wants.contains(n))
                    .map(|(n, t)| Ok((n, reference.download(&t)?)))
                    .collect::<Result<Vec<_>>>()?;
                Ok(RefStep {
                    out,
                    extra,
                    joint,
                    seconds: t0.elapsed().as_secs_f64(),
                })
            });
            let cand_side = (|| -> Result<CandStep> {
                let mut done = CandStep::default();
                if modes.chained {
                    if let (Candidate::Engine(_), Some(c)) = (&candidate, &mut cand) {
                        let t0 = Instant::now();
                        let extra = {
                            let wants = |n: &str| sink.wants(n);
                            c.step(&wants)?
                        };
                        for n in &step.outputs {
                            if sink.wants(n) || is_selection(n) {
                                let t = c.get(n).with_context(|| {
                                    format!("driver: output {n} of the step just run is gone")
                                })?;
                                done.chained.insert(n.clone(), c.engine().download(t)?);
                            }
                        }
                        for (n, t) in extra {
                            if sink.wants(&n) {
                                done.chained.insert(n, c.engine().download(&t)?);
                            }
                        }
                        done.chained_seconds = t0.elapsed().as_secs_f64();
                        done.chained_upload = Some(c.engine().take_upload_stats());
                    }
                }
                if let Some((c, inputs)) = replay_now {
                    let t0 = Instant::now();
                    if cand.is_none() {
                        cand_residency.enter(c, plan, step)?;
                    }
                    let wants = |n: &str| sink.wants(n) || is_selection(n);
                    done.replay = Some(replay_step(c, step, &inputs.values, tokens, &wants)?);
                    done.replay_seconds = t0.elapsed().as_secs_f64();
                    done.replay_upload = Some(c.take_upload_stats());
                }
                Ok(done)
            })();
            let ref_done = ref_side
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("driver: the reference's step panicked")));
            (ref_done, cand_side)
        });
        let RefStep {
            out: ref_out,
            extra: ref_extra,
            joint: mut joint_out,
            seconds: took,
        } = ref_done?;
        // The further rows the engine computed (one that computes only whole steps gives none).
        let further: usize = joint_rows
            .iter()
            .zip(&joint_out)
            .filter(|(_, out)| out.is_some())
            .map(|(rows, _)| rows.len())
            .sum();
        let mut prepared = |at: Option<usize>| {
            let i = at?;
            Some(Prepared {
                rows: joint_rows.get(i)?.clone(),
                out: joint_out.get_mut(i)?.take()?,
            })
        };
        let (follow_prepared, replay_prepared) = (prepared(joint.follow), prepared(joint.replay));
        let mut cand_done = cand_done?;
        summary.time(layer).reference += took;
        if step.op != Op::Alias {
            summary.reference_work.plain.add(tokens.len(), took);
        }
        if further > 0 {
            summary.reference_work.joint.add(further, took);
        }
        {
            let t = summary.time(layer);
            t.chained += cand_done.chained_seconds;
            t.replay += cand_done.replay_seconds;
            for u in [
                cand_done.chained_upload.take(),
                cand_done.replay_upload.take(),
            ]
            .into_iter()
            .flatten()
            {
                t.add_upload(u);
            }
        }
        let mut experts = Vec::new();
        let mut wanted_extra = Vec::new();
        for (n, host) in ref_extra {
            let own = own_experts.as_ref().and_then(|(l, _)| expert_of(*l, &n));
            match (own, sink.wants(&n)) {
                (Some(e), true) => {
                    experts.push((e, host.clone()));
                    wanted_extra.push((n, host));
                }
                (Some(e), false) => experts.push((e, host)),
                (None, _) => wanted_extra.push((n, host)),
            }
        }
        if let Some((_, inputs)) = &own_experts {
            sink.reference_experts(step, inputs, experts);
        }
        let ref_extra: Vec<(String, HostTensor)> = wanted_extra;

        if modes.chained {
            let cand_values = &cand_done.chained;
            let value = |n: &str| -> Result<Option<HostTensor>> {
                match &candidate {
                    Candidate::Trace(tr) => tr.get(n),
                    Candidate::Engine(_) => Ok(cand_values.get(n).cloned()),
                }
            };
            let plain_out: Vec<(String, HostTensor)> =
                ref_out.iter().chain(&ref_extra).cloned().collect();
            let (t0, f0) = (Instant::now(), spent.get());
            follow.step(
                FollowStep {
                    reference,
                    plain: &refr,
                    plain_out: &plain_out,
                    weights,
                    step,
                    tokens,
                    start,
                    absent: absent(&candidate),
                    prepared: follow_prepared,
                },
                &value,
                sink,
                &mut summary,
            )?;
            // The followed chain's steps are the reference's; its pairs' comparison is not.
            summary.time(layer).reference +=
                (t0.elapsed().as_secs_f64() - (spent.get() - f0)).max(0.0);
        }

        if let Some(inputs) = replay_inputs {
            match inputs {
                Err(why) => {
                    for (n, _) in ref_out.iter().chain(&ref_extra) {
                        sink.missing(n, Mode::Replay, &why);
                        summary.missing += 1;
                    }
                }
                Ok(inputs) => {
                    if step.op != Op::Alias && sink.wants_replay_inputs() {
                        sink.replay_inputs(step, &inputs.values);
                    }
                    match &candidate {
                        Candidate::Engine(_) => {
                            if step.op == Op::Alias {
                                // No arithmetic: the candidate's selection keeps its new name.
                                if let (Some(src), Some(out)) =
                                    (step.inputs.first(), step.outputs.first())
                                {
                                    if let Some(v) = cand_sel.get(src).cloned() {
                                        cand_sel.insert(out.clone(), v);
                                    }
                                }
                            } else {
                                // Computed beside the reference's step above.
                                let out = cand_done.replay.take().with_context(|| {
                                    format!(
                                        "driver: the candidate's replay of {:?} is gone",
                                        step.outputs
                                    )
                                })?;
                                for (n, t) in &out {
                                    if is_selection(n) {
                                        cand_sel.insert(n.clone(), t.clone());
                                    }
                                }
                                // The reference recomputes the step when the candidate's
                                // selection differs from its own: only the rows it reaches
                                // where it can.
                                let own = ref_out.iter().chain(&ref_extra).cloned().collect();
                                let reference_side = if inputs.substituted {
                                    recompute_reference(
                                        reference,
                                        step,
                                        &inputs,
                                        own,
                                        tokens,
                                        &*sink,
                                        only_changed,
                                        replay_prepared,
                                        &mut summary,
                                    )?
                                } else {
                                    own
                                };
                                let reference_side: Vec<(String, HostTensor)> = reference_side
                                    .into_iter()
                                    .filter(|(n, _)| sink.wants(n))
                                    .collect();
                                let cand: Vec<(String, Option<HostTensor>)> =
                                    out.into_iter().map(|(n, t)| (n, Some(t))).collect();
                                hand_over(
                                    sink,
                                    Mode::Replay,
                                    absent(&candidate),
                                    step,
                                    reference_side.into_iter(),
                                    cand,
                                    None,
                                    &mut summary,
                                )?;
                            }
                        }
                        // Replayed by `trace_replay` below.
                        Candidate::Trace(_) => {}
                    }
                }
            }
        }
        if let Some(tr) = &mut trace_replay {
            tr.step(reference, weights, step, tokens, start, sink, &mut summary)?;
        }
        summary.time(layer).compare += spent.get() - compared_before;
        summary.steps += 1;
        steps.after(step);
    }
    refr.finish()?;
    if let Some(c) = &mut cand {
        c.finish()?;
    }
    if let Candidate::Engine(c) = &candidate {
        cand_residency.finish(*c)?;
    }
    steps.finish();
    Ok(summary)
}

/// The reference's side of one step, run beside the candidate's.
struct RefStep<T> {
    /// Its outputs the sink wants, on the host.
    out: Vec<(String, HostTensor)>,
    /// Its optional hooks asked for, on the host.
    extra: Vec<(String, HostTensor)>,
    /// The further rows computed in its pass ([`Joint::more`]), in order.
    joint: Vec<Option<ExpertsOut<T>>>,
    /// Seconds it took.
    seconds: f64,
}

/// The candidate engine's side of one step, run beside the reference's.
#[derive(Default)]
struct CandStep {
    /// Chained: the outputs the sink wants and its selections, on the host.
    chained: HashMap<String, HostTensor>,
    /// Seconds of the chained step.
    chained_seconds: f64,
    /// The chained step's uploads.
    chained_upload: Option<UploadStats>,
    /// The replayed step's outputs (the sink's and the selections), on the host.
    replay: Option<Vec<(String, HostTensor)>>,
    /// Seconds of the replayed step.
    replay_seconds: f64,
    /// The replayed step's uploads.
    replay_upload: Option<UploadStats>,
}

/// Every name step `step` can hand out: its outputs and its optional hooks (the attention's
/// probabilities, each expert's outputs).
fn step_names(step: &Step, weights: &Weights<'_>) -> Vec<String> {
    let mut v = step.outputs.clone();
    match step.op {
        Op::Attention { layer } => v.push(hook(layer, point::ATTN_PROBS)),
        Op::MoeExperts { layer } => {
            v.extend((0..weights.hparams().n_expert).map(|e| expert_hook(layer, e)))
        }
        _ => {}
    }
    v
}

/// Host copies of the values the runner's next step, `step`, reads.
fn own_inputs<R: Engine>(
    refr: &Runner<'_, R>,
    reference: &R,
    step: &Step,
) -> Result<Vec<HostTensor>> {
    step.inputs
        .iter()
        .map(|n| {
            let t = refr.get(n).with_context(|| {
                format!(
                    "driver: step {:?} needs {n}, which no earlier step produced",
                    step.outputs
                )
            })?;
            reference.download(t)
        })
        .collect()
}

/// The expert whose output hook `name` is in layer `layer` (`blk.{layer}.exp.{e}.out`).
fn expert_of(layer: usize, name: &str) -> Option<usize> {
    let e: usize = name
        .strip_prefix(&format!("blk.{layer}.exp."))?
        .strip_suffix(".out")?
        .parse()
        .ok()?;
    (expert_hook(layer, e) == name).then_some(e)
}

/// The inputs replay feeds both sides of one step.
struct ReplayInputs {
    /// One host value per step input.
    values: Vec<HostTensor>,
    /// Per input, the reference's own value where the candidate's replaced it.
    replaced: Vec<Option<HostTensor>>,
    /// A selection input was replaced by the candidate's, and differs from the reference's.
    substituted: bool,
}

impl ReplayInputs {
    /// The reference's own inputs (what its own step ran on).
    fn base(&self) -> Vec<&HostTensor> {
        self.values
            .iter()
            .zip(&self.replaced)
            .map(|(v, r)| r.as_ref().unwrap_or(v))
            .collect()
    }
}

/// The host values of `step`'s inputs that replay feeds both sides of an engine candidate: the
/// reference's own with the candidate's selections.
fn replay_inputs<R: Engine>(
    refr: &Runner<'_, R>,
    step: &Step,
    cand_sel: &HashMap<String, HostTensor>,
) -> Result<std::result::Result<ReplayInputs, String>> {
    let mut r = ReplayInputs {
        values: Vec::with_capacity(step.inputs.len()),
        replaced: Vec::with_capacity(step.inputs.len()),
        substituted: false,
    };
    let reference_value = |n: &str| -> Result<HostTensor> {
        let t = refr
            .get(n)
            .with_context(|| format!("driver: replay input {n} is not alive"))?;
        refr.engine().download(t)
    };
    for n in &step.inputs {
        let own = reference_value(n)?;
        match cand_sel.get(n) {
            Some(c) if step.op != Op::Alias && *c != own => {
                r.substituted = true;
                r.values.push(c.clone());
                r.replaced.push(Some(own));
            }
            _ => {
                r.values.push(own);
                r.replaced.push(None);
            }
        }
    }
    Ok(Ok(r))
}

/// The reference's outputs of a replayed step whose selection the candidate's replaced (`own`:
/// its outputs from its own inputs, those `sink` wants): recomputed only in the rows the
/// candidate's selection reaches where it can ([`rows::recompute`], with `only_changed`), whole
/// otherwise. Its time counts as the reference's.
#[allow(clippy::too_many_arguments)]
fn recompute_reference<R: Engine>(
    reference: &R,
    step: &Step,
    inputs: &ReplayInputs,
    own: Vec<(String, HostTensor)>,
    tokens: &[u32],
    sink: &dyn PairSink,
    only_changed: bool,
    prepared: Option<Prepared<R::Tensor>>,
    summary: &mut PairSummary,
) -> Result<Vec<(String, HostTensor)>> {
    let t0 = Instant::now();
    let sink_wants = |n: &str| sink.wants(n);
    let rows = if only_changed {
        let values: Vec<&HostTensor> = inputs.values.iter().collect();
        rows::recompute(
            reference,
            step,
            &values,
            &inputs.base(),
            &own,
            &sink_wants,
            prepared,
        )?
    } else {
        None
    };
    let (out, work, n) = match rows {
        Some(r) => (r.outputs, &mut summary.reference_work.replay_rows, r.rows),
        None => {
            let wants = |n: &str| sink.wants(n) || is_selection(n);
            let out = replay_step(reference, step, &inputs.values, tokens, &wants)?;
            (out, &mut summary.reference_work.replay_whole, tokens.len())
        }
    };
    let took = t0.elapsed().as_secs_f64();
    work.add(n, took);
    summary.time(step.layer).reference += took;
    Ok(out)
}

/// Which recomputations of a routed-experts step may join the reference's own pass.
struct JointFor {
    /// The followed chain's (chained mode, computing only changed rows).
    follow: bool,
    /// The replay's with the candidate's selection (computing only changed rows).
    replay: bool,
}

/// The further inputs of a routed-experts step computed in the reference's own pass
/// ([`Runner::step_joint`]) and whose they are.
struct Joint<T> {
    /// Inputs (one per step input) and the rows computed.
    more: Vec<(Vec<T>, Vec<usize>)>,
    /// The followed chain's entry of `more`.
    follow: Option<usize>,
    /// The replay's entry of `more`.
    replay: Option<usize>,
}

/// What of the next step, a routed-experts step, the followed chain ([`Follow::experts_request`])
/// and the replay with the candidate's selection (the rows its selection reaches) will
/// recompute: at short prompts each would dequantize the layer's selected experts again, so
/// the reference's own step computes them in the same pass. Nothing for another step.
fn experts_requests<R: Engine>(
    reference: &R,
    refr: &Runner<'_, R>,
    step: &Step,
    start: &[(String, HostTensor)],
    follow: &Follow,
    replay: Option<&ReplayInputs>,
    joint_for: JointFor,
) -> Result<Joint<R::Tensor>> {
    let mut joint = Joint {
        more: Vec::new(),
        follow: None,
        replay: None,
    };
    if !matches!(step.op, Op::MoeExperts { .. }) {
        return Ok(joint);
    }
    let upload = |values: &[&HostTensor]| -> Result<Vec<R::Tensor>> {
        values.iter().map(|v| reference.upload(v)).collect()
    };
    if joint_for.follow {
        if let Some((inputs, rows)) = follow.experts_request(refr, step, start)? {
            joint.follow = Some(joint.more.len());
            joint
                .more
                .push((upload(&inputs.iter().collect::<Vec<_>>())?, rows));
        }
    }
    if let Some(r) = replay.filter(|r| joint_for.replay && r.substituted) {
        let values: Vec<&HostTensor> = r.values.iter().collect();
        if let Some(rows) = rows::rows_reached(step, &values, &r.base()).filter(|x| !x.is_empty()) {
            joint.replay = Some(joint.more.len());
            joint.more.push((upload(&values)?, rows));
        }
    }
    Ok(joint)
}

/// How a candidate output that is not there is described.
fn absent<C: Engine>(c: &Candidate<'_, C>) -> &'static str {
    match c {
        Candidate::Engine(_) => "not produced by the candidate",
        Candidate::Trace(_) => "not in the trace",
    }
}

/// Pairs reference and candidate outputs by name and hands them to the sink; a candidate
/// output that is `None` (not in a trace) is reported missing.
#[allow(clippy::too_many_arguments)]
fn hand_over(
    sink: &mut dyn PairSink,
    mode: Mode,
    absent: &str,
    step: &Step,
    reference: impl Iterator<Item = (String, HostTensor)>,
    candidate: Vec<(String, Option<HostTensor>)>,
    note: Option<&str>,
    summary: &mut PairSummary,
) -> Result<()> {
    let mut candidate = candidate;
    for (name, r) in reference {
        let c = candidate
            .iter_mut()
            .find(|(n, _)| *n == name)
            .and_then(|(_, t)| t.take());
        match c {
            Some(c) => {
                sink.record(Pair {
                    name: &name,
                    mode,
                    inputs: &step.inputs,
                    reference: r,
                    candidate: c,
                    note: note.map(str::to_string),
                })?;
                summary.pairs += 1;
            }
            None => {
                sink.reference_only(&name, mode, &step.inputs, &r);
                sink.missing(&name, mode, absent);
                summary.missing += 1;
            }
        }
    }
    Ok(())
}
