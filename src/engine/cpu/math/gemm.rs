//! The blocked matrix product of the CPU reference: many [`dot`](super::dot) products at once,
//! each bit for bit the one [`dot`](super::dot) computes alone.
//!
//! # Why the bits are those of `dot`
//! [`dot`](super::dot) defines every output element: in f64, the product of element `i` added
//! into lane `i % LANES` in order of `i`, the lanes combined in a fixed tree, rounded to f32
//! once. Here each output element keeps its own [`LANES`] accumulators and receives the same
//! products in the same order; only which elements advance side by side changes (a tile of
//! tokens by weight rows sharing its loads), and where the lanes wait between blocks of
//! columns (in memory, as they are). In detail:
//! - the f32 -> f64 conversions of the operands, done once per block instead of per product,
//!   are exact;
//! - a product of two f32 values is exact in f64 (24 + 24 significant bits fit in 53, and its
//!   exponent stays inside f64's normal range), so a fused multiply-add, which rounds once,
//!   rounds what the add after an exact multiply rounds: `fma(a, b, c) == c + a * b`. The AVX2
//!   and AVX-512 builds use `f64::mul_add` (one instruction there); the baseline build (no FMA
//!   on x86-64-v1, where `mul_add` would call libm) multiplies then adds;
//! - rows are padded with zeros on both operands to a multiple of [`LANES`] columns: a lane
//!   starts at +0 and an IEEE sum is -0 only when both terms are, so no lane is ever -0, and
//!   adding `+0 * +0 = +0` leaves every lane as it is (infinities and NaN included); the padded
//!   last chunk is `dot`'s remainder loop. (The rows added to fill the last tile are zeros too,
//!   and their outputs are dropped.)
//!
//! So the values depend on none of the tile shape, the block sizes, the SIMD build, or how
//! rows are split into tasks and threads; `tests` checks them against `dot` for every build
//! the CPU has.
//!
//! # Blocking
//! A call multiplies `n` weight rows (a task of the caller: dequantized rows still in cache)
//! with `t` tokens. The rows are converted to f64 once per call. Tokens go in blocks of
//! [`TOKEN_BLOCK`] and columns in blocks of [`COL_BLOCK`]: per pair of blocks the tokens'
//! columns are converted into a small f64 buffer (from cache), then for each tile of
//! [`TILE_TOKENS`] tokens by `TR` rows the tile's lanes are loaded into registers, advanced over
//! the block's columns and stored back. A tile loads `TILE_TOKENS + TR` vectors of [`LANES`]
//! values per `TILE_TOKENS * TR` multiply-adds; the weight tile stays in L1, the token block
//! and the lanes in L2, and the activations are read from memory once per call, so a caller
//! with many tokens gives each call many rows ([`super::rows_per_task`]).
//! `TR` is 4 in the AVX-512 build (16 accumulators of 8 f64 and 8 operands in 32 registers),
//! 2 in the AVX2 build (16 registers of 4 f64) and 1 in the baseline build (SSE2).

use super::{combine, LANES};
use crate::quant::simd::multiversion;

/// Tokens of a tile (the last tile of a token block may have fewer).
pub const TILE_TOKENS: usize = 4;
/// Tokens per block: their converted columns and the lanes of their outputs stay in cache.
pub const TOKEN_BLOCK: usize = 64;
/// Columns per block, a multiple of [`LANES`].
pub const COL_BLOCK: usize = 256;

/// Working memory of [`products`], kept by a thread from one call to the next.
#[derive(Default)]
pub struct Scratch {
    /// The call's weight rows in f64, padded: `[rows rounded up to TR, cols rounded up to LANES]`.
    w: Vec<f64>,
    /// One block of tokens' columns in f64: `[tokens, block columns]`.
    x: Vec<f64>,
    /// The lanes of one token block's outputs: `[tokens, padded rows]`.
    lanes: Vec<[f64; LANES]>,
}

multiversion! {
    /// `out[r * t + tok] = dot(x[tok], w[r]) as f32` for the `n` rows `w` (`[n, k]`) and the
    /// `t` tokens `x` (`[t, k]`): every value bit for bit [`dot`](super::dot)'s (see the module
    /// documentation), computed in tiles.
    pub fn products(
        x: &[f32],
        t: usize,
        w: &[f32],
        n: usize,
        k: usize,
        out: &mut [f32],
        s: &mut Scratch,
    ) = products_tiled::<4, true>;
    avx2 products_tiled::<2, true>, base products_tiled::<1, false>
}

/// `c + a * b`, fused when `FMA` (the same value: see the module documentation).
#[inline(always)]
fn madd<const FMA: bool>(a: f64, b: f64, c: f64) -> f64 {
    if FMA {
        a.mul_add(b, c)
    } else {
        c + a * b
    }
}

/// [`products`] with tiles of [`TILE_TOKENS`] tokens by `TR` rows, fused multiply-adds when
/// `FMA`.
#[inline(always)]
fn products_tiled<const TR: usize, const FMA: bool>(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    debug_assert!(x.len() >= t * k && w.len() >= n * k && out.len() >= n * t);
    if t == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // No products: every lane stays 0, and so does the sum.
        out[..n * t].fill(0.0);
        return;
    }
    let kp = k.div_ceil(LANES) * LANES;
    let np = n.div_ceil(TR) * TR;
    s.w.resize(np * kp, 0.0);
    for (r, d) in s.w.chunks_exact_mut(kp).enumerate() {
        let src = if r < n { &w[r * k..(r + 1) * k] } else { &[] };
        for (d, &v) in d.iter_mut().zip(src) {
            *d = f64::from(v);
        }
        d[src.len()..].fill(0.0);
    }
    let Scratch {
        w: wf,
        x: xf,
        lanes,
    } = s;
    for t0 in (0..t).step_by(TOKEN_BLOCK) {
        let tb = TOKEN_BLOCK.min(t - t0);
        lanes.clear();
        lanes.resize(tb * np, [0.0; LANES]);
        for c0 in (0..kp).step_by(COL_BLOCK) {
            let cb = COL_BLOCK.min(kp - c0);
            let real = cb.min(k - c0.min(k)); // columns of this block inside the rows
            xf.resize(tb * cb, 0.0);
            for (i, d) in xf.chunks_exact_mut(cb).take(tb).enumerate() {
                let src = &x[(t0 + i) * k + c0..(t0 + i) * k + c0 + real];
                for (d, &v) in d.iter_mut().zip(src) {
                    *d = f64::from(v);
                }
                d[real..].fill(0.0);
            }
            for r0 in (0..np).step_by(TR) {
                let wt = &wf[r0 * kp + c0..];
                let full = tb / TILE_TOKENS * TILE_TOKENS;
                for i0 in (0..full).step_by(TILE_TOKENS) {
                    tile::<TILE_TOKENS, TR, FMA>(
                        &xf[i0 * cb..],
                        cb,
                        wt,
                        kp,
                        cb,
                        &mut lanes[i0 * np + r0..],
                        np,
                    );
                }
                if full < tb {
                    let (xt, lt) = (&xf[full * cb..], &mut lanes[full * np + r0..]);
                    match tb - full {
                        1 => tile::<1, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                        2 => tile::<2, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                        _ => tile::<3, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                    }
                }
            }
        }
        for i in 0..tb {
            for (r, l) in lanes[i * np..i * np + n].iter().enumerate() {
                out[r * t + t0 + i] = combine(*l) as f32;
            }
        }
    }
}

/// Advances the lanes of `TT` tokens by `TR` rows over `cols` columns (a multiple of
/// [`LANES`]): token `i`'s columns at `x[i * xs..]`, row `j`'s at `w[j * ws..]`, the lanes of
/// (token `i`, row `j`) at `lanes[i * ls + j]`.
#[inline(always)]
fn tile<const TT: usize, const TR: usize, const FMA: bool>(
    x: &[f64],
    xs: usize,
    w: &[f64],
    ws: usize,
    cols: usize,
    lanes: &mut [[f64; LANES]],
    ls: usize,
) {
    let mut acc = [[[0f64; LANES]; TR]; TT];
    for (i, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&lanes[i * ls..i * ls + TR]);
    }
    for c in (0..cols).step_by(LANES) {
        let mut xv = [[0f64; LANES]; TT];
        for (i, v) in xv.iter_mut().enumerate() {
            v.copy_from_slice(&x[i * xs + c..i * xs + c + LANES]);
        }
        let mut wv = [[0f64; LANES]; TR];
        for (j, v) in wv.iter_mut().enumerate() {
            v.copy_from_slice(&w[j * ws + c..j * ws + c + LANES]);
        }
        for i in 0..TT {
            for j in 0..TR {
                for l in 0..LANES {
                    acc[i][j][l] = madd::<FMA>(xv[i][l], wv[j][l], acc[i][j][l]);
                }
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        lanes[i * ls..i * ls + TR].copy_from_slice(a);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::cpu::math::dot;
    use crate::quant::simd::{detected, with_cap, Level};
    use crate::util::rng::SplitMix64;

    /// f32 values over most of the exponent range (2^-149 .. 2^10): both zeros, subnormals,
    /// and normal values of every size next to each other.
    pub(crate) fn wild(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = rng.next_u64();
                let sign = if u & 1 == 1 { -1.0f32 } else { 1.0 };
                match (u >> 1) % 16 {
                    0 => 0.0 * sign,
                    // Subnormal: a random payload below 2^-126.
                    1 => f32::from_bits(((u >> 8) as u32) & 0x007f_ffff) * sign,
                    2 => f32::MIN_POSITIVE * sign,
                    _ => {
                        let m = 1.0 + ((u >> 8) & 0xff_ffff) as f32 / (1 << 24) as f32;
                        let e = ((u >> 40) % 111) as i32 - 100; // 2^-100 .. 2^10
                        sign * m * 2f32.powi(e)
                    }
                }
            })
            .collect()
    }

    /// `x` (`[t, k]`) and `w` (`[n, k]`) with two columns of each chunk of [`LANES`] made into
    /// a pair of products near +-2^60 that cancel (`x` +-2^30 and its negation, `w` one value
    /// near 2^30 twice), in lanes that change from chunk to chunk (all 56 ordered pairs over
    /// 56 chunks): each lane holds a partial sum 2^29 times larger than the result, so the
    /// rounding of every partial sum, and any change of order, shows in the f32 result.
    pub(crate) fn cancelling(
        rng: &mut SplitMix64,
        mut x: Vec<f32>,
        mut w: Vec<f32>,
        k: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        for (j, c) in (0..k).step_by(LANES).enumerate() {
            let a = j % LANES;
            let b = (a + 1 + (j / LANES) % (LANES - 1)) % LANES;
            if c + a.max(b) >= k {
                continue;
            }
            for row in x.chunks_exact_mut(k) {
                let sign = if rng.next_u64() & 1 == 1 { -1.0 } else { 1.0 };
                row[c + a] = sign * 2f32.powi(30);
                row[c + b] = -row[c + a];
            }
            for row in w.chunks_exact_mut(k) {
                row[c + a] = (1.0 + rng.uniform()) * 2f32.powi(30);
                row[c + b] = row[c + a];
            }
        }
        (x, w)
    }

    /// The levels this CPU has, lowest first.
    pub(crate) fn levels() -> Vec<Level> {
        [Level::Base, Level::Avx2, Level::Avx512]
            .into_iter()
            .filter(|&l| l <= detected())
            .collect()
    }

    fn bits_equal(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// At every SIMD build the CPU has, every element of [`products`] is bit for bit the [`dot`]
    /// of its token and row, for token counts around the tile and the block (1, 2, 3, 5, 17,
    /// 64, 67), column counts around the lanes and the column block (1, 7, 8, 9, 64, 257, 1000,
    /// 6144) and odd and even row counts; the scratch is reused across shapes, as a thread's is.
    #[test]
    fn products_are_dot_bit_for_bit_at_every_level() {
        let mut rng = SplitMix64::new(0x9e37);
        let (mut order_sensitive, mut outputs) = (0, 0);
        for &k in &[1usize, 7, 8, 9, 64, 257, 1000, 6144] {
            for &t in &[1usize, 2, 3, 5, 17, 64, 67] {
                for &n in &[1usize, 2, 3, 4, 5, 8, 9] {
                    if k * t * n > 6144 * 67 * 5 {
                        continue;
                    }
                    let (x, w) = (wild(&mut rng, t * k), wild(&mut rng, n * k));
                    let (x, w) = cancelling(&mut rng, x, w, k);
                    let want: Vec<f32> = (0..n * t)
                        .map(|i| {
                            let (r, tok) = (i / t, i % t);
                            dot(&x[tok * k..(tok + 1) * k], &w[r * k..(r + 1) * k]) as f32
                        })
                        .collect();
                    // The data must be order sensitive, else equal sums prove little.
                    outputs += n * t;
                    order_sensitive += (0..n * t)
                        .filter(|&i| {
                            let (r, tok) = (i / t, i % t);
                            let seq: f64 = (0..k)
                                .map(|c| f64::from(x[tok * k + c]) * f64::from(w[r * k + c]))
                                .sum();
                            !bits_equal(seq as f32, want[i])
                        })
                        .count();
                    for l in levels() {
                        let mut s = Scratch::default();
                        let mut out = vec![f32::NAN; n * t];
                        with_cap(l, || products(&x, t, &w, n, k, &mut out, &mut s));
                        for (i, (&a, &b)) in out.iter().zip(&want).enumerate() {
                            assert!(
                                bits_equal(a, b),
                                "{}: t={t} k={k} n={n} row {} token {}: {a:e} vs dot {b:e}",
                                l.name(),
                                i / t,
                                i % t
                            );
                        }
                    }
                }
            }
        }
        assert!(
            order_sensitive * 10 >= outputs,
            "{order_sensitive} of {outputs}"
        );
    }

    /// Infinities and NaN go through as in [`dot`]: inf stays inf, inf - inf and 0 * inf give
    /// NaN, at every level (NaN compared as NaN: its payload is not part of the contract).
    #[test]
    fn infinities_and_nan_as_dot() {
        let k = 19;
        let mut x = vec![1.0f32; 3 * k];
        let mut w = vec![0.5f32; 3 * k];
        x[3] = f32::INFINITY; // token 0: +inf
        x[k + 4] = f32::INFINITY; // token 1: +inf, and -inf in the tail lane
        x[k + 17] = f32::NEG_INFINITY;
        w[2 * k + 5] = f32::NAN; // row 2: NaN for every token
        w[k + 3] = 0.0; // row 1 against token 0's inf: 0 * inf
        let want: Vec<f32> = (0..9)
            .map(|i| {
                dot(
                    &x[(i % 3) * k..(i % 3 + 1) * k],
                    &w[(i / 3) * k..(i / 3 + 1) * k],
                ) as f32
            })
            .collect();
        assert!(want.iter().any(|v| v.is_infinite()) && want.iter().any(|v| v.is_nan()));
        for l in levels() {
            let mut out = vec![0f32; 9];
            with_cap(l, || {
                products(&x, 3, &w, 3, k, &mut out, &mut Scratch::default())
            });
            for (a, b) in out.iter().zip(&want) {
                assert!(bits_equal(*a, *b), "{}: {a} vs {b}", l.name());
            }
        }
    }

    /// No columns: every product is 0 (an empty [`dot`]); no tokens or no rows: nothing written.
    #[test]
    fn empty_shapes() {
        let mut out = vec![f32::NAN; 6];
        products(&[], 3, &[], 2, 0, &mut out, &mut Scratch::default());
        assert!(out.iter().all(|v| v.to_bits() == 0));
        let mut out = vec![7.0f32; 2];
        products(&[], 0, &[1.0; 4], 2, 2, &mut out, &mut Scratch::default());
        products(&[1.0; 4], 2, &[], 0, 2, &mut out, &mut Scratch::default());
        assert_eq!(out, vec![7.0; 2]);
    }
}
