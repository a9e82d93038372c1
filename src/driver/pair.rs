//! Two engines over one plan, in one pass: a reference and a candidate, compared hook by hook.
//!
//! Modes (both can run in the same pass):
//! - **chained**: each side runs on its own earlier outputs, so a hook shows the error accumulated
//!   up to it (what a user's output shows).
//! - **replay**: each step is run by both sides *from the same inputs*, so a hook shows that
//!   step's own error, and the first bad step is named even when everything after it is garbage.
//!   With an engine as candidate the inputs are the reference's (`upload(download(..))`); with a
//!   trace as candidate (an engine glmdiff cannot run) the reference runs the step from the
//!   trace's own inputs and is compared with the trace's output.
//!
//! Every output the sink wants is downloaded, handed to the sink as a (reference, candidate) pair
//! and dropped: nothing accumulates here, so memory stays bounded by a layer's activations.
//! Hooks that cannot be compared (missing from a trace, or a step whose inputs are missing) are
//! reported to the sink as missing, not as errors.

use anyhow::{Context, Result};

use super::{check_tokens, exec_step, is_layer_end, Plan, Progress, Runner};
use crate::engine::{Engine, HostTensor};
use crate::model::steps::{expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, Pair, PairSink, TraceFile};

/// Which modes a pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Modes {
    /// Replay: every step from the same inputs on both sides.
    pub replay: bool,
    /// Chained: each side on its own outputs.
    pub chained: bool,
}

impl Modes {
    /// Both modes.
    pub const BOTH: Modes = Modes {
        replay: true,
        chained: true,
    };
}

/// The candidate side of a pass.
pub enum Candidate<'a, C: Engine> {
    /// An engine glmdiff runs.
    Engine(&'a C),
    /// A trace dumped by another engine (hooks of `shared/spec/hooks.md`).
    Trace(&'a TraceFile),
}

/// What a pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PairSummary {
    /// Steps run.
    pub steps: usize,
    /// Pairs handed to the sink.
    pub pairs: usize,
    /// Hooks reported missing.
    pub missing: usize,
}

/// Runs `plan` on `reference` and `candidate` for `tokens`, starting from `start` (the plan's
/// free inputs, given to both sides), in `modes`; hands every wanted hook to `sink`.
#[allow(clippy::too_many_arguments)]
pub fn run_pair<R: Engine, C: Engine>(
    reference: &R,
    candidate: Candidate<'_, C>,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    start: &[(String, HostTensor)],
    modes: Modes,
    sink: &mut dyn PairSink,
    progress: &dyn Progress,
) -> Result<PairSummary> {
    check_tokens(weights, tokens)?;
    let mut refr = Runner::new(reference, plan, tokens, start, &[])?;
    let mut cand = match (&candidate, modes.chained) {
        (Candidate::Engine(c), true) => Some(Runner::new(*c, plan, tokens, start, &[])?),
        _ => None,
    };
    let mut summary = PairSummary::default();
    progress.start("layers", plan.layers().len() as u64);
    while let Some(step) = refr.peek() {
        // Replay inputs are taken before the reference moves on (its step may drop them), and
        // only for steps with a wanted hook: nothing else leaves the reference.
        let replay_inputs = if modes.replay && step_wanted(step, &*sink, weights) {
            Some(replay_inputs(&refr, &candidate, step, start)?)
        } else {
            None
        };
        let ref_extra = {
            let wants = |n: &str| sink.wants(n);
            refr.step(&wants)?
        };
        let ref_out: Vec<(String, HostTensor)> = wanted_outputs(&refr, step, &*sink)?;
        let ref_extra: Vec<(String, HostTensor)> = ref_extra
            .into_iter()
            .filter(|(n, _)| sink.wants(n))
            .map(|(n, t)| Ok((n, reference.download(&t)?)))
            .collect::<Result<_>>()?;

        if modes.chained {
            let cand_out: Vec<(String, Option<HostTensor>)> = match (&candidate, &mut cand) {
                (Candidate::Engine(_), Some(c)) => {
                    let extra = {
                        let wants = |n: &str| sink.wants(n);
                        c.step(&wants)?
                    };
                    let mut v: Vec<(String, Option<HostTensor>)> = wanted_outputs(c, step, &*sink)?
                        .into_iter()
                        .map(|(n, t)| (n, Some(t)))
                        .collect();
                    for (n, t) in extra {
                        if sink.wants(&n) {
                            v.push((n, Some(c.engine().download(&t)?)));
                        }
                    }
                    v
                }
                (Candidate::Trace(tr), _) => ref_out
                    .iter()
                    .chain(&ref_extra)
                    .map(|(n, _)| Ok((n.clone(), tr.get(n)?)))
                    .collect::<Result<_>>()?,
                (Candidate::Engine(_), None) => Vec::new(),
            };
            let reference_side = ref_out.iter().chain(&ref_extra);
            hand_over(
                sink,
                Mode::Chained,
                absent(&candidate),
                step,
                reference_side.cloned(),
                cand_out,
                &mut summary,
            )?;
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
                    let wants = |n: &str| sink.wants(n);
                    match &candidate {
                        Candidate::Engine(c) => {
                            let out = replay_step(*c, step, &inputs, tokens, &wants)?;
                            let cand: Vec<(String, Option<HostTensor>)> =
                                out.into_iter().map(|(n, t)| (n, Some(t))).collect();
                            let reference_side = ref_out.iter().chain(&ref_extra).cloned();
                            hand_over(
                                sink,
                                Mode::Replay,
                                absent(&candidate),
                                step,
                                reference_side,
                                cand,
                                &mut summary,
                            )?;
                        }
                        Candidate::Trace(tr) => {
                            // The reference runs the step from the trace's inputs; the trace's
                            // outputs are the candidate.
                            let out = replay_step(reference, step, &inputs, tokens, &wants)?;
                            let cand: Vec<(String, Option<HostTensor>)> = out
                                .iter()
                                .map(|(n, _)| Ok((n.clone(), tr.get(n)?)))
                                .collect::<Result<_>>()?;
                            hand_over(
                                sink,
                                Mode::Replay,
                                absent(&candidate),
                                step,
                                out.into_iter(),
                                cand,
                                &mut summary,
                            )?;
                        }
                    }
                }
            }
        }
        summary.steps += 1;
        if is_layer_end(step) {
            progress.inc(1);
        }
    }
    progress.finish();
    Ok(summary)
}

/// Whether `sink` wants any hook `step` produces, optional ones included.
fn step_wanted(step: &Step, sink: &dyn PairSink, weights: &Weights<'_>) -> bool {
    step.outputs.iter().any(|o| sink.wants(o))
        || match step.op {
            Op::Attention { layer } => sink.wants(&hook(layer, point::ATTN_PROBS)),
            Op::MoeExperts { layer } => {
                (0..weights.hparams().n_expert).any(|e| sink.wants(&expert_hook(layer, e)))
            }
            _ => false,
        }
}

/// The host values of `step`'s inputs that replay feeds both sides: the reference's own, or,
/// for a trace candidate, the trace's (`Err` names the first input the trace lacks).
fn replay_inputs<R: Engine, C: Engine>(
    refr: &Runner<'_, R>,
    candidate: &Candidate<'_, C>,
    step: &Step,
    start: &[(String, HostTensor)],
) -> Result<std::result::Result<Vec<HostTensor>, String>> {
    let mut v = Vec::with_capacity(step.inputs.len());
    for n in &step.inputs {
        match candidate {
            Candidate::Engine(_) => {
                let t = refr
                    .get(n)
                    .with_context(|| format!("driver: replay input {n} is not alive"))?;
                v.push(refr.engine().download(t)?);
            }
            Candidate::Trace(tr) => match tr.get(n)? {
                Some(t) => v.push(t),
                // The run's starting values stand for the trace's when it lacks them (a trace
                // of layers A..B only): both sides then start from the same residual.
                None => match start.iter().find(|(s, _)| s == n) {
                    Some((_, t)) => v.push(t.clone()),
                    None => return Ok(Err(format!("input {n} is not in the trace"))),
                },
            },
        }
    }
    Ok(Ok(v))
}

/// Runs `step` on `engine` from host `inputs` and returns every output `wants` asks for, as host
/// tensors (an alias returns its input).
fn replay_step<E: Engine>(
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

/// The outputs of the step `runner` just ran that `sink` wants, downloaded.
fn wanted_outputs<E: Engine>(
    runner: &Runner<'_, E>,
    step: &Step,
    sink: &dyn PairSink,
) -> Result<Vec<(String, HostTensor)>> {
    let mut v = Vec::new();
    for n in &step.outputs {
        if sink.wants(n) {
            let t = runner
                .get(n)
                .with_context(|| format!("driver: output {n} of the step just run is gone"))?;
            v.push((n.clone(), runner.engine().download(t)?));
        }
    }
    Ok(v)
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
fn hand_over(
    sink: &mut dyn PairSink,
    mode: Mode,
    absent: &str,
    step: &Step,
    reference: impl Iterator<Item = (String, HostTensor)>,
    candidate: Vec<(String, Option<HostTensor>)>,
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
                })?;
                summary.pairs += 1;
            }
            None => {
                sink.missing(&name, mode, absent);
                summary.missing += 1;
            }
        }
    }
    Ok(())
}
