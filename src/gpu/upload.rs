//! Uploads behind compute: byte ranges of files put on a device by a host thread of their own,
//! through pinned staging memory and a copy stream of their own, while the caller's thread and
//! the device's compute stream go on with other work. The CUDA engine's prefetch
//! (`engine::cuda::prefetch`) and dequant-check's pipeline (`dcheck`) both use it.
//!
//! # How
//! [`Uploader::start`] creates a non-blocking copy stream (no implicit synchronisation with the
//! legacy default stream the compute runs on), a ring of [`STAGING_SLOTS`] pinned host buffers
//! of [`STAGING_BYTES`] each, and a thread. The thread takes [`Job`]s in order; for each it reads
//! the file range chunk by chunk into the next buffer of the ring ([`READERS`] threads reading
//! parts of a chunk at once, positional reads of the file: nothing borrowed from the caller),
//! issues an asynchronous host-to-device copy of the chunk on the copy stream and records the
//! buffer's event after it. A buffer is refilled only once its event says the copy out of it is
//! done, so at most [`STAGING_SLOTS`] x [`STAGING_BYTES`] of pinned memory is in use whatever the
//! sizes. Before a job's first copy the thread records its `start` event, after its last chunk
//! its `done` event, and hands the device buffer back ([`Outcome::Ready`]); the two events and
//! the host time of the reads time the upload ([`Ready::take_timed`], [`CopyTiming`]).
//!
//! # Ordering (the caller's side of the contract)
//! - The device buffer of a job is allocated by the caller on the compute stream
//!   ([`alloc_dst`]), or is one an earlier job gave back, and the job carries an event recorded
//!   on the compute stream after that allocation and after the work that used the buffer last:
//!   the copy stream waits for it before its first copy.
//! - The compute stream must wait for `done` before it reads the buffer ([`Ready::take`] does
//!   it); the buffer is then an ordinary compute-stream allocation, freed in that stream's order.
//! - A buffer that copies were issued into and that is dropped unused is first made to wait for
//!   them on the compute stream ([`Outcome::retire`]), so that its stream-ordered free never
//!   comes before a copy into it.
//!
//! The copy stream is created through the driver and wrapped without registering it with
//! cudarc's context, so the context stays in its single-stream mode (no per-argument event
//! bookkeeping on every launch of the compute stream): every ordering across the two streams is
//! the explicit event waits above.
//!
//! Every failure of a job (the file, the device) comes back as [`Outcome::Failed`] with the
//! reason, never as a panic; the caller decides what to do instead.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, PinnedHostSlice,
};

use super::Gpu;

/// Bytes of one pinned staging buffer.
pub const STAGING_BYTES: usize = 256 << 20;
/// Pinned staging buffers in the ring.
pub const STAGING_SLOTS: usize = 2;
/// Threads reading the parts of one chunk from its file at once (host memory copies out of the
/// page cache: one thread alone reads a few GB/s).
pub const READERS: usize = 4;
/// Smallest part of a chunk given to a reader thread of its own.
pub const MIN_PART: usize = 8 << 20;

/// Where a job's bytes are: `len` bytes at `offset` of the file `path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRange {
    /// The file.
    pub path: PathBuf,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
}

/// Byte ranges to put on the device, one after another in a buffer of their own.
pub struct Job {
    /// The caller's id of the job (its [`Done`] carries it).
    pub id: u64,
    /// The job is dropped unread once [`Uploader::cancel_before`] is given a later generation.
    pub generation: u64,
    /// What the bytes are (a tensor name), for messages.
    pub what: String,
    /// Where the bytes are: one range (a tensor), or several (a stacked tensor's rows of some
    /// experts), copied one after another from the buffer's start.
    pub src: Vec<FileRange>,
    /// The bytes the ranges, one after another, must start with, and end with (taken by the
    /// caller from its own view of the file): a file changed since the caller read it is
    /// refused, not uploaded.
    pub head: Vec<u8>,
    /// See `head`.
    pub tail: Vec<u8>,
    /// The device buffer, at least [`Job::len`] bytes (those first are filled), allocated
    /// on the compute stream ([`alloc_dst`]) or taken back from an earlier job once the compute
    /// stream's work with it is issued (`after` comes after that work).
    pub dst: CudaSlice<u8>,
    /// Recorded on the compute stream after `dst` was allocated (and after any work that
    /// still uses it).
    pub after: Arc<CudaEvent>,
}

/// Bytes of `ranges` laid one after another.
pub fn total_len(ranges: &[FileRange]) -> usize {
    ranges.iter().map(|r| r.len).sum()
}

impl Job {
    /// Bytes of the job: its ranges' lengths added.
    pub fn len(&self) -> usize {
        total_len(&self.src)
    }

    /// Whether the job has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes are, for messages: `<len> bytes at offset <o> of <file>`, or the ranges'
    /// count and the first range's offset when there are several.
    fn describe(&self) -> String {
        match self.src.as_slice() {
            [] => "no bytes".to_string(),
            [r] => format!(
                "{} bytes at offset {} of {}",
                r.len,
                r.offset,
                r.path.display()
            ),
            [r, ..] => format!(
                "{} bytes in {} ranges of {} (the first at offset {})",
                self.len(),
                self.src.len(),
                r.path.display(),
                r.offset
            ),
        }
    }
}

/// A job's device buffer with every copy into it issued.
pub struct Ready {
    dst: CudaSlice<u8>,
    /// Recorded on the copy stream before the job's first copy (after its wait for the
    /// allocation); `done` after its last. Both time the copies.
    start: CudaEvent,
    done: CudaEvent,
    /// Host seconds the upload thread spent reading the job's bytes from the file.
    read_s: f64,
    /// Bytes copied ([`Job::len`]; the buffer may be larger).
    bytes: usize,
}

/// How long a job's copies took: taken with [`Ready::take_timed`], read once they are finished.
pub struct CopyTiming {
    start: CudaEvent,
    done: CudaEvent,
    /// Bytes copied.
    pub bytes: usize,
    /// Host seconds the upload thread spent reading the bytes from the file into pinned
    /// staging memory (positional reads, [`READERS`] threads a chunk).
    pub read_s: f64,
}

impl CopyTiming {
    /// Device milliseconds from the job's first copy to the end of its last (a job longer than
    /// a staging buffer includes the copy stream's waits for the next chunk's read). Waits for
    /// the copies when they are not finished.
    pub fn copy_ms(&self) -> Result<f64> {
        let ms = self
            .start
            .elapsed_ms(&self.done)
            .context("cuda: timing an upload's copies")?;
        Ok(f64::from(ms))
    }
}

impl Ready {
    /// Whether the copies are finished (false on a device error: [`Ready::take`] reports it).
    pub fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    /// Blocks the calling thread until the copies are finished.
    pub fn wait_host(&self) -> Result<()> {
        self.done
            .synchronize()
            .context("cuda: waiting for an upload to finish")
    }

    /// The buffer, for use on `compute`: that stream is made to wait for the copies first.
    pub fn take(self, compute: &CudaStream) -> Result<CudaSlice<u8>> {
        Ok(self.take_timed(compute)?.0)
    }

    /// [`Ready::take`], with the events and figures that time the upload.
    pub fn take_timed(self, compute: &CudaStream) -> Result<(CudaSlice<u8>, CopyTiming)> {
        compute
            .wait(&self.done)
            .context("cuda: ordering compute after an upload")?;
        let bytes = self.bytes;
        Ok((
            self.dst,
            CopyTiming {
                start: self.start,
                done: self.done,
                bytes,
                read_s: self.read_s,
            },
        ))
    }
}

/// What became of a job.
pub enum Outcome {
    /// On the device (its copies issued, perhaps not finished).
    Ready(Ready),
    /// Not uploaded, and why.
    Failed(String),
    /// Dropped by [`Uploader::cancel_before`].
    Cancelled,
}

impl Outcome {
    /// Drops the outcome; a ready buffer is freed only after its copies (the compute stream
    /// waits for them first: its free is ordered on that stream).
    pub fn retire(self, compute: &CudaStream) {
        if let Outcome::Ready(r) = self {
            // Best effort: on a device error nothing more can be ordered anyway.
            let _ = compute.wait(&r.done);
            drop(r.dst);
        }
    }
}

/// A job's outcome, by id.
pub struct Done {
    /// [`Job::id`].
    pub id: u64,
    /// What became of it.
    pub outcome: Outcome,
}

/// `len` bytes of device memory on `gpu`'s compute stream for a job to fill (contents unset until
/// its copies are done).
pub fn alloc_dst(gpu: &Gpu, len: usize, what: &str) -> Result<CudaSlice<u8>> {
    // SAFETY: the memory is unset; nothing reads it before the job's copies fill all `len`
    // bytes (the compute stream waits for the job's `done` event first, `Ready::take`), and a
    // buffer whose job fails is only freed.
    unsafe { gpu.stream().alloc::<u8>(len) }.map_err(|e| gpu.oom(e, len, what))
}

/// The copy stream: created through the driver, wrapped without registering it with the
/// context (see the module documentation), destroyed when dropped. The wrapper is never
/// cloned out of this struct.
struct CopyStream {
    stream: Arc<CudaStream>,
}

impl CopyStream {
    fn new(ctx: &Arc<CudaContext>) -> Result<CopyStream> {
        ctx.bind_to_thread().context("cuda: binding the context")?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .context("cuda: creating a copy stream")?;
        // SAFETY: `raw` is a stream of `ctx`, created just above on its bound context; it lives
        // until this struct's drop destroys it, after the last use of the wrapper, which stays
        // inside this struct (every user borrows it).
        let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok(CopyStream { stream })
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let ctx = self.stream.context();
        let _ = ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the stream was created by `CopyStream::new` and is destroyed once, here; the
        // wrapper is not used after this (it is dropped with the struct).
        let _ = unsafe { result::stream::destroy(self.stream.cu_stream()) };
    }
}

/// The pinned staging buffers and the event recorded after the last copy out of each.
struct Ring {
    events: Vec<CudaEvent>,
    bufs: Vec<PinnedHostSlice<u8>>,
    next: usize,
}

impl Ring {
    fn new(ctx: &Arc<CudaContext>, slots: usize, bytes: usize) -> Result<Ring> {
        let mut bufs = Vec::with_capacity(slots);
        let mut events = Vec::with_capacity(slots);
        for _ in 0..slots {
            // SAFETY: the memory is unset: it is zeroed below before anything makes a slice of it.
            let mut b =
                unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.with_context(|| {
                    format!(
                        "cuda: cannot allocate {} MiB of pinned staging memory",
                        bytes >> 20
                    )
                })?;
            let p = b.as_mut_ptr().context("cuda: pinned staging memory")?;
            // SAFETY: `p` points to the `bytes` bytes just allocated, owned by `b`, used by
            // nothing else yet.
            unsafe { std::ptr::write_bytes(p, 0, bytes) };
            bufs.push(b);
            events.push(
                ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                    .context("cuda: creating an event")?,
            );
        }
        Ok(Ring {
            events,
            bufs,
            next: 0,
        })
    }

    /// The next buffer, once the copy out of it is done.
    fn next(&mut self) -> Result<usize, String> {
        let i = self.next;
        self.next = (self.next + 1) % self.bufs.len();
        self.events[i]
            .synchronize()
            .map_err(|e| format!("cuda: waiting for a staging buffer: {e}"))?;
        Ok(i)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The buffers are freed after this: every copy out of them must be done.
        for e in &self.events {
            let _ = e.synchronize();
        }
    }
}

/// The upload thread of one device.
pub struct Uploader {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    cancel: Arc<AtomicU64>,
    compute: Arc<CudaStream>,
    thread: Option<JoinHandle<()>>,
}

impl Uploader {
    /// Starts the copy stream, the staging ring and the thread on `gpu`.
    pub fn start(gpu: &Gpu) -> Result<Uploader> {
        let ctx = gpu.context().clone();
        let copy = CopyStream::new(&ctx)?;
        let ring = Ring::new(&ctx, STAGING_SLOTS, STAGING_BYTES)?;
        let compute = gpu.stream().clone();
        let cancel = Arc::new(AtomicU64::new(0));
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let worker = Worker {
            ctx,
            copy,
            ring,
            compute: compute.clone(),
            cancel: cancel.clone(),
            files: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("upload-cuda{}", gpu.info.ordinal))
            .spawn(move || worker.run(job_rx, done_tx))
            .context("cuda: starting the upload thread")?;
        Ok(Uploader {
            jobs: Some(job_tx),
            done: done_rx,
            cancel,
            compute,
            thread: Some(thread),
        })
    }

    /// Queues `job`; when the thread has stopped, the job comes back with the error.
    pub fn send(&self, job: Job) -> std::result::Result<(), Box<Job>> {
        match &self.jobs {
            Some(tx) => tx.send(job).map_err(|e| Box::new(e.0)),
            None => Err(Box::new(job)),
        }
    }

    /// Drops every job of a generation before `generation` that has not been uploaded yet (a
    /// job under way stops at its next chunk).
    pub fn cancel_before(&self, generation: u64) {
        self.cancel.fetch_max(generation, Ordering::AcqRel);
    }

    /// The next outcome, waiting for it; `None` once the thread has stopped.
    pub fn recv(&self) -> Option<Done> {
        self.done.recv().ok()
    }

    /// The next outcome if there is one already.
    pub fn try_recv(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }

    /// The compute stream the buffers belong to.
    pub fn compute(&self) -> &CudaStream {
        &self.compute
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        self.cancel.store(u64::MAX, Ordering::Release);
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        while let Ok(d) = self.done.try_recv() {
            d.outcome.retire(&self.compute);
        }
    }
}

/// The upload thread's state.
struct Worker {
    ctx: Arc<CudaContext>,
    copy: CopyStream,
    ring: Ring,
    compute: Arc<CudaStream>,
    cancel: Arc<AtomicU64>,
    files: HashMap<PathBuf, File>,
}

impl Worker {
    fn run(mut self, jobs: Receiver<Job>, done: Sender<Done>) {
        let _ = self.ctx.bind_to_thread();
        for job in jobs.iter() {
            let id = job.id;
            let outcome = if self.cancelled(job.generation) {
                Outcome::Cancelled
            } else {
                self.upload(job)
            };
            if let Err(back) = done.send(Done { id, outcome }) {
                back.0.outcome.retire(&self.compute);
            }
        }
        // The ring and the copy stream are dropped next: every copy finishes first (their own
        // drops wait for it).
    }

    fn cancelled(&self, generation: u64) -> bool {
        generation < self.cancel.load(Ordering::Acquire)
    }

    /// Reads and copies every chunk of `job`; on failure the buffer is retired after the
    /// copies already issued into it.
    fn upload(&mut self, mut job: Job) -> Outcome {
        let mut issued = false;
        let mut timing = (None, 0.0);
        let bytes = job.len();
        match self.copy_chunks(&mut job, &mut issued, &mut timing) {
            Ok(true) => {
                // A job without bytes has no first copy: its two events are recorded together.
                let start = match timing.0.take() {
                    Some(e) => Ok(e),
                    None => self.timing_event(),
                };
                match start.and_then(|start| self.timing_event().map(|done| (start, done))) {
                    Ok((start, done)) => Outcome::Ready(Ready {
                        dst: job.dst,
                        start,
                        done,
                        read_s: timing.1,
                        bytes,
                    }),
                    Err(e) => {
                        self.abandon(job.dst, issued);
                        Outcome::Failed(format!("cuda: recording an upload's end: {e}"))
                    }
                }
            }
            Ok(false) => {
                self.abandon(job.dst, issued);
                Outcome::Cancelled
            }
            Err(why) => {
                let at = job.describe();
                self.abandon(job.dst, issued);
                Outcome::Failed(format!("{}: {at}: {why}", job.what))
            }
        }
    }

    /// A timing event recorded on the copy stream now.
    fn timing_event(&self) -> Result<CudaEvent, cudarc::driver::DriverError> {
        timing_event(&self.ctx, &self.copy.stream)
    }

    /// Frees `dst` after the copies issued into it (the compute stream, where its free is
    /// ordered, waits for them).
    fn abandon(&self, dst: CudaSlice<u8>, issued: bool) {
        if issued {
            if let Ok(e) = self.copy.stream.record_event(None) {
                let _ = self.compute.wait(&e);
            }
        }
        drop(dst);
    }

    /// Ok(true): every chunk copied; Ok(false): cancelled on the way. `timing` gets the event
    /// recorded before the first copy and the seconds spent reading the file.
    fn copy_chunks(
        &mut self,
        job: &mut Job,
        issued: &mut bool,
        timing: &mut (Option<CudaEvent>, f64),
    ) -> Result<bool, String> {
        let len = job.len();
        if job.dst.len() < len {
            return Err(format!(
                "the device buffer holds {} bytes, not {len}",
                job.dst.len()
            ));
        }
        self.copy
            .stream
            .wait(&job.after)
            .map_err(|e| format!("cuda: ordering the copy after the allocation: {e}"))?;
        if job.head.len() > len || job.tail.len() > len {
            return Err("a fingerprint longer than the range".to_string());
        }
        for r in &job.src {
            open_cached(&mut self.files, &r.path)?;
        }
        let files: Vec<&File> = job
            .src
            .iter()
            .map(|r| {
                self.files
                    .get(&r.path)
                    .ok_or_else(|| format!("{} not opened", r.path.display()))
            })
            .collect::<Result<_, String>>()?;
        let pieces: Vec<Piece<'_>> = job
            .src
            .iter()
            .zip(&files)
            .map(|(r, f)| Piece {
                file: f,
                path: &r.path,
                offset: r.offset,
                len: r.len,
            })
            .collect();
        let chunk = self.ring.bufs.first().map_or(0, |b| b.len());
        let tail_at = len - job.tail.len();
        for r in chunks(len, chunk) {
            if self.cancelled(job.generation) {
                return Ok(false);
            }
            let slot = self.ring.next()?;
            let buf = self.ring.bufs[slot]
                .as_mut_slice()
                .map_err(|e| format!("cuda: staging buffer: {e}"))?;
            let buf = &mut buf[..r.len()];
            let t0 = std::time::Instant::now();
            read_parts(&pieces, r.start, buf, READERS)?;
            timing.1 += t0.elapsed().as_secs_f64();
            if !agrees(&job.head, 0, buf, r.start) || !agrees(&job.tail, tail_at, buf, r.start) {
                let paths: std::collections::BTreeSet<String> = job
                    .src
                    .iter()
                    .map(|r| r.path.display().to_string())
                    .collect();
                return Err(format!(
                    "the file's bytes differ from those mapped when the model was opened (was {} changed?)",
                    paths.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
            if timing.0.is_none() {
                // After the first read, so the copy stream's time starts with the first copy.
                timing.0 = Some(
                    timing_event(&self.ctx, &self.copy.stream)
                        .map_err(|e| format!("cuda: recording an upload's start: {e}"))?,
                );
            }
            let (ptr, rec) = job.dst.device_ptr_mut(&self.copy.stream);
            // SAFETY: `ptr + r.start .. + r.len()` lies inside `dst` (checked: dst holds at least
            // the job's `len` bytes and r is inside 0..len); `buf` is pinned memory that is not
            // written again before the event recorded below says this copy is done
            // (`Ring::next`), and it outlives the copy (the ring waits for its events when
            // dropped); the copy stream waited for `dst`'s allocation above.
            unsafe {
                result::memcpy_htod_async(ptr + r.start as u64, &*buf, self.copy.stream.cu_stream())
            }
            .map_err(|e| format!("cuda: copy to the device: {e}"))?;
            drop(rec);
            *issued = true;
            self.ring.events[slot]
                .record(&self.copy.stream)
                .map_err(|e| format!("cuda: recording a copy: {e}"))?;
        }
        Ok(true)
    }
}

/// A timing event (blocking: a host wait on it sleeps) of `ctx` recorded on `stream` now.
fn timing_event(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
) -> Result<CudaEvent, cudarc::driver::DriverError> {
    let e = ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
    e.record(stream)?;
    Ok(e)
}

/// `path` opened for reading, once.
fn open_cached<'f>(files: &'f mut HashMap<PathBuf, File>, path: &Path) -> Result<&'f File, String> {
    if !files.contains_key(path) {
        let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        files.insert(path.to_path_buf(), f);
    }
    files
        .get(path)
        .ok_or_else(|| format!("{} not opened", path.display()))
}

/// The chunks of `len` bytes, `chunk` at most each, in order.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| i * chunk..((i + 1) * chunk).min(len))
}

/// `len` bytes split among at most `readers` contiguous parts of at least `min_part` bytes
/// (one part when `len` is below twice that), in order, covering `0..len`; parts after the
/// first start at a multiple of 4096.
pub fn parts(len: usize, readers: usize, min_part: usize) -> Vec<Range<usize>> {
    const PAGE: usize = 4096;
    let n = (len / min_part.max(1)).clamp(1, readers.max(1));
    let each = len.div_ceil(n).div_ceil(PAGE) * PAGE;
    let mut v = Vec::with_capacity(n);
    let mut start = 0;
    while start < len {
        let end = (start + each).min(len);
        v.push(start..end);
        start = end;
    }
    if v.is_empty() {
        v.push(0..0);
    }
    v
}

/// Whether `got` (bytes at offset `got_at` of a range) equals `want` (bytes at `want_at` of the
/// same range) where the two overlap.
pub fn agrees(want: &[u8], want_at: usize, got: &[u8], got_at: usize) -> bool {
    let lo = want_at.max(got_at);
    let hi = (want_at + want.len()).min(got_at + got.len());
    lo >= hi || want[lo - want_at..hi - want_at] == got[lo - got_at..hi - got_at]
}

/// One file range of a job, its file open.
#[derive(Clone, Copy)]
struct Piece<'f> {
    file: &'f File,
    path: &'f Path,
    offset: u64,
    len: usize,
}

/// The reads that fill bytes `at..at + len` of `pieces` laid one after another: for each
/// range of a piece overlapping them, `(index of the piece, offset in its file, offset in the
/// bytes asked for, length)`, in order.
fn spans(lens: &[usize], at: usize, len: usize) -> Vec<(usize, u64, usize, usize)> {
    let mut v = Vec::new();
    let mut start = 0;
    for (i, &l) in lens.iter().enumerate() {
        let (lo, hi) = (start.max(at), (start + l).min(at + len));
        if lo < hi {
            v.push((i, (lo - start) as u64, lo - at, hi - lo));
        }
        start += l;
        if start >= at + len {
            break;
        }
    }
    v
}

/// Fills `buf` with bytes `at..at + buf.len()` of `pieces` laid one after another, its parts
/// ([`parts`]) read by threads of their own; an error names the file and the offset.
fn read_parts(
    pieces: &[Piece<'_>],
    at: usize,
    buf: &mut [u8],
    readers: usize,
) -> Result<(), String> {
    let lens: Vec<usize> = pieces.iter().map(|p| p.len).collect();
    let read = |part: &mut [u8], part_at: usize| -> Result<(), String> {
        for (i, in_piece, in_part, n) in spans(&lens, at + part_at, part.len()) {
            let p = pieces[i];
            let offset = p.offset + in_piece;
            read_at(p.file, &mut part[in_part..in_part + n], offset).map_err(|e| {
                format!(
                    "reading {n} bytes at offset {offset} of {}: {e}",
                    p.path.display()
                )
            })?;
        }
        Ok(())
    };
    let ps = parts(buf.len(), readers, MIN_PART);
    if ps.len() <= 1 {
        return read(buf, 0);
    }
    std::thread::scope(|s| {
        let mut rest: &mut [u8] = buf;
        let mut handles = Vec::with_capacity(ps.len());
        for r in ps {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            rest = tail;
            let read = &read;
            handles.push(
                std::thread::Builder::new()
                    .spawn_scoped(s, move || read(part, r.start))
                    .map_err(|e| format!("starting a reader thread: {e}"))?,
            );
        }
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err("a reader thread panicked".to_string()))
        })
    })
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset)
}

#[cfg(not(unix))]
fn read_at(_: &File, _: &mut [u8], _: u64) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "positional reads need a Unix system",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order() {
        for (len, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (17, 4), (1000, 256), (7, 0)] {
            let c: Vec<Range<usize>> = chunks(len, chunk).collect();
            assert_eq!(c.len(), len.div_ceil(chunk.max(1)), "{len} {chunk}");
            let mut at = 0;
            for r in &c {
                assert_eq!(r.start, at, "{len} {chunk}: {c:?}");
                assert!(
                    !r.is_empty() && r.len() <= chunk.max(1),
                    "{len} {chunk}: {c:?}"
                );
                at = r.end;
            }
            assert_eq!(at, len);
        }
        // A GLM-5 MoE expert tensor through the ring: 9 full chunks, a partial last one, and
        // the slots alternate so a slot is refilled two chunks after it was filled.
        let len = 2_415_919_104 + 12_345;
        let c: Vec<Range<usize>> = chunks(len, STAGING_BYTES).collect();
        assert_eq!(c.len(), 10);
        assert!(c[..9].iter().all(|r| r.len() == STAGING_BYTES));
        assert_eq!(c[9].len(), len - 9 * STAGING_BYTES);
        let slots: Vec<usize> = (0..c.len()).map(|i| i % STAGING_SLOTS).collect();
        assert_eq!(slots[..4], [0, 1, 0, 1]);
    }

    #[test]
    fn parts_split_a_chunk_among_readers() {
        let mib = 1 << 20;
        // Small: one part.
        assert_eq!(parts(0, 4, 8 * mib), vec![0..0]);
        assert_eq!(parts(5, 4, 8 * mib), vec![0..5]);
        assert_eq!(parts(15 * mib, 4, 8 * mib), vec![0..15 * mib]);
        // Two readers' worth, then the cap of four.
        assert_eq!(
            parts(16 * mib, 4, 8 * mib),
            vec![0..8 * mib, 8 * mib..16 * mib]
        );
        let p = parts(STAGING_BYTES, READERS, MIN_PART);
        assert_eq!(p.len(), READERS);
        assert!(p.iter().all(|r| r.len() == STAGING_BYTES / READERS));
        // Odd sizes: contiguous, page-aligned starts, no empty part, all covered.
        for len in [24 * mib + 1, 100 * mib + 4095, STAGING_BYTES - 3] {
            let p = parts(len, 4, 8 * mib);
            assert!(p.len() <= 4 && !p.is_empty());
            assert_eq!(p[0].start, 0);
            assert_eq!(p.last().map(|r| r.end), Some(len));
            for w in p.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[1].start % 4096, 0);
            }
            assert!(p.iter().all(|r| !r.is_empty()), "{len}: {p:?}");
        }
    }

    #[test]
    fn fingerprints_compare_where_they_overlap() {
        let data: Vec<u8> = (0..100u8).collect();
        let head = &data[..16];
        let tail = &data[84..];
        // Chunks of 10: every chunk agrees with both ends.
        for r in chunks(100, 10) {
            let got = &data[r.clone()];
            assert!(agrees(head, 0, got, r.start) && agrees(tail, 84, got, r.start));
        }
        // A changed byte inside the head, the tail, and outside both.
        let mut bad = data.clone();
        bad[3] = 0xff;
        assert!(!agrees(head, 0, &bad[0..10], 0));
        let mut bad = data.clone();
        bad[90] = 0xff;
        assert!(!agrees(tail, 84, &bad[90..100], 90));
        assert!(agrees(tail, 84, &bad[80..85], 80));
        let mut bad = data.clone();
        bad[50] = 0xff;
        assert!(agrees(head, 0, &bad[40..60], 40) && agrees(tail, 84, &bad[40..60], 40));
        // Empty fingerprints and chunks agree with anything.
        assert!(agrees(&[], 0, &[1, 2], 0) && agrees(&[1], 0, &[], 0));
    }

    #[test]
    fn parts_are_read_at_their_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        let data: Vec<u8> = (0..3 * MIN_PART + 777)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        let whole = |offset: u64, len: usize| Piece {
            file: &f,
            path: &path,
            offset,
            len,
        };
        let mut buf = vec![0u8; data.len() - 5];
        read_parts(&[whole(5, data.len() - 5)], 0, &mut buf, READERS).unwrap();
        assert_eq!(buf, data[5..]);
        let mut past = vec![0u8; 10];
        let e = read_parts(&[whole(data.len() as u64 - 5, 10)], 0, &mut past, READERS).unwrap_err();
        assert!(
            e.contains(&format!("offset {}", data.len() - 5)) && e.contains("f.bin"),
            "{e}"
        );
        // Ranges laid one after another (a stacked tensor's rows of some experts), read from
        // the middle of the second on, parts crossing from one range to the next.
        let ranges = [
            (0, 1000),
            (MIN_PART + 3, 2 * MIN_PART + 11),
            (100, 5),
            (17, MIN_PART - 2),
        ];
        let pieces: Vec<Piece<'_>> = ranges.iter().map(|&(o, l)| whole(o as u64, l)).collect();
        let laid: Vec<u8> = ranges
            .iter()
            .flat_map(|&(o, l)| data[o..o + l].iter().copied())
            .collect();
        for (at, len) in [(0, laid.len()), (1500, laid.len() - 1500), (999, 3), (7, 0)] {
            let mut buf = vec![0u8; len];
            read_parts(&pieces, at, &mut buf, READERS).unwrap();
            assert_eq!(buf, laid[at..at + len], "{at} {len}");
        }
    }

    #[test]
    fn spans_cut_the_ranges_laid_one_after_another() {
        // Ranges of 10, 0, 5 and 20 bytes: 0..10, 10..15, 15..35 laid out.
        let lens = [10, 0, 5, 20];
        assert_eq!(
            spans(&lens, 0, 35),
            vec![(0, 0, 0, 10), (2, 0, 10, 5), (3, 0, 15, 20)]
        );
        assert_eq!(spans(&lens, 8, 4), vec![(0, 8, 0, 2), (2, 0, 2, 2)]);
        assert_eq!(spans(&lens, 12, 3), vec![(2, 2, 0, 3)]);
        assert_eq!(spans(&lens, 30, 5), vec![(3, 15, 0, 5)]);
        assert!(spans(&lens, 35, 0).is_empty() && spans(&lens, 3, 0).is_empty());
    }
}
