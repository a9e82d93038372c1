//! Grid-based i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.
//!
//! Formulas: ggml `ggml/src/ggml-quants.c` (`dequantize_row_iq2_xxs` .. `dequantize_row_iq1_m`),
//! block layouts: ggml `ggml/src/ggml-common.h` (`block_iq2_xxs` ..), cross-read with gguf-py
//! `gguf/quants.py` (classes `IQ2_XXS` .. `IQ1_M`). Grids: [`super::grids`].
//!
//! Every super-block covers [`QK_K`] = 256 values as 32 groups of 8. A group is one grid entry
//! (8 bytes, or two 4-byte IQ3 entries) times a per-32 (or per-16) scale, with 8 sign bits. The
//! f32 arithmetic follows ggml's grouping exactly: `db = d * (0.5 + s) * 0.25`, then
//! `db * grid[j]`, then the sign; IQ1: `dl * (grid[j] + delta)`. With f16 `d` every such product
//! is exact in f32, so the output is bit-identical to ggml and gguf-py.

use super::grids::{
    IQ1S_DELTA, IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KMASK_IQ2XS,
    KSIGNS_IQ2XS,
};
use super::simd::multiversion;
use super::{f16_le, QK_K};

/// Bytes per block: `ggml-common.h` static_asserts (d is f16 unless noted).
/// IQ2_XXS: d, u16 qs[32].
const IQ2XXS_BYTES: usize = 66;
/// IQ2_XS: d, u16 qs[32], scales[8].
const IQ2XS_BYTES: usize = 74;
/// IQ2_S: d, qs[64] (32 grid-index low bytes, then 32 sign bytes), qh[8], scales[8].
const IQ2S_BYTES: usize = 82;
/// IQ3_XXS: d, qs[96] (64 grid indices, then 8 u32 of 4-bit scale + 4x7 sign bits).
const IQ3XXS_BYTES: usize = 98;
/// IQ3_S: d, qs[64], qh[8], signs[32], scales[4].
const IQ3S_BYTES: usize = 110;
/// IQ1_S: d, qs[32], u16 qh[8].
const IQ1S_BYTES: usize = 50;
/// IQ1_M: qs[32], qh[16], scales[8] (the f16 d is spread over the top nibbles of the scales).
const IQ1M_BYTES: usize = 56;

/// Values per sign byte / grid group.
const GROUP: usize = 8;
/// Values per sub-block that shares one scale field.
const SUB: usize = 32;
/// Bit shifts of the four 7-bit sign indices packed in an IQ2_XXS / IQ3_XXS u32.
const SIGN_SHIFTS: [u32; 4] = [0, 7, 14, 21];

/// Reads a little-endian u32 at `b[0..4]`.
#[inline(always)]
fn u32_le(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads a little-endian u16 at `b[0..2]`.
#[inline(always)]
fn u16_le(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// Writes `y[j] = db * grid[j] * (signs bit j ? -1 : 1)` for the 8 bytes of `grid`
/// (ggml: `db * grid[j] * (signs & kmask_iq2xs[j] ? -1.f : 1.f)`; negation is exact).
#[inline(always)]
fn signed_group(y: &mut [f32], db: f32, grid: u64, signs: u8) {
    let g = grid.to_le_bytes();
    for ((yj, &gj), &m) in y.iter_mut().zip(&g).zip(&KMASK_IQ2XS) {
        let v = db * f32::from(gj);
        *yj = if signs & m != 0 { -v } else { v };
    }
}

/// Writes `y[j] = dl * (grid[j] + delta)` for the 8 i8 values of an IQ1 grid entry
/// (ggml `dequantize_row_iq1_s`: `dl * (grid[j] + delta)`).
#[inline(always)]
fn iq1_group(y: &mut [f32], dl: f32, delta: f32, grid: u64) {
    let g = grid.to_le_bytes();
    for (yj, &gj) in y.iter_mut().zip(&g) {
        *yj = dl * (f32::from(gj as i8) + delta);
    }
}

/// `d * (0.5 + scale) * factor`, grouped as in ggml (`0.25f` for IQ2, `0.5f` for IQ3_XXS).
#[inline(always)]
fn half_step_scale(d: f32, scale: u32, factor: f32) -> f32 {
    d * (0.5 + scale as f32) * factor
}

multiversion! {
    /// IQ2_XXS (2.0625 bpw): per 32 values, 4 grid bytes and a u32 of 4x7 sign indices plus a 4-bit
    /// scale. ggml `dequantize_row_iq2_xxs`.
    pub fn dequant_iq2_xxs(src: &[u8], dst: &mut [f32]) = iq2_xxs; max avx2
}

#[inline(always)]
fn iq2_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ2XXS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_le(&b[0..2]);
        for (q, y) in b[2..].chunks_exact(8).zip(y.chunks_exact_mut(SUB)) {
            let aux = u32_le(&q[4..8]);
            let db = half_step_scale(d, aux >> 28, 0.25);
            for ((y, &gi), sh) in y.chunks_exact_mut(GROUP).zip(&q[..4]).zip(SIGN_SHIFTS) {
                let signs = KSIGNS_IQ2XS[((aux >> sh) & 127) as usize];
                signed_group(y, db, IQ2XXS_GRID[usize::from(gi)], signs);
            }
        }
    }
}

multiversion! {
    /// IQ2_XS (2.3125 bpw): u16 = 9-bit grid index | 7-bit sign index << 9; two 4-bit scales per 32.
    /// ggml `dequantize_row_iq2_xs`.
    pub fn dequant_iq2_xs(src: &[u8], dst: &mut [f32]) = iq2_xs; max avx2
}

#[inline(always)]
fn iq2_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ2XS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_le(&b[0..2]);
        let (qs, scales) = b[2..].split_at(2 * QK_K / GROUP);
        for ((q, &sc), y) in qs.chunks_exact(8).zip(scales).zip(y.chunks_exact_mut(SUB)) {
            let db = [
                half_step_scale(d, u32::from(sc & 0xf), 0.25),
                half_step_scale(d, u32::from(sc >> 4), 0.25),
            ];
            for (l, (y, q2)) in y.chunks_exact_mut(GROUP).zip(q.chunks_exact(2)).enumerate() {
                let v = u16_le(q2);
                let signs = KSIGNS_IQ2XS[usize::from(v >> 9)];
                signed_group(y, db[l / 2], IQ2XS_GRID[usize::from(v & 511)], signs);
            }
        }
    }
}

multiversion! {
    /// IQ2_S (2.5625 bpw): 10-bit grid index (qs byte | 2 bits of qh), explicit sign bytes, two 4-bit
    /// scales per 32. ggml `dequantize_row_iq2_s`.
    pub fn dequant_iq2_s(src: &[u8], dst: &mut [f32]) = iq2_s;
}

#[inline(always)]
fn iq2_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ2S_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_le(&b[0..2]);
        let (qs, rest) = b[2..].split_at(QK_K / GROUP);
        let (signs, rest) = rest.split_at(QK_K / GROUP);
        let (qh, scales) = rest.split_at(QK_K / SUB);
        let per32 = qs
            .chunks_exact(4)
            .zip(signs.chunks_exact(4))
            .zip(qh.iter().zip(scales));
        for (((q, s), (&h, &sc)), y) in per32.zip(y.chunks_exact_mut(SUB)) {
            let db = [
                half_step_scale(d, u32::from(sc & 0xf), 0.25),
                half_step_scale(d, u32::from(sc >> 4), 0.25),
            ];
            let h = usize::from(h);
            for (l, ((y, &ql), &sl)) in y.chunks_exact_mut(GROUP).zip(q).zip(s).enumerate() {
                let idx = usize::from(ql) | ((h << (8 - 2 * l)) & 0x300);
                signed_group(y, db[l / 2], IQ2S_GRID[idx], sl);
            }
        }
    }
}

multiversion! {
    /// IQ3_XXS (3.0625 bpw): two 4-value grid bytes per group of 8; per 32, a u32 of 4x7 sign
    /// indices plus a 4-bit scale. ggml `dequantize_row_iq3_xxs`.
    pub fn dequant_iq3_xxs(src: &[u8], dst: &mut [f32]) = iq3_xxs; max avx2
}

#[inline(always)]
fn iq3_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ3XXS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_le(&b[0..2]);
        let (qs, scales_signs) = b[2..].split_at(QK_K / 4);
        let per32 = qs.chunks_exact(8).zip(scales_signs.chunks_exact(4));
        for ((q, ss), y) in per32.zip(y.chunks_exact_mut(SUB)) {
            let aux = u32_le(ss);
            let db = half_step_scale(d, aux >> 28, 0.5);
            for ((y, q2), sh) in y
                .chunks_exact_mut(GROUP)
                .zip(q.chunks_exact(2))
                .zip(SIGN_SHIFTS)
            {
                let signs = KSIGNS_IQ2XS[((aux >> sh) & 127) as usize];
                let lo = IQ3XXS_GRID[usize::from(q2[0])];
                let hi = IQ3XXS_GRID[usize::from(q2[1])];
                signed_group(y, db, u64::from(lo) | u64::from(hi) << 32, signs);
            }
        }
    }
}

multiversion! {
    /// IQ3_S (3.4375 bpw): 9-bit grid indices (qs byte | 1 bit of qh), explicit sign bytes, odd
    /// 4-bit scales `1 + 2*s` per 32. ggml `dequantize_row_iq3_s`.
    pub fn dequant_iq3_s(src: &[u8], dst: &mut [f32]) = iq3_s;
}

#[inline(always)]
fn iq3_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ3S_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_le(&b[0..2]);
        let (qs, rest) = b[2..].split_at(QK_K / 4);
        let (qh, rest) = rest.split_at(QK_K / SUB);
        let (signs, scales) = rest.split_at(QK_K / GROUP);
        let per32 = qs.chunks_exact(8).zip(qh).zip(signs.chunks_exact(4));
        for (ib, (((q, &h), s), y)) in per32.zip(y.chunks_exact_mut(SUB)).enumerate() {
            let sc = (scales[ib / 2] >> (4 * (ib % 2))) & 0xf;
            // ggml: `d * (1 + 2*(scale & 0xf))`, an int product converted once.
            let db = d * (1 + 2 * u32::from(sc)) as f32;
            let h = usize::from(h);
            for (l, ((y, q2), &sl)) in y
                .chunks_exact_mut(GROUP)
                .zip(q.chunks_exact(2))
                .zip(s)
                .enumerate()
            {
                let lo = IQ3S_GRID[usize::from(q2[0]) | ((h << (8 - 2 * l)) & 256)];
                let hi = IQ3S_GRID[usize::from(q2[1]) | ((h << (7 - 2 * l)) & 256)];
                signed_group(y, db, u64::from(lo) | u64::from(hi) << 32, sl);
            }
        }
    }
}

/// The IQ1 offset for a set or clear sign bit (ggml: `qh & 0x8000 ? -IQ1S_DELTA : IQ1S_DELTA`).
#[inline(always)]
fn iq1_delta(negative: bool) -> f32 {
    if negative {
        -IQ1S_DELTA
    } else {
        IQ1S_DELTA
    }
}

multiversion! {
    /// IQ1_S (1.5625 bpw): 11-bit indices into the ternary grid (qs byte | 3 bits of qh), per 32 an
    /// odd 3-bit scale and the sign of the 0.125 offset. ggml `dequantize_row_iq1_s`.
    pub fn dequant_iq1_s(src: &[u8], dst: &mut [f32]) = iq1_s;
}

#[inline(always)]
fn iq1_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ1S_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_le(&b[0..2]);
        let (qs, qh) = b[2..].split_at(QK_K / GROUP);
        let per32 = qs.chunks_exact(4).zip(qh.chunks_exact(2));
        for ((q, h2), y) in per32.zip(y.chunks_exact_mut(SUB)) {
            let h = u16_le(h2);
            let dl = d * (2 * ((h >> 12) & 7) + 1) as f32;
            let delta = iq1_delta(h & 0x8000 != 0);
            let h = usize::from(h);
            for (l, (y, &ql)) in y.chunks_exact_mut(GROUP).zip(q).enumerate() {
                let idx = usize::from(ql) | (((h >> (3 * l)) & 7) << 8);
                iq1_group(y, dl, delta, IQ1S_GRID[idx]);
            }
        }
    }
}

multiversion! {
    /// IQ1_M (1.75 bpw): like IQ1_S with per-16 3-bit scales, a per-8 offset sign in qh, and the f16
    /// `d` assembled from the top nibbles of the four u16 scale words. ggml `dequantize_row_iq1_m`.
    pub fn dequant_iq1_m(src: &[u8], dst: &mut [f32]) = iq1_m;
}

#[inline(always)]
fn iq1_m(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ1M_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (qs, rest) = b.split_at(QK_K / GROUP);
        let (qh, scales) = rest.split_at(QK_K / 16);
        let sc = [
            u16_le(&scales[0..2]),
            u16_le(&scales[2..4]),
            u16_le(&scales[4..6]),
            u16_le(&scales[6..8]),
        ];
        // ggml: `(sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00)
        //        | (sc[3] & 0xf000)`.
        let d_bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        let d = half::f16::from_bits(d_bits).to_f32();
        let per32 = qs.chunks_exact(4).zip(qh.chunks_exact(2));
        for (ib, ((q, h), y)) in per32.zip(y.chunks_exact_mut(SUB)).enumerate() {
            let s = sc[ib / 2] >> (6 * (ib % 2));
            let dl = [
                d * (2 * (s & 7) + 1) as f32,
                d * (2 * ((s >> 3) & 7) + 1) as f32,
            ];
            for (l, (y, &ql)) in y.chunks_exact_mut(GROUP).zip(q).enumerate() {
                // Group l takes its 3 high index bits and offset sign from nibble l%2 of qh[l/2].
                let nib = usize::from(h[l / 2] >> (4 * (l % 2))) & 0xf;
                let idx = usize::from(ql) | ((nib & 7) << 8);
                iq1_group(y, dl[l / 2], iq1_delta(nib & 8 != 0), IQ1S_GRID[idx]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Hand-computed blocks (grid entries read from ggml `ggml-common.h`); the bit-exact check on
    //! random blocks against gguf-py lives with the fixtures.
    use super::*;

    const ONE_F16: [u8; 2] = [0x00, 0x3c];

    fn run(f: fn(&[u8], &mut [f32]), block: &[u8]) -> Vec<f32> {
        let mut y = vec![f32::NAN; QK_K];
        f(block, &mut y);
        y
    }

    #[test]
    fn iq2_xxs_hand_block() {
        let mut b = [0u8; IQ2XXS_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2] = 1; // group 0: iq2xxs_grid[1] = 0x080808080808082b
        b[6..10].copy_from_slice(&(1u32 | 3 << 28).to_le_bytes()); // ksigns[1] = 0x81, scale 3
        let y = run(dequant_iq2_xxs, &b);
        // db = 1 * (0.5 + 3) * 0.25 = 0.875
        assert_eq!(y[..8], [-37.625, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, -7.0]);
        assert_eq!(y[8..16], [7.0; 8]);
        assert_eq!(y[32..40], [1.0; 8]); // zero bytes: grid 0x08 * 0.5 * 0.25
    }

    #[test]
    fn iq2_xs_hand_block() {
        let mut b = [0u8; IQ2XS_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2..4].copy_from_slice(&(511u16 | 1 << 9).to_le_bytes()); // all 0x2b, ksigns[1] = 0x81
        b[66] = 0x10; // db = 0.125 for groups 0-1, 0.375 for groups 2-3
        let y = run(dequant_iq2_xs, &b);
        assert_eq!(
            y[..8],
            [-5.375, 5.375, 5.375, 5.375, 5.375, 5.375, 5.375, -5.375]
        );
        assert_eq!(y[16..24], [3.0; 8]);
    }

    #[test]
    fn iq2_s_hand_block() {
        let mut b = [0u8; IQ2S_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2] = 0xff;
        b[66] = 0x03; // qh: index 0x3ff = iq2s_grid[1023], all 0x2b
        b[34] = 0x02; // sign byte of group 0
        let y = run(dequant_iq2_s, &b);
        assert_eq!(y[..3], [5.375, -5.375, 5.375]);
        assert_eq!(y[8..16], [1.0; 8]);
    }

    #[test]
    fn iq3_xxs_hand_block() {
        let mut b = [0u8; IQ3XXS_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2] = 255; // iq3xxs_grid[255] = 0x3e341c04
        b[3] = 5; // iq3xxs_grid[5] = 0x04040c3e
        b[66..70].copy_from_slice(&(3u32 | 1 << 28).to_le_bytes()); // ksigns[3] = 0x03, scale 1
        let y = run(dequant_iq3_xxs, &b);
        // db = 1 * (0.5 + 1) * 0.5 = 0.75
        assert_eq!(y[..8], [-3.0, -21.0, 39.0, 46.5, 46.5, 9.0, 3.0, 3.0]);
    }

    #[test]
    fn iq3_s_hand_block() {
        let mut b = [0u8; IQ3S_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2] = 0xff;
        b[66] = 0x01; // qh bit 0: index 511, iq3s_grid[511] = 0x0f0f0101
        b[74] = 0x04; // sign of value 2
        b[106] = 0x02; // db = 1 * (1 + 2*2) = 5
        let y = run(dequant_iq3_s, &b);
        assert_eq!(y[..8], [5.0, 5.0, -75.0, 75.0, 5.0, 5.0, 5.0, 5.0]);
    }

    #[test]
    fn iq1_s_hand_block() {
        let mut b = [0u8; IQ1S_BYTES];
        b[..2].copy_from_slice(&ONE_F16);
        b[2] = 0xff;
        b[34..36].copy_from_slice(&0xa007u16.to_le_bytes()); // -delta, scale 2, high bits 7
        let y = run(dequant_iq1_s, &b);
        // dl = 1 * (2*2 + 1) = 5; iq1s_grid[2047] = all +1, iq1s_grid[0] = all -1
        assert_eq!(y[..8], [4.375; 8]);
        assert_eq!(y[8..16], [-5.625; 8]);
    }

    #[test]
    fn iq1_m_hand_block() {
        let mut b = [0u8; IQ1M_BYTES];
        b[0] = 0xff;
        b[32] = 0x87; // group 0: high bits 7, +delta; group 1: high bits 0, -delta
        b[48] = 0x11; // sub-block 0 scales: 1 (dl1 = 3), 2 (dl2 = 5)
        b[53] = 0xc0; // d = 0x3c00 = 1.0 from the top nibbles of the 4 scale words
        b[55] = 0x30;
        let y = run(dequant_iq1_m, &b);
        assert_eq!(y[..8], [3.375; 8]);
        assert_eq!(y[8..16], [-3.375; 8]);
        assert_eq!(y[16..24], [-4.375; 8]);
    }
}
