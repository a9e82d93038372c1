//! Pinned host memory that one reference product's values travel through ([`Parcel`]): its
//! input and weights are packed there by the thread that asks for the product, before it takes
//! the device's turn, and its output comes back there; the device's turn only queues the copies
//! and the kernels (`ReferenceProducts::submit`). Many threads asking for small products (a
//! layer's routed experts, each a few MiB) then keep the device busy instead of waiting while
//! one of them copies its values.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, PinnedHostSlice};

use crate::quant::GgmlType;

/// Most bytes of one product packed in a parcel: its input, weights, output and counter (a
/// GLM-5 routed expert's at 4096 tokens: about 128 tokens x 6144 inputs, 2048 x 6144 Q4_K
/// weights and 128 x 2048 outputs, 11 MiB). A larger product goes through the shared staging
/// buffers during its turn.
pub const PARCEL_BYTES: usize = 64 << 20;

/// The smallest parcel allocated (parcels are kept and reused; a product that needs more than
/// any kept one gets a new one).
const SMALLEST: usize = 16 << 20;

/// Where each part of a product lies in its parcel (byte ranges, each 256-byte aligned).
#[derive(Clone, Debug)]
pub struct Layout {
    /// The input, `[t, cols]` f32.
    pub x: Range<usize>,
    /// The weights: raw GGUF rows or f32 values.
    pub w: Range<usize>,
    /// The output, `[t, rows]` f32.
    pub out: Range<usize>,
    /// The count of non-finite weight values (u64).
    pub count: Range<usize>,
    /// The hash of device weights ([`Packed::OnDevice`], when asked; u64).
    pub hash: Range<usize>,
}

/// What a parcel's weights are.
#[derive(Clone, Copy, Debug)]
pub enum Packed {
    /// Raw GGUF rows of this type.
    Raw(GgmlType),
    /// f32 values.
    Dense,
    /// None: raw GGUF rows of this type already on the device (another engine's,
    /// `gpu::resident`), given when the product is queued (`ReferenceProducts::submit_device`).
    OnDevice(GgmlType),
}

/// One product's values in pinned memory (see the module's text), with its shape.
pub struct Parcel {
    /// The pinned bytes (at least `layout.hash.end`).
    pub(super) buf: PinnedHostSlice<u8>,
    /// Their address in the device's address space (the memory is mapped there); `None` when
    /// the driver gave none (then only copies reach them: `ReferenceProducts::submit`).
    pub(super) dev: Option<u64>,
    /// Where its parts lie.
    pub layout: Layout,
    /// What its weights are.
    pub packed: Packed,
    /// Tokens, weight rows, columns.
    pub dims: (usize, usize, usize),
}

/// Kept parcels, and the context that allocates new ones.
pub struct Parcels {
    ctx: Arc<CudaContext>,
    /// Kept parcels' memory, with its device address.
    free: Mutex<Vec<(PinnedHostSlice<u8>, Option<u64>)>>,
}

/// `n` rounded up to 256.
fn aligned(n: usize) -> usize {
    n.div_ceil(256) * 256
}

impl Parcels {
    /// No parcels yet; new ones from `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Parcels {
        Parcels {
            ctx,
            free: Mutex::new(Vec::new()),
        }
    }

    /// The product of `x` (`[t, cols]`) with `rows` weight rows of `cols` values from `w`,
    /// packed in a parcel; `None` when it needs more than [`PARCEL_BYTES`] (or is empty). The caller gives
    /// the parcel back ([`Parcels::give`]) once its output is read.
    pub fn pack(
        &self,
        x: &[f32],
        t: usize,
        w: &Weights<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Parcel>> {
        check_input(x, t, cols)?;
        check_weights(w, rows, cols)?;
        let (w_bytes, packed): (&[u8], Packed) = match w {
            Weights::Raw { ty, bytes } => (bytes, Packed::Raw(*ty)),
            Weights::Dense(v) => (f32_bytes(v), Packed::Dense),
        };
        if t == 0 || rows == 0 {
            return Ok(None);
        }
        let Some(mut parcel) = self.parcel(x, t, w_bytes.len(), packed, (rows, cols))? else {
            return Ok(None);
        };
        let at = parcel.layout.w.clone();
        parcel
            .buf
            .as_mut_slice()
            .context("cuda: a product's pinned memory")?[at]
            .copy_from_slice(w_bytes);
        Ok(Some(parcel))
    }

    /// The input `x` (`[t, cols]`) of a product with `rows` raw rows of `ty` already on the
    /// device, packed in a parcel with room for the output, the count and the weights' hash;
    /// `None` when it needs more than [`PARCEL_BYTES`] (or is empty). Given back as
    /// [`Parcels::pack`]'s.
    pub fn pack_input(
        &self,
        x: &[f32],
        t: usize,
        ty: GgmlType,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Parcel>> {
        check_input(x, t, cols)?;
        row_bytes(ty, cols)?;
        if t == 0 || rows == 0 {
            return Ok(None);
        }
        self.parcel(x, t, 0, Packed::OnDevice(ty), (rows, cols))
    }

    /// A parcel laid out for `x` (copied in), `w_len` bytes of weights, the output of `t`
    /// tokens by `rows`, the count and the hash; `None` past [`PARCEL_BYTES`].
    fn parcel(
        &self,
        x: &[f32],
        t: usize,
        w_len: usize,
        packed: Packed,
        (rows, cols): (usize, usize),
    ) -> Result<Option<Parcel>> {
        let x_at = 0..x.len() * 4;
        let w_at = aligned(x_at.end)..aligned(x_at.end) + w_len;
        let out_at = aligned(w_at.end)..aligned(w_at.end) + t * rows * 4;
        let count_at = aligned(out_at.end)..aligned(out_at.end) + 8;
        let hash_at = count_at.end..count_at.end + 8;
        if hash_at.end > PARCEL_BYTES {
            return Ok(None);
        }
        let (mut buf, dev) = self.take(hash_at.end)?;
        buf.as_mut_slice()
            .context("cuda: a product's pinned memory")?[x_at.clone()]
        .copy_from_slice(f32_bytes(x));
        Ok(Some(Parcel {
            buf,
            dev,
            layout: Layout {
                x: x_at,
                w: w_at,
                out: out_at,
                count: count_at,
                hash: hash_at,
            },
            packed,
            dims: (t, rows, cols),
        }))
    }

    /// A kept parcel of at least `n` bytes (the smallest such), or a new one, with its device
    /// address.
    fn take(&self, n: usize) -> Result<(PinnedHostSlice<u8>, Option<u64>)> {
        if let Ok(mut free) = self.free.lock() {
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, (b, _))| b.len() >= n)
                .min_by_key(|(_, (b, _))| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(free.swap_remove(i));
            }
        }
        let size = n.next_power_of_two().clamp(SMALLEST, PARCEL_BYTES).max(n);
        // SAFETY: the memory is unset; the host reads only what it wrote (the input and
        // weights) or what the device wrote before the product's end event (the outputs).
        let mut buf = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<u8>(size, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .with_context(|| {
            format!(
                "cuda: cannot allocate {} MiB of pinned memory for a reference product",
                size >> 20
            )
        })?;
        let host = buf
            .as_mut_ptr()
            .context("cuda: a product's pinned memory")?;
        let mut dev = 0u64;
        // SAFETY: `host` is the start of a live allocation of cuMemHostAlloc, mapped into the
        // device's address space (CU_MEMHOSTALLOC_DEVICEMAP); `dev` receives its address there.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
                &mut dev,
                host as *mut std::ffi::c_void,
                0,
            )
        };
        // Without an address the parcel still serves the products whose values are copied.
        let dev = (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(dev);
        Ok((buf, dev))
    }

    /// Keeps `parcel`'s memory for another product (the copies that used it are done: the
    /// caller waited for them).
    pub fn give(&self, parcel: Parcel) {
        if let Ok(mut free) = self.free.lock() {
            free.push((parcel.buf, parcel.dev));
        }
    }
}

impl Parcel {
    /// The output `[t, rows]` and the count of non-finite weight values, read from the parcel
    /// (after the copies back are done).
    pub(super) fn read(&mut self) -> Result<(Vec<f32>, u64)> {
        let b = self
            .buf
            .as_mut_slice()
            .context("cuda: a product's pinned memory")?;
        let out: Vec<f32> = b[self.layout.out.clone()]
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let count = word(&b[self.layout.count.clone()]);
        Ok((out, count))
    }

    /// The device weights' hash read from the parcel (after the copies back are done).
    pub(super) fn read_hash(&mut self) -> Result<u64> {
        let b = self
            .buf
            .as_mut_slice()
            .context("cuda: a product's pinned memory")?;
        Ok(word(&b[self.layout.hash.clone()]))
    }
}

/// The u64 of 8 bytes (native order, as the device wrote it).
fn word(c: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    for (d, s) in w.iter_mut().zip(c) {
        *d = *s;
    }
    u64::from_ne_bytes(w)
}

/// The bytes of f32 values.
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte of it may be read as u8; the view covers
    // exactly `v`'s values.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Where a product's weights come from.
pub enum Weights<'a> {
    /// Raw GGUF blocks of `ty`, whole rows of `cols` values, dequantized on the device.
    Raw {
        /// The GGML type.
        ty: GgmlType,
        /// The rows' bytes.
        bytes: &'a [u8],
    },
    /// f32 values, row-major.
    Dense(&'a [f32]),
}

/// Whether `x` holds `t` tokens of `cols` values.
fn check_input(x: &[f32], t: usize, cols: usize) -> Result<()> {
    if x.len() != t * cols {
        bail!(
            "cuda: reference products: {} input values for [{t}, {cols}]",
            x.len()
        );
    }
    Ok(())
}

/// Whether `w` holds `rows` rows of `cols` values (whole blocks of its type, when raw).
pub(super) fn check_weights(w: &Weights<'_>, rows: usize, cols: usize) -> Result<()> {
    match w {
        Weights::Raw { ty, bytes } => {
            let per_row = row_bytes(*ty, cols)?;
            if bytes.len() != rows * per_row {
                bail!(
                    "cuda: reference products: {} bytes of {ty} for {rows} rows of {cols}",
                    bytes.len()
                );
            }
        }
        Weights::Dense(v) => {
            if v.len() != rows * cols {
                bail!(
                    "cuda: reference products: {} weight values for [{rows}, {cols}]",
                    v.len()
                );
            }
        }
    }
    Ok(())
}

/// Bytes of one row of `cols` values of `ty` (whole blocks).
pub(super) fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if bs == 0 || cols % bs != 0 {
        bail!("cuda: reference products: rows of {cols} values are not whole blocks of {ty}");
    }
    Ok(cols / bs * ts)
}
