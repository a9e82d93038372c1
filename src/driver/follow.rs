//! The chained side of a pass: the reference's chain that follows the candidate's near-tie
//! selections.
//!
//! A correct low-precision candidate picks another key or expert wherever two are nearly tied;
//! from there its chain and the reference's own run on different selections, and every later
//! hook differs by more than precision explains. So the chain the candidate is judged against
//! takes the candidate's selection, row by row, where that flip is a near tie by the chain's
//! own scores at that point ([`NearTies::near_tie_rows`](crate::trace::NearTies::near_tie_rows): margin within the tolerance): both
//! chains then stay comparable and every later hook is judged against its floor again. A
//! confident flip is not taken (it fails; what follows from it is drift). The selection's pair
//! is handed over first (the chain's own selection against the candidate's), then the sink is
//! told which rows were taken ([`PairSink::followed`]).
//!
//! Where the candidate's selection is unknown (a trace that lacks it: a fused router, a fused
//! DSA indexer, layer outputs only), the chain tries the near-tie alternatives of its own
//! selection as [`super::segment`] does in replay (rounds, [`Rounds`]) and, at the next hook the
//! candidate has that they reach, keeps row by row the round closest to the candidate's value,
//! and carries on with it.
//!
//! The reference's own chain (its selections everywhere; the runner of [`super::pair`]) is what
//! the user's output shows: where a hook of the followed chain differs from it, its value is
//! handed over too ([`PairSink::plain_chain`]). Until the first selection taken or alternative
//! tried both chains are one: the followed chain then reads the runner's values and computes
//! nothing; from there it runs its own steps on the reference engine from host values, except
//! that a step whose inputs are the own chain's bit for bit takes the own chain's outputs, and
//! an attention, expert or row-wise step whose inputs differ from them in some rows is
//! computed in the rows that reach only ([`super::rows`]). A routed-experts step's rows are
//! computed by the own chain's step, in its pass over the experts' weights
//! ([`Follow::experts_request`], [`super::Runner::step_joint`]): at short prompts a MoE layer
//! costs the dequantization of its selected experts, which would otherwise be paid twice. At
//! short prompts a projection's, the router's and the shared MLP's rows are computed the same
//! way, beside the own chain's rows in one call ([`rows::joins_rows`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use anyhow::{Context, Result};

use super::replay::{is_selection, PairSummary, ReferenceWork};
use super::rows::{self, Prepared};
use super::segment::{collapse, step_in_rounds, RoundOutput, RoundOutputs, Rounds, Variants};
use super::{Plan, Runner};
use crate::engine::cpu::selected_weights;
use crate::engine::{Engine, HostTensor};
use crate::model::names::split_blk;
use crate::model::steps::{point, Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, NearTies, Pair, PairSink};

/// The candidate's value of a hook in chained mode, `None` when it has none.
pub(super) type CandidateValue<'c> = dyn Fn(&str) -> Result<Option<HostTensor>> + 'c;

/// The chain that follows the candidate's near ties (module documentation).
pub(super) struct Follow {
    /// Index of the last step reading each hook.
    last_use: HashMap<String, usize>,
    next: usize,
    /// The chain's values once it has left the reference's own chain; `None` while both are
    /// one (its values are then the runner's).
    env: Option<HashMap<String, Variants>>,
    rounds: Rounds,
    /// Whether steps are computed only where the chain differs from the own chain.
    only_changed: bool,
}

/// What one step of the followed chain is given.
pub(super) struct FollowStep<'a, 'r, R: Engine> {
    /// The reference engine.
    pub reference: &'a R,
    /// The reference's own chain, which has just run the step.
    pub plain: &'a Runner<'r, R>,
    /// The own chain's outputs of the step that the sink wants (optional hooks included).
    pub plain_out: &'a [(String, HostTensor)],
    /// The model's weights.
    pub weights: &'a Weights<'a>,
    /// The step.
    pub step: &'a Step,
    /// The prompt.
    pub tokens: &'a [u32],
    /// The plan's free inputs.
    pub start: &'a [(String, HostTensor)],
    /// How a hook the candidate lacks is described.
    pub absent: &'a str,
    /// The reference's scores behind each selection, asked about near ties.
    pub ties: &'a (dyn NearTies + Sync),
    /// The routed-experts step's rows this chain differs in, computed beside the own chain's
    /// step from [`Follow::experts_request`]'s inputs.
    pub prepared: Option<Prepared<R::Tensor>>,
}

/// Whether `name` is a selection of ids (the DSA keys, the routed experts).
fn is_ids(name: &str) -> bool {
    let p = split_blk(name).map_or(name, |(_, p)| p);
    p == point::INDEXER_TOPK || p == point::MOE_TOPK_IDS
}

/// Whether `name` holds the scores a selection is made from.
fn is_score(name: &str) -> bool {
    let p = split_blk(name).map_or(name, |(_, p)| p);
    p == point::INDEXER_SCORES || p == point::MOE_PROBS
}

impl Follow {
    /// The followed chain over `plan`'s steps, from the first; with `only_changed`, a step
    /// whose inputs are the own chain's takes its outputs, and one whose inputs differ from
    /// them in some rows is computed in those rows only ([`super::rows`]).
    pub(super) fn new(plan: &Plan, only_changed: bool) -> Follow {
        let mut last_use = HashMap::new();
        for (i, s) in plan.steps.iter().enumerate() {
            for n in &s.inputs {
                last_use.insert(n.clone(), i);
            }
        }
        Follow {
            last_use,
            next: 0,
            env: None,
            rounds: Rounds::default(),
            only_changed,
        }
    }

    /// Runs the plan's next step, `x.step`, on the followed chain and hands its pairs with the
    /// candidate's values (`candidate`) to `sink`.
    pub(super) fn step<R: Engine>(
        &mut self,
        mut x: FollowStep<'_, '_, R>,
        candidate: &CandidateValue<'_>,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let i = self.next;
        self.next += 1;
        let prepared = x.prepared.take();
        let result = self.run(&x, i, prepared, candidate, sink, summary);
        let last_use = &self.last_use;
        if let Some(env) = &mut self.env {
            env.retain(|n, _| last_use.get(n).is_some_and(|&j| j > i));
        }
        result
    }

    /// Leaves the reference's own chain: the values of `plain` that later steps read become the
    /// followed chain's own.
    fn fork<R: Engine>(&mut self, plain: &Runner<'_, R>, i: usize) -> Result<()> {
        if self.env.is_some() {
            return Ok(());
        }
        let mut env = HashMap::new();
        for (n, &j) in &self.last_use {
            if j > i {
                if let Some(t) = plain.get(n) {
                    env.insert(n.clone(), Variants::plain(plain.engine().download(t)?));
                }
            }
        }
        self.env = Some(env);
        Ok(())
    }

    /// The chain's values of the step's outputs: the runner's while both chains are one, else
    /// computed from the chain's own inputs in every round of alternatives.
    fn outputs<R: Engine>(
        &self,
        x: &FollowStep<'_, '_, R>,
        prepared: Option<Prepared<R::Tensor>>,
        sink: &dyn PairSink,
        work: &mut ReferenceWork,
    ) -> Result<RoundOutputs> {
        let step = x.step;
        let declared = |n: &str| step.outputs.iter().any(|o| o == n);
        let Some(env) = &self.env else {
            let mut outputs = Vec::new();
            for o in &step.outputs {
                let value = match x.plain_out.iter().find(|(n, _)| n == o) {
                    Some((_, t)) => Some(t.clone()),
                    None if is_selection(o) || is_score(o) => x
                        .plain
                        .get(o)
                        .map(|t| x.plain.engine().download(t))
                        .transpose()?,
                    None => None,
                };
                if let Some(t) = value {
                    outputs.push((o.clone(), t, BTreeMap::new()));
                }
            }
            for (n, t) in x.plain_out {
                if !declared(n) {
                    outputs.push((n.clone(), t.clone(), BTreeMap::new()));
                }
            }
            return Ok(RoundOutputs {
                outputs,
                notes: Vec::new(),
                via: Default::default(),
            });
        };
        let inputs = step
            .inputs
            .iter()
            .map(|n| {
                env.get(n)
                    .cloned()
                    .or_else(|| {
                        x.start
                            .iter()
                            .find(|(s, _)| s == n)
                            .map(|(_, t)| Variants::plain(t.clone()))
                    })
                    .with_context(|| {
                        format!(
                            "driver: the chain that follows the candidate has no {n}, an input of {}",
                            step.outputs.join(", ")
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let wants = |n: &str| declared(n) || sink.wants(n) || is_selection(n);
        let t0 = Instant::now();
        if let Some((out, rows)) = self.own_chain_outputs(x, &inputs, &wants, prepared)? {
            let took = t0.elapsed().as_secs_f64();
            match rows {
                Some(n) => work.followed_rows.add(n, took),
                None => work.followed_reused.add(0, took),
            }
            let via = inputs.iter().flat_map(|v| v.via.iter().cloned()).collect();
            return Ok(RoundOutputs {
                outputs: out
                    .into_iter()
                    .map(|(n, t)| (n, t, BTreeMap::new()))
                    .collect(),
                notes: Vec::new(),
                via,
            });
        }
        let out = step_in_rounds(x.reference, step, inputs, x.tokens, &wants)?;
        if step.op != Op::Alias {
            work.followed_whole
                .add(x.tokens.len(), t0.elapsed().as_secs_f64());
        }
        Ok(out)
    }

    /// The inputs of the next step, a routed-experts step (or at short prompts a row-wise step
    /// with weights, [`rows::joins_rows`]) that the own chain (`plain`) is about to run, and
    /// the rows in which they differ from the own chain's, when this chain would compute those
    /// rows ([`rows::recompute`]): the own chain's step can compute them in the same pass over
    /// the weights ([`super::Runner::step_joint`]), and hands them to
    /// [`FollowStep::prepared`]. `None` while both chains are one, where the inputs are the own
    /// chain's, where rounds of alternatives are tried, or for another step.
    #[allow(clippy::type_complexity)]
    pub(super) fn experts_request<R: Engine>(
        &self,
        plain: &Runner<'_, R>,
        step: &Step,
        start: &[(String, HostTensor)],
    ) -> Result<Option<(Vec<HostTensor>, Vec<usize>)>> {
        let Some(env) = &self.env else {
            return Ok(None);
        };
        let joins = match step.op {
            Op::MoeExperts { .. } => true,
            ref op => {
                rows::joins_rows(op)
                    && plain.engine().rows_independent()
                    && plain.tokens.len() <= rows::JOINT_ROWS_MAX_TOKENS
            }
        };
        if !self.only_changed || !joins {
            return Ok(None);
        }
        let mut chain = Vec::with_capacity(step.inputs.len());
        let mut base = Vec::with_capacity(step.inputs.len());
        for n in &step.inputs {
            let value = match env.get(n) {
                Some(v) if !v.alt.is_empty() => return Ok(None),
                Some(v) => v.base.clone(),
                None => match start.iter().find(|(s, _)| s == n) {
                    Some((_, t)) => t.clone(),
                    None => return Ok(None),
                },
            };
            let Some(own) = plain.get(n) else {
                return Ok(None);
            };
            chain.push(value);
            base.push(plain.engine().download(own)?);
        }
        let rows = rows::rows_reached(
            step,
            &chain.iter().collect::<Vec<_>>(),
            &base.iter().collect::<Vec<_>>(),
        );
        Ok(rows.filter(|r| !r.is_empty()).map(|r| (chain, r)))
    }

    /// The step's outputs from the own chain's, when the chain's inputs (without rounds of
    /// alternatives) are the own chain's bit for bit (`None` rows: nothing computed), or differ
    /// from them in rows that [`rows::recompute`] recomputes (`Some(rows recomputed)`); `None`
    /// when the step must run whole.
    #[allow(clippy::type_complexity)]
    fn own_chain_outputs<R: Engine>(
        &self,
        x: &FollowStep<'_, '_, R>,
        inputs: &[Variants],
        wants: &dyn Fn(&str) -> bool,
        prepared: Option<Prepared<R::Tensor>>,
    ) -> Result<Option<(Vec<(String, HostTensor)>, Option<usize>)>> {
        let step = x.step;
        if !self.only_changed || step.op == Op::Alias || inputs.iter().any(|v| !v.alt.is_empty()) {
            return Ok(None);
        }
        let mut base = Vec::with_capacity(step.inputs.len());
        for n in &step.inputs {
            match x.plain.get(n) {
                Some(t) => base.push(x.plain.engine().download(t)?),
                None => return Ok(None),
            }
        }
        // The own chain's outputs of the step: declared ones from the runner, optional ones
        // (only those the sink wants) from what it handed over.
        let mut known: Vec<(String, HostTensor)> = Vec::new();
        for o in &step.outputs {
            match x.plain.get(o) {
                Some(t) => known.push((o.clone(), x.plain.engine().download(t)?)),
                None => return Ok(None),
            }
        }
        known.extend(
            x.plain_out
                .iter()
                .filter(|(n, _)| !step.outputs.contains(n))
                .cloned(),
        );
        let chain: Vec<&HostTensor> = inputs.iter().map(|v| &v.base).collect();
        let base: Vec<&HostTensor> = base.iter().collect();
        let same = chain
            .iter()
            .zip(&base)
            .all(|(a, b)| rows::rows_differing(a, b).is_some_and(|r| r.is_empty()));
        if same {
            known.retain(|(n, _)| wants(n));
            return Ok(Some((known, None)));
        }
        Ok(
            rows::recompute(x.reference, step, &chain, &base, &known, wants, prepared)?
                .map(|r| (r.outputs, Some(r.rows))),
        )
    }

    /// The host values the chain feeds the step (the reference's own choices where it has
    /// rounds of alternatives); `None` when one is not at hand.
    fn chain_inputs<R: Engine>(&self, x: &FollowStep<'_, '_, R>) -> Option<Vec<HostTensor>> {
        x.step
            .inputs
            .iter()
            .map(|n| {
                let start = || x.start.iter().find(|(s, _)| s == n).map(|(_, t)| t.clone());
                match &self.env {
                    Some(env) => env.get(n).map(|v| v.base.clone()).or_else(start),
                    None => x
                        .plain
                        .get(n)
                        .and_then(|t| x.plain.engine().download(t).ok())
                        .or_else(start),
                }
            })
            .collect()
    }

    /// Runs step `i`, `x.step`, on the followed chain: its outputs ([`Follow::outputs`]) handed
    /// over against the candidate's values ([`Follow::hand_over`]), the rounds of alternatives
    /// that a candidate's hook decided kept, a selection the candidate lacks forking the chain
    /// where it has near ties, and the values later steps read carried on.
    fn run<R: Engine>(
        &mut self,
        x: &FollowStep<'_, '_, R>,
        i: usize,
        prepared: Option<Prepared<R::Tensor>>,
        candidate: &CandidateValue<'_>,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let step = x.step;
        if sink.wants_chained_inputs()
            && step.op != Op::Alias
            && step.outputs.iter().any(|o| sink.wants(o))
        {
            if let Some(inputs) = self.chain_inputs(x) {
                sink.chained_inputs(step, &inputs);
            }
        }
        let mut round = self.outputs(x, prepared, &*sink, &mut summary.reference_work)?;
        let handed = self.hand_over(x, i, &mut round, candidate, sink, summary)?;
        let mut outputs = round.outputs;
        // The rows of the rounds the candidate's hook chose are what the chain carries on with.
        if let Some(chosen) = &handed.decided {
            self.keep_decided(&mut outputs, chosen)?;
        }
        // Alternatives of a selection the candidate lacks, when it has near ties.
        if let Some(sel) = &handed.lacked_selection {
            let chosen = outputs.iter().find(|(n, _, _)| n == sel).map(|(_, t, _)| t);
            let any = chosen.is_some_and(|t| {
                !x.ties
                    .near_ties(sel, Mode::Chained, t, super::segment::ALTERNATIVES_PER_ROW)
                    .is_empty()
            });
            if any {
                self.fork(x.plain, i)?;
            }
        }
        self.carry_on(x, i, outputs, handed.lacked_selection.is_some())
    }

    /// Hands each output of step `i` (`round`: the chain's values) to `sink` against the
    /// candidate's value where the sink wants it ([`Follow::record`]; the reference's alone,
    /// and missing, where the candidate lacks it), and takes the candidate's selection in the
    /// rows where its flip is a near tie.
    fn hand_over<R: Engine>(
        &mut self,
        x: &FollowStep<'_, '_, R>,
        i: usize,
        round: &mut RoundOutputs,
        candidate: &CandidateValue<'_>,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<Handed> {
        let step = x.step;
        let outputs = &mut round.outputs;
        let mut handed = Handed::default();
        for k in 0..outputs.len() {
            let name = outputs[k].0.clone();
            let wanted = sink.wants(&name);
            let cand = if wanted || is_selection(&name) {
                candidate(&name)?
            } else {
                None
            };
            let Some(c) = cand else {
                if lacks(x, &name, &outputs[k].1, wanted, sink, summary) {
                    handed.lacked_selection = Some(name.clone());
                }
                continue;
            };
            if wanted {
                let chosen = self.record(x, &outputs[k], &round.notes, &c, sink, summary)?;
                if !outputs[k].2.is_empty() && handed.decided.is_none() {
                    handed.decided = Some(chosen);
                }
            }
            if is_ids(&name) && c.shape == outputs[k].1.shape && c != outputs[k].1 {
                let rows = x
                    .ties
                    .near_tie_rows(&name, Mode::Chained, &outputs[k].1, &c);
                if !rows.is_empty() {
                    self.fork(x.plain, i)?;
                    for &t in &rows {
                        outputs[k].1.copy_row_from(t, &c)?;
                    }
                    if matches!(step.op, Op::MoeRoute { .. }) {
                        reweigh(x.weights, outputs, &rows)?;
                    }
                    sink.followed(&name, Mode::Chained, &rows);
                }
            }
        }
        Ok(handed)
    }

    /// The pair of one output of the step (the chain's value, each row from the round closest
    /// to the candidate's, with the step's `notes`) against the candidate's value `c`, handed
    /// to `sink`, then the own chain's value where it differs. Returns the rows taken from a
    /// round, with their round.
    fn record<R: Engine>(
        &self,
        x: &FollowStep<'_, '_, R>,
        (name, value, alts): &RoundOutput,
        notes: &[String],
        c: &HostTensor,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<Vec<(usize, usize)>> {
        let (reference, note, chosen) = self.rounds.closest_rows(value.clone(), alts, c);
        let mut note_parts = notes.to_vec();
        note_parts.extend(note);
        let plain = x
            .plain_out
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .filter(|p| **p != reference)
            .cloned();
        sink.record(Pair {
            name,
            mode: Mode::Chained,
            inputs: &x.step.inputs,
            reference,
            candidate: c.clone(),
            note: (!note_parts.is_empty()).then(|| note_parts.join("; ")),
        })?;
        summary.pairs += 1;
        if let Some(p) = plain {
            sink.plain_chain(name, &p, c);
        }
        Ok(chosen)
    }

    /// Takes, in every value that differs by round (the step's `outputs` and the chain's own),
    /// each row of `chosen` from its round.
    fn keep_decided(
        &mut self,
        outputs: &mut [RoundOutput],
        chosen: &[(usize, usize)],
    ) -> Result<()> {
        for (_, value, alts) in outputs.iter_mut() {
            if !alts.is_empty() {
                let v = Variants {
                    base: value.clone(),
                    alt: std::mem::take(alts),
                    via: Default::default(),
                };
                *value = collapse(&v, chosen)?;
            }
        }
        if let Some(env) = &mut self.env {
            for v in env.values_mut() {
                if !v.alt.is_empty() {
                    v.base = collapse(v, chosen)?;
                    v.alt.clear();
                }
            }
        }
        Ok(())
    }

    /// Once the chain has left the own chain: the declared outputs of step `i` that later steps
    /// read become the chain's values, and after a selection the candidate lacks (`lacked`),
    /// the near-tie alternatives of the chain's selection are added as rounds.
    fn carry_on<R: Engine>(
        &mut self,
        x: &FollowStep<'_, '_, R>,
        i: usize,
        outputs: Vec<RoundOutput>,
        lacked: bool,
    ) -> Result<()> {
        let step = x.step;
        let declared = |n: &str| step.outputs.iter().any(|o| o == n);
        let route_probs = match step.op {
            Op::MoeRoute { .. } => outputs.first().map(|(_, t, _)| t.clone()),
            _ => None,
        };
        let Some(env) = &mut self.env else {
            return Ok(());
        };
        for (name, value, alt) in outputs {
            if declared(&name) && self.last_use.get(&name).is_some_and(|&j| j > i) {
                env.insert(
                    name,
                    Variants {
                        base: value,
                        alt,
                        via: Default::default(),
                    },
                );
            }
        }
        if lacked {
            self.rounds.add(
                env,
                x.weights,
                step,
                route_probs.as_ref(),
                x.ties,
                Mode::Chained,
            )?;
        }
        Ok(())
    }
}

/// What the candidate's values decided of a step's outputs on the followed chain.
#[derive(Default)]
struct Handed {
    /// The rows of the rounds kept (with their round), once a hook the candidate has decided
    /// them.
    decided: Option<Vec<(usize, usize)>>,
    /// The selection the candidate lacks: its alternatives are tried after the step.
    lacked_selection: Option<String>,
}

/// An output of the step, `name` (the chain's value `value`), that the candidate lacks: handed
/// to `sink` as the reference's alone and missing when `wanted`; the scores of a selection are
/// handed as the reference's alone in any case (they judge the selection's flips and give its
/// alternatives). Returns whether it is the selection of a selection step.
fn lacks<R: Engine>(
    x: &FollowStep<'_, '_, R>,
    name: &str,
    value: &HostTensor,
    wanted: bool,
    sink: &mut dyn PairSink,
    summary: &mut PairSummary,
) -> bool {
    let step = x.step;
    if wanted {
        sink.reference_only(name, Mode::Chained, &step.inputs, value);
        sink.missing(name, Mode::Chained, x.absent);
        summary.missing += 1;
    } else if is_score(name) {
        sink.reference_only(name, Mode::Chained, &step.inputs, value);
    }
    is_ids(name) && matches!(step.op, Op::TopK { .. } | Op::MoeRoute { .. })
}

/// After the router's selection took the candidate's experts in `rows`: the weights of those
/// rows from the chain's own probabilities (the step's outputs are probabilities, ids, weights).
fn reweigh(weights: &Weights<'_>, outputs: &mut [RoundOutput], rows: &[usize]) -> Result<()> {
    let [(_, probs, _), (_, ids, _), (_, w, _), ..] = outputs else {
        return Ok(());
    };
    let cols = probs.shape.last().copied().unwrap_or(1).max(1);
    let width = ids.shape.last().copied().unwrap_or(1).max(1);
    let p = probs.as_f32("moe_probs")?;
    let ids = ids.as_i32("moe_topk_ids")?;
    let mut new_w = w.as_f32("moe_weights")?.to_vec();
    for &t in rows {
        let pr: Vec<f64> = p[t * cols..(t + 1) * cols]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        let sel: Vec<usize> = ids[t * width..(t + 1) * width]
            .iter()
            .map(|&x| x.max(0) as usize)
            .collect();
        for (dst, v) in new_w[t * width..(t + 1) * width]
            .iter_mut()
            .zip(selected_weights(weights.hparams(), &pr, &sel))
        {
            *dst = v as f32;
        }
    }
    *w = HostTensor::f32(w.shape.clone(), new_w)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::driver::pair::RunInputs;
    use crate::driver::pair::{run_pair, Candidate, Modes};
    use crate::driver::NoProgress;
    use crate::engine::cpu::CpuEngine;
    use crate::explain::fault::{Fault, FaultEngine, FaultKind};
    use crate::model::testutil::{tiny_hparams, tiny_model};
    use crate::model::Arch;
    use crate::trace::{HookFilter, Pair};

    /// A sink that takes every row whose selection differs as a near tie, and keeps what the
    /// chained side hands it.
    #[derive(Default)]
    struct EveryRowATie {
        pairs: BTreeMap<String, (HostTensor, HostTensor)>,
        plain: BTreeMap<String, HostTensor>,
        followed: Vec<(String, Vec<usize>)>,
    }

    impl PairSink for EveryRowATie {
        fn wants(&self, name: &str) -> bool {
            HookFilter::default().wants(name)
        }
        fn record(&mut self, p: Pair<'_>) -> Result<()> {
            assert_eq!(p.mode, Mode::Chained);
            self.pairs
                .insert(p.name.to_string(), (p.reference, p.candidate));
            Ok(())
        }
        fn missing(&mut self, name: &str, mode: Mode, why: &str) {
            panic!("{name} missing in {mode}: {why}");
        }
        fn followed(&mut self, selection: &str, _: Mode, rows: &[usize]) {
            self.followed.push((selection.to_string(), rows.to_vec()));
        }
        fn plain_chain(&mut self, name: &str, reference: &HostTensor, _: &HostTensor) {
            self.plain.insert(name.to_string(), reference.clone());
        }
    }

    /// A candidate engine whose DSA indexer in layer 0 selects other keys (half-split RoPE in
    /// the indexer) and is otherwise the reference: once the chain takes its selection, every
    /// hook from layer 0's attention on is the reference's bit for bit, while the reference's
    /// own chain (handed over as the plain chain) differs there.
    #[test]
    fn the_chain_takes_the_candidates_selection_and_agrees_from_there() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let reference = CpuEngine::new(&w);
        let inner = CpuEngine::new(&w);
        let fault = Fault::new(FaultKind::IndexerRopeNeox, Some(vec![0]));
        let cand = FaultEngine::new(&inner, &w, vec![fault]);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 32).collect();
        let plan = Plan::full(&w).unwrap();
        let mut sink = EveryRowATie::default();
        let modes = Modes {
            replay: false,
            chained: true,
        };
        let inputs = RunInputs {
            weights: &w,
            tokens: &tokens,
            plan: &plan,
            start: &[],
            ties: &crate::driver::rows::DifferingRows,
        };
        run_pair(
            &reference,
            Candidate::Engine(&cand),
            inputs,
            modes,
            &mut sink,
            &NoProgress,
        )
        .unwrap();
        let (sel, rows) = sink.followed.first().expect("the indexer must flip a row");
        assert_eq!(sel, "blk.0.indexer_topk");
        assert!(!rows.is_empty());
        // The selection's pair is the chain's own against the candidate's: it differs.
        let (r, c) = &sink.pairs["blk.0.indexer_topk"];
        assert_ne!(r, c);
        for (name, (r, c)) in &sink.pairs {
            let downstream = !name.starts_with("blk.0.")
                || ["attn_heads", "attn_out", "ffn_inp", "l_out"]
                    .iter()
                    .any(|p| name.ends_with(p));
            if name != "token_embd" && downstream {
                assert_eq!(
                    r, c,
                    "{name}: the followed chain differs from the candidate"
                );
            }
        }
        assert_eq!(sink.pairs["logits"].0, sink.pairs["logits"].1);
        // The reference's own chain does not agree there.
        let plain = &sink.plain["blk.0.attn_heads"];
        assert_ne!(plain, &sink.pairs["blk.0.attn_heads"].1);
        assert!(sink.plain.contains_key("logits"));
    }
}
