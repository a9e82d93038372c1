//! `glmdiff dequant-check`: GPU dequantization against the CPU's, tensor by tensor.

use anyhow::{bail, Result};

use super::Outcome;
use crate::cli::DequantCheckArgs;
use crate::gguf::Model;

/// Runs `glmdiff dequant-check`.
pub fn run(args: &DequantCheckArgs) -> Result<Outcome> {
    if let Some(j) = &args.json {
        crate::util::atomic::check_output_dir(j)?;
    }
    let model = Model::open(&args.model)?;
    let mut names: Vec<String> = Vec::new();
    for n in &args.tensor {
        if model.find(n).is_none() {
            bail!(
                "dequant-check: {} has no tensor {n} ({} tensors; `glmdiff inspect` lists them)",
                model.file_name(),
                model.n_tensors()
            );
        }
        names.push(n.clone());
    }
    if args.all || args.tensors.is_some() {
        for t in model.tensors() {
            let keep = args.all
                || args
                    .tensors
                    .as_deref()
                    .is_some_and(|g| crate::util::glob::matches(g, &t.info.name));
            if keep && !names.contains(&t.info.name) {
                names.push(t.info.name.clone());
            }
        }
    }
    if names.is_empty() {
        bail!("dequant-check: give tensor names, --tensors GLOB or --all");
    }
    run_checks(args, &model, &names)
}

#[cfg(feature = "cuda")]
fn run_checks(args: &DequantCheckArgs, model: &Model, names: &[String]) -> Result<Outcome> {
    use crate::cuda::check::check_tensor;
    use crate::cuda::dequant::kernel_stem;
    use crate::cuda::Gpu;
    use crate::report::dequant_check::{render, to_json, Skipped};
    use crate::report::progress::Bar;

    let gpu = Gpu::open(args.device)?;
    let bar = Bar::new();
    let mut checks = Vec::new();
    let mut skipped = Vec::new();
    for n in names {
        let t = model.tensor(n)?;
        if kernel_stem(t.info.ty).is_none() {
            skipped.push(Skipped {
                name: n.clone(),
                ty: t.info.ty.name().to_string(),
                why: "no dequantizer for this type (CPU or GPU)".into(),
            });
            continue;
        }
        checks.push(check_tensor(&gpu, model, t, &bar)?);
    }
    print!("{}", render(&gpu.describe(), &checks, &skipped));
    if let Some(j) = &args.json {
        let doc = to_json(&gpu.describe(), &checks, &skipped);
        crate::util::atomic::write_atomic(j, |w| {
            serde_json::to_writer_pretty(&mut *w, &doc)?;
            Ok(w.write_all(b"\n")?)
        })?;
    }
    Ok(if checks.iter().any(|c| c.mismatches > 0) {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

#[cfg(not(feature = "cuda"))]
fn run_checks(_: &DequantCheckArgs, _: &Model, _: &[String]) -> Result<Outcome> {
    bail!("dequant-check: this glmdiff was built without the `cuda` feature")
}
