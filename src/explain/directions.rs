//! The directions of bug families at a replayed step, for the systematic test
//! (`compare::systematic`): computed by the CPU reference from the inputs replay fed both sides.
//!
//! - `moe_routed` (a routed-experts step): each routed expert's weighted contribution
//!   `C_e[t] = sum_k [ids[t,k] = e] w[t,k] Y_e(x_t)` (`[T, hidden]`, zero on rows that do not
//!   route to `e`: held on its tokens' rows only, `[n_e, hidden]` with the rows named, so that
//!   a long prompt's 256 experts take `T k hidden` values, not `256 T hidden`). The routed sum is `sum_e C_e`; an expert whose output is scaled by `1 + a`
//!   (a wrong block scale in its down projection, a wrong per-expert scale) adds `a C_e`.
//! - `attn_heads` (an attention step): `D = (f(s (1 + h)) - f(s)) / h`, the change of the
//!   heads per relative change of the softmax scale `s` (`h` = [`SCALE_STEP`]): a scale off by
//!   `1 + a` (a YaRN mscale applied once more or missing, a wrong head dimension) adds about
//!   `a D`.
//!
//!   At the same step, the direction of a RoPE base change inside its inputs (`q_pe`, `k_pe`
//!   rotated back and forward by the moved base's angles): where a trace lacks the rotated
//!   values (RoPE fused into attention), a wrong base shows first at `attn_heads`.
//! - `q_pe_rope`, `k_pe_rope` (a RoPE step): `D = (f(theta (1 + h)) - f(theta)) / h`, the
//!   change of the rotated values per relative change of the frequency base (YaRN's ramp and
//!   factor recomputed for the moved base, as an engine with that base computes them): a wrong
//!   `rope_theta` adds about `a D`.
//!
//! Cost: what the reference already computed from the same inputs is taken from it
//! ([`Own`]): the attention's output (the base of both attention directions) and each routed
//! expert's outputs where the expert got the same tokens with the same values; the rest is
//! computed here: two more attentions per attention step (the scale and the base moved, from
//! one product `kv = kv_a_norm kv_b^T`, [`CpuEngine::kv_product`]; on at most
//! [`ATTENTION_DIRECTION_ROWS`] query rows of a long prompt), and the outputs of experts whose
//! tokens changed (the candidate's routing in replay).

use std::collections::HashMap;

use anyhow::{bail, Result};

use crate::compare::systematic::Part;
use crate::engine::cpu::math::rotate_pairs;
use crate::engine::cpu::{mla_host_kv, CpuEngine};
use crate::engine::{Engine, HostTensor, MlaInputs};
use crate::model::steps::{Op, Step};
use crate::model::{rope, RopeSlice};

/// The relative step of the softmax scale and the RoPE base for their directions.
pub const SCALE_STEP: f64 = 0.01;

/// Query rows an attention step's directions are computed on, at most. A longer prompt's
/// directions are computed on every k-th row (the last row included, the rows spread over every
/// position), and their coefficients are fitted over those rows alone
/// ([`crate::compare::systematic::Direction::sampled`]): the two moved attentions cost
/// `1024 / T` of the step's own. What that costs in significance: a coefficient's standard
/// error grows as `sqrt(T / 1024)`, about 2x at 4096 tokens, where a softmax scale 2% off
/// still shows at thousands of them (measured on the H200: 2928 from the sampled rows, 3599
/// from every row; docs/gpu.md); the noise of a correct engine's gain is estimated from the
/// same rows, so the threshold keeps its meaning.
pub const ATTENTION_DIRECTION_ROWS: usize = 1024;

/// The query rows of a `t`-row attention its directions are computed on (`most` at most: every
/// `ceil(t / most)`-th row counted back from the last); `None`: every row.
fn sampled_rows(t: usize, most: usize) -> Option<Vec<usize>> {
    if t <= most || most == 0 {
        return None;
    }
    let stride = t.div_ceil(most);
    let mut rows: Vec<usize> = (0..t).rev().step_by(stride).collect();
    rows.reverse();
    Some(rows)
}

/// What the reference computed itself at a step, which the directions reuse instead of
/// computing again (each only where it is what they would compute: the same arithmetic on the
/// same bits).
#[derive(Clone, Copy, Default)]
pub struct Own<'a> {
    /// The reference's output at the hook, from exactly the inputs the directions are asked
    /// for (the reference side of the hook's pair).
    pub output: Option<&'a HostTensor>,
    /// A routed-experts step's own run: the inputs it read (`x`, ids, weights) and each
    /// expert's unweighted outputs on its tokens (`[n_e, hidden]`, tokens in order), by expert.
    pub experts: Option<(&'a [HostTensor], &'a HashMap<usize, HostTensor>)>,
}

/// The directions of the bug families of `step` at `hook`, from the step's replay `inputs`
/// (one per `step.inputs`); empty for a step without a family. What `own` holds is taken
/// instead of computed where it is the same.
pub fn parts(
    cpu: &CpuEngine<'_>,
    step: &Step,
    inputs: &[HostTensor],
    hook: &str,
    own: Own<'_>,
) -> Result<Vec<Part>> {
    if step.outputs.first().map(String::as_str) != Some(hook) {
        return Ok(Vec::new());
    }
    match &step.op {
        Op::MoeExperts { layer } if inputs.len() >= 3 => experts(
            cpu,
            *layer,
            [&inputs[0], &inputs[1], &inputs[2]],
            own.experts,
        ),
        Op::Attention { layer } if inputs.len() >= 4 => {
            softmax_scale(cpu, *layer, inputs, own.output, ATTENTION_DIRECTION_ROWS)
        }
        Op::Rope(slice) if !inputs.is_empty() => rope_theta(cpu, slice, &inputs[0]),
        _ => Ok(Vec::new()),
    }
}

/// The tokens routed to each expert (`ids` `[T, k]`), in token order.
fn routed_tokens(ids: &[i32], k: usize) -> HashMap<i32, Vec<usize>> {
    let mut m: HashMap<i32, Vec<usize>> = HashMap::new();
    for (i, &e) in ids.iter().enumerate() {
        m.entry(e).or_default().push(i / k.max(1));
    }
    m
}

/// Each routed expert's weighted contribution to the routed sum (module documentation), from
/// the step's inputs `[x, ids, w]`; an expert's outputs are taken from `own` (the reference's
/// run: its inputs and outputs) where its `x` has the same bits and the expert the same tokens.
fn experts(
    cpu: &CpuEngine<'_>,
    layer: usize,
    [x, ids, w]: [&HostTensor; 3],
    own: Option<(&[HostTensor], &HashMap<usize, HostTensor>)>,
) -> Result<Vec<Part>> {
    let (t, hidden) = x.dims2("moe input")?;
    let (ti, k) = ids.dims2("moe_topk_ids")?;
    if ti != t || w.shape != ids.shape {
        bail!(
            "systematic: layer {layer} experts: input {:?}, ids {:?}, weights {:?} disagree",
            x.shape,
            ids.shape,
            w.shape
        );
    }
    let (xv, idv, wv) = (x.as_f32("x")?, ids.as_i32("ids")?, w.as_f32("w")?);
    let n_expert = cpu.weights().hparams().n_expert;
    // The reference's own run, when it read the same x: its tokens per expert and outputs.
    let own = own.and_then(|(inputs, outputs)| {
        let (ox, oids) = (inputs.first()?, inputs.get(1)?);
        if !ox.same_bits(x) || oids.shape.get(1) != Some(&k) {
            return None;
        }
        Some((routed_tokens(oids.as_i32("ids").ok()?, k), outputs))
    });
    let mut out = Vec::new();
    for e in 0..n_expert {
        // The (token, weight) pairs routed to e, in token order.
        let routed: Vec<(usize, f32)> = (0..t * k)
            .filter(|&i| idv[i] == e as i32)
            .map(|i| (i / k, wv[i]))
            .collect();
        if routed.is_empty() {
            continue;
        }
        let same_tokens = |toks: &Vec<usize>| toks.iter().copied().eq(routed.iter().map(|r| r.0));
        let reused = own.as_ref().and_then(|(tokens, outputs)| {
            let y = outputs.get(&e)?;
            (tokens.get(&(e as i32)).is_some_and(same_tokens) && y.shape == [routed.len(), hidden])
                .then(|| y.as_f32("expert output").ok())
                .flatten()
        });
        let computed;
        let y: &[f32] = match reused {
            Some(y) => y,
            None => {
                let xs: Vec<f32> = routed
                    .iter()
                    .flat_map(|&(tok, _)| xv[tok * hidden..(tok + 1) * hidden].iter().copied())
                    .collect();
                let rows = cpu.expert_rows(layer, e)?;
                computed = cpu.expert_output(&rows, &xs, routed.len())?; // [n_e, hidden]
                &computed
            }
        };
        // Its tokens' rows only, zero in the others ([n_rows, hidden]); a token routed to it
        // twice (a candidate's selection in replay) adds both into its row.
        let mut rows: Vec<usize> = Vec::new();
        let mut c: Vec<f32> = Vec::with_capacity(routed.len() * hidden);
        for (j, &(tok, wt)) in routed.iter().enumerate() {
            let y = &y[j * hidden..(j + 1) * hidden];
            if rows.last() == Some(&tok) {
                let at = c.len() - hidden;
                for (a, &v) in c[at..].iter_mut().zip(y) {
                    *a += wt * v;
                }
            } else {
                rows.push(tok);
                c.extend(y.iter().map(|&v| wt * v));
            }
        }
        out.push(Part {
            label: format!("expert {e}"),
            family: "expert",
            tensor: HostTensor::f32(vec![rows.len(), hidden], c)?,
            rows: Some(rows),
            sampled: false,
        });
    }
    Ok(out)
}

/// The direction of a softmax-scale change at an attention step (module documentation), and
/// of a RoPE base change inside its inputs, on `most` query rows at most
/// ([`ATTENTION_DIRECTION_ROWS`]). `own`: the reference's output from the same inputs (the
/// base), when it has the whole step's shape.
fn softmax_scale(
    cpu: &CpuEngine<'_>,
    layer: usize,
    inputs: &[HostTensor],
    own: Option<&HostTensor>,
    most: usize,
) -> Result<Vec<Part>> {
    let hp = cpu.weights().hparams();
    // The keys and values before the heads' split, once for both attentions (and the base's).
    let kv = cpu.kv_product(layer, &inputs[2])?;
    let scale = rope::softmax_scale(hp);
    let t = inputs[0].shape.first().copied().unwrap_or(0);
    let rows = sampled_rows(t, most);
    let rows = rows.as_deref();
    let inp = || MlaInputs {
        q_b: &inputs[0],
        q_pe: &inputs[1],
        kv_norm: &inputs[2],
        k_pe: &inputs[3],
        selection: inputs.get(4),
    };
    // Heads `[n, H*v]` on the n rows.
    let moved = mla_host_kv(
        hp,
        layer,
        inp(),
        &kv,
        scale * (1.0 + SCALE_STEP),
        rows,
        cpu.device(),
    )?;
    let whole = vec![
        t,
        moved.len() / moved.shape.first().copied().unwrap_or(1).max(1),
    ];
    let base = match own.filter(|o| o.shape == whole) {
        Some(o) => match rows {
            Some(r) => o.gather_rows(r)?,
            None => o.clone(),
        },
        None => mla_host_kv(hp, layer, inp(), &kv, scale, rows, cpu.device())?,
    };
    let part_rows = rows.map(<[usize]>::to_vec);
    let mut parts = vec![Part {
        label: "softmax scale".to_string(),
        family: "softmax scale",
        tensor: per_step(&moved, &base)?,
        rows: part_rows.clone(),
        sampled: rows.is_some(),
    }];
    // The RoPE base inside the step's inputs: q_pe and k_pe rotated back by the model's
    // angles and forward by the moved base's (a trace without q_pe_rope/k_pe_rope, whose
    // RoPE is fused into its attention, shows a wrong base only here).
    let params = &hp.rope;
    let mut moved_params = params.clone();
    moved_params.base *= 1.0 + SCALE_STEP;
    let (old, new) = (rope::inv_freq(params), rope::inv_freq(&moved_params));
    let q_pe = rerotate(&inputs[1], &old, &new)?;
    let k_pe = rerotate(&inputs[3], &old, &new)?;
    let moved_inp = MlaInputs {
        q_b: &inputs[0],
        q_pe: &q_pe,
        kv_norm: &inputs[2],
        k_pe: &k_pe,
        selection: inputs.get(4),
    };
    let moved = mla_host_kv(hp, layer, moved_inp, &kv, scale, rows, cpu.device())?;
    parts.push(Part {
        label: "rope theta".to_string(),
        family: "rope theta",
        tensor: per_step(&moved, &base)?,
        rows: part_rows,
        sampled: rows.is_some(),
    });
    Ok(parts)
}

/// Rotated RoPE values (`[T, ...]`, every row a run of interleaved pairs at position `t`)
/// turned back by the angles of `old` and forward by those of `new` (the magnitude factor
/// cancels).
fn rerotate(x: &HostTensor, old: &[f64], new: &[f64]) -> Result<HostTensor> {
    let t = x.shape.first().copied().unwrap_or(0);
    let v = x.as_f32("rope values")?;
    let n = v.len() / t.max(1);
    let rd = old.len() * 2;
    if rd == 0 || n % rd != 0 || new.len() != old.len() {
        bail!(
            "systematic: rope: rows of {n} values do not hold pairs of {rd} rotated values ({:?})",
            x.shape
        );
    }
    let mut out = v.to_vec();
    for (pos, row) in out.chunks_mut(n).enumerate() {
        // The rotation by (new - old) angles.
        let cs: Vec<(f64, f64)> = old
            .iter()
            .zip(new)
            .map(|(&a, &b)| {
                let d = pos as f64 * (b - a);
                (d.cos(), d.sin())
            })
            .collect();
        for chunk in row.chunks_mut(rd) {
            rotate_pairs(chunk, &cs);
        }
    }
    HostTensor::f32(x.shape.clone(), out)
}

/// The direction of a RoPE frequency-base change at a RoPE step (module documentation).
fn rope_theta(cpu: &CpuEngine<'_>, s: &RopeSlice, x: &HostTensor) -> Result<Vec<Part>> {
    let weights = cpu.weights();
    let params = &weights.hparams().rope;
    let mut moved_params = params.clone();
    moved_params.base *= 1.0 + SCALE_STEP;
    let moved_engine = CpuEngine::with_rope(
        weights,
        rope::inv_freq(&moved_params),
        rope::attention_factor(params),
    );
    let base = cpu.rope(x, s)?;
    let moved = moved_engine.rope(x, s)?;
    Ok(vec![Part {
        label: "rope theta".to_string(),
        family: "rope theta",
        tensor: per_step(&moved, &base)?,
        rows: None,
        sampled: false,
    }])
}

/// `(moved - base) / SCALE_STEP`: the change of an output per relative change of a parameter.
fn per_step(moved: &HostTensor, base: &HostTensor) -> Result<HostTensor> {
    let d: Vec<f32> = moved
        .as_f32("moved output")?
        .iter()
        .zip(base.as_f32("output")?)
        .map(|(&a, &b)| ((f64::from(a) - f64::from(b)) / SCALE_STEP) as f32)
        .collect();
    HostTensor::f32(base.shape.clone(), d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::mla_host;
    use crate::engine::ExpertInputs;
    use crate::gguf::Model;
    use crate::model::Weights;
    use crate::util::rng::SplitMix64;
    use std::path::Path;

    fn model() -> Model {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
        Model::open(&p).unwrap()
    }

    fn random(rng: &mut SplitMix64, shape: Vec<usize>) -> HostTensor {
        let n = shape.iter().product();
        HostTensor::f32(shape, (0..n).map(|_| rng.uniform() - 0.5).collect()).unwrap()
    }

    /// Random inputs of layer 0's attention for `t` tokens: q_b, q_pe, kv_a_norm, k_pe.
    fn attention_inputs(hp: &crate::model::HParams, t: usize, seed: u64) -> Vec<HostTensor> {
        let mut rng = SplitMix64::new(seed);
        vec![
            random(&mut rng, vec![t, hp.n_head * hp.qk_head()]),
            random(&mut rng, vec![t, hp.n_head, hp.qk_rope]),
            random(&mut rng, vec![t, hp.kv_lora_rank]),
            random(&mut rng, vec![t, hp.qk_rope]),
        ]
    }

    /// Layer 0's attention heads from `inputs` with softmax scale `scale`, from kv_b (not the
    /// kv product the directions use).
    fn heads(cpu: &CpuEngine<'_>, inputs: &[HostTensor], scale: f64) -> HostTensor {
        let hp = cpu.weights().hparams();
        let kv_b = cpu.host_kv_b(0).unwrap();
        let x = MlaInputs {
            q_b: &inputs[0],
            q_pe: &inputs[1],
            kv_norm: &inputs[2],
            k_pe: &inputs[3],
            selection: None,
        };
        mla_host(hp, 0, x, &kv_b, scale, false).unwrap().0
    }

    fn same(a: &[Part], b: &[Part]) -> bool {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                x.label == y.label && x.family == y.family && x.tensor.same_bits(&y.tensor)
            })
    }

    /// The systematic test's view of `parts`.
    fn directions(parts: &[Part]) -> Vec<crate::compare::systematic::Direction<'_>> {
        parts
            .iter()
            .map(|p| crate::compare::systematic::Direction {
                label: &p.label,
                family: p.family,
                values: p.tensor.as_f32("").unwrap(),
                rows: p.rows.as_deref(),
                sampled: p.sampled,
            })
            .collect()
    }

    /// The expert directions from the reference's own outputs are the computed ones bit for
    /// bit, also when the routing changed for some tokens (those experts are computed), and
    /// an own run from other values of `x` is not taken.
    #[test]
    fn own_expert_outputs_give_the_same_directions() {
        let m = model();
        let w = Weights::new(&m).unwrap();
        let cpu = CpuEngine::new(&w);
        let hp = w.hparams();
        let layer = hp.n_dense; // the first MoE layer
        let (t, k, hidden) = (6, hp.n_expert_used, hp.hidden);
        let mut rng = SplitMix64::new(11);
        let x = random(&mut rng, vec![t, hidden]);
        let ids: Vec<i32> = (0..t * k)
            .map(|i| ((i / k * 3 + i % k) % hp.n_expert) as i32)
            .collect();
        let ids = HostTensor::i32(vec![t, k], ids).unwrap();
        let wts = random(&mut rng, vec![t, k]);
        let own = cpu
            .moe_experts(
                layer,
                ExpertInputs {
                    x: &x,
                    ids: &ids,
                    weights: &wts,
                },
                &|_| true,
            )
            .unwrap();
        let outputs: HashMap<usize, HostTensor> = own.experts.into_iter().collect();
        let inputs = [x.clone(), ids.clone(), wts.clone()];
        let computed = experts(&cpu, layer, [&x, &ids, &wts], None).unwrap();
        assert!(!computed.is_empty());
        let reused = experts(&cpu, layer, [&x, &ids, &wts], Some((&inputs, &outputs))).unwrap();
        assert!(same(&computed, &reused));

        // Token 0 routed elsewhere: its old and new experts get other tokens.
        let mut moved = ids.as_i32("ids").unwrap().to_vec();
        moved[0] = ((moved[0] as usize + k) % hp.n_expert) as i32;
        let moved = HostTensor::i32(vec![t, k], moved).unwrap();
        let want = experts(&cpu, layer, [&x, &moved, &wts], None).unwrap();
        let got = experts(&cpu, layer, [&x, &moved, &wts], Some((&inputs, &outputs))).unwrap();
        assert!(same(&want, &got));
        assert!(!same(&want, &computed));

        // Outputs of other inputs are not taken.
        let other = random(&mut rng, vec![t, hidden]);
        let want = experts(&cpu, layer, [&other, &ids, &wts], None).unwrap();
        let got = experts(&cpu, layer, [&other, &ids, &wts], Some((&inputs, &outputs))).unwrap();
        assert!(same(&want, &got));
    }

    /// The attention directions with the reference's output as their base are the computed
    /// ones bit for bit.
    #[test]
    fn own_attention_output_gives_the_same_directions() {
        let m = model();
        let w = Weights::new(&m).unwrap();
        let cpu = CpuEngine::new(&w);
        let hp = w.hparams();
        let t = 5;
        let inputs = attention_inputs(hp, t, 12);
        let base = heads(&cpu, &inputs, rope::softmax_scale(hp));
        let computed = softmax_scale(&cpu, 0, &inputs, None, t).unwrap();
        let reused = softmax_scale(&cpu, 0, &inputs, Some(&base), t).unwrap();
        assert_eq!(computed.len(), 2);
        assert!(same(&computed, &reused));
        assert!(computed.iter().all(|p| p.rows.is_none()));
        // On sampled rows (of 5: rows 1 and 4, then 0, 2 and 4): the whole directions' rows,
        // bit for bit, from the base computed or taken.
        for most in [2, 3] {
            let rows = sampled_rows(t, most).unwrap();
            assert_eq!(rows.last(), Some(&(t - 1)));
            assert!(rows.len() <= most);
            for own in [None, Some(&base)] {
                let sampled = softmax_scale(&cpu, 0, &inputs, own, most).unwrap();
                assert_eq!(sampled.len(), 2);
                for (s, c) in sampled.iter().zip(&computed) {
                    assert_eq!(s.rows.as_deref(), Some(rows.as_slice()));
                    assert!(s.tensor.same_bits(&c.tensor.gather_rows(&rows).unwrap()));
                }
            }
        }
    }

    /// A softmax scale 2% off is named from directions on sampled rows as from the whole ones
    /// (the gain within its standard errors, which grow with fewer rows), and a correct
    /// candidate (the reference with independent noise) is named from neither. The expected
    /// gain is the plant's, not a fit of glmdiff's own.
    #[test]
    fn sampled_attention_directions_name_a_scale_as_the_whole_ones() {
        use crate::compare::systematic::{analyse, Group, Layout};
        let m = model();
        let w = Weights::new(&m).unwrap();
        let cpu = CpuEngine::new(&w);
        let hp = w.hparams();
        let t = 96;
        let inputs = attention_inputs(hp, t, 13);
        let mut rng = SplitMix64::new(14);
        let heads = |scale: f64| heads(&cpu, &inputs, scale);
        let scale = rope::softmax_scale(hp);
        let base = heads(scale);
        let r = base.as_f32("base").unwrap();
        let size = (r.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / r.len() as f64).sqrt();
        // Noise of about 1e-3 of the values' size on every element, as rounding leaves.
        let noisy = |v: &[f32], rng: &mut SplitMix64| -> Vec<f32> {
            v.iter()
                .map(|&x| x + (f64::from(rng.normal()) * 1e-3 * size) as f32)
                .collect()
        };
        let planted = noisy(heads(scale * 1.02).as_f32("planted").unwrap(), &mut rng);
        let correct = noisy(r, &mut rng);
        let layout = Layout {
            rows: t,
            cols: r.len() / t,
            heads: Some(hp.n_head),
        };
        let fit = |c: &[f32], most: usize| {
            let parts = softmax_scale(&cpu, 0, &inputs, Some(&base), most).unwrap();
            analyse(r, c, layout, &directions(&parts)).unwrap()
        };
        let whole = fit(&planted, t);
        let sampled = fit(&planted, 24);
        for s in [&whole, &sampled] {
            let f = s.finding.as_ref().expect("the planted scale is named");
            assert_eq!(f.group, Group::Part("softmax scale".to_string()));
            assert!((f.gain - 1.02).abs() < 0.002, "gain {}", f.gain);
            assert!(
                (f.gain - 1.02).abs() < 4.0 * f.se,
                "gain {} se {}",
                f.gain,
                f.se
            );
        }
        let (fw, fs) = (whole.finding.unwrap(), sampled.finding.unwrap());
        assert!(fs.se > fw.se, "se sampled {} whole {}", fs.se, fw.se);
        for most in [t, 24] {
            let s = fit(&correct, most);
            assert!(s.finding.is_none(), "{most} rows: {:?}", s.finding);
        }
    }

    /// Rounding shared by every head and every query row is not a bug family's direction: a
    /// bf16 engine's RoPE tables (cos and sin times YaRN's attention factor, rounded once per
    /// position and frequency and read by every head), its rotated `k_pe` (one head, read by
    /// every query) and its keys and values from the latent (rounded once, read by every
    /// query), with its heads rounded to bf16, give no finding at a replayed attention step on
    /// DeepSeek-V3 tiny (YaRN, original context 256) and GLM-5 tiny at 12 to 2048 tokens (the
    /// largest direction at 2.3 standard errors), while the same engine with a softmax scale
    /// 2% off is named at every length and with a RoPE base 2% off from 300 tokens (at a few
    /// dozen positions a 2% base turns no angle far enough to tell: DeepSeek-V3 tiny's is
    /// named from 48, GLM-5 tiny's not at 48).
    #[test]
    fn shared_rounding_inside_attention_is_not_a_direction() {
        for (model, yarn) in [
            ("dsv3-tiny/dsv3-tiny-f32.gguf", true),
            ("glm5-tiny/glm5-tiny-f32.gguf", false),
        ] {
            shared_rounding_on(model, yarn);
        }
    }

    /// A table of `(cos, sin)` per rotated pair at a position.
    type Table<'a> = &'a dyn Fn(usize) -> Vec<(f64, f64)>;

    fn bf16(x: f64) -> f64 {
        half::bf16::from_f64(x).to_f64()
    }

    /// `x` `[T, heads * rd]` of interleaved pairs rotated at each row's position by `cs(pos)`,
    /// each value rounded by `round`.
    fn rotate(x: &HostTensor, cs: Table<'_>, round: &dyn Fn(f64) -> f64) -> HostTensor {
        let t = x.shape[0];
        let v = x.as_f32("x").unwrap();
        let n = v.len() / t;
        let mut out = Vec::with_capacity(v.len());
        for (pos, row) in v.chunks(n).enumerate() {
            let c = cs(pos);
            for pair in row.chunks(2 * c.len()) {
                for (p, &(co, si)) in pair.chunks(2).zip(&c) {
                    let (x0, x1) = (f64::from(p[0]), f64::from(p[1]));
                    out.push(round(x0 * co - x1 * si) as f32);
                    out.push(round(x0 * si + x1 * co) as f32);
                }
            }
        }
        HostTensor::f32(x.shape.clone(), out).unwrap()
    }

    /// Layer 0's attention inputs of `t` tokens before RoPE, and the reference's and a bf16
    /// engine's rotations of them.
    struct Shared<'a, 'w> {
        cpu: &'a CpuEngine<'w>,
        raw: Vec<HostTensor>,
        q_pe: HostTensor,
        t: usize,
    }

    impl Shared<'_, '_> {
        fn heads3(&self, x: HostTensor) -> HostTensor {
            let hp = self.cpu.weights().hparams();
            let shape = vec![self.t, hp.n_head, hp.qk_rope];
            HostTensor::f32(shape, x.as_f32("q_pe").unwrap().to_vec()).unwrap()
        }

        /// The reference's inputs: q_pe and k_pe rotated by the exact tables.
        fn reference(&self) -> Vec<HostTensor> {
            let exact = |pos: usize| self.cpu.cos_sin(pos);
            let keep = |x: f64| f64::from(x as f32);
            vec![
                self.raw[0].clone(),
                self.heads3(rotate(&self.q_pe, &exact, &keep)),
                self.raw[2].clone(),
                rotate(&self.raw[3], &exact, &keep),
            ]
        }

        /// A bf16 engine's heads with tables `cs` and softmax scale `s`: q_pe and k_pe rotated
        /// and rounded, keys and values from the latent rounded, the heads rounded.
        fn engine(&self, cs: Table<'_>, s: f64) -> Vec<f32> {
            let hp = self.cpu.weights().hparams();
            let kv = self.cpu.kv_product(0, &self.raw[2]).unwrap();
            let kv: Vec<f32> = kv.iter().map(|&x| bf16(f64::from(x)) as f32).collect();
            let q_pe = self.heads3(rotate(&self.q_pe, cs, &bf16));
            let k_pe = rotate(&self.raw[3], cs, &bf16);
            let x = MlaInputs {
                q_b: &self.raw[0],
                q_pe: &q_pe,
                kv_norm: &self.raw[2],
                k_pe: &k_pe,
                selection: None,
            };
            let out = mla_host_kv(hp, 0, x, &kv, s, None, None).unwrap();
            let v = out.as_f32("heads").unwrap();
            v.iter().map(|&x| bf16(f64::from(x)) as f32).collect()
        }
    }

    fn shared_rounding_on(model: &str, yarn: bool) {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/models")
            .join(model);
        let m = Model::open(&p).unwrap();
        let w = Weights::new(&m).unwrap();
        let cpu = CpuEngine::new(&w);
        let hp = w.hparams();
        assert_eq!(hp.rope.yarn.is_some(), yarn, "{model}");
        for (t, seed) in [
            (12, 21),
            (48, 22),
            (120, 23),
            (300, 24),
            (600, 25),
            (2048, 26),
        ] {
            let raw = attention_inputs(hp, t, seed);
            let q_pe = HostTensor::f32(
                vec![t, hp.n_head * hp.qk_rope],
                raw[1].as_f32("q_pe").unwrap().to_vec(),
            )
            .unwrap();
            let case = Shared {
                cpu: &cpu,
                raw,
                q_pe,
                t,
            };
            shared_rounding_at(model, &case);
        }
    }

    /// The checks of [`shared_rounding_inside_attention_is_not_a_direction`] at one length.
    fn shared_rounding_at(model: &str, case: &Shared<'_, '_>) {
        use crate::compare::systematic::{analyse, Group, Layout};
        let (cpu, t) = (case.cpu, case.t);
        let hp = cpu.weights().hparams();
        let scale = rope::softmax_scale(hp);
        let rounded = |pos: usize| -> Vec<(f64, f64)> {
            cpu.cos_sin(pos)
                .into_iter()
                .map(|(c, s)| (bf16(c), bf16(s)))
                .collect()
        };
        let mut moved_params = hp.rope.clone();
        moved_params.base *= 1.02;
        let moved_freq = rope::inv_freq(&moved_params);
        let factor = rope::attention_factor(&hp.rope);
        let moved = |pos: usize| -> Vec<(f64, f64)> {
            moved_freq
                .iter()
                .map(|&f| {
                    let a = pos as f64 * f;
                    (bf16(a.cos() * factor), bf16(a.sin() * factor))
                })
                .collect()
        };
        let reference = case.reference();
        let kv = cpu.kv_product(0, &reference[2]).unwrap();
        let x = MlaInputs {
            q_b: &reference[0],
            q_pe: &reference[1],
            kv_norm: &reference[2],
            k_pe: &reference[3],
            selection: None,
        };
        let base = mla_host_kv(hp, 0, x, &kv, scale, None, None).unwrap();
        let r = base.as_f32("base").unwrap();
        let parts = softmax_scale(cpu, 0, &reference, Some(&base), usize::MAX).unwrap();
        let dirs = directions(&parts);
        let layout = Layout {
            rows: t,
            cols: r.len() / t,
            heads: Some(hp.n_head),
        };
        let s = analyse(r, &case.engine(&rounded, scale), layout, &dirs).expect("tested");
        assert!(
            s.finding.is_none(),
            "{model}, {t} tokens: a correct bf16 engine named: {:?}",
            s.finding
        );
        let best = s.best_part.as_ref().map_or(0.0, |g| g.sigma);
        assert!(best < 4.0, "{model}, {t} tokens: {:?}", s.best_part);
        for (c, name) in [
            (case.engine(&moved, scale), "rope theta"),
            (case.engine(&rounded, scale * 1.02), "softmax scale"),
        ] {
            if name == "rope theta" && t < 300 {
                continue;
            }
            let s = analyse(r, &c, layout, &dirs).expect("tested");
            let f = s
                .finding
                .as_ref()
                .unwrap_or_else(|| panic!("{model}, {t} tokens: {name} 2% off not named: {s:?}"));
            assert_eq!(
                f.group,
                Group::Part(name.to_string()),
                "{model}, {t}: {f:?}"
            );
            assert!((f.gain - 1.02).abs() < 0.004, "{model}, {t}: {f:?}");
        }
    }
}
