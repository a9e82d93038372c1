//! 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.
//! Formulas: ggml `src/ggml-quants.c`, `dequantize_row_q4_0` and neighbours.

use super::f16_le;

/// Q8_0: `y = d * qs[i]`; block = f16 d, i8 qs[32].
pub fn dequant_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = f16_le(&b[0..2]);
        for (yi, &q) in y.iter_mut().zip(&b[2..34]) {
            *yi = (q as i8) as f32 * d;
        }
    }
}

/// Q4_0 (to be written).
pub fn dequant_q4_0(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("Q4_0")
}
/// Q4_1 (to be written).
pub fn dequant_q4_1(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("Q4_1")
}
/// Q5_0 (to be written).
pub fn dequant_q5_0(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("Q5_0")
}
/// Q5_1 (to be written).
pub fn dequant_q5_1(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("Q5_1")
}
/// IQ4_NL (to be written).
pub fn dequant_iq4_nl(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("IQ4_NL")
}
