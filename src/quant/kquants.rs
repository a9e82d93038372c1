//! 256-element super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.
//!
//! Formulas: ggml `ggml/src/ggml-quants.c` (`dequantize_row_q2_K` .. `dequantize_row_q6_K`,
//! `dequantize_row_iq4_xs`) and gguf-py `gguf/quants.py` (`Q2_K.dequantize_blocks` ..
//! `IQ4_XS.dequantize_blocks`); block layouts from ggml `ggml/src/ggml-common.h`.
//!
//! Every function first computes the per-sub-block scale products exactly as ggml groups them
//! (`dl = d * sc`, `ml = dmin * m`), then runs one branch-free loop per sub-block. All those
//! products are exact in f32 (at most 11 + 8 + 6 significant bits), and the types with a min
//! round once at the final `- ml`, so the output equals ggml and gguf-py bit for bit.

use super::legacy::{blocks, IQ4NL_LEVELS};
use super::simd::multiversion;
use super::{f16_le, QK_K};

/// Bytes per super-block (ggml `src/ggml-common.h` static_asserts).
const Q2_K_BYTES: usize = 84;
const Q3_K_BYTES: usize = 110;
const Q4_K_BYTES: usize = 144;
const Q5_K_BYTES: usize = 176;
const Q6_K_BYTES: usize = 210;
const IQ4_XS_BYTES: usize = 136;

/// Bytes of packed 6-bit scales and mins in Q4_K/Q5_K (`K_SCALE_SIZE`), and of Q3_K's scales.
const K_SCALE_SIZE: usize = 12;
/// Elements per Q4_K/Q5_K/IQ4_XS sub-block (one scale each).
const SUB32: usize = 32;
/// Elements per Q2_K/Q3_K/Q6_K sub-block (one scale each).
const SUB16: usize = 16;
/// Elements per half super-block in Q2_K/Q3_K/Q6_K (one pass over the packed low bits).
const HALF_K: usize = QK_K / 2;

/// ggml's `get_scale_min_k4` for all eight sub-blocks of a Q4_K/Q5_K super-block:
/// `j < 4`: `sc = s[j] & 63`, `m = s[j+4] & 63`;
/// `j >= 4`: `sc = (s[j+4] & 0xF) | (s[j-4] >> 6) << 4`, `m = (s[j+4] >> 4) | (s[j] >> 6) << 4`.
#[inline(always)]
fn scale_min_k4(s: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// The `K_SCALE_SIZE` scale bytes at `off` of a Q4_K/Q5_K block, as an array.
#[inline(always)]
fn scale_bytes<const TS: usize>(b: &[u8; TS], off: usize) -> [u8; K_SCALE_SIZE] {
    std::array::from_fn(|i| b[off + i])
}

/// The per-sub-block products `(d * sc[j], dmin * m[j])` of a Q4_K/Q5_K super-block.
#[inline(always)]
fn k4_scales(d: f32, dmin: f32, s: &[u8; K_SCALE_SIZE]) -> ([f32; 8], [f32; 8]) {
    let (sc, m) = scale_min_k4(s);
    (sc.map(|v| d * f32::from(v)), m.map(|v| dmin * f32::from(v)))
}

multiversion! {
    /// Q4_K: block = f16 d, f16 dmin, scales[12], qs[128]. For element `e = 64g + 32t + l`:
    /// `q = t ? qs[32g+l] >> 4 : qs[32g+l] & 0xF`, `(sc, m) = get_scale_min_k4(2g+t)`,
    /// `y = (d*sc)*q - (dmin*m)`.
    pub fn dequant_q4_k(src: &[u8], dst: &mut [f32]) = q4_k;
}

#[inline(always)]
fn q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q4_K_BYTES, QK_K>(src, dst) {
        let (d, dmin) = (f16_le(&b[0..2]), f16_le(&b[2..4]));
        let (dl, ml) = k4_scales(d, dmin, &scale_bytes(b, 4));
        let qs = &b[16..144];
        for g in 0..4 {
            let (d0, m0, d1, m1) = (dl[2 * g], ml[2 * g], dl[2 * g + 1], ml[2 * g + 1]);
            let (y0, y1) = y[64 * g..64 * g + 64].split_at_mut(SUB32);
            let q = &qs[32 * g..32 * g + 32];
            for ((a, c), &x) in y0.iter_mut().zip(y1.iter_mut()).zip(q) {
                *a = d0 * f32::from(x & 0xF) - m0;
                *c = d1 * f32::from(x >> 4) - m1;
            }
        }
    }
}

multiversion! {
    /// Q5_K: block = f16 d, f16 dmin, scales[12], qh[32], qs[128]. As Q4_K with
    /// `q += 16` when `(qh[l] >> (2g+t)) & 1`; `y = (d*sc)*q - (dmin*m)`.
    pub fn dequant_q5_k(src: &[u8], dst: &mut [f32]) = q5_k;
}

#[inline(always)]
fn q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q5_K_BYTES, QK_K>(src, dst) {
        let (d, dmin) = (f16_le(&b[0..2]), f16_le(&b[2..4]));
        let (dl, ml) = k4_scales(d, dmin, &scale_bytes(b, 4));
        let qh = &b[16..48];
        let qs = &b[48..176];
        for g in 0..4 {
            let (d0, m0, d1, m1) = (dl[2 * g], ml[2 * g], dl[2 * g + 1], ml[2 * g + 1]);
            let (u0, u1) = (1u8 << (2 * g), 2u8 << (2 * g));
            let (y0, y1) = y[64 * g..64 * g + 64].split_at_mut(SUB32);
            let q = &qs[32 * g..32 * g + 32];
            for (((a, c), &x), &h) in y0.iter_mut().zip(y1.iter_mut()).zip(q).zip(qh) {
                let q0 = (x & 0xF) | if h & u0 != 0 { 16 } else { 0 };
                let q1 = (x >> 4) | if h & u1 != 0 { 16 } else { 0 };
                *a = d0 * f32::from(q0) - m0;
                *c = d1 * f32::from(q1) - m1;
            }
        }
    }
}

multiversion! {
    /// Q6_K: block = ql[128], qh[64], i8 scales[16], f16 d. For `e = 128h + 32k + l`:
    /// low 4 bits from `ql[64h + l + 32*(k&1)]` (low nibble for k<2, high for k>=2), high 2 bits
    /// `(qh[32h+l] >> 2k) & 3`, `q = (lo | hi<<4) - 32`, `y = (d * sc[8h + 2k + l/16]) * q`.
    pub fn dequant_q6_k(src: &[u8], dst: &mut [f32]) = q6_k;
}

#[inline(always)]
fn q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q6_K_BYTES, QK_K>(src, dst) {
        let d = f16_le(&b[208..210]);
        let ds: [f32; 16] = std::array::from_fn(|i| d * f32::from(b[192 + i] as i8));
        for h in 0..2 {
            let ql = &b[64 * h..64 * h + 64];
            let qh = &b[128 + 32 * h..128 + 32 * h + 32];
            let yh = &mut y[HALF_K * h..HALF_K * h + HALF_K];
            for s in 0..2 {
                // l runs over 16s..16s+16: one scale per output quarter.
                let sc = &ds[8 * h + s..];
                let (s0, s1, s2, s3) = (sc[0], sc[2], sc[4], sc[6]);
                let r = SUB16 * s..SUB16 * s + SUB16;
                let (qa, qb, hh) = (&ql[r.clone()], &ql[32 + r.start..32 + r.end], &qh[r]);
                let (y0, rest) = yh[SUB16 * s..].split_at_mut(SUB32);
                let (y1, rest) = rest.split_at_mut(SUB32);
                let (y2, y3) = rest.split_at_mut(SUB32);
                let lanes = y0
                    .iter_mut()
                    .zip(y1.iter_mut())
                    .zip(y2.iter_mut())
                    .zip(y3.iter_mut());
                for ((((((o0, o1), o2), o3), &a), &c), &x) in lanes.zip(qa).zip(qb).zip(hh) {
                    let q0 = ((a & 0xF) | ((x & 3) << 4)) as i8 - 32;
                    let q1 = ((c & 0xF) | (((x >> 2) & 3) << 4)) as i8 - 32;
                    let q2 = ((a >> 4) | (((x >> 4) & 3) << 4)) as i8 - 32;
                    let q3 = ((c >> 4) | (((x >> 6) & 3) << 4)) as i8 - 32;
                    *o0 = s0 * f32::from(q0);
                    *o1 = s1 * f32::from(q1);
                    *o2 = s2 * f32::from(q2);
                    *o3 = s3 * f32::from(q3);
                }
            }
        }
    }
}

multiversion! {
    /// Q2_K: block = scales[16], qs[64], f16 d, f16 dmin. For `e = 128h + 32j + 16t + l`:
    /// `q = (qs[32h+16t+l] >> 2j) & 3`, `s = scales[8h+2j+t]`, `y = (d*(s&0xF))*q - dmin*(s>>4)`.
    pub fn dequant_q2_k(src: &[u8], dst: &mut [f32]) = q2_k;
}

#[inline(always)]
fn q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q2_K_BYTES, QK_K>(src, dst) {
        let (d, dmin) = (f16_le(&b[80..82]), f16_le(&b[82..84]));
        let dl: [f32; 16] = std::array::from_fn(|i| d * f32::from(b[i] & 0xF));
        let ml: [f32; 16] = std::array::from_fn(|i| dmin * f32::from(b[i] >> 4));
        for h in 0..2 {
            let qs = &b[16 + 32 * h..16 + 32 * h + 32];
            for j in 0..4 {
                for t in 0..2 {
                    let (dd, mm) = (dl[8 * h + 2 * j + t], ml[8 * h + 2 * j + t]);
                    let e = HALF_K * h + SUB32 * j + SUB16 * t;
                    let q = &qs[SUB16 * t..SUB16 * t + SUB16];
                    for (o, &x) in y[e..e + SUB16].iter_mut().zip(q) {
                        *o = dd * f32::from((x >> (2 * j)) & 3) - mm;
                    }
                }
            }
        }
    }
}

/// Q3_K's sixteen 6-bit scales, minus 32: low nibble `j<8 ? sc[j]&0xF : sc[j-8]>>4`,
/// high bits `(sc[8 + j%4] >> 2*(j/4)) & 3`.
#[inline(always)]
fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (lo | (hi << 4)) as i8 - 32
    })
}

multiversion! {
    /// Q3_K: block = hmask[32], qs[64], scales[12], f16 d. Indexing as Q2_K;
    /// `q = ((qs[32h+16t+l] >> 2j) & 3) - (hmask[16t+l] bit (4h+j) ? 0 : 4)`, `y = (d*scale)*q`.
    ///
    /// Two passes: the signed 3-bit values first (byte lanes), then one scale per 16 outputs;
    /// a single fused loop makes LLVM vectorize across the bit planes instead of along `l`.
    pub fn dequant_q3_k(src: &[u8], dst: &mut [f32]) = q3_k;
}

#[inline(always)]
fn q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<Q3_K_BYTES, QK_K>(src, dst) {
        let d = f16_le(&b[108..110]);
        let dl = q3_k_scales(&b[96..108]).map(|s| d * f32::from(s));
        let hmask = &b[0..32];
        let mut q = [0i8; QK_K];
        for (h, qh) in q.chunks_exact_mut(HALF_K).enumerate() {
            let qs = &b[32 + 32 * h..32 + 32 * h + 32];
            for (j, qj) in qh.chunks_exact_mut(SUB32).enumerate() {
                let bit = 1u8 << (4 * h + j);
                let shift = 2 * j;
                for ((o, &x), &m) in qj.iter_mut().zip(qs).zip(hmask) {
                    let low = ((x >> shift) & 3) as i8;
                    *o = low - if m & bit != 0 { 0 } else { 4 };
                }
            }
        }
        for ((ys, qs), &dd) in y
            .chunks_exact_mut(SUB16)
            .zip(q.chunks_exact(SUB16))
            .zip(&dl)
        {
            for (o, &v) in ys.iter_mut().zip(qs) {
                *o = dd * f32::from(v);
            }
        }
    }
}

multiversion! {
    /// IQ4_XS: block = f16 d, u16 scales_h, scales_l[4], qs[128]. For sub-block `ib` (0..8):
    /// `ls = ((scales_l[ib/2] >> 4*(ib%2)) & 0xF) | ((scales_h >> 2ib) & 3) << 4`, `dl = d*(ls-32)`;
    /// `y[32ib+j] = dl*kv[qs[16ib+j] & 0xF]`, `y[32ib+16+j] = dl*kv[qs[16ib+j] >> 4]`
    /// with `kv` the IQ4_NL levels.
    pub fn dequant_iq4_xs(src: &[u8], dst: &mut [f32]) = iq4_xs::<true>; base iq4_xs::<false>
}

#[inline(always)]
fn iq4_xs<const SHIFT: bool>(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<IQ4_XS_BYTES, QK_K>(src, dst) {
        let d = f16_le(&b[0..2]);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        for ib in 0..8 {
            let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
            let hi = ((scales_h >> (2 * ib)) & 3) as u8;
            let dl = d * f32::from((lo | (hi << 4)) as i8 - 32);
            let (y0, y1) = y[SUB32 * ib..SUB32 * ib + SUB32].split_at_mut(SUB16);
            let q = &b[8 + 16 * ib..8 + 16 * ib + 16];
            for ((a, c), &x) in y0.iter_mut().zip(y1.iter_mut()).zip(q) {
                *a = dl * IQ4NL_LEVELS.get::<SHIFT>(x & 0xF);
                *c = dl * IQ4NL_LEVELS.get::<SHIFT>(x >> 4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 bit patterns: 0x3800 = 0.5, 0x3C00 = 1.0.
    const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes();
    const F16_ONE: [u8; 2] = 0x3C00u16.to_le_bytes();

    fn run(f: fn(&[u8], &mut [f32]), block: &[u8]) -> Vec<f32> {
        let mut y = vec![f32::NAN; QK_K];
        f(block, &mut y);
        y
    }

    #[test]
    fn q4_k_hand_block() {
        let mut b = vec![0u8; Q4_K_BYTES];
        b[0..2].copy_from_slice(&F16_ONE); // d = 1
        b[2..4].copy_from_slice(&F16_HALF); // dmin = 0.5
        let s = 4; // scales start
        b[s] = 2; // sc0 = 2
        b[s + 4] = 3; // m0 = 3
        b[s + 1] = 0x40; // sc1 = 0x40 & 63 = 0; top bits give sc5 its bit 4
        b[s + 9] = 0x21; // sc5 = 1 | (0x40 >> 6) << 4 = 17, m5 = 2 | (s[5] >> 6) << 4 = 2
        b[16] = 0x0F; // qs[0]: element 0 (sub-block 0) low nibble 15, element 32 high 0
        b[16 + 64] = 0x30; // qs[64]: element 128 low 0 (sub-block 4), element 160 high 3 (sub 5)
        let y = run(dequant_q4_k, &b);
        assert_eq!(y[0], 28.5); // (1*2)*15 - 0.5*3
        assert_eq!(y[1], -1.5); // (1*2)*0 - 0.5*3
        assert_eq!(y[32], 0.0); // sc1 = m1 = 0
        assert_eq!(y[128], 0.0); // sc4 = m4 = 0
        assert_eq!(y[160], 50.0); // (1*17)*3 - 0.5*2
        assert_eq!(y[161], -1.0); // (1*17)*0 - 0.5*2
    }

    #[test]
    fn q5_k_hand_block() {
        let mut b = vec![0u8; Q5_K_BYTES];
        b[0..2].copy_from_slice(&F16_ONE); // d = 1
        b[2..4].copy_from_slice(&F16_ONE); // dmin = 1
        b[4] = 1; // sc0 = 1 (m0 = s[4] = 0)
        b[5] = 3; // sc1 = 3
        b[9] = 1; // m1 = 1
        b[16] = 0x03; // qh[0]: bit 0 -> element 0 +16, bit 1 -> element 32 +16
        b[48] = 0x05; // qs[0]: element 0 low nibble 5, element 32 high nibble 0
        let y = run(dequant_q5_k, &b);
        assert_eq!(y[0], 21.0); // 1*(5+16) - 0
        assert_eq!(y[1], 0.0); // 1*0 - 0
        assert_eq!(y[32], 47.0); // 3*(0+16) - 1*1
        assert_eq!(y[33], -1.0); // 3*0 - 1
    }

    #[test]
    fn q6_k_hand_block() {
        let mut b = vec![0u8; Q6_K_BYTES];
        b[208..210].copy_from_slice(&F16_HALF); // d = 0.5
        b[0] = 0x3A; // ql[0]: low 10 -> element 0, high 3 -> element 64
        b[32] = 0x10; // ql[32]: low 0 -> element 32, high 1 -> element 96
        b[128] = 0x93; // qh[0] = 0b10_01_00_11: elements 0,32,64,96 get hi = 3, 0, 1, 2
        b[192] = 2; // sc[0]
        b[194] = (-1i8) as u8; // sc[2]
        b[196] = 4; // sc[4]
        b[198] = 0x80; // sc[6] = -128
        b[192 + 9] = 3; // sc[9]: element 144 (h=1, k=0, l=16)
        b[64 + 16] = 0x01; // ql[80] low nibble 1 -> element 144; qh[48] = 0
        let y = run(dequant_q6_k, &b);
        assert_eq!(y[0], 26.0); // 0.5*2 * ((10 | 3<<4) - 32)
        assert_eq!(y[32], 16.0); // 0.5*-1 * (0 - 32)
        assert_eq!(y[64], -26.0); // 0.5*4 * ((3 | 1<<4) - 32)
        assert_eq!(y[96], -64.0); // 0.5*-128 * ((1 | 2<<4) - 32)
        assert_eq!(y[1], -32.0); // 0.5*2 * (0 - 32)
        assert_eq!(y[144], -46.5); // 0.5*3 * (1 - 32)
    }

    #[test]
    fn q2_k_hand_block() {
        let mut b = vec![0u8; Q2_K_BYTES];
        b[80..82].copy_from_slice(&F16_HALF); // d = 0.5
        b[82..84].copy_from_slice(&F16_ONE); // dmin = 1
        b[0] = 0x23; // scales[0]: dl = 0.5*3, ml = 1*2
        b[2] = 0x01; // scales[2]: dl = 0.5, ml = 0 (element 32: j=1, t=0)
        b[8] = 0xF0; // scales[8]: dl = 0, ml = 15 (element 128)
        b[16] = 0b0111; // qs[0]: bits 0-1 = 3 -> element 0, bits 2-3 = 1 -> element 32
        let y = run(dequant_q2_k, &b);
        assert_eq!(y[0], 2.5); // 1.5*3 - 2
        assert_eq!(y[1], -2.0); // 1.5*0 - 2
        assert_eq!(y[32], 0.5); // 0.5*1 - 0
        assert_eq!(y[128], -15.0); // 0*q - 15
    }

    #[test]
    fn q3_k_hand_block() {
        let mut b = vec![0u8; Q3_K_BYTES];
        b[108..110].copy_from_slice(&F16_ONE); // d = 1
        b[96] = 0x21; // sc[0]: scale 0 low = 1, scale 8 low = 2
        b[96 + 8] = 0x02; // sc[8]: scale 0 high = 2 -> 33-32 = 1; scale 8 high = 0 -> 2-32 = -30
        b[32] = 3; // qs[0] bits 0-1 = 3 (element 0)
        b[64] = 2; // qs[32] bits 0-1 = 2 (element 128)
        b[0] = 0x11; // hmask[0]: bit 0 (element 0) and bit 4 (element 128) set: no -4
        let y = run(dequant_q3_k, &b);
        assert_eq!(y[0], 3.0); // (1*1) * 3
        assert_eq!(y[1], -4.0); // (1*1) * (0 - 4)
        assert_eq!(y[128], -60.0); // (1*-30) * 2
        assert_eq!(y[16], 128.0); // scale 1 = 0-32: (1*-32) * (0 - 4)
    }

    #[test]
    fn iq4_xs_hand_block() {
        let mut b = vec![0u8; IQ4_XS_BYTES];
        b[0..2].copy_from_slice(&F16_HALF); // d = 0.5
        b[2..4].copy_from_slice(&0x0002u16.to_le_bytes()); // scales_h: ib0 high bits = 2
        b[4] = 0x1F; // scales_l[0]: ib0 low 15 -> ls 47 -> dl 0.5*15 = 7.5; ib1 low 1 -> dl 0.5*-31
        b[8] = 0xF0; // qs[0]: element 0 kv[0] = -127, element 16 kv[15] = 113
        b[8 + 16] = 0x08; // qs[16]: element 32 kv[8] = 1, element 48 kv[0] = -127
        let y = run(dequant_iq4_xs, &b);
        assert_eq!(y[0], -952.5); // 7.5 * -127
        assert_eq!(y[16], 847.5); // 7.5 * 113
        assert_eq!(y[1], -952.5); // qs[1] = 0 -> kv[0]
        assert_eq!(y[32], -15.5); // -15.5 * 1
        assert_eq!(y[48], 1968.5); // -15.5 * -127
        assert_eq!(y[64], 2032.0); // ib2: ls 0 -> 0.5*-32 = -16, * kv[0] = -127
    }
}

#[cfg(test)]
mod speed {
    use crate::util::thread_cpu_s;

    /// ns per value of dequantizing a reference task's rows (16 rows of 6144, in cache) of
    /// Q4_K, Q6_K and Q8_0 at every SIMD level the CPU has: `cargo test --release --lib
    /// dequant_task_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn dequant_task_speed() {
        use crate::quant::simd::{detected, with_cap, Level};
        use crate::quant::GgmlType as G;
        let n = 16 * 6144;
        let mut rng = crate::util::rng::SplitMix64::new(5);
        for (ty, bytes, per) in [(G::Q4_K, 144, 256), (G::Q6_K, 210, 256), (G::Q8_0, 34, 32)] {
            let mut src = vec![0u8; n / per * bytes];
            rng.fill(&mut src);
            for b in src.chunks_exact_mut(bytes) {
                let at = if ty == G::Q6_K { 208 } else { 0 };
                b[at..at + 2].copy_from_slice(&0x2c00u16.to_le_bytes());
                if ty != G::Q8_0 && ty != G::Q6_K {
                    b[2..4].copy_from_slice(&0x2c00u16.to_le_bytes());
                }
            }
            let mut y = vec![0f32; n];
            for l in [Level::Base, Level::Avx2, Level::Avx512] {
                if l > detected() {
                    continue;
                }
                let best = (0..9)
                    .map(|_| {
                        let c = thread_cpu_s();
                        for _ in 0..100 {
                            with_cap(l, || crate::quant::dequantize(ty, &src, &mut y)).unwrap();
                            std::hint::black_box(&mut y);
                        }
                        (thread_cpu_s() - c) * 1e9 / (100 * n) as f64
                    })
                    .fold(f64::INFINITY, f64::min);
                println!("{ty:?} {:6}: {best:.3} ns/value", l.name());
            }
        }
    }
}
