//! Random valid blocks of every supported GGML type, with a chosen standard deviation.
//!
//! Quant codes are uniform random bytes (every bit pattern of a code field is valid); the
//! scales are chosen so that the dequantized values have the requested RMS: each type's
//! sub-scales are drawn from a fixed integer range, and the f16 super-scale `d` is
//! `target / (rms of sub-scale x code)`, computed in closed form from those ranges. Types with
//! a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) get the minimum that centres each sub-block, so the
//! values have mean ~0 like trained weights. The i-quants with grids (IQ2_*, IQ3_*, IQ1_S) are
//! random bytes whose RMS at `d = 1` is measured once through [`crate::quant::dequantize`].
//!
//! Block layouts and scale packings follow ggml `src/ggml-common.h` and the encoders in
//! `src/ggml-quants.c` (`quantize_row_q3_K_ref` for the Q3_K scales, `quantize_row_q4_K_ref`
//! for the Q4_K/Q5_K `get_scale_min_k4` packing); see also shared spec `quant-formats.md`.

use anyhow::{bail, Result};
use half::f16;

use crate::quant::draw::{Codes, SynthDraw};
use crate::quant::{self, GgmlType};
use crate::util::rng::SplitMix64;

/// What a tensor's values look like.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Zero-mean weights with this standard deviation (`1/sqrt(fan_in)` for matrices).
    Weight(f32),
    /// RMSNorm / LayerNorm scales: 1 plus small noise.
    Norm,
    /// Small biases around 0.
    Bias,
}

/// Standard deviation of the noise on norm scales.
const NORM_NOISE: f32 = 0.05;
/// Standard deviation of biases.
const BIAS_STD: f32 = 0.02;

/// Mean of x^2 for x uniform over the integers `lo..=hi`.
fn mean_sq(lo: i32, hi: i32) -> f64 {
    let n = f64::from(hi - lo + 1);
    (lo..=hi).map(|x| f64::from(x) * f64::from(x)).sum::<f64>() / n
}

/// Variance of a code uniform over `0..levels` (the minimum removes the mean).
fn centred_var(levels: u32) -> f64 {
    let n = f64::from(levels);
    (n * n - 1.0) / 12.0
}

use SynthDraw as D;

/// Generates blocks of one type with one [`Init`].
#[derive(Clone, Debug)]
pub struct BlockGen {
    ty: GgmlType,
    /// How `ty`'s blocks are drawn (its row of the type table).
    draw: SynthDraw,
    init: Init,
    /// Dequantized RMS of a block with `d = 1` (quantized types).
    unit_rms: f64,
}

/// The types [`BlockGen`] can produce (those whose row of the type table has a
/// [`SynthDraw`]), in id order.
pub fn supported() -> impl Iterator<Item = GgmlType> {
    quant::TYPE_TABLE
        .iter()
        .filter(|r| r.synth.is_some())
        .map(|r| r.ty)
}

/// Whether [`BlockGen`] can produce `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    ty.info().synth.is_some()
}

/// Mean of x^2 over the values of one code.
fn codes_ms(codes: Codes) -> f64 {
    match codes {
        Codes::Ints(lo, hi) => mean_sq(lo, hi),
        Codes::Levels(k) => levels_ms(k),
    }
}

/// Mean of x^2 over a table of levels.
fn levels_ms(levels: &[i8]) -> f64 {
    levels
        .iter()
        .map(|&k| f64::from(k) * f64::from(k))
        .sum::<f64>()
        / levels.len() as f64
}

/// Mean of x^2 for x uniform over the integers `sc.0 + shift..=sc.1 + shift`.
fn sc_ms(sc: (u32, u32), shift: i32) -> f64 {
    mean_sq(sc.0 as i32 + shift, sc.1 as i32 + shift)
}

/// Blocks measured to calibrate a grid i-quant.
const CALIBRATION_BLOCKS: usize = 256;
/// Seed of the calibration blocks (fixed: the calibration is part of the type, not the file).
const CALIBRATION_SEED: u64 = 0x5EED_CA11_B8A7_E000;

impl BlockGen {
    /// A generator for `ty`; fails for types it cannot produce.
    pub fn new(ty: GgmlType, init: Init) -> Result<BlockGen> {
        let Some(draw) = ty.info().synth else {
            let names: Vec<&str> = supported().map(|t| t.name()).collect();
            bail!(
                "synth: cannot generate {ty} blocks (supported: {})",
                names.join(", ")
            );
        };
        let unit_ms = match draw {
            D::Float(_) => 1.0,
            D::Scale(codes) => codes_ms(codes),
            D::Int8 { lim } => mean_sq(-lim, lim),
            D::ScaleMin { levels } => centred_var(levels),
            D::Q2K { sc } => sc_ms(sc, 0) * centred_var(4),
            D::Q3K { sc } => sc_ms(sc, -32) * mean_sq(-4, 3),
            D::Q4K { levels, sc } => sc_ms(sc, 0) * centred_var(levels),
            D::Q6K { sc } => sc_ms(sc, 0) * mean_sq(-32, 31),
            D::Iq4Xs { sc, levels } => sc_ms(sc, -32) * levels_ms(levels),
            D::Grid => measure_unit_ms(ty)?,
        };
        Ok(BlockGen {
            ty,
            draw,
            init,
            unit_rms: unit_ms.sqrt(),
        })
    }

    /// The type generated.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Fills `out` (a whole number of blocks) with random blocks.
    pub fn fill(&self, out: &mut [u8], rng: &mut SplitMix64) {
        let ts = self.ty.type_size();
        let target = match self.init {
            Init::Weight(s) => s,
            Init::Norm => NORM_NOISE,
            Init::Bias => BIAS_STD,
        };
        let offset = if self.init == Init::Norm { 1.0 } else { 0.0 };
        match self.draw {
            D::Float(encode) => {
                for b in out.chunks_exact_mut(ts) {
                    encode(offset + target * rng.normal(), b);
                }
            }
            _ => {
                // Quantized 1-D parameters are not produced (norms stay F32); a quantized
                // tensor with Norm init would still get the right spread around 0.
                let d = (f64::from(target) / self.unit_rms) as f32;
                for b in out.chunks_exact_mut(ts) {
                    self.quant_block(b, d, rng);
                }
            }
        }
    }

    fn quant_block(&self, b: &mut [u8], d: f32, rng: &mut SplitMix64) {
        let mut d16 = f16::from_f32(d);
        // Types without a minimum whose codes are not symmetric about 0 get a random sign on
        // `d` (ggml's own quantizers write negative `d` too), so their mean is ~0. Types with
        // a minimum are centred by it and keep `d > 0` as ggml writes them; Q8_0 is symmetric.
        let positive_d = matches!(
            self.draw,
            D::Int8 { .. } | D::ScaleMin { .. } | D::Q2K { .. } | D::Q4K { .. }
        );
        if !positive_d && rng.next_u64() & 1 == 1 {
            d16 = -d16;
        }
        let put = |b: &mut [u8], at: usize, v: f16| b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        match self.draw {
            D::Int8 { lim } => {
                // i8 codes in -lim..=lim (ggml's quantizer never writes -128).
                for q in &mut b[2..] {
                    *q = (rng.range(0, 2 * lim as u32) as i32 - lim) as i8 as u8;
                }
                put(b, 0, d16);
            }
            D::Scale(_) => {
                rng.fill(&mut b[2..]);
                put(b, 0, d16);
            }
            D::ScaleMin { levels } => {
                rng.fill(&mut b[4..]);
                let half_range = (levels as f32 - 1.0) / 2.0;
                put(b, 0, d16);
                put(b, 2, f16::from_f32(-half_range * d16.to_f32()));
            }
            D::Q2K { sc: range } => {
                // scales[16] (scale | min << 4), qs[64], d, dmin = 2 d: min = 0.75 scale
                // centres q in 0..=3 (mean 1.5).
                for s in &mut b[..16] {
                    let sc = rng.range(range.0, range.1);
                    let m = (sc as f32 * 0.75).round() as u32;
                    *s = (sc | m << 4) as u8;
                }
                rng.fill(&mut b[16..80]);
                put(b, 80, d16);
                put(b, 82, f16::from_f32(2.0 * d16.to_f32()));
            }
            D::Q3K { sc: range } => {
                // hmask[32], qs[64], scales[12], d.
                rng.fill(&mut b[..96]);
                let mut raw = [0u8; 16];
                for r in &mut raw {
                    *r = rng.range(range.0, range.1) as u8;
                }
                let sc = &mut b[96..108];
                sc.fill(0);
                for (j, &l) in raw.iter().enumerate() {
                    if j < 8 {
                        sc[j] = l & 0xF;
                    } else {
                        sc[j - 8] |= (l & 0xF) << 4;
                    }
                    sc[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
                }
                put(b, 108, d16);
            }
            D::Q4K { levels, sc: range } => {
                // d, dmin, scales[12], (qh[32],) qs[128]; dmin = levels/2 d so that
                // min = round(scale * (levels - 1) / levels) centres the codes.
                let levels = levels as f32;
                let mut sc = [0u8; 8];
                let mut m = [0u8; 8];
                for j in 0..8 {
                    sc[j] = rng.range(range.0, range.1) as u8;
                    m[j] = (f32::from(sc[j]) * (levels - 1.0) / levels).round() as u8;
                }
                put(b, 0, d16);
                put(b, 2, f16::from_f32(levels / 2.0 * d16.to_f32()));
                b[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &m));
                rng.fill(&mut b[16..]);
            }
            D::Q6K { sc: range } => {
                // ql[128], qh[64], i8 scales[16], d.
                rng.fill(&mut b[..192]);
                for s in &mut b[192..208] {
                    *s = rng.range(range.0, range.1) as u8;
                }
                put(b, 208, d16);
            }
            D::Iq4Xs { sc: range, .. } => {
                // d, u16 scales_h, scales_l[4], qs[128].
                let mut h = 0u16;
                let mut l = [0u8; 4];
                for ib in 0..8 {
                    let ls = rng.range(range.0, range.1) as u16;
                    l[ib / 2] |= ((ls & 0xF) as u8) << (4 * (ib % 2));
                    h |= (ls >> 4) << (2 * ib);
                }
                put(b, 0, d16);
                b[2..4].copy_from_slice(&h.to_le_bytes());
                b[4..8].copy_from_slice(&l);
                rng.fill(&mut b[8..]);
            }
            D::Grid => {
                // Grid i-quants: any bytes are a valid block; d (f16 at offset 0) sets the size.
                rng.fill(b);
                put(b, 0, d16);
            }
            // Float types are written by `fill` and never reach here.
            D::Float(_) => {}
        }
    }
}

/// Packs eight 6-bit scales and mins the way `get_scale_min_k4` unpacks them (ggml
/// `quantize_row_q4_K_ref`).
fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

/// Mean square of random blocks of a grid i-quant with `d = 1`, through the dequantizer.
fn measure_unit_ms(ty: GgmlType) -> Result<f64> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut bytes = vec![0u8; CALIBRATION_BLOCKS * ts];
    let mut rng = SplitMix64::new(CALIBRATION_SEED);
    for b in bytes.chunks_exact_mut(ts) {
        rng.fill(b);
        b[..2].copy_from_slice(&f16::ONE.to_le_bytes());
    }
    let mut vals = vec![0f32; CALIBRATION_BLOCKS * bs];
    quant::dequantize(ty, &bytes, &mut vals)?;
    let ms = vals
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        / vals.len() as f64;
    if !(ms.is_finite() && ms > 0.0) {
        bail!("synth: calibration of {ty} blocks gave mean square {ms}");
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips_through_get_scale_min_k4() {
        // The unpacking formula from the spec (ggml `get_scale_min_k4`), written out here.
        let unpack = |j: usize, s: &[u8; 12]| -> (u8, u8) {
            if j < 4 {
                (s[j] & 63, s[j + 4] & 63)
            } else {
                (
                    (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                    (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                )
            }
        };
        let sc = [63, 0, 17, 42, 33, 63, 1, 50];
        let m = [5, 63, 0, 31, 62, 2, 47, 63];
        let p = pack_scale_min_k4(&sc, &m);
        for j in 0..8 {
            assert_eq!(unpack(j, &p), (sc[j], m[j]), "j = {j}");
        }
    }

    /// Every type the table gives a synth draw makes blocks that dequantize to the requested
    /// RMS (within 15%: the closed forms and the calibration are exact only on average).
    #[test]
    fn every_supported_type_hits_the_requested_rms() {
        let target = 0.02f64;
        for ty in supported() {
            let g = BlockGen::new(ty, Init::Weight(target as f32)).unwrap();
            let n = 256 * 64;
            let mut bytes = vec![0u8; n / ty.block_size() * ty.type_size()];
            g.fill(&mut bytes, &mut SplitMix64::new(3));
            let mut y = vec![0f32; n];
            quant::dequantize(ty, &bytes, &mut y).unwrap();
            let rms = (y.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64).sqrt();
            assert!((rms / target - 1.0).abs() < 0.15, "{ty}: rms {rms}");
        }
        assert!(BlockGen::new(GgmlType::Q8_1, Init::Bias).is_err());
    }
}
