//! A [`PairSink`] in front of another (the comparison: metrics, verdicts, the bug families'
//! directions) that adds up the seconds the other spends on what it is handed, by layer and by
//! point, so that the driver can say how much of a layer's time is the comparison rather than
//! either side's steps.
//!
//! When the sink answers the driver's questions apart from itself ([`PairSink::answers`]), its
//! calls are made on a thread of its own ([`Queue::serve`]), in the order the driver made them,
//! while the driver goes on with the next steps: the comparison of one step runs beside the
//! reference's later steps. What the driver asks back about selections (their near ties, from
//! the scores the sink keeps) waits until every call made before is done ([`Synced`]), so every
//! answer is the one it would be with every call made at once. The values waiting for the
//! comparison are bounded ([`WAITING_BYTES`]): beyond it the driver waits.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::{anyhow, Result};

use crate::engine::HostTensor;
use crate::model::steps::Step;
use crate::trace::{Answers, Mode, NearTies, Pair, PairSink, Swap};

/// The most bytes of values waiting for the comparison's thread (the driver waits beyond it,
/// unless nothing waits): at 4096 GLM-5 tokens one step's pairs in both modes are up to about
/// 1 GiB (the heads' attention output, `[4096, 64 * 256]` f32, reference and candidate, each
/// mode), so a few steps can wait while a long comparison runs.
pub(super) const WAITING_BYTES: usize = 4 << 30;

/// Forwards every call to the sink unchanged, on this thread or on the comparison's, adding the
/// seconds the sink spends on it to its step's layer and its point.
pub(super) struct Timed<'s> {
    /// Where the calls go.
    route: Route<'s>,
    /// The layer of the step whose calls are being made (set by the driver per step).
    pub layer: Option<usize>,
    /// Seconds spent by the sink, by what was handed over: a hook's point and mode (`attn_out
    /// replay`, its layer left out) or the call (`reference_experts`). Calls made on this
    /// thread only; the comparison's thread keeps its own ([`Queue`]).
    by: BTreeMap<String, f64>,
    /// Seconds spent by the sink on calls made on this thread, by their step's layer, not yet
    /// taken by the driver.
    done: Vec<(Option<usize>, f64)>,
    /// Seconds this thread spent inside the sink's calls (on this thread).
    here: f64,
}

/// Where a [`Timed`]'s calls go.
enum Route<'s> {
    /// To the sink, at once, on this thread.
    Here(&'s mut dyn PairSink),
    /// To the comparison's thread, through `queue`; `answers` answers the driver's questions.
    There { queue: &'s Queue, answers: Answers },
}

impl<'s> Timed<'s> {
    /// Every call made at once on this thread.
    pub fn here(sink: &'s mut dyn PairSink) -> Timed<'s> {
        Timed::with(Route::Here(sink))
    }

    /// Every call left to the thread serving `queue` ([`Queue::serve`]); the driver's
    /// questions answered by `answers` (the sink's).
    pub fn there(queue: &'s Queue, answers: Answers) -> Timed<'s> {
        Timed::with(Route::There { queue, answers })
    }

    fn with(route: Route<'s>) -> Timed<'s> {
        Timed {
            route,
            layer: None,
            by: BTreeMap::new(),
            done: Vec::new(),
            here: 0.0,
        }
    }

    /// Seconds this thread has spent in the sink's calls and waiting for the comparison's
    /// thread (its queue's room and the near ties' answers), so far.
    pub fn blocked(&self) -> f64 {
        match &self.route {
            Route::Here(_) => self.here,
            Route::There { queue, .. } => queue.lock().waited,
        }
    }

    /// The first error of a call the comparison's thread has made, if any (without waiting):
    /// the pass ends with it.
    pub fn failed(&self) -> Result<()> {
        match &self.route {
            Route::Here(_) => Ok(()),
            Route::There { queue, .. } => queue.error(),
        }
    }

    /// Waits until every call made so far is done; the first error of one, if any.
    pub fn finish(&mut self) -> Result<()> {
        match &self.route {
            Route::Here(_) => Ok(()),
            Route::There { queue, .. } => {
                queue.drain(2);
                queue.error()
            }
        }
    }

    /// The seconds this thread waited for the comparison's thread, by cause ([`WAITS`]), where
    /// it waited.
    pub fn waits(&self) -> Vec<(String, f64)> {
        match &self.route {
            Route::Here(_) => Vec::new(),
            Route::There { queue, .. } => {
                let waits = queue.lock().waits;
                WAITS
                    .iter()
                    .zip(waits)
                    .filter(|(_, s)| *s > 0.0)
                    .map(|(w, s)| (w.to_string(), s))
                    .collect()
            }
        }
    }

    /// The seconds the sink spent on calls done since the last call, by their step's layer.
    pub fn take_done(&mut self) -> Vec<(Option<usize>, f64)> {
        let mut done = std::mem::take(&mut self.done);
        if let Route::There { queue, .. } = &self.route {
            done.extend(std::mem::take(&mut queue.lock().done));
        }
        done
    }

    /// The seconds by point, of every call done (the comparison's thread's and this one's).
    pub fn take_by(&mut self) -> BTreeMap<String, f64> {
        let mut by = std::mem::take(&mut self.by);
        if let Route::There { queue, .. } = &self.route {
            for (k, s) in std::mem::take(&mut queue.lock().by) {
                *by.entry(k).or_insert(0.0) += s;
            }
        }
        by
    }

    /// Makes `call`: at once, or on the comparison's thread. An error of a call made here is
    /// returned; one made there comes out of [`Timed::failed`] or [`Timed::finish`].
    fn call(&mut self, call: Held) -> Result<()> {
        match &mut self.route {
            Route::Here(sink) => {
                let what = call.what();
                let t0 = Instant::now();
                let out = call.hand(&mut **sink);
                let s = t0.elapsed().as_secs_f64();
                self.here += s;
                self.done.push((self.layer, s));
                *self.by.entry(point_of(&what).to_string()).or_insert(0.0) += s;
                out
            }
            Route::There { queue, .. } => {
                queue.push(self.layer, call);
                Ok(())
            }
        }
    }

    /// Makes a call that returns nothing: an error made here is kept by the sink's own
    /// reckoning (these calls cannot fail).
    fn tell(&mut self, call: Held) {
        // Only `record` can fail; the others' `hand` is always Ok.
        let _ = self.call(call);
    }

    /// The questions, from the sink here or from its answers there.
    fn ask(&self) -> Asked<'_> {
        match &self.route {
            Route::Here(sink) => Asked::Sink(&**sink),
            Route::There { answers, .. } => Asked::Answers(answers),
        }
    }
}

/// Who answers the driver's questions.
enum Asked<'a> {
    Sink(&'a dyn PairSink),
    Answers(&'a Answers),
}

/// A call of the sink, with what it was handed (hook values are shared, not copied).
enum Held {
    Record {
        name: String,
        mode: Mode,
        inputs: Vec<String>,
        reference: HostTensor,
        candidate: HostTensor,
        note: Option<String>,
    },
    Missing {
        name: String,
        mode: Mode,
        why: String,
    },
    ReplayInputs {
        step: Step,
        inputs: Vec<HostTensor>,
    },
    ReferenceOnly {
        name: String,
        mode: Mode,
        inputs: Vec<String>,
        reference: HostTensor,
    },
    Followed {
        selection: String,
        mode: Mode,
        rows: Vec<usize>,
    },
    ReferenceExperts {
        step: Step,
        inputs: Vec<HostTensor>,
        experts: Vec<(usize, HostTensor)>,
    },
    ChainedInputs {
        step: Step,
        inputs: Vec<HostTensor>,
    },
    PlainChain {
        name: String,
        reference: HostTensor,
        candidate: HostTensor,
    },
}

impl Held {
    /// What its seconds are kept under ([`point_of`] takes the layer off).
    fn what(&self) -> String {
        match self {
            Held::Record { name, mode, .. } => format!("{name} {}", mode.as_str()),
            Held::Missing { .. } => "missing".into(),
            Held::ReplayInputs { .. } => "replay_inputs".into(),
            Held::ReferenceOnly { name, mode, .. } => {
                format!("{name} {} (reference only)", mode.as_str())
            }
            Held::Followed { .. } => "followed".into(),
            Held::ReferenceExperts { .. } => "reference_experts".into(),
            Held::ChainedInputs { .. } => "chained_inputs".into(),
            Held::PlainChain { name, .. } => format!("{name} (plain chain)"),
        }
    }

    /// The bytes of the values it holds (shared with others or not: what it keeps alive).
    fn bytes(&self) -> usize {
        let sum = |v: &[HostTensor]| v.iter().map(|t| t.len() * 4).sum::<usize>();
        match self {
            Held::Record {
                reference,
                candidate,
                ..
            }
            | Held::PlainChain {
                reference,
                candidate,
                ..
            } => (reference.len() + candidate.len()) * 4,
            Held::ReferenceOnly { reference, .. } => reference.len() * 4,
            Held::ReplayInputs { inputs, .. } | Held::ChainedInputs { inputs, .. } => sum(inputs),
            Held::ReferenceExperts {
                inputs, experts, ..
            } => sum(inputs) + experts.iter().map(|(_, t)| t.len() * 4).sum::<usize>(),
            Held::Missing { .. } | Held::Followed { .. } => 0,
        }
    }

    /// Makes the call on `sink`.
    fn hand(self, sink: &mut dyn PairSink) -> Result<()> {
        match self {
            Held::Record {
                name,
                mode,
                inputs,
                reference,
                candidate,
                note,
            } => {
                return sink.record(Pair {
                    name: &name,
                    mode,
                    inputs: &inputs,
                    reference,
                    candidate,
                    note,
                })
            }
            Held::Missing { name, mode, why } => sink.missing(&name, mode, &why),
            Held::ReplayInputs { step, inputs } => sink.replay_inputs(&step, &inputs),
            Held::ReferenceOnly {
                name,
                mode,
                inputs,
                reference,
            } => sink.reference_only(&name, mode, &inputs, &reference),
            Held::Followed {
                selection,
                mode,
                rows,
            } => sink.followed(&selection, mode, &rows),
            Held::ReferenceExperts {
                step,
                inputs,
                experts,
            } => sink.reference_experts(&step, &inputs, experts),
            Held::ChainedInputs { step, inputs } => sink.chained_inputs(&step, &inputs),
            Held::PlainChain {
                name,
                reference,
                candidate,
            } => sink.plain_chain(&name, &reference, &candidate),
        }
        Ok(())
    }
}

/// The calls waiting for the comparison's thread, in order, and what it has done.
pub(super) struct Queue {
    state: Mutex<QueueState>,
    /// Signalled on every change of `state`.
    changed: Condvar,
    /// [`WAITING_BYTES`], or less in tests.
    room: usize,
}

#[derive(Default)]
struct QueueState {
    /// The calls not yet taken, with their step's layer and bytes.
    calls: VecDeque<(Option<usize>, usize, Held)>,
    /// The bytes of `calls` and of the call being made.
    bytes: usize,
    /// Whether a call is being made.
    busy: bool,
    /// No more calls come: the thread ends once `calls` is empty.
    closed: bool,
    /// A call failed: the calls after it are dropped, not made.
    failed: bool,
    /// The first failure, until taken.
    error: Option<anyhow::Error>,
    /// Seconds of the calls done, by their step's layer, until taken.
    done: Vec<(Option<usize>, f64)>,
    /// The same by point, until taken.
    by: BTreeMap<String, f64>,
    /// Seconds the driver waited for the comparison.
    waited: f64,
    /// The same by cause ([`WAITS`]).
    waits: [f64; 3],
}

/// Why the driver waited for the comparison: room in its queue, the answers about a selection's
/// near ties, its end.
pub(super) const WAITS: [&str; 3] = [
    "waited for the comparison's queue",
    "waited for the comparison's near ties",
    "waited for the comparison's end",
];

impl Queue {
    /// An empty queue of at most `room` waiting bytes.
    pub fn new(room: usize) -> Queue {
        Queue {
            state: Mutex::new(QueueState::default()),
            changed: Condvar::new(),
            room,
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A panic while the lock was held leaves plain counters: go on with them.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'g>(&self, g: MutexGuard<'g, QueueState>) -> MutexGuard<'g, QueueState> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `call` of a step of `layer` (after the calls queued before), once there is room.
    fn push(&self, layer: Option<usize>, call: Held) {
        let bytes = call.bytes();
        let mut s = self.lock();
        let t0 = Instant::now();
        let mut waited = false;
        while s.bytes > 0 && s.bytes + bytes > self.room && !s.failed {
            waited = true;
            s = self.wait(s);
        }
        if waited {
            let w = t0.elapsed().as_secs_f64();
            s.waited += w;
            s.waits[0] += w;
        }
        if s.failed {
            return;
        }
        s.bytes += bytes;
        s.calls.push_back((layer, bytes, call));
        self.changed.notify_all();
    }

    /// Waits until every call queued so far is done (or dropped after a failure), the wait
    /// counted to cause `why` of [`WAITS`].
    fn drain(&self, why: usize) {
        let mut s = self.lock();
        let t0 = Instant::now();
        let mut waited = false;
        while !s.calls.is_empty() || s.busy {
            waited = true;
            s = self.wait(s);
        }
        if waited {
            let w = t0.elapsed().as_secs_f64();
            s.waited += w;
            s.waits[why] += w;
        }
    }

    /// The first failure, once (the calls after it are dropped either way).
    fn error(&self) -> Result<()> {
        match self.lock().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The pass ended with an error of the driver's: the calls still queued are dropped, not
    /// made (their results would not be read).
    pub fn abandon(&self) {
        self.lock().failed = true;
        self.changed.notify_all();
    }

    /// No more calls come: [`Queue::serve`] returns once the queued ones are done.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Makes the queued calls on `sink` in order, until [`Queue::close`]; after a call fails
    /// (an error or a panic), the rest are dropped.
    pub fn serve(&self, sink: &mut dyn PairSink) {
        loop {
            let (layer, bytes, call) = {
                let mut s = self.lock();
                loop {
                    if let Some(c) = s.calls.pop_front() {
                        s.busy = true;
                        break c;
                    }
                    if s.closed {
                        return;
                    }
                    s = self.wait(s);
                }
            };
            let what = call.what();
            let failed = self.lock().failed;
            let t0 = Instant::now();
            let out = if failed {
                drop(call);
                Ok(())
            } else {
                catch_unwind(AssertUnwindSafe(|| call.hand(&mut *sink)))
                    .unwrap_or_else(|_| Err(anyhow!("the comparison panicked at {what}")))
            };
            let secs = t0.elapsed().as_secs_f64();
            let mut s = self.lock();
            s.busy = false;
            s.bytes -= bytes;
            if !failed {
                s.done.push((layer, secs));
                *s.by.entry(point_of(&what).to_string()).or_insert(0.0) += secs;
            }
            if let Err(e) = out {
                s.failed = true;
                s.error = Some(e);
            }
            drop(s);
            self.changed.notify_all();
        }
    }
}

/// Closes its queue when dropped: the comparison's thread ends however the pass does.
pub(super) struct Closing<'q>(pub &'q Queue);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The driver's questions about near ties, answered once every call queued before is done (the
/// scores they hand over are what the answers are computed from).
pub(super) struct Synced<'a> {
    /// The sink's answers.
    pub ties: &'a (dyn NearTies + Sync),
    /// The comparison's calls.
    pub queue: &'a Queue,
}

impl NearTies for Synced<'_> {
    fn near_ties(
        &self,
        selection: &str,
        mode: Mode,
        chosen: &HostTensor,
        per_row: usize,
    ) -> Vec<Swap> {
        self.queue.drain(1);
        self.ties.near_ties(selection, mode, chosen, per_row)
    }

    fn near_tie_rows(
        &self,
        selection: &str,
        mode: Mode,
        reference: &HostTensor,
        candidate: &HostTensor,
    ) -> Vec<usize> {
        if crate::trace::selections_agree(reference, candidate) {
            // No row differs, so no row differs by near ties alone, whatever the scores: the
            // answer needs no wait (a short prompt's DSA rows keep every key, in an order the
            // candidate's own scores may change).
            return Vec::new();
        }
        self.queue.drain(1);
        self.ties
            .near_tie_rows(selection, mode, reference, candidate)
    }
}

/// `blk.3.attn_out replay` -> `attn_out replay`: what a time is kept under.
pub(super) fn point_of(what: &str) -> &str {
    match what.strip_prefix("blk.") {
        Some(rest) => match rest.split_once('.') {
            Some((layer, point)) if layer.chars().all(|c| c.is_ascii_digit()) => point,
            _ => what,
        },
        None => what,
    }
}

impl PairSink for Timed<'_> {
    fn wants(&self, name: &str) -> bool {
        match self.ask() {
            Asked::Sink(s) => s.wants(name),
            Asked::Answers(a) => (a.wants)(name),
        }
    }

    fn record(&mut self, pair: Pair<'_>) -> Result<()> {
        self.call(Held::Record {
            name: pair.name.to_string(),
            mode: pair.mode,
            inputs: pair.inputs.to_vec(),
            reference: pair.reference,
            candidate: pair.candidate,
            note: pair.note,
        })
    }

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        self.tell(Held::Missing {
            name: name.to_string(),
            mode,
            why: why.to_string(),
        })
    }

    fn wants_replay_inputs(&self) -> bool {
        match self.ask() {
            Asked::Sink(s) => s.wants_replay_inputs(),
            Asked::Answers(a) => a.replay_inputs,
        }
    }

    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.tell(Held::ReplayInputs {
            step: step.clone(),
            inputs: inputs.to_vec(),
        })
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        self.tell(Held::ReferenceOnly {
            name: name.to_string(),
            mode,
            inputs: inputs.to_vec(),
            reference: reference.clone(),
        })
    }

    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        self.tell(Held::Followed {
            selection: selection.to_string(),
            mode,
            rows: rows.to_vec(),
        })
    }

    fn wants_reference_experts(&self, step: &Step) -> bool {
        match self.ask() {
            Asked::Sink(s) => s.wants_reference_experts(step),
            Asked::Answers(a) => a.reference_experts,
        }
    }

    fn reference_experts(
        &mut self,
        step: &Step,
        inputs: &[HostTensor],
        experts: Vec<(usize, HostTensor)>,
    ) {
        self.tell(Held::ReferenceExperts {
            step: step.clone(),
            inputs: inputs.to_vec(),
            experts,
        })
    }

    fn wants_chained_inputs(&self) -> bool {
        match self.ask() {
            Asked::Sink(s) => s.wants_chained_inputs(),
            Asked::Answers(a) => a.chained_inputs,
        }
    }

    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.tell(Held::ChainedInputs {
            step: step.clone(),
            inputs: inputs.to_vec(),
        })
    }

    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        self.tell(Held::PlainChain {
            name: name.to_string(),
            reference: reference.clone(),
            candidate: candidate.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::steps::Op;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Logs every call it is handed and counts its pairs in `seen`; a pair named `bad` is an
    /// error, one named `panic` a panic, one named `slow` takes 20 ms.
    #[derive(Default)]
    struct Log(Vec<String>, Arc<AtomicUsize>);

    impl PairSink for Log {
        fn wants(&self, _: &str) -> bool {
            true
        }
        fn record(&mut self, p: Pair<'_>) -> Result<()> {
            match p.name {
                "bad" => anyhow::bail!("bad pair"),
                "panic" => panic!("a pair the sink cannot take"),
                "slow" => std::thread::sleep(std::time::Duration::from_millis(20)),
                _ => {}
            }
            self.1.fetch_add(1, Ordering::SeqCst);
            let v = p.reference.as_f32("r")?.to_vec();
            self.0.push(format!(
                "record {} {:?} {v:?} {:?}",
                p.name, p.inputs, p.note
            ));
            Ok(())
        }
        fn missing(&mut self, name: &str, mode: Mode, why: &str) {
            self.0.push(format!("missing {name} {mode:?} {why}"));
        }
        fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
            self.0
                .push(format!("replay_inputs {:?} {}", step.outputs, inputs.len()));
        }
        fn reference_only(&mut self, name: &str, mode: Mode, i: &[String], _: &HostTensor) {
            self.0.push(format!("reference_only {name} {mode:?} {i:?}"));
        }
        fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
            self.0
                .push(format!("followed {selection} {mode:?} {rows:?}"));
        }
        fn reference_experts(
            &mut self,
            step: &Step,
            inputs: &[HostTensor],
            experts: Vec<(usize, HostTensor)>,
        ) {
            let ids: Vec<usize> = experts.iter().map(|e| e.0).collect();
            self.0.push(format!(
                "experts {:?} {} {ids:?}",
                step.outputs,
                inputs.len()
            ));
        }
        fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
            self.0.push(format!(
                "chained_inputs {:?} {}",
                step.outputs,
                inputs.len()
            ));
        }
        fn plain_chain(&mut self, name: &str, _: &HostTensor, _: &HostTensor) {
            self.0.push(format!("plain {name}"));
        }
    }

    /// One of every call, in an order a step makes them.
    fn calls(t: &mut Timed<'_>) -> Result<()> {
        let x = |v: f32| HostTensor::f32(vec![1], vec![v]).unwrap_or_else(|e| panic!("{e}"));
        let step = Step {
            op: Op::Alias,
            inputs: vec!["a".into()],
            outputs: vec!["b".into()],
            layer: Some(1),
        };
        let inputs = vec!["a".to_string()];
        t.chained_inputs(&step, &[x(1.0)]);
        t.replay_inputs(&step, &[x(1.0), x(2.0)]);
        t.reference_only("s", Mode::Chained, &inputs, &x(3.0));
        t.record(Pair {
            name: "b",
            mode: Mode::Chained,
            inputs: &inputs,
            reference: x(4.0),
            candidate: x(5.0),
            note: Some("n".into()),
        })?;
        t.followed("sel", Mode::Chained, &[2, 3]);
        t.plain_chain("b", &x(6.0), &x(7.0));
        t.reference_experts(&step, &[x(1.0)], vec![(4, x(8.0)), (9, x(9.0))]);
        t.missing("c", Mode::Replay, "why");
        Ok(())
    }

    fn answers() -> Answers {
        Answers {
            wants: Arc::new(|_: &str| true),
            replay_inputs: true,
            reference_experts: true,
            chained_inputs: true,
        }
    }

    fn pair(name: &'static str) -> Pair<'static> {
        let x = HostTensor::f32(vec![1], vec![0.0]).unwrap_or_else(|e| panic!("{e}"));
        Pair {
            name,
            mode: Mode::Replay,
            inputs: &[],
            reference: x.clone(),
            candidate: x,
            note: None,
        }
    }

    /// Seconds done by layer.
    type Done = Vec<(Option<usize>, f64)>;

    /// `make` on a [`Timed`] whose calls go to `sink` on a thread of its own (a queue of
    /// `room` bytes), then the end of the pass: `make`'s result, the end's, and the seconds
    /// done by layer.
    fn there<T>(
        sink: &mut Log,
        room: usize,
        make: impl FnOnce(&mut Timed<'_>) -> T,
    ) -> (T, Result<()>, Done) {
        let queue = Queue::new(room);
        std::thread::scope(|scope| {
            let q = &queue;
            let serving = scope.spawn(move || q.serve(sink));
            let closing = Closing(q);
            let mut t = Timed::there(q, answers());
            t.layer = Some(7);
            let made = make(&mut t);
            let end = t.finish();
            let done = t.take_done();
            drop(closing);
            serving
                .join()
                .unwrap_or_else(|_| panic!("the serving thread panicked"));
            (made, end, done)
        })
    }

    /// Calls made on the comparison's thread reach the sink as they would at once: the same
    /// calls with the same values in the same order, with a queue of any room (1 byte: every
    /// call waits for the one before); their seconds are counted to the step's layer.
    #[test]
    fn calls_on_the_comparisons_thread_are_the_same_in_order() {
        let mut now = Log::default();
        let mut t = Timed::here(&mut now);
        calls(&mut t).unwrap();
        assert_eq!(t.take_done().len(), 8);
        drop(t);
        assert_eq!(now.0.len(), 8);
        for room in [1, WAITING_BYTES] {
            let mut later = Log::default();
            let (made, end, done) = there(&mut later, room, calls);
            made.unwrap();
            end.unwrap();
            assert_eq!(done.len(), 8);
            assert!(done.iter().all(|(l, s)| *l == Some(7) && *s >= 0.0));
            assert_eq!(later.0, now.0, "room {room}");
        }
    }

    /// A pair that fails there ends the pass at the next check: the calls after it are not
    /// made, and its error (or its panic, as an error) comes out once.
    #[test]
    fn a_failure_there_comes_out_and_stops_the_calls_after_it() {
        for (name, says) in [("bad", "bad pair"), ("panic", "the comparison panicked")] {
            let mut sink = Log::default();
            let (made, end, _) = there(&mut sink, WAITING_BYTES, |t| {
                t.record(pair(name)).unwrap();
                t.record(pair("after")).unwrap();
                t.finish().unwrap_err()
            });
            assert!(format!("{made:#}").contains(says), "{made:#}");
            end.unwrap();
            assert!(sink.0.is_empty(), "{:?}", sink.0);
        }
    }

    /// Calls still queued when the pass is abandoned are dropped, not made.
    #[test]
    fn an_abandoned_pass_drops_the_calls_still_queued() {
        let mut sink = Log::default();
        let (_, end, done) = there(&mut sink, WAITING_BYTES, |t| {
            t.record(pair("slow")).unwrap();
            let Route::There { queue, .. } = &t.route else {
                panic!("a queue");
            };
            queue.abandon();
            t.record(pair("after")).unwrap();
        });
        end.unwrap();
        assert!(done.len() <= 1, "{done:?}");
        assert!(!sink.0.iter().any(|c| c.contains("after")), "{:?}", sink.0);
    }

    /// Answers a question about near-tie rows with the number of pairs the sink has taken.
    struct Seen(Arc<AtomicUsize>);

    impl NearTies for Seen {
        fn near_ties(&self, _: &str, _: Mode, _: &HostTensor, _: usize) -> Vec<Swap> {
            Vec::new()
        }
        fn near_tie_rows(&self, _: &str, _: Mode, _: &HostTensor, _: &HostTensor) -> Vec<usize> {
            vec![self.0.load(Ordering::SeqCst)]
        }
    }

    /// The near ties' answers wait for every call queued before them: the scores they are
    /// computed from.
    #[test]
    fn near_ties_are_answered_after_the_calls_before_them() {
        let mut sink = Log::default();
        let seen = Seen(sink.1.clone());
        let queue = Queue::new(WAITING_BYTES);
        let x = HostTensor::f32(vec![1], vec![0.0]).unwrap();
        let rows = std::thread::scope(|scope| {
            let q = &queue;
            let serving = scope.spawn(|| q.serve(&mut sink));
            let closing = Closing(q);
            let mut t = Timed::there(q, answers());
            for _ in 0..3 {
                t.record(pair("slow")).unwrap();
            }
            let synced = Synced {
                ties: &seen,
                queue: q,
            };
            let rows = synced.near_tie_rows("s", Mode::Replay, &x, &x);
            assert!(t.blocked() > 0.0, "the driver waited");
            let waits = t.waits();
            assert!(
                waits.len() == 1 && waits[0].0.ends_with("near ties"),
                "{waits:?}"
            );
            drop(closing);
            serving.join().unwrap();
            rows
        });
        assert_eq!(rows, vec![3]);
    }

    /// A question about selections whose rows hold the same sets (in another order) is
    /// answered at once, with no row; one about sets that differ waits for the call before and
    /// sees it.
    #[test]
    fn near_tie_rows_of_the_same_sets_need_no_wait() {
        let mut sink = Log::default();
        let seen = Seen(sink.1.clone());
        let queue = Queue::new(WAITING_BYTES);
        let ids = |v: Vec<i32>| HostTensor::i32(vec![2, 3], v).unwrap();
        let reference = ids(vec![0, 1, 2, 5, 4, -1]);
        let reordered = ids(vec![2, 0, 1, 4, 5, -1]);
        let flipped = ids(vec![0, 1, 2, 5, 3, -1]);
        std::thread::scope(|scope| {
            let q = &queue;
            let serving = scope.spawn(|| q.serve(&mut sink));
            let closing = Closing(q);
            let mut t = Timed::there(q, answers());
            let synced = Synced {
                ties: &seen,
                queue: q,
            };
            t.record(pair("slow")).unwrap();
            let rows = synced.near_tie_rows("s", Mode::Chained, &reference, &reordered);
            assert!(rows.is_empty() && t.blocked() == 0.0, "{rows:?}");
            let rows = synced.near_tie_rows("s", Mode::Chained, &reference, &flipped);
            assert!(rows == vec![1] && t.blocked() > 0.0, "{rows:?}");
            drop(closing);
            serving.join().unwrap();
        });
    }

    #[test]
    fn times_are_kept_by_point() {
        assert_eq!(point_of("blk.12.attn_out replay"), "attn_out replay");
        assert_eq!(point_of("logits chained"), "logits chained");
        assert_eq!(point_of("blk.x.y"), "blk.x.y");
        assert_eq!(point_of("reference_experts"), "reference_experts");
    }
}
