//! The two kinds of weight stores `weights-check` reads, behind one trait: a Hugging Face
//! checkpoint (the original values) and a GGUF model (values rounded to its tensor types, with
//! the rounding error each block is expected to carry, `quant::noise`).
//!
//! Every tensor is seen as a matrix `[rows, row_len]`: `row_len` is the last PyTorch dimension
//! (GGUF `ne[0]`), rows run over all others, so an expert stack `[E, I, H]` has `E * I` rows.

use std::ops::Range;

use anyhow::{bail, Context, Result};

use crate::gguf::Model;
use crate::hf::Checkpoint;
use crate::quant::{noise, GgmlType, TypeStatus};

/// A tensor's shape (PyTorch order) and storage type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Shape, slowest dimension first.
    pub shape: Vec<u64>,
    /// Storage type as the file spells it (`BF16`, `F8_E4M3`, `Q4_K`).
    pub dtype: String,
}

impl Meta {
    /// Elements per row (the last dimension).
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Rows (product of all dimensions but the last).
    pub fn rows(&self) -> u64 {
        match self.shape.split_last() {
            Some((_, lead)) => lead.iter().product(),
            None => 1,
        }
    }
}

/// Values of a region, row-major, and the expected squared rounding error of each value where
/// the store is a rounded copy (`None`: exact, or not asked for).
#[derive(Clone, Debug, Default)]
pub struct Values {
    /// The values.
    pub vals: Vec<f32>,
    /// Expected squared rounding error per value.
    pub var: Option<Vec<f32>>,
}

impl Values {
    /// Appends `other`.
    pub fn extend(&mut self, other: Values) {
        self.vals.extend(other.vals);
        match (&mut self.var, other.var) {
            (Some(a), Some(b)) => a.extend(b),
            (None, Some(b)) if self.vals.len() == b.len() => self.var = Some(b),
            _ => {}
        }
    }
}

/// A source of tensor values.
pub trait Store: Sync {
    /// What it is, for reports (`HF checkpoint DIR (3 shards)`, `GGUF FILE`).
    fn describe(&self) -> String;
    /// Whether values are originals (an HF checkpoint) rather than rounded copies.
    fn is_original(&self) -> bool;
    /// Every tensor name.
    fn names(&self) -> Vec<String>;
    /// Shape and type of tensor `name`.
    fn meta(&self, name: &str) -> Option<Meta>;
    /// The block `rows` x `cols` of tensor `name` (matrix view), with per-value expected rounding
    /// error when `want_var` and the store has one.
    fn read(
        &self,
        name: &str,
        rows: Range<u64>,
        cols: Range<u64>,
        want_var: bool,
    ) -> Result<Values>;
}

/// A Hugging Face checkpoint as a store.
pub struct HfStore<'a> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
}

impl Store for HfStore<'_> {
    fn describe(&self) -> String {
        format!(
            "HF checkpoint {} ({} safetensors file{})",
            self.ckpt.dir().display(),
            self.ckpt.n_shards(),
            if self.ckpt.n_shards() == 1 { "" } else { "s" }
        )
    }

    fn is_original(&self) -> bool {
        true
    }

    fn names(&self) -> Vec<String> {
        self.ckpt.tensors().map(|t| t.name.clone()).collect()
    }

    fn meta(&self, name: &str) -> Option<Meta> {
        self.ckpt.get(name).map(|t| Meta {
            shape: t.shape.clone(),
            dtype: t.dtype.name().to_string(),
        })
    }

    fn read(&self, name: &str, rows: Range<u64>, cols: Range<u64>, _: bool) -> Result<Values> {
        let t = self.ckpt.tensor(name)?;
        Ok(Values {
            vals: self.ckpt.read_block(t, rows, cols)?,
            var: None,
        })
    }
}

/// A GGUF model as a store.
pub struct GgufStore<'a> {
    /// The model.
    pub model: &'a Model,
}

impl GgufStore<'_> {
    /// The summed expected squared rounding error of rows `rows` of tensor `name`.
    pub fn sq_error(&self, name: &str, rows: Range<u64>) -> Result<f64> {
        let t = self.model.tensor(name)?;
        let bytes = self.model.row_data(t, rows.clone())?;
        let e = noise::expected_sq_error(t.info.ty, bytes).with_context(|| {
            format!(
                "weights-check: {}: tensor {}",
                self.model.path().display(),
                name
            )
        });
        self.model.release_rows(t, rows);
        e
    }
}

impl Store for GgufStore<'_> {
    fn describe(&self) -> String {
        let n = self.model.shards().len();
        if n == 1 {
            format!("GGUF {}", self.model.path().display())
        } else {
            format!("GGUF {} ({n} shards)", self.model.path().display())
        }
    }

    fn is_original(&self) -> bool {
        false
    }

    fn names(&self) -> Vec<String> {
        self.model.tensors().map(|t| t.info.name.clone()).collect()
    }

    fn meta(&self, name: &str) -> Option<Meta> {
        self.model.find(name).map(|t| Meta {
            shape: t.info.shape(),
            dtype: t.info.ty.name().to_string(),
        })
    }

    fn read(
        &self,
        name: &str,
        rows: Range<u64>,
        cols: Range<u64>,
        want_var: bool,
    ) -> Result<Values> {
        let t = self.model.tensor(name)?;
        let ty = t.info.ty;
        if ty.status() != TypeStatus::Dequant {
            bail!(
                "weights-check: {}: tensor {name} has type {ty}, which has no dequantization",
                self.model.path().display()
            );
        }
        let row_len = t.info.row_len();
        let full = self.model.dequantize_rows(t, rows.clone())?;
        let var = if want_var {
            let bytes = self.model.row_data(t, rows.clone())?;
            let per_block = noise::block_sq_errors(ty, bytes)?;
            let bs = ty.block_size();
            let mut v = Vec::with_capacity(full.len());
            for e in per_block {
                v.extend(std::iter::repeat_n((e / bs as f64) as f32, bs));
            }
            Some(v)
        } else {
            None
        };
        self.model.release_rows(t, rows);
        if cols.start == 0 && cols.end == row_len {
            return Ok(Values { vals: full, var });
        }
        let pick = |v: &[f32]| -> Vec<f32> {
            v.chunks_exact(row_len as usize)
                .flat_map(|r| r[cols.start as usize..cols.end as usize].iter().copied())
                .collect()
        };
        Ok(Values {
            vals: pick(&full),
            var: var.as_deref().map(pick),
        })
    }
}

/// Whether glmdiff can dequantize and model tensors of type `ty`.
pub fn comparable_type(ty: GgmlType) -> bool {
    ty.status() == TypeStatus::Dequant && noise::has_model(ty)
}
