//! The tiled kernels of the CPU reference's MLA attention: the scores of a block of queries
//! against a block of keys, and the weighted sums of the values, each value bit for bit the
//! definition's (see [`super`]'s documentation for why, and `super::block` for their use).
//!
//! Both kernels work on f64 rows padded with zeros: a query or key row is `[nope | rot]`, each
//! part padded to a multiple of [`LANES`] (`np` and `kp - np` columns), a value row to a
//! multiple of [`V_PAD`]; the blocks of queries are padded to a multiple of [`QUERY_PAD`] rows
//! (zero rows) and the key lists of the scores to a multiple of [`KEY_PAD`] keys (repeating a
//! key); the scores of the padding are dropped.
//!
//! Tiles by level: scores 4 queries by 4 keys in the AVX-512 build (16 accumulators of 8 f64
//! and 8 operands in 32 registers), 4 by 2 in the AVX2 build, 4 by 1 in the baseline build;
//! weighted sums 4 queries by 32 values in the AVX-512 build, 2 by 16 in the AVX2 build, 2 by
//! 8 in the baseline build.

use crate::engine::cpu::math::{combine, LANES};
use crate::quant::simd::multiversion;

/// Query rows of a block are padded to a multiple of this (the tiles' queries).
pub const QUERY_PAD: usize = 4;
/// Key rows of a block of scores are padded to a multiple of this (the widest tile's keys).
pub const KEY_PAD: usize = 4;
/// Value rows are padded to a multiple of this many values (the widest tile's values).
pub const V_PAD: usize = 32;

multiversion! {
    /// `out[i * os + j] = (dot(q_i[..np], k_j[..np]) + dot(q_i[np..], k_j[np..])) * scale`
    /// for the `nq` query rows `q` (`[nq, kp]`, `nq` a multiple of [`QUERY_PAD`]) and the key
    /// rows `k_j = kf[keys[j] * kp..][..kp]` (`keys.len()` a multiple of [`KEY_PAD`]), each dot
    /// in [`dot`]'s order (element `c` into lane `c % LANES`, the lanes combined by
    /// [`combine`]).
    ///
    /// [`dot`]: crate::engine::cpu::math::dot
    #[allow(clippy::too_many_arguments)]
    pub fn scores(
        q: &[f64],
        nq: usize,
        kf: &[f64],
        keys: &[u32],
        kp: usize,
        np: usize,
        scale: f64,
        out: &mut [f64],
        os: usize,
    ) = scores_tiled::<4, true>;
    avx2 scores_tiled::<2, true>, base scores_tiled::<1, false>
}

multiversion! {
    /// `acc[i * vp + d] = acc[i * vp + d] + p[i * ps + j] * vf[keys[j] * vp + d]` for `j` in
    /// `0..keys.len()` in ascending order, for the `nq` rows of `acc` (`[nq, vp]`, `nq` a
    /// multiple of [`QUERY_PAD`], `vp` of [`V_PAD`]): a multiply then an add (never fused: `p`
    /// is not an f32 value, so the product is not exact).
    pub fn weighted_sums(
        p: &[f64],
        ps: usize,
        nq: usize,
        vf: &[f64],
        keys: &[u32],
        vp: usize,
        acc: &mut [f64],
    ) = sums_tiled::<4, 32>;
    avx2 sums_tiled::<2, 16>, base sums_tiled::<2, 8>
}

/// `c + a * b`, fused when `FMA` (the same value when `a * b` is exact, as a product of two
/// f32 values in f64 is).
#[inline(always)]
fn madd<const FMA: bool>(a: f64, b: f64, c: f64) -> f64 {
    if FMA {
        a.mul_add(b, c)
    } else {
        c + a * b
    }
}

/// [`scores`] in tiles of 4 queries by `TK` keys, fused multiply-adds when `FMA`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores_tiled<const TK: usize, const FMA: bool>(
    q: &[f64],
    nq: usize,
    kf: &[f64],
    keys: &[u32],
    kp: usize,
    np: usize,
    scale: f64,
    out: &mut [f64],
    os: usize,
) {
    debug_assert!(nq % QUERY_PAD == 0 && keys.len() % TK == 0);
    debug_assert!(np % LANES == 0 && kp % LANES == 0 && q.len() >= nq * kp);
    for i0 in (0..nq).step_by(QUERY_PAD) {
        for (j0, kt) in keys.chunks_exact(TK).enumerate() {
            let qt = &q[i0 * kp..(i0 + QUERY_PAD) * kp];
            let mut rows: [&[f64]; TK] = [&[]; TK];
            for (r, &key) in rows.iter_mut().zip(kt) {
                *r = &kf[key as usize * kp..(key as usize + 1) * kp];
            }
            let nope = lanes::<QUERY_PAD, TK, FMA>(qt, kp, &rows, 0, np);
            let rot = lanes::<QUERY_PAD, TK, FMA>(qt, kp, &rows, np, kp);
            for i in 0..QUERY_PAD {
                for j in 0..TK {
                    out[(i0 + i) * os + j0 * TK + j] = (nope[i][j] + rot[i][j]) * scale;
                }
            }
        }
    }
}

/// The dot products of `TQ` query rows (`q`, rows `kp` apart) by `TK` key rows over columns
/// `c0..c1` (a multiple of [`LANES`] apart): the lanes, from zero, then [`combine`]d. (The
/// lanes are combined here, so that they stay in registers over the columns.)
#[inline(always)]
fn lanes<const TQ: usize, const TK: usize, const FMA: bool>(
    q: &[f64],
    kp: usize,
    k: &[&[f64]; TK],
    c0: usize,
    c1: usize,
) -> [[f64; TK]; TQ] {
    let mut acc = [[[0f64; LANES]; TK]; TQ];
    for c in (c0..c1).step_by(LANES) {
        let mut qv = [[0f64; LANES]; TQ];
        for (i, x) in qv.iter_mut().enumerate() {
            x.copy_from_slice(&q[i * kp + c..i * kp + c + LANES]);
        }
        let mut kv = [[0f64; LANES]; TK];
        for (x, row) in kv.iter_mut().zip(k) {
            x.copy_from_slice(&row[c..c + LANES]);
        }
        for i in 0..TQ {
            for j in 0..TK {
                for l in 0..LANES {
                    acc[i][j][l] = madd::<FMA>(qv[i][l], kv[j][l], acc[i][j][l]);
                }
            }
        }
    }
    let mut out = [[0f64; TK]; TQ];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, a) in o.iter_mut().zip(a) {
            *o = combine(*a);
        }
    }
    out
}

/// [`weighted_sums`] in tiles of `TQ` rows by `DB` values: the tile's sums stay in registers
/// over all the keys.
#[inline(always)]
fn sums_tiled<const TQ: usize, const DB: usize>(
    p: &[f64],
    ps: usize,
    nq: usize,
    vf: &[f64],
    keys: &[u32],
    vp: usize,
    acc: &mut [f64],
) {
    debug_assert!(nq % TQ == 0 && vp % DB == 0 && acc.len() >= nq * vp);
    for d0 in (0..vp).step_by(DB) {
        for i0 in (0..nq).step_by(TQ) {
            let mut a = [[0f64; DB]; TQ];
            for (i, x) in a.iter_mut().enumerate() {
                x.copy_from_slice(&acc[(i0 + i) * vp + d0..(i0 + i) * vp + d0 + DB]);
            }
            for (j, &key) in keys.iter().enumerate() {
                let at = key as usize * vp + d0;
                let mut vv = [0f64; DB];
                vv.copy_from_slice(&vf[at..at + DB]);
                for (i, x) in a.iter_mut().enumerate() {
                    let pij = p[(i0 + i) * ps + j];
                    for d in 0..DB {
                        x[d] += pij * vv[d];
                    }
                }
            }
            for (i, x) in a.iter().enumerate() {
                acc[(i0 + i) * vp + d0..(i0 + i) * vp + d0 + DB].copy_from_slice(x);
            }
        }
    }
}
