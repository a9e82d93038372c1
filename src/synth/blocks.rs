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
use half::{bf16, f16};

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

/// IQ4_NL / IQ4_XS code values (ggml `kvalues_iq4nl`).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

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

// Sub-scale ranges (raw field values) for each type: high enough that the codes use their
// full resolution, narrow enough that the RMS stays close to the closed form.
const Q2K_SC: (u32, u32) = (8, 15);
const Q3K_SC: (u32, u32) = (48, 63); // stored as scale + 32, so scales 16..31
const Q4K_SC: (u32, u32) = (32, 63);
const Q6K_SC: (u32, u32) = (16, 63);
const IQ4XS_SC: (u32, u32) = (48, 63); // stored as scale + 32

/// Generates blocks of one type with one [`Init`].
#[derive(Clone, Debug)]
pub struct BlockGen {
    ty: GgmlType,
    init: Init,
    /// Dequantized RMS of a block with `d = 1` (quantized types).
    unit_rms: f64,
}

/// The types [`BlockGen`] can produce.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
];

/// Whether the type is an i-quant generated as random bytes behind an f16 `d` at offset 0.
fn is_grid_iquant(ty: GgmlType) -> bool {
    use GgmlType as T;
    matches!(
        ty,
        T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S | T::IQ1_S
    )
}

/// Blocks measured to calibrate a grid i-quant.
const CALIBRATION_BLOCKS: usize = 256;
/// Seed of the calibration blocks (fixed: the calibration is part of the type, not the file).
const CALIBRATION_SEED: u64 = 0x5EED_CA11_B8A7_E000;

impl BlockGen {
    /// A generator for `ty`; fails for types it cannot produce.
    pub fn new(ty: GgmlType, init: Init) -> Result<BlockGen> {
        use GgmlType as T;
        if !SUPPORTED.contains(&ty) {
            let names: Vec<&str> = SUPPORTED.iter().map(|t| t.name()).collect();
            bail!(
                "synth: cannot generate {ty} blocks (supported: {})",
                names.join(", ")
            );
        }
        let kv2 = KVALUES_IQ4NL
            .iter()
            .map(|&k| f64::from(k) * f64::from(k))
            .sum::<f64>()
            / 16.0;
        let unit_ms = match ty {
            T::F32 | T::F16 | T::BF16 => 1.0,
            T::Q4_0 => mean_sq(-8, 7),
            T::Q4_1 => centred_var(16),
            T::Q5_0 => mean_sq(-16, 15),
            T::Q5_1 => centred_var(32),
            T::Q8_0 => mean_sq(-127, 127),
            T::IQ4_NL => kv2,
            T::Q2_K => mean_sq(Q2K_SC.0 as i32, Q2K_SC.1 as i32) * centred_var(4),
            T::Q3_K => mean_sq(Q3K_SC.0 as i32 - 32, Q3K_SC.1 as i32 - 32) * mean_sq(-4, 3),
            T::Q4_K => mean_sq(Q4K_SC.0 as i32, Q4K_SC.1 as i32) * centred_var(16),
            T::Q5_K => mean_sq(Q4K_SC.0 as i32, Q4K_SC.1 as i32) * centred_var(32),
            T::Q6_K => mean_sq(Q6K_SC.0 as i32, Q6K_SC.1 as i32) * mean_sq(-32, 31),
            T::IQ4_XS => mean_sq(IQ4XS_SC.0 as i32 - 32, IQ4XS_SC.1 as i32 - 32) * kv2,
            _ => measure_unit_ms(ty)?,
        };
        Ok(BlockGen {
            ty,
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
        use GgmlType as T;
        let ts = self.ty.type_size();
        let target = match self.init {
            Init::Weight(s) => s,
            Init::Norm => NORM_NOISE,
            Init::Bias => BIAS_STD,
        };
        let offset = if self.init == Init::Norm { 1.0 } else { 0.0 };
        match self.ty {
            T::F32 => {
                for b in out.chunks_exact_mut(4) {
                    b.copy_from_slice(&(offset + target * rng.normal()).to_le_bytes());
                }
            }
            T::F16 => {
                for b in out.chunks_exact_mut(2) {
                    let v = f16::from_f32(offset + target * rng.normal());
                    b.copy_from_slice(&v.to_le_bytes());
                }
            }
            T::BF16 => {
                for b in out.chunks_exact_mut(2) {
                    let v = bf16::from_f32(offset + target * rng.normal());
                    b.copy_from_slice(&v.to_le_bytes());
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
        use GgmlType as T;
        let mut d16 = f16::from_f32(d);
        // Types without a minimum whose codes are not symmetric about 0 get a random sign on
        // `d` (ggml's own quantizers write negative `d` too), so their mean is ~0. Types with
        // a minimum are centred by it and keep `d > 0` as ggml writes them; Q8_0 is symmetric.
        let positive_d = matches!(
            self.ty,
            T::Q8_0 | T::Q4_1 | T::Q5_1 | T::Q2_K | T::Q4_K | T::Q5_K
        );
        if !positive_d && rng.next_u64() & 1 == 1 {
            d16 = -d16;
        }
        let put = |b: &mut [u8], at: usize, v: f16| b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        match self.ty {
            T::Q8_0 => {
                // i8 codes in -127..=127 (ggml's quantizer never writes -128).
                for q in &mut b[2..] {
                    *q = (rng.range(0, 254) as i32 - 127) as i8 as u8;
                }
                put(b, 0, d16);
            }
            T::Q4_0 | T::IQ4_NL | T::Q5_0 => {
                rng.fill(&mut b[2..]);
                put(b, 0, d16);
            }
            T::Q4_1 | T::Q5_1 => {
                rng.fill(&mut b[4..]);
                let half_range = if self.ty == T::Q4_1 { 7.5 } else { 15.5 };
                put(b, 0, d16);
                put(b, 2, f16::from_f32(-half_range * d16.to_f32()));
            }
            T::Q2_K => {
                // scales[16] (scale | min << 4), qs[64], d, dmin = 2 d: min = 0.75 scale
                // centres q in 0..=3 (mean 1.5).
                for s in &mut b[..16] {
                    let sc = rng.range(Q2K_SC.0, Q2K_SC.1);
                    let m = (sc as f32 * 0.75).round() as u32;
                    *s = (sc | m << 4) as u8;
                }
                rng.fill(&mut b[16..80]);
                put(b, 80, d16);
                put(b, 82, f16::from_f32(2.0 * d16.to_f32()));
            }
            T::Q3_K => {
                // hmask[32], qs[64], scales[12], d.
                rng.fill(&mut b[..96]);
                let mut raw = [0u8; 16];
                for r in &mut raw {
                    *r = rng.range(Q3K_SC.0, Q3K_SC.1) as u8;
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
            T::Q4_K | T::Q5_K => {
                // d, dmin, scales[12], (qh[32],) qs[128]; dmin = levels/2 d so that
                // min = round(scale * (levels - 1) / levels) centres the codes.
                let levels: f32 = if self.ty == T::Q4_K { 16.0 } else { 32.0 };
                let mut sc = [0u8; 8];
                let mut m = [0u8; 8];
                for j in 0..8 {
                    sc[j] = rng.range(Q4K_SC.0, Q4K_SC.1) as u8;
                    m[j] = (f32::from(sc[j]) * (levels - 1.0) / levels).round() as u8;
                }
                put(b, 0, d16);
                put(b, 2, f16::from_f32(levels / 2.0 * d16.to_f32()));
                b[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &m));
                rng.fill(&mut b[16..]);
            }
            T::Q6_K => {
                // ql[128], qh[64], i8 scales[16], d.
                rng.fill(&mut b[..192]);
                for s in &mut b[192..208] {
                    *s = rng.range(Q6K_SC.0, Q6K_SC.1) as u8;
                }
                put(b, 208, d16);
            }
            T::IQ4_XS => {
                // d, u16 scales_h, scales_l[4], qs[128].
                let mut h = 0u16;
                let mut l = [0u8; 4];
                for ib in 0..8 {
                    let ls = rng.range(IQ4XS_SC.0, IQ4XS_SC.1) as u16;
                    l[ib / 2] |= ((ls & 0xF) as u8) << (4 * (ib % 2));
                    h |= (ls >> 4) << (2 * ib);
                }
                put(b, 0, d16);
                b[2..4].copy_from_slice(&h.to_le_bytes());
                b[4..8].copy_from_slice(&l);
                rng.fill(&mut b[8..]);
            }
            _ => {
                // Grid i-quants: any bytes are a valid block; d (f16 at offset 0) sets the size.
                rng.fill(b);
                put(b, 0, d16);
            }
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
    debug_assert!(is_grid_iquant(ty));
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
}
