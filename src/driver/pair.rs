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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};

use super::follow::{Follow, FollowStep};
pub use super::replay::{is_selection, LayerTime, PairSummary, ReferenceWork, Work};
use super::replay::{replay_step, step_wanted};
use super::rows::{self, JointOut, Prepared};
use super::segment::TraceReplay;
use super::timed::{Closing, Queue, Synced, Timed, WAITING_BYTES};
use super::{check_tokens, Progress, Residency, Runner, StepProgress};
use crate::engine::{Engine, HostTensor, UploadStats};
use crate::model::steps::{expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, Pair, PairSink, TraceFile};

pub use super::inputs::RunInputs;
pub use crate::words::Modes;

/// The candidate side of a pass.
pub enum Candidate<'a, C: Engine> {
    /// An engine glmdiff runs.
    Engine(&'a C),
    /// A trace dumped by another engine (hooks of `docs/hooks.md`).
    Trace(&'a TraceFile),
}

/// Runs `inputs.plan` on `reference` and `candidate` for `inputs.tokens`, starting from
/// `inputs.start` (the plan's free inputs, given to both sides), in `modes`; hands every wanted
/// hook to `sink`, and asks `inputs.ties` about the near ties of selections.
pub fn run_pair<R: Engine + Sync, C: Engine>(
    reference: &R,
    candidate: Candidate<'_, C>,
    inputs: RunInputs<'_>,
    modes: Modes,
    sink: &mut (dyn PairSink + Send),
    progress: &dyn Progress,
) -> Result<PairSummary>
where
    R::Tensor: Send,
{
    let ahead = if candidate_ahead() {
        Ahead::WhileReferenceRuns
    } else {
        Ahead::Off
    };
    run_pair_with(
        reference, candidate, inputs, modes, sink, progress, true, ahead,
    )
}

/// Whether and how far the candidate's chain runs ahead of the pass
/// ([`CandidateSide::run_ahead`]) at prompts of up to [`AHEAD_MAX_TOKENS`] tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ahead {
    /// It runs each step with the pass.
    Off,
    /// While the reference's side of a step runs.
    WhileReferenceRuns,
    /// Up to its layer's routing whatever the reference does (tests: every step that can run
    /// ahead does).
    #[cfg(test)]
    ToTheRouting,
}

/// [`run_pair`], where the reference recomputes a replayed step with the candidate's selection
/// and runs the followed chain only where they change ([`super::rows`]) when `only_changed`, and
/// whole otherwise, and the candidate's chain runs `ahead` of the pass or not (what tests
/// compare it with: the results are the same bit for bit).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_pair_with<R: Engine + Sync, C: Engine>(
    reference: &R,
    candidate: Candidate<'_, C>,
    inputs: RunInputs<'_>,
    modes: Modes,
    sink: &mut (dyn PairSink + Send),
    progress: &dyn Progress,
    only_changed: bool,
    ahead: Ahead,
) -> Result<PairSummary>
where
    R::Tensor: Send,
{
    check_tokens(inputs.weights, inputs.tokens)?;
    let Some(answers) = sink.answers() else {
        let timed = Timed::here(sink);
        return drive(
            reference,
            candidate,
            inputs,
            modes,
            timed,
            progress,
            only_changed,
            ahead,
        );
    };
    // The comparison on a thread of its own, in the order of the calls, beside the driver's
    // later steps; the driver's questions about near ties wait for it. Its parallel work runs
    // on threads of lower priority, so that it takes the cores the reference leaves idle rather
    // than the reference's, or with `--compare-pool N` on N threads of the normal priority (the
    // values are the same on any threads).
    let queue = Queue::new(WAITING_BYTES);
    let pool = crate::util::background::compare_pool(rayon::current_num_threads());
    std::thread::scope(|scope| {
        let q = &queue;
        let serving = scope.spawn(move || match &pool {
            Some(p) => p.install(|| q.serve(sink)),
            None => q.serve(sink),
        });
        let closing = Closing(q);
        let synced = Synced {
            ties: inputs.ties,
            queue: q,
        };
        let inputs = RunInputs {
            ties: &synced,
            ..inputs
        };
        let timed = Timed::there(q, answers);
        let out = drive(
            reference,
            candidate,
            inputs,
            modes,
            timed,
            progress,
            only_changed,
            ahead,
        );
        if out.is_err() {
            // The pass ended: what still waits for the comparison would not be read.
            q.abandon();
        }
        drop(closing);
        match serving.join() {
            Ok(()) => out,
            Err(_) => out.and(Err(anyhow::anyhow!(
                "driver: the comparison's thread panicked"
            ))),
        }
    })
}

/// The pass of [`run_pair_with`], its sink's calls made through `timed`.
#[allow(clippy::too_many_arguments)]
fn drive<'a, R: Engine + Sync, C: Engine>(
    reference: &'a R,
    candidate: Candidate<'a, C>,
    inputs: RunInputs<'a>,
    modes: Modes,
    timed: Timed<'a>,
    progress: &dyn Progress,
    only_changed: bool,
    ahead: Ahead,
) -> Result<PairSummary>
where
    R::Tensor: Send,
{
    let mut run = PairRun::new(reference, candidate, inputs, modes, only_changed, timed)?;
    run.ahead = if inputs.tokens.len() <= AHEAD_MAX_TOKENS {
        ahead
    } else {
        Ahead::Off
    };
    let mut steps = StepProgress::start(progress, inputs.plan);
    while let Some(step) = run.refr.peek() {
        steps.before(step);
        run.step(step)?;
        steps.after(step);
    }
    run.finish()?;
    steps.finish();
    let by = run.sink.take_by();
    let waits = run.sink.waits();
    let mut summary = run.summary;
    summary.compare_waits = waits;
    let mut times: Vec<(String, f64)> = by.into_iter().collect();
    times.sort_by(|a, b| b.1.total_cmp(&a.1));
    summary.compare_times = times;
    for times in [
        &mut summary.reference_times,
        &mut summary.candidate_times,
        &mut summary.candidate_beyond_times,
    ] {
        times.sort_by(|a, b| b.1.total_cmp(&a.1));
    }
    Ok(summary)
}

/// One pass's state across its steps: what it runs on, both sides' walks through the plan, each
/// mode's own state and what the pass has counted so far.
struct PairRun<'a, R: Engine, C: Engine> {
    /// The reference engine.
    reference: &'a R,
    /// The candidate.
    candidate: Candidate<'a, C>,
    /// What the pass runs on.
    inputs: RunInputs<'a>,
    /// The modes run.
    modes: Modes,
    /// Whether the reference recomputes only the rows that change ([`run_pair_with`]).
    only_changed: bool,
    /// Whether the candidate's chain runs ahead of the pass ([`run_pair_with`]).
    ahead: Ahead,
    /// The sink, with the seconds spent in it (the comparison).
    sink: Timed<'a>,
    /// The reference's own chain.
    refr: Runner<'a, R>,
    /// A candidate engine's own side.
    cand: CandidateSide<'a, C>,
    /// The candidate's replayed selections (engine candidates), by hook name.
    cand_sel: HashMap<String, HostTensor>,
    /// Replay against a trace: across the hooks it lacks.
    trace_replay: Option<TraceReplay<'a>>,
    /// Chained: the reference's chain that follows the candidate's near-tie selections.
    follow: Follow,
    /// What the pass has counted.
    summary: PairSummary,
}

/// What is taken of a step before the reference runs it.
struct Before<T> {
    /// Replay's inputs of an engine candidate's step with a wanted hook, or why there are none.
    replay: Option<std::result::Result<ReplayInputs, String>>,
    /// The layer and the inputs of the reference's own per-expert outputs, for a sink that
    /// takes them.
    own_experts: Option<(usize, Vec<HostTensor>)>,
    /// The names the reference's step hands out, asked of the sink here (it stays on this
    /// thread while the reference runs on another).
    wants: HashSet<String>,
    /// The rows of a routed-experts step that the followed chain and the replay recompute,
    /// computed in the reference's own pass over the experts' weights.
    joint: Joint<T>,
}

impl<'a, R: Engine + Sync, C: Engine> PairRun<'a, R, C>
where
    R::Tensor: Send,
{
    /// A pass at the plan's first step: both sides' runners (the candidate's in chained mode
    /// only) and each mode's state.
    fn new(
        reference: &'a R,
        candidate: Candidate<'a, C>,
        inputs: RunInputs<'a>,
        modes: Modes,
        only_changed: bool,
        sink: Timed<'a>,
    ) -> Result<Self> {
        let RunInputs {
            tokens,
            plan,
            start,
            ..
        } = inputs;
        let refr = Runner::new(reference, plan, tokens, start, &[])?;
        let cand = CandidateSide::new(&candidate, inputs, modes, &sink)?;
        let trace_replay = match (&candidate, modes.replay) {
            (&Candidate::Trace(tr), true) => Some(TraceReplay::new(tr, plan)),
            _ => None,
        };
        Ok(PairRun {
            reference,
            candidate,
            inputs,
            modes,
            only_changed,
            ahead: Ahead::Off,
            sink,
            refr,
            cand,
            cand_sel: HashMap::new(),
            trace_replay,
            follow: Follow::new(plan, only_changed),
            summary: PairSummary::default(),
        })
    }

    /// Runs the plan's next step, `step`, on both sides in every mode and hands its pairs to
    /// the sink: the reference's step beside the candidate's, then the chained side, the replay
    /// of an engine candidate and the replay across a trace's segments.
    fn step(&mut self, step: &Step) -> Result<()> {
        // A comparison that failed on its own thread ends the pass at the next step.
        self.sink.failed()?;
        self.sink.layer = step.layer;
        let blocked_before = self.sink.blocked();
        let Before {
            replay,
            own_experts,
            wants,
            joint,
        } = self.before(step)?;
        let joint_rows: Vec<Vec<usize>> = joint.more.iter().map(|(_, r)| r.clone()).collect();
        let replay_now = replay.as_ref().and_then(|r| r.as_ref().ok());
        let (ref_done, (cand_done, cand_ended), ran_ahead) =
            self.both_sides(step, &wants, joint.more, replay_now);
        let RefStep {
            out,
            extra,
            joint: joint_out,
            seconds,
            ended,
        } = ref_done?;
        self.summary.candidate_ahead_steps += ran_ahead;
        if matches!(self.candidate, Candidate::Engine(_)) {
            let beyond = cand_ended.saturating_duration_since(ended).as_secs_f64();
            self.summary.candidate_beyond(step, beyond);
        }
        let (further, follow_prepared, replay_prepared) =
            joint_results(&joint_rows, joint_out, joint.follow, joint.replay);
        let mut cand_done = cand_done?;
        self.record_times(step, seconds, further, &mut cand_done);
        let own = self.reference_experts(step, own_experts, out, extra);
        if self.modes.chained {
            self.chained(step, &own, &cand_done.chained, follow_prepared)?;
        }
        self.replay(step, replay, &own, cand_done.replay.take(), replay_prepared)?;
        self.segments(step)?;
        self.take_done();
        self.summary.time(step.layer).compare_wait += self.sink.blocked() - blocked_before;
        self.summary.steps += 1;
        Ok(())
    }

    /// Adds the seconds the sink spent on calls done since the last call (on whichever
    /// thread) to their steps' layers.
    fn take_done(&mut self) {
        for (layer, s) in self.sink.take_done() {
            self.summary.time(layer).compare += s;
        }
    }

    /// What is taken of `step` before the reference runs it (its step may drop its inputs):
    /// replay's inputs, only for steps with a wanted hook (nothing else leaves the reference),
    /// the inputs of its own per-expert outputs, the names its step hands out and the further
    /// rows of a routed-experts step its pass computes.
    fn before(&self, step: &Step) -> Result<Before<R::Tensor>> {
        let RunInputs { weights, start, .. } = self.inputs;
        let sink: &dyn PairSink = &self.sink;
        let replay = match &self.candidate {
            Candidate::Engine(_) if self.modes.replay && step_wanted(step, sink, weights) => {
                Some(replay_inputs(&self.refr, step, &self.cand_sel)?)
            }
            _ => None,
        };
        let own_experts = match step.op {
            Op::MoeExperts { layer } if sink.wants_reference_experts(step) => {
                Some((layer, own_inputs(&self.refr, self.reference, step)?))
            }
            _ => None,
        };
        let wants: HashSet<String> = step_names(step, weights)
            .into_iter()
            .filter(|n| {
                sink.wants(n)
                    || own_experts
                        .as_ref()
                        .is_some_and(|(l, _)| expert_of(*l, n).is_some())
            })
            .collect();
        let joint = experts_requests(
            self.reference,
            &self.refr,
            step,
            start,
            &self.follow,
            replay.as_ref().and_then(|r| r.as_ref().ok()),
            JointFor {
                follow: self.modes.chained && self.only_changed,
                replay: self.only_changed,
            },
        )?;
        Ok(Before {
            replay,
            own_experts,
            wants,
            joint,
        })
    }

    /// The reference's step (CPU threads, with the further rows of `more` in its pass) and the
    /// candidate engine's (its device: its chained step, and its replay from `replay`'s inputs)
    /// at the same time: neither reads the other's values until both are done. The candidate's
    /// side comes with the moment it ended, and with the steps its chain ran ahead of the pass
    /// meanwhile ([`CandidateSide::run_ahead`]).
    fn both_sides(
        &mut self,
        step: &Step,
        wants: &HashSet<String>,
        more: Vec<(Vec<R::Tensor>, Vec<usize>)>,
        replay: Option<&ReplayInputs>,
    ) -> (Result<RefStep<R::Tensor>>, CandSide, usize) {
        let replay = replay.filter(|_| step.op != Op::Alias);
        let (refr, cand, sink, inputs) =
            (&mut self.refr, &mut self.cand, &mut self.sink, self.inputs);
        let ahead = self.ahead;
        let ref_ended = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let ended = &ref_ended;
            let ref_side = scope.spawn(move || {
                let done = reference_step(refr, step, wants, &more);
                ended.store(true, Ordering::Release);
                done
            });
            let cand_done = (cand.step(step, inputs, &*sink, replay), Instant::now());
            let before = cand.ahead.len();
            if ahead != Ahead::Off && cand_done.0.is_ok() {
                cand.run_ahead(step, &*sink, &ref_ended, ahead);
            }
            let ran_ahead = cand.ahead.len().saturating_sub(before);
            // While the reference's side runs, the candidate offers it the weights whose
            // uploads finish (`--reference-reuse`; an engine without any returns at once).
            if let Some(c) = cand.engine {
                while !ref_ended.load(Ordering::Acquire) && c.offer_uploads() {
                    std::thread::sleep(OFFER_POLL);
                }
            }
            let ref_done = ref_side
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("driver: the reference's step panicked")));
            (ref_done, cand_done, ran_ahead)
        })
    }

    /// Adds the step's times to the layer's: the reference's step (`took`, also counted as its
    /// plain work, and as its joint work when it computed `further` rows beside its own), the
    /// candidate's chained and replayed steps and their uploads.
    fn record_times(&mut self, step: &Step, took: f64, further: usize, cand_done: &mut CandStep) {
        let summary = &mut self.summary;
        summary.reference_time(step, "own", took);
        if step.op != Op::Alias {
            summary
                .reference_work
                .plain
                .add(self.inputs.tokens.len(), took);
        }
        if further > 0 {
            summary.reference_work.joint.add(further, took);
        }
        summary.candidate_time(step, cand_done.chained_seconds, cand_done.replay_seconds);
        let t = summary.time(step.layer);
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

    /// Hands the reference's own per-expert outputs (of `extra`) to a sink that takes them
    /// (`own_experts`: their layer and inputs); returns the reference's outputs of the step that
    /// the sink wants: `out`, then the optional hooks of `extra` it wants.
    fn reference_experts(
        &mut self,
        step: &Step,
        own_experts: Option<(usize, Vec<HostTensor>)>,
        out: Vec<(String, HostTensor)>,
        extra: Vec<(String, HostTensor)>,
    ) -> Vec<(String, HostTensor)> {
        let mut experts = Vec::new();
        let mut own = out;
        for (n, host) in extra {
            let e = own_experts.as_ref().and_then(|(l, _)| expert_of(*l, &n));
            match (e, self.sink.wants(&n)) {
                (Some(e), true) => {
                    experts.push((e, host.clone()));
                    own.push((n, host));
                }
                (Some(e), false) => experts.push((e, host)),
                (None, _) => own.push((n, host)),
            }
        }
        if let Some((_, inputs)) = &own_experts {
            self.sink.reference_experts(step, inputs, experts);
        }
        own
    }

    /// Chained: the step on the chain that follows the candidate's near ties ([`Follow`]), from
    /// the reference's own chain's outputs `own`, against the candidate's values (`cand`, an
    /// engine's; a trace's are read from it). The followed chain's steps are the reference's
    /// time; its pairs' comparison is not.
    fn chained(
        &mut self,
        step: &Step,
        own: &[(String, HostTensor)],
        cand: &HashMap<String, HostTensor>,
        prepared: Option<Prepared<R::Tensor>>,
    ) -> Result<()> {
        let candidate = &self.candidate;
        let value = |n: &str| -> Result<Option<HostTensor>> {
            match candidate {
                Candidate::Trace(tr) => tr.get(n),
                Candidate::Engine(_) => Ok(cand.get(n).cloned()),
            }
        };
        let RunInputs {
            weights,
            tokens,
            start,
            ties,
            ..
        } = self.inputs;
        let (t0, f0) = (Instant::now(), self.sink.blocked());
        self.follow.step(
            FollowStep {
                reference: self.reference,
                plain: &self.refr,
                plain_out: own,
                weights,
                step,
                tokens,
                start,
                absent: absent(candidate),
                ties,
                prepared,
            },
            &value,
            &mut self.sink,
            &mut self.summary,
        )?;
        let took = (t0.elapsed().as_secs_f64() - (self.sink.blocked() - f0)).max(0.0);
        self.summary.reference_time(step, "followed", took);
        Ok(())
    }

    /// Replay of an engine candidate's step (`inputs`: what both sides ran it from, or why
    /// there are none): its outputs (`cand_out`, computed beside the reference's step) against
    /// the reference's own (`own`), recomputed by the reference with the candidate's selection
    /// where that differs from its own. A trace's replay is [`TraceReplay`]'s.
    fn replay(
        &mut self,
        step: &Step,
        inputs: Option<std::result::Result<ReplayInputs, String>>,
        own: &[(String, HostTensor)],
        cand_out: Option<Vec<(String, HostTensor)>>,
        prepared: Option<Prepared<R::Tensor>>,
    ) -> Result<()> {
        let inputs = match inputs {
            None => return Ok(()),
            Some(Err(why)) => {
                for (n, _) in own {
                    self.sink.missing(n, Mode::Replay, &why);
                    self.summary.missing += 1;
                }
                return Ok(());
            }
            Some(Ok(inputs)) => inputs,
        };
        if step.op != Op::Alias && self.sink.wants_replay_inputs() {
            self.sink.replay_inputs(step, &inputs.values);
        }
        if let Candidate::Trace(_) = self.candidate {
            return Ok(());
        }
        if step.op == Op::Alias {
            // No arithmetic: the candidate's selection keeps its new name.
            if let (Some(src), Some(out)) = (step.inputs.first(), step.outputs.first()) {
                if let Some(v) = self.cand_sel.get(src).cloned() {
                    self.cand_sel.insert(out.clone(), v);
                }
            }
            return Ok(());
        }
        let out = cand_out.with_context(|| {
            format!(
                "driver: the candidate's replay of {:?} is gone",
                step.outputs
            )
        })?;
        for (n, t) in &out {
            if is_selection(n) {
                self.cand_sel.insert(n.clone(), t.clone());
            }
        }
        // The reference recomputes the step when the candidate's selection differs from its
        // own: only the rows it reaches where it can.
        let own = own.to_vec();
        let reference_side = if inputs.substituted {
            recompute_reference(
                self.reference,
                step,
                &inputs,
                own,
                self.inputs.tokens,
                &self.sink,
                self.only_changed,
                prepared,
                &mut self.summary,
            )?
        } else {
            own
        };
        let reference_side: Vec<(String, HostTensor)> = reference_side
            .into_iter()
            .filter(|(n, _)| self.sink.wants(n))
            .collect();
        let cand: Vec<(String, Option<HostTensor>)> =
            out.into_iter().map(|(n, t)| (n, Some(t))).collect();
        hand_over(
            &mut self.sink,
            Mode::Replay,
            absent(&self.candidate),
            step,
            reference_side.into_iter(),
            cand,
            None,
            &mut self.summary,
        )
    }

    /// Replay against a trace: the step from the trace's inputs, across the hooks the trace
    /// lacks ([`TraceReplay`]).
    fn segments(&mut self, step: &Step) -> Result<()> {
        match &mut self.trace_replay {
            Some(tr) => tr.step(
                self.reference,
                self.inputs,
                step,
                &mut self.sink,
                &mut self.summary,
            ),
            None => Ok(()),
        }
    }

    /// Waits for the comparison of what the sink was handed (its end counted to the last
    /// step's layer), then ends both sides' weight hooks: the reference's runner's, then the
    /// candidate's.
    fn finish(&mut self) -> Result<()> {
        let blocked = self.sink.blocked();
        let finished = self.sink.finish();
        self.take_done();
        let last = self.sink.layer;
        self.summary.time(last).compare_wait += self.sink.blocked() - blocked;
        finished?;
        self.refr.finish()?;
        self.cand.finish()
    }
}

/// The further rows the reference computed in its pass over a routed-experts step's experts
/// (`out`, of the rows `rows`; an engine that computes only whole steps gives none), and the
/// followed chain's and the replay's entries of them (`follow`, `replay`).
fn joint_results<T>(
    rows: &[Vec<usize>],
    mut out: Vec<Option<JointOut<T>>>,
    follow: Option<usize>,
    replay: Option<usize>,
) -> (usize, Option<Prepared<T>>, Option<Prepared<T>>) {
    let further: usize = rows
        .iter()
        .zip(&out)
        .filter(|(_, out)| out.is_some())
        .map(|(rows, _)| rows.len())
        .sum();
    let mut take = |at: Option<usize>| {
        let i = at?;
        Some(Prepared {
            rows: rows.get(i)?.clone(),
            out: out.get_mut(i)?.take()?,
        })
    };
    let (follow, replay) = (take(follow), take(replay));
    (further, follow, replay)
}

/// The reference's step, on its own thread beside the candidate's: the runner's next step,
/// with the further rows of `more` in its pass over the experts; its outputs and optional hooks
/// that `wants` names, on the host.
fn reference_step<R: Engine>(
    refr: &mut Runner<'_, R>,
    step: &Step,
    wants: &HashSet<String>,
    more: &[(Vec<R::Tensor>, Vec<usize>)],
) -> Result<RefStep<R::Tensor>> {
    let reference = refr.engine();
    let t0 = Instant::now();
    let (extra, joint) = refr.step_joint(&|n: &str| wants.contains(n), more)?;
    let mut out = Vec::new();
    for n in step.outputs.iter().filter(|n| wants.contains(*n)) {
        let t = refr
            .get(n)
            .with_context(|| format!("driver: output {n} of the step just run is gone"))?;
        out.push((n.clone(), reference.download(t)?));
    }
    let extra = extra
        .into_iter()
        .filter(|(n, _)| wants.contains(n))
        .map(|(n, t)| Ok((n, reference.download(&t)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(RefStep {
        out,
        extra,
        joint,
        seconds: t0.elapsed().as_secs_f64(),
        ended: Instant::now(),
    })
}

/// A candidate engine's own side of a pass: its chain, and the weight hooks it is told of when
/// it only replays.
struct CandidateSide<'a, C: Engine> {
    /// The engine; `None` for a trace.
    engine: Option<&'a C>,
    /// Its chain, in chained mode.
    runner: Option<Runner<'a, C>>,
    /// The weight hooks of a candidate engine that only replays (no runner of its own): it
    /// begins the layers with a step it replays.
    residency: Residency,
    /// Chained steps run ahead of the pass ([`CandidateSide::run_ahead`]), in order, with what
    /// each gave.
    ahead: VecDeque<(&'a Step, Result<Chained>)>,
}

impl<'a, C: Engine> CandidateSide<'a, C> {
    /// The side of `candidate` over `inputs` in `modes`, told of the layers of the steps with a
    /// hook `sink` wants.
    fn new(
        candidate: &Candidate<'a, C>,
        inputs: RunInputs<'a>,
        modes: Modes,
        sink: &dyn PairSink,
    ) -> Result<Self> {
        let RunInputs {
            weights,
            tokens,
            plan,
            start,
            ..
        } = inputs;
        let engine = match candidate {
            Candidate::Engine(c) => Some(*c),
            Candidate::Trace(_) => None,
        };
        let runner = match (engine, modes.chained) {
            (Some(c), true) => Some(Runner::new(c, plan, tokens, start, &[])?),
            _ => None,
        };
        let residency = Residency::only(
            plan.steps
                .iter()
                .filter(|s| s.op != Op::Alias && step_wanted(s, sink, weights))
                .filter_map(|s| s.layer)
                .collect(),
        );
        Ok(CandidateSide {
            engine,
            runner,
            residency,
            ahead: VecDeque::new(),
        })
    }

    /// The candidate's side of `step`, beside the reference's: its chained step, then its
    /// replay of the step from `replay`'s inputs.
    fn step(
        &mut self,
        step: &Step,
        inputs: RunInputs<'_>,
        sink: &dyn PairSink,
        replay: Option<&ReplayInputs>,
    ) -> Result<CandStep> {
        let mut done = CandStep::default();
        self.chained(step, sink, &mut done)?;
        if let (Some(c), Some(replay)) = (self.engine, replay) {
            let t0 = Instant::now();
            if self.runner.is_none() {
                self.residency.enter(c, inputs.plan, step)?;
            }
            let wants = |n: &str| sink.wants(n) || is_selection(n);
            done.replay = Some(replay_step(c, step, &replay.values, inputs.tokens, &wants)?);
            done.replay_seconds = t0.elapsed().as_secs_f64();
            done.replay_upload = Some(c.take_upload_stats());
        }
        Ok(done)
    }

    /// The runner's step (chained mode): the outputs `sink` wants and the selections, on the
    /// host, into `done`; taken from the steps run ahead when the chain ran it already.
    fn chained(&mut self, step: &Step, sink: &dyn PairSink, done: &mut CandStep) -> Result<()> {
        let Some(c) = &mut self.runner else {
            return Ok(());
        };
        let got = match self.ahead.pop_front() {
            Some((ran, got)) => {
                if ran.outputs != step.outputs {
                    anyhow::bail!(
                        "driver: the candidate's chain ran ahead to step {:?}, the pass is at {:?}",
                        ran.outputs,
                        step.outputs
                    );
                }
                got?
            }
            None => run_chained(c, step, sink)?,
        };
        done.chained = got.out;
        done.chained_seconds = got.seconds;
        done.chained_upload = got.upload;
        Ok(())
    }

    /// While the reference's side of the step `last` has not `ended`, runs the candidate's
    /// chain ahead, up to and including the routing of `last`'s layer (the chain does not
    /// depend on the reference's values): an engine that uploads the experts its routing picks
    /// starts them there, behind the reference's attention, instead of at the step the pass
    /// reaches the router. Each step's outputs wait in [`CandidateSide::ahead`] for the pass;
    /// nothing else changes (the pass hands them to the sink at their own step, in order). Runs
    /// nothing in a layer without a routing step ahead, nor past an error (which waits there
    /// too, for its own step).
    fn run_ahead(&mut self, last: &Step, sink: &dyn PairSink, ended: &AtomicBool, how: Ahead) {
        let Some(c) = &mut self.runner else {
            return;
        };
        let Some(layer) = last.layer else {
            return;
        };
        if self.ahead.back().is_some_and(|(_, r)| r.is_err()) {
            return;
        }
        // Every step from here to the layer's routing is of the layer.
        let route_ahead = c.plan.steps[c.next..]
            .iter()
            .take_while(|s| s.layer == Some(layer))
            .any(|s| matches!(s.op, Op::MoeRoute { .. }));
        if !route_ahead {
            return;
        }
        let waits = how == Ahead::WhileReferenceRuns;
        while !(waits && ended.load(Ordering::Acquire)) {
            let Some(next) = c.peek() else {
                break;
            };
            let got = run_chained(c, next, sink);
            let stop = got.is_err() || matches!(next.op, Op::MoeRoute { .. });
            self.ahead.push_back((next, got));
            if stop {
                break;
            }
        }
    }

    /// Ends the candidate's weight hooks: its runner's, then those of its replay.
    fn finish(&mut self) -> Result<()> {
        if let Some(r) = &mut self.runner {
            r.finish()?;
        }
        if let Some(c) = self.engine {
            self.residency.finish(c)?;
        }
        Ok(())
    }
}

/// How often the pass asks the candidate to offer the reference its finished uploads while it
/// waits for the reference's side of a step ([`Engine::offer_uploads`]): a copy of a routed
/// group of 16 experts takes milliseconds.
const OFFER_POLL: std::time::Duration = std::time::Duration::from_micros(300);

/// Most tokens of a prompt whose candidate chain runs ahead of the pass
/// ([`CandidateSide::run_ahead`]): its steps' outputs wait on the host until the pass reaches
/// them, a few KB each at short prompts, where the reference's steps are short enough that the
/// candidate's upload of its routed experts shows (at long prompts the reference's layer is
/// seconds and the uploads are prefetched whole).
pub(super) const AHEAD_MAX_TOKENS: usize = 64;

/// Whether the candidate's chain runs ahead of the pass at short prompts (`--candidate-ahead`;
/// [`set_candidate_ahead`]). Off unless set.
pub fn candidate_ahead() -> bool {
    CANDIDATE_AHEAD.load(Ordering::Relaxed)
}

/// Sets whether the candidate's chain runs ahead of the pass at short prompts (up to its
/// layer's routing, while the reference's side of a step runs); only when the steps run
/// changes, not their values.
pub fn set_candidate_ahead(on: bool) {
    CANDIDATE_AHEAD.store(on, Ordering::Relaxed);
}

static CANDIDATE_AHEAD: AtomicBool = AtomicBool::new(false);

/// What one step of the candidate's chain gave.
struct Chained {
    /// The outputs the sink wants and the selections, on the host.
    out: HashMap<String, HostTensor>,
    /// Seconds of the step.
    seconds: f64,
    /// Its uploads.
    upload: Option<UploadStats>,
}

/// Runs the chain `c`'s next step, `step`: the outputs `sink` wants and the selections, on the
/// host.
fn run_chained<C: Engine>(
    c: &mut Runner<'_, C>,
    step: &Step,
    sink: &dyn PairSink,
) -> Result<Chained> {
    let t0 = Instant::now();
    let extra = {
        let wants = |n: &str| sink.wants(n);
        c.step(&wants)?
    };
    let mut out = HashMap::new();
    for n in &step.outputs {
        if sink.wants(n) || is_selection(n) {
            let t = c
                .get(n)
                .with_context(|| format!("driver: output {n} of the step just run is gone"))?;
            out.insert(n.clone(), c.engine().download(t)?);
        }
    }
    for (n, t) in extra {
        if sink.wants(&n) {
            out.insert(n, c.engine().download(&t)?);
        }
    }
    Ok(Chained {
        out,
        seconds: t0.elapsed().as_secs_f64(),
        upload: Some(c.engine().take_upload_stats()),
    })
}

/// The reference's side of one step, run beside the candidate's.
struct RefStep<T> {
    /// Its outputs the sink wants, on the host.
    out: Vec<(String, HostTensor)>,
    /// Its optional hooks asked for, on the host.
    extra: Vec<(String, HostTensor)>,
    /// The further rows computed in its pass ([`Joint::more`]), in order.
    joint: Vec<Option<JointOut<T>>>,
    /// Seconds it took.
    seconds: f64,
    /// When it ended (its outputs on the host).
    ended: Instant,
}

/// The candidate engine's side of a step and the moment it ended.
type CandSide = (Result<CandStep>, Instant);

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
    summary.reference_time(step, "replay", took);
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
    let experts = matches!(step.op, Op::MoeExperts { .. });
    if !experts && !rows::joins_rows(&step.op) {
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
    // A replayed step takes the candidate's selection only in the steps that read one.
    if let Some(r) = replay.filter(|r| experts && joint_for.replay && r.substituted) {
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
