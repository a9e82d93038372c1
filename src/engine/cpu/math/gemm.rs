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
//! with `t` tokens, by one of two paths that give the same bits.
//!
//! *The direct path*, with fewer than [`SMALL_TOKENS`] tokens (32; [`SMALL_TOKENS_BASE`], 3,
//! in the baseline build): the tokens' columns are converted to f64 once per call, then for
//! each group of `TR` rows and each tile of up to [`TILE_TOKENS`] tokens (2 when `TR` is
//! below 4: the accumulators of 4 tokens by 2 rows would take all 16 AVX2 registers) one pass
//! over all the columns loads the weights straight from the f32 rows, converting them in
//! registers, into accumulators that stay in registers from the first column to the last
//! (and are combined after it, from memory: combined in registers, LLVM split them in halves).
//! With few tokens each weight value serves 1 to 4 products, so converting the rows into a
//! buffer first (786 KB for 16 rows of 6144, with the 393 KB of f32 rows: over L2) cost more
//! than the products. The rows short of a last group of `TR` go one at a time. Measured on a
//! 2-core Zen 4 VM (shared, noisy; thread CPU time), a task of 16 rows of 6144 values in
//! cache (`tests::small_tokens_speed`), ns per weight value, direct against blocked: AVX-512
//! t = 1: 0.07-0.08 / 0.26-0.32, t = 4: 0.17-0.19 / 0.36-0.47, t = 16: 0.71 / 1.05-1.13,
//! t = 48: 2.5 / 2.9; AVX2 t = 1: 0.08 / 0.27, t = 4: 0.25 / 0.6, t = 16: 1.4 / 2.2-2.4; the
//! baseline build within the noise of the blocked path up to t = 2, slower from t = 3 (10-40%).
//! `[t, 6144] x [6144 -> 2048]` on one thread (`math::tests::matmul_speed`), AVX-512: t = 4
//! 11.7 -> 21.1 GFLOP/s, t = 16 20.5 -> 34.0; AVX2 7.9 -> 12.3, 11.0 -> 20.1. One routed
//! expert of GLM-5 (gate and up 6144 -> 2048 Q4_K, down 2048 -> 6144 Q6_K, dequantization
//! included, `moe::tests::expert_speed`), AVX-512, ms: t = 1 14-16 -> 8-10, t = 4 21-23 ->
//! 11-14, t = 16 51-57 -> 33-37. The direct path still won at 48 and 63 tokens (by 10-20%
//! with AVX-512), but its converted tokens (t x 8 B per column) no longer fit in L2 from about
//! 20 tokens of 6144 columns, which costs more when many threads share L3: 32 keeps a margin.
//!
//! *The blocked path*, with more tokens: the rows are converted to f64 once per call. Tokens
//! go in blocks of [`TOKEN_BLOCK`] and columns in blocks of [`COL_BLOCK`]: per pair of blocks
//! the tokens' columns are converted into a small f64 buffer (from cache), then for each tile
//! of `TT` tokens by `TR` rows the tile's lanes are loaded into registers, advanced over the
//! block's columns and stored back. A tile loads `TT + TR` vectors of [`LANES`] values per
//! `TT * TR` multiply-adds; the weight tile stays in L1, the token block and the lanes in L2,
//! and the activations are read from memory once per call, so a caller with many tokens gives
//! each call many rows ([`super::rows_per_task`]).
//! `TR` is 4 in the AVX-512 build (`TT` = [`TILE_TOKENS`], 4: 16 accumulators of 8 f64 and 8
//! operands in 32 registers), 2 in the AVX2 build and 1 in the baseline build (SSE2), both with
//! `TT` = [`NARROW_TILE_TOKENS`], 3: the accumulators of 3 tokens by 2 rows take 12 of AVX2's
//! 16 registers of 4 f64 (those of 3 tokens by 1 row 12 of SSE2's 16 of 2), leaving room for
//! the operands. With 4 tokens, as in the AVX-512 build, the accumulators alone took all 16
//! and spilled: on a 2-core Zen 3 VM (AVX2), `[t, 6144] x [6144 -> 2048]` on one thread
//! (`math::tests::matmul_speed`) went from 12.6-13.1 to 16.9-20.3 GFLOP/s at t = 32-1024,
//! the blocked path of `tests::small_tokens_speed` from 4.8 to 3.2 ns a value at t = 32 and
//! from 9.3 to 5.9 at t = 63 (the baseline build 7.8 to 7.2 and 15.1 to 11.3), and
//! `tests::small_tokens_parallel_speed` on both cores from 25.0-25.8 to 39.0-42.5 GFLOP/s at
//! t = 16-63 (the direct path 44.0-48.2 there).

use super::{combine, LANES};
use crate::quant::simd::multiversion;

/// Tokens of a tile of the direct path, and of the blocked path in the AVX-512 build (the last
/// tile of a token block may have fewer).
pub const TILE_TOKENS: usize = 4;
/// Tokens of a blocked path's tile in the AVX2 and baseline builds (fewer registers: see the
/// module documentation).
pub const NARROW_TILE_TOKENS: usize = 3;
/// Tokens per block: their converted columns and the lanes of their outputs stay in cache.
pub const TOKEN_BLOCK: usize = 64;
/// Columns per block, a multiple of [`LANES`].
pub const COL_BLOCK: usize = 256;
/// Fewest tokens [`products`] gives the blocked path in the AVX2 and AVX-512 builds: with
/// fewer it takes the direct path (see the module documentation).
pub const SMALL_TOKENS: usize = 32;
/// [`SMALL_TOKENS`] of the baseline build.
pub const SMALL_TOKENS_BASE: usize = 3;

/// Working memory of [`products`], kept by a thread from one call to the next.
#[derive(Default)]
pub struct Scratch {
    /// The call's weight rows in f64, padded: `[rows rounded up to TR, cols rounded up to LANES]`
    /// (the blocked path).
    w: Vec<f64>,
    /// One block of tokens' columns in f64: `[tokens, block columns]` (the blocked path); all
    /// the tokens' columns, padded: `[t, cols rounded up to LANES]` (the direct path).
    x: Vec<f64>,
    /// The lanes of one token block's outputs: `[tokens, padded rows]` (the blocked path); of
    /// one group of rows: `[t, TR]` (the direct path).
    lanes: Vec<[f64; LANES]>,
}

impl Scratch {
    /// Bytes its buffers hold (their capacity).
    pub fn bytes(&self) -> usize {
        (self.w.capacity() + self.x.capacity()) * 8 + self.lanes.capacity() * 8 * LANES
    }
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

/// [`products`] with tiles of up to [`TILE_TOKENS`] tokens by `TR` rows (the module
/// documentation gives each build's), fused multiply-adds when
/// `FMA`: the direct path with fewer than [`SMALL_TOKENS`] tokens ([`SMALL_TOKENS_BASE`]
/// without `FMA`, the baseline build), else the blocked one.
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
    let small = if FMA { SMALL_TOKENS } else { SMALL_TOKENS_BASE };
    products_path::<TR, FMA>(x, t, w, n, k, out, s, t < small);
}

/// [`products_tiled`] by the direct path when `direct`, else by the blocked one (the tests
/// run both at every token count).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn products_path<const TR: usize, const FMA: bool>(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
    s: &mut Scratch,
    direct: bool,
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
    if direct {
        products_direct::<TR, FMA>(x, t, w, n, k, out, s);
    } else {
        products_blocked::<TR, FMA>(x, t, w, n, k, out, s);
    }
}

/// The direct path (few tokens): the tokens' columns converted to f64 once, then for each
/// group of `TR` rows and each tile of up to [`TILE_TOKENS`] tokens one pass over all the
/// columns, the weights converted in registers. `t`, `n` and `k` are not 0.
#[inline(always)]
fn products_direct<const TR: usize, const FMA: bool>(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let kp = k.div_ceil(LANES) * LANES;
    let Scratch { x: xf, lanes, .. } = s;
    // Written once (no zero fill first): `[t, kp]`.
    xf.clear();
    for src in x.chunks_exact(k).take(t) {
        xf.extend(src.iter().map(|&v| f64::from(v)));
        xf.extend(std::iter::repeat_n(0.0, kp - k));
    }
    let xf = &xf[..t * kp];
    let full = n / TR * TR;
    for r0 in (0..full).step_by(TR) {
        let wr = &w[r0 * k..(r0 + TR) * k];
        direct_rows::<TR, FMA>(xf, t, kp, wr, k, &mut out[r0 * t..], lanes);
    }
    // The rows short of a group, one at a time.
    for r in full..n {
        let wr = &w[r * k..(r + 1) * k];
        direct_rows::<1, FMA>(xf, t, kp, wr, k, &mut out[r * t..], lanes);
    }
}

/// `out[j * t + i]` for the `TR` rows `w` (`[TR, k]`) and the `t` tokens `x` (`[t, kp]` in f64,
/// padded), in tiles of up to [`TILE_TOKENS`] tokens with 4 rows, 2 with fewer (the
/// accumulators of 2 tokens by 2 rows fill 8 of AVX2's 16 registers, those of 4 by 2 all of
/// them); the lanes wait in `lanes` to be combined.
#[inline(always)]
fn direct_rows<const TR: usize, const FMA: bool>(
    x: &[f64],
    t: usize,
    kp: usize,
    w: &[f32],
    k: usize,
    out: &mut [f32],
    lanes: &mut Vec<[f64; LANES]>,
) {
    lanes.resize(t * TR, [0.0; LANES]);
    let tt = if TR >= 4 { TILE_TOKENS } else { 2 };
    let mut i0 = 0;
    while i0 < t {
        let (xt, lt) = (&x[i0 * kp..], &mut lanes[i0 * TR..]);
        let m = (t - i0).min(tt);
        match m {
            1 => direct::<1, TR, FMA>(xt, kp, w, k, lt),
            2 => direct::<2, TR, FMA>(xt, kp, w, k, lt),
            3 => direct::<3, TR, FMA>(xt, kp, w, k, lt),
            _ => direct::<TILE_TOKENS, TR, FMA>(xt, kp, w, k, lt),
        }
        i0 += m;
    }
    for (i, l) in lanes[..t * TR].chunks_exact(TR).enumerate() {
        for (j, l) in l.iter().enumerate() {
            out[j * t + i] = combine(*l) as f32;
        }
    }
}

/// The lanes of `TT` tokens by `TR` rows over all `k` columns, each from 0, into
/// `lanes[i * TR + j]` (token `i`, row `j`): token `i`'s columns in f64 at `x[i * xs..]`,
/// padded with zeros to a multiple of [`LANES`]; row `j`'s in f32 at `w[j * k..(j + 1) * k]`,
/// their last partial chunk padded with zeros here. (Combining the lanes here, in registers,
/// makes LLVM split the accumulators into halves.)
#[inline(always)]
fn direct<const TT: usize, const TR: usize, const FMA: bool>(
    x: &[f64],
    xs: usize,
    w: &[f32],
    k: usize,
    lanes: &mut [[f64; LANES]],
) {
    let mut acc = [[[0f64; LANES]; TR]; TT];
    let kf = k / LANES * LANES;
    let rows: [&[f32]; TR] = std::array::from_fn(|j| &w[j * k..(j + 1) * k]);
    let toks: [&[f64]; TT] = std::array::from_fn(|i| &x[i * xs..(i + 1) * xs]);
    for c in (0..kf).step_by(LANES) {
        let mut xv = [[0f64; LANES]; TT];
        for (v, xr) in xv.iter_mut().zip(&toks) {
            v.copy_from_slice(&xr[c..c + LANES]);
        }
        let mut wv = [[0f64; LANES]; TR];
        for (v, wr) in wv.iter_mut().zip(&rows) {
            for (d, &s) in v.iter_mut().zip(&wr[c..c + LANES]) {
                *d = f64::from(s);
            }
        }
        for i in 0..TT {
            for j in 0..TR {
                for l in 0..LANES {
                    acc[i][j][l] = madd::<FMA>(xv[i][l], wv[j][l], acc[i][j][l]);
                }
            }
        }
    }
    if kf < k {
        // The last partial chunk, zeros on both operands after the rows' end.
        let mut xv = [[0f64; LANES]; TT];
        for (v, xr) in xv.iter_mut().zip(&toks) {
            v.copy_from_slice(&xr[kf..kf + LANES]);
        }
        let mut wv = [[0f64; LANES]; TR];
        for (v, wr) in wv.iter_mut().zip(&rows) {
            for (d, &s) in v.iter_mut().zip(&wr[kf..]) {
                *d = f64::from(s);
            }
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
        lanes[i * TR..(i + 1) * TR].copy_from_slice(a);
    }
}

/// The blocked path: the rows converted to f64 once, then token blocks by column blocks by
/// tiles. `t`, `n` and `k` are not 0.
#[inline(always)]
fn products_blocked<const TR: usize, const FMA: bool>(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
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
    let tt = if TR >= 4 {
        TILE_TOKENS
    } else {
        NARROW_TILE_TOKENS
    };
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
                let mut i0 = 0;
                while i0 < tb {
                    let m = (tb - i0).min(tt);
                    let (xt, lt) = (&xf[i0 * cb..], &mut lanes[i0 * np + r0..]);
                    match m {
                        1 => tile::<1, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                        2 => tile::<2, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                        3 => tile::<3, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                        _ => tile::<TILE_TOKENS, TR, FMA>(xt, cb, wt, kp, cb, lt, np),
                    }
                    i0 += m;
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

    multiversion! {
        /// [`products`] by the direct path when `direct`, else by the blocked one, whatever
        /// the number of tokens.
        #[allow(clippy::too_many_arguments)]
        fn products_by(
            x: &[f32],
            t: usize,
            w: &[f32],
            n: usize,
            k: usize,
            out: &mut [f32],
            s: &mut Scratch,
            direct: bool,
        ) = products_path::<4, true>;
        avx2 products_path::<2, true>, base products_path::<1, false>
    }

    /// The outputs of [`products`] (`[n, t]`), then of its direct and its blocked path, at SIMD
    /// build `l`, each started from NaN, with one scratch reused as a thread's is.
    fn every_path(
        l: Level,
        x: &[f32],
        t: usize,
        w: &[f32],
        n: usize,
        k: usize,
        s: &mut Scratch,
    ) -> [(&'static str, Vec<f32>); 3] {
        let mut run = |f: &mut dyn FnMut(&mut [f32], &mut Scratch)| {
            let mut out = vec![f32::NAN; n * t];
            with_cap(l, || f(&mut out, s));
            out
        };
        [
            ("products", run(&mut |o, s| products(x, t, w, n, k, o, s))),
            (
                "direct",
                run(&mut |o, s| products_by(x, t, w, n, k, o, s, true)),
            ),
            (
                "blocked",
                run(&mut |o, s| products_by(x, t, w, n, k, o, s, false)),
            ),
        ]
    }

    /// At every SIMD build the CPU has, every element of [`products`], and of its direct and
    /// its blocked path each at every token count, is bit for bit the [`dot`] of its token and
    /// row, for token counts around the tiles, the paths' switches and the block (1 to 9, 17,
    /// 31, 32, 64, 67), column counts around the lanes and the column block (1, 7, 8, 9, 64,
    /// 257, 1000, 6144) and row counts that are and are not multiples of the tiles' rows; the
    /// scratch is reused across shapes and paths, as a thread's is.
    #[test]
    fn products_are_dot_bit_for_bit_at_every_level() {
        let mut rng = SplitMix64::new(0x9e37);
        let (mut order_sensitive, mut outputs) = (0, 0);
        let mut s = Scratch::default();
        for &k in &[1usize, 7, 8, 9, 64, 257, 1000, 6144] {
            for &t in &[1usize, 2, 3, 4, 5, 6, 7, 8, 9, 17, 31, 32, 64, 67] {
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
                        for (path, out) in every_path(l, &x, t, &w, n, k, &mut s) {
                            for (i, (&a, &b)) in out.iter().zip(&want).enumerate() {
                                assert!(
                                    bits_equal(a, b),
                                    "{} {path}: t={t} k={k} n={n} row {} token {}: {a:e} vs \
                                     dot {b:e}",
                                    l.name(),
                                    i / t,
                                    i % t
                                );
                            }
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
    /// NaN, at every level and on both paths (NaN compared as NaN: its payload is not part of the contract).
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
            for (path, out) in every_path(l, &x, 3, &w, 3, k, &mut Scratch::default()) {
                for (a, b) in out.iter().zip(&want) {
                    assert!(bits_equal(*a, *b), "{} {path}: {a} vs {b}", l.name());
                }
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

    use crate::util::thread_cpu_s;

    /// Speed of the direct and the blocked path with few tokens, as a task of a routed
    /// expert's matrix product gets them (16 rows of 6144 values, in cache), at each SIMD
    /// build: ns per weight value of thread CPU time (best of 7 runs of 64 calls), and which
    /// path [`products`] takes:
    /// `cargo test --release --lib small_tokens_speed -- --ignored --nocapture`
    /// (`GLMDIFF_SMALL_TOKENS_K` sets the row's values, e.g. 16384 as GLM-5's attention output).
    #[test]
    #[ignore]
    fn small_tokens_speed() {
        let k: usize = std::env::var("GLMDIFF_SMALL_TOKENS_K")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(6144);
        let (n, calls) = (16, 64);
        let mut rng = SplitMix64::new(3);
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform() - 0.5).collect();
        let mut s = Scratch::default();
        for l in levels() {
            for t in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 63] {
                let x: Vec<f32> = (0..t * k).map(|_| rng.uniform() - 0.5).collect();
                let mut out = vec![0f32; n * t];
                let mut time = |direct: bool| {
                    (0..7)
                        .map(|_| {
                            let c = thread_cpu_s();
                            for _ in 0..calls {
                                with_cap(l, || {
                                    products_by(&x, t, &w, n, k, &mut out, &mut s, direct)
                                });
                                std::hint::black_box(&mut out);
                            }
                            (thread_cpu_s() - c) * 1e9 / (calls * n * k) as f64
                        })
                        .fold(f64::INFINITY, f64::min)
                };
                let (d, b) = (time(true), time(false));
                println!(
                    "{:6} t={t:2}: direct {d:.3} ns/value, blocked {b:.3} ({:.2}x){}",
                    l.name(),
                    b / d,
                    if t < if l == Level::Base {
                        SMALL_TOKENS_BASE
                    } else {
                        SMALL_TOKENS
                    } {
                        "  <- products"
                    } else {
                        ""
                    }
                );
            }
        }
    }

    /// The direct and the blocked path on every thread at once, as a projection of a short
    /// prompt gets them (`[t, 6144] x [6144 -> 16384]`, 16 rows a task, the weights beyond the
    /// caches): GFLOP/s of wall time (best of 5) at the widest SIMD build, for the token counts
    /// around [`SMALL_TOKENS`], where the paths part. Many threads share the last-level cache
    /// there, which a single thread's figures (`small_tokens_speed`) do not show:
    /// `cargo test --release --lib small_tokens_parallel_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn small_tokens_parallel_speed() {
        use rayon::prelude::*;
        let (k, rows, n) = (6144, 16384, 16);
        let mut rng = SplitMix64::new(9);
        let w: Vec<f32> = (0..rows * k).map(|_| rng.uniform() - 0.5).collect();
        for t in [16usize, 24, 31, 32, 40, 48, 63] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.uniform() - 0.5).collect();
            let gflop = 2.0 * (t * rows * k) as f64 * 1e-9;
            let rate = |direct: bool| {
                let mut out = vec![0f32; rows * t];
                (0..5)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        out.par_chunks_mut(n * t).enumerate().for_each_init(
                            Scratch::default,
                            |s, (task, o)| {
                                let r0 = task * n;
                                let m = o.len() / t;
                                products_by(&x, t, &w[r0 * k..(r0 + m) * k], m, k, o, s, direct);
                            },
                        );
                        std::hint::black_box(&mut out);
                        gflop / start.elapsed().as_secs_f64()
                    })
                    .fold(0.0, f64::max)
            };
            let (d, b) = (rate(true), rate(false));
            println!(
                "{} threads, {} t={t:2}: direct {d:6.1} GFLOP/s, blocked {b:6.1} ({:.2}x){}",
                rayon::current_num_threads(),
                detected().name(),
                d / b,
                if t < SMALL_TOKENS {
                    "  <- products"
                } else {
                    ""
                }
            );
        }
    }
}
