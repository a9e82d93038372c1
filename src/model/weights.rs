//! Typed access to a model's weights by GGUF tensor name, dequantized to f32 on demand and only
//! as far as asked: embedding rows of the prompt's tokens, row ranges of big matrices, one
//! expert's slice of a stacked `ffn_*_exps` tensor. Every access checks the tensor's dimensions
//! against [`names::expected_ne`] and names tensor, expected and actual shapes when they differ.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde::Serialize;

use super::hparams::HParams;
use super::names::{self, blk};
use crate::gguf::{Model, TensorRef};
use crate::quant;

/// Values per parallel task when [`Weights`] dequantizes a whole tensor or row range while
/// counting (the same work split as `quant::dequantize_par`, each task timed on its thread).
const COUNTED_TASK_ELEMS: usize = 1 << 16;

/// Measures the CPU time of the calling thread (Linux `CLOCK_THREAD_CPUTIME_ID`: time the thread
/// ran, not time it waited while preempted), or wall time where that clock is unavailable.
#[derive(Clone, Copy, Debug)]
pub struct ThreadTimer {
    cpu_ns: Option<u64>,
    wall: Instant,
}

impl ThreadTimer {
    /// Starts measuring.
    pub fn start() -> ThreadTimer {
        ThreadTimer {
            cpu_ns: thread_cpu_ns(),
            wall: Instant::now(),
        }
    }

    /// Nanoseconds of CPU time of this thread since [`ThreadTimer::start`] (wall time when the
    /// CPU clock is unavailable). Call it on the thread that started the timer.
    pub fn elapsed_ns(&self) -> u64 {
        match (self.cpu_ns, thread_cpu_ns()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => self.wall.elapsed().as_nanos() as u64,
        }
    }
}

/// CPU time of the calling thread, nanoseconds (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`).
#[cfg(target_os = "linux")]
fn thread_cpu_ns() -> Option<u64> {
    use std::os::raw::{c_int, c_long};
    /// `struct timespec` of the Linux C ABIs (`time_t` and `long` are both `long`).
    #[repr(C)]
    struct Timespec {
        tv_sec: c_long,
        tv_nsec: c_long,
    }
    extern "C" {
        fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int;
    }
    /// `CLOCK_THREAD_CPUTIME_ID` of `<linux/time.h>`.
    const CLOCK_THREAD_CPUTIME_ID: c_int = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime (libc, linked by std) writes one `struct timespec`, whose layout
    // `Timespec` reproduces, through a pointer to a live local; it keeps no reference to it.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// No thread CPU clock: [`ThreadTimer`] measures wall time.
#[cfg(not(target_os = "linux"))]
fn thread_cpu_ns() -> Option<u64> {
    None
}

/// Counters of the work done on a model's weights, shared by every thread: relaxed atomic adds
/// and two reads of the thread CPU clock per task of up to 64 Ki values (a system call each,
/// about 0.6 us on the reference VM: a few percent of a task, paid only when counting).
///
/// - dequantization: thread CPU nanoseconds inside the dequantizers ([`ThreadTimer`], summed
///   over rayon's threads, so with N busy threads it grows up to N times faster than the wall
///   clock), calls, quantized bytes read, f32 values produced;
/// - matmul arithmetic: thread CPU nanoseconds in the dot products that consume dequantized
///   rows (CPU engine matmuls against weights) and their multiply-adds.
///
/// Filled only for a [`Weights`] made with [`Weights::with_stats`]; values never change.
#[derive(Debug, Default)]
pub struct WeightStats {
    dequant_ns: AtomicU64,
    dequant_calls: AtomicU64,
    bytes_in: AtomicU64,
    values_out: AtomicU64,
    matmul_ns: AtomicU64,
    madds: AtomicU64,
}

/// A snapshot of [`WeightStats`] (or the difference of two).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WeightCounts {
    /// Thread-nanoseconds spent dequantizing.
    pub dequant_ns: u64,
    /// Dequantization calls (tasks).
    pub dequant_calls: u64,
    /// Quantized bytes read.
    pub bytes_in: u64,
    /// f32 values produced.
    pub values_out: u64,
    /// Thread-nanoseconds in weight matmul dot products.
    pub matmul_ns: u64,
    /// Multiply-adds of those dot products.
    pub madds: u64,
}

impl WeightCounts {
    /// The counts accumulated since `earlier`.
    pub fn since(&self, earlier: &WeightCounts) -> WeightCounts {
        WeightCounts {
            dequant_ns: self.dequant_ns.saturating_sub(earlier.dequant_ns),
            dequant_calls: self.dequant_calls.saturating_sub(earlier.dequant_calls),
            bytes_in: self.bytes_in.saturating_sub(earlier.bytes_in),
            values_out: self.values_out.saturating_sub(earlier.values_out),
            matmul_ns: self.matmul_ns.saturating_sub(earlier.matmul_ns),
            madds: self.madds.saturating_sub(earlier.madds),
        }
    }
}

impl WeightStats {
    /// The current counts.
    pub fn snapshot(&self) -> WeightCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WeightCounts {
            dequant_ns: r(&self.dequant_ns),
            dequant_calls: r(&self.dequant_calls),
            bytes_in: r(&self.bytes_in),
            values_out: r(&self.values_out),
            matmul_ns: r(&self.matmul_ns),
            madds: r(&self.madds),
        }
    }

    /// Records one dequantization call timed by `timer` (started on this thread).
    pub fn add_dequant(&self, timer: &ThreadTimer, bytes_in: usize, values_out: usize) {
        let ns = timer.elapsed_ns();
        self.dequant_ns.fetch_add(ns, Ordering::Relaxed);
        self.dequant_calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_in.fetch_add(bytes_in as u64, Ordering::Relaxed);
        self.values_out
            .fetch_add(values_out as u64, Ordering::Relaxed);
    }

    /// Records dot products of `madds` multiply-adds timed by `timer` (started on this thread).
    pub fn add_matmul(&self, timer: &ThreadTimer, madds: usize) {
        let ns = timer.elapsed_ns();
        self.matmul_ns.fetch_add(ns, Ordering::Relaxed);
        self.madds.fetch_add(madds as u64, Ordering::Relaxed);
    }
}

/// A dense f32 matrix, row-major: `data[r * cols + c]`, PyTorch shape `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Number of rows (output features of a linear layer).
    pub rows: usize,
    /// Number of columns (input features; GGUF `ne[0]`).
    pub cols: usize,
    /// `rows * cols` values.
    pub data: Vec<f32>,
}

impl Matrix {
    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A range of rows of a GGUF matrix (a 2-D tensor, or one expert's slice of a stacked 3-D one)
/// that dequantizes any sub-range of its rows into a caller's buffer, straight from the map.
/// Rows are whole quant blocks (`ne[0]` is a multiple of the block size), so any row range is
/// block-aligned; the values equal those of [`Model::dequantize_rows`].
#[derive(Clone, Copy)]
pub struct RowSource<'m> {
    model: &'m Model,
    t: TensorRef<'m>,
    first: u64,
    stats: Option<&'m WeightStats>,
    /// Rows of this source.
    pub rows: usize,
    /// Values per row (`ne[0]`).
    pub cols: usize,
}

impl<'m> RowSource<'m> {
    /// The tensor's GGUF name.
    pub fn name(&self) -> &str {
        &self.t.info.name
    }

    /// The counters this source reports to, if any (see [`Weights::with_stats`]).
    pub fn stats(&self) -> Option<&'m WeightStats> {
        self.stats
    }

    /// Dequantizes rows `rows` (relative to this source) into `dst` (`rows.len() * cols` values),
    /// on the calling thread.
    pub fn dequantize_into(&self, rows: Range<usize>, dst: &mut [f32]) -> Result<()> {
        if rows.end > self.rows || dst.len() != rows.len() * self.cols {
            bail!(
                "model: {}: tensor {}: rows {rows:?} of {} into {} values",
                self.model.path().display(),
                self.t.info.name,
                self.rows,
                dst.len()
            );
        }
        let bytes = self.model.row_data(
            self.t,
            self.first + rows.start as u64..self.first + rows.end as u64,
        )?;
        let timer = self.stats.map(|_| ThreadTimer::start());
        quant::dequantize(self.t.info.ty, bytes, dst).with_context(|| {
            format!(
                "model: {}: tensor {}",
                self.model.path().display(),
                self.t.info.name
            )
        })?;
        if let (Some(s), Some(timer)) = (self.stats, timer) {
            s.add_dequant(&timer, bytes.len(), dst.len());
        }
        Ok(())
    }
}

/// The weights of one opened model, with its hyperparameters.
pub struct Weights<'m> {
    model: &'m Model,
    hp: HParams,
    n_vocab: usize,
    output: &'static str,
    stats: Option<&'m WeightStats>,
}

impl<'m> Weights<'m> {
    /// Reads the hyperparameters of `model` and checks the embedding and output tensors.
    /// `output.weight` absent means the output projection is `token_embd.weight` (tied).
    pub fn new(model: &'m Model) -> Result<Weights<'m>> {
        let hp = HParams::from_model(model)?;
        let all = model.tensors().map(|t| t.info.name.as_str());
        if let Some(name) = names::unknown_layer_tensor(&hp, all) {
            bail!(
                "model: {}: tensor {name} is not part of the {} forward pass (a bias or weight it has no term for, \
                 e.g. from a config with attention_bias = true); ignoring it would compute a different model",
                model.path().display(),
                hp.arch.as_str()
            );
        }
        check_dense_layers(model, &hp)?;
        let emb = model.tensor(names::TOKEN_EMBD)?;
        if emb.info.ne.len() != 2 || emb.info.ne[0] != hp.hidden as u64 {
            bail!(
                "model: {}: tensor {} has ne={:?}, expected [{}, n_vocab] (embedding_length = {})",
                model.path().display(),
                names::TOKEN_EMBD,
                emb.info.ne,
                hp.hidden,
                hp.hidden
            );
        }
        let n_vocab = emb.info.ne[1] as usize;
        let output = if model.find(names::OUTPUT).is_some() {
            names::OUTPUT
        } else {
            names::TOKEN_EMBD
        };
        let w = Weights {
            model,
            hp,
            n_vocab,
            output,
            stats: None,
        };
        w.tensor(output)?;
        Ok(w)
    }

    /// Like [`Weights::new`], and every dequantization and weight matmul (CPU engine) through
    /// these weights is counted in `stats`.
    pub fn with_stats(model: &'m Model, stats: &'m WeightStats) -> Result<Weights<'m>> {
        let mut w = Weights::new(model)?;
        w.stats = Some(stats);
        Ok(w)
    }

    /// The counters, when made with [`Weights::with_stats`].
    pub fn stats(&self) -> Option<&'m WeightStats> {
        self.stats
    }

    /// Rows `rows` of tensor `t` to f32, as [`Model::dequantize_rows`]. When counting, the same
    /// per-block dequantizers run in parallel tasks of [`COUNTED_TASK_ELEMS`] values, each timed
    /// on its thread (the values are the same: every block dequantizes independently).
    fn dequantize_rows(&self, t: TensorRef<'m>, rows: Range<u64>) -> Result<Vec<f32>> {
        if self.stats.is_none() {
            return self.model.dequantize_rows(t, rows);
        }
        let n = rows.end.saturating_sub(rows.start) as usize;
        let src = self.source(t, rows.start, n)?;
        let per_task = (COUNTED_TASK_ELEMS / src.cols.max(1)).max(1);
        let mut out = vec![0f32; n * src.cols]; // [n, cols]
        out.par_chunks_mut(per_task * src.cols.max(1))
            .enumerate()
            .try_for_each(|(i, d)| {
                let r0 = i * per_task;
                src.dequantize_into(r0..r0 + d.len() / src.cols.max(1), d)
            })?;
        Ok(out)
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &HParams {
        &self.hp
    }

    /// The underlying model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Vocabulary size (rows of `token_embd.weight`).
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Name of the output projection: `output.weight`, or `token_embd.weight` when tied.
    pub fn output_name(&self) -> &'static str {
        self.output
    }

    /// Whether the model has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.model.find(name).is_some()
    }

    /// Tensor `name`, its dimensions checked against the architecture's table.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'m>> {
        let t = self.model.tensor(name)?;
        if let Some(want) = names::expected_ne(&self.hp, self.n_vocab, name) {
            if t.info.ne != want {
                let torch = |ne: &[u64]| ne.iter().rev().copied().collect::<Vec<_>>();
                bail!(
                    "model: {}: tensor {name} has ne={:?} (PyTorch {:?}), expected ne={want:?} (PyTorch {:?}) from the {} hyperparameters",
                    self.model.path().display(),
                    t.info.ne,
                    t.info.shape(),
                    torch(&want),
                    self.hp.arch.as_str()
                );
            }
        }
        Ok(t)
    }

    fn source(&self, t: TensorRef<'m>, first: u64, rows: usize) -> Result<RowSource<'m>> {
        if self.model.shards()[t.shard].is_big_endian() && t.info.ty.type_size() > 1 {
            bail!(
                "model: {}: tensor {}: big-endian tensor data is not supported",
                self.model.path().display(),
                t.info.name
            );
        }
        Ok(RowSource {
            model: self.model,
            t,
            first,
            stats: self.stats,
            rows,
            cols: t.info.ne[0] as usize,
        })
    }

    /// All rows of the 2-D tensor `name`, to be dequantized on demand.
    pub fn rows(&self, name: &str) -> Result<RowSource<'m>> {
        let (rows, _) = self.matrix_dims(name)?;
        self.source(self.tensor(name)?, 0, rows)
    }

    /// Expert `e`'s rows of a stacked 3-D tensor (`ne = [cols, rows, n_expert]`).
    pub fn expert_rows(&self, name: &str, e: usize) -> Result<RowSource<'m>> {
        let t = self.tensor(name)?;
        let ne = &t.info.ne;
        if ne.len() != 3 || e as u64 >= ne[2] {
            bail!(
                "model: {}: tensor {name} (ne={ne:?}): expected [cols, rows, n_expert] and expert {e} < n_expert",
                self.model.path().display()
            );
        }
        let rows = ne[1] as usize;
        self.source(t, (e * rows) as u64, rows)
    }

    /// Expert `e`'s gate and up rows of layer `layer` (`[n_ff_exp, hidden]` each), from
    /// `ffn_gate_exps`/`ffn_up_exps` or the fused `ffn_gate_up_exps` (per expert, gate rows then
    /// up rows, as llama.cpp's `build_moe_ffn` splits it).
    pub fn expert_gate_up_rows(
        &self,
        layer: usize,
        e: usize,
    ) -> Result<(RowSource<'m>, RowSource<'m>)> {
        let gate = names::blk(layer, blk::FFN_GATE_EXPS);
        let fused = names::blk(layer, blk::FFN_GATE_UP_EXPS);
        if self.has(&gate) || !self.has(&fused) {
            return Ok((
                self.expert_rows(&gate, e)?,
                self.expert_rows(&names::blk(layer, blk::FFN_UP_EXPS), e)?,
            ));
        }
        let both = self.expert_rows(&fused, e)?;
        let half = both.rows / 2;
        let gate = RowSource { rows: half, ..both };
        let up = RowSource {
            rows: half,
            first: both.first + half as u64,
            ..both
        };
        Ok((gate, up))
    }

    /// A 1-D tensor (norm weight, bias).
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        if t.info.ne.len() != 1 {
            bail!(
                "model: {}: tensor {name} has ne={:?}, expected one dimension",
                self.model.path().display(),
                t.info.ne
            );
        }
        self.dequantize_rows(t, 0..t.info.n_rows())
    }

    /// `(rows, cols)` of a 2-D tensor: rows = output features, cols = `ne[0]`.
    pub fn matrix_dims(&self, name: &str) -> Result<(usize, usize)> {
        let t = self.tensor(name)?;
        if t.info.ne.len() != 2 {
            bail!(
                "model: {}: tensor {name} has ne={:?}, expected a matrix (two dimensions)",
                self.model.path().display(),
                t.info.ne
            );
        }
        Ok((t.info.ne[1] as usize, t.info.ne[0] as usize))
    }

    /// Rows `rows` of a 2-D tensor.
    pub fn matrix_rows(&self, name: &str, rows: Range<usize>) -> Result<Matrix> {
        let (n_rows, cols) = self.matrix_dims(name)?;
        if rows.start > rows.end || rows.end > n_rows {
            bail!(
                "model: {}: tensor {name}: rows {}..{} out of range 0..{n_rows}",
                self.model.path().display(),
                rows.start,
                rows.end
            );
        }
        let t = self.tensor(name)?;
        let data = self.dequantize_rows(t, rows.start as u64..rows.end as u64)?;
        Ok(Matrix {
            rows: rows.len(),
            cols,
            data,
        })
    }

    /// A whole 2-D tensor.
    pub fn matrix(&self, name: &str) -> Result<Matrix> {
        let (rows, _) = self.matrix_dims(name)?;
        self.matrix_rows(name, 0..rows)
    }

    /// Embedding rows of `ids`: `[ids.len(), hidden]`. Ids out of range are an error.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Matrix> {
        let t = self.tensor(names::TOKEN_EMBD)?;
        let hidden = self.hp.hidden;
        let mut data = Vec::with_capacity(ids.len() * hidden);
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= self.n_vocab {
                bail!(
                    "model: token {i} has id {id}, outside the vocabulary 0..{} of {}",
                    self.n_vocab,
                    self.model.file_name()
                );
            }
            data.extend(self.dequantize_rows(t, id as u64..id as u64 + 1)?);
        }
        Ok(Matrix {
            rows: ids.len(),
            cols: hidden,
            data,
        })
    }

    /// Expert `e`'s matrix of a stacked 3-D tensor (`ne = [cols, rows, n_expert]`): rows
    /// `e*rows..(e+1)*rows` of the tensor, nothing else dequantized.
    pub fn expert(&self, name: &str, e: usize) -> Result<Matrix> {
        let t = self.tensor(name)?;
        let ne = &t.info.ne;
        if ne.len() != 3 || e as u64 >= ne[2] {
            bail!(
                "model: {}: tensor {name} (ne={ne:?}): expected [cols, rows, n_expert] and expert {e} < n_expert",
                self.model.path().display()
            );
        }
        let (cols, rows) = (ne[0] as usize, ne[1] as usize);
        let start = (e * rows) as u64;
        let data = self
            .dequantize_rows(t, start..start + rows as u64)
            .with_context(|| {
                format!(
                    "model: {}: expert {e} of {name}",
                    self.model.path().display()
                )
            })?;
        Ok(Matrix { rows, cols, data })
    }

    /// The kv_b projection of layer `layer` in HF `kv_b_proj` layout, `[H*(nope+v), kv_lora]`:
    /// rows per head, `nope` K rows then `v` V rows. Built from `attn_k_b`/`attn_v_b` (spec 3.1),
    /// or read from the legacy unsplit `attn_kv_b`.
    pub fn kv_b(&self, layer: usize) -> Result<Matrix> {
        let hp = &self.hp;
        let (h, nope, v, kv_lora) = (hp.n_head, hp.qk_nope, hp.v_head, hp.kv_lora_rank);
        let k_name = names::blk(layer, blk::ATTN_K_B);
        let legacy = names::blk(layer, blk::ATTN_KV_B);
        if !self.has(&k_name) && self.has(&legacy) {
            return self.matrix(&legacy);
        }
        let kt = self.tensor(&k_name)?;
        let k_b = self.dequantize_rows(kt, 0..kt.info.n_rows())?;
        let vt = self.tensor(&names::blk(layer, blk::ATTN_V_B))?;
        let v_b = self.dequantize_rows(vt, 0..vt.info.n_rows())?;
        Ok(Matrix {
            rows: h * (nope + v),
            cols: kv_lora,
            data: assemble_kv_b(&k_b, &v_b, h, nope, v, kv_lora),
        })
    }
}

/// Checks that every run layer is there and has the MLP that `leading_dense_block_count` gives it.
/// A missing `attn_norm` means the file does not hold the trunk (e.g. the converter's `--mtp`
/// output: only the NextN block, its layer numbers after the trunk's). A dense layer with the MoE
/// router instead of `ffn_gate` (or the reverse) means the count disagrees with the tensors (e.g. a
/// transformers `mlp_layer_types` that is not `first_k_dense_replace` dense layers followed by MoE
/// ones: the converter writes the count, not the pattern).
fn check_dense_layers(model: &Model, hp: &HParams) -> Result<()> {
    for l in 0..hp.n_layer {
        let norm = names::blk(l, blk::ATTN_NORM);
        if model.find(&norm).is_none() {
            bail!(
                "model: {}: {}.block_count = {} with nextn_predict_layers = {} runs layers 0..{}, but the file has no {norm} \
                 (a file with only the NextN/MTP block, as the converter's --mtp writes, cannot run the model)",
                model.path().display(),
                hp.arch.as_str(),
                hp.n_block,
                hp.n_nextn,
                hp.n_layer
            );
        }
        let (want, other) = if hp.is_dense(l) {
            (blk::FFN_GATE, blk::FFN_GATE_INP)
        } else {
            (blk::FFN_GATE_INP, blk::FFN_GATE)
        };
        let (want, other) = (names::blk(l, want), names::blk(l, other));
        if model.find(&want).is_none() && model.find(&other).is_some() {
            bail!(
                "model: {}: {}.leading_dense_block_count = {} makes layer {l} {}, but the file has {other} and no {want}",
                model.path().display(),
                hp.arch.as_str(),
                hp.n_dense,
                if hp.is_dense(l) { "dense" } else { "MoE" }
            );
        }
    }
    Ok(())
}

/// Rebuilds HF `kv_b_proj` `[H*(nope+v), kv_lora]` from the converter's split tensors:
/// `k_b` is PyTorch `[H, kv_lora, nope]` (`k_b[h][c][d]`), `v_b` is `[H, v, kv_lora]`.
/// Per head h: rows `d < nope` are `k_b[h][:, d]` (transposed back), then the `v` rows of `v_b[h]`
/// (spec 3.1: `cat([K.transpose(1,2), V], dim=1).reshape(H*(nope+v), kv_lora)`).
pub fn assemble_kv_b(
    k_b: &[f32],
    v_b: &[f32],
    h: usize,
    nope: usize,
    v: usize,
    kv_lora: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(h * (nope + v) * kv_lora);
    for head in 0..h {
        let kh = &k_b[head * kv_lora * nope..(head + 1) * kv_lora * nope]; // [kv_lora, nope]
        for d in 0..nope {
            out.extend((0..kv_lora).map(|c| kh[c * nope + d]));
        }
        out.extend_from_slice(&v_b[head * v * kv_lora..(head + 1) * v * kv_lora]);
        // [v, kv_lora]
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::{build_with, metadata, tensor_names, tiny_hparams};
    use crate::model::Arch;
    use std::collections::HashMap;

    #[test]
    fn wrong_shapes_name_tensor_and_shapes() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let mut wrong = hp.clone();
        wrong.q_lora_rank = Some(10); // attn_q_a written [16, 10], expected [16, 12]
        let names = tensor_names(&hp);
        let model = build_with(&wrong, &metadata(&hp), &names, 32, &HashMap::new());
        let w = Weights::new(&model).unwrap();
        let e = w.matrix("blk.0.attn_q_a.weight").unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("blk.0.attn_q_a.weight has ne=[16, 10]")
                && msg.contains("expected ne=[16, 12]"),
            "{msg}"
        );
    }

    /// The converter writes `attn_kv_a_mqa.bias` (and `attn_q_a.bias`, `attn_output.bias`) for a
    /// transformers config with `attention_bias = true`; the forward pass has no such term, so the
    /// file is refused with the tensor named rather than run as a different model.
    #[test]
    fn projection_biases_are_refused_by_name() {
        use crate::gguf::{GgufFile, GgufWriter};
        use crate::quant::GgmlType;
        let hp = tiny_hparams(Arch::Deepseek2);
        let mut w = GgufWriter::new();
        for (k, v) in metadata(&hp) {
            w.add(&k, v).unwrap();
        }
        for name in tensor_names(&hp) {
            let ne = names::expected_ne(&hp, 32, &name).unwrap();
            w.add_tensor(&name, &ne, GgmlType::F32).unwrap();
        }
        let kv_a = (hp.kv_lora_rank + hp.qk_rope) as u64;
        w.add_tensor("blk.0.attn_kv_a_mqa.bias", &[kv_a], GgmlType::F32)
            .unwrap();
        let bytes = w
            .to_bytes(&mut |info, out| {
                out.write_all(&vec![0u8; info.n_elements() as usize * 4])?;
                Ok(())
            })
            .unwrap();
        let file = GgufFile::from_bytes("bias.gguf", bytes).unwrap();
        let model = Model::from_shards(vec![file]).unwrap();
        let msg = match Weights::new(&model) {
            Ok(_) => panic!("a file with attention biases was accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            msg.contains("tensor blk.0.attn_kv_a_mqa.bias is not part of the deepseek2"),
            "{msg}"
        );
    }

    /// The tensors have one dense layer, the metadata says two: the error names the count and the
    /// tensors instead of failing later at the first missing `ffn_gate`.
    #[test]
    fn dense_count_disagreeing_with_tensors_is_named() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let mut meta_hp = hp.clone();
        meta_hp.n_dense = 2;
        let model = build_with(
            &hp,
            &metadata(&meta_hp),
            &tensor_names(&hp),
            32,
            &HashMap::new(),
        );
        let msg = match Weights::new(&model) {
            Ok(_) => panic!("accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            msg.contains("glm-dsa.leading_dense_block_count = 2 makes layer 1 dense")
                && msg.contains("blk.1.ffn_gate_inp.weight and no blk.1.ffn_gate.weight"),
            "{msg}"
        );
    }

    /// Only the MTP block's tensors (converter `--mtp`): the run layers are named as missing.
    #[test]
    fn missing_trunk_layers_are_named() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let names: Vec<String> = tensor_names(&hp)
            .into_iter()
            .filter(|n| !n.starts_with("blk.0."))
            .collect();
        let model = build_with(&hp, &metadata(&hp), &names, 32, &HashMap::new());
        let msg = match Weights::new(&model) {
            Ok(_) => panic!("accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            msg.contains("runs layers 0..2, but the file has no blk.0.attn_norm.weight"),
            "{msg}"
        );
    }

    /// H=2, nope=2, v=1, kv_lora=3. HF kv_b rows (per head: K0, K1, V0), written by hand:
    /// head 0: [1,2,3] [4,5,6] [7,8,9]; head 1: [10,11,12] [13,14,15] [16,17,18].
    /// The converter's split: k_b[h] = K rows transposed ([kv_lora, nope]), v_b[h] = V rows.
    #[test]
    fn kv_b_split_and_reassembly_by_hand() {
        let k_b = [
            1., 4., 2., 5., 3., 6., // head 0: [[1,4],[2,5],[3,6]]
            10., 13., 11., 14., 12., 15., // head 1
        ];
        let v_b = [7., 8., 9., 16., 17., 18.];
        let kv = assemble_kv_b(&k_b, &v_b, 2, 2, 1, 3);
        let want: Vec<f32> = (1..=18).map(|x| x as f32).collect();
        assert_eq!(kv, want);
    }

    /// Regression: expert and row-range errors did not name the file.
    #[test]
    fn expert_and_row_range_errors_name_the_file() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = build_with(&hp, &metadata(&hp), &tensor_names(&hp), 32, &HashMap::new());
        let w = Weights::new(&model).unwrap();
        let name = "blk.1.ffn_up_exps.weight";
        for e in [
            w.expert(name, hp.n_expert).unwrap_err(),
            w.expert_rows(name, hp.n_expert).err().unwrap(),
            w.matrix_rows("blk.0.attn_q_a.weight", 0..1000).unwrap_err(),
        ] {
            let msg = format!("{e:#}");
            assert!(msg.contains("tiny.gguf"), "{msg}");
        }
    }
}
