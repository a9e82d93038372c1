//! `glmdiff step DIR`: the step of a case written by `run --repro`, re-run from its stored
//! inputs, and a candidate (the stored output, a second CPU reference, or the CUDA engine)
//! judged against the reference by the floors of `run`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::judge::{case_precision, model_facts};
use crate::compare::{Comparison, Judge, JudgeSpec, Precision};
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, HostTensor};
use crate::explain::case::{output_on, Case};
use crate::explain::{explain, noise, residual, CapturedStep, Explanation};
use crate::model::Weights;
use crate::report::run::EngineDesc;
use crate::report::step::StepReport;
use crate::trace::{Mode, Pair, PairSink};
use crate::util::progress::Progress;
use crate::words::Against;

/// What `step` is asked, as plain values.
#[derive(Clone, Debug)]
pub struct StepRequest {
    /// The case directory.
    pub dir: PathBuf,
    /// The candidate: `None` for the stored output, `cpu`, `cuda` or `cuda:N`.
    pub against: Option<Against>,
    /// A floor (relative L2) replacing the one the candidate is judged by.
    pub tol: Option<f64>,
    /// Test which known bug reproduces the candidate's output.
    pub explain: bool,
}

/// Re-runs the case's step: the reference recomputed from the stored inputs, the candidate
/// judged against it, and (`explain`) the known bugs tested; `hypotheses` shows their progress.
pub fn step(req: &StepRequest, hypotheses: &dyn Progress) -> Result<StepReport> {
    let case = Case::read(&req.dir)?;
    let weights = Weights::partial(&case.model)?;
    let stored = case.captured(&weights)?;
    let tokens = case.header.tokens.clone();

    // The reference, recomputed here from the stored inputs.
    let cpu = CpuEngine::new(&weights);
    let reference = output_on(&cpu, &weights, &stored, &tokens).context("step: the reference")?;
    let mut notes = Vec::new();
    if reference != stored.reference {
        notes.push(format!(
            "the reference recomputed here differs from the one stored in the case (relative L2 {:.3e}): the case was written by another glmdiff version or its files were changed",
            residual(&stored.reference, &reference)
        ));
    }
    // The candidate, and its precision when an engine here computes it (a stored one's is read
    // from the case).
    let (desc, candidate, engine_prec) = candidate(req, &case, &weights, &stored, &tokens)?;
    let cand_prec = match engine_prec {
        Some(p) => p,
        None => case_precision(&desc.dtype, &candidate, &mut notes)?,
    };

    // The verdict, by run's judge.
    let judge = Judge::new(JudgeSpec {
        reference: cpu.precision(),
        candidate: cand_prec,
        tol: req.tol.map(|v| ("*".to_string(), v)).into_iter().collect(),
        precision: Vec::new(),
        model: Some(model_facts(
            &weights,
            std::slice::from_ref(&stored.step),
            None,
        )?),
        engine_candidate: true,
        positions: tokens.len(),
    })?;
    let hook = stored.hook.clone();
    let mut cmp = Comparison::new(judge, Box::new(|_| true), &tokens);
    // The bug families' directions of the step, as `run` hands them over (the systematic test).
    let values: Vec<HostTensor> = stored.inputs.iter().map(|(_, t)| t.clone()).collect();
    if let Ok(parts) =
        crate::explain::directions::parts(&cpu, &stored.step, &values, &hook, Default::default())
    {
        if !parts.is_empty() {
            cmp.components(&hook, Mode::Replay, parts);
        }
    }
    cmp.record(Pair {
        name: &hook,
        mode: Mode::Replay,
        inputs: &stored.step.inputs,
        reference: reference.clone(),
        candidate: candidate.clone(),
        note: None,
    })?;
    let record = cmp
        .get(&hook)
        .cloned()
        .context("step: the comparison lost its hook")?;
    let differs = cmp.differs();
    let explanation = match (req.explain, differs) {
        (false, _) => None,
        (true, false) => Some(Explanation::NothingWrong),
        (true, true) => {
            let here = CapturedStep {
                reference,
                candidate,
                error: record.replay.as_ref().map_or(f64::NAN, |r| r.error),
                allowed: record.replay.as_ref().map_or(stored.allowed, |r| r.allowed),
                noise: record.replay.as_ref().and_then(noise),
                ..stored
            };
            Some(explain(&here, &weights, &tokens, hypotheses)?)
        }
    };
    Ok(StepReport {
        dir: case.dir.display().to_string(),
        header: case.header.clone(),
        candidate: desc,
        reference_dtype: cpu.precision().to_string(),
        record,
        differs,
        notes,
        explanation,
    })
}

/// The candidate asked and its output of the case's step.
fn candidate(
    req: &StepRequest,
    case: &Case,
    weights: &Weights<'_>,
    stored: &CapturedStep,
    tokens: &[u32],
) -> Result<(EngineDesc, HostTensor, Option<Precision>)> {
    Ok(match &req.against {
        None => (
            EngineDesc {
                spec: format!("stored ({})", case.header.candidate),
                describe: case.header.candidate_describe.clone(),
                dtype: case.header.candidate_dtype.clone(),
            },
            stored.candidate.clone(),
            None,
        ),
        Some(Against::Cpu) => {
            let second = CpuEngine::new(weights);
            (
                EngineDesc {
                    spec: "cpu".into(),
                    describe: second.describe(),
                    dtype: second.precision().to_string(),
                },
                output_on(&second, weights, stored, tokens)?,
                Some(second.precision()),
            )
        }
        Some(a @ Against::Cuda(_)) => {
            let (desc, prec, out) = cuda_candidate(a, weights, stored, tokens)?;
            (desc, out, Some(prec))
        }
        Some(other) => bail!("step: --against {other}: expected cpu, cuda or cuda:N"),
    })
}

/// The CUDA engine's output of the case's step.
#[cfg(feature = "cuda")]
fn cuda_candidate(
    against: &Against,
    weights: &Weights<'_>,
    c: &CapturedStep,
    tokens: &[u32],
) -> Result<(EngineDesc, Precision, HostTensor)> {
    let n = match against {
        Against::Cuda(n) => n.unwrap_or(0),
        _ => bail!("step: --against {against}: expected cuda or cuda:N"),
    };
    crate::gpu::probe_libraries()?;
    let gpu = crate::gpu::Gpu::open(n).context("step: --against cuda")?;
    let e =
        crate::engine::cuda::CudaEngine::new(&gpu, weights, crate::engine::cuda::GpuDtype::F32)?;
    let out = output_on(&e, weights, c, tokens)?;
    Ok((
        EngineDesc {
            spec: format!("cuda:{n}"),
            describe: e.describe(),
            dtype: e.precision().to_string(),
        },
        e.precision(),
        out,
    ))
}

/// Without the `cuda` feature there is no CUDA engine.
#[cfg(not(feature = "cuda"))]
fn cuda_candidate(
    against: &Against,
    _weights: &Weights<'_>,
    _c: &CapturedStep,
    _tokens: &[u32],
) -> Result<(EngineDesc, Precision, HostTensor)> {
    bail!("step: --against {against}: this glmdiff was built without the `cuda` feature")
}
