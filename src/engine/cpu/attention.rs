//! MLA attention (naive form), the DSA lightning indexer and causal top-k on the CPU.
//!
//! Definitions: `shared/spec/glm5-architecture.md` 2.1 and 2.2; transformers
//! `models/glm_moe_dsa/modeling_glm_moe_dsa.py` (`GlmMoeDsaIndexer`, `GlmMoeDsaAttention`) and
//! `models/deepseek_v3/modeling_deepseek_v3.py`; llama.cpp `src/models/glm-dsa.cpp`.
//!
//! # MLA: the definition, computed in blocks
//! Per head and query row, over the row's keys `s` (causal, and in the DSA selection when
//! there is one) in ascending order:
//! `score_s = (dot(q_nope, k_nope_s) + dot(q_rot, k_rot_s)) * scale` ([`dot`](super::math::dot): two dots, two
//! lane sets combined, added, then scaled), [`softmax_in_place`] of the scores, then `acc[d] = acc[d] + p_s * f64(v_s[d])` from
//! `acc = +0`, rounded to f32 once. The code computes exactly these operations on exactly
//! these values, arranged for speed:
//! - per head, K (`[nope | rot]`) and V rows are converted to f64 once (exact), each part
//!   padded with zeros to a multiple of the lanes, so the kernels read rows contiguously and
//!   convert nothing (a zero column adds `+0 * +0 = +0` to a lane, which is never -0);
//! - query rows go in blocks of up to 32 consecutive rows over the ascending union of their
//!   keys (`plan`; a block is halved while the union makes more than twice the scores its
//!   rows need, so disjoint selections go a row at a time). The scores of the block's rows
//!   against the union are computed in register tiles of 4 rows by 4 keys (AVX-512; 4 by 2 in
//!   the AVX2 build, 4 by 1 in the baseline), each score keeping its own [`LANES`] lanes fed
//!   the same products in the same order, fused multiply-adds in the FMA builds (the product
//!   of two f32 values is exact in f64, so `fma(a, b, c) == c + a * b`, as in
//!   [`super::math::gemm`]);
//! - each row's softmax is [`softmax_in_place`] over its own keys' scores in their order;
//! - the weighted sums run over the union in ascending order for all the block's rows at
//!   once, in tiles of 4 rows by 32 values (AVX-512; 2 by 16 in AVX2, 2 by 8 in the
//!   baseline), a multiply then an add (never fused: `p_s` is not an f32 value). A key of the
//!   union outside a row's own has probability +0 for that row: it adds `+0 * x = +-0`, which
//!   changes no sum (a sum starts at +0 and is never -0) when `x` is finite; a head with an
//!   infinite or NaN V value goes a row at a time.
//!
//! So every head and probability is bit for bit the definition's at every SIMD build and
//! thread count (`blocks::blocks_are_the_definition_at_every_level`,
//! `timing::mla_equals_the_naive_definition`).
//!
//! Measured with `timing::mla_timing` (random inputs at GLM-5's widths, 64 heads, a window of
//! T/2 keys per row; CPU seconds of the 2-core Zen 4 VM, AVX-512, shared so noisy), the call
//! including its kv product (1.2 s at T = 1024, 2.3-3.0 s at 2048): T = 1024, 5.5 s with one
//! `dot` at a time and per-head f32 copies, 2.4 s blocked; T = 2048, 17.0 s, 6.5 s. The
//! attention alone went from 4.3 to 1.3 s and from 14.7 to 4.2 s (3.4-3.5x; 5.2x against the
//! definition as first written, 21.8 s); of what is left, about a third is the softmax's
//! `exp` and most of the rest the two kernels in equal parts.

use std::sync::Arc;

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::device::Device;
#[cfg(test)]
use super::math::dot;
use super::math::{dot64, layer_norm, rotate_pairs, softmax_in_place, LANES};
use super::weights::Matrix;
use super::CpuEngine;
use super::KeptKv;
use crate::engine::{HostTensor, MlaInputs};
use crate::model::hparams::INDEXER_K_NORM_EPS;
use crate::model::names::{self, blk};
use crate::model::rope;
use crate::model::HParams;

mod tiles;

/// `I(t, s) = sum_h hw[t, h] * scale * ReLU(q_h(t) . k(s))` for `s <= t` (`-inf` above the
/// diagonal; no ReLU unless `relu`), from `q` `[T, nI*dI]`, `k` `[T, dI]` and `hw` `[T, nI]`:
/// each dot is [`dot`](super::math::dot)'s of the f32 values (on their f64 copies, made once: [`dot64`]), the
/// heads summed in order, so the bits are those of one `dot` at a time. The rows `rows` only
/// (`[rows.len(), T]`) when given.
#[allow(clippy::too_many_arguments)]
fn index_scores(
    q: &[f32],
    k: &[f32],
    hw: &[f32],
    t: usize,
    ni: usize,
    di: usize,
    scale: f64,
    relu: bool,
    rows: Option<&[usize]>,
) -> Vec<f32> {
    let kf: Vec<f64> = k.iter().map(|&v| f64::from(v)).collect(); // [T, dI]
    let n = rows.map_or(t, <[usize]>::len);
    let mut out = vec![f32::NEG_INFINITY; n * t];
    out.par_chunks_mut(t.max(1))
        .enumerate()
        .for_each(|(i, row)| {
            let qt = rows.map_or(i, |r| r[i]);
            let qf: Vec<f64> = q[qt * ni * di..(qt + 1) * ni * di]
                .iter()
                .map(|&v| f64::from(v))
                .collect(); // [nI, dI]
            for (s, o) in row.iter_mut().enumerate().take(qt + 1) {
                let ks = &kf[s * di..(s + 1) * di];
                let mut acc = 0f64;
                for h in 0..ni {
                    let qk = dot64(&qf[h * di..(h + 1) * di], ks);
                    let qk = if relu { qk.max(0.0) } else { qk };
                    acc += f64::from(hw[qt * ni + h]) * scale * qk;
                }
                *o = acc as f32;
            }
        });
    out
}

/// The DSA index scores `[T, T]` of `q` `[T, nI*dI]`, `k` `[T, dI]` and `hw` `[T, nI]` (as
/// [`CpuEngine::indexer_scores_with`] defines them, the scale given): on `device` when there is
/// one and it takes them (the same bits, checked there against these rows computed here), else
/// here.
pub fn index_scores_on(
    q: &[f32],
    k: &[f32],
    hw: &[f32],
    (t, ni, di): (usize, usize, usize),
    scale: f64,
    relu: bool,
    device: Option<&Device>,
) -> Result<Vec<f32>> {
    if q.len() != t * ni * di || k.len() != t * di || hw.len() != t * ni {
        bail!(
            "engine: cpu: index scores of {t} rows of {ni} heads of {di}: {} query values, {} key values, {} head weights",
            q.len(),
            k.len(),
            hw.len()
        );
    }
    let on_device = match device {
        Some(d) => d.index_scores(q, k, hw, (t, ni, di), scale, relu, &|rows| {
            Ok(index_scores(q, k, hw, t, ni, di, scale, relu, Some(rows)))
        })?,
        None => None,
    };
    Ok(on_device.unwrap_or_else(|| index_scores(q, k, hw, t, ni, di, scale, relu, None)))
}

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
        let out = index_scores_on(&q, &k, &hw, (t, ni, di), scale, relu, self.device())?; // [T, T]
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
        let kv = self.kv_product(layer, x.kv_norm)?;
        let scale = rope::softmax_scale(self.weights.hparams());
        mla_queries(
            self.weights.hparams(),
            layer,
            x,
            Kv::Product(&kv),
            scale,
            want_probs,
            rows,
            self.device(),
        )
    }

    /// `kv = kv_a_norm kv_b^T` of layer `layer` with its own kv_b (`[T, H*(nope+v)]`, per head
    /// `nope` K values then `v` V values): kept for the next call with the same layer and the
    /// same bits of `kv_norm` (a step's recomputation in rows, the directions' attentions).
    pub fn kv_product(&self, layer: usize, kv_norm: &HostTensor) -> Result<Arc<Vec<f32>>> {
        if let Ok(kept) = self.kv.lock() {
            if let Some(k) = kept.as_ref() {
                if k.layer == layer && k.kv_norm.same_bits(kv_norm) {
                    return Ok(Arc::clone(&k.kv));
                }
            }
        }
        let hp = self.weights.hparams();
        let kv_b = self.kv_b(layer)?;
        let kv = Arc::new(kv_of(hp, layer, kv_norm, &kv_b, self.device())?);
        if let Ok(mut kept) = self.kv.lock() {
            *kept = Some(KeptKv {
                layer,
                kv_norm: kv_norm.clone(),
                kv: Arc::clone(&kv),
            });
        }
        Ok(kv)
    }
}

/// `kv = kv_norm kv_b^T` (`[T, H*(nope+v)]`), kv_b checked against the model's widths.
fn kv_of(
    hp: &HParams,
    layer: usize,
    kv_norm: &HostTensor,
    kv_b: &Matrix,
    device: Option<&super::device::Device>,
) -> Result<Vec<f32>> {
    let (h, nope, v) = (hp.n_head, hp.qk_nope, hp.v_head);
    if kv_b.rows != h * (nope + v) || kv_b.cols != hp.kv_lora_rank {
        bail!(
            "engine: cpu: layer {layer} attention: kv_b is [{}, {}], expected [{}, {}]",
            kv_b.rows,
            kv_b.cols,
            h * (nope + v),
            hp.kv_lora_rank
        );
    }
    let (t, width) = kv_norm.dims2("kv_a_norm")?;
    if width != hp.kv_lora_rank {
        bail!(
            "engine: cpu: layer {layer} attention: kv_a_norm has shape {:?}, expected [{t}, {}]",
            kv_norm.shape,
            hp.kv_lora_rank
        );
    }
    super::device::matmul_dense(device, kv_norm.as_f32("kv_a_norm")?, t, kv_b, "kv_b")
}

/// Where an attention's `kv` comes from: kv_b (the product is computed), or the product.
#[derive(Clone, Copy)]
pub enum Kv<'a> {
    /// `[H*(nope+v), kv_lora]`: `kv = kv_a_norm kv_b^T` is computed.
    B(&'a Matrix),
    /// The product itself, `[T, H*(nope+v)]` ([`CpuEngine::kv_product`]).
    Product(&'a [f32]),
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
    mla_queries(hp, layer, x, Kv::B(kv_b), scale, want_probs, None, None)
}

/// [`mla_host`] from the keys and values before the heads' split, `kv = kv_a_norm kv_b^T`
/// (`[T, H*(nope+v)]`, [`CpuEngine::kv_product`]), instead of kv_b: the same bits; for the
/// query rows `rows` only (ascending, distinct: heads `[rows.len(), H*v]`, each row the whole
/// step's bits), all when `None`; its scores and weighted sums on `device` when it makes them
/// (the same bits, checked).
pub fn mla_host_kv(
    hp: &HParams,
    layer: usize,
    x: MlaInputs<'_, HostTensor>,
    kv: &[f32],
    scale: f64,
    rows: Option<&[usize]>,
    device: Option<&Device>,
) -> Result<HostTensor> {
    Ok(mla_queries(hp, layer, x, Kv::Product(kv), scale, false, rows, device)?.0)
}

/// [`mla_host`] for the query rows `rows` (ascending, distinct, each `< T`; all when `None`)
/// against every key: heads `[n, H*v]` and probabilities `[H, n, T]` for the `n` rows. Each
/// query row is computed the same way whichever others are, so a row is bit for bit the
/// whole step's.
#[allow(clippy::too_many_arguments)]
fn mla_queries(
    hp: &HParams,
    layer: usize,
    x: MlaInputs<'_, HostTensor>,
    kv: Kv<'_>,
    scale: f64,
    want_probs: bool,
    rows: Option<&[usize]>,
    device: Option<&Device>,
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

        // Per query row, the keys it may see in ascending order: causal, and in the DSA
        // selection when there is one. [n][<= T] (at most n * index_topk ids with a selection).
        let keys_of: Vec<Vec<u32>> = match selection {
            None => queries
                .par_iter()
                .map(|&qt| (0..=qt as u32).collect())
                .collect(),
            Some(sel) => {
                let (st, sk) = sel.dims2("attention selection")?;
                if st != t {
                    bail!("engine: cpu: layer {layer} attention: selection has {st} rows for {t} tokens");
                }
                let sel = sel.as_i32("selection")?;
                queries
                    .par_iter()
                    .map(|&qt| {
                        let row = &sel[qt * sk..(qt + 1) * sk];
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
        let computed;
        let kv: &[f32] = match kv {
            Kv::B(kv_b) => {
                computed = kv_of(hp, layer, kv_norm, kv_b, None)?;
                &computed
            }
            Kv::Product(kv) => {
                if kv.len() != t * h * (nope + v) {
                    bail!(
                        "engine: cpu: layer {layer} attention: kv holds {} values, expected {t} x {}",
                        kv.len(),
                        h * (nope + v)
                    );
                }
                kv
            }
        };
        let dims = Dims { h, nope, rd, v };
        let inputs = Inputs {
            qb,
            qpe,
            kv,
            kpe,
            t,
        };
        let on_device = match device {
            Some(dev) if !want_probs => attend_on(dev, dims, inputs, &queries, &keys_of, scale)?,
            _ => None,
        };
        let (heads, probs) = match on_device {
            Some(heads) => (heads, None),
            None => attend(dims, inputs, &queries, &keys_of, scale, want_probs),
        };
        let probs = match probs {
            Some(p) => Some(HostTensor::f32(vec![h, n, t], p)?),
            None => None,
        };
        Ok((HostTensor::f32(vec![n, h * v], heads)?, probs))
    }
}

/// The widths of one MLA attention: heads, and per head the K values without RoPE, with RoPE,
/// and the V values.
#[derive(Clone, Copy, Debug)]
struct Dims {
    h: usize,
    nope: usize,
    rd: usize,
    v: usize,
}

/// The values one MLA attention reads, `t` tokens: `qb` `[T, H*(nope+rd)]` (per head the
/// nope values first; the rest is not read), `qpe` `[T, H, rd]`, `kv` `[T, H*(nope+v)]` (per
/// head nope K values then v V values), `kpe` `[T, rd]` (shared by the heads).
#[derive(Clone, Copy)]
struct Inputs<'a> {
    qb: &'a [f32],
    qpe: &'a [f32],
    kv: &'a [f32],
    kpe: &'a [f32],
    t: usize,
}

/// Query rows of a block at most (its scores and probabilities stay in cache: `[32, T]` f64).
const BLOCK_QUERIES: usize = 32;

/// Keys of a block whose scores are computed for all the block's rows before the next keys
/// (their K rows, `[64, nope+rd]` f64, stay in L2).
const KEY_BLOCK: usize = 64;

/// A block of query rows computed together: the ascending union of their keys, and for each
/// row the positions of its own keys in the union.
struct Block {
    /// Index of the first row in the call's query rows.
    first: usize,
    /// The union of the rows' keys, ascending, then copies of the last one up to a multiple of
    /// [`tiles::KEY_PAD`] (whose scores are computed and dropped).
    keys: Vec<u32>,
    /// Keys in the union.
    union: usize,
    /// Row `r`'s keys are `keys[pos[start[r]..start[r + 1]]]`, ascending.
    pos: Vec<u32>,
    /// `rows + 1` offsets into `pos`.
    start: Vec<usize>,
}

impl Block {
    /// Rows in the block.
    fn rows(&self) -> usize {
        self.start.len() - 1
    }

    /// The block of rows `first..first + keys_of.len()` (`keys_of` their key lists, each key
    /// below `index_of.len()`, the scratch that maps a key to its position).
    fn new(first: usize, keys_of: &[Vec<u32>], index_of: &mut [u32]) -> Block {
        let mut keys: Vec<u32> = keys_of.iter().flatten().copied().collect();
        keys.sort_unstable();
        keys.dedup();
        for (m, &s) in keys.iter().enumerate() {
            index_of[s as usize] = m as u32;
        }
        let mut start = Vec::with_capacity(keys_of.len() + 1);
        let mut pos = Vec::with_capacity(keys_of.iter().map(Vec::len).sum());
        start.push(0);
        for k in keys_of {
            pos.extend(k.iter().map(|&s| index_of[s as usize]));
            start.push(pos.len());
        }
        let union = keys.len();
        if let Some(&last) = keys.last() {
            keys.resize(round_up(union, tiles::KEY_PAD), last);
        }
        Block {
            first,
            keys,
            union,
            pos,
            start,
        }
    }
}

/// Splits the query rows (their key lists `keys_of`, keys below `t`) into [`Block`]s of at
/// most [`BLOCK_QUERIES`] consecutive rows, halved while a block's scores (rows times the
/// union of their keys) would be more than twice the scores its rows need: with a causal mask
/// or keys that neighbours share, blocks are whole; with disjoint selections, single rows.
/// Only the speed depends on the split.
fn plan(keys_of: &[Vec<u32>], t: usize) -> Vec<Block> {
    fn split(first: usize, keys_of: &[Vec<u32>], index_of: &mut [u32], out: &mut Vec<Block>) {
        let b = Block::new(first, keys_of, index_of);
        if keys_of.len() > 1 && keys_of.len() * b.union > 2 * b.pos.len() {
            let half = keys_of.len() / 2;
            split(first, &keys_of[..half], index_of, out);
            split(first + half, &keys_of[half..], index_of, out);
        } else {
            out.push(b);
        }
    }
    keys_of
        .par_chunks(BLOCK_QUERIES)
        .enumerate()
        .map(|(c, chunk)| {
            let mut index_of = vec![0u32; t];
            let mut out = Vec::new();
            split(c * BLOCK_QUERIES, chunk, &mut index_of, &mut out);
            out
        })
        .flatten_iter()
        .collect()
}

/// Working memory of one thread's heads.
#[derive(Default)]
struct Scratch {
    /// The head's K rows in f64, `[T, kp]`: nope values, zeros, rot values, zeros.
    kf: Vec<f64>,
    /// The head's V rows in f64, `[T, vp]`: v values, zeros.
    vf: Vec<f64>,
    /// A block's query rows in the layout of `kf`, `[rows padded, kp]`.
    q: Vec<f64>,
    /// Scores, then probabilities (0 outside a row's keys), `[rows padded, union padded]`.
    s: Vec<f64>,
    /// The weighted sums, `[rows padded, vp]`.
    acc: Vec<f64>,
    /// One row's probabilities.
    p: Vec<f64>,
}

/// `n` rounded up to a multiple of `m`.
fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// The widths of rows padded for [`tiles`]: (`np`, `kp`, `vp`).
fn padded(d: Dims) -> (usize, usize, usize) {
    let np = round_up(d.nope, LANES);
    (np, np + round_up(d.rd, LANES), round_up(d.v, tiles::V_PAD))
}

/// [`attend`]'s heads (`[n, H*v]`) made on `device` (`None` when it does not make them): the
/// scores and the weighted sums there, each row's softmax here, a few rows checked against
/// [`attend`] ([`attend_with`]).
fn attend_on(
    device: &Device,
    d: Dims,
    x: Inputs<'_>,
    queries: &[usize],
    keys_of: &[Vec<u32>],
    scale: f64,
) -> Result<Option<Vec<f32>>> {
    if queries.len() < super::device::MIN_QUERIES {
        return Ok(None);
    }
    let cpu = |rows: &[usize]| -> Result<Vec<f32>> {
        let qs: Vec<usize> = rows.iter().map(|&i| queries[i]).collect();
        let ks: Vec<Vec<u32>> = rows.iter().map(|&i| keys_of[i].clone()).collect();
        Ok(attend(d, x, &qs, &ks, scale, false).0)
    };
    attend_with(d, x, queries, keys_of, &mut |q, offs, keys, softmax| {
        device.attention(
            q,
            x.kv,
            x.kpe,
            offs,
            keys,
            (d.h, d.nope, d.rd, d.v),
            scale,
            softmax,
            &cpu,
        )
    })
}

/// What makes an attention's scores and weighted sums elsewhere: from the query rows' values
/// (`[n, H, nope + rd]`), the offsets of their keys (`[n + 1]`) and the keys, with the softmax
/// to apply between (see `gpu::reference`'s `mla` for the layouts).
type MakeAttention<'a> = dyn FnMut(&[f32], &[u64], &[u32], &mut super::device::Softmax<'_>) -> Result<Option<Vec<f32>>>
    + 'a;

/// [`attend`]'s heads made by `make` from the query rows' values and key lists laid out for it,
/// with each row's softmax made here: [`softmax_in_place`] over its own keys' scores in their
/// order, as [`block`] does.
fn attend_with(
    d: Dims,
    x: Inputs<'_>,
    queries: &[usize],
    keys_of: &[Vec<u32>],
    make: &mut MakeAttention<'_>,
) -> Result<Option<Vec<f32>>> {
    let Dims { h, nope, rd, .. } = d;
    let n = queries.len();
    let qk = nope + rd;
    // The query rows' q_nope then q_rot per head: [n, h, nope + rd].
    let mut q = vec![0f32; n * h * qk];
    q.par_chunks_mut((h * qk).max(1))
        .zip(queries.par_iter())
        .for_each(|(row, &qt)| {
            for (head, out) in row.chunks_exact_mut(qk).enumerate() {
                let at = qt * h * qk + head * qk;
                out[..nope].copy_from_slice(&x.qb[at..at + nope]);
                let at = (qt * h + head) * rd;
                out[nope..].copy_from_slice(&x.qpe[at..at + rd]);
            }
        });
    let mut offs = Vec::with_capacity(n + 1);
    let mut total = 0u64;
    offs.push(0);
    for k in keys_of {
        total += k.len() as u64;
        offs.push(total);
    }
    let keys: Vec<u32> = keys_of.iter().flatten().copied().collect();
    // A chunk of rows' scores, per row and head its keys' scores: each becomes the row's
    // softmax over them.
    let mut softmax = |scores: &mut [f64], rows: std::ops::Range<usize>| -> Result<()> {
        let mut parts = Vec::with_capacity(rows.len());
        let mut rest = scores;
        for i in rows {
            let len = (offs[i + 1] - offs[i]) as usize;
            if rest.len() < len * h {
                bail!(
                    "engine: cpu: attention: {} scores for query row {i}'s {len} keys of {h} heads",
                    rest.len()
                );
            }
            let (part, tail) = rest.split_at_mut(len * h);
            parts.push((part, len));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(part, len)| {
            if len > 0 {
                for head in part.chunks_exact_mut(len) {
                    softmax_in_place(head);
                }
            }
        });
        Ok(())
    };
    make(&q, &offs, &keys, &mut softmax)
}

/// The MLA attention of the query rows `queries` (tokens) whose key lists are `keys_of`
/// (ascending, each `< T`): heads `[n, H*v]` and, when `want_probs`, probabilities
/// `[H, n, T]` (0 outside a row's keys). Parallel over the heads; the rows go in [`plan`]'s
/// blocks through the kernels of [`tiles`] (see the module documentation for why the values
/// are the definition's).
fn attend(
    d: Dims,
    x: Inputs<'_>,
    queries: &[usize],
    keys_of: &[Vec<u32>],
    scale: f64,
    want_probs: bool,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let Dims { h, nope, rd, v } = d;
    let (t, n) = (x.t, keys_of.len());
    let (np, kp, vp) = padded(d);
    let kv_w = nope + v;
    let blocks = plan(keys_of, t);
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..h)
        .into_par_iter()
        .map_init(Scratch::default, |s, head| {
            let mut o = vec![0f32; n * v];
            let mut probs = vec![0f32; if want_probs { n * t } else { 0 }];
            // The head's K and V rows in f64, converted once (exact).
            s.kf.clear();
            s.kf.resize(t * kp, 0.0);
            s.vf.clear();
            s.vf.resize(t * vp, 0.0);
            let mut finite = true;
            for r in 0..t {
                let row = &x.kv[r * h * kv_w + head * kv_w..r * h * kv_w + (head + 1) * kv_w];
                let kr = &mut s.kf[r * kp..(r + 1) * kp];
                for (d, &y) in kr[..nope].iter_mut().zip(&row[..nope]) {
                    *d = f64::from(y);
                }
                for (d, &y) in kr[np..np + rd].iter_mut().zip(&x.kpe[r * rd..(r + 1) * rd]) {
                    *d = f64::from(y);
                }
                for (d, &y) in s.vf[r * vp..r * vp + v].iter_mut().zip(&row[nope..]) {
                    *d = f64::from(y);
                    finite &= y.is_finite();
                }
            }
            // A key outside a row's own gets probability +0 in its block, which adds
            // +0 * x = +-0 to the row's sums: no change (they start at +0 and are never -0)
            // when x is finite. With an infinite or NaN V value, single rows.
            if finite {
                for b in &blocks {
                    block(
                        d, x, queries, head, b, scale, s, &mut o, &mut probs, want_probs,
                    );
                }
            } else {
                let mut index_of = vec![0u32; t];
                for (i, k) in keys_of.iter().enumerate() {
                    let b = Block::new(i, std::slice::from_ref(k), &mut index_of);
                    block(
                        d, x, queries, head, &b, scale, s, &mut o, &mut probs, want_probs,
                    );
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
    let probs = want_probs.then(|| per_head.into_iter().flat_map(|(_, p)| p).collect());
    (heads, probs)
}

/// One head's outputs (`o` `[n, v]`) and probabilities (`probs` `[n, T]`) of the rows of
/// block `b` (the head's K and V rows in `s.kf` and `s.vf`): the scores of the rows against
/// the union of their keys, each row's softmax over its own keys, then the weighted sums over
/// the union (probability 0 outside a row's keys).
#[allow(clippy::too_many_arguments)]
fn block(
    d: Dims,
    x: Inputs<'_>,
    queries: &[usize],
    head: usize,
    b: &Block,
    scale: f64,
    s: &mut Scratch,
    o: &mut [f32],
    probs: &mut [f32],
    want_probs: bool,
) {
    let Dims { h, nope, rd, v } = d;
    let t = x.t;
    let (np, kp, vp) = padded(d);
    let qk = nope + rd;
    let nq = b.rows();
    let nqp = round_up(nq, tiles::QUERY_PAD);
    let su = b.keys.len();

    // The rows' queries in f64, [nqp, kp].
    s.q.clear();
    s.q.resize(nqp * kp, 0.0);
    for (i, row) in s.q.chunks_exact_mut(kp).take(nq).enumerate() {
        let qt = queries[b.first + i];
        let q_nope = &x.qb[qt * h * qk + head * qk..qt * h * qk + head * qk + nope];
        let q_rot = &x.qpe[(qt * h + head) * rd..(qt * h + head + 1) * rd];
        for (d, &y) in row[..nope].iter_mut().zip(q_nope) {
            *d = f64::from(y);
        }
        for (d, &y) in row[np..np + rd].iter_mut().zip(q_rot) {
            *d = f64::from(y);
        }
    }

    // Scores [nqp, su], a block of keys at a time for all the rows.
    s.s.clear();
    s.s.resize(nqp * su, 0.0);
    for k0 in (0..su).step_by(KEY_BLOCK) {
        let keys = &b.keys[k0..su.min(k0 + KEY_BLOCK)];
        tiles::scores(&s.q, nqp, &s.kf, keys, kp, np, scale, &mut s.s[k0..], su);
    }

    // Each row's softmax over its own keys, in their order; the row of scores becomes the
    // row's probabilities over the union, 0 outside its keys (and in the padding rows).
    for i in 0..nqp {
        let row = &mut s.s[i * su..(i + 1) * su];
        if i >= nq {
            row.fill(0.0);
            continue;
        }
        let pos = &b.pos[b.start[i]..b.start[i + 1]];
        s.p.clear();
        s.p.extend(pos.iter().map(|&m| row[m as usize]));
        softmax_in_place(&mut s.p);
        row.fill(0.0);
        for (&m, &ps) in pos.iter().zip(&s.p) {
            row[m as usize] = ps;
        }
        if want_probs {
            let pr = &mut probs[(b.first + i) * t..(b.first + i + 1) * t];
            for (&m, &ps) in pos.iter().zip(&s.p) {
                pr[b.keys[m as usize] as usize] = ps as f32;
            }
        }
    }

    // The weighted sums of the V rows over the union in ascending order, a block of keys at a
    // time for all the rows.
    s.acc.clear();
    s.acc.resize(nqp * vp, 0.0);
    for k0 in (0..b.union).step_by(KEY_BLOCK) {
        let keys = &b.keys[k0..b.union.min(k0 + KEY_BLOCK)];
        tiles::weighted_sums(&s.s[k0..], su, nqp, &s.vf, keys, vp, &mut s.acc);
    }
    for (i, a) in s.acc.chunks_exact(vp).take(nq).enumerate() {
        for (o, &a) in o[(b.first + i) * v..(b.first + i + 1) * v]
            .iter_mut()
            .zip(a)
        {
            *o = a as f32;
        }
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
    /// The index scores are one `dot` of the f32 values at a time, bit for bit: against the
    /// definition as written, on values over the whole exponent range and cancelling sums,
    /// with and without the ReLU, widths not a multiple of the lanes.
    #[test]
    fn index_scores_are_the_definition() {
        use super::{dot, index_scores};
        use crate::engine::cpu::math::gemm::tests::{cancelling, wild};
        use crate::util::rng::SplitMix64;
        let mut rng = SplitMix64::new(29);
        for (t, ni, di) in [(1usize, 1usize, 1usize), (5, 3, 7), (9, 4, 16), (13, 2, 37)] {
            let q = wild(&mut rng, t * ni * di);
            let k = wild(&mut rng, t * di);
            let (q, k) = cancelling(&mut rng, q, k, di);
            let hw: Vec<f32> = (0..t * ni).map(|_| rng.uniform() - 0.3).collect();
            for relu in [true, false] {
                let scale = 1.0 / ((ni * di) as f64).sqrt();
                let got = index_scores(&q, &k, &hw, t, ni, di, scale, relu, None);
                for qt in 0..t {
                    for s in 0..t {
                        let want = if s > qt {
                            f32::NEG_INFINITY
                        } else {
                            let mut acc = 0f64;
                            for h in 0..ni {
                                let qk = dot(
                                    &q[qt * ni * di + h * di..qt * ni * di + (h + 1) * di],
                                    &k[s * di..(s + 1) * di],
                                );
                                let qk = if relu { qk.max(0.0) } else { qk };
                                acc += f64::from(hw[qt * ni + h]) * scale * qk;
                            }
                            acc as f32
                        };
                        assert_eq!(
                            got[qt * t + s].to_bits(),
                            want.to_bits(),
                            "t={t} ni={ni} di={di} qt={qt} s={s}"
                        );
                    }
                }
            }
        }
    }

    /// `cuda/reference.cu`'s `reference_index_scores` written out on the host operation for
    /// operation (lane `c % 8` by fused multiply-adds from +0, the butterfly's adds in its
    /// order, `fmax` for the ReLU, the weight times the scale then times the dot, added), and
    /// the CPU's rows on their own: both are `index_scores` bit for bit, on wild and cancelling
    /// values, widths not a multiple of the lanes, a NaN and an infinite value.
    #[test]
    fn the_device_kernel_written_out_and_chosen_rows_are_index_scores() {
        use super::index_scores;
        use crate::engine::cpu::math::gemm::tests::{cancelling, wild};
        use crate::util::rng::SplitMix64;
        #[allow(clippy::too_many_arguments)]
        fn kernel(
            q: &[f32],
            k: &[f32],
            hw: &[f32],
            t: usize,
            ni: usize,
            di: usize,
            scale: f64,
            relu: bool,
        ) -> Vec<f32> {
            let mut out = vec![f32::NEG_INFINITY; t * t];
            for qt in 0..t {
                let qs: Vec<f64> = q[qt * ni * di..(qt + 1) * ni * di]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let ws: Vec<f64> = (0..ni)
                    .map(|h| f64::from(hw[qt * ni + h]) * scale)
                    .collect();
                for s in 0..=qt {
                    let mut acc = 0f64;
                    for h in 0..ni {
                        let mut v = [0f64; 8];
                        for (l, lane) in v.iter_mut().enumerate() {
                            let mut c = l;
                            while c < di {
                                *lane = qs[h * di + c].mul_add(f64::from(k[s * di + c]), *lane);
                                c += 8;
                            }
                        }
                        for m in [1, 2, 4] {
                            let before = v;
                            for l in 0..8 {
                                v[l] = before[l] + before[l ^ m];
                            }
                        }
                        let a = if relu { v[0].max(0.0) } else { v[0] };
                        acc += ws[h] * a;
                    }
                    out[qt * t + s] = acc as f32;
                }
            }
            out
        }
        let mut rng = SplitMix64::new(31);
        for (t, ni, di) in [(1usize, 1usize, 1usize), (6, 3, 7), (9, 4, 16), (11, 2, 37)] {
            let q = wild(&mut rng, t * ni * di);
            let k = wild(&mut rng, t * di);
            let (mut q, mut k) = cancelling(&mut rng, q, k, di);
            if t > 5 {
                q[ni * di + 2] = f32::NAN;
                k[3 * di + 1] = f32::INFINITY;
            }
            let hw: Vec<f32> = (0..t * ni).map(|_| rng.uniform() - 0.3).collect();
            for relu in [true, false] {
                let scale = 1.0 / ((ni * di) as f64).sqrt();
                let want = index_scores(&q, &k, &hw, t, ni, di, scale, relu, None);
                let same =
                    |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                let got = kernel(&q, &k, &hw, t, ni, di, scale, relu);
                for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        same(a, b),
                        "kernel: t={t} ni={ni} di={di} at {i}: {a:e} {b:e}"
                    );
                }
                let rows: Vec<usize> = (0..t).rev().step_by(2).collect();
                let part = index_scores(&q, &k, &hw, t, ni, di, scale, relu, Some(&rows));
                for (j, &r) in rows.iter().enumerate() {
                    for c in 0..t {
                        let (a, b) = (part[j * t + c], want[r * t + c]);
                        assert!(same(a, b), "rows: t={t} row {r} col {c}: {a:e} {b:e}");
                    }
                }
            }
        }
    }

    use super::causal_top_k;

    #[test]
    fn top_k_breaks_ties_by_lower_index() {
        assert_eq!(causal_top_k(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(causal_top_k(&[0.0, 0.0, 0.0], 2), vec![0, 1]);
        assert_eq!(causal_top_k(&[5.0], 4), vec![0]);
    }
}

#[cfg(test)]
mod device_layout {
    use super::*;
    use crate::engine::cpu::math::gemm::tests::wild;
    use crate::util::rng::SplitMix64;

    /// `cuda/reference.cu`'s `reference_mla_scores` and `reference_mla_sums` written out on the
    /// host with the same operations in the same order (each lane's fused multiply-adds in
    /// column order, the butterfly as lane 0 sees it, the product then the add of the sums),
    /// chunked as `gpu::reference`'s `mla` chunks (at most `most` scores a chunk).
    #[allow(clippy::too_many_arguments)]
    fn kernels(
        d: Dims,
        x: Inputs<'_>,
        q: &[f32],
        offs: &[u64],
        keys: &[u32],
        scale: f64,
        most: usize,
        softmax: &mut super::super::device::Softmax<'_>,
    ) -> Vec<f32> {
        let Dims { h, nope, rd, v } = d;
        let (qk, kvw) = (nope + rd, nope + v);
        let n = offs.len() - 1;
        let butterfly = |a: [f64; 8]| -> f64 {
            let s1: Vec<f64> = (0..8).map(|l| a[l] + a[l ^ 1]).collect();
            let s2: Vec<f64> = (0..8).map(|l| s1[l] + s1[l ^ 2]).collect();
            s2[0] + s2[4]
        };
        let mut out = vec![0f32; n * h * v];
        let mut c0 = 0;
        while c0 < n {
            let mut c1 = c0 + 1;
            while c1 < n && (offs[c1 + 1] - offs[c0]) as usize * h <= most {
                c1 += 1;
            }
            let base = offs[c0];
            let m = (offs[c1] - base) as usize * h;
            let mut sc = vec![0f64; m];
            for i in c0..c1 {
                let (o0, len) = (offs[i], (offs[i + 1] - offs[i]) as usize);
                for hd in 0..h {
                    let qr = &q[(i * h + hd) * qk..(i * h + hd + 1) * qk];
                    for j in 0..len {
                        let key = keys[o0 as usize + j] as usize;
                        let kr = &x.kv[(key * h + hd) * kvw..];
                        let pr = &x.kpe[key * rd..];
                        let (mut a, mut b) = ([0f64; 8], [0f64; 8]);
                        for c in 0..nope {
                            a[c % 8] = f64::from(qr[c]).mul_add(f64::from(kr[c]), a[c % 8]);
                        }
                        for c in 0..rd {
                            b[c % 8] = f64::from(qr[nope + c]).mul_add(f64::from(pr[c]), b[c % 8]);
                        }
                        sc[(o0 - base) as usize * h + hd * len + j] =
                            (butterfly(a) + butterfly(b)) * scale;
                    }
                }
            }
            softmax(&mut sc, c0..c1).unwrap();
            for i in c0..c1 {
                let (o0, len) = (offs[i], (offs[i + 1] - offs[i]) as usize);
                for hd in 0..h {
                    let p = &sc[(o0 - base) as usize * h + hd * len..];
                    for dd in 0..v {
                        let mut acc = 0f64;
                        for j in 0..len {
                            let key = keys[o0 as usize + j] as usize;
                            let val = f64::from(x.kv[(key * h + hd) * kvw + nope + dd]);
                            let prod = p[j] * val;
                            acc += prod;
                        }
                        out[(i * h + hd) * v + dd] = acc as f32;
                    }
                }
            }
            c0 = c1;
        }
        out
    }

    /// The device's scores and weighted sums (as its kernels compute them, written out here),
    /// with the host's softmax between them, in chunks, give [`attend`]'s heads bit for bit:
    /// causal and with ragged DSA selections, all rows and a subset, widths not a multiple of
    /// the lanes, values over the whole exponent range, an infinite V value (the CPU's rows
    /// one at a time; the device's sums over the own keys alone are the same).
    #[test]
    fn device_kernels_and_host_softmax_are_attend() {
        let mut rng = SplitMix64::new(31);
        let d = Dims {
            h: 3,
            nope: 13,
            rd: 6,
            v: 10,
        };
        let t = 70;
        let qb = wild(&mut rng, t * d.h * (d.nope + d.rd));
        let qpe = wild(&mut rng, t * d.h * d.rd);
        let mut kv = wild(&mut rng, t * d.h * (d.nope + d.v));
        let kpe = wild(&mut rng, t * d.rd);
        let selection: Vec<Vec<u32>> = (0..t)
            .map(|qt| {
                let mut k: Vec<u32> = (0..9)
                    .map(|_| (rng.next_u64() % (qt as u64 + 1)) as u32)
                    .collect();
                k.sort_unstable();
                k.dedup();
                k
            })
            .collect();
        let causal: Vec<Vec<u32>> = (0..t).map(|qt| (0..=qt as u32).collect()).collect();
        let mut n = 0;
        for poison in [false, true] {
            if poison {
                kv[5 * d.h * (d.nope + d.v) + d.nope + 2] = f32::INFINITY;
            }
            let x = Inputs {
                qb: &qb,
                qpe: &qpe,
                kv: &kv,
                kpe: &kpe,
                t,
            };
            for keys_of in [&causal, &selection] {
                for queries in [
                    (0..t).collect::<Vec<_>>(),
                    (0..t).filter(|r| r % 4 != 1).collect(),
                ] {
                    let ks: Vec<Vec<u32>> = queries.iter().map(|&r| keys_of[r].clone()).collect();
                    let want = attend(d, x, &queries, &ks, 0.3, false).0;
                    for most in [1usize, 200, 1 << 20] {
                        let got =
                            attend_with(d, x, &queries, &ks, &mut |q, offs, keys, softmax| {
                                Ok(Some(kernels(d, x, q, offs, keys, 0.3, most, softmax)))
                            })
                            .unwrap()
                            .unwrap();
                        let bad = want.iter().zip(&got).position(|(a, b)| {
                            a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan())
                        });
                        assert!(
                            bad.is_none(),
                            "poison {poison} most {most}: element {bad:?}"
                        );
                        n += 1;
                    }
                }
            }
        }
        assert_eq!(n, 24);
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
            let kv = crate::engine::cpu::math::matmul(kv_norm.as_f32("kv_a_norm")?, t, kv_b);
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
        let (c3, wall) = (cpu(), t0.elapsed().as_secs_f64());
        // The product both compute first (kv = c · kv_b^T), timed alone.
        std::hint::black_box(crate::engine::cpu::math::matmul(
            kv_norm.as_f32("c").unwrap(),
            t,
            &kv_b,
        ));
        let kv_s = cpu() - c3;
        let o = o.as_f32("o").unwrap();
        let h64: u64 = o.iter().fold(0xcbf29ce484222325, |a, x| {
            (a ^ u64::from(x.to_bits())).wrapping_mul(0x100000001b3)
        });
        let c2 = c3;
        eprintln!(
            "mla T={t} k={k}: {:.3} s wall, cpu naive {:.2} s new {:.2} s, of which the kv \
             product {kv_s:.2} s, hash {h64:016x}",
            wall,
            c1 - c0,
            c2 - c1
        );
        assert_eq!(o0.as_f32("o").unwrap(), o);
        (c1 - c0, c2 - c1)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn pool(n: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    }

    /// `sel` `[T, k]`: every row's `k` ids drawn from `-3..=T+2` (so -1 and other negatives,
    /// ids past the row's token, duplicates and gaps), some rows all -1.
    fn messy_selection(rng: &mut crate::util::rng::SplitMix64, t: usize, k: usize) -> Vec<i32> {
        (0..t * k)
            .map(|i| {
                if (i / k) % 11 == 5 {
                    -1
                } else {
                    rng.range(0, t as u32 + 6) as i32 - 3
                }
            })
            .collect()
    }

    /// `mla_queries` (all rows and row subsets, with and without probabilities, at every SIMD
    /// build in a 1-thread pool and in a 3-thread pool) equals the definition as first written
    /// ([`mla_host_naive`]), heads and probabilities bit for bit, on the tiny GLM-5 fixture's
    /// dimensions: token counts around the blocks (1, 7, 40, 77), a causal mask, a window of
    /// the last keys, and messy selections (ids out of range, -1, duplicates, empty rows; few
    /// keys per row, so that blocks split down to single rows, and many).
    #[test]
    fn mla_equals_the_naive_definition() {
        use crate::engine::cpu::math::gemm::tests::{levels, wild};
        use crate::util::rng::SplitMix64;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/models/glm5-tiny/glm5-tiny-f32.gguf"
        );
        let model = crate::gguf::Model::open(std::path::Path::new(path)).unwrap();
        let hp = HParams::from_metadata(&model).unwrap();
        let (h, qk, rd, kvl, v) = (
            hp.n_head,
            hp.qk_head(),
            hp.qk_rope,
            hp.kv_lora_rank,
            hp.v_head,
        );
        let mut rng = SplitMix64::new(0x5eed);
        let mut checked = 0;
        for t in [1usize, 7, 40, 77] {
            // Queries over a wide range of magnitudes; keys and values moderate (wild values
            // through kv_b would overflow the scores to inf for every row).
            let q_b = HostTensor::f32(vec![t, h * qk], wild(&mut rng, t * h * qk)).unwrap();
            let scaled = |rng: &mut SplitMix64, n: usize, s: f32| -> Vec<f32> {
                (0..n).map(|_| (rng.uniform() - 0.5) * s).collect()
            };
            let q_pe = HostTensor::f32(vec![t, h, rd], scaled(&mut rng, t * h * rd, 4.0)).unwrap();
            let kv_norm = HostTensor::f32(vec![t, kvl], scaled(&mut rng, t * kvl, 2.0)).unwrap();
            let k_pe = HostTensor::f32(vec![t, rd], scaled(&mut rng, t * rd, 4.0)).unwrap();
            let kv_b = Matrix {
                rows: h * (hp.qk_nope + v),
                cols: kvl,
                data: scaled(&mut rng, h * (hp.qk_nope + v) * kvl, 1.0),
            };
            let window = 5.min(t);
            let sels: Vec<Option<HostTensor>> = vec![
                None,
                Some(
                    HostTensor::i32(
                        vec![t, window],
                        (0..t)
                            .flat_map(|q| {
                                (0..window).map(move |i| if i <= q { (q - i) as i32 } else { -1 })
                            })
                            .collect(),
                    )
                    .unwrap(),
                ),
                Some(HostTensor::i32(vec![t, 3], messy_selection(&mut rng, t, 3)).unwrap()),
                Some(HostTensor::i32(vec![t, 2 * t], messy_selection(&mut rng, t, 2 * t)).unwrap()),
            ];
            let subsets: Vec<Option<Vec<usize>>> = vec![
                None,
                Some((0..t).filter(|r| r % 3 != 1).collect()),
                Some(vec![t - 1]),
            ];
            for sel in &sels {
                let x = || MlaInputs {
                    q_b: &q_b,
                    q_pe: &q_pe,
                    kv_norm: &kv_norm,
                    k_pe: &k_pe,
                    selection: sel.as_ref(),
                };
                let (o0, p0) = mla_host_naive(&hp, 0, x(), &kv_b, 0.07, true).unwrap();
                let (o0, p0) = (o0.as_f32("o").unwrap(), p0.unwrap());
                let p0 = p0.as_f32("p").unwrap();
                for rows in &subsets {
                    let r: Vec<usize> = rows.clone().unwrap_or_else(|| (0..t).collect());
                    let want_o: Vec<f32> = r
                        .iter()
                        .flat_map(|&q| o0[q * h * v..(q + 1) * h * v].to_vec())
                        .collect();
                    let want_p: Vec<f32> = (0..h)
                        .flat_map(|hd| r.iter().map(move |&q| (hd, q)))
                        .flat_map(|(hd, q)| p0[(hd * t + q) * t..(hd * t + q + 1) * t].to_vec())
                        .collect();
                    let mut runs: Vec<(String, rayon::ThreadPool, _)> = levels()
                        .into_iter()
                        .map(|l| (l.name().to_string(), pool(1), l))
                        .collect();
                    runs.push(("3 threads".into(), pool(3), *levels().last().unwrap()));
                    for (name, p, l) in &runs {
                        for want_probs in [false, true] {
                            let (o, pr) = p
                                .install(|| {
                                    crate::quant::simd::with_cap(*l, || {
                                        mla_queries(
                                            &hp,
                                            0,
                                            x(),
                                            Kv::B(&kv_b),
                                            0.07,
                                            want_probs,
                                            rows.as_deref(),
                                            None,
                                        )
                                    })
                                })
                                .unwrap();
                            let what = format!(
                                "{name}: t={t} sel={:?} rows={rows:?} probs={want_probs}",
                                sel.as_ref().map(|s| s.shape.clone())
                            );
                            assert!(bits(o.as_f32("o").unwrap()) == bits(&want_o), "{what}");
                            assert_eq!(o.shape, vec![r.len(), h * v]);
                            match pr {
                                Some(pr) => {
                                    assert!(want_probs, "{what}");
                                    assert_eq!(pr.shape, vec![h, r.len(), t]);
                                    assert!(
                                        bits(pr.as_f32("p").unwrap()) == bits(&want_p),
                                        "{what}"
                                    );
                                }
                                None => assert!(!want_probs, "{what}"),
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked >= 4 * 4 * 3 * 2 * 2);
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

#[cfg(test)]
mod blocks {
    use super::*;
    use crate::engine::cpu::math::gemm::tests::{cancelling, levels, wild};
    use crate::quant::simd::with_cap;
    use crate::util::rng::SplitMix64;

    /// The definition on explicit K and V rows: per head and row, the two dots of every key
    /// of the row in ascending order, [`softmax_in_place`], then the keys' V rows summed in
    /// ascending order. Heads `[n, H*v]`, probabilities `[H, n, T]`.
    fn definition(
        d: Dims,
        x: Inputs<'_>,
        queries: &[usize],
        keys_of: &[Vec<u32>],
        scale: f64,
    ) -> (Vec<f32>, Vec<f32>) {
        definition_with(d, x, queries, keys_of, scale, dot)
    }

    /// [`definition`] with `dot` in place of [`dot`] (to count the values its order changes).
    fn definition_with(
        d: Dims,
        x: Inputs<'_>,
        queries: &[usize],
        keys_of: &[Vec<u32>],
        scale: f64,
        dot: fn(&[f32], &[f32]) -> f64,
    ) -> (Vec<f32>, Vec<f32>) {
        let Dims { h, nope, rd, v } = d;
        let (t, n, qk, kv_w) = (x.t, queries.len(), nope + rd, nope + v);
        let mut heads = vec![0f32; n * h * v];
        let mut probs = vec![0f32; h * n * t];
        for head in 0..h {
            for (i, (&qt, keys)) in queries.iter().zip(keys_of).enumerate() {
                let q_nope = &x.qb[qt * h * qk + head * qk..][..nope];
                let q_rot = &x.qpe[(qt * h + head) * rd..][..rd];
                let mut p: Vec<f64> = keys
                    .iter()
                    .map(|&s| {
                        let s = s as usize;
                        let k_nope = &x.kv[s * h * kv_w + head * kv_w..][..nope];
                        (dot(q_nope, k_nope) + dot(q_rot, &x.kpe[s * rd..][..rd])) * scale
                    })
                    .collect();
                softmax_in_place(&mut p);
                let mut acc = vec![0f64; v];
                for (&s, &ps) in keys.iter().zip(&p) {
                    let s = s as usize;
                    let vs = &x.kv[s * h * kv_w + head * kv_w + nope..][..v];
                    for (a, &y) in acc.iter_mut().zip(vs) {
                        *a += ps * f64::from(y);
                    }
                    probs[(head * n + i) * t + s] = ps as f32;
                }
                for (o, a) in heads[i * h * v + head * v..][..v].iter_mut().zip(&acc) {
                    *o = *a as f32;
                }
            }
        }
        (heads, probs)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `sum a[i] * b[i]` in f64, in index order.
    fn sequential(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum()
    }

    /// Inputs of `t` tokens with widths `d` whose every score is order sensitive: the queries'
    /// and keys' nope and rot parts are [`wild`] values with [`cancelling`] pairs of products
    /// near 2^60 in changing lanes (scaled by 2^-24 into moderate scores). Tokens go in pairs
    /// (2m, 2m+1) with equal K rows, so equal probabilities; V values are below 1/32, but
    /// half of a pair's columns are near +-2^30 in the first row and the negation in the
    /// second: a sum swamps and cancels there, dropping the low bits of what came before, so
    /// the order of the keys shows. `(qb, qpe, kv, kpe)`.
    fn order_sensitive(
        rng: &mut SplitMix64,
        d: Dims,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let Dims { h, nope, rd, v } = d;
        let (qk, kv_w) = (nope + rd, nope + v);
        let (qn, kn) = (wild(rng, t * h * nope), wild(rng, t * h * nope));
        let (qn, kn) = cancelling(rng, qn, kn, nope);
        let (qr, kr) = (wild(rng, t * h * rd), wild(rng, t * rd));
        let (qr, mut kr) = cancelling(rng, qr, kr, rd);
        let vals: Vec<f32> = (0..t * h * v)
            .map(|_| (rng.uniform() - 0.5) / 16.0)
            .collect();
        let (mut qb, mut kv) = (vec![0f32; t * h * qk], vec![0f32; t * h * kv_w]);
        for r in 0..t * h {
            qb[r * qk..r * qk + nope].copy_from_slice(&qn[r * nope..(r + 1) * nope]);
            qb[r * qk + nope..(r + 1) * qk].fill(f32::NAN); // never read (rope part of q_b)
            kv[r * kv_w..r * kv_w + nope].copy_from_slice(&kn[r * nope..(r + 1) * nope]);
            kv[r * kv_w + nope..(r + 1) * kv_w].copy_from_slice(&vals[r * v..(r + 1) * v]);
        }
        for tok in (1..t).step_by(2) {
            let row = tok * h * kv_w;
            for head in 0..h {
                let (a, b) = (row - h * kv_w + head * kv_w, row + head * kv_w);
                kv.copy_within(a..a + nope, b);
                for c in 0..v {
                    let u = rng.next_u64();
                    if u & 2 == 2 {
                        let sign = if u & 1 == 1 { 1.0 } else { -1.0 };
                        kv[a + nope + c] = sign * (1.0 + rng.uniform()) * 2f32.powi(30);
                        kv[b + nope + c] = -kv[a + nope + c];
                    }
                }
            }
            kr.copy_within((tok - 1) * rd..tok * rd, tok * rd);
        }
        (qb, qr, kv, kr)
    }

    /// Key lists of the rows `queries` of `t` tokens: every key up to the row (causal), a
    /// window of 37, a few random keys per row (blocks split down to single rows), and random
    /// lists with empty rows.
    fn selections(rng: &mut SplitMix64, t: usize, queries: &[usize]) -> Vec<Vec<Vec<u32>>> {
        let random = |rng: &mut SplitMix64, per: u32, empty_every: usize| -> Vec<Vec<u32>> {
            queries
                .iter()
                .enumerate()
                .map(|(i, &q)| {
                    if empty_every > 0 && i % empty_every == 2 {
                        return Vec::new();
                    }
                    let mut k: Vec<u32> = (0..per).map(|_| rng.range(0, q as u32)).collect();
                    k.sort_unstable();
                    k.dedup();
                    k
                })
                .collect()
        };
        vec![
            queries.iter().map(|&q| (0..=q as u32).collect()).collect(),
            queries
                .iter()
                .map(|&q| (q.saturating_sub(36) as u32..=q as u32).collect())
                .collect(),
            random(rng, 3, 0),
            random(rng, t as u32, 5),
        ]
    }

    /// [`attend`] equals [`definition`] bit for bit, heads and probabilities, at every SIMD
    /// build the CPU has (1-thread pool; and 3 threads at the widest): widths that are not
    /// multiples of the lanes or the tiles (nope 19, rot 6, v 37), GLM-5's (192, 64, 256) and
    /// no rot part; token counts around the blocks (1, 5, 33, 70); all rows and a subset; on
    /// data whose every score and many sums change with the order of their additions.
    #[test]
    fn blocks_are_the_definition_at_every_level() {
        let mut rng = SplitMix64::new(0xa77e);
        let dims = [
            Dims {
                h: 2,
                nope: 19,
                rd: 6,
                v: 37,
            },
            Dims {
                h: 2,
                nope: 192,
                rd: 64,
                v: 256,
            },
            Dims {
                h: 3,
                nope: 16,
                rd: 0,
                v: 8,
            },
        ];
        let scale = 2f64.powi(-24);
        let (mut sums_sensitive, mut outputs, mut probs_sensitive, mut probs) = (0, 0, 0, 0);
        for d in dims {
            for t in [1usize, 5, 33, 70] {
                let (qb, qpe, kv, kpe) = order_sensitive(&mut rng, d, t);
                let x = Inputs {
                    qb: &qb,
                    qpe: &qpe,
                    kv: &kv,
                    kpe: &kpe,
                    t,
                };
                let all: Vec<usize> = (0..t).collect();
                let some: Vec<usize> = (0..t).filter(|q| q % 4 != 1).collect();
                for queries in [&all, &some] {
                    for keys_of in selections(&mut rng, t, queries) {
                        let (want_o, want_p) = definition(d, x, queries, &keys_of, scale);
                        // The same definition with the keys reversed, and with sequential
                        // dot products: how many values each order would change.
                        let rev: Vec<Vec<u32>> = keys_of
                            .iter()
                            .map(|k| k.iter().rev().copied().collect())
                            .collect();
                        let (rev_o, _) = definition(d, x, queries, &rev, scale);
                        let (_, seq_p) =
                            definition_with(d, x, queries, &keys_of, scale, sequential);
                        let differ = |a: &[f32], b: &[f32]| {
                            a.iter()
                                .zip(b)
                                .filter(|(a, b)| a.to_bits() != b.to_bits())
                                .count()
                        };
                        outputs += want_o.len();
                        sums_sensitive += differ(&rev_o, &want_o);
                        probs += want_p.iter().filter(|p| **p != 0.0).count();
                        probs_sensitive += differ(&seq_p, &want_p);
                        let mut runs: Vec<(usize, crate::quant::simd::Level)> =
                            levels().into_iter().map(|l| (1, l)).collect();
                        runs.push((3, *levels().last().unwrap()));
                        for (threads, l) in runs {
                            let (o, p) = rayon::ThreadPoolBuilder::new()
                                .num_threads(threads)
                                .build()
                                .unwrap()
                                .install(|| {
                                    with_cap(l, || attend(d, x, queries, &keys_of, scale, true))
                                });
                            let what = format!(
                                "{} threads={threads} {d:?} t={t} rows={}",
                                l.name(),
                                queries.len()
                            );
                            assert!(bits(&o) == bits(&want_o), "{what}: heads");
                            assert!(bits(&p.unwrap()) == bits(&want_p), "{what}: probs");
                        }
                    }
                }
            }
        }
        // The data must be order sensitive, else equal values prove little.
        assert!(
            sums_sensitive * 10 >= outputs,
            "sums: {sums_sensitive} of {outputs}"
        );
        assert!(
            probs_sensitive * 10 >= probs,
            "probabilities: {probs_sensitive} of {probs}"
        );
    }

    /// V values that are infinite or NaN in one head: that head's rows go one at a time (a
    /// key outside a row's own would add 0 * inf = NaN in a block), and every value is still
    /// the definition's, at every level.
    #[test]
    fn infinite_values_as_the_definition() {
        let mut rng = SplitMix64::new(0x1f);
        let d = Dims {
            h: 2,
            nope: 8,
            rd: 8,
            v: 16,
        };
        let t = 40;
        let (qb, qpe, mut kv, kpe) = order_sensitive(&mut rng, d, t);
        let kv_w = d.nope + d.v;
        // Head 1: token 3's V has +inf, token 9's NaN.
        kv[3 * d.h * kv_w + kv_w + d.nope + 2] = f32::INFINITY;
        kv[9 * d.h * kv_w + kv_w + d.nope + 5] = f32::NAN;
        let x = Inputs {
            qb: &qb,
            qpe: &qpe,
            kv: &kv,
            kpe: &kpe,
            t,
        };
        let queries: Vec<usize> = (0..t).collect();
        // Every row sees token 0 and its own; rows 20.. also 3 and 9.
        let keys_of: Vec<Vec<u32>> = queries
            .iter()
            .map(|&q| {
                let mut k = vec![0, q as u32];
                if q >= 20 {
                    k.extend([3, 9]);
                }
                k.sort_unstable();
                k.dedup();
                k
            })
            .collect();
        let (want_o, want_p) = definition(d, x, &queries, &keys_of, 1e-6);
        assert!(want_o.iter().any(|v| v.is_nan()) && want_o.iter().any(|v| v.is_finite()));
        for l in levels() {
            let (o, p) = with_cap(l, || attend(d, x, &queries, &keys_of, 1e-6, true));
            let same = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
            };
            assert!(same(&o, &want_o), "{}: heads", l.name());
            assert!(same(&p.unwrap(), &want_p), "{}: probs", l.name());
        }
    }
}
