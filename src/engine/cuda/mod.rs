//! The CUDA engine: every step of the forward pass on one GPU, behind the same [`Engine`] trait
//! as the CPU reference, so that `glmdiff run --against cuda` compares the two step by step.
//!
//! What it does the way serving engines do:
//! - weights stay as their raw GGUF blocks on the device (uploaded once per tensor) and are
//!   dequantized per step into scratch by the bit-exact kernels of `cuda/dequant*.cu`, a chunk of
//!   rows at a time, then multiplied with cuBLAS SGEMM (pedantic math: no TF32);
//! - only the experts a step routes to are dequantized (a stacked expert tensor is read as one
//!   expert's row range of its raw bytes);
//! - MLA runs in the *absorbed* form: `W_UK` folded into the query (`q_lat = q_nope · W_UK`),
//!   attention over the latent `c_kv` and `k_pe`, `W_UV` applied after, the form whose kernels
//!   broke on a new GPU in the field; the reference stays naive, so a run compares the two forms.
//!
//! Everything but the projections runs in `cuda/forward.cu`: norms, RoPE, the DSA indexer and
//! top-k, the attention core, the router, SwiGLU, gathers and the weighted expert sum. Its
//! reductions accumulate in f64 like the reference; GEMMs accumulate in f32, so the engine's
//! precision is `f32 storage, f32 accumulation` and `run` judges it against the f32 floors.
//! The engine never prints; errors name the step, the tensor and the shapes.

pub mod multi;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;

use anyhow::{bail, Context, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t, cublasSetMathMode, cublasStatus_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{Engine, ExpertInputs, ExpertsOut, HostData, HostTensor, MlaInputs, Routing};
use crate::cuda::dequant::OutFormat;
use crate::cuda::{Gpu, FORWARD_SOURCE};
use crate::model::hparams::INDEXER_K_NORM_EPS;
use crate::model::names::{self, blk};
use crate::model::{rope, Gating, RopeSlice, Weights};

/// Most f32 values one projection dequantizes at once (256 MiB of scratch); bigger matrices
/// (the output projection of a large vocabulary) go in row chunks.
const SCRATCH_VALUES: usize = 64 << 20;

/// Threads per block of the forward kernels (`FWD_THREADS` in `cuda/forward.cu`).
const THREADS: u32 = 256;

/// The engine's compute precision (`run --dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuDtype {
    /// f32 weights and activations, cuBLAS SGEMM in pedantic math (no TF32): must match the
    /// reference within the f32 floors.
    F32,
    /// Weights and activations rounded to bf16 (every step's output; the inputs of every GEMM
    /// and of the attention core), bf16 GEMMs on tensor cores with f32 accumulation and bf16
    /// output, as serving engines run; the router (its logits, probabilities and weights) in
    /// f32, as transformers and vLLM compute it. The bf16 floors apply.
    Bf16,
}

impl GpuDtype {
    /// Parses `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<GpuDtype> {
        match s {
            "f32" => Ok(GpuDtype::F32),
            "bf16" => Ok(GpuDtype::Bf16),
            other => bail!("--dtype {other:?}: expected f32 or bf16"),
        }
    }
}

/// Element types the engine multiplies with cuBLAS (f32, bf16), with their 1 and 0.
trait GemmScalar: Copy {
    const ONE: Self;
    const ZERO: Self;
}

impl GemmScalar for f32 {
    const ONE: f32 = 1.0;
    const ZERO: f32 = 0.0;
}

impl GemmScalar for half::bf16 {
    const ONE: half::bf16 = half::bf16::ONE;
    const ZERO: half::bf16 = half::bf16::ZERO;
}

/// The extents of a per-head batched GEMM ([`CudaEngine::head_gemm`]).
struct HeadGemm {
    t: usize,
    heads: usize,
    m: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    sa: usize,
    sb: usize,
}

/// A tensor on the device: f32 or i32 values in PyTorch-order `shape`.
#[derive(Clone)]
pub struct GpuTensor {
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Which engine of a several-device run made it (0 with one device).
    slot: usize,
    data: GpuData,
}

#[derive(Clone)]
enum GpuData {
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
}

impl GpuTensor {
    fn f32(&self, what: &str) -> Result<&CudaSlice<f32>> {
        match &self.data {
            GpuData::F32(s) => Ok(s),
            GpuData::I32(_) => bail!("engine: cuda: {what}: expected f32 values, got i32"),
        }
    }

    fn i32(&self, what: &str) -> Result<&CudaSlice<i32>> {
        match &self.data {
            GpuData::I32(s) => Ok(s),
            GpuData::F32(_) => bail!("engine: cuda: {what}: expected i32 values, got f32"),
        }
    }

    fn dims2(&self, what: &str) -> Result<(usize, usize)> {
        match self.shape.as_slice() {
            [a, b] => Ok((*a, *b)),
            [a, b, c] => Ok((*a, b * c)),
            s => bail!("engine: cuda: {what}: expected a [T, n] tensor, got shape {s:?}"),
        }
    }
}

/// A grid for `n` independent items, `THREADS` a block (grid-stride kernels cover the rest).
fn items(gpu: &Gpu, n: u64) -> LaunchConfig {
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
fn rows_cfg(rows: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn i32_arg(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .with_context(|| format!("engine: cuda: {what} = {v} does not fit a cuBLAS int"))
}

/// Launches kernel `$name` of `cuda/forward.cu` with `$cfg` and the arguments in order.
macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $self.gpu.function("forward", FORWARD_SOURCE, $name)?;
        let mut b = $self.gpu.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: every call site passes device buffers holding the element counts the kernel
        // reads and writes for the scalar sizes passed with them (checked by the caller against
        // the tensors' shapes), and scalars of the kernel's parameter types.
        unsafe { b.launch($cfg) }.with_context(|| format!("engine: cuda: launching {}", $name))?;
    }};
}

/// The CUDA engine over one model's weights on one GPU.
pub struct CudaEngine<'w> {
    gpu: &'w Gpu,
    /// This engine's index among the devices of a run (tensors carry it).
    slot: usize,
    dtype: GpuDtype,
    weights: &'w Weights<'w>,
    blas: CudaBlas,
    /// RoPE inverse frequencies `[rope/2]` (f64) on the device, and their count.
    inv_freq: CudaSlice<f64>,
    n_freq: usize,
    attn_factor: f64,
    /// Raw GGUF bytes of the tensors uploaded so far, by name.
    raw: RefCell<HashMap<String, Rc<CudaSlice<u8>>>>,
    /// f32 vectors (norm weights, biases) uploaded so far, by name.
    vectors: RefCell<HashMap<String, Rc<CudaSlice<f32>>>>,
}

impl<'w> CudaEngine<'w> {
    /// An engine running `weights` on `gpu` in precision `dtype`.
    pub fn new(gpu: &'w Gpu, weights: &'w Weights<'w>, dtype: GpuDtype) -> Result<CudaEngine<'w>> {
        let blas = CudaBlas::new(gpu.stream().clone())
            .map_err(|e| anyhow::anyhow!("cuda: cuBLAS: {e:?} (is libcublas.so.13 installed?)"))?;
        // f32: pedantic math (no TF32, no reduced-precision shortcuts); bf16: the default math
        // serving engines get (tensor cores, f32 accumulation).
        let mode = match dtype {
            GpuDtype::F32 => cublasMath_t::CUBLAS_PEDANTIC_MATH,
            GpuDtype::Bf16 => cublasMath_t::CUBLAS_DEFAULT_MATH,
        };
        // SAFETY: the handle was created just above and lives as long as `blas`.
        let st = unsafe { cublasSetMathMode(*blas.handle(), mode) };
        if st != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cuda: cuBLAS: setting math mode {mode:?}: {st:?}");
        }
        let hp = weights.hparams();
        let freq = rope::inv_freq(&hp.rope);
        Ok(CudaEngine {
            gpu,
            slot: 0,
            dtype,
            weights,
            blas,
            inv_freq: gpu.alloc_copy(&freq, "RoPE frequencies")?,
            n_freq: freq.len(),
            attn_factor: rope::attention_factor(&hp.rope),
            raw: RefCell::new(HashMap::new()),
            vectors: RefCell::new(HashMap::new()),
        })
    }

    /// The same engine as device `slot` of a several-device run.
    pub fn with_slot(mut self, slot: usize) -> CudaEngine<'w> {
        self.slot = slot;
        self
    }

    /// Frees the device copies of every tensor whose name starts with `prefix` (e.g. `blk.3.`).
    pub fn forget(&self, prefix: &str) {
        self.raw.borrow_mut().retain(|k, _| !k.starts_with(prefix));
        self.vectors
            .borrow_mut()
            .retain(|k, _| !k.starts_with(prefix));
    }

    /// In bf16 mode, rounds a step's f32 output to bf16 values in place (f32 mode: as is).
    fn finish(&self, mut y: CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        if self.dtype == GpuDtype::Bf16 {
            let n = y.len() as u64;
            launch!(self, "round_bf16", items(self.gpu, n), &mut y, &n);
        }
        Ok(y)
    }

    /// `x` as bf16 values.
    fn to_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<half::bf16>> {
        let mut y = self.gpu.alloc_zeroed::<half::bf16>(n.max(1), "bf16 copy")?;
        let nn = n as u64;
        launch!(self, "f32_to_bf16", items(self.gpu, nn), x, &mut y, &nn);
        Ok(y)
    }

    /// bf16 values `x` as f32.
    fn widen_bf16(&self, x: &CudaSlice<half::bf16>, n: usize) -> Result<CudaSlice<f32>> {
        let mut y = self.zeros_f32(n, "f32 copy")?;
        let nn = n as u64;
        launch!(self, "bf16_to_f32", items(self.gpu, nn), x, &mut y, &nn);
        Ok(y)
    }

    fn zeros_f32(&self, n: usize, what: &str) -> Result<CudaSlice<f32>> {
        self.gpu.alloc_zeroed::<f32>(n.max(1), what)
    }

    fn tensor_f32(&self, shape: Vec<usize>, s: CudaSlice<f32>) -> GpuTensor {
        GpuTensor {
            shape,
            slot: self.slot,
            data: GpuData::F32(s),
        }
    }

    /// The raw blocks of tensor `name` on the device (uploaded on first use).
    fn raw(&self, name: &str) -> Result<Rc<CudaSlice<u8>>> {
        if let Some(r) = self.raw.borrow().get(name) {
            return Ok(r.clone());
        }
        let bytes = self
            .weights
            .tensor_desc(name)?
            .data()
            .with_context(|| format!("engine: cuda: reading {name}"))?;
        let d = Rc::new(self.gpu.alloc_copy(bytes, name)?);
        self.raw.borrow_mut().insert(name.to_string(), d.clone());
        Ok(d)
    }

    /// Rows `rows` (of the tensor's `ne[1]*ne[2]...` rows of `ne[0]` values) of `name`,
    /// dequantized to f32 into `dst` (`rows.len() * ne[0]` values).
    fn dequant_rows(
        &self,
        name: &str,
        rows: Range<usize>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.dequant_rows_as(name, rows, OutFormat::F32, dst)
    }

    /// The same into `format`'s values (f32, or bf16 / f16 bit patterns).
    fn dequant_rows_as<T: DeviceRepr>(
        &self,
        name: &str,
        rows: Range<usize>,
        format: OutFormat,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let t = self.weights.tensor(name)?;
        let ty = t.info.ty;
        let cols = t.info.ne[0] as usize;
        let row_bytes = cols / ty.block_size() * ty.type_size();
        let raw = self.raw(name)?;
        let view = raw.slice(rows.start * row_bytes..rows.end * row_bytes);
        self.gpu
            .dequant_view(ty, format, &view, dst)
            .with_context(|| format!("engine: cuda: dequantizing {name} rows {rows:?}"))
    }

    /// A 1-D weight as f32 on the device.
    fn vector(&self, name: &str) -> Result<Rc<CudaSlice<f32>>> {
        if let Some(v) = self.vectors.borrow().get(name) {
            return Ok(v.clone());
        }
        let host = self.weights.vector_desc(name)?.dequantize()?;
        let d = Rc::new(self.gpu.alloc_copy(&host, name)?);
        self.vectors
            .borrow_mut()
            .insert(name.to_string(), d.clone());
        Ok(d)
    }

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
    fn head_gemm(
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
    fn project(
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
            let mut r0 = 0;
            while r0 < out {
                let r1 = (r0 + chunk).min(out);
                let mut wv = scratch.slice_mut(0..(r1 - r0) * k);
                self.dequant_rows_as(
                    name,
                    rows.start + r0..rows.start + r1,
                    OutFormat::Bf16,
                    &mut wv,
                )?;
                let wv = scratch.slice(0..(r1 - r0) * k);
                let mut yv = yb.slice_mut(r0..);
                self.gemm_xwt(&xb, k, &wv, &mut yv, out, t, k, r1 - r0)?;
                r0 = r1;
            }
            return self.widen_bf16(&yb, t * out);
        }
        let mut y = self.zeros_f32(t * out, "projection output")?;
        let mut scratch = self.zeros_f32(chunk * k, "dequant scratch")?;
        let mut r0 = 0;
        while r0 < out {
            let r1 = (r0 + chunk).min(out);
            let mut wv = scratch.slice_mut(0..(r1 - r0) * k);
            self.dequant_rows(name, rows.start + r0..rows.start + r1, &mut wv)?;
            let wv = scratch.slice(0..(r1 - r0) * k);
            let mut yv = y.slice_mut(r0..);
            self.gemm_xwt(x, k, &wv, &mut yv, out, t, k, r1 - r0)?;
            r0 = r1;
        }
        Ok(y)
    }

    /// `x · W^T` for the 2-D GGUF matrix `name`, `x` `[t, k]`.
    fn linear_slice(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        k: usize,
        name: &str,
    ) -> Result<CudaSlice<f32>> {
        self.linear_slice_as(x, t, k, name, self.dtype)
    }

    /// [`Self::linear_slice`] in precision `dtype`.
    fn linear_slice_as(
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

    /// The absorbed MLA weights of `layer` on the device: `wk [H, L, nope]` (`attn_k_b`) and
    /// `wv [H, v, L]` (`attn_v_b`), from the split tensors or the legacy `attn_kv_b`.
    fn mla_weights(&self, layer: usize) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let hp = self.weights.hparams();
        let (h, nope, v, l) = (hp.n_head, hp.qk_nope, hp.v_head, hp.kv_lora_rank);
        let k_name = names::blk(layer, blk::ATTN_K_B);
        let legacy = names::blk(layer, blk::ATTN_KV_B);
        let mut wk = self.zeros_f32(h * l * nope, "W_UK")?;
        let mut wv = self.zeros_f32(h * v * l, "W_UV")?;
        if !self.weights.has(&k_name) && self.weights.has(&legacy) {
            let rows = h * (nope + v);
            let mut kv = self.zeros_f32(rows * l, "kv_b")?;
            self.dequant_rows(&legacy, 0..rows, &mut kv.as_view_mut())?;
            let (hh, nn, vv, ll) = (h as u32, nope as u32, v as u32, l as u32);
            launch!(
                self,
                "split_kv_b_f32",
                items(self.gpu, (rows * l) as u64),
                &kv,
                &mut wk,
                &mut wv,
                &hh,
                &nn,
                &vv,
                &ll
            );
        } else {
            let kt = self.weights.tensor(&k_name)?;
            self.dequant_rows(&k_name, 0..kt.info.n_rows() as usize, &mut wk.as_view_mut())?;
            let v_name = names::blk(layer, blk::ATTN_V_B);
            let vt = self.weights.tensor(&v_name)?;
            self.dequant_rows(&v_name, 0..vt.info.n_rows() as usize, &mut wv.as_view_mut())?;
        }
        Ok((wk, wv))
    }
}

impl Engine for CudaEngine<'_> {
    type Tensor = GpuTensor;

    fn describe(&self) -> String {
        format!("cuda:{} {}", self.gpu.info.ordinal, self.gpu.describe())
    }

    fn dtype(&self) -> String {
        match self.dtype {
            GpuDtype::F32 => {
                "f32 storage, f32 accumulation (cuBLAS SGEMM, pedantic math: no TF32; absorbed MLA)"
            }
            GpuDtype::Bf16 => {
                "bf16 storage, f32 accumulation (cuBLAS bf16 GEMM on tensor cores; absorbed MLA)"
            }
        }
        .to_string()
    }

    fn upload(&self, t: &HostTensor) -> Result<GpuTensor> {
        let data = match &t.data {
            HostData::F32(v) => GpuData::F32(self.gpu.alloc_copy(v, "input")?),
            HostData::I32(v) => GpuData::I32(self.gpu.alloc_copy(v, "input")?),
        };
        Ok(GpuTensor {
            shape: t.shape.clone(),
            slot: self.slot,
            data,
        })
    }

    fn download(&self, t: &GpuTensor) -> Result<HostTensor> {
        let s = self.gpu.stream();
        match &t.data {
            GpuData::F32(d) => {
                let n: usize = t.shape.iter().product();
                let v = s
                    .clone_dtoh(&d.slice(0..n))
                    .context("engine: cuda: download")?;
                HostTensor::f32(t.shape.clone(), v)
            }
            GpuData::I32(d) => {
                let n: usize = t.shape.iter().product();
                let v = s
                    .clone_dtoh(&d.slice(0..n))
                    .context("engine: cuda: download")?;
                HostTensor::i32(t.shape.clone(), v)
            }
        }
    }

    fn embed(&self, ids: &[u32]) -> Result<GpuTensor> {
        let name = names::TOKEN_EMBD;
        let (n_vocab, hidden) = self.weights.matrix_dims(name)?;
        let mut out = self.zeros_f32(ids.len() * hidden, "embedding")?;
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= n_vocab {
                bail!("engine: cuda: token id {id} at position {i} is outside the vocabulary of {n_vocab}");
            }
            let mut row = out.slice_mut(i * hidden..(i + 1) * hidden);
            self.dequant_rows(name, id as usize..id as usize + 1, &mut row)?;
        }
        Ok(self.tensor_f32(vec![ids.len(), hidden], self.finish(out)?))
    }

    fn rms_norm(
        &self,
        x: &GpuTensor,
        weight: &str,
        eps: f64,
        cols: Option<Range<usize>>,
    ) -> Result<GpuTensor> {
        let (t, n) = x.dims2(weight)?;
        let cols = cols.unwrap_or(0..n);
        if cols.end > n || cols.is_empty() {
            bail!("engine: cuda: rms_norm {weight}: columns {cols:?} of a [{t}, {n}] input");
        }
        let w = self.vector(weight)?;
        if w.len() != cols.len() {
            bail!(
                "engine: cuda: rms_norm {weight}: weight has {} values for {} columns",
                w.len(),
                cols.len()
            );
        }
        let mut y = self.zeros_f32(t * cols.len(), "rms_norm output")?;
        let (nn, c0, nc) = (n as u32, cols.start as u32, cols.len() as u32);
        launch!(
            self,
            "rms_norm_f32",
            rows_cfg(t, 0),
            x.f32(weight)?,
            &*w,
            &mut y,
            &nn,
            &c0,
            &nc,
            &eps
        );
        Ok(self.tensor_f32(vec![t, cols.len()], self.finish(y)?))
    }

    fn linear(&self, x: &GpuTensor, weight: &str) -> Result<GpuTensor> {
        let (t, k) = x.dims2(weight)?;
        // The router's logits are computed in f32 in bf16 mode too, as transformers
        // (`DeepseekV3TopkRouter`, GLM-5) and vLLM compute them: bf16 router logits are a bug.
        let dtype = if weight.ends_with(blk::FFN_GATE_INP) {
            GpuDtype::F32
        } else {
            self.dtype
        };
        let y = self.linear_slice_as(x.f32(weight)?, t, k, weight, dtype)?;
        let rows = self.weights.matrix_dims(weight)?.0;
        Ok(self.tensor_f32(vec![t, rows], y))
    }

    fn rope(&self, x: &GpuTensor, s: &RopeSlice) -> Result<GpuTensor> {
        let (t, n) = x.dims2("rope input")?;
        let rd = self.n_freq * 2;
        if n != s.heads * s.stride || s.offset + rd > s.stride {
            bail!(
                "engine: cuda: rope: input [{t}, {n}] does not hold {} heads of {} with {rd} rotated values at {}",
                s.heads, s.stride, s.offset
            );
        }
        let mut y = self.zeros_f32(t * s.heads * rd, "rope output")?;
        let xs = x.f32("rope input")?;
        let (tt, hh, st, off, r) = (
            t as u32,
            s.heads as u32,
            s.stride as u32,
            s.offset as u32,
            rd as u32,
        );
        let zero = 0u32;
        // The kernel writes through `x` only in place (flag 1); here it reads it.
        let xp = {
            let (p, _rec) = xs.device_ptr(self.gpu.stream());
            p
        };
        launch!(
            self,
            "rope_f32",
            items(self.gpu, (t * s.heads * rd / 2) as u64),
            &xp,
            &mut y,
            &self.inv_freq,
            &tt,
            &hh,
            &st,
            &off,
            &r,
            &self.attn_factor,
            &zero
        );
        let shape = if s.keep_head_axis {
            vec![t, s.heads, rd]
        } else {
            vec![t, s.heads * rd]
        };
        Ok(self.tensor_f32(shape, self.finish(y)?))
    }

    fn indexer_scores(&self, layer: usize, a: &GpuTensor, cq: &GpuTensor) -> Result<GpuTensor> {
        let hp = self.weights.hparams();
        let Some(ix) = &hp.indexer else {
            bail!("engine: cuda: indexer_scores on layer {layer}, but the model has no indexer");
        };
        let (t, ka) = a.dims2("indexer_scores input a")?;
        let (_, kq) = cq.dims2("indexer_scores input cq")?;
        let (ni, di, rd) = (ix.n_head, ix.head_dim, hp.qk_rope);
        let w = |s: &str| names::blk(layer, s);
        let mut q = self.linear_slice(cq.f32("cq")?, t, kq, &w(blk::INDEXER_Q_B))?; // [T, nI*dI]
        let mut k = self.linear_slice(a.f32("a")?, t, ka, &w(blk::INDEXER_K))?; // [T, dI]
        let hw = self.linear_slice(a.f32("a")?, t, ka, &w(blk::INDEXER_PROJ))?; // [T, nI]
        let kn_w = self.vector(&w(blk::INDEXER_K_NORM))?;
        let kn_b = self.vector(&w(blk::INDEXER_K_NORM_B))?;
        let d = di as u32;
        launch!(
            self,
            "layer_norm_f32",
            rows_cfg(t, 0),
            &mut k,
            &*kn_w,
            &*kn_b,
            &d,
            &INDEXER_K_NORM_EPS
        );
        let mut k = self.finish(k)?;
        let (tt, r, one) = (t as u32, rd as u32, 1u32);
        let (nih, zero) = (ni as u32, 0u32);
        let null = 0u64;
        launch!(
            self,
            "rope_f32",
            items(self.gpu, (t * ni * rd / 2) as u64),
            &mut q,
            &null,
            &self.inv_freq,
            &tt,
            &nih,
            &d,
            &zero,
            &r,
            &self.attn_factor,
            &one
        );
        launch!(
            self,
            "rope_f32",
            items(self.gpu, (t * rd / 2) as u64),
            &mut k,
            &null,
            &self.inv_freq,
            &tt,
            &one,
            &d,
            &zero,
            &r,
            &self.attn_factor,
            &one
        );
        let (q, k) = (self.finish(q)?, self.finish(k)?);
        let scale = 1.0 / ((ni * di) as f64).sqrt();
        let mut out = self.zeros_f32(t * t, "indexer scores")?;
        let warps = (t * t) as u64;
        let cfg = LaunchConfig {
            grid_dim: (
                (warps * 32).div_ceil(u64::from(THREADS)).max(1) as u32,
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "indexer_scores_f32",
            cfg,
            &q,
            &k,
            &hw,
            &mut out,
            &tt,
            &nih,
            &d,
            &scale
        );
        Ok(self.tensor_f32(vec![t, t], self.finish(out)?))
    }

    fn top_k(&self, scores: &GpuTensor, k: usize) -> Result<GpuTensor> {
        let (t, t2) = scores.dims2("top_k scores")?;
        if t != t2 {
            bail!(
                "engine: cuda: top_k expects [T, T] scores, got {:?}",
                scores.shape
            );
        }
        let width = k.min(t);
        let mut out = self
            .gpu
            .alloc_zeroed::<i32>((t * width).max(1), "top-k ids")?;
        let (tt, kk, ww) = (t as u32, k as u32, width as u32);
        launch!(
            self,
            "topk_rows_f32",
            items(self.gpu, t as u64),
            scores.f32("scores")?,
            &mut out,
            &tt,
            &kk,
            &ww
        );
        Ok(GpuTensor {
            shape: vec![t, width],
            slot: self.slot,
            data: GpuData::I32(out),
        })
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, GpuTensor>,
        want_probs: bool,
    ) -> Result<(GpuTensor, Option<GpuTensor>)> {
        let hp = self.weights.hparams();
        let (h, nope, rd, v, l) = (
            hp.n_head,
            hp.qk_nope,
            hp.qk_rope,
            hp.v_head,
            hp.kv_lora_rank,
        );
        let qk = hp.qk_head();
        let (t, _) = x.q_b.dims2("q_b")?;
        let expect = |g: &GpuTensor, shape: Vec<usize>, what: &str| -> Result<()> {
            if g.shape != shape {
                bail!("engine: cuda: layer {layer} attention: {what} has shape {:?}, expected {shape:?}", g.shape);
            }
            Ok(())
        };
        expect(x.q_b, vec![t, h * qk], "q_b")?;
        expect(x.q_pe, vec![t, h, rd], "q_pe_rope")?;
        expect(x.kv_norm, vec![t, l], "kv_a_norm")?;
        expect(x.k_pe, vec![t, rd], "k_pe_rope")?;
        let smem = (t * 8) as u32;
        if smem > 48 * 1024 {
            bail!("engine: cuda: layer {layer} attention: {t} tokens need {smem} bytes of shared memory for one row of scores (at most 6144 tokens)");
        }
        let (wk, wv) = self.mla_weights(layer)?;
        // bf16 mode: the latent cache (c_kv, k_pe) and the rotated queries are bf16 values.
        let rounded = |g: &GpuTensor, what: &str| -> Result<CudaSlice<f32>> {
            self.finish(g.f32(what)?.clone())
        };
        let (q_pe_r, kv_r, k_pe_r) = (
            rounded(x.q_pe, "q_pe")?,
            rounded(x.kv_norm, "kv_norm")?,
            rounded(x.k_pe, "k_pe")?,
        );
        // q_lat[t, h, :] = q_nope[t, h, :] · W_UK[h]^T (W_UK[h] is [L, nope]): one batched GEMM.
        let q_b = x.q_b.f32("q_b")?;
        let g = HeadGemm {
            t,
            heads: h,
            m: l,
            k: nope,
            lda: nope,
            ldb: h * qk,
            sa: l * nope,
            sb: qk,
        };
        let q_lat = self
            .head_gemm(&wk, q_b, &g)
            .with_context(|| format!("engine: cuda: layer {layer}: q_lat"))?;
        // The keys each query may see.
        let mut mask = self
            .gpu
            .alloc_zeroed::<u8>((t * t).max(1), "attention mask")?;
        let tt = t as u32;
        match x.selection {
            Some(sel) => {
                let (st, sk) = sel.dims2("selection")?;
                if st != t {
                    bail!("engine: cuda: layer {layer} attention: selection has {st} rows for {t} tokens");
                }
                let skk = sk as u32;
                launch!(
                    self,
                    "mla_mask",
                    items(self.gpu, t as u64),
                    sel.i32("selection")?,
                    &mut mask,
                    &tt,
                    &skk
                );
            }
            None => {
                let null = 0u64;
                let zero = 0u32;
                launch!(
                    self,
                    "mla_mask",
                    items(self.gpu, t as u64),
                    &null,
                    &mut mask,
                    &tt,
                    &zero
                );
            }
        }
        let mut o_lat = self.zeros_f32(t * h * l, "o_lat")?;
        let mut probs = if want_probs {
            Some(self.zeros_f32(h * t * t, "attention probabilities")?)
        } else {
            None
        };
        let probs_ptr = match &mut probs {
            Some(p) => {
                let (ptr, _rec) = p.device_ptr_mut(self.gpu.stream());
                ptr
            }
            None => 0,
        };
        let scale = rope::softmax_scale(hp);
        let (hh, ll, rr) = (h as u32, l as u32, rd as u32);
        let cfg = LaunchConfig {
            grid_dim: ((t * h).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        launch!(
            self,
            "mla_attend_f32",
            cfg,
            &q_lat,
            &q_pe_r,
            &kv_r,
            &k_pe_r,
            &mask,
            &mut o_lat,
            &probs_ptr,
            &tt,
            &hh,
            &ll,
            &rr,
            &scale
        );
        // out[t, h, :] = o_lat[t, h, :] · W_UV[h]^T (W_UV[h] is [v, L]).
        let o_lat = self.finish(o_lat)?;
        let g = HeadGemm {
            t,
            heads: h,
            m: v,
            k: l,
            lda: l,
            ldb: h * l,
            sa: v * l,
            sb: l,
        };
        let out = self
            .head_gemm(&wv, &o_lat, &g)
            .with_context(|| format!("engine: cuda: layer {layer}: W_UV"))?;
        let probs = match probs {
            Some(p) => Some(self.tensor_f32(vec![h, t, t], self.finish(p)?)),
            None => None,
        };
        Ok((self.tensor_f32(vec![t, h * v], out), probs))
    }

    fn moe_route(&self, layer: usize, logits: &GpuTensor) -> Result<Routing<GpuTensor>> {
        let hp = self.weights.hparams();
        let (t, e) = logits.dims2("moe_logits")?;
        if e != hp.n_expert {
            bail!(
                "engine: cuda: layer {layer} router: {e} logits per token for {} experts",
                hp.n_expert
            );
        }
        if e > 512 || hp.n_expert_used > 64 || hp.groups.is_some_and(|(g, _)| g > 64) {
            bail!("engine: cuda: layer {layer} router: {e} experts, {} used, groups {:?}: the router kernel takes at most 512 experts, 64 used and 64 groups", hp.n_expert_used, hp.groups);
        }
        let k = hp.n_expert_used;
        let bias_name = names::blk(layer, blk::EXP_PROBS_B);
        let bias = if self.weights.has(&bias_name) {
            Some(self.vector(&bias_name)?)
        } else {
            None
        };
        let bias_ptr = match &bias {
            Some(b) => {
                let (p, _rec) = b.device_ptr(self.gpu.stream());
                p
            }
            None => 0,
        };
        let mut probs = self.zeros_f32(t * e, "router probabilities")?;
        let mut ids = self.gpu.alloc_zeroed::<i32>((t * k).max(1), "expert ids")?;
        let mut w = self.zeros_f32(t * k, "expert weights")?;
        let gating = match hp.gating {
            Gating::Sigmoid => 0u32,
            Gating::Softmax => 1u32,
        };
        let (n_group, used) = hp
            .groups
            .map_or((0u32, 0u32), |(g, u)| (g as u32, u as u32));
        let (tt, ee, kk, norm) = (
            t as u32,
            e as u32,
            k as u32,
            u32::from(hp.expert_weights_norm),
        );
        launch!(
            self,
            "moe_route_f32",
            items(self.gpu, t as u64),
            logits.f32("moe_logits")?,
            &bias_ptr,
            &mut probs,
            &mut ids,
            &mut w,
            &tt,
            &ee,
            &kk,
            &gating,
            &n_group,
            &used,
            &norm,
            &hp.expert_weights_scale
        );
        Ok(Routing {
            probs: self.tensor_f32(vec![t, e], probs),
            ids: GpuTensor {
                shape: vec![t, k],
                slot: self.slot,
                data: GpuData::I32(ids),
            },
            weights: self.tensor_f32(vec![t, k], w),
        })
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, GpuTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<GpuTensor>> {
        let hp = self.weights.hparams();
        let (t, hidden) = x.x.dims2("moe input")?;
        let (ti, k) = x.ids.dims2("moe_topk_ids")?;
        if ti != t || x.weights.shape != x.ids.shape {
            bail!(
                "engine: cuda: layer {layer} experts: input {:?}, ids {:?}, weights {:?} disagree",
                x.x.shape,
                x.ids.shape,
                x.weights.shape
            );
        }
        // The routing table is small ([T, K]): it comes to the host to group tokens by expert.
        let s = self.gpu.stream();
        let ids = s
            .clone_dtoh(x.ids.i32("ids")?)
            .context("engine: cuda: reading expert ids")?;
        let ws = s
            .clone_dtoh(x.weights.f32("weights")?)
            .context("engine: cuda: reading expert weights")?;
        let mut routed: Vec<Vec<(i32, f32)>> = vec![Vec::new(); hp.n_expert];
        for tok in 0..t {
            for j in 0..k {
                let e = ids[tok * k + j];
                if e < 0 || e as usize >= hp.n_expert {
                    bail!(
                        "engine: cuda: layer {layer}: token {tok} selects expert {e} of {}",
                        hp.n_expert
                    );
                }
                routed[e as usize].push((tok as i32, ws[tok * k + j]));
            }
        }
        let gate_name = names::blk(layer, blk::FFN_GATE_EXPS);
        let fused = names::blk(layer, blk::FFN_GATE_UP_EXPS);
        let up_name = names::blk(layer, blk::FFN_UP_EXPS);
        let down_name = names::blk(layer, blk::FFN_DOWN_EXPS);
        let use_fused = !self.weights.has(&gate_name) && self.weights.has(&fused);
        let ff = hp.n_ff_exp;
        let mut acc = self
            .gpu
            .alloc_zeroed::<f64>((t * hidden).max(1), "expert sum")?;
        let mut extra = Vec::new();
        let xs = x.x.f32("moe input")?;
        let hid = hidden as u32;
        for (e, toks) in routed.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let tok_ids: Vec<i32> = toks.iter().map(|p| p.0).collect();
            let tok_w: Vec<f32> = toks.iter().map(|p| p.1).collect();
            let tok_d = self.gpu.alloc_copy(&tok_ids, "expert tokens")?;
            let w_d = self.gpu.alloc_copy(&tok_w, "expert token weights")?;
            let mut xe = self.zeros_f32(n * hidden, "expert input")?;
            let nn = n as u32;
            launch!(
                self,
                "gather_rows_f32",
                items(self.gpu, (n * hidden) as u64),
                xs,
                &tok_d,
                &mut xe,
                &nn,
                &hid
            );
            let (g, u) = if use_fused {
                let base = e * 2 * ff;
                (
                    self.project(&xe, n, &fused, base..base + ff)?,
                    self.project(&xe, n, &fused, base + ff..base + 2 * ff)?,
                )
            } else {
                (
                    self.project(&xe, n, &gate_name, e * ff..(e + 1) * ff)?,
                    self.project(&xe, n, &up_name, e * ff..(e + 1) * ff)?,
                )
            };
            let mut act = self.zeros_f32(n * ff, "expert activation")?;
            let nf = (n * ff) as u64;
            launch!(
                self,
                "swiglu_f32",
                items(self.gpu, nf),
                &g,
                &u,
                &mut act,
                &nf
            );
            let act = self.finish(act)?;
            let y = self.project(&act, n, &down_name, e * hidden..(e + 1) * hidden)?;
            launch!(
                self,
                "scatter_add_f64",
                items(self.gpu, (n * hidden) as u64),
                &mut acc,
                &y,
                &tok_d,
                &w_d,
                &nn,
                &hid
            );
            if want_expert(e) {
                extra.push((e, self.tensor_f32(vec![n, hidden], y)));
            }
        }
        let mut out = self.zeros_f32(t * hidden, "moe_routed")?;
        let total = (t * hidden) as u64;
        launch!(
            self,
            "f64_to_f32",
            items(self.gpu, total),
            &acc,
            &mut out,
            &total
        );
        Ok(ExpertsOut {
            routed: self.tensor_f32(vec![t, hidden], self.finish(out)?),
            experts: extra,
        })
    }

    fn mlp(&self, x: &GpuTensor, gate: &str, up: &str, down: &str) -> Result<GpuTensor> {
        let g = self.linear(x, gate)?;
        let u = self.linear(x, up)?;
        let act = self.swiglu(&g, &u)?;
        self.linear(&act, down)
    }

    fn swiglu(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        if a.shape != b.shape {
            bail!(
                "engine: cuda: swiglu: shapes {:?} and {:?} differ",
                a.shape,
                b.shape
            );
        }
        let n: usize = a.shape.iter().product();
        let mut y = self.zeros_f32(n, "swiglu output")?;
        let nn = n as u64;
        launch!(
            self,
            "swiglu_f32",
            items(self.gpu, nn),
            a.f32("swiglu a")?,
            b.f32("swiglu b")?,
            &mut y,
            &nn
        );
        Ok(self.tensor_f32(a.shape.clone(), self.finish(y)?))
    }

    fn add(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        if a.shape != b.shape {
            bail!(
                "engine: cuda: add: shapes {:?} and {:?} differ",
                a.shape,
                b.shape
            );
        }
        let n: usize = a.shape.iter().product();
        let mut y = self.zeros_f32(n, "sum")?;
        let nn = n as u64;
        launch!(
            self,
            "add_f32",
            items(self.gpu, nn),
            a.f32("add a")?,
            b.f32("add b")?,
            &mut y,
            &nn
        );
        Ok(self.tensor_f32(a.shape.clone(), self.finish(y)?))
    }

    /// A layer's quantized weights are uploaded as its steps first read them and freed when
    /// the layer ends, so the device holds one layer (plus the embedding and output) at a time.
    fn end_layer(&self, layer: usize) -> Result<()> {
        self.forget(&format!("blk.{layer}."));
        Ok(())
    }

    fn zeros_like(&self, x: &GpuTensor) -> Result<GpuTensor> {
        let n: usize = x.shape.iter().product();
        Ok(self.tensor_f32(x.shape.clone(), self.zeros_f32(n, "zeros")?))
    }
}
