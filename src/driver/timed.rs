//! A [`PairSink`] in front of another that adds up the time the other spends on what it is
//! handed (the comparison: metrics, verdicts, the bug families' directions), so that the driver
//! can say how much of a layer's time is the comparison rather than either side's steps.
//!
//! It can also hold what it is handed (while [`Timed::defer`] is set) and hand it over later,
//! in the same order ([`Timed::flush`]): the driver compares one step's pairs while the
//! reference runs the next step. Nothing the sink answers may depend on what is held: the
//! driver flushes before a step whose outputs include a selection (it asks the sink's kept
//! scores about their near ties) and at the end of the pass; what the sink is asked meanwhile
//! (`wants`, `wants_*`) depends on its options alone.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Result;

use crate::engine::HostTensor;
use crate::model::steps::Step;
use crate::trace::{Mode, Pair, PairSink};

/// Forwards every call to `inner` unchanged (at once, or held and handed over in order by
/// [`Timed::flush`]), adding the seconds of the calls that hand it work to `spent`.
pub(super) struct Timed<'s, 'c> {
    /// The sink.
    pub inner: &'s mut dyn PairSink,
    /// Seconds spent inside `inner` so far.
    pub spent: &'c Cell<f64>,
    /// The same seconds by what was handed over: a hook's point and mode (`attn_out replay`,
    /// its layer left out) or the call (`reference_experts`).
    pub by: &'c RefCell<BTreeMap<String, f64>>,
    /// Whether calls that hand work over are held for [`Timed::flush`] (set by the driver per
    /// step), and the layer they are counted to.
    pub defer: Option<Option<usize>>,
    /// The calls held, in order, with the layer of the step that made each.
    held: Vec<(Option<usize>, Held)>,
    /// Seconds spent by [`Timed::flush`] on held calls, by their step's layer (taken by the
    /// driver for its layer times).
    pub flushed: Vec<(Option<usize>, f64)>,
}

/// A call held for [`Timed::flush`], with what it was handed (hook values are shared, not
/// copied).
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

impl<'s, 'c> Timed<'s, 'c> {
    /// `inner`, its time added to `spent` and `by`; nothing held.
    pub fn new(
        inner: &'s mut dyn PairSink,
        spent: &'c Cell<f64>,
        by: &'c RefCell<BTreeMap<String, f64>>,
    ) -> Timed<'s, 'c> {
        Timed {
            inner,
            spent,
            by,
            defer: None,
            held: Vec::new(),
            flushed: Vec::new(),
        }
    }

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

    /// Holds `call` when calls are deferred (`true`), else leaves it to the caller.
    fn hold(&mut self, call: impl FnOnce() -> Held) -> bool {
        match self.defer {
            Some(layer) => {
                self.held.push((layer, call()));
                true
            }
            None => false,
        }
    }

    /// Hands the held calls to the sink in order (their seconds in `spent`, `by` and
    /// `flushed`); the first error stops it (the rest are dropped: the pass ends with it).
    pub fn flush(&mut self) -> Result<()> {
        let held = std::mem::take(&mut self.held);
        for (layer, call) in held {
            let before = self.spent.get();
            let out = self.hand(call);
            self.flushed.push((layer, self.spent.get() - before));
            out?;
        }
        Ok(())
    }

    /// Hands one held call to the sink, timed.
    fn hand(&mut self, call: Held) -> Result<()> {
        match call {
            Held::Record {
                name,
                mode,
                inputs,
                reference,
                candidate,
                note,
            } => self.record_now(Pair {
                name: &name,
                mode,
                inputs: &inputs,
                reference,
                candidate,
                note,
            }),
            Held::Missing { name, mode, why } => {
                self.timed("missing", |s| s.missing(&name, mode, &why));
                Ok(())
            }
            Held::ReplayInputs { step, inputs } => {
                self.timed("replay_inputs", |s| s.replay_inputs(&step, &inputs));
                Ok(())
            }
            Held::ReferenceOnly {
                name,
                mode,
                inputs,
                reference,
            } => {
                self.reference_only_now(&name, mode, &inputs, &reference);
                Ok(())
            }
            Held::Followed {
                selection,
                mode,
                rows,
            } => {
                self.timed("followed", |s| s.followed(&selection, mode, &rows));
                Ok(())
            }
            Held::ReferenceExperts {
                step,
                inputs,
                experts,
            } => {
                self.timed("reference_experts", |s| {
                    s.reference_experts(&step, &inputs, experts)
                });
                Ok(())
            }
            Held::ChainedInputs { step, inputs } => {
                self.timed("chained_inputs", |s| s.chained_inputs(&step, &inputs));
                Ok(())
            }
            Held::PlainChain {
                name,
                reference,
                candidate,
            } => {
                self.plain_chain_now(&name, &reference, &candidate);
                Ok(())
            }
        }
    }

    fn record_now(&mut self, pair: Pair<'_>) -> Result<()> {
        let what = format!("{} {}", pair.name, pair.mode.as_str());
        self.timed(&what, |s| s.record(pair))
    }

    fn reference_only_now(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        let what = format!("{name} {} (reference only)", mode.as_str());
        self.timed(&what, |s| s.reference_only(name, mode, inputs, reference))
    }

    fn plain_chain_now(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        let what = format!("{name} (plain chain)");
        self.timed(&what, |s| s.plain_chain(name, reference, candidate))
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
        let Some(layer) = self.defer else {
            return self.record_now(pair);
        };
        self.held.push((
            layer,
            Held::Record {
                name: pair.name.to_string(),
                mode: pair.mode,
                inputs: pair.inputs.to_vec(),
                reference: pair.reference,
                candidate: pair.candidate,
                note: pair.note,
            },
        ));
        Ok(())
    }

    fn missing(&mut self, name: &str, mode: Mode, why: &str) {
        if !self.hold(|| Held::Missing {
            name: name.to_string(),
            mode,
            why: why.to_string(),
        }) {
            self.timed("missing", |s| s.missing(name, mode, why))
        }
    }

    fn wants_replay_inputs(&self) -> bool {
        self.inner.wants_replay_inputs()
    }

    fn replay_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        if !self.hold(|| Held::ReplayInputs {
            step: step.clone(),
            inputs: inputs.to_vec(),
        }) {
            self.timed("replay_inputs", |s| s.replay_inputs(step, inputs))
        }
    }

    fn reference_only(
        &mut self,
        name: &str,
        mode: Mode,
        inputs: &[String],
        reference: &HostTensor,
    ) {
        if !self.hold(|| Held::ReferenceOnly {
            name: name.to_string(),
            mode,
            inputs: inputs.to_vec(),
            reference: reference.clone(),
        }) {
            self.reference_only_now(name, mode, inputs, reference)
        }
    }

    fn followed(&mut self, selection: &str, mode: Mode, rows: &[usize]) {
        if !self.hold(|| Held::Followed {
            selection: selection.to_string(),
            mode,
            rows: rows.to_vec(),
        }) {
            self.timed("followed", |s| s.followed(selection, mode, rows))
        }
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
        match self.defer {
            Some(layer) => self.held.push((
                layer,
                Held::ReferenceExperts {
                    step: step.clone(),
                    inputs: inputs.to_vec(),
                    experts,
                },
            )),
            None => self.timed("reference_experts", |s| {
                s.reference_experts(step, inputs, experts)
            }),
        }
    }

    fn wants_chained_inputs(&self) -> bool {
        self.inner.wants_chained_inputs()
    }

    fn chained_inputs(&mut self, step: &Step, inputs: &[HostTensor]) {
        if !self.hold(|| Held::ChainedInputs {
            step: step.clone(),
            inputs: inputs.to_vec(),
        }) {
            self.timed("chained_inputs", |s| s.chained_inputs(step, inputs))
        }
    }

    fn plain_chain(&mut self, name: &str, reference: &HostTensor, candidate: &HostTensor) {
        if !self.hold(|| Held::PlainChain {
            name: name.to_string(),
            reference: reference.clone(),
            candidate: candidate.clone(),
        }) {
            self.plain_chain_now(name, reference, candidate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::steps::Op;

    /// Logs every call it is handed; a pair named `bad` is an error.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl PairSink for Log {
        fn wants(&self, _: &str) -> bool {
            true
        }
        fn record(&mut self, p: Pair<'_>) -> Result<()> {
            if p.name == "bad" {
                anyhow::bail!("bad pair");
            }
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
    fn calls(t: &mut Timed<'_, '_>) -> Result<()> {
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

    /// Held calls reach the sink at the flush as they would have at once: the same calls with
    /// the same values in the same order; their seconds are counted to the step's layer; an
    /// error of a held pair comes out of the flush.
    #[test]
    fn held_calls_are_handed_over_in_order_at_the_flush() {
        let (spent, by) = (Cell::new(0.0), RefCell::new(BTreeMap::new()));
        let mut now = Log::default();
        calls(&mut Timed::new(&mut now, &spent, &by)).unwrap();
        assert_eq!(now.0.len(), 8);

        let mut later = Log::default();
        let mut t = Timed::new(&mut later, &spent, &by);
        t.defer = Some(Some(7));
        calls(&mut t).unwrap();
        t.defer = None;
        assert_eq!(t.held.len(), 8, "held, not handed over yet");
        t.flush().unwrap();
        assert_eq!(t.flushed.len(), 8);
        assert!(t.flushed.iter().all(|(l, s)| *l == Some(7) && *s >= 0.0));
        t.flush().unwrap();
        assert_eq!(t.flushed.len(), 8, "nothing held twice");
        drop(t);
        assert_eq!(later.0, now.0);

        let mut bad = Log::default();
        let mut t = Timed::new(&mut bad, &spent, &by);
        t.defer = Some(None);
        let x = HostTensor::f32(vec![1], vec![0.0]).unwrap();
        let pair = |name: &'static str| Pair {
            name,
            mode: Mode::Replay,
            inputs: &[],
            reference: x.clone(),
            candidate: x.clone(),
            note: None,
        };
        t.record(pair("bad")).unwrap();
        t.record(pair("after")).unwrap();
        let err = t.flush().unwrap_err();
        assert!(format!("{err:#}").contains("bad pair"));
    }

    #[test]
    fn times_are_kept_by_point() {
        assert_eq!(point_of("blk.12.attn_out replay"), "attn_out replay");
        assert_eq!(point_of("logits chained"), "logits chained");
        assert_eq!(point_of("blk.x.y"), "blk.x.y");
        assert_eq!(point_of("reference_experts"), "reference_experts");
    }
}
