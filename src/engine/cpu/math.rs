//! Arithmetic kernels of the CPU reference: f32 storage, f64 accumulation, fixed reduction order.
//!
//! # Accumulation scheme
//! Every value a step stores is f32. Every reduction (dot product, sum of squares, softmax
//! denominator, weighted sum) is done in f64 and rounded to f32 once at the end. A dot product of
//! f32 vectors multiplies in f64 (exact: a product of two 24-bit mantissas fits in 53 bits) and
//! adds into [`LANES`] f64 accumulators, element `i` into accumulator `i % LANES`, which are then
//! combined pairwise in a fixed tree. The order depends only on the vector length, never on the
//! thread count: threads only split *independent outputs* (rows of a matmul, heads, tokens), so
//! results are bit-identical for any `RAYON_NUM_THREADS`. No fused multiply-add is used (Rust
//! never contracts `a * b + c` on its own), so results do not depend on the CPU either.

use anyhow::Result;
use rayon::prelude::*;

use super::weights::{Matrix, RowSource};

/// Weight rows a step multiplies with: read from the file and dequantized as they are used (the
/// reference), or a dense host matrix (another realisation of the same description, e.g. the
/// weights a faulty loader would have built). Both multiply with the same [`dot`], so
/// equal values give bit-identical products.
pub enum Rows<'m> {
    /// Rows of a GGUF tensor.
    Source(RowSource<'m>),
    /// A host matrix.
    Dense(Matrix),
}

impl Rows<'_> {
    /// `x · W^T`: `[t, cols]` -> `[t, rows]`.
    pub fn matmul(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        match self {
            Rows::Source(src) => matmul_rows(x, t, src),
            Rows::Dense(m) => Ok(matmul(x, t, m)),
        }
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        match self {
            Rows::Source(src) => src.cols,
            Rows::Dense(m) => m.cols,
        }
    }
}

/// Independent f64 accumulators of a dot product (lets the compiler use SIMD lanes).
pub const LANES: usize = 8;

/// Combines the lanes in a fixed pairwise tree: ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).
#[inline]
fn combine(acc: [f64; LANES]) -> f64 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// `sum a[i] * b[i]` in f64 (see the module documentation for the order).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f64; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += f64::from(x[l]) * f64::from(y[l]);
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += f64::from(*x) * f64::from(*y);
    }
    combine(acc)
}

/// `x · W^T` for `x` `[t, w.cols]`: writes columns `col0..col0+w.rows` of `out` (`[t, out_cols]`).
/// Parallel over the rows of `w` (each output element is one [`dot`]), in tasks of
/// [`ROW_TASK_ELEMS`] weight values; the values do not depend on the split.
pub fn matmul_into(x: &[f32], t: usize, w: &Matrix, out: &mut [f32], out_cols: usize, col0: usize) {
    let k = w.cols;
    debug_assert_eq!(x.len(), t * k);
    let rows_per_task = (ROW_TASK_ELEMS / k.max(1)).max(1);
    let tt = t.max(1);
    // [w.rows, t]: one row of W against every token, so the weight row stays in cache.
    let mut tr = vec![0f32; w.rows * tt];
    tr.par_chunks_mut(rows_per_task * tt)
        .enumerate()
        .for_each(|(task, o)| {
            for (i, orow) in o.chunks_exact_mut(tt).enumerate() {
                let wr = w.row(task * rows_per_task + i);
                for (tok, v) in orow.iter_mut().enumerate().take(t) {
                    *v = dot(&x[tok * k..(tok + 1) * k], wr) as f32;
                }
            }
        });
    for r in 0..w.rows {
        for tok in 0..t {
            out[tok * out_cols + col0 + r] = tr[r * tt + tok];
        }
    }
}

/// Values of weight rows dequantized by one task of [`matmul_rows`] (256 KiB of f32, so the rows
/// are still in cache when their dot products run).
pub const ROW_TASK_ELEMS: usize = 1 << 16;

/// `x · W^T` for weight rows read from a quantized tensor: `[t, src.cols]` -> `[t, src.rows]`.
/// Each task dequantizes a few rows into a per-thread buffer and uses them at once, so neither
/// the whole f32 matrix nor large temporary allocations ever exist.
pub fn matmul_rows(x: &[f32], t: usize, src: &RowSource<'_>) -> Result<Vec<f32>> {
    let k = src.cols;
    debug_assert_eq!(x.len(), t * k);
    let rows_per_task = (ROW_TASK_ELEMS / k.max(1)).max(1);
    let tt = t.max(1);
    // [src.rows, t]: one weight row against every token.
    let mut tr = vec![0f32; src.rows * tt];
    tr.par_chunks_mut(rows_per_task * tt)
        .enumerate()
        .try_for_each_init(Vec::new, |buf: &mut Vec<f32>, (task, o)| -> Result<()> {
            let r0 = task * rows_per_task;
            let n = o.len() / tt;
            buf.resize(n * k, 0.0);
            src.dequantize_into(r0..r0 + n, buf)?;
            for (i, orow) in o.chunks_exact_mut(tt).enumerate() {
                let wr = &buf[i * k..(i + 1) * k];
                for (tok, v) in orow.iter_mut().enumerate().take(t) {
                    *v = dot(&x[tok * k..(tok + 1) * k], wr) as f32;
                }
            }
            Ok(())
        })?;
    let mut out = vec![0f32; t * src.rows];
    for r in 0..src.rows {
        for tok in 0..t {
            out[tok * src.rows + r] = tr[r * tt + tok];
        }
    }
    Ok(out)
}

/// `x · W^T`: `[t, w.cols]` -> `[t, w.rows]`.
pub fn matmul(x: &[f32], t: usize, w: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; t * w.rows];
    matmul_into(x, t, w, &mut out, w.rows, 0);
    out
}

/// RMSNorm of each row of `x` (`[t, n]`): `w * v / sqrt(mean(v^2) + eps)`.
pub fn rms_norm(x: &[f32], n: usize, w: &[f32], eps: f64) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(n.max(1))
        .zip(x.par_chunks(n.max(1)))
        .for_each(|(o, v)| {
            let inv = 1.0 / (dot(v, v) / n as f64 + eps).sqrt();
            for ((o, &v), &w) in o.iter_mut().zip(v).zip(w) {
                *o = (f64::from(w) * (f64::from(v) * inv)) as f32;
            }
        });
    out
}

/// LayerNorm of one row: `(v - mean) / sqrt(var + eps) * w + b` (biased variance, as PyTorch).
pub fn layer_norm(v: &[f32], w: &[f32], b: &[f32], eps: f64) -> Vec<f32> {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = v
        .iter()
        .map(|&x| {
            let d = f64::from(x) - mean;
            d * d
        })
        .sum::<f64>()
        / n;
    let inv = 1.0 / (var + eps).sqrt();
    v.iter()
        .zip(w)
        .zip(b)
        .map(|((&x, &w), &b)| ((f64::from(x) - mean) * inv * f64::from(w) + f64::from(b)) as f32)
        .collect()
}

/// `x * sigmoid(x)` in f64.
#[inline]
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + exp(-x))` in f64.
#[inline]
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu(a) * b` elementwise, rounded to f32.
pub fn swiglu(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter()
        .zip(b)
        .map(|(&g, &u)| (silu(f64::from(g)) * f64::from(u)) as f32)
        .collect()
}

/// Softmax of `v` in place (max subtracted; sum in index order).
pub fn softmax_in_place(v: &mut [f64]) {
    let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for x in v.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    for x in v.iter_mut() {
        *x /= sum;
    }
}

/// Rotates adjacent pairs `(x[2i], x[2i+1])` of `x` by `cos_sin[i] = (cos, sin)` (already scaled
/// by the attention factor): `(x0 c - x1 s, x0 s + x1 c)`.
pub fn rotate_pairs(x: &mut [f32], cos_sin: &[(f64, f64)]) {
    for (p, &(c, s)) in x.chunks_exact_mut(2).zip(cos_sin) {
        let (x0, x1) = (f64::from(p[0]), f64::from(p[1]));
        p[0] = (x0 * c - x1 * s) as f32;
        p[1] = (x0 * s + x1 * c) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_by_hand() {
        // v = [3, 4]: mean(v^2) = 12.5; eps = 0 -> 1/sqrt(12.5); w = [1, 2].
        let out = rms_norm(&[3.0, 4.0], 2, &[1.0, 2.0], 0.0);
        let r = 1.0 / 12.5f64.sqrt();
        assert_eq!(out, vec![(3.0 * r) as f32, (2.0 * 4.0 * r) as f32]);
        // With eps: v = [1, 1], eps = 1 -> 1/sqrt(2).
        let out = rms_norm(&[1.0, 1.0], 2, &[1.0, 1.0], 1.0);
        assert_eq!(out[0], (0.5f64).sqrt() as f32);
    }

    #[test]
    fn rope_pairs_by_hand() {
        // Pair (1, 0) rotated by 90 degrees -> (0, 1); pair (2, 3) by 0 -> unchanged.
        let mut x = [1.0f32, 0.0, 2.0, 3.0];
        let half_pi = std::f64::consts::FRAC_PI_2;
        rotate_pairs(&mut x, &[(half_pi.cos(), half_pi.sin()), (1.0, 0.0)]);
        assert!(x[0].abs() < 1e-7 && (x[1] - 1.0).abs() < 1e-7);
        assert_eq!(&x[2..], &[2.0, 3.0]);
    }

    #[test]
    fn layer_norm_by_hand() {
        // v = [1, 3]: mean 2, var 1 -> [-1, 1] * w + b.
        let out = layer_norm(&[1.0, 3.0], &[2.0, 1.0], &[0.5, 0.0], 0.0);
        assert_eq!(out, vec![-1.5, 1.0]);
    }

    #[test]
    fn dot_and_matmul_by_hand() {
        let a: Vec<f32> = (1..=10).map(|x| x as f32).collect();
        assert_eq!(dot(&a, &a), 385.0); // sum of squares 1..10
        let w = Matrix {
            rows: 2,
            cols: 2,
            data: vec![1.0, 2.0, 3.0, 4.0],
        };
        // x = [[1, 1], [0, 1]] -> x W^T = [[3, 7], [2, 4]].
        assert_eq!(
            matmul(&[1.0, 1.0, 0.0, 1.0], 2, &w),
            vec![3.0, 7.0, 2.0, 4.0]
        );
    }

    #[test]
    fn softmax_by_hand() {
        let mut v = [0.0, 2f64.ln()];
        softmax_in_place(&mut v);
        assert!((v[0] - 1.0 / 3.0).abs() < 1e-15 && (v[1] - 2.0 / 3.0).abs() < 1e-15);
    }
}
