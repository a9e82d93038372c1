//! Fuzzes the GGUF reader: any byte string must give `Ok` or `Err`, never a panic, and a file
//! that parses must keep the reader's invariants (every tensor's bytes inside the file, row
//! slices adding up to the tensor, the model view agreeing with the file).

#![no_main]

use std::hint::black_box;

use glmdiff::gguf::{GgufFile, Model, Value};
use libfuzzer_sys::fuzz_target;

/// Renders a value every way the CLI does, to walk nested arrays.
fn touch_value(v: &Value) {
    black_box(v.summary(8));
    black_box(v.to_json());
    black_box(v.to_string());
    black_box((v.as_int(), v.as_f64(), v.as_str()));
    if let Some(items) = v.as_array() {
        items.iter().for_each(touch_value);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for (_, v) in f.metadata() {
        touch_value(v);
    }
    let mut sum = 0u64;
    for t in f.tensors() {
        let bytes = f.tensor_data(t).expect("a parsed tensor");
        assert_eq!(bytes.len() as u64, t.nbytes, "{}", t.name);
        sum = bytes.iter().fold(sum, |s, &b| s.wrapping_add(u64::from(b)));
        let rows = t.n_rows();
        black_box((t.n_elements(), t.row_len(), t.row_bytes(), t.shape()));
        let all = f.row_data(t, 0..rows).expect("all rows of a parsed tensor");
        assert_eq!(all, bytes, "{}", t.name);
        if rows > 0 {
            let last = f.row_data(t, rows - 1..rows).expect("last row");
            assert_eq!(last.len() as u64, t.row_bytes(), "{}", t.name);
        }
        assert!(f.row_data(t, 0..rows + 1).is_err(), "{}", t.name);
    }
    black_box(sum);
    let n = f.tensors().len();
    let Ok(m) = Model::from_shards(vec![f]) else {
        return;
    };
    assert_eq!(m.n_tensors(), n);
    black_box(m.architecture());
    for t in m.tensors() {
        let found = m.tensor(&t.info.name).expect("a listed tensor");
        assert_eq!(m.tensor_data(found).expect("a listed tensor").len() as u64, t.info.nbytes);
    }
    black_box(m.tensor("blk.0.attn_q.weight").is_err());
});
