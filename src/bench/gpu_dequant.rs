//! `glmdiff bench dequant --device N`: each dequant kernel's bytes moved per second (raw blocks
//! read + f32 written) against a device-to-device copy measured in the same run. CUDA events
//! time the kernels after a warm-up; the median of five runs counts. Inputs are random valid
//! blocks (never zeros) of 2^28 elements, far beyond the 60 MB L2.

use anyhow::{Context, Result};
use cudarc::driver::sys::CUevent_flags;
use serde::Serialize;

use super::random_blocks::fill_blocks;
use crate::gpu::dequant::kernel_stem;
use crate::gpu::Gpu;
use crate::quant::{GgmlType, TYPE_TABLE};
use crate::util::rng::SplitMix64;

/// Elements per type.
pub const ELEMENTS: usize = 1 << 28;

/// One type's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Type name.
    pub ty: String,
    /// Median kernel time (ms).
    pub ms: f64,
    /// (raw bytes + 4 bytes per output) per second, GB/s.
    pub gbps: f64,
    /// `gbps` over the copy's.
    pub of_copy: f64,
    /// Output elements per second (G/s).
    pub gelems: f64,
}

/// The benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The device line.
    pub device: String,
    /// Device-to-device copy (read + write) GB/s, median of five.
    pub copy_gbps: f64,
    /// Per type.
    pub rows: Vec<Row>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark on `gpu` for `types` (all with a kernel when empty).
pub fn run(gpu: &Gpu, types: &[GgmlType]) -> Result<Report> {
    let s = gpu.stream();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    // Copy ceiling: 1 GiB device to device.
    let n_copy = 1usize << 28;
    let src = gpu.alloc_zeroed::<f32>(n_copy, "copy source")?;
    let mut dst = gpu.alloc_zeroed::<f32>(n_copy, "copy destination")?;
    let mut times = Vec::new();
    for i in 0..6 {
        let e0 = s.record_event(flags).context("cuda: event")?;
        s.memcpy_dtod(&src, &mut dst).context("cuda: device copy")?;
        let e1 = s.record_event(flags).context("cuda: event")?;
        if i > 0 {
            times.push(f64::from(e0.elapsed_ms(&e1)?));
        }
    }
    let copy_gbps = (8 * n_copy) as f64 / (median(times) * 1e-3) / 1e9;
    drop((src, dst));

    let types: Vec<GgmlType> = if types.is_empty() {
        TYPE_TABLE
            .iter()
            .map(|t| t.ty)
            .filter(|&t| kernel_stem(t).is_some())
            .collect()
    } else {
        types.to_vec()
    };
    let mut rows = Vec::new();
    for ty in types {
        if kernel_stem(ty).is_none() {
            continue;
        }
        let n = ELEMENTS / ty.block_size() * ty.block_size();
        let mut bytes = vec![0u8; n / ty.block_size() * ty.type_size()];
        fill_blocks(ty, &mut SplitMix64::new(u64::from(ty.id())), &mut bytes);
        let raw = gpu.alloc_copy(&bytes, "raw blocks")?;
        let mut out = gpu.alloc_zeroed::<f32>(n, "output")?;
        let mut times = Vec::new();
        for i in 0..6 {
            let e0 = s.record_event(flags).context("cuda: event")?;
            gpu.dequant_f32(ty, &raw, &mut out)?;
            let e1 = s.record_event(flags).context("cuda: event")?;
            if i > 0 {
                times.push(f64::from(e0.elapsed_ms(&e1)?));
            }
        }
        let ms = median(times);
        let gbps = (bytes.len() + 4 * n) as f64 / (ms * 1e-3) / 1e9;
        rows.push(Row {
            ty: ty.name().to_string(),
            ms,
            gbps,
            of_copy: gbps / copy_gbps,
            gelems: n as f64 / (ms * 1e-3) / 1e9,
        });
    }
    Ok(Report {
        device: gpu.describe(),
        copy_gbps,
        rows,
    })
}
