//! Prefetch: the raw blocks of the layer a walk begins next ([`Engine::prefetch_layer`]) put on
//! the device by an [`Uploader`] (a thread of its own copying from the model's mapped files, or
//! through pinned staging buffers: `--upload-from`; a copy stream of its own) while the current
//! layer's steps run on the host and the compute stream; [`CudaEngine::raw`] takes a prefetched
//! tensor instead of uploading it, after making the compute stream wait for its copies.
//!
//! Bounds: a tensor is prefetched only when the device's free memory holds the whole layer's
//! raw blocks plus [`PREFETCH_RESERVE`] (the current layer's scratch), so the device holds at
//! most two layers' raw blocks (the current one and the next) besides the globals; pinned host
//! memory is the uploader's ring (`gpu::upload`). Prefetches the walk will not use (a layer that
//! is not begun next, a tensor no step read) are dropped at the next `begin_layer` /
//! `end_layer`, after their copies.
//!
//! Nothing here is an error: a layer that does not fit, an uploader that cannot start, a
//! tensor whose upload fails, all leave the tensor to the on-demand upload of `raw`, as without
//! prefetch, and say why in [`PrefetchSummary::notes`]. A command's `--no-prefetch` (through
//! [`set_prefetch_by_default`]) or [`CudaEngine::with_prefetch`] turns prefetching off.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::CudaEngine;
use crate::gpu::upload::{
    alloc_dst, source_by_default, total_len, Done, FileRange, Job, Outcome, Uploader,
};
use crate::gpu::Gpu;

/// Free device memory a layer's prefetch leaves untouched: the current layer's scratch
/// (dequantized weights, activations, cuBLAS workspace), as the several-device plan allows it.
pub const PREFETCH_RESERVE: u64 = 2 << 30;
/// Bytes of a tensor's first and last bytes compared between the memory map and the file.
const FINGERPRINT: usize = 64;
/// Distinct reasons kept in [`PrefetchSummary::notes`].
const MAX_NOTES: usize = 4;

/// Whether engines opened from now on prefetch ([`set_prefetch_by_default`]).
static BY_DEFAULT: AtomicBool = AtomicBool::new(true);

/// Whether prefetching is on unless told otherwise: on, but for a command run with
/// `--no-prefetch` ([`set_prefetch_by_default`]).
pub fn prefetch_by_default() -> bool {
    BY_DEFAULT.load(Ordering::Relaxed)
}

/// Sets whether the engines this process opens from now on prefetch: the command's
/// `--no-prefetch` (whose default `GLMDIFF_NO_PREFETCH` sets), set once at its start, before
/// any engine opens.
pub fn set_prefetch_by_default(on: bool) {
    BY_DEFAULT.store(on, Ordering::Relaxed);
}

/// What prefetching did over an engine's life.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefetchSummary {
    /// Whether prefetching was on.
    pub on: bool,
    /// Tensors a step took from a prefetch.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Tensors of a prefetched layer uploaded on demand instead (the layer did not fit, the
    /// upload failed).
    pub fallbacks: usize,
    /// Why, a few distinct reasons.
    pub notes: Vec<String>,
}

impl PrefetchSummary {
    /// Adds another engine's figures (the devices of a several-device run).
    pub fn merge(&mut self, o: &PrefetchSummary) {
        self.on |= o.on;
        self.tensors += o.tensors;
        self.bytes += o.bytes;
        self.fallbacks += o.fallbacks;
        for n in &o.notes {
            if !self.notes.contains(n) && self.notes.len() < MAX_NOTES {
                self.notes.push(n.clone());
            }
        }
    }
}

/// A prefetched tensor not yet taken.
pub(super) struct Entry {
    id: u64,
    layer: usize,
    state: State,
}

enum State {
    /// Queued or under way.
    Issued,
    /// Its outcome came back.
    Arrived(Outcome),
}

/// The prefetch state of one engine.
pub(super) struct Prefetch {
    on: bool,
    uploader: Option<Uploader>,
    /// The uploader could not start, or stopped: no more prefetches.
    dead: bool,
    begun: Option<usize>,
    /// The tensors of the layer begun (`begin_layer`'s names).
    begun_weights: Vec<String>,
    next_id: u64,
    generation: u64,
    pub(super) pending: HashMap<String, Entry>,
    summary: PrefetchSummary,
}

impl Prefetch {
    pub(super) fn new(on: bool) -> Prefetch {
        Prefetch {
            on,
            uploader: None,
            dead: false,
            begun: None,
            begun_weights: Vec::new(),
            next_id: 0,
            generation: 0,
            pending: HashMap::new(),
            summary: PrefetchSummary {
                on,
                ..PrefetchSummary::default()
            },
        }
    }

    pub(super) fn set_on(&mut self, on: bool) {
        self.on = on;
        self.summary.on = on;
    }

    fn note(&mut self, why: String) {
        if !self.summary.notes.contains(&why) && self.summary.notes.len() < MAX_NOTES {
            self.summary.notes.push(why);
        }
    }

    /// Drops an outcome after its copies.
    fn retire(&self, o: Outcome) {
        if let Some(u) = &self.uploader {
            o.retire(u.compute());
        }
    }

    /// Files an outcome that came back under its entry (or retires it: nobody waits for it).
    fn place(&mut self, d: Done) {
        match self.pending.values_mut().find(|e| e.id == d.id) {
            Some(e) if matches!(e.state, State::Issued) => e.state = State::Arrived(d.outcome),
            _ => self.retire(d.outcome),
        }
    }

    /// Where the upload of `name` stands, the outcomes already back filed first: `Some(true)`
    /// when its copies are done (taken without a wait), `Some(false)` while it or they are under
    /// way (the uploader alive), `None` else (not sent, failed, no uploader: a take won't wait).
    pub(super) fn upload_done(&mut self, name: &str) -> Option<bool> {
        while let Some(r) = self.uploader.as_ref().map(Uploader::try_recv_alive) {
            match r {
                Ok(Some(d)) => self.place(d),
                Ok(None) => break,
                Err(()) => {
                    self.dead = true;
                    break;
                }
            }
        }
        match &self.pending.get(name)?.state {
            State::Issued => (!self.dead && self.uploader.is_some()).then_some(false),
            State::Arrived(Outcome::Ready(r)) => Some(r.is_complete()),
            State::Arrived(_) => None,
        }
    }

    /// Files every outcome already back.
    fn drain(&mut self) {
        while let Some(d) = self.uploader.as_ref().and_then(Uploader::try_recv) {
            self.place(d);
        }
    }

    /// Drops the entries of layers `keep` rejects; when no entry under way is left, the
    /// uploader drops what it has not uploaded yet.
    fn drop_layers(&mut self, keep: impl Fn(usize) -> bool) {
        self.drain();
        let names: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, e)| !keep(e.layer))
            .map(|(n, _)| n.clone())
            .collect();
        let mut dropped_issued = false;
        for n in names {
            if let Some(e) = self.pending.remove(&n) {
                match e.state {
                    State::Issued => dropped_issued = true,
                    State::Arrived(o) => self.retire(o),
                }
            }
        }
        let issued_left = self
            .pending
            .values()
            .any(|e| matches!(e.state, State::Issued));
        if dropped_issued && !issued_left {
            self.generation += 1;
            if let Some(u) = &self.uploader {
                u.cancel_before(self.generation);
            }
        }
    }

    /// Layer `layer` (tensors `weights`) begins: prefetches of other layers are not wanted any
    /// more.
    pub(super) fn begin(&mut self, layer: usize, weights: &[String]) {
        self.begun = Some(layer);
        self.begun_weights = weights.to_vec();
        self.drop_layers(|l| l == layer);
    }

    /// Whether `name` is on its way (or arrived, not yet taken).
    pub(super) fn is_pending(&self, name: &str) -> bool {
        self.pending.contains_key(name)
    }

    /// Whether uploads can be sent: prefetching is on and the uploader has not stopped.
    pub(super) fn can_send(&self) -> bool {
        self.on && !self.dead
    }

    /// Sends `wants` of layer `layer` to the uploader (started on first use), each into a
    /// device buffer of its own allocated here, and files them as pending; what cannot be
    /// sent is counted as a fallback (uploaded on demand when a step reads it), with the
    /// reason noted.
    pub(super) fn send(&mut self, gpu: &Gpu, layer: usize, wants: Vec<Want>) {
        if self.uploader.is_none() {
            match Uploader::start_from(gpu, source_by_default()) {
                Ok(u) => self.uploader = Some(u),
                Err(e) => {
                    self.dead = true;
                    self.summary.fallbacks += wants.len();
                    self.note(format!("prefetch off on cuda:{}: {e:#}", gpu.info.ordinal));
                    return;
                }
            }
        }
        let n_wants = wants.len();
        let mut ready = Vec::with_capacity(n_wants);
        for w in wants {
            match alloc_dst(gpu, w.len(), &w.name) {
                Ok(d) => ready.push((w, d)),
                Err(e) => {
                    self.note(format!("layer {layer} prefetched in part: {e:#}"));
                    break;
                }
            }
        }
        // The copy stream starts after the allocations, in the compute stream's order.
        // (Nothing was copied into the buffers yet: on failure they are freed as they are.)
        let after = match gpu.stream().record_event(None) {
            Ok(e) => Arc::new(e),
            Err(e) => {
                self.summary.fallbacks += n_wants;
                self.note(format!("layer {layer} not prefetched: cuda: {e}"));
                return;
            }
        };
        let mut sent = 0;
        for (w, dst) in ready {
            let id = self.next_id;
            self.next_id += 1;
            let job = Job {
                id,
                generation: self.generation,
                what: w.name.clone(),
                src: w.src,
                head: w.head,
                tail: w.tail,
                dst,
                after: after.clone(),
            };
            let Some(u) = &self.uploader else { break };
            match u.send(job) {
                Ok(()) => {
                    sent += 1;
                    self.pending.insert(
                        w.name,
                        Entry {
                            id,
                            layer,
                            state: State::Issued,
                        },
                    );
                }
                // No copy was issued into it: the buffer is freed as it is.
                Err(_job) => {
                    self.dead = true;
                    self.note("the upload thread stopped".to_string());
                    break;
                }
            }
        }
        self.summary.fallbacks += n_wants - sent;
    }

    /// Layer `layer` ends: its prefetched tensors no step took are dropped.
    pub(super) fn end(&mut self, layer: usize) {
        self.begun = None;
        self.begun_weights.clear();
        self.drop_layers(|l| l != layer);
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        let entries: Vec<Entry> = self.pending.drain().map(|(_, e)| e).collect();
        for e in entries {
            if let State::Arrived(o) = e.state {
                self.retire(o);
            }
        }
        // The uploader (a field) stops its thread and retires what is still under way.
    }
}

/// Bytes to prefetch: a tensor's raw blocks, or a stacked tensor's rows of some experts
/// (`super::routed`), filed under `name`.
pub(super) struct Want {
    pub(super) name: String,
    pub(super) src: Vec<FileRange>,
    pub(super) head: Vec<u8>,
    pub(super) tail: Vec<u8>,
}

impl Want {
    /// Bytes to upload.
    pub(super) fn len(&self) -> usize {
        total_len(&self.src)
    }
}

impl CudaEngine<'_> {
    /// The same engine with prefetching on or off (on by default unless the command says
    /// otherwise, [`prefetch_by_default`]).
    pub fn with_prefetch(self, on: bool) -> Self {
        self.prefetch.borrow_mut().set_on(on);
        self
    }

    /// What prefetching did so far.
    pub fn prefetch_summary(&self) -> PrefetchSummary {
        self.prefetch.borrow().summary.clone()
    }

    /// The raw tensors of `weights` (layer `layer`) that are neither resident nor on their way,
    /// with where their bytes are in the model's files.
    fn prefetch_wants(&self, p: &Prefetch, weights: &[String]) -> Vec<Want> {
        let raw = self.raw.borrow();
        let mut v = Vec::new();
        for name in weights {
            if raw.contains_key(name) || p.pending.contains_key(name) {
                continue;
            }
            // A tensor the model lacks is the step's to report; a 1-D tensor is uploaded as f32
            // by `vector`, not as raw blocks.
            let Ok(desc) = self.weights.tensor_desc(name) else {
                continue;
            };
            if desc.tensor.info.ne.len() < 2 {
                continue;
            }
            let (Ok(Some((path, offset, len))), Ok(data)) = (desc.file_range(), desc.data()) else {
                continue;
            };
            if len == 0 || len as usize != data.len() {
                continue;
            }
            let k = FINGERPRINT.min(data.len());
            v.push(Want {
                name: name.clone(),
                src: vec![FileRange {
                    path: path.to_path_buf(),
                    offset,
                    len: data.len(),
                }],
                head: data[..k].to_vec(),
                tail: data[data.len() - k..].to_vec(),
            });
        }
        v
    }

    /// Starts the uploads of layer `layer`'s raw tensors (see the module documentation); never
    /// fails: what cannot be prefetched is uploaded on demand.
    pub(super) fn prefetch_tensors(&self, layer: usize, weights: &[String]) {
        let mut guard = self.prefetch.borrow_mut();
        let p: &mut Prefetch = &mut guard;
        if !p.on || p.dead {
            return;
        }
        let begun = p.begun;
        p.drop_layers(|l| Some(l) == begun || l == layer);
        let wants = self.prefetch_wants(p, weights);
        if wants.is_empty() {
            return;
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let need: u64 = wants.iter().map(|w| w.len() as u64).sum();
        // The current layer's tensors still to be uploaded on demand need their room too.
        let current: u64 = self
            .prefetch_wants(p, &p.begun_weights)
            .iter()
            .map(|w| w.len() as u64)
            .sum();
        match self.gpu.memory() {
            Ok((free, _)) if free >= need + current + PREFETCH_RESERVE => {}
            Ok((free, _)) => {
                p.summary.fallbacks += wants.len();
                p.note(format!(
                    "layer {layer} not prefetched on cuda:{}: its {:.2} GiB, the current layer's {:.2} GiB still to upload and {:.0} GiB of reserve exceed the {:.2} GiB free",
                    self.gpu.info.ordinal,
                    gib(need),
                    gib(current),
                    gib(PREFETCH_RESERVE),
                    gib(free)
                ));
                return;
            }
            Err(e) => {
                p.summary.fallbacks += wants.len();
                p.note(format!("layer {layer} not prefetched: {e:#}"));
                return;
            }
        }
        p.send(self.gpu, layer, wants);
    }

    /// Tensor `name` from its prefetch, the compute stream ordered after its copies; `None`
    /// when it was not prefetched or its prefetch failed (then it is uploaded on demand).
    /// Waits on the host only for a tensor still under way.
    pub(super) fn take_prefetched(&self, name: &str) -> Option<CudaSlice<u8>> {
        self.wait_offering(name);
        let mut guard = self.prefetch.borrow_mut();
        let p: &mut Prefetch = &mut guard;
        let entry = p.pending.remove(name)?;
        let mut state = entry.state;
        while matches!(state, State::Issued) {
            match p.uploader.as_ref().and_then(Uploader::recv) {
                Some(d) if d.id == entry.id => state = State::Arrived(d.outcome),
                Some(d) => p.place(d),
                None => {
                    p.dead = true;
                    state = State::Arrived(Outcome::Failed("the upload thread stopped".into()));
                }
            }
        }
        let outcome = match state {
            State::Arrived(o) => o,
            State::Issued => Outcome::Cancelled,
        };
        let why = match outcome {
            Outcome::Ready(r) => {
                if let Some(n) = r.note() {
                    p.note(n.to_string());
                }
                let waited = if r.is_complete() {
                    Ok(())
                } else {
                    r.wait_host()
                };
                match waited {
                    Ok(()) => match r.take(self.gpu.stream()) {
                        Ok(s) => {
                            p.summary.tensors += 1;
                            p.summary.bytes += s.len() as u64;
                            return Some(s);
                        }
                        Err(e) => format!("{e:#}"),
                    },
                    Err(e) => {
                        p.retire(Outcome::Ready(r));
                        format!("{e:#}")
                    }
                }
            }
            Outcome::Failed(why) => why,
            Outcome::Cancelled => "cancelled".to_string(),
        };
        p.summary.fallbacks += 1;
        p.note(format!("{name} uploaded on demand: {why}"));
        None
    }
}

#[cfg(test)]
mod upload_done_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(p: &mut Prefetch, name: &str, layer: usize, arrived: bool) {
        let id = p.next_id;
        p.next_id += 1;
        let state = if arrived {
            State::Arrived(Outcome::Failed("test".into()))
        } else {
            State::Issued
        };
        p.pending
            .insert(name.to_string(), Entry { id, layer, state });
    }

    fn names(p: &Prefetch) -> Vec<String> {
        let mut v: Vec<String> = p.pending.keys().cloned().collect();
        v.sort();
        v
    }

    /// The host-side bookkeeping: beginning a layer drops the prefetches of every other layer,
    /// ending one drops its leftovers; the uploader is told to drop queued jobs (a new
    /// generation) only when no job under way is still wanted; outcomes nobody waits for are
    /// dropped, not filed.
    #[test]
    fn layers_begun_and_ended_keep_only_wanted_prefetches() {
        let mut p = Prefetch::new(true);
        entry(&mut p, "blk.1.a", 1, false);
        entry(&mut p, "blk.1.b", 1, true);
        entry(&mut p, "blk.2.a", 2, false);
        // Layer 1 begins: layer 2's issued job is dropped, but layer 1's are still under way:
        // no new generation.
        p.begin(1, &["blk.1.a".to_string()]);
        assert_eq!(names(&p), ["blk.1.a", "blk.1.b"]);
        assert_eq!((p.begun, p.generation), (Some(1), 0));
        assert_eq!(p.begun_weights, ["blk.1.a"]);
        // Its outcome, when it comes back, is not filed under any entry.
        p.place(Done {
            id: 2,
            outcome: Outcome::Cancelled,
        });
        assert_eq!(names(&p), ["blk.1.a", "blk.1.b"]);
        // Layer 1 ends with its two tensors never taken: both dropped; one was under way and
        // none is left: a new generation.
        p.end(1);
        assert!(p.pending.is_empty() && p.begun.is_none() && p.begun_weights.is_empty());
        assert_eq!(p.generation, 1);
        // A layer begun with only arrived entries of another: dropped, no new generation.
        entry(&mut p, "blk.3.a", 3, true);
        p.begin(4, &[]);
        assert!(p.pending.is_empty());
        assert_eq!(p.generation, 1);
        // An outcome filed under its issued entry.
        entry(&mut p, "blk.5.a", 5, false);
        let id = p.next_id - 1;
        p.place(Done {
            id,
            outcome: Outcome::Failed("x".into()),
        });
        assert!(matches!(
            p.pending["blk.5.a"].state,
            State::Arrived(Outcome::Failed(_))
        ));
    }

    #[test]
    fn summaries_of_several_devices_add_up() {
        let mut a = PrefetchSummary {
            on: true,
            tensors: 3,
            bytes: 100,
            fallbacks: 1,
            notes: vec!["x".into()],
        };
        let b = PrefetchSummary {
            on: false,
            tensors: 2,
            bytes: 50,
            fallbacks: 2,
            notes: vec!["x".into(), "y".into()],
        };
        a.merge(&b);
        assert_eq!(
            a,
            PrefetchSummary {
                on: true,
                tensors: 5,
                bytes: 150,
                fallbacks: 3,
                notes: vec!["x".into(), "y".into()],
            }
        );
    }
}
