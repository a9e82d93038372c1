//! 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.
//!
//! Formulas: ggml `ggml/src/ggml-quants.c` (`dequantize_row_q4_0`, `_q4_1`, `_q5_0`, `_q5_1`,
//! `_q8_0`, `_iq4_nl`) and gguf-py `gguf/quants.py` (`Q4_0.dequantize_blocks` and neighbours);
//! block layouts from ggml `ggml/src/ggml-common.h`.
//!
//! Each product `d * q` is exact in f32 (an 11-bit f16 significand times an integer of at most
//! 8 bits), and Q4_1/Q5_1 round once at the final `+ m`, so the output equals both references
//! bit for bit whatever the evaluation order or FMA contraction.
//!
//! The loops walk fixed-size arrays (see [`blocks`]) and zip the two output halves of a block
//! with its packed bytes, so they compile without bounds checks and auto-vectorize.

use std::sync::atomic::{compiler_fence, Ordering};

use super::f16_le;
use super::simd::multiversion;

/// Elements per legacy block (`QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK4_NL`).
const QK: usize = 32;
/// Half a legacy block: byte `j` of `qs` holds elements `j` (low nibble) and `j + HALF` (high).
const HALF: usize = QK / 2;

/// Bytes per block (ggml `src/ggml-common.h` static_asserts).
const Q4_0_BYTES: usize = 18;
const Q4_1_BYTES: usize = 20;
const Q5_0_BYTES: usize = 22;
const Q5_1_BYTES: usize = 24;
const Q8_0_BYTES: usize = 34;
const IQ4_NL_BYTES: usize = 18;

/// The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml `src/ggml-common.h`, `kvalues_iq4nl`).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The sixteen levels of a 4-bit code that indexes a table of small integers (IQ4_NL, IQ4_XS,
/// MXFP4, NVFP4), read one of two ways: [`Levels::get`]`::<false>` loads from an f32 table;
/// `::<true>` shifts the level out of one of two words holding eight levels as bytes. A table
/// load becomes a gather, or scalar loads, when the loop is vectorized; the shift becomes a
/// variable shift and a blend, which AVX2 and AVX-512 have, so their builds of these bodies
/// shift and the baseline's loads. Both give the same exact integer as f32.
pub(super) struct Levels {
    f32s: [f32; 16],
    lo: u64,
    hi: u64,
}

impl Levels {
    /// The levels `l[0..16]`.
    pub(super) const fn new(l: [i8; 16]) -> Levels {
        let mut f32s = [0f32; 16];
        let (mut lo, mut hi) = (0u64, 0u64);
        let mut i = 0;
        while i < 8 {
            f32s[i] = l[i] as f32;
            f32s[i + 8] = l[i + 8] as f32;
            lo |= (l[i] as u8 as u64) << (8 * i);
            hi |= (l[i + 8] as u8 as u64) << (8 * i);
            i += 1;
        }
        Levels { f32s, lo, hi }
    }

    /// The level of code `q` (`q < 16`) as f32, by shifting (`SHIFT`) or by a table load.
    #[inline(always)]
    pub(super) fn get<const SHIFT: bool>(&self, q: u8) -> f32 {
        if SHIFT {
            let word = if q & 8 != 0 { self.hi } else { self.lo };
            f32::from((word >> (u32::from(q & 7) * 8)) as u8 as i8)
        } else {
            self.f32s[usize::from(q & 0xF)]
        }
    }
}

/// [`KVALUES_IQ4NL`] as [`Levels`].
pub(super) const IQ4NL_LEVELS: Levels = Levels::new(KVALUES_IQ4NL);

/// Bit `j` for `j` in 0..32: testing `qh & BIT[j]` vectorizes where a per-lane shift would not.
const BIT: [u32; QK] = {
    let mut t = [0u32; QK];
    let mut j = 0;
    while j < QK {
        t[j] = 1 << j;
        j += 1;
    }
    t
};

/// Pairs each `TS`-byte block of `src` with its `BS` outputs in `dst`, both as fixed-size
/// arrays so that indexing inside a block needs no bounds checks. Trailing partial chunks
/// (never present: callers pass whole blocks) are ignored.
///
/// Each step passes a compiler fence (no instruction: it only keeps LLVM from moving memory
/// accesses from one block to another). Without it LLVM vectorizes short blocks *across*
/// blocks, one lane per block, which turns every byte load into a gather and runs several
/// times slower than vectorizing within the block, as the loops are written to be.
#[inline(always)]
pub(super) fn blocks<'a, const TS: usize, const BS: usize>(
    src: &'a [u8],
    dst: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8; TS], &'a mut [f32; BS])> {
    src.chunks_exact(TS)
        .zip(dst.chunks_exact_mut(BS))
        .filter_map(|(b, y)| {
            compiler_fence(Ordering::SeqCst);
            Some((b.first_chunk::<TS>()?, y.first_chunk_mut::<BS>()?))
        })
}

multiversion! {
    /// Q8_0: block = f16 d, i8 qs[32]; `y[j] = qs[j] * d`.
    pub fn dequant_q8_0(src: &[u8], dst: &mut [f32]) = q8_0;
}

#[inline(always)]
fn q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q8_0_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        for (yi, &q) in y.iter_mut().zip(&b[2..]) {
            *yi = f32::from(q as i8) * d;
        }
    }
}

multiversion! {
    /// Q4_0: block = f16 d, qs[16];
    /// `y[j] = ((qs[j] & 0xF) - 8) * d`, `y[j+16] = ((qs[j] >> 4) - 8) * d`.
    pub fn dequant_q4_0(src: &[u8], dst: &mut [f32]) = q4_0;
}

#[inline(always)]
fn q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q4_0_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        let q = nibbles(&b[2..]);
        for (yi, &qi) in y.iter_mut().zip(&q) {
            *yi = f32::from(qi as i8 - 8) * d;
        }
    }
}

/// The 4-bit values of a legacy block: `q[j] = qs[j] & 0xF`, `q[j + 16] = qs[j] >> 4`.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    let (lo, hi) = q.split_at_mut(HALF);
    for ((q0, q1), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
        *q0 = x & 0xF;
        *q1 = x >> 4;
    }
    q
}

multiversion! {
    /// Q4_1: block = f16 d, f16 m, qs[16];
    /// `y[j] = (qs[j] & 0xF) * d + m`, `y[j+16] = (qs[j] >> 4) * d + m`.
    pub fn dequant_q4_1(src: &[u8], dst: &mut [f32]) = q4_1;
}

#[inline(always)]
fn q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q4_1_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        let m = f16_le(&b[2..4]);
        let (lo, hi) = y.split_at_mut(HALF);
        for ((y0, y1), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..]) {
            *y0 = f32::from(q & 0xF) * d + m;
            *y1 = f32::from(q >> 4) * d + m;
        }
    }
}

/// The 5-bit values of a Q5 block: `q[e] = nibble | ((qh >> e) & 1) << 4`, with the nibble
/// the low half of `qs[e]` for `e < 16` and the high half of `qs[e - 16]` above.
#[inline(always)]
fn q5_values(qh: u32, qs: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    let (lo, hi) = q.split_at_mut(HALF);
    let (bit_lo, bit_hi) = BIT.split_at(HALF);
    for ((((q0, q1), &x), &b0), &b1) in lo
        .iter_mut()
        .zip(hi.iter_mut())
        .zip(qs)
        .zip(bit_lo)
        .zip(bit_hi)
    {
        *q0 = (x & 0xF) | if qh & b0 != 0 { 0x10 } else { 0 };
        *q1 = (x >> 4) | if qh & b1 != 0 { 0x10 } else { 0 };
    }
    q
}

multiversion! {
    /// Q5_0: block = f16 d, u32 qh (LE), qs[16]; `y[e] = (q[e] - 16) * d` with `q` as in
    /// ggml's `((qs & 0xF) | xh_0)` / `((qs >> 4) | xh_1)`.
    pub fn dequant_q5_0(src: &[u8], dst: &mut [f32]) = q5_0;
}

#[inline(always)]
fn q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q5_0_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let q = q5_values(qh, &b[6..]);
        for (yi, &qi) in y.iter_mut().zip(&q) {
            *yi = f32::from(i16::from(qi) - 16) * d;
        }
    }
}

multiversion! {
    /// Q5_1: block = f16 d, f16 m, u32 qh (LE), qs[16]; `y[e] = q[e] * d + m`.
    pub fn dequant_q5_1(src: &[u8], dst: &mut [f32]) = q5_1;
}

#[inline(always)]
fn q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q5_1_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        let m = f16_le(&b[2..4]);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let q = q5_values(qh, &b[8..]);
        for (yi, &qi) in y.iter_mut().zip(&q) {
            *yi = f32::from(qi) * d + m;
        }
    }
}

multiversion! {
    /// IQ4_NL: block = f16 d, qs[16];
    /// `y[j] = d * kv[qs[j] & 0xF]`, `y[j+16] = d * kv[qs[j] >> 4]` with `kv` = [`KVALUES_IQ4NL`].
    pub fn dequant_iq4_nl(src: &[u8], dst: &mut [f32]) = iq4_nl::<true>; base iq4_nl::<false>
}

#[inline(always)]
fn iq4_nl<const SHIFT: bool>(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<IQ4_NL_BYTES, QK>(src, dst) {
        let d = f16_le(&b[0..2]);
        let (lo, hi) = y.split_at_mut(HALF);
        for ((y0, y1), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
            *y0 = d * IQ4NL_LEVELS.get::<SHIFT>(q & 0xF);
            *y1 = d * IQ4NL_LEVELS.get::<SHIFT>(q >> 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 bit patterns used below: 0x3800 = 0.5, 0x3C00 = 1.0, 0xBC00 = -1.0, 0x4000 = 2.0.
    const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes();
    const F16_ONE: [u8; 2] = 0x3C00u16.to_le_bytes();
    const F16_MINUS_ONE: [u8; 2] = 0xBC00u16.to_le_bytes();
    const F16_TWO: [u8; 2] = 0x4000u16.to_le_bytes();

    fn run(f: fn(&[u8], &mut [f32]), block: &[u8]) -> Vec<f32> {
        let mut y = vec![f32::NAN; QK];
        f(block, &mut y);
        y
    }

    #[test]
    fn q8_0_hand_block() {
        // d = 0.5; qs[0] = -128 -> -64.0, qs[1] = 127 -> 63.5, qs[31] = -3 -> -1.5, rest 0.
        let mut b = vec![0u8; Q8_0_BYTES];
        b[0..2].copy_from_slice(&F16_HALF);
        b[2] = 0x80;
        b[3] = 0x7F;
        b[33] = (-3i8) as u8;
        let y = run(dequant_q8_0, &b);
        assert_eq!((y[0], y[1], y[31]), (-64.0, 63.5, -1.5));
        assert!(y[2..31].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q4_0_hand_block() {
        // d = 0.5; qs[0] = 0x1F: y[0] = (15-8)*0.5 = 3.5, y[16] = (1-8)*0.5 = -3.5;
        // qs[15] = 0x80: y[15] = (0-8)*0.5 = -4.0, y[31] = (8-8)*0.5 = 0; other bytes 0x88 -> 0.
        let mut b = vec![0x88u8; Q4_0_BYTES];
        b[0..2].copy_from_slice(&F16_HALF);
        b[2] = 0x1F;
        b[17] = 0x80;
        let y = run(dequant_q4_0, &b);
        assert_eq!((y[0], y[16], y[15], y[31]), (3.5, -3.5, -4.0, 0.0));
        assert!(y[1..15].iter().chain(&y[17..31]).all(|&v| v == 0.0));
    }

    #[test]
    fn q4_1_hand_block() {
        // d = 2, m = -1; qs[0] = 0xF3: y[0] = 3*2 - 1 = 5, y[16] = 15*2 - 1 = 29; other bytes 0 -> -1.
        let mut b = vec![0u8; Q4_1_BYTES];
        b[0..2].copy_from_slice(&F16_TWO);
        b[2..4].copy_from_slice(&F16_MINUS_ONE);
        b[4] = 0xF3;
        let y = run(dequant_q4_1, &b);
        assert_eq!((y[0], y[16]), (5.0, 29.0));
        assert!(y[1..16].iter().chain(&y[17..]).all(|&v| v == -1.0));
    }

    #[test]
    fn q5_0_hand_block() {
        // d = 1; qh = bit 0 and bit 17 set; qs[0] = 0x2F, qs[1] = 0x00, others 0x00.
        // y[0] = (0xF | 0x10) - 16 = 15; y[16] = (0x2 | 0) - 16 = -14;
        // y[17] = (0 | 0x10) - 16 = 0; y[1] = 0 - 16 = -16; every other element -16.
        let mut b = vec![0u8; Q5_0_BYTES];
        b[0..2].copy_from_slice(&F16_ONE);
        b[2..6].copy_from_slice(&((1u32 << 0) | (1u32 << 17)).to_le_bytes());
        b[6] = 0x2F;
        let y = run(dequant_q5_0, &b);
        assert_eq!((y[0], y[16], y[17], y[1]), (15.0, -14.0, 0.0, -16.0));
        let others = (2..16).chain(18..32);
        assert!(others.map(|e| y[e]).all(|v| v == -16.0));
    }

    #[test]
    fn q5_1_hand_block() {
        // d = 0.5, m = 1; qh = bit 31 only; qs[15] = 0xF1.
        // y[15] = 1*0.5 + 1 = 1.5; y[31] = (0xF | 0x10)*0.5 + 1 = 31*0.5 + 1 = 16.5; others m = 1.
        let mut b = vec![0u8; Q5_1_BYTES];
        b[0..2].copy_from_slice(&F16_HALF);
        b[2..4].copy_from_slice(&F16_ONE);
        b[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        b[23] = 0xF1;
        let y = run(dequant_q5_1, &b);
        assert_eq!((y[15], y[31]), (1.5, 16.5));
        assert!(y[..15].iter().chain(&y[16..31]).all(|&v| v == 1.0));
    }

    #[test]
    fn iq4_nl_hand_block() {
        // d = 0.5; qs[0] = 0xF0: y[0] = 0.5*kv[0] = -63.5, y[16] = 0.5*kv[15] = 56.5;
        // other bytes 0x88: kv[8] = 1 -> 0.5.
        let mut b = vec![0x88u8; IQ4_NL_BYTES];
        b[0..2].copy_from_slice(&F16_HALF);
        b[2] = 0xF0;
        let y = run(dequant_iq4_nl, &b);
        assert_eq!((y[0], y[16]), (-63.5, 56.5));
        assert!(y[1..16].iter().chain(&y[17..]).all(|&v| v == 0.5));
    }
}
