//! One tensor's raw GGUF bytes dequantized on the device and compared there
//! with the CPU's dequantization of the same rows, streamed in chunks of rows so that a tensor of
//! any size needs a bounded amount of host and device memory. The CPU hashes its dequantization
//! of the next chunk on another thread while the device works on the current one.
//!
//! Only the raw blocks travel to the device: both sides hash their f32 values (an
//! order-independent 64-bit hash, [`crate::gpu::dequant::hash_f32_host`]) and only a chunk whose
//! hashes differ has the CPU's values made, copied over and compared value by value (mismatch
//! count, first index, largest difference). A wrong kernel therefore costs a second
//! dequantization and a copy; a right one never does. The CPU's hash is fused with its
//! dequantization ([`crate::gpu::dequant::dequant_hash`]): each thread dequantizes a tile into
//! a buffer of its own and hashes it there, so a chunk's values are never stored.

use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::sys::CUevent_flags;

use super::{FirstMismatch, TensorCheck};
use crate::gguf::{Model, TensorRef};
use crate::gpu::dequant::{dequant_hash, CompareStats};
use crate::gpu::Gpu;
use crate::quant::{dequantize_to_vec, GgmlType};
use crate::util::progress::Progress;

/// Elements per chunk (256 MiB of f32 per side).
pub const CHUNK_ELEMS: u64 = 1 << 26;

/// Checks one tensor (see the module documentation).
pub fn check_tensor(
    gpu: &Gpu,
    model: &Model,
    t: TensorRef<'_>,
    progress: &dyn Progress,
) -> Result<TensorCheck> {
    let t0 = Instant::now();
    let info = t.info;
    let ty: GgmlType = info.ty;
    let row_len = info.row_len();
    let n_rows = info.n_rows();
    let rows_per_chunk = (CHUNK_ELEMS / row_len.max(1)).max(1);
    let chunks: Vec<(u64, u64)> = (0..n_rows)
        .step_by(rows_per_chunk as usize)
        .map(|a| (a, (a + rows_per_chunk).min(n_rows)))
        .collect();
    let what = || format!("dequant-check: {} ({ty})", info.name);
    let mut out = TensorCheck {
        name: info.name.clone(),
        ty: ty.name().to_string(),
        shape: info.shape(),
        elements: info.n_elements(),
        mismatches: 0,
        max_abs: 0.0,
        first: None,
        bytes: info.nbytes,
        kernel_ms: 0.0,
        kernel_gbps: 0.0,
        cpu_ms: 0.0,
        h2d_ms: 0.0,
        compare_ms: 0.0,
        wall_ms: 0.0,
    };
    let mut stats = CompareStats::default();
    progress.start(&info.name, chunks.len() as u64);
    std::thread::scope(|scope| -> Result<()> {
        // The CPU side runs one chunk ahead on its own thread.
        let (tx, rx) = mpsc::sync_channel::<Result<(u64, u64, f64)>>(1);
        let chunks_cpu = chunks.clone();
        scope.spawn(move || {
            for (a, b) in chunks_cpu {
                let c0 = Instant::now();
                let r = model
                    .row_data(t, a..b)
                    .and_then(|raw| dequant_hash(ty, raw, a * row_len));
                let msg = r.map(|h| (a, h, c0.elapsed().as_secs_f64() * 1e3));
                if tx.send(msg).is_err() {
                    return;
                }
            }
        });
        let s = gpu.stream();
        for &(a, b) in &chunks {
            let (a_cpu, cpu_hash, cpu_ms) = rx
                .recv()
                .context("dequant-check: the CPU side stopped")?
                .with_context(what)?;
            debug_assert_eq!(a_cpu, a);
            out.cpu_ms += cpu_ms;
            let raw = model.row_data(t, a..b).with_context(what)?;
            let n = ((b - a) * row_len) as usize;
            let h0 = Instant::now();
            let raw_d = gpu.alloc_copy(raw, "raw blocks")?;
            s.synchronize().context("cuda: synchronize")?;
            out.h2d_ms += h0.elapsed().as_secs_f64() * 1e3;
            let mut gpu_d = gpu.alloc_zeroed::<f32>(n, "GPU values")?;
            let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let e0 = s.record_event(flags).context("cuda: event")?;
            gpu.dequant_f32(ty, &raw_d, &mut gpu_d).with_context(what)?;
            let e1 = s.record_event(flags).context("cuda: event")?;
            out.kernel_ms += f64::from(e0.elapsed_ms(&e1).context("cuda: event timing")?);
            let c0 = Instant::now();
            let mut cpu: Vec<f32> = Vec::new();
            let mut remade_ms = 0.0;
            let chunk = if gpu.hash_f32(&gpu_d, a * row_len).with_context(what)? == cpu_hash {
                CompareStats::default()
            } else {
                // Hashes differ: the CPU's values are made, go over and are compared one by one.
                let v0 = Instant::now();
                cpu = dequantize_to_vec(ty, raw, n).with_context(what)?;
                remade_ms = v0.elapsed().as_secs_f64() * 1e3;
                out.cpu_ms += remade_ms;
                let h0 = Instant::now();
                let cpu_d = gpu.alloc_copy(&cpu, "CPU values")?;
                out.h2d_ms += h0.elapsed().as_secs_f64() * 1e3;
                gpu.compare_f32(&gpu_d, &cpu_d).with_context(what)?
            };
            out.compare_ms += c0.elapsed().as_secs_f64() * 1e3 - remade_ms;
            let offset = a * row_len;
            if stats.first.is_none() {
                if let Some(i) = chunk.first {
                    let v = s
                        .clone_dtoh(&gpu_d.slice(i as usize..i as usize + 1))
                        .context("cuda: reading the first differing value")?;
                    let idx = offset + i;
                    let (row, col) = (idx / row_len, idx % row_len);
                    let bs = ty.block_size() as u64;
                    let ts = ty.type_size();
                    let blk = (col / bs) as usize;
                    let row_bytes = model.row_data(t, row..row + 1).with_context(what)?;
                    let raw = &row_bytes[blk * ts..(blk + 1) * ts];
                    out.first = Some(FirstMismatch {
                        index: idx,
                        row,
                        col,
                        block: blk as u64,
                        raw: raw.iter().take(48).map(|b| format!("{b:02x}")).collect(),
                        cpu: cpu.get(i as usize).copied().unwrap_or(f32::NAN),
                        gpu: v[0],
                    });
                }
            }
            stats.merge(chunk, offset);
            progress.inc(1);
        }
        Ok(())
    })?;
    progress.finish();
    out.mismatches = stats.mismatches;
    out.max_abs = stats.max_abs;
    out.wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    out.kernel_gbps = if out.kernel_ms > 0.0 {
        (out.bytes + 4 * out.elements) as f64 / (out.kernel_ms * 1e-3) / 1e9
    } else {
        0.0
    };
    Ok(out)
}
