//! Device tensors and launching: [`GpuTensor`] (f32 or i32 values on one device, with their
//! shape), the launch configurations of the forward kernels, the `launch!` macro and the scalar
//! argument helpers, and the engine's small tensor helpers (zeroed buffers, bf16 rounding and
//! conversion).

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{CudaEngine, GpuDtype};
use crate::gpu::Gpu;

/// Threads per block of the forward kernels (`FWD_THREADS` in `cuda/forward.cu`).
pub(super) const THREADS: u32 = 256;

/// A tensor on the device: f32 or i32 values in PyTorch-order `shape`.
#[derive(Clone)]
pub struct GpuTensor {
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Which engine of a several-device run made it (0 with one device).
    pub(super) slot: usize,
    pub(super) data: GpuData,
}

/// A device tensor's values.
#[derive(Clone)]
pub(super) enum GpuData {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// i32 values (token and expert ids).
    I32(CudaSlice<i32>),
}

impl GpuTensor {
    /// The f32 values (`what` names the tensor in the error when they are i32).
    pub(super) fn f32(&self, what: &str) -> Result<&CudaSlice<f32>> {
        match &self.data {
            GpuData::F32(s) => Ok(s),
            GpuData::I32(_) => bail!("engine: cuda: {what}: expected f32 values, got i32"),
        }
    }

    /// The i32 values (`what` names the tensor in the error when they are f32).
    pub(super) fn i32(&self, what: &str) -> Result<&CudaSlice<i32>> {
        match &self.data {
            GpuData::I32(s) => Ok(s),
            GpuData::F32(_) => bail!("engine: cuda: {what}: expected i32 values, got f32"),
        }
    }

    /// `[a, b]` as is, `[a, b, c]` as `[a, b*c]`.
    pub(super) fn dims2(&self, what: &str) -> Result<(usize, usize)> {
        match self.shape.as_slice() {
            [a, b] => Ok((*a, *b)),
            [a, b, c] => Ok((*a, b * c)),
            s => bail!("engine: cuda: {what}: expected a [T, n] tensor, got shape {s:?}"),
        }
    }
}

/// A grid for `n` independent items, `THREADS` a block (grid-stride kernels cover the rest).
pub(super) fn items(gpu: &Gpu, n: u64) -> LaunchConfig {
    let blocks = n
        .div_ceil(u64::from(THREADS))
        .clamp(1, u64::from(gpu.info.sms.max(1)) * 16);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
pub(super) fn rows_cfg(rows: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// `v` as a cuBLAS (and kernel) `int`, or an error naming `what`.
pub(super) fn i32_arg(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .with_context(|| format!("engine: cuda: {what} = {v} does not fit a cuBLAS int"))
}

/// Launches kernel `$name` of `cuda/forward.cu` with `$cfg` and the arguments in order.
macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        use ::anyhow::Context as _;
        use ::cudarc::driver::PushKernelArg as _;
        let f = $self
            .gpu
            .function("forward", $crate::gpu::FORWARD_SOURCE, $name)?;
        let mut b = $self.gpu.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: every call site passes device buffers holding the element counts the kernel
        // reads and writes for the scalar sizes passed with them (checked by the caller against
        // the tensors' shapes), and scalars of the kernel's parameter types.
        unsafe { b.launch($cfg) }.with_context(|| format!("engine: cuda: launching {}", $name))?;
    }};
}
pub(super) use launch;

impl CudaEngine<'_> {
    /// In bf16 mode, rounds a step's f32 output to bf16 values in place (f32 mode: as is).
    pub(super) fn finish(&self, mut y: CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        if self.dtype == GpuDtype::Bf16 {
            let n = y.len() as u64;
            launch!(self, "round_bf16", items(self.gpu, n), &mut y, &n);
        }
        Ok(y)
    }

    /// `x` as bf16 values.
    pub(super) fn to_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<half::bf16>> {
        let mut y = self.gpu.alloc_zeroed::<half::bf16>(n.max(1), "bf16 copy")?;
        let nn = n as u64;
        launch!(self, "f32_to_bf16", items(self.gpu, nn), x, &mut y, &nn);
        Ok(y)
    }

    /// bf16 values `x` as f32.
    pub(super) fn widen_bf16(&self, x: &CudaSlice<half::bf16>, n: usize) -> Result<CudaSlice<f32>> {
        let mut y = self.zeros_f32(n, "f32 copy")?;
        let nn = n as u64;
        launch!(self, "bf16_to_f32", items(self.gpu, nn), x, &mut y, &nn);
        Ok(y)
    }

    /// `n` zeroed f32 values (at least one), `what` naming them in an allocation error.
    pub(super) fn zeros_f32(&self, n: usize, what: &str) -> Result<CudaSlice<f32>> {
        self.gpu.alloc_zeroed::<f32>(n.max(1), what)
    }

    /// `s` as this engine's f32 tensor of `shape`.
    pub(super) fn tensor_f32(&self, shape: Vec<usize>, s: CudaSlice<f32>) -> GpuTensor {
        GpuTensor {
            shape,
            slot: self.slot,
            data: GpuData::F32(s),
        }
    }
}
