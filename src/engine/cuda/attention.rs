//! Attention on the GPU: RoPE, the DSA lightning indexer (scores and causal top-k) and MLA in the
//! absorbed form (`q_lat = q_nope · W_UK`, attention over the latent `c_kv` and `k_pe`, `W_UV`
//! after).

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::gemm::HeadGemm;
use super::tensor::{items, launch, rows_cfg, GpuData, THREADS};
use super::{CudaEngine, GpuTensor};
use crate::engine::MlaInputs;
use crate::model::hparams::INDEXER_K_NORM_EPS;
use crate::model::names::{self, blk};
use crate::model::{rope, RopeSlice};

/// Longest row `topk_rows_sort_f32` sorts (its keys' indices fit the low half of a key with
/// room to spare; 2^14 keys take 128 KiB of shared memory).
const SORT_MAX_KEYS: usize = 1 << 14;

impl CudaEngine<'_> {
    /// Lets kernel `name` of the forward family have `bytes` of dynamic shared memory a block
    /// ([`crate::gpu::Gpu::opt_in_shared`]).
    fn opt_in_shared(&self, name: &str, bytes: usize) -> Result<std::result::Result<(), usize>> {
        self.gpu
            .opt_in_shared("forward", crate::gpu::FORWARD_SOURCE, name, bytes)
    }

    /// The `rope` step: interleaved RoPE of `s.heads` heads of `x` into a new tensor.
    pub(super) fn rope_gpu(&self, x: &GpuTensor, s: &RopeSlice) -> Result<GpuTensor> {
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

    /// The `indexer_scores` step: DSA index scores `[T, T]` of `layer`.
    pub(super) fn indexer_scores_gpu(
        &self,
        layer: usize,
        a: &GpuTensor,
        cq: &GpuTensor,
    ) -> Result<GpuTensor> {
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

    /// The `top_k` step: each row's `k` best causal keys `[T, min(k, T)]`.
    pub(super) fn top_k_gpu(&self, scores: &GpuTensor, k: usize) -> Result<GpuTensor> {
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
        // Rows sorted in shared memory (their power of two of 8-byte keys) where a block may
        // hold the longest; else one thread a row, k passes over it.
        let smem = t.next_power_of_two() * 8;
        if t <= SORT_MAX_KEYS && self.opt_in_shared("topk_rows_sort_f32", smem)?.is_ok() {
            launch!(
                self,
                "topk_rows_sort_f32",
                rows_cfg(t, smem as u32),
                scores.f32("scores")?,
                &mut out,
                &tt,
                &kk,
                &ww
            );
        } else {
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
        }
        Ok(GpuTensor {
            shape: vec![t, width],
            slot: self.slot,
            data: GpuData::I32(out),
        })
    }

    /// The `mla_attention` step in the absorbed form, with the probabilities `[H, T, T]` when
    /// `want_probs`.
    pub(super) fn mla_gpu(
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
        // One row of scores in shared memory: past the default 48 KiB (6144 tokens) the kernel
        // opts in to what the device allows a block (227 KiB on sm_90: 29056 tokens; 99 KiB on
        // sm_120).
        let smem = t * 8;
        if let Err(most) = self.opt_in_shared("mla_attend_f32", smem)? {
            bail!(
                "engine: cuda: layer {layer} attention: {t} tokens need {smem} bytes of shared memory for one row of scores; {} allows {most} a block (at most {} tokens)",
                self.gpu.info,
                most / 8
            );
        }
        let smem = smem as u32;
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
}
