//! The MoE block on the GPU: the router (sigmoid or softmax gating, group-limited top-k, the
//! selection bias), the routed experts (only the experts a step routes to are dequantized, the
//! tokens gathered per expert, the weighted sum accumulated in f64) and SwiGLU.

use anyhow::{bail, Context, Result};
use cudarc::driver::DevicePtr;

use super::tensor::{items, launch, GpuData};
use super::{CudaEngine, GpuTensor};
use crate::engine::{ExpertInputs, ExpertsOut, Routing};
use crate::model::names::{self, blk};
use crate::model::Gating;

impl CudaEngine<'_> {
    /// The `moe_route` step: router probabilities, expert ids and weights of `layer`.
    pub(super) fn moe_route_gpu(
        &self,
        layer: usize,
        logits: &GpuTensor,
    ) -> Result<Routing<GpuTensor>> {
        let hp = self.weights.hparams();
        let (t, e) = logits.dims2("moe_logits")?;
        if e != hp.n_expert {
            bail!(
                "engine: cuda: layer {layer} router: {e} logits per token for {} experts",
                hp.n_expert
            );
        }
        if e > 512 || hp.n_expert_used > 64 || hp.groups.is_some_and(|(g, _)| g > 64) {
            bail!("engine: cuda: layer {layer} router: {e} experts, {} used, groups {:?}: the router kernel takes at most 512 experts, 64 used and 64 groups", hp.n_expert_used, hp.groups);
        }
        let k = hp.n_expert_used;
        self.tokens.set(Some(t));
        let bias_name = names::blk(layer, blk::EXP_PROBS_B);
        let bias = if self.weights.has(&bias_name) {
            Some(self.vector(&bias_name)?)
        } else {
            None
        };
        let bias_ptr = match &bias {
            Some(b) => {
                let (p, _rec) = b.device_ptr(self.gpu.stream());
                p
            }
            None => 0,
        };
        let mut probs = self.zeros_f32(t * e, "router probabilities")?;
        let mut ids = self.gpu.alloc_zeroed::<i32>((t * k).max(1), "expert ids")?;
        let mut w = self.zeros_f32(t * k, "expert weights")?;
        let gating = match hp.gating {
            Gating::Sigmoid => 0u32,
            Gating::Softmax => 1u32,
        };
        let (n_group, used) = hp
            .groups
            .map_or((0u32, 0u32), |(g, u)| (g as u32, u as u32));
        let (tt, ee, kk, norm) = (
            t as u32,
            e as u32,
            k as u32,
            u32::from(hp.expert_weights_norm),
        );
        launch!(
            self,
            "moe_route_f32",
            items(self.gpu, t as u64),
            logits.f32("moe_logits")?,
            &bias_ptr,
            &mut probs,
            &mut ids,
            &mut w,
            &tt,
            &ee,
            &kk,
            &gating,
            &n_group,
            &used,
            &norm,
            &hp.expert_weights_scale
        );
        // At short prompts the routed experts' rows go up by expert: their uploads start here,
        // behind whatever runs between the router and the expert step (the expert step starts
        // those still missing, e.g. of another routing).
        if self.routed_uploads() {
            let s = self.gpu.stream();
            let picked = s
                .clone_dtoh(&ids)
                .context("engine: cuda: reading expert ids")?;
            let mut experts: Vec<usize> = picked
                .iter()
                .filter_map(|&e| usize::try_from(e).ok().filter(|&e| e < hp.n_expert))
                .collect();
            experts.sort_unstable();
            experts.dedup();
            let names = self.stacked_expert_names(layer);
            let stacked: Vec<&str> = names.iter().map(String::as_str).collect();
            self.upload_routed(layer, &stacked, &experts)?;
        }
        Ok(Routing {
            probs: self.tensor_f32(vec![t, e], probs),
            ids: GpuTensor {
                shape: vec![t, k],
                slot: self.slot,
                data: GpuData::I32(ids),
            },
            weights: self.tensor_f32(vec![t, k], w),
        })
    }

    /// The `moe_experts` step: the routed experts' weighted sum, and the outputs of the experts
    /// `want_expert` asks for.
    pub(super) fn moe_experts_gpu(
        &self,
        layer: usize,
        x: ExpertInputs<'_, GpuTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<GpuTensor>> {
        let hp = self.weights.hparams();
        let (t, hidden) = x.x.dims2("moe input")?;
        let (ti, k) = x.ids.dims2("moe_topk_ids")?;
        if ti != t || x.weights.shape != x.ids.shape {
            bail!(
                "engine: cuda: layer {layer} experts: input {:?}, ids {:?}, weights {:?} disagree",
                x.x.shape,
                x.ids.shape,
                x.weights.shape
            );
        }
        // The routing table is small ([T, K]): it comes to the host to group tokens by expert.
        let s = self.gpu.stream();
        let ids = s
            .clone_dtoh(x.ids.i32("ids")?)
            .context("engine: cuda: reading expert ids")?;
        let ws = s
            .clone_dtoh(x.weights.f32("weights")?)
            .context("engine: cuda: reading expert weights")?;
        let mut routed: Vec<Vec<(i32, f32)>> = vec![Vec::new(); hp.n_expert];
        for tok in 0..t {
            for j in 0..k {
                let e = ids[tok * k + j];
                if e < 0 || e as usize >= hp.n_expert {
                    bail!(
                        "engine: cuda: layer {layer}: token {tok} selects expert {e} of {}",
                        hp.n_expert
                    );
                }
                routed[e as usize].push((tok as i32, ws[tok * k + j]));
            }
        }
        let ff = hp.n_ff_exp;
        // At short prompts only the routed experts' rows are put on the device (`routed`); the
        // router started their uploads, this starts those of experts it did not pick.
        self.tokens.set(Some(t));
        let names = self.stacked_expert_names(layer);
        let stacked: Vec<&str> = names.iter().map(String::as_str).collect();
        // The fused `ffn_gate_up_exps` and `ffn_down_exps`, or gate, up and down.
        let (gate_up, down_name) = match stacked.as_slice() {
            [fused, down] => (GateUp::Fused(fused), *down),
            [gate, up, down] => (GateUp::Split(gate, up), *down),
            _ => bail!("engine: cuda: layer {layer} experts: stacked tensors {stacked:?}"),
        };
        let experts: Vec<usize> = (0..hp.n_expert)
            .filter(|&e| !routed[e].is_empty())
            .collect();
        self.upload_routed(layer, &stacked, &experts)?;
        let mut acc = self
            .gpu
            .alloc_zeroed::<f64>((t * hidden).max(1), "expert sum")?;
        let mut extra = Vec::new();
        let xs = x.x.f32("moe input")?;
        let hid = hidden as u32;
        for (e, toks) in routed.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let tok_ids: Vec<i32> = toks.iter().map(|p| p.0).collect();
            let tok_w: Vec<f32> = toks.iter().map(|p| p.1).collect();
            let tok_d = self.gpu.alloc_copy(&tok_ids, "expert tokens")?;
            let w_d = self.gpu.alloc_copy(&tok_w, "expert token weights")?;
            let mut xe = self.zeros_f32(n * hidden, "expert input")?;
            let nn = n as u32;
            launch!(
                self,
                "gather_rows_f32",
                items(self.gpu, (n * hidden) as u64),
                xs,
                &tok_d,
                &mut xe,
                &nn,
                &hid
            );
            let (g, u) = match gate_up {
                GateUp::Fused(fused) => {
                    let base = e * 2 * ff;
                    (
                        self.project(&xe, n, fused, base..base + ff)?,
                        self.project(&xe, n, fused, base + ff..base + 2 * ff)?,
                    )
                }
                GateUp::Split(gate, up) => (
                    self.project(&xe, n, gate, e * ff..(e + 1) * ff)?,
                    self.project(&xe, n, up, e * ff..(e + 1) * ff)?,
                ),
            };
            let mut act = self.zeros_f32(n * ff, "expert activation")?;
            let nf = (n * ff) as u64;
            launch!(
                self,
                "swiglu_f32",
                items(self.gpu, nf),
                &g,
                &u,
                &mut act,
                &nf
            );
            let act = self.finish(act)?;
            let y = self.project(&act, n, down_name, e * hidden..(e + 1) * hidden)?;
            launch!(
                self,
                "scatter_add_f64",
                items(self.gpu, (n * hidden) as u64),
                &mut acc,
                &y,
                &tok_d,
                &w_d,
                &nn,
                &hid
            );
            if want_expert(e) {
                extra.push((e, self.tensor_f32(vec![n, hidden], y)));
            }
        }
        let mut out = self.zeros_f32(t * hidden, "moe_routed")?;
        let total = (t * hidden) as u64;
        launch!(
            self,
            "f64_to_f32",
            items(self.gpu, total),
            &acc,
            &mut out,
            &total
        );
        Ok(ExpertsOut {
            routed: self.tensor_f32(vec![t, hidden], self.finish(out)?),
            experts: extra,
        })
    }

    /// The `swiglu` step: `silu(a) * b`.
    pub(super) fn swiglu_gpu(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        if a.shape != b.shape {
            bail!(
                "engine: cuda: swiglu: shapes {:?} and {:?} differ",
                a.shape,
                b.shape
            );
        }
        let n: usize = a.shape.iter().product();
        let mut y = self.zeros_f32(n, "swiglu output")?;
        let nn = n as u64;
        launch!(
            self,
            "swiglu_f32",
            items(self.gpu, nn),
            a.f32("swiglu a")?,
            b.f32("swiglu b")?,
            &mut y,
            &nn
        );
        Ok(self.tensor_f32(a.shape.clone(), self.finish(y)?))
    }
}

/// The stacked gate and up tensors of an expert step: fused (`ffn_gate_up_exps`, each expert's
/// gate rows then its up rows) or apart.
#[derive(Clone, Copy)]
enum GateUp<'a> {
    Fused(&'a str),
    Split(&'a str, &'a str),
}
