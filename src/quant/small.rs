//! Ternary and FP4 formats: TQ1_0, TQ2_0, MXFP4, NVFP4.
//! Formulas: ggml `src/ggml-quants.c`, `dequantize_row_tq1_0`, `dequantize_row_tq2_0`, `dequantize_row_mxfp4`, `dequantize_row_nvfp4`.

macro_rules! todo_fn { ($($n:ident),*) => { $(
    /// (to be written)
    pub fn $n(_src: &[u8], _dst: &mut [f32]) { unimplemented!(stringify!($n)) }
)* } }
todo_fn!(dequant_tq1_0, dequant_tq2_0, dequant_mxfp4, dequant_nvfp4);
