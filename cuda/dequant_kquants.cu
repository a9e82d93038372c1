// K-quant dequantizers (Q2_K..Q6_K, IQ4_XS): see dequant.cu for the conventions.
