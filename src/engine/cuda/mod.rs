//! The CUDA engine: every step of the forward pass on one GPU, behind the same [`Engine`] trait
//! as the CPU reference, so that `glmdiff run --against cuda` compares the two step by step.
//!
//! What it does the way serving engines do:
//! - weights stay as their raw GGUF blocks on the device (uploaded once per tensor, the next
//!   layer's while the current one runs: `prefetch`) and are dequantized per step into scratch
//!   by the bit-exact kernels of `cuda/dequant*.cu`, a chunk of rows at a time, then multiplied
//!   with cuBLAS SGEMM (pedantic math: no TF32);
//! - only the experts a step routes to are dequantized (a stacked expert tensor is read as one
//!   expert's row range of its raw bytes), and at short prompts only those are uploaded, after
//!   the router (`routed`);
//! - MLA runs in the *absorbed* form: `W_UK` folded into the query (`q_lat = q_nope · W_UK`),
//!   attention over the latent `c_kv` and `k_pe`, `W_UV` applied after, the form whose kernels
//!   broke on a new GPU in the field; the reference stays naive, so a run compares the two forms.
//!
//! Everything but the projections runs in `cuda/forward.cu`: norms, RoPE, the DSA indexer and
//! top-k, the attention core, the router, SwiGLU, gathers and the weighted expert sum. Its
//! reductions accumulate in f64 like the reference; GEMMs accumulate in f32, so the engine's
//! precision is `f32 storage, f32 accumulation` and `run` judges it against the f32 floors.
//! The engine never prints; errors name the step, the tensor and the shapes.
//!
//! Rooms: `tensor` (device tensors, launch configurations, the `launch!` macro), `gemm`
//! (cuBLAS and the chunked projections), `weights` (raw-block residency, dequantization into
//! scratch), `prefetch` (the next layer's raw blocks uploaded behind the current one), `routed`
//! (the routed experts' rows uploaded by expert at short prompts),
//! `attention` (RoPE, the DSA indexer, MLA), `moe` (router, experts, SwiGLU); this file holds
//! the engine and its [`Engine`] implementation, which delegates to them; [`multi`] spreads the
//! layers over several devices.

mod attention;
mod gemm;
mod moe;
pub mod multi;
mod prefetch;
mod routed;
mod tensor;
mod weights;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasSetMathMode, cublasStatus_t};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaSlice;

use super::{
    Engine, ExpertInputs, ExpertsOut, HostData, HostTensor, MlaInputs, Routing, UploadStats,
};
use crate::gpu::dequant::{dequant_family, kernel_stem, OutFormat};
use crate::gpu::Gpu;
use crate::model::names::{self, blk};
use crate::model::{rope, RopeSlice, Weights};
use crate::precision::{Dtype, Precision};
use tensor::{items, launch, rows_cfg, GpuData};

pub use prefetch::{
    prefetch_by_default, set_prefetch_by_default, PrefetchSummary, PREFETCH_RESERVE,
};
pub use routed::{
    expected_routed_share, expert_uploads_by_default, set_expert_uploads_by_default, ExpertUploads,
    ROUTED_SHARE_MAX,
};
pub use tensor::GpuTensor;

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
    /// The engine's precision in this mode: the floors read its storage and accumulation (and
    /// in bf16 mode its router's, f32 with an f32 matrix by the rule of
    /// `Engine::router_logits`); its note says how the GEMMs and attention run.
    pub fn precision(self) -> Precision {
        match self {
            GpuDtype::F32 => Precision::new(Dtype::F32, Dtype::F32)
                .with_note("cuBLAS SGEMM, pedantic math: no TF32; absorbed MLA"),
            GpuDtype::Bf16 => Precision::new(Dtype::Bf16, Dtype::F32)
                .with_router(Dtype::F32, Dtype::F32)
                .with_note("cuBLAS bf16 GEMM on tensor cores; absorbed MLA"),
        }
    }
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
    raw: RefCell<HashMap<String, Arc<CudaSlice<u8>>>>,
    /// f32 vectors (norm weights, biases) uploaded so far, by name.
    vectors: RefCell<HashMap<String, Rc<CudaSlice<f32>>>>,
    /// The next layer's raw blocks on their way ([`prefetch`]).
    prefetch: RefCell<prefetch::Prefetch>,
    /// How stacked expert tensors reach the device ([`routed`]).
    expert_uploads: ExpertUploads,
    /// The tokens of the last prompt embedded or routed (what `auto` expert uploads go by).
    tokens: Cell<Option<usize>>,
    /// The experts of stacked tensors put on the device by expert ([`routed`]).
    routed: RefCell<routed::RoutedIndex>,
    /// Weight uploads since the driver last asked ([`Engine::take_upload_stats`]).
    upload_stats: Cell<UploadStats>,
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
        // Its kernel families compile now, side by side and beside the caller's work until
        // their first launch (a cold cache costs seconds each): the forward kernels and the
        // dequant families of the model's types.
        let mut families = vec![("forward", crate::gpu::FORWARD_SOURCE)];
        for t in weights.model().tensors() {
            if let Some(stem) = kernel_stem(t.info.ty) {
                let f = dequant_family(stem);
                if !families.contains(&f) {
                    families.push(f);
                }
            }
        }
        gpu.compile_ahead(&families);
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
            prefetch: RefCell::new(prefetch::Prefetch::new(prefetch::prefetch_by_default())),
            expert_uploads: routed::expert_uploads_by_default(),
            tokens: Cell::new(None),
            routed: RefCell::new(HashMap::new()),
            upload_stats: Cell::new(UploadStats::default()),
        })
    }

    /// The same engine as device `slot` of a several-device run.
    pub fn with_slot(mut self, slot: usize) -> CudaEngine<'w> {
        self.slot = slot;
        self
    }

    /// Counts `bytes` of weights put in place, and the time since `t0` spent on it.
    fn count_upload(&self, t0: Instant, bytes: usize) {
        let mut s = self.upload_stats.get();
        s += UploadStats {
            wait: t0.elapsed().as_secs_f64(),
            bytes: bytes as u64,
        };
        self.upload_stats.set(s);
    }
}

impl Engine for CudaEngine<'_> {
    type Tensor = GpuTensor;

    fn describe(&self) -> String {
        format!("cuda:{} {}", self.gpu.info.ordinal, self.gpu.describe())
    }

    fn precision(&self) -> Precision {
        self.dtype.precision()
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

    /// The prompt's rows of the table gathered on the host (raw blocks, in token order), one
    /// upload, one dequant launch over them: the table itself never goes to the device.
    fn embed(&self, ids: &[u32]) -> Result<GpuTensor> {
        let name = names::TOKEN_EMBD;
        let (n_vocab, hidden) = self.weights.matrix_dims(name)?;
        if let Some((i, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= n_vocab)
        {
            bail!("engine: cuda: token id {id} at position {i} is outside the vocabulary of {n_vocab}");
        }
        self.tokens.set(Some(ids.len()));
        let n = ids.len() * hidden;
        let mut out = self.zeros_f32(n, "embedding")?;
        if n > 0 {
            let t0 = Instant::now();
            let rows = self.weights.embedding_rows_desc(ids)?;
            let mut bytes =
                Vec::with_capacity(rows.iter().map(|r| r.n_rows() * r.row_bytes()).sum());
            for r in &rows {
                bytes.extend_from_slice(
                    r.data()
                        .with_context(|| format!("engine: cuda: reading {name}"))?,
                );
            }
            let raw = self.gpu.alloc_copy(&bytes, "embedding rows")?;
            self.count_upload(t0, bytes.len());
            let ty = self.weights.tensor(name)?.info.ty;
            self.gpu
                .dequant_view(ty, OutFormat::F32, &raw.as_view(), &mut out.slice_mut(0..n))
                .with_context(|| {
                    format!("engine: cuda: dequantizing {} rows of {name}", ids.len())
                })?;
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
        self.linear_as(x, weight, self.dtype)
    }

    /// In f32 in bf16 mode too (the trait's precision rule).
    fn router_logits(&self, layer: usize, x: &GpuTensor) -> Result<GpuTensor> {
        self.linear_as(x, &names::blk(layer, blk::FFN_GATE_INP), GpuDtype::F32)
    }

    fn rope(&self, x: &GpuTensor, s: &RopeSlice) -> Result<GpuTensor> {
        self.rope_gpu(x, s)
    }

    fn indexer_scores(&self, layer: usize, a: &GpuTensor, cq: &GpuTensor) -> Result<GpuTensor> {
        self.indexer_scores_gpu(layer, a, cq)
    }

    fn top_k(&self, scores: &GpuTensor, k: usize) -> Result<GpuTensor> {
        self.top_k_gpu(scores, k)
    }

    fn mla_attention(
        &self,
        layer: usize,
        x: MlaInputs<'_, GpuTensor>,
        want_probs: bool,
    ) -> Result<(GpuTensor, Option<GpuTensor>)> {
        self.mla_gpu(layer, x, want_probs)
    }

    fn moe_route(&self, layer: usize, logits: &GpuTensor) -> Result<Routing<GpuTensor>> {
        self.moe_route_gpu(layer, logits)
    }

    fn moe_experts(
        &self,
        layer: usize,
        x: ExpertInputs<'_, GpuTensor>,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<GpuTensor>> {
        self.moe_experts_gpu(layer, x, want_expert)
    }

    fn mlp(&self, x: &GpuTensor, gate: &str, up: &str, down: &str) -> Result<GpuTensor> {
        let g = self.linear(x, gate)?;
        let u = self.linear(x, up)?;
        let act = self.swiglu(&g, &u)?;
        self.linear(&act, down)
    }

    fn swiglu(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        self.swiglu_gpu(a, b)
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

    /// Prefetches of other layers are dropped (see [`prefetch`]).
    fn begin_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        // The routed experts offered to the reference stay for the layer before this one too
        // (the reference may still be in it).
        crate::gpu::resident::keep_around(layer);
        let whole = self.whole_tensors(weights);
        self.prefetch.borrow_mut().begin(layer, &whole);
        Ok(())
    }

    /// A layer's quantized weights are uploaded as its steps first read them (or taken from
    /// their prefetch) and freed when the layer ends, so the device holds the current layer
    /// and the next one's prefetch (plus the output projection) at a time.
    fn end_layer(&self, layer: usize) -> Result<()> {
        self.forget(&format!("blk.{layer}."));
        self.prefetch.borrow_mut().end(layer);
        Ok(())
    }

    /// Starts the uploads of the layer's raw blocks behind the current layer's work (see
    /// [`prefetch`]); never an error.
    fn prefetch_layer(&self, layer: usize, weights: &[String]) -> Result<()> {
        let t0 = Instant::now();
        // The stacked expert tensors of a step that routes few tokens are uploaded by expert,
        // after its router (`routed`).
        self.prefetch_tensors(layer, &self.whole_tensors(weights));
        self.count_upload(t0, 0);
        Ok(())
    }

    fn take_upload_stats(&self) -> UploadStats {
        self.upload_stats.take()
    }

    fn offer_uploads(&self) -> bool {
        self.offer_arrived()
    }

    fn zeros_like(&self, x: &GpuTensor) -> Result<GpuTensor> {
        let n: usize = x.shape.iter().product();
        Ok(self.tensor_f32(x.shape.clone(), self.zeros_f32(n, "zeros")?))
    }
}

#[cfg(test)]
mod tests {
    use super::GpuDtype;
    use crate::precision::Dtype;

    /// Both modes' precisions: what the floors read, and the prose that trace metadata and
    /// reports have always carried (no GPU needed).
    #[test]
    fn gpu_precisions_and_their_prose() {
        let f32p = GpuDtype::F32.precision();
        assert_eq!((f32p.storage, f32p.accumulate), (Dtype::F32, Dtype::F32));
        assert_eq!(
            f32p.to_string(),
            "f32 storage, f32 accumulation (cuBLAS SGEMM, pedantic math: no TF32; absorbed MLA)"
        );
        let bf16 = GpuDtype::Bf16.precision();
        assert_eq!((bf16.storage, bf16.accumulate), (Dtype::Bf16, Dtype::F32));
        assert!(!f32p.q8_activations && !bf16.q8_activations);
        assert_eq!(
            bf16.router.map(|r| (r.compute, r.matrix)),
            Some((Dtype::F32, Dtype::F32))
        );
        assert_eq!(
            bf16.to_string(),
            "bf16 storage, f32 accumulation, f32 router (cuBLAS bf16 GEMM on tensor cores; absorbed MLA)"
        );
    }
}
