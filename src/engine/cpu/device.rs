//! The reference's large matrix products on a device's f64 units, the same bits.
//!
//! A product of [`MIN_TOKENS`] tokens or more (a long prompt's projections, the experts that
//! many tokens chose, the kv product) can be made by `gpu::reference`: the weights' raw GGUF
//! blocks dequantized on the device by the bit-exact kernels, then every element summed as
//! [`math::dot`] sums it (8 f64 lanes by column, the same tree, one rounding to f32). Nothing
//! about the values changes, so the reference stays the definition: what changes is where its
//! multiply-adds run.
//!
//! Each product made on the device is checked on the CPU before it is used: [`CHECK_ROWS`]
//! weight rows by [`CHECK_TOKENS`] tokens (the first, the last, and others spread between)
//! dequantized and summed by [`math::dot`] here, and compared bit for bit. A difference names
//! the tensor, the element and both values (the device, its driver or the kernels are then not
//! computing the definition): with `--reference-on cuda:N` it is an error; with `auto` the
//! device is set aside, this product and every later one are the CPU's, and the run's note says
//! why (as it does for a failure of the device itself: a copy, a launch, its memory). A weight that dequantizes to a non-finite value goes back to the CPU path, which names
//! it.

use std::sync::Mutex;

use anyhow::{bail, Context, Result};

use super::math::{self, dot};
use super::weights::{Matrix, RowSource};

/// Fewest tokens of a product made on the device: with fewer, the weights' upload costs more
/// than the CPU's dequantization and products (a short prompt's products are bound by reading
/// the weights, which the CPU does once either way).
pub const MIN_TOKENS: usize = 32;

/// The fewest tokens of a product made on the device as the process set it
/// (`--reference-min-tokens`: [`set_min_tokens`]), [`MIN_TOKENS`] unless set.
pub fn min_tokens() -> usize {
    MIN_TOKENS_SET.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets the fewest tokens of a product made on the devices of references built from now on (at
/// least 1).
pub fn set_min_tokens(n: usize) {
    MIN_TOKENS_SET.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

static MIN_TOKENS_SET: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(MIN_TOKENS);

/// Weight rows of each product checked on the CPU.
pub const CHECK_ROWS: usize = 4;

/// Tokens of each product checked on the CPU (for each checked row).
pub const CHECK_TOKENS: usize = 3;

/// What turns a chunk of an attention's scores (its query rows given) into probabilities, in
/// place (`gpu::reference::Softmax` where there is a device).
pub type Softmax<'a> = dyn FnMut(&mut [f64], std::ops::Range<usize>) -> Result<()> + 'a;

/// Fewest query rows of an attention made on the device (the keys and values' upload costs
/// more than a few rows' scores).
pub const MIN_QUERIES: usize = 32;

/// Query rows of each attention made on the device that the CPU also computes, every head and
/// value compared bit for bit.
pub const CHECK_QUERIES: usize = 3;

/// What the device did for the reference so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceWork {
    /// Products made on the device.
    pub products: u64,
    /// Their multiply-adds.
    pub multiply_adds: f64,
    /// Their elements checked on the CPU (all equal, or the run stopped).
    pub checked: u64,
    /// Seconds spent in them (uploads, dequantization, products, downloads).
    pub seconds: f64,
    /// The part of `seconds` the product kernels ran (device events).
    pub kernel_seconds: f64,
    /// Products left to the CPU for having fewer than [`MIN_TOKENS`] tokens.
    pub on_cpu: u64,
    /// Their multiply-adds.
    pub on_cpu_multiply_adds: f64,
    /// MLA attentions made on the device (scores and weighted sums; the softmax on the CPU).
    pub attentions: u64,
    /// Their query rows.
    pub attention_rows: u64,
    /// Seconds spent in them (also in `seconds`; their kernels also in `kernel_seconds`).
    pub attention_seconds: f64,
    /// The part of `seconds` spent handing host values to the device (staging them).
    pub upload_seconds: f64,
    /// Seconds the reference's threads waited for the device while another product had it
    /// (summed over threads, like `seconds`).
    pub wait_seconds: f64,
    /// The part of `products` packed in pinned memory by their callers before their turn
    /// (`gpu::parcels`), their turn only queuing their copies and kernels.
    pub packed: u64,
    /// DSA index score matrices made on the device.
    pub index_scores: u64,
    /// Their query rows.
    pub index_rows: u64,
    /// Seconds spent in them (also in `seconds`; their kernels also in `kernel_seconds`).
    pub index_seconds: f64,
    /// The part of `products` made from weight bytes the CUDA candidate put on the device
    /// (`gpu::resident`, `--reference-reuse`), whatever their token count.
    pub reused: u64,
    /// The candidate's device bytes proven to be the file's by their hash before that use.
    pub reused_bytes: u64,
    /// Seconds spent hashing them (host and device; also in `seconds`).
    pub hash_seconds: f64,
    /// Spans of the candidate's device bytes that differed from the file (not used).
    pub refused: u64,
}

/// The reference's device: `gpu::reference` behind a lock (the reference's steps call it one
/// product at a time; rayon's threads may ask together), and what it did.
pub struct Device {
    #[cfg(feature = "cuda")]
    products: Mutex<crate::gpu::reference::ReferenceProducts>,
    /// Pinned memory for the products small enough to be packed by their callers before their
    /// turn ([`crate::gpu::parcels`]).
    #[cfg(feature = "cuda")]
    parcels: crate::gpu::parcels::Parcels,
    describe: String,
    /// Each tiling's measured rate and the one used, in words.
    kernels: String,
    work: Mutex<DeviceWork>,
    /// A difference from the CPU is an error (`--reference-on cuda:N`); else (`auto`) the
    /// device is set aside and the CPU makes every product from then on, with a note.
    strict: bool,
    /// Why the device was set aside, once it was.
    set_aside: Mutex<Option<String>>,
    /// Fewest tokens of a product made here ([`min_tokens`] at open).
    pub min_tokens: usize,
    /// The device's ordinal.
    #[cfg(feature = "cuda")]
    ordinal: usize,
    /// Spans of the candidate's device bytes hashed so far, and whether they were the file's.
    #[cfg(feature = "cuda")]
    proven: Mutex<std::collections::HashMap<Proof, bool>>,
    /// The first span of the candidate's device bytes that differed from the file, in words.
    refusal: Mutex<Option<String>>,
    /// Opened for the products made from the CUDA candidate's device bytes alone (a prompt
    /// shorter than `min_tokens`): every other product stays on the CPU.
    pub reuse_only: bool,
}

impl Device {
    /// Device `ordinal` for the reference's products (its kernels start compiling now).
    #[cfg(feature = "cuda")]
    pub fn open(ordinal: usize, strict: bool) -> Result<Device> {
        let p = crate::gpu::reference::ReferenceProducts::open(ordinal)?;
        let (rates, used) = p.kernel_rates();
        let rates: Vec<String> = rates
            .iter()
            .map(|(k, r)| format!("{k} {:.0} G/s", r))
            .collect();
        Ok(Device {
            describe: p.describe(),
            kernels: format!("{} (used: {used})", rates.join(", ")),
            parcels: p.parcels(),
            products: Mutex::new(p),
            work: Mutex::new(DeviceWork::default()),
            strict,
            set_aside: Mutex::new(None),
            min_tokens: min_tokens(),
            ordinal,
            proven: Mutex::new(std::collections::HashMap::new()),
            refusal: Mutex::new(None),
            reuse_only: false,
        })
    }

    /// Without the `cuda` feature there is no device.
    #[cfg(not(feature = "cuda"))]
    pub fn open(ordinal: usize, _strict: bool) -> Result<Device> {
        bail!("cuda:{ordinal}: this glmdiff was built without the cuda feature")
    }

    /// The device, options and versions, for report headers.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// Why the device was set aside (a product that differed from the CPU's under `auto`), if
    /// it was.
    pub fn set_aside(&self) -> Option<String> {
        self.set_aside.lock().ok().and_then(|s| s.clone())
    }

    /// The first span of the CUDA candidate's device bytes whose hash differed from the file's
    /// (those products were made on the CPU), in words.
    pub fn refusal(&self) -> Option<String> {
        self.refusal.lock().ok().and_then(|r| r.clone())
    }

    /// Whether the device still makes products.
    fn in_use(&self) -> bool {
        self.set_aside.lock().map(|s| s.is_none()).unwrap_or(false)
    }

    /// Each tiling's multiply-add rate measured at open and the one used, in words.
    pub fn kernels(&self) -> &str {
        &self.kernels
    }

    /// Counts a product of `t` tokens and `madds` multiply-adds left to the CPU.
    fn declined(&self, t: usize, madds: f64) {
        if t == 0 {
            return;
        }
        if let Ok(mut w) = self.work.lock() {
            w.on_cpu += 1;
            w.on_cpu_multiply_adds += madds;
        }
    }

    /// What the device did so far.
    pub fn work(&self) -> DeviceWork {
        self.work.lock().map(|w| *w).unwrap_or_default()
    }

    /// `x · W^T` of `t` tokens with the rows of `src` on the device, checked; `None` when it
    /// is not made there (too few tokens, or a weight the CPU must name).
    pub(super) fn products_rows(
        &self,
        x: &[f32],
        t: usize,
        src: &RowSource<'_>,
    ) -> Result<Option<Vec<f32>>> {
        let (ty, bytes) = src.raw()?;
        let row = |r: usize, buf: &mut [f32]| src.dequantize_into(r..r + 1, buf);
        #[cfg(feature = "cuda")]
        if t > 0
            && (t < self.min_tokens || self.reuse_only)
            && crate::gpu::resident::reuse()
            && self.in_use()
        {
            if let Some(out) = self.reused(x, t, src, ty, bytes)? {
                return self.checked(
                    self.check(x, t, src.rows, src.cols, &out, src.name(), &row),
                    Some(out),
                );
            }
        }
        self.product(
            (x, t),
            (src.rows, src.cols),
            Raw::Gguf { ty, bytes },
            src.name(),
            &row,
        )
    }

    /// `x · W^T` of `t` tokens made from the CUDA candidate's device bytes of `src`'s rows
    /// (`gpu::resident`), once their hash proved them the file's (`bytes`, the reference's own
    /// map of them); `None` when the candidate offers none on this device, they differ from the
    /// file (counted, the first named in [`Device::refusal`]), or a weight is not finite. Not
    /// yet checked against the CPU (the caller does).
    #[cfg(feature = "cuda")]
    fn reused(
        &self,
        x: &[f32],
        t: usize,
        src: &RowSource<'_>,
        ty: crate::quant::GgmlType,
        bytes: &[u8],
    ) -> Result<Option<Vec<f32>>> {
        use crate::gpu::resident::{self, FileSpan};
        let Some((path, offset, len)) = src.file_range()? else {
            return Ok(None);
        };
        let span = FileSpan {
            path: path.to_path_buf(),
            offset,
            len,
        };
        let Some(on) = resident::find(&span, self.ordinal) else {
            return Ok(None);
        };
        let Some(view) = on.view(bytes.len()) else {
            return Ok(None);
        };
        let start = std::time::Instant::now();
        // Proven once per span and buffer (another buffer offered for the span is hashed anew).
        let proof = (
            span.clone(),
            std::sync::Arc::as_ptr(&on.buf) as usize,
            on.at,
        );
        let known = self.proven.lock().ok().and_then(|p| p.get(&proof).copied());
        if known == Some(false) {
            return Ok(None);
        }
        let hash = known.is_none();
        // The input packed by this thread before the device's turn, which only queues the
        // copies and kernels (and the hash of the bytes, not yet proven); this thread hashes
        // the file's bytes meanwhile, then waits for the product.
        let packed = self.parcels.pack_input(x, t, ty, src.rows, src.cols);
        let Some(mut parcel) = self.or_set_aside(packed)?.flatten() else {
            return Ok(None);
        };
        let (sent, wait_seconds) = {
            let t0 = std::time::Instant::now();
            let p = self.turn()?;
            let waited = t0.elapsed().as_secs_f64();
            (p.submit_device(&mut parcel, &view, hash), waited)
        };
        let h0 = std::time::Instant::now();
        let want = (hash && sent.is_ok()).then(|| resident::hash_bytes_host(bytes, 0));
        let hash_seconds = h0.elapsed().as_secs_f64();
        let done = sent.and_then(|s| s.wait_hashed(&mut parcel));
        // The buffer's handle goes only now: the products waited for their stream.
        drop(on);
        self.parcels.give(parcel);
        let Some((out, kernel_seconds, got)) = self.or_set_aside(done)? else {
            return Ok(None);
        };
        if let Some(want) = want {
            let same = got == want;
            if let Ok(mut p) = self.proven.lock() {
                p.insert(proof, same);
            }
            if let Ok(mut w) = self.work.lock() {
                w.hash_seconds += hash_seconds;
                if same {
                    w.reused_bytes += len;
                } else {
                    w.refused += 1;
                }
            }
            if !same {
                if let Ok(mut r) = self.refusal.lock() {
                    r.get_or_insert(format!(
                        "the candidate's device bytes of {} (bytes {offset}..{} of {}) hash to {got:#018x}, the file's to {want:#018x}",
                        src.name(),
                        offset + len,
                        span.path.display()
                    ));
                }
                return Ok(None);
            }
        }
        if out.is_some() {
            self.count_made(
                (t, src.rows, src.cols),
                start,
                [kernel_seconds, 0.0, wait_seconds],
                true,
            );
            if let Ok(mut w) = self.work.lock() {
                w.reused += 1;
            }
        }
        Ok(out)
    }

    /// `x · W^T` of `t` tokens with the host matrix `w` on the device, checked; `None` when it
    /// is not made there (too few tokens).
    pub(super) fn products_dense(
        &self,
        x: &[f32],
        t: usize,
        w: &Matrix,
        what: &str,
    ) -> Result<Option<Vec<f32>>> {
        self.product(
            (x, t),
            (w.rows, w.cols),
            Raw::Dense(&w.data),
            what,
            &|r, buf| {
                buf.copy_from_slice(w.row(r));
                Ok(())
            },
        )
    }

    /// The product of `x` (`t` tokens) with `rows` weight rows of `cols` values given by `w`
    /// (named `what`; `row(r, buf)` writes row `r` for the check) on the device, checked;
    /// `None` when it is not made there.
    fn product(
        &self,
        (x, t): (&[f32], usize),
        (rows, cols): (usize, usize),
        w: Raw<'_>,
        what: &str,
        row: &dyn Fn(usize, &mut [f32]) -> Result<()>,
    ) -> Result<Option<Vec<f32>>> {
        if t < self.min_tokens || self.reuse_only {
            self.declined(t, (t * rows) as f64 * cols as f64);
            return Ok(None);
        }
        if !self.in_use() {
            return Ok(None);
        }
        let out = self.made(x, t, rows, cols, w)?;
        match &out {
            Some(o) => self.checked(self.check(x, t, rows, cols, o, what, row), out),
            None => Ok(None),
        }
    }

    /// The MLA attention of `n` query rows on the device (see `gpu::reference`'s `mla` for
    /// the layouts; `softmax` turns a chunk's scores into probabilities on the CPU), checked:
    /// `cpu(rows)` computes the heads `[rows.len(), h * v]` of the query rows `rows` (indices
    /// into the call's rows) on the CPU, compared bit for bit at [`CHECK_QUERIES`] rows. `None`
    /// when it is not made there (fewer than [`MIN_QUERIES`] rows, the device set aside).
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn attention(
        &self,
        q: &[f32],
        kv: &[f32],
        kpe: &[f32],
        offs: &[u64],
        keys: &[u32],
        dims: (usize, usize, usize, usize),
        scale: f64,
        softmax: &mut Softmax<'_>,
        cpu: &dyn Fn(&[usize]) -> Result<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        let n = offs.len().saturating_sub(1);
        if n < MIN_QUERIES || self.reuse_only || !self.in_use() {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            let (heads, nope, rope, v) = dims;
            let start = std::time::Instant::now();
            let d = crate::gpu::reference::MlaDims {
                heads,
                nope,
                rope,
                v,
            };
            let made =
                self.run_there(|p| p.mla(q, kv, kpe, offs, keys, d, scale, softmax).map(Some))?;
            let Some((out, kernel_seconds)) = made else {
                return Ok(None);
            };
            let width = heads * v;
            let rows = spread(n, CHECK_QUERIES);
            let want = cpu(&rows)?;
            let check = match first_row_difference(&out, &want, &rows, width) {
                None => Ok(()),
                Some((i, c, got, want)) => Err(anyhow::anyhow!(
                    "engine: cpu: the reference's attention made on {} differs from the CPU's at query row {i} of {n}, head {}, value {}: {got:e} ({:#010x}) against {want:e} ({:#010x}); the device does not compute the reference's sums (run with --reference-on cpu)",
                    self.describe,
                    c / v.max(1),
                    c % v.max(1),
                    got.to_bits(),
                    want.to_bits()
                )),
            };
            let out = self.checked(check, Some(out))?;
            if out.is_some() {
                if let Ok(mut work) = self.work.lock() {
                    let took = start.elapsed().as_secs_f64();
                    work.attentions += 1;
                    work.attention_rows += n as u64;
                    work.attention_seconds += took;
                    work.seconds += took;
                    work.kernel_seconds += kernel_seconds;
                    work.checked += (rows.len() * width) as u64;
                }
            }
            Ok(out)
        }
        #[cfg(not(feature = "cuda"))]
        Ok(None)
    }

    /// The DSA index scores `[t, t]` of `q` `[t, ni, di]`, `k` `[t, di]` and `hw` `[t, ni]` on
    /// the device (`gpu::reference`'s `index_scores`), checked: `cpu(rows)` computes the rows
    /// `rows` (`[rows.len(), t]`) on the CPU, compared bit for bit at [`CHECK_QUERIES`] rows.
    /// `None` when it is not made there (fewer than [`MIN_QUERIES`] rows, the device set
    /// aside, a row too wide for a block).
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn index_scores(
        &self,
        q: &[f32],
        k: &[f32],
        hw: &[f32],
        (t, ni, di): (usize, usize, usize),
        scale: f64,
        relu: bool,
        cpu: &dyn Fn(&[usize]) -> Result<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        if t < MIN_QUERIES || self.reuse_only || !self.in_use() {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            let start = std::time::Instant::now();
            let made = self.run_there(|p| p.index_scores(q, k, hw, (t, ni, di), scale, relu))?;
            let Some((out, kernel_seconds)) = made else {
                return Ok(None);
            };
            let rows = spread(t, CHECK_QUERIES);
            let want = cpu(&rows)?;
            let check = match first_row_difference(&out, &want, &rows, t) {
                None => Ok(()),
                Some((i, c, got, want)) => Err(anyhow::anyhow!(
                    "engine: cpu: the reference's DSA index scores made on {} differ from the CPU's at query row {i} of {t}, key {c}: {got:e} ({:#010x}) against {want:e} ({:#010x}); the device does not compute the reference's sums (run with --reference-on cpu)",
                    self.describe,
                    got.to_bits(),
                    want.to_bits()
                )),
            };
            let out = self.checked(check, Some(out))?;
            if out.is_some() {
                if let Ok(mut work) = self.work.lock() {
                    let took = start.elapsed().as_secs_f64();
                    work.index_scores += 1;
                    work.index_rows += t as u64;
                    work.index_seconds += took;
                    work.seconds += took;
                    work.kernel_seconds += kernel_seconds;
                    work.checked += (rows.len() * t) as u64;
                }
            }
            Ok(out)
        }
        #[cfg(not(feature = "cuda"))]
        Ok(None)
    }

    /// `make` run with the device's products (under its lock), with the seconds its kernels
    /// ran; `None` when `make` declines, or when it fails under `auto` (the device is then set
    /// aside: the CPU makes this and everything after it). A failure under
    /// `--reference-on cuda:N` is the error.
    #[cfg(feature = "cuda")]
    fn run_there(
        &self,
        make: impl FnOnce(&crate::gpu::reference::ReferenceProducts) -> Result<Option<Vec<f32>>>,
    ) -> Result<Option<(Vec<f32>, f64)>> {
        let p = self.turn()?;
        let k0 = p.kernel_seconds();
        let made = self.or_set_aside(make(&p))?.flatten();
        Ok(made.map(|out| (out, p.kernel_seconds() - k0)))
    }

    /// The device's turn: its products, locked (the reference's threads ask one at a time).
    #[cfg(feature = "cuda")]
    fn turn(&self) -> Result<std::sync::MutexGuard<'_, crate::gpu::reference::ReferenceProducts>> {
        self.products
            .lock()
            .map_err(|_| anyhow::anyhow!("engine: cpu: the reference's device lock is poisoned"))
    }

    /// `r`'s value; a failure of the device or a difference from the CPU is the error under
    /// `--reference-on cuda:N`, else (`auto`) it sets the device aside (the CPU makes this
    /// product and every later one): `None`.
    fn or_set_aside<T>(&self, r: Result<T>) -> Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) if self.strict => Err(e),
            Err(e) => {
                if let Ok(mut s) = self.set_aside.lock() {
                    s.get_or_insert(format!("{e:#}"));
                }
                Ok(None)
            }
        }
    }

    /// `out` when its check passed; when it failed, see [`Device::or_set_aside`].
    fn checked(&self, check: Result<()>, out: Option<Vec<f32>>) -> Result<Option<Vec<f32>>> {
        Ok(self.or_set_aside(check)?.and(out))
    }

    /// Counts a product of `t` tokens by `rows` rows of `cols` made on the device since
    /// `start`: its kernels', staging and waiting seconds (`secs`), and whether it was packed.
    #[cfg(feature = "cuda")]
    fn count_made(
        &self,
        (t, rows, cols): (usize, usize, usize),
        start: std::time::Instant,
        [kernel, upload, wait]: [f64; 3],
        packed: bool,
    ) {
        if let Ok(mut work) = self.work.lock() {
            work.products += 1;
            work.multiply_adds += (t * rows) as f64 * cols as f64;
            work.seconds += start.elapsed().as_secs_f64();
            work.kernel_seconds += kernel;
            work.upload_seconds += upload;
            work.wait_seconds += wait;
            work.packed += u64::from(packed);
        }
    }

    /// The product packed in `parcel` (`t` tokens, `rows` rows of `cols`), queued during the
    /// device's turn and waited for after it, counted (its packing, since `start`, as the
    /// staging of its values); the parcel is kept for another product.
    #[cfg(feature = "cuda")]
    fn made_packed(
        &self,
        mut parcel: crate::gpu::parcels::Parcel,
        start: std::time::Instant,
        t: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<f32>>> {
        let upload_seconds = start.elapsed().as_secs_f64();
        let (sent, wait_seconds) = {
            let t0 = std::time::Instant::now();
            let p = self.turn()?;
            let waited = t0.elapsed().as_secs_f64();
            (p.submit(&mut parcel), waited)
        };
        let done = sent.and_then(|s| s.wait(&mut parcel));
        self.parcels.give(parcel);
        // Under `auto` a failure of the device (a copy, a launch, its memory) sets it aside as
        // a difference does: the CPU makes this product and the rest.
        let (out, kernel_seconds) = self.or_set_aside(done)?.unwrap_or((None, 0.0));
        if out.is_some() {
            let secs = [kernel_seconds, upload_seconds, wait_seconds];
            self.count_made((t, rows, cols), start, secs, true);
        }
        Ok(out)
    }

    /// The product made on the device, counted.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn made(
        &self,
        x: &[f32],
        t: usize,
        rows: usize,
        cols: usize,
        w: Raw<'_>,
    ) -> Result<Option<Vec<f32>>> {
        #[cfg(feature = "cuda")]
        {
            use crate::gpu::reference::Weights;
            let start = std::time::Instant::now();
            let weights = match w {
                Raw::Gguf { ty, bytes } => Weights::Raw { ty, bytes },
                Raw::Dense(v) => Weights::Dense(v),
            };
            // A small product is packed in pinned memory by this thread before its turn, and
            // waited for after it: the turn only queues its copies and kernels.
            let Some(packed) = self.or_set_aside(self.parcels.pack(x, t, &weights, rows, cols))?
            else {
                return Ok(None);
            };
            if let Some(parcel) = packed {
                return self.made_packed(parcel, start, t, rows, cols);
            }
            let (out, kernel_seconds, upload_seconds, wait_seconds) = {
                let p = self.turn()?;
                let waited = start.elapsed().as_secs_f64();
                let (k0, u0) = (p.kernel_seconds(), p.upload_seconds());
                // Under `auto` a failure of the device (a copy, a launch, its memory) sets it
                // aside as a difference does: the CPU makes this product and the rest.
                let out = self
                    .or_set_aside(p.products(x, t, weights, rows, cols))?
                    .flatten();
                (
                    out,
                    p.kernel_seconds() - k0,
                    p.upload_seconds() - u0,
                    waited,
                )
            };
            if out.is_some() {
                let secs = [kernel_seconds, upload_seconds, wait_seconds];
                self.count_made((t, rows, cols), start, secs, false);
            }
            Ok(out)
        }
        #[cfg(not(feature = "cuda"))]
        Ok(None)
    }

    /// Checks `out` (`[t, rows]`, made on the device) at [`CHECK_ROWS`] x [`CHECK_TOKENS`]
    /// elements against [`math::dot`] of the row `row(r, buf)` writes.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &self,
        x: &[f32],
        t: usize,
        rows: usize,
        cols: usize,
        out: &[f32],
        what: &str,
        row: &dyn Fn(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let mut buf = vec![0f32; cols];
        let mut checked = 0u64;
        for r in spread(rows, CHECK_ROWS) {
            row(r, &mut buf)?;
            for i in spread(t, CHECK_TOKENS) {
                let want = dot(&x[i * cols..(i + 1) * cols], &buf) as f32;
                let got = out[i * rows + r];
                // NaN's payload is not part of the definition (x86 and CUDA make different
                // ones from inf * 0); a reference value that is not finite is refused later.
                if want.to_bits() != got.to_bits() && !(want.is_nan() && got.is_nan()) {
                    bail!(
                        "engine: cpu: the reference's product with {what} made on {} differs from the CPU's at token {i}, row {r}: {got:e} ({:#010x}) against {want:e} ({:#010x}); the device does not compute the reference's sums (run with --reference-on cpu)",
                        self.describe,
                        got.to_bits(),
                        want.to_bits()
                    );
                }
                checked += 1;
            }
        }
        if let Ok(mut work) = self.work.lock() {
            work.checked += checked;
        }
        Ok(())
    }
}

/// The first place where rows `rows` of `out` (`width` values each) and `want` (those rows,
/// `[rows.len(), width]`) differ in their bits (a NaN's payload is no part of the definition):
/// `(row, column, got, want)`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn first_row_difference(
    out: &[f32],
    want: &[f32],
    rows: &[usize],
    width: usize,
) -> Option<(usize, usize, f32, f32)> {
    for (k, &i) in rows.iter().enumerate() {
        for c in 0..width {
            let (got, w) = (out[i * width + c], want[k * width + c]);
            if got.to_bits() != w.to_bits() && !(got.is_nan() && w.is_nan()) {
                return Some((i, c, got, w));
            }
        }
    }
    None
}

/// Where the reference makes its products of [`MIN_TOKENS`] tokens or more (`--reference-on`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReferenceOn {
    /// On the candidate's device when the candidate is the CUDA engine, else on device 0 when
    /// there is one, else on the CPU; a device that cannot be opened leaves them on the CPU
    /// (with a note).
    #[default]
    Auto,
    /// On the CPU.
    Cpu,
    /// On device N (an error when it cannot be opened).
    Cuda(usize),
}

impl ReferenceOn {
    /// Parses `auto`, `cpu`, `cuda` (device 0) or `cuda:N`.
    pub fn parse(s: &str) -> Result<ReferenceOn> {
        Ok(match s.trim() {
            "auto" => ReferenceOn::Auto,
            "cpu" => ReferenceOn::Cpu,
            "cuda" => ReferenceOn::Cuda(0),
            c if c.starts_with("cuda:") => match c["cuda:".len()..].parse() {
                Ok(n) => ReferenceOn::Cuda(n),
                Err(_) => bail!("{s:?}: expected auto, cpu, cuda or cuda:N with N a device index"),
            },
            _ => bail!("{s:?}: expected auto, cpu, cuda or cuda:N"),
        })
    }
}

/// The process's `--reference-on` (set once by the command, before any reference is built).
static REFERENCE_ON: Mutex<ReferenceOn> = Mutex::new(ReferenceOn::Auto);

/// Sets where the references built from now on make their large products.
pub fn set_reference_on(on: ReferenceOn) {
    if let Ok(mut r) = REFERENCE_ON.lock() {
        *r = on;
    }
}

/// The device a reference of `tokens` tokens makes its large products on, as the process's
/// [`ReferenceOn`] says (`candidate_device`: the CUDA candidate's device, if the candidate is
/// one), and a note when `auto` could not open one. `None` with fewer than [`MIN_TOKENS`]
/// tokens (no product would go there).
pub fn reference_device(
    tokens: usize,
    candidate_device: Option<usize>,
) -> Result<(Option<std::sync::Arc<Device>>, Option<String>)> {
    let on = REFERENCE_ON.lock().map(|r| *r).unwrap_or_default();
    // With fewer tokens no product goes to a device, but for those made from the CUDA
    // candidate's device bytes (`--reference-reuse`), on its device.
    #[cfg(feature = "cuda")]
    let reused = crate::gpu::resident::reuse() && candidate_device.is_some();
    #[cfg(not(feature = "cuda"))]
    let reused = false;
    if tokens < min_tokens() && !reused {
        return Ok((None, None));
    }
    match on {
        ReferenceOn::Cpu => Ok((None, None)),
        ReferenceOn::Cuda(n) => {
            let mut d = Device::open(n, true).with_context(|| {
                format!("--reference-on cuda:{n}: the reference's products cannot go to device {n}")
            })?;
            d.reuse_only = tokens < min_tokens();
            Ok((Some(std::sync::Arc::new(d)), None))
        }
        ReferenceOn::Auto => {
            let Some(n) = candidate_device.or_else(first_device) else {
                return Ok((None, None));
            };
            match Device::open(n, false) {
                Ok(mut d) => {
                    d.reuse_only = tokens < min_tokens();
                    Ok((Some(std::sync::Arc::new(d)), None))
                }
                Err(e) => Ok((
                    None,
                    Some(format!(
                        "the reference's products stay on the CPU: cuda:{n} could not be opened ({e:#})"
                    )),
                )),
            }
        }
    }
}

/// The reference engine of a run of `tokens` tokens: its large products on a device as the
/// process's [`ReferenceOn`] says (`candidate_device`: the CUDA candidate's), and a note when
/// `auto` could not open one.
pub fn reference_engine<'w>(
    weights: &'w crate::model::Weights<'w>,
    tokens: usize,
    candidate_device: Option<usize>,
) -> Result<(super::CpuEngine<'w>, Option<String>)> {
    let (device, note) = reference_device(tokens, candidate_device)?;
    let engine = super::CpuEngine::new(weights);
    Ok(match device {
        Some(d) => (engine.with_device(d), note),
        None => (engine, note),
    })
}

/// Device 0 when CUDA is there and reports a device.
fn first_device() -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        crate::gpu::DeviceInfo::list()
            .ok()
            .filter(|d| !d.is_empty())
            .map(|_| 0)
    }
    #[cfg(not(feature = "cuda"))]
    None
}

/// A span of the CUDA candidate's device bytes as the reference proved it: the file span, the
/// buffer (its handle's address) and the span's offset in it.
#[cfg(feature = "cuda")]
type Proof = (crate::gpu::resident::FileSpan, usize, usize);

/// A product's weights as the device takes them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Raw<'a> {
    /// Raw GGUF blocks.
    Gguf {
        ty: crate::quant::GgmlType,
        bytes: &'a [u8],
    },
    /// f32 rows.
    Dense(&'a [f32]),
}

/// Up to `k` indices of `0..n`, the first and the last among them, the others spread evenly
/// between (each once).
pub(super) fn spread(n: usize, k: usize) -> Vec<usize> {
    if n == 0 || k == 0 {
        return Vec::new();
    }
    let k = k.min(n);
    let mut v: Vec<usize> = if k == 1 {
        vec![0]
    } else {
        (0..k).map(|j| j * (n - 1) / (k - 1)).collect()
    };
    v.dedup();
    v
}

/// `x · W^T` with `src` through `device` when it makes it, else on the CPU ([`math::matmul_rows`]).
pub(super) fn matmul_rows(
    device: Option<&Device>,
    x: &[f32],
    t: usize,
    src: &RowSource<'_>,
) -> Result<Vec<f32>> {
    if let Some(d) = device {
        if let Some(out) = d.products_rows(x, t, src)? {
            return Ok(out);
        }
    }
    math::matmul_rows(x, t, src)
}

/// `x · W^T` with the host matrix `w` (named `what` in errors) through `device` when it makes
/// it, else on the CPU ([`math::matmul`]).
pub(super) fn matmul_dense(
    device: Option<&Device>,
    x: &[f32],
    t: usize,
    w: &Matrix,
    what: &str,
) -> Result<Vec<f32>> {
    if let Some(d) = device {
        if let Some(out) = d.products_dense(x, t, w, what)? {
            return Ok(out);
        }
    }
    Ok(math::matmul(x, t, w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_row_difference_is_found_by_bits() {
        use super::first_row_difference;
        let out = [0.0f32, 1.0, 2.0, 3.0, f32::NAN, 5.0];
        let rows = [0usize, 2];
        assert_eq!(
            first_row_difference(&out, &[0.0, 1.0, -f32::NAN, 5.0], &rows, 2),
            None
        );
        assert_eq!(
            first_row_difference(&out, &[-0.0, 1.0, f32::NAN, 5.0], &rows, 2),
            Some((0, 0, 0.0, -0.0))
        );
        assert_eq!(
            first_row_difference(&out, &[0.0, 1.0, f32::NAN, 5.5], &rows, 2),
            Some((2, 1, 5.0, 5.5))
        );
    }

    #[test]
    fn spread_takes_the_ends_and_between() {
        assert_eq!(spread(10, 4), vec![0, 3, 6, 9]);
        assert_eq!(spread(2, 4), vec![0, 1]);
        assert_eq!(spread(1, 3), vec![0]);
        assert_eq!(spread(5, 1), vec![0]);
        assert!(spread(0, 3).is_empty());
        assert_eq!(spread(4096, 3), vec![0, 2047, 4095]);
    }
}
