//! Benchmarks: measured rates with baselines taken in the same run. These functions compute
//! and return reports; printing is the caller's job.

pub mod dequant;
pub mod layer;
pub mod random_blocks;
