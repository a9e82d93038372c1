//! The tensors of a check on one device, or spread over several: one pipeline
//! ([`DeviceCheck`]) per device, each on a thread of its own taking the next tensor (largest
//! first) as it nears the end of the current one; then the rates and projections.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, Result};

use super::project::{projections, Busy, Rates};
use super::tensor::DeviceCheck;
use super::{checkable_size, Checked, Options, Skipped, TensorCheck};
use crate::gguf::{Model, TensorRef};
use crate::gpu::dequant::kernel_stem;
use crate::gpu::Gpu;
use crate::util::progress::{NoProgress, Progress};

/// Checks the tensors `names` of `model` as `options` say (one device: chunk by chunk,
/// reported to `progress`; several: [`spread`], tensor by tensor); a tensor whose type has no
/// dequantizer is skipped.
pub fn check(
    model: &Model,
    names: &[String],
    options: &Options,
    progress: &(dyn Progress + Sync),
) -> Result<Checked> {
    let t0 = Instant::now();
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
    let (device, staging, per_device, checks) = if options.devices.len() > 1 {
        spread(model, &todo, options, progress)?
    } else {
        let gpu = Gpu::open(options.devices.first().copied().unwrap_or(0))?;
        let mut dc = DeviceCheck::new(&gpu, options.staging);
        let mut it = todo.iter().copied().enumerate();
        let mut checks = Vec::with_capacity(todo.len());
        dc.run(model, &mut || it.next(), progress, &mut |_, c| {
            checks.push(c);
            Ok(())
        })?;
        let staging = dc.staging().to_string();
        let busy = dc.busy().clone();
        (gpu.describe(), staging, vec![busy], checks)
    };
    // The pipelines' time, the devices' setup (contexts, pinned memory) left out.
    let loops_ms = per_device.iter().map(|b| b.wall_ms).fold(0.0, f64::max);
    let rates = Rates::measure(&per_device, loops_ms);
    let checked: u64 = checks.iter().map(|c| c.elements).sum();
    let (values, bytes) = checkable_size(model);
    let projections = rates.as_ref().map_or_else(Vec::new, |r| {
        projections(
            r,
            (&model.file_name(), values, bytes),
            checked,
            options.project,
        )
    });
    Ok(Checked {
        device,
        staging,
        checks,
        skipped,
        per_device,
        wall_ms: t0.elapsed().as_secs_f64() * 1e3,
        rates,
        projections,
        project: options.project.copied(),
    })
}

/// What [`spread`] returns: the device line, the staging line, each device's pipeline, the
/// checks in `todo`'s order.
type Spread = (String, String, Vec<Busy>, Vec<TensorCheck>);

/// The tensors `todo` checked on several devices at once: one pipeline per device, each taking
/// the next tensor (largest first) when it needs one; results in `todo`'s order, and a line that
/// says which device checked how many tensors in how long. A device that fails stops the others
/// at their next tensor.
fn spread(
    model: &Model,
    todo: &[TensorRef<'_>],
    options: &Options,
    progress: &(dyn Progress + Sync),
) -> Result<Spread> {
    let gpus = options
        .devices
        .iter()
        .map(|&d| Gpu::open(d))
        .collect::<Result<Vec<_>>>()?;
    let mut order: Vec<usize> = (0..todo.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(todo[i].info.nbytes));
    let queue = Queue {
        todo,
        order,
        next: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        results: Mutex::new((0..todo.len()).map(|_| None).collect()),
        progress,
    };
    progress.start("dequant-check", todo.len() as u64);
    let per_device: Vec<Result<(Busy, String)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = gpus
            .iter()
            .map(|gpu| {
                let queue = &queue;
                sc.spawn(move || {
                    let r = queue.work(gpu, model, options);
                    if r.is_err() {
                        queue.failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("dequant-check: a device thread panicked")))
            })
            .collect()
    });
    progress.finish();
    let mut parts = Vec::new();
    let mut busy = Vec::new();
    let mut stagings: Vec<String> = Vec::new();
    for (g, r) in gpus.iter().zip(per_device) {
        let (b, staging) = r?;
        parts.push(format!(
            "{} ({} tensors, {:.1} s)",
            g.describe(),
            b.tensors,
            b.wall_ms * 1e-3
        ));
        if !stagings.contains(&staging) {
            stagings.push(staging);
        }
        busy.push(b);
    }
    let checks = queue
        .results
        .into_inner()
        .map_err(|_| anyhow!("dequant-check: a device thread panicked"))?
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| anyhow!("dequant-check: a tensor was not checked"))?;
    Ok((
        format!("{} devices: {}", gpus.len(), parts.join("; ")),
        stagings.join("; "),
        busy,
        checks,
    ))
}

/// The tensors the device threads share: each takes the next in `order` when it needs one.
struct Queue<'a, 'm> {
    todo: &'a [TensorRef<'m>],
    /// Indices into `todo`, largest tensor first.
    order: Vec<usize>,
    /// The next position in `order` to take.
    next: AtomicUsize,
    /// A device failed: the others take no more tensors.
    failed: AtomicBool,
    /// Results in `todo`'s order.
    results: Mutex<Vec<Option<TensorCheck>>>,
    /// One unit per tensor checked.
    progress: &'a (dyn Progress + Sync),
}

impl<'m> Queue<'_, 'm> {
    /// The next tensor to check, with its index in `todo`.
    fn take(&self) -> Option<(usize, TensorRef<'m>)> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        self.order.get(k).map(|&i| (i, self.todo[i]))
    }

    /// Checks tensors on `gpu` until none is left: what its pipeline did, and its staging.
    fn work(&self, gpu: &Gpu, model: &'m Model, options: &Options) -> Result<(Busy, String)> {
        let mut dc = DeviceCheck::new(gpu, options.staging);
        dc.run(model, &mut || self.take(), &NoProgress, &mut |i, c| {
            self.results
                .lock()
                .map_err(|_| anyhow!("dequant-check: a device thread panicked"))?[i] = Some(c);
            self.progress.inc(1);
            Ok(())
        })?;
        Ok((dc.busy().clone(), dc.staging().to_string()))
    }
}
