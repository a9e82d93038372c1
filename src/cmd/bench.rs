//! `glmdiff bench dequant`, `glmdiff bench layer` and `glmdiff bench run`.

use anyhow::{bail, Context, Result};

use super::Outcome;
use crate::bench::dequant::{self, BenchDequantOptions};
use crate::bench::layer::{self, BenchLayerOptions};
use crate::bench::run::{BenchRunOptions, Depth};
use crate::cli::{BenchDequantArgs, BenchLayerArgs, BenchRunArgs};
use crate::quant::GgmlType;

/// Runs `glmdiff bench dequant`.
pub fn run_dequant(args: &BenchDequantArgs) -> Result<Outcome> {
    let types = args
        .types
        .iter()
        .map(|n| {
            GgmlType::from_name(n).with_context(|| format!("bench: --types: unknown type {n:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(d) = args.device {
        return run_dequant_gpu(d, &types, args.json);
    }
    let opts = BenchDequantOptions {
        types,
        libggml: args.libggml.clone(),
        elements: args.elements.unwrap_or(dequant::DEFAULT_ELEMENTS),
        ..BenchDequantOptions::default()
    };
    let report =
        dequant::run_with_progress(&opts, &crate::report::progress::Bar::with_unit("types"))?;
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::emit(&crate::report::bench::render_dequant(&report));
    }
    Ok(if report.libggml_differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

#[cfg(feature = "cuda")]
fn run_dequant_gpu(device: usize, types: &[GgmlType], json: bool) -> Result<Outcome> {
    let gpu = crate::gpu::Gpu::open(device)?;
    let report = crate::bench::gpu_dequant::run(&gpu, types)?;
    if json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::emit(&crate::report::bench::render_gpu_dequant(&report));
    }
    Ok(Outcome::Ok)
}

#[cfg(not(feature = "cuda"))]
fn run_dequant_gpu(_: usize, _: &[GgmlType], _: bool) -> Result<Outcome> {
    bail!("bench: --device: this glmdiff was built without the `cuda` feature")
}

/// Runs `glmdiff bench layer`: progress on stderr (when it is a terminal), the table (or JSON) on stdout.
pub fn run_layer(args: &BenchLayerArgs) -> Result<Outcome> {
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!(
            "bench: --tokens {:?}: give one or more token counts, each at least 1",
            args.tokens
        );
    }
    let opts = BenchLayerOptions::new(args.model.clone(), args.tokens.clone())?;
    let report = layer::run_with_progress(
        &opts,
        &mut |msg| crate::report::progress::line(msg),
        &crate::report::progress::Bar::bytes(),
    )?;
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::emit(&crate::report::bench::render_layer(&report));
    }
    Ok(Outcome::Ok)
}

/// Runs `glmdiff bench run`: the candidate, the depth and the flags checked before any work,
/// progress on stderr (when it is a terminal), the table (or JSON) on stdout.
pub fn run_run(args: &BenchRunArgs) -> Result<Outcome> {
    super::set_prefetch(&args.prefetch);
    if args.tokens.is_empty() || args.tokens.contains(&0) {
        bail!(
            "bench: --tokens {:?}: give one or more token counts, each at least 1",
            args.tokens
        );
    }
    let mut pipeline =
        crate::session::bench::RunPipeline::new(&args.against, args.mode, args.dtype)?;
    let mut opts = BenchRunOptions::new(args.model.clone(), args.tokens.clone())?;
    opts.layers = args
        .layers
        .as_ref()
        .map(|r| r.start as usize..r.end as usize);
    opts.project = args.project.as_deref().map(Depth::named).transpose()?;
    opts.reps = args.reps;
    let report = crate::bench::run::run(
        &opts,
        &mut pipeline,
        &mut |msg| crate::report::progress::line(msg),
        &crate::report::progress::Bar::new(),
        &crate::report::progress::Bar::bytes(),
    )?;
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::emit(&crate::report::bench::render_run(&report));
    }
    Ok(Outcome::Ok)
}
