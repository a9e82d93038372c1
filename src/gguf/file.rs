//! One GGUF file: header, metadata, tensor infos, bounds checks, zero-copy tensor bytes.
//!
//! Layout (ggml `docs/gguf.md`, `src/gguf.cpp`): magic `GGUF`, u32 version, u64 tensor count,
//! u64 metadata count, metadata key/value pairs, tensor infos, padding to `general.alignment`,
//! then the data section. Every count, length and offset read from the file is checked against
//! the bytes left before it is used, so a malformed file gives an error that names the file,
//! the field, its offset and the numbers, never a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

use super::value::{Value, ValueType};
use crate::quant::{GgmlType, TypeStatus};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays accepted in metadata (real files use 1; the bound stops bombs).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Longest key or tensor name accepted (ggml limits names to 63 bytes; keys are free-form).
pub const MAX_NAME_LEN: u64 = 65_535;

/// The bytes of a GGUF file: a read-only memory map, or an owned buffer (tests, fuzzing).
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A tensor's description from its tensor info record.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name (`blk.3.ffn_down_exps.weight`).
    pub name: String,
    /// Dimensions, fastest-varying first (ggml `ne`). PyTorch shape is this reversed.
    pub ne: Vec<u64>,
    /// Storage type.
    pub ty: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub nbytes: u64,
    /// File offset where this tensor's info record starts (for error messages).
    pub info_offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Elements per row (`ne[0]`).
    pub fn row_len(&self) -> u64 {
        self.ne[0]
    }

    /// Number of rows (product of `ne[1..]`).
    pub fn n_rows(&self) -> u64 {
        self.ne[1..].iter().product()
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.ne[0] / self.ty.block_size() as u64 * self.ty.type_size() as u64
    }

    /// Shape in PyTorch order (slowest first).
    pub fn shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }
}

/// One parsed GGUF file.
pub struct GgufFile {
    path: PathBuf,
    backing: Backing,
    version: u32,
    big_endian: bool,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and checks `path` through a read-only memory map.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).with_context(|| format!("gguf: cannot open {}", path.display()))?;
        // SAFETY: the map is read-only and glmdiff never writes the file. Another process
        // truncating the file while it is mapped would fault; that is the documented caveat of
        // every mmap-based model loader (llama.cpp included) and not something safe Rust can
        // exclude.
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("gguf: cannot map {}", path.display()))?;
        Self::parse(path.to_path_buf(), Backing::Mmap(mmap))
    }

    /// Parses a GGUF held in memory; `name` stands for the file in error messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(PathBuf::from(name), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<GgufFile> {
        let (header, tensors) = {
            let mut r = Reader {
                buf: backing.bytes(),
                pos: 0,
                be: false,
                path: &path,
            };
            let header = r.header()?;
            let tensors = r.tensor_infos(header.n_tensors)?;
            (header, (tensors, r.pos as u64))
        };
        let (tensors, infos_end) = tensors;
        let Header {
            version,
            big_endian,
            metadata,
            ..
        } = header;
        let mut key_index = HashMap::with_capacity(metadata.len());
        for (i, (k, _)) in metadata.iter().enumerate() {
            if key_index.insert(k.clone(), i).is_some() {
                bail!("gguf: {}: metadata key {k:?} appears twice", path.display());
            }
        }
        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
            Some(Value::U32(a)) => bail!(
                "gguf: {}: general.alignment is {a}; it must be a power of two",
                path.display()
            ),
            Some(v) => bail!(
                "gguf: {}: general.alignment has type {}; it must be u32",
                path.display(),
                v.value_type().name()
            ),
        };
        let data_start = infos_end.div_ceil(alignment) * alignment;
        let mut f = GgufFile {
            path,
            backing,
            version,
            big_endian,
            metadata,
            key_index,
            tensors,
            tensor_index: HashMap::new(),
            alignment,
            data_start,
        };
        f.check_tensors()?;
        Ok(f)
    }

    /// Checks every tensor: unique names, offsets aligned, data inside the file, no overlaps.
    fn check_tensors(&mut self) -> Result<()> {
        let file_len = self.backing.bytes().len() as u64;
        let p = self.path.display();
        for (i, t) in self.tensors.iter().enumerate() {
            if let Some(j) = self.tensor_index.insert(t.name.clone(), i) {
                bail!(
                    "gguf: {p}: tensor {:?} appears twice (tensor infos {j} and {i}, at offsets {} and {})",
                    t.name,
                    self.tensors[j].info_offset,
                    t.info_offset
                );
            }
            if t.offset % self.alignment != 0 {
                bail!(
                    "gguf: {p}: tensor {:?}: data offset {} is not a multiple of the alignment {}",
                    t.name,
                    t.offset,
                    self.alignment
                );
            }
            let end = self
                .data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.nbytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => bail!(
                    "gguf: {p}: tensor {:?} ({} {:?}) needs {} bytes at file offset {} (data section {} + offset {}), but the file has {} bytes",
                    t.name,
                    t.ty,
                    t.ne,
                    t.nbytes,
                    self.data_start as u128 + t.offset as u128,
                    self.data_start,
                    t.offset,
                    file_len
                ),
            }
        }
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by_key(|&i| self.tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&self.tensors[w[0]], &self.tensors[w[1]]);
            if a.nbytes > 0 && b.nbytes > 0 && a.offset + a.nbytes > b.offset {
                bail!(
                    "gguf: {p}: tensors {:?} (bytes {}..{}) and {:?} (bytes {}..{}) overlap in the data section",
                    a.name,
                    a.offset,
                    a.offset + a.nbytes,
                    b.name,
                    b.offset,
                    b.offset + b.nbytes
                );
            }
        }
        Ok(())
    }

    /// Path of the file (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Whether the file is big-endian.
    pub fn is_big_endian(&self) -> bool {
        self.big_endian
    }

    /// Alignment of the data section.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// File offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor of this file (zero-copy view into the map).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_start + t.offset) as usize;
        &self.backing.bytes()[start..start + t.nbytes as usize]
    }

    /// The raw bytes of rows `rows` of a tensor (rows of `ne[0]` elements).
    pub fn row_data(&self, t: &TensorInfo, rows: Range<u64>) -> Result<&[u8]> {
        if rows.start > rows.end || rows.end > t.n_rows() {
            bail!(
                "gguf: {}: tensor {:?}: rows {}..{} out of range (it has {} rows)",
                self.path.display(),
                t.name,
                rows.start,
                rows.end,
                t.n_rows()
            );
        }
        let rb = t.row_bytes();
        let start = (self.data_start + t.offset + rows.start * rb) as usize;
        let len = ((rows.end - rows.start) * rb) as usize;
        Ok(&self.backing.bytes()[start..start + len])
    }
}

/// Parsed header and metadata.
struct Header {
    version: u32,
    big_endian: bool,
    n_tensors: u64,
    metadata: Vec<(String, Value)>,
}

/// A bounds-checked cursor over the file's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    be: bool,
    path: &'a Path,
}

macro_rules! read_num {
    ($name:ident, $t:ty) => {
        fn $name(&mut self, what: &dyn Fn() -> String) -> Result<$t> {
            const N: usize = std::mem::size_of::<$t>();
            let b = self.take(N as u64, what)?;
            let mut a = [0u8; N];
            a.copy_from_slice(b);
            Ok(if self.be {
                <$t>::from_be_bytes(a)
            } else {
                <$t>::from_le_bytes(a)
            })
        }
    };
}

impl<'a> Reader<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn fail(&self, what: &dyn Fn() -> String, msg: String) -> anyhow::Error {
        anyhow::anyhow!("gguf: {}: {} at offset {}: {msg}", self.path.display(), what(), self.pos)
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.fail(
                what,
                format!(
                    "truncated: needs {n} bytes, only {} left in the {}-byte file",
                    self.left(),
                    self.buf.len()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    read_num!(u8, u8);
    read_num!(i8, i8);
    read_num!(u16, u16);
    read_num!(i16, i16);
    read_num!(u32, u32);
    read_num!(i32, i32);
    read_num!(u64, u64);
    read_num!(i64, i64);
    read_num!(f32, f32);
    read_num!(f64, f64);

    /// A count of things each at least `min_size` bytes long, bounded by the bytes left.
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<u64> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = self.left() / min_size.max(1);
        if n > fits {
            self.pos = at;
            return Err(self.fail(
                what,
                format!(
                    "count {n} cannot fit: {} bytes left hold at most {fits} entries of {min_size}+ bytes",
                    self.left() - 8
                ),
            ));
        }
        Ok(n)
    }

    fn string(&mut self, max_len: u64, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > max_len {
            self.pos = at;
            return Err(self.fail(what, format!("string length {len} exceeds the limit {max_len}")));
        }
        if len > self.left() {
            self.pos = at;
            return Err(self.fail(
                what,
                format!(
                    "string length {len} exceeds the {} bytes left in the file",
                    self.left() - 8
                ),
            ));
        }
        let b = self.take(len, what)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    fn header(&mut self) -> Result<Header> {
        let magic = self.take(4, &|| "magic".to_string())?;
        if magic != GGUF_MAGIC {
            bail!(
                "gguf: {}: not a GGUF file: magic at offset 0 is {:02x?} ({:?}), expected \"GGUF\"",
                self.path.display(),
                magic,
                String::from_utf8_lossy(magic)
            );
        }
        let mut version = self.u32(&|| "version".to_string())?;
        let mut big_endian = false;
        if version & 0xFFFF == 0 && version != 0 {
            // A big-endian writer stores 3 as 00 00 00 03, which reads as 0x03000000 here.
            big_endian = true;
            self.be = true;
            version = version.swap_bytes();
        }
        if version != 2 && version != 3 {
            bail!(
                "gguf: {}: version at offset 4 is {version}; glmdiff reads GGUF versions 2 and 3",
                self.path.display()
            );
        }
        let n_tensors = self.count(32, &|| "tensor count".to_string())?;
        let n_kv = self.count(13, &|| "metadata count".to_string())?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = self.string(MAX_NAME_LEN, &|| format!("metadata key #{i}"))?;
            let k = key.clone();
            let what = move || format!("metadata value {k:?}");
            let tid = self.u32(&|| format!("type of metadata value {key:?}"))?;
            let ty = ValueType::from_id(tid).ok_or_else(|| {
                self.fail(
                    &|| format!("type of metadata value {key:?}"),
                    format!("value type {tid} is not a GGUF type (0..=12)"),
                )
            })?;
            let v = self.value(ty, 0, &what)?;
            metadata.push((key, v));
        }
        Ok(Header {
            version,
            big_endian,
            n_tensors,
            metadata,
        })
    }

    fn value(&mut self, ty: ValueType, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.i8(what)?),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.i16(what)?),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.i32(what)?),
            ValueType::F32 => Value::F32(self.f32(what)?),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.i64(what)?),
            ValueType::F64 => Value::F64(self.f64(what)?),
            ValueType::Bool => {
                let b = self.u8(what)?;
                if b > 1 {
                    self.pos -= 1;
                    return Err(self.fail(what, format!("bool byte is {b}, expected 0 or 1")));
                }
                Value::Bool(b == 1)
            }
            ValueType::String => Value::String(self.string(u64::MAX, what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.fail(
                        what,
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
                    ));
                }
                let tid = self.u32(what)?;
                let et = ValueType::from_id(tid).ok_or_else(|| {
                    self.fail(what, format!("array element type {tid} is not a GGUF type (0..=12)"))
                })?;
                let n = self.count(et.min_size() as u64, what)?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1, what)?);
                }
                Value::Array(et, v)
            }
        })
    }

    fn tensor_infos(&mut self, n: u64) -> Result<Vec<TensorInfo>> {
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let info_offset = self.pos as u64;
            let name = self.string(MAX_NAME_LEN, &|| format!("name of tensor info #{i}"))?;
            let nm = name.clone();
            let what = move || format!("tensor {nm:?}");
            let nd_at = self.pos;
            let n_dims = self.u32(&|| format!("n_dims of tensor {name:?}"))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                self.pos = nd_at;
                return Err(self.fail(
                    &what,
                    format!("n_dims is {n_dims}; ggml tensors have 1 to {MAX_DIMS} dimensions"),
                ));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                ne.push(self.u64(&|| format!("ne[{d}] of tensor {name:?}"))?);
            }
            let mut total: u64 = 1;
            for &x in &ne {
                total = match total.checked_mul(x) {
                    Some(t) if t <= i64::MAX as u64 => t,
                    _ => {
                        return Err(self.fail(
                            &what,
                            format!("dimensions {ne:?} overflow: the element count exceeds 2^63"),
                        ))
                    }
                };
            }
            let ty_at = self.pos;
            let tid = self.u32(&|| format!("type of tensor {name:?}"))?;
            let ty = match GgmlType::from_id(tid) {
                None => {
                    self.pos = ty_at;
                    return Err(self.fail(
                        &what,
                        format!("type id {tid} is not a ggml type (known ids 0..=41)"),
                    ));
                }
                Some(t) if t.status() == TypeStatus::Removed => {
                    self.pos = ty_at;
                    return Err(self.fail(
                        &what,
                        format!("type id {tid} ({t}) was removed from ggml; re-convert the model"),
                    ));
                }
                Some(t) => t,
            };
            if ne[0] % ty.block_size() as u64 != 0 {
                self.pos = ty_at;
                return Err(self.fail(
                    &what,
                    format!(
                        "ne[0] = {} is not a multiple of the {ty} block size {}",
                        ne[0],
                        ty.block_size()
                    ),
                ));
            }
            let nbytes = ty.bytes_for(total).ok_or_else(|| {
                self.fail(&what, format!("byte size of {total} {ty} elements overflows"))
            })?;
            let offset = self.u64(&|| format!("data offset of tensor {name:?}"))?;
            out.push(TensorInfo {
                name,
                ne,
                ty,
                offset,
                nbytes,
                info_offset,
            });
        }
        Ok(out)
    }
}
