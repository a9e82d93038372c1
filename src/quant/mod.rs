//! GGML types and CPU dequantization to f32, bit-exact against gguf-py and ggml's
//! `dequantize_row_*` (`ggml/src/ggml-quants.c`).
//!
//! Every function here works on whole blocks of bytes already in memory; it never touches a
//! file. Each block dequantizes independently, so the parallel path (rayon over fixed chunks of
//! blocks) gives exactly the single-thread result for any thread count.

pub mod draw;
mod float;
pub(crate) mod grids;
mod iquants;
mod kquants;
pub(crate) mod legacy;
pub mod noise;
pub mod simd;
pub(crate) mod small;
pub mod types;

use anyhow::{bail, Result};
use rayon::prelude::*;

use simd::multiversion;

pub use float::EncodeFn;
pub use noise::NoiseModel;
pub use types::{GgmlType, TypeInfo, TypeStatus, TYPE_TABLE};

/// Number of elements in a K-quant / IQ super-block.
pub const QK_K: usize = 256;

/// Signature of a block dequantizer: `src` holds exactly `dst.len() / block_size` blocks.
pub type DequantFn = fn(src: &[u8], dst: &mut [f32]);

/// The dequantizer of `ty` (its row of [`TYPE_TABLE`]), or `None` when glmdiff has none
/// (activation-only, removed, Q1_0).
pub fn dequant_fn(ty: GgmlType) -> Option<DequantFn> {
    ty.info().dequant
}

/// Checks that `src` and `dst` hold the same whole number of blocks of `ty`.
fn check_sizes(ty: GgmlType, src: &[u8], dst: &[f32]) -> Result<DequantFn> {
    let Some(f) = dequant_fn(ty) else {
        bail!(
            "quant: no dequantization for type {ty} (id {}): {}",
            ty.id(),
            match ty.status() {
                TypeStatus::Removed => "the type was removed from ggml",
                _ => "it is an activation-only or unsupported format",
            }
        );
    };
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if dst.len() % bs != 0 || src.len() != dst.len() / bs * ts {
        bail!(
            "quant: {ty}: {} output elements need {} bytes ({} blocks of {ts}), got {} bytes",
            dst.len(),
            dst.len() / bs * ts,
            dst.len() / bs,
            src.len()
        );
    }
    Ok(f)
}

/// Dequantizes `src` (whole blocks of `ty`) into `dst` on the calling thread.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let f = check_sizes(ty, src, dst)?;
    f(src, dst);
    Ok(())
}

/// Blocks per parallel work item: large enough to amortize scheduling, small enough to balance.
const PAR_CHUNK_ELEMS: usize = 1 << 16;

/// Dequantizes `src` into `dst` using rayon's pool; the result equals [`dequantize`] bit for bit.
pub fn dequantize_par(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let f = check_sizes(ty, src, dst)?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let blocks_per_chunk = (PAR_CHUNK_ELEMS / bs).max(1);
    dst.par_chunks_mut(blocks_per_chunk * bs)
        .zip(src.par_chunks(blocks_per_chunk * ts))
        .for_each(|(d, s)| f(s, d));
    Ok(())
}

/// Dequantizes into a new vector of `n_elements` values (parallel).
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n_elements];
    dequantize_par(ty, src, &mut out)?;
    Ok(out)
}

/// Whether every value dequantized from `src` (whole blocks of `ty`) is finite, shown from the
/// blocks' f16 scales alone: `true` only for a type whose values are a finite scale times, or
/// less, a small integer (Q4_K, Q5_K: `(d*sc)*q - (dmin*m)` with `sc, m <= 63`, `q <= 31`;
/// Q6_K: `(d*sc)*q` with `|sc| <= 128`, `|q| <= 32`; Q8_0: `d*q` with `|q| <= 128`: every
/// intermediate at most 65504 * 128 * 32, about 2.7e8, far inside f32's range, so every step is
/// finite once the scales are) and every block's scales finite. `false` says nothing: a caller then looks at
/// the values themselves ([`first_non_finite`]), which also finds the element to name. About
/// one f16 test per block instead of one per value.
pub fn finite_by_scales(ty: GgmlType, src: &[u8]) -> bool {
    // (block bytes, offsets of the block's f16 scales)
    let (bytes, scales): (usize, &[usize]) = match ty {
        GgmlType::Q4_K => (144, &[0, 2]),
        GgmlType::Q5_K => (176, &[0, 2]),
        GgmlType::Q6_K => (210, &[208]),
        GgmlType::Q8_0 => (34, &[0]),
        _ => return false,
    };
    if src.is_empty() || src.len() % bytes != 0 {
        return false;
    }
    // An f16 is finite unless its exponent bits are all ones.
    let mut all_finite = true;
    for b in src.chunks_exact(bytes) {
        for &o in scales {
            all_finite &= u16::from_le_bytes([b[o], b[o + 1]]) & 0x7c00 != 0x7c00;
        }
    }
    all_finite
}

/// Values per run of [`first_non_finite`]: each run is tested with no branch inside (its
/// largest magnitude, or an OR of comparisons), and only a run that holds a NaN or an infinity
/// is searched.
const FINITE_RUN: usize = 256;

multiversion! {
    /// Index of the first NaN or infinity in `values`, `None` when every value is finite. The
    /// same answer as `values.iter().position(|v| !v.is_finite())`, about 15 times faster (that
    /// loop's early exit keeps it scalar, and it cost more than dequantizing the values: about
    /// 0.7 ns per value against 0.04-0.07 with AVX2 and 0.10-0.15 in the baseline build, on a
    /// 2-core AMD EPYC VM).
    pub fn first_non_finite(values: &[f32]) -> Option<usize> = first_non_finite_max;
    base first_non_finite_or
}

/// `|v|`'s bits as a signed integer: above `f32::MAX`'s exactly for an infinity or a NaN (the
/// exponent all ones); never negative, so signed comparisons order them.
#[inline(always)]
fn magnitude_bits(v: f32) -> i32 {
    (v.to_bits() & 0x7fff_ffff) as i32
}

/// [`first_non_finite`] where the vectors have a signed maximum (AVX2, AVX-512): each run's
/// largest magnitude against `f32::MAX`'s.
#[inline(always)]
fn first_non_finite_max(values: &[f32]) -> Option<usize> {
    let max_finite = magnitude_bits(f32::MAX);
    for (c, run) in values.chunks(FINITE_RUN).enumerate() {
        let m = run.iter().fold(0, |m, &v| m.max(magnitude_bits(v)));
        if m > max_finite {
            return first_in_run(run, c);
        }
    }
    None
}

/// [`first_non_finite`] in the baseline build (SSE2 compares signed integers but has no
/// maximum of them): each run's OR of the comparisons.
#[inline(always)]
fn first_non_finite_or(values: &[f32]) -> Option<usize> {
    let max_finite = magnitude_bits(f32::MAX);
    for (c, run) in values.chunks(FINITE_RUN).enumerate() {
        let any = run
            .iter()
            .fold(0i32, |a, &v| a | i32::from(magnitude_bits(v) > max_finite));
        if any != 0 {
            return first_in_run(run, c);
        }
    }
    None
}

/// The first non-finite value of run `c`, as an index into the whole slice.
#[inline(always)]
fn first_in_run(run: &[f32], c: usize) -> Option<usize> {
    run.iter()
        .position(|v| !v.is_finite())
        .map(|i| c * FINITE_RUN + i)
}

/// Reads f16 little-endian at `b[0..2]` as f32 (exact). The conversion is `half`'s portable
/// one, inlined into each build of a dequantizer ([`simd`]), rather than its run-time-detected
/// F16C call; NaNs come out quiet with their payload, as F16C gives them (the unit test
/// `f16_le_equals_half_for_every_pattern` checks all 65536 patterns).
#[inline(always)]
pub(crate) fn f16_le(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32_const()
}

#[cfg(test)]
mod tests {
    /// [`super::finite_by_scales`]: blocks of random bytes whose f16 scales are every finite
    /// kind (the largest, subnormals, zeros, both signs) give `true` and finite values; one
    /// infinite or NaN scale anywhere gives `false`; a type it does not cover, and a partial
    /// block, give `false`.
    #[test]
    fn finite_by_scales_is_the_values() {
        use super::GgmlType as G;
        let mut rng = crate::util::rng::SplitMix64::new(0x5ca1e5);
        let kinds: [u16; 8] = [
            0x7bff, 0xfbff, 0x0001, 0x8001, 0x0000, 0x8000, 0x3c00, 0x5a3f,
        ];
        for (ty, bytes, scales) in [
            (G::Q4_K, 144usize, vec![0usize, 2]),
            (G::Q5_K, 176, vec![0, 2]),
            (G::Q6_K, 210, vec![208]),
            (G::Q8_0, 34, vec![0]),
        ] {
            let per = if ty == G::Q8_0 { 32 } else { 256 };
            for round in 0..64 {
                let blocks = 1 + round % 5;
                let mut src = vec![0u8; blocks * bytes];
                rng.fill(&mut src);
                for (i, b) in src.chunks_exact_mut(bytes).enumerate() {
                    for (j, &o) in scales.iter().enumerate() {
                        let k = kinds[(round + i + j) % kinds.len()];
                        b[o..o + 2].copy_from_slice(&k.to_le_bytes());
                    }
                }
                let mut y = vec![0f32; blocks * per];
                super::dequantize(ty, &src, &mut y).unwrap();
                assert!(super::finite_by_scales(ty, &src), "{ty:?} round {round}");
                assert_eq!(super::first_non_finite(&y), None, "{ty:?} round {round}");
                for bad in [0x7c00u16, 0xfc00, 0x7e00, 0x7c01] {
                    let mut s2 = src.clone();
                    let at = (round % blocks) * bytes + scales[round % scales.len()];
                    s2[at..at + 2].copy_from_slice(&bad.to_le_bytes());
                    assert!(!super::finite_by_scales(ty, &s2), "{ty:?} {bad:#x}");
                }
                assert!(!super::finite_by_scales(ty, &src[..src.len() - 1]));
            }
        }
        assert!(!super::finite_by_scales(G::F32, &[0u8; 8]));
        assert!(!super::finite_by_scales(G::BF16, &[0u8; 8]));
    }

    /// [`super::first_non_finite`] finds what `position` finds at every SIMD level the CPU
    /// has: none, each special value at each place of a run and across runs, and the first of
    /// several.
    #[test]
    fn first_non_finite_is_positions() {
        use super::simd::{detected, with_cap, Level};
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN];
        let edge = [f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0, 1e-45];
        for n in [0usize, 1, 7, 255, 256, 257, 1000] {
            let base: Vec<f32> = (0..n).map(|i| edge[i % edge.len()]).collect();
            for l in [Level::Base, Level::Avx2, Level::Avx512] {
                if l <= detected() {
                    assert_eq!(
                        with_cap(l, || super::first_non_finite(&base)),
                        None,
                        "n {n}"
                    );
                }
            }
            for i in (0..n).step_by(37).chain(n.checked_sub(1)) {
                for &s in &specials {
                    let mut v = base.clone();
                    v[i] = s;
                    if i + 300 < n {
                        v[i + 300] = f32::NAN;
                    }
                    let want = v.iter().position(|x| !x.is_finite());
                    for l in [Level::Base, Level::Avx2, Level::Avx512] {
                        if l <= detected() {
                            let got = with_cap(l, || super::first_non_finite(&v));
                            assert_eq!(got, want, "{} n {n} at {i}: {s}", l.name());
                        }
                    }
                }
            }
        }
    }

    /// The portable f16 conversion equals `half`'s (F16C where the CPU has it) for every bit
    /// pattern, NaN payloads included.
    #[test]
    fn f16_le_equals_half_for_every_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32().to_bits();
            assert_eq!(super::f16_le(&h.to_le_bytes()).to_bits(), want, "{h:#06x}");
        }
    }
}
