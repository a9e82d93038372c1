// i-quant, ternary and FP4 dequantizers: see dequant.cu for the conventions.
