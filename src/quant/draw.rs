//! How random valid blocks of a type are drawn: plain data in the type table that the layers
//! above interpret (`synth` draws blocks with a chosen spread, `bench` blocks with sane scales),
//! so neither needs a `match` over the types.
//!
//! Field offsets follow the block structs of ggml `ggml/src/ggml-common.h`.

use super::float::EncodeFn;

/// The values one code of a block takes at scale 1, each equally likely.
#[derive(Clone, Copy, Debug)]
pub enum Codes {
    /// The integers `lo..=hi`.
    Ints(i32, i32),
    /// A table of levels (IQ4_NL's `kvalues_iq4nl`), one per code.
    Levels(&'static [i8]),
}

/// How `synth` draws blocks whose values have a chosen RMS. Sub-scale ranges are raw field
/// values: high enough that the codes use their full resolution, narrow enough that the RMS
/// stays close to its closed form.
#[derive(Clone, Copy, Debug)]
pub enum SynthDraw {
    /// A float type: each value encoded directly.
    Float(EncodeFn),
    /// An f16 `d` at byte 0 and random code bytes after it (Q4_0, Q5_0, IQ4_NL).
    Scale(Codes),
    /// An f16 `d` at byte 0 and i8 codes in `-lim..=lim` (Q8_0: ggml never writes -128).
    Int8 {
        /// Largest code magnitude.
        lim: i32,
    },
    /// An f16 `d` at byte 0, a minimum `m` at byte 2 centring codes `0..levels` (Q4_1, Q5_1).
    ScaleMin {
        /// Number of code values.
        levels: u32,
    },
    /// Q2_K: scale | min << 4 bytes, codes 0..=3, `d` and `dmin` at bytes 80 and 82.
    Q2K {
        /// Sub-scale range.
        sc: (u32, u32),
    },
    /// Q3_K: 6-bit scales stored as scale + 32 (`quantize_row_q3_K_ref` packing), `d` at 108.
    Q3K {
        /// Stored sub-scale range.
        sc: (u32, u32),
    },
    /// Q4_K / Q5_K: `d`, `dmin`, `get_scale_min_k4` scales and mins, codes `0..levels`.
    Q4K {
        /// Number of code values (16 or 32).
        levels: u32,
        /// Sub-scale range.
        sc: (u32, u32),
    },
    /// Q6_K: i8 scales at bytes 192..208, `d` at 208.
    Q6K {
        /// Sub-scale range.
        sc: (u32, u32),
    },
    /// IQ4_XS: `d`, 6-bit scales stored as scale + 32 split into high and low bits, level codes.
    Iq4Xs {
        /// Stored sub-scale range.
        sc: (u32, u32),
        /// The levels of one code.
        levels: &'static [i8],
    },
    /// A grid i-quant: any bytes are a valid block behind an f16 `d` at byte 0; the RMS at
    /// `d = 1` is measured through the dequantizer.
    Grid,
}

/// Where a block keeps its scales, for drawing random blocks with sane ones.
#[derive(Clone, Copy, Debug)]
pub struct ScaleFields {
    /// Byte offsets of f16 scales (`d`, `dmin`, `m`).
    pub f16: &'static [usize],
    /// Byte offsets of E8M0 exponents (MXFP4 `e`).
    pub e8m0: &'static [usize],
    /// Byte offsets of UE4M3 scales (NVFP4 `d[4]`).
    pub ue4m3: &'static [usize],
    /// `(byte, mask)`: bits cleared last (IQ1_M assembles its f16 scale from the top nibbles of
    /// four u16 sub-scales at bytes 48..56; clearing bit 6 of byte 55, the exponent's top bit,
    /// keeps `|d| < 2`).
    pub clear: &'static [(usize, u8)],
}

impl ScaleFields {
    /// No scale fields: every bit pattern is a valid block.
    pub const NONE: ScaleFields = ScaleFields {
        f16: &[],
        e8m0: &[],
        ue4m3: &[],
        clear: &[],
    };

    /// Only f16 scales, at these offsets.
    pub const fn f16(at: &'static [usize]) -> ScaleFields {
        ScaleFields {
            f16: at,
            ..ScaleFields::NONE
        }
    }
}

/// How `bench` draws random blocks whose values are finite and of moderate size.
#[derive(Clone, Copy, Debug)]
pub enum RandomDraw {
    /// Random bytes with the scale fields set to sane values.
    Scaled(ScaleFields),
    /// A 16-bit float per value: random sign, biased exponent in `exp.0..=exp.1`, mantissa.
    Float16 {
        /// Biased exponent range.
        exp: (u32, u32),
        /// Mantissa bits.
        mant_bits: u32,
    },
    /// An f32 uniform in [-1, 1) from 24 random bits.
    UniformF32,
    /// An f64 uniform in [-1, 1) from 53 random bits.
    UniformF64,
}
