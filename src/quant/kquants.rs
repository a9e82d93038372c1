//! 256-element super-block formats: Q2_K..Q6_K and IQ4_XS.
//! Formulas: ggml `src/ggml-quants.c`, `dequantize_row_q2_K` .. `dequantize_row_q6_K`, `dequantize_row_iq4_xs`.

macro_rules! todo_fn { ($($n:ident),*) => { $(
    /// (to be written)
    pub fn $n(_src: &[u8], _dst: &mut [f32]) { unimplemented!(stringify!($n)) }
)* } }
todo_fn!(dequant_q2_k, dequant_q3_k, dequant_q4_k, dequant_q5_k, dequant_q6_k, dequant_iq4_xs);
