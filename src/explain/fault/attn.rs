//! The attention, norm and projection faults: what each can apply to ([`check`]) and their host
//! arithmetic (a kv_b split the wrong way, scaled weights and scores, RoPE tables with another
//! base or YaRN magnitude, the softmax scale). Nothing here is used by the reference.

use anyhow::{bail, Result};

use super::{FaultKind, Mscale};
use crate::engine::cpu::Matrix;
use crate::model::names::{self, blk};
use crate::model::steps::{self, Op};
use crate::model::{rope, HParams, Weights};
use crate::util::glob::matches as glob_match;

/// Whether tensor `name` matches `glob`: a layer's tensor by its suffix (without `blk.L.`), a
/// global tensor (`output.weight`, `output_norm.weight`) by its full name.
pub fn matches(glob: &str, name: &str) -> bool {
    match names::split_blk(name) {
        Some((_, suffix)) => glob_match(glob, suffix),
        None => glob_match(glob, name),
    }
}

/// kv_b as an engine that splits a per-head kv_b as if it were all heads' K rows, then all V
/// rows, uses it, written back in the per-head layout attention reads. In: HF `kv_b_proj`
/// `[H*(nope+v), kv_lora]`. Out: head `h`'s K rows are rows `h*nope..(h+1)*nope` of the input
/// and its V rows `H*nope + h*v..H*nope + (h+1)*v`. The inverse of
/// [`super::host::kv_b_concat`].
pub fn kv_b_split(kv: &Matrix, heads: usize, nope: usize, v: usize) -> Matrix {
    let mut data = Vec::with_capacity(kv.data.len());
    for h in 0..heads {
        for d in 0..nope {
            data.extend_from_slice(kv.row(h * nope + d));
        }
        for j in 0..v {
            data.extend_from_slice(kv.row(heads * nope + h * v + j));
        }
    }
    Matrix {
        rows: kv.rows,
        cols: kv.cols,
        data,
    }
}

/// Multiplies every value by `f` (in f64, rounded back to f32).
pub fn scale(data: &mut [f32], f: f64) {
    for x in data {
        *x = (f64::from(*x) * f) as f32;
    }
}

/// Multiplies the finite values by `f` (scores: the masked entries stay `-inf`).
pub fn scale_finite(data: &mut [f32], f: f64) {
    for x in data.iter_mut().filter(|x| x.is_finite()) {
        *x = (f64::from(*x) * f) as f32;
    }
}

/// Multiplies the K rows of every head of a per-head kv_b (`[H*(nope+v), kv_lora]`) by `k` and
/// its V rows by `v_factor`.
pub fn scale_kv_b(kv: &mut Matrix, nope: usize, v: usize, k: f64, v_factor: f64) {
    let per = nope + v;
    let cols = kv.cols;
    for (r, row) in kv.data.chunks_exact_mut(cols.max(1)).enumerate() {
        let f = if r % per < nope { k } else { v_factor };
        if f != 1.0 {
            scale(row, f);
        }
    }
}

/// The product of the factors of the `weight_scale` kinds in `kinds` whose glob matches tensor
/// `name` (`None` when none does).
pub fn weight_factor<'k>(
    kinds: impl IntoIterator<Item = &'k FaultKind>,
    name: &str,
) -> Option<f64> {
    kinds
        .into_iter()
        .filter_map(|k| match k {
            FaultKind::WeightScale { glob, factor } if matches(glob, name) => Some(*factor),
            _ => None,
        })
        .reduce(|a, b| a * b)
}

/// The RoPE tables (inverse frequencies, cos/sin factor) of an engine with the `rope_theta`,
/// `yarn_factor` and `yarn_mscale` kinds among `kinds`, `None` when there is none.
pub fn rope_tables<'k>(
    hp: &HParams,
    kinds: impl IntoIterator<Item = &'k FaultKind>,
) -> Option<(Vec<f64>, f64)> {
    let mut r = hp.rope.clone();
    let (mut touched, mut dropped, mut extra) = (false, false, 1.0);
    for k in kinds {
        match k {
            FaultKind::RopeTheta(x) => {
                r.base = *x;
                touched = true;
            }
            FaultKind::YarnFactor(x) => {
                if let Some(y) = &mut r.yarn {
                    y.factor = *x;
                }
                touched = true;
            }
            FaultKind::YarnMscale(Mscale::Missing) => {
                dropped = true;
                touched = true;
            }
            FaultKind::YarnMscale(Mscale::Twice) => {
                // ggml's rope_yarn magnitude, `1 + 0.1 ln(factor)`, not cancelled.
                if let Some(y) = &r.yarn {
                    extra *= rope::yarn_get_mscale(y.factor, 1.0);
                }
                touched = true;
            }
            _ => {}
        }
    }
    if !touched {
        return None;
    }
    let factor = if dropped {
        1.0
    } else {
        rope::attention_factor(&r)
    };
    Some((rope::inv_freq(&r), factor * extra))
}

/// The MLA softmax scale of an engine with the kinds `kinds`: the model's
/// ([`rope::softmax_scale`]; with `yarn_factor`'s factor in its `mscale^2`), without YaRN's
/// `mscale^2` under `yarn_mscale:none`, from the
/// latent width under `scale_latent`, times every `softmax_scale` factor.
pub fn softmax_scale<'k>(hp: &HParams, kinds: impl IntoIterator<Item = &'k FaultKind>) -> f64 {
    let kinds: Vec<&FaultKind> = kinds.into_iter().collect();
    let factor = kinds.iter().find_map(|k| match k {
        FaultKind::YarnFactor(x) => Some(*x),
        _ => None,
    });
    let mut scale = if kinds.contains(&&FaultKind::YarnMscale(Mscale::Missing)) {
        1.0 / (hp.qk_head() as f64).sqrt()
    } else if let (Some(x), Some(_)) = (factor, &hp.rope.yarn) {
        // The mscale^2 of the engine's factor.
        let mut h = hp.clone();
        if let Some(y) = &mut h.rope.yarn {
            y.factor = x;
        }
        rope::softmax_scale(&h)
    } else {
        rope::softmax_scale(hp)
    };
    if kinds.contains(&&FaultKind::ScaleLatent) {
        scale *= latent_ratio(hp);
    }
    for k in kinds {
        if let FaultKind::SoftmaxScale(f) = k {
            scale *= f;
        }
    }
    scale
}

/// `scale_latent`'s factor on the softmax scale: `sqrt(nope + rope) / sqrt(kv_lora + rope)`.
pub fn latent_ratio(hp: &HParams) -> f64 {
    (hp.qk_head() as f64).sqrt() / ((hp.kv_lora_rank + hp.qk_rope) as f64).sqrt()
}

/// The YaRN `mscale` of the model's softmax scale (`0.1 * mscale_all_dim * ln(factor) + 1`),
/// `None` without YaRN or `mscale_all_dim`.
pub fn yarn_mscale(hp: &HParams) -> Option<f64> {
    let y = hp.rope.yarn.as_ref()?;
    Some(rope::yarn_get_mscale(y.factor, y.mscale_all_dim?))
}

/// The product of the `indexer_scale` and `indexer_wproj_scale` factors among `kinds` (`None`
/// when there is none): both multiply every index score.
pub fn indexer_factor<'k>(kinds: impl IntoIterator<Item = &'k FaultKind>) -> Option<f64> {
    kinds
        .into_iter()
        .filter_map(|k| match k {
            FaultKind::IndexerScale(f) | FaultKind::IndexerWprojScale(f) => Some(*f),
            _ => None,
        })
        .reduce(|a, b| a * b)
}

/// The tensors of layer `l` (or the tail when `l` is `None`) that `weight_scale` can change:
/// the projections (router and shared expert included), the RMSNorm weights and kv_b.
fn scalable(weights: &Weights<'_>, l: Option<usize>) -> Vec<String> {
    let hp = weights.hparams();
    let steps = match l {
        Some(l) => steps::layer_steps(hp, l),
        None => steps::tail_steps(hp, hp.n_layer, weights.output_name()),
    };
    let mut v = Vec::new();
    for s in &steps {
        match &s.op {
            Op::RmsNorm { weight, .. } | Op::Linear { weight } => v.push(weight.clone()),
            Op::RouterLogits { layer } => v.push(names::blk(*layer, blk::FFN_GATE_INP)),
            Op::Mlp { gate, up, down } => v.extend([gate.clone(), up.clone(), down.clone()]),
            Op::Attention { layer } => v.extend(weights.kv_b_names(*layer)),
            _ => {}
        }
    }
    v
}

/// The RMSNorm weights of layer `l` (or the tail's when `None`).
fn norms(hp: &HParams, weights: &Weights<'_>, l: Option<usize>) -> Vec<String> {
    let steps = match l {
        Some(l) => steps::layer_steps(hp, l),
        None => steps::tail_steps(hp, hp.n_layer, weights.output_name()),
    };
    steps
        .iter()
        .filter_map(|s| match &s.op {
            Op::RmsNorm { weight, .. } => Some(weight.clone()),
            _ => None,
        })
        .collect()
}

/// Checks that `kind` (one of this module's kinds, written `me`) applies to `weights` over
/// `layers` (and the final norm and output projection when `global`): clear errors for a model
/// without YaRN or a DSA indexer, a glob that matches nothing it can change, a value that is
/// the model's own.
pub(super) fn check(
    kind: &FaultKind,
    me: &str,
    weights: &Weights<'_>,
    layers: &[usize],
    global: bool,
) -> Result<()> {
    let hp = weights.hparams();
    let mut scopes: Vec<Option<usize>> = layers.iter().map(|&l| Some(l)).collect();
    if global {
        scopes.push(None);
    }
    let need_indexer = || super::need_indexer(me, weights, layers).map(|ix| ix.top_k);
    match kind {
        FaultKind::WeightScale { glob, .. } => {
            let mut hit = 0;
            let mut elsewhere: Vec<String> = Vec::new();
            for &s in &scopes {
                let ok = scalable(weights, s);
                hit += ok.iter().filter(|n| matches(glob, n)).count();
                if let Some(l) = s {
                    let all = steps::weights_of(&steps::layer_steps(hp, l), weights);
                    elsewhere.extend(
                        all.into_iter()
                            .filter(|n| matches(glob, n) && !ok.contains(n)),
                    );
                }
            }
            if hit == 0 && !elsewhere.is_empty() {
                bail!(
                    "--inject {me}: weight_scale changes projections, RMSNorm weights and kv_b; {} {} read inside the DSA indexer or the routed experts",
                    elsewhere.join(", "),
                    if elsewhere.len() == 1 { "is" } else { "are" }
                );
            }
            if hit == 0 {
                bail!("--inject {me}: no tensor of layers {layers:?} matches {glob:?} (matched against the name without blk.L., e.g. attn_output.weight, or a global tensor's full name, output.weight)");
            }
        }
        FaultKind::NormOnePlus { glob } => {
            let hit = scopes
                .iter()
                .flat_map(|&s| norms(hp, weights, s))
                .filter(|n| matches(glob, n))
                .count();
            if hit == 0 {
                bail!("--inject {me}: no RMSNorm weight of layers {layers:?} matches {glob:?} (e.g. attn_norm.weight, attn_q_a_norm.weight)");
            }
        }
        FaultKind::YarnMscale(_) if hp.rope.yarn.is_none() => {
            bail!(
                "--inject {me}: the model ({}) has no YaRN rope scaling (rope.scaling.type is not yarn): there is no mscale to get wrong",
                hp.arch.as_str()
            );
        }
        FaultKind::RopeTheta(x) if (x - hp.rope.base).abs() <= 1e-9 * hp.rope.base => {
            bail!("--inject {me}: {x} is the model's own rope.freq_base");
        }
        FaultKind::YarnFactor(_) if hp.rope.yarn.is_none() => {
            bail!(
                "--inject {me}: the model ({}) has no YaRN rope scaling (rope.scaling.type is not yarn): there is no factor to get wrong",
                hp.arch.as_str()
            );
        }
        FaultKind::YarnFactor(x)
            if hp
                .rope
                .yarn
                .as_ref()
                .is_some_and(|y| (x - y.factor).abs() <= 1e-9 * y.factor) =>
        {
            bail!("--inject {me}: {x} is the model's own rope.scaling.factor");
        }
        FaultKind::DsaTopK(k) => {
            let top_k = need_indexer()?;
            if *k == top_k {
                bail!("--inject {me}: {k} is the model's own index_topk");
            }
        }
        FaultKind::IndexerScale(_) | FaultKind::IndexerWprojScale(_) => {
            need_indexer()?;
        }
        FaultKind::KvBSplit if hp.n_head < 2 => {
            bail!("--inject {me}: with one head the two kv_b layouts are the same");
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::host::kv_b_concat;
    use super::*;

    fn m(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: (0..rows * cols).map(|x| x as f32).collect(),
        }
    }

    /// H=2, nope=2, v=1: rows [0 1 2 | 3 4 5] read as [K0 K0 K1 K1 | V0 V1] give head 0 the
    /// K rows 0, 1 and V row 4, head 1 the K rows 2, 3 and V row 5.
    #[test]
    fn kv_b_split_by_hand_and_inverse_of_concat() {
        let kv = m(6, 1);
        assert_eq!(kv_b_split(&kv, 2, 2, 1).data, vec![0., 1., 4., 2., 3., 5.]);
        let big = m(4 * (3 + 2), 3);
        assert_eq!(kv_b_split(&kv_b_concat(&big, 4, 3, 2), 4, 3, 2), big);
        assert_ne!(kv_b_split(&big, 4, 3, 2), kv_b_concat(&big, 4, 3, 2));
    }

    #[test]
    fn kv_b_halves_scale_by_hand() {
        let mut kv = m(6, 1);
        scale_kv_b(&mut kv, 2, 1, 2.0, 10.0);
        assert_eq!(kv.data, vec![0., 2., 20., 6., 8., 50.]);
        let mut s = vec![1.0, f32::NEG_INFINITY, -2.0];
        scale_finite(&mut s, 3.0);
        assert_eq!(s, vec![3.0, f32::NEG_INFINITY, -6.0]);
    }
}
