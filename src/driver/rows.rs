//! A step recomputed only in the rows where its inputs changed.
//!
//! The reference has run a step from some inputs (its own) and holds the outputs; the same step
//! is wanted from inputs that differ from those in a few rows (the candidate's selection in
//! replay, a near tie taken by the followed chain). The routed experts compute each token's row
//! from that token's rows of `x`, the ids and the weights alone; attention computes query row
//! `t` from query row `t`, selection row `t` and the keys and values of positions `0..=t`; a
//! row-wise step (a norm, a projection, the router, the shared MLP, SwiGLU, a sum) computes row
//! `t` from row `t` of its inputs. So the outputs differ from the ones at hand only in the rows
//! the changed inputs reach, and only those are recomputed ([`Engine::moe_experts_rows`],
//! [`Engine::mla_attention_rows`], a row-wise step on those rows of its inputs where
//! [`Engine::rows_independent`]) and spliced in: bit for bit what the whole step computes, at
//! the cost of the rows that changed. (At 4096 tokens a bf16 candidate's DSA selection takes
//! near ties in about half the rows: the chain that follows it then computes half a layer.)
//! An engine that computes only whole steps, inputs of another shape, a step of another kind,
//! or changes that reach every row leave the whole step to the caller ([`recompute`] returns
//! `None`). A routed-experts step's rows may come already computed ([`Prepared`]: the own
//! chain's step computed them in its pass over the experts), even every row; so may a row-wise
//! step's with weights at short prompts ([`joins_rows`]: the own chain's step computed them
//! beside its own rows, in one pass over the weights).

use std::collections::BTreeSet;

use anyhow::{bail, Result};
use rayon::prelude::*;

use crate::engine::{Engine, ExpertInputs, ExpertsOut, HostData, HostTensor, MlaInputs};
use crate::model::steps::{expert_hook, hook, point, Op, Step};

/// The rows of the first axis in which `a` and `b` differ bit for bit (`-0.0` and `0.0` differ,
/// a NaN equals the same NaN), or `None` when their shapes or kinds of values differ.
pub(super) fn rows_differing(a: &HostTensor, b: &HostTensor) -> Option<Vec<usize>> {
    if a.shape != b.shape {
        return None;
    }
    if a.shares_values(b) {
        return Some(Vec::new());
    }
    let rows = a.shape.first().copied().unwrap_or(0);
    let width = a.len().checked_div(rows).unwrap_or(0).max(1);
    // Rows compared on the threads (a long prompt's hook holds 25M values), kept in order.
    let differ: Vec<usize> = match (&a.data, &b.data) {
        (HostData::F32(x), HostData::F32(y)) => (0..rows)
            .into_par_iter()
            .filter(|&t| {
                let span = t * width..(t + 1) * width;
                x[span.clone()]
                    .iter()
                    .zip(&y[span])
                    .any(|(p, q)| p.to_bits() != q.to_bits())
            })
            .collect(),
        (HostData::I32(x), HostData::I32(y)) => (0..rows)
            .into_par_iter()
            .filter(|&t| x[t * width..(t + 1) * width] != y[t * width..(t + 1) * width])
            .collect(),
        _ => return None,
    };
    Some(differ)
}

/// A step's outputs in some token rows, computed ahead of [`recompute`] beside the own chain's
/// step ([`super::Runner::step_joint`]).
pub(super) struct Prepared<T> {
    /// The token rows computed, ascending.
    pub(super) rows: Vec<usize>,
    /// Their outputs.
    pub(super) out: JointOut<T>,
}

/// The outputs of one further input of a joint step, in its rows.
pub(super) enum JointOut<T> {
    /// A routed-experts step's ([`Engine::moe_experts_joint`]).
    Experts(ExpertsOut<T>),
    /// A row-wise step's with weights ([`joins_rows`]): its declared outputs, `[rows, ..]` each,
    /// in the step's order.
    Rows(Vec<(String, HostTensor)>),
}

/// Most tokens of a prompt whose row-wise steps with weights compute a changed chain's rows
/// beside the own chain's ([`joins_rows`]). A step's weights are dequantized once for every
/// row either way; at a few tokens that is most of the step (at 16 tokens a projection's
/// dequantization costs about what 4 tokens of its products do), so computing the changed
/// rows apart costs nearly a second step. From about a hundred tokens the products dominate
/// and joining saves little, while the joint step's inputs and outputs are copies of the
/// whole step's.
pub(super) const JOINT_ROWS_MAX_TOKENS: usize = 64;

/// Whether `op` is a row-wise step with weights ([`row_wise`]: a projection, the router's
/// logits, the shared MLP), whose changed rows the own chain's step computes beside its own at
/// short prompts ([`JOINT_ROWS_MAX_TOKENS`]).
pub(super) fn joins_rows(op: &Op) -> bool {
    matches!(
        op,
        Op::Linear { .. } | Op::RouterLogits { .. } | Op::Mlp { .. }
    )
}

/// What [`recompute`] gives.
pub(super) struct Recomputed {
    /// The outputs asked for, in the order the whole step gives them.
    pub(super) outputs: Vec<(String, HostTensor)>,
    /// The rows recomputed.
    pub(super) rows: usize,
}

/// The output rows of `step` that inputs differing from `base` in `inputs` reach, ascending, or
/// `None` when `step` is not one that [`recompute`] restricts or an input changed shape.
pub(super) fn rows_reached(
    step: &Step,
    inputs: &[&HostTensor],
    base: &[&HostTensor],
) -> Option<Vec<usize>> {
    if inputs.len() != step.inputs.len() || base.len() != inputs.len() {
        return None;
    }
    let mut per_input = Vec::with_capacity(inputs.len());
    for (a, b) in inputs.iter().zip(base) {
        per_input.push(rows_differing(a, b)?);
    }
    let rows = inputs.first()?.shape.first().copied()?;
    let mut reached: BTreeSet<usize> = BTreeSet::new();
    match step.op {
        Op::MoeExperts { .. } => reached.extend(per_input.into_iter().flatten()),
        _ if row_wise(&step.op) => {
            if inputs.iter().any(|t| t.shape.first() != Some(&rows)) {
                return None;
            }
            reached.extend(per_input.into_iter().flatten());
        }
        Op::Attention { .. } => {
            // q_b, q_pe_rope, kv_a_norm, k_pe_rope[, indexer_topk]: a changed key or value at
            // position s reaches every query from s on.
            for (i, r) in per_input.into_iter().enumerate() {
                match i {
                    2 | 3 => {
                        if let Some(&s) = r.first() {
                            reached.extend(s..rows);
                        }
                    }
                    _ => reached.extend(r),
                }
            }
        }
        _ => return None,
    }
    Some(reached.into_iter().collect())
}

/// The outputs of `step` from `inputs` that `wants` asks for (declared outputs, then optional
/// hooks, as [`super::replay::replay_step`] returns them), computed in the rows where `inputs`
/// differ from `base` only and taken from `known` elsewhere. `known` holds what the step gave
/// from `base`: at least every output `wants` asks for. `None` when the step is left whole to
/// the caller (module documentation).
///
/// `prepared` is a routed-experts step's rows already computed beside the own chain's step
/// ([`super::Runner::step_joint`]): taken when its rows are the ones the change reaches, even
/// all of them (nothing is left to compute), in place of [`Engine::moe_experts_rows`].
pub(super) fn recompute<E: Engine>(
    engine: &E,
    step: &Step,
    inputs: &[&HostTensor],
    base: &[&HostTensor],
    known: &[(String, HostTensor)],
    wants: &dyn Fn(&str) -> bool,
    prepared: Option<Prepared<E::Tensor>>,
) -> Result<Option<Recomputed>> {
    let Some(rows) = rows_reached(step, inputs, base) else {
        return Ok(None);
    };
    let prepared = prepared.filter(|p| {
        p.rows == rows
            && match &p.out {
                JointOut::Experts(_) => matches!(step.op, Op::MoeExperts { .. }),
                JointOut::Rows(_) => joins_rows(&step.op),
            }
    });
    let n_rows = inputs.first().and_then(|t| t.shape.first()).copied();
    if n_rows.is_none_or(|n| rows.len() >= n && prepared.is_none()) {
        return Ok(None);
    }
    let known_of = |name: &str| known.iter().find(|(n, _)| n == name).map(|(_, t)| t);
    let out = match step.op {
        Op::Attention { layer } => attention(engine, layer, step, inputs, &rows, &known_of, wants)?,
        Op::MoeExperts { layer } => experts(
            engine,
            layer,
            step,
            inputs,
            base,
            &rows,
            &known_of,
            wants,
            prepared.and_then(|p| match p.out {
                JointOut::Experts(e) => Some(e),
                JointOut::Rows(_) => None,
            }),
        )?,
        _ if row_wise(&step.op) => {
            let part = prepared.and_then(|p| match p.out {
                JointOut::Rows(r) => Some(r),
                JointOut::Experts(_) => None,
            });
            by_rows(engine, step, inputs, &rows, &known_of, wants, part)?
        }
        _ => None,
    };
    Ok(out.map(|outputs| Recomputed {
        outputs,
        rows: rows.len(),
    }))
}

/// Whether each output row of `op` is computed from the same row of its inputs alone: norms,
/// projections, the router, the shared MLP, SwiGLU, sums (not RoPE or the causal top-k, which
/// read the row's position, nor the indexer scores and attention, which mix rows).
fn row_wise(op: &Op) -> bool {
    matches!(
        op,
        Op::RmsNorm { .. }
            | Op::Linear { .. }
            | Op::RouterLogits { .. }
            | Op::MoeRoute { .. }
            | Op::Mlp { .. }
            | Op::SwiGlu
            | Op::Add
            | Op::ZerosLike
    )
}

/// A row-wise step ([`row_wise`]) in the rows `rows`: run on those rows of its inputs (or
/// taken from `part`, those rows' outputs computed beside the own chain's step), its outputs
/// spliced into the known ones. Only for an engine whose rows are independent
/// ([`Engine::rows_independent`]): then a row's bits are the whole step's.
fn by_rows<'k, E: Engine>(
    engine: &E,
    step: &Step,
    inputs: &[&HostTensor],
    rows: &[usize],
    known: &dyn Fn(&str) -> Option<&'k HostTensor>,
    wants: &dyn Fn(&str) -> bool,
    part: Option<Vec<(String, HostTensor)>>,
) -> Result<Option<Vec<(String, HostTensor)>>> {
    if !engine.rows_independent() {
        return Ok(None);
    }
    if rows.is_empty() {
        // Nothing reached: the known outputs as they are.
        let mut out = Vec::new();
        for n in step.outputs.iter().filter(|n| wants(n)) {
            let Some(k) = known(n) else {
                return Ok(None);
            };
            out.push((n.clone(), k.clone()));
        }
        return Ok(Some(out));
    }
    let computed = match part {
        Some(p) => p.into_iter().filter(|(n, _)| wants(n)).collect(),
        None => {
            let part: Vec<HostTensor> = inputs
                .iter()
                .map(|t| t.gather_rows(rows))
                .collect::<Result<_>>()?;
            super::replay::replay_step(engine, step, &part, &[], wants)?
        }
    };
    let mut out = Vec::new();
    for (n, p) in computed {
        let Some(k) = known(&n) else {
            return Ok(None);
        };
        out.push((n, splice(k, &p, rows)?));
    }
    Ok(Some(out))
}

/// A known output with the rows `rows` replaced by those of `part` (`[rows.len(), ..]`).
fn splice(known: &HostTensor, part: &HostTensor, rows: &[usize]) -> Result<HostTensor> {
    let n = known.shape.first().copied().unwrap_or(0);
    let width = known.len().checked_div(n).unwrap_or(0);
    if part.shape.first() != Some(&rows.len()) || part.len() != rows.len() * width {
        bail!(
            "driver: rows {rows:?} of shape {:?} cannot come from shape {:?}",
            known.shape,
            part.shape
        );
    }
    let data = match (&known.data, &part.data) {
        (HostData::F32(k), HostData::F32(p)) => {
            HostData::F32(std::sync::Arc::new(spliced(k, p, rows, width)))
        }
        (HostData::I32(k), HostData::I32(p)) => {
            HostData::I32(std::sync::Arc::new(spliced(k, p, rows, width)))
        }
        _ => bail!("driver: rows {rows:?}: f32 and i32 values do not mix"),
    };
    Ok(HostTensor {
        shape: known.shape.clone(),
        data,
    })
}

/// `known` (rows of `width` values) with its rows `rows` replaced by those of `part`, copied on
/// the threads a row at a time (a long prompt's hook holds 25M values).
fn spliced<T: Copy + Default + Send + Sync>(
    known: &[T],
    part: &[T],
    rows: &[usize],
    width: usize,
) -> Vec<T> {
    // Where each row comes from: the known row, or row i of `part`.
    let mut from: Vec<Option<usize>> = vec![None; known.len().checked_div(width).unwrap_or(0)];
    for (i, &t) in rows.iter().enumerate() {
        if let Some(f) = from.get_mut(t) {
            *f = Some(i);
        }
    }
    let mut out = vec![T::default(); known.len()];
    out.par_chunks_mut(width.max(1))
        .zip(from.par_iter())
        .enumerate()
        .for_each(|(t, (o, f))| match f {
            Some(i) => o.copy_from_slice(&part[i * width..(i + 1) * width]),
            None => o.copy_from_slice(&known[t * width..(t + 1) * width]),
        });
    out
}

/// Attention in the query rows `rows`, spliced into the known heads and probabilities.
fn attention<'k, E: Engine>(
    engine: &E,
    layer: usize,
    step: &Step,
    inputs: &[&HostTensor],
    rows: &[usize],
    known: &dyn Fn(&str) -> Option<&'k HostTensor>,
    wants: &dyn Fn(&str) -> bool,
) -> Result<Option<Vec<(String, HostTensor)>>> {
    let (Some(heads_name), true) = (step.outputs.first(), inputs.len() >= 4) else {
        return Ok(None);
    };
    let probs_name = hook(layer, point::ATTN_PROBS);
    let want_heads = wants(heads_name);
    let want_probs = wants(&probs_name);
    let known_heads = known(heads_name);
    let known_probs = known(&probs_name);
    if (want_heads && known_heads.is_none()) || (want_probs && known_probs.is_none()) {
        return Ok(None);
    }
    let up = inputs
        .iter()
        .map(|t| engine.upload(t))
        .collect::<Result<Vec<_>>>()?;
    let x = MlaInputs {
        q_b: &up[0],
        q_pe: &up[1],
        kv_norm: &up[2],
        k_pe: &up[3],
        selection: up.get(4),
    };
    let Some((heads, probs)) = engine.mla_attention_rows(layer, x, rows, want_probs)? else {
        return Ok(None);
    };
    let mut out = Vec::new();
    if let (true, Some(k)) = (want_heads, known_heads) {
        out.push((
            heads_name.clone(),
            splice(k, &engine.download(&heads)?, rows)?,
        ));
    }
    if let (true, Some(k), Some(p)) = (want_probs, known_probs, probs) {
        out.push((probs_name, splice_probs(k, &engine.download(&p)?, rows)?));
    }
    Ok(Some(out))
}

/// Known probabilities `[H, T, T]` with the query rows `rows` of every head taken from `part`
/// (`[H, rows.len(), T]`).
fn splice_probs(known: &HostTensor, part: &HostTensor, rows: &[usize]) -> Result<HostTensor> {
    let (&[h, t, t2], &[ph, pn, pt]) = (known.shape.as_slice(), part.shape.as_slice()) else {
        bail!(
            "driver: attention probabilities of shapes {:?} and {:?}",
            known.shape,
            part.shape
        );
    };
    if (ph, pn, pt) != (h, rows.len(), t2) || rows.iter().any(|&r| r >= t) {
        bail!(
            "driver: query rows {rows:?} of probabilities {:?} cannot come from {:?}",
            known.shape,
            part.shape
        );
    }
    let (k, p) = (known.as_f32("attn_probs")?, part.as_f32("attn_probs")?);
    let mut out = k.to_vec();
    for head in 0..h {
        for (i, &qt) in rows.iter().enumerate() {
            let dst = (head * t + qt) * t2;
            let src = (head * pn + i) * t2;
            out[dst..dst + t2].copy_from_slice(&p[src..src + t2]);
        }
    }
    HostTensor::f32(known.shape.clone(), out)
}

/// The routed experts in the token rows `rows`, spliced into the known routed sum and expert
/// outputs. An expert's output lists the tokens routed to it in token order: each row comes
/// from the recomputed tokens or from the known output, whose routing is the base's.
#[allow(clippy::too_many_arguments)]
fn experts<'k, E: Engine>(
    engine: &E,
    layer: usize,
    step: &Step,
    inputs: &[&HostTensor],
    base: &[&HostTensor],
    rows: &[usize],
    known: &dyn Fn(&str) -> Option<&'k HostTensor>,
    wants: &dyn Fn(&str) -> bool,
    prepared: Option<ExpertsOut<E::Tensor>>,
) -> Result<Option<Vec<(String, HostTensor)>>> {
    let (Some(routed_name), true) = (step.outputs.first(), inputs.len() == 3 && base.len() == 3)
    else {
        return Ok(None);
    };
    let want_routed = wants(routed_name);
    let known_routed = known(routed_name);
    if want_routed && known_routed.is_none() {
        return Ok(None);
    }
    let (t, k) = inputs[1].dims2("moe_topk_ids")?;
    let new_ids = inputs[1].as_i32("moe_topk_ids")?;
    let base_ids = base[1].as_i32("moe_topk_ids")?;
    let part = match prepared {
        Some(p) => p,
        None => {
            let up = inputs
                .iter()
                .map(|x| engine.upload(x))
                .collect::<Result<Vec<_>>>()?;
            let x = ExpertInputs {
                x: &up[0],
                ids: &up[1],
                weights: &up[2],
            };
            let want_expert = |e: usize| wants(&expert_hook(layer, e));
            match engine.moe_experts_rows(layer, x, rows, &want_expert)? {
                Some(part) => part,
                None => return Ok(None),
            }
        }
    };
    let mut out = Vec::new();
    if let (true, Some(kr)) = (want_routed, known_routed) {
        out.push((
            routed_name.clone(),
            splice(kr, &engine.download(&part.routed)?, rows)?,
        ));
    }
    let recomputed: BTreeSet<usize> = rows.iter().copied().collect();
    // The experts the whole step would list: every one some token selects, ascending.
    let selected: BTreeSet<i32> = new_ids.iter().copied().collect();
    for e in selected {
        let Ok(e) = usize::try_from(e) else {
            return Ok(None);
        };
        let name = expert_hook(layer, e);
        if !wants(&name) {
            continue;
        }
        let count = |ids: &[i32], tok: usize| {
            ids[tok * k..(tok + 1) * k]
                .iter()
                .filter(|&&x| x == e as i32)
                .count()
        };
        let from_part = part
            .experts
            .iter()
            .find(|(pe, _)| *pe == e)
            .map(|(_, v)| engine.download(v))
            .transpose()?;
        let from_known = known(&name);
        let mut values: Vec<f32> = Vec::new();
        let mut width: Option<usize> = None;
        let (mut next_part, mut next_known) = (0usize, 0usize);
        for tok in 0..t {
            let n = count(new_ids, tok);
            let (src, next) = if recomputed.contains(&tok) {
                // The known output's rows of this token (its base routing) are replaced.
                next_known += count(base_ids, tok);
                (from_part.as_ref(), &mut next_part)
            } else {
                (from_known, &mut next_known)
            };
            if n == 0 {
                continue;
            }
            let Some(src) = src else {
                return Ok(None);
            };
            let (sn, sw) = src.dims2(&name)?;
            if *next + n > sn || width.is_some_and(|w| w != sw) {
                return Ok(None);
            }
            width = Some(sw);
            values.extend_from_slice(&src.as_f32(&name)?[*next * sw..(*next + n) * sw]);
            *next += n;
        }
        let used = |t: Option<&HostTensor>, n: usize| {
            t.map_or(0, |t| t.shape.first().copied().unwrap_or(0)) == n
        };
        if !used(from_part.as_ref(), next_part) || !used(from_known, next_known) {
            return Ok(None);
        }
        let Some(width) = width else {
            continue;
        };
        let n = values.len() / width.max(1);
        out.push((name, HostTensor::f32(vec![n, width], values)?));
    }
    Ok(Some(out))
}

/// For the driver's tests: every row whose selection differs is a near tie, with no
/// alternatives.
#[cfg(test)]
pub(super) struct DifferingRows;

#[cfg(test)]
impl crate::trace::NearTies for DifferingRows {
    fn near_ties(
        &self,
        _: &str,
        _: crate::trace::Mode,
        _: &HostTensor,
        _: usize,
    ) -> Vec<crate::trace::Swap> {
        Vec::new()
    }

    fn near_tie_rows(
        &self,
        _: &str,
        _: crate::trace::Mode,
        reference: &HostTensor,
        candidate: &HostTensor,
    ) -> Vec<usize> {
        rows_differing(reference, candidate).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::driver::pair::{run_pair_with, Ahead, Candidate, Modes, ReferenceWork, RunInputs};
    use crate::driver::{NoProgress, Plan};
    use crate::engine::cpu::CpuEngine;
    use crate::explain::fault::{Fault, FaultEngine, FaultKind};
    use crate::gguf::Model;
    use crate::model::steps::layer_steps;
    use crate::model::testutil::tiny_hparams;
    use crate::model::{Arch, Weights};
    use crate::trace::{Mode, Pair, PairSink};

    /// A tensor as its shape and the bits of its values.
    type Bits = (Vec<usize>, Vec<u32>);

    fn bits(t: &HostTensor) -> Bits {
        let v = match &t.data {
            HostData::F32(x) => x.iter().map(|v| v.to_bits()).collect(),
            HostData::I32(x) => x.iter().map(|&v| v as u32).collect(),
        };
        (t.shape.clone(), v)
    }

    /// Everything a pass hands a sink, in order, values as bits.
    #[derive(Debug, PartialEq)]
    enum Event {
        Pair(String, Mode, Bits, Bits, Option<String>),
        Missing(String, Mode, String),
        ReplayInputs(Vec<String>, Vec<Bits>),
        ReferenceOnly(String, Mode, Bits),
        Followed(String, Mode, Vec<usize>),
        Plain(String, Bits, Bits),
    }

    /// Wants every hook (optional ones too), takes every row whose selection differs as a near
    /// tie (so that the chained side follows the candidate) and logs everything.
    #[derive(Default)]
    struct Log(Vec<Event>);

    impl PairSink for Log {
        fn wants(&self, _: &str) -> bool {
            true
        }
        fn record(&mut self, p: Pair<'_>) -> anyhow::Result<()> {
            let e = Event::Pair(
                p.name.to_string(),
                p.mode,
                bits(&p.reference),
                bits(&p.candidate),
                p.note,
            );
            self.0.push(e);
            Ok(())
        }
        fn missing(&mut self, name: &str, mode: Mode, why: &str) {
            self.0
                .push(Event::Missing(name.to_string(), mode, why.to_string()));
        }
        fn wants_replay_inputs(&self) -> bool {
            true
        }
        fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
            let e = Event::ReplayInputs(step.outputs.clone(), inputs.iter().map(bits).collect());
            self.0.push(e);
        }
        fn reference_only(&mut self, name: &str, mode: Mode, _: &[String], r: &HostTensor) {
            self.0
                .push(Event::ReferenceOnly(name.to_string(), mode, bits(r)));
        }
        fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
            self.0
                .push(Event::Followed(selection.to_string(), mode, rows.to_vec()));
        }
        fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
            self.0.push(Event::Plain(
                name.to_string(),
                bits(reference),
                bits(candidate),
            ));
        }
    }

    /// Both modes of a pass of `reference` against `cand` on `tokens`: what the sink got and
    /// what the reference computed.
    fn pass<R: Engine + Sync, C: Engine>(
        reference: &R,
        cand: &C,
        w: &Weights<'_>,
        tokens: &[u32],
        only_changed: bool,
        ahead: Ahead,
    ) -> (Vec<Event>, ReferenceWork, usize)
    where
        R::Tensor: Send,
    {
        let plan = Plan::full(w).unwrap();
        let mut log = Log::default();
        let inputs = RunInputs {
            weights: w,
            tokens,
            plan: &plan,
            start: &[],
            ties: &DifferingRows,
        };
        let s = run_pair_with(
            reference,
            Candidate::Engine(cand),
            inputs,
            Modes::BOTH,
            &mut log,
            &NoProgress,
            only_changed,
            ahead,
        )
        .unwrap();
        (log.0, s.reference_work, s.candidate_ahead_steps)
    }

    fn fixture(rel: &str) -> Model {
        Model::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
    }

    /// The candidate's chain run ahead of the pass to each MoE layer's routing (all of it, and
    /// as far as the reference's steps leave it time): every event of the pass is bit for bit
    /// the same, and so is what the reference computed, with a candidate whose selections
    /// differ (its chained routing is what the pass follows).
    #[test]
    fn the_candidates_chain_run_ahead_gives_the_same_pass() {
        for file in [
            "fixtures/models/glm5-tiny/glm5-tiny-f32.gguf",
            "fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "fixtures/models/dsv3-tiny/dsv3-tiny-f32.gguf",
        ] {
            let model = fixture(file);
            let w = Weights::new(&model).unwrap();
            let cpu = CpuEngine::new(&w);
            let cand = FaultEngine::new(&cpu, &w, vec![Fault::new(FaultKind::BiasUnused, None)]);
            let tokens: Vec<u32> = (0..21u32)
                .map(|i| (i * 7 + 3) % w.n_vocab() as u32)
                .collect();
            let (rows, work, none) = pass(&cpu, &cand, &w, &tokens, true, Ahead::Off);
            assert_eq!(none, 0);
            assert!(
                rows.iter().any(|e| matches!(e, Event::Followed(..))),
                "{file}"
            );
            let (ahead, ahead_work, ran) =
                pass(&cpu, &cand, &w, &tokens, true, Ahead::ToTheRouting);
            assert!(ran > 0, "{file}");
            assert_eq!(rows, ahead, "{file}");
            let counts = |w: &ReferenceWork| {
                [
                    w.plain,
                    w.replay_whole,
                    w.replay_rows,
                    w.followed_whole,
                    w.followed_rows,
                    w.followed_reused,
                    w.joint,
                ]
                .map(|x| (x.steps, x.rows))
            };
            assert_eq!(counts(&work), counts(&ahead_work), "{file}");
            let (while_ref, _, _) = pass(&cpu, &cand, &w, &tokens, true, Ahead::WhileReferenceRuns);
            assert_eq!(rows, while_ref, "{file}");
        }
    }

    /// A candidate that selects other DSA keys (layer 0) or other experts in some rows: the
    /// reference recomputes its replayed attention and expert steps only in the rows the
    /// candidate's selection changes, and the followed chain only where it differs from the
    /// reference's own, and every pair, note, missing hook, replay input, followed row and
    /// plain-chain value is bit for bit what recomputing whole steps gives: with the rows of the
    /// CPU engine, and with an engine that computes only whole steps (the trait's default).
    #[test]
    fn recomputing_the_changed_rows_gives_the_whole_steps_bit_for_bit() {
        let cases: [(&str, Vec<Fault>); 3] = [
            (
                "fixtures/models/glm5-tiny/glm5-tiny-f32.gguf",
                vec![
                    Fault::new(FaultKind::IndexerRopeNeox, Some(vec![0])),
                    Fault::new(FaultKind::BiasUnused, None),
                ],
            ),
            (
                "fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
                vec![
                    Fault::new(FaultKind::BiasUnused, None),
                    Fault::new(FaultKind::IndexerRopeNeox, Some(vec![1])),
                ],
            ),
            (
                "fixtures/models/dsv3-tiny/dsv3-tiny-f32.gguf",
                vec![Fault::new(FaultKind::BiasUnused, None)],
            ),
        ];
        for (file, faults) in cases {
            let model = fixture(file);
            let w = Weights::new(&model).unwrap();
            let cpu = CpuEngine::new(&w);
            let cand = FaultEngine::new(&cpu, &w, faults);
            let whole_steps = FaultEngine::new(&cpu, &w, Vec::new());
            let tokens: Vec<u32> = (0..21u32)
                .map(|i| (i * 7 + 3) % w.n_vocab() as u32)
                .collect();
            let t = tokens.len();
            let (whole, whole_work, _) = pass(&cpu, &cand, &w, &tokens, false, Ahead::Off);
            let (rows, work, _) = pass(&cpu, &cand, &w, &tokens, true, Ahead::Off);
            let (default, default_work, _) =
                pass(&whole_steps, &cand, &w, &tokens, true, Ahead::Off);
            assert!(
                whole.iter().any(|e| matches!(e, Event::Followed(..))),
                "{file}"
            );
            assert_eq!(whole.len(), rows.len(), "{file}");
            for (a, b) in whole.iter().zip(&rows) {
                assert_eq!(a, b, "{file}");
            }
            assert_eq!(whole, default, "{file}");
            // The rows were restricted: fewer than whole steps, and every recomputed step of the
            // whole run is one of the restricted run.
            assert!(work.replay_rows.steps > 0, "{file}: {work:?}");
            assert!(work.replay_rows.rows < work.replay_rows.steps * t, "{file}");
            assert_eq!(
                work.replay_rows.steps + work.replay_whole.steps,
                whole_work.replay_whole.steps,
                "{file}"
            );
            assert_eq!(whole_work.replay_rows.steps, 0);
            assert_eq!(
                whole_work.followed_rows.steps + whole_work.followed_reused.steps,
                0
            );
            assert!(
                work.followed_rows.steps + work.followed_reused.steps > 0,
                "{file}"
            );
            assert_eq!(
                work.followed_rows.steps + work.followed_reused.steps + work.followed_whole.steps,
                whole_work.followed_whole.steps,
                "{file}"
            );
            // Row-wise steps (norms, projections, sums) follow in rows too: fewer rows computed.
            assert!(
                work.followed_rows.rows + work.followed_whole.rows < whole_work.followed_whole.rows,
                "{file}: {work:?}"
            );
            // The expert steps' recomputed rows were computed in the own chain's pass over the
            // experts (bit for bit, as the events above show); never when recomputing whole.
            assert!(
                work.joint.steps > 0 && work.joint.rows > 0,
                "{file}: {work:?}"
            );
            assert_eq!(whole_work.joint.steps, 0, "{file}");
            assert_eq!(default_work.joint.steps, 0, "{file}");
            // At 21 tokens the projections', the router's and the shared MLP's followed rows are
            // computed beside the own chain's too: more joint steps than expert steps.
            let expert_steps = Plan::full(&w)
                .unwrap()
                .steps
                .iter()
                .filter(|s| matches!(s.op, Op::MoeExperts { .. }))
                .count();
            assert!(
                t <= JOINT_ROWS_MAX_TOKENS && work.joint.steps > expert_steps,
                "{file}: {work:?}, {expert_steps} expert steps"
            );
            // The engine without rows recomputes whole replayed steps.
            assert_eq!(default_work.replay_rows.steps, 0, "{file}");
            assert_eq!(
                default_work.replay_whole.steps,
                whole_work.replay_whole.steps
            );
        }
    }

    fn f(shape: Vec<usize>, v: Vec<f32>) -> HostTensor {
        HostTensor::f32(shape, v).unwrap()
    }

    /// Rows differ bit for bit: a zero of the other sign differs, the same NaN does not; other
    /// shapes or kinds of values are no row-wise difference at all.
    #[test]
    fn rows_differ_bit_for_bit() {
        let a = f(vec![3, 2], vec![0.0, 1.0, f32::NAN, 2.0, 3.0, 4.0]);
        let b = f(vec![3, 2], vec![-0.0, 1.0, f32::NAN, 2.0, 3.0, 4.5]);
        assert_eq!(rows_differing(&a, &b), Some(vec![0, 2]));
        assert_eq!(rows_differing(&a, &a), Some(vec![]));
        assert_eq!(rows_differing(&a, &f(vec![2, 3], vec![0.0; 6])), None);
        let i = HostTensor::i32(vec![3, 2], vec![0; 6]).unwrap();
        assert_eq!(rows_differing(&a, &i), None);
    }

    /// A changed key reaches every later query; a changed query or selection row only itself;
    /// the experts' and the row-wise steps' rows are the union of their inputs' changed rows;
    /// other steps are not restricted.
    #[test]
    fn the_rows_a_change_reaches() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let steps = layer_steps(&hp, 1);
        let of = |op: fn(&Op) -> bool| steps.iter().find(|s| op(&s.op)).unwrap().clone();
        let attn = of(|o| matches!(o, Op::Attention { .. }));
        let experts = of(|o| matches!(o, Op::MoeExperts { .. }));
        let zero = f(vec![5, 1], vec![0.0; 5]);
        let row = |r: usize| {
            let mut v = vec![0.0; 5];
            v[r] = 1.0;
            f(vec![5, 1], v)
        };
        let (r1, r2, r3) = (row(1), row(2), row(3));
        let base = [&zero; 5];
        let reached = |inputs: [&HostTensor; 5]| rows_reached(&attn, &inputs, &base);
        assert_eq!(
            reached([&zero, &zero, &r2, &zero, &zero]),
            Some(vec![2, 3, 4])
        );
        assert_eq!(reached([&zero, &zero, &zero, &r3, &zero]), Some(vec![3, 4]));
        assert_eq!(reached([&r1, &zero, &zero, &zero, &r3]), Some(vec![1, 3]));
        let base = [&zero; 3];
        assert_eq!(
            rows_reached(&experts, &[&r1, &zero, &r3], &base),
            Some(vec![1, 3])
        );
        let other = f(vec![4, 1], vec![0.0; 4]);
        assert_eq!(rows_reached(&experts, &[&r1, &other, &r3], &base), None);
        // A row-wise step: the rows its inputs changed; one that reads positions or mixes rows
        // is not restricted.
        let norm = of(|o| matches!(o, Op::RmsNorm { .. }));
        assert_eq!(rows_reached(&norm, &[&r1], &[&zero]), Some(vec![1]));
        let add = of(|o| matches!(o, Op::Add));
        assert_eq!(
            rows_reached(&add, &[&r1, &r3], &[&zero, &zero]),
            Some(vec![1, 3])
        );
        assert_eq!(rows_reached(&add, &[&r1, &other], &[&zero, &zero]), None);
        let rope = of(|o| matches!(o, Op::Rope(_)));
        assert_eq!(rows_reached(&rope, &[&r1], &[&zero]), None);
        let top_k = of(|o| matches!(o, Op::TopK { .. }));
        assert_eq!(rows_reached(&top_k, &[&r1], &[&zero]), None);
    }
}
