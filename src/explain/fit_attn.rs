//! Fitted hypotheses of the attention, norm and projection families: a continuous fault
//! (`weight_scale:GLOB,F`, `softmax_scale:F`, `rope_theta:X`, `norm_eps:X`, `indexer_scale:F`,
//! `indexer_wproj_scale:F`) is tested with the parameter that brings the recomputed step closest
//! to the candidate's output, not with a guessed value.
//!
//! Where the step's output is linear in the parameter (a projection's or an RMSNorm's weight
//! scaled by `F`, kv_b's V half, every index score multiplied by `F`) the fit is closed form: `F
//! = <c, r> / <r, r>` with `r` the reference's output (the step at `F = 1`) and `c` the
//! candidate's. Otherwise it is a bounded 1-D search on a log scale ([`minimise`]: a grid, then
//! golden-section refinement around its best point, [`EVALUATIONS`] recomputations of the step)
//! and one Gauss-Newton step from its result (three more). Either way up to three shorter values
//! of the result are tried, and kept when they reproduce the candidate as well (a linear step's
//! output there is the reference's scaled): one recomputation for a closed-form fit, at most 39
//! for a search. Every evaluation recomputes the step through the fault's own host code.

use anyhow::{bail, Result};

use super::fault::attn::{latent_ratio, matches, yarn_mscale};
use super::fault::{Fault, FaultKind};
use crate::engine::HostTensor;
use crate::model::steps::{Op, Step};
use crate::model::{HParams, Weights};

/// Grid points of [`minimise`] over the search range.
const GRID: usize = 11;
/// Golden-section steps of [`minimise`] after the grid.
const GOLDEN: usize = 20;
/// The most recomputations one search makes: the grid, the two golden start points, the steps.
pub const EVALUATIONS: usize = GRID + 2 + GOLDEN;
/// The step of the finite difference of the Gauss-Newton refinement after a search (in the log
/// of the parameter).
const NEWTON_STEP: f64 = 1e-4;
/// Significant digits of the shorter values tried in place of a fitted one ([`fit`]).
const SNAP_DIGITS: [usize; 3] = [1, 2, 3];
/// `softmax_scale:F` (and kv_b's K half scaled by `F`) is searched in `[1/10, 10]`.
const SOFTMAX_RANGE: (f64, f64) = (0.1, 10.0);
/// `rope_theta:X` is searched in `nominal * [1e-3, 1e3]` (never below 1.5).
const THETA_DECADES: f64 = 3.0;
/// `yarn_factor:F` is searched in `[1, 1000]` (YaRN factors in use: 4 to 64).
const YARN_FACTOR_RANGE: (f64, f64) = (1.0, 1000.0);
/// `norm_eps:X` is searched in `[1e-12, 1e-1]`.
const EPS_RANGE: (f64, f64) = (1e-12, 1e-1);
/// A fitted factor is named after a known bug's factor when within this relative distance.
const NAMED_TOLERANCE: f64 = 0.01;
/// Significant digits of the fitted value in the hypothesis' name.
const NAME_DIGITS: usize = 5;

/// A fitted hypothesis.
#[derive(Clone, Debug)]
pub struct Fit {
    /// The fault with the fitted parameter, written with [`NAME_DIGITS`] significant digits.
    pub fault: Fault,
    /// The parameter's name (`factor`, `theta`, `eps`).
    pub param: &'static str,
    /// The fitted value (full precision).
    pub fitted: f64,
    /// The model's value (what no fault gives).
    pub nominal: f64,
    /// The step's output at `hook` with the fitted value (full precision).
    pub output: HostTensor,
    /// A known bug whose factor the fitted one matches, in words.
    pub note: Option<String>,
}

/// The parameter of a fitted family: its name and the model's value at `step`; `None` for the
/// kinds that are not fitted.
pub fn param(kind: &FaultKind, step: &Step, hp: &HParams) -> Option<(&'static str, f64)> {
    match kind {
        FaultKind::WeightScale { .. }
        | FaultKind::SoftmaxScale(_)
        | FaultKind::IndexerScale(_)
        | FaultKind::IndexerWprojScale(_) => Some(("factor", 1.0)),
        FaultKind::RopeTheta(_) => Some(("theta", hp.rope.base)),
        FaultKind::YarnFactor(_) => hp.rope.yarn.as_ref().map(|y| ("factor", y.factor)),
        FaultKind::NormEps(_) => match &step.op {
            Op::RmsNorm { eps, .. } => Some(("eps", *eps)),
            _ => Some(("eps", hp.rms_eps)),
        },
        _ => None,
    }
}

/// `kind` with its parameter set to `x`.
fn with_param(kind: &FaultKind, x: f64) -> FaultKind {
    match kind {
        FaultKind::WeightScale { glob, .. } => FaultKind::WeightScale {
            glob: glob.clone(),
            factor: x,
        },
        FaultKind::SoftmaxScale(_) => FaultKind::SoftmaxScale(x),
        FaultKind::IndexerScale(_) => FaultKind::IndexerScale(x),
        FaultKind::IndexerWprojScale(_) => FaultKind::IndexerWprojScale(x),
        FaultKind::RopeTheta(_) => FaultKind::RopeTheta(x),
        FaultKind::YarnFactor(_) => FaultKind::YarnFactor(x),
        FaultKind::NormEps(_) => FaultKind::NormEps(x),
        k => k.clone(),
    }
}

/// Whether `step`'s output is linear in the kind's parameter (closed-form fit): a projection's
/// or a norm's weight scale, kv_b's V half in attention (the output is a convex combination of
/// V rows), the index score scales. kv_b's K half goes through the softmax: searched.
fn linear(kind: &FaultKind, step: &Step, weights: &Weights<'_>) -> bool {
    match (kind, &step.op) {
        (FaultKind::WeightScale { glob, .. }, Op::Attention { layer }) => {
            match weights.kv_b_names(*layer).as_slice() {
                [k, v] => matches(glob, v) && !matches(glob, k),
                _ => false,
            }
        }
        (FaultKind::WeightScale { .. }, _) => true,
        (FaultKind::IndexerScale(_) | FaultKind::IndexerWprojScale(_), _) => true,
        _ => false,
    }
}

/// Fits the parameter of `fault` (a kind [`param`] knows) at `step`: `reference` and `candidate`
/// are the step's outputs at the failing hook, `eval` recomputes the step under a fault and
/// returns its output there, `residual` is the distance ranked by `--explain`.
pub fn fit(
    fault: &Fault,
    step: &Step,
    weights: &Weights<'_>,
    reference: &HostTensor,
    candidate: &HostTensor,
    eval: &dyn Fn(&Fault) -> Result<HostTensor>,
    residual: &dyn Fn(&HostTensor) -> f64,
) -> Result<Fit> {
    let hp = weights.hparams();
    let Some((name, nominal)) = param(&fault.kind, step, hp) else {
        bail!("explain: {fault} has no fitted parameter");
    };
    let at = |x: f64| Fault::new(with_param(&fault.kind, x), fault.layers.clone());
    let linear = linear(&fault.kind, step, weights);
    // The fitted value and, after a search, the step's output there.
    let (mut fitted, mut output) = if linear {
        (closed_form(reference, candidate)?, None)
    } else {
        let (lo, hi) = match &fault.kind {
            FaultKind::SoftmaxScale(_) | FaultKind::WeightScale { .. } => SOFTMAX_RANGE,
            FaultKind::RopeTheta(_) => (
                (nominal * 10f64.powf(-THETA_DECADES)).max(1.5),
                nominal * 10f64.powf(THETA_DECADES),
            ),
            FaultKind::YarnFactor(_) => YARN_FACTOR_RANGE,
            _ => EPS_RANGE,
        };
        let mut cost = |ln_x: f64| -> Result<f64> { Ok(residual(&eval(&at(ln_x.exp()))?)) };
        let ln_x = minimise(lo.ln(), hi.ln(), &mut cost)?.0;
        // One Gauss-Newton step from there: the golden section's last bracket is ~1e-5 wide,
        // and a candidate the fault reproduces exactly deserves its residual of ~0.
        let (h0, h1) = (
            eval(&at(ln_x.exp()))?,
            eval(&at((ln_x + NEWTON_STEP).exp()))?,
        );
        let step = newton(candidate, &h0, &h1, NEWTON_STEP)
            .map(|d| ln_x + d)
            .filter(|x| x.is_finite() && (lo.ln()..=hi.ln()).contains(x));
        let moved = match step {
            Some(x) => Some((x.exp(), eval(&at(x.exp()))?)),
            None => None,
        };
        match moved {
            Some((x, h)) if residual(&h) < residual(&h0) => (x, Some(h)),
            _ => (ln_x.exp(), Some(h0)),
        }
    };
    // The shortest value that reproduces the candidate as well (a flat minimum: an eps far
    // under the mean square, a factor found to 1e-9): 1e-6 rather than 9.9956e-7. A linear
    // step's output at x is x times the reference's: compared so, without recomputing it.
    let score = |x: f64, out: Option<&HostTensor>| -> Result<(f64, Option<HostTensor>)> {
        if linear {
            return Ok((residual(&scaled(reference, x)?), None));
        }
        let out = match out {
            Some(o) => o.clone(),
            None => eval(&at(x))?,
        };
        Ok((residual(&out), Some(out)))
    };
    let best = score(fitted, output.as_ref())?.0;
    for d in SNAP_DIGITS {
        let short = round_sig(fitted, d);
        if short == fitted || short == nominal {
            continue;
        }
        let (r, out) = score(short, None)?;
        if r <= best {
            (fitted, output) = (short, out);
            break;
        }
    }
    let output = match output {
        Some(o) => o,
        None => eval(&at(fitted))?,
    };
    Ok(Fit {
        fault: at(name_value(fitted, nominal)),
        param: name,
        fitted,
        nominal,
        output,
        note: named(&fault.kind, hp, fitted),
    })
}

/// `fitted` with [`NAME_DIGITS`] significant digits, more when that would read as the model's
/// own value (`weight_scale:..,1` for 0.99998).
fn name_value(fitted: f64, nominal: f64) -> f64 {
    (NAME_DIGITS..=12)
        .map(|d| round_sig(fitted, d))
        .find(|&v| v != nominal)
        .unwrap_or(fitted)
}

/// The Gauss-Newton step `d` that brings `h0 + d * (h1 - h0) / step` closest to `c` (least
/// squares over the entries finite in all three), `None` when `h` does not move.
fn newton(c: &HostTensor, h0: &HostTensor, h1: &HostTensor, step: f64) -> Option<f64> {
    let (c, h0, h1) = (c.as_f32("").ok()?, h0.as_f32("").ok()?, h1.as_f32("").ok()?);
    if c.len() != h0.len() || h0.len() != h1.len() {
        return None;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for ((&c, &a), &b) in c.iter().zip(h0).zip(h1) {
        if c.is_finite() && a.is_finite() && b.is_finite() {
            let j = (f64::from(b) - f64::from(a)) / step;
            num += (f64::from(c) - f64::from(a)) * j;
            den += j * j;
        }
    }
    (den > 0.0).then(|| num / den)
}

/// `x` times every value of `t` (f32 tensors).
fn scaled(t: &HostTensor, x: f64) -> Result<HostTensor> {
    let v = t
        .as_f32("reference")?
        .iter()
        .map(|&v| (f64::from(v) * x) as f32)
        .collect();
    HostTensor::f32(t.shape.clone(), v)
}

/// The least-squares factor `F` of `candidate ≈ F * reference` over the entries finite in both:
/// `<c, r> / <r, r>`.
pub fn closed_form(reference: &HostTensor, candidate: &HostTensor) -> Result<f64> {
    if reference.shape != candidate.shape {
        bail!(
            "explain: the candidate's shape {:?} is not the reference's {:?}",
            candidate.shape,
            reference.shape
        );
    }
    let (r, c) = (
        reference.as_f32("reference")?,
        candidate.as_f32("candidate")?,
    );
    let (mut cr, mut rr) = (0f64, 0f64);
    for (&r, &c) in r.iter().zip(c) {
        if r.is_finite() && c.is_finite() {
            cr += f64::from(c) * f64::from(r);
            rr += f64::from(r) * f64::from(r);
        }
    }
    if rr == 0.0 {
        bail!("explain: the reference's output is zero: no scale to fit");
    }
    Ok(cr / rr)
}

/// The minimum of `f` over `[lo, hi]`: `f` at [`GRID`] evenly spaced points, then golden-section
/// refinement in the two grid cells around the best one ([`GOLDEN`] steps); [`fit`] then tries
/// up to three shorter values. Returns the best
/// point evaluated and its value. `f` need only be unimodal near its minimum.
pub fn minimise(lo: f64, hi: f64, f: &mut dyn FnMut(f64) -> Result<f64>) -> Result<(f64, f64)> {
    if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
        bail!("explain: empty search range [{lo}, {hi}]");
    }
    let step = (hi - lo) / (GRID - 1) as f64;
    let mut best = (lo, f64::INFINITY);
    let keep = |x: f64, y: f64, best: &mut (f64, f64)| {
        if y < best.1 {
            *best = (x, y);
        }
    };
    let mut at_best = 0;
    for i in 0..GRID {
        let x = lo + step * i as f64;
        let y = f(x)?;
        if y < best.1 {
            at_best = i;
        }
        keep(x, y, &mut best);
    }
    let (mut a, mut b) = (
        lo + step * at_best.saturating_sub(1) as f64,
        lo + step * (at_best + 1).min(GRID - 1) as f64,
    );
    let g = (5f64.sqrt() - 1.0) / 2.0;
    let (mut c, mut d) = (b - g * (b - a), a + g * (b - a));
    let (mut fc, mut fd) = (f(c)?, f(d)?);
    keep(c, fc, &mut best);
    keep(d, fd, &mut best);
    for _ in 0..GOLDEN {
        if fc < fd {
            b = d;
            d = c;
            fd = fc;
            c = b - g * (b - a);
            fc = f(c)?;
            keep(c, fc, &mut best);
        } else {
            a = c;
            c = d;
            fc = fd;
            d = a + g * (b - a);
            fd = f(d)?;
            keep(d, fd, &mut best);
        }
    }
    Ok(best)
}

/// `x` rounded to `digits` significant digits (through its decimal form, so that it prints
/// short).
fn round_sig(x: f64, digits: usize) -> f64 {
    format!("{x:.*e}", digits.saturating_sub(1))
        .parse()
        .unwrap_or(x)
}

/// The known bug whose factor `fitted` matches, for the fitted scale families.
fn named(kind: &FaultKind, hp: &HParams, fitted: f64) -> Option<String> {
    let mut known: Vec<(f64, String)> = Vec::new();
    match kind {
        FaultKind::SoftmaxScale(_) => {
            known.push((
                latent_ratio(hp),
                "scale_latent (sqrt(nope + rope) / sqrt(kv_lora + rope))".into(),
            ));
            if let Some(m) = yarn_mscale(hp) {
                known.push((1.0 / (m * m), "yarn_mscale:none (1 / mscale^2)".into()));
                known.push((m * m, "YaRN's mscale^2 applied twice".into()));
                known.push((
                    m,
                    "YaRN's mscale applied once more (mscale^3 in the softmax scale)".into(),
                ));
                known.push((
                    1.0 / m,
                    "YaRN's mscale applied once (mscale, not mscale^2)".into(),
                ));
            }
        }
        FaultKind::IndexerScale(_) | FaultKind::IndexerWprojScale(_) => {
            if let Some(ix) = &hp.indexer {
                let (n, d) = (ix.n_head as f64, ix.head_dim as f64);
                known.push((n.sqrt(), "the weights' n_head^-0.5 missing".into()));
                known.push((
                    1.0 / n.sqrt(),
                    "the weights' n_head^-0.5 applied twice".into(),
                ));
                known.push((d.sqrt(), "the score scale head_dim^-0.5 missing".into()));
                known.push((
                    1.0 / d.sqrt(),
                    "the score scale head_dim^-0.5 applied twice".into(),
                ));
            }
        }
        FaultKind::WeightScale { glob, .. } if glob.contains("shexp") => {
            let r = hp.expert_weights_scale;
            if r.is_finite() && r > 0.0 && r != 1.0 {
                known.push((
                    r,
                    "the routed scaling factor (expert_weights_scale) applied to the shared expert"
                        .into(),
                ));
            }
        }
        _ => {}
    }
    known
        .into_iter()
        .find(|(f, _)| (fitted / f).ln().abs() < NAMED_TOLERANCE)
        .map(|(f, what)| format!("the fitted factor {fitted:.4} is that of {what}: {f:.4}"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::driver::exec_step;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::Engine;
    use crate::explain::fault::FaultEngine;
    use crate::model::names::blk;
    use crate::model::steps::{self, point};
    use crate::model::testutil::{tiny_hparams, tiny_model};
    use crate::model::Arch;

    /// A planted scale of 1.01 (a subtle one) is found to 1e-6 in closed form, the masked
    /// `-inf` entries ignored.
    #[test]
    fn closed_form_finds_a_subtle_scale() {
        let r: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 3.0)
            .collect();
        let mut c: Vec<f32> = r.iter().map(|&x| x * 1.01).collect();
        let mut r2 = r.clone();
        r2[5] = f32::NEG_INFINITY;
        c[5] = f32::NEG_INFINITY;
        let rt = HostTensor::f32(vec![8, 8], r2).unwrap();
        let ct = HostTensor::f32(vec![8, 8], c).unwrap();
        let f = closed_form(&rt, &ct).unwrap();
        assert!((f - 1.01).abs() < 1e-6, "{f}");
        let zero = HostTensor::f32(vec![8, 8], vec![0.0; 64]).unwrap();
        assert!(closed_form(&zero, &ct).is_err());
    }

    /// The search finds the minimum of a V-shaped and of a smooth function to 1e-4 within its
    /// evaluation budget, and only a smooth minimum near a grid point's neighbours matters.
    #[test]
    fn minimise_finds_the_minimum_within_budget() {
        for target in [1.01f64, 0.5335, 3.7] {
            let mut n = 0;
            let mut f = |x: f64| -> Result<f64> {
                n += 1;
                Ok((x - target.ln()).abs())
            };
            let (x, _) = minimise(0.1f64.ln(), 10f64.ln(), &mut f).unwrap();
            assert!(
                (x.exp() / target - 1.0).abs() < 1e-4,
                "{target}: {}",
                x.exp()
            );
            assert!(n <= EVALUATIONS, "{n} evaluations");
        }
        let mut f = |x: f64| -> Result<f64> { Ok((x - 2.0).powi(2) + 1.0) };
        let (x, y) = minimise(-5.0, 5.0, &mut f).unwrap();
        assert!((x - 2.0).abs() < 1e-3 && (y - 1.0).abs() < 1e-6, "{x} {y}");
        assert!(minimise(1.0, 1.0, &mut f).is_err());
    }

    /// The step of the tiny GLM-5 model that produces `hook` (layer 1), its inputs computed by
    /// the CPU reference from a fixed prompt, and the reference's output there.
    fn step_of(
        weights: &Weights<'_>,
        point: &str,
    ) -> (Step, Vec<(String, HostTensor)>, HostTensor) {
        let hp = weights.hparams();
        let cpu = CpuEngine::new(weights);
        let tokens: Vec<u32> = (0..8).map(|i| (i * 5 + 3) % 32).collect();
        let mut env: HashMap<String, HostTensor> = HashMap::new();
        let hook = steps::hook(1, point);
        let all = steps::embed_steps()
            .into_iter()
            .chain(steps::layer_steps(hp, 0))
            .chain(steps::layer_steps(hp, 1));
        for s in all {
            let inputs: Vec<(String, HostTensor)> = s
                .inputs
                .iter()
                .map(|n| (n.clone(), env[n].clone()))
                .collect();
            let refs: Vec<&HostTensor> = inputs.iter().map(|(_, t)| t).collect();
            let out = exec_step(&cpu, &s, &refs, &tokens, &|_| false).unwrap();
            if let Some(i) = s.outputs.iter().position(|o| *o == hook) {
                return (s.clone(), inputs, out.outputs[i].clone());
            }
            for (n, t) in s.outputs.iter().zip(out.outputs) {
                env.insert(n.clone(), t);
            }
        }
        panic!("no step produces {hook}");
    }

    /// Subtle faults (1%) planted in the CPU engine at the step they concern are fitted back
    /// through the fault's own host code to 1e-3 of the planted value: the closed form (a
    /// projection, a norm weight, kv_b's V half, the index scores) and the 1-D searches (the
    /// softmax scale, kv_b's K half, the RoPE base, an RMSNorm eps large enough to matter).
    #[test]
    fn subtle_faults_are_fitted_back() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let weights = Weights::new(&model).unwrap();
        let cpu = CpuEngine::new(&weights);
        let ws = |g: &str, f: f64| FaultKind::WeightScale {
            glob: g.to_string(),
            factor: f,
        };
        let cases = [
            (point::ATTN_OUT, ws(blk::ATTN_OUTPUT, 1.01), 1.01),
            (point::Q_A_NORM, ws(blk::ATTN_Q_A_NORM, 1.01), 1.01),
            (point::ATTN_HEADS, ws(blk::ATTN_V_B, 0.99), 0.99),
            (point::ATTN_HEADS, ws(blk::ATTN_K_B, 1.01), 1.01),
            (point::ATTN_HEADS, FaultKind::SoftmaxScale(1.01), 1.01),
            (
                point::INDEXER_SCORES,
                FaultKind::IndexerWprojScale(1.01),
                1.01,
            ),
            (point::Q_PE_ROPE, FaultKind::RopeTheta(10100.0), 10100.0),
            (point::ATTN_NORM, FaultKind::NormEps(1.01e-3), 1.01e-3),
        ];
        for (point, kind, planted) in cases {
            let (step, inputs, reference) = step_of(&weights, point);
            let hook = steps::hook(1, point);
            let evals = std::cell::Cell::new(0);
            let eval = |f: &Fault| -> Result<HostTensor> {
                evals.set(evals.get() + 1);
                let e = FaultEngine::new(&cpu, &weights, vec![f.clone()]);
                e.begin_layer(1, &[])?;
                let refs: Vec<&HostTensor> = inputs.iter().map(|(_, t)| t).collect();
                let out = exec_step(&e, &step, &refs, &[], &|_| false)?;
                let i = step.outputs.iter().position(|o| *o == hook).unwrap();
                Ok(out.outputs[i].clone())
            };
            let planted_fault = Fault::new(kind.clone(), Some(vec![1]));
            let candidate = eval(&planted_fault).unwrap();
            let r = |h: &HostTensor| super::super::residual(&candidate, h);
            let placeholder = Fault::new(with_param(&kind, 1.0), Some(vec![1]));
            evals.set(0);
            let f = fit(
                &placeholder,
                &step,
                &weights,
                &reference,
                &candidate,
                &eval,
                &r,
            )
            .unwrap();
            let most = if linear(&kind, &step, &weights) {
                1
            } else {
                39
            };
            assert!(evals.get() <= most, "{kind}: {} evaluations", evals.get());
            assert!(
                (f.fitted / planted - 1.0).abs() < 1e-3,
                "{kind}: fitted {} for {planted}",
                f.fitted
            );
            assert_eq!(f.fault.to_string(), planted_fault.to_string(), "{kind}");
        }
    }

    #[test]
    fn fitted_values_print_short() {
        assert_eq!(round_sig(1.050_000_3, 4), 1.05);
        assert_eq!(round_sig(9.999_87e-7, 4), 1e-6);
        assert_eq!(round_sig(1_000_023.0, 4), 1e6);
        assert_eq!(round_sig(0.533_516, 4), 0.5335);
    }
}
