//! Valid files: every value type, nested arrays, GGUF v2, big-endian files, the model view,
//! and the fuzzing seeds.

use super::*;

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
    assert_eq!(f.tensor_data(w).unwrap(), &f32_data(8, 1.0, be)[..]);
    assert_eq!(f.row_data(w, 1..2).unwrap(), &f32_data(8, 1.0, be)[16..32]);
    let q = f.tensor("q").unwrap();
    assert_eq!((q.nbytes, q.offset), (34, 32));
    assert_eq!(f.tensor_data(q).unwrap(), &[0xAB; 34][..]);
    let v = f.tensor("v").unwrap();
    assert_eq!(f.tensor_data(v).unwrap(), &f32_data(3, -1.0, be)[..]);
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
    assert_eq!(m.tensor_data(t).unwrap(), &f32_data(3, -1.0, false)[..]);
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
        &["metadata count at offset 16: truncated: count 1099511627776 cannot fit"],
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

/// Regression: `tensor_data`/`row_data` sliced the map with the offset of whatever info they
/// were given, so an info or `TensorRef` taken from another file panicked out of bounds.
#[test]
fn tensor_info_from_another_file_is_an_error_not_a_panic() {
    let f = ok(every_type_file(3, false).build().bytes);
    let mut far = f.tensor("w").unwrap().clone();
    far.offset = 1 << 40;
    let e = format!("{:#}", f.tensor_data(&far).unwrap_err());
    assert!(e.contains("\"w\"") && e.contains("another file"), "{e}");
    assert!(f.row_data(&far, 0..1).is_err());
    let mut stranger = far.clone();
    stranger.name = "not_here".into();
    let e = format!("{:#}", f.tensor_data(&stranger).unwrap_err());
    assert!(e.contains("no tensor named \"not_here\""), "{e}");

    let m = Model::from_shards(vec![f]).unwrap();
    let mut t = m.tensor("v").unwrap();
    t.shard = 7;
    let e = format!("{:#}", m.tensor_data(t).unwrap_err());
    assert!(e.contains("shard 7") && e.contains("1 shard"), "{e}");
    assert!(m.row_data(t, 0..1).is_err());
    assert!(m.dequantize(t).is_err());
}
