//! A [`PairSink`] in front of another that adds up the time the other spends on what it is
//! handed (the comparison: metrics, verdicts, the bug families' directions), so that the driver
//! can say how much of a layer's time is the comparison rather than either side's steps.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
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
    /// The same seconds by what was handed over: a hook's point and mode (`attn_out replay`,
    /// its layer left out) or the call (`reference_experts`).
    pub by: &'c RefCell<BTreeMap<String, f64>>,
}

impl Timed<'_, '_> {
    fn timed<T>(&mut self, what: &str, f: impl FnOnce(&mut dyn PairSink) -> T) -> T {
        let t0 = Instant::now();
        let out = f(&mut *self.inner);
        let s = t0.elapsed().as_secs_f64();
        self.spent.set(self.spent.get() + s);
        *self
            .by
            .borrow_mut()
            .entry(point_of(what).to_string())
            .or_insert(0.0) += s;
        out
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

impl PairSink for Timed<'_, '_> {
    fn wants(&self, name: &str) -> bool {
        self.inner.wants(name)
    }

    fn record(&mut self, pair: Pair<'_>) -> Result<()> {
        let what = format!("{} {}", pair.name, pair.mode.as_str());
        self.timed(&what, |s| s.record(pair))
    }

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        self.timed("missing", |s| s.missing(name, mode, why))
    }

    fn wants_replay_inputs(&self) -> bool {
        self.inner.wants_replay_inputs()
    }

    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.timed("replay_inputs", |s| s.replay_inputs(step, inputs))
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        let what = format!("{name} {} (reference only)", mode.as_str());
        self.timed(&what, |s| s.reference_only(name, mode, inputs, reference))
    }

    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        self.timed("followed", |s| s.followed(selection, mode, rows))
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
        self.timed("reference_experts", |s| {
            s.reference_experts(step, inputs, experts)
        })
    }

    fn wants_chained_inputs(&self) -> bool {
        self.inner.wants_chained_inputs()
    }

    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        self.timed("chained_inputs", |s| s.chained_inputs(step, inputs))
    }

    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        let what = format!("{name} (plain chain)");
        self.timed(&what, |s| s.plain_chain(name, reference, candidate))
    }
}

#[cfg(test)]
mod tests {
    use super::point_of;

    #[test]
    fn times_are_kept_by_point() {
        assert_eq!(point_of("blk.12.attn_out replay"), "attn_out replay");
        assert_eq!(point_of("logits chained"), "logits chained");
        assert_eq!(point_of("blk.x.y"), "blk.x.y");
        assert_eq!(point_of("reference_experts"), "reference_experts");
    }
}
