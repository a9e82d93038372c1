//! The CPU realisation of the weight descriptions of [`crate::model::weights`]: host f32,
//! dequantized on demand and only as far as a step needs (the embedding rows of the prompt, one
//! expert's slice, a matrix a few rows at a time), with kv_b reassembled into HF `kv_b_proj`
//! layout.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::CpuEngine;
use crate::model::{KvB, WeightSlice};
use crate::quant;
use rayon::prelude::*;

/// A dense f32 matrix, row-major: `data[r * cols + c]`, PyTorch shape `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Number of rows (output features of a linear layer).
    pub rows: usize,
    /// Number of columns (input features; GGUF `ne[0]`).
    pub cols: usize,
    /// `rows * cols` values.
    pub data: Vec<f32>,
}

/// `values` of rows `slice.rows.start + first..` of `slice` (`slice.cols` a row), when every
/// one is finite. A NaN or Inf in a weight makes every output it reaches NaN on both sides, which
/// a comparison would blame on the candidate: the model itself is broken, said at the first
/// weight the reference reads, with the element (exit 2 like any bad input).
fn finite(slice: &WeightSlice<'_>, first: usize, values: &[f32]) -> Result<()> {
    let Some(i) = crate::quant::first_non_finite(values) else {
        return Ok(());
    };
    let cols = slice.cols.max(1);
    let bad = values.iter().filter(|v| !v.is_finite()).count();
    bail!(
        "model: {}: tensor {} ({:?}) holds non-finite weights: {} at row {} column {}, {bad} NaN/Inf in the {} values read; \
         the model file is broken, not the engine (`glmdiff weights-check` or `glmdiff dequant` show the tensor)",
        slice.model().path().display(),
        slice.name(),
        slice.ty(),
        values[i],
        slice.rows.start + first + i / cols,
        i % cols,
        values.len()
    )
}

/// [`WeightSlice::dequantize`], checked by [`finite`].
fn dequantize_finite(slice: &WeightSlice<'_>) -> Result<Vec<f32>> {
    let v = slice.dequantize()?;
    finite(slice, 0, &v)?;
    Ok(v)
}

impl Matrix {
    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A [`WeightSlice`] that dequantizes any sub-range of its rows into a caller's buffer, on the
/// calling thread. The values equal those of [`WeightSlice::dequantize`].
#[derive(Clone)]
pub struct RowSource<'m> {
    slice: WeightSlice<'m>,
    /// Rows of this source.
    pub rows: usize,
    /// Values per row (`ne[0]`).
    pub cols: usize,
}

impl<'m> RowSource<'m> {
    /// Rows of `slice`.
    pub fn new(slice: WeightSlice<'m>) -> RowSource<'m> {
        RowSource {
            rows: slice.n_rows(),
            cols: slice.cols,
            slice,
        }
    }

    /// The tensor's GGUF name.
    pub fn name(&self) -> &str {
        self.slice.name()
    }

    /// Where its rows lie in a file: the shard's path, their first byte and their length
    /// (`None` for a model held in memory).
    pub fn file_range(&self) -> Result<Option<(&'m std::path::Path, u64, u64)>> {
        self.slice.file_range()
    }

    /// The GGML type and raw GGUF bytes of all its rows (whole blocks, `rows * cols` values).
    pub fn raw(&self) -> Result<(crate::quant::GgmlType, &'m [u8])> {
        Ok((self.slice.ty(), self.slice.data()?))
    }

    /// Dequantizes rows `rows` (relative to this source) into `dst` (`rows.len() * cols` values),
    /// on the calling thread.
    pub fn dequantize_into(&self, rows: Range<usize>, dst: &mut [f32]) -> Result<()> {
        let model = self.slice.model();
        if rows.start > rows.end || rows.end > self.rows || dst.len() != rows.len() * self.cols {
            bail!(
                "model: {}: tensor {}: rows {rows:?} of {} into {} values",
                model.path().display(),
                self.name(),
                self.rows,
                dst.len()
            );
        }
        let bytes = self.slice.sub(rows.clone())?.data()?;
        quant::dequantize(self.slice.ty(), bytes, dst).with_context(|| {
            format!("model: {}: tensor {}", model.path().display(), self.name())
        })?;
        if quant::finite_by_scales(self.slice.ty(), bytes) {
            return Ok(());
        }
        finite(&self.slice, rows.start, dst)
    }
}

/// Rebuilds HF `kv_b_proj` `[H*(nope+v), kv_lora]` from the converter's split tensors:
/// `k_b` is PyTorch `[H, kv_lora, nope]` (`k_b[h][c][d]`), `v_b` is `[H, v, kv_lora]`.
/// Per head h: rows `d < nope` are `k_b[h][:, d]` (transposed back), then the `v` rows of `v_b[h]`
/// (spec 3.1: `cat([K.transpose(1,2), V], dim=1).reshape(H*(nope+v), kv_lora)`).
pub fn assemble_kv_b(
    k_b: &[f32],
    v_b: &[f32],
    h: usize,
    nope: usize,
    v: usize,
    kv_lora: usize,
) -> Vec<f32> {
    let per_head = (nope + v) * kv_lora;
    let mut out = vec![0f32; h * per_head];
    if per_head == 0 {
        return out;
    }
    // One head per task: its K rows transposed from [kv_lora, nope], its V rows ([v, kv_lora])
    // copied.
    out.par_chunks_mut(per_head)
        .enumerate()
        .for_each(|(head, o)| {
            let kh = &k_b[head * kv_lora * nope..(head + 1) * kv_lora * nope]; // [kv_lora, nope]
            let (ko, vo) = o.split_at_mut(nope * kv_lora);
            for (d, row) in ko.chunks_exact_mut(kv_lora).enumerate() {
                for (c, x) in row.iter_mut().enumerate() {
                    *x = kh[c * nope + d];
                }
            }
            vo.copy_from_slice(&v_b[head * v * kv_lora..(head + 1) * v * kv_lora]);
        });
    out
}

/// The dimensions of a split kv_b ([`KvB::Split`]).
#[derive(Clone, Copy)]
struct KvBDims {
    heads: usize,
    nope: usize,
    v: usize,
    kv_lora: usize,
}

/// [`assemble_kv_b`] of the split tensors `k_b` and `v_b` read from the file head by head on the
/// threads, into `buf`'s allocation: each head's `k_b` rows dequantized into a small buffer and
/// transposed in tiles, its `v_b` rows dequantized in place. The same values (dequantization
/// goes block by block, and rows hold whole blocks); `[H*(nope+v), kv_lora]`.
fn assemble_kv_b_by_head(
    k_b: &WeightSlice<'_>,
    v_b: &WeightSlice<'_>,
    d: KvBDims,
    mut buf: Vec<f32>,
) -> Result<Vec<f32>> {
    let (ks, vs) = (RowSource::new(k_b.clone()), RowSource::new(v_b.clone()));
    let KvBDims {
        heads,
        nope,
        v,
        kv_lora,
    } = d;
    if (ks.rows, ks.cols, vs.rows, vs.cols) != (heads * kv_lora, nope, heads * v, kv_lora) {
        bail!(
            "model: {}: {} holds {} rows of {} and {} {} rows of {}, where {heads} heads of nope {nope}, \
             v {v} and kv_lora {kv_lora} need {} of {nope} and {} of {kv_lora}",
            k_b.model().path().display(),
            ks.name(),
            ks.rows,
            ks.cols,
            vs.name(),
            vs.rows,
            vs.cols,
            heads * kv_lora,
            heads * v
        );
    }
    let per_head = (nope + v) * kv_lora;
    if buf.len() != heads * per_head {
        buf.clear();
        buf.resize(heads * per_head, 0.0);
    }
    if per_head == 0 {
        return Ok(buf);
    }
    buf.par_chunks_mut(per_head).enumerate().try_for_each_init(
        Vec::new,
        |kh: &mut Vec<f32>, (h, o)| -> Result<()> {
            kh.resize(kv_lora * nope, 0.0);
            ks.dequantize_into(h * kv_lora..(h + 1) * kv_lora, kh)?; // [kv_lora, nope]
            let (ko, vo) = o.split_at_mut(nope * kv_lora); // [nope, kv_lora], [v, kv_lora]
            transpose(kh, kv_lora, nope, ko);
            vs.dequantize_into(h * v..(h + 1) * v, vo)
        },
    )?;
    Ok(buf)
}

/// `dst[j * rows + i] = src[i * cols + j]`: `src` `[rows, cols]` transposed into `dst`
/// `[cols, rows]`, in tiles of 16 by 16 (a column read a value at a time takes a cache line a
/// value).
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const TILE: usize = 16;
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            for i in i0..(i0 + TILE).min(rows) {
                for j in j0..(j0 + TILE).min(cols) {
                    dst[j * rows + i] = src[i * cols + j];
                }
            }
        }
    }
}

impl<'w> CpuEngine<'w> {
    /// The 1-D tensor `name` (norm weight, bias) in f32.
    pub fn host_vector(&self, name: &str) -> Result<Vec<f32>> {
        dequantize_finite(&self.weights.vector_desc(name)?)
    }

    /// Embedding rows of `ids`: `[ids.len(), hidden]`. Ids out of range are an error.
    pub(super) fn host_embedding(&self, ids: &[u32]) -> Result<Matrix> {
        let hidden = self.weights.hparams().hidden;
        let mut data = Vec::with_capacity(ids.len() * hidden);
        for row in self.weights.embedding_rows_desc(ids)? {
            data.extend(dequantize_finite(&row)?);
        }
        Ok(Matrix {
            rows: ids.len(),
            cols: hidden,
            data,
        })
    }

    /// Layer `layer`'s kv_b as [`CpuEngine::host_kv_b`] assembles it, kept for the next call
    /// with the same layer (one layer at a time: 59 MB at GLM-5 size). The kept layer's buffer
    /// serves the next one when nothing else holds it (new memory each layer, page faults and
    /// all, was about 4% of a 16-token layer's CPU time).
    pub fn kv_b(&self, layer: usize) -> Result<Arc<Matrix>> {
        let mut buf = Vec::new();
        if let Ok(mut kept) = self.kv_b.lock() {
            if let Some((l, m)) = kept.as_ref() {
                if *l == layer {
                    return Ok(Arc::clone(m));
                }
            }
            if let Some(Ok(m)) = kept.take().map(|(_, m)| Arc::try_unwrap(m)) {
                buf = m.data;
            }
        }
        let m = Arc::new(self.host_kv_b_in(layer, buf)?);
        if let Ok(mut kept) = self.kv_b.lock() {
            *kept = Some((layer, Arc::clone(&m)));
        }
        Ok(m)
    }

    /// The kv_b projection of layer `layer` in HF `kv_b_proj` layout, `[H*(nope+v), kv_lora]`:
    /// rows per head, `nope` K rows then `v` V rows; reassembled from `attn_k_b`/`attn_v_b`
    /// ([`assemble_kv_b`]) or read from the legacy unsplit `attn_kv_b`.
    pub fn host_kv_b(&self, layer: usize) -> Result<Matrix> {
        self.host_kv_b_in(layer, Vec::new())
    }

    /// [`CpuEngine::host_kv_b`] written into `buf`'s allocation (any length; its values are
    /// not read).
    fn host_kv_b_in(&self, layer: usize, buf: Vec<f32>) -> Result<Matrix> {
        match self.weights.kv_b_desc(layer)? {
            KvB::Legacy(kv_b) => Ok(Matrix {
                rows: kv_b.n_rows(),
                cols: kv_b.cols,
                data: dequantize_finite(&kv_b)?,
            }),
            KvB::Split {
                k_b,
                v_b,
                heads,
                nope,
                v,
                kv_lora,
            } => {
                let dims = KvBDims {
                    heads,
                    nope,
                    v,
                    kv_lora,
                };
                match assemble_kv_b_by_head(&k_b, &v_b, dims, buf) {
                    Ok(data) => Ok(Matrix {
                        rows: heads * (nope + v),
                        cols: kv_lora,
                        data,
                    }),
                    Err(e) => {
                        // The error of the whole tensors, as every other read of a weight
                        // gives it (the first non-finite value of `k_b`, then of `v_b`).
                        dequantize_finite(&k_b)?;
                        dequantize_finite(&v_b)?;
                        Err(e)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Model;
    use crate::model::names::{self, blk};
    use crate::model::testutil::{build_with, metadata, tensor_names, tiny_hparams};
    use crate::model::{Arch, Weights};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// kv_b rebuilt head by head, into a fresh buffer, another layer's, or one of another length
    /// holding NaN, is bit for bit [`assemble_kv_b`] of the whole tensors' dequantized values, on
    /// the quantized and the f32 fixtures of both architectures.
    #[test]
    fn kv_b_by_head_is_the_whole_tensors_assembled() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models");
        for rel in [
            "glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "glm5-tiny/glm5-tiny-f32.gguf",
            "dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
            "dsv3-tiny/dsv3-tiny-f32.gguf",
        ] {
            let model = Model::open(&dir.join(rel)).unwrap();
            let w = Weights::new(&model).unwrap();
            let cpu = CpuEngine::new(&w);
            let n_layer = w.hparams().n_layer;
            let want: Vec<Vec<f32>> = (0..n_layer)
                .map(|l| match w.kv_b_desc(l).unwrap() {
                    KvB::Split {
                        k_b,
                        v_b,
                        heads,
                        nope,
                        v,
                        kv_lora,
                    } => assemble_kv_b(
                        &k_b.dequantize().unwrap(),
                        &v_b.dequantize().unwrap(),
                        heads,
                        nope,
                        v,
                        kv_lora,
                    ),
                    KvB::Legacy(_) => panic!("{rel}: layer {l}: unsplit kv_b"),
                })
                .collect();
            // Each layer after the first takes the buffer of the one before.
            for l in (0..n_layer).chain((0..n_layer).rev()) {
                let got = cpu.kv_b(l).unwrap();
                assert_eq!(bits(&got.data), bits(&want[l]), "{rel}: layer {l}");
                assert_eq!(got.rows * got.cols, want[l].len());
            }
            let got = cpu.host_kv_b_in(0, vec![f32::NAN; 7]).unwrap();
            assert_eq!(bits(&got.data), bits(&want[0]), "{rel}: another length");
            let got = cpu.host_kv_b_in(0, vec![f32::NAN; want[0].len()]).unwrap();
            assert_eq!(bits(&got.data), bits(&want[0]), "{rel}: NaN in the buffer");
        }
    }

    /// The tiled transpose moves every value where the definition puts it, with whole and
    /// partial tiles in both directions (the fixtures' heads fit in one partial tile).
    #[test]
    fn transpose_in_tiles_by_definition() {
        for (rows, cols) in [(1, 1), (16, 16), (37, 20), (512, 192), (5, 33)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let mut dst = vec![f32::NAN; rows * cols];
            transpose(&src, rows, cols, &mut dst);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(
                        dst[j * rows + i],
                        src[i * cols + j],
                        "{rows}x{cols} at {i},{j}"
                    );
                }
            }
        }
    }

    /// A non-finite value in `attn_k_b` or `attn_v_b` is reported as a read of the whole tensor
    /// reports it: the tensor, the first such value's row and column, and the count over the
    /// tensor (`attn_k_b`'s first when both hold one).
    #[test]
    fn kv_b_non_finite_is_the_whole_tensors_error() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let (k_b, v_b) = (names::blk(0, blk::ATTN_K_B), names::blk(0, blk::ATTN_V_B));
        let (nk, nv) = (
            hp.n_head * hp.kv_lora_rank * hp.qk_nope,
            hp.n_head * hp.v_head * hp.kv_lora_rank,
        );
        let with = |k: &[(usize, f32)], v: &[(usize, f32)]| {
            let mut over = std::collections::HashMap::new();
            let (mut kv, mut vv) = (vec![0.25f32; nk], vec![0.5f32; nv]);
            k.iter().for_each(|&(i, x)| kv[i] = x);
            v.iter().for_each(|&(i, x)| vv[i] = x);
            over.insert(k_b.clone(), kv);
            over.insert(v_b.clone(), vv);
            build_with(&hp, &metadata(&hp), &tensor_names(&hp), 32, &over)
        };
        for (k, v, name) in [
            (vec![(nk - 1, f32::NAN)], vec![], &k_b),
            (vec![], vec![(3, f32::INFINITY), (nv - 2, f32::NAN)], &v_b),
            (
                vec![(nk / 2 + 1, f32::NEG_INFINITY)],
                vec![(0, f32::NAN)],
                &k_b,
            ),
        ] {
            let model = with(&k, &v);
            let w = Weights::new(&model).unwrap();
            let cpu = CpuEngine::new(&w);
            let got = format!("{:#}", cpu.host_kv_b(0).unwrap_err());
            let want = format!(
                "{:#}",
                dequantize_finite(&w.tensor_desc(name).unwrap()).unwrap_err()
            );
            assert_eq!(got, want);
            assert!(
                got.contains(name.as_str()) && got.contains("non-finite"),
                "{got}"
            );
        }
    }

    /// H=2, nope=2, v=1, kv_lora=3. HF kv_b rows (per head: K0, K1, V0), written by hand:
    /// head 0: [1,2,3] [4,5,6] [7,8,9]; head 1: [10,11,12] [13,14,15] [16,17,18].
    /// The converter's split: k_b[h] = K rows transposed ([kv_lora, nope]), v_b[h] = V rows.
    #[test]
    fn kv_b_split_and_reassembly_by_hand() {
        let k_b = [
            1., 4., 2., 5., 3., 6., // head 0: [[1,4],[2,5],[3,6]]
            10., 13., 11., 14., 12., 15., // head 1
        ];
        let v_b = [7., 8., 9., 16., 17., 18.];
        let kv = assemble_kv_b(&k_b, &v_b, 2, 2, 1, 3);
        let want: Vec<f32> = (1..=18).map(|x| x as f32).collect();
        assert_eq!(kv, want);
    }
}
