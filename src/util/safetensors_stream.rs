//! A one-tensor f32 safetensors file written as a stream: header, then the values in chunks, so
//! a multi-GB tensor is never copied into a byte buffer (the `safetensors` crate's `serialize`
//! needs the bytes, then builds the whole file in memory: three copies of the tensor).
//! Format: huggingface/safetensors `README.md` (u64 header size, JSON header padded with
//! spaces, little-endian data).

use std::collections::HashMap;
use std::io::Write;

use anyhow::Result;
use serde_json::{json, Map, Value};

/// Header length is padded to a multiple of this, as the `safetensors` crate does.
const HEADER_ALIGN: usize = 8;
/// Values converted to bytes per write.
const CHUNK_VALUES: usize = 1 << 16;

/// Writes the header of a safetensors file holding one F32 tensor `name` of `shape` with
/// `metadata`; its `shape.iter().product()` values follow, written by [`write_values`].
pub fn write_f32_header(
    w: &mut dyn Write,
    name: &str,
    shape: &[u64],
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let n_bytes = shape.iter().product::<u64>() * 4;
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".to_string(), json!(metadata));
    }
    header.insert(
        name.to_string(),
        json!({"dtype": "F32", "shape": shape, "data_offsets": [0, n_bytes]}),
    );
    let mut text = serde_json::to_string(&Value::Object(header))?;
    text.push_str(&" ".repeat((HEADER_ALIGN - text.len() % HEADER_ALIGN) % HEADER_ALIGN));
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(text.as_bytes())?;
    Ok(())
}

/// Writes f32 values little-endian, [`CHUNK_VALUES`] at a time (the data of a safetensors or
/// `.npy` file after its header).
pub fn write_values(w: &mut dyn Write, data: &[f32]) -> Result<()> {
    let mut buf = Vec::with_capacity(CHUNK_VALUES.min(data.len()) * 4);
    for chunk in data.chunks(CHUNK_VALUES) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        w.write_all(&buf)?;
    }
    Ok(())
}

/// Writes tensor `name` (`shape`, f32 values `data`) with `metadata` as a safetensors file.
pub fn write_f32(
    w: &mut dyn Write,
    name: &str,
    shape: &[u64],
    data: &[f32],
    metadata: &HashMap<String, String>,
) -> Result<()> {
    write_f32_header(w, name, shape, metadata)?;
    write_values(w, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    /// Read back with the `safetensors` crate, the reader numpy/PyTorch users have.
    #[test]
    fn streamed_file_reads_back_with_the_safetensors_crate() {
        let data: Vec<f32> = (0..150_000).map(|i| i as f32 * 0.5 - 7.25).collect();
        let meta = HashMap::from([("source".to_string(), "m.gguf".to_string())]);
        let mut out = Vec::new();
        write_f32(&mut out, "blk.0.w", &[3, 50_000], &data, &meta).unwrap();
        let (_, m) = SafeTensors::read_metadata(&out).unwrap();
        assert_eq!(m.metadata().as_ref().unwrap()["source"], "m.gguf");
        let st = SafeTensors::deserialize(&out).unwrap();
        let t = st.tensor("blk.0.w").unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        assert_eq!(t.shape(), &[3, 50_000]);
        let back: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, data);
    }
}
