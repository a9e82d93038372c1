//! Tensor data to f32 (or integers), whole or by row ranges, straight from the map.
//! Only the requested rows are read; nothing else of the tensor is touched.

use std::ops::Range;

use anyhow::{bail, Context, Result};

use super::model::{Model, TensorRef};
use crate::quant::{self, TypeStatus};

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

    /// Reads an integer tensor (I8, I16, I32 or I64: the types of status
    /// [`TypeStatus::Integer`], little-endian two's complement of the type's size) as i64 values.
    pub fn read_ints(&self, t: TensorRef<'_>) -> Result<Vec<i64>> {
        self.check_endian(t)?;
        let b = self.tensor_data(t)?;
        let ty = t.info.ty;
        let width = ty.type_size();
        if ty.status() != TypeStatus::Integer || !(1..=8).contains(&width) {
            bail!(
                "gguf: {}: tensor {:?} has type {ty}, not an integer type",
                self.path().display(),
                t.info.name
            );
        }
        Ok(b.chunks_exact(width)
            .map(|c| {
                // Sign-extend: the bytes above the value repeat its sign bit.
                let fill = if c[width - 1] & 0x80 != 0 { 0xFF } else { 0 };
                let mut a = [fill; 8];
                a[..width].copy_from_slice(c);
                i64::from_le_bytes(a)
            })
            .collect())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;
    use crate::quant::GgmlType;

    /// Integer tensors read back as the values written, negative ones included (each width's
    /// little-endian two's complement written by hand); a float tensor is refused.
    #[test]
    fn integer_tensors_read_with_their_sign() {
        let data: [(&str, GgmlType, Vec<u8>); 5] = [
            ("i8", GgmlType::I8, vec![0x7F, 0x80, 0xFF]),
            (
                "i16",
                GgmlType::I16,
                vec![0xFF, 0x7F, 0x00, 0x80, 0xFE, 0xFF],
            ),
            (
                "i32",
                GgmlType::I32,
                vec![1, 0, 0, 0, 0, 0, 0, 0x80, 0xFF, 0xFF, 0xFF, 0xFF],
            ),
            (
                "i64",
                GgmlType::I64,
                [
                    [0xFF; 8],
                    [0, 0, 0, 0, 0, 0, 0, 0x80],
                    [2, 0, 0, 0, 0, 0, 0, 0],
                ]
                .concat(),
            ),
            (
                "f32",
                GgmlType::F32,
                vec![0, 0, 0x80, 0x3F, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
        ];
        let mut w = GgufWriter::new();
        for (name, ty, _) in &data {
            w.add_tensor(name, &[3], *ty).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ints.gguf");
        let mut i = 0;
        w.write_file(&path, &mut |_, out| {
            out.write_all(&data[i].2)?;
            i += 1;
            Ok(())
        })
        .unwrap();
        let m = Model::open(&path).unwrap();
        let read = |name: &str| m.read_ints(m.tensor(name).unwrap());
        assert_eq!(read("i8").unwrap(), [127, -128, -1]);
        assert_eq!(read("i16").unwrap(), [32767, -32768, -2]);
        assert_eq!(read("i32").unwrap(), [1, i64::from(i32::MIN), -1]);
        assert_eq!(read("i64").unwrap(), [-1, i64::MIN, 2]);
        let e = read("f32").unwrap_err().to_string();
        assert!(e.contains("has type F32, not an integer type"), "{e}");
    }
}
