//! One GGUF file: header, metadata, tensor infos, bounds checks, zero-copy tensor bytes.
//!
//! Layout (ggml `docs/gguf.md`, `src/gguf.cpp`): magic `GGUF`, u32 version, u64 tensor count,
//! u64 metadata count, metadata key/value pairs, tensor infos, padding to `general.alignment`,
//! then the data section. Every count, length and offset read from the file is checked against
//! the bytes left before it is used, so a malformed file gives an error that names the file,
//! the field, its offset and the numbers, never a panic or a huge allocation.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

use super::value::{Value, ValueType};
use crate::quant::{GgmlType, TypeStatus, TYPE_TABLE};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays accepted in metadata (real files use 1; the bound stops bombs).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most array elements read from one file's metadata, all arrays together: each element is held
/// as a [`Value`] of 32 bytes, so a count bounded by the file's size alone (one byte per `u8`)
/// could ask for 32 times the file in memory. Real files hold under a million (GLM-5's
/// tokenizer: 154,880 tokens, their types and about 320,000 merges); the limit keeps the
/// metadata under 256 MiB.
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// Longest key or tensor name accepted (ggml limits names to 63 bytes; keys are free-form).
pub const MAX_NAME_LEN: u64 = 65_535;
/// Metadata key that sets the alignment of the data section (must be a u32 power of two).
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// Smallest tensor info record: name length u64, n_dims u32, one u64 dimension, type u32,
/// offset u64.
const MIN_TENSOR_INFO_BYTES: u64 = 32;
/// Smallest metadata pair: key length u64, type u32, one byte of value.
const MIN_KV_BYTES: u64 = 13;
/// Largest dimension or element count: ggml stores them as int64_t.
const I64_MAX: u64 = i64::MAX as u64;

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
        // A regular file (checked before the open, which would wait on a FIFO).
        let file = crate::util::open_regular(path, "gguf")?;
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
        let (header, tensors, offset_fields, infos_end) = {
            let mut r = Reader {
                buf: backing.bytes(),
                pos: 0,
                be: false,
                path: &path,
                array_elements: 0,
            };
            let header = r.header()?;
            let (tensors, offset_fields) = r.tensor_infos(header.n_tensors)?;
            (header, tensors, offset_fields, r.pos as u64)
        };
        let Header {
            version,
            big_endian,
            metadata,
            key_index,
            value_at,
            ..
        } = header;
        let alignment = match key_index.get(KEY_ALIGNMENT).copied() {
            None => DEFAULT_ALIGNMENT,
            Some(i) => {
                let at = value_at[i];
                match &metadata[i].1 {
                    Value::U32(a) if a.is_power_of_two() => u64::from(*a),
                    Value::U32(a) => bail!(
                        "gguf: {}: metadata value \"{KEY_ALIGNMENT}\" at offset {at}: alignment is {a}; it must be a power of two",
                        path.display()
                    ),
                    v => bail!(
                        "gguf: {}: metadata value \"{KEY_ALIGNMENT}\" at offset {at}: type is {}; it must be u32",
                        path.display(),
                        v.value_type().name()
                    ),
                }
            }
        };
        // Cannot overflow: `infos_end` is at most the file length and `alignment` below 2^32.
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
        f.check_tensors(&offset_fields)?;
        Ok(f)
    }

    /// Checks every tensor: unique names, offsets aligned, data inside the file, no overlaps.
    /// `offset_fields[i]` is the file offset of tensor `i`'s data offset field (for messages).
    fn check_tensors(&mut self, offset_fields: &[u64]) -> Result<()> {
        let file_len = self.backing.bytes().len() as u64;
        let p = self.path.display();
        for (i, t) in self.tensors.iter().enumerate() {
            if let Some(j) = self.tensor_index.insert(t.name.clone(), i) {
                bail!(
                    "gguf: {p}: name of tensor info #{i} at offset {}: tensor {:?} appears twice (tensor infos #{j} at offset {} and #{i})",
                    t.info_offset,
                    t.name,
                    self.tensors[j].info_offset
                );
            }
            let at = offset_fields[i];
            if t.offset % self.alignment != 0 {
                bail!(
                    "gguf: {p}: data offset of tensor {:?} at offset {at}: {} is not a multiple of the alignment {}",
                    t.name,
                    t.offset,
                    self.alignment
                );
            }
            let start = u128::from(self.data_start) + u128::from(t.offset);
            let end = start + u128::from(t.nbytes);
            if end > u128::from(file_len) {
                bail!(
                    "gguf: {p}: data offset of tensor {:?} at offset {at}: the tensor ({} {:?}) needs {} bytes at file offset {start} (data section {} + offset {}), but the file has {file_len} bytes ({} missing)",
                    t.name,
                    t.ty,
                    t.ne,
                    t.nbytes,
                    self.data_start,
                    t.offset,
                    end - u128::from(file_len)
                );
            }
        }
        // Every range now lies inside the file, so `offset + nbytes` cannot overflow. Walk the
        // tensors by offset, remembering the non-empty tensor that reaches furthest: comparing
        // only neighbours would miss an overlap hidden behind an empty tensor between them.
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        order.sort_by_key(|&i| self.tensors[i].offset);
        let mut furthest: Option<&TensorInfo> = None;
        for &i in &order {
            let b = &self.tensors[i];
            if b.nbytes == 0 {
                continue;
            }
            if let Some(a) = furthest {
                if a.offset + a.nbytes > b.offset {
                    bail!(
                        "gguf: {p}: data offset of tensor {:?} at offset {}: its bytes {}..{} overlap tensor {:?} (bytes {}..{}) in the data section",
                        b.name,
                        offset_fields[i],
                        b.offset,
                        b.offset + b.nbytes,
                        a.name,
                        a.offset,
                        a.offset + a.nbytes
                    );
                }
            }
            if furthest.is_none_or(|a| b.offset + b.nbytes > a.offset + a.nbytes) {
                furthest = Some(b);
            }
        }
        Ok(())
    }

    /// Path of the file (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the bytes are a map of the file at [`GgufFile::path`] (not a buffer held in
    /// memory): then a tensor's bytes can also be read from that file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mmap(_))
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

    /// The bytes before the data section: header, metadata and tensor infos (what identifies the
    /// file's contents cheaply, e.g. for cache keys).
    pub fn header_bytes(&self) -> &[u8] {
        let b = self.backing.bytes();
        &b[..(self.data_start as usize).min(b.len())]
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

    /// The raw bytes of a tensor of this file (zero-copy view into the map). `t` must be one of
    /// this file's tensor infos (same name, type, dimensions, offset and size); an info from
    /// another file is an error, never an out-of-bounds read.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8]> {
        self.check_own(t)?;
        self.data_slice(t, t.offset, t.nbytes)
    }

    /// The raw bytes of rows `rows` of a tensor of this file (rows of `ne[0]` elements).
    pub fn row_data(&self, t: &TensorInfo, rows: Range<u64>) -> Result<&[u8]> {
        self.check_own(t)?;
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
        // Cannot overflow: rows.end <= n_rows and n_rows * row_bytes = nbytes, checked at parse.
        let rb = t.row_bytes();
        self.data_slice(t, t.offset + rows.start * rb, (rows.end - rows.start) * rb)
    }

    /// Drops the mapped pages of rows `rows` of `t` from this process's resident set (they stay in
    /// the page cache, and a later read maps them again), so that streaming through a file larger
    /// than memory keeps the resident set at what is being worked on. Best effort: errors are
    /// ignored, and an in-memory file is left alone.
    pub fn release_rows(&self, t: &TensorInfo, rows: Range<u64>) {
        let Backing::Mmap(m) = &self.backing else {
            return;
        };
        if self.check_own(t).is_err() || rows.start >= rows.end || rows.end > t.n_rows() {
            return;
        }
        const PAGE: u64 = 4096;
        let rb = t.row_bytes();
        let start = (self.data_start + t.offset + rows.start * rb) / PAGE * PAGE;
        let end = (self.data_start + t.offset + rows.end * rb).min(m.len() as u64);
        if end > start {
            release(m, start as usize, (end - start) as usize);
        }
    }

    /// Checks that `t` is this file's info of tensor `t.name`, not one from another file.
    fn check_own(&self, t: &TensorInfo) -> Result<()> {
        match self.tensor(&t.name) {
            Some(own)
                if own.offset == t.offset
                    && own.nbytes == t.nbytes
                    && own.ty == t.ty
                    && own.ne == t.ne =>
            {
                Ok(())
            }
            Some(own) => bail!(
                "gguf: {}: tensor {:?} ({} {:?}, {} bytes at data offset {}) does not match this file's ({} {:?}, {} bytes at data offset {}); the info comes from another file",
                self.path.display(),
                t.name,
                t.ty,
                t.ne,
                t.nbytes,
                t.offset,
                own.ty,
                own.ne,
                own.nbytes,
                own.offset
            ),
            None => bail!(
                "gguf: {}: no tensor named {:?} in this file; the info comes from another file",
                self.path.display(),
                t.name
            ),
        }
    }

    /// `len` bytes at `offset` from the start of the data section, bounds-checked.
    fn data_slice(&self, t: &TensorInfo, offset: u64, len: u64) -> Result<&[u8]> {
        let bytes = self.backing.bytes();
        let range = self
            .data_start
            .checked_add(offset)
            .and_then(|s| Some(s..s.checked_add(len)?))
            .filter(|r| r.end <= bytes.len() as u64);
        match range {
            Some(r) => Ok(&bytes[r.start as usize..r.end as usize]),
            None => bail!(
                "gguf: {}: tensor {:?}: {len} bytes at data offset {offset} (data section at {}) run past the end of the {}-byte file",
                self.path.display(),
                t.name,
                self.data_start,
                bytes.len()
            ),
        }
    }
}

/// Parsed header and metadata.
struct Header {
    version: u32,
    big_endian: bool,
    n_tensors: u64,
    metadata: Vec<(String, Value)>,
    /// Key -> index into `metadata`.
    key_index: HashMap<String, usize>,
    /// File offset of each metadata value (after its type id), for messages.
    value_at: Vec<u64>,
}

/// A bounds-checked cursor over the file's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    be: bool,
    path: &'a Path,
    /// Array elements read so far (bounded by [`MAX_ARRAY_ELEMENTS`]).
    array_elements: u64,
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
        anyhow::anyhow!(
            "gguf: {}: {} at offset {}: {msg}",
            self.path.display(),
            what(),
            self.pos
        )
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
                    "truncated: count {n} cannot fit: the {} bytes left in the {}-byte file hold at most {fits} entries of {min_size}+ bytes",
                    self.left() - 8,
                    self.buf.len()
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
            return Err(self.fail(
                what,
                format!("string length {len} exceeds the limit {max_len}"),
            ));
        }
        if len > self.left() {
            self.pos = at;
            return Err(self.fail(
                what,
                format!(
                    "truncated: string length {len} exceeds the {} bytes left in the {}-byte file",
                    self.left() - 8,
                    self.buf.len()
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
                "gguf: {}: magic at offset 0: bytes are {:02x?} ({:?}), expected \"GGUF\": not a GGUF file",
                self.path.display(),
                magic,
                String::from_utf8_lossy(magic)
            );
        }
        let raw_version = self.u32(&|| "version".to_string())?;
        let mut version = raw_version;
        let mut big_endian = false;
        if version & 0xFFFF == 0 && version != 0 {
            // A big-endian writer stores 3 as 00 00 00 03, which reads as 0x03000000 here
            // (the same test as ggml's `gguf.cpp` and gguf-py's `gguf_reader.py`).
            big_endian = true;
            self.be = true;
            version = version.swap_bytes();
        }
        if version != 2 && version != 3 {
            let order = if big_endian {
                format!(" (0x{raw_version:08x} read little-endian, so the file looked big-endian)")
            } else {
                String::new()
            };
            bail!(
                "gguf: {}: version at offset 4: version is {version}{order}; glmdiff reads GGUF versions 2 and 3",
                self.path.display()
            );
        }
        let n_tensors = self.count(MIN_TENSOR_INFO_BYTES, &|| "tensor count".to_string())?;
        let n_kv = self.count(MIN_KV_BYTES, &|| "metadata count".to_string())?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index: HashMap<String, usize> = HashMap::with_capacity(n_kv as usize);
        let mut key_at = Vec::with_capacity(n_kv as usize);
        let mut value_at = Vec::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let at = self.pos;
            let key_what = || format!("metadata key #{i}");
            let key = self.string(MAX_NAME_LEN, &key_what)?;
            if key.is_empty() {
                self.pos = at;
                return Err(self.fail(&key_what, "the key is empty".to_string()));
            }
            if let Some(&j) = key_index.get(&key) {
                self.pos = at;
                return Err(self.fail(
                    &key_what,
                    format!(
                        "key {key:?} appears twice (first as metadata key #{j} at offset {})",
                        key_at[j]
                    ),
                ));
            }
            let ty_at = self.pos;
            let ty_what = || format!("type of metadata value {key:?}");
            let tid = self.u32(&ty_what)?;
            let Some(ty) = ValueType::from_id(tid) else {
                self.pos = ty_at;
                return Err(self.fail(
                    &ty_what,
                    format!("value type {tid} is not a GGUF type (0..=12)"),
                ));
            };
            let k = key.clone();
            let what = move || format!("metadata value {k:?}");
            value_at.push(self.pos as u64);
            let v = self.value(ty, 0, &what)?;
            key_index.insert(key.clone(), metadata.len());
            key_at.push(at as u64);
            metadata.push((key, v));
        }
        Ok(Header {
            version,
            big_endian,
            n_tensors,
            metadata,
            key_index,
            value_at,
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
                let et_at = self.pos;
                let tid = self.u32(what)?;
                let Some(et) = ValueType::from_id(tid) else {
                    self.pos = et_at;
                    return Err(self.fail(
                        what,
                        format!("array element type {tid} is not a GGUF type (0..=12)"),
                    ));
                };
                let at = self.pos;
                let n = self.count(et.min_size() as u64, what)?;
                if self.array_elements + n > MAX_ARRAY_ELEMENTS {
                    self.pos = at;
                    return Err(self.fail(
                        what,
                        format!(
                            "array of {n} elements: the metadata's arrays would hold {} elements in all, more than the {MAX_ARRAY_ELEMENTS} glmdiff reads (a tokenizer has under a million)",
                            self.array_elements + n
                        ),
                    ));
                }
                self.array_elements += n;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1, what)?);
                }
                Value::Array(et, v)
            }
        })
    }

    /// Reads `n` tensor infos; also returns the file offset of each one's data offset field.
    fn tensor_infos(&mut self, n: u64) -> Result<(Vec<TensorInfo>, Vec<u64>)> {
        let mut out = Vec::with_capacity(n as usize);
        let mut offset_fields = Vec::with_capacity(n as usize);
        for i in 0..n {
            let info_offset = self.pos as u64;
            let name = self.string(MAX_NAME_LEN, &|| format!("name of tensor info #{i}"))?;
            if name.is_empty() {
                self.pos = info_offset as usize;
                return Err(self.fail(
                    &|| format!("name of tensor info #{i}"),
                    "the name is empty; every tensor needs one (ggml accepts 1 to 63 bytes)".into(),
                ));
            }
            let nd_at = self.pos;
            let nd_what = || format!("n_dims of tensor {name:?}");
            let n_dims = self.u32(&nd_what)?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                self.pos = nd_at;
                return Err(self.fail(
                    &nd_what,
                    format!("n_dims is {n_dims}; ggml tensors have 1 to {MAX_DIMS} dimensions"),
                ));
            }
            let ne_at = self.pos;
            let mut ne = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                ne.push(self.u64(&|| format!("ne[{d}] of tensor {name:?}"))?);
            }
            let ne_what = || format!("ne of tensor {name:?}");
            // ggml keeps dimensions and element counts in int64_t (`gguf.cpp` rejects negative
            // ne and products >= INT64_MAX). The row count and row bytes are checked too: with a
            // zero dimension the element count is 0 while they could still overflow.
            if let Some(d) = ne.iter().position(|&x| x > I64_MAX) {
                self.pos = ne_at;
                return Err(self.fail(
                    &ne_what,
                    format!("ne[{d}] = {} in {ne:?} exceeds 2^63 - 1", ne[d]),
                ));
            }
            let product = |dims: &[u64]| {
                dims.iter()
                    .try_fold(1u64, |acc, &x| acc.checked_mul(x).filter(|&t| t <= I64_MAX))
            };
            let (Some(total), Some(_)) = (product(&ne), product(&ne[1..])) else {
                self.pos = ne_at;
                return Err(self.fail(
                    &ne_what,
                    format!("dimensions {ne:?} overflow: the element count exceeds 2^63 - 1"),
                ));
            };
            let ty_at = self.pos;
            let ty_what = || format!("type of tensor {name:?}");
            let tid = self.u32(&ty_what)?;
            let ty = match GgmlType::from_id(tid) {
                None => {
                    self.pos = ty_at;
                    return Err(self.fail(
                        &ty_what,
                        format!(
                            "type id {tid} is not a ggml type (known ids 0..={})",
                            TYPE_TABLE.len() - 1
                        ),
                    ));
                }
                Some(t) if t.status() == TypeStatus::Removed => {
                    self.pos = ty_at;
                    return Err(self.fail(
                        &ty_what,
                        format!("type id {tid} ({t}) was removed from ggml; re-convert the model"),
                    ));
                }
                Some(t) => t,
            };
            if ne[0] % ty.block_size() as u64 != 0 {
                self.pos = ty_at;
                return Err(self.fail(
                    &ty_what,
                    format!(
                        "ne[0] = {} is not a multiple of the {ty} block size {}",
                        ne[0],
                        ty.block_size()
                    ),
                ));
            }
            let (Some(nbytes), Some(_)) = (ty.bytes_for(total), ty.bytes_for(ne[0])) else {
                self.pos = ty_at;
                return Err(self.fail(
                    &ty_what,
                    format!("byte size of {ty} tensor {ne:?} overflows"),
                ));
            };
            offset_fields.push(self.pos as u64);
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
        Ok((out, offset_fields))
    }
}

/// `madvise(MADV_DONTNEED)` on a range of a read-only file map.
#[cfg(unix)]
fn release(m: &Mmap, offset: usize, len: usize) {
    // SAFETY: the map is a shared, read-only mapping of a file glmdiff never writes. DONTNEED
    // only drops this process's page-table entries; the next access faults the same file bytes
    // back in from the page cache, so every live slice into the map keeps reading the same data.
    let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
}

/// No page release off Unix.
#[cfg(not(unix))]
fn release(_: &Mmap, _: usize, _: usize) {}
