//! Weight residency: the raw GGUF blocks of each tensor uploaded once (or taken from its
//! prefetch) and kept on the device by name (freed a layer at a time by `end_layer`), the f32 vectors (norm weights, biases), the
//! dequantization of a row range into scratch, and the absorbed MLA weights `W_UK`, `W_UV`.

use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr};

use super::tensor::{items, launch};
use super::CudaEngine;
use crate::gpu::dequant::OutFormat;
use crate::model::names::{self, blk};

impl CudaEngine<'_> {
    /// Frees the device copies of every tensor whose name starts with `prefix` (e.g. `blk.3.`).
    pub fn forget(&self, prefix: &str) {
        self.raw.borrow_mut().retain(|k, _| !k.starts_with(prefix));
        self.routed
            .borrow_mut()
            .retain(|k, _| !k.starts_with(prefix));
        self.vectors
            .borrow_mut()
            .retain(|k, _| !k.starts_with(prefix));
    }

    /// The raw blocks of tensor `name` on the device: taken from its prefetch, or uploaded on
    /// first use; the time and bytes are counted as the engine's weight uploads.
    pub(super) fn raw(&self, name: &str) -> Result<Arc<CudaSlice<u8>>> {
        if let Some(r) = self.raw.borrow().get(name) {
            return Ok(r.clone());
        }
        let t0 = Instant::now();
        let d = match self.take_prefetched(name) {
            Some(d) => d,
            None => {
                let bytes = self
                    .weights
                    .tensor_desc(name)?
                    .data()
                    .with_context(|| format!("engine: cuda: reading {name}"))?;
                self.gpu.alloc_copy(bytes, name)?
            }
        };
        self.count_upload(t0, d.len());
        let d = Arc::new(d);
        self.raw.borrow_mut().insert(name.to_string(), d.clone());
        self.offer_tensor(name, &d);
        Ok(d)
    }

    /// Offers the raw blocks of a layer's tensor `name`, held whole in `buf`, to the
    /// reference's products on this device (`gpu::resident`, `--reference-reuse`), by the
    /// tensor's file span.
    fn offer_tensor(&self, name: &str, buf: &Arc<CudaSlice<u8>>) {
        if !crate::gpu::resident::reuse() {
            return;
        }
        let Some((layer, _)) = names::split_blk(name) else {
            return;
        };
        let Ok(desc) = self.weights.tensor_desc(name) else {
            return;
        };
        let Ok(Some((path, offset, len))) = desc.file_range() else {
            return;
        };
        crate::gpu::resident::offer(
            layer,
            crate::gpu::resident::FileSpan {
                path: path.to_path_buf(),
                offset,
                len,
            },
            crate::gpu::resident::OnDevice {
                ordinal: self.gpu.info.ordinal,
                buf: buf.clone(),
                at: 0,
            },
        );
    }

    /// Rows `rows` (of the tensor's `ne[1]*ne[2]...` rows of `ne[0]` values) of `name`,
    /// dequantized to f32 into `dst` (`rows.len() * ne[0]` values).
    pub(super) fn dequant_rows(
        &self,
        name: &str,
        rows: Range<usize>,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.dequant_rows_as(name, rows, OutFormat::F32, dst)
    }

    /// The same into `format`'s values (f32, or bf16 / f16 bit patterns).
    pub(super) fn dequant_rows_as<T: DeviceRepr>(
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
        // An expert's rows uploaded by expert (`routed`), else the whole tensor's raw blocks.
        let (raw, at) = match self.routed_rows(name, &rows, row_bytes)? {
            Some(held) => held,
            None => (self.raw(name)?, rows.start * row_bytes),
        };
        let view = raw.slice(at..at + rows.len() * row_bytes);
        self.gpu
            .dequant_view(ty, format, &view, dst)
            .with_context(|| format!("engine: cuda: dequantizing {name} rows {rows:?}"))
    }

    /// A 1-D weight as f32 on the device.
    pub(super) fn vector(&self, name: &str) -> Result<Rc<CudaSlice<f32>>> {
        if let Some(v) = self.vectors.borrow().get(name) {
            return Ok(v.clone());
        }
        let t0 = Instant::now();
        let host = self.weights.vector_desc(name)?.dequantize()?;
        let d = Rc::new(self.gpu.alloc_copy(&host, name)?);
        self.count_upload(t0, std::mem::size_of_val(host.as_slice()));
        self.vectors
            .borrow_mut()
            .insert(name.to_string(), d.clone());
        Ok(d)
    }

    /// The absorbed MLA weights of `layer` on the device: `wk [H, L, nope]` (`attn_k_b`) and
    /// `wv [H, v, L]` (`attn_v_b`), from the split tensors or the legacy `attn_kv_b`.
    pub(super) fn mla_weights(&self, layer: usize) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
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
