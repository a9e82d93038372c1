//! Grid-based i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.
//! Formulas: ggml `src/ggml-quants.c`, `dequantize_row_iq2_xxs` and neighbours; grids in `grids.rs`.

macro_rules! todo_fn { ($($n:ident),*) => { $(
    /// (to be written)
    pub fn $n(_src: &[u8], _dst: &mut [f32]) { unimplemented!(stringify!($n)) }
)* } }
todo_fn!(dequant_iq2_xxs, dequant_iq2_xs, dequant_iq2_s, dequant_iq3_xxs, dequant_iq3_s, dequant_iq1_s, dequant_iq1_m);
