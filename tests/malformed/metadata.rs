//! Metadata cases: string lengths, value and element types, nested arrays, bools, duplicate
//! and empty keys, `general.alignment`.

use super::*;

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
    let len = built.bytes.len();
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: truncated: string length 1099511627776 exceeds the 3 bytes left in the {len}-byte file"
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
    let len = built.bytes.len();
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: truncated: count 1099511627776 cannot fit: the 0 bytes left in the {len}-byte file hold at most 0 entries of 12+ bytes"
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
    let len = built.bytes.len();
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"k\" at offset {at}: truncated: count 18446744073709551615 cannot fit: the 24 bytes left in the {len}-byte file hold at most 3 entries of 8+ bytes"
        )],
    );

    // Many empty arrays are fine: 1000 of them parse.
    let v = Val::Arr(vt::ARRAY, vec![Val::Arr(vt::U8, vec![]); 1000]);
    let f = ok(padded().kv("k", v).bytes());
    assert_eq!(f.get("k").unwrap().as_array().unwrap().len(), 1000);
}

/// A u8 array of `n` elements written raw (one byte each), fast to build at millions.
fn u8_array(n: u64) -> Val {
    let mut w = W::new(false);
    w.u32(vt::U8).u64(n);
    w.raw(&vec![7u8; n as usize]);
    Val::Raw(vt::ARRAY, w.buf)
}

#[test]
fn metadata_arrays_beyond_the_element_limit() {
    // Each element is held as a 32-byte value: a file of 2^23 + 1 one-byte elements (8 MiB)
    // would take 256 MiB, and one of 2^31 (2 GiB) 64 GiB. The limit is counted over all arrays,
    // so the second of two arrays crosses it.
    let limit = glmdiff::gguf::MAX_ARRAY_ELEMENTS;
    assert_eq!(limit, 1 << 23);
    let f = ok(padded().kv("k", u8_array(limit)).bytes());
    assert_eq!(
        f.get("k").unwrap().as_array().unwrap().len(),
        limit as usize
    );

    let built = padded()
        .kv("a", u8_array(limit - 5))
        .kv("b", u8_array(6))
        .build();
    let at = built.value_at[2] + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"b\" at offset {at}: array of 6 elements: the metadata's arrays would hold {} elements in all, more than the {limit} glmdiff reads",
            limit + 1
        )],
    );

    // 2^24 empty strings (8 bytes each in the file, 32 in memory).
    let n: u64 = 1 << 24;
    let mut w = W::new(false);
    w.u32(vt::STRING).u64(n);
    w.raw(&vec![0u8; (n * 8) as usize]);
    let built = padded().kv("s", Val::Raw(vt::ARRAY, w.buf)).build();
    let at = built.value_at[1] + 4;
    expect_err(
        built.bytes,
        &[&format!(
            "metadata value \"s\" at offset {at}: array of {n} elements"
        )],
    );
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
