//! [`FaultEngine`]: any engine with faults injected into the steps they concern.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};

use super::route::{self, RouteChange};
use super::{attn, host};
use super::{Fault, FaultKind, MlpPart};
use crate::engine::cpu::{mla_host, rms_norm_with, CpuEngine, Matrix, Rows};
use crate::engine::{
    Engine, ExpertInputs, ExpertsOut, HostTensor, MlaInputs, Routing, UploadStats,
};
use crate::model::names::{self, blk};
use crate::model::steps::{self, Op};
use crate::model::{rope, RopeSlice, Weights};
use crate::precision::{Dtype, Precision};
use crate::quant::GgmlType;
use crate::util::glob::matches as glob_match;

/// An engine whose steps are those of `inner`, except the steps the faults concern: those are
/// computed on the host, the faulty way (module [`host`]), from the inputs `inner` holds
/// (downloaded) and handed back to it (uploaded). Works around any engine; with no fault it is
/// `inner`.
///
/// The layer of a RoPE step (which the trait does not pass) is the one the driver began last
/// ([`Engine::begin_layer`]); a step run outside a walk counts as every layer.
pub struct FaultEngine<'a, 'w, E: Engine> {
    inner: &'a E,
    weights: &'w Weights<'w>,
    host: CpuEngine<'w>,
    faults: Vec<Fault>,
    layer: Mutex<Option<usize>>,
}

impl<'a, 'w, E: Engine> FaultEngine<'a, 'w, E> {
    /// `inner` with `faults` (checked by the caller with [`Fault::check`]).
    pub fn new(inner: &'a E, weights: &'w Weights<'w>, faults: Vec<Fault>) -> Self {
        FaultEngine {
            inner,
            weights,
            host: CpuEngine::new(weights),
            faults,
            layer: Mutex::new(None),
        }
    }

    /// Sets the layer begun last, returning the one before.
    fn set_layer(&self, layer: Option<usize>) -> Option<usize> {
        match self.layer.lock() {
            Ok(mut l) => std::mem::replace(&mut *l, layer),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), layer),
        }
    }

    /// The faults.
    pub fn faults(&self) -> &[Fault] {
        &self.faults
    }

    /// The kinds of the faults that touch `layer`.
    fn kinds_at(&self, layer: Option<usize>) -> impl Iterator<Item = &FaultKind> {
        self.faults
            .iter()
            .filter(move |f| f.at(layer))
            .map(|f| &f.kind)
    }

    /// The kinds of the faults that touch the step being run (RoPE, top-k: the layer begun
    /// last; every fault outside a walk).
    fn kinds_now(&self) -> Vec<&FaultKind> {
        match self.current_layer() {
            Some(l) => self.kinds_at(Some(l)).collect(),
            None => self.faults.iter().map(|f| &f.kind).collect(),
        }
    }

    /// A host engine with the RoPE tables the faults of the step being run give (`rope_theta`,
    /// `yarn_mscale`), `None` when they give the model's.
    fn rope_engine(&self) -> Option<CpuEngine<'w>> {
        attn::rope_tables(self.weights.hparams(), self.kinds_now())
            .map(|(f, a)| CpuEngine::with_rope(self.weights, f, a))
    }

    /// The first fault whose kind satisfies `pred` and that touches `layer`.
    fn find(&self, layer: Option<usize>, pred: impl Fn(&FaultKind) -> bool) -> Option<&Fault> {
        self.faults.iter().find(|f| pred(&f.kind) && f.at(layer))
    }

    fn to_host(&self, t: &E::Tensor) -> Result<HostTensor> {
        self.inner.download(t)
    }

    fn to_engine(&self, t: &HostTensor) -> Result<E::Tensor> {
        self.inner.upload(t)
    }

    /// The layer and suffix of a tensor name (`None` for global tensors).
    fn split(name: &str) -> (Option<usize>, &str) {
        match names::split_blk(name) {
            Some((l, s)) => (Some(l), s),
            None => (None, name),
        }
    }

    /// Where a layer's tensor `name` is read from under `layer_weights` (itself otherwise).
    fn source_name(&self, name: &str) -> String {
        let (layer, suffix) = Self::split(name);
        for f in &self.faults {
            if let FaultKind::LayerWeights { src, glob } = &f.kind {
                if layer.is_some() && f.at(layer) && glob_match(glob, suffix) {
                    return names::blk(*src, suffix);
                }
            }
        }
        name.to_string()
    }

    /// Whether any weight fault changes matrix `name` (cheap: no values read).
    fn touches_matrix(&self, name: &str) -> bool {
        let (layer, suffix) = Self::split(name);
        let q4k = |n: &str| {
            self.weights
                .model()
                .find(n)
                .is_some_and(|t| t.info.ty == GgmlType::Q4_K)
        };
        self.source_name(name) != name
            || self
                .find(layer, |k| matches!(k, FaultKind::Q4kScaleBits))
                .is_some_and(|_| q4k(&self.source_name(name)))
            || self
                .find(
                    layer,
                    |k| matches!(k, FaultKind::Transposed { glob } if glob_match(glob, suffix)),
                )
                .is_some()
            || (self
                .find(layer, |k| matches!(k, FaultKind::TpShard(_)))
                .is_some()
                && (suffix == blk::ATTN_Q_B || suffix == blk::ATTN_OUTPUT))
            || attn::weight_factor(self.kinds_at(layer), name).is_some()
    }

    /// Matrix `name` as the faults realise it (`[rows, cols]`), `None` when no fault changes it.
    fn faulted_matrix(&self, name: &str) -> Result<Option<Matrix>> {
        if !self.touches_matrix(name) {
            return Ok(None);
        }
        let (layer, suffix) = Self::split(name);
        let src = self.source_name(name);
        let desc = self.weights.matrix_desc(&src)?;
        let mut m = if self
            .find(layer, |k| matches!(k, FaultKind::Q4kScaleBits))
            .is_some()
            && desc.ty() == GgmlType::Q4_K
        {
            Matrix {
                rows: desc.n_rows(),
                cols: desc.cols,
                data: host::dequant_q4k_faulty(&desc)?,
            }
        } else {
            host::dense(&desc)?
        };
        if self
            .find(
                layer,
                |k| matches!(k, FaultKind::Transposed { glob } if glob_match(glob, suffix)),
            )
            .is_some()
        {
            m = host::transposed(&m);
        }
        if let Some(FaultKind::TpShard(n)) = self
            .find(layer, |k| matches!(k, FaultKind::TpShard(_)))
            .map(|f| &f.kind)
        {
            let hp = self.weights.hparams();
            let from = host::shard_heads(hp.n_head, *n);
            if suffix == blk::ATTN_Q_B {
                m = host::map_row_blocks(&m, hp.qk_head(), &from)?;
            } else if suffix == blk::ATTN_OUTPUT {
                m = host::map_col_blocks(&m, hp.v_head, &from)?;
            }
        }
        if let Some(f) = attn::weight_factor(self.kinds_at(layer), name) {
            attn::scale(&mut m.data, f);
        }
        Ok(Some(m))
    }

    /// `x · W^T` for matrix `weight` on the host, the faulty way, when a fault concerns it: the
    /// matrix as the weight faults realise it, multiplied with inputs and weights rounded to
    /// bf16 (`bf16`), or with f32 sums (`f32_accumulate`), or as the reference multiplies.
    /// `None` when no fault concerns it (the caller runs `inner`'s step).
    fn faulted_linear(&self, x: &E::Tensor, weight: &str, bf16: bool) -> Result<Option<E::Tensor>> {
        let (layer, _) = Self::split(weight);
        let f32acc = self
            .find(layer, |k| matches!(k, FaultKind::F32Accumulate))
            .is_some();
        let m = self.faulted_matrix(weight)?;
        if m.is_none() && !bf16 && !f32acc {
            return Ok(None);
        }
        let m = match m {
            Some(m) => m,
            None => host::dense(&self.weights.matrix_desc(weight)?)?,
        };
        let hx = self.to_host(x)?;
        let (t, k) = hx.dims2(weight)?;
        if k != m.cols {
            bail!(
                "fault: linear {weight}: input has {k} columns, the weight [{}, {}] expects {}",
                m.rows,
                m.cols,
                m.cols
            );
        }
        let xv = hx.as_f32(weight)?;
        let out = if bf16 {
            host::matmul_bf16(xv, t, &m)
        } else if f32acc {
            host::matmul_f32_accumulate(xv, t, &m)
        } else {
            host::matmul(xv, t, &m)
        };
        self.to_engine(&HostTensor::f32(vec![t, m.rows], out)?)
            .map(Some)
    }

    /// The layer of the step being run (RoPE): the one begun last.
    fn current_layer(&self) -> Option<usize> {
        self.layer.lock().map_or(None, |l| *l)
    }

    /// Whether a fault concerns the RoPE step now (every layer when outside a walk).
    fn rope_fault(&self) -> bool {
        match self.current_layer() {
            Some(l) => self
                .find(Some(l), |k| matches!(k, FaultKind::RopeNeox))
                .is_some(),
            None => self
                .faults
                .iter()
                .any(|f| matches!(f.kind, FaultKind::RopeNeox)),
        }
    }

    /// Expert `e`'s `[gate, up, down]` rows of layer `layer` as the faults realise them.
    fn expert_rows(&self, layer: usize, e: usize) -> Result<[Rows<'w>; 3]> {
        let from = self
            .find(Some(layer), |k| matches!(k, FaultKind::ExpertMap(_)))
            .and_then(|f| match &f.kind {
                FaultKind::ExpertMap(m) => m.iter().find(|(s, _)| *s == e).map(|&(_, f)| f),
                _ => None,
            })
            .unwrap_or(e);
        // The tensors each projection reads (a layer_weights glob may move some of them).
        let gate_up = self.weights.expert_gate_up_names(layer);
        let down = names::blk(layer, blk::FFN_DOWN_EXPS);
        let src_layer =
            |n: &str| -> usize { names::split_blk(&self.source_name(n)).map_or(layer, |(l, _)| l) };
        let (gl, dl) = (src_layer(&gate_up[0]), src_layer(&down));
        let gu = self.host.expert_rows(gl, from)?;
        let dn = self.host.expert_rows(dl, from)?;
        let [g, u, _] = gu;
        let [_, _, d] = dn;
        let mut rows = [g, u, d];
        if self
            .find(Some(layer), |k| matches!(k, FaultKind::Q4kScaleBits))
            .is_some()
        {
            let descs = {
                let (g, u) = self.weights.expert_gate_up_desc(gl, from)?;
                let d = self
                    .weights
                    .expert_desc(&names::blk(dl, blk::FFN_DOWN_EXPS), from)?;
                [g, u, d]
            };
            for (r, d) in rows.iter_mut().zip(&descs) {
                if d.ty() == GgmlType::Q4_K {
                    *r = Rows::Dense(Matrix {
                        rows: d.n_rows(),
                        cols: d.cols,
                        data: host::dequant_q4k_faulty(d)?,
                    });
                }
            }
        }
        if self
            .find(Some(layer), |k| matches!(k, FaultKind::GateUpSwap))
            .is_some()
        {
            rows.swap(0, 1);
        }
        let scale = self.find(
            Some(layer),
            |k| matches!(k, FaultKind::ExpertScale { expert, .. } if *expert == e),
        );
        if let Some(FaultKind::ExpertScale { factor, .. }) = scale.map(|f| &f.kind) {
            rows[2] = Rows::Dense(route::scaled(&rows[2], *factor)?);
        }
        Ok(rows)
    }

    /// `name`, or its gate/up partner under `gate_up_swap:dense` (`ffn_gate` <-> `ffn_up`) or
    /// `gate_up_swap:shared` (`ffn_gate_shexp` <-> `ffn_up_shexp`) at its layer.
    fn gate_up_name(&self, name: &str) -> String {
        let (layer, suffix) = Self::split(name);
        let (part, other) = match suffix {
            blk::FFN_GATE => (MlpPart::Dense, blk::FFN_UP),
            blk::FFN_UP => (MlpPart::Dense, blk::FFN_GATE),
            blk::FFN_GATE_SHEXP => (MlpPart::Shared, blk::FFN_UP_SHEXP),
            blk::FFN_UP_SHEXP => (MlpPart::Shared, blk::FFN_GATE_SHEXP),
            _ => return name.to_string(),
        };
        match (
            layer,
            self.find(layer, |k| *k == FaultKind::GateUpSwapMlp(part)),
        ) {
            (Some(l), Some(_)) => names::blk(l, other),
            _ => name.to_string(),
        }
    }

    /// `x · W^T` for matrix `weight` (already exchanged by [`Self::gate_up_name`]), the faulty
    /// way when a weight fault concerns it.
    fn linear_as(&self, x: &E::Tensor, weight: &str) -> Result<E::Tensor> {
        match self.faulted_linear(x, weight, false)? {
            Some(y) => Ok(y),
            None => self.inner.linear(x, weight),
        }
    }

    /// Whether a fault concerns the routed experts of `layer`.
    fn experts_fault(&self, layer: usize) -> bool {
        let q4k = self.weights.expert_gate_up_names(layer).iter().any(|n| {
            self.weights
                .model()
                .find(n)
                .is_some_and(|t| t.info.ty == GgmlType::Q4_K)
        }) || self
            .weights
            .model()
            .find(&names::blk(layer, blk::FFN_DOWN_EXPS))
            .is_some_and(|t| t.info.ty == GgmlType::Q4_K);
        let moved = self
            .weights
            .expert_gate_up_names(layer)
            .iter()
            .chain(std::iter::once(&names::blk(layer, blk::FFN_DOWN_EXPS)))
            .any(|n| self.source_name(n) != *n);
        moved
            || self
                .find(Some(layer), |k| {
                    matches!(
                        k,
                        FaultKind::ExpertMap(_)
                            | FaultKind::GateUpSwap
                            | FaultKind::ExpertScale { .. }
                    ) || (q4k && matches!(k, FaultKind::Q4kScaleBits))
                })
                .is_some()
    }

    /// Runs the first MTP block as one more layer on `x` (the residual stream after the last
    /// layer), through this engine (so other faults apply inside it), and returns its output.
    fn mtp_layer(&self, x: &E::Tensor) -> Result<E::Tensor> {
        let hp = self.weights.hparams();
        let mtp = hp.n_layer;
        let mut hp2 = hp.clone();
        hp2.n_layer = mtp + 1;
        if let Some(ix) = &mut hp2.indexer {
            ix.full.resize(mtp + 1, true);
        }
        let steps = steps::layer_steps(&hp2, mtp);
        let input = steps::layer_input(mtp);
        let out_name = steps::hook(mtp, steps::point::L_OUT);
        let names = steps::weights_of(&steps, self.weights);
        self.inner.begin_layer(mtp, &names)?;
        let before = self.set_layer(Some(mtp));
        let mut env: HashMap<String, E::Tensor> = HashMap::new();
        let result = (|| -> Result<()> {
            for s in &steps {
                let inputs: Vec<&E::Tensor> = s
                    .inputs
                    .iter()
                    .map(|n| {
                        if *n == input {
                            Ok(x)
                        } else {
                            env.get(n).with_context(|| {
                                format!("fault run_mtp: step {:?} needs {n}", s.outputs)
                            })
                        }
                    })
                    .collect::<Result<_>>()?;
                let outs = self.exec_layer_step(&s.op, &inputs)?;
                for (n, t) in s.outputs.iter().zip(outs) {
                    env.insert(n.clone(), t);
                }
            }
            Ok(())
        })();
        self.set_layer(before);
        result.with_context(|| format!("fault run_mtp: the MTP block blk.{mtp} as a layer"))?;
        self.inner.end_layer(mtp)?;
        env.remove(&out_name)
            .with_context(|| format!("fault run_mtp: blk.{mtp} produced no {out_name}"))
    }

    /// One step of a layer on this engine (the MTP layer of `run_mtp`).
    fn exec_layer_step(&self, op: &Op, i: &[&E::Tensor]) -> Result<Vec<E::Tensor>> {
        let x = |n: usize| -> Result<&E::Tensor> {
            i.get(n)
                .copied()
                .context("fault run_mtp: missing step input")
        };
        Ok(match op {
            Op::RmsNorm { weight, eps, cols } => {
                vec![self.rms_norm(x(0)?, weight, *eps, cols.clone())?]
            }
            Op::Linear { weight } => vec![self.linear(x(0)?, weight)?],
            Op::RouterLogits { layer } => vec![self.router_logits(*layer, x(0)?)?],
            Op::Rope(s) => vec![self.rope(x(0)?, s)?],
            Op::IndexerScores { layer } => vec![self.indexer_scores(*layer, x(0)?, x(1)?)?],
            Op::TopK { k } => vec![self.top_k(x(0)?, *k)?],
            Op::Attention { layer } => {
                let inp = MlaInputs {
                    q_b: x(0)?,
                    q_pe: x(1)?,
                    kv_norm: x(2)?,
                    k_pe: x(3)?,
                    selection: i.get(4).copied(),
                };
                vec![self.mla_attention(*layer, inp, false)?.0]
            }
            Op::MoeRoute { layer } => {
                let r = self.moe_route(*layer, x(0)?)?;
                vec![r.probs, r.ids, r.weights]
            }
            Op::MoeExperts { layer } => {
                let inp = ExpertInputs {
                    x: x(0)?,
                    ids: x(1)?,
                    weights: x(2)?,
                };
                vec![self.moe_experts(*layer, inp, &|_| false)?.routed]
            }
            Op::Mlp { gate, up, down } => vec![self.mlp(x(0)?, gate, up, down)?],
            Op::SwiGlu => vec![self.swiglu(x(0)?, x(1)?)?],
            Op::Add => vec![self.add(x(0)?, x(1)?)?],
            Op::ZerosLike => vec![self.zeros_like(x(0)?)?],
            Op::Embed | Op::Alias => bail!("fault run_mtp: unexpected step in a layer: {op:?}"),
        })
    }
}

impl<E: Engine> Engine for FaultEngine<'_, '_, E> {
    type Tensor = E::Tensor;

    fn describe(&self) -> String {
        if self.faults.is_empty() {
            return self.inner.describe();
        }
        let f: Vec<String> = self.faults.iter().map(Fault::to_string).collect();
        format!(
            "{} with injected fault {}",
            self.inner.describe(),
            f.join(" + ")
        )
    }

    /// `inner`'s, with f32 sums where it accumulates in f64 under `f32_accumulate`.
    fn precision(&self) -> Precision {
        let mut p = self.inner.precision();
        if p.accumulate == Dtype::F64
            && self
                .faults
                .iter()
                .any(|f| matches!(f.kind, FaultKind::F32Accumulate))
        {
            p.accumulate = Dtype::F32;
        }
        p
    }

    fn begin_model(&self, weights: &[String]) -> Result<()> {
        self.inner.begin_model(weights)
    }

    fn end_model(&self) -> Result<()> {
        self.inner.end_model()
    }

    fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        self.set_layer(Some(layer));
        self.inner.begin_layer(layer, weights)
    }

    fn end_layer(&self, layer: usize) -> Result<()> {
        self.set_layer(None);
        self.inner.end_layer(layer)
    }

    fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        self.inner.prefetch_layer(layer, weights)
    }

    fn take_upload_stats(&self) -> UploadStats {
        self.inner.take_upload_stats()
    }

    fn upload(&self, t: &HostTensor) -> Result<E::Tensor> {
        self.inner.upload(t)
    }

    fn download(&self, t: &E::Tensor) -> Result<HostTensor> {
        self.inner.download(t)
    }

    fn embed(&self, ids: &[u32]) -> Result<E::Tensor> {
        let q4k = self
            .find(None, |k| matches!(k, FaultKind::Q4kScaleBits))
            .is_some()
            && self
                .weights
                .model()
                .find(names::TOKEN_EMBD)
                .is_some_and(|t| t.info.ty == GgmlType::Q4_K);
        if !q4k {
            return self.inner.embed(ids);
        }
        let hidden = self.weights.hparams().hidden;
        let mut data = Vec::with_capacity(ids.len() * hidden);
        for row in self.weights.embedding_rows_desc(ids)? {
            data.extend(host::dequant_q4k_faulty(&row)?);
        }
        self.to_engine(&HostTensor::f32(vec![ids.len(), hidden], data)?)
    }

    fn rms_norm(
        &self,
        x: &E::Tensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<E::Tensor> {
        let (layer, _) = Self::split(weight);
        let mtp;
        let x = if weight == names::OUTPUT_NORM
            && self
                .find(None, |k| matches!(k, FaultKind::RunMtp))
                .is_some()
        {
            mtp = self.mtp_layer(x)?;
            &mtp
        } else {
            x
        };
        let eps = match self
            .find(layer, |k| matches!(k, FaultKind::NormEps(_)))
            .map(|f| &f.kind)
        {
            Some(FaultKind::NormEps(e)) => *e,
            _ => eps,
        };
        let src = self.source_name(weight);
        let factor = attn::weight_factor(self.kinds_at(layer), weight);
        let one_plus = self
            .kinds_at(layer)
            .any(|k| matches!(k, FaultKind::NormOnePlus { glob } if attn::matches(glob, weight)));
        if src != weight || factor.is_some() || one_plus {
            let mut w = self.host.host_vector(&src)?;
            if one_plus {
                w.iter_mut().for_each(|v| *v += 1.0);
            }
            if let Some(f) = factor {
                attn::scale(&mut w, f);
            }
            let out = rms_norm_with(&self.to_host(x)?, &src, &w, eps, cols)?;
            return self.to_engine(&out);
        }
        self.inner.rms_norm(x, weight, eps, cols)
    }

    fn linear(&self, x: &E::Tensor, weight: &str) -> Result<E::Tensor> {
        self.linear_as(x, &self.gate_up_name(weight))
    }

    /// `router_bf16` computes the logits in bf16, against the trait's precision rule.
    fn router_logits(&self, layer: usize, x: &E::Tensor) -> Result<E::Tensor> {
        let weight = names::blk(layer, blk::FFN_GATE_INP);
        let bf16 = self
            .find(Some(layer), |k| matches!(k, FaultKind::RouterBf16))
            .is_some();
        match self.faulted_linear(x, &weight, bf16)? {
            Some(y) => Ok(y),
            None => self.inner.router_logits(layer, x),
        }
    }

    fn rope(&self, x: &E::Tensor, s: &RopeSlice) -> Result<E::Tensor> {
        let tables = self.rope_engine();
        if !self.rope_fault() {
            return match &tables {
                Some(e) => self.to_engine(&e.rope(&self.to_host(x)?, s)?),
                None => self.inner.rope(x, s),
            };
        }
        let eng = tables.as_ref().unwrap_or(&self.host);
        let out = eng.rope_with(&self.to_host(x)?, s, host::rotate_halves)?;
        self.to_engine(&out)
    }

    /// `rope_theta` and `yarn_mscale` change the indexer's RoPE too (one RoPE per engine);
    /// `indexer_scale` and `indexer_wproj_scale` multiply every score (module [`attn`]).
    fn indexer_scores(&self, layer: usize, a: &E::Tensor, cq: &E::Tensor) -> Result<E::Tensor> {
        let neox = self
            .find(Some(layer), |k| matches!(k, FaultKind::IndexerRopeNeox))
            .is_some();
        let no_relu = self
            .find(Some(layer), |k| matches!(k, FaultKind::IndexerNoRelu))
            .is_some();
        let tables = attn::rope_tables(self.weights.hparams(), self.kinds_at(Some(layer)))
            .map(|(f, a)| CpuEngine::with_rope(self.weights, f, a));
        let factor = attn::indexer_factor(self.kinds_at(Some(layer)));
        if !neox && !no_relu && tables.is_none() && factor.is_none() {
            return self.inner.indexer_scores(layer, a, cq);
        }
        let mut out = if neox || no_relu || tables.is_some() {
            let rotate = if neox {
                host::rotate_halves
            } else {
                crate::engine::cpu::math::rotate_pairs
            };
            let (a, cq) = (self.to_host(a)?, self.to_host(cq)?);
            let eng = tables.as_ref().unwrap_or(&self.host);
            eng.indexer_scores_with(layer, &a, &cq, rotate, !no_relu)?
        } else {
            self.to_host(&self.inner.indexer_scores(layer, a, cq)?)?
        };
        if let Some(f) = factor {
            let shape = out.shape.clone();
            let mut v = out.as_f32("indexer_scores")?.to_vec();
            attn::scale_finite(&mut v, f);
            out = HostTensor::f32(shape, v)?;
        }
        self.to_engine(&out)
    }

    /// `dsa_topk:K` keeps `K` keys (the layer is the one begun last, as for RoPE).
    fn top_k(&self, scores: &E::Tensor, k: usize) -> Result<E::Tensor> {
        let n = self.kinds_now().into_iter().find_map(|f| match f {
            FaultKind::DsaTopK(n) => Some(*n),
            _ => None,
        });
        let n = match n {
            None => return self.inner.top_k(scores, k),
            Some(n) if n >= k => return self.inner.top_k(scores, n),
            Some(n) => n,
        };
        // Fewer keys than the model's top-k: each row is padded with -1 to the hook's width
        // `min(index_topk, T)`, as the trace format keeps it (docs/hooks.md).
        let picked = self.to_host(&self.inner.top_k(scores, n)?)?;
        let (t, have) = picked.dims2("indexer_topk")?;
        let width = k.min(self.to_host(scores)?.shape.last().copied().unwrap_or(k));
        if have >= width {
            return self.to_engine(&picked);
        }
        let ids = picked.as_i32("indexer_topk")?;
        let mut out = Vec::with_capacity(t * width);
        for row in ids.chunks(have.max(1)).take(t) {
            out.extend_from_slice(row);
            out.extend(std::iter::repeat_n(-1, width - have));
        }
        self.to_engine(&HostTensor::i32(vec![t, width], out)?)
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, E::Tensor>,
        want_probs: bool,
    ) -> Result<(E::Tensor, Option<E::Tensor>)> {
        let l = Some(layer);
        let concat = self
            .find(l, |k| matches!(k, FaultKind::KvBConcat))
            .is_some();
        let split = self.find(l, |k| matches!(k, FaultKind::KvBSplit)).is_some();
        let shard = match self
            .find(l, |k| matches!(k, FaultKind::TpShard(_)))
            .map(|f| &f.kind)
        {
            Some(FaultKind::TpShard(n)) => Some(*n),
            _ => None,
        };
        let hp = self.weights.hparams();
        // kv_b's K and V halves under weight_scale (attn_k_b, attn_v_b; or the legacy attn_kv_b).
        let names = self.weights.kv_b_names(layer);
        let factor = |n: Option<&String>| {
            n.and_then(|n| attn::weight_factor(self.kinds_at(l), n))
                .unwrap_or(1.0)
        };
        let (fk, fv) = match names.as_slice() {
            [kv] => (factor(Some(kv)), factor(Some(kv))),
            _ => (factor(names.first()), factor(names.get(1))),
        };
        let scale = attn::softmax_scale(hp, self.kinds_at(l));
        if !concat
            && !split
            && shard.is_none()
            && (fk, fv) == (1.0, 1.0)
            && scale == rope::softmax_scale(hp)
        {
            return self.inner.mla_attention(layer, x, want_probs);
        }
        let mut kv_b = self.host.host_kv_b(layer)?;
        if (fk, fv) != (1.0, 1.0) {
            attn::scale_kv_b(&mut kv_b, hp.qk_nope, hp.v_head, fk, fv);
        }
        if concat {
            kv_b = host::kv_b_concat(&kv_b, hp.n_head, hp.qk_nope, hp.v_head);
        }
        if split {
            kv_b = attn::kv_b_split(&kv_b, hp.n_head, hp.qk_nope, hp.v_head);
        }
        if let Some(n) = shard {
            let from = host::shard_heads(hp.n_head, n);
            kv_b = host::map_row_blocks(&kv_b, hp.qk_nope + hp.v_head, &from)?;
        }
        let (q_b, q_pe, kv_norm, k_pe) = (
            self.to_host(x.q_b)?,
            self.to_host(x.q_pe)?,
            self.to_host(x.kv_norm)?,
            self.to_host(x.k_pe)?,
        );
        let sel = x.selection.map(|s| self.to_host(s)).transpose()?;
        let inp = MlaInputs {
            q_b: &q_b,
            q_pe: &q_pe,
            kv_norm: &kv_norm,
            k_pe: &k_pe,
            selection: sel.as_ref(),
        };
        let (heads, probs) = mla_host(hp, layer, inp, &kv_b, scale, want_probs)?;
        Ok((
            self.to_engine(&heads)?,
            probs.map(|p| self.to_engine(&p)).transpose()?,
        ))
    }

    fn moe_route(&self, layer: usize, logits: &E::Tensor) -> Result<Routing<E::Tensor>> {
        let hp = self.weights.hparams();
        let kinds = self
            .faults
            .iter()
            .filter(|f| f.at(Some(layer)))
            .map(|f| &f.kind);
        let Some(change) = RouteChange::of(hp, kinds)? else {
            return self.inner.moe_route(layer, logits);
        };
        let bias_name = names::blk(layer, blk::EXP_PROBS_B);
        let bias = if self.weights.has(&bias_name) {
            Some(self.host.host_vector(&bias_name)?)
        } else {
            None
        };
        let hl = self.to_host(logits)?;
        let (t, e) = hl.dims2("moe_logits")?;
        if e != hp.n_expert {
            bail!(
                "fault: layer {layer} router: {e} logits per token for {} experts",
                hp.n_expert
            );
        }
        let k = change.per_token();
        let (probs, ids, weights) = change.route(hl.as_f32("moe_logits")?, bias.as_deref());
        Ok(Routing {
            probs: self.to_engine(&HostTensor::f32(vec![t, e], probs)?)?,
            ids: self.to_engine(&HostTensor::i32(vec![t, k], ids)?)?,
            weights: self.to_engine(&HostTensor::f32(vec![t, k], weights)?)?,
        })
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, E::Tensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<E::Tensor>> {
        if !self.experts_fault(layer) {
            return self.inner.moe_experts(layer, x, want_expert);
        }
        let (hx, ids, w) = (
            self.to_host(x.x)?,
            self.to_host(x.ids)?,
            self.to_host(x.weights)?,
        );
        // Each selected expert's rows, made here (the experts are computed on the threads,
        // each taking its own).
        let n_expert = self.weights.hparams().n_expert;
        let mut rows: Vec<Option<[Rows<'_>; 3]>> = (0..n_expert).map(|_| None).collect();
        for &e in ids.as_i32("moe_topk_ids")? {
            if let Some(slot) = usize::try_from(e).ok().and_then(|e| rows.get_mut(e)) {
                if slot.is_none() {
                    *slot = Some(self.expert_rows(layer, e as usize)?);
                }
            }
        }
        let rows = Mutex::new(rows);
        let out = self
            .host
            .moe_experts_with(layer, &hx, &ids, &w, want_expert, &|e| {
                rows.lock()
                    .map_err(|_| anyhow::anyhow!("explain: the experts' rows lock is poisoned"))?
                    .get_mut(e)
                    .and_then(Option::take)
                    .ok_or_else(|| {
                        anyhow::anyhow!("explain: layer {layer}: expert {e}'s rows taken twice")
                    })
            })?;
        Ok(ExpertsOut {
            routed: self.to_engine(&out.routed)?,
            experts: out
                .experts
                .iter()
                .map(|(e, t)| Ok((*e, self.to_engine(t)?)))
                .collect::<Result<_>>()?,
        })
    }

    fn mlp(&self, x: &E::Tensor, gate: &str, up: &str, down: &str) -> Result<E::Tensor> {
        let (layer, _) = Self::split(gate);
        let f32acc = self
            .find(layer, |k| matches!(k, FaultKind::F32Accumulate))
            .is_some();
        let (gate, up) = (self.gate_up_name(gate), self.gate_up_name(up));
        if !f32acc && ![&gate, &up, down].iter().any(|w| self.touches_matrix(w)) {
            return self.inner.mlp(x, &gate, &up, down);
        }
        let g = self.linear_as(x, &gate)?;
        let u = self.linear_as(x, &up)?;
        let act = self.inner.swiglu(&g, &u)?;
        self.linear_as(&act, down)
    }

    fn swiglu(&self, a: &E::Tensor, b: &E::Tensor) -> Result<E::Tensor> {
        self.inner.swiglu(a, b)
    }

    fn add(&self, a: &E::Tensor, b: &E::Tensor) -> Result<E::Tensor> {
        self.inner.add(a, b)
    }

    fn zeros_like(&self, x: &E::Tensor) -> Result<E::Tensor> {
        self.inner.zeros_like(x)
    }
}
