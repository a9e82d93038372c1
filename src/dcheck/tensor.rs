//! One device's pipeline: a sequence of tensors streamed through the device in chunks of rows,
//! so that a tensor of any size needs a bounded amount of host and device memory.
//!
//! Three sides work at once, each on its own chunk:
//! - the upload thread ([`crate::gpu::upload`], with [`Staging::Pinned`]) reads the raw blocks of
//!   the next chunks from the model's files into a ring of pinned buffers and copies them on a
//!   copy stream of its own, [`AHEAD`] chunks ahead of the device, the next tensor's first
//!   chunks while the current tensor's last ones are checked;
//! - the CPU thread dequantizes and hashes the same chunks from the mapped file, fused
//!   ([`crate::gpu::dequant::dequant_hash`]: each thread dequantizes a tile into a buffer of its
//!   own and hashes it there, so a chunk's values are never stored);
//! - the device loop (the caller's thread) makes the compute stream wait for a chunk's copies
//!   (an event), dequantizes and hashes it there, and compares the two hashes.
//!
//! Only the raw blocks travel to the device: both sides hash their f32 values (an
//! order-independent 64-bit hash, [`crate::gpu::dequant::hash_f32_host`]) and only a chunk whose
//! hashes differ has the CPU's values made, copied over and compared value by value (mismatch
//! count, first index, largest difference). A wrong kernel therefore costs a second
//! dequantization and a copy; a right one never does.
//!
//! Ordering: a chunk's device buffer is taken on the compute stream (allocated, or one a
//! finished chunk gave back) and the copy stream waits for that point (an event) before copying
//! into it, so a reused buffer is overwritten only after the kernels that read it; the compute
//! stream waits for the copies' event before the kernels read it; a staging buffer is refilled
//! only once the copy out of it is done (the upload thread's ring). With [`Staging::Pageable`]
//! the device loop copies each chunk from the mapped file itself, synchronously (to compare).
//!
//! Nothing is allocated or compiled chunk by chunk: the kernels are loaded (an NVRTC compile
//! on a cold cache takes seconds) and the hash counter and timing events made before the
//! pipeline starts ([`Busy::load_ms`]); the raw-block buffers (at most one per chunk in
//! flight) and the values buffer are kept and reused. The device side's time is then the
//! span of its kernels alone: events recorded just before the dequant launch and just after
//! the hash launch, with nothing but those launches between them.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice};

use super::project::Busy;
use super::{
    chunk_rows, row_chunks, FirstMismatch, Staging, TensorCheck, CHUNK_ELEMS, PAGEABLE_ENV,
};
use crate::gguf::{Model, TensorRef};
use crate::gpu::dequant::{dequant_hash, CompareStats, OutFormat};
use crate::gpu::upload::{
    alloc_dst, CopyTiming, FileRange, Job, Outcome, Uploader, READERS, STAGING_BYTES, STAGING_SLOTS,
};
use crate::gpu::Gpu;
use crate::quant::{dequantize_to_vec, GgmlType};
use crate::util::progress::Progress;

/// Chunks on their way (read, copied, hashed by the CPU) beyond the one the device works on.
pub const AHEAD: usize = 2;
/// Bytes of a chunk's first and last bytes the upload thread compares with the memory map.
const FINGERPRINT: usize = 64;

/// Checks one tensor on `gpu` with `staging` (a pipeline of its own: [`DeviceCheck`] keeps one
/// for many tensors).
pub fn check_tensor(
    gpu: &Gpu,
    staging: Staging,
    model: &Model,
    t: TensorRef<'_>,
    progress: &dyn Progress,
) -> Result<TensorCheck> {
    DeviceCheck::new(gpu, staging).check_tensor(model, t, progress)
}

/// One device's pipeline (see the module documentation); its upload thread and pinned ring
/// live as long as it does.
pub struct DeviceCheck<'g> {
    gpu: &'g Gpu,
    uploader: Option<Uploader>,
    staging: String,
    chunk_elems: u64,
    next_id: u64,
    generation: u64,
    /// Jobs sent to the upload thread whose outcome has not been received.
    outstanding: usize,
    busy: Busy,
    /// Made once, before the first run's pipeline.
    prepared: Option<Prepared>,
    /// Raw-block device buffers that finished chunks gave back, for the next chunks.
    spare: Vec<CudaSlice<u8>>,
    /// The device's values of a chunk, reused chunk after chunk.
    values: Option<CudaSlice<f32>>,
}

/// What the pipeline makes once, before its first chunk.
struct Prepared {
    /// The hash counter the hash kernel sums into.
    hash: CudaSlice<u64>,
    /// Recorded before the dequant launch, between it and the hash launch, after the hash
    /// launch.
    events: [CudaEvent; 3],
}

/// A chunk of a tensor.
struct Spec<'m> {
    /// The caller's index of the tensor.
    idx: usize,
    t: TensorRef<'m>,
    rows: Range<u64>,
    /// The chunk's number and the tensor's chunk count (an empty tensor is one empty chunk).
    k: usize,
    n: usize,
}

/// How a chunk's raw blocks come.
enum Src {
    /// The upload job of this id.
    Job(u64),
    /// Copied from the mapped file when the device needs them.
    Pageable,
    /// No values.
    Empty,
}

/// A chunk on its way.
struct InFlight<'m> {
    spec: Spec<'m>,
    src: Src,
}

/// A chunk for the CPU thread.
struct CpuJob<'m> {
    t: TensorRef<'m>,
    rows: Range<u64>,
}

/// The CPU's hash of a chunk and its milliseconds.
type CpuDone = Result<(u64, f64)>;

/// The tensor the device loop is on.
struct Acc {
    idx: usize,
    out: TensorCheck,
    stats: CompareStats,
    started: Instant,
}

/// The tensors of a run, a chunk at a time.
struct Feed<'a, 'm> {
    next: &'a mut dyn FnMut() -> Option<(usize, TensorRef<'m>)>,
    chunks: VecDeque<Spec<'m>>,
    chunk_elems: u64,
}

impl<'m> Feed<'_, 'm> {
    fn next_chunk(&mut self) -> Option<Spec<'m>> {
        if self.chunks.is_empty() {
            let (idx, t) = (self.next)()?;
            let info = t.info;
            let per = chunk_rows(
                info.row_len(),
                info.row_bytes(),
                self.chunk_elems,
                STAGING_BYTES as u64,
            );
            let mut rows = row_chunks(info.n_rows(), per);
            if rows.is_empty() {
                rows.push(0..0);
            }
            let n = rows.len();
            self.chunks
                .extend(
                    rows.into_iter()
                        .enumerate()
                        .map(|(k, rows)| Spec { idx, t, rows, k, n }),
                );
        }
        self.chunks.pop_front()
    }
}

impl<'g> DeviceCheck<'g> {
    /// The pipeline of `gpu`. Pinned staging that cannot start (pinned memory refused) falls
    /// back to pageable copies, and [`DeviceCheck::staging`] says why.
    pub fn new(gpu: &'g Gpu, staging: Staging) -> DeviceCheck<'g> {
        let (uploader, staging) = match staging {
            Staging::Pageable => (
                None,
                format!("pageable: synchronous copies from the mapped file ({PAGEABLE_ENV})"),
            ),
            Staging::Pinned => match Uploader::start(gpu) {
                Ok(u) => (
                    Some(u),
                    format!(
                        "pinned: a ring of {STAGING_SLOTS} x {} MiB a device, {READERS} reader threads, a copy stream, {AHEAD} chunks ahead",
                        STAGING_BYTES >> 20
                    ),
                ),
                Err(e) => (
                    None,
                    format!(
                        "pageable: pinned staging could not start on cuda:{}: {e:#}",
                        gpu.info.ordinal
                    ),
                ),
            },
        };
        DeviceCheck {
            gpu,
            uploader,
            staging,
            chunk_elems: CHUNK_ELEMS,
            next_id: 0,
            generation: 0,
            outstanding: 0,
            busy: Busy {
                device: gpu.info.to_string(),
                ..Busy::default()
            },
            prepared: None,
            spare: Vec::new(),
            values: None,
        }
    }

    /// Loads the kernels and makes the hash counter and the timing events, once; the time it
    /// took goes to [`Busy::load_ms`] (in no rate).
    fn prepare(&mut self) -> Result<()> {
        if self.prepared.is_some() {
            return Ok(());
        }
        let t0 = Instant::now();
        let gpu = self.gpu;
        gpu.load_dequant_kernels()
            .context("dequant-check: loading the kernels")?;
        let hash = gpu.alloc_zeroed::<u64>(1, "hash")?;
        let event = || {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .context("cuda: creating a timing event")
        };
        let events = [event()?, event()?, event()?];
        self.prepared = Some(Prepared { hash, events });
        self.busy.load_ms += t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// A device buffer for `len` raw bytes: a spare one that holds them, else a new one of a
    /// whole staging buffer's size (or `len` when larger; a spare too small gives way, so that
    /// no more buffers live than chunks in flight).
    fn raw_buffer(&mut self, len: usize, what: &str) -> Result<CudaSlice<u8>> {
        match take_spare(&mut self.spare, len, |b| b.len()) {
            Some(b) => Ok(b),
            None => alloc_dst(self.gpu, len.max(STAGING_BYTES), what),
        }
    }

    /// The values buffer, for at least `n` values (allocated zeroed when there is none or it is
    /// too small: at least a chunk's values).
    fn values_buffer(&mut self, n: usize) -> Result<CudaSlice<f32>> {
        match self.values.take() {
            Some(v) if v.len() >= n => Ok(v),
            old => {
                drop(old);
                let cap = usize::try_from(self.chunk_elems).unwrap_or(usize::MAX);
                self.gpu.alloc_zeroed::<f32>(n.max(cap), "GPU values")
            }
        }
    }

    /// The same pipeline with chunks of at most `n` values (tests: many chunks from small
    /// tensors).
    pub fn with_chunk_elems(mut self, n: u64) -> Self {
        self.chunk_elems = n.max(1);
        self
    }

    /// How the raw blocks reach the device, in words.
    pub fn staging(&self) -> &str {
        &self.staging
    }

    /// Whether the raw blocks travel through pinned staging.
    pub fn is_pinned(&self) -> bool {
        self.uploader.is_some()
    }

    /// What the pipeline did so far.
    pub fn busy(&self) -> &Busy {
        &self.busy
    }

    /// Checks one tensor, reporting its chunks to `progress`.
    pub fn check_tensor(
        &mut self,
        model: &Model,
        t: TensorRef<'_>,
        progress: &dyn Progress,
    ) -> Result<TensorCheck> {
        let mut one = Some((0, t));
        let mut out = None;
        self.run(model, &mut || one.take(), progress, &mut |_, c| {
            out = Some(c);
            Ok(())
        })?;
        out.context("dequant-check: the tensor was not checked")
    }

    /// Checks the tensors `next` gives (the caller's index and the tensor, until `None`; the
    /// next one is asked for while the current one's last chunks are checked), each reported
    /// to `progress` as a phase of chunks and handed to `done` when checked, in order.
    pub fn run<'m>(
        &mut self,
        model: &'m Model,
        next: &mut dyn FnMut() -> Option<(usize, TensorRef<'m>)>,
        progress: &dyn Progress,
        done: &mut dyn FnMut(usize, TensorCheck) -> Result<()>,
    ) -> Result<()> {
        // Kernels compiled and loaded before the clock starts: a cold NVRTC cache costs seconds
        // that belong to no side of the pipeline.
        self.prepare()?;
        let t0 = Instant::now();
        let stop = AtomicBool::new(false);
        let r = std::thread::scope(|scope| -> Result<()> {
            let (job_tx, job_rx) = mpsc::channel::<CpuJob<'m>>();
            let (res_tx, res_rx) = mpsc::channel::<CpuDone>();
            let stop = &stop;
            std::thread::Builder::new()
                .name("dequant-check-cpu".into())
                .spawn_scoped(scope, move || cpu_side(model, &job_rx, &res_tx, stop))
                .context("dequant-check: starting the CPU thread")?;
            let mut feed = Feed {
                next,
                chunks: VecDeque::new(),
                chunk_elems: self.chunk_elems,
            };
            let mut flight: VecDeque<InFlight<'m>> = VecDeque::new();
            let r = self.device_loop(
                model,
                &mut feed,
                &mut flight,
                progress,
                done,
                &job_tx,
                &res_rx,
            );
            // The CPU thread stops at its next chunk (at once when it has none).
            stop.store(true, Ordering::Relaxed);
            drop(job_tx);
            r
        });
        if r.is_err() {
            self.drain();
        }
        self.busy.wall_ms += t0.elapsed().as_secs_f64() * 1e3;
        r
    }

    /// Drops the uploads still under way after a failure: queued jobs are cancelled, and every
    /// outcome is received and retired (its buffer freed after its copies), so that the next
    /// run starts with none outstanding.
    fn drain(&mut self) {
        let Some(u) = &self.uploader else { return };
        self.generation += 1;
        u.cancel_before(self.generation);
        while self.outstanding > 0 {
            match u.recv() {
                Some(d) => d.outcome.retire(self.gpu.stream()),
                None => break,
            }
            self.outstanding -= 1;
        }
        self.outstanding = 0;
    }

    #[allow(clippy::too_many_arguments)]
    fn device_loop<'m>(
        &mut self,
        model: &'m Model,
        feed: &mut Feed<'_, 'm>,
        flight: &mut VecDeque<InFlight<'m>>,
        progress: &dyn Progress,
        done: &mut dyn FnMut(usize, TensorCheck) -> Result<()>,
        cpu_tx: &Sender<CpuJob<'m>>,
        cpu_rx: &Receiver<CpuDone>,
    ) -> Result<()> {
        let mut acc: Option<Acc> = None;
        loop {
            while flight.len() <= AHEAD {
                let Some(spec) = feed.next_chunk() else { break };
                let c = self.launch(model, spec, cpu_tx)?;
                flight.push_back(c);
            }
            let Some(c) = flight.pop_front() else { break };
            let info = c.spec.t.info;
            if c.spec.k == 0 {
                progress.start(&info.name, c.spec.n as u64);
                acc = Some(Acc::new(c.spec.idx, c.spec.t));
            }
            let a = acc
                .as_mut()
                .context("dequant-check: a chunk came before its tensor's first")?;
            let last = c.spec.k + 1 == c.spec.n;
            self.chunk(model, c, a, cpu_rx)?;
            progress.inc(1);
            if last {
                if let Some(a) = acc.take() {
                    progress.finish();
                    let out = a.finish();
                    self.busy.tensors += 1;
                    self.busy.values += out.elements;
                    self.busy.bytes += out.bytes;
                    done(a.idx, out)?;
                }
            }
        }
        Ok(())
    }

    /// Sends a chunk on its way: to the CPU thread, and (pinned staging, a mapped file) to the
    /// upload thread into a device buffer allocated for it.
    fn launch<'m>(
        &mut self,
        model: &'m Model,
        spec: Spec<'m>,
        cpu_tx: &Sender<CpuJob<'m>>,
    ) -> Result<InFlight<'m>> {
        let (t, rows) = (spec.t, spec.rows.clone());
        if rows.is_empty() || t.info.row_len() == 0 {
            return Ok(InFlight {
                spec,
                src: Src::Empty,
            });
        }
        cpu_tx
            .send(CpuJob {
                t,
                rows: rows.clone(),
            })
            .map_err(|_| anyhow!("dequant-check: the CPU side stopped"))?;
        if self.uploader.is_none() {
            return Ok(InFlight {
                spec,
                src: Src::Pageable,
            });
        }
        let what = || {
            format!(
                "dequant-check: {} rows {}..{}",
                t.info.name, rows.start, rows.end
            )
        };
        let Some((path, offset, len)) = model.row_file_range(t, rows.clone()).with_context(what)?
        else {
            // A model held in memory has no file to read: its bytes are copied as they are.
            return Ok(InFlight {
                spec,
                src: Src::Pageable,
            });
        };
        let raw = model.row_data(t, rows.clone()).with_context(what)?;
        let len = usize::try_from(len).context("dequant-check: a chunk larger than memory")?;
        let k = FINGERPRINT.min(raw.len());
        let dst = self.raw_buffer(len, &t.info.name)?;
        // The copy stream starts after the allocation (or the kernels that read a reused
        // buffer last), in the compute stream's order.
        let after = Arc::new(
            self.gpu
                .stream()
                .record_event(None)
                .context("cuda: recording an allocation")?,
        );
        let id = self.next_id;
        self.next_id += 1;
        let job = Job {
            id,
            generation: self.generation,
            what: t.info.name.clone(),
            src: vec![FileRange {
                path: path.to_path_buf(),
                offset,
                len,
            }],
            head: raw[..k].to_vec(),
            tail: raw[raw.len() - k..].to_vec(),
            dst,
            after,
        };
        let u = self
            .uploader
            .as_ref()
            .context("dequant-check: an upload without its thread")?;
        // A job that comes back was not started: its buffer has no copy to wait for.
        u.send(job)
            .map_err(|_| anyhow!("dequant-check: {}: the upload thread stopped", t.info.name))?;
        self.outstanding += 1;
        Ok(InFlight {
            spec,
            src: Src::Job(id),
        })
    }

    /// The raw blocks of chunk `c` on the device (the compute stream ordered after their
    /// copies), with the upload's timing for pinned staging.
    fn raw_on_device(
        &mut self,
        model: &Model,
        c: &InFlight<'_>,
        a: &mut Acc,
    ) -> Result<(CudaSlice<u8>, Option<CopyTiming>)> {
        let (t, rows) = (c.spec.t, c.spec.rows.clone());
        let what = || {
            format!(
                "dequant-check: {} ({}) rows {}..{}",
                t.info.name, t.info.ty, rows.start, rows.end
            )
        };
        let w0 = Instant::now();
        let got = match c.src {
            Src::Job(id) => {
                let u = self
                    .uploader
                    .as_ref()
                    .context("dequant-check: an upload without its thread")?;
                let d = u
                    .recv()
                    .ok_or_else(|| anyhow!("{}: the upload thread stopped", what()))?;
                self.outstanding = self.outstanding.saturating_sub(1);
                if d.id != id {
                    d.outcome.retire(self.gpu.stream());
                    bail!("{}: upload {} came back instead of {id}", what(), d.id);
                }
                match d.outcome {
                    Outcome::Ready(r) => {
                        if !r.is_complete() {
                            if let Err(e) = r.wait_host() {
                                Outcome::Ready(r).retire(self.gpu.stream());
                                return Err(e).with_context(what);
                            }
                        }
                        let (d, timing) = r.take_timed(self.gpu.stream()).with_context(what)?;
                        (d, Some(timing))
                    }
                    Outcome::Failed(why) => bail!("{}: upload failed: {why}", what()),
                    Outcome::Cancelled => bail!("{}: upload cancelled", what()),
                }
            }
            Src::Pageable => {
                let raw = model.row_data(t, rows.clone()).with_context(what)?;
                let mut d = self.raw_buffer(raw.len(), "raw blocks")?;
                let s = self.gpu.stream();
                s.memcpy_htod(raw, &mut d.slice_mut(..raw.len()))
                    .context("cuda: copying raw blocks to the device")?;
                s.synchronize().context("cuda: synchronize")?;
                let ms = w0.elapsed().as_secs_f64() * 1e3;
                a.out.h2d_ms += ms;
                self.busy.copy_ms += ms;
                self.busy.copy_bytes += raw.len() as u64;
                (d, None)
            }
            Src::Empty => bail!("{}: an empty chunk has no blocks", what()),
        };
        let waited = w0.elapsed().as_secs_f64() * 1e3;
        a.out.wait_upload_ms += waited;
        self.busy.wait_upload_ms += waited;
        Ok(got)
    }

    /// Checks chunk `c` into `a`.
    fn chunk(
        &mut self,
        model: &Model,
        c: InFlight<'_>,
        a: &mut Acc,
        cpu_rx: &Receiver<CpuDone>,
    ) -> Result<()> {
        let (t, rows) = (c.spec.t, c.spec.rows.clone());
        let info = t.info;
        let ty: GgmlType = info.ty;
        let row_len = info.row_len();
        let n = ((rows.end - rows.start) * row_len) as usize;
        if n == 0 {
            return Ok(());
        }
        let what = || format!("dequant-check: {} ({ty})", info.name);
        let (raw_d, timing) = self.raw_on_device(model, &c, a)?;
        let len = usize::try_from((rows.end - rows.start) * info.row_bytes())
            .context("dequant-check: a chunk larger than memory")?;
        if raw_d.len() < len {
            bail!(
                "{}: rows {}..{}: a device buffer of {} bytes for {len}",
                what(),
                rows.start,
                rows.end,
                raw_d.len()
            );
        }
        let mut vals = self.values_buffer(n)?;
        let gpu = self.gpu;
        let s = gpu.stream();
        let offset = rows.start * row_len;
        let p = self
            .prepared
            .as_mut()
            .context("dequant-check: the pipeline was not prepared")?;
        // Nothing but the two launches between the first and the last event: no allocation, no
        // compile (both done before), so the span is the kernels' own time.
        p.events[0].record(s).context("cuda: event")?;
        gpu.dequant_view(
            ty,
            OutFormat::F32,
            &raw_d.slice(..len),
            &mut vals.slice_mut(..n),
        )
        .with_context(what)?;
        p.events[1].record(s).context("cuda: event")?;
        gpu.hash_f32_into(&vals.slice(..n), offset, &mut p.hash)
            .with_context(what)?;
        p.events[2].record(s).context("cuda: event")?;
        let gpu_hash = gpu.hash_read(&p.hash).with_context(what)?;
        // The kernels that read it are done (the read above waited for them); the compute
        // stream orders its next copy after them anyway.
        self.spare.push(raw_d);
        let elapsed = |a: usize, b: usize| -> Result<f64> {
            Ok(f64::from(
                p.events[a]
                    .elapsed_ms(&p.events[b])
                    .context("cuda: event timing")?,
            ))
        };
        a.out.kernel_ms += elapsed(0, 1)?;
        let gpu_ms = elapsed(0, 2)?;
        a.out.gpu_ms += gpu_ms;
        self.busy.gpu_ms += gpu_ms;
        if let Some(tm) = timing {
            // Finished: the compute stream waited for the copies before the kernels.
            let ms = tm.copy_ms()?;
            a.out.h2d_ms += ms;
            a.out.read_ms += tm.read_s * 1e3;
            self.busy.copy_ms += ms;
            self.busy.copy_bytes += tm.bytes as u64;
            self.busy.read_ms += tm.read_s * 1e3;
            self.busy.read_bytes += tm.bytes as u64;
        }
        let w0 = Instant::now();
        let (cpu_hash, cpu_ms) = cpu_rx
            .recv()
            .map_err(|_| anyhow!("dequant-check: the CPU side stopped"))??;
        let waited = w0.elapsed().as_secs_f64() * 1e3;
        a.out.wait_cpu_ms += waited;
        self.busy.wait_cpu_ms += waited;
        a.out.cpu_ms += cpu_ms;
        self.busy.cpu_ms += cpu_ms;
        let c0 = Instant::now();
        let mut cpu: Vec<f32> = Vec::new();
        let mut remade_ms = 0.0;
        let chunk = if gpu_hash == cpu_hash {
            CompareStats::default()
        } else {
            // Hashes differ: the CPU's values are made, go over and are compared one by one.
            let raw = model.row_data(t, rows.clone()).with_context(what)?;
            let v0 = Instant::now();
            cpu = dequantize_to_vec(ty, raw, n).with_context(what)?;
            remade_ms = v0.elapsed().as_secs_f64() * 1e3;
            a.out.cpu_ms += remade_ms;
            let h0 = Instant::now();
            let cpu_d = gpu.alloc_copy(&cpu, "CPU values")?;
            a.out.h2d_ms += h0.elapsed().as_secs_f64() * 1e3;
            gpu.compare_f32_views(&vals.slice(..n), &cpu_d.as_view())
                .with_context(what)?
        };
        a.out.compare_ms += c0.elapsed().as_secs_f64() * 1e3 - remade_ms;
        if a.stats.first.is_none() {
            if let Some(i) = chunk.first {
                let v = s
                    .clone_dtoh(&vals.slice(i as usize..i as usize + 1))
                    .context("cuda: reading the first differing value")?;
                let idx = offset + i;
                let (row, col) = (idx / row_len, idx % row_len);
                let bs = ty.block_size() as u64;
                let ts = ty.type_size();
                let blk = (col / bs) as usize;
                let row_bytes = model.row_data(t, row..row + 1).with_context(what)?;
                let raw = row_bytes
                    .get(blk * ts..(blk + 1) * ts)
                    .with_context(|| format!("{}: block {blk} of row {row}", what()))?;
                a.out.first = Some(FirstMismatch {
                    index: idx,
                    row,
                    col,
                    block: blk as u64,
                    raw: raw.iter().take(48).map(|b| format!("{b:02x}")).collect(),
                    cpu: cpu.get(i as usize).copied().unwrap_or(f32::NAN),
                    gpu: v.first().copied().unwrap_or(f32::NAN),
                });
            }
        }
        a.stats.merge(chunk, offset);
        self.values = Some(vals);
        Ok(())
    }
}

impl Acc {
    fn new(idx: usize, t: TensorRef<'_>) -> Acc {
        let info = t.info;
        Acc {
            idx,
            out: TensorCheck {
                name: info.name.clone(),
                ty: info.ty.name().to_string(),
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
                read_ms: 0.0,
                gpu_ms: 0.0,
                wait_upload_ms: 0.0,
                wait_cpu_ms: 0.0,
                compare_ms: 0.0,
                wall_ms: 0.0,
            },
            stats: CompareStats::default(),
            started: Instant::now(),
        }
    }

    fn finish(&self) -> TensorCheck {
        let mut out = self.out.clone();
        out.mismatches = self.stats.mismatches;
        out.max_abs = self.stats.max_abs;
        out.wall_ms = self.started.elapsed().as_secs_f64() * 1e3;
        out.kernel_gbps = if out.kernel_ms > 0.0 {
            (out.bytes + 4 * out.elements) as f64 / (out.kernel_ms * 1e-3) / 1e9
        } else {
            0.0
        };
        out
    }
}

/// A buffer of `spare` that holds `len` bytes (`size` says how many a buffer holds), taken out;
/// `None` when none does, after dropping one spare, so that a caller that then allocates keeps
/// no more buffers than it has chunks in flight.
fn take_spare<T>(spare: &mut Vec<T>, len: usize, size: impl Fn(&T) -> usize) -> Option<T> {
    match spare.iter().position(|b| size(b) >= len) {
        Some(i) => Some(spare.swap_remove(i)),
        None => {
            spare.pop();
            None
        }
    }
}

/// The CPU thread: each chunk's raw bytes from the map, dequantized and hashed (fused), in the
/// order sent; stops when told, when the jobs end or when nobody takes its results.
fn cpu_side(
    model: &Model,
    jobs: &Receiver<CpuJob<'_>>,
    results: &Sender<CpuDone>,
    stop: &AtomicBool,
) {
    for j in jobs.iter() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let c0 = Instant::now();
        let info = j.t.info;
        let r = model
            .row_data(j.t, j.rows.clone())
            .and_then(|raw| dequant_hash(info.ty, raw, j.rows.start * info.row_len()))
            .with_context(|| {
                format!(
                    "dequant-check: {} ({}) rows {}..{}: the CPU side",
                    info.name, info.ty, j.rows.start, j.rows.end
                )
            });
        if results
            .send(r.map(|h| (h, c0.elapsed().as_secs_f64() * 1e3)))
            .is_err()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Raw-block buffers through a pipeline of `AHEAD + 1` chunks in flight: a chunk takes a
    /// spare that holds it or allocates one of a staging buffer's size (its own size when
    /// larger), and gives it back when checked. Chunks of a few sizes, then a row larger than a
    /// staging buffer, then small ones again: buffers are allocated only at the start and when
    /// a chunk outgrows them, and never more live than chunks in flight.
    #[test]
    fn raw_buffers_are_reused_and_bounded() {
        let big = STAGING_BYTES + 1000;
        let mut sizes = vec![37 << 20, 55 << 20, 4096, STAGING_BYTES, 71 << 20];
        sizes = sizes.repeat(20);
        sizes.extend([big, 37 << 20, big, 5, 6, 7, 8]);
        let mut spare: Vec<usize> = Vec::new();
        let mut flight: VecDeque<(usize, usize)> = VecDeque::new();
        let (mut allocated, mut most_live) = (Vec::new(), 0);
        for (k, &len) in sizes.iter().enumerate() {
            let buf = take_spare(&mut spare, len, |b| *b).unwrap_or_else(|| {
                let b = len.max(STAGING_BYTES);
                allocated.push((k, b));
                b
            });
            assert!(buf >= len, "chunk {k}: {buf} bytes for {len}");
            flight.push_back((len, buf));
            most_live = most_live.max(flight.len() + spare.len());
            if flight.len() > AHEAD {
                if let Some((_, b)) = flight.pop_front() {
                    spare.push(b);
                }
            }
        }
        assert!(most_live <= AHEAD + 1, "{most_live} buffers live");
        // Three at the start; then each of the two larger rows replaces one; the small chunks
        // after them fit what there is.
        let at: Vec<usize> = allocated.iter().map(|a| a.0).collect();
        assert_eq!(at, [0, 1, 2, 100, 102], "{allocated:?}");
        assert!(allocated[..3].iter().all(|a| a.1 == STAGING_BYTES));
        assert!(allocated[3..].iter().all(|a| a.1 == big));
    }
}
