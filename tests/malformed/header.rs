//! Header cases: magic, version, truncation of the header and of metadata pairs, counts.

use super::*;

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
        &[&format!(
            "metadata count at offset 16: truncated: count 1 cannot fit: the 12 bytes left in the {}-byte file hold at most 0 entries of 13+ bytes",
            HEADER + 12
        )],
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
                "gguf: {NAME}: metadata key #1 at offset {at}: truncated: string length {} exceeds the {} bytes left in the {cut}-byte file",
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
                    format!("gguf: {NAME}: metadata value \"k\" at offset {at}: truncated: string length {} exceeds the {} bytes left in the {cut}-byte file", s.len(), left - 8),
                    "{ctx}"
                ),
                (Val::Arr(vt::U16, items), None) if left >= 12 => assert_eq!(
                    msg,
                    format!(
                        "gguf: {NAME}: metadata value \"k\" at offset {}: truncated: count {} cannot fit: the {} bytes left in the {cut}-byte file hold at most {} entries of 2+ bytes",
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
    let len = g.bytes().len();
    expect_err(
        g.bytes(),
        &[&format!(
            "tensor count at offset 8: truncated: count {} cannot fit: the {rest} bytes left in the {len}-byte file hold at most {} entries of 32+ bytes",
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
        &["tensor count at offset 8: truncated: count 1099511627776 cannot fit"],
    );
}

#[test]
fn huge_kv_count_u64_max() {
    let mut g = padded();
    g.n_kv = Some(u64::MAX);
    let rest = g.bytes().len() - HEADER;
    let len = g.bytes().len();
    expect_err(
        g.bytes(),
        &[&format!(
            "metadata count at offset 16: truncated: count 18446744073709551615 cannot fit: the {rest} bytes left in the {len}-byte file hold at most {} entries of 13+ bytes",
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
        &["metadata count at offset 16: truncated: count 1099511627776 cannot fit"],
    );
}
