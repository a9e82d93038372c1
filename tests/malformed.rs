//! The GGUF reader on malformed input: every case corrupts one field of an otherwise valid file
//! built by `common::gguf_bytes`, and checks that `GgufFile::from_bytes` returns an error (never
//! panics) whose message names the file, the field, its offset and the numbers involved.
//! Offsets and byte counts are worked out from the GGUF layout (ggml `docs/gguf.md`), not read
//! back from glmdiff.

use std::panic::{catch_unwind, AssertUnwindSafe};

use glmdiff::gguf::{GgufFile, Model, Value, ValueType};

use crate::common::gguf_bytes::{f32_data, gt, tensor, vt, Gguf, Val, W};

/// The name every case passes to `from_bytes`; messages must start with it.
const NAME: &str = "case.gguf";
/// Size of the fixed header: magic, version, tensor count, metadata count.
const HEADER: usize = 24;
/// A 64-byte string value that makes the file large enough for the tensor and metadata counts
/// to pass their bounds check, so that truncation further on reaches the field under test.
const PAD_KEY: &str = "general.name";

fn pad_value() -> Val {
    Val::Str("p".repeat(64))
}

/// A file with the padding pair and nothing else.
fn padded() -> Gguf {
    Gguf::default().kv(PAD_KEY, pad_value())
}

/// A valid file: padding pair, one F32 tensor "w" [4, 2] at data offset 0, 32 bytes of data.
fn one_tensor() -> Gguf {
    padded()
        .tensor(tensor("w", &[4, 2], gt::F32, 0))
        .data(f32_data(8, 0.0, false))
}

/// Parses `bytes`, turning a panic into a test failure that says so.
fn parse(bytes: Vec<u8>) -> Result<GgufFile, String> {
    match catch_unwind(AssertUnwindSafe(|| GgufFile::from_bytes(NAME, bytes))) {
        Ok(Ok(f)) => Ok(f),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(_) => panic!("the reader panicked"),
    }
}

/// The error message for `bytes`, which must not parse.
fn error_of(bytes: Vec<u8>) -> String {
    match parse(bytes) {
        Ok(f) => panic!("a malformed file parsed: {f:?}"),
        Err(msg) => {
            assert!(
                msg.starts_with(&format!("gguf: {NAME}: ")),
                "message does not name the file: {msg}"
            );
            msg
        }
    }
}

/// Checks that `bytes` fails with a message containing every one of `parts`.
fn expect_err(bytes: Vec<u8>, parts: &[&str]) -> String {
    let msg = error_of(bytes);
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
    msg
}

fn ok(bytes: Vec<u8>) -> GgufFile {
    parse(bytes).unwrap_or_else(|e| panic!("a valid file was rejected: {e}"))
}

/// An array nested `levels` deep whose innermost array holds one u8.
fn nested(levels: usize) -> Val {
    let mut v = Val::Arr(vt::U8, vec![Val::U8(7)]);
    for _ in 1..levels {
        v = Val::Arr(vt::ARRAY, vec![v]);
    }
    v
}

mod data;
mod header;
mod metadata;
mod tensors;
mod valid;
