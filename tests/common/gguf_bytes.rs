//! A GGUF byte builder for tests: writes the header, metadata, tensor infos, padding and data
//! section with full control over every field (counts, lengths, type ids, byte order), and
//! records where each field landed so a test can corrupt exactly one and predict the offset
//! an error message must name.
//!
//! Layout from ggml's `docs/gguf.md` (ggml-org/ggml): magic `GGUF`, u32 version, u64 tensor
//! count, u64 metadata count, metadata pairs (u64 key length, key bytes, u32 value type, value),
//! tensor infos (u64 name length, name, u32 n_dims, n_dims x u64 ne, u32 ggml type, u64 data
//! offset), zero padding to the alignment, data section. Type ids are written here as numbers
//! from ggml's `gguf.h` and `ggml.h`, not taken from glmdiff, so the tests stay independent.

#![allow(dead_code)]

/// GGUF metadata value type ids (`enum gguf_type` in ggml's `include/gguf.h`).
pub mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// GGML tensor type ids (`enum ggml_type` in ggml's `include/ggml.h`).
pub mod gt {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const I32: u32 = 26;
}

/// A metadata value as it will be written. `Bool` takes the raw byte so that a test can
/// write 2; `Raw` writes a type id and arbitrary bytes.
#[derive(Clone, Debug)]
pub enum Val {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(u8),
    Str(String),
    /// Element type id and elements (written without checking that they match it).
    Arr(u32, Vec<Val>),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Type id and the bytes that follow it, verbatim.
    Raw(u32, Vec<u8>),
}

impl Val {
    /// The type id written before the value.
    pub fn type_id(&self) -> u32 {
        match self {
            Val::U8(_) => vt::U8,
            Val::I8(_) => vt::I8,
            Val::U16(_) => vt::U16,
            Val::I16(_) => vt::I16,
            Val::U32(_) => vt::U32,
            Val::I32(_) => vt::I32,
            Val::F32(_) => vt::F32,
            Val::Bool(_) => vt::BOOL,
            Val::Str(_) => vt::STRING,
            Val::Arr(..) => vt::ARRAY,
            Val::U64(_) => vt::U64,
            Val::I64(_) => vt::I64,
            Val::F64(_) => vt::F64,
            Val::Raw(t, _) => *t,
        }
    }
}

/// A byte sink that writes numbers in the chosen byte order.
#[derive(Clone, Debug, Default)]
pub struct W {
    pub buf: Vec<u8>,
    pub be: bool,
}

impl W {
    pub fn new(be: bool) -> W {
        W {
            buf: Vec::new(),
            be,
        }
    }
    pub fn pos(&self) -> usize {
        self.buf.len()
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut W {
        self.buf.extend_from_slice(b);
        self
    }
    pub fn u8(&mut self, v: u8) -> &mut W {
        self.raw(&[v])
    }
    pub fn u16(&mut self, v: u16) -> &mut W {
        let b = if self.be {
            v.to_be_bytes()
        } else {
            v.to_le_bytes()
        };
        self.raw(&b)
    }
    pub fn u32(&mut self, v: u32) -> &mut W {
        let b = if self.be {
            v.to_be_bytes()
        } else {
            v.to_le_bytes()
        };
        self.raw(&b)
    }
    pub fn u64(&mut self, v: u64) -> &mut W {
        let b = if self.be {
            v.to_be_bytes()
        } else {
            v.to_le_bytes()
        };
        self.raw(&b)
    }
    /// A GGUF string: u64 length, then the bytes.
    pub fn str(&mut self, s: &str) -> &mut W {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// A value without its type id (arrays: element type, count, elements).
    pub fn val(&mut self, v: &Val) -> &mut W {
        match v {
            Val::U8(x) => self.u8(*x),
            Val::I8(x) => self.u8(*x as u8),
            Val::U16(x) => self.u16(*x),
            Val::I16(x) => self.u16(*x as u16),
            Val::U32(x) => self.u32(*x),
            Val::I32(x) => self.u32(*x as u32),
            Val::F32(x) => self.u32(x.to_bits()),
            Val::Bool(x) => self.u8(*x),
            Val::Str(s) => self.str(s),
            Val::Arr(et, items) => {
                self.u32(*et).u64(items.len() as u64);
                for it in items {
                    self.val(it);
                }
                self
            }
            Val::U64(x) => self.u64(*x),
            Val::I64(x) => self.u64(*x as u64),
            Val::F64(x) => self.u64(x.to_bits()),
            Val::Raw(_, b) => self.raw(b),
        }
    }
}

/// One tensor info record.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    /// n_dims as written; `None` writes `ne.len()`.
    pub n_dims: Option<u32>,
    pub ne: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

/// A tensor info record with `n_dims = ne.len()`.
pub fn tensor(name: &str, ne: &[u64], ty: u32, offset: u64) -> Tensor {
    Tensor {
        name: name.to_string(),
        n_dims: None,
        ne: ne.to_vec(),
        ty,
        offset,
    }
}

/// A whole file. Every field can be set to a wrong value.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub be: bool,
    pub magic: [u8; 4],
    pub version: u32,
    /// Tensor count as written; `None` writes `tensors.len()`.
    pub n_tensors: Option<u64>,
    /// Metadata count as written; `None` writes `kvs.len()`.
    pub n_kv: Option<u64>,
    pub kvs: Vec<(String, Val)>,
    pub tensors: Vec<Tensor>,
    /// Padding target after the tensor infos (independent of any `general.alignment` written);
    /// no padding is written when there are neither tensors nor data.
    pub pad_to: usize,
    /// Bytes of the data section.
    pub data: Vec<u8>,
}

/// Where the fields of a built file landed.
#[derive(Clone, Debug, Default)]
pub struct Built {
    pub bytes: Vec<u8>,
    /// Offset of each metadata pair (its key length field).
    pub kv_at: Vec<usize>,
    /// Offset of each metadata value's type id.
    pub type_at: Vec<usize>,
    /// Offset of each metadata value (after its type id).
    pub value_at: Vec<usize>,
    /// Offset of each tensor info record (its name length field).
    pub info_at: Vec<usize>,
    /// Offset of each tensor info's n_dims field.
    pub n_dims_at: Vec<usize>,
    /// Offset of each tensor info's ggml type field.
    pub ty_at: Vec<usize>,
    /// Offset of each tensor info's data offset field.
    pub offset_at: Vec<usize>,
    /// End of the tensor infos.
    pub infos_end: usize,
    /// Start of the data section.
    pub data_start: usize,
}

impl Default for Gguf {
    fn default() -> Gguf {
        Gguf {
            be: false,
            magic: *b"GGUF",
            version: 3,
            n_tensors: None,
            n_kv: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            pad_to: 32,
            data: Vec::new(),
        }
    }
}

impl Gguf {
    /// Adds a metadata pair.
    pub fn kv(mut self, key: &str, v: Val) -> Gguf {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// Adds a tensor info.
    pub fn tensor(mut self, t: Tensor) -> Gguf {
        self.tensors.push(t);
        self
    }

    /// Sets the data section.
    pub fn data(mut self, d: Vec<u8>) -> Gguf {
        self.data = d;
        self
    }

    /// Writes the file and records field offsets.
    pub fn build(&self) -> Built {
        let mut w = W::new(self.be);
        let mut b = Built::default();
        w.raw(&self.magic).u32(self.version);
        w.u64(self.n_tensors.unwrap_or(self.tensors.len() as u64));
        w.u64(self.n_kv.unwrap_or(self.kvs.len() as u64));
        for (k, v) in &self.kvs {
            b.kv_at.push(w.pos());
            w.str(k);
            b.type_at.push(w.pos());
            w.u32(v.type_id());
            b.value_at.push(w.pos());
            w.val(v);
        }
        for t in &self.tensors {
            b.info_at.push(w.pos());
            w.str(&t.name);
            b.n_dims_at.push(w.pos());
            w.u32(t.n_dims.unwrap_or(t.ne.len() as u32));
            for &d in &t.ne {
                w.u64(d);
            }
            b.ty_at.push(w.pos());
            w.u32(t.ty);
            b.offset_at.push(w.pos());
            w.u64(t.offset);
        }
        b.infos_end = w.pos();
        // A file without tensors ends after its metadata (so byte counts in tests stay simple).
        while (!self.tensors.is_empty() || !self.data.is_empty())
            && w.pos() % self.pad_to.max(1) != 0
        {
            w.u8(0);
        }
        b.data_start = w.pos();
        w.raw(&self.data);
        b.bytes = w.buf;
        b
    }

    /// Just the bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.build().bytes
    }
}

/// `n` f32 values `base, base + 1, ...` in the given byte order.
pub fn f32_data(n: usize, base: f32, be: bool) -> Vec<u8> {
    let mut w = W::new(be);
    for i in 0..n {
        w.u32((base + i as f32).to_bits());
    }
    w.buf
}
