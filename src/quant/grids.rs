//! Lookup grids of the i-quants (ggml `src/ggml-common.h`).
