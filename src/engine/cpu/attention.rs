//! MLA attention (naive form), the DSA lightning indexer and causal top-k on the CPU.
//!
//! Definitions: `shared/spec/glm5-architecture.md` 2.1 and 2.2; transformers
//! `models/glm_moe_dsa/modeling_glm_moe_dsa.py` (`GlmMoeDsaIndexer`, `GlmMoeDsaAttention`) and
//! `models/deepseek_v3/modeling_deepseek_v3.py`; llama.cpp `src/models/glm-dsa.cpp`.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::math::{dot, layer_norm, matmul, rotate_pairs, softmax_in_place};
use super::weights::Matrix;
use super::CpuEngine;
use crate::engine::{HostTensor, MlaInputs};
use crate::model::hparams::INDEXER_K_NORM_EPS;
use crate::model::names::{self, blk};
use crate::model::rope;
use crate::model::HParams;

/// A RoPE rotation of one head's rotated values by `cos_sin[i] = (cos, sin)` per frequency, in
/// place ([`rotate_pairs`] is the interleaved layout every engine must use).
pub type Rotate = fn(&mut [f32], &[(f64, f64)]);

impl CpuEngine<'_> {
    /// DSA index scores `[T, T]` (see [`crate::engine::Engine::indexer_scores`]).
    ///
    /// `qI = cq Wq_b^T` viewed `[T, nI, dI]`, each head `[pe | nope]` (rope part first);
    /// `kI = LayerNorm(a Wk^T)` `[T, dI]`, also `[pe | nope]`; interleaved RoPE on both pe parts;
    /// `w = (a Wproj^T) * nI^-0.5 * dI^-0.5`; `I(t,s) = sum_h w_h(t) ReLU(qI_h(t) . kI(s))`.
    /// (transformers scales `q.k` by `dI^-0.5` before the ReLU and the weights by `nI^-0.5`;
    /// llama.cpp folds both into the weights; the scale is positive, so all three agree.)
    pub(super) fn indexer_scores_cpu(
        &self,
        layer: usize,
        a: &HostTensor,
        cq: &HostTensor,
    ) -> Result<HostTensor> {
        self.indexer_scores_with(layer, a, cq, rotate_pairs, true)
    }

    /// The DSA index scores with `rotate` applied to the pe parts of the indexer's q and k in
    /// place of the interleaved RoPE [`rotate_pairs`] (what an engine with another RoPE layout
    /// computes), and without the ReLU on each head's `q.k` unless `relu`;
    /// [`CpuEngine::indexer_scores_cpu`] passes [`rotate_pairs`] and the ReLU.
    pub fn indexer_scores_with(
        &self,
        layer: usize,
        a: &HostTensor,
        cq: &HostTensor,
        rotate: Rotate,
        relu: bool,
    ) -> Result<HostTensor> {
        let hp = self.weights.hparams();
        let Some(ix) = &hp.indexer else {
            bail!("engine: cpu: indexer_scores on layer {layer}, but the model has no indexer");
        };
        let (t, _) = a.dims2("indexer_scores input a")?;
        let (ni, di, rope_dim) = (ix.n_head, ix.head_dim, hp.qk_rope);
        let w = |s: &str| names::blk(layer, s);

        let mut q = self.linear_host(cq, &w(blk::INDEXER_Q_B))?; // [T, nI*dI]
        let mut k = self.linear_host(a, &w(blk::INDEXER_K))?; // [T, dI]
        let hw = self.linear_host(a, &w(blk::INDEXER_PROJ))?; // [T, nI]
        let kn_w = self.host_vector(&w(blk::INDEXER_K_NORM))?;
        let kn_b = self.host_vector(&w(blk::INDEXER_K_NORM_B))?;
        for row in k.chunks_exact_mut(di) {
            let normed = layer_norm(row, &kn_w, &kn_b, INDEXER_K_NORM_EPS);
            row.copy_from_slice(&normed);
        }
        for pos in 0..t {
            let cs = self.cos_sin(pos);
            for head in q[pos * ni * di..(pos + 1) * ni * di].chunks_exact_mut(di) {
                rotate(&mut head[..rope_dim], &cs);
            }
            rotate(&mut k[pos * di..pos * di + rope_dim], &cs);
        }
        let scale = 1.0 / ((ni * di) as f64).sqrt();
        let mut out = vec![f32::NEG_INFINITY; t * t];
        out.par_chunks_mut(t).enumerate().for_each(|(qt, row)| {
            let qrow = &q[qt * ni * di..(qt + 1) * ni * di];
            for (s, o) in row.iter_mut().enumerate().take(qt + 1) {
                let ks = &k[s * di..(s + 1) * di];
                let mut acc = 0f64;
                for h in 0..ni {
                    let qk = dot(&qrow[h * di..(h + 1) * di], ks);
                    let qk = if relu { qk.max(0.0) } else { qk };
                    acc += f64::from(hw[qt * ni + h]) * scale * qk;
                }
                *o = acc as f32;
            }
        });
        HostTensor::f32(vec![t, t], out)
    }

    /// Causal top-k of each score row (see [`crate::engine::Engine::top_k`]).
    pub(super) fn top_k_cpu(&self, scores: &HostTensor, k: usize) -> Result<HostTensor> {
        let (t, t2) = scores.dims2("top_k scores")?;
        if t != t2 {
            bail!(
                "engine: cpu: top_k expects [T, T] scores, got {:?}",
                scores.shape
            );
        }
        let sc = scores.as_f32("top_k scores")?;
        let width = k.min(t);
        let mut out = vec![-1i32; t * width];
        for (row_t, o) in out.chunks_mut(width.max(1)).enumerate().take(t) {
            for (slot, s) in causal_top_k(&sc[row_t * t..row_t * t + row_t + 1], k)
                .into_iter()
                .enumerate()
            {
                o[slot] = s as i32;
            }
        }
        HostTensor::i32(vec![t, width], out)
    }

    /// Naive MLA (see [`crate::engine::Engine::mla_attention`]): [`mla_host`] with this
    /// layer's kv_b and the model's softmax scale.
    pub(super) fn mla_cpu(
        &self,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        want_probs: bool,
    ) -> Result<(HostTensor, Option<HostTensor>)> {
        self.mla_cpu_rows(layer, x, None, want_probs)
    }

    /// [`CpuEngine::mla_cpu`] for the query rows `rows` only (all when `None`; see
    /// [`crate::engine::Engine::mla_attention_rows`]).
    pub(super) fn mla_cpu_rows(
        &self,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        rows: Option<&[usize]>,
        want_probs: bool,
    ) -> Result<(HostTensor, Option<HostTensor>)> {
        let kv_b = self.kv_b(layer)?;
        let scale = rope::softmax_scale(self.weights.hparams());
        mla_queries(
            self.weights.hparams(),
            layer,
            x,
            &kv_b,
            scale,
            want_probs,
            rows,
        )
    }
}

/// Naive MLA of layer `layer` on host tensors with a given kv_b (HF `kv_b_proj` layout
/// `[H*(nope+v), kv_lora]`, per head `nope` K rows then `v` V rows) and softmax scale: what
/// [`crate::engine::Engine::mla_attention`] computes with the layer's own kv_b and
/// `model::rope::softmax_scale`.
pub fn mla_host(
    hp: &HParams,
    layer: usize,
    x: MlaInputs<'_, HostTensor>,
    kv_b: &Matrix,
    scale: f64,
    want_probs: bool,
) -> Result<(HostTensor, Option<HostTensor>)> {
    mla_queries(hp, layer, x, kv_b, scale, want_probs, None)
}

/// [`mla_host`] for the query rows `rows` (ascending, distinct, each `< T`; all when `None`)
/// against every key: heads `[n, H*v]` and probabilities `[H, n, T]` for the `n` rows. Each
/// query row is computed the same way whichever others are, so a row is bit for bit the
/// whole step's.
fn mla_queries(
    hp: &HParams,
    layer: usize,
    x: MlaInputs<'_, HostTensor>,
    kv_b: &Matrix,
    scale: f64,
    want_probs: bool,
    rows: Option<&[usize]>,
) -> Result<(HostTensor, Option<HostTensor>)> {
    let MlaInputs {
        q_b,
        q_pe,
        kv_norm,
        k_pe,
        selection,
    } = x;
    {
        let (h, nope, rd, v) = (hp.n_head, hp.qk_nope, hp.qk_rope, hp.v_head);
        let qk = hp.qk_head();
        let (t, qcols) = q_b.dims2("attention q_b")?;
        let expect = |x: &HostTensor, shape: Vec<usize>, what: &str| -> Result<()> {
            if x.shape != shape {
                bail!("engine: cpu: layer {layer} attention: {what} has shape {:?}, expected {shape:?}", x.shape);
            }
            Ok(())
        };
        expect(q_b, vec![t, h * qk], "q_b")?;
        let _ = qcols;
        expect(q_pe, vec![t, h, rd], "q_pe_rope")?;
        expect(kv_norm, vec![t, hp.kv_lora_rank], "kv_a_norm")?;
        expect(k_pe, vec![t, rd], "k_pe_rope")?;
        let (qb, qpe) = (q_b.as_f32("q_b")?, q_pe.as_f32("q_pe_rope")?);
        let kpe = k_pe.as_f32("k_pe_rope")?;
        let queries: Vec<usize> = match rows {
            None => (0..t).collect(),
            Some(r) => {
                check_rows(r, t).map_err(|e| {
                    anyhow::anyhow!("engine: cpu: layer {layer} attention: query {e}")
                })?;
                r.to_vec()
            }
        };
        let n = queries.len();

        // Per query, the keys it may see in ascending order: causal, and in the DSA selection
        // when there is one. [T][<= T] (at most T * index_topk ids with a selection).
        let keys_of: Vec<Vec<u32>> = match selection {
            None => (0..t).map(|qt| (0..=qt as u32).collect()).collect(),
            Some(sel) => {
                let (st, sk) = sel.dims2("attention selection")?;
                if st != t {
                    bail!("engine: cpu: layer {layer} attention: selection has {st} rows for {t} tokens");
                }
                sel.as_i32("selection")?
                    .par_chunks(sk.max(1))
                    .enumerate()
                    .take(t)
                    .map(|(qt, row)| {
                        let mut k: Vec<u32> = row
                            .iter()
                            .filter(|&&s| s >= 0 && (s as usize) <= qt)
                            .map(|&s| s as u32)
                            .collect();
                        k.sort_unstable();
                        k.dedup();
                        k
                    })
                    .collect()
            }
        };

        // kv = c · kv_b^T: per head, nope K values then v V values. [T, H*(nope+v)]
        if kv_b.rows != h * (nope + v) || kv_b.cols != hp.kv_lora_rank {
            bail!(
                "engine: cpu: layer {layer} attention: kv_b is [{}, {}], expected [{}, {}]",
                kv_b.rows,
                kv_b.cols,
                h * (nope + v),
                hp.kv_lora_rank
            );
        }
        let kv = matmul(kv_norm.as_f32("kv_a_norm")?, t, kv_b);
        let kv_w = nope + v;

        // Per head: outputs [n, v] and probabilities [n, T] of the query rows. The head's K and
        // V rows are first copied out of `kv` so that a query's keys are read contiguously
        // ([T, nope], [T, v]); the arithmetic and its order are those of the definition (two
        // dots, softmax, keys summed in ascending order).
        let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..h)
            .into_par_iter()
            .map(|head| {
                let mut kh = vec![0f32; t * nope]; // [T, nope]
                let mut vh = vec![0f32; t * v]; // [T, v]
                for s in 0..t {
                    let row = &kv[s * h * kv_w + head * kv_w..s * h * kv_w + (head + 1) * kv_w];
                    kh[s * nope..(s + 1) * nope].copy_from_slice(&row[..nope]);
                    vh[s * v..(s + 1) * v].copy_from_slice(&row[nope..]);
                }
                let mut o = vec![0f32; n * v];
                let mut probs = vec![0f32; if want_probs { n * t } else { 0 }];
                let mut p = Vec::with_capacity(t);
                let mut acc = vec![0f64; v];
                for (i, &qt) in queries.iter().enumerate() {
                    let keys = &keys_of[qt];
                    let q_nope = &qb[qt * h * qk + head * qk..qt * h * qk + head * qk + nope];
                    let q_rot = &qpe[(qt * h + head) * rd..(qt * h + head + 1) * rd];
                    p.clear();
                    for &s in keys {
                        let s = s as usize;
                        let k_nope = &kh[s * nope..(s + 1) * nope];
                        let k_rot = &kpe[s * rd..(s + 1) * rd];
                        p.push((dot(q_nope, k_nope) + dot(q_rot, k_rot)) * scale);
                    }
                    softmax_in_place(&mut p);
                    acc.fill(0.0);
                    for (&s, &ps) in keys.iter().zip(&p) {
                        let s = s as usize;
                        for (a, &x) in acc.iter_mut().zip(&vh[s * v..(s + 1) * v]) {
                            *a += ps * f64::from(x);
                        }
                        if want_probs {
                            probs[i * t + s] = ps as f32;
                        }
                    }
                    for (o, a) in o[i * v..(i + 1) * v].iter_mut().zip(&acc) {
                        *o = *a as f32;
                    }
                }
                (o, probs)
            })
            .collect();

        let mut heads = vec![0f32; n * h * v];
        for (head, (o, _)) in per_head.iter().enumerate() {
            for i in 0..n {
                heads[i * h * v + head * v..i * h * v + (head + 1) * v]
                    .copy_from_slice(&o[i * v..(i + 1) * v]);
            }
        }
        let probs = if want_probs {
            let all: Vec<f32> = per_head.into_iter().flat_map(|(_, p)| p).collect();
            Some(HostTensor::f32(vec![h, n, t], all)?)
        } else {
            None
        };
        Ok((HostTensor::f32(vec![n, h * v], heads)?, probs))
    }
}

/// Checks that `rows` are ascending, distinct and below `t`; the error says which is not, as
/// `row R of T` for the caller to prefix.
pub(super) fn check_rows(rows: &[usize], t: usize) -> std::result::Result<(), String> {
    for (i, &r) in rows.iter().enumerate() {
        if r >= t {
            return Err(format!("row {r} of {t}"));
        }
        if i > 0 && rows[i - 1] >= r {
            return Err(format!(
                "rows {} then {r}: not ascending and distinct",
                rows[i - 1]
            ));
        }
    }
    Ok(())
}

/// Indices of the `min(k, row.len())` largest values of `row`, largest first; ties go to the
/// lower index (a stable order, so the result never depends on the sort implementation).
pub fn causal_top_k(row: &[f32], k: usize) -> Vec<usize> {
    crate::util::topk::top_k(row, k)
}

#[cfg(test)]
mod tests {
    use super::causal_top_k;

    #[test]
    fn top_k_breaks_ties_by_lower_index() {
        assert_eq!(causal_top_k(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(causal_top_k(&[0.0, 0.0, 0.0], 2), vec![0, 1]);
        assert_eq!(causal_top_k(&[5.0], 4), vec![0]);
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// The definition as first written (a mask of [T, T], keys strided in `kv`).
    #[allow(clippy::too_many_lines)]
    fn mla_host_naive(
        hp: &HParams,
        layer: usize,
        x: MlaInputs<'_, HostTensor>,
        kv_b: &Matrix,
        scale: f64,
        want_probs: bool,
    ) -> Result<(HostTensor, Option<HostTensor>)> {
        let MlaInputs {
            q_b,
            q_pe,
            kv_norm,
            k_pe,
            selection,
        } = x;
        {
            let (h, nope, rd, v) = (hp.n_head, hp.qk_nope, hp.qk_rope, hp.v_head);
            let qk = hp.qk_head();
            let (t, qcols) = q_b.dims2("attention q_b")?;
            let expect = |x: &HostTensor, shape: Vec<usize>, what: &str| -> Result<()> {
                if x.shape != shape {
                    bail!("engine: cpu: layer {layer} attention: {what} has shape {:?}, expected {shape:?}", x.shape);
                }
                Ok(())
            };
            expect(q_b, vec![t, h * qk], "q_b")?;
            let _ = qcols;
            expect(q_pe, vec![t, h, rd], "q_pe_rope")?;
            expect(kv_norm, vec![t, hp.kv_lora_rank], "kv_a_norm")?;
            expect(k_pe, vec![t, rd], "k_pe_rope")?;
            let (qb, qpe) = (q_b.as_f32("q_b")?, q_pe.as_f32("q_pe_rope")?);
            let kpe = k_pe.as_f32("k_pe_rope")?;

            // allowed[t][s]: causal, and in the DSA selection when there is one.
            let mut allowed = vec![false; t * t];
            match selection {
                None => {
                    for qt in 0..t {
                        allowed[qt * t..qt * t + qt + 1].fill(true);
                    }
                }
                Some(sel) => {
                    let (st, sk) = sel.dims2("attention selection")?;
                    if st != t {
                        bail!("engine: cpu: layer {layer} attention: selection has {st} rows for {t} tokens");
                    }
                    for (qt, row) in sel
                        .as_i32("selection")?
                        .chunks(sk.max(1))
                        .enumerate()
                        .take(t)
                    {
                        for &s in row {
                            if s >= 0 && (s as usize) <= qt {
                                allowed[qt * t + s as usize] = true;
                            }
                        }
                    }
                }
            }

            // kv = c · kv_b^T: per head, nope K values then v V values. [T, H*(nope+v)]
            if kv_b.rows != h * (nope + v) || kv_b.cols != hp.kv_lora_rank {
                bail!(
                    "engine: cpu: layer {layer} attention: kv_b is [{}, {}], expected [{}, {}]",
                    kv_b.rows,
                    kv_b.cols,
                    h * (nope + v),
                    hp.kv_lora_rank
                );
            }
            let kv = matmul(kv_norm.as_f32("kv_a_norm")?, t, kv_b);
            let kv_w = nope + v;

            // Per head: outputs [T, v] and probabilities [T, T].
            let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..h)
                .into_par_iter()
                .map(|head| {
                    let mut o = vec![0f32; t * v];
                    let mut probs = vec![0f32; if want_probs { t * t } else { 0 }];
                    let mut p = Vec::with_capacity(t);
                    for qt in 0..t {
                        let q_nope = &qb[qt * h * qk + head * qk..qt * h * qk + head * qk + nope];
                        let q_rot = &qpe[(qt * h + head) * rd..(qt * h + head + 1) * rd];
                        let keys: Vec<usize> = (0..t).filter(|&s| allowed[qt * t + s]).collect();
                        p.clear();
                        for &s in &keys {
                            let k_nope =
                                &kv[s * h * kv_w + head * kv_w..s * h * kv_w + head * kv_w + nope];
                            let k_rot = &kpe[s * rd..(s + 1) * rd];
                            p.push((dot(q_nope, k_nope) + dot(q_rot, k_rot)) * scale);
                        }
                        softmax_in_place(&mut p);
                        let mut acc = vec![0f64; v];
                        for (&s, &ps) in keys.iter().zip(&p) {
                            let vs = &kv[s * h * kv_w + head * kv_w + nope
                                ..s * h * kv_w + (head + 1) * kv_w];
                            for (a, &x) in acc.iter_mut().zip(vs) {
                                *a += ps * f64::from(x);
                            }
                            if want_probs {
                                probs[qt * t + s] = ps as f32;
                            }
                        }
                        for (o, a) in o[qt * v..(qt + 1) * v].iter_mut().zip(&acc) {
                            *o = *a as f32;
                        }
                    }
                    (o, probs)
                })
                .collect();

            let mut heads = vec![0f32; t * h * v];
            for (head, (o, _)) in per_head.iter().enumerate() {
                for qt in 0..t {
                    heads[qt * h * v + head * v..qt * h * v + (head + 1) * v]
                        .copy_from_slice(&o[qt * v..(qt + 1) * v]);
                }
            }
            let probs = if want_probs {
                let all: Vec<f32> = per_head.into_iter().flat_map(|(_, p)| p).collect();
                Some(HostTensor::f32(vec![h, t, t], all)?)
            } else {
                None
            };
            Ok((HostTensor::f32(vec![t, h * v], heads)?, probs))
        }
    }

    /// Runs `mla_host` and the naive definition on random inputs of `t` tokens with the
    /// dimensions of the model at `path` and a DSA selection of `min(2048, t/2)` keys, checks
    /// that they agree bit for bit, and returns (naive, new) CPU seconds.
    fn against_naive(path: &str, t: usize) -> (f64, f64) {
        let model = crate::gguf::Model::open(std::path::Path::new(&path)).unwrap();
        let hp = HParams::from_metadata(&model).unwrap();
        let (h, qk, rd, kvl) = (hp.n_head, hp.qk_head(), hp.qk_rope, hp.kv_lora_rank);
        let mut seed = 1u64;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect()
        };
        let q_b = HostTensor::f32(vec![t, h * qk], rnd(t * h * qk)).unwrap();
        let q_pe = HostTensor::f32(vec![t, h, rd], rnd(t * h * rd)).unwrap();
        let kv_norm = HostTensor::f32(vec![t, kvl], rnd(t * kvl)).unwrap();
        let k_pe = HostTensor::f32(vec![t, rd], rnd(t * rd)).unwrap();
        let kv_b = Matrix {
            rows: h * (hp.qk_nope + hp.v_head),
            cols: kvl,
            data: rnd(h * (hp.qk_nope + hp.v_head) * kvl),
        };
        let k = 2048.min(t / 2).max(1);
        let sel: Vec<i32> = (0..t)
            .flat_map(|q| (0..k).map(move |i| if i <= q { (q - i) as i32 } else { -1 }))
            .collect();
        let sel = HostTensor::i32(vec![t, k], sel).unwrap();
        let cpu = || {
            let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
            // SAFETY: getrusage writes the struct.
            unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
            // SAFETY: initialised by the call above.
            let ru = unsafe { ru.assume_init() };
            ru.ru_utime.tv_sec as f64 + ru.ru_utime.tv_usec as f64 * 1e-6
        };
        let c0 = cpu();
        let (o0, _) = mla_host_naive(
            &hp,
            0,
            MlaInputs {
                q_b: &q_b,
                q_pe: &q_pe,
                kv_norm: &kv_norm,
                k_pe: &k_pe,
                selection: Some(&sel),
            },
            &kv_b,
            0.07,
            false,
        )
        .unwrap();
        let c1 = cpu();
        let t0 = std::time::Instant::now();
        let (o, _) = mla_host(
            &hp,
            0,
            MlaInputs {
                q_b: &q_b,
                q_pe: &q_pe,
                kv_norm: &kv_norm,
                k_pe: &k_pe,
                selection: Some(&sel),
            },
            &kv_b,
            0.07,
            false,
        )
        .unwrap();
        let o = o.as_f32("o").unwrap();
        let h64: u64 = o.iter().fold(0xcbf29ce484222325, |a, x| {
            (a ^ u64::from(x.to_bits())).wrapping_mul(0x100000001b3)
        });
        let c2 = cpu();
        eprintln!(
            "mla T={t} k={k}: {:.3} s wall, cpu naive {:.2} s new {:.2} s, hash {h64:016x}",
            t0.elapsed().as_secs_f64(),
            c1 - c0,
            c2 - c1
        );
        assert_eq!(o0.as_f32("o").unwrap(), o);
        (c1 - c0, c2 - c1)
    }

    /// The per-head copy of K and V and the per-query key lists change no value.
    #[test]
    fn mla_equals_the_naive_definition() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/models/glm5-tiny/glm5-tiny-f32.gguf"
        );
        for t in [1, 7, 40] {
            against_naive(path, t);
        }
    }

    /// Timing at a model's dimensions: `GLMDIFF_MLA_MODEL=F.gguf GLMDIFF_MLA_T=1024 cargo test
    /// --release --lib mla_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn mla_timing() {
        let (Ok(path), Ok(t)) = (
            std::env::var("GLMDIFF_MLA_MODEL"),
            std::env::var("GLMDIFF_MLA_T"),
        ) else {
            eprintln!("mla_timing: set GLMDIFF_MLA_MODEL and GLMDIFF_MLA_T to time it");
            return;
        };
        against_naive(&path, t.parse().unwrap());
    }
}
