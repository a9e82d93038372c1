//! Ternary and FP4 formats: TQ1_0, TQ2_0, MXFP4, NVFP4.
//!
//! Formulas: ggml `ggml/src/ggml-quants.c` (`dequantize_row_tq1_0`, `dequantize_row_tq2_0`,
//! `dequantize_row_mxfp4`, `dequantize_row_nvfp4`), the scale decoders `ggml_e8m0_to_fp32_half`
//! and `ggml_ue4m3_to_fp32` in ggml `ggml/src/ggml-impl.h`, and gguf-py `gguf/quants.py`
//! (`TQ1_0`, `TQ2_0`, `MXFP4`, `NVFP4` `.dequantize_blocks`), whose NVFP4 layout (64-element
//! block: four UE4M3 scale bytes, then 32 bytes of E2M1 pairs, 16 elements per scale) is the
//! one followed here.
//!
//! All products are exact in f32 (a power of two, an f16 or a 4-bit-significand scale times
//! an integer of at most 4 bits), including MXFP4's subnormal scales, so the output matches
//! both references bit for bit. No flush-to-zero is involved: Rust never enables it.

use super::legacy::{blocks, Levels};
use super::simd::multiversion;
use super::{f16_le, QK_K};

/// Bytes per block (ggml `src/ggml-common.h` static_asserts, gguf-py `GGML_QUANT_SIZES`).
const TQ1_0_BYTES: usize = 54;
const TQ2_0_BYTES: usize = 66;
const MXFP4_BYTES: usize = 17;
const NVFP4_BYTES: usize = 36;
/// Elements per MXFP4 block (`QK_MXFP4`).
const QK_MXFP4: usize = 32;
/// Elements per NVFP4 block (`QK_NVFP4`) and per NVFP4 scale (`QK_NVFP4_SUB`).
const QK_NVFP4: usize = 64;
const QK_NVFP4_SUB: usize = 16;

/// E2M1 values doubled (ggml `src/ggml-common.h`, `kvalues_mxfp4`); the scale decoders below
/// return half the scale to compensate.
pub(crate) const KVALUES_MXFP4: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
];

/// [`KVALUES_MXFP4`] as [`Levels`] (the same integers).
const MXFP4_LEVELS: Levels = Levels::new([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]);

/// Powers of three that shift the next base-3 digit of a TQ1_0 byte into its top bits.
pub(crate) const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// `2^k` as f32 for `-126 <= k <= 127`.
const fn pow2(k: i32) -> f32 {
    f32::from_bits(((127 + k) as u32) << 23)
}

/// ggml's `ggml_e8m0_to_fp32_half`: `2^(x-128)` as f32 bits, subnormal for `x < 2`.
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(x: u8) -> f32 {
    let bits = if x < 2 {
        0x0020_0000u32 << x
    } else {
        u32::from(x - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `ggml_ue4m3_to_fp32`: half of an unsigned E4M3 value (bias 7); bit 7 is ignored,
/// and 0x00 and 0x7F (the NaN code) give 0.
const fn ue4m3_to_f32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let exp = ((x >> 3) & 0xF) as i32;
    let man = (x & 7) as f32;
    let raw = if exp == 0 {
        man * pow2(-9)
    } else {
        (1.0 + man / 8.0) * pow2(exp - 7)
    };
    raw * 0.5
}

/// [`ue4m3_to_f32_half`] for every byte.
pub(crate) const UE4M3_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = ue4m3_to_f32_half(i as u8);
        i += 1;
    }
    t
};

/// One TQ1_0 digit: the byte `q` (already multiplied by a power of three, mod 256) holds a
/// base-3 fraction; `((q * 3) >> 8) - 1` is its leading trit in {-1, 0, 1}.
#[inline(always)]
fn tq1_trit(q: u8) -> f32 {
    f32::from(((u16::from(q) * 3) >> 8) as i16 - 1)
}

/// Writes the five (or four, for `qh`) trits of each byte of `q`: digit `n` of byte `m` goes to
/// `y[n * q.len() + m]`.
#[inline(always)]
fn tq1_digits(q: &[u8], y: &mut [f32], d: f32) {
    for (&p, yn) in POW3.iter().zip(y.chunks_exact_mut(q.len())) {
        for (o, &x) in yn.iter_mut().zip(q) {
            *o = tq1_trit(x.wrapping_mul(p)) * d;
        }
    }
}

multiversion! {
    /// TQ1_0: block = qs[48], qh[4], f16 d. Bytes hold 5 (qs) or 4 (qh) base-3 digits; digit `n`
    /// of byte `m` is `t = ((u8(byte * 3^n) * 3) >> 8) - 1`, and `y = t * d` lands at
    /// `32n + m` (qs[0..32]), `160 + 16n + m` (qs[32..48]) and `240 + 4n + m` (qh).
    pub fn dequant_tq1_0(src: &[u8], dst: &mut [f32]) = tq1_0; max avx2
}

#[inline(always)]
fn tq1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<TQ1_0_BYTES, QK_K>(src, dst) {
        let d = f16_le(&b[52..54]);
        tq1_digits(&b[0..32], &mut y[0..160], d);
        tq1_digits(&b[32..48], &mut y[160..240], d);
        tq1_digits(&b[48..52], &mut y[240..256], d);
    }
}

multiversion! {
    /// TQ2_0: block = qs[64], f16 d. For `e = 128j + 32l + m`:
    /// `y = (((qs[32j+m] >> 2l) & 3) - 1) * d`.
    pub fn dequant_tq2_0(src: &[u8], dst: &mut [f32]) = tq2_0;
}

#[inline(always)]
fn tq2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<TQ2_0_BYTES, QK_K>(src, dst) {
        let d = f16_le(&b[64..66]);
        for (q, yj) in b[0..64].chunks_exact(32).zip(y.chunks_exact_mut(128)) {
            for (l, yl) in yj.chunks_exact_mut(32).enumerate() {
                let shift = 2 * l;
                for (o, &x) in yl.iter_mut().zip(q) {
                    *o = f32::from(((x >> shift) & 3) as i8 - 1) * d;
                }
            }
        }
    }
}

multiversion! {
    /// MXFP4: block = u8 e (E8M0), qs[16]; `d = 2^(e-128)`;
    /// `y[j] = kv[qs[j] & 0xF] * d`, `y[j+16] = kv[qs[j] >> 4] * d` (`kv` = doubled E2M1).
    pub fn dequant_mxfp4(src: &[u8], dst: &mut [f32]) = mxfp4::<true>; base mxfp4::<false>
}

#[inline(always)]
fn mxfp4<const SHIFT: bool>(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<MXFP4_BYTES, QK_MXFP4>(src, dst) {
        let d = e8m0_to_f32_half(b[0]);
        let (lo, hi) = y.split_at_mut(QK_MXFP4 / 2);
        for ((y0, y1), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[1..]) {
            *y0 = MXFP4_LEVELS.get::<SHIFT>(q & 0xF) * d;
            *y1 = MXFP4_LEVELS.get::<SHIFT>(q >> 4) * d;
        }
    }
}

multiversion! {
    /// NVFP4: block = u8 d[4] (UE4M3), qs[32]. For sub-block `s` (16 elements) and `j` in 0..8:
    /// `y[16s+j] = kv[qs[8s+j] & 0xF] * ue4m3(d[s])`, `y[16s+8+j] = kv[qs[8s+j] >> 4] * ue4m3(d[s])`.
    pub fn dequant_nvfp4(src: &[u8], dst: &mut [f32]) = nvfp4::<false>; max avx2
}

#[inline(always)]
fn nvfp4<const SHIFT: bool>(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<NVFP4_BYTES, QK_NVFP4>(src, dst) {
        let subs = y.chunks_exact_mut(QK_NVFP4_SUB).zip(b[4..].chunks_exact(8));
        for ((ys, q), &ds) in subs.zip(&b[0..4]) {
            let d = UE4M3_HALF[usize::from(ds)];
            let (lo, hi) = ys.split_at_mut(QK_NVFP4_SUB / 2);
            for ((y0, y1), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
                *y0 = MXFP4_LEVELS.get::<SHIFT>(x & 0xF) * d;
                *y1 = MXFP4_LEVELS.get::<SHIFT>(x >> 4) * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tq1_0_hand_block() {
        // Trits (2,1,0,1,2) = 2*81 + 27 + 3 + 2 = 194 are stored as ceil(194*256/243) = 205.
        // Decoding 205: n=0: 205 -> (615>>8) = 2 -> +1; n=1: 205*3 = 103 (mod 256) -> 1 -> 0;
        // n=2: 205*9 = 53 -> 0 -> -1; n=3: 205*27 = 159 -> 1 -> 0; n=4: 205*81 = 221 -> 2 -> +1.
        let mut b = vec![0u8; TQ1_0_BYTES];
        b[52..54].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        b[0] = 205;
        b[32] = 205;
        b[48] = 205;
        let mut y = vec![f32::NAN; QK_K];
        dequant_tq1_0(&b, &mut y);
        let at = |idx: &[usize]| idx.iter().map(|&i| y[i]).collect::<Vec<_>>();
        assert_eq!(at(&[0, 32, 64, 96, 128]), [0.5, 0.0, -0.5, 0.0, 0.5]);
        assert_eq!(at(&[160, 176, 192, 208, 224]), [0.5, 0.0, -0.5, 0.0, 0.5]);
        assert_eq!(at(&[240, 244, 248, 252]), [0.5, 0.0, -0.5, 0.0]);
        assert_eq!(at(&[1, 161, 241, 255]), [-0.5; 4]); // byte 0: every trit 0 -> -1
    }

    #[test]
    fn tq2_0_hand_block() {
        // d = 2; qs[0] = 0b11_10_01_00 -> y[0,32,64,96] = (0,1,2,3) - 1 = -1,0,1,2 times 2;
        // qs[32] = 0b00_01_10_11 -> y[128,160,192,224] = 2,1,0,-1 times 2.
        let mut b = vec![0x55u8; TQ2_0_BYTES]; // 0x55: every 2-bit digit 1 -> 0
        b[64..66].copy_from_slice(&0x4000u16.to_le_bytes());
        b[0] = 0xE4;
        b[32] = 0x1B;
        let mut y = vec![f32::NAN; QK_K];
        dequant_tq2_0(&b, &mut y);
        let at = |idx: &[usize]| idx.iter().map(|&i| y[i]).collect::<Vec<_>>();
        assert_eq!(at(&[0, 32, 64, 96]), [-2.0, 0.0, 2.0, 4.0]);
        assert_eq!(at(&[128, 160, 192, 224]), [4.0, 2.0, 0.0, -2.0]);
        assert_eq!(at(&[1, 33, 255]), [0.0; 3]);
    }

    #[test]
    fn mxfp4_hand_blocks() {
        // Block 0: e = 128 -> d = 2^0 = 1; qs[0] = 0xF7 -> y[0] = kv[7] = 12, y[16] = kv[15] = -12.
        // Block 1: e = 1 -> d = 2^-127 (subnormal bits 0x00400000); qs[1] = 0x01 -> y[33] = 2^-127,
        // y[49] = kv[0] * d = 0.
        let mut b = vec![0u8; 2 * MXFP4_BYTES];
        b[0] = 128;
        b[1] = 0xF7;
        b[MXFP4_BYTES] = 1;
        b[MXFP4_BYTES + 2] = 0x01;
        let mut y = vec![f32::NAN; 2 * QK_MXFP4];
        dequant_mxfp4(&b, &mut y);
        assert_eq!((y[0], y[16], y[1]), (12.0, -12.0, 0.0));
        assert_eq!(y[33].to_bits(), 0x0040_0000);
        assert_eq!(y[49], 0.0);
    }

    #[test]
    fn nvfp4_hand_block() {
        // Scales: 0x38 (exp 7, man 0) -> 1.0/2 = 0.5; 0x7F -> 0; 0x01 (exp 0, man 1) -> 2^-9/2
        // = 2^-10; 0x8B (bit 7 ignored: exp 1, man 3) -> (1 + 3/8) * 2^-6 / 2 = 0.0107421875.
        let mut b = vec![0u8; NVFP4_BYTES];
        b[0..4].copy_from_slice(&[0x38, 0x7F, 0x01, 0x8B]);
        b[4] = 0xE6; // sub 0, j=0: low kv[6] = 8 -> y[0] = 4; high kv[14] = -8 -> y[8] = -4
        b[4 + 8] = 0x77; // sub 1: scale 0 -> y[16] = y[24] = 0
        b[4 + 16] = 0x07; // sub 2: y[32] = 12 * 2^-10 = 0.01171875, y[40] = 0
        b[4 + 24] = 0x0C; // sub 3: y[48] = kv[12] = -4 -> -0.04296875, y[56] = 0
        let mut y = vec![f32::NAN; QK_NVFP4];
        dequant_nvfp4(&b, &mut y);
        assert_eq!((y[0], y[8], y[16], y[24]), (4.0, -4.0, 0.0, 0.0));
        assert_eq!((y[32], y[40]), (0.01171875, 0.0));
        assert_eq!((y[48], y[56]), (-0.04296875, 0.0));
        assert_eq!(UE4M3_HALF[0xFF], 240.0); // exp 15, man 7: (1 + 7/8) * 2^8 / 2
    }
}
