//! The routing and MoE faults `--explain` tests ([`hypotheses`]), and the continuous ones among
//! them with their parameter fitted to the candidate ([`fit`]).
//!
//! Both fitted families are linear in their parameter, so the fit is closed form (least squares
//! of the candidate on the step's output as a function of the parameter):
//!
//! - `routed_scale:X` at the router's weights output: the weights are `X * w1`, with `w1` the
//!   weights recomputed at `X = 1`, so `X = <c, w1> / <w1, w1>`. A fitted `X` within 1% of 1 is
//!   named `routed_scaling_ignored`, within 1% of `s^2` `routed_scaling_twice`.
//! - `expert_scale:E,F` at the routed experts' output `A + F * B_E` (`B_E` expert `E`'s weighted
//!   contribution, from every routed expert's own output computed once, as the expert search of
//!   [`super::search`] does): for each routed expert `F_E = 1 + <c - base, B_E> / <B_E, B_E>`
//!   and the expert whose fit leaves the smallest residual; at an expert's own output hook
//!   (`blk.L.exp.E.out`), `F = <c, y> / <y, y>`.
//!
//! The caller recomputes the step through [`FaultEngine`] with the fitted value, so the residual
//! reported is the fault's own, not the fit's.

use anyhow::{Context, Result};

use super::fault::{Fault, FaultEngine, FaultKind, GroupLimit, MlpPart, RoutedScale};
use super::{output_at, CapturedStep};
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, HostTensor};
use crate::model::names::{self, blk};
use crate::model::steps::{self, Op, Step};
use crate::model::{HParams, Weights};

/// A fitted factor this close (relative) to a named case of `routed_scale` is named after it.
pub const NAMED_WITHIN: f64 = 0.01;

/// The grouping DeepSeek-V3 routes with (`n_group` 8, `topk_group` 4), tested on a model
/// without groups: an engine that takes it as its default.
const DEEPSEEK_V3_GROUPS: (usize, usize) = (8, 4);

/// A hypothesis with its parameter fitted to the candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The fault with the fitted value: what the step is recomputed with.
    pub fault: Fault,
    /// How it is reported: the fault, or the named case the fitted value matches
    /// (`routed_scaling_ignored@1`).
    pub kind: String,
    /// The parameter's name (`routed_scale`, `expert_scale`).
    pub param: String,
    /// The fitted value.
    pub fitted: f64,
    /// The model's own value (what no fault gives).
    pub nominal: f64,
}

/// The routing and MoE faults that concern `step` in its layer: at the router the routed scale
/// (a seed [`fit`] replaces), the top-k normalisation, the bias left out of the selection, and
/// the group limit ignored or with other groups; at the routed experts one expert's scale (a
/// seed); gate and up exchanged in the dense MLP and the shared expert. The caller keeps those
/// that apply to the model ([`Fault::check`]).
pub fn hypotheses(step: &Step, weights: &Weights<'_>) -> Vec<Fault> {
    let hp = weights.hparams();
    let at = |k: FaultKind| Fault::new(k, step.layer.map(|l| vec![l]));
    let suffix = |w: &str| names::split_blk(w).map(|(_, s)| s.to_string());
    let mut v = Vec::new();
    match &step.op {
        Op::MoeRoute { .. } => {
            let seed = if hp.expert_weights_scale != 1.0 {
                RoutedScale::Ignored
            } else {
                RoutedScale::Factor(2.0)
            };
            v.push(at(FaultKind::RoutedScale(seed)));
            v.push(at(FaultKind::TopkNorm(!hp.expert_weights_norm)));
            v.push(at(FaultKind::BiasUnused));
            v.push(at(FaultKind::GroupLimit(GroupLimit::Off)));
            for (groups, keep) in group_variants(hp) {
                v.push(at(FaultKind::GroupLimit(GroupLimit::Groups {
                    groups,
                    keep: Some(keep),
                })));
            }
        }
        Op::MoeExperts { .. } => v.push(at(FaultKind::ExpertScale {
            expert: 0,
            factor: 2.0,
        })),
        Op::Mlp { gate, .. } if suffix(gate).as_deref() == Some(blk::FFN_GATE_SHEXP) => {
            v.push(at(FaultKind::GateUpSwapMlp(MlpPart::Shared)));
        }
        Op::Linear { weight }
            if matches!(suffix(weight).as_deref(), Some(blk::FFN_GATE | blk::FFN_UP)) =>
        {
            v.push(at(FaultKind::GateUpSwapMlp(MlpPart::Dense)));
        }
        _ => {}
    }
    v
}

/// Groupings other than the model's to test: with the model's groups, its group count keeping
/// any other number of groups, and every other group count keeping the model's number or one;
/// without groups, DeepSeek-V3's. Those that cannot apply are left to [`Fault::check`].
fn group_variants(hp: &HParams) -> Vec<(usize, usize)> {
    let Some((g, u)) = hp.groups else {
        return vec![DEEPSEEK_V3_GROUPS];
    };
    let mut v: Vec<(usize, usize)> = (1..g).filter(|&k| k != u).map(|k| (g, k)).collect();
    for n in (2..=hp.n_expert).filter(|&n| hp.n_expert % n == 0 && n != g) {
        v.push((n, u));
        if u != 1 {
            v.push((n, 1));
        }
    }
    v
}

/// `fault` with its parameter fitted to the captured candidate, for the continuous families
/// (`routed_scale`, `expert_scale`); `None` for any other fault, or where the hook failing is
/// not one the parameter moves linearly (the router's selection, for `routed_scale`).
pub fn fit(
    fault: &Fault,
    captured: &CapturedStep,
    weights: &Weights<'_>,
    tokens: &[u32],
) -> Result<Option<Fit>> {
    match &fault.kind {
        FaultKind::RoutedScale(_) => fit_routed_scale(fault, captured, weights, tokens),
        FaultKind::ExpertScale { .. } => fit_expert_scale(fault, captured, weights),
        _ => Ok(None),
    }
}

/// `<c, y> / <y, y>`: the factor `f` minimising `|c - f y|`; `None` when `y` is zero, the
/// lengths differ or the result is not finite.
pub fn scale_fit(c: &[f32], y: &[f32]) -> Option<f64> {
    if c.len() != y.len() {
        return None;
    }
    let (cy, yy) = c.iter().zip(y).fold((0f64, 0f64), |(cy, yy), (&c, &y)| {
        let (c, y) = (f64::from(c), f64::from(y));
        (cy + c * y, yy + y * y)
    });
    let f = cy / yy;
    (yy > 0.0 && f.is_finite()).then_some(f)
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

fn fit_routed_scale(
    fault: &Fault,
    captured: &CapturedStep,
    weights: &Weights<'_>,
    tokens: &[u32],
) -> Result<Option<Fit>> {
    let step = &captured.step;
    // Only the routing weights are linear in the scale (the selection does not move).
    if step.outputs.get(2) != Some(&captured.hook) {
        return Ok(None);
    }
    let cpu = CpuEngine::new(weights);
    let unit = Fault::new(
        FaultKind::RoutedScale(RoutedScale::Factor(1.0)),
        fault.layers.clone(),
    );
    let engine = FaultEngine::new(&cpu, weights, vec![unit]);
    if let Some(l) = step.layer {
        engine.begin_layer(l, &[])?;
    }
    let w1 = output_at(&engine, step, &captured.inputs, tokens, &captured.hook)?;
    let Some(x) = scale_fit(
        captured.candidate.as_f32("candidate")?,
        w1.as_f32("weights at scale 1")?,
    ) else {
        return Ok(None);
    };
    let s = weights.hparams().expert_weights_scale;
    let named = if relative(x, 1.0) <= NAMED_WITHIN {
        Some(RoutedScale::Ignored)
    } else if relative(x, s * s) <= NAMED_WITHIN {
        Some(RoutedScale::Twice)
    } else {
        None
    };
    let fitted = Fault::new(
        FaultKind::RoutedScale(RoutedScale::Factor(x)),
        fault.layers.clone(),
    );
    let kind = match named {
        Some(r) => Fault::new(FaultKind::RoutedScale(r), fault.layers.clone()).to_string(),
        None => fitted.to_string(),
    };
    Ok(Some(Fit {
        fault: fitted,
        kind,
        param: "routed_scale".to_string(),
        fitted: x,
        nominal: s,
    }))
}

fn fit_expert_scale(
    fault: &Fault,
    captured: &CapturedStep,
    weights: &Weights<'_>,
) -> Result<Option<Fit>> {
    let step = &captured.step;
    let Op::MoeExperts { layer } = step.op else {
        return Ok(None);
    };
    let hook = captured.hook.as_str();
    let cand = captured.candidate.as_f32("candidate")?;
    let found = if step.outputs.first().map(String::as_str) == Some(hook) {
        let input = |i: usize| -> Result<&HostTensor> {
            captured
                .inputs
                .get(i)
                .map(|(_, t)| t)
                .with_context(|| format!("explain: {hook}: the step has no input {i}"))
        };
        let cpu = CpuEngine::new(weights);
        best_expert(&cpu, layer, input(0)?, input(1)?, input(2)?, cand)?
    } else {
        // One expert's own output: the reference's there, scaled.
        (0..weights.hparams().n_expert)
            .find(|&e| steps::expert_hook(layer, e) == hook)
            .and_then(|e| {
                let y = captured.reference.as_f32("reference").ok()?;
                scale_fit(cand, y).map(|f| (e, f))
            })
    };
    let Some((expert, factor)) = found else {
        return Ok(None);
    };
    let fitted = Fault::new(
        FaultKind::ExpertScale { expert, factor },
        fault.layers.clone(),
    );
    Ok(Some(Fit {
        kind: fitted.to_string(),
        fault: fitted,
        param: "expert_scale".to_string(),
        fitted: factor,
        nominal: 1.0,
    }))
}

/// One token's weighted output of an expert: `(token, w * y)`.
type Contribution = (usize, Vec<f64>);

/// The routed expert whose output scaled best reproduces `cand` (`[T, hidden]`) from the
/// routed experts' step inputs `x` (`[T, hidden]`), `ids` and `w` (`[T, K]`), and its factor;
/// `None` when no expert is routed or every contribution is zero.
pub fn best_expert(
    cpu: &CpuEngine<'_>,
    layer: usize,
    x: &HostTensor,
    ids: &HostTensor,
    w: &HostTensor,
    cand: &[f32],
) -> Result<Option<(usize, f64)>> {
    let n_expert = cpu.weights().hparams().n_expert;
    let (t, hidden) = x.dims2("moe input")?;
    let (ti, k) = ids.dims2("moe_topk_ids")?;
    if ti != t || w.shape != ids.shape || cand.len() != t * hidden {
        anyhow::bail!(
            "explain: expert scale fit: input {:?}, ids {:?}, weights {:?} and {} output values disagree",
            x.shape,
            ids.shape,
            w.shape,
            cand.len()
        );
    }
    let (xv, idv, wv) = (x.as_f32("x")?, ids.as_i32("ids")?, w.as_f32("w")?);
    // routed[e]: (token, weight) of every slot routed to e.
    let mut routed: Vec<Vec<(usize, f64)>> = vec![Vec::new(); n_expert];
    for tok in 0..t {
        for j in 0..k {
            let e = idv[tok * k + j];
            if e >= 0 && (e as usize) < n_expert {
                routed[e as usize].push((tok, f64::from(wv[tok * k + j])));
            }
        }
    }
    // contrib[e]: (token, w * y_e(token)) for each routed token; base: their sum.
    let mut base = vec![0f64; t * hidden];
    let mut contrib: Vec<(usize, Vec<Contribution>)> = Vec::new();
    for (e, toks) in routed.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let xs: Vec<f32> = toks
            .iter()
            .flat_map(|&(tok, _)| xv[tok * hidden..(tok + 1) * hidden].iter().copied())
            .collect();
        let rows = cpu.expert_rows(layer, e)?;
        let y = cpu.expert_output(&rows, &xs, toks.len())?;
        let mut per = Vec::with_capacity(toks.len());
        for (i, &(tok, wt)) in toks.iter().enumerate() {
            let b: Vec<f64> = y[i * hidden..(i + 1) * hidden]
                .iter()
                .map(|&v| wt * f64::from(v))
                .collect();
            for (a, v) in base[tok * hidden..(tok + 1) * hidden].iter_mut().zip(&b) {
                *a += v;
            }
            per.push((tok, b));
        }
        contrib.push((e, per));
    }
    // d = c - base; for expert e: F - 1 = <d, B_e> / <B_e, B_e>, and the fit removes
    // <d, B_e>^2 / <B_e, B_e> from |d|^2: the best expert removes the most.
    let d: Vec<f64> = cand
        .iter()
        .zip(&base)
        .map(|(&c, &b)| f64::from(c) - b)
        .collect();
    let mut best: Option<(f64, usize, f64)> = None;
    for (e, per) in &contrib {
        let (mut db, mut bb) = (0f64, 0f64);
        for (tok, b) in per {
            for (dv, bv) in d[tok * hidden..(tok + 1) * hidden].iter().zip(b) {
                db += dv * bv;
                bb += bv * bv;
            }
        }
        if bb <= 0.0 {
            continue;
        }
        let gain = db * db / bb;
        let f = 1.0 + db / bb;
        if f.is_finite() && best.is_none_or(|(g, _, _)| gain > g) {
            best = Some((gain, *e, f));
        }
    }
    Ok(best.map(|(_, e, f)| (e, f)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::engine::ExpertInputs;
    use crate::gguf::Model;
    use crate::util::rng::SplitMix64;

    #[test]
    fn scale_fit_by_hand() {
        assert_eq!(scale_fit(&[2.0, 4.0], &[1.0, 2.0]), Some(2.0));
        assert_eq!(scale_fit(&[1.0], &[0.0]), None);
        assert_eq!(scale_fit(&[1.0, 2.0], &[1.0]), None);
    }

    fn open(rel: &str) -> Model {
        Model::open(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/models")
                .join(rel),
        )
        .unwrap()
    }

    fn step_of(weights: &Weights<'_>, layer: usize, op: &Op) -> Step {
        steps::layer_steps(weights.hparams(), layer)
            .into_iter()
            .find(|s| s.op == *op)
            .unwrap()
    }

    fn random(rng: &mut SplitMix64, shape: Vec<usize>) -> HostTensor {
        let n = shape.iter().product();
        HostTensor::f32(shape, (0..n).map(|_| rng.normal()).collect()).unwrap()
    }

    fn captured(
        step: &Step,
        hook: &str,
        inputs: Vec<HostTensor>,
        r: &HostTensor,
        c: HostTensor,
    ) -> CapturedStep {
        CapturedStep {
            step: step.clone(),
            hook: hook.to_string(),
            inputs: step.inputs.iter().cloned().zip(inputs).collect(),
            reference: r.clone(),
            candidate: c,
            error: 0.0,
            allowed: 0.0,
            noise: None,
            inside: Vec::new(),
        }
    }

    /// The router's weights of a planted scale, made here as the reference's times X/s (the
    /// weights are linear in the scale; no fault code): the fit gives X back to 1e-6, a subtle
    /// 1% off the model's scale included, and names X = 1 and X = s^2 (and what is within 1% of
    /// them) after their cases.
    #[test]
    fn routed_scale_is_fitted_and_named() {
        for rel in [
            "glm5-tiny/glm5-tiny-f32.gguf",
            "dsv3-tiny/dsv3-tiny-f32.gguf",
        ] {
            let model = open(rel);
            let w = Weights::new(&model).unwrap();
            let hp = w.hparams();
            let s = hp.expert_weights_scale;
            let step = step_of(&w, 1, &Op::MoeRoute { layer: 1 });
            let mut rng = SplitMix64::new(11);
            let logits = random(&mut rng, vec![9, hp.n_expert]);
            let r = CpuEngine::new(&w).moe_route(1, &logits).unwrap();
            let seed = Fault::new(FaultKind::RoutedScale(RoutedScale::Ignored), Some(vec![1]));
            for (x, named) in [
                (1.01 * s, "routed_scale:2.525@1"),
                (0.99 * s, "routed_scale:2.475@1"),
                (1.0, "routed_scaling_ignored@1"),
                (1.009, "routed_scaling_ignored@1"),
                (1.02, "routed_scale:1.02@1"),
                (s * s, "routed_scaling_twice@1"),
            ] {
                let cand: Vec<f32> = r
                    .weights
                    .as_f32("w")
                    .unwrap()
                    .iter()
                    .map(|&v| (f64::from(v) * x / s) as f32)
                    .collect();
                let cand = HostTensor::f32(r.weights.shape.clone(), cand).unwrap();
                let c = captured(
                    &step,
                    &step.outputs[2],
                    vec![logits.clone()],
                    &r.weights,
                    cand,
                );
                let f = fit(&seed, &c, &w, &[]).unwrap().unwrap();
                assert!((f.fitted - x).abs() < 1e-6 * x, "{rel}: {x}: {}", f.fitted);
                assert_eq!((f.kind.as_str(), f.nominal), (named, s), "{rel}: {x}");
                assert_eq!(f.param, "routed_scale");
                assert_eq!(
                    f.fault.kind,
                    FaultKind::RoutedScale(RoutedScale::Factor(f.fitted))
                );
            }
            // At the selection the scale moves nothing: no fit.
            let c = captured(
                &step,
                &step.outputs[1],
                vec![logits.clone()],
                &r.ids,
                r.ids.clone(),
            );
            assert_eq!(fit(&seed, &c, &w, &[]).unwrap(), None);
        }
    }

    /// The routed experts' output with one expert's contribution planted 1% (and 5%, and 0.5x)
    /// larger, made here from the reference's expert output (no fault code): the fit finds the
    /// expert and the factor to 1e-4; at the expert's own output hook likewise.
    #[test]
    fn expert_scale_is_fitted_with_its_expert() {
        for rel in [
            "glm5-tiny/glm5-tiny-f32.gguf",
            "dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ] {
            let model = open(rel);
            let w = Weights::new(&model).unwrap();
            let hp = w.hparams();
            let cpu = CpuEngine::new(&w);
            let step = step_of(&w, 1, &Op::MoeExperts { layer: 1 });
            let mut rng = SplitMix64::new(5);
            let t = 12;
            let x = random(&mut rng, vec![t, hp.hidden]);
            let r = cpu
                .moe_route(1, &random(&mut rng, vec![t, hp.n_expert]))
                .unwrap();
            let inp = ExpertInputs {
                x: &x,
                ids: &r.ids,
                weights: &r.weights,
            };
            let reference = cpu.moe_experts(1, inp, &|_| false).unwrap().routed;
            let (ids, wts) = (r.ids.as_i32("ids").unwrap(), r.weights.as_f32("w").unwrap());
            let k = hp.n_expert_used;
            for (e, factor) in [
                (ids[0] as usize, 1.01),
                (ids[k + 1] as usize, 1.05),
                (ids[1] as usize, 0.5),
            ] {
                // Expert e's own output on the tokens routed to it, weighted, added (factor - 1)
                // times to the reference.
                let toks: Vec<(usize, f64)> = (0..t)
                    .flat_map(|tok| (0..k).map(move |j| (tok, j)))
                    .filter(|&(tok, j)| ids[tok * k + j] as usize == e)
                    .map(|(tok, j)| (tok, f64::from(wts[tok * k + j])))
                    .collect();
                let xs: Vec<f32> = toks
                    .iter()
                    .flat_map(|&(tok, _)| {
                        x.as_f32("x").unwrap()[tok * hp.hidden..(tok + 1) * hp.hidden].to_vec()
                    })
                    .collect();
                let y = cpu
                    .expert_output(&cpu.expert_rows(1, e).unwrap(), &xs, toks.len())
                    .unwrap();
                let mut cand: Vec<f64> = reference
                    .as_f32("r")
                    .unwrap()
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                for (i, &(tok, wt)) in toks.iter().enumerate() {
                    for c in 0..hp.hidden {
                        cand[tok * hp.hidden + c] +=
                            (factor - 1.0) * wt * f64::from(y[i * hp.hidden + c]);
                    }
                }
                let cand = HostTensor::f32(
                    reference.shape.clone(),
                    cand.iter().map(|&v| v as f32).collect(),
                )
                .unwrap();
                let inputs = vec![x.clone(), r.ids.clone(), r.weights.clone()];
                let c = captured(&step, &step.outputs[0], inputs.clone(), &reference, cand);
                let seed = Fault::new(
                    FaultKind::ExpertScale {
                        expert: 0,
                        factor: 2.0,
                    },
                    Some(vec![1]),
                );
                let f = fit(&seed, &c, &w, &[]).unwrap().unwrap();
                let FaultKind::ExpertScale { expert, .. } = f.fault.kind else {
                    panic!()
                };
                assert_eq!(expert, e, "{rel}: {factor}");
                assert!(
                    (f.fitted - factor).abs() < 1e-4,
                    "{rel}: {factor}: {}",
                    f.fitted
                );
                assert_eq!((f.param.as_str(), f.nominal), ("expert_scale", 1.0));
                // The expert's own output hook: the reference's rows there, scaled.
                let own = HostTensor::f32(vec![toks.len(), hp.hidden], y.clone()).unwrap();
                let scaled = HostTensor::f32(
                    own.shape.clone(),
                    y.iter().map(|&v| (f64::from(v) * factor) as f32).collect(),
                )
                .unwrap();
                let c = captured(&step, &steps::expert_hook(1, e), inputs, &own, scaled);
                let f = fit(&seed, &c, &w, &[]).unwrap().unwrap();
                assert_eq!(
                    f.kind,
                    format!(
                        "expert_scale:{e},{}@1",
                        super::super::fault::factor_words(factor)
                    )
                );
                assert!((f.fitted - factor).abs() < 1e-6, "{rel}: {}", f.fitted);
            }
        }
    }

    /// The routing hypotheses of a grouped model: the group variants other than the model's,
    /// those that cannot apply left to `Fault::check`.
    #[test]
    fn group_variants_by_hand() {
        let model = open("dsv3-tiny/dsv3-tiny-f32.gguf");
        let w = Weights::new(&model).unwrap();
        // 8 experts in 4 groups, 2 kept.
        assert_eq!(
            group_variants(w.hparams()),
            vec![(4, 1), (4, 3), (2, 2), (2, 1), (8, 2), (8, 1)]
        );
        let model = open("glm5-tiny/glm5-tiny-f32.gguf");
        let w = Weights::new(&model).unwrap();
        assert_eq!(group_variants(w.hparams()), vec![(8, 4)]);
    }
}
