//! A [`PairSink`] in front of another that adds up the time the other spends on what it is
//! handed (the comparison: metrics, verdicts, the bug families' directions), so that the driver
//! can say how much of a layer's time is the comparison rather than either side's steps.

use std::cell::Cell;
use std::time::Instant;

use anyhow::Result;

use crate::engine::HostTensor;
use crate::model::steps::Step;
use crate::trace::{Mode, Pair, PairSink};

/// Forwards every call to `inner` unchanged, adding the seconds of the calls that hand it work
/// to `spent`.
pub(super) struct Timed<'s, 'c> {
    /// The sink.
    pub inner: &'s mut dyn PairSink,
    /// Seconds spent inside `inner` so far.
    pub spent: &'c Cell<f64>,
}

impl Timed<'_, '_> {
    fn timed<T>(&mut self, f: impl FnOnce(&mut dyn PairSink) -> T) -> T {
        let t0 = Instant::now();
        let out = f(&mut *self.inner);
        self.spent
            .set(self.spent.get() + t0.elapsed().as_secs_f64());
        out
    }
}

impl PairSink for Timed<'_, '_> {
    fn wants(&self, name: &str) -> bool {
        self.inner.wants(name)
    }

    fn record(&mut self, pair: Pair<'_>) -> Result<()> {
        self.timed(|s| s.record(pair))
    }

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        self.timed(|s| s.missing(name, mode, why))
    }

    fn wants_replay_inputs(&self) -> bool {
        self.inner.wants_replay_inputs()
    }

    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.timed(|s| s.replay_inputs(step, inputs))
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        self.timed(|s| s.reference_only(name, mode, inputs, reference))
    }

    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        self.timed(|s| s.followed(selection, mode, rows))
    }

    fn wants_reference_experts(&self, step: &Step) -> bool {
        self.inner.wants_reference_experts(step)
    }

    fn reference_experts(
        &mut self,
        step: &Step,
        inputs: &[HostTensor],
        experts: Vec<(usize, HostTensor)>,
    ) {
        self.timed(|s| s.reference_experts(step, inputs, experts))
    }

    fn wants_chained_inputs(&self) -> bool {
        self.inner.wants_chained_inputs()
    }

    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.timed(|s| s.chained_inputs(step, inputs))
    }

    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        self.timed(|s| s.plain_chain(name, reference, candidate))
    }
}
