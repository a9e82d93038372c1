//! The routing and MoE faults: where they apply ([`check`]), the router as they change it
//! ([`RouteChange`]: the reference's `route_token` over changed hyperparameters, never a copy of
//! its arithmetic) and an expert's down projection under a wrong scale ([`scaled`]).

use anyhow::{bail, Context, Result};

use super::{FaultKind, MlpPart};
use crate::engine::cpu::{route_token, Matrix, Rows};
use crate::model::names::{self, blk};
use crate::model::{Gating, HParams, Weights};

/// Checks a routing or MoE fault (`me`, as the user wrote it) against the model over `layers`
/// (the run's layers the fault touches): clear errors where it cannot apply or changes nothing.
pub(super) fn check(
    kind: &FaultKind,
    me: &str,
    weights: &Weights<'_>,
    layers: &[usize],
) -> Result<()> {
    let hp = weights.hparams();
    let moe = super::moe_layers(weights, layers);
    let need_moe = || super::need_moe(me, weights, layers);
    match kind {
        FaultKind::RoutedScale(r) => {
            need_moe()?;
            let s = hp.expert_weights_scale;
            let x = r.factor(s);
            if (x - s).abs() <= 1e-9 * s.abs().max(1.0) {
                bail!(
                    "--inject {me}: scales the routed experts' weights by {x}, the model's own expert_weights_scale: nothing changes"
                );
            }
        }
        FaultKind::TopkNorm(on) => {
            need_moe()?;
            if *on == hp.expert_weights_norm {
                bail!(
                    "--inject {me}: the model {} the top-k weights already (expert_weights_norm = {on}); the opposite is topk_norm:{}",
                    if *on { "normalises" } else { "does not normalise" },
                    if *on { "off" } else { "on" }
                );
            }
        }
        FaultKind::BiasUnused => {
            need_moe()?;
            if !moe
                .iter()
                .any(|&l| weights.has(&names::blk(l, blk::EXP_PROBS_B)))
            {
                bail!("--inject {me}: no layer among {moe:?} has a selection bias exp_probs_b");
            }
        }
        FaultKind::GroupLimit(g) => {
            need_moe()?;
            let Some(groups) = g.resolve(hp.groups) else {
                bail!(
                    "--inject {me}: the model has no expert groups, so no kept count to reuse: give it, group_limit:N,K"
                );
            };
            check_groups(hp, me, groups)?;
        }
        FaultKind::ExpertScale { expert, .. } => {
            need_moe()?;
            if *expert >= hp.n_expert {
                bail!(
                    "--inject {me}: expert {expert} is not one of the model's {} experts",
                    hp.n_expert
                );
            }
        }
        FaultKind::ExpertsPerToken(k) => {
            need_moe()?;
            if *k == hp.n_expert_used {
                bail!(
                    "--inject {me}: routes {k} experts per token, the model's own expert_used_count: nothing changes"
                );
            }
            if *k > hp.n_expert {
                bail!(
                    "--inject {me}: routes {k} experts per token, but the model has {} experts",
                    hp.n_expert
                );
            }
            if let Some((n, kept)) = hp.groups {
                let reach = kept * (hp.n_expert / n.max(1));
                if *k > reach {
                    bail!(
                        "--inject {me}: routes {k} experts per token, but the model's group limit ({kept} of {n} groups) reaches {reach} experts"
                    );
                }
            }
        }
        FaultKind::GateUpSwapMlp(MlpPart::Dense) if !layers.iter().any(|&l| hp.is_dense(l)) => {
            bail!(
                "--inject {me}: no dense layer among {layers:?} (the dense layers are 0..{})",
                hp.n_dense
            );
        }
        FaultKind::GateUpSwapMlp(MlpPart::Shared)
            if !moe
                .iter()
                .any(|&l| weights.has(&names::blk(l, blk::FFN_GATE_SHEXP))) =>
        {
            bail!("--inject {me}: no layer among {layers:?} has a shared expert (ffn_gate_shexp)");
        }
        _ => {}
    }
    Ok(())
}

/// Checks the grouping a `group_limit` fault routes with (`None`: no limit).
fn check_groups(hp: &HParams, me: &str, groups: Option<(usize, usize)>) -> Result<()> {
    let Some((n, k)) = groups else {
        if hp.groups.is_none() {
            bail!(
                "--inject {me}: the model has no group-limited routing (expert_group_count is not above 1): nothing to ignore"
            );
        }
        return Ok(());
    };
    let off = if hp.groups.is_some() {
        " (group_limit:off)"
    } else {
        ", the model's"
    };
    if n == 0 || hp.n_expert % n != 0 {
        bail!(
            "--inject {me}: {n} groups do not divide the model's {} experts",
            hp.n_expert
        );
    }
    let size = hp.n_expert / n;
    if k >= n {
        bail!("--inject {me}: keeps {k} of {n} groups, every group: the selection without a group limit{off}");
    }
    if k * size < hp.n_expert_used {
        bail!(
            "--inject {me}: {k} kept groups of {size} experts hold fewer than the {} experts a token selects",
            hp.n_expert_used
        );
    }
    if size == 1 && k >= hp.n_expert_used {
        bail!(
            "--inject {me}: keeps {k} groups of one expert, at least the {} a token selects: the selection without a group limit{off}",
            hp.n_expert_used
        );
    }
    if hp.groups == Some((n, k)) {
        bail!("--inject {me}: {n} groups keeping {k} is the model's own routing");
    }
    Ok(())
}

/// How the routing faults at one layer change its router: the hyperparameters
/// [`route_token`] reads, whether the selection bias chooses, whether it enters the weights.
pub(super) struct RouteChange {
    hp: HParams,
    select_bias: bool,
    bias_in_weights: bool,
}

impl RouteChange {
    /// The change `kinds` make to a router of a model with `hp`; `None` when no kind concerns
    /// the router.
    pub(super) fn of<'k>(
        hp: &HParams,
        kinds: impl IntoIterator<Item = &'k FaultKind>,
    ) -> Result<Option<RouteChange>> {
        let mut c = RouteChange {
            hp: hp.clone(),
            select_bias: true,
            bias_in_weights: false,
        };
        let mut any = false;
        for k in kinds {
            match k {
                FaultKind::SoftmaxGating => c.hp.gating = Gating::Softmax,
                FaultKind::BiasInWeights => c.bias_in_weights = true,
                FaultKind::RoutedScale(r) => {
                    c.hp.expert_weights_scale = r.factor(hp.expert_weights_scale)
                }
                FaultKind::TopkNorm(on) => c.hp.expert_weights_norm = *on,
                FaultKind::BiasUnused => c.select_bias = false,
                FaultKind::ExpertsPerToken(k) => c.hp.n_expert_used = *k,
                FaultKind::GroupLimit(g) => {
                    c.hp.groups = g.resolve(hp.groups).with_context(|| {
                        format!(
                            "fault {k}: the model has no expert groups to take the kept count from"
                        )
                    })?
                }
                _ => continue,
            }
            any = true;
        }
        Ok(any.then_some(c))
    }

    /// The experts each token is routed to under the change.
    pub(super) fn per_token(&self) -> usize {
        self.hp.n_expert_used
    }

    /// Routes every token of `logits` (`[T, n_expert]` values) with selection bias `bias`:
    /// probabilities `[T, n_expert]`, selected ids and their weights `[T, K]`.
    pub(super) fn route(
        &self,
        logits: &[f32],
        bias: Option<&[f32]>,
    ) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
        let hp = &self.hp;
        let (e, k) = (hp.n_expert, hp.n_expert_used);
        let t = logits.len() / e.max(1);
        let (mut probs, mut ids, mut weights) = (
            Vec::with_capacity(t * e),
            Vec::with_capacity(t * k),
            Vec::with_capacity(t * k),
        );
        let select = if self.select_bias { bias } else { None };
        for row in logits.chunks_exact(e) {
            let (p, i, mut w) = route_token(hp, row, select);
            if self.bias_in_weights {
                if let Some(b) = bias {
                    // The bias enters the weights: (p + b)[idx], then the same normalisation
                    // and scale.
                    w = i.iter().map(|&x| p[x] + f64::from(b[x])).collect();
                    if hp.expert_weights_norm {
                        let sum: f64 = w.iter().sum();
                        w.iter_mut().for_each(|x| *x /= sum);
                    }
                    w.iter_mut().for_each(|x| *x *= hp.expert_weights_scale);
                }
            }
            probs.extend(p.iter().map(|&x| x as f32));
            ids.extend(i.iter().map(|&x| x as i32));
            weights.extend(w.iter().map(|&x| x as f32));
        }
        (probs, ids, weights)
    }
}

/// `rows` (an expert's down projection) dequantized and scaled by `f`: every output of the
/// expert `f` times the reference's, up to f32 rounding of the weights.
pub(super) fn scaled(rows: &Rows<'_>, f: f64) -> Result<Matrix> {
    let mut m = match rows {
        Rows::Dense(m) => m.clone(),
        Rows::Source(src) => {
            let mut data = vec![0f32; src.rows * src.cols];
            src.dequantize_into(0..src.rows, &mut data)?;
            Matrix {
                rows: src.rows,
                cols: src.cols,
                data,
            }
        }
    };
    m.data
        .iter_mut()
        .for_each(|v| *v = (f64::from(*v) * f) as f32);
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_rows_by_hand() {
        let m = Matrix {
            rows: 1,
            cols: 2,
            data: vec![1.0, -2.0],
        };
        assert_eq!(scaled(&Rows::Dense(m), 1.5).unwrap().data, vec![1.5, -3.0]);
    }
}
