//! Benchmarks: measured rates with baselines taken in the same run. These functions measure
//! and return report structs; [`crate::report::bench`] renders them and the caller prints.

#[cfg(feature = "cuda")]
pub mod copy;
pub mod dequant;
#[cfg(feature = "cuda")]
pub mod gpu_dequant;
pub mod layer;
pub mod libggml;
pub mod random_blocks;
pub mod run;
mod scratch;

/// The CPU model name from /proc/cpuinfo, or "unknown".
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}
