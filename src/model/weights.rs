//! Typed access to a model's weights by GGUF tensor name, dequantized to f32 on demand and only
//! as far as asked: embedding rows of the prompt's tokens, row ranges of big matrices, one
//! expert's slice of a stacked `ffn_*_exps` tensor. Every access checks the tensor's dimensions
//! against [`names::expected_ne`] and names tensor, expected and actual shapes when they differ.

use std::ops::Range;

use anyhow::{bail, Context, Result};

use super::hparams::HParams;
use super::names::{self, blk};
use crate::gguf::{Model, TensorRef};
use crate::quant;

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
    /// Rows of this source.
    pub rows: usize,
    /// Values per row (`ne[0]`).
    pub cols: usize,
}

impl RowSource<'_> {
    /// The tensor's GGUF name.
    pub fn name(&self) -> &str {
        &self.t.info.name
    }

    /// Dequantizes rows `rows` (relative to this source) into `dst` (`rows.len() * cols` values),
    /// on the calling thread.
    pub fn dequantize_into(&self, rows: Range<usize>, dst: &mut [f32]) -> Result<()> {
        if rows.end > self.rows || dst.len() != rows.len() * self.cols {
            bail!(
                "model: tensor {}: rows {rows:?} of {} into {} values",
                self.t.info.name,
                self.rows,
                dst.len()
            );
        }
        let bytes = self.model.row_data(
            self.t,
            self.first + rows.start as u64..self.first + rows.end as u64,
        )?;
        quant::dequantize(self.t.info.ty, bytes, dst)
            .with_context(|| format!("model: tensor {}", self.t.info.name))
    }
}

/// The weights of one opened model, with its hyperparameters.
pub struct Weights<'m> {
    model: &'m Model,
    hp: HParams,
    n_vocab: usize,
    output: &'static str,
}

impl<'m> Weights<'m> {
    /// Reads the hyperparameters of `model` and checks the embedding and output tensors.
    /// `output.weight` absent means the output projection is `token_embd.weight` (tied).
    pub fn new(model: &'m Model) -> Result<Weights<'m>> {
        let hp = HParams::from_model(model)?;
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
        };
        w.tensor(output)?;
        Ok(w)
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
                "model: tensor {name} (ne={ne:?}): expected [cols, rows, n_expert] and expert {e} < n_expert"
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
        self.model.dequantize(t)
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
                "model: tensor {name}: rows {}..{} out of range 0..{n_rows}",
                rows.start,
                rows.end
            );
        }
        let t = self.tensor(name)?;
        let data = self
            .model
            .dequantize_rows(t, rows.start as u64..rows.end as u64)?;
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
            data.extend(self.model.dequantize_rows(t, id as u64..id as u64 + 1)?);
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
                "model: tensor {name} (ne={ne:?}): expected [cols, rows, n_expert] and expert {e} < n_expert"
            );
        }
        let (cols, rows) = (ne[0] as usize, ne[1] as usize);
        let start = (e * rows) as u64;
        let data = self
            .model
            .dequantize_rows(t, start..start + rows as u64)
            .with_context(|| format!("model: expert {e} of {name}"))?;
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
        let k_b = self.model.dequantize(kt)?;
        let vt = self.tensor(&names::blk(layer, blk::ATTN_V_B))?;
        let v_b = self.model.dequantize(vt)?;
        Ok(Matrix {
            rows: h * (nope + v),
            cols: kv_lora,
            data: assemble_kv_b(&k_b, &v_b, h, nope, v, kv_lora),
        })
    }
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
}
