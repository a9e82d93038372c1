//! GGUF reading and dequantization checked bit for bit against gguf-py.
//!
//! The fixtures in `fixtures/quant/` are written by `reference/fixtures/make_quant_fixtures.py` with
//! gguf-py's `GGUFWriter`; the expected values in `all_types.expected.safetensors` are
//! `gguf.quants.dequantize` of the same bytes. Nothing here is derived from glmdiff's own output.
//! Each type has its own test (`dequant_q4_k_matches_gguf_py`), so one broken dequantizer shows
//! as one failure, and the test name is the filter that re-runs it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use glmdiff::gguf::{Model, Value, ValueType};
use glmdiff::quant::{self, GgmlType};
use safetensors::{Dtype, SafeTensors};

/// Number of tensors in the fixture model (one per type below).
const N_TENSORS: usize = 29;
/// Shards of the split fixture.
const N_SHARDS: usize = 3;
/// Entries of `tokenizer.ggml.tokens` in `all_types.gguf` and in the split model's first shard.
const N_TOKENS: usize = 150_000;
const N_TOKENS_SPLIT: usize = 1_000;
/// Elements per parallel work item in `quant::dequantize_par`; the chunked check repeats a tensor
/// until it spans several of them.
const PAR_CHUNK_ELEMS: usize = 1 << 16;
/// Written into output buffers before dequantizing, so that an element left unwritten shows up
/// (a NaN payload that no fixture value carries).
const SENTINEL_BITS: u32 = 0x7FBA_DBAD;

/// Every type in the fixture, in file order.
const ALL_TYPES: [GgmlType; N_TENSORS] = {
    use GgmlType as T;
    [
        T::F32,
        T::F16,
        T::BF16,
        T::Q4_0,
        T::Q4_1,
        T::Q5_0,
        T::Q5_1,
        T::Q8_0,
        T::Q2_K,
        T::Q3_K,
        T::Q4_K,
        T::Q5_K,
        T::Q6_K,
        T::IQ2_XXS,
        T::IQ2_XS,
        T::IQ2_S,
        T::IQ3_XXS,
        T::IQ3_S,
        T::IQ1_S,
        T::IQ1_M,
        T::IQ4_NL,
        T::IQ4_XS,
        T::TQ1_0,
        T::TQ2_0,
        T::MXFP4,
        T::NVFP4,
        T::I8,
        T::I16,
        T::I32,
    ]
};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/quant")
        .join(rel)
}

fn shard_name(k: usize) -> String {
    format!("all_types-{k:05}-of-{N_SHARDS:05}.gguf")
}

fn split_shard(k: usize) -> PathBuf {
    fixture(&format!("split/{}", shard_name(k)))
}

/// The fixture's name for the tensor of type `ty` (`q4_k.weight`).
fn tensor_name(ty: GgmlType) -> String {
    format!("{}.weight", ty.name().to_lowercase())
}

fn open(path: &Path) -> Model {
    Model::open(path).unwrap_or_else(|e| panic!("cannot open {}: {e:#}", path.display()))
}

/// Expected values of one tensor: f32 bit patterns in PyTorch order, the shape, and for integer
/// tensors their raw little-endian bytes.
struct Expected {
    bits: Vec<u32>,
    shape: Vec<u64>,
    int_bytes: Option<Vec<u8>>,
}

fn expected(name: &str) -> Expected {
    let path = fixture("all_types.expected.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let view = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("{}: no tensor {name}: {e}", path.display()));
    let data = view.data();
    let shape = view.shape().iter().map(|&d| d as u64).collect();
    let (bits, int_bytes): (Vec<u32>, _) = match view.dtype() {
        Dtype::F32 => (
            data.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            None,
        ),
        Dtype::I8 => (
            data.iter().map(|&b| (b as i8 as f32).to_bits()).collect(),
            Some(data.to_vec()),
        ),
        Dtype::I16 => (
            data.chunks_exact(2)
                .map(|c| (i16::from_le_bytes([c[0], c[1]]) as f32).to_bits())
                .collect(),
            Some(data.to_vec()),
        ),
        Dtype::I32 => (
            data.chunks_exact(4)
                .map(|c| (i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).to_bits())
                .collect(),
            Some(data.to_vec()),
        ),
        other => panic!("{name}: unexpected dtype {other:?} in the expected file"),
    };
    Expected {
        bits,
        shape,
        int_bytes,
    }
}

/// Panics with the type, the first mismatching index and both values when `got` and `want`
/// differ in any bit.
fn assert_bits_eq(what: &str, ty: GgmlType, got: &[f32], want: &[u32]) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {ty}: glmdiff gave {} values, gguf-py {}",
        got.len(),
        want.len()
    );
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i])
        .collect();
    if let Some(&i) = bad.first() {
        let bs = ty.block_size();
        panic!(
            "{what}: {ty}: {} of {} values differ; first at index {i} (block {}, element {} of the block): \
             glmdiff {:e} ({:#010x}), gguf-py {:e} ({:#010x})",
            bad.len(),
            got.len(),
            i / bs,
            i % bs,
            got[i],
            got[i].to_bits(),
            f32::from_bits(want[i]),
            want[i]
        );
    }
}

fn sentinel_vec(n: usize) -> Vec<f32> {
    vec![f32::from_bits(SENTINEL_BITS); n]
}

/// Row ranges to dequantize on their own: first, last, a short run, the second half, and empty.
fn row_ranges(n_rows: u64) -> Vec<Range<u64>> {
    let mut v = vec![0..1, n_rows - 1..n_rows, 1.min(n_rows)..3.min(n_rows)];
    v.push(n_rows / 2..n_rows);
    v.push(n_rows / 2..n_rows / 2);
    v
}

/// Dequantizes the tensor of type `ty` from `model` whole (parallel and single-threaded), by row
/// ranges, and repeated past several parallel chunks, comparing each to gguf-py bit for bit.
fn check_tensor(model: &Model, label: &str, ty: GgmlType) {
    let name = tensor_name(ty);
    let t = model
        .tensor(&name)
        .unwrap_or_else(|e| panic!("{label}: {e:#}"));
    assert_eq!(t.info.ty, ty, "{label}: {name}: type");
    let want = expected(&name);
    assert_eq!(t.info.shape(), want.shape, "{label}: {name}: PyTorch shape");
    let n = t.info.n_elements() as usize;
    let data = model.tensor_data(t).unwrap();

    if let Some(raw) = &want.int_bytes {
        assert!(
            data == raw.as_slice(),
            "{label}: {name}: stored integers differ from what gguf-py wrote"
        );
    }

    let mut got = sentinel_vec(n);
    quant::dequantize_par(ty, data, &mut got).unwrap();
    assert_bits_eq(
        &format!("{label}: {name}: whole, parallel"),
        ty,
        &got,
        &want.bits,
    );

    let mut got = sentinel_vec(n);
    quant::dequantize(ty, data, &mut got).unwrap();
    assert_bits_eq(
        &format!("{label}: {name}: whole, one thread"),
        ty,
        &got,
        &want.bits,
    );

    let row_len = t.info.row_len() as usize;
    for rows in row_ranges(t.info.n_rows()) {
        let src = model.row_data(t, rows.clone()).unwrap();
        let (a, b) = (rows.start as usize * row_len, rows.end as usize * row_len);
        let mut got = sentinel_vec(b - a);
        quant::dequantize(ty, src, &mut got).unwrap();
        assert_bits_eq(
            &format!("{label}: {name}: rows {}..{}", rows.start, rows.end),
            ty,
            &got,
            &want.bits[a..b],
        );
    }

    // The tensors are smaller than one parallel chunk: repeat the bytes so that the parallel path
    // splits the work at several chunk boundaries.
    let reps = (3 * PAR_CHUNK_ELEMS).div_ceil(n);
    let src = data.repeat(reps);
    let want_rep = want.bits.repeat(reps);
    let mut got = sentinel_vec(n * reps);
    quant::dequantize_par(ty, &src, &mut got).unwrap();
    assert_bits_eq(
        &format!("{label}: {name}: repeated x{reps}, parallel"),
        ty,
        &got,
        &want_rep,
    );
}

/// The single-file fixture, then the split one opened through a shard that depends on the type
/// (so that every shard serves as the entry point).
fn check_type(ty: GgmlType) {
    let single = open(&fixture("all_types.gguf"));
    check_tensor(&single, "all_types.gguf", ty);
    let k = 1 + ty.id() as usize % N_SHARDS;
    let split = open(&split_shard(k));
    check_tensor(
        &split,
        &format!("split model opened through {}", shard_name(k)),
        ty,
    );
}

macro_rules! dequant_tests {
    ($($test:ident => $ty:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                check_type(GgmlType::$ty);
            }
        )*
    };
}

dequant_tests! {
    dequant_f32_matches_gguf_py => F32,
    dequant_f16_matches_gguf_py => F16,
    dequant_bf16_matches_gguf_py => BF16,
    dequant_q4_0_matches_gguf_py => Q4_0,
    dequant_q4_1_matches_gguf_py => Q4_1,
    dequant_q5_0_matches_gguf_py => Q5_0,
    dequant_q5_1_matches_gguf_py => Q5_1,
    dequant_q8_0_matches_gguf_py => Q8_0,
    dequant_q2_k_matches_gguf_py => Q2_K,
    dequant_q3_k_matches_gguf_py => Q3_K,
    dequant_q4_k_matches_gguf_py => Q4_K,
    dequant_q5_k_matches_gguf_py => Q5_K,
    dequant_q6_k_matches_gguf_py => Q6_K,
    dequant_iq2_xxs_matches_gguf_py => IQ2_XXS,
    dequant_iq2_xs_matches_gguf_py => IQ2_XS,
    dequant_iq2_s_matches_gguf_py => IQ2_S,
    dequant_iq3_xxs_matches_gguf_py => IQ3_XXS,
    dequant_iq3_s_matches_gguf_py => IQ3_S,
    dequant_iq1_s_matches_gguf_py => IQ1_S,
    dequant_iq1_m_matches_gguf_py => IQ1_M,
    dequant_iq4_nl_matches_gguf_py => IQ4_NL,
    dequant_iq4_xs_matches_gguf_py => IQ4_XS,
    dequant_tq1_0_matches_gguf_py => TQ1_0,
    dequant_tq2_0_matches_gguf_py => TQ2_0,
    dequant_mxfp4_matches_gguf_py => MXFP4,
    dequant_nvfp4_matches_gguf_py => NVFP4,
    dequant_i8_matches_gguf_py => I8,
    dequant_i16_matches_gguf_py => I16,
    dequant_i32_matches_gguf_py => I32,
}

#[test]
fn dequant_fixture_holds_every_type_in_order() {
    let m = open(&fixture("all_types.gguf"));
    let types: Vec<GgmlType> = m.tensors().map(|t| t.info.ty).collect();
    assert_eq!(types, ALL_TYPES.to_vec());
    let names: Vec<String> = m.tensors().map(|t| t.info.name.clone()).collect();
    let want: Vec<String> = ALL_TYPES.iter().map(|&t| tensor_name(t)).collect();
    assert_eq!(names, want);
    let path = fixture("all_types.expected.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut in_expected: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    in_expected.sort();
    let mut want_sorted = want;
    want_sorted.sort();
    assert_eq!(in_expected, want_sorted, "tensors of {}", path.display());
}

// ---------------------------------------------------------------------------------------------
// Metadata

/// Token `i` of the fixture vocabulary, as `token()` in reference/fixtures/make_quant_fixtures.py makes it.
fn fixture_token(i: usize, n: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    match i {
        0 => return "<pad>".into(),
        1 => return String::new(),
        2 => return "\u{2581}the".into(),
        100 => return "\u{4e16}\u{754c}".into(),
        _ if i == n - 1 => return "<|endoftext|>".into(),
        _ => {}
    }
    let a = ALPHABET[i % 62] as char;
    if i % 3 == 0 {
        a.to_string()
    } else {
        format!("{a}{}", ALPHABET[(i / 62) % 62] as char)
    }
}

fn arr(t: ValueType, v: Vec<Value>) -> Value {
    Value::Array(t, v)
}

fn i32s(v: &[i32]) -> Value {
    arr(ValueType::I32, v.iter().map(|&x| Value::I32(x)).collect())
}

fn strs(v: &[&str]) -> Value {
    arr(
        ValueType::String,
        v.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

/// Checks every key that make_quant_fixtures.py writes (values hand-copied from the script).
fn check_metadata(m: &Model, n_tokens: usize) {
    use Value as V;
    let get = |k: &str| {
        m.get(k)
            .unwrap_or_else(|| panic!("{}: no metadata key {k}", m.file_name()))
    };
    let scalars: Vec<(&str, Value)> = vec![
        ("general.architecture", V::String("quant-fixture".into())),
        ("general.name", V::String("glmdiff quant fixture".into())),
        ("glm-dsa.block_count", V::U32(78)),
        ("glm-dsa.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("test.u8", V::U8(200)),
        ("test.i8", V::I8(-100)),
        ("test.u16", V::U16(60000)),
        ("test.i16", V::I16(-30000)),
        ("test.u32", V::U32(4_000_000_000)),
        ("test.i32", V::I32(-2_000_000_000)),
        ("test.f32", V::F32(0.1)),
        ("test.bool_true", V::Bool(true)),
        ("test.bool_false", V::Bool(false)),
        (
            "test.string",
            V::String("h\u{e9}llo \u{2581}\u{4e16}\u{754c} \u{1f642}".into()),
        ),
        ("test.u64", V::U64((1u64 << 63) + 5)),
        ("test.i64", V::I64(-(1i64 << 62) - 3)),
        ("test.f64", V::F64(1.0 / 3.0)),
        (
            "test.array.u8",
            arr(ValueType::U8, vec![V::U8(0), V::U8(1), V::U8(255)]),
        ),
        (
            "test.array.i8",
            arr(ValueType::I8, vec![V::I8(-128), V::I8(0), V::I8(127)]),
        ),
        (
            "test.array.u16",
            arr(ValueType::U16, vec![V::U16(0), V::U16(65535)]),
        ),
        (
            "test.array.i16",
            arr(ValueType::I16, vec![V::I16(-32768), V::I16(32767)]),
        ),
        (
            "test.array.u32",
            arr(ValueType::U32, vec![V::U32(0), V::U32(u32::MAX)]),
        ),
        ("test.array.i32", i32s(&[i32::MIN, i32::MAX])),
        (
            "test.array.bool",
            arr(
                ValueType::Bool,
                vec![V::Bool(true), V::Bool(false), V::Bool(true)],
            ),
        ),
        (
            "test.array.u64",
            arr(ValueType::U64, vec![V::U64(0), V::U64(u64::MAX)]),
        ),
        (
            "test.array.i64",
            arr(ValueType::I64, vec![V::I64(i64::MIN), V::I64(i64::MAX)]),
        ),
        ("test.array.string", strs(&["a", "", "\u{fc}"])),
        (
            "test.nested",
            arr(
                ValueType::Array,
                vec![i32s(&[1, 2, 3]), i32s(&[4]), i32s(&[5, 6])],
            ),
        ),
        (
            "test.nested_strings",
            arr(ValueType::Array, vec![strs(&["x", "yz"]), strs(&["w"])]),
        ),
        (
            "test.nested3",
            arr(
                ValueType::Array,
                vec![
                    arr(ValueType::Array, vec![i32s(&[1]), i32s(&[2, 3])]),
                    arr(ValueType::Array, vec![i32s(&[4])]),
                ],
            ),
        ),
    ];
    for (k, want) in &scalars {
        assert_eq!(get(k), want, "{}: metadata {k}", m.file_name());
    }

    // Floats whose sign or subnormal bits matter: compare bits, not values.
    let bits32: Vec<u32> = match get("test.array.f32") {
        V::Array(ValueType::F32, v) => v
            .iter()
            .map(|x| match x {
                V::F32(f) => f.to_bits(),
                o => panic!("test.array.f32 holds {o:?}"),
            })
            .collect(),
        o => panic!("test.array.f32 is {o:?}"),
    };
    let want32: Vec<u32> = [1.5f32, -0.0, 3.25e-5]
        .iter()
        .map(|f| f.to_bits())
        .collect();
    assert_eq!(bits32, want32, "test.array.f32");
    let bits64: Vec<u64> = match get("test.array.f64") {
        V::Array(ValueType::F64, v) => v
            .iter()
            .map(|x| match x {
                V::F64(f) => f.to_bits(),
                o => panic!("test.array.f64 holds {o:?}"),
            })
            .collect(),
        o => panic!("test.array.f64 is {o:?}"),
    };
    let want64: Vec<u64> = [5e-324f64, 1e300, -2.5]
        .iter()
        .map(|f| f.to_bits())
        .collect();
    assert_eq!(bits64, want64, "test.array.f64");

    let tokens = get("tokenizer.ggml.tokens");
    let V::Array(ValueType::String, tokens) = tokens else {
        panic!("tokenizer.ggml.tokens is {}", tokens.summary(4));
    };
    assert_eq!(tokens.len(), n_tokens, "tokenizer.ggml.tokens length");
    for (i, t) in tokens.iter().enumerate() {
        let want = fixture_token(i, n_tokens);
        assert_eq!(
            t.as_str(),
            Some(want.as_str()),
            "tokenizer.ggml.tokens[{i}]"
        );
    }
}

#[test]
fn metadata_reads_back_what_gguf_py_wrote() {
    let m = open(&fixture("all_types.gguf"));
    check_metadata(&m, N_TOKENS);
    // 32 keys from the script plus general.architecture, which GGUFWriter adds itself.
    assert_eq!(m.metadata().len(), 33, "number of metadata keys");
    assert!(m.get("split.count").is_none());
    assert_eq!(m.shards().len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Split models

#[test]
fn split_metadata_and_split_keys() {
    let m = open(&split_shard(1));
    check_metadata(&m, N_TOKENS_SPLIT);
    assert_eq!(m.shards().len(), N_SHARDS);
    for (k, f) in m.shards().iter().enumerate() {
        let p = f.path().display().to_string();
        assert!(p.ends_with(&shard_name(k + 1)), "shard {k} is {p}");
        assert_eq!(
            f.get("split.no"),
            Some(&Value::U16(k as u16)),
            "{p}: split.no"
        );
        assert_eq!(
            f.get("split.count"),
            Some(&Value::U16(N_SHARDS as u16)),
            "{p}: split.count"
        );
        assert_eq!(
            f.get("split.tensors.count"),
            Some(&Value::I32(N_TENSORS as i32)),
            "{p}: split.tensors.count"
        );
        if k > 0 {
            // GGUFWriter puts all other metadata in the first shard only.
            assert_eq!(f.metadata().len(), 3, "{p}: keys besides split.*");
        }
    }
}

#[test]
fn split_opens_through_any_shard_and_serves_each_tensor_from_its_shard() {
    let manifest_path = fixture("MANIFEST.json");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    let placement = manifest["tensors"].as_array().unwrap();
    assert_eq!(placement.len(), N_TENSORS);
    let single = open(&fixture("all_types.gguf"));
    for k in 1..=N_SHARDS {
        let m = open(&split_shard(k));
        assert_eq!(m.n_tensors(), N_TENSORS, "opened through shard {k}");
        assert!(
            m.path().ends_with(shard_name(1)),
            "first shard stands for the model"
        );
        assert_eq!(m.architecture(), Some("quant-fixture"));
        for p in placement {
            let name = p["name"].as_str().unwrap();
            let shard = p["split_shard_index"].as_u64().unwrap() as usize;
            let t = m.tensor(name).unwrap();
            assert_eq!(t.shard, shard, "{name}: shard (opened through shard {k})");
            assert!(
                m.shards()[shard].tensor(name).is_some(),
                "{name}: not in the file of shard {shard}"
            );
            let s = single.tensor(name).unwrap();
            assert_eq!(t.info.ne, s.info.ne, "{name}: ne");
            let ne: Vec<u64> = p["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(t.info.ne, ne, "{name}: ne in the manifest");
            assert!(
                m.tensor_data(t).unwrap() == single.tensor_data(s).unwrap(),
                "{name}: bytes from shard {shard} differ from the single-file model"
            );
        }
    }
}

/// Copies the split fixture into a fresh temporary directory.
fn copy_split() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for k in 1..=N_SHARDS {
        std::fs::copy(split_shard(k), dir.path().join(shard_name(k))).unwrap();
    }
    dir
}

#[test]
fn split_missing_shard_is_an_error_naming_the_file() {
    for missing in 1..=N_SHARDS {
        let dir = copy_split();
        std::fs::remove_file(dir.path().join(shard_name(missing))).unwrap();
        for entry in (1..=N_SHARDS).filter(|&k| k != missing) {
            let err = Model::open(&dir.path().join(shard_name(entry)))
                .expect_err("a model with a missing shard must not open");
            let msg = format!("{err:#}");
            assert!(
                msg.contains(&shard_name(missing)),
                "shard {missing} missing, opened through {entry}: message does not name it: {msg}"
            );
        }
    }
}

#[test]
fn split_foreign_shard_is_rejected_naming_the_key() {
    // The foreign set is a valid model of its own: the rejection below comes from the mix.
    let foreign = open(&fixture(&format!("foreign/{}", shard_name(1))));
    assert_eq!(foreign.n_tensors(), 5);
    for replaced in 1..=N_SHARDS {
        let dir = copy_split();
        std::fs::copy(
            fixture(&format!("foreign/{}", shard_name(replaced))),
            dir.path().join(shard_name(replaced)),
        )
        .unwrap();
        let err = Model::open(&dir.path().join(shard_name(1)))
            .expect_err("a model with a foreign shard must not open");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("split.tensors.count"),
            "shard {replaced} replaced by another model's: message does not name the key: {msg}"
        );
        assert!(
            msg.contains(".gguf"),
            "shard {replaced} replaced: message names no file: {msg}"
        );
    }
}
