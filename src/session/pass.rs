//! One pass of a run: the reference and the one candidate over the plan into a comparison,
//! judged by the run's judge.

use std::time::Instant;

use anyhow::Result;

use super::config::RunConfig;
use super::judge::{model_facts, overrides_with_trace, wants_with_scores};
use crate::compare::{Comparison, Judge, JudgeSpec, Precision};
use crate::driver::pair::{run_pair, Candidate, LayerTime, ReferenceWork, RunInputs};
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::explain::fault::Fault;
use crate::explain::{Capture, CapturedStep};
use crate::model::Weights;
use crate::report::run::EngineDesc;
use crate::tensor::HostTensor;
use crate::trace::TraceFile;
use crate::util::progress::Progress;

/// Everything a pass needs but the candidate.
pub(super) struct Pass<'a, 'w> {
    /// The run.
    pub cfg: &'a RunConfig,
    /// The model's weights.
    pub weights: &'a Weights<'w>,
    /// The reference engine.
    pub reference: &'a CpuEngine<'w>,
    /// The reference's precision.
    pub ref_precision: Precision,
    /// The plan's free inputs (the reference's, given to both sides).
    pub start: &'a [(String, HostTensor)],
    /// Progress of the layers.
    pub progress: &'a dyn Progress,
}

/// What a pass computed.
pub(super) struct Passed {
    /// Every hook's metrics and verdicts.
    pub comparison: Comparison,
    /// The first step that failed in replay, with its inputs (with `--explain`/`--repro`).
    pub captured: Option<CapturedStep>,
    /// Each side's time per layer.
    pub layer_times: Vec<LayerTime>,
    /// The comparison's seconds by what it was handed, the largest first.
    pub compare_times: Vec<(String, f64)>,
    /// The driver's waits for the comparison, by cause.
    pub compare_waits: Vec<(String, f64)>,
    /// The reference's seconds by step and cause, the largest first.
    pub reference_times: Vec<(String, f64)>,
    /// The candidate engine's seconds by step and mode, the largest first.
    pub candidate_times: Vec<(String, f64)>,
    /// The wall by which the candidate engine's side of a step ended after the reference's, by
    /// step, the largest first.
    pub candidate_beyond_times: Vec<(String, f64)>,
    /// What the reference computed, by cause.
    pub reference_work: ReferenceWork,
    /// The candidate.
    pub candidate: EngineDesc,
    /// Notes about the candidate and how it is judged, in order.
    pub notes: Vec<String>,
    /// Seconds the comparison took.
    pub seconds: f64,
}

impl Pass<'_, '_> {
    /// The run's one pass: the reference and `candidate` (described by `desc`, judged by
    /// `precision`; `notes` so far about it) over the plan into a comparison, capturing the
    /// first step that fails in replay when `--explain` or `--repro` asks.
    pub(super) fn compare<C: Engine>(
        &self,
        candidate: Candidate<'_, C>,
        desc: EngineDesc,
        precision: Precision,
        mut notes: Vec<String>,
    ) -> Result<Passed> {
        let cfg = self.cfg;
        let trace = match &candidate {
            Candidate::Trace(t) => Some(*t),
            Candidate::Engine(_) => None,
        };
        let judge = run_judge(
            cfg,
            self.weights,
            self.ref_precision,
            precision,
            trace,
            &mut notes,
        )?;
        if !cfg.faults.is_empty() {
            let f: Vec<String> = cfg.faults.iter().map(Fault::to_string).collect();
            notes.push(format!(
                "--inject {}: the candidate computes the steps these faults concern the faulty way (on the host, from its own inputs); every other step is the {} engine's",
                f.join(" "),
                desc.spec
            ));
        }
        let mut cmp = Comparison::new(judge, wants_with_scores(&cfg.hook), &cfg.tokens);
        let ties = cmp.ties();
        let t0 = Instant::now();
        // Without --explain/--repro the capture copies nothing and only passes pairs on.
        let mut sink = Capture::new(&mut cmp, cfg.explain || cfg.repro.is_some()).with_directions(
            self.weights,
            trace.is_none(),
            cfg.mode,
            self.reference.shared_device(),
        );
        let inputs = RunInputs {
            weights: self.weights,
            tokens: &cfg.tokens,
            plan: &cfg.plan,
            start: self.start,
            ties: &ties,
        };
        let summary = run_pair(
            self.reference,
            candidate,
            inputs,
            cfg.mode,
            &mut sink,
            self.progress,
        )?;
        let captured = sink.captured();
        Ok(Passed {
            comparison: cmp,
            captured,
            layer_times: summary.layer_times,
            compare_times: summary.compare_times,
            compare_waits: summary.compare_waits,
            reference_times: summary.reference_times,
            candidate_times: summary.candidate_times,
            candidate_beyond_times: summary.candidate_beyond_times,
            reference_work: summary.reference_work,
            candidate: desc,
            notes,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }
}

/// The judge of a run: `reference` and `candidate` precisions, the floors of the plan's steps,
/// the overrides (a trace candidate's own said in `notes`) and the selection bias.
fn run_judge(
    cfg: &RunConfig,
    weights: &Weights<'_>,
    reference: Precision,
    candidate: Precision,
    trace: Option<&TraceFile>,
    notes: &mut Vec<String>,
) -> Result<Judge> {
    Judge::new(JudgeSpec {
        reference,
        candidate,
        tol: cfg.tol.clone(),
        precision: overrides_with_trace(&cfg.precision, trace, notes)?,
        model: Some(model_facts(weights, &cfg.plan.steps, Some(&cfg.plan))?),
        engine_candidate: trace.is_none(),
        positions: cfg.tokens.len(),
    })
}
