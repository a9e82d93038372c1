//! A GGUF v3 writer for synthetic models and fixtures.
//!
//! The layout follows ggml's `src/gguf.cpp` (`gguf_write_to_file`) and gguf-py's
//! `gguf/gguf_writer.py`: magic, version, tensor count, metadata count, metadata pairs, tensor
//! infos, zero padding to `general.alignment`, then each tensor's bytes followed by zero padding
//! to the alignment (the last tensor included). Tensor data is not held here: the caller streams
//! each tensor's bytes (already in its storage format) when the file is written, so a file of
//! many gigabytes never sits in memory.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::file::{TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_ALIGNMENT, MAX_DIMS};
use super::value::{Value, ValueType};
use crate::quant::{GgmlType, TypeStatus};
use crate::util::atomic::write_atomic;

/// The GGUF version this writer produces.
pub const GGUF_WRITE_VERSION: u32 = 3;
/// Longest tensor name ggml accepts (`GGML_MAX_NAME` is 64 bytes including the final NUL).
pub const MAX_TENSOR_NAME_BYTES: usize = 63;
/// Size of the zero buffer used for padding (alignments are at most this in practice; larger
/// ones are written in several pieces).
const PAD_CHUNK: usize = 256;

/// A tensor declared to the writer: name, dimensions (fastest first) and storage type.
#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    ne: Vec<u64>,
    ty: GgmlType,
    nbytes: u64,
}

impl PendingTensor {
    /// Bytes of this tensor's info record: name, n_dims, ne, type, offset.
    fn info_len(&self) -> u64 {
        8 + self.name.len() as u64 + 4 + 8 * self.ne.len() as u64 + 4 + 8
    }
}

/// Builds a GGUF file: metadata and tensor infos are declared first, then
/// [`GgufWriter::write_file`] streams the tensor bytes from a callback.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

/// Rounds `n` up to a multiple of `align` (a power of two).
fn pad_to(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// Checks that every element of an array value has the declared element type, at any depth.
fn check_array(key: &str, v: &Value, depth: usize) -> Result<()> {
    if let Value::Array(et, elems) = v {
        if depth >= super::file::MAX_ARRAY_DEPTH {
            bail!(
                "gguf: metadata key {key:?}: arrays nested deeper than {} levels",
                super::file::MAX_ARRAY_DEPTH
            );
        }
        for (i, e) in elems.iter().enumerate() {
            if e.value_type() != *et {
                bail!(
                    "gguf: metadata key {key:?}: array element #{i} has type {}, but the array holds {}",
                    e.value_type().name(),
                    et.name()
                );
            }
            check_array(key, e, depth + 1)?;
        }
    }
    Ok(())
}

/// Writes `v` without its type id (the caller writes the id where GGUF wants one).
fn write_value(w: &mut dyn Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&x.to_le_bytes()),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_str(w, s),
        Value::Array(et, elems) => {
            w.write_all(&(*et as u32).to_le_bytes())?;
            w.write_all(&(elems.len() as u64).to_le_bytes())?;
            for e in elems {
                write_value(w, e)?;
            }
            Ok(())
        }
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// A GGUF string: u64 byte length, then the UTF-8 bytes (no terminator).
fn write_str(w: &mut dyn Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_zeros(w: &mut dyn Write, mut n: u64) -> std::io::Result<()> {
    let zeros = [0u8; PAD_CHUNK];
    while n > 0 {
        let k = n.min(PAD_CHUNK as u64) as usize;
        w.write_all(&zeros[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Counts the bytes that pass through to `inner`.
struct Counting<'a> {
    inner: &'a mut dyn Write,
    n: u64,
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Fills one tensor: receives the tensor's final info (offset included) and a sink that must
/// receive exactly `info.nbytes` bytes.
pub type FillFn<'a> = dyn FnMut(&TensorInfo, &mut dyn Write) -> Result<()> + 'a;

impl GgufWriter {
    /// An empty writer (alignment 32 until `general.alignment` is set).
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds metadata pair `key` = `value`. Keys must be unique and non-empty, arrays must hold
    /// elements of their declared type, and `general.alignment` must be a u32 power of two.
    pub fn add(&mut self, key: &str, value: Value) -> Result<()> {
        if key.is_empty() {
            bail!("gguf: metadata key is empty");
        }
        if self.keys.contains(key) {
            bail!("gguf: metadata key {key:?} added twice");
        }
        if key == KEY_ALIGNMENT {
            match value {
                Value::U32(a) if a.is_power_of_two() => {}
                ref v => bail!(
                    "gguf: metadata key {KEY_ALIGNMENT:?} must be a u32 power of two, got {} {v}",
                    v.value_type().name()
                ),
            }
        }
        check_array(key, &value, 0)?;
        self.keys.insert(key.to_string());
        self.metadata.push((key.to_string(), value));
        Ok(())
    }

    /// Adds a string value.
    pub fn add_str(&mut self, key: &str, s: &str) -> Result<()> {
        self.add(key, Value::String(s.to_string()))
    }

    /// Adds a u32 value.
    pub fn add_u32(&mut self, key: &str, v: u32) -> Result<()> {
        self.add(key, Value::U32(v))
    }

    /// Adds an f32 value.
    pub fn add_f32(&mut self, key: &str, v: f32) -> Result<()> {
        self.add(key, Value::F32(v))
    }

    /// Adds a bool value.
    pub fn add_bool(&mut self, key: &str, v: bool) -> Result<()> {
        self.add(key, Value::Bool(v))
    }

    /// Adds an array of strings.
    pub fn add_str_array<S: AsRef<str>>(&mut self, key: &str, items: &[S]) -> Result<()> {
        let v = items
            .iter()
            .map(|s| Value::String(s.as_ref().to_string()))
            .collect();
        self.add(key, Value::Array(ValueType::String, v))
    }

    /// Declares a tensor. Its bytes are supplied later, in declaration order, by the callback
    /// given to [`GgufWriter::write_to`] / [`GgufWriter::write_file`].
    pub fn add_tensor(&mut self, name: &str, ne: &[u64], ty: GgmlType) -> Result<()> {
        if name.is_empty() || name.len() > MAX_TENSOR_NAME_BYTES {
            bail!(
                "gguf: tensor name {name:?} has {} bytes; ggml accepts 1 to {MAX_TENSOR_NAME_BYTES}",
                name.len()
            );
        }
        if self.names.contains(name) {
            bail!("gguf: tensor {name:?} added twice");
        }
        if ne.is_empty() || ne.len() > MAX_DIMS {
            bail!(
                "gguf: tensor {name:?}: {} dimensions {ne:?}; ggml tensors have 1 to {MAX_DIMS}",
                ne.len()
            );
        }
        if matches!(ty.status(), TypeStatus::Removed) {
            bail!("gguf: tensor {name:?}: type {ty} was removed from ggml");
        }
        let bs = ty.block_size() as u64;
        if ne[0] % bs != 0 {
            bail!(
                "gguf: tensor {name:?}: ne[0] = {} is not a multiple of the {ty} block size {bs}",
                ne[0]
            );
        }
        let total = ne
            .iter()
            .try_fold(1u64, |a, &x| {
                a.checked_mul(x).filter(|&t| t <= i64::MAX as u64)
            })
            .with_context(|| format!("gguf: tensor {name:?}: dimensions {ne:?} overflow"))?;
        let nbytes = ty.bytes_for(total).with_context(|| {
            format!("gguf: tensor {name:?}: byte size of {ty} {ne:?} overflows")
        })?;
        self.names.insert(name.to_string());
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ne: ne.to_vec(),
            ty,
            nbytes,
        });
        Ok(())
    }

    /// The alignment of the data section (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == KEY_ALIGNMENT)
            .and_then(|(_, v)| v.as_int())
            .map_or(DEFAULT_ALIGNMENT, |a| a as u64)
    }

    /// Number of declared tensors.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// File offset where the tensor infos start (after the header and the metadata).
    fn infos_start(&self) -> u64 {
        let header = 4 + 4 + 8 + 8; // magic, version, tensor count, metadata count
        let meta: u64 = self
            .metadata
            .iter()
            .map(|(k, v)| 8 + k.len() as u64 + 4 + value_len(v))
            .sum();
        header + meta
    }

    /// Bytes of the header, metadata and tensor infos (before the padding to the data section).
    fn header_len(&self) -> u64 {
        self.infos_start()
            + self
                .tensors
                .iter()
                .map(PendingTensor::info_len)
                .sum::<u64>()
    }

    /// The tensor infos as they will be written: offsets within the data section (each a
    /// multiple of the alignment) and the file offset of each info record.
    pub fn layout(&self) -> Vec<TensorInfo> {
        let align = self.alignment();
        let mut info_offset = self.infos_start();
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            out.push(TensorInfo {
                name: t.name.clone(),
                ne: t.ne.clone(),
                ty: t.ty,
                offset,
                nbytes: t.nbytes,
                info_offset,
            });
            info_offset += t.info_len();
            offset += pad_to(t.nbytes, align);
        }
        out
    }

    /// Total size of the file this writer produces.
    pub fn file_len(&self) -> u64 {
        let align = self.alignment();
        let data: u64 = self.tensors.iter().map(|t| pad_to(t.nbytes, align)).sum();
        pad_to(self.header_len(), align) + data
    }

    /// Writes the whole file to `w`. `fill` is called once per tensor in declaration order and
    /// must write exactly that tensor's `nbytes`. Returns the number of bytes written.
    pub fn write_to(&self, w: &mut dyn Write, fill: &mut FillFn<'_>) -> Result<u64> {
        let align = self.alignment();
        let mut c = Counting { inner: w, n: 0 };
        let io = |e: std::io::Error| anyhow::anyhow!("gguf: write failed: {e}");
        c.write_all(GGUF_MAGIC).map_err(io)?;
        c.write_all(&GGUF_WRITE_VERSION.to_le_bytes()).map_err(io)?;
        c.write_all(&(self.tensors.len() as u64).to_le_bytes())
            .map_err(io)?;
        c.write_all(&(self.metadata.len() as u64).to_le_bytes())
            .map_err(io)?;
        for (k, v) in &self.metadata {
            write_str(&mut c, k).map_err(io)?;
            c.write_all(&(v.value_type() as u32).to_le_bytes())
                .map_err(io)?;
            write_value(&mut c, v)
                .map_err(io)
                .with_context(|| format!("gguf: metadata key {k:?}"))?;
        }
        let layout = self.layout();
        for t in &layout {
            write_str(&mut c, &t.name).map_err(io)?;
            c.write_all(&(t.ne.len() as u32).to_le_bytes())
                .map_err(io)?;
            for &d in &t.ne {
                c.write_all(&d.to_le_bytes()).map_err(io)?;
            }
            c.write_all(&t.ty.id().to_le_bytes()).map_err(io)?;
            c.write_all(&t.offset.to_le_bytes()).map_err(io)?;
        }
        let pad = pad_to(c.n, align) - c.n;
        write_zeros(&mut c, pad).map_err(io)?;
        let data_start = c.n;
        for t in &layout {
            let start = c.n;
            if start - data_start != t.offset {
                bail!(
                    "gguf: tensor {:?}: data would start at offset {} of the data section, its info says {}",
                    t.name,
                    start - data_start,
                    t.offset
                );
            }
            fill(t, &mut c).with_context(|| format!("gguf: writing tensor {:?}", t.name))?;
            let wrote = c.n - start;
            if wrote != t.nbytes {
                bail!(
                    "gguf: tensor {:?} ({} {:?}): {wrote} bytes were written, it needs {}",
                    t.name,
                    t.ty,
                    t.ne,
                    t.nbytes
                );
            }
            let pad = pad_to(wrote, align) - wrote;
            write_zeros(&mut c, pad).map_err(io)?;
        }
        c.flush().map_err(io)?;
        Ok(c.n)
    }

    /// Writes the file to `path` atomically (temporary file, flush, rename); see
    /// [`GgufWriter::write_to`]. Returns the file size.
    pub fn write_file(&self, path: &Path, fill: &mut FillFn<'_>) -> Result<u64> {
        let mut n = 0;
        write_atomic(path, |w| {
            n = self.write_to(w, fill)?;
            Ok(())
        })
        .with_context(|| format!("gguf: writing {}", path.display()))?;
        Ok(n)
    }

    /// Writes the file into memory (small fixtures and tests).
    pub fn to_bytes(&self, fill: &mut FillFn<'_>) -> Result<Vec<u8>> {
        let mut v = Vec::with_capacity(self.file_len() as usize);
        self.write_to(&mut v, fill)?;
        Ok(v)
    }
}

/// Bytes `v` takes in the file, without its type id.
fn value_len(v: &Value) -> u64 {
    match v {
        Value::String(s) => 8 + s.len() as u64,
        Value::Array(_, elems) => 4 + 8 + elems.iter().map(value_len).sum::<u64>(),
        other => other.value_type().fixed_size().unwrap_or(0) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    /// A tiny file whose every byte is spelled out by hand from the GGUF layout in ggml's
    /// `docs/gguf.md` (not from this writer).
    #[test]
    fn tiny_file_matches_hand_written_bytes() {
        let mut w = GgufWriter::new();
        w.add("a", Value::U8(7)).unwrap();
        w.add_tensor("t", &[2], GgmlType::F32).unwrap();
        let bytes = w
            .to_bytes(&mut |_, out| {
                out.write_all(&1.0f32.to_le_bytes())?;
                out.write_all(&2.0f32.to_le_bytes())?;
                Ok(())
            })
            .unwrap();
        let mut e: Vec<u8> = Vec::new();
        e.extend(b"GGUF");
        e.extend([3, 0, 0, 0]); // version 3
        e.extend([1, 0, 0, 0, 0, 0, 0, 0]); // tensor count
        e.extend([1, 0, 0, 0, 0, 0, 0, 0]); // metadata count
        e.extend([1, 0, 0, 0, 0, 0, 0, 0]); // key length
        e.extend(b"a");
        e.extend([0, 0, 0, 0]); // type u8
        e.push(7);
        e.extend([1, 0, 0, 0, 0, 0, 0, 0]); // name length
        e.extend(b"t");
        e.extend([1, 0, 0, 0]); // n_dims
        e.extend([2, 0, 0, 0, 0, 0, 0, 0]); // ne[0]
        e.extend([0, 0, 0, 0]); // type F32
        e.extend([0, 0, 0, 0, 0, 0, 0, 0]); // offset
        assert_eq!(e.len(), 71);
        e.extend([0u8; 25]); // pad to 96
        e.extend([0x00, 0x00, 0x80, 0x3f]); // 1.0f32
        e.extend([0x00, 0x00, 0x00, 0x40]); // 2.0f32
        e.extend([0u8; 24]); // pad the tensor to 32
        assert_eq!(bytes, e);
        assert_eq!(w.file_len(), 128);
    }

    #[test]
    fn every_value_type_round_trips_through_the_reader() {
        use ValueType as VT;
        let values = vec![
            ("u8", Value::U8(200)),
            ("i8", Value::I8(-100)),
            ("u16", Value::U16(60000)),
            ("i16", Value::I16(-30000)),
            ("u32", Value::U32(4_000_000_000)),
            ("i32", Value::I32(-2_000_000_000)),
            ("f32", Value::F32(1.5e-5)),
            ("bool", Value::Bool(true)),
            ("str", Value::String("héllo ▁world".into())),
            ("u64", Value::U64(u64::MAX - 1)),
            ("i64", Value::I64(i64::MIN + 1)),
            ("f64", Value::F64(-2.5e300)),
            (
                "strs",
                Value::Array(
                    VT::String,
                    vec![Value::String("a".into()), Value::String(String::new())],
                ),
            ),
            (
                "nested",
                Value::Array(
                    VT::Array,
                    vec![
                        Value::Array(VT::I32, vec![Value::I32(1), Value::I32(-2)]),
                        Value::Array(VT::Bool, vec![]),
                    ],
                ),
            ),
            ("empty", Value::Array(VT::F32, vec![])),
        ];
        let mut w = GgufWriter::new();
        for (k, v) in &values {
            w.add(k, v.clone()).unwrap();
        }
        w.add_u32(KEY_ALIGNMENT, 64).unwrap();
        w.add_tensor("x", &[64, 3], GgmlType::Q8_0).unwrap();
        w.add_tensor("y", &[5], GgmlType::F16).unwrap();
        let data: Vec<Vec<u8>> = vec![
            (0..2 * 3 * 34).map(|i| (i % 251) as u8).collect(),
            (0..10).map(|i| i as u8).collect(),
        ];
        let mut i = 0;
        let bytes = w
            .to_bytes(&mut |_, out| {
                out.write_all(&data[i])?;
                i += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(bytes.len() as u64, w.file_len());
        let f = GgufFile::from_bytes("mem.gguf", bytes).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 64);
        for (k, v) in &values {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        assert_eq!(f.tensors().len(), 2);
        let x = f.tensor("x").unwrap();
        assert_eq!(
            (x.ne.clone(), x.ty, x.offset),
            (vec![64, 3], GgmlType::Q8_0, 0)
        );
        let y = f.tensor("y").unwrap();
        assert_eq!(y.offset, 256); // 204 bytes padded to 64
        assert_eq!(f.tensor_data(x).unwrap(), &data[0][..]);
        assert_eq!(f.tensor_data(y).unwrap(), &data[1][..]);
        for (a, b) in w.layout().iter().zip(f.tensors()) {
            assert_eq!(a.info_offset, b.info_offset);
        }
    }

    #[test]
    fn bad_declarations_and_short_data_are_errors() {
        let mut w = GgufWriter::new();
        assert!(w.add("", Value::U8(0)).is_err());
        w.add("k", Value::U8(0)).unwrap();
        assert!(w.add("k", Value::U8(0)).is_err());
        assert!(w.add(KEY_ALIGNMENT, Value::U32(24)).is_err());
        assert!(w.add(KEY_ALIGNMENT, Value::U64(32)).is_err());
        let mixed = Value::Array(ValueType::U8, vec![Value::U8(1), Value::I8(1)]);
        assert!(format!("{:#}", w.add("m", mixed).unwrap_err()).contains("element #1"));
        assert!(w.add_tensor("q", &[100], GgmlType::Q4_K).is_err());
        assert!(w.add_tensor(&"n".repeat(64), &[1], GgmlType::F32).is_err());
        assert!(w.add_tensor("z", &[1, 1, 1, 1, 1], GgmlType::F32).is_err());
        w.add_tensor("t", &[4], GgmlType::F32).unwrap();
        assert!(w.add_tensor("t", &[4], GgmlType::F32).is_err());
        let err = w
            .to_bytes(&mut |_, out| Ok(out.write_all(&[0u8; 12])?))
            .unwrap_err();
        assert!(format!("{err:#}").contains("12 bytes were written, it needs 16"));
    }

    #[test]
    fn file_is_written_atomically_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.gguf");
        let mut w = GgufWriter::new();
        w.add_str("general.architecture", "test").unwrap();
        w.add_tensor("a", &[8], GgmlType::F32).unwrap();
        let n = w
            .write_file(&p, &mut |t, out| {
                Ok(out.write_all(&vec![1u8; t.nbytes as usize])?)
            })
            .unwrap();
        assert_eq!(n, std::fs::metadata(&p).unwrap().len());
        let m = crate::gguf::Model::open(&p).unwrap();
        assert_eq!(m.architecture(), Some("test"));
        assert_eq!(m.tensor_data(m.tensor("a").unwrap()).unwrap(), &[1u8; 32]);
        // A failing callback leaves the old file in place and no temporary behind.
        let err = w.write_file(&p, &mut |_, _| bail!("no data"));
        assert!(err.is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
