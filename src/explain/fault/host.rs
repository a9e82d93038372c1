//! The faulty arithmetic and weight layouts, on host f32: each function is one field bug, written
//! beside the correct form it departs from. Nothing here is used by the reference.

use anyhow::{bail, Result};

use crate::engine::cpu::{math, Matrix};
use crate::model::WeightSlice;
use crate::quant::{self, GgmlType};

/// Bytes per Q4_K super-block (ggml `block_q4_K`: f16 d, f16 dmin, scales[12], qs[128]).
const Q4_K_BYTES: usize = 144;
/// Offset of the 12 packed scale bytes in a Q4_K block.
const Q4_K_SCALES: usize = 4;

/// kv_b as a loader that concatenates all heads' K rows, then all heads' V rows, builds it,
/// read back as the per-head layout attention expects. In: HF `kv_b_proj` `[H*(nope+v),
/// kv_lora]` (per head `nope` K rows, then `v` V rows). Out: same shape, rows `K[0], K[1], ..,
/// K[H-1], V[0], .., V[H-1]` (`torch.cat([kv[:, :nope].reshape(H*nope, -1), kv[:,
/// nope:].reshape(H*v, -1)])`, the plant of `reference/fixtures/engine_dumps.py`).
pub fn kv_b_concat(kv: &Matrix, heads: usize, nope: usize, v: usize) -> Matrix {
    let per = nope + v;
    let mut data = Vec::with_capacity(kv.data.len());
    for h in 0..heads {
        for d in 0..nope {
            data.extend_from_slice(kv.row(h * per + d));
        }
    }
    for h in 0..heads {
        for j in 0..v {
            data.extend_from_slice(kv.row(h * per + nope + j));
        }
    }
    Matrix {
        rows: kv.rows,
        cols: kv.cols,
        data,
    }
}

/// The head each slot reads when `heads` are split into `shards` tensor-parallel shards and the
/// last shard is loaded one head further: slot `h` of the last shard reads head `(h+1) % heads`.
pub fn shard_heads(heads: usize, shards: usize) -> Vec<usize> {
    let per = heads / shards.max(1);
    (0..heads)
        .map(|h| if h >= heads - per { (h + 1) % heads } else { h })
        .collect()
}

/// Row blocks of `rows_per_head` rows moved per head: block `h` of the result is block
/// `from[h]` of `m` (`[heads*rows_per_head, cols]`).
pub fn map_row_blocks(m: &Matrix, rows_per_head: usize, from: &[usize]) -> Result<Matrix> {
    if m.rows != from.len() * rows_per_head {
        bail!(
            "fault: a [{}, {}] matrix is not {} heads of {rows_per_head} rows",
            m.rows,
            m.cols,
            from.len()
        );
    }
    let block = rows_per_head * m.cols;
    let mut data = Vec::with_capacity(m.data.len());
    for &f in from {
        data.extend_from_slice(&m.data[f * block..(f + 1) * block]);
    }
    Ok(Matrix {
        rows: m.rows,
        cols: m.cols,
        data,
    })
}

/// Column blocks of `cols_per_head` columns moved per head: column block `h` of every row of the
/// result is block `from[h]` of `m` (`[rows, heads*cols_per_head]`).
pub fn map_col_blocks(m: &Matrix, cols_per_head: usize, from: &[usize]) -> Result<Matrix> {
    if m.cols != from.len() * cols_per_head {
        bail!(
            "fault: a [{}, {}] matrix is not {} heads of {cols_per_head} columns",
            m.rows,
            m.cols,
            from.len()
        );
    }
    let mut data = Vec::with_capacity(m.data.len());
    for r in 0..m.rows {
        let row = m.row(r);
        for &f in from {
            data.extend_from_slice(&row[f * cols_per_head..(f + 1) * cols_per_head]);
        }
    }
    Ok(Matrix {
        rows: m.rows,
        cols: m.cols,
        data,
    })
}

/// The matrix as a loader that reads its memory in the transposed order sees it: same shape,
/// `W'[r][c] = data[c * rows + r]`.
pub fn transposed(m: &Matrix) -> Matrix {
    let mut data = Vec::with_capacity(m.data.len());
    for r in 0..m.rows {
        data.extend((0..m.cols).map(|c| m.data[c * m.rows + r]));
    }
    Matrix {
        rows: m.rows,
        cols: m.cols,
        data,
    }
}

/// Q4_K blocks as a `get_scale_min_k4` that drops the high bits of sub-blocks 4..7 reads them.
/// ggml's form: `j >= 4`: `sc = (s[j+4] & 0xF) | (s[j-4] >> 6) << 4`, `m = (s[j+4] >> 4) |
/// (s[j] >> 6) << 4`; without the `>> 6` terms the result is that of blocks whose bytes
/// `s[0..8]` have their two top bits cleared (sub-blocks 0..3 read those bytes `& 63`, so they
/// are unchanged). The returned bytes are valid Q4_K blocks that the exact dequantizer turns into
/// the faulty values.
pub fn q4k_without_high_scale_bits(bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for b in out.chunks_exact_mut(Q4_K_BYTES) {
        for s in &mut b[Q4_K_SCALES..Q4_K_SCALES + 8] {
            *s &= 0x3F;
        }
    }
    out
}

/// `slice` dequantized, Q4_K with the high scale bits dropped (`[n_rows, cols]`).
pub fn dequant_q4k_faulty(slice: &WeightSlice<'_>) -> Result<Vec<f32>> {
    if slice.ty() != GgmlType::Q4_K {
        bail!("fault: {} is {:?}, not Q4_K", slice.name(), slice.ty());
    }
    let bytes = q4k_without_high_scale_bits(slice.data()?);
    let mut out = vec![0f32; slice.n_values()];
    quant::dequantize(GgmlType::Q4_K, &bytes, &mut out)?;
    Ok(out)
}

/// A slice as a dense matrix (`[n_rows, cols]`).
pub fn dense(slice: &WeightSlice<'_>) -> Result<Matrix> {
    Ok(Matrix {
        rows: slice.n_rows(),
        cols: slice.cols,
        data: slice.dequantize()?,
    })
}

/// Rotates the half-split pairs `(x[i], x[i + d/2])` of `x` (length `d`) by `cos_sin[i]`: the
/// NeoX layout, where the model (and every correct engine) rotates adjacent pairs
/// ([`math::rotate_pairs`]).
pub fn rotate_halves(x: &mut [f32], cos_sin: &[(f64, f64)]) {
    let half = x.len() / 2;
    for (i, &(c, s)) in cos_sin.iter().enumerate().take(half) {
        let (x0, x1) = (f64::from(x[i]), f64::from(x[i + half]));
        x[i] = (x0 * c - x1 * s) as f32;
        x[i + half] = (x0 * s + x1 * c) as f32;
    }
}

/// `x · W^T` with every product added into one f32 accumulator in index order (a naive f32
/// kernel; the reference accumulates in f64).
pub fn matmul_f32_accumulate(x: &[f32], t: usize, w: &Matrix) -> Vec<f32> {
    let k = w.cols;
    let mut out = vec![0f32; t * w.rows];
    for tok in 0..t {
        let xr = &x[tok * k..(tok + 1) * k];
        for r in 0..w.rows {
            let mut acc = 0f32;
            for (a, b) in xr.iter().zip(w.row(r)) {
                acc += a * b;
            }
            out[tok * w.rows + r] = acc;
        }
    }
    out
}

/// Rounds to bfloat16 (nearest even) and back.
pub fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// `x · W^T` in bf16: inputs and weights rounded to bf16, products (exact in f32) summed in f32,
/// the output rounded to bf16.
pub fn matmul_bf16(x: &[f32], t: usize, w: &Matrix) -> Vec<f32> {
    let xb: Vec<f32> = x.iter().map(|&v| bf16(v)).collect();
    let wb = Matrix {
        rows: w.rows,
        cols: w.cols,
        data: w.data.iter().map(|&v| bf16(v)).collect(),
    };
    matmul_f32_accumulate(&xb, t, &wb)
        .into_iter()
        .map(bf16)
        .collect()
}

/// The reference product, for faults that change only the weights.
pub fn matmul(x: &[f32], t: usize, w: &Matrix) -> Vec<f32> {
    math::matmul(x, t, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: (0..rows * cols).map(|x| x as f32).collect(),
        }
    }

    /// H=2, nope=2, v=1: per-head rows [K00 K01 V0 | K10 K11 V1] become [K00 K01 K10 K11 V0 V1].
    #[test]
    fn kv_b_concat_by_hand() {
        let kv = m(6, 1);
        assert_eq!(kv_b_concat(&kv, 2, 2, 1).data, vec![0., 1., 3., 4., 2., 5.]);
    }

    #[test]
    fn shards_and_blocks_by_hand() {
        assert_eq!(shard_heads(4, 2), vec![0, 1, 3, 0]);
        assert_eq!(shard_heads(4, 4), vec![0, 1, 2, 0]);
        let r = map_row_blocks(&m(4, 1), 2, &[1, 1]).unwrap();
        assert_eq!(r.data, vec![2., 3., 2., 3.]);
        let c = map_col_blocks(&m(1, 4), 2, &[1, 0]).unwrap();
        assert_eq!(c.data, vec![2., 3., 0., 1.]);
        // [[0, 1, 2], [3, 4, 5]] read transposed: data[c*2 + r].
        assert_eq!(transposed(&m(2, 3)).data, vec![0., 2., 4., 1., 3., 5.]);
    }

    #[test]
    fn neox_rotation_by_hand() {
        // (x0, x2) rotated by 90 degrees, (x1, x3) by 0.
        let mut x = [1.0f32, 2.0, 0.0, 3.0];
        let q = std::f64::consts::FRAC_PI_2;
        rotate_halves(&mut x, &[(q.cos(), q.sin()), (1.0, 0.0)]);
        assert!(x[0].abs() < 1e-7 && (x[2] - 1.0).abs() < 1e-7);
        assert_eq!((x[1], x[3]), (2.0, 3.0));
    }

    /// One Q4_K block whose scale bytes 0..8 have their top bits set: the faulty reading differs
    /// only in sub-blocks 4..7, and there by the dropped `<< 4` terms.
    #[test]
    fn q4k_high_bits_only_change_upper_sub_blocks() {
        let mut b = vec![0u8; Q4_K_BYTES];
        b[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes()); // d
        b[2..4].copy_from_slice(&half::f16::from_f32(0.0).to_le_bytes()); // dmin
        for s in &mut b[4..12] {
            *s = 0xC1; // sc (j<4) = 1, high bits 3 for j>=4
        }
        for s in &mut b[12..16] {
            *s = 0x02; // sc (j>=4) low bits = 2
        }
        for q in &mut b[16..] {
            *q = 0x11; // every quant 1
        }
        let (mut good, mut bad) = (vec![0f32; 256], vec![0f32; 256]);
        quant::dequantize(GgmlType::Q4_K, &b, &mut good).unwrap();
        quant::dequantize(GgmlType::Q4_K, &q4k_without_high_scale_bits(&b), &mut bad).unwrap();
        // Sub-block j covers values 32j..32j+32 in the order (g, t): j = 2g + t.
        for j in 0..8 {
            let (g, t) = (j / 2, j % 2);
            let v = 64 * g + 32 * t;
            let (want_good, want_bad) = if j < 4 { (1.0, 1.0) } else { (2.0 + 48.0, 2.0) };
            assert_eq!((good[v], bad[v]), (want_good, want_bad), "sub-block {j}");
        }
    }

    #[test]
    fn bf16_and_f32_products() {
        let w = Matrix {
            rows: 1,
            cols: 2,
            data: vec![1.0 + 1.0 / 512.0, 1.0],
        };
        // bf16(1 + 2^-9) = 1 (ties to even): 1*1 + 1*1 = 2.
        assert_eq!(matmul_bf16(&[1.0, 1.0], 1, &w), vec![2.0]);
        assert_eq!(
            matmul_f32_accumulate(&[1.0, 1.0], 1, &w),
            vec![2.0 + 1.0 / 512.0]
        );
    }
}
