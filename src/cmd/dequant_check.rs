//! `glmdiff dequant-check`: GPU dequantization against the CPU's, tensor by tensor.

use anyhow::{bail, Result};

use super::{model_input, Outcome};
use crate::cli::DequantCheckArgs;
use crate::gguf::Model;

/// Runs `glmdiff dequant-check`.
pub fn run(args: &DequantCheckArgs) -> Result<Outcome> {
    let mut g = crate::util::guard::Guard::new();
    model_input(&mut g, "the input model", &args.model);
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
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
    if let Some(g) = &args.tensors {
        if !model
            .tensors()
            .any(|t| crate::util::glob::matches(g, &t.info.name))
        {
            bail!(
                "dequant-check: --tensors {g:?} matches no tensor of {} ({} tensors; `glmdiff inspect` lists them)",
                model.path().display(),
                model.n_tensors()
            );
        }
    }
    if names.is_empty() {
        bail!("dequant-check: give tensor names, --tensors GLOB or --all");
    }
    run_checks(args, &model, &names)
}

#[cfg(feature = "cuda")]
fn run_checks(args: &DequantCheckArgs, model: &Model, names: &[String]) -> Result<Outcome> {
    use crate::dcheck::check_tensor;
    use crate::gpu::dequant::kernel_stem;
    use crate::gpu::Gpu;
    use crate::report::dequant_check::{render, to_json, Skipped};
    use crate::report::progress::Bar;

    let mut skipped = Vec::new();
    let mut todo = Vec::new();
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
        todo.push(t);
    }
    let (device_line, checks) = if args.devices.len() > 1 {
        spread(model, &todo, &args.devices)?
    } else {
        let gpu = Gpu::open(args.devices.first().copied().unwrap_or(args.device))?;
        let bar = Bar::with_unit("chunks");
        let checks = todo
            .iter()
            .map(|&t| check_tensor(&gpu, model, t, &bar))
            .collect::<Result<Vec<_>>>()?;
        (gpu.describe(), checks)
    };
    super::print_report(
        &render(&device_line, &checks, &skipped),
        super::to_stdout(args.json.as_deref()),
    );
    if let Some(j) = &args.json {
        super::write_json("--json", j, &to_json(&device_line, &checks, &skipped))?;
    }
    Ok(if checks.iter().any(|c| c.mismatches > 0) {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

/// The tensors `todo` checked on several devices at once: one thread per device, each taking
/// the next tensor (largest first) when it is done; results in `todo`'s order, and a line that
/// says which device checked how many tensors in how long.
#[cfg(feature = "cuda")]
fn spread(
    model: &Model,
    todo: &[crate::gguf::TensorRef<'_>],
    devices: &[usize],
) -> Result<(String, Vec<crate::dcheck::TensorCheck>)> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Instant;

    use crate::dcheck::check_tensor;
    use crate::gpu::Gpu;
    use crate::report::progress::Bar;
    use crate::util::progress::{NoProgress, Progress};

    let gpus = devices
        .iter()
        .map(|&d| Gpu::open(d))
        .collect::<Result<Vec<_>>>()?;
    let mut order: Vec<usize> = (0..todo.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(todo[i].info.nbytes));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<crate::dcheck::TensorCheck>>> =
        Mutex::new((0..todo.len()).map(|_| None).collect());
    let bar = Bar::with_unit("tensors");
    bar.start("dequant-check", todo.len() as u64);
    let bar = Mutex::new(bar);
    let per_device: Vec<Result<(usize, f64)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = gpus
            .iter()
            .map(|gpu| {
                let (next, results, order, bar) = (&next, &results, &order, &bar);
                sc.spawn(move || -> Result<(usize, f64)> {
                    let t0 = Instant::now();
                    let mut done = 0;
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = order.get(k) else { break };
                        let c = check_tensor(gpu, model, todo[i], &NoProgress)?;
                        results.lock().map_err(|_| {
                            anyhow::anyhow!("dequant-check: a device thread panicked")
                        })?[i] = Some(c);
                        if let Ok(b) = bar.lock() {
                            b.inc(1);
                        }
                        done += 1;
                    }
                    Ok((done, t0.elapsed().as_secs_f64()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(anyhow::anyhow!("dequant-check: a device thread panicked"))
                })
            })
            .collect()
    });
    if let Ok(b) = bar.lock() {
        b.finish();
    }
    let mut parts = Vec::new();
    for (g, r) in gpus.iter().zip(per_device) {
        let (n, secs) = r?;
        parts.push(format!("{} ({n} tensors, {secs:.1} s)", g.describe()));
    }
    let checks = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("dequant-check: a device thread panicked"))?
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| anyhow::anyhow!("dequant-check: a tensor was not checked"))?;
    Ok((
        format!("{} devices: {}", gpus.len(), parts.join("; ")),
        checks,
    ))
}

#[cfg(not(feature = "cuda"))]
fn run_checks(_: &DequantCheckArgs, _: &Model, _: &[String]) -> Result<Outcome> {
    bail!("dequant-check: this glmdiff was built without the `cuda` feature")
}
