//! A content digest of one tensor of a GGUF, as traces carry it to say which model file they
//! were made from (`model_digest`, docs/hooks.md): SHA-256 of the tensor's name, a 0 byte, its
//! GGML type id (u32 LE), its number of dimensions (u32 LE), each dimension in GGUF order (u64 LE),
//! its data size (u64 LE) and the first `prefix` bytes of its data as stored in the file. The raw
//! blocks, not dequantized values: two quantizations of the same weights differ.

use anyhow::Result;
use sha2::{Digest, Sha256};

use super::model::{Model, TensorRef};

/// Bytes of each tensor's data a digest covers: the first MiB, so that a model's digest reads a
/// few dozen MiB however large its tensors are.
pub const DIGEST_PREFIX_BYTES: u64 = 1 << 20;

/// The digest of tensor `t` of `model` over the first `prefix` bytes of its data, lowercase hex.
pub fn tensor_digest(model: &Model, t: TensorRef<'_>, prefix: u64) -> Result<String> {
    let data = model.tensor_data(t)?;
    let info = t.info;
    let mut h = Sha256::new();
    h.update(info.name.as_bytes());
    h.update([0u8]);
    h.update(info.ty.id().to_le_bytes());
    h.update((info.ne.len() as u32).to_le_bytes());
    for d in &info.ne {
        h.update(d.to_le_bytes());
    }
    h.update(info.nbytes.to_le_bytes());
    h.update(&data[..prefix.min(data.len() as u64) as usize]);
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    /// The hasher against FIPS 180-4's known answer for "abc", then a tensor's digest against
    /// the digest of its layout assembled here by hand, whole and cut to a 12-byte prefix.
    #[test]
    fn digest_covers_name_type_shape_size_and_the_data_prefix() {
        let abc: String = Sha256::digest(b"abc")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            abc,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut w = crate::gguf::GgufWriter::new();
        let vals: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor("w", &[4, 2], crate::quant::GgmlType::F32)
            .expect("tensor");
        let bytes = w
            .to_bytes(&mut |_, out| Ok(out.write_all(&data)?))
            .expect("write");
        let model = Model::from_shards(vec![GgufFile::from_bytes("t.gguf", bytes).expect("parse")])
            .expect("model");
        let t = model.tensor("w").expect("w");
        let mut laid = b"w\0".to_vec();
        laid.extend(0u32.to_le_bytes()); // F32
        laid.extend(2u32.to_le_bytes());
        laid.extend(4u64.to_le_bytes());
        laid.extend(2u64.to_le_bytes());
        laid.extend(32u64.to_le_bytes());
        let hex = |b: &[u8]| -> String {
            Sha256::digest(b)
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect()
        };
        let mut whole = laid.clone();
        whole.extend(&data);
        assert_eq!(
            tensor_digest(&model, t, 1 << 20).expect("digest"),
            hex(&whole)
        );
        let mut cut = laid;
        cut.extend(&data[..12]);
        assert_eq!(tensor_digest(&model, t, 12).expect("digest"), hex(&cut));
    }
}
