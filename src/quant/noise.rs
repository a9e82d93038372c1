//! The rounding error a GGML type is expected to add to a tensor, read from the tensor's own
//! blocks: what `weights-check` compares a GGUF tensor's measured error against.
//!
//! # Derivation
//! A quantizer that rounds each value to the nearest point of a grid leaves an error that lies in
//! the cell around the chosen point. With the original value spread evenly over that cell (true
//! when the cell is small against the spread of the weights), a cell `[-a, b]` around the point
//! gives `E[e^2] = (a^3 + b^3) / (3 (a + b))`, which for a uniform grid of step `D` (`a = b = D/2`)
//! is the familiar `D^2 / 12`. Every GGML block stores the scales that fix its grid, so the step
//! of every sub-block is known exactly, and the expected squared error of a tensor is the sum of
//! that per-element variance over its elements:
//!
//! | types | grid of one sub-block | per element |
//! |---|---|---|
//! | F32, F16, BF16 | the format's own spacing at the stored value (`ulp`) | `ulp^2 / 12` |
//! | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 | `d * q` (+ `m`) | `d^2 / 12` |
//! | Q2_K, Q3_K, Q4_K, Q5_K, Q6_K | `d * sc_j * q` (- `dmin * m_j`) per 16 or 32 | `(d sc_j)^2 / 12` |
//! | TQ1_0, TQ2_0 | `d * {-1, 0, 1}` | `d^2 / 12` |
//! | IQ4_NL, IQ4_XS, MXFP4, NVFP4 | a scale times 16 non-uniform levels | the cell of the stored level |
//! | IQ2_*, IQ3_*, IQ1_* | 8-value codebook entries on a lattice of step `D` per coordinate | `F * D^2 / 12` |
//!
//! `D` for the codebooks: IQ2 grid magnitudes are 8, 25, 43 (step 17 times the sub-block scale),
//! IQ3_XXS magnitudes 4, 12, .., 62 (step 8), IQ3_S 1, 3, .., 15 (step 2), IQ1 values -1, 0, 1 (step 1). A codebook holds only a
//! few of the lattice's points (IQ2_XXS: 256 of 3^8 magnitude patterns), so the nearest entry is
//! farther than the nearest lattice point: `F` (the `factor` of the type's [`NoiseModel`] in
//! [`crate::quant::TYPE_TABLE`]) is that excess, measured on llama.cpp's own quantizer (numbers
//! beside the table). The K-quants' scale search may clip a few
//! values beyond the last level and the importance matrix shifts error between columns: both
//! stay inside the measured range (K-quants 0.77..1.19 of the model).
//!
//! **One intermediate rounding.** `llama-quantize` usually requantizes the converter's BF16 (or
//! F16) output rather than the original checkpoint, so a GGUF tensor may carry one BF16 rounding
//! of the original on top of its own type's (it shows alone on tensors kept in F16/F32 because no
//! block type fits their width). [`bf16_intermediate_sq_error`] is that allowance: `ulp_bf16^2 /
//! 12` for every original value BF16 cannot hold exactly, so it is zero against a BF16 checkpoint.
//!
//! The model assumes the quantizer rounds to nearest against its grid, as every ggml quantizer
//! does (the importance-weighted ones trade error between columns, not in total by much).

use anyhow::{bail, Result};

use super::legacy::KVALUES_IQ4NL;
use super::small::{e8m0_to_f32_half, KVALUES_MXFP4, UE4M3_HALF};
use super::{f16_le, GgmlType};

/// Step of the IQ2 grids in grid units (magnitudes 8, 25, 43).
const IQ2_STEP: f64 = 17.0;
/// Step of the IQ3_XXS grid in grid units (magnitudes 4, 12, .., 62).
const IQ3XXS_STEP: f64 = 8.0;
/// Step of the IQ3_S grid in grid units (magnitudes 1, 3, .., 15).
const IQ3S_STEP: f64 = 2.0;

/// The rounding-error model of a type: which of the block layouts below it has, and its
/// parameters. Each type's row of [`crate::quant::TYPE_TABLE`] names its model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NoiseModel {
    /// A float format (`exp_bits` exponent, `mant_bits` mantissa bits, bias `2^(exp_bits-1) - 1`)
    /// of one little-endian value per block: `ulp^2 / 12` at the stored value.
    Float {
        /// Exponent bits.
        exp_bits: u32,
        /// Mantissa bits.
        mant_bits: u32,
    },
    /// One f16 scale `d` at byte `d_at` for the whole block (Q4_0..Q8_0, TQ1_0, TQ2_0):
    /// `block_size * d^2 / 12`.
    OneScale {
        /// Byte offset of `d`.
        d_at: usize,
    },
    /// Q2_K: `d` at 80, 4-bit scales in the low nibbles of bytes 0..16.
    Q2K,
    /// Q3_K: `d` at 108, 6-bit scales (stored + 32) packed in bytes 96..108.
    Q3K,
    /// Q4_K and Q5_K: `d` at 0, `get_scale_min_k4` scales in bytes 4..16.
    Q4K,
    /// Q6_K: `d` at 208, i8 scales in bytes 192..208.
    Q6K,
    /// IQ4_NL: `d` at 0, the cells of the 16 `kvalues_iq4nl` levels.
    Iq4Nl,
    /// IQ4_XS: `d` at 0, 6-bit sub-scales, the cells of the IQ4_NL levels.
    Iq4Xs,
    /// MXFP4: an E8M0 scale at 0, the cells of the E2M1 levels.
    Mxfp4,
    /// NVFP4: four UE4M3 scales at 0..4, the cells of the E2M1 levels.
    Nvfp4,
    /// IQ2_XXS: `d` at 0, 4-bit scales in the top of every second u32: `factor * D^2 / 12`.
    Iq2Xxs {
        /// Measured codebook excess `F`.
        factor: f64,
    },
    /// IQ2_XS / IQ2_S: `d` at 0, 4-bit scales in the 8 bytes at `scales_at`.
    Iq2Scales {
        /// Byte offset of the scales.
        scales_at: usize,
        /// Measured codebook excess `F`.
        factor: f64,
    },
    /// IQ3_XXS: `d` at 0, 4-bit scales in the top of the u32s at 66..98.
    Iq3Xxs {
        /// Measured codebook excess `F`.
        factor: f64,
    },
    /// IQ3_S: `d` at 0, 4-bit scales at 106..110.
    Iq3S {
        /// Measured codebook excess `F`.
        factor: f64,
    },
    /// IQ1_S: `d` at 0, 3-bit scales in the u16s at 34..50.
    Iq1S {
        /// Measured codebook excess `F`.
        factor: f64,
    },
    /// IQ1_M: `d` assembled from the u16 scales at 48..56, 3-bit sub-scales.
    Iq1M {
        /// Measured codebook excess `F`.
        factor: f64,
    },
}

/// Per-element variance of a uniform grid of step `d`.
#[inline(always)]
fn uniform(d: f64) -> f64 {
    d * d / 12.0
}

/// `E[e^2]` of a value spread evenly over the cell `[-a, b]` around its grid point.
fn cell(a: f64, b: f64) -> f64 {
    if a + b <= 0.0 {
        0.0
    } else {
        (a * a * a + b * b * b) / (3.0 * (a + b))
    }
}

/// Per-level cell variances of a sorted-or-not list of levels (unit scale): each level's cell
/// runs halfway to its neighbours; the outermost cells mirror their inner half.
fn level_variances<const N: usize>(levels: [f64; N]) -> [f64; N] {
    let mut sorted = levels.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.dedup();
    std::array::from_fn(|i| {
        let v = levels[i];
        let k = sorted.iter().position(|&x| x == v).unwrap_or(0);
        let below = (k > 0).then(|| (v - sorted[k - 1]) / 2.0);
        let above = (k + 1 < sorted.len()).then(|| (sorted[k + 1] - v) / 2.0);
        let (a, b) = match (below, above) {
            (Some(a), Some(b)) => (a, b),
            (Some(a), None) => (a, a),
            (None, Some(b)) => (b, b),
            (None, None) => (0.0, 0.0),
        };
        cell(a, b)
    })
}

/// Variance per IQ4_NL level index at unit scale.
fn iq4nl_vars() -> [f64; 16] {
    level_variances(KVALUES_IQ4NL.map(f64::from))
}

/// Variance per E2M1 (doubled, as ggml stores it) level index at unit scale.
fn e2m1_vars() -> [f64; 16] {
    level_variances(KVALUES_MXFP4.map(f64::from))
}

/// Spacing of a float format at a stored value whose biased exponent field is `e`:
/// `2^(e - bias - mant)`, or the subnormal spacing `2^(1 - bias - mant)` for `e = 0`.
fn ulp(e: i32, bias: i32, mant: i32) -> f64 {
    2f64.powi(e.max(1) - bias - mant)
}

/// Sum over `original` of the squared error one rounding to BF16 is expected to add: `ulp^2 / 12`
/// for each value BF16 cannot hold exactly, 0 for the others (see the module documentation).
pub fn bf16_intermediate_sq_error(original: &[f32]) -> f64 {
    original
        .iter()
        .filter(|v| v.to_bits() & 0xFFFF != 0 && v.is_finite())
        .map(|v| uniform(ulp(((v.to_bits() >> 23) & 0xFF) as i32, 127, 7)))
        .sum()
}

/// Sum over the elements of `src` (whole blocks of `ty`) of the expected squared rounding error
/// of storing the original values in `ty` (see the module documentation).
pub fn expected_sq_error(ty: GgmlType, src: &[u8]) -> Result<f64> {
    let f = block_fn(ty)?;
    Ok(blocks_of(ty, src)?.map(f).sum())
}

/// The same per block: one value per block of `src`, the block's summed expected squared error.
pub fn block_sq_errors(ty: GgmlType, src: &[u8]) -> Result<Vec<f64>> {
    let f = block_fn(ty)?;
    Ok(blocks_of(ty, src)?.map(f).collect())
}

/// Whether [`expected_sq_error`] has a model for `ty`.
pub fn has_model(ty: GgmlType) -> bool {
    block_fn(ty).is_ok()
}

/// The blocks of `src`, checked to be whole.
fn blocks_of(ty: GgmlType, src: &[u8]) -> Result<std::slice::ChunksExact<'_, u8>> {
    let ts = ty.type_size();
    if ts == 0 || src.len() % ts != 0 {
        bail!(
            "quant: {ty}: {} bytes are not whole blocks of {ts}",
            src.len()
        );
    }
    Ok(src.chunks_exact(ts))
}

/// A block's f16 at byte `o`, as f64.
fn b16(b: &[u8], o: usize) -> f64 {
    f64::from(f16_le(&b[o..o + 2]))
}

/// Expected squared error of one block of `ty`.
type BlockFn = Box<dyn Fn(&[u8]) -> f64 + Send + Sync>;

/// The per-block model of `ty`, built from its row's [`NoiseModel`].
fn block_fn(ty: GgmlType) -> Result<BlockFn> {
    use NoiseModel as M;
    let Some(model) = ty.info().noise else {
        bail!("quant: no rounding-error model for type {ty}");
    };
    Ok(match model {
        M::Float {
            exp_bits,
            mant_bits,
        } => {
            let bias = (1i32 << (exp_bits - 1)) - 1;
            let mask = (1u64 << exp_bits) - 1;
            Box::new(move |b| {
                let mut a = [0u8; 8];
                a[..b.len()].copy_from_slice(b);
                let e = ((u64::from_le_bytes(a) >> mant_bits) & mask) as i32;
                uniform(ulp(e, bias, mant_bits as i32))
            })
        }
        M::OneScale { d_at } => {
            let n = ty.block_size() as f64;
            Box::new(move |b| n * uniform(b16(b, d_at)))
        }
        M::Q2K => Box::new(|b| {
            let d = b16(b, 80);
            (0..16)
                .map(|j| 16.0 * uniform(d * f64::from(b[j] & 0xF)))
                .sum::<f64>()
        }),
        M::Q3K => Box::new(|b| {
            let d = b16(b, 108);
            let s = &b[96..108];
            (0..16)
                .map(|j| {
                    let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
                    let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
                    let sc = f64::from((lo | (hi << 4)) as i8 - 32);
                    16.0 * uniform(d * sc)
                })
                .sum::<f64>()
        }),
        M::Q4K => Box::new(|b| {
            let d = b16(b, 0);
            let s = &b[4..16];
            (0..8)
                .map(|j| {
                    let sc = if j < 4 {
                        s[j] & 63
                    } else {
                        (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
                    };
                    32.0 * uniform(d * f64::from(sc))
                })
                .sum::<f64>()
        }),
        M::Q6K => Box::new(|b| {
            let d = b16(b, 208);
            (0..16)
                .map(|j| 16.0 * uniform(d * f64::from(b[192 + j] as i8)))
                .sum::<f64>()
        }),
        M::Iq4Nl => {
            let v = iq4nl_vars();
            Box::new(move |b| {
                let d = b16(b, 0);
                d * d * nibble_sum(&b[2..18], &v)
            })
        }
        M::Iq4Xs => {
            let v = iq4nl_vars();
            Box::new(move |b| {
                let d = b16(b, 0);
                let sh = u16::from_le_bytes([b[2], b[3]]);
                (0..8)
                    .map(|ib| {
                        let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
                        let hi = ((sh >> (2 * ib)) & 3) as u8;
                        let dl = d * f64::from((lo | (hi << 4)) as i8 - 32);
                        dl * dl * nibble_sum(&b[8 + 16 * ib..24 + 16 * ib], &v)
                    })
                    .sum::<f64>()
            })
        }
        M::Mxfp4 => {
            let v = e2m1_vars();
            Box::new(move |b| {
                let d = f64::from(e8m0_to_f32_half(b[0]));
                d * d * nibble_sum(&b[1..17], &v)
            })
        }
        M::Nvfp4 => {
            let v = e2m1_vars();
            Box::new(move |b| {
                (0..4)
                    .map(|s| {
                        let d = f64::from(UE4M3_HALF[usize::from(b[s])]);
                        d * d * nibble_sum(&b[4 + 8 * s..12 + 8 * s], &v)
                    })
                    .sum::<f64>()
            })
        }
        M::Iq2Xxs { factor: cb } => Box::new(move |b| {
            let d = b16(b, 0);
            cb * (0..8)
                .map(|ib| {
                    let w = &b[2 + 8 * ib + 4..2 + 8 * ib + 8];
                    let aux = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    let db = d * (0.5 + f64::from(aux >> 28)) * 0.25;
                    32.0 * uniform(IQ2_STEP * db)
                })
                .sum::<f64>()
        }),
        M::Iq2Scales {
            scales_at: off,
            factor: cb,
        } => Box::new(move |b| {
            let d = b16(b, 0);
            cb * b[off..off + 8]
                .iter()
                .flat_map(|&sc| [sc & 0xF, sc >> 4])
                .map(|s| {
                    let db = d * (0.5 + f64::from(s)) * 0.25;
                    16.0 * uniform(IQ2_STEP * db)
                })
                .sum::<f64>()
        }),
        M::Iq3Xxs { factor: cb } => Box::new(move |b| {
            let d = b16(b, 0);
            cb * b[66..98]
                .chunks_exact(4)
                .map(|w| {
                    let aux = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    let db = d * (0.5 + f64::from(aux >> 28)) * 0.5;
                    32.0 * uniform(IQ3XXS_STEP * db)
                })
                .sum::<f64>()
        }),
        M::Iq3S { factor: cb } => Box::new(move |b| {
            let d = b16(b, 0);
            cb * (0..8)
                .map(|ib| {
                    let sc = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF;
                    let db = d * f64::from(1 + 2 * u32::from(sc));
                    32.0 * uniform(IQ3S_STEP * db)
                })
                .sum::<f64>()
        }),
        M::Iq1S { factor: cb } => Box::new(move |b| {
            let d = b16(b, 0);
            cb * b[34..50]
                .chunks_exact(2)
                .map(|h| {
                    let h = u16::from_le_bytes([h[0], h[1]]);
                    let dl = d * f64::from(2 * ((h >> 12) & 7) + 1);
                    32.0 * uniform(dl)
                })
                .sum::<f64>()
        }),
        M::Iq1M { factor: cb } => Box::new(move |b| {
            let sc: [u16; 4] =
                std::array::from_fn(|i| u16::from_le_bytes([b[48 + 2 * i], b[49 + 2 * i]]));
            let d_bits = (sc[0] >> 12)
                | ((sc[1] >> 8) & 0x00f0)
                | ((sc[2] >> 4) & 0x0f00)
                | (sc[3] & 0xf000);
            let d = f64::from(half::f16::from_bits(d_bits).to_f32());
            cb * (0..8)
                .map(|ib| {
                    let s = sc[ib / 2] >> (6 * (ib % 2));
                    [s & 7, (s >> 3) & 7]
                        .iter()
                        .map(|&k| 16.0 * uniform(d * f64::from(2 * k + 1)))
                        .sum::<f64>()
                })
                .sum::<f64>()
        }),
    })
}

/// Sum of `vars[nibble]` over both nibbles of every byte.
fn nibble_sum(q: &[u8], vars: &[f64; 16]) -> f64 {
    q.iter()
        .map(|&x| vars[usize::from(x & 0xF)] + vars[usize::from(x >> 4)])
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand values: a Q8_0 block with d = 0.5 expects 32 * 0.25 / 12; an F16 1.0 has ulp 2^-10.
    #[test]
    fn uniform_types_by_hand() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        let e = expected_sq_error(GgmlType::Q8_0, &b).unwrap();
        assert!((e - 32.0 * 0.25 / 12.0).abs() < 1e-12);
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        let e = expected_sq_error(GgmlType::F16, &one).unwrap();
        assert_eq!(e, 2f64.powi(-20) / 12.0);
        let e = expected_sq_error(GgmlType::BF16, &[0x80, 0x3F]).unwrap();
        assert_eq!(e, 2f64.powi(-14) / 12.0);
        assert!(expected_sq_error(GgmlType::Q8_0, &b[..33]).is_err());
        // 1.0 and -2.0 are BF16 values: no allowance; 1 + 2^-10 is not: ulp 2^-7 at 1.
        assert_eq!(bf16_intermediate_sq_error(&[1.0, -2.0]), 0.0);
        let e = bf16_intermediate_sq_error(&[1.0 + 2f32.powi(-10)]);
        assert_eq!(e, 2f64.powi(-14) / 12.0);
    }

    /// The cell formula: a uniform grid gives D^2/12; IQ4_NL's innermost levels 1 and -10 have
    /// neighbours at -10/13 and -22/1: half-gaps (5.5, 6) and (6, 5.5).
    #[test]
    fn level_cells_by_hand() {
        assert!((cell(0.5, 0.5) - 1.0 / 12.0).abs() < 1e-15);
        let v = iq4nl_vars();
        let want = (5.5f64.powi(3) + 6f64.powi(3)) / (3.0 * 11.5);
        assert!((v[8] - want).abs() < 1e-12 && (v[7] - want).abs() < 1e-12);
        // the outer level -127 mirrors its inner half-gap (127-104)/2
        assert!((v[0] - 11.5f64.powi(2) / 3.0).abs() < 1e-12);
    }
}
