//! The counting decorator of `bench layer`: an [`Engine`] that delegates every step to the
//! engine it wraps and logs the weight slices each step reads ([`Read`]: tensor, rows, tokens
//! that multiply them), from the step's arguments and the model's table of the tensors each
//! step kind reads ([`Step::weights`]). The wrapped engine is not asked anything: the counts are
//! those of the weights the step's definition reads, so any engine gives the same ones, and the
//! values it computes are its own, bit for bit.
//!
//! The CPU reference reads exactly those slices (the embedding rows of the prompt, norms and
//! matrices whole, kv_b split or legacy, only the selected experts' rows), and multiplies every
//! matrix row with every token of the step (an expert's rows with the tokens routed to it).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;

use anyhow::Result;
use serde::Serialize;

use super::count_ids;
use super::reads::{reads_of, Read};
use crate::engine::{
    Engine, ExpertInputs, ExpertsOut, HostTensor, MlaInputs, Routing, UploadStats,
};
use crate::model::names;
use crate::model::steps::{Op, Step};
use crate::model::{RopeSlice, Weights};
use crate::precision::Precision;

/// Work on weights over a span of a run: the quantized bytes read, the f32 values they
/// dequantize to, the multiply-adds of those values with the step's tokens, and the CPU
/// reference's tasks (counted from the shapes, see `Read::tasks`); the thread CPU time of the
/// dequantization and of the dot products, measured by redoing the span's reads in the
/// reference's tasks (`work::time`), 0 until measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WeightCounts {
    /// Thread-nanoseconds spent dequantizing.
    pub dequant_ns: u64,
    /// Dequantization calls (tasks).
    pub dequant_calls: u64,
    /// Quantized bytes read.
    pub bytes_in: u64,
    /// f32 values produced.
    pub values_out: u64,
    /// Thread-nanoseconds in weight matmul dot products.
    pub matmul_ns: u64,
    /// Multiply-adds of those dot products.
    pub madds: u64,
}

impl WeightCounts {
    /// The bytes, values, multiply-adds and tasks of `reads` (times 0).
    pub(super) fn of(reads: &[Read<'_>]) -> WeightCounts {
        let mut c = WeightCounts::default();
        for r in reads {
            c.bytes_in += r.bytes();
            c.values_out += r.values();
            c.madds += r.madds();
            c.dequant_calls += r.tasks();
        }
        c
    }
}

/// An engine whose weight reads are logged (see the module documentation).
pub struct Counted<'m, E> {
    inner: E,
    weights: &'m Weights<'m>,
    log: RefCell<Vec<Read<'m>>>,
}

impl<'m, E: Engine<Tensor = HostTensor>> Counted<'m, E> {
    /// `inner`, reading `weights`, with an empty log.
    pub fn new(inner: E, weights: &'m Weights<'m>) -> Counted<'m, E> {
        Counted {
            inner,
            weights,
            log: RefCell::new(Vec::new()),
        }
    }

    /// The counts of every read since the engine was made or last cleared.
    pub fn counts(&self) -> WeightCounts {
        WeightCounts::of(&self.log.borrow())
    }

    /// Reads logged so far (a position in the log).
    pub(super) fn position(&self) -> usize {
        self.log.borrow().len()
    }

    /// The reads logged between two positions.
    pub(super) fn reads(&self, span: Range<usize>) -> Vec<Read<'m>> {
        self.log.borrow().get(span).unwrap_or_default().to_vec()
    }

    /// Empties the log.
    pub(super) fn clear(&self) {
        self.log.borrow_mut().clear();
    }

    /// Logs the reads of `names` by a step on `tokens` tokens (`routed`: expert -> tokens routed
    /// to it, for the stacked expert tensors).
    fn log(&self, names: &[String], tokens: usize, routed: &Routed) -> Result<()> {
        let reads = reads_of(self.weights, names, tokens, routed)?;
        self.log.borrow_mut().extend(reads);
        Ok(())
    }

    /// Logs the reads of the step `op` of layer `layer`, whose tensors the model's step table
    /// names ([`Step::weights`]).
    fn log_op(&self, layer: usize, op: Op, tokens: usize, routed: &Routed) -> Result<()> {
        let step = Step {
            op,
            inputs: Vec::new(),
            outputs: Vec::new(),
            layer: Some(layer),
        };
        self.log(&step.weights(self.weights), tokens, routed)
    }
}

/// Routed experts of a step: expert -> tokens routed to it.
type Routed = BTreeMap<usize, usize>;

/// Tokens (rows) of a `[T, ...]` step input.
fn tokens(x: &HostTensor) -> usize {
    x.shape.first().copied().unwrap_or(0)
}

impl<E: Engine<Tensor = HostTensor>> Engine for Counted<'_, E> {
    type Tensor = HostTensor;

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn precision(&self) -> Precision {
        self.inner.precision()
    }

    fn begin_model(&self, weights: &[String]) -> Result<()> {
        self.inner.begin_model(weights)
    }

    fn end_model(&self) -> Result<()> {
        self.inner.end_model()
    }

    fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        self.inner.begin_layer(layer, weights)
    }

    fn end_layer(&self, layer: usize) -> Result<()> {
        self.inner.end_layer(layer)
    }

    fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        self.inner.prefetch_layer(layer, weights)
    }

    fn take_upload_stats(&self) -> UploadStats {
        self.inner.take_upload_stats()
    }

    fn upload(&self, t: &HostTensor) -> Result<HostTensor> {
        self.inner.upload(t)
    }

    fn download(&self, t: &HostTensor) -> Result<HostTensor> {
        self.inner.download(t)
    }

    fn embed(&self, ids: &[u32]) -> Result<HostTensor> {
        let out = self.inner.embed(ids)?;
        // One row of the table per token, each its own read (a repeated id is read again).
        let table = self.weights.tensor(names::TOKEN_EMBD)?;
        self.log.borrow_mut().extend(ids.iter().map(|&id| Read {
            t: table,
            rows: u64::from(id)..u64::from(id) + 1,
            tokens: 0,
        }));
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &HostTensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<HostTensor> {
        let out = self.inner.rms_norm(x, weight, eps, cols)?;
        self.log(&[weight.to_string()], tokens(x), &Routed::new())?;
        Ok(out)
    }

    fn linear(&self, x: &HostTensor, weight: &str) -> Result<HostTensor> {
        let out = self.inner.linear(x, weight)?;
        self.log(&[weight.to_string()], tokens(x), &Routed::new())?;
        Ok(out)
    }

    fn router_logits(&self, layer: usize, x: &HostTensor) -> Result<HostTensor> {
        let out = self.inner.router_logits(layer, x)?;
        self.log_op(layer, Op::RouterLogits { layer }, tokens(x), &Routed::new())?;
        Ok(out)
    }

    fn rope(&self, x: &HostTensor, s: &RopeSlice) -> Result<HostTensor> {
        self.inner.rope(x, s)
    }

    fn indexer_scores(&self, layer: usize, a: &HostTensor, cq: &HostTensor) -> Result<HostTensor> {
        let out = self.inner.indexer_scores(layer, a, cq)?;
        self.log_op(
            layer,
            Op::IndexerScores { layer },
            tokens(a),
            &Routed::new(),
        )?;
        Ok(out)
    }

    fn top_k(&self, scores: &HostTensor, k: usize) -> Result<HostTensor> {
        self.inner.top_k(scores, k)
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        want_probs: bool,
    ) -> Result<(HostTensor, Option<HostTensor>)> {
        let t = tokens(x.kv_norm);
        let out = self.inner.mla_attention(layer, x, want_probs)?;
        self.log_op(layer, Op::Attention { layer }, t, &Routed::new())?;
        Ok(out)
    }

    fn moe_route(&self, layer: usize, logits: &HostTensor) -> Result<Routing<HostTensor>> {
        let out = self.inner.moe_route(layer, logits)?;
        self.log_op(
            layer,
            Op::MoeRoute { layer },
            tokens(logits),
            &Routed::new(),
        )?;
        Ok(out)
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, HostTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<HostTensor>> {
        let routed = count_ids(x.ids.as_i32("moe_topk_ids")?);
        let t = tokens(x.x);
        let out = self.inner.moe_experts(layer, x, want_expert)?;
        self.log_op(layer, Op::MoeExperts { layer }, t, &routed)?;
        Ok(out)
    }

    fn mlp(&self, x: &HostTensor, gate: &str, up: &str, down: &str) -> Result<HostTensor> {
        let out = self.inner.mlp(x, gate, up, down)?;
        let names = [gate, up, down].map(str::to_string);
        self.log(&names, tokens(x), &Routed::new())?;
        Ok(out)
    }

    fn swiglu(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        self.inner.swiglu(a, b)
    }

    fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        self.inner.add(a, b)
    }

    fn zeros_like(&self, x: &HostTensor) -> Result<HostTensor> {
        self.inner.zeros_like(x)
    }
}
