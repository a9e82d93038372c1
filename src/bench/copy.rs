//! Host-to-device copy floors of `bench run`: a layer's raw GGUF bytes copied to a device from
//! pinned host memory (the DMA ceiling the CUDA engine's prefetch stages through) and from
//! pageable memory (the model's map, as an upload without staging reads it).
//!
//! Both copy the same number of bytes in calls of at most [`CHUNK_BYTES`] into one device
//! buffer of that size on the device's stream; the time is the host's clock from a
//! synchronised stream to the stream synchronised after the last copy. The pinned copies send
//! one pinned buffer (filled with the layer's first bytes) again and again: they measure the
//! transfer alone, not reading the file.

use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{CudaSlice, PinnedHostSlice};

use crate::gpu::Gpu;

/// Bytes per copy call (the staging buffer size of the engine's prefetch).
pub const CHUNK_BYTES: usize = crate::gpu::upload::STAGING_BYTES;

/// The lowest of `reps` timed copies (after an untimed one) of the bytes of `parts` to `gpu`:
/// `(pinned_s, pageable_s)`; `(0, 0)` for no bytes.
pub fn layer_copy(gpu: &Gpu, parts: &[&[u8]], reps: usize) -> Result<(f64, f64)> {
    let bytes: usize = parts.iter().map(|p| p.len()).sum();
    if bytes == 0 {
        return Ok((0.0, 0.0));
    }
    let chunk = bytes.min(CHUNK_BYTES);
    let (full, rest) = (bytes / chunk, bytes % chunk);
    let mut dst = gpu.alloc_zeroed::<u8>(chunk, "the copy floor's device buffer")?;
    let pinned = pinned_with(gpu, chunk, parts)?;
    let pinned_rest = match rest {
        0 => None,
        n => Some(pinned_with(gpu, n, parts)?),
    };
    let (mut pinned_s, mut pageable_s) = (f64::INFINITY, f64::INFINITY);
    for rep in 0..=reps.max(1) {
        let p = timed(
            gpu,
            &mut |dst: &mut CudaSlice<u8>| {
                for _ in 0..full {
                    gpu.stream()
                        .memcpy_htod(&pinned, dst)
                        .context("cuda: copy from pinned memory")?;
                }
                if let Some(r) = &pinned_rest {
                    gpu.stream()
                        .memcpy_htod(r, &mut dst.slice_mut(0..r.len()))
                        .context("cuda: copy from pinned memory")?;
                }
                Ok(())
            },
            &mut dst,
        )?;
        let q = timed(
            gpu,
            &mut |dst: &mut CudaSlice<u8>| {
                for part in parts {
                    for c in part.chunks(chunk) {
                        gpu.stream()
                            .memcpy_htod(c, &mut dst.slice_mut(0..c.len()))
                            .context("cuda: copy from pageable memory")?;
                    }
                }
                Ok(())
            },
            &mut dst,
        )?;
        if rep > 0 {
            pinned_s = pinned_s.min(p);
            pageable_s = pageable_s.min(q);
        }
    }
    Ok((pinned_s, pageable_s))
}

/// Seconds of `copy` into `dst`, from a synchronised stream to the stream synchronised after it.
fn timed(
    gpu: &Gpu,
    copy: &mut dyn FnMut(&mut CudaSlice<u8>) -> Result<()>,
    dst: &mut CudaSlice<u8>,
) -> Result<f64> {
    let s = gpu.stream();
    s.synchronize()
        .context("cuda: synchronising before a copy")?;
    let t0 = Instant::now();
    copy(dst)?;
    s.synchronize()
        .context("cuda: synchronising after a copy")?;
    Ok(t0.elapsed().as_secs_f64())
}

/// `len` bytes of pinned host memory holding the first `len` bytes of `parts` (laid end to end;
/// zeros past their end).
fn pinned_with(gpu: &Gpu, len: usize, parts: &[&[u8]]) -> Result<PinnedHostSlice<u8>> {
    // SAFETY: the memory is unset; it is zeroed through the raw pointer just below, before any
    // slice of it is made or any copy reads it.
    let mut b = unsafe { gpu.context().alloc_pinned_with_flags::<u8>(len, 0) }
        .with_context(|| format!("cuda: cannot allocate {len} bytes of pinned host memory"))?;
    let p = b.as_mut_ptr().context("cuda: pinned host memory")?;
    // SAFETY: `p` points to the `len` bytes just allocated, owned by `b`, used by nothing else.
    unsafe { std::ptr::write_bytes(p, 0, len) };
    let buf = b.as_mut_slice().context("cuda: pinned host memory")?;
    let mut at = 0;
    for part in parts {
        if at == len {
            break;
        }
        let n = part.len().min(len - at);
        buf[at..at + n].copy_from_slice(&part[..n]);
        at += n;
    }
    Ok(b)
}
