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
//! alone ([`PairSink::reference_only`]) and listed as not in the trace.
//!
//! **Selections the trace lacks.** A segment that selects (the DSA keys, the routed experts)
//! selects by the reference's scores; a correct low-precision candidate picks another key or
//! expert wherever two are nearly tied, and its output then reflects a choice the reference
//! did not make. The reference therefore also tries the near-tie alternatives of its selection
//! (single swaps whose gap, by its own scores, is within the score hook's tolerance:
//! [`NearTies::near_ties`](crate::trace::NearTies::near_ties)): alternative *k* of every row that has one forms round *k*, the
//! segment's later steps run once per round, and at the next hook of the trace each row keeps
//! the round whose output is closest to the candidate's (the pair's note says which rows and
//! swaps). A round changes only its own rows (row-wise steps; attention reads the selection of
//! its own query row), so rows are chosen independently; a step that mixes rows from a value
//! that differs by round (the keys and values of attention, the keys of the index scores) drops
//! the rounds and says so. A real bug is not explained this way: only near ties are tried.
//!
//! Values live until the last step that reads them; nothing else is kept.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::Result;

use super::inputs::RunInputs;
use super::replay::{is_selection, replay_step, step_wanted, PairSummary};
use super::Plan;
use crate::engine::cpu::selected_weights;
use crate::engine::{Engine, HostTensor};
use crate::model::steps::{Op, Step};
use crate::model::Weights;
use crate::trace::{Mode, NearTies, Pair, PairSink, Swap, TraceFile};

/// Near-tie alternatives tried per row of a selection.
pub const ALTERNATIVES_PER_ROW: usize = 4;

/// A value the reference computed for a hook the trace lacks: its own choice, and its value in
/// the rounds of near-tie alternatives that change it.
#[derive(Clone, Debug)]
pub(super) struct Variants {
    /// The value with the reference's own choices.
    pub(super) base: HostTensor,
    /// Round -> value.
    pub(super) alt: BTreeMap<usize, HostTensor>,
    /// Selections the trace lacks upstream of it, inside its segment.
    pub(super) via: BTreeSet<String>,
}

impl Variants {
    /// A value that is the same in every round.
    pub(super) fn plain(base: HostTensor) -> Variants {
        Variants {
            base,
            alt: BTreeMap::new(),
            via: BTreeSet::new(),
        }
    }
}

/// One round of near-tie alternatives: a swap in each of some rows of one selection.
#[derive(Clone, Debug)]
struct Round {
    selection: String,
    swaps: BTreeMap<usize, Swap>,
}

/// The replay side of a pass against a trace (module documentation).
pub(super) struct TraceReplay<'t> {
    trace: &'t TraceFile,
    env: HashMap<String, Variants>,
    rounds: Rounds,
    /// Index of the last step reading each hook.
    last_use: HashMap<String, usize>,
    next: usize,
}

/// An input of a step: its value per round (`alt` empty when it is the same in every round).
pub(super) type Input = Variants;

/// The rounds of near-tie alternatives tried so far: round r is `rounds[r - 1]`; round 0 is the
/// reference's own choices.
#[derive(Default)]
pub(super) struct Rounds {
    rounds: Vec<Round>,
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
            rounds: Rounds::default(),
            last_use,
            next: 0,
        }
    }

    /// Replays the plan's next step, `step`, on `reference` and hands its pairs (and the
    /// reference's values of the hooks the trace lacks) to `sink`.
    pub(super) fn step<R: Engine>(
        &mut self,
        reference: &R,
        inputs: RunInputs<'_>,
        step: &Step,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let i = self.next;
        self.next += 1;
        let result = self.run(reference, inputs, step, i, sink, summary);
        // Values nobody reads from the next step on are dropped.
        let last_use = &self.last_use;
        self.env
            .retain(|n, _| last_use.get(n).is_some_and(|&j| j > i));
        result
    }

    fn needed_later(&self, name: &str, i: usize) -> bool {
        self.last_use.get(name).is_some_and(|&j| j > i)
    }

    /// Replays step `i`, `step`, when a hook of it is wanted or feeds a later step: in every
    /// round of alternatives, from its inputs ([`TraceReplay::inputs`]); its outputs the trace
    /// has are compared, those it lacks are kept for the segment's later steps, and a selection
    /// adds the rounds of its near-tie alternatives.
    fn run<R: Engine>(
        &mut self,
        reference: &R,
        inputs: RunInputs<'_>,
        step: &Step,
        i: usize,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        let tr = self.trace;
        let lacked = |o: &str| !tr.has(o);
        let wanted = step_wanted(step, &*sink, inputs.weights);
        let feeds = step
            .outputs
            .iter()
            .any(|o| lacked(o) && self.needed_later(o, i));
        if !wanted && !feeds {
            return Ok(());
        }
        let Some(values) = self.inputs(step, inputs.start, sink, summary)? else {
            return Ok(());
        };
        let compared = step.outputs.iter().any(|o| !lacked(o) && sink.wants(o));
        // A step inside a segment hands its inputs over too: `--explain` re-runs it under a
        // hypothesis where the segment fails.
        if (compared || feeds) && step.op != Op::Alias && sink.wants_replay_inputs() {
            let base_inputs: Vec<HostTensor> = values.iter().map(|x| x.base.clone()).collect();
            sink.replay_inputs(step, &base_inputs);
        }
        let declared = |n: &str| step.outputs.iter().any(|o| o == n);
        let wants = |n: &str| declared(n) || sink.wants(n) || is_selection(n);
        let mut round = step_in_rounds(reference, step, values, inputs.tokens, &wants)?;
        // The router's probabilities give the weights of another expert set.
        let route_probs = match step.op {
            Op::MoeRoute { .. } => round.outputs.first().map(|(_, t, _)| t.clone()),
            _ => None,
        };

        for output in std::mem::take(&mut round.outputs) {
            if lacked(&output.0) {
                self.keep(step, i, output, &round.via, sink, summary);
            } else {
                self.compare(step, output, &round, sink, summary)?;
            }
        }
        self.rounds.add(
            &mut self.env,
            inputs.weights,
            step,
            route_probs.as_ref(),
            inputs.ties,
            Mode::Replay,
        )?;
        Ok(())
    }

    /// The inputs of `step`: the trace's, else the reference's values inside a segment, else
    /// the run's starting values `start` (a run from layer A: both sides start from the same
    /// residual). `None` when one is in none of them: the step's wanted outputs are then
    /// reported missing.
    fn inputs(
        &self,
        step: &Step,
        start: &[(String, HostTensor)],
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<Option<Vec<Input>>> {
        let mut inputs: Vec<Input> = Vec::with_capacity(step.inputs.len());
        for n in &step.inputs {
            let input = match self.trace.get(n)? {
                Some(t) => Input {
                    base: t,
                    alt: BTreeMap::new(),
                    via: BTreeSet::new(),
                },
                None => match (self.env.get(n), start.iter().find(|(s, _)| s == n)) {
                    (Some(v), _) => Input {
                        base: v.base.clone(),
                        alt: v.alt.clone(),
                        via: v.via.clone(),
                    },
                    (None, Some((_, t))) => Input {
                        base: t.clone(),
                        alt: BTreeMap::new(),
                        via: BTreeSet::new(),
                    },
                    (None, None) => {
                        let why = format!("input {n} is not in the trace");
                        for o in &step.outputs {
                            if sink.wants(o) {
                                sink.missing(o, Mode::Replay, &why);
                                summary.missing += 1;
                            }
                        }
                        return Ok(None);
                    }
                },
            };
            inputs.push(input);
        }
        Ok(Some(inputs))
    }

    /// An output of `step` that the trace has, when `sink` wants it: the reference's value,
    /// each row from the round closest to the trace's (`round`: what the step computed),
    /// against the trace's.
    fn compare(
        &self,
        step: &Step,
        (name, value, alts): RoundOutput,
        round: &RoundOutputs,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) -> Result<()> {
        if !sink.wants(&name) {
            return Ok(());
        }
        let Some(candidate) = self.trace.get(&name)? else {
            return Ok(());
        };
        let (reference, chosen, _) = self.rounds.closest_rows(value, &alts, &candidate);
        let mut note = round.notes.clone();
        if !round.via.is_empty() {
            let v: Vec<&str> = round.via.iter().map(String::as_str).collect();
            note.push(format!(
                "{} not in the trace: the reference's own selection from the trace's inputs",
                v.join(", ")
            ));
        }
        if let Some(c) = chosen {
            note.push(c);
        }
        sink.record(Pair {
            name: &name,
            mode: Mode::Replay,
            inputs: &step.inputs,
            reference,
            candidate,
            note: (!note.is_empty()).then(|| note.join("; ")),
        })?;
        summary.pairs += 1;
        Ok(())
    }

    /// An output of step `i`, `step`, that the trace lacks: handed to `sink` as the
    /// reference's alone (and missing, where wanted), and kept, in every round, for the later
    /// steps that read it (`via`: the selections the trace lacks upstream of it).
    fn keep(
        &mut self,
        step: &Step,
        i: usize,
        (name, value, alts): RoundOutput,
        via: &BTreeSet<String>,
        sink: &mut dyn PairSink,
        summary: &mut PairSummary,
    ) {
        sink.reference_only(&name, Mode::Replay, &step.inputs, &value);
        if sink.wants(&name) {
            sink.missing(&name, Mode::Replay, "not in the trace");
            summary.missing += 1;
        }
        let declared = step.outputs.contains(&name);
        if declared && self.needed_later(&name, i) {
            let mut via = via.clone();
            if is_selection(&name) {
                via.insert(name.clone());
            }
            self.env.insert(
                name,
                Variants {
                    base: value,
                    alt: alts,
                    via,
                },
            );
        }
    }
}

impl Rounds {
    /// After a selection step whose selection the candidate lacks: the near-tie alternatives of
    /// the reference's selection in `env` (by the scores `ties` holds for `mode`), as new rounds
    /// (module documentation). Returns whether any was added.
    pub(super) fn add(
        &mut self,
        env: &mut HashMap<String, Variants>,
        weights: &Weights<'_>,
        step: &Step,
        route_probs: Option<&HostTensor>,
        ties: &dyn NearTies,
        mode: Mode,
    ) -> Result<bool> {
        let (sel, weights_hook) = match (&step.op, step.outputs.as_slice()) {
            (Op::TopK { .. }, [ids]) => (ids.clone(), None),
            (Op::MoeRoute { .. }, [_, ids, w]) => (ids.clone(), Some(w.clone())),
            _ => return Ok(false),
        };
        let Some(chosen) = env.get(&sel).map(|v| v.base.clone()) else {
            return Ok(false);
        };
        let swaps = ties.near_ties(&sel, mode, &chosen, ALTERNATIVES_PER_ROW);
        if swaps.is_empty() {
            return Ok(false);
        }
        let width = chosen.shape.last().copied().unwrap_or(1).max(1);
        let ids = chosen.as_i32(&sel)?.to_vec();
        // The k-th best swap of every row that has one forms one round.
        let mut by_row: BTreeMap<usize, Vec<Swap>> = BTreeMap::new();
        for s in swaps {
            by_row.entry(s.row).or_default().push(s);
        }
        let depth = by_row.values().map(Vec::len).max().unwrap_or(0);
        let probs: Option<(Vec<f64>, usize)> = match route_probs {
            Some(t) => {
                let cols = t.shape.last().copied().unwrap_or(1).max(1);
                Some((
                    t.as_f32("moe_probs")?
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect(),
                    cols,
                ))
            }
            None => None,
        };
        let base_w = weights_hook
            .as_ref()
            .and_then(|w| env.get(w).map(|v| v.base.clone()));
        let hp = weights.hparams();
        for k in 0..depth {
            let round: BTreeMap<usize, Swap> = by_row
                .iter()
                .filter_map(|(&row, v)| v.get(k).map(|s| (row, s.clone())))
                .collect();
            let mut new_ids = ids.clone();
            let mut new_w = base_w
                .as_ref()
                .and_then(|w| w.as_f32("moe_weights").ok().map(<[f32]>::to_vec));
            for (&row, s) in &round {
                let r = &mut new_ids[row * width..(row + 1) * width];
                for (l, e) in s.left.iter().zip(&s.entered) {
                    if let Some(x) = r.iter_mut().find(|x| *x == l) {
                        *x = *e;
                    }
                }
                if let (Some(w), Some((p, cols))) = (&mut new_w, &probs) {
                    let sel: Vec<usize> = r.iter().map(|&x| x.max(0) as usize).collect();
                    let pr = &p[row * cols..(row + 1) * cols];
                    for (dst, v) in w[row * width..(row + 1) * width]
                        .iter_mut()
                        .zip(selected_weights(hp, pr, &sel))
                    {
                        *dst = v as f32;
                    }
                }
            }
            self.rounds.push(Round {
                selection: sel.clone(),
                swaps: round,
            });
            let r = self.rounds.len();
            if let Some(v) = env.get_mut(&sel) {
                v.alt
                    .insert(r, HostTensor::i32(chosen.shape.clone(), new_ids)?);
            }
            if let (Some(wh), Some(w), Some(bw)) = (&weights_hook, new_w, &base_w) {
                if let Some(v) = env.get_mut(wh) {
                    v.alt.insert(r, HostTensor::f32(bw.shape.clone(), w)?);
                }
            }
        }
        Ok(true)
    }

    /// The reference's output with each row taken from the round closest to the candidate
    /// there (only rounds that change that row compete with the reference's own choice), a
    /// note naming the rows a near-tie alternative explains better, and those rows with their
    /// round.
    pub(super) fn closest_rows(
        &self,
        base: HostTensor,
        alts: &BTreeMap<usize, HostTensor>,
        candidate: &HostTensor,
    ) -> (HostTensor, Option<String>, Vec<(usize, usize)>) {
        if alts.is_empty() || base.shape != candidate.shape {
            return (base, None, Vec::new());
        }
        let (Ok(b), Ok(c)) = (base.as_f32(""), candidate.as_f32("")) else {
            return (base, None, Vec::new());
        };
        let rows = base.shape.first().copied().unwrap_or(0);
        let width = b.len().checked_div(rows).unwrap_or(0);
        let dist = |x: &[f32], y: &[f32]| -> f64 {
            x.iter()
                .zip(y)
                .map(|(&p, &q)| (f64::from(p) - f64::from(q)).powi(2))
                .sum()
        };
        let mut out = b.to_vec();
        let mut chosen: Vec<(usize, usize)> = Vec::new();
        for t in 0..rows {
            let span = t * width..(t + 1) * width;
            let mut best = (0usize, dist(&b[span.clone()], &c[span.clone()]));
            for (&r, a) in alts {
                let touches = self
                    .rounds
                    .get(r - 1)
                    .is_some_and(|round| round.swaps.contains_key(&t));
                let Ok(a) = a.as_f32("") else { continue };
                if !touches || a.len() != b.len() {
                    continue;
                }
                let d = dist(&a[span.clone()], &c[span.clone()]);
                if d < best.1 {
                    best = (r, d);
                }
            }
            if best.0 != 0 {
                if let Ok(a) = alts[&best.0].as_f32("") {
                    out[span.clone()].copy_from_slice(&a[span]);
                    chosen.push((t, best.0));
                }
            }
        }
        let note = (!chosen.is_empty()).then(|| {
            let items: Vec<String> = chosen
                .iter()
                .take(4)
                .filter_map(|&(t, r)| {
                    let round = self.rounds.get(r - 1)?;
                    let s = round.swaps.get(&t)?;
                    Some(format!(
                        "{} token {t}: {:?} in, {:?} out, margin {:.2e} <= tolerance {:.2e}",
                        round.selection, s.entered, s.left, s.margin, s.tolerance
                    ))
                })
                .collect();
            format!(
                "near-tie alternatives explain {} row(s) better: {}{}",
                chosen.len(),
                items.join("; "),
                if chosen.len() > 4 { "; ..." } else { "" }
            )
        });
        match HostTensor::f32(base.shape.clone(), out) {
            Ok(t) => (t, note, chosen),
            Err(_) => (base, None, Vec::new()),
        }
    }
}

/// `value` with each row of `chosen` taken from its round (rows the round leaves alone, or
/// values that do not differ by round, keep the base): what a chain that keeps those rounds
/// carries on with.
pub(super) fn collapse(value: &Variants, chosen: &[(usize, usize)]) -> Result<HostTensor> {
    let mut out = value.base.clone();
    let rows = out.shape.first().copied().unwrap_or(0);
    for &(t, r) in chosen {
        let Some(a) = value.alt.get(&r) else { continue };
        if a.shape != out.shape || t >= rows {
            continue;
        }
        out.copy_row_from(t, a)?;
    }
    Ok(out)
}

/// One output of a step computed in every round: its name, its value with the reference's own
/// choices, and its value in the rounds that change it.
pub(super) type RoundOutput = (String, HostTensor, BTreeMap<usize, HostTensor>);

/// What a step computed in every round.
pub(super) struct RoundOutputs {
    /// Per output (declared, then optional ones asked for): its value with the reference's own
    /// choices, and its value in the rounds that change it.
    pub(super) outputs: Vec<RoundOutput>,
    /// Rounds set aside (the step mixes rows).
    pub(super) notes: Vec<String>,
    /// Selections the candidate lacks upstream, inside the segment.
    pub(super) via: BTreeSet<String>,
}

/// Runs `step` on `reference` from `inputs` once with their base values (every output `wants`
/// asks for) and once per round any of them differs in (the declared outputs), unless the step
/// mixes rows through a value that differs by round (the rounds are then set aside, said in a
/// note).
pub(super) fn step_in_rounds<R: Engine>(
    reference: &R,
    step: &Step,
    inputs: Vec<Input>,
    tokens: &[u32],
    wants: &dyn Fn(&str) -> bool,
) -> Result<RoundOutputs> {
    let mut notes: Vec<String> = Vec::new();
    let mut rounds: BTreeSet<usize> = inputs.iter().flat_map(|x| x.alt.keys().copied()).collect();
    if !rounds.is_empty() && mixes_rows(step, &inputs) {
        notes.push(format!(
            "near-tie alternatives upstream were set aside at {}: that step mixes rows",
            step.outputs.join(", ")
        ));
        rounds.clear();
    }
    let via: BTreeSet<String> = inputs.iter().flat_map(|x| x.via.iter().cloned()).collect();
    let base_inputs: Vec<HostTensor> = inputs.iter().map(|x| x.base.clone()).collect();
    let declared = |n: &str| step.outputs.iter().any(|o| o == n);
    let base = replay_step(reference, step, &base_inputs, tokens, wants)?;
    drop(base_inputs);
    let mut alt: BTreeMap<usize, Vec<(String, HostTensor)>> = BTreeMap::new();
    for &r in &rounds {
        let values: Vec<HostTensor> = inputs
            .iter()
            .map(|x| x.alt.get(&r).unwrap_or(&x.base).clone())
            .collect();
        alt.insert(r, replay_step(reference, step, &values, tokens, &declared)?);
    }
    let outputs = base
        .into_iter()
        .map(|(name, value)| {
            let alts: BTreeMap<usize, HostTensor> = alt
                .iter_mut()
                .filter_map(|(&r, out)| {
                    let i = out.iter().position(|(n, _)| *n == name)?;
                    Some((r, out.swap_remove(i).1))
                })
                .collect();
            (name, value, alts)
        })
        .collect();
    Ok(RoundOutputs {
        outputs,
        notes,
        via,
    })
}

/// Whether `step` mixes rows through an input that differs by round: attention's keys and
/// values (`kv_a_norm`, `k_pe_rope`) and the index scores' keys (`attn_norm`) are read for every
/// query row. Row-wise steps and the query side keep a round's change in its own rows.
fn mixes_rows(step: &Step, inputs: &[Input]) -> bool {
    let varies = |i: usize| inputs.get(i).is_some_and(|x| !x.alt.is_empty());
    match step.op {
        Op::Attention { .. } => varies(2) || varies(3),
        Op::IndexerScores { .. } => varies(0),
        _ => false,
    }
}
