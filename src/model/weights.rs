//! Typed access to a model's weights by GGUF tensor name, as *descriptions* that every engine
//! realises its own way: a [`WeightSlice`] names a tensor (name, GGML type, `ne`, shard and
//! offset, as the reader has them) and a range of its rows, and gives the raw GGUF bytes of those
//! rows straight from the map. The CPU reference dequantizes them to f32 on demand
//! (`engine::cpu`); a GPU engine may upload the quantized blocks as they are.
//!
//! Only what a step reads is described: one embedding row per prompt token, a matrix, a norm
//! vector, one expert's slice of a stacked `ffn_*_exps` tensor, and kv_b either as the
//! converter's split `attn_k_b`/`attn_v_b` pair or as the legacy unsplit `attn_kv_b` ([`KvB`]).
//! Every description checks the tensor's dimensions against [`shapes::expected_ne`] and names
//! tensor, expected and actual shapes when they differ.
//!
//! # Rows
//! A GGUF tensor with `ne = [n0, n1, n2, ...]` (fastest first) is `n1 * n2 * ...` rows of `n0`
//! values, row-major: row `r` holds the values `[r*n0, (r+1)*n0)` of the tensor, and its bytes
//! are whole quant blocks (`n0` is a multiple of the type's block size), `n0 / block_size *
//! type_size` bytes per row. So any row range is block-aligned, a 2-D `[cols, rows]` tensor is
//! a PyTorch `[rows, cols]` matrix whose row `r` is output feature `r` of `y = x · W^T`, and
//! expert `e` of a stacked `[cols, rows, n_expert]` tensor is rows `e*rows..(e+1)*rows`.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};

use super::hparams::HParams;
use super::names::{self, blk};
use super::shapes;
use crate::gguf::{Model, TensorRef};
use crate::quant::GgmlType;

/// A range of rows of one GGUF tensor: all rows of a matrix, one expert's rows of a stacked 3-D
/// tensor, the one row of a 1-D vector, one embedding row. A description only: nothing is read
/// until [`WeightSlice::data`] (raw blocks) or [`WeightSlice::dequantize`] (host f32) is called.
///
/// Element order: the slice is `n_rows() = rows.len()` rows of `cols` values, row-major
/// (PyTorch `[rows.len(), cols]`), exactly the tensor's own order (see the module
/// documentation); [`WeightSlice::data`] is those rows' `n_rows() * row_bytes()` bytes, in the
/// GGUF's block layout of [`WeightSlice::ty`] (little-endian; big-endian files are refused when
/// the description is made).
#[derive(Clone)]
pub struct WeightSlice<'m> {
    model: &'m Model,
    /// The tensor as the reader has it: name, GGML type, `ne` (fastest first), shard index and
    /// offset of its data within the shard's data section.
    pub tensor: TensorRef<'m>,
    /// Rows of the tensor this slice covers (rows of `ne[0]` values, counted over every other
    /// dimension of the tensor).
    pub rows: Range<usize>,
    /// Values per row (`ne[0]`).
    pub cols: usize,
}

impl fmt::Debug for WeightSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightSlice")
            .field("name", &self.tensor.info.name)
            .field("ty", &self.tensor.info.ty)
            .field("ne", &self.tensor.info.ne)
            .field("shard", &self.tensor.shard)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl<'m> WeightSlice<'m> {
    /// The tensor's GGUF name.
    pub fn name(&self) -> &'m str {
        &self.tensor.info.name
    }

    /// The tensor's GGML type (the block layout of [`WeightSlice::data`]).
    pub fn ty(&self) -> GgmlType {
        self.tensor.info.ty
    }

    /// Number of rows (`rows.len()`).
    pub fn n_rows(&self) -> usize {
        self.rows.len()
    }

    /// Bytes per row in the file (`cols / block_size * type_size`).
    pub fn row_bytes(&self) -> usize {
        self.tensor.info.row_bytes() as usize
    }

    /// Values of the slice (`n_rows() * cols`).
    pub fn n_values(&self) -> usize {
        self.n_rows() * self.cols
    }

    /// The model the tensor belongs to.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Rows `rows` of this slice (relative to its first row) as a slice of their own.
    pub fn sub(&self, rows: Range<usize>) -> Result<WeightSlice<'m>> {
        if rows.start > rows.end || rows.end > self.n_rows() {
            bail!(
                "model: {}: tensor {}: rows {}..{} out of range 0..{}",
                self.model.path().display(),
                self.name(),
                rows.start,
                rows.end,
                self.n_rows()
            );
        }
        Ok(WeightSlice {
            rows: self.rows.start + rows.start..self.rows.start + rows.end,
            ..self.clone()
        })
    }

    /// The raw GGUF bytes of the slice's rows (zero-copy from the map): `n_rows() * row_bytes()`
    /// bytes of whole [`WeightSlice::ty`] blocks, what a GPU engine uploads as it is.
    pub fn data(&self) -> Result<&'m [u8]> {
        self.model
            .row_data(self.tensor, self.rows.start as u64..self.rows.end as u64)
    }

    /// Where [`WeightSlice::data`] lies in the model's files: the shard's path, the byte offset
    /// in it and the length; `None` for a model held in memory.
    pub fn file_range(&self) -> Result<Option<(&'m Path, u64, u64)>> {
        let shard = self.model.shard_of(self.tensor)?;
        if !shard.is_mapped() {
            return Ok(None);
        }
        let rb = self.tensor.info.row_bytes();
        let offset = shard.data_start() + self.tensor.info.offset + self.rows.start as u64 * rb;
        Ok(Some((shard.path(), offset, self.n_rows() as u64 * rb)))
    }

    /// The slice dequantized to host f32, `[n_rows(), cols]` row-major (parallel over blocks,
    /// bit-identical for any thread count; the values of gguf-py's `dequantize`).
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.model
            .dequantize_rows(self.tensor, self.rows.start as u64..self.rows.end as u64)
    }
}

/// The kv_b projection of one layer (MLA's up-projection of the latent `c_kv` to per-head keys
/// and values), as the file holds it. HF `kv_b_proj` is `[H*(nope+v), kv_lora]`: per head `h`,
/// rows `h*(nope+v) .. h*(nope+v)+nope` are `W_UK[h]` (`[nope, kv_lora]`) and the next `v` rows
/// `W_UV[h]` (`[v, kv_lora]`); `shared/spec/glm5-architecture.md` 3.1 gives the converter's split.
#[derive(Clone, Debug)]
pub enum KvB<'m> {
    /// `attn_k_b` and `attn_v_b`, the converter's split (every current GLM-5/DeepSeek-V3 GGUF).
    Split {
        /// `attn_k_b.weight`: `ne = [nope, kv_lora, H]`, PyTorch `[H, kv_lora, nope]`, all
        /// `H*kv_lora` rows of `nope` values: row `h*kv_lora + c` holds `k_b[h][c][0..nope]`,
        /// and `k_b[h][c][d] = kv_b_proj[h*(nope+v) + d][c]` (each head's K block transposed).
        /// Use: `q_lat[h][c] = sum_d k_b[h][c][d] q_nope[h][d]`.
        k_b: WeightSlice<'m>,
        /// `attn_v_b.weight`: `ne = [kv_lora, v, H]`, PyTorch `[H, v, kv_lora]`, all `H*v` rows
        /// of `kv_lora` values: row `h*v + j` is `kv_b_proj[h*(nope+v) + nope + j]` (not
        /// transposed). Use: `o[h][j] = sum_c v_b[h][j][c] o_lat[h][c]`.
        v_b: WeightSlice<'m>,
        /// Attention heads `H`.
        heads: usize,
        /// Non-RoPE query/key dimension per head (`qk_nope_head_dim`).
        nope: usize,
        /// Value dimension per head (`v_head_dim`).
        v: usize,
        /// Latent rank (`kv_lora_rank`).
        kv_lora: usize,
    },
    /// `attn_kv_b.weight` of older files (read only when `attn_k_b` is absent): `ne = [kv_lora,
    /// H*(nope+v)]`, PyTorch `[H*(nope+v), kv_lora]`, exactly HF `kv_b_proj` (per head `nope` K
    /// rows then `v` V rows). The dimensions are those of [`HParams`].
    Legacy(WeightSlice<'m>),
}

impl<'m> KvB<'m> {
    /// The slices the projection is made of (`[k_b, v_b]` or `[kv_b]`).
    pub fn slices(&self) -> Vec<&WeightSlice<'m>> {
        match self {
            KvB::Split { k_b, v_b, .. } => vec![k_b, v_b],
            KvB::Legacy(kv_b) => vec![kv_b],
        }
    }
}

/// The weights of one opened model, with its hyperparameters: descriptions of what each step
/// reads ([`WeightSlice`], [`KvB`]), never values.
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
        let all = model.tensors().map(|t| t.info.name.as_str());
        if let Some(name) = shapes::unknown_layer_tensor(&hp, all) {
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
        };
        w.tensor(output)?;
        w.check_complete()?;
        Ok(w)
    }

    /// Every tensor the whole forward pass reads is in the file: a model that lacks one is
    /// refused at load, naming it, rather than failing after the layers before it have run.
    /// The tensors are those the steps read ([`super::steps`]' `Step::weights`), listed here from
    /// the hyperparameters and the layout the file chose (split or legacy kv_b, fused or
    /// separate expert gate and up; the selection bias is optional).
    fn check_complete(&self) -> Result<()> {
        let hp = &self.hp;
        let mut need: Vec<String> = vec![
            names::TOKEN_EMBD.to_string(),
            names::OUTPUT_NORM.to_string(),
            self.output.to_string(),
        ];
        for l in 0..hp.n_layer {
            let w = |s: &str| names::blk(l, s);
            need.extend(
                [
                    blk::ATTN_NORM,
                    blk::ATTN_KV_A_MQA,
                    blk::ATTN_KV_A_NORM,
                    blk::ATTN_OUTPUT,
                    blk::FFN_NORM,
                ]
                .map(w),
            );
            if hp.q_lora_rank.is_some() {
                need.extend([blk::ATTN_Q_A, blk::ATTN_Q_A_NORM, blk::ATTN_Q_B].map(w));
            } else {
                need.push(w(blk::ATTN_Q));
            }
            need.extend(self.kv_b_names(l));
            if hp
                .indexer
                .as_ref()
                .is_some_and(|ix| ix.full.get(l) == Some(&true))
            {
                need.extend(
                    [
                        blk::INDEXER_Q_B,
                        blk::INDEXER_K,
                        blk::INDEXER_K_NORM,
                        blk::INDEXER_K_NORM_B,
                        blk::INDEXER_PROJ,
                    ]
                    .map(w),
                );
            }
            if hp.is_dense(l) {
                need.extend([blk::FFN_GATE, blk::FFN_UP, blk::FFN_DOWN].map(w));
            } else {
                need.push(w(blk::FFN_GATE_INP));
                need.extend(self.expert_gate_up_names(l));
                need.push(w(blk::FFN_DOWN_EXPS));
                if hp.n_expert_shared > 0 {
                    need.extend(
                        [blk::FFN_GATE_SHEXP, blk::FFN_UP_SHEXP, blk::FFN_DOWN_SHEXP].map(w),
                    );
                }
            }
        }
        if let Some(name) = need.iter().find(|n| !self.has(n)) {
            bail!(
                "model: {}: tensor {name} is missing; the {} forward pass reads it (the file holds {} tensors)",
                self.model.path().display(),
                hp.arch.as_str(),
                self.model.tensors().count()
            );
        }
        Ok(())
    }

    /// The weights of a file that holds only some of a model's tensors, with the model's
    /// metadata (a step case of `glmdiff step`, which keeps the tensors one step reads): the
    /// hyperparameters come from the metadata and every tensor read is checked against them as
    /// with [`Weights::new`], but no layer, embedding or output tensor is required. The
    /// vocabulary size is that of `token_embd.weight` or `output.weight` when the file has one
    /// (0 otherwise); the output projection is `output.weight` when present.
    pub fn partial(model: &'m Model) -> Result<Weights<'m>> {
        let hp = HParams::from_partial_model(model)?;
        let n_vocab = [names::TOKEN_EMBD, names::OUTPUT]
            .iter()
            .find_map(|n| model.find(n))
            .and_then(|t| t.info.ne.get(1).copied())
            .unwrap_or(0) as usize;
        let output = if model.find(names::OUTPUT).is_some() {
            names::OUTPUT
        } else {
            names::TOKEN_EMBD
        };
        Ok(Weights {
            model,
            hp,
            n_vocab,
            output,
        })
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
        if let Some(want) = shapes::expected_ne(&self.hp, self.n_vocab, name) {
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

    /// Rows `first..first+rows` of `t`, refusing tensor data a little-endian reader cannot use.
    fn slice(&self, t: TensorRef<'m>, first: usize, rows: usize) -> Result<WeightSlice<'m>> {
        if self.model.shards()[t.shard].is_big_endian() && t.info.ty.type_size() > 1 {
            bail!(
                "model: {}: tensor {}: big-endian tensor data is not supported",
                self.model.path().display(),
                t.info.name
            );
        }
        Ok(WeightSlice {
            model: self.model,
            tensor: t,
            rows: first..first + rows,
            cols: t.info.ne[0] as usize,
        })
    }

    /// Every row of tensor `name`, whatever its dimensions (all experts of a stacked tensor, the
    /// one row of a vector): what an engine that keeps a whole layer resident uploads.
    pub fn tensor_desc(&self, name: &str) -> Result<WeightSlice<'m>> {
        let t = self.tensor(name)?;
        self.slice(t, 0, t.info.n_rows() as usize)
    }

    /// The 1-D tensor `name` (norm weight, bias) as one row of `ne[0]` values.
    pub fn vector_desc(&self, name: &str) -> Result<WeightSlice<'m>> {
        let t = self.tensor(name)?;
        if t.info.ne.len() != 1 {
            bail!(
                "model: {}: tensor {name} has ne={:?}, expected one dimension",
                self.model.path().display(),
                t.info.ne
            );
        }
        self.slice(t, 0, 1)
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

    /// All rows of the 2-D tensor `name` (`ne = [cols, rows]`, PyTorch `[rows, cols]`: row `r`
    /// is output feature `r` of `x · W^T`).
    pub fn matrix_desc(&self, name: &str) -> Result<WeightSlice<'m>> {
        let (rows, _) = self.matrix_dims(name)?;
        self.slice(self.tensor(name)?, 0, rows)
    }

    /// Expert `e`'s rows of the stacked 3-D tensor `name` (`ne = [cols, rows, n_expert]`): rows
    /// `e*rows..(e+1)*rows`, PyTorch `[rows, cols]` like a matrix.
    pub fn expert_desc(&self, name: &str, e: usize) -> Result<WeightSlice<'m>> {
        let t = self.tensor(name)?;
        let ne = &t.info.ne;
        if ne.len() != 3 || e as u64 >= ne[2] {
            bail!(
                "model: {}: tensor {name} (ne={ne:?}): expected [cols, rows, n_expert] and expert {e} < n_expert",
                self.model.path().display()
            );
        }
        let rows = ne[1] as usize;
        self.slice(t, e * rows, rows)
    }

    /// Whether layer `layer` holds its experts' gates and ups fused in `ffn_gate_up_exps`
    /// (`--fuse-gate-up-exps`) rather than in `ffn_gate_exps` and `ffn_up_exps`.
    fn gate_up_fused(&self, layer: usize) -> bool {
        !self.has(&names::blk(layer, blk::FFN_GATE_EXPS))
            && self.has(&names::blk(layer, blk::FFN_GATE_UP_EXPS))
    }

    /// Names of the stacked expert gate and up tensors of layer `layer`: `[ffn_gate_exps,
    /// ffn_up_exps]`, or `[ffn_gate_up_exps]` when fused.
    pub fn expert_gate_up_names(&self, layer: usize) -> Vec<String> {
        if self.gate_up_fused(layer) {
            vec![names::blk(layer, blk::FFN_GATE_UP_EXPS)]
        } else {
            vec![
                names::blk(layer, blk::FFN_GATE_EXPS),
                names::blk(layer, blk::FFN_UP_EXPS),
            ]
        }
    }

    /// Expert `e`'s gate and up rows of layer `layer` (`[n_ff_exp, hidden]` each), from
    /// `ffn_gate_exps`/`ffn_up_exps` or the fused `ffn_gate_up_exps` (`ne = [hidden,
    /// 2*n_ff_exp, n_expert]`: per expert, its `n_ff_exp` gate rows then its `n_ff_exp` up rows,
    /// as llama.cpp's `build_moe_ffn` splits it; the two slices are then rows of one tensor).
    pub fn expert_gate_up_desc(
        &self,
        layer: usize,
        e: usize,
    ) -> Result<(WeightSlice<'m>, WeightSlice<'m>)> {
        if !self.gate_up_fused(layer) {
            return Ok((
                self.expert_desc(&names::blk(layer, blk::FFN_GATE_EXPS), e)?,
                self.expert_desc(&names::blk(layer, blk::FFN_UP_EXPS), e)?,
            ));
        }
        let both = self.expert_desc(&names::blk(layer, blk::FFN_GATE_UP_EXPS), e)?;
        let half = both.n_rows() / 2;
        Ok((both.sub(0..half)?, both.sub(half..2 * half)?))
    }

    /// The whole embedding table `token_embd.weight` (`ne = [hidden, n_vocab]`, PyTorch
    /// `[n_vocab, hidden]`: row `id` is token `id`'s embedding).
    pub fn embedding_desc(&self) -> Result<WeightSlice<'m>> {
        self.matrix_desc(names::TOKEN_EMBD)
    }

    /// The embedding rows of `ids`, one single-row slice per token (`[1, hidden]` each), in
    /// token order. Ids outside the vocabulary are an error naming the token.
    pub fn embedding_rows_desc(&self, ids: &[u32]) -> Result<Vec<WeightSlice<'m>>> {
        let table = self.embedding_desc()?;
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                if id as usize >= self.n_vocab {
                    bail!(
                        "model: token {i} has id {id}, outside the vocabulary 0..{} of {}",
                        self.n_vocab,
                        self.model.file_name()
                    );
                }
                table.sub(id as usize..id as usize + 1)
            })
            .collect()
    }

    /// Whether layer `layer` holds kv_b only as the legacy unsplit `attn_kv_b` (no `attn_k_b`).
    fn kv_b_legacy(&self, layer: usize) -> bool {
        !self.has(&names::blk(layer, blk::ATTN_K_B)) && self.has(&names::blk(layer, blk::ATTN_KV_B))
    }

    /// Names of the kv_b tensors of layer `layer` that attention reads: `[attn_k_b, attn_v_b]`,
    /// or `[attn_kv_b]` in a file without the split (see [`KvB`]).
    pub fn kv_b_names(&self, layer: usize) -> Vec<String> {
        if self.kv_b_legacy(layer) {
            vec![names::blk(layer, blk::ATTN_KV_B)]
        } else {
            vec![
                names::blk(layer, blk::ATTN_K_B),
                names::blk(layer, blk::ATTN_V_B),
            ]
        }
    }

    /// The kv_b projection of layer `layer`: the split `attn_k_b`/`attn_v_b` (preferred when
    /// present, spec 3.1), or the legacy unsplit `attn_kv_b`. Shapes and element order are
    /// documented on [`KvB`]; both are checked against the hyperparameters.
    pub fn kv_b_desc(&self, layer: usize) -> Result<KvB<'m>> {
        if self.kv_b_legacy(layer) {
            return Ok(KvB::Legacy(
                self.matrix_desc(&names::blk(layer, blk::ATTN_KV_B))?,
            ));
        }
        let hp = &self.hp;
        Ok(KvB::Split {
            k_b: self.tensor_desc(&names::blk(layer, blk::ATTN_K_B))?,
            v_b: self.tensor_desc(&names::blk(layer, blk::ATTN_V_B))?,
            heads: hp.n_head,
            nope: hp.qk_nope,
            v: hp.v_head,
            kv_lora: hp.kv_lora_rank,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testutil::{build_with, metadata, tensor_names, tiny_hparams};
    use crate::model::Arch;
    use crate::quant::GgmlType;
    use std::collections::HashMap;

    #[test]
    fn wrong_shapes_name_tensor_and_shapes() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let mut wrong = hp.clone();
        wrong.q_lora_rank = Some(10); // attn_q_a written [16, 10], expected [16, 12]
        let names = tensor_names(&hp);
        let model = build_with(&wrong, &metadata(&hp), &names, 32, &HashMap::new());
        // Refused when the weights are opened, before any step: the key, its value, the tensor
        // and its shape.
        let msg = match Weights::new(&model) {
            Ok(_) => panic!("accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            msg.contains("metadata glm-dsa.attention.q_lora_rank = 12 disagrees with tensor blk.0.attn_q_a.weight")
                && msg.contains("its ne[1] is 10, not 12")
                && msg.contains("ne=[16, 10]"),
            "{msg}"
        );
        // A step case's weights (only some tensors) are checked the same way.
        let msg = match Weights::partial(&model) {
            Ok(_) => panic!("accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(msg.contains("blk.0.attn_q_a.weight"), "{msg}");
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
            let ne = shapes::expected_ne(&hp, 32, &name).unwrap();
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

    /// Regression: expert and row-range errors did not name the file.
    #[test]
    fn expert_and_row_range_errors_name_the_file() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = build_with(&hp, &metadata(&hp), &tensor_names(&hp), 32, &HashMap::new());
        let w = Weights::new(&model).unwrap();
        let name = "blk.1.ffn_up_exps.weight";
        for e in [
            w.expert_desc(name, hp.n_expert).unwrap_err(),
            w.matrix_desc("blk.0.attn_q_a.weight")
                .and_then(|m| m.sub(0..1000))
                .unwrap_err(),
        ] {
            let msg = format!("{e:#}");
            assert!(msg.contains("tiny.gguf"), "{msg}");
        }
    }

    /// Rows, columns and bytes of each kind of description on the tiny F32 model (hidden 16,
    /// q_lora 12, H 2, nope 6, v 5, kv_lora 8, 4 experts of 8 rows), and their values equal the
    /// tensor's own rows as the reader dequantizes them.
    #[test]
    fn descriptions_name_tensor_rows_and_bytes() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = build_with(&hp, &metadata(&hp), &tensor_names(&hp), 32, &HashMap::new());
        let w = Weights::new(&model).unwrap();
        let whole = |name: &str| model.dequantize_named(name).unwrap();

        let q_a = w.matrix_desc("blk.0.attn_q_a.weight").unwrap();
        assert_eq!(
            (q_a.rows.clone(), q_a.cols, q_a.ty()),
            (0..12, 16, GgmlType::F32)
        );
        assert_eq!(q_a.data().unwrap().len(), 12 * 16 * 4);
        assert_eq!(q_a.dequantize().unwrap(), whole("blk.0.attn_q_a.weight"));

        let up = w.expert_desc("blk.1.ffn_up_exps.weight", 2).unwrap();
        assert_eq!((up.rows.clone(), up.cols), (16..24, 16));
        let all = whole("blk.1.ffn_up_exps.weight");
        assert_eq!(up.dequantize().unwrap(), &all[16 * 16..24 * 16]);
        let (gate, up2) = w.expert_gate_up_desc(1, 2).unwrap();
        assert_eq!(gate.name(), "blk.1.ffn_gate_exps.weight");
        assert_eq!((gate.rows.clone(), up2.rows.clone()), (16..24, 16..24));

        let norm = w.vector_desc("blk.0.attn_norm.weight").unwrap();
        assert_eq!((norm.n_rows(), norm.cols), (1, 16));
        assert!(w.vector_desc("blk.0.attn_q_a.weight").is_err());

        let emb = w.embedding_rows_desc(&[3, 0]).unwrap();
        let table = whole(names::TOKEN_EMBD);
        assert_eq!(emb[0].rows, 3..4);
        assert_eq!(emb[0].dequantize().unwrap(), &table[3 * 16..4 * 16]);
        let msg = format!("{:#}", w.embedding_rows_desc(&[1, 32]).unwrap_err());
        assert!(
            msg.contains("token 1 has id 32, outside the vocabulary 0..32"),
            "{msg}"
        );

        match w.kv_b_desc(0).unwrap() {
            KvB::Split {
                k_b,
                v_b,
                heads,
                nope,
                v,
                kv_lora,
            } => {
                assert_eq!((heads, nope, v, kv_lora), (2, 6, 5, 8));
                // k_b: [H, kv_lora, nope] = 16 rows of 6; v_b: [H, v, kv_lora] = 10 rows of 8.
                assert_eq!((k_b.rows.clone(), k_b.cols), (0..16, 6));
                assert_eq!((v_b.rows.clone(), v_b.cols), (0..10, 8));
            }
            KvB::Legacy(_) => panic!("the split pair is there"),
        }
    }

    /// `file_range` names the bytes `data` gives: read from the file at that offset they are
    /// the same, for every tensor (whole and one expert's rows) of a model in two shards (each
    /// with its own data section); a model held in memory has no file range.
    #[test]
    #[cfg(unix)]
    fn file_ranges_are_where_the_data_lies() {
        use crate::gguf::{GgufWriter, Value, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS};
        use std::os::unix::fs::FileExt;

        let hp = tiny_hparams(Arch::GlmDsa);
        let mem = crate::model::testutil::tiny_model(&hp);
        let wm = Weights::new(&mem).unwrap();
        assert!(wm
            .tensor_desc("blk.0.attn_q_a.weight")
            .unwrap()
            .file_range()
            .unwrap()
            .is_none());

        // The same tensors in two shards, metadata in the first.
        let dir = tempfile::tempdir().unwrap();
        let all: Vec<String> = mem.tensors().map(|t| t.info.name.clone()).collect();
        let half = all.len() / 2;
        for (k, names) in [&all[..half], &all[half..]].iter().enumerate() {
            let mut w = GgufWriter::new();
            if k == 0 {
                for (key, v) in mem.metadata() {
                    w.add(key, v.clone()).unwrap();
                }
            }
            w.add(KEY_SPLIT_NO, Value::U16(k as u16)).unwrap();
            w.add(KEY_SPLIT_COUNT, Value::U16(2)).unwrap();
            w.add(KEY_SPLIT_TENSORS, Value::I32(all.len() as i32))
                .unwrap();
            for n in names.iter() {
                let t = mem.tensor(n).unwrap();
                w.add_tensor(n, &t.info.ne, t.info.ty).unwrap();
            }
            let bytes = w
                .to_bytes(&mut |info, out| {
                    out.write_all(mem.tensor_data(mem.tensor(&info.name)?)?)?;
                    Ok(())
                })
                .unwrap();
            std::fs::write(
                dir.path().join(format!("m-0000{}-of-00002.gguf", k + 1)),
                bytes,
            )
            .unwrap();
        }
        let model = Model::open(&dir.path().join("m-00001-of-00002.gguf")).unwrap();
        assert_eq!(model.shards().len(), 2);
        let w = Weights::new(&model).unwrap();
        let expert = w.expert_desc("blk.1.ffn_up_exps.weight", 2).unwrap();
        let mut slices = vec![expert];
        slices.extend(all.iter().map(|n| w.tensor_desc(n).unwrap()));
        let mut shards_seen = std::collections::BTreeSet::new();
        for s in slices {
            let (path, offset, len) = s.file_range().unwrap().expect("a mapped file");
            let data = s.data().unwrap();
            assert_eq!(len as usize, data.len(), "{}", s.name());
            let mut buf = vec![0u8; data.len()];
            std::fs::File::open(path)
                .unwrap()
                .read_exact_at(&mut buf, offset)
                .unwrap();
            assert_eq!(buf, data, "{} rows {:?}", s.name(), s.rows);
            shards_seen.insert(path.to_path_buf());
        }
        assert_eq!(shards_seen.len(), 2);
    }

    /// Fused `ffn_gate_up_exps` (`[hidden, 2*n_ff_exp, E]`): expert e's gate is rows
    /// `2e*ff..(2e+1)*ff`, its up the next `ff`; legacy `attn_kv_b` is one `[H*(nope+v),
    /// kv_lora]` matrix.
    #[test]
    fn fused_gate_up_and_legacy_kv_b_descriptions() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let split = [
            blk::ATTN_K_B,
            blk::ATTN_V_B,
            blk::FFN_GATE_EXPS,
            blk::FFN_UP_EXPS,
        ];
        let mut names: Vec<String> = tensor_names(&hp)
            .into_iter()
            .filter(|n| !names::split_blk(n).is_some_and(|(_, s)| split.contains(&s)))
            .collect();
        names.extend([
            names::blk(0, blk::ATTN_KV_B),
            names::blk(1, blk::ATTN_KV_B),
            names::blk(1, blk::FFN_GATE_UP_EXPS),
        ]);
        let model = build_with(&hp, &metadata(&hp), &names, 32, &HashMap::new());
        let w = Weights::new(&model).unwrap();
        let (gate, up) = w.expert_gate_up_desc(1, 2).unwrap();
        assert_eq!(gate.name(), "blk.1.ffn_gate_up_exps.weight");
        assert_eq!((gate.rows.clone(), up.rows.clone()), (32..40, 40..48));
        match w.kv_b_desc(1).unwrap() {
            KvB::Legacy(kv_b) => assert_eq!((kv_b.rows.clone(), kv_b.cols), (0..22, 8)),
            KvB::Split { .. } => panic!("the file has only attn_kv_b"),
        }
    }
}
