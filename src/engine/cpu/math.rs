//! Arithmetic kernels of the CPU reference: f32 storage, f64 accumulation, fixed reduction order.
//!
//! # Accumulation scheme
//! Every value a step stores is f32. Every reduction (dot product, sum of squares, softmax
//! denominator, weighted sum) is done in f64 and rounded to f32 once at the end. A dot product of
//! f32 vectors multiplies in f64 (exact: a product of two 24-bit mantissas fits in 53 bits) and
//! adds into [`LANES`] f64 accumulators, element `i` into accumulator `i % LANES`, which are then
//! combined pairwise in a fixed tree. The order depends only on the vector length, never on the
//! thread count: threads only split *independent outputs* (rows of a matmul, heads, tokens), so
//! results are bit-identical for any `RAYON_NUM_THREADS`. The matrix products compute many dot
//! products at once ([`gemm`]: tiles of tokens by weight rows, fused multiply-adds in the AVX2
//! and AVX-512 builds), each with exactly [`dot`]'s operations in [`dot`]'s order: since every
//! product is exact, a fused multiply-add rounds where the add does, so results do not depend
//! on the CPU or its SIMD build either (Rust never contracts `a * b + c` on its own elsewhere).

use anyhow::Result;
use rayon::prelude::*;

use super::weights::{Matrix, RowSource};

pub mod gemm;

/// Weight rows a step multiplies with: read from the file and dequantized as they are used (the
/// reference), or a dense host matrix (another realisation of the same description, e.g. the
/// weights a faulty loader would have built). Both multiply with the same kernel
/// ([`gemm::products`], every element [`dot`]'s), so equal values give bit-identical products;
/// `CpuEngine::rows_matmul` multiplies either (on the engine's device when it has one).
pub enum Rows<'m> {
    /// Rows of a GGUF tensor.
    Source(RowSource<'m>),
    /// A host matrix.
    Dense(Matrix),
}

impl Rows<'_> {
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
#[inline(always)]
pub(super) fn combine(acc: [f64; LANES]) -> f64 {
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

/// [`dot`] of f32 values already converted to f64 (exactly): the same products in the same
/// lanes and order, so the same bits, without converting at every call.
#[inline]
pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f64; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += *x * *y;
    }
    combine(acc)
}

/// `x · W^T` for `x` `[t, w.cols]`: writes columns `col0..col0+w.rows` of `out` (`[t, out_cols]`).
/// Parallel over the rows of `w` in tasks of [`rows_per_task`] rows, each element the [`dot`] of
/// its token and its row ([`gemm::products`]); the values do not depend on the split.
pub fn matmul_into(x: &[f32], t: usize, w: &Matrix, out: &mut [f32], out_cols: usize, col0: usize) {
    let k = w.cols;
    debug_assert_eq!(x.len(), t * k);
    let n = rows_per_task(t, k);
    let tt = t.max(1);
    // [w.rows, t]: each task's rows against every token.
    let mut tr = vec![0f32; w.rows * tt];
    tr.par_chunks_mut(n * tt).enumerate().for_each(|(task, o)| {
        let r0 = task * n;
        let m = o.len() / tt;
        with_scratch(|s| gemm::products(x, t, &w.data[r0 * k..(r0 + m) * k], m, k, o, &mut s.gemm));
    });
    transpose_into(&tr, w.rows, t, out, out_cols, col0);
}

/// Values of weight rows dequantized by one task of [`matmul_rows`] with fewer tokens than a
/// token block of [`gemm`] (256 KiB of f32, so the rows are still in cache when their dot
/// products run, and many tasks share the dequantization).
pub const ROW_TASK_ELEMS: usize = 1 << 16;

/// Values of weight rows per task with a token block or more: the tokens' activations are read
/// from memory once per task, so a task takes more rows (1 MiB of f32).
pub const ROW_TASK_ELEMS_MANY_TOKENS: usize = 1 << 18;

/// Fewest rows of one task: with fewer, converting the task's tokens to f64 and the tiles'
/// set-up weigh on the products (measured on a 2-core Zen 4 VM, AVX-512, 16 tokens of 6144
/// values: 17 GFLOP/s per thread with tasks of 8 rows, 26 with 16).
pub const ROW_TASK_MIN_ROWS: usize = 16;

/// Most rows of one task (bounds the lanes a token block keeps in cache).
pub const ROW_TASK_MAX_ROWS: usize = 64;

/// Weight rows of `cols` values per task of [`matmul_rows`] and [`matmul_into`] with `t`
/// tokens: [`ROW_TASK_ELEMS`] values with fewer tokens than [`gemm::TOKEN_BLOCK`], else
/// [`ROW_TASK_ELEMS_MANY_TOKENS`], between [`ROW_TASK_MIN_ROWS`] and [`ROW_TASK_MAX_ROWS`]
/// rows, a multiple of 4 (the tiles' rows). Only the speed depends on it.
pub fn rows_per_task(t: usize, cols: usize) -> usize {
    let elems = if t >= gemm::TOKEN_BLOCK {
        ROW_TASK_ELEMS_MANY_TOKENS
    } else {
        ROW_TASK_ELEMS
    };
    (elems / cols.max(1)).clamp(ROW_TASK_MIN_ROWS, ROW_TASK_MAX_ROWS) / 4 * 4
}

/// Token rows per piece of [`transpose_into`]'s parallel loop.
const TRANSPOSE_TOKENS: usize = 16;

/// Writes `tr` (`[rows, t]`) transposed into columns `col0..col0+rows` of `out` (`[t, out_cols]`),
/// in parallel over blocks of tokens.
fn transpose_into(
    tr: &[f32],
    rows: usize,
    t: usize,
    out: &mut [f32],
    out_cols: usize,
    col0: usize,
) {
    if t == 0 || rows == 0 {
        return;
    }
    out[..t * out_cols]
        .par_chunks_mut(TRANSPOSE_TOKENS * out_cols)
        .enumerate()
        .for_each(|(b, o)| {
            let t0 = b * TRANSPOSE_TOKENS;
            let tb = o.len() / out_cols;
            for r in 0..rows {
                for (i, &v) in tr[r * t + t0..r * t + t0 + tb].iter().enumerate() {
                    o[i * out_cols + col0 + r] = v;
                }
            }
        });
}

/// Scratch of one thread's tasks of [`matmul_rows`] and [`matmul_into`]: the dequantized rows
/// and [`gemm`]'s own.
#[derive(Default)]
struct RowsScratch {
    rows: Vec<f32>,
    gemm: gemm::Scratch,
}

/// Bytes of a thread's [`RowsScratch`] kept for its next task; more is freed after a task.
/// A task with fewer than [`gemm::TOKEN_BLOCK`] tokens of 16384 columns holds 1 MiB of rows
/// and up to 4 MiB of converted tokens, one with more 1 MiB of rows and 2 MiB of them in f64,
/// so every projection of GLM-5 keeps its buffers; a process keeps at most this much a thread
/// that made products (about 3-7 MiB at GLM-5's sizes: 50-110 MiB for 16 threads).
const SCRATCH_KEEP_BYTES: usize = 8 << 20;

thread_local! {
    /// This thread's [`RowsScratch`], kept from one task to the next: a fresh one per task (or
    /// per rayon job) costs an allocation, page faults and a zero fill of every buffer, about
    /// as much as a short prompt's products of a task.
    static ROWS_SCRATCH: std::cell::RefCell<RowsScratch> = std::cell::RefCell::new(RowsScratch::default());
}

/// `f` with this thread's [`RowsScratch`], or with a fresh one when it is in use (a task that
/// waits for other work may run another task on its thread). Only the speed depends on which.
fn with_scratch<R>(f: impl FnOnce(&mut RowsScratch) -> R) -> R {
    ROWS_SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut s) => {
            let r = f(&mut s);
            if s.rows.capacity() * 4 + s.gemm.bytes() > SCRATCH_KEEP_BYTES {
                *s = RowsScratch::default();
            }
            r
        }
        Err(_) => f(&mut RowsScratch::default()),
    })
}

/// `x · W^T` for weight rows read from a quantized tensor: `[t, src.cols]` -> `[t, src.rows]`.
/// Each task dequantizes [`rows_per_task`] rows into a per-thread buffer and multiplies them at
/// once with every token ([`gemm::products`]), so neither the whole f32 matrix nor large
/// temporary allocations ever exist.
pub fn matmul_rows(x: &[f32], t: usize, src: &RowSource<'_>) -> Result<Vec<f32>> {
    let k = src.cols;
    debug_assert_eq!(x.len(), t * k);
    let n = rows_per_task(t, k);
    let tt = t.max(1);
    // [src.rows, t]: each task's rows against every token.
    let mut tr = vec![0f32; src.rows * tt];
    tr.par_chunks_mut(n * tt)
        .enumerate()
        .try_for_each(|(task, o)| -> Result<()> {
            let r0 = task * n;
            let m = o.len() / tt;
            with_scratch(|s| {
                s.rows.resize(m * k, 0.0);
                src.dequantize_into(r0..r0 + m, &mut s.rows)?;
                gemm::products(x, t, &s.rows, m, k, o, &mut s.gemm);
                Ok(())
            })
        })?;
    let mut out = vec![0f32; t * src.rows];
    transpose_into(&tr, src.rows, t, &mut out, src.rows, 0);
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
    use crate::util::rng::SplitMix64;

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

    /// `x · W^T` by [`dot`] alone, `[t, rows]`: the definition the matrix products keep.
    fn by_dot(x: &[f32], t: usize, w: &[f32], rows: usize, k: usize) -> Vec<u32> {
        (0..t * rows)
            .map(|i| {
                let (tok, r) = (i / rows, i % rows);
                (dot(&x[tok * k..(tok + 1) * k], &w[r * k..(r + 1) * k]) as f32).to_bits()
            })
            .collect()
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

    /// [`matmul`] and [`matmul_into`] are [`dot`] per element, bit for bit, in a 1-thread and a
    /// 3-thread pool, with token counts on both sides of the task size's switch (63, 64, 65) and
    /// row counts that leave a last task and a last tile short; `matmul_into` writes only its
    /// columns.
    #[test]
    fn matmul_is_dot_per_element_for_any_split() {
        let mut rng = SplitMix64::new(11);
        for &(t, k, rows) in &[
            (1, 9, 5),
            (3, 1000, 77),
            (17, 6144, 13),
            (63, 257, 150),
            (64, 257, 150),
            (65, 1031, 131),
        ] {
            let (x, w) = (gemm_data(&mut rng, t * k), gemm_data(&mut rng, rows * k));
            let (x, w) = gemm::tests::cancelling(&mut rng, x, w, k);
            let want = by_dot(&x, t, &w, rows, k);
            let m = Matrix {
                rows,
                cols: k,
                data: w.clone(),
            };
            for threads in [1, 3] {
                let got = pool(threads).install(|| matmul(&x, t, &m));
                assert!(
                    bits(&got) == want,
                    "t={t} k={k} rows={rows} threads={threads}"
                );
                // Into columns 2.. of a wider output: the others keep their values.
                let cols = rows + 3;
                let mut out = vec![-1.0f32; t * cols];
                pool(threads).install(|| matmul_into(&x, t, &m, &mut out, cols, 2));
                for tok in 0..t {
                    let row = &out[tok * cols..(tok + 1) * cols];
                    assert_eq!(bits(&row[2..2 + rows]), want[tok * rows..(tok + 1) * rows]);
                    assert!(row[..2].iter().chain(&row[2 + rows..]).all(|&v| v == -1.0));
                }
            }
        }
    }

    fn gemm_data(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        gemm::tests::wild(rng, n)
    }

    /// [`matmul_rows`] over a GGUF tensor (F32 rows, so the dequantized values are the stored
    /// ones) is [`dot`] per element with the tensor's rows, for few and many tokens and any
    /// thread count.
    #[test]
    fn matmul_rows_is_dot_per_element() {
        use crate::model::testutil::{build, metadata, tensor_names, tiny_hparams};
        use crate::model::{names, Arch, Weights};
        let mut hp = tiny_hparams(Arch::Deepseek2);
        hp.hidden = 70;
        let model = build(&hp, &metadata(&hp), &tensor_names(&hp), 150);
        let weights = Weights::new(&model).unwrap();
        let src = RowSource::new(weights.matrix_desc(names::OUTPUT).unwrap());
        let (rows, k) = (src.rows, src.cols);
        assert_eq!((rows, k), (150, 70));
        let mut w = vec![0f32; rows * k];
        src.dequantize_into(0..rows, &mut w).unwrap();
        let mut rng = SplitMix64::new(12);
        for t in [1, 5, 64, 70] {
            let x = gemm_data(&mut rng, t * k);
            let want = by_dot(&x, t, &w, rows, k);
            for threads in [1, 3] {
                let got = pool(threads).install(|| matmul_rows(&x, t, &src)).unwrap();
                assert!(bits(&got) == want, "t={t} threads={threads}");
            }
        }
    }

    /// Tasks are whole tiles of rows (a multiple of 4), 16 to 64 rows, larger with a token
    /// block or more.
    #[test]
    fn rows_per_task_by_hand() {
        assert_eq!(rows_per_task(16, 6144), 16); // 65536 / 6144 = 10, raised to 16
        assert_eq!(rows_per_task(64, 6144), 40); // 262144 / 6144 = 42 -> 40
        assert_eq!(rows_per_task(4096, 12288), 20); // 21 -> 20
        assert_eq!(rows_per_task(4096, 16384), 16);
        assert_eq!(rows_per_task(1, 2048), 32);
        assert_eq!(rows_per_task(256, 2048), 64); // 128, capped
        assert_eq!(rows_per_task(1, 1 << 20), 16);
        assert_eq!(rows_per_task(0, 0), 64);
    }

    use crate::util::thread_cpu_s;

    /// The products as they were computed before [`gemm`]: tasks of [`ROW_TASK_ELEMS`] values
    /// of rows, each row against every token with [`dot`] (`[rows, t]`).
    fn one_dot_at_a_time(x: &[f32], t: usize, w: &Matrix) -> Vec<f32> {
        let k = w.cols;
        let per_task = (ROW_TASK_ELEMS / k).max(1);
        let mut tr = vec![0f32; w.rows * t];
        tr.par_chunks_mut(per_task * t)
            .enumerate()
            .for_each(|(task, o)| {
                for (i, orow) in o.chunks_exact_mut(t).enumerate() {
                    let wr = w.row(task * per_task + i);
                    for (tok, v) in orow.iter_mut().enumerate() {
                        *v = dot(&x[tok * k..(tok + 1) * k], wr) as f32;
                    }
                }
            });
        tr
    }

    /// Speed of `[t, 6144] x [6144 -> 2048]` on one thread, GFLOP/s of thread CPU time (best of
    /// 3), at each SIMD build, against one [`dot`] at a time:
    /// `cargo test --release --lib matmul_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn matmul_speed() {
        use crate::quant::simd::with_cap;
        let (k, rows) = (6144, 2048);
        let mut rng = SplitMix64::new(5);
        let w = Matrix {
            rows,
            cols: k,
            data: (0..rows * k).map(|_| rng.uniform() - 0.5).collect(),
        };
        let one = pool(1);
        for t in [4, 16, 32, 256, 1024] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.uniform() - 0.5).collect();
            let gflop = 2.0 * (t * rows * k) as f64 * 1e-9;
            let best = |f: &(dyn Fn() -> Vec<f32> + Sync)| {
                one.install(|| {
                    (0..3)
                        .map(|_| {
                            let c = thread_cpu_s();
                            std::hint::black_box(f());
                            gflop / (thread_cpu_s() - c)
                        })
                        .fold(0.0, f64::max)
                })
            };
            let old = best(&|| one_dot_at_a_time(&x, t, &w));
            let mut line = format!("t={t:5}: one dot at a time {old:6.1} GFLOP/s");
            for l in gemm::tests::levels() {
                let g = best(&|| with_cap(l, || matmul(&x, t, &w)));
                line += &format!(", {} {g:6.1} ({:.1}x)", l.name(), g / old);
            }
            println!("{line}");
        }
    }

    #[test]
    fn softmax_by_hand() {
        let mut v = [0.0, 2f64.ln()];
        softmax_in_place(&mut v);
        assert!((v[0] - 1.0 / 3.0).abs() < 1e-15 && (v[1] - 2.0 / 3.0).abs() < 1e-15);
    }
}
