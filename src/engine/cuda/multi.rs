//! Several GPUs behind one [`Engine`]: layers in contiguous ranges balanced by the bytes of the
//! quantized weights they read, one [`CudaEngine`] per device, the residual stream handed from
//! GPU to GPU where a layer's inputs live on the previous device.
//!
//! Each device holds one layer's raw weights at a time (its engine uploads them as the layer's
//! steps read them and frees them at the layer's end), plus the embedding on the first device
//! and the output projection on the last; [`plan_devices`] checks that this fits each device's
//! free memory before anything runs, and says what each needs when it does not. Each engine
//! also prefetches the next layer of its own range (the first layer of a range while the
//! previous device runs the last of its own) when its free memory holds it
//! (`engine::cuda`'s `prefetch`); a device without that room uploads on demand. Hand-offs go
//! through the host (a download and an upload of the tensors a step needs); they are counted.

use std::borrow::Cow;
use std::cell::Cell;
use std::ops::Range;

use anyhow::{bail, Context, Result};

use super::{CudaEngine, GpuDtype, GpuTensor, PrefetchSummary};
use crate::engine::{
    Engine, ExpertInputs, ExpertsOut, HostTensor, MlaInputs, Routing, UploadStats,
};
use crate::gpu::Gpu;
use crate::model::steps::{embed_steps, layer_steps, tail_steps, weights_of};
use crate::model::{RopeSlice, Weights};
use crate::precision::Precision;

/// Scratch a device needs beyond the weights it holds: dequantized matrices (at most 256 MiB
/// a projection), activations and cuBLAS workspace. A round allowance, not a measurement.
const SCRATCH_BYTES: u64 = 2 << 30;

/// Which layers run on which device, and what each device needs.
#[derive(Clone, Debug)]
pub struct DevicePlan {
    /// Per device (in `--devices` order): its contiguous layer range.
    pub ranges: Vec<Range<usize>>,
    /// Per device: bytes of raw weights its layers read, in total.
    pub layer_bytes: Vec<u64>,
    /// Per device: the most it holds at once (its largest layer, plus the embedding on the
    /// first and the output on the last device, plus scratch).
    pub peak_bytes: Vec<u64>,
}

fn tensor_bytes(w: &Weights<'_>, names: &[String]) -> Result<u64> {
    names
        .iter()
        .map(|n| Ok(w.tensor(n)?.info.nbytes))
        .sum::<Result<u64>>()
}

/// Splits layers `0..n_layer` into `n` contiguous ranges whose weight bytes are as even as a
/// greedy cut allows (a range closes once it reaches its share of what is left), and computes
/// what each device holds at most.
pub fn plan_devices(w: &Weights<'_>, n: usize) -> Result<DevicePlan> {
    let hp = w.hparams();
    if n == 0 {
        bail!("engine: cuda: no devices given");
    }
    let per_layer: Vec<u64> = (0..hp.n_layer)
        .map(|l| tensor_bytes(w, &weights_of(&layer_steps(hp, l), w)))
        .collect::<Result<_>>()?;
    let mut ranges = Vec::with_capacity(n);
    let mut start = 0;
    for d in 0..n {
        let left: u64 = per_layer[start..].iter().sum();
        let share = left.div_ceil((n - d) as u64);
        let mut end = start;
        let mut acc = 0u64;
        // Leave one layer for each later device while there are layers to give.
        let later = (n - d - 1).min(hp.n_layer.saturating_sub(start + 1));
        let max_end = (hp.n_layer - later).max(start);
        while end < max_end && (acc < share || end == start) {
            acc += per_layer[end];
            end += 1;
        }
        if d == n - 1 {
            end = hp.n_layer;
        }
        ranges.push(start..end);
        start = end;
    }
    let globals_first = tensor_bytes(w, &weights_of(&embed_steps(), w))?;
    let globals_last = tensor_bytes(
        w,
        &weights_of(&tail_steps(hp, hp.n_layer, w.output_name()), w),
    )?;
    let layer_bytes: Vec<u64> = ranges
        .iter()
        .map(|r| per_layer[r.clone()].iter().sum())
        .collect();
    let peak_bytes = ranges
        .iter()
        .enumerate()
        .map(|(d, r)| {
            let largest = per_layer[r.clone()].iter().copied().max().unwrap_or(0);
            let mut p = largest + SCRATCH_BYTES;
            if d == 0 {
                p += globals_first;
            }
            if d == n - 1 {
                p += globals_last;
            }
            p
        })
        .collect();
    Ok(DevicePlan {
        ranges,
        layer_bytes,
        peak_bytes,
    })
}

/// The CUDA engine over several devices.
pub struct MultiCudaEngine<'w> {
    engines: Vec<CudaEngine<'w>>,
    /// Per layer: the index of its engine.
    layer_dev: Vec<usize>,
    plan: DevicePlan,
    current: Cell<usize>,
    handoffs: Cell<u64>,
    handoff_bytes: Cell<u64>,
}

impl<'w> MultiCudaEngine<'w> {
    /// Engines on `gpus` (one each, in that order) running `weights` in precision `dtype`, after
    /// checking that each device's share fits its free memory.
    pub fn new(
        gpus: &'w [Gpu],
        weights: &'w Weights<'w>,
        dtype: GpuDtype,
    ) -> Result<MultiCudaEngine<'w>> {
        let plan = plan_devices(weights, gpus.len())?;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut short = Vec::new();
        for (d, g) in gpus.iter().enumerate() {
            let (free, _) = g.memory()?;
            if plan.peak_bytes[d] > free {
                short.push(format!(
                    "  cuda:{} ({}): layers {:?} need {:.2} GiB at once (largest layer, globals, {:.0} GiB scratch), {:.2} GiB free",
                    g.info.ordinal,
                    g.info.name,
                    plan.ranges[d],
                    gib(plan.peak_bytes[d]),
                    gib(SCRATCH_BYTES),
                    gib(free)
                ));
            }
        }
        if !short.is_empty() {
            bail!(
                "engine: cuda: the model does not fit these devices even one layer at a time:\n{}\ngive more devices (--devices) or free memory on these",
                short.join("\n")
            );
        }
        let mut layer_dev = vec![0; weights.hparams().n_layer];
        for (d, r) in plan.ranges.iter().enumerate() {
            for l in r.clone() {
                layer_dev[l] = d;
            }
        }
        let engines = gpus
            .iter()
            .enumerate()
            .map(|(d, g)| CudaEngine::new(g, weights, dtype).map(|e| e.with_slot(d)))
            .collect::<Result<Vec<_>>>()?;
        Ok(MultiCudaEngine {
            engines,
            layer_dev,
            plan,
            current: Cell::new(0),
            handoffs: Cell::new(0),
            handoff_bytes: Cell::new(0),
        })
    }

    /// The layer assignment and memory plan.
    pub fn plan(&self) -> &DevicePlan {
        &self.plan
    }

    /// The same engines with prefetching on or off ([`CudaEngine::with_prefetch`]).
    pub fn with_prefetch(mut self, on: bool) -> MultiCudaEngine<'w> {
        self.engines = self
            .engines
            .into_iter()
            .map(|e| e.with_prefetch(on))
            .collect();
        self
    }

    /// The same engines with stacked expert tensors uploaded as `mode` says
    /// ([`CudaEngine::with_expert_uploads`]).
    pub fn with_expert_uploads(mut self, mode: super::ExpertUploads) -> MultiCudaEngine<'w> {
        self.engines = self
            .engines
            .into_iter()
            .map(|e| e.with_expert_uploads(mode))
            .collect();
        self
    }

    /// What prefetching did, over every device.
    pub fn prefetch_summary(&self) -> PrefetchSummary {
        let mut s = PrefetchSummary::default();
        for e in &self.engines {
            s.merge(&e.prefetch_summary());
        }
        s
    }

    /// Tensors handed from one device to another so far, and their bytes.
    pub fn handoffs(&self) -> (u64, u64) {
        (self.handoffs.get(), self.handoff_bytes.get())
    }

    fn cur(&self) -> &CudaEngine<'w> {
        &self.engines[self.current.get()]
    }

    /// `t` on the current device: as is, or copied over from the device that holds it.
    fn here<'a>(&self, t: &'a GpuTensor) -> Result<Cow<'a, GpuTensor>> {
        let c = self.current.get();
        if t.slot == c {
            return Ok(Cow::Borrowed(t));
        }
        let src = self
            .engines
            .get(t.slot)
            .context("engine: cuda: a tensor of an unknown device")?;
        let h = src.download(t)?;
        self.handoffs.set(self.handoffs.get() + 1);
        self.handoff_bytes
            .set(self.handoff_bytes.get() + 4 * h.len() as u64);
        Ok(Cow::Owned(self.engines[c].upload(&h)?))
    }
}

impl Engine for MultiCudaEngine<'_> {
    type Tensor = GpuTensor;

    fn describe(&self) -> String {
        if self.engines.len() == 1 {
            return self.engines[0].describe();
        }
        let parts: Vec<String> = self
            .engines
            .iter()
            .zip(&self.plan.ranges)
            .map(|(e, r)| format!("layers {}..{} on {}", r.start, r.end, e.describe()))
            .collect();
        format!("{} GPUs: {}", self.engines.len(), parts.join("; "))
    }

    fn precision(&self) -> Precision {
        self.engines[0].precision()
    }

    fn upload(&self, t: &HostTensor) -> Result<GpuTensor> {
        self.cur().upload(t)
    }

    fn download(&self, t: &GpuTensor) -> Result<HostTensor> {
        self.engines
            .get(t.slot)
            .context("engine: cuda: a tensor of an unknown device")?
            .download(t)
    }

    fn begin_model(&self, weights: &[String]) -> Result<()> {
        for e in &self.engines {
            e.begin_model(weights)?;
        }
        Ok(())
    }

    fn end_model(&self) -> Result<()> {
        for e in &self.engines {
            e.end_model()?;
        }
        Ok(())
    }

    fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        // A layer past the plan (the MTP block run as a layer, `--inject run_mtp`) runs on the
        // last device, after the last planned layer.
        let d = self
            .layer_dev
            .get(layer)
            .copied()
            .unwrap_or(self.engines.len() - 1);
        self.current.set(d);
        self.engines[d].begin_layer(layer, weights)
    }

    fn end_layer(&self, layer: usize) -> Result<()> {
        self.cur().end_layer(layer)
    }

    /// On the device that runs `layer` (which may not be the current one: the next device's
    /// engine prefetches the first layer of its range while the last of the previous range
    /// runs).
    fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        match self.layer_dev.get(layer) {
            Some(&d) => self.engines[d].prefetch_layer(layer, weights),
            None => Ok(()),
        }
    }

    fn offer_uploads(&self) -> bool {
        // Every engine offers (no short-circuit).
        self.engines
            .iter()
            .fold(false, |under_way, e| e.offer_uploads() | under_way)
    }

    fn take_upload_stats(&self) -> UploadStats {
        let mut s = UploadStats::default();
        for e in &self.engines {
            s += e.take_upload_stats();
        }
        s
    }

    fn embed(&self, ids: &[u32]) -> Result<GpuTensor> {
        self.cur().embed(ids)
    }

    fn rms_norm(
        &self,
        x: &GpuTensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<GpuTensor> {
        self.cur().rms_norm(&*self.here(x)?, weight, eps, cols)
    }

    fn linear(&self, x: &GpuTensor, weight: &str) -> Result<GpuTensor> {
        self.cur().linear(&*self.here(x)?, weight)
    }

    fn router_logits(&self, layer: usize, x: &GpuTensor) -> Result<GpuTensor> {
        self.cur().router_logits(layer, &*self.here(x)?)
    }

    fn rope(&self, x: &GpuTensor, s: &RopeSlice) -> Result<GpuTensor> {
        self.cur().rope(&*self.here(x)?, s)
    }

    fn indexer_scores(&self, layer: usize, a: &GpuTensor, cq: &GpuTensor) -> Result<GpuTensor> {
        self.cur()
            .indexer_scores(layer, &*self.here(a)?, &*self.here(cq)?)
    }

    fn top_k(&self, scores: &GpuTensor, k: usize) -> Result<GpuTensor> {
        self.cur().top_k(&*self.here(scores)?, k)
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, GpuTensor>,
        want_probs: bool,
    ) -> Result<(GpuTensor, Option<GpuTensor>)> {
        let (q_b, q_pe, kv_norm, k_pe) = (
            self.here(x.q_b)?,
            self.here(x.q_pe)?,
            self.here(x.kv_norm)?,
            self.here(x.k_pe)?,
        );
        let sel = match x.selection {
            Some(s) => Some(self.here(s)?),
            None => None,
        };
        self.cur().mla_attention(
            layer,
            MlaInputs {
                q_b: &q_b,
                q_pe: &q_pe,
                kv_norm: &kv_norm,
                k_pe: &k_pe,
                selection: sel.as_deref(),
            },
            want_probs,
        )
    }

    fn moe_route(&self, layer: usize, logits: &GpuTensor) -> Result<Routing<GpuTensor>> {
        self.cur().moe_route(layer, &*self.here(logits)?)
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, GpuTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<GpuTensor>> {
        let (xx, ids, w) = (self.here(x.x)?, self.here(x.ids)?, self.here(x.weights)?);
        self.cur().moe_experts(
            layer,
            ExpertInputs {
                x: &xx,
                ids: &ids,
                weights: &w,
            },
            want_expert,
        )
    }

    fn mlp(&self, x: &GpuTensor, gate: &str, up: &str, down: &str) -> Result<GpuTensor> {
        self.cur().mlp(&*self.here(x)?, gate, up, down)
    }

    fn swiglu(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        self.cur().swiglu(&*self.here(a)?, &*self.here(b)?)
    }

    fn add(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        self.cur().add(&*self.here(a)?, &*self.here(b)?)
    }

    fn zeros_like(&self, x: &GpuTensor) -> Result<GpuTensor> {
        self.cur().zeros_like(&*self.here(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::plan_devices;
    use crate::gguf::Model;
    use crate::model::Weights;

    /// Contiguous ranges that cover every layer once, none empty while there are layers to
    /// give, bytes that add up; more devices than layers leave the last ones empty.
    #[test]
    fn layers_split_in_contiguous_ranges_by_bytes() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for f in [
            "fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "fixtures/models/dsv3-tiny/dsv3-tiny-f32.gguf",
        ] {
            let m = Model::open(&root.join(f)).expect("fixture");
            let w = Weights::new(&m).expect("weights");
            let n_layer = w.hparams().n_layer;
            let total = plan_devices(&w, 1).expect("plan").layer_bytes[0];
            for n in 1..=n_layer + 1 {
                let p = plan_devices(&w, n).expect("plan");
                assert_eq!(p.ranges.len(), n);
                assert_eq!(p.ranges[0].start, 0, "{f} {n}");
                assert_eq!(p.ranges[n - 1].end, n_layer, "{f} {n}");
                for d in 1..n {
                    assert_eq!(p.ranges[d].start, p.ranges[d - 1].end, "{f} {n}");
                }
                for d in 0..n.min(n_layer) {
                    assert!(!p.ranges[d].is_empty(), "{f} {n}: {:?}", p.ranges);
                }
                assert_eq!(p.layer_bytes.iter().sum::<u64>(), total, "{f} {n}");
                assert!(p.peak_bytes.iter().all(|&b| b > 0));
            }
        }
        assert!(plan_devices(
            &Weights::new(
                &Model::open(&root.join("fixtures/models/glm5-tiny/glm5-tiny-f32.gguf"))
                    .expect("fixture")
            )
            .expect("weights"),
            0
        )
        .is_err());
    }
}
