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
