//! The one candidate of a run, built from the checked choice: a second CPU reference, the CUDA
//! engine over one or several devices, or a trace. An engine is wrapped in a `FaultEngine` only
//! when `--inject` gave faults. Whichever it is, it goes through the one pass of
//! [`Pass::compare`](super::pass::Pass::compare).

use std::path::Path;

use anyhow::Result;

use super::config::Chosen;
use super::judge::trace_side_precision;
use super::pass::{Pass, Passed};
use crate::compare::Precision;
use crate::driver::pair::Candidate;
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::explain::fault::FaultEngine;
use crate::report::run::EngineDesc;
use crate::trace::TraceFile;

/// Builds the run's candidate and compares it with the reference in the pass `p`.
pub(super) fn compare_candidate(p: &Pass<'_, '_>) -> Result<Passed> {
    match &p.cfg.candidate {
        // A second reference: judged by the reference's precision.
        Chosen::Cpu => {
            let cpu = CpuEngine::new(p.weights);
            engine(p, &cpu, "cpu".to_string(), p.ref_precision)
        }
        Chosen::Cuda { device, devices } => cuda(p, *device, devices),
        Chosen::Trace { path, file } => trace(p, path, file),
    }
}

/// The description of a trace side: `spec` as asked, its metadata `engine` and `dtype`.
pub(super) fn trace_desc(spec: String, t: &TraceFile) -> EngineDesc {
    EngineDesc {
        spec,
        describe: t
            .metadata()
            .get("engine")
            .cloned()
            .unwrap_or_else(|| "?".into()),
        dtype: t.metadata().get("dtype").cloned().unwrap_or_default(),
    }
}

/// A trace candidate, judged by the precision its metadata declares (inferred from its values
/// when it declares none known, or set by `--precision '*=DTYPE'`).
fn trace(p: &Pass<'_, '_>, path: &Path, file: &TraceFile) -> Result<Passed> {
    let desc = trace_desc(format!("trace:{}", path.display()), file);
    let mut notes = Vec::new();
    let precision = trace_side_precision(file, "trace", &p.cfg.precision, &mut notes)?;
    p.compare(
        Candidate::<CpuEngine<'_>>::Trace(file),
        desc,
        precision,
        notes,
    )
}

/// An engine candidate `e` asked as `spec`, judged by `precision`: with `--inject`, wrapped in a
/// `FaultEngine` that computes the faults' steps the faulty way.
fn engine<E: Engine>(
    p: &Pass<'_, '_>,
    e: &E,
    spec: String,
    precision: Precision,
) -> Result<Passed> {
    if p.cfg.faults.is_empty() {
        return engine_as_is(p, e, spec, precision);
    }
    let faulty = FaultEngine::new(e, p.weights, p.cfg.faults.clone());
    engine_as_is(p, &faulty, spec, precision)
}

/// `e` as the candidate, described by itself.
fn engine_as_is<E: Engine>(
    p: &Pass<'_, '_>,
    e: &E,
    spec: String,
    precision: Precision,
) -> Result<Passed> {
    let desc = EngineDesc {
        spec,
        describe: e.describe(),
        dtype: e.precision().to_string(),
    };
    p.compare(Candidate::Engine(e), desc, precision, Vec::new())
}

/// The CUDA engine over `devices` (asked as `cuda:device`), and how much it handed from GPU to
/// GPU when there are several.
#[cfg(feature = "cuda")]
fn cuda(p: &Pass<'_, '_>, device: usize, devices: &[usize]) -> Result<Passed> {
    use anyhow::Context;

    use super::config::CudaDtype;
    use crate::engine::cuda::multi::MultiCudaEngine;
    use crate::engine::cuda::GpuDtype;

    let gpus: Vec<crate::gpu::Gpu> = devices
        .iter()
        .map(|&d| crate::gpu::Gpu::open(d))
        .collect::<Result<_>>()
        .context("run: --against cuda")?;
    let dtype = match p.cfg.dtype {
        CudaDtype::F32 => GpuDtype::F32,
        CudaDtype::Bf16 => GpuDtype::Bf16,
    };
    let multi = MultiCudaEngine::new(&gpus, p.weights, dtype)?;
    let precision = multi.precision();
    let mut passed = engine(p, &multi, format!("cuda:{device}"), precision)?;
    let pf = multi.prefetch_summary();
    if !pf.on {
        passed.notes.push(
            "each layer's weights uploaded as its steps read them: prefetch off (GLMDIFF_NO_PREFETCH)"
                .to_string(),
        );
    } else if pf.fallbacks > 0 {
        passed.notes.push(format!(
            "prefetch: {} weight tensors uploaded on demand instead: {}",
            pf.fallbacks,
            pf.notes.join("; ")
        ));
    }
    if devices.len() > 1 {
        let (n, bytes) = multi.handoffs();
        passed.notes.push(format!(
            "{} devices, layers {:?}; {n} tensors ({:.1} MB) handed from GPU to GPU through the host",
            devices.len(),
            multi.plan().ranges,
            bytes as f64 / 1e6
        ));
    }
    Ok(passed)
}

/// Without the `cuda` feature there is no CUDA engine (a run asking for it is refused when it
/// is checked).
#[cfg(not(feature = "cuda"))]
fn cuda(_: &Pass<'_, '_>, device: usize, _: &[usize]) -> Result<Passed> {
    anyhow::bail!("run: --against cuda:{device}: this glmdiff was built without the `cuda` feature")
}
