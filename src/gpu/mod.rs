//! The GPU: devices, NVRTC-compiled kernel modules and the kernels glmdiff launches.
//!
//! CUDA is opened at run time (cudarc's `dynamic-loading`): the same binary builds and runs on
//! machines without CUDA, and a GPU command there fails with a clear error (no driver, no
//! NVRTC, no device) instead of a panic. Kernel sources live in `cuda/*.cu`, are embedded in the
//! binary, and are compiled at first use by NVRTC to a CUBIN for the device's own compute
//! capability with fixed options ([`CompileOptions`]) that every report prints; compiled
//! modules are cached per device and on disk (keyed by source, options, NVRTC version).
//!
//! [`nvrtc`] compiles, [`tables`] writes the CPU's lookup tables as CUDA source, [`dequant`]
//! launches the dequant kernels and the on-device comparison, [`upload`] puts file ranges on a
//! device from a thread of its own (pinned staging, a copy stream) behind the compute,
//! [`reference`] makes the CPU reference's products and attention there, [`parcels`] is the
//! pinned memory its small products' values travel through, [`resident`] offers the CUDA
//! candidate's weight bytes on a device to those products (proven to be the file's by a hash).

pub mod tables;

#[cfg(feature = "cuda")]
pub mod dequant;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod parcels;
#[cfg(feature = "cuda")]
pub mod reference;
#[cfg(feature = "cuda")]
pub mod resident;
#[cfg(feature = "cuda")]
pub mod upload;

#[cfg(feature = "cuda")]
pub use device::{probe_libraries, set_wait_by_default, wait_by_default, DeviceInfo, Gpu, Wait};

/// Where the CUDA libraries usually are, for error messages.
#[cfg(feature = "cuda")]
pub(crate) const LIB_HINT: &str = "install the NVIDIA driver (libcuda.so.1) and CUDA 13 (libnvrtc.so.13, libcublas.so.13), or put their directories on LD_LIBRARY_PATH";

/// The kernel families embedded in the binary, in the order NVRTC sees them (each family is
/// compiled as one source: `common.cuh`, the generated tables, then the family's file).
pub const COMMON_SOURCE: &str = include_str!("../../cuda/common.cuh");
/// The dequant kernels of the scalar types and 32-element blocks: the kernel macros
/// (`dequant.cu`), then their instances. Each dequant family is compiled on its own, so that
/// the three compile side by side ([`Gpu::compile_ahead`]).
pub const DEQUANT_SCALAR_SOURCE: &str = concat!(
    include_str!("../../cuda/dequant.cu"),
    "\n",
    include_str!("../../cuda/dequant_scalar.cu"),
);
/// The K-quant dequant kernels (Q2_K..Q6_K, IQ4_XS) after the kernel macros.
pub const DEQUANT_K_SOURCE: &str = concat!(
    include_str!("../../cuda/dequant.cu"),
    "\n",
    include_str!("../../cuda/dequant_kquants.cu"),
);
/// The i-quant, ternary and FP4 dequant kernels after the kernel macros.
pub const DEQUANT_IQ_SOURCE: &str = concat!(
    include_str!("../../cuda/dequant.cu"),
    "\n",
    include_str!("../../cuda/dequant_iquants.cu"),
);
/// The dequant kernel families, `(name, source)`.
pub const DEQUANT_FAMILIES: [(&str, &str); 3] = [
    ("dequant_scalar", DEQUANT_SCALAR_SOURCE),
    ("dequant_k", DEQUANT_K_SOURCE),
    ("dequant_iq", DEQUANT_IQ_SOURCE),
];
/// On-device comparison kernels.
pub const COMPARE_SOURCE: &str = include_str!("../../cuda/compare.cu");
/// The CPU reference's matrix products, bit for bit (`cuda/reference.cu`).
pub const REFERENCE_SOURCE: &str = include_str!("../../cuda/reference.cu");
/// The forward-pass kernels of the CUDA engine (all but the projections, which are cuBLAS).
pub const FORWARD_SOURCE: &str = include_str!("../../cuda/forward.cu");

/// Fixed NVRTC options (they change numerics, so they are part of every report).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileOptions {
    /// Target, e.g. `sm_90`.
    pub arch: String,
    /// Contract `a*b+c` into FMAs (off: the CPU reference never fuses).
    pub fmad: bool,
    /// Flush subnormals to zero (off).
    pub ftz: bool,
    /// IEEE division (on).
    pub prec_div: bool,
    /// IEEE square root (on).
    pub prec_sqrt: bool,
}

impl CompileOptions {
    /// glmdiff's options for compute capability `major.minor`.
    pub fn for_capability(major: i32, minor: i32) -> CompileOptions {
        CompileOptions {
            arch: format!("sm_{major}{minor}"),
            fmad: false,
            ftz: false,
            prec_div: true,
            prec_sqrt: true,
        }
    }

    /// The NVRTC command-line options.
    pub fn args(&self) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", self.arch),
            "--std=c++17".into(),
            format!("--fmad={}", self.fmad),
            format!("--ftz={}", self.ftz),
            format!("--prec-div={}", self.prec_div),
            format!("--prec-sqrt={}", self.prec_sqrt),
        ]
    }
}

impl std::fmt::Display for CompileOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "arch {} fmad={} ftz={} prec-div={} prec-sqrt={}",
            self.arch, self.fmad, self.ftz, self.prec_div, self.prec_sqrt
        )
    }
}

/// The full source of a kernel family as NVRTC compiles it.
pub fn family_source(family: &str) -> String {
    [COMMON_SOURCE, tables::source().as_str(), family].join("\n")
}
