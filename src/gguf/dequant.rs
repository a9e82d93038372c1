//! Tensor data to f32 (or integers), whole or by row ranges, straight from the map.
//! Only the requested rows are read; nothing else of the tensor is touched.

use std::ops::Range;

use anyhow::{bail, Context, Result};

use super::model::{Model, TensorRef};
use crate::quant::{self, GgmlType};

impl Model {
    /// Dequantizes rows `rows` of tensor `t` to f32 (row = `ne[0]` elements; rows run over all
    /// other dimensions, so rows `e*ne1..(e+1)*ne1` of a stacked expert tensor are expert `e`).
    /// Output: `[rows.len(), ne0]` row-major. Parallel over blocks; bit-identical for any thread count.
    pub fn dequantize_rows(&self, t: TensorRef<'_>, rows: Range<u64>) -> Result<Vec<f32>> {
        self.check_endian(t)?;
        let bytes = self.row_data(t, rows.clone())?;
        let n = ((rows.end - rows.start) * t.info.row_len()) as usize;
        quant::dequantize_to_vec(t.info.ty, bytes, n)
            .with_context(|| format!("gguf: {}: tensor {:?}", self.path().display(), t.info.name))
    }

    /// Dequantizes a whole tensor to f32 (shape = `t.info.shape()`).
    pub fn dequantize(&self, t: TensorRef<'_>) -> Result<Vec<f32>> {
        self.dequantize_rows(t, 0..t.info.n_rows())
    }

    /// Dequantizes the tensor called `name`.
    pub fn dequantize_named(&self, name: &str) -> Result<Vec<f32>> {
        self.dequantize(self.tensor(name)?)
    }

    /// Reads an integer tensor (I8, I16, I32 or I64) as i64 values.
    pub fn read_ints(&self, t: TensorRef<'_>) -> Result<Vec<i64>> {
        self.check_endian(t)?;
        let b = self.tensor_data(t)?;
        Ok(match t.info.ty {
            GgmlType::I8 => b.iter().map(|&x| i64::from(x as i8)).collect(),
            GgmlType::I16 => b
                .chunks_exact(2)
                .map(|c| i64::from(i16::from_le_bytes([c[0], c[1]])))
                .collect(),
            GgmlType::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            GgmlType::I64 => b
                .chunks_exact(8)
                .map(|c| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    i64::from_le_bytes(a)
                })
                .collect(),
            other => bail!(
                "gguf: {}: tensor {:?} has type {other}, not an integer type",
                self.path().display(),
                t.info.name
            ),
        })
    }

    fn check_endian(&self, t: TensorRef<'_>) -> Result<()> {
        let shard = self.shard_of(t)?;
        if shard.is_big_endian() && t.info.ty.type_size() > 1 {
            bail!(
                "gguf: {}: tensor {:?} ({}): big-endian tensor data is not supported (metadata and inspect work)",
                shard.path().display(),
                t.info.name,
                t.info.ty
            );
        }
        Ok(())
    }
}
