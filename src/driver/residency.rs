//! The weight residency hooks of one engine's walk of a plan (see the [`super`] documentation):
//! which of [`Engine::begin_model`], [`Engine::begin_layer`], [`Engine::prefetch_layer`],
//! [`Engine::end_layer`] and [`Engine::end_model`] are due before a step and at the end.

use std::collections::BTreeSet;

use anyhow::{Context, Result};

use super::Plan;
use crate::engine::Engine;
use crate::model::Step;

/// Where one engine's walk of a plan stands in the weight hooks of [`Engine`]: whether the model
/// is begun, and which layer.
#[derive(Debug, Default)]
pub(crate) struct Residency {
    model: bool,
    layer: Option<usize>,
    /// The layers the walk begins, when not every layer of the plan (a candidate that replays
    /// only some steps).
    only: Option<BTreeSet<usize>>,
}

impl Residency {
    /// The hooks of a walk that begins only the layers `layers` of its plan.
    pub(crate) fn only(layers: BTreeSet<usize>) -> Residency {
        Residency {
            only: Some(layers),
            ..Residency::default()
        }
    }

    /// The layer the walk begins after `layer`: the next of the plan's layers (of those it
    /// begins), none after the last.
    fn next_layer(&self, plan: &Plan, layer: usize) -> Option<usize> {
        let mut later = plan.layer_weights.range(layer + 1..).map(|(&l, _)| l);
        match &self.only {
            None => later.next(),
            Some(only) => later.find(|l| only.contains(l)),
        }
    }

    /// Readies `engine` for `step`: begins the model before the walk's first step, and when the
    /// step's layer differs from the one begun, ends that one, begins the step's and tells the
    /// engine which layer comes next ([`Engine::prefetch_layer`]).
    pub(crate) fn enter<E: Engine>(&mut self, engine: &E, plan: &Plan, step: &Step) -> Result<()> {
        if !self.model {
            engine
                .begin_model(&plan.global_weights)
                .context("driver: begin_model")?;
            self.model = true;
        }
        if step.layer != self.layer {
            if let Some(l) = self.layer.take() {
                engine
                    .end_layer(l)
                    .with_context(|| format!("driver: end_layer {l}"))?;
            }
            if let Some(l) = step.layer {
                engine
                    .begin_layer(l, plan.weights_of_layer(l))
                    .with_context(|| format!("driver: begin_layer {l}"))?;
                self.layer = Some(l);
                if let Some(n) = self.next_layer(plan, l) {
                    engine
                        .prefetch_layer(n, plan.weights_of_layer(n))
                        .with_context(|| format!("driver: prefetch_layer {n}"))?;
                }
            }
        }
        Ok(())
    }

    /// Ends the layer begun, then the model (nothing when the walk ran no step).
    pub(crate) fn finish<E: Engine>(&mut self, engine: &E) -> Result<()> {
        if let Some(l) = self.layer.take() {
            engine
                .end_layer(l)
                .with_context(|| format!("driver: end_layer {l}"))?;
        }
        if std::mem::take(&mut self.model) {
            engine.end_model().context("driver: end_model")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;
    use std::sync::Mutex;

    use anyhow::bail;

    use super::super::{pair, prefix_values, run, run_from, NoProgress};
    use super::*;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{ExpertInputs, ExpertsOut, HostTensor, MlaInputs, Routing, UploadStats};
    use crate::model::names::{self, blk};
    use crate::model::testutil::{tensor_names, tiny_hparams, tiny_model};
    use crate::model::{Arch, RopeSlice, Weights};
    use crate::precision::Precision;
    use crate::trace::{HookFilter, Mode, Pair, PairSink, TraceSink};

    const TOKENS: [u32; 5] = [3, 1, 4, 1, 5];

    /// The CPU engine, recording the weight hooks the driver calls and checking that every
    /// weight a method reads was announced: by `begin_model`, or by `begin_layer` of the layer
    /// begun (which must be the method's own layer).
    struct Recording<'w> {
        cpu: CpuEngine<'w>,
        weights: &'w Weights<'w>,
        events: Mutex<Vec<String>>,
        global: Mutex<Option<Vec<String>>>,
        layer: Mutex<Option<(usize, Vec<String>)>>,
        /// Every `prefetch_layer` call: the layer and the names given.
        prefetched: Mutex<Vec<(usize, Vec<String>)>>,
        /// Every `begin_layer` call: the layer and the names given.
        begun: Mutex<Vec<(usize, Vec<String>)>>,
        /// Upload figures not yet taken: each `begin_layer L` adds `1000 * (L + 1)` bytes and
        /// `L + 1` ms.
        uploads: Mutex<UploadStats>,
        /// What `offer_uploads` answers (uploads under way), and how often it was called.
        offers: Mutex<(bool, usize)>,
        /// Slept in every `rms_norm` (a slow side of a step).
        slow: std::time::Duration,
    }

    impl<'w> Recording<'w> {
        fn new(weights: &'w Weights<'w>) -> Recording<'w> {
            Recording {
                cpu: CpuEngine::new(weights),
                weights,
                events: Default::default(),
                global: Default::default(),
                layer: Default::default(),
                prefetched: Default::default(),
                begun: Default::default(),
                uploads: Default::default(),
                offers: Default::default(),
                slow: std::time::Duration::ZERO,
            }
        }

        fn events(&self) -> Vec<String> {
            self.events.lock().unwrap().clone()
        }

        fn uses(&self, name: &str) -> Result<()> {
            let global = self.global.lock().unwrap();
            let layer = self.layer.lock().unwrap();
            let announced = global.as_ref().is_some_and(|g| g.iter().any(|n| n == name))
                || layer
                    .as_ref()
                    .is_some_and(|(_, ws)| ws.iter().any(|n| n == name));
            if !announced {
                bail!("{name} read without being announced (layer begun: {layer:?})");
            }
            Ok(())
        }

        fn in_layer(&self, layer: usize, names: &[String]) -> Result<()> {
            let begun = self.layer.lock().unwrap().as_ref().map(|(l, _)| *l);
            if begun != Some(layer) {
                bail!("a step of layer {layer} ran while layer {begun:?} was begun");
            }
            names.iter().try_for_each(|n| self.uses(n))
        }
    }

    impl Engine for Recording<'_> {
        type Tensor = HostTensor;
        fn describe(&self) -> String {
            self.cpu.describe()
        }
        fn precision(&self) -> Precision {
            self.cpu.precision()
        }
        fn begin_model(&self, weights: &[String]) -> Result<()> {
            if self.global.lock().unwrap().is_some() {
                bail!("begin_model twice");
            }
            *self.global.lock().unwrap() = Some(weights.to_vec());
            self.events
                .lock()
                .unwrap()
                .push(format!("begin_model {}", weights.join(" ")));
            Ok(())
        }
        fn end_model(&self) -> Result<()> {
            if self.layer.lock().unwrap().is_some() || self.global.lock().unwrap().take().is_none()
            {
                bail!("end_model with a layer begun or no model");
            }
            self.events.lock().unwrap().push("end_model".into());
            Ok(())
        }
        fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
            if self.global.lock().unwrap().is_none() || self.layer.lock().unwrap().is_some() {
                bail!("begin_layer {layer} outside the model or inside another layer");
            }
            *self.layer.lock().unwrap() = Some((layer, weights.to_vec()));
            self.begun.lock().unwrap().push((layer, weights.to_vec()));
            *self.uploads.lock().unwrap() += UploadStats {
                wait: (layer + 1) as f64 * 1e-3,
                bytes: 1000 * (layer as u64 + 1),
            };
            self.events
                .lock()
                .unwrap()
                .push(format!("begin_layer {layer}"));
            Ok(())
        }
        fn end_layer(&self, layer: usize) -> Result<()> {
            match self.layer.lock().unwrap().take() {
                Some((l, _)) if l == layer => {}
                other => bail!("end_layer {layer} while {other:?} was begun"),
            }
            self.events
                .lock()
                .unwrap()
                .push(format!("end_layer {layer}"));
            Ok(())
        }
        fn take_upload_stats(&self) -> UploadStats {
            std::mem::take(&mut *self.uploads.lock().unwrap())
        }
        fn offer_uploads(&self) -> bool {
            let mut o = self.offers.lock().unwrap();
            o.1 += 1;
            o.0
        }
        fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
            match &*self.layer.lock().unwrap() {
                Some((l, _)) if *l < layer => {}
                other => bail!("prefetch_layer {layer} while {other:?} was begun"),
            }
            self.prefetched
                .lock()
                .unwrap()
                .push((layer, weights.to_vec()));
            self.events
                .lock()
                .unwrap()
                .push(format!("prefetch_layer {layer}"));
            Ok(())
        }
        fn upload(&self, t: &HostTensor) -> Result<HostTensor> {
            self.cpu.upload(t)
        }
        fn download(&self, t: &HostTensor) -> Result<HostTensor> {
            self.cpu.download(t)
        }
        fn embed(&self, ids: &[u32]) -> Result<HostTensor> {
            self.uses(names::TOKEN_EMBD)?;
            self.cpu.embed(ids)
        }
        fn rms_norm(
            &self,
            x: &HostTensor,
            weight: &str,
            eps: f64,
            cols: Option<Range<usize>>,
        ) -> Result<HostTensor> {
            self.uses(weight)?;
            std::thread::sleep(self.slow);
            self.cpu.rms_norm(x, weight, eps, cols)
        }
        fn linear(&self, x: &HostTensor, weight: &str) -> Result<HostTensor> {
            self.uses(weight)?;
            self.cpu.linear(x, weight)
        }
        fn router_logits(&self, layer: usize, x: &HostTensor) -> Result<HostTensor> {
            self.in_layer(layer, &[names::blk(layer, blk::FFN_GATE_INP)])?;
            self.cpu.router_logits(layer, x)
        }
        fn rope(&self, x: &HostTensor, s: &RopeSlice) -> Result<HostTensor> {
            self.cpu.rope(x, s)
        }
        fn indexer_scores(
            &self,
            layer: usize,
            a: &HostTensor,
            cq: &HostTensor,
        ) -> Result<HostTensor> {
            let w = |s: &str| names::blk(layer, s);
            let ix = [
                blk::INDEXER_Q_B,
                blk::INDEXER_K,
                blk::INDEXER_PROJ,
                blk::INDEXER_K_NORM,
                blk::INDEXER_K_NORM_B,
            ];
            self.in_layer(layer, &ix.map(w))?;
            self.cpu.indexer_scores(layer, a, cq)
        }
        fn top_k(&self, scores: &HostTensor, k: usize) -> Result<HostTensor> {
            self.cpu.top_k(scores, k)
        }
        fn mla_attention(
            &self,
            layer: usize,
            x: MlaInputs<'_, HostTensor>,
            want_probs: bool,
        ) -> Result<(HostTensor, Option<HostTensor>)> {
            self.in_layer(layer, &self.weights.kv_b_names(layer))?;
            self.cpu.mla_attention(layer, x, want_probs)
        }
        fn moe_route(&self, layer: usize, logits: &HostTensor) -> Result<Routing<HostTensor>> {
            self.in_layer(layer, &[names::blk(layer, blk::EXP_PROBS_B)])?;
            self.cpu.moe_route(layer, logits)
        }
        fn moe_experts(
            &self,
            layer: usize,
            x: ExpertInputs<'_, HostTensor>,
            want_expert: &dyn Fn(usize) -> bool,
        ) -> Result<ExpertsOut<HostTensor>> {
            let mut ws = self.weights.expert_gate_up_names(layer);
            ws.push(names::blk(layer, blk::FFN_DOWN_EXPS));
            self.in_layer(layer, &ws)?;
            self.cpu.moe_experts(layer, x, want_expert)
        }
        fn mlp(&self, x: &HostTensor, gate: &str, up: &str, down: &str) -> Result<HostTensor> {
            [gate, up, down].iter().try_for_each(|n| self.uses(n))?;
            self.cpu.mlp(x, gate, up, down)
        }
        fn swiglu(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
            self.cpu.swiglu(a, b)
        }
        fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
            self.cpu.add(a, b)
        }
    }

    /// A pair sink that wants the hooks of `filter` and counts what it gets.
    /// `run_pair` of `reference` and the engine `candidate` over `plan` of [`TOKENS`] in
    /// `modes` into `sink`.
    fn pair_pass(
        reference: &Recording<'_>,
        candidate: &Recording<'_>,
        w: &Weights<'_>,
        plan: &Plan,
        modes: pair::Modes,
        sink: &mut CountPairs,
    ) -> pair::PairSummary {
        pair::run_pair(
            reference,
            pair::Candidate::Engine(candidate),
            pair::RunInputs {
                weights: w,
                tokens: &TOKENS,
                plan,
                start: &[],
                ties: &crate::trace::NoNearTies,
            },
            modes,
            sink,
            &NoProgress,
        )
        .unwrap()
    }

    struct CountPairs(HookFilter, usize);

    impl PairSink for CountPairs {
        fn wants(&self, name: &str) -> bool {
            self.0.wants(name)
        }
        fn record(&mut self, _: Pair<'_>) -> Result<()> {
            self.1 += 1;
            Ok(())
        }
        fn missing(&mut self, name: &str, mode: Mode, why: &str) {
            panic!("{name} missing in {mode:?}: {why}");
        }
    }

    /// While the reference's side of a step runs, the pass asks a candidate engine to offer the
    /// weights its uploads finished (`Engine::offer_uploads`) for as long as it says some are
    /// under way, and not past the reference's end: an engine that always says so still ends
    /// the pass, with the same pairs, and is asked while a slow reference norm runs; one that
    /// says none are under way is asked at most once a step.
    #[test]
    fn the_pass_asks_for_offers_while_the_reference_runs() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let plan = Plan::full(&w).unwrap();
        let mut pairs = Vec::new();
        for under_way in [false, true] {
            let mut reference = Recording::new(&w);
            reference.slow = std::time::Duration::from_millis(5);
            let candidate = Recording::new(&w);
            candidate.offers.lock().unwrap().0 = under_way;
            let mut sink = CountPairs(HookFilter::default(), 0);
            let summary = pair_pass(
                &reference,
                &candidate,
                &w,
                &plan,
                pair::Modes::BOTH,
                &mut sink,
            );
            let asked = candidate.offers.lock().unwrap().1;
            if under_way {
                assert!(asked > 0, "never asked while the reference's norms ran");
            } else {
                assert!(
                    asked <= summary.steps,
                    "{asked} asks for {} steps",
                    summary.steps
                );
            }
            assert_eq!(reference.offers.lock().unwrap().1, 0);
            pairs.push(sink.1);
        }
        assert!(pairs[0] > 0);
        assert_eq!(pairs[0], pairs[1]);
    }

    /// The weight hooks in order, around every layer, for a chained run, a reference prefix and
    /// both pair modes (a replay-only candidate begins only the layers it replays); the names
    /// handed over are every tensor of the layer, and every weight a step reads was announced
    /// first (checked by the recording engine, which fails the run otherwise).
    #[test]
    fn driver_announces_each_layers_weights_in_order() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let full = [
            "begin_model token_embd.weight output_norm.weight output.weight",
            "begin_layer 0",
            "prefetch_layer 1",
            "end_layer 0",
            "begin_layer 1",
            "end_layer 1",
            "end_model",
        ];

        let engine = Recording::new(&w);
        let plan = Plan::full(&w).unwrap();
        let mut sink = TraceSink::new(HookFilter::default());
        run(&engine, &w, &TOKENS, &plan, &mut sink).unwrap();
        assert_eq!(engine.events(), full);
        for l in 0..hp.n_layer {
            let mut got = plan.weights_of_layer(l).to_vec();
            let mut want: Vec<String> = tensor_names(&hp)
                .into_iter()
                .filter(|n| names::split_blk(n).is_some_and(|(nl, _)| nl == l))
                .collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "layer {l}");
        }

        // Layers 1..2 from the reference's prefix 0..1.
        let engine = Recording::new(&w);
        let next = Plan::range(&w, 1..2, true).unwrap();
        let start = prefix_values(&engine, &w, &TOKENS, &next, &NoProgress).unwrap();
        assert_eq!(
            engine.events(),
            [
                "begin_model token_embd.weight",
                "begin_layer 0",
                "end_layer 0",
                "end_model"
            ]
        );

        for (modes, hooks, cand_events) in [
            (pair::Modes::BOTH, vec![], full.to_vec()),
            (
                pair::Modes {
                    replay: true,
                    chained: false,
                },
                vec!["blk.1.attn_out".to_string()],
                vec![
                    "begin_model token_embd.weight output_norm.weight output.weight",
                    "begin_layer 1",
                    "end_layer 1",
                    "end_model",
                ],
            ),
        ] {
            let (reference, candidate) = (Recording::new(&w), Recording::new(&w));
            let mut sink = CountPairs(
                HookFilter {
                    layers: None,
                    globs: hooks,
                },
                0,
            );
            pair_pass(&reference, &candidate, &w, &plan, modes, &mut sink);
            assert!(sink.1 > 0);
            assert_eq!(reference.events(), full);
            assert_eq!(candidate.events(), cand_events, "{modes:?}");
        }

        // A plan of the last layer and the tail, started from the prefix's values.
        let engine = Recording::new(&w);
        let mut sink = TraceSink::new(HookFilter::default());
        run_from(&engine, &w, &TOKENS, &next, &start, &mut sink, &NoProgress).unwrap();
        assert_eq!(
            engine.events(),
            [
                "begin_model output_norm.weight output.weight",
                "begin_layer 1",
                "end_layer 1",
                "end_model"
            ]
        );
    }

    /// `prefetch_layer` names the next layer the walk begins, right after each `begin_layer`,
    /// with the names that layer's `begin_layer` gets: every next layer of a chained run, never
    /// past the plan's last layer (a prefix plan, a plan that ends before the model does), and
    /// for a candidate that only replays some layers, the next of those (skipping the layers it
    /// does not begin).
    #[test]
    fn prefetch_names_the_next_layer_the_walk_begins() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        hp.n_layer = 3;
        hp.n_block = 3;
        if let Some(ix) = &mut hp.indexer {
            ix.full = vec![true; 3];
        }
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();

        // Chained, the whole model.
        let engine = Recording::new(&w);
        let plan = Plan::full(&w).unwrap();
        run(
            &engine,
            &w,
            &TOKENS,
            &plan,
            &mut TraceSink::new(HookFilter::default()),
        )
        .unwrap();
        assert_eq!(
            engine.events()[1..8],
            [
                "begin_layer 0",
                "prefetch_layer 1",
                "end_layer 0",
                "begin_layer 1",
                "prefetch_layer 2",
                "end_layer 1",
                "begin_layer 2",
            ]
        );
        let prefetched = engine.prefetched.lock().unwrap().clone();
        assert_eq!(
            prefetched.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            [1, 2]
        );
        for (l, names) in &prefetched {
            assert_eq!(names, plan.weights_of_layer(*l), "layer {l}");
            let begun = engine.begun.lock().unwrap();
            let (_, at_begin) = begun.iter().find(|(b, _)| b == l).unwrap();
            assert_eq!(names, at_begin, "layer {l}");
        }

        // Layers 0..2 only: layer 2 is past the plan, never prefetched; the prefix of a plan
        // from layer 2 likewise.
        for plan in [
            Plan::new(&w, 2, false).unwrap(),
            Plan::range(&w, 2..3, true).unwrap(),
        ] {
            let engine = Recording::new(&w);
            let mut sink = TraceSink::new(HookFilter::default());
            if plan.first_layer == 0 {
                run(&engine, &w, &TOKENS, &plan, &mut sink).unwrap();
            } else {
                prefix_values(&engine, &w, &TOKENS, &plan, &NoProgress).unwrap();
            }
            let got: Vec<usize> = engine
                .prefetched
                .lock()
                .unwrap()
                .iter()
                .map(|(l, _)| *l)
                .collect();
            assert_eq!(got, [1], "{:?}", engine.events());
        }

        // A replay-only candidate that replays layers 0 and 2: it begins those two and is
        // told of layer 2 while in layer 0; the reference walks every layer.
        let (reference, candidate) = (Recording::new(&w), Recording::new(&w));
        let mut sink = CountPairs(
            HookFilter {
                layers: None,
                globs: vec!["blk.0.attn_out".to_string(), "blk.2.attn_out".to_string()],
            },
            0,
        );
        pair::run_pair(
            &reference,
            pair::Candidate::Engine(&candidate),
            pair::RunInputs {
                weights: &w,
                tokens: &TOKENS,
                plan: &Plan::range(&w, 0..3, false).unwrap(),
                start: &[],
                ties: &crate::trace::NoNearTies,
            },
            pair::Modes {
                replay: true,
                chained: false,
            },
            &mut sink,
            &NoProgress,
        )
        .unwrap();
        assert_eq!(sink.1, 2);
        assert_eq!(
            candidate.events(),
            [
                "begin_model token_embd.weight",
                "begin_layer 0",
                "prefetch_layer 2",
                "end_layer 0",
                "begin_layer 2",
                "end_layer 2",
                "end_model",
            ]
        );
        let got: Vec<usize> = reference
            .prefetched
            .lock()
            .unwrap()
            .iter()
            .map(|(l, _)| *l)
            .collect();
        assert_eq!(got, [1, 2]);
    }

    /// The pair driver takes the candidate engine's upload figures after its steps and files
    /// them under the layer of the step (chained, and replay-only where the candidate begins
    /// layers through its own residency); the reference's are not the candidate's.
    #[test]
    fn pair_files_the_candidates_uploads_by_layer() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let plan = Plan::full(&w).unwrap();
        for modes in [
            pair::Modes::BOTH,
            pair::Modes {
                replay: true,
                chained: false,
            },
        ] {
            let (reference, candidate) = (Recording::new(&w), Recording::new(&w));
            let mut sink = CountPairs(HookFilter::default(), 0);
            let summary = pair_pass(&reference, &candidate, &w, &plan, modes, &mut sink);
            let got: Vec<(Option<usize>, u64, f64)> = summary
                .layer_times
                .iter()
                .map(|t| (t.layer, t.upload_bytes, t.upload))
                .collect();
            assert_eq!(
                got,
                [(None, 0, 0.0), (Some(0), 1000, 1e-3), (Some(1), 2000, 2e-3)],
                "{modes:?}"
            );
        }
    }
}
