//! Uploads behind compute: byte ranges of files put on a device by a host thread of their own,
//! through pinned staging memory or from the file's registered pages, and a copy stream of their
//! own, while the caller's thread and the device's compute stream go on with other work. The
//! CUDA engine's prefetch (`engine::cuda::prefetch`) and dequant-check's pipeline (`dcheck`) both
//! use it.
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
//! # From the mapped file ([`Source::Mapped`])
//! Instead of the staging copy, the thread can map the file and register the pages of a job's
//! ranges with the driver (`cuMemHostRegister`, read-only): the device's copy engine then reads
//! the page cache itself, and no host thread copies the bytes. The pages a job registers
//! (its ranges rounded out to pages, merged where they touch) stay registered until its copies
//! are done; they are unregistered when a later job starts and finds them done, or before a
//! later job registers a page they hold (two registrations may not share a page), and all of
//! them before the thread ends. When a file cannot be mapped or the driver refuses a
//! registration, that job and every later one go through the staging buffers, and the job's
//! [`Ready::note`] says why.
//!
//! Every failure of a job (the file, the device) comes back as [`Outcome::Failed`] with the
//! reason, never as a panic; the caller decides what to do instead.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// Microseconds the upload threads started from now on sleep after each registration
/// ([`set_register_pause_by_default`]).
static REGISTER_PAUSE_US: AtomicU64 = AtomicU64::new(0);

/// How long the upload threads of engines opened from now on sleep after each registration of
/// a mapped file's pages: the command's `--register-pause`, set once at its start.
pub fn set_register_pause_by_default(pause: std::time::Duration) {
    let us = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX);
    REGISTER_PAUSE_US.store(us, Ordering::Relaxed);
}

/// What [`set_register_pause_by_default`] set (none unless told otherwise).
pub fn register_pause_by_default() -> std::time::Duration {
    std::time::Duration::from_micros(REGISTER_PAUSE_US.load(Ordering::Relaxed))
}

/// How the upload thread puts a job's bytes on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Read into pinned staging buffers by [`READERS`] threads, copied from there.
    Staged,
    /// Copied by the device from the file's mapped pages, registered with the driver for the
    /// copy (see the module documentation); staged where the driver refuses.
    Mapped,
}

/// Whether uploaders started with [`source_by_default`] stage ([`set_source_by_default`]).
static STAGED_BY_DEFAULT: AtomicBool = AtomicBool::new(false);

/// Where the uploads of engines opened from now on take their bytes: the command's
/// `--upload-from`, set once at its start, before any engine opens.
pub fn set_source_by_default(source: Source) {
    STAGED_BY_DEFAULT.store(source == Source::Staged, Ordering::Relaxed);
}

/// The source [`set_source_by_default`] set ([`Source::Mapped`] unless told otherwise).
pub fn source_by_default() -> Source {
    if STAGED_BY_DEFAULT.load(Ordering::Relaxed) {
        Source::Staged
    } else {
        Source::Mapped
    }
}

/// Page size the registered ranges are rounded to.
const PAGE: usize = 4096;

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
    /// Why the job went through the staging buffers though the thread copies from the mapped
    /// file ([`Source::Mapped`]): the driver refused to register its pages.
    note: Option<String>,
}

/// How long a job's copies took: taken with [`Ready::take_timed`], read once they are finished.
pub struct CopyTiming {
    start: CudaEvent,
    done: CudaEvent,
    /// Bytes copied.
    pub bytes: usize,
    /// Host seconds the upload thread spent reading the bytes from the file into pinned
    /// staging memory (positional reads, [`READERS`] threads a chunk), or registering their
    /// mapped pages ([`Source::Mapped`]).
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
    /// Why a job of a thread that copies from the mapped file ([`Source::Mapped`]) was staged
    /// instead, if it was.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

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
    /// Starts the copy stream, the staging ring and the thread on `gpu`, staging every job
    /// ([`Source::Staged`]).
    pub fn start(gpu: &Gpu) -> Result<Uploader> {
        Uploader::start_from(gpu, Source::Staged)
    }

    /// [`Uploader::start`], the jobs' bytes taken from `source`, the thread sleeping
    /// [`register_pause_by_default`] after each registration.
    pub fn start_from(gpu: &Gpu, source: Source) -> Result<Uploader> {
        Uploader::start_giving_way(gpu, source, register_pause_by_default())
    }

    /// [`Uploader::start_from`], the thread sleeping `give_way` after each registration of a
    /// mapped file's pages ([`Source::Mapped`]), so that other threads' calls into the driver,
    /// which a registration may hold up, get their turn between two.
    pub fn start_giving_way(
        gpu: &Gpu,
        source: Source,
        give_way: std::time::Duration,
    ) -> Result<Uploader> {
        let ctx = gpu.context().clone();
        let copy = CopyStream::new(&ctx)?;
        let ring = Ring::new(&ctx, STAGING_SLOTS, STAGING_BYTES)?;
        let compute = gpu.stream().clone();
        let cancel = Arc::new(AtomicU64::new(0));
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let worker = Worker {
            pins: Pins::default(),
            maps: HashMap::new(),
            mapped: match source {
                Source::Mapped => Ok(()),
                Source::Staged => Err(String::new()),
            },
            ctx,
            copy,
            ring,
            compute: compute.clone(),
            cancel: cancel.clone(),
            files: HashMap::new(),
            give_way,
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

    /// The next outcome if there is one already; `Err(())` once the thread has stopped and
    /// every outcome was taken.
    #[allow(clippy::result_unit_err)]
    pub fn try_recv_alive(&self) -> std::result::Result<Option<Done>, ()> {
        match self.done.try_recv() {
            Ok(d) => Ok(Some(d)),
            Err(std::sync::mpsc::TryRecvError::Empty) => Ok(None),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(()),
        }
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

/// The upload thread's state. Fields drop in order: the registered pages are unregistered
/// (after their copies) before the maps they lie in.
struct Worker {
    pins: Pins,
    maps: HashMap<PathBuf, memmap2::Mmap>,
    /// Ok: jobs are copied from the mapped files ([`Source::Mapped`]); Err: staged, and why
    /// (empty when staging was asked for).
    mapped: Result<(), String>,
    ctx: Arc<CudaContext>,
    copy: CopyStream,
    ring: Ring,
    compute: Arc<CudaStream>,
    cancel: Arc<AtomicU64>,
    files: HashMap<PathBuf, File>,
    /// Slept after each registration of mapped pages ([`Uploader::start_giving_way`]).
    give_way: std::time::Duration,
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

    /// Copies `job` from the mapped file ([`Source::Mapped`]) when the driver registers its
    /// pages, else reads and copies every chunk of it through the staging buffers; on failure
    /// the buffer is retired after the copies already issued into it.
    fn upload(&mut self, mut job: Job) -> Outcome {
        let mut issued = false;
        let mut timing = (None, 0.0);
        let bytes = job.len();
        let mut note = None;
        let copied = if self.mapped.is_ok() {
            match self.copy_mapped(&mut job, &mut issued, &mut timing) {
                Ok(Some(copied)) => Ok(copied),
                Ok(None) => {
                    let why = self.mapped.clone().err().unwrap_or_default();
                    note = Some(format!("uploads staged from {}: {why}", job.what));
                    self.copy_chunks(&mut job, &mut issued, &mut timing)
                }
                Err(e) => Err(e),
            }
        } else {
            self.copy_chunks(&mut job, &mut issued, &mut timing)
        };
        match copied {
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
                        note,
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

    /// Copies `job` from the mapped file: its ranges' pages registered with the driver, one
    /// asynchronous copy per range. Ok(Some(true)): every copy issued; Ok(Some(false)):
    /// cancelled before any; Ok(None): a file could not be mapped or the driver refused a
    /// registration (nothing was copied; `self.mapped` says why), so the job is to be staged.
    /// `timing` gets the event recorded before the first copy and the seconds spent registering.
    fn copy_mapped(
        &mut self,
        job: &mut Job,
        issued: &mut bool,
        timing: &mut (Option<CudaEvent>, f64),
    ) -> Result<Option<bool>, String> {
        use cudarc::driver::sys;
        let len = job.len();
        if job.dst.len() < len {
            return Err(format!(
                "the device buffer holds {} bytes, not {len}",
                job.dst.len()
            ));
        }
        if job.head.len() > len || job.tail.len() > len {
            return Err("a fingerprint longer than the range".to_string());
        }
        if self.cancelled(job.generation) {
            return Ok(Some(false));
        }
        self.copy
            .stream
            .wait(&job.after)
            .map_err(|e| format!("cuda: ordering the copy after the allocation: {e}"))?;
        // The ranges' host addresses in the maps: (address, length), laid in order.
        let mut host: Vec<(usize, usize)> = Vec::with_capacity(job.src.len());
        for r in &job.src {
            // A file that cannot be mapped (a file system without maps) is staged instead.
            let m = match map_cached(&mut self.maps, &r.path) {
                Ok(m) => m,
                Err(why) => {
                    self.mapped = Err(why);
                    return Ok(None);
                }
            };
            let end = r.offset.checked_add(r.len as u64);
            if end.is_none_or(|e| e > m.len() as u64) {
                return Err(format!(
                    "{} bytes at offset {} of {}: past the file's end ({} bytes)",
                    r.len,
                    r.offset,
                    r.path.display(),
                    m.len()
                ));
            }
            host.push((m.as_ptr() as usize + r.offset as usize, r.len));
        }
        // Bytes `at..at + n` of the ranges laid one after another, read from the maps.
        let laid = |at: usize, n: usize| -> Vec<u8> {
            let lens: Vec<usize> = host.iter().map(|h| h.1).collect();
            let mut v = Vec::with_capacity(n);
            for (i, in_piece, _, k) in spans(&lens, at, n) {
                let a = host[i].0 + in_piece as usize;
                // SAFETY: `a .. a + k` lies inside range `i`, inside its live map (checked
                // above), which is only read.
                v.extend_from_slice(unsafe { std::slice::from_raw_parts(a as *const u8, k) });
            }
            v
        };
        if laid(0, job.head.len()) != job.head
            || laid(len - job.tail.len(), job.tail.len()) != job.tail
        {
            return Err(changed_file(job));
        }
        // Each range's whole pages are copied where they lie, registered; its ends on pages
        // it shares with other bytes (less than a page each) go through a staging buffer, so
        // that no page is registered by two jobs at once.
        let pieces = mapped_pieces(&host);
        let pages = page_spans(&pieces);
        let t0 = std::time::Instant::now();
        self.pins.release(&pages)?;
        let mut registered = Vec::with_capacity(pages.len());
        for &(lo, hi) in &pages {
            // SAFETY: `lo..hi` is page-aligned and lies inside a live read-only map of this
            // thread's (whole pages of the jobs' ranges); no page of it is registered already
            // (`release` unregistered every earlier span sharing one); it stays registered, and
            // the map alive, until its copies are done (`Pins`).
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    lo as *mut std::ffi::c_void,
                    hi - lo,
                    sys::CU_MEMHOSTREGISTER_READ_ONLY,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                unregister(&registered);
                timing.1 += t0.elapsed().as_secs_f64();
                self.mapped = Err(format!(
                    "the driver did not register {} bytes of the mapped file ({r:?})",
                    hi - lo
                ));
                return Ok(None);
            }
            registered.push((lo, hi));
            if !self.give_way.is_zero() {
                std::thread::sleep(self.give_way);
            }
        }
        timing.1 += t0.elapsed().as_secs_f64();
        let start = timing_event(&self.ctx, &self.copy.stream)
            .map_err(|e| format!("cuda: recording an upload's start: {e}"));
        let start = match start {
            Ok(e) => e,
            Err(e) => {
                unregister(&registered);
                return Err(e);
            }
        };
        timing.0 = Some(start);
        *issued = true;
        let failed = self.issue_mapped(job, &pieces).err();
        match timing_event(&self.ctx, &self.copy.stream) {
            Ok(done) => self.pins.held.push(Pin {
                spans: registered,
                done,
            }),
            Err(e) => {
                // The copies' end cannot be marked: wait for the stream before unregistering.
                let _ = self.copy.stream.synchronize();
                unregister(&registered);
                return Err(format!("cuda: recording a copy: {e}"));
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(Some(true)),
        }
    }

    /// Issues the copies of `pieces` into `job.dst` on the copy stream: the staged ones (a
    /// range's ends) first, gathered into the next staging buffer, then the registered ones
    /// straight from their pages.
    fn issue_mapped(&mut self, job: &mut Job, pieces: &[MappedPiece]) -> Result<(), String> {
        use cudarc::driver::sys;
        let staged: usize = pieces.iter().filter(|p| !p.registered).map(|p| p.len).sum();
        let (ptr, rec) = job.dst.device_ptr_mut(&self.copy.stream);
        let stream = self.copy.stream.cu_stream();
        let copy = |dst: u64, src: *const u8, n: usize| -> Result<(), String> {
            // SAFETY: `dst .. + n` lies inside the job's buffer (a piece's place in the ranges
            // laid one after another, which the buffer holds: checked by the caller); `src`
            // is pinned (a staging buffer not refilled before this copy's event, or registered
            // pages of a live map kept registered until the job's copies are done).
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, n, stream)
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("cuda: copy to the device: {r:?}"))
            }
        };
        let result = (|| {
            if staged > 0 {
                let slot = self.ring.next()?;
                let buf = self.ring.bufs[slot]
                    .as_mut_slice()
                    .map_err(|e| format!("cuda: staging buffer: {e}"))?;
                if staged > buf.len() {
                    return Err(format!(
                        "{staged} bytes of range ends for one staging buffer"
                    ));
                }
                let mut at = 0;
                for p in pieces.iter().filter(|p| !p.registered) {
                    // SAFETY: the piece lies inside a live map of this thread's (checked when the
                    // ranges were placed), which is only read.
                    let src = unsafe { std::slice::from_raw_parts(p.host as *const u8, p.len) };
                    buf[at..at + p.len].copy_from_slice(src);
                    copy(ptr + p.dst as u64, buf[at..].as_ptr(), p.len)?;
                    at += p.len;
                }
                self.ring.events[slot]
                    .record(&self.copy.stream)
                    .map_err(|e| format!("cuda: recording a copy: {e}"))?;
            }
            for p in pieces.iter().filter(|p| p.registered) {
                copy(ptr + p.dst as u64, p.host as *const u8, p.len)?;
            }
            Ok(())
        })();
        drop(rec);
        result
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
                return Err(changed_file(job));
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

/// The error of a job whose file's bytes differ from its fingerprints.
fn changed_file(job: &Job) -> String {
    let paths: std::collections::BTreeSet<String> = job
        .src
        .iter()
        .map(|r| r.path.display().to_string())
        .collect();
    format!(
        "the file's bytes differ from those mapped when the model was opened (was {} changed?)",
        paths.into_iter().collect::<Vec<_>>().join(", ")
    )
}

/// `path` mapped read-only, once.
fn map_cached<'m>(
    maps: &'m mut HashMap<PathBuf, memmap2::Mmap>,
    path: &Path,
) -> Result<&'m memmap2::Mmap, String> {
    if !maps.contains_key(path) {
        let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // SAFETY: a read-only shared map; the model's own reader maps the same file the same
        // way, and a file changed under it is caught by the jobs' fingerprints.
        let m = unsafe { memmap2::Mmap::map(&f) }
            .map_err(|e| format!("cannot map {}: {e}", path.display()))?;
        maps.insert(path.to_path_buf(), m);
    }
    maps.get(path)
        .ok_or_else(|| format!("{} not mapped", path.display()))
}

/// One copy of a job copied from the mapped file: `len` bytes at host address `host` to offset
/// `dst` of the job's buffer; `registered`: whole pages of one range (copied from where they
/// lie), else one of a range's ends (staged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MappedPiece {
    host: usize,
    len: usize,
    dst: usize,
    registered: bool,
}

/// The copies of the host ranges `(address, length)`, laid one after another from offset 0:
/// each range's whole pages as one registered piece, the bytes before and after them (on pages
/// the range shares with other bytes) as staged pieces; a range on no whole page is one staged
/// piece. Empty ranges give none.
fn mapped_pieces(host: &[(usize, usize)]) -> Vec<MappedPiece> {
    let mut v = Vec::with_capacity(3 * host.len());
    let mut dst = 0;
    for &(a, n) in host {
        let (lo, hi) = (a.div_ceil(PAGE) * PAGE, (a + n) / PAGE * PAGE);
        let parts = if lo < hi {
            [
                (a, lo - a, false),
                (lo, hi - lo, true),
                (hi, a + n - hi, false),
            ]
        } else {
            [(a, n, false), (a + n, 0, false), (a + n, 0, false)]
        };
        for (h, len, registered) in parts {
            if len > 0 {
                v.push(MappedPiece {
                    host: h,
                    len,
                    dst: dst + (h - a),
                    registered,
                });
            }
        }
        dst += n;
    }
    v
}

/// The page spans to register for `pieces`: the registered pieces (whole pages), sorted,
/// merged where they touch; `(start, end)` addresses.
fn page_spans(pieces: &[MappedPiece]) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = pieces
        .iter()
        .filter(|p| p.registered)
        .map(|p| (p.host, p.host + p.len))
        .collect();
    v.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(v.len());
    for (lo, hi) in v {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// Unregisters the page spans `spans` (registered by [`Worker::copy_mapped`]); a failure
/// leaves the pages pinned until the process ends, which is harmless.
fn unregister(spans: &[(usize, usize)]) {
    for &(lo, _) in spans {
        // SAFETY: `lo` starts a span this thread registered and has not unregistered; its
        // copies are done (every caller waits for them, or issued none).
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(lo as *mut std::ffi::c_void) };
    }
}

/// The page spans of one job copied from the mapped file, registered until `done`.
struct Pin {
    spans: Vec<(usize, usize)>,
    done: CudaEvent,
}

/// The registered page spans whose copies may still run.
#[derive(Default)]
struct Pins {
    held: Vec<Pin>,
}

impl Pins {
    /// Unregisters the spans whose copies are done, and those sharing a page with `spans`
    /// (after waiting for their copies); the others stay.
    fn release(&mut self, spans: &[(usize, usize)]) -> Result<(), String> {
        let mut err = None;
        let mut keep = Vec::with_capacity(self.held.len());
        for p in std::mem::take(&mut self.held) {
            let shares = p
                .spans
                .iter()
                .any(|&(lo, hi)| spans.iter().any(|&(a, b)| a < hi && lo < b));
            if shares {
                if let Err(e) = p.done.synchronize() {
                    err.get_or_insert(format!("cuda: waiting for an earlier upload: {e}"));
                    keep.push(p);
                    continue;
                }
            } else if !p.done.is_complete() {
                keep.push(p);
                continue;
            }
            unregister(&p.spans);
        }
        self.held = keep;
        err.map_or(Ok(()), Err)
    }
}

impl Drop for Pins {
    /// Waits for every copy still reading registered pages, then unregisters them (before the
    /// maps they lie in are dropped: see [`Worker`]).
    fn drop(&mut self) {
        for p in self.held.drain(..) {
            let _ = p.done.synchronize();
            unregister(&p.spans);
        }
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
#[path = "upload/beside_tests.rs"]
mod beside_tests;

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
    fn mapped_pieces_by_hand() {
        let p = |host: usize, len: usize, dst: usize, registered: bool| MappedPiece {
            host,
            len,
            dst,
            registered,
        };
        // 12288 bytes from 41060 (10 pages + 100): 3996 bytes to the next page (45056), its two
        // whole pages (to 53248), 100 bytes after; then 100 bytes inside one page, an empty
        // range, and two whole pages.
        let host = [(41060, 3 * 4096), (8192 + 10, 100), (5, 0), (16384, 8192)];
        assert_eq!(
            mapped_pieces(&host),
            vec![
                p(41060, 3996, 0, false),
                p(45056, 8192, 3996, true),
                p(53248, 100, 12188, false),
                p(8202, 100, 12288, false),
                p(16384, 8192, 12388, true),
            ]
        );
        // The registered spans sorted; touching and repeated ones merged.
        let pieces = mapped_pieces(&host);
        assert_eq!(page_spans(&pieces), vec![(16384, 24576), (45056, 53248)]);
        let touching = mapped_pieces(&[(4096, 4096), (0, 4096), (0, 4096), (8192, 1)]);
        assert_eq!(page_spans(&touching), vec![(0, 8192)]);
        assert!(page_spans(&mapped_pieces(&[(1, 4094), (0, 0)])).is_empty());
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
    /// Host-to-device copy rates of file bytes in the page cache, by the staging path (this
    /// module's [`Uploader`]) and by registering the file's mapped pages with the driver and
    /// copying from them (no staging copy): the registration, the copy and the unregistration
    /// timed apart, on a fresh map and on one whose pages are mapped already, from one thread
    /// and from [`READERS`] threads at once. A probe for the GPU machine:
    /// `GLMDIFF_REGISTER_FILE=<a file of 2 GiB or more> cargo test --release --lib
    /// registered_copy_speed -- --ignored --nocapture` (returns early without the variable).
    #[test]
    #[ignore]
    fn registered_copy_speed() {
        use cudarc::driver::sys;
        use std::time::Instant;
        let Ok(path) = std::env::var("GLMDIFF_REGISTER_FILE") else {
            eprintln!("registered_copy_speed: GLMDIFF_REGISTER_FILE not set, skipped");
            return;
        };
        let path = PathBuf::from(path);
        let gpu = Gpu::open(0).unwrap();
        let ctx = gpu.context().clone();
        ctx.bind_to_thread().unwrap();
        for (name, a) in [
            (
                "host register supported",
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
            ),
            (
                "read-only host register supported",
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
            ),
            (
                "pageable memory access",
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
            ),
        ] {
            println!("{name}: {:?}", ctx.attribute(a));
        }
        let file = File::open(&path).unwrap();
        let flen = file.metadata().unwrap().len() as usize;
        let base = 256usize << 20;
        let sizes: Vec<usize> = [16usize << 20, 128 << 20, 512 << 20, 1536 << 20]
            .into_iter()
            .filter(|&s| base + s <= flen)
            .collect();
        // Bring the bytes into the page cache.
        let mut warm = vec![0u8; 64 << 20];
        let top = base + sizes.last().copied().unwrap_or(0);
        let mut at = base;
        while at < top {
            let n = warm.len().min(top - at);
            read_at(&file, &mut warm[..n], at as u64).unwrap();
            at += n;
        }
        drop(warm);
        let dst = alloc_dst(&gpu, sizes.last().copied().unwrap_or(1), "probe").unwrap();
        let stream = gpu.stream().clone();
        let gbs = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
        // The staging path, through an uploader.
        let up = Uploader::start(&gpu).unwrap();
        let mut dst = Some(dst);
        for &size in &sizes {
            for _ in 0..2 {
                let after = Arc::new(stream.record_event(None).unwrap());
                let t0 = Instant::now();
                up.send(Job {
                    id: 0,
                    generation: 0,
                    what: "probe".into(),
                    src: vec![FileRange {
                        path: path.clone(),
                        offset: base as u64,
                        len: size,
                    }],
                    head: Vec::new(),
                    tail: Vec::new(),
                    dst: dst.take().unwrap(),
                    after,
                })
                .map_err(|_| "send")
                .unwrap();
                let done = up.recv().unwrap();
                let Outcome::Ready(r) = done.outcome else {
                    panic!("staging upload failed")
                };
                r.wait_host().unwrap();
                let s = t0.elapsed().as_secs_f64();
                println!(
                    "staging {:5} MiB: {:7.1} ms, {:5.1} GB/s (reads {:.1} ms)",
                    size >> 20,
                    s * 1e3,
                    gbs(size, s),
                    r.read_s * 1e3
                );
                dst = Some(r.take(&stream).unwrap());
            }
        }
        drop(up);
        let mut dst = dst.unwrap();
        // Registered: register, copy, unregister, on `threads` threads (a part each).
        let registered = |size: usize, threads: usize, populate: bool, dst: &mut CudaSlice<u8>| {
            // SAFETY: a read-only shared map of a file nothing writes during the probe.
            let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
            let p = map[base..].as_ptr();
            if populate {
                // SAFETY: the range lies inside the live map.
                let r = unsafe { libc::madvise(p as *mut libc::c_void, size, 22) };
                assert_eq!(
                    r,
                    0,
                    "MADV_POPULATE_READ: {}",
                    std::io::Error::last_os_error()
                );
            }
            let part = size.div_ceil(threads).div_ceil(4096) * 4096;
            let (dptr, rec) = dst.device_ptr_mut(&stream);
            let t0 = Instant::now();
            let times: Vec<(f64, f64)> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|i| {
                        let ctx = ctx.clone();
                        let p = p as usize;
                        s.spawn(move || {
                            ctx.bind_to_thread().unwrap();
                            let lo = (i * part).min(size);
                            let hi = ((i + 1) * part).min(size);
                            if lo >= hi {
                                return (0.0, 0.0);
                            }
                            let hp = (p + lo) as *mut std::ffi::c_void;
                            let t = Instant::now();
                            // SAFETY: a page-aligned range of the live read-only map.
                            let r = unsafe {
                                sys::cuMemHostRegister_v2(
                                    hp,
                                    hi - lo,
                                    sys::CU_MEMHOSTREGISTER_READ_ONLY,
                                )
                            };
                            assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "register");
                            let reg = t.elapsed().as_secs_f64();
                            let cs = ctx.new_stream().unwrap();
                            // SAFETY: the destination holds `size` bytes; the host range is
                            // registered and stays so until the synchronize below.
                            unsafe {
                                let r = sys::cuMemcpyHtoDAsync_v2(
                                    dptr + lo as u64,
                                    hp,
                                    hi - lo,
                                    cs.cu_stream(),
                                );
                                assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "copy");
                            }
                            cs.synchronize().unwrap();
                            let t2 = Instant::now();
                            // SAFETY: registered above; its copy is done.
                            let r = unsafe { sys::cuMemHostUnregister(hp) };
                            assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "unregister");
                            (reg, t2.elapsed().as_secs_f64())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let total = t0.elapsed().as_secs_f64();
            drop(rec);
            let reg = times.iter().map(|t| t.0).fold(0.0, f64::max);
            let unreg = times.iter().map(|t| t.1).fold(0.0, f64::max);
            println!(
                "registered {:5} MiB, {threads} thread(s), {}: {:7.1} ms, {:5.1} GB/s \
                 (register {:.1} ms, unregister {:.1} ms, slowest thread)",
                size >> 20,
                if populate {
                    "mapped first"
                } else {
                    "fresh map"
                },
                total * 1e3,
                gbs(size, total),
                reg * 1e3,
                unreg * 1e3
            );
        };
        for &size in &sizes {
            for (threads, populate) in [(1, false), (1, true), (READERS, false), (READERS, true)] {
                registered(size, threads, populate, &mut dst);
            }
        }
        // A check of the bytes: the last registered copy against the file.
        let size = sizes.last().copied().unwrap_or(0).min(16 << 20);
        let mut host = vec![0u8; size];
        stream.memcpy_dtoh(&dst.slice(0..size), &mut host).unwrap();
        let mut want = vec![0u8; size];
        read_at(&file, &mut want, base as u64).unwrap();
        assert!(host == want, "registered copy differs from the file");
        println!(
            "registered copy: the first {} MiB equal the file",
            size >> 20
        );
    }
}
