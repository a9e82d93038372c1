//! The tensors of a check on one device, or spread over several: one thread per device, each
//! taking the next tensor (largest first) when it is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, Result};

use super::tensor::check_tensor;
use super::{Checked, Skipped, TensorCheck};
use crate::gguf::{Model, TensorRef};
use crate::gpu::dequant::kernel_stem;
use crate::gpu::Gpu;
use crate::util::progress::{NoProgress, Progress};

/// Checks the tensors `names` of `model` on `devices` (one: chunk by chunk on it, reported to
/// `progress`; several: [`spread`], tensor by tensor); a tensor whose type has no dequantizer is
/// skipped.
pub fn check(
    model: &Model,
    names: &[String],
    devices: &[usize],
    progress: &(dyn Progress + Sync),
) -> Result<Checked> {
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
    let (device, checks) = if devices.len() > 1 {
        spread(model, &todo, devices, progress)?
    } else {
        let gpu = Gpu::open(devices.first().copied().unwrap_or(0))?;
        let checks = todo
            .iter()
            .map(|&t| check_tensor(&gpu, model, t, progress))
            .collect::<Result<Vec<_>>>()?;
        (gpu.describe(), checks)
    };
    Ok(Checked {
        device,
        checks,
        skipped,
    })
}

/// The tensors `todo` checked on several devices at once: one thread per device, each taking
/// the next tensor (largest first) when it is done; results in `todo`'s order, and a line that
/// says which device checked how many tensors in how long.
fn spread(
    model: &Model,
    todo: &[TensorRef<'_>],
    devices: &[usize],
    progress: &(dyn Progress + Sync),
) -> Result<(String, Vec<TensorCheck>)> {
    let gpus = devices
        .iter()
        .map(|&d| Gpu::open(d))
        .collect::<Result<Vec<_>>>()?;
    let mut order: Vec<usize> = (0..todo.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(todo[i].info.nbytes));
    let queue = Queue {
        model,
        todo,
        order,
        next: AtomicUsize::new(0),
        results: Mutex::new((0..todo.len()).map(|_| None).collect()),
        progress,
    };
    progress.start("dequant-check", todo.len() as u64);
    let per_device: Vec<Result<(usize, f64)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = gpus
            .iter()
            .map(|gpu| {
                let queue = &queue;
                sc.spawn(move || queue.work(gpu))
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
    for (g, r) in gpus.iter().zip(per_device) {
        let (n, secs) = r?;
        parts.push(format!("{} ({n} tensors, {secs:.1} s)", g.describe()));
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
        checks,
    ))
}

/// The tensors the device threads share: each takes the next in `order` when it is done.
struct Queue<'a, 'm> {
    model: &'m Model,
    todo: &'a [TensorRef<'m>],
    /// Indices into `todo`, largest tensor first.
    order: Vec<usize>,
    /// The next position in `order` to take.
    next: AtomicUsize,
    /// Results in `todo`'s order.
    results: Mutex<Vec<Option<TensorCheck>>>,
    /// One unit per tensor checked.
    progress: &'a (dyn Progress + Sync),
}

impl Queue<'_, '_> {
    /// Checks tensors on `gpu` until none is left: how many, in how many seconds.
    fn work(&self, gpu: &Gpu) -> Result<(usize, f64)> {
        let t0 = Instant::now();
        let mut done = 0;
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = self.order.get(k) else { break };
            let c = check_tensor(gpu, self.model, self.todo[i], &NoProgress)?;
            self.results
                .lock()
                .map_err(|_| anyhow!("dequant-check: a device thread panicked"))?[i] = Some(c);
            self.progress.inc(1);
            done += 1;
        }
        Ok((done, t0.elapsed().as_secs_f64()))
    }
}
