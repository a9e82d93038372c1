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

// ---------------------------------------------------------------------------------------------
// Header

#[test]
fn bad_magic() {
    let g = Gguf {
        magic: *b"GGUX",
        ..Gguf::default()
    };
    let msg = expect_err(
        g.bytes(),
        &["magic at offset 0", "GGUX", "expected \"GGUF\""],
    );
    assert!(msg.contains("[47, 47, 55, 58]"), "{msg}");
}

#[test]
fn unsupported_version_1() {
    let g = Gguf {
        version: 1,
        ..Gguf::default()
    };
    expect_err(
        g.bytes(),
        &["version at offset 4: version is 1;", "versions 2 and 3"],
    );
}

#[test]
fn unsupported_version_4() {
    let g = Gguf {
        version: 4,
        ..Gguf::default()
    };
    expect_err(g.bytes(), &["version at offset 4: version is 4;"]);
}

#[test]
fn unsupported_version_0xffff() {
    let g = Gguf {
        version: 0xFFFF,
        ..Gguf::default()
    };
    expect_err(g.bytes(), &["version at offset 4: version is 65535;"]);
}

#[test]
fn unsupported_version_0() {
    let g = Gguf {
        version: 0,
        ..Gguf::default()
    };
    expect_err(g.bytes(), &["version at offset 4: version is 0;"]);
}

#[test]
fn unsupported_version_that_looks_big_endian() {
    // 0x00010000 has its low 16 bits clear, so it reads as a byte-swapped 256.
    let g = Gguf {
        version: 0x0001_0000,
        ..Gguf::default()
    };
    expect_err(
        g.bytes(),
        &["version at offset 4: version is 256 (0x00010000 read little-endian"],
    );
}

#[test]
fn truncated_in_header() {
    let full = Gguf::default().bytes();
    assert_eq!(full.len(), HEADER);
    // (field, start, size) of the four header fields.
    let fields = [
        ("magic", 0, 4),
        ("version", 4, 4),
        ("tensor count", 8, 8),
        ("metadata count", 16, 8),
    ];
    for cut in 0..HEADER {
        let (field, start, size) = fields
            .iter()
            .copied()
            .find(|&(_, s, n)| (s..s + n).contains(&cut))
            .unwrap();
        expect_err(
            full[..cut].to_vec(),
            &[&format!(
                "{field} at offset {start}: truncated: needs {size} bytes, only {} left in the {cut}-byte file",
                cut - start
            )],
        );
    }
    // The empty header itself is a valid file.
    assert_eq!(ok(full).tensors().len(), 0);
}

#[test]
fn truncated_file_fails_the_count_bound() {
    // One metadata pair announced, 12 bytes after the count: a pair takes at least 13.
    let mut b = Gguf::default().kv("k", Val::U8(1)).bytes();
    b.truncate(HEADER + 12);
    expect_err(
        b,
        &["metadata count at offset 16: count 1 cannot fit: 12 bytes left hold at most 0 entries of 13+ bytes"],
    );
}

#[test]
fn truncated_in_key() {
    let key = "glm-dsa.block_count";
    let built = padded().kv(key, Val::U32(78)).build();
    let at = built.kv_at[1];
    // Header 24 + padding pair (8 + 12 key + 4 type + 8 + 64 string) = 120.
    assert_eq!(at, 120);
    for cut in at..at + 8 + key.len() {
        let msg = error_of(built.bytes[..cut].to_vec());
        let want = if cut < at + 8 {
            format!(
                "gguf: {NAME}: metadata key #1 at offset {at}: truncated: needs 8 bytes, only {} left in the {cut}-byte file",
                cut - at
            )
        } else {
            format!(
                "gguf: {NAME}: metadata key #1 at offset {at}: string length {} exceeds the {} bytes left in the file",
                key.len(),
                cut - at - 8
            )
        };
        assert_eq!(msg, want);
    }
    // Cut inside the value type id.
    let ty_at = built.type_at[1];
    expect_err(
        built.bytes[..ty_at + 3].to_vec(),
        &[&format!(
            "type of metadata value \"{key}\" at offset {ty_at}: truncated: needs 4 bytes, only 3 left"
        )],
    );
}

/// One value of every type, with its size in the file when fixed.
fn every_value() -> Vec<(Val, Option<usize>)> {
    vec![
        (Val::U8(200), Some(1)),
        (Val::I8(-100), Some(1)),
        (Val::U16(60_000), Some(2)),
        (Val::I16(-30_000), Some(2)),
        (Val::U32(4_000_000_000), Some(4)),
        (Val::I32(-2_000_000_000), Some(4)),
        (Val::F32(-1.5), Some(4)),
        (Val::Bool(1), Some(1)),
        (Val::Str("hello".into()), None),
        (Val::Arr(vt::U16, vec![Val::U16(1), Val::U16(2)]), None),
        (Val::U64(u64::MAX - 1), Some(8)),
        (Val::I64(i64::MIN + 1), Some(8)),
        (Val::F64(std::f64::consts::PI), Some(8)),
        (
            Val::Arr(
                vt::STRING,
                vec![Val::Str("ab".into()), Val::Str("cde".into())],
            ),
            None,
        ),
        (
            Val::Arr(
                vt::ARRAY,
                vec![
                    Val::Arr(vt::I32, vec![Val::I32(1), Val::I32(-2)]),
                    Val::Arr(vt::I32, vec![]),
                ],
            ),
            None,
        ),
    ]
}

#[test]
fn truncated_in_value_of_every_type() {
    for (v, size) in every_value() {
        let built = padded().kv("k", v.clone()).build();
        let at = built.value_at[1];
        let end = built.bytes.len();
        if let Some(size) = size {
            assert_eq!(end - at, size, "{v:?}");
        }
        for cut in at..end {
            let msg = error_of(built.bytes[..cut].to_vec());
            let ctx = format!("{v:?} cut at {cut}: {msg}");
            let left = cut - at;
            match (&v, size) {
                (_, Some(size)) => assert_eq!(
                    msg,
                    format!("gguf: {NAME}: metadata value \"k\" at offset {at}: truncated: needs {size} bytes, only {left} left in the {cut}-byte file"),
                    "{ctx}"
                ),
                (Val::Str(s), None) if left >= 8 => assert_eq!(
                    msg,
                    format!("gguf: {NAME}: metadata value \"k\" at offset {at}: string length {} exceeds the {} bytes left in the file", s.len(), left - 8),
                    "{ctx}"
                ),
                (Val::Arr(vt::U16, items), None) if left >= 12 => assert_eq!(
                    msg,
                    format!(
                        "gguf: {NAME}: metadata value \"k\" at offset {}: count {} cannot fit: {} bytes left hold at most {} entries of 2+ bytes",
                        at + 4,
                        items.len(),
                        left - 12,
                        (left - 12) / 2
                    ),
                    "{ctx}"
                ),
                _ => {
                    // Inside a length, type id or count, or inside nested elements: the message
                    // names the value, an offset inside it, and why.
                    let prefix = format!("gguf: {NAME}: metadata value \"k\" at offset ");
                    let rest = msg.strip_prefix(&prefix).unwrap_or_else(|| panic!("{ctx}"));
                    let off: usize = rest.split(':').next().unwrap().parse().unwrap();
                    assert!((at..=cut).contains(&off), "{ctx}");
                    assert!(
                        ["truncated", "exceeds", "cannot fit"].iter().any(|w| msg.contains(w)),
                        "{ctx}"
                    );
                }
            }
        }
    }
}

#[test]
fn huge_tensor_count_u64_max() {
    let mut g = padded();
    g.n_tensors = Some(u64::MAX);
    let rest = g.bytes().len() - 16;
    expect_err(
        g.bytes(),
        &[&format!(
            "tensor count at offset 8: count {} cannot fit: {rest} bytes left hold at most {} entries of 32+ bytes",
            u64::MAX,
            rest / 32
        )],
    );
}

#[test]
fn huge_tensor_count_2_pow_40() {
    let mut g = padded();
    g.n_tensors = Some(1 << 40);
    expect_err(
        g.bytes(),
        &["tensor count at offset 8: count 1099511627776 cannot fit"],
    );
}

#[test]
fn huge_kv_count_u64_max() {
    let mut g = padded();
    g.n_kv = Some(u64::MAX);
    let rest = g.bytes().len() - HEADER;
    expect_err(
        g.bytes(),
        &[&format!(
            "metadata count at offset 16: count 18446744073709551615 cannot fit: {rest} bytes left hold at most {} entries of 13+ bytes",
            rest / 13
        )],
    );
}

#[test]
fn huge_kv_count_2_pow_40() {
    let mut g = padded();
    g.n_kv = Some(1 << 40);
    expect_err(
        g.bytes(),
        &["metadata count at offset 16: count 1099511627776 cannot fit"],
    );
}

// ---------------------------------------------------------------------------------------------
// Metadata

#[test]
fn huge_string_length() {
    // A key whose length is u64::MAX: over the key limit before any bytes are looked at.
    let mut w = W::new(false);
    w.raw(b"GGUF")
        .u32(3)
        .u64(0)
        .u64(1)
        .u64(u64::MAX)
        .raw(&[0; 40]);
    expect_err(
        w.buf,
        &["metadata key #0 at offset 24: string length 18446744073709551615 exceeds the limit 65535"],
    );

    // A string value whose length is 2^40: over the bytes left.
    let built = padded()
        .kv(
            "k",
            Val::Raw(
                vt::STRING,
                W::new(false).u64(1 << 40).raw(b"abc").buf.clone(),
            ),
        )
        .build();
    let at = built.value_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: string length 1099511627776 exceeds the 3 bytes left in the file"
        )],
    );

    // A tensor name whose length is u64::MAX.
    let mut built = one_tensor().build();
    let at = built.info_at[0];
    built.bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_err(
        built.bytes,
        &[&format!(
            "name of tensor info #0 at offset {at}: string length 18446744073709551615 exceeds the limit 65535"
        )],
    );
}

#[test]
fn bad_value_type_13() {
    let built = padded().kv("k", Val::Raw(13, vec![0; 8])).build();
    let at = built.type_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "type of metadata value \"k\" at offset {at}: value type 13 is not a GGUF type (0..=12)"
        )],
    );
}

#[test]
fn bad_value_type_0xffffffff() {
    let built = padded().kv("k", Val::Raw(u32::MAX, vec![0; 8])).build();
    let at = built.type_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "type of metadata value \"k\" at offset {at}: value type 4294967295 is not a GGUF type"
        )],
    );
}

#[test]
fn bad_array_element_type() {
    for et in [13, 1000, u32::MAX] {
        let built = padded().kv("k", Val::Arr(et, vec![])).build();
        let at = built.value_at[1];
        expect_err(
            built.bytes,
            &[&format!(
                "metadata value \"k\" at offset {at}: array element type {et} is not a GGUF type (0..=12)"
            )],
        );
    }
}

/// An array nested `levels` deep whose innermost array holds one u8.
fn nested(levels: usize) -> Val {
    let mut v = Val::Arr(vt::U8, vec![Val::U8(7)]);
    for _ in 1..levels {
        v = Val::Arr(vt::ARRAY, vec![v]);
    }
    v
}

#[test]
fn nested_array_bomb_too_deep() {
    // Eight levels are accepted...
    let f = ok(padded().kv("k", nested(8)).bytes());
    let mut v = f.get("k").unwrap();
    for _ in 1..8 {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v, &Value::Array(ValueType::U8, vec![Value::U8(7)]));

    // ...nine are not. Each level is a 4-byte element type and an 8-byte count, so the ninth
    // array starts 8 * 12 bytes into the value.
    let built = padded().kv("k", nested(9)).build();
    let at = built.value_at[1] + 8 * 12;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: arrays nested deeper than 8 levels"
        )],
    );

    // A thousand levels: the same error, no stack overflow.
    let built = padded().kv("k", nested(1000)).build();
    let at = built.value_at[1] + 8 * 12;
    expect_err(
        built.bytes,
        &[&format!(
            "at offset {at}: arrays nested deeper than 8 levels"
        )],
    );
}

#[test]
fn nested_array_bomb_huge_counts() {
    // An array announcing 2^40 arrays: each takes at least 12 bytes, so the count cannot fit.
    let body = W::new(false).u32(vt::ARRAY).u64(1 << 40).buf.clone();
    let built = padded().kv("k", Val::Raw(vt::ARRAY, body)).build();
    let at = built.value_at[1] + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: count 1099511627776 cannot fit: 0 bytes left hold at most 0 entries of 12+ bytes"
        )],
    );

    // Three arrays of u64 that each announce u64::MAX elements: the first inner count fails.
    let mut w = W::new(false);
    w.u32(vt::ARRAY).u64(3);
    for _ in 0..3 {
        w.u32(vt::U64).u64(u64::MAX);
    }
    let built = padded().kv("k", Val::Raw(vt::ARRAY, w.buf)).build();
    let at = built.value_at[1] + 12 + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: count 18446744073709551615 cannot fit: 24 bytes left hold at most 3 entries of 8+ bytes"
        )],
    );

    // Many empty arrays are fine: 1000 of them parse.
    let v = Val::Arr(vt::ARRAY, vec![Val::Arr(vt::U8, vec![]); 1000]);
    let f = ok(padded().kv("k", v).bytes());
    assert_eq!(f.get("k").unwrap().as_array().unwrap().len(), 1000);
}

#[test]
fn bool_byte_2() {
    let built = padded().kv("k", Val::Bool(2)).build();
    let at = built.value_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: bool byte is 2, expected 0 or 1"
        )],
    );
    // Inside an array: the offset is the bad element's.
    let v = Val::Arr(vt::BOOL, vec![Val::Bool(0), Val::Bool(1), Val::Bool(255)]);
    let built = padded().kv("k", v).build();
    let at = built.value_at[1] + 12 + 2;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: bool byte is 255"
        )],
    );
}

#[test]
fn duplicate_metadata_keys() {
    let built = padded()
        .kv("k", Val::U8(1))
        .kv("j", Val::U8(2))
        .kv("k", Val::U8(3))
        .build();
    let (first, again) = (built.kv_at[1], built.kv_at[3]);
    expect_err(
        built.bytes,
        &[&format!(
            "metadata key #3 at offset {again}: key \"k\" appears twice (first as metadata key #1 at offset {first})"
        )],
    );
}

#[test]
fn empty_metadata_key() {
    let built = padded().kv("", Val::U8(1)).build();
    let at = built.kv_at[1];
    expect_err(
        built.bytes,
        &[&format!("metadata key #1 at offset {at}: the key is empty")],
    );
}

#[test]
fn general_alignment_0() {
    let built = one_tensor().kv("general.alignment", Val::U32(0)).build();
    let at = built.value_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"general.alignment\" at offset {at}: alignment is 0; it must be a power of two"
        )],
    );
}

#[test]
fn general_alignment_3() {
    let built = one_tensor().kv("general.alignment", Val::U32(3)).build();
    let at = built.value_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"general.alignment\" at offset {at}: alignment is 3; it must be a power of two"
        )],
    );
}

#[test]
fn general_alignment_of_type_string() {
    let built = one_tensor()
        .kv("general.alignment", Val::Str("32".into()))
        .build();
    let at = built.value_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"general.alignment\" at offset {at}: type is string; it must be u32"
        )],
    );
    // u64 is not accepted either: ggml reads it with gguf_get_val_u32.
    expect_err(
        one_tensor().kv("general.alignment", Val::U64(32)).bytes(),
        &["type is u64; it must be u32"],
    );
}

// ---------------------------------------------------------------------------------------------
// Tensor infos

#[test]
fn truncated_in_tensor_info() {
    let built = one_tensor().build();
    let info = built.info_at[0];
    // name length 8 + "w" 1 + n_dims 4 + ne 2 x 8 + type 4 + offset 8.
    let fields = [
        ("name of tensor info #0", info, 8),
        ("n_dims of tensor \"w\"", info + 9, 4),
        ("ne[0] of tensor \"w\"", info + 13, 8),
        ("ne[1] of tensor \"w\"", info + 21, 8),
        ("type of tensor \"w\"", info + 29, 4),
        ("data offset of tensor \"w\"", info + 33, 8),
    ];
    assert_eq!(built.infos_end, info + 41);
    for cut in info..built.infos_end {
        let msg = error_of(built.bytes[..cut].to_vec());
        if cut == info + 8 {
            // The name's bytes are missing.
            assert_eq!(
                msg,
                format!("gguf: {NAME}: name of tensor info #0 at offset {info}: string length 1 exceeds the 0 bytes left in the file")
            );
            continue;
        }
        let (field, start, size) = fields
            .iter()
            .copied()
            .find(|&(_, s, n)| (s..s + n).contains(&cut))
            .unwrap();
        assert_eq!(
            msg,
            format!(
                "gguf: {NAME}: {field} at offset {start}: truncated: needs {size} bytes, only {} left in the {cut}-byte file",
                cut - start
            )
        );
    }
}

#[test]
fn n_dims_0() {
    let mut t = tensor("w", &[4, 2], gt::F32, 0);
    t.n_dims = Some(0);
    let built = padded().tensor(t).data(f32_data(8, 0.0, false)).build();
    let at = built.n_dims_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "n_dims of tensor \"w\" at offset {at}: n_dims is 0; ggml tensors have 1 to 4 dimensions"
        )],
    );
}

#[test]
fn n_dims_5() {
    let built = padded()
        .tensor(tensor("w", &[2, 1, 1, 1, 2], gt::F32, 0))
        .data(f32_data(4, 0.0, false))
        .build();
    let at = built.n_dims_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "n_dims of tensor \"w\" at offset {at}: n_dims is 5;"
        )],
    );
}

#[test]
fn ne_product_overflows() {
    for ne in [
        vec![1u64 << 40, 1 << 40],
        vec![1 << 32, 1 << 31],
        vec![2, 2, 1 << 31, 1 << 31],
    ] {
        let built = padded().tensor(tensor("w", &ne, gt::F32, 0)).build();
        let at = built.n_dims_at[0] + 4;
        expect_err(
            built.bytes,
            &[&format!(
                "ne of tensor \"w\" at offset {at}: dimensions {ne:?} overflow: the element count exceeds 2^63 - 1"
            )],
        );
    }
    // One dimension alone above i64::MAX (ggml keeps ne in int64_t).
    let built = padded()
        .tensor(tensor("w", &[1, 1 << 63], gt::F32, 0))
        .build();
    let at = built.n_dims_at[0] + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "ne of tensor \"w\" at offset {at}: ne[1] = 9223372036854775808 in [1, 9223372036854775808] exceeds 2^63 - 1"
        )],
    );
    // Element count fits in i64 but its F32 byte size (4 bytes each) does not fit in u64.
    let built = padded()
        .tensor(tensor("w", &[1 << 31, 1 << 31], gt::F32, 0))
        .build();
    let at = built.ty_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "type of tensor \"w\" at offset {at}: byte size of F32 tensor [2147483648, 2147483648] overflows"
        )],
    );
}

#[test]
fn regression_zero_dimension_hid_row_count_overflow() {
    // [0, 2^40, 2^40] has no elements, but its row count 2^80 overflowed `n_rows()`.
    let built = padded()
        .tensor(tensor("w", &[0, 1 << 40, 1 << 40], gt::F32, 0))
        .build();
    let at = built.n_dims_at[0] + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "ne of tensor \"w\" at offset {at}: dimensions [0, 1099511627776, 1099511627776] overflow"
        )],
    );
}

#[test]
fn regression_zero_dimension_hid_row_bytes_overflow() {
    // [2^62, 0] F32 has no elements, but one row of 2^62 f32 is 2^64 bytes: `row_bytes()`
    // overflowed.
    let built = padded()
        .tensor(tensor("w", &[1 << 62, 0], gt::F32, 0))
        .build();
    let at = built.ty_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "type of tensor \"w\" at offset {at}: byte size of F32 tensor [4611686018427387904, 0] overflows"
        )],
    );
    // An empty tensor whose dimensions do fit is fine, and its accessors are consistent.
    let f = ok(padded()
        .tensor(tensor("w", &[1 << 20, 0], gt::F32, 0))
        .bytes());
    let t = f.tensor("w").unwrap();
    assert_eq!((t.nbytes, t.n_rows(), t.row_bytes()), (0, 0, 4 << 20));
    assert_eq!(f.row_data(t, 0..0).unwrap().len(), 0);
    assert!(f.row_data(t, 0..1).is_err());
}

fn expect_type_error(ty: u32, ne0: u64, want: &str) {
    let built = padded()
        .tensor(tensor("w", &[ne0, 1], ty, 0))
        .data(vec![0; 4096])
        .build();
    let at = built.ty_at[0];
    expect_err(
        built.bytes,
        &[&format!("type of tensor \"w\" at offset {at}: {want}")],
    );
}

#[test]
fn unknown_type_id_42() {
    expect_type_error(42, 32, "type id 42 is not a ggml type (known ids 0..=41)");
}

#[test]
fn unknown_type_id_1000() {
    expect_type_error(1000, 32, "type id 1000 is not a ggml type");
    expect_type_error(u32::MAX, 32, "type id 4294967295 is not a ggml type");
}

#[test]
fn removed_type_ids() {
    // Names of the removed ids from the comments in ggml's include/ggml.h.
    let removed = [
        (4, "Q4_2"),
        (5, "Q4_3"),
        (31, "Q4_0_4_4"),
        (32, "Q4_0_4_8"),
        (33, "Q4_0_8_8"),
        (36, "IQ4_NL_4_4"),
        (37, "IQ4_NL_4_8"),
        (38, "IQ4_NL_8_8"),
    ];
    for (id, name) in removed {
        expect_type_error(
            id,
            256,
            &format!("type id {id} ({name}) was removed from ggml; re-convert the model"),
        );
    }
}

#[test]
fn ne0_not_a_multiple_of_the_block() {
    // Q4_K blocks hold 256 elements (QK_K in ggml's ggml-common.h).
    expect_type_error(
        gt::Q4_K,
        100,
        "ne[0] = 100 is not a multiple of the Q4_K block size 256",
    );
    // Q8_0 blocks hold 32 (QK8_0).
    expect_type_error(
        gt::Q8_0,
        48,
        "ne[0] = 48 is not a multiple of the Q8_0 block size 32",
    );
}

// ---------------------------------------------------------------------------------------------
// Data section

#[test]
fn misaligned_tensor_offset() {
    let built = padded()
        .tensor(tensor("w", &[4], gt::F32, 16))
        .data(vec![0; 64])
        .build();
    let at = built.offset_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"w\" at offset {at}: 16 is not a multiple of the alignment 32"
        )],
    );
    // With general.alignment = 64, offset 32 is misaligned.
    let mut g = padded()
        .kv("general.alignment", Val::U32(64))
        .tensor(tensor("w", &[4], gt::F32, 32))
        .data(vec![0; 64]);
    g.pad_to = 64;
    let built = g.build();
    let at = built.offset_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"w\" at offset {at}: 32 is not a multiple of the alignment 64"
        )],
    );
}

#[test]
fn truncated_in_data_tensor_extends_past_eof() {
    // Two F32 [4, 2] tensors (32 bytes each) at 0 and 32; the data section keeps 50 bytes.
    let mut built = one_tensor()
        .tensor(tensor("v", &[4, 2], gt::F32, 32))
        .data(f32_data(16, 0.0, false))
        .build();
    let ds = built.data_start;
    assert_eq!(ds % 32, 0);
    built.bytes.truncate(ds + 50);
    let at = built.offset_at[1];
    let msg = error_of(built.bytes);
    assert_eq!(
        msg,
        format!(
            "gguf: {NAME}: data offset of tensor \"v\" at offset {at}: the tensor (F32 [4, 2]) needs 32 bytes at file offset {} (data section {ds} + offset 32), but the file has {} bytes (14 missing)",
            ds + 32,
            ds + 50
        )
    );
    // Cut inside the first tensor: it is the one named.
    let mut built = one_tensor().build();
    built.bytes.truncate(built.data_start + 31);
    let at = built.offset_at[0];
    expect_err(
        built.bytes,
        &[
            &format!(
            "data offset of tensor \"w\" at offset {at}: the tensor (F32 [4, 2]) needs 32 bytes"
        ),
            "(1 missing)",
        ],
    );
    // Cut inside the padding before the data section.
    let mut built = one_tensor().build();
    let cut = built.infos_end + 1;
    assert!(cut < built.data_start);
    let missing = built.data_start + 32 - cut;
    built.bytes.truncate(cut);
    expect_err(
        built.bytes,
        &[&format!("but the file has {cut} bytes ({missing} missing)")],
    );
}

#[test]
fn offset_past_the_end() {
    let built = padded()
        .tensor(tensor("w", &[8], gt::F32, 1 << 20))
        .data(vec![0; 32])
        .build();
    let (ds, len) = (built.data_start, built.bytes.len());
    let at = built.offset_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"w\" at offset {at}: the tensor (F32 [8]) needs 32 bytes at file offset {} (data section {ds} + offset 1048576), but the file has {len} bytes",
            ds + (1 << 20)
        )],
    );
}

#[test]
fn offset_plus_size_overflows() {
    // u64::MAX with alignment 1: data start + offset + size overflows u64.
    let mut g = padded()
        .kv("general.alignment", Val::U32(1))
        .tensor(tensor("w", &[8], gt::F32, u64::MAX))
        .data(vec![0; 32]);
    g.pad_to = 1;
    let built = g.build();
    let ds = built.data_start as u128;
    let at = built.offset_at[0];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"w\" at offset {at}: the tensor (F32 [8]) needs 32 bytes at file offset {} (data section {ds} + offset 18446744073709551615)",
            ds + u64::MAX as u128
        )],
    );
    // The largest aligned offset with the default alignment.
    let off = u64::MAX - 31;
    let built = padded()
        .tensor(tensor("w", &[8], gt::F32, off))
        .data(vec![0; 32])
        .build();
    expect_err(
        built.bytes,
        &[&format!("+ offset {off}), but the file has")],
    );
    // Also via a huge byte size rather than offset: 2^61 F32 at offset 0.
    expect_err(
        padded().tensor(tensor("w", &[1 << 61], gt::F32, 0)).bytes(),
        &["needs 9223372036854775808 bytes"],
    );
}

#[test]
fn overlapping_tensors() {
    // "a" covers 0..64, "b" starts at 32.
    let built = padded()
        .tensor(tensor("a", &[16], gt::F32, 0))
        .tensor(tensor("b", &[8], gt::F32, 32))
        .data(vec![0; 96])
        .build();
    let at = built.offset_at[1];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"b\" at offset {at}: its bytes 32..64 overlap tensor \"a\" (bytes 0..64) in the data section"
        )],
    );
    // Same offset, listed in the other order.
    expect_err(
        padded()
            .tensor(tensor("b", &[8], gt::F32, 0))
            .tensor(tensor("a", &[8], gt::F32, 0))
            .data(vec![0; 32])
            .bytes(),
        &["its bytes 0..32 overlap tensor"],
    );
    // Touching is not overlapping.
    let f = ok(padded()
        .tensor(tensor("a", &[8], gt::F32, 0))
        .tensor(tensor("b", &[8], gt::F32, 32))
        .data(vec![0; 64])
        .bytes());
    assert_eq!(f.tensors().len(), 2);
}

#[test]
fn regression_empty_tensor_hid_overlap() {
    // "a" covers 0..128; the empty "e" at 32 sat between "a" and "b" (64..96) in offset order,
    // and comparing neighbours only skipped both pairs.
    let built = padded()
        .tensor(tensor("a", &[32], gt::F32, 0))
        .tensor(tensor("e", &[0], gt::F32, 32))
        .tensor(tensor("b", &[8], gt::F32, 64))
        .data(vec![0; 128])
        .build();
    let at = built.offset_at[2];
    expect_err(
        built.bytes,
        &[&format!(
            "data offset of tensor \"b\" at offset {at}: its bytes 64..96 overlap tensor \"a\" (bytes 0..128)"
        )],
    );
    // An empty tensor inside another's bytes is not an overlap.
    let f = ok(padded()
        .tensor(tensor("a", &[32], gt::F32, 0))
        .tensor(tensor("e", &[0], gt::F32, 32))
        .tensor(tensor("b", &[8], gt::F32, 128))
        .data(vec![0; 160])
        .bytes());
    assert_eq!(f.tensors().len(), 3);
}

#[test]
fn duplicate_tensor_names() {
    let built = padded()
        .tensor(tensor("w", &[8], gt::F32, 0))
        .tensor(tensor("w", &[8], gt::F32, 32))
        .data(vec![0; 64])
        .build();
    let (first, again) = (built.info_at[0], built.info_at[1]);
    expect_err(
        built.bytes,
        &[&format!(
            "name of tensor info #1 at offset {again}: tensor \"w\" appears twice (tensor infos #0 at offset {first} and #1)"
        )],
    );
}

// ---------------------------------------------------------------------------------------------
// Valid files

/// Metadata with every value type, a hyphenated key and nested arrays, in byte order `be`.
fn every_type_file(version: u32, be: bool) -> Gguf {
    let mut g = Gguf {
        be,
        version,
        ..Gguf::default()
    };
    g = g
        .kv("general.architecture", Val::Str("glm-dsa".into()))
        .kv("glm-dsa.block_count", Val::U32(78))
        .kv("t.u8", Val::U8(200))
        .kv("t.i8", Val::I8(-100))
        .kv("t.u16", Val::U16(0x1234))
        .kv("t.i16", Val::I16(-30_000))
        .kv("t.u32", Val::U32(0xDEAD_BEEF))
        .kv("t.i32", Val::I32(-2_000_000_000))
        .kv("t.f32", Val::F32(-1.5))
        .kv("t.bool", Val::Bool(1))
        .kv("t.string", Val::Str("héllo, wörld".into()))
        .kv("t.u64", Val::U64(0x0123_4567_89AB_CDEF))
        .kv("t.i64", Val::I64(-0x0123_4567_89AB_CDEF))
        .kv("t.f64", Val::F64(1.0e-300))
        .kv(
            "t.arr_f32",
            Val::Arr(vt::F32, vec![Val::F32(0.5), Val::F32(-2.0)]),
        )
        .kv(
            "t.arr_str",
            Val::Arr(vt::STRING, vec![Val::Str("a".into()), Val::Str("".into())]),
        )
        .kv(
            "t.nested",
            Val::Arr(
                vt::ARRAY,
                vec![
                    Val::Arr(vt::I16, vec![Val::I16(1), Val::I16(-1)]),
                    Val::Arr(vt::BOOL, vec![Val::Bool(0)]),
                    Val::Arr(vt::ARRAY, vec![Val::Arr(vt::U64, vec![Val::U64(9)])]),
                ],
            ),
        )
        .kv("t.empty", Val::Arr(vt::U8, vec![]));
    let mut data = f32_data(8, 1.0, be); // "w": 8 f32 at offset 0
    data.resize(32, 0);
    data.extend_from_slice(&[0xAB; 34]); // "q": one Q8_0 block (34 bytes) at offset 32
    data.resize(96, 0);
    data.extend_from_slice(&f32_data(3, -1.0, be)); // "v": 3 f32 at offset 96
    g.data(data)
        .tensor(tensor("w", &[4, 2], gt::F32, 0))
        .tensor(tensor("q", &[32], gt::Q8_0, 32))
        .tensor(tensor("v", &[3], gt::F32, 96))
}

/// Checks what `every_type_file` wrote.
fn check_every_type(f: &GgufFile, version: u32, be: bool) {
    assert_eq!(f.version(), version);
    assert_eq!(f.is_big_endian(), be);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.metadata().len(), 18);
    let g = |k: &str| f.get(k).unwrap_or_else(|| panic!("missing {k}"));
    assert_eq!(g("general.architecture").as_str(), Some("glm-dsa"));
    assert_eq!(g("glm-dsa.block_count"), &Value::U32(78));
    assert_eq!(g("t.u8"), &Value::U8(200));
    assert_eq!(g("t.i8"), &Value::I8(-100));
    assert_eq!(g("t.u16"), &Value::U16(0x1234));
    assert_eq!(g("t.i16"), &Value::I16(-30_000));
    assert_eq!(g("t.u32"), &Value::U32(0xDEAD_BEEF));
    assert_eq!(g("t.i32"), &Value::I32(-2_000_000_000));
    assert_eq!(g("t.f32"), &Value::F32(-1.5));
    assert_eq!(g("t.bool"), &Value::Bool(true));
    assert_eq!(g("t.string").as_str(), Some("héllo, wörld"));
    assert_eq!(g("t.u64"), &Value::U64(0x0123_4567_89AB_CDEF));
    assert_eq!(g("t.i64"), &Value::I64(-0x0123_4567_89AB_CDEF));
    assert_eq!(g("t.f64"), &Value::F64(1.0e-300));
    assert_eq!(
        g("t.arr_f32"),
        &Value::Array(ValueType::F32, vec![Value::F32(0.5), Value::F32(-2.0)])
    );
    assert_eq!(
        g("t.arr_str"),
        &Value::Array(
            ValueType::String,
            vec![Value::String("a".into()), Value::String("".into())]
        )
    );
    assert_eq!(
        g("t.nested"),
        &Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::I16, vec![Value::I16(1), Value::I16(-1)]),
                Value::Array(ValueType::Bool, vec![Value::Bool(false)]),
                Value::Array(
                    ValueType::Array,
                    vec![Value::Array(ValueType::U64, vec![Value::U64(9)])]
                ),
            ]
        )
    );
    assert_eq!(g("t.empty"), &Value::Array(ValueType::U8, vec![]));
    assert!(f.get("glm-dsa.missing").is_none());

    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["w", "q", "v"]);
    let w = f.tensor("w").unwrap();
    assert_eq!(
        (w.ne.as_slice(), w.shape(), w.nbytes),
        (&[4, 2][..], vec![2, 4], 32)
    );
    assert_eq!(f.tensor_data(w), &f32_data(8, 1.0, be)[..]);
    assert_eq!(f.row_data(w, 1..2).unwrap(), &f32_data(8, 1.0, be)[16..32]);
    let q = f.tensor("q").unwrap();
    assert_eq!((q.nbytes, q.offset), (34, 32));
    assert_eq!(f.tensor_data(q), &[0xAB; 34][..]);
    let v = f.tensor("v").unwrap();
    assert_eq!(f.tensor_data(v), &f32_data(3, -1.0, be)[..]);
    assert_eq!(f.file_len() - f.data_start(), 96 + 12);
}

#[test]
fn valid_file_reads_every_value_type() {
    let built = every_type_file(3, false).build();
    let (ds, end) = (built.data_start, built.infos_end);
    let f = ok(built.bytes);
    check_every_type(&f, 3, false);
    assert_eq!(f.data_start(), ds as u64);
    assert!(ds % 32 == 0 && ds - end < 32);

    let m = Model::from_shards(vec![f]).unwrap();
    assert_eq!(m.n_tensors(), 3);
    assert_eq!(m.architecture(), Some("glm-dsa"));
    let t = m.tensor("v").unwrap();
    assert_eq!(m.tensor_data(t), &f32_data(3, -1.0, false)[..]);
}

#[test]
fn valid_file_gguf_version_2() {
    check_every_type(&ok(every_type_file(2, false).bytes()), 2, false);
}

#[test]
fn big_endian_file_parses() {
    let built = every_type_file(3, true).build();
    // The version field reads 00 00 00 03.
    assert_eq!(&built.bytes[4..8], &[0, 0, 0, 3]);
    check_every_type(&ok(built.bytes), 3, true);
    check_every_type(&ok(every_type_file(2, true).bytes()), 2, true);
}

#[test]
fn big_endian_file_truncated_or_corrupt() {
    let mut g = padded();
    g.be = true;
    g.n_kv = Some(1 << 40);
    expect_err(
        g.bytes(),
        &["metadata count at offset 16: count 1099511627776 cannot fit"],
    );
    let built = {
        let mut g = one_tensor();
        g.be = true;
        g.build()
    };
    let at = built.offset_at[0];
    let mut b = built.bytes.clone();
    b.truncate(built.data_start + 8);
    expect_err(
        b,
        &[
            &format!(
            "data offset of tensor \"w\" at offset {at}: the tensor (F32 [4, 2]) needs 32 bytes"
        ),
            "(24 missing)",
        ],
    );
}

#[test]
fn model_from_shards_accepts_a_plain_file() {
    // The fuzz target calls Model::from_shards on whatever parses: a plain file works.
    let m = Model::from_shards(vec![ok(one_tensor().bytes())]).unwrap();
    assert_eq!(m.n_tensors(), 1);
    assert!(m.tensor("x").is_err());
}

/// Writes the valid files above as fuzzing seeds into `$GLMDIFF_FUZZ_SEEDS` (see
/// `fuzz/README.md`): `GLMDIFF_FUZZ_SEEDS=fuzz/seeds cargo test --test tests -- --ignored write_fuzz_seeds`.
#[test]
#[ignore = "writes files; run by hand to refresh fuzz/seeds"]
fn write_fuzz_seeds() {
    let dir = std::path::PathBuf::from(std::env::var("GLMDIFF_FUZZ_SEEDS").unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    let seeds = [
        ("every_type_v3_le.gguf", every_type_file(3, false).bytes()),
        ("every_type_v2_le.gguf", every_type_file(2, false).bytes()),
        ("every_type_v3_be.gguf", every_type_file(3, true).bytes()),
        ("one_tensor.gguf", one_tensor().bytes()),
        ("header_only.gguf", Gguf::default().bytes()),
        ("nested_8.gguf", padded().kv("k", nested(8)).bytes()),
        (
            "split_shard.gguf",
            one_tensor()
                .kv("split.no", Val::U16(0))
                .kv("split.count", Val::U16(1))
                .kv("split.tensors.count", Val::I32(1))
                .bytes(),
        ),
        (
            "quant_types.gguf",
            padded()
                .kv("general.alignment", Val::U32(64))
                .tensor(tensor("q4k", &[256, 2], gt::Q4_K, 0))
                .tensor(tensor("q40", &[64], gt::Q4_0, 320))
                .tensor(tensor("f16", &[4, 4], gt::F16, 384))
                .tensor(tensor("idx", &[4], gt::I32, 448))
                .tensor(tensor("empty", &[0, 3], gt::F32, 512))
                .data((0..512u32).map(|i| (i * 7) as u8).collect())
                .bytes(),
        ),
    ];
    for (name, bytes) in seeds {
        ok(bytes.clone());
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
