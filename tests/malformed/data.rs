//! Data section cases: alignment, tensors past the end of the file, overflowing offsets,
//! overlaps, duplicate names.

use super::*;

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
