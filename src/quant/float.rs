//! Scalar types: F32, F16, BF16, F64 and the integer types, converted to f32.
//! F64 and I64 round to nearest f32 (`as f32`), as numpy's `astype(float32)` does.

use super::simd::multiversion;

macro_rules! scalar {
    ($name:ident, $body:ident, $n:expr, $conv:expr) => {
        multiversion! {
            /// Converts little-endian scalars to f32.
            pub fn $name(src: &[u8], dst: &mut [f32]) = $body;
        }

        #[inline(always)]
        fn $body(src: &[u8], dst: &mut [f32]) {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact($n)) {
                let mut a = [0u8; $n];
                a.copy_from_slice(s);
                *d = $conv(a);
            }
        }
    };
}

scalar!(dequant_f32, f32_body, 4, f32::from_le_bytes);

/// F16 to f32 in runs of [`F16_RUN`] values through `half`'s slice conversion, which uses the
/// CPU's F16C instructions when present (detected once per run, not per element). f16 -> f32
/// is exact either way.
pub fn dequant_f16(src: &[u8], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [half::f16::ZERO; F16_RUN];
    for (d, s) in dst.chunks_mut(F16_RUN).zip(src.chunks(2 * F16_RUN)) {
        let b = &mut buf[..d.len()];
        for (h, c) in b.iter_mut().zip(s.chunks_exact(2)) {
            *h = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
        }
        b.convert_to_f32_slice(d);
    }
}

/// Values converted per call of the F16 slice conversion.
const F16_RUN: usize = 256;
scalar!(dequant_bf16, bf16_body, 2, |a| f32::from_bits(
    u32::from(u16::from_le_bytes(a)) << 16
));
scalar!(dequant_f64, f64_body, 8, |a| f64::from_le_bytes(a) as f32);
scalar!(dequant_i8, i8_body, 1, |a: [u8; 1]| a[0] as i8 as f32);
scalar!(dequant_i16, i16_body, 2, |a| i16::from_le_bytes(a) as f32);
scalar!(dequant_i32, i32_body, 4, |a| i32::from_le_bytes(a) as f32);
scalar!(dequant_i64, i64_body, 8, |a| i64::from_le_bytes(a) as f32);

/// Signature of a float encoder: `v` rounded to nearest into one little-endian value in `out`
/// (exactly the type's size).
pub type EncodeFn = fn(v: f32, out: &mut [u8]);

/// Writes `v` as a little-endian f32.
pub fn encode_f32(v: f32, out: &mut [u8]) {
    out.copy_from_slice(&v.to_le_bytes());
}

/// Writes `v` rounded to nearest even as a little-endian IEEE half.
pub fn encode_f16(v: f32, out: &mut [u8]) {
    out.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// Writes `v` rounded to nearest even as a little-endian bfloat16.
pub fn encode_bf16(v: f32, out: &mut [u8]) {
    out.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
}
