//! The CPU reference engine: the living definition of every step.
//!
//! Clarity first: f32 storage, f64 accumulation in a fixed order ([`math`] documents the
//! scheme), naive (non-absorbed) MLA. Speed comes from doing only the work needed: the weight
//! descriptions of [`Weights`] are dequantized on demand ([`weights`]: embedding rows of the
//! prompt, only the selected experts' slices; matrices a few rows at a time, used while in cache,
//! so that `output.weight` of a 154880-token vocabulary never sits in memory as f32), and
//! independent outputs run in parallel with rayon. Results are bit-identical for any thread count.
//!
//! The engine keeps nothing between steps, so the layer hooks of [`Engine`] are no-ops here.
//! It measures nothing: `glmdiff bench layer` counts its work from the outside
//! (`bench::layer::Counted`, a decorator over the [`Engine`] trait).

mod attention;
pub mod device;
pub mod math;
mod moe;
pub mod weights;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

use super::{
    AttentionOut, Engine, ExpertInputs, ExpertsOut, HostTensor, JointExperts, MlaInputs, Routing,
};
use crate::model::names::{self, blk};
use crate::model::{rope, RopeSlice, Weights};
use crate::precision::Precision;

pub use attention::{causal_top_k, index_scores_on, mla_host, mla_host_kv, Rotate};
pub use math::Rows;
use moe::ExpertGroup;
pub use moe::{route_token, selected_weights};
pub use weights::{assemble_kv_b, Matrix, RowSource};

/// The CPU reference engine over one model's weights.
pub struct CpuEngine<'w> {
    weights: &'w Weights<'w>,
    /// RoPE inverse frequencies `[rope/2]`.
    inv_freq: Vec<f64>,
    /// cos/sin factor (YaRN attention factor; 1 without scaling).
    attn_factor: f64,
    /// The last layer's assembled kv_b ([`CpuEngine::kv_b`]): a layer's attention, its
    /// recomputations and the directions read it several times.
    kv_b: Mutex<Option<(usize, Arc<Matrix>)>>,
    /// The last attention's keys and values before the heads' split ([`CpuEngine::kv_product`]),
    /// with the layer and `kv_a_norm` they came from: a step's recomputation and the directions'
    /// two attentions read the same product.
    kv: Mutex<Option<KeptKv>>,
    /// The device that makes the large products, the same bits ([`device`]), if any.
    device: Option<Arc<device::Device>>,
}

/// One kept `kv = kv_a_norm kv_b^T` ([`CpuEngine::kv_product`]).
pub(super) struct KeptKv {
    pub(super) layer: usize,
    /// The `kv_a_norm` it was computed from (compared bit for bit).
    pub(super) kv_norm: HostTensor,
    /// `[T, H*(nope+v)]`.
    pub(super) kv: Arc<Vec<f32>>,
}

impl<'w> CpuEngine<'w> {
    /// An engine reading `weights`.
    pub fn new(weights: &'w Weights<'w>) -> CpuEngine<'w> {
        let hp = weights.hparams();
        CpuEngine {
            weights,
            inv_freq: rope::inv_freq(&hp.rope),
            attn_factor: rope::attention_factor(&hp.rope),
            kv_b: Mutex::new(None),
            kv: Mutex::new(None),
            device: None,
        }
    }

    /// This engine with its products of [`device::MIN_TOKENS`] tokens or more made on
    /// `device` (the same bits, each product checked: [`device`]).
    pub fn with_device(mut self, device: Arc<device::Device>) -> CpuEngine<'w> {
        self.device = Some(device);
        self
    }

    /// The device that makes its large products, if any.
    pub fn device(&self) -> Option<&device::Device> {
        self.device.as_deref()
    }

    /// The device that makes its large products, shared (for another engine of the same run).
    pub fn shared_device(&self) -> Option<Arc<device::Device>> {
        self.device.clone()
    }

    /// An engine reading `weights` whose RoPE uses `inv_freq` (one per rotated pair) and the
    /// cos/sin factor `attn_factor` instead of the model's: what an engine with another RoPE
    /// base or YaRN magnitude computes (the known bugs of `explain::fault`). With the tables
    /// of [`CpuEngine::new`] it is the reference.
    pub fn with_rope(
        weights: &'w Weights<'w>,
        inv_freq: Vec<f64>,
        attn_factor: f64,
    ) -> CpuEngine<'w> {
        CpuEngine {
            weights,
            inv_freq,
            attn_factor,
            kv_b: Mutex::new(None),
            kv: Mutex::new(None),
            device: None,
        }
    }

    /// RoPE of slice `s` of `x` with `rotate` applied to each head's rotated values in place
    /// of the interleaved pairs [`math::rotate_pairs`] (what an engine with another RoPE layout
    /// computes); [`Engine::rope`] passes [`math::rotate_pairs`].
    pub fn rope_with(&self, x: &HostTensor, s: &RopeSlice, rotate: Rotate) -> Result<HostTensor> {
        let (t, n) = x.dims2("rope input")?;
        let rd = self.inv_freq.len() * 2;
        if n != s.heads * s.stride || s.offset + rd > s.stride {
            bail!(
                "engine: cpu: rope: input [{t}, {n}] does not hold {} heads of {} with {rd} rotated values at {}",
                s.heads,
                s.stride,
                s.offset
            );
        }
        let xv = x.as_f32("rope input")?;
        let mut out = Vec::with_capacity(t * s.heads * rd);
        for pos in 0..t {
            let cs = self.cos_sin(pos);
            for h in 0..s.heads {
                let start = pos * n + h * s.stride + s.offset;
                let mut pair = xv[start..start + rd].to_vec();
                rotate(&mut pair, &cs);
                out.extend(pair);
            }
        }
        let shape = if s.keep_head_axis {
            vec![t, s.heads, rd]
        } else {
            vec![t, s.heads * rd]
        };
        HostTensor::f32(shape, out)
    }

    /// The weights the engine reads.
    pub fn weights(&self) -> &'w Weights<'w> {
        self.weights
    }

    /// `(cos, sin)` of every rotated pair at position `pos`, times the attention factor.
    pub fn cos_sin(&self, pos: usize) -> Vec<(f64, f64)> {
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = pos as f64 * f;
                (a.cos() * self.attn_factor, a.sin() * self.attn_factor)
            })
            .collect()
    }

    /// `x · W^T` for the GGUF matrix `name`, dequantized on the fly. Returns `[T, out]` values.
    fn linear_host(&self, x: &HostTensor, name: &str) -> Result<Vec<f32>> {
        let (t, k) = x.dims2(name)?;
        let src = RowSource::new(self.weights.matrix_desc(name)?);
        if src.cols != k {
            bail!(
                "engine: cpu: linear {name}: input has {k} columns, the weight [{}, {}] expects {}",
                src.rows,
                src.cols,
                src.cols
            );
        }
        device::matmul_rows(self.device(), x.as_f32(name)?, t, &src)
    }

    /// `x · W^T` for the weight rows `rows` (`[t, rows.cols()]` -> `[t, rows]`): [`math`]'s
    /// products, the large ones on the engine's device.
    pub fn rows_matmul(&self, rows: &Rows<'_>, x: &[f32], t: usize) -> Result<Vec<f32>> {
        match rows {
            Rows::Source(src) => device::matmul_rows(self.device(), x, t, src),
            Rows::Dense(m) => device::matmul_dense(self.device(), x, t, m, "a host matrix"),
        }
    }
}

/// RMSNorm of the columns `cols` (all when `None`) of `x` with the weight values `w` (of the
/// tensor named `weight`, for errors): what [`Engine::rms_norm`] computes with the tensor's own
/// values. `[T, cols]`.
pub fn rms_norm_with(
    x: &HostTensor,
    weight: &str,
    w: &[f32],
    eps: f64,
    cols: Option<Range<usize>>,
) -> Result<HostTensor> {
    let (t, n) = x.dims2(weight)?;
    let cols = cols.unwrap_or(0..n);
    if cols.end > n || cols.is_empty() {
        bail!("engine: cpu: rms_norm {weight}: columns {cols:?} of a [{t}, {n}] input");
    }
    if w.len() != cols.len() {
        bail!(
            "engine: cpu: rms_norm {weight}: weight has {} values for {} columns",
            w.len(),
            cols.len()
        );
    }
    let xv = x.as_f32(weight)?;
    let sub: Vec<f32> = if cols.len() == n {
        xv.to_vec()
    } else {
        xv.chunks_exact(n)
            .flat_map(|r| r[cols.clone()].iter().copied())
            .collect()
    };
    HostTensor::f32(
        vec![t, cols.len()],
        math::rms_norm(&sub, cols.len(), w, eps),
    )
}

fn same_shape(a: &HostTensor, b: &HostTensor, what: &str) -> Result<()> {
    if a.shape != b.shape {
        bail!(
            "engine: cpu: {what}: shapes {:?} and {:?} differ",
            a.shape,
            b.shape
        );
    }
    Ok(())
}

impl Engine for CpuEngine<'_> {
    type Tensor = HostTensor;

    fn describe(&self) -> String {
        "cpu".to_string()
    }

    fn precision(&self) -> Precision {
        Precision::REFERENCE
    }

    fn upload(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn download(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn embed(&self, ids: &[u32]) -> Result<HostTensor> {
        let m = self.host_embedding(ids)?;
        HostTensor::f32(vec![m.rows, m.cols], m.data)
    }

    fn rms_norm(
        &self,
        x: &HostTensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<HostTensor> {
        rms_norm_with(x, weight, &self.host_vector(weight)?, eps, cols)
    }

    fn linear(&self, x: &HostTensor, weight: &str) -> Result<HostTensor> {
        let (t, _) = x.dims2(weight)?;
        let out = self
            .linear_host(x, weight)
            .with_context(|| format!("engine: cpu: linear {weight}"))?;
        let rows = out.len() / t.max(1);
        HostTensor::f32(vec![t, rows], out)
    }

    /// Like any projection: f32 values and f64 sums already keep the trait's f32 rule.
    fn router_logits(&self, layer: usize, x: &HostTensor) -> Result<HostTensor> {
        self.linear(x, &names::blk(layer, blk::FFN_GATE_INP))
    }

    fn rope(&self, x: &HostTensor, s: &RopeSlice) -> Result<HostTensor> {
        self.rope_with(x, s, math::rotate_pairs)
    }

    fn indexer_scores(&self, layer: usize, a: &HostTensor, cq: &HostTensor) -> Result<HostTensor> {
        self.indexer_scores_cpu(layer, a, cq)
    }

    fn top_k(&self, scores: &HostTensor, k: usize) -> Result<HostTensor> {
        self.top_k_cpu(scores, k)
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        want_probs: bool,
    ) -> Result<(HostTensor, Option<HostTensor>)> {
        self.mla_cpu(layer, x, want_probs)
    }

    /// Every product is [`math::dot`]'s bits whatever the rows beside it (`math::gemm`), and
    /// norms, routing and elementwise steps work row by row.
    fn rows_independent(&self) -> bool {
        true
    }

    fn mla_attention_rows(
        &self,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        rows: &[usize],
        want_probs: bool,
    ) -> Result<Option<AttentionOut<HostTensor>>> {
        self.mla_cpu_rows(layer, x, Some(rows), want_probs)
            .map(Some)
    }

    fn moe_route(&self, layer: usize, logits: &HostTensor) -> Result<Routing<HostTensor>> {
        self.moe_route_cpu(layer, logits)
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, HostTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<HostTensor>> {
        self.moe_experts_cpu(layer, x.x, x.ids, x.weights, want_expert)
    }

    fn moe_experts_rows(
        &self,
        layer: usize,
        x: ExpertInputs<'_, HostTensor>,
        rows: &[usize],
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<Option<ExpertsOut<HostTensor>>> {
        self.moe_experts_tokens(
            layer,
            x.x,
            x.ids,
            x.weights,
            Some(rows),
            want_expert,
            &|e| self.expert_rows(layer, e),
        )
        .map(Some)
    }

    fn moe_experts_joint(
        &self,
        layer: usize,
        x: ExpertInputs<'_, HostTensor>,
        more: &[(ExpertInputs<'_, HostTensor>, &[usize])],
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<JointExperts<HostTensor>> {
        let mut groups = vec![ExpertGroup {
            x: x.x,
            ids: x.ids,
            weights: x.weights,
            rows: None,
        }];
        groups.extend(more.iter().map(|(m, rows)| ExpertGroup {
            x: m.x,
            ids: m.ids,
            weights: m.weights,
            rows: Some(*rows),
        }));
        let mut out = self
            .moe_experts_groups(layer, &groups, want_expert, &|e| self.expert_rows(layer, e))?
            .into_iter();
        let own = out
            .next()
            .ok_or_else(|| anyhow::anyhow!("engine: cpu: layer {layer} experts: no output"))?;
        Ok(JointExperts {
            own,
            more: out.map(Some).collect(),
        })
    }

    fn mlp(&self, x: &HostTensor, gate: &str, up: &str, down: &str) -> Result<HostTensor> {
        let g = self.linear(x, gate)?;
        let u = self.linear(x, up)?;
        let act = self.swiglu(&g, &u)?;
        self.linear(&act, down)
    }

    fn swiglu(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        same_shape(a, b, "swiglu")?;
        let out = math::swiglu(a.as_f32("swiglu a")?, b.as_f32("swiglu b")?);
        HostTensor::f32(a.shape.clone(), out)
    }

    fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        same_shape(a, b, "add")?;
        let out = a
            .as_f32("add a")?
            .iter()
            .zip(b.as_f32("add b")?)
            .map(|(&x, &y)| (f64::from(x) + f64::from(y)) as f32)
            .collect();
        HostTensor::f32(a.shape.clone(), out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::driver::{run, Plan};
    use crate::model::testutil::{tiny_hparams, tiny_model};
    use crate::model::Arch;
    use crate::trace::{HookFilter, TraceSink};

    const TOKENS: [u32; 7] = [3, 1, 4, 1, 5, 9, 2];

    /// Every hook of a run of the tiny GLM-5 model, optional ones included.
    fn hooks(w: &Weights<'_>) -> BTreeMap<String, HostTensor> {
        let mut sink = TraceSink::new(HookFilter {
            layers: None,
            globs: vec!["*".into()],
        });
        run(
            &CpuEngine::new(w),
            w,
            &TOKENS,
            &Plan::full(w).unwrap(),
            &mut sink,
        )
        .unwrap();
        sink.into_tensors()
    }

    /// Rows `rows` of `t` (first axis), or of its second axis when `heads` (`[H, T, T]`).
    fn rows_of(t: &HostTensor, rows: &[usize], heads: bool) -> Vec<f32> {
        let v = t.as_f32("").unwrap();
        if heads {
            let (h, n, m) = (t.shape[0], t.shape[1], t.shape[2]);
            (0..h)
                .flat_map(|hd| rows.iter().map(move |&r| (hd * n + r) * m))
                .flat_map(|s| v[s..s + m].iter().copied())
                .collect()
        } else {
            let w = t.len() / t.shape[0];
            rows.iter()
                .flat_map(|&r| v[r * w..(r + 1) * w].iter().copied())
                .collect()
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Attention and the routed experts computed for some rows give exactly those rows of the
    /// whole step: the heads, the probabilities, the routed sum and each expert's outputs for
    /// the tokens among the rows.
    #[test]
    fn some_rows_are_those_rows_of_the_whole_step() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let e = CpuEngine::new(&w);
        let h = hooks(&w);
        let rows = [1usize, 4, 6];
        let x = |l: usize| MlaInputs {
            q_b: &h[&format!("blk.{l}.q_b")],
            q_pe: &h[&format!("blk.{l}.q_pe_rope")],
            kv_norm: &h[&format!("blk.{l}.kv_a_norm")],
            k_pe: &h[&format!("blk.{l}.k_pe_rope")],
            selection: h.get(&format!("blk.{l}.indexer_topk")),
        };
        for l in 0..hp.n_layer {
            let (heads, probs) = e.mla_attention(l, x(l), true).unwrap();
            let (part, part_probs) = e.mla_attention_rows(l, x(l), &rows, true).unwrap().unwrap();
            assert_eq!(part.shape, vec![rows.len(), heads.shape[1]]);
            assert_eq!(
                bits(part.as_f32("").unwrap()),
                bits(&rows_of(&heads, &rows, false))
            );
            let (probs, part_probs) = (probs.unwrap(), part_probs.unwrap());
            assert_eq!(part_probs.shape, vec![hp.n_head, rows.len(), TOKENS.len()]);
            assert_eq!(
                bits(part_probs.as_f32("").unwrap()),
                bits(&rows_of(&probs, &rows, true))
            );
        }
        let l = 1;
        let ids = &h["blk.1.moe_topk_ids"];
        let inputs = || ExpertInputs {
            x: &h["blk.1.ffn_norm"],
            ids,
            weights: &h["blk.1.moe_weights"],
        };
        let whole = e.moe_experts(l, inputs(), &|_| true).unwrap();
        let part = e
            .moe_experts_rows(l, inputs(), &rows, &|_| true)
            .unwrap()
            .unwrap();
        assert_eq!(
            bits(part.routed.as_f32("").unwrap()),
            bits(&rows_of(&whole.routed, &rows, false))
        );
        let k = hp.n_expert_used;
        let idv = ids.as_i32("").unwrap();
        let mut seen = 0;
        for (ex, out) in &whole.experts {
            // The positions of the rows' tokens among the expert's tokens.
            let toks: Vec<usize> = (0..TOKENS.len())
                .filter(|t| idv[t * k..(t + 1) * k].contains(&(*ex as i32)))
                .collect();
            let at: Vec<usize> = (0..toks.len())
                .filter(|&i| rows.contains(&toks[i]))
                .collect();
            match part.experts.iter().find(|(pe, _)| pe == ex) {
                Some((_, p)) => {
                    assert_eq!(bits(p.as_f32("").unwrap()), bits(&rows_of(out, &at, false)));
                    seen += 1;
                }
                None => assert!(at.is_empty(), "expert {ex}"),
            }
        }
        assert_eq!(seen, part.experts.len());
        assert!(seen > 0);
    }

    /// The routed experts of several inputs in one pass give each what its own call gives,
    /// bit for bit: the whole step from the first, and the rows of the others (other inputs,
    /// other experts selected in some rows, every row).
    #[test]
    fn experts_in_one_pass_are_each_calls_bit_for_bit() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let e = CpuEngine::new(&w);
        let h = hooks(&w);
        let l = 1;
        let (x, ids, weights) = (
            &h["blk.1.ffn_norm"],
            &h["blk.1.moe_topk_ids"],
            &h["blk.1.moe_weights"],
        );
        let (t, k) = ids.dims2("").unwrap();
        // Another chain: other values in rows 2 and 5, another expert in row 5.
        let mut x2 = x.clone();
        for v in &mut x2.as_f32_mut("").unwrap()[2 * hp.hidden..3 * hp.hidden] {
            *v *= 1.5;
        }
        let mut ids2 = ids.clone();
        {
            let v = ids2.as_i32_mut("").unwrap();
            let unused = (0..hp.n_expert as i32)
                .find(|c| !v[5 * k..6 * k].contains(c))
                .unwrap();
            v[5 * k] = unused;
        }
        let all: Vec<usize> = (0..t).collect();
        let want = |ex: usize| ex % 2 == 0;
        let of = |x, ids| ExpertInputs { x, ids, weights };
        let more = [(of(&x2, &ids2), &[2usize, 5][..]), (of(x, ids), &all[..])];
        let joint = e.moe_experts_joint(l, of(x, ids), &more, &want).unwrap();
        let same = |a: &ExpertsOut<HostTensor>, b: &ExpertsOut<HostTensor>| {
            assert!(a.routed.same_bits(&b.routed));
            assert_eq!(a.experts.len(), b.experts.len());
            for ((ea, ta), (eb, tb)) in a.experts.iter().zip(&b.experts) {
                assert_eq!(ea, eb);
                assert!(ta.same_bits(tb), "expert {ea}");
            }
        };
        same(&joint.own, &e.moe_experts(l, of(x, ids), &want).unwrap());
        assert_eq!(joint.more.len(), 2);
        for (got, (inputs, rows)) in joint.more.iter().zip(&more) {
            let alone = ExpertInputs {
                x: inputs.x,
                ids: inputs.ids,
                weights: inputs.weights,
            };
            let alone = e.moe_experts_rows(l, alone, rows, &want).unwrap().unwrap();
            same(got.as_ref().unwrap(), &alone);
        }
        assert!(!joint.own.experts.is_empty());
    }

    /// Rows outside the step or out of order are an error naming the step, never a panic.
    #[test]
    fn rows_outside_the_step_or_out_of_order_are_errors() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let e = CpuEngine::new(&w);
        let h = hooks(&w);
        let x = || MlaInputs {
            q_b: &h["blk.1.q_b"],
            q_pe: &h["blk.1.q_pe_rope"],
            kv_norm: &h["blk.1.kv_a_norm"],
            k_pe: &h["blk.1.k_pe_rope"],
            selection: h.get("blk.1.indexer_topk"),
        };
        let inputs = || ExpertInputs {
            x: &h["blk.1.ffn_norm"],
            ids: &h["blk.1.moe_topk_ids"],
            weights: &h["blk.1.moe_weights"],
        };
        for (rows, why) in [
            (&[2usize, 7][..], "row 7 of 7"),
            (&[3, 1][..], "rows 3 then 1: not ascending and distinct"),
            (&[2, 2][..], "rows 2 then 2: not ascending and distinct"),
        ] {
            let err = e.mla_attention_rows(1, x(), rows, false).unwrap_err();
            assert_eq!(
                format!("{err:#}"),
                format!("engine: cpu: layer 1 attention: query {why}")
            );
            let err = e.moe_experts_rows(1, inputs(), rows, &|_| false).err();
            assert_eq!(
                format!("{:#}", err.unwrap()),
                format!("engine: cpu: layer 1 experts: token {why}")
            );
        }
    }
}
