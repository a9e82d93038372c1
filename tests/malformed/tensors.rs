//! Tensor info cases: truncation, n_dims, dimensions, type ids, block sizes.

use super::*;

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
                format!("gguf: {NAME}: name of tensor info #0 at offset {info}: truncated: string length 1 exceeds the 0 bytes left in the {cut}-byte file")
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
