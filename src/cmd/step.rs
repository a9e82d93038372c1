//! `glmdiff step DIR`: re-runs the step of a case written by `run --repro`, from its stored
//! inputs, and judges a candidate (the stored output, a second CPU reference, or the CUDA
//! engine) against the reference by the floors of `run`.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};

use super::{print_report, to_stdout, write_json, Outcome};
use crate::cli::StepArgs;
use crate::compare::floors::hook_infos;
use crate::compare::{Comparison, Judge, Precision};
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::explain::case::{output_on, Case};
use crate::explain::{explain, residual, CapturedStep};
use crate::model::Weights;
use crate::report::run::EngineDesc;
use crate::report::step::{render, to_json, StepReport};
use crate::trace::{Mode, Pair, PairSink};
use crate::util::guard::Guard;

/// Runs `glmdiff step`.
pub fn run(args: &StepArgs) -> Result<Outcome> {
    let mut g = Guard::new();
    if let Ok(rd) = std::fs::read_dir(&args.dir) {
        for p in rd.filter_map(|e| e.ok().map(|e| e.path())) {
            g.input("the case file", &p);
        }
    }
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
    let case = Case::read(&args.dir)?;
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

    // The candidate.
    let (desc, candidate) = match args.against.as_deref() {
        None => (
            EngineDesc {
                spec: format!("stored ({})", case.header.candidate),
                describe: case.header.candidate_describe.clone(),
                dtype: case.header.candidate_dtype.clone(),
            },
            stored.candidate.clone(),
        ),
        Some("cpu") => {
            let second = CpuEngine::new(&weights);
            (
                EngineDesc {
                    spec: "cpu".into(),
                    describe: second.describe(),
                    dtype: second.dtype(),
                },
                output_on(&second, &weights, &stored, &tokens)?,
            )
        }
        Some(c) if c == "cuda" || c.starts_with("cuda:") => {
            cuda_candidate(c, &weights, &stored, &tokens)?
        }
        Some(other) => bail!("step: --against {other:?}: expected cpu, cuda or cuda:N"),
    };

    // The verdict, by run's judge.
    let ref_prec = Precision::parse(&cpu.dtype()).context("step: reference precision")?;
    let cand_prec = match Precision::parse(&desc.dtype) {
        Some(p) => p,
        None => {
            notes.push(format!(
                "the candidate's dtype {:?} is not a known precision; the floor assumes bf16",
                desc.dtype
            ));
            Precision::parse("bf16").context("bf16")?
        }
    };
    let judge = Judge {
        reference: ref_prec,
        candidate: cand_prec,
        infos: hook_infos(std::slice::from_ref(&stored.step), &weights),
        tol: args.tol.map(|v| ("*".to_string(), v)).into_iter().collect(),
        precision: Vec::new(),
        selection_bias: HashMap::new(),
        groups: weights.hparams().groups,
    };
    let hook = stored.hook.clone();
    let mut cmp = Comparison::new(judge, Box::new(|_| true), &tokens);
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

    let explanation = if args.explain {
        let allowed = record.replay.as_ref().map_or(stored.allowed, |r| r.allowed);
        let here = CapturedStep {
            reference,
            candidate,
            error: record.replay.as_ref().map_or(f64::NAN, |r| r.error),
            allowed,
            ..stored
        };
        Some(if differs {
            explain(
                &here,
                &weights,
                &tokens,
                &crate::report::progress::Bar::with_unit("hypotheses"),
            )?
        } else {
            crate::explain::Explanation::NothingWrong
        })
    } else {
        None
    };
    let report = StepReport {
        dir: case.dir.display().to_string(),
        header: case.header.clone(),
        candidate: desc,
        reference_dtype: cpu.dtype(),
        record,
        differs,
        notes,
        explanation,
    };
    print_report(&render(&report), to_stdout(args.json.as_deref()));
    if let Some(j) = &args.json {
        write_json("--json", j, &to_json(&report))?;
    }
    Ok(if differs {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

/// The CUDA engine's output of the case's step.
#[cfg(feature = "cuda")]
fn cuda_candidate(
    spec: &str,
    weights: &Weights<'_>,
    c: &CapturedStep,
    tokens: &[u32],
) -> Result<(EngineDesc, crate::engine::HostTensor)> {
    let n: usize = match spec.strip_prefix("cuda:") {
        None => 0,
        Some(n) => n.parse().with_context(|| {
            format!("step: --against {spec}: expected cuda or cuda:N with N a device index")
        })?,
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
            dtype: e.dtype(),
        },
        out,
    ))
}

/// Without the `cuda` feature there is no CUDA engine.
#[cfg(not(feature = "cuda"))]
fn cuda_candidate(
    spec: &str,
    _weights: &Weights<'_>,
    _c: &CapturedStep,
    _tokens: &[u32],
) -> Result<(EngineDesc, crate::engine::HostTensor)> {
    bail!("step: --against {spec}: this glmdiff was built without the `cuda` feature")
}
