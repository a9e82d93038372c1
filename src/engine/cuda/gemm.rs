//! The projections: cuBLAS GEMMs (`x · W^T`, and the per-head strided-batched GEMMs of absorbed
//! MLA) in f32 (pedantic math) or bf16 (tensor cores, f32 accumulation), and the projection of a
//! GGUF matrix (or a stacked tensor's row range) dequantized into scratch a chunk of rows at a
//! time.

use std::ops::Range;

use anyhow::{bail, Result};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};

use super::tensor::i32_arg;
use super::{CudaEngine, GpuDtype, GpuTensor};
use crate::gpu::dequant::OutFormat;

/// Most f32 values one projection dequantizes at once (256 MiB of scratch); bigger matrices
/// (the output projection of a large vocabulary) go in row chunks.
const SCRATCH_VALUES: usize = 64 << 20;

/// Element types the engine multiplies with cuBLAS (f32, bf16), with their 1 and 0 and the
/// dequantizer output that writes them.
trait GemmScalar: Copy + DeviceRepr {
    const ONE: Self;
    const ZERO: Self;
    /// The dequantizer output format of this type.
    const FORMAT: OutFormat;
}

impl GemmScalar for f32 {
    const ONE: f32 = 1.0;
    const ZERO: f32 = 0.0;
    const FORMAT: OutFormat = OutFormat::F32;
}

impl GemmScalar for half::bf16 {
    const ONE: half::bf16 = half::bf16::ONE;
    const ZERO: half::bf16 = half::bf16::ZERO;
    const FORMAT: OutFormat = OutFormat::Bf16;
}

/// The extents of a per-head batched GEMM ([`CudaEngine::head_gemm`]).
pub(super) struct HeadGemm {
    /// Tokens (rows of each head's input and output).
    pub(super) t: usize,
    /// Heads (the batch).
    pub(super) heads: usize,
    /// Output values per head (rows of each `W_h`).
    pub(super) m: usize,
    /// Input values per head (columns of each `W_h`).
    pub(super) k: usize,
    /// Row stride of each `W_h`.
    pub(super) lda: usize,
    /// Row stride of the input.
    pub(super) ldb: usize,
    /// Values from one head's `W_h` to the next.
    pub(super) sa: usize,
    /// Values from one head's input to the next within a row.
    pub(super) sb: usize,
}

impl CudaEngine<'_> {
    /// `y [t, out] (ldy) = x [t, k] (ldx) · W^T` for `W` the row-major `[out, k]` matrix `w`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_xwt<E: GemmScalar, A: DevicePtr<E>, B: DevicePtr<E>, C: DevicePtrMut<E>>(
        &self,
        x: &B,
        ldx: usize,
        w: &A,
        y: &mut C,
        ldy: usize,
        t: usize,
        k: usize,
        out: usize,
    ) -> Result<()>
    where
        CudaBlas: Gemm<E>,
    {
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: i32_arg(out, "rows")?,
            n: i32_arg(t, "tokens")?,
            k: i32_arg(k, "columns")?,
            alpha: E::ONE,
            lda: i32_arg(k, "columns")?,
            ldb: i32_arg(ldx, "input stride")?,
            beta: E::ZERO,
            ldc: i32_arg(ldy, "output stride")?,
        };
        // SAFETY: column-major view of row-major data: W (k x out, lda k) transposed times X^T
        // (k x t, ldb ldx >= k) into Y^T (out x t, ldc ldy >= out); the callers size x, w and y
        // for exactly these extents.
        unsafe { self.blas.gemm(cfg, w, x, y) }.map_err(|e| {
            anyhow::anyhow!("engine: cuda: cuBLAS GEMM [{t}x{k}]x[{out}x{k}]^T: {e:?}")
        })
    }

    /// Per head `h < g.heads`: `y[:, h, :] [t, m] = x_h [t, k] · W_h^T` with `W_h` the row-major
    /// `[m, k]` matrix at `h * sa` of `w` and `x_h` at `h * sb` of `x` (row stride `ldb`); `y` is
    /// `[t, heads, m]`. One strided-batched GEMM, in f32 or (bf16 mode) bf16.
    pub(super) fn head_gemm(
        &self,
        w: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &HeadGemm,
    ) -> Result<CudaSlice<f32>> {
        let n_out = g.t * g.heads * g.m;
        fn cfg<E: GemmScalar>(g: &HeadGemm) -> Result<StridedBatchedConfig<E>> {
            Ok(StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: i32_arg(g.m, "rows")?,
                    n: i32_arg(g.t, "tokens")?,
                    k: i32_arg(g.k, "columns")?,
                    alpha: E::ONE,
                    lda: i32_arg(g.lda, "lda")?,
                    ldb: i32_arg(g.ldb, "ldb")?,
                    beta: E::ZERO,
                    ldc: i32_arg(g.heads * g.m, "ldc")?,
                },
                batch_size: i32_arg(g.heads, "heads")?,
                stride_a: g.sa as i64,
                stride_b: g.sb as i64,
                stride_c: g.m as i64,
            })
        }
        if self.dtype == GpuDtype::Bf16 {
            let wb = self.to_bf16(w, w.len())?;
            let xb = self.to_bf16(x, x.len())?;
            let mut yb = self
                .gpu
                .alloc_zeroed::<half::bf16>(n_out.max(1), "head GEMM output")?;
            // SAFETY: per head h: W_h at h*sa (k x m, lda >= k) transposed, x_h at h*sb (k x t,
            // ldb), y at h*m (m x t, ldc heads*m): the callers' buffers hold these extents.
            unsafe {
                self.blas
                    .gemm_strided_batched(cfg::<half::bf16>(g)?, &wb, &xb, &mut yb)
            }
            .map_err(|e| anyhow::anyhow!("cuBLAS bf16 batched GEMM: {e:?}"))?;
            return self.widen_bf16(&yb, n_out);
        }
        let mut y = self.zeros_f32(n_out, "head GEMM output")?;
        // SAFETY: as above, in f32.
        unsafe { self.blas.gemm_strided_batched(cfg::<f32>(g)?, w, x, &mut y) }
            .map_err(|e| anyhow::anyhow!("cuBLAS batched SGEMM: {e:?}"))?;
        Ok(y)
    }

    /// `x [t, k] · W^T` for the GGUF matrix (or stacked-tensor row range) `name`/`rows`:
    /// `[t, rows.len()]`, dequantized a chunk of rows at a time (f32, or bf16 in bf16 mode).
    pub(super) fn project(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        name: &str,
        rows: Range<usize>,
    ) -> Result<CudaSlice<f32>> {
        self.project_as(x, t, name, rows, self.dtype)
    }

    /// [`Self::project`] in precision `dtype` (the router stays f32 in bf16 mode).
    fn project_as(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        name: &str,
        rows: Range<usize>,
        dtype: GpuDtype,
    ) -> Result<CudaSlice<f32>> {
        let k = self.weights.tensor(name)?.info.ne[0] as usize;
        let out = rows.len();
        let chunk = (SCRATCH_VALUES / k.max(1)).clamp(1, out.max(1));
        if dtype == GpuDtype::Bf16 {
            let xb = self.to_bf16(x, t * k)?;
            let mut yb = self
                .gpu
                .alloc_zeroed::<half::bf16>((t * out).max(1), "projection output")?;
            let mut scratch = self
                .gpu
                .alloc_zeroed::<half::bf16>(chunk * k, "dequant scratch")?;
            self.project_chunks(&xb, t, k, name, &rows, chunk, &mut scratch, &mut yb)?;
            return self.widen_bf16(&yb, t * out);
        }
        let mut y = self.zeros_f32(t * out, "projection output")?;
        let mut scratch = self.zeros_f32(chunk * k, "dequant scratch")?;
        self.project_chunks(x, t, k, name, &rows, chunk, &mut scratch, &mut y)?;
        Ok(y)
    }

    /// The chunk loop of [`Self::project_as`] in element type `E`: rows `rows` of `name`, `chunk`
    /// rows at a time, dequantized into `scratch` (`chunk * k` values of `E`) and multiplied with
    /// `x` `[t, k]` into their columns of `y` `[t, rows.len()]`.
    #[allow(clippy::too_many_arguments)]
    fn project_chunks<E: GemmScalar, X: DevicePtr<E>>(
        &self,
        x: &X,
        t: usize,
        k: usize,
        name: &str,
        rows: &Range<usize>,
        chunk: usize,
        scratch: &mut CudaSlice<E>,
        y: &mut CudaSlice<E>,
    ) -> Result<()>
    where
        CudaBlas: Gemm<E>,
    {
        let out = rows.len();
        let mut r0 = 0;
        while r0 < out {
            let r1 = (r0 + chunk).min(out);
            let mut wv = scratch.slice_mut(0..(r1 - r0) * k);
            self.dequant_rows_as(name, rows.start + r0..rows.start + r1, E::FORMAT, &mut wv)?;
            let wv = scratch.slice(0..(r1 - r0) * k);
            let mut yv = y.slice_mut(r0..);
            self.gemm_xwt(x, k, &wv, &mut yv, out, t, k, r1 - r0)?;
            r0 = r1;
        }
        Ok(())
    }

    /// `x · W^T` for the 2-D GGUF matrix `name`, `x` `[t, k]`.
    pub(super) fn linear_slice(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        k: usize,
        name: &str,
    ) -> Result<CudaSlice<f32>> {
        self.linear_slice_as(x, t, k, name, self.dtype)
    }

    /// `x · W^T` for the GGUF matrix `name` in precision `dtype`: `[T, in]` -> `[T, out]`.
    pub(super) fn linear_as(
        &self,
        x: &GpuTensor,
        name: &str,
        dtype: GpuDtype,
    ) -> Result<GpuTensor> {
        let (t, k) = x.dims2(name)?;
        let y = self.linear_slice_as(x.f32(name)?, t, k, name, dtype)?;
        let rows = self.weights.matrix_dims(name)?.0;
        Ok(self.tensor_f32(vec![t, rows], y))
    }

    /// [`Self::linear_slice`] in precision `dtype`.
    pub(super) fn linear_slice_as(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        k: usize,
        name: &str,
        dtype: GpuDtype,
    ) -> Result<CudaSlice<f32>> {
        let (rows, cols) = self.weights.matrix_dims(name)?;
        if cols != k {
            bail!("engine: cuda: linear {name}: input has {k} columns, the weight [{rows}, {cols}] expects {cols}");
        }
        self.project_as(x, t, name, 0..rows, dtype)
    }
}
