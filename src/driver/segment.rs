//! Replay of a trace across the hooks it lacks.
//!
//! Serving engines do not hand over every hook: RoPE fused into attention leaves no
//! `q_pe_rope`/`k_pe_rope`, a fused router no `moe_probs` or selection, a dump of layer outputs
//! nothing but `l_out`. In replay the reference runs each step from the trace's own inputs;
//! where an input is not in the trace, it is the reference's own value of that hook, computed
//! the same way from the trace's nearest hooks upstream. So the reference runs from the nearest
//! captured hooks through the steps whose outputs the trace lacks to the next hook the trace
//! has, and that *segment* is compared as one (the sink composes its floor from its steps, see
//! `compare::floors`). The hooks inside a segment are handed to the sink as the reference's
//! alone ([`PairSink::reference_only`]) and listed as not in the trace. A selection the trace
//! lacks (the DSA keys, the routed experts) is the reference's own, made from the trace's
//! inputs, and the pairs after it say so.
//!
//! Values live until the last step that reads them; nothing else is kept.

use std::collections::{BTreeSet, HashMap};

use anyhow::Result;

use super::pair::{is_selection, replay_step, step_wanted, PairSummary};
use super::Plan;
use crate::engine::{Engine, HostTensor};
use crate::model::steps::{Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, Pair, PairSink, TraceFile};

/// A value the reference computed for a hook the trace lacks.
#[derive(Clone, Debug)]
struct Inside {
    value: HostTensor,
    /// Selections the trace lacks upstream of it, inside its segment.
    via: BTreeSet<String>,
}

/// The replay side of a pass against a trace (module documentation).
pub(super) struct TraceReplay<'t> {
    trace: &'t TraceFile,
    env: HashMap<String, Inside>,
    /// Index of the last step reading each hook.
    last_use: HashMap<String, usize>,
    next: usize,
}

impl<'t> TraceReplay<'t> {
    /// Replay of `trace` over `plan`'s steps, from the first.
    pub(super) fn new(trace: &'t TraceFile, plan: &Plan) -> TraceReplay<'t> {
        let mut last_use = HashMap::new();
        for (i, s) in plan.steps.iter().enumerate() {
            for n in &s.inputs {
                last_use.insert(n.clone(), i);
            }
        }
        TraceReplay {
            trace,
            env: HashMap::new(),
            last_use,
            next: 0,
        }
    }

    /// Replays the plan's next step, `step`, on `reference` and hands its pairs (and the
    /// reference's values of the hooks the trace lacks) to `sink`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step<R: Engine>(
        &mut self,
        reference: &R,
        weights: &Weights<'_>,
        step: &Step,
        tokens: &[u32],
        start: &[(String, HostTensor)],
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let i = self.next;
        self.next += 1;
        let result = self.run(reference, weights, step, i, tokens, start, sink, summary);
        // Values nobody reads from the next step on are dropped.
        let last_use = &self.last_use;
        self.env
            .retain(|n, _| last_use.get(n).is_some_and(|&j| j > i));
        result
    }

    fn needed_later(&self, name: &str, i: usize) -> bool {
        self.last_use.get(name).is_some_and(|&j| j > i)
    }

    #[allow(clippy::too_many_arguments)]
    fn run<R: Engine>(
        &mut self,
        reference: &R,
        weights: &Weights<'_>,
        step: &Step,
        i: usize,
        tokens: &[u32],
        start: &[(String, HostTensor)],
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let tr = self.trace;
        let lacked = |o: &str| !tr.has(o);
        let wanted = step_wanted(step, &*sink, weights);
        let feeds = step
            .outputs
            .iter()
            .any(|o| lacked(o) && self.needed_later(o, i));
        if !wanted && !feeds {
            return Ok(());
        }
        // The inputs: the trace's, else the reference's values inside a segment, else the run's
        // starting values (a run from layer A: both sides start from the same residual).
        let mut inputs: Vec<HostTensor> = Vec::with_capacity(step.inputs.len());
        let mut via: BTreeSet<String> = BTreeSet::new();
        for n in &step.inputs {
            let value = match tr.get(n)? {
                Some(t) => t,
                None => match (self.env.get(n), start.iter().find(|(s, _)| s == n)) {
                    (Some(v), _) => {
                        via.extend(v.via.iter().cloned());
                        v.value.clone()
                    }
                    (None, Some((_, t))) => t.clone(),
                    (None, None) => {
                        let why = format!("input {n} is not in the trace");
                        for o in &step.outputs {
                            if sink.wants(o) {
                                sink.missing(o, Mode::Replay, &why);
                                summary.missing += 1;
                            }
                        }
                        return Ok(());
                    }
                },
            };
            inputs.push(value);
        }
        let compared = step.outputs.iter().any(|o| !lacked(o) && sink.wants(o));
        if compared && step.op != Op::Alias && sink.wants_replay_inputs() {
            sink.replay_inputs(step, &inputs);
        }
        let declared = |n: &str| step.outputs.iter().any(|o| o == n);
        let wants = |n: &str| declared(n) || sink.wants(n) || is_selection(n);
        let out = replay_step(reference, step, &inputs, tokens, &wants)?;
        drop(inputs);

        for (name, value) in out {
            if !lacked(&name) {
                if !sink.wants(&name) {
                    continue;
                }
                let Some(candidate) = tr.get(&name)? else {
                    continue;
                };
                let note = (!via.is_empty()).then(|| {
                    let v: Vec<&str> = via.iter().map(String::as_str).collect();
                    format!(
                        "{} not in the trace: the reference's own selection from the trace's inputs",
                        v.join(", ")
                    )
                });
                sink.record(Pair {
                    name: &name,
                    mode: Mode::Replay,
                    inputs: &step.inputs,
                    reference: value,
                    candidate,
                    note,
                })?;
                summary.pairs += 1;
                continue;
            }
            sink.reference_only(&name, Mode::Replay, &step.inputs, &value);
            if sink.wants(&name) {
                sink.missing(&name, Mode::Replay, "not in the trace");
                summary.missing += 1;
            }
            if declared(&name) && self.needed_later(&name, i) {
                let mut via = via.clone();
                if is_selection(&name) {
                    via.insert(name.clone());
                }
                self.env.insert(name.clone(), Inside { value, via });
            }
        }
        Ok(())
    }
}
