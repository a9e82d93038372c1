//! The CPU reference's matrix products on a device, bit for bit (`cuda/reference.cu`).
//!
//! The reference defines every product element as `engine::cpu::math::dot` computes it: exact
//! f64 products added into 8 lanes by column, in column order, the lanes combined in a fixed
//! tree, rounded to f32 once. The kernel `reference_products_f32` computes that same sum with
//! the same operations in the same order (its source says why the bits agree), so a product
//! made here is the reference's own value, only made on a device's f64 units; the weights are
//! dequantized on the device by the bit-exact dequant kernels (`cuda/dequant*.cu`).
//!
//! This module only moves values and launches: when the reference uses it, and how each use is
//! checked against the CPU, is `engine::cpu`'s ([`ReferenceProducts`] is its device).

use std::sync::Arc;

use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use cudarc::driver::{
    result, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use rayon::prelude::*;

use super::dequant::OutFormat;
pub use super::parcels::Weights;
use super::parcels::{check_weights, row_bytes, Packed, Parcel, Parcels};
use super::{Gpu, REFERENCE_SOURCE};
use crate::quant::GgmlType;

/// The two tilings of `cuda/reference.cu` (the same sums): kernel name, a block's tokens and rows.
pub const KERNELS: [(&str, usize, usize); 2] = [
    ("reference_products_f32", 32, 32),
    ("reference_products_f32_t64", 64, 32),
];
/// The kernel of products of at most [`FEW_TOKENS`] tokens (the same sums as [`KERNELS`]):
/// kernel name, a block's tokens and rows.
pub const FEW: (&str, usize, usize) = ("reference_products_f32_few", 4, 32);
/// Most tokens of a product made by [`FEW`] instead of the tiles (which compute 32 or 64 tokens
/// a tile whatever the product has: a routed expert's one or two at a short prompt).
pub const FEW_TOKENS: usize = 8;
/// Most f32 weight values dequantized on the device at a time (256 MiB): a larger matrix goes
/// in chunks of rows.
const CHUNK_VALUES: usize = 1 << 26;

/// Bytes of each pinned staging buffer (two: one is filled while the other's copy runs).
const STAGE_BYTES: usize = 32 << 20;

/// A device that makes the reference's matrix products, on a stream of its own (so that its
/// work and another engine's on the same device do not wait for each other). Host values go
/// through two pinned staging buffers, filled by all cores while the other one's copy runs;
/// device buffers are kept between products and grow as needed.
pub struct ReferenceProducts {
    // Fields drop in order: the buffers and the staging memory before the device's context.
    stage: Mutex<Staging>,
    bufs: Mutex<Buffers>,
    /// The tiling used (an index of [`KERNELS`]): the faster on this device.
    kernel: usize,
    /// Each tiling's rate measured at open, G multiply-adds per second.
    rates: Vec<f64>,
    /// Seconds the product kernels ran so far (device events).
    kernel_seconds: Mutex<f64>,
    /// Seconds spent handing host values to the device so far (staging them, and waiting for a
    /// staging buffer's earlier copy).
    upload_seconds: Mutex<f64>,
    gpu: Gpu,
}

/// The pinned staging buffers and the event recorded after the last copy out of each.
struct Staging {
    bufs: Vec<PinnedHostSlice<u8>>,
    events: Vec<Option<CudaEvent>>,
    next: usize,
}

impl Drop for Staging {
    /// Waits for the copies still reading the pinned buffers before they are freed.
    fn drop(&mut self) {
        for e in self.events.iter().flatten() {
            let _ = e.synchronize();
        }
    }
}

/// Device buffers kept between products (grow-only): raw weight bytes, f32 weights, the input
/// and the output.
#[derive(Default)]
struct Buffers {
    raw: Option<CudaSlice<u8>>,
    w: Option<CudaSlice<f32>>,
    x: Option<CudaSlice<f32>>,
    out: Option<CudaSlice<f32>>,
    /// The non-finite weight values of the product under way.
    count: Option<CudaSlice<u64>>,
    /// The hash of the device weights of the product under way (`submit_device`).
    hash: Option<CudaSlice<u64>>,
    /// Pinned host memory for a chunk of an attention's scores: read back into it, turned
    /// into probabilities there, copied back from it.
    scores_host: Option<PinnedHostSlice<f64>>,
}

/// `slot` holding at least `n` values (a new allocation when it holds fewer).
fn at_least<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    slot: &'a mut Option<CudaSlice<T>>,
    n: usize,
    what: &str,
) -> Result<&'a mut CudaSlice<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None;
        *slot = Some(gpu.alloc_zeroed::<T>(n.max(1), what)?);
    }
    slot.as_mut()
        .ok_or_else(|| anyhow::anyhow!("cuda: {what}: no buffer"))
}

/// Most scores (f64) of one chunk of [`ReferenceProducts::mla`]'s query rows (512 MiB).
const ATTENTION_SCORES: usize = 1 << 26;

/// What turns a chunk of [`ReferenceProducts::mla`]'s scores (its query rows given) into
/// probabilities, in place.
pub type Softmax<'a> = dyn FnMut(&mut [f64], std::ops::Range<usize>) -> Result<()> + 'a;

/// The widths of an MLA attention for [`ReferenceProducts::mla`].
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    /// Heads.
    pub heads: usize,
    /// Per head, K values without RoPE (and of q_nope).
    pub nope: usize,
    /// Per head, rotated values (q_rot; `kpe` is shared by the heads).
    pub rope: usize,
    /// Per head, V values.
    pub v: usize,
}

impl ReferenceProducts {
    /// Opens device `ordinal` with a stream of its own and starts compiling the kernels the
    /// products need (the reference family and the dequant families).
    pub fn open(ordinal: usize) -> Result<ReferenceProducts> {
        let gpu = Gpu::open_own_stream(ordinal)?;
        let mut families: Vec<(&'static str, &'static str)> = vec![("reference", REFERENCE_SOURCE)];
        families.extend(super::DEQUANT_FAMILIES);
        gpu.compile_ahead(&families);
        let mut bufs = Vec::new();
        for _ in 0..2 {
            // SAFETY: the memory is unset; nothing reads it before a copy into it fills the
            // bytes read (`ReferenceProducts::put` copies only what it wrote).
            let b = unsafe { gpu.context().alloc_pinned_with_flags::<u8>(STAGE_BYTES, 0) }
                .with_context(|| {
                    format!(
                        "cuda: cannot allocate {} MiB of pinned staging memory",
                        STAGE_BYTES >> 20
                    )
                })?;
            bufs.push(b);
        }
        let mut p = ReferenceProducts {
            gpu,
            stage: Mutex::new(Staging {
                bufs,
                events: vec![None, None],
                next: 0,
            }),
            bufs: Mutex::new(Buffers::default()),
            kernel: 0,
            rates: Vec::new(),
            kernel_seconds: Mutex::new(0.0),
            upload_seconds: Mutex::new(0.0),
        };
        p.rates = p.time_kernels()?;
        p.kernel = (0..KERNELS.len())
            .max_by(|&a, &b| p.rates[a].total_cmp(&p.rates[b]))
            .unwrap_or(0);
        if let Ok(mut k) = p.kernel_seconds.lock() {
            *k = 0.0;
        }
        Ok(p)
    }

    /// Each tiling's rate on a product of 512 tokens by 1024 rows of 4096 values (of mixed
    /// signs and magnitudes, so that another order of the adds shows in the bits), the best of
    /// 3 launches, G multiply-adds per second; a tiling whose output differs from the first's
    /// in any bit, or that cannot be loaded or launched here, is left out (rate 0).
    fn time_kernels(&self) -> Result<Vec<f64>> {
        let (t, rows, cols) = (512usize, 1024usize, 4096usize);
        let values = |n: usize, seed: u64| -> Vec<f32> {
            let mut rng = crate::util::rng::SplitMix64::new(seed);
            (0..n)
                .map(|_| {
                    let u = rng.next_u64();
                    let m = 1.0 + ((u >> 8) & 0xff_ffff) as f32 / (1 << 24) as f32;
                    let e = ((u >> 40) % 41) as i32 - 20;
                    let sign = if u & 1 == 1 { -1.0f32 } else { 1.0 };
                    sign * m * 2f32.powi(e)
                })
                .collect()
        };
        let x = self
            .gpu
            .alloc_copy(&values(t * cols, 1), "a timing input")?;
        let w = self
            .gpu
            .alloc_copy(&values(rows * cols, 5), "a timing weight")?;
        let mut out = self.gpu.alloc_zeroed::<f32>(t * rows, "a timing output")?;
        let mut rates = Vec::new();
        let mut first: Option<Vec<f32>> = None;
        for k in 0..KERNELS.len() {
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                match self
                    .launch_with(k, &x, &w, &mut out, (t, rows, cols), 0, rows)
                    .and_then(|e| elapsed(&[e]))
                {
                    Ok(s) => best = best.min(s),
                    Err(e) if k + 1 < KERNELS.len() || rates.iter().any(|&r| r > 0.0) => {
                        let _ = e;
                        best = f64::INFINITY;
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            if best.is_finite() {
                let got = self
                    .stream()
                    .clone_dtoh(&out)
                    .context("cuda: reading a timing output")?;
                match &first {
                    None => first = Some(got),
                    Some(f) if f.iter().zip(&got).any(|(a, b)| a.to_bits() != b.to_bits()) => {
                        best = f64::INFINITY;
                    }
                    Some(_) => {}
                }
            }
            rates.push(if best.is_finite() {
                (t * rows * cols) as f64 / best / 1e9
            } else {
                0.0
            });
        }
        Ok(rates)
    }

    /// This device with tiling `kernel` of [`KERNELS`] instead of the faster (the tests check
    /// every tiling's bits).
    pub fn with_kernel(mut self, kernel: usize) -> ReferenceProducts {
        self.kernel = kernel.min(KERNELS.len() - 1);
        self
    }

    /// Each tiling's measured rate (G multiply-adds per second) and the one used.
    pub fn kernel_rates(&self) -> (Vec<(&'static str, f64)>, &'static str) {
        let r = KERNELS
            .iter()
            .zip(&self.rates)
            .map(|(k, &r)| (k.0, r))
            .collect();
        (r, KERNELS[self.kernel].0)
    }

    /// Seconds the product kernels ran so far.
    pub fn kernel_seconds(&self) -> f64 {
        self.kernel_seconds.lock().map(|k| *k).unwrap_or(0.0)
    }

    /// Copies `src` into `dst` (of the same length) through the staging buffers: all cores fill
    /// one while the other's copy runs.
    fn put(&self, src: &[u8], dst: &mut CudaViewMut<'_, u8>) -> Result<()> {
        let start = std::time::Instant::now();
        let out = self.put_staged(src, dst);
        if let Ok(mut u) = self.upload_seconds.lock() {
            *u += start.elapsed().as_secs_f64();
        }
        out
    }

    /// Seconds spent handing host values to the device so far.
    pub fn upload_seconds(&self) -> f64 {
        self.upload_seconds.lock().map(|u| *u).unwrap_or(0.0)
    }

    /// [`ReferenceProducts::put`] itself.
    fn put_staged(&self, src: &[u8], dst: &mut CudaViewMut<'_, u8>) -> Result<()> {
        if src.len() != dst.len() {
            bail!("cuda: staging {} bytes into {}", src.len(), dst.len());
        }
        let s = self.stream();
        let mut st = self
            .stage
            .lock()
            .map_err(|_| anyhow::anyhow!("cuda: the staging lock is poisoned"))?;
        for (i, chunk) in src.chunks(STAGE_BYTES).enumerate() {
            let slot = st.next;
            st.next = (slot + 1) % st.bufs.len();
            if let Some(e) = st.events[slot].take() {
                e.synchronize()
                    .context("cuda: waiting for a staging copy")?;
            }
            let buf = st.bufs[slot]
                .as_mut_slice()
                .context("cuda: pinned staging memory")?;
            let buf = &mut buf[..chunk.len()];
            // On the pool's threads unless this is one of them (a product asked from a task
            // of the pool would otherwise wait on its own locks while the pool steals it).
            if rayon::current_thread_index().is_some() {
                buf.copy_from_slice(chunk);
            } else {
                buf.par_chunks_mut(1 << 20)
                    .zip(chunk.par_chunks(1 << 20))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            }
            let (ptr, rec) = dst.device_ptr_mut(s);
            // SAFETY: `ptr + i * STAGE_BYTES .. + chunk.len()` lies inside `dst` (it holds
            // src.len() bytes); `buf` is pinned memory not written again before the event
            // recorded below says this copy is done (waited for at the slot's next use), and it
            // lives as long as `self`, whose products end by synchronizing the stream.
            unsafe {
                result::memcpy_htod_async(ptr + (i * STAGE_BYTES) as u64, &*buf, s.cu_stream())
            }
            .context("cuda: copy to the device")?;
            drop(rec);
            match s.record_event(None) {
                Ok(e) => st.events[slot] = Some(e),
                Err(e) => {
                    // Nothing would say when the copy is done: wait for it before the buffer
                    // can be written again or freed.
                    let _ = s.synchronize();
                    return Err(e).context("cuda: recording a staging copy");
                }
            }
        }
        Ok(())
    }

    /// [`ReferenceProducts::put`] of f32 values into the first `src.len()` values of `dst`.
    fn put_f32(&self, src: &[f32], dst: &mut CudaSlice<f32>) -> Result<()> {
        self.put_values(src, dst)
    }

    /// [`ReferenceProducts::put`] of plain values (no padding, every bit pattern valid: f32,
    /// f64, u32, u64) into the first `src.len()` values of `dst`.
    fn put_values<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<()> {
        // SAFETY: the callers' types have no padding; the byte view covers exactly `src`'s
        // values.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src))
        };
        // SAFETY: any bytes are valid values of the callers' types; the view covers the first
        // src.len() values of `dst` (transmute_mut checks that it holds them).
        let mut view = unsafe { dst.transmute_mut::<u8>(bytes.len()) }
            .context("cuda: a device buffer smaller than its values")?;
        self.put(bytes, &mut view)
    }

    /// The device, for report headers.
    pub fn describe(&self) -> String {
        self.gpu.describe()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.gpu.info.ordinal
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.gpu.stream()
    }

    /// The device buffers kept between products, locked.
    fn buffers(&self) -> Result<std::sync::MutexGuard<'_, Buffers>> {
        self.bufs
            .lock()
            .map_err(|_| anyhow::anyhow!("cuda: the buffer lock is poisoned"))
    }

    /// The device buffers of a product of `t` tokens by `rows` rows of `cols` (input, output,
    /// a chunk's dequantized weights, the non-finite counter, cleared): the rows of a chunk.
    fn product_buffers(
        &self,
        b: &mut Buffers,
        (t, rows, cols): (usize, usize, usize),
    ) -> Result<usize> {
        let g = &self.gpu;
        let chunk_rows = (CHUNK_VALUES / cols.max(1)).clamp(1, rows);
        at_least(g, &mut b.x, t * cols, "the reference's product input")?;
        at_least(g, &mut b.out, t * rows, "the reference's product output")?;
        at_least(
            g,
            &mut b.w,
            chunk_rows * cols,
            "the reference's dequantized weights",
        )?;
        let count = at_least(g, &mut b.count, 1, "a counter")?;
        self.stream()
            .memset_zeros(count)
            .context("cuda: clearing a counter")?;
        Ok(chunk_rows)
    }

    /// Raw bytes of `ty` on the device dequantized into the first `values` weights, their
    /// non-finite values counted: `from`'s when given (another engine's, `gpu::resident`), else
    /// the first `len` of the raw buffer.
    fn dequant_chunk(
        &self,
        b: &mut Buffers,
        ty: GgmlType,
        (len, from): (usize, Option<&CudaView<'_, u8>>),
        values: usize,
    ) -> Result<()> {
        let wd = b.w.as_mut().context("cuda: no weight buffer")?;
        let raw = match from {
            Some(v) => v.slice(..len),
            None => b.raw.as_ref().context("cuda: no raw buffer")?.slice(..len),
        };
        self.gpu
            .dequant_view(ty, OutFormat::F32, &raw, &mut wd.slice_mut(..values))?;
        let count = b.count.as_mut().context("cuda: no counter")?;
        self.count_nonfinite(wd, values, count)
    }

    /// The hash of the device bytes `v` (`gpu::resident`'s, base 0), on this device's stream.
    pub fn hash_bytes(&self, v: &cudarc::driver::CudaView<'_, u8>) -> Result<u64> {
        self.gpu.hash_bytes(v, 0)
    }

    /// A store of pinned parcels for products packed by their callers ([`Parcels`]).
    pub fn parcels(&self) -> Parcels {
        Parcels::new(self.gpu.context().clone())
    }

    /// Queues the product packed in `parcel` on the stream: its input and weights copied from
    /// the parcel, the weights dequantized and counted, the product, its output and count
    /// copied back into the parcel; returns without waiting for them ([`Sent::wait`] does).
    /// The caller holds the device's turn while this runs, not while it waits: the next
    /// product's copies queue behind this one's on the same stream, so the device buffers
    /// reused are not written before this product has read them. On an error the stream is
    /// waited for, so that nothing still reads or writes the parcel.
    pub fn submit(&self, parcel: &mut Parcel) -> Result<Sent> {
        let out = self.submit_queued(parcel);
        if out.is_err() {
            let _ = self.stream().synchronize();
        }
        out
    }

    /// [`ReferenceProducts::submit`] itself.
    fn submit_queued(&self, parcel: &mut Parcel) -> Result<Sent> {
        let (t, rows, cols) = parcel.dims;
        if t == 0 || rows == 0 {
            bail!("cuda: reference products: an empty product [{t}, {rows}] in a parcel");
        }
        let s = self.stream();
        let g = &self.gpu;
        let mut guard = self.buffers()?;
        let b = &mut *guard;
        let chunk_rows = self.product_buffers(b, (t, rows, cols))?;
        let layout = parcel.layout.clone();
        let packed = parcel.packed;
        let host = parcel
            .buf
            .as_mut_slice()
            .context("cuda: a product's pinned memory")?;
        let xd = b.x.as_mut().context("cuda: no input buffer")?;
        let (ptr, rec) = xd.device_ptr_mut(s);
        // SAFETY: `xd` holds at least t * cols f32 values, the bytes of `layout.x` (the input
        // packed there); the parcel's pinned memory is not touched by the host until the event
        // recorded at the end says every copy is done (Sent::wait), or the stream is waited
        // for after an error (submit).
        unsafe { result::memcpy_htod_async(ptr, &host[layout.x.clone()], s.cu_stream()) }
            .context("cuda: copying a product's input to the device")?;
        drop(rec);
        let mut events = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let n = chunk_rows.min(rows - r0);
            let values = n * cols;
            match packed {
                Packed::Raw(ty) => {
                    let per_row = row_bytes(ty, cols)?;
                    let len = n * per_row;
                    let from = layout.w.start + r0 * per_row;
                    let raw = at_least(g, &mut b.raw, len, "the reference's raw weights")?;
                    let (ptr, rec) = raw.device_ptr_mut(s);
                    // SAFETY: `raw` holds at least `len` bytes; `from..from + len` lies inside
                    // `layout.w` (rows * per_row bytes, checked when packed); the parcel as
                    // above.
                    unsafe {
                        result::memcpy_htod_async(ptr, &host[from..from + len], s.cu_stream())
                    }
                    .context("cuda: copying a product's weights to the device")?;
                    drop(rec);
                    self.dequant_chunk(b, ty, (len, None), values)?;
                }
                Packed::OnDevice(_) => bail!(
                    "cuda: reference products: a parcel of device weights queued without them"
                ),
                Packed::Dense => {
                    let from = layout.w.start + r0 * cols * 4;
                    let wd = b.w.as_mut().context("cuda: no weight buffer")?;
                    let (ptr, rec) = wd.device_ptr_mut(s);
                    // SAFETY: `wd` holds at least chunk_rows * cols >= n * cols values; the
                    // bytes copied are rows r0..r0 + n of the f32 weights in `layout.w`; the
                    // parcel as above.
                    unsafe {
                        result::memcpy_htod_async(
                            ptr,
                            &host[from..from + values * 4],
                            s.cu_stream(),
                        )
                    }
                    .context("cuda: copying a product's weights to the device")?;
                    drop(rec);
                }
            }
            events.push(self.launch_chunk(b, (t, rows, cols), r0, n)?);
            r0 += n;
        }
        let out = b.out.as_ref().context("cuda: no output buffer")?;
        let (src, rec) = out.device_ptr(s);
        // SAFETY: `layout.out` holds t * rows * 4 bytes, `out` at least t * rows values; the
        // parcel as above.
        unsafe { result::memcpy_dtoh_async(&mut host[layout.out.clone()], src, s.cu_stream()) }
            .context("cuda: reading the reference's products")?;
        drop(rec);
        let count = b.count.as_ref().context("cuda: no counter")?;
        let (src, rec) = count.device_ptr(s);
        // SAFETY: `layout.count` holds 8 bytes, the counter one u64; the parcel as above.
        unsafe { result::memcpy_dtoh_async(&mut host[layout.count.clone()], src, s.cu_stream()) }
            .context("cuda: reading a counter")?;
        drop(rec);
        let done = s
            .record_event(None)
            .context("cuda: recording a product's end")?;
        Ok(Sent { events, done })
    }

    /// Queues the product packed in `parcel` by [`Parcels::pack_input`] with the raw rows
    /// `bytes` already on the device (another engine's, `gpu::resident`), as
    /// [`ReferenceProducts::submit`] queues one: its input copied from the parcel, the rows
    /// dequantized from `bytes` and counted, the product, its output and count copied back;
    /// when `hash`, first the hash of `bytes` (`Gpu::hash_bytes`, base 0), copied back too
    /// ([`Sent::wait_hashed`]). `bytes` must stay on the device until the product is waited for.
    pub fn submit_device(
        &self,
        parcel: &mut Parcel,
        bytes: &CudaView<'_, u8>,
        hash: bool,
    ) -> Result<Sent> {
        let out = self.submit_device_queued(parcel, bytes, hash);
        if out.is_err() {
            let _ = self.stream().synchronize();
        }
        out
    }

    /// [`ReferenceProducts::submit_device`] itself. The parcel's input and outputs travel by
    /// [`ReferenceProducts::copy_words`] (the parcel is mapped into the device's address
    /// space), not by copies: a copy queues on a copy engine behind the bulk uploads another
    /// stream of the device may have issued (the candidate's routed experts), a kernel's loads
    /// and stores do not.
    fn submit_device_queued(
        &self,
        parcel: &mut Parcel,
        bytes: &CudaView<'_, u8>,
        hash: bool,
    ) -> Result<Sent> {
        let (t, rows, cols) = parcel.dims;
        let Packed::OnDevice(ty) = parcel.packed else {
            bail!("cuda: reference products: a packed parcel queued as one of device weights");
        };
        if t == 0 || rows == 0 {
            bail!("cuda: reference products: an empty product [{t}, {rows}] in a parcel");
        }
        let per_row = row_bytes(ty, cols)?;
        if bytes.len() != rows * per_row {
            bail!(
                "cuda: reference products: {} device bytes of {ty} for {rows} rows of {cols}",
                bytes.len()
            );
        }
        let s = self.stream();
        let mut guard = self.buffers()?;
        let b = &mut *guard;
        let chunk_rows = self.product_buffers(b, (t, rows, cols))?;
        let layout = parcel.layout.clone();
        // The parcel's pinned memory, in the device's address space: it is not touched by
        // the host until the event recorded at the end says the kernels that read and write
        // it are done (Sent::wait), or the stream is waited for after an error (submit_device).
        let Some(dev) = parcel.dev else {
            bail!("cuda: reference products: the driver gave no device address for a product's pinned memory");
        };
        let host = |r: &std::ops::Range<usize>| dev + r.start as u64;
        let words = |r: &std::ops::Range<usize>| r.len() / 4;
        {
            let xd = b.x.as_mut().context("cuda: no input buffer")?;
            let (ptr, rec) = xd.device_ptr_mut(s);
            // `xd` holds at least t * cols f32 values, the words of `layout.x`.
            self.copy_words(host(&layout.x), ptr, words(&layout.x))?;
            drop(rec);
        }
        if hash {
            let h = at_least(&self.gpu, &mut b.hash, 1, "a hash")?;
            s.memset_zeros(h).context("cuda: clearing a hash")?;
            self.gpu.hash_bytes_queued(bytes, 0, h)?;
            let (src, rec) = h.device_ptr(s);
            // `layout.hash` holds 8 bytes, the hash one u64.
            self.copy_words(src, host(&layout.hash), words(&layout.hash))?;
            drop(rec);
        }
        let mut events = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let n = chunk_rows.min(rows - r0);
            let rows_bytes = bytes.slice(r0 * per_row..);
            self.dequant_chunk(b, ty, (n * per_row, Some(&rows_bytes)), n * cols)?;
            events.push(self.launch_chunk(b, (t, rows, cols), r0, n)?);
            r0 += n;
        }
        let out = b.out.as_ref().context("cuda: no output buffer")?;
        let (src, rec) = out.device_ptr(s);
        // `layout.out` holds t * rows * 4 bytes, `out` at least t * rows values.
        self.copy_words(src, host(&layout.out), words(&layout.out))?;
        drop(rec);
        let count = b.count.as_ref().context("cuda: no counter")?;
        let (src, rec) = count.device_ptr(s);
        // `layout.count` holds 8 bytes, the counter one u64.
        self.copy_words(src, host(&layout.count), words(&layout.count))?;
        drop(rec);
        let done = s
            .record_event(None)
            .context("cuda: recording a product's end")?;
        Ok(Sent { events, done })
    }

    /// Queues the copy of `words` 32-bit words from device address `src` to `dst` on the stream
    /// by a kernel (`reference_copy_words`): either may be host memory mapped into the
    /// device's address space. The caller vouches that both hold `words` words.
    fn copy_words(&self, src: u64, dst: u64, words: usize) -> Result<()> {
        if words == 0 {
            return Ok(());
        }
        let f = self
            .gpu
            .function("reference", REFERENCE_SOURCE, "reference_copy_words")?;
        let n = words as u64;
        let mut b = self.stream().launch_builder(&f);
        b.arg(&src).arg(&dst).arg(&n);
        // SAFETY: the callers pass `src` and `dst` holding at least `words` 32-bit words each
        // (device buffers, or ranges of a live parcel mapped into the device's address space
        // that the host does not touch until the stream has passed this kernel); the kernel
        // reads src[i] and writes dst[i] for i < n only.
        unsafe { b.launch(self.strided(words, 4)) }
            .context("cuda: launching reference_copy_words")?;
        Ok(())
    }

    /// A launch of blocks of 256 threads striding over `n` items, at most `per_sm` blocks a
    /// multiprocessor.
    fn strided(&self, n: usize, per_sm: u64) -> LaunchConfig {
        let most = u64::from(self.gpu.info.sms.max(1)) * per_sm;
        let blocks = (n.div_ceil(256) as u64).clamp(1, most);
        LaunchConfig {
            grid_dim: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `x · W^T` for `x` `[t, cols]` and `rows` weight rows of `cols` values: `[t, rows]`, every
    /// element the reference's `dot`. `None` when a raw weight dequantizes to a non-finite value
    /// (the CPU refuses such a weight and names it: the caller goes back to it).
    pub fn products(
        &self,
        x: &[f32],
        t: usize,
        w: Weights<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<f32>>> {
        if x.len() != t * cols {
            bail!(
                "cuda: reference products: {} input values for [{t}, {cols}]",
                x.len()
            );
        }
        if t == 0 || rows == 0 {
            return Ok(Some(vec![0.0; t * rows]));
        }
        let s = self.stream();
        let mut guard = self.buffers()?;
        let b = &mut *guard;
        let g = &self.gpu;
        check_weights(&w, rows, cols)?;
        let chunk_rows = self.product_buffers(b, (t, rows, cols))?;
        let xd = b.x.as_mut().context("cuda: no input buffer")?;
        self.put_f32(x, xd)?;
        // Nothing waits for the device until the output is read: each chunk's dequantized
        // weights are counted (non-finite values) and multiplied in stream order, and the
        // kernels' events are read once they are done.
        let mut events = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let n = chunk_rows.min(rows - r0);
            let values = n * cols;
            match &w {
                Weights::Raw { ty, bytes } => {
                    let per_row = row_bytes(*ty, cols)?;
                    let len = n * per_row;
                    let raw = at_least(g, &mut b.raw, len, "the reference's raw weights")?;
                    self.put(
                        &bytes[r0 * per_row..r0 * per_row + len],
                        &mut raw.slice_mut(..len),
                    )?;
                    self.dequant_chunk(b, *ty, (len, None), values)?;
                }
                Weights::Dense(v) => {
                    let wd = b.w.as_mut().context("cuda: no weight buffer")?;
                    self.put_f32(&v[r0 * cols..(r0 + n) * cols], wd)?;
                }
            }
            events.push(self.launch_chunk(b, (t, rows, cols), r0, n)?);
            r0 += n;
        }
        let out = b.out.as_ref().context("cuda: no output buffer")?;
        let mut host = vec![0f32; t * rows];
        s.memcpy_dtoh(&out.slice(..t * rows), &mut host)
            .context("cuda: reading the reference's products")?;
        let count = b.count.as_ref().context("cuda: no counter")?;
        let nonfinite = s
            .clone_dtoh(count)
            .context("cuda: reading a counter")?
            .first()
            .copied()
            .unwrap_or(0);
        s.synchronize().context("cuda: the reference's products")?;
        let ran = elapsed(&events)?;
        if let Ok(mut k) = self.kernel_seconds.lock() {
            *k += ran;
        }
        // An output past 1 GiB (a long prompt's logits) is not kept for the next product.
        if t * rows * 4 > 1 << 30 {
            b.out = None;
        }
        if nonfinite > 0 {
            return Ok(None);
        }
        Ok(Some(host))
    }

    /// The MLA attention of `n` query rows (`q` `[n, h, nope + rd]`: each row's q_nope then
    /// q_rot per head) over the keys and values of `kv` (`[T, h, nope + v]`: K's nope part then V
    /// per head) and `kpe` (`[T, rd]`): query `i` sees the keys `keys[offs[i]..offs[i + 1]]`
    /// (ascending, each `< T`). The scores are made here (`cuda/reference.cu`
    /// `reference_mla_scores`) and handed, a chunk of query rows at a time, to `softmax`
    /// (query rows `range`, their scores laid out per query and head as the kernel's comment
    /// says), which turns them into probabilities in place; the weighted sums are made here
    /// (`reference_mla_sums`). Returns the heads `[n, h * v]`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla(
        &self,
        q: &[f32],
        kv: &[f32],
        kpe: &[f32],
        offs: &[u64],
        keys: &[u32],
        d: MlaDims,
        scale: f64,
        softmax: &mut Softmax<'_>,
    ) -> Result<Vec<f32>> {
        let MlaDims {
            heads: h,
            nope,
            rope: rd,
            v,
        } = d;
        let n = offs.len().saturating_sub(1);
        let (qk, kvw) = (nope + rd, nope + v);
        let t = kpe.len().checked_div(rd).unwrap_or(0);
        if q.len() != n * h * qk
            || kv.len() != t * h * kvw
            || offs.last().copied() != Some(keys.len() as u64)
            || keys.iter().any(|&k| k as usize >= t)
        {
            bail!(
                "cuda: reference attention: {} query values, {} kv values, {} keys for {n} rows of {h} heads",
                q.len(),
                kv.len(),
                keys.len()
            );
        }
        if n == 0 || h == 0 || v == 0 {
            return Ok(vec![0.0; n * h * v]);
        }
        let g = &self.gpu;
        let s = self.stream();
        let mut qd = g.alloc_zeroed::<f32>(q.len(), "the reference's attention queries")?;
        self.put_f32(q, &mut qd)?;
        let mut kvd = g.alloc_zeroed::<f32>(kv.len().max(1), "the reference's keys and values")?;
        self.put_f32(kv, &mut kvd)?;
        let mut kpd = g.alloc_zeroed::<f32>(kpe.len().max(1), "the reference's rotated keys")?;
        self.put_f32(kpe, &mut kpd)?;
        let mut od = g.alloc_zeroed::<u64>(offs.len(), "the reference's key offsets")?;
        self.put_values(offs, &mut od)?;
        let mut keyd = g.alloc_zeroed::<u32>(keys.len().max(1), "the reference's keys")?;
        self.put_values(keys, &mut keyd)?;
        let mut out = g.alloc_zeroed::<f32>(n * h * v, "the reference's attention heads")?;
        // Query rows in chunks whose scores take at most ATTENTION_SCORES values.
        let mut chunks = Vec::new();
        let mut c0 = 0;
        while c0 < n {
            let mut c1 = c0 + 1;
            while c1 < n && (offs[c1 + 1] - offs[c0]) as usize * h <= ATTENTION_SCORES {
                c1 += 1;
            }
            chunks.push(c0..c1);
            c0 = c1;
        }
        let most = chunks
            .iter()
            .map(|r| (offs[r.end] - offs[r.start]) as usize * h)
            .max()
            .unwrap_or(0);
        let mut scores = g.alloc_zeroed::<f64>(most.max(1), "the reference's attention scores")?;
        let mut bufs = self.buffers()?;
        if bufs.scores_host.as_ref().is_none_or(|b| b.len() < most) {
            bufs.scores_host = None;
            // SAFETY: the memory is unset; nothing reads it before a copy from the device
            // fills the values read (each chunk's first `m`).
            let b = unsafe { g.context().alloc_pinned_with_flags::<f64>(most.max(1), 0) }
                .with_context(|| {
                    format!(
                        "cuda: cannot allocate {} MiB of pinned memory for attention scores",
                        (most * 8) >> 20
                    )
                })?;
            bufs.scores_host = Some(b);
        }
        let host = bufs
            .scores_host
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("cuda: no pinned memory for attention scores"))?
            .as_mut_slice()
            .context("cuda: pinned memory for attention scores")?;
        let scores_f = g.function("reference", REFERENCE_SOURCE, "reference_mla_scores")?;
        let sums_f = g.function("reference", REFERENCE_SOURCE, "reference_mla_sums")?;
        let u = |x: usize, what: &str| -> Result<u32> {
            u32::try_from(x).with_context(|| format!("cuda: reference attention: {what} {x}"))
        };
        let (hu, nu, ru, vu) = (u(h, "heads")?, u(nope, "nope")?, u(rd, "rope")?, u(v, "v")?);
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::new();
        // Every path out of the chunks waits for the stream (a copy may still read the pinned
        // scores when an error stops them).
        let ran_chunks = (|| -> Result<Vec<f32>> {
            for r in chunks {
                let m = (offs[r.end] - offs[r.start]) as usize * h;
                let base = offs[r.start];
                let grid = (u(r.len(), "query rows")?, hu, 1);
                let q_view = qd.slice(r.start * h * qk..);
                let o_view = od.slice(r.start..);
                let start = s.record_event(timing).context("cuda: an event")?;
                let mut sc = scores.slice_mut(..m);
                let mut b = s.launch_builder(&scores_f);
                b.arg(&q_view)
                    .arg(&kvd)
                    .arg(&kpd)
                    .arg(&o_view)
                    .arg(&keyd)
                    .arg(&mut sc)
                    .arg(&hu)
                    .arg(&nu)
                    .arg(&ru)
                    .arg(&vu)
                    .arg(&scale)
                    .arg(&base);
                // SAFETY: query row i < r.len() of the view reads q[(i h + hd) qk + c] for c < qk,
                // inside `qd` (n h qk values); its keys keys[offs[i]..offs[i + 1]] (offs ends at
                // keys.len(), checked) are each < T (checked), so kv and kpe reads stay inside
                // [T, h, nope + v] and [T, rd]; it writes (offs[i] - base) h + hd len + j < m for
                // j < len, inside `sc` (m values). Shared memory: qk doubles.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: grid,
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: u(qk * 8, "query bytes")?,
                    })
                }
                .context("cuda: launching reference_mla_scores")?;
                let mid = s.record_event(timing).context("cuda: an event")?;
                events.push((start, mid));
                // The scores through pinned memory both ways (the stream waited for before the
                // host touches it, and before this returns: every path ends in a synchronize).
                let (src, rec) = scores.device_ptr(s);
                // SAFETY: `host` holds at least `most >= m` values, `scores` at least m; `host` is
                // pinned memory not touched by the host before the synchronize below.
                let copied =
                    unsafe { result::memcpy_dtoh_async(&mut host[..m], src, s.cu_stream()) };
                drop(rec);
                let waited = s.synchronize();
                copied.context("cuda: reading the reference's attention scores")?;
                waited.context("cuda: the reference's attention scores")?;
                softmax(&mut host[..m], r.clone())?;
                let (dst, rec) = scores.device_ptr_mut(s);
                // SAFETY: as above; the host does not write `host` again before the next
                // chunk's synchronize, or the one that ends this call (on every path).
                let copied = unsafe { result::memcpy_htod_async(dst, &host[..m], s.cu_stream()) };
                drop(rec);
                copied.context("cuda: copying the reference's attention probabilities")?;
                let start = s.record_event(timing).context("cuda: an event")?;
                let mut o_out = out.slice_mut(r.start * h * v..);
                let mut b = s.launch_builder(&sums_f);
                b.arg(&scores)
                    .arg(&kvd)
                    .arg(&o_view)
                    .arg(&keyd)
                    .arg(&mut o_out)
                    .arg(&hu)
                    .arg(&nu)
                    .arg(&vu)
                    .arg(&base);
                // SAFETY: reads the probabilities at the offsets the scores were written to (< m,
                // inside `scores`), V values inside [T, h, nope + v] (keys < T), and writes
                // (i h + hd) v + d < r.len() h v for the chunk's rows, inside `out` from row r.start.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: grid,
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .context("cuda: launching reference_mla_sums")?;
                let end = s.record_event(timing).context("cuda: an event")?;
                events.push((start, end));
            }
            let mut heads = vec![0f32; n * h * v];
            s.memcpy_dtoh(&out, &mut heads)
                .context("cuda: reading the reference's attention heads")?;
            s.synchronize().context("cuda: the reference's attention")?;
            Ok(heads)
        })();
        if ran_chunks.is_err() {
            let _ = s.synchronize();
        }
        let heads = ran_chunks?;
        let ran = elapsed(&events)?;
        if let Ok(mut k) = self.kernel_seconds.lock() {
            *k += ran;
        }
        Ok(heads)
    }

    /// The DSA indexer's scores `[t, t]` (`-inf` above the diagonal) from `q` `[t, ni, di]`,
    /// `k` `[t, di]` and the head weights `hw` `[t, ni]` (`cuda/reference.cu`
    /// `reference_index_scores`: the CPU reference's `index_scores`, bit for bit), query rows in
    /// chunks of at most [`ATTENTION_SCORES`] scores. `Ok(None)` when a row's q and weights do
    /// not fit a block's shared memory.
    pub fn index_scores(
        &self,
        q: &[f32],
        k: &[f32],
        hw: &[f32],
        (t, ni, di): (usize, usize, usize),
        scale: f64,
        relu: bool,
    ) -> Result<Option<Vec<f32>>> {
        if q.len() != t * ni * di || k.len() != t * di || hw.len() != t * ni {
            bail!(
                "cuda: reference index scores: {} query values, {} key values, {} head weights for {t} rows of {ni} heads of {di}",
                q.len(),
                k.len(),
                hw.len()
            );
        }
        if t == 0 {
            return Ok(Some(Vec::new()));
        }
        const NAME: &str = "reference_index_scores";
        let smem = (ni * di + ni) * 8;
        if self
            .gpu
            .opt_in_shared("reference", REFERENCE_SOURCE, NAME, smem)?
            .is_err()
        {
            return Ok(None);
        }
        let u = |x: usize, what: &str| -> Result<u32> {
            u32::try_from(x).with_context(|| format!("cuda: reference index scores: {what} {x}"))
        };
        let (tu, nu, du, su) = (
            u(t, "rows")?,
            u(ni, "heads")?,
            u(di, "width")?,
            u(smem, "bytes")?,
        );
        let g = &self.gpu;
        let s = self.stream();
        let mut qd = g.alloc_zeroed::<f32>(q.len().max(1), "the reference's indexer queries")?;
        self.put_f32(q, &mut qd)?;
        let mut kd = g.alloc_zeroed::<f32>(k.len().max(1), "the reference's indexer keys")?;
        self.put_f32(k, &mut kd)?;
        let mut wd = g.alloc_zeroed::<f32>(hw.len().max(1), "the reference's indexer weights")?;
        self.put_f32(hw, &mut wd)?;
        let rows = (ATTENTION_SCORES / t).clamp(1, t);
        let mut od = g.alloc_zeroed::<f32>(rows * t, "the reference's index scores")?;
        let f = g.function("reference", REFERENCE_SOURCE, NAME)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut out = vec![0f32; t * t];
        let mut events = Vec::new();
        let relu = u32::from(relu);
        for r0 in (0..t).step_by(rows) {
            let m = rows.min(t - r0);
            let r0u = u(r0, "row")?;
            let start = s.record_event(timing).context("cuda: an event")?;
            let mut b = s.launch_builder(&f);
            b.arg(&qd)
                .arg(&kd)
                .arg(&wd)
                .arg(&mut od)
                .arg(&tu)
                .arg(&nu)
                .arg(&du)
                .arg(&scale)
                .arg(&relu)
                .arg(&r0u);
            // SAFETY: block i < m makes row r0 + i < t: it reads q[(r0 + i) ni di ..][.. ni di],
            // hw[(r0 + i) ni ..][.. ni] and k rows s <= r0 + i < t, inside the t ni di, t ni and
            // t di values uploaded, and writes od[i t + s] for s < t, inside od's rows * t >= m t
            // values. Shared memory: ni di + ni doubles (opted in above).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (u(m, "rows")?, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: su,
                })
            }
            .with_context(|| format!("cuda: launching {NAME}"))?;
            let end = s.record_event(timing).context("cuda: an event")?;
            events.push((start, end));
            s.memcpy_dtoh(&od.slice(..m * t), &mut out[r0 * t..(r0 + m) * t])
                .context("cuda: reading the reference's index scores")?;
        }
        s.synchronize()
            .context("cuda: the reference's index scores")?;
        let ran = elapsed(&events)?;
        if let Ok(mut k) = self.kernel_seconds.lock() {
            *k += ran;
        }
        Ok(Some(out))
    }

    /// [`ReferenceProducts::launch_with`] of the buffers' input and dequantized weights into
    /// their output, with the device's tiling.
    fn launch_chunk(
        &self,
        b: &mut Buffers,
        dims: (usize, usize, usize),
        r0: usize,
        n: usize,
    ) -> Result<(CudaEvent, CudaEvent)> {
        let (xd, wd, out) = (
            b.x.as_ref().context("cuda: no input buffer")?,
            b.w.as_ref().context("cuda: no weight buffer")?,
            b.out.as_mut().context("cuda: no output buffer")?,
        );
        self.launch_with(self.kernel, xd, wd, out, dims, r0, n)
    }

    /// Launches the products of weight rows `r0..r0 + n` (the first `n` rows of `w`) into
    /// columns `r0..r0 + n` of `out` (`[t, rows]`) with tiling `kernel` of [`KERNELS`], between
    /// two recorded events (what [`elapsed`] reads once the stream has passed them).
    #[allow(clippy::too_many_arguments)]
    fn launch_with(
        &self,
        kernel: usize,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        (t, rows, cols): (usize, usize, usize),
        r0: usize,
        n: usize,
    ) -> Result<(CudaEvent, CudaEvent)> {
        let (name, tile_tokens, tile_rows) = if t <= FEW_TOKENS {
            FEW
        } else {
            KERNELS[kernel]
        };
        let f = self.gpu.function("reference", REFERENCE_SOURCE, name)?;
        let u = |v: usize, what: &str| -> Result<u32> {
            u32::try_from(v).with_context(|| format!("cuda: reference products: {what} {v}"))
        };
        let (tu, nu, ku, ldo) = (
            u(t, "tokens")?,
            u(n, "rows")?,
            u(cols, "columns")?,
            u(rows, "rows")?,
        );
        let cfg = LaunchConfig {
            grid_dim: (
                u(n.div_ceil(tile_rows), "row tiles")?,
                u(t.div_ceil(tile_tokens), "token tiles")?,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if cfg.grid_dim.1 > 65_535 {
            bail!("cuda: reference products: {t} tokens are more than a launch takes");
        }
        if x.len() < t * cols || w.len() < n * cols || out.len() < t * rows || r0 + n > rows {
            bail!("cuda: reference products: buffers too small for [{t}, {cols}] x [{n}, {cols}]");
        }
        let s = self.stream();
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = s.record_event(timing).context("cuda: an event")?;
        let mut dst = out.slice_mut(r0..);
        let mut b = s.launch_builder(&f);
        b.arg(x)
            .arg(w)
            .arg(&mut dst)
            .arg(&tu)
            .arg(&nu)
            .arg(&ku)
            .arg(&ldo);
        // SAFETY: `x` holds t * cols values and `w` at least n * cols (checked); the kernel
        // reads x[i * cols + c] for i < t, c < cols and w[j * cols + c] for j < n, and writes
        // dst[i * ldo + j] for i < t, j < n: the last is (t - 1) * rows + n - 1 < t * rows - r0,
        // inside `out` from column r0 (checked: n <= rows - r0, out holds t * rows).
        unsafe { b.launch(cfg) }.with_context(|| format!("cuda: launching {name}"))?;
        let end = s.record_event(timing).context("cuda: an event")?;
        Ok((start, end))
    }

    /// Adds the non-finite values among the first `n` of `v` to `count` (on the stream: read
    /// it once the stream has passed this).
    fn count_nonfinite(
        &self,
        v: &CudaSlice<f32>,
        n: usize,
        count: &mut CudaSlice<u64>,
    ) -> Result<()> {
        let s = self.stream();
        let f = self
            .gpu
            .function("reference", REFERENCE_SOURCE, "reference_count_nonfinite")?;
        let n64 = n as u64;
        let mut b = s.launch_builder(&f);
        b.arg(v).arg(&n64).arg(count);
        // SAFETY: `v` holds at least n values; `count` one counter.
        unsafe { b.launch(self.strided(n, 8)) }
            .context("cuda: launching reference_count_nonfinite")?;
        Ok(())
    }
}

/// A product queued by [`ReferenceProducts::submit`]: the events around its kernels and the
/// one after its copies back.
pub struct Sent {
    events: Vec<(CudaEvent, CudaEvent)>,
    done: CudaEvent,
}

impl Sent {
    /// Waits for the product and reads it from `parcel` (the one it was submitted with): its
    /// output `[t, rows]` (`None` when a raw weight dequantized to a non-finite value) and the
    /// seconds its kernels ran.
    pub fn wait(self, parcel: &mut Parcel) -> Result<(Option<Vec<f32>>, f64)> {
        self.done
            .synchronize()
            .context("cuda: the reference's products")?;
        let ran = elapsed(&self.events)?;
        let (out, nonfinite) = parcel.read()?;
        Ok(((nonfinite == 0).then_some(out), ran))
    }

    /// [`Sent::wait`] of a product queued by [`ReferenceProducts::submit_device`] with its
    /// hash, with the device weights' hash.
    pub fn wait_hashed(self, parcel: &mut Parcel) -> Result<(Option<Vec<f32>>, f64, u64)> {
        let (out, ran) = self.wait(parcel)?;
        Ok((out, ran, parcel.read_hash()?))
    }
}

/// The seconds between each pair of events, added (waits for the last).
fn elapsed(events: &[(CudaEvent, CudaEvent)]) -> Result<f64> {
    let mut total = 0.0;
    for (start, end) in events {
        end.synchronize()
            .context("cuda: the reference's products")?;
        let ms = start.elapsed_ms(end).context("cuda: timing a product")?;
        total += f64::from(ms) / 1e3;
    }
    Ok(total)
}
