//! The `glmdiff` binary end to end: `inspect` and `dequant` on the gguf-py fixtures, exit codes,
//! error messages, atomic outputs. Expected values come from the fixture MANIFEST written by
//! `reference/fixtures/make_quant_fixtures.py` (gguf-py) and from gguf-py's dequantized values.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_glmdiff"))
}

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/quant")
        .join(p)
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run glmdiff")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn manifest() -> Value {
    let s = std::fs::read_to_string(fixture("MANIFEST.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

/// Bytes per block and elements per block, copied by hand from gguf-py 0.19.0 `GGML_QUANT_SIZES`.
fn block_bytes(ty: &str) -> (u64, u64) {
    match ty {
        "F32" | "I32" => (1, 4),
        "F16" | "BF16" | "I16" => (1, 2),
        "I8" => (1, 1),
        "Q4_0" | "IQ4_NL" => (32, 18),
        "Q4_1" => (32, 20),
        "Q5_0" => (32, 22),
        "Q5_1" => (32, 24),
        "Q8_0" => (32, 34),
        "Q2_K" => (256, 84),
        "Q3_K" | "IQ3_S" => (256, 110),
        "Q4_K" => (256, 144),
        "Q5_K" => (256, 176),
        "Q6_K" => (256, 210),
        "IQ2_XXS" | "TQ2_0" => (256, 66),
        "IQ2_XS" => (256, 74),
        "IQ2_S" => (256, 82),
        "IQ3_XXS" => (256, 98),
        "IQ1_S" => (256, 50),
        "IQ1_M" => (256, 56),
        "IQ4_XS" => (256, 136),
        "TQ1_0" => (256, 54),
        "MXFP4" => (32, 17),
        "NVFP4" => (64, 36),
        other => panic!("no size for {other}"),
    }
}

#[test]
fn inspect_json_lists_every_tensor_as_gguf_py_wrote_it() {
    let o = run(&[
        "inspect",
        fixture("all_types.gguf").to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = manifest();
    let want = m["tensors"].as_array().unwrap();
    assert_eq!(r["tensor_count"].as_u64().unwrap() as usize, want.len());
    assert_eq!(r["architecture"], "quant-fixture");
    assert_eq!(r["gguf_version"], 3);
    let got = r["tensors"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    let mut total = 0;
    for w in want {
        let name = w["name"].as_str().unwrap();
        let g = got
            .iter()
            .find(|g| g["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(g["ty"], w["type"], "{name}");
        assert_eq!(g["shape"], w["shape"], "{name}");
        let n: u64 = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        let (bs, ts) = block_bytes(w["type"].as_str().unwrap());
        assert_eq!(g["bytes"].as_u64().unwrap(), n / bs * ts, "{name}");
        total += n / bs * ts;
    }
    assert_eq!(r["total_bytes"].as_u64().unwrap(), total);
    let hist: u64 = r["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(hist, total);
    // The tokenizer summary counts the 150k-entry token array; the hyphenated key is kept as written.
    assert_eq!(r["tokenizer"]["tokens"], 150_000);
    assert_eq!(r["other_metadata"]["glm-dsa.block_count"], "78");
}

#[test]
fn inspect_table_filters_by_glob_and_shows_shards() {
    let shard = fixture("split/all_types-00002-of-00003.gguf");
    let o = run(&["inspect", shard.to_str().unwrap(), "--tensors", "q4_*"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("in 3 files"), "{out}");
    let m = manifest();
    for w in m["tensors"].as_array().unwrap() {
        let name = w["name"].as_str().unwrap();
        let shown = out.lines().any(|l| l.contains(&format!("| {name} ")));
        assert_eq!(shown, name.starts_with("q4_"), "{name} in\n{out}");
        if shown {
            let shard = w["split_shard_index"].as_u64().unwrap() + 1;
            let line = out
                .lines()
                .find(|l| l.contains(&format!("| {name} ")))
                .unwrap();
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            assert_eq!(cells[cells.len() - 2], shard.to_string(), "{line}");
        }
    }
}

/// Reads a little-endian f32 `.npy` written by glmdiff (header parsed per numpy's format spec).
fn read_npy_f32(p: &Path) -> (String, Vec<f32>) {
    let b = std::fs::read(p).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = String::from_utf8(b[10..10 + hl].to_vec()).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    let data = b[10 + hl..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (header, data)
}

fn expected(name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(fixture("all_types.expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (t.shape().to_vec(), v)
}

#[test]
fn dequant_rows_to_npy_equals_gguf_py_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rows.npy");
    let m = manifest();
    let t = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["type"] == "Q4_K")
        .unwrap();
    let name = t["name"].as_str().unwrap();
    let (shape, want) = expected(name);
    let row = *shape.last().unwrap();
    let n_rows = want.len() / row;
    assert!(n_rows >= 3, "fixture tensor has {n_rows} rows");
    let o = run(&[
        "dequant",
        fixture("split/all_types-00001-of-00003.gguf")
            .to_str()
            .unwrap(),
        name,
        "--rows",
        "1..3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (header, got) = read_npy_f32(&out);
    assert!(header.contains(&format!("'shape': (2, {row})")), "{header}");
    let want_rows = &want[row..3 * row];
    assert_eq!(got.len(), want_rows.len());
    for (i, (a, b)) in got.iter().zip(want_rows).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "element {i}: {a} vs {b}");
    }
}

#[test]
fn dequant_whole_tensor_to_safetensors_keeps_pytorch_shape() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    let m = manifest();
    let t = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["shape"].as_array().unwrap().len() >= 3 && t["type"] != "I32")
        .expect("a 3-D fixture tensor");
    let name = t["name"].as_str().unwrap();
    let o = run(&[
        "dequant",
        fixture("all_types.gguf").to_str().unwrap(),
        name,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let got = st.tensor(name).unwrap();
    let (shape, want) = expected(name);
    assert_eq!(got.shape(), shape.as_slice());
    let got: Vec<u32> = got
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want);
}

fn assert_error(args: &[&str], needles: &[&str]) {
    let o = run(args);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "args {args:?}: {e}");
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "expected {n:?} in: {e}");
    }
}

#[test]
fn bad_input_exits_2_with_a_message_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.npy");
    let o = out.to_str().unwrap();
    let model = fixture("all_types.gguf");
    let m = model.to_str().unwrap();
    assert_error(
        &["inspect", "/nonexistent/x.gguf"],
        &["/nonexistent/x.gguf"],
    );
    assert_error(
        &["dequant", m, "no.such.tensor", "--out", o],
        &["no.such.tensor", "all_types.gguf"],
    );
    assert_error(
        &[
            "dequant",
            m,
            "q4_k.weight",
            "--rows",
            "0..100000",
            "--out",
            o,
        ],
        &["0..100000", "rows"],
    );
    assert_error(
        &["dequant", m, "q4_k.weight", "--rows", "5", "--out", o],
        &["A..B"],
    );
    assert_error(
        &[
            "dequant",
            m,
            "q4_k.weight",
            "--out",
            dir.path().join("x.txt").to_str().unwrap(),
        ],
        &[".npy"],
    );
    assert_error(&["frobnicate"], &["frobnicate"]);
    assert!(
        !out.exists(),
        "a failed command must not leave an output file"
    );
    // A truncated copy: the error names the file, the tensor and the byte counts.
    let bytes = std::fs::read(&model).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).unwrap();
    assert_error(
        &["inspect", cut.to_str().unwrap()],
        &["cut.gguf", "needs", "bytes"],
    );
    // A shard whose siblings are missing names the missing file.
    let lone = dir.path().join("m-00001-of-00002.gguf");
    std::fs::copy(fixture("split/all_types-00001-of-00003.gguf"), &lone).unwrap();
    assert_error(
        &["inspect", lone.to_str().unwrap()],
        &["m-00002-of-00002.gguf"],
    );
}

#[test]
fn help_and_version_exit_0() {
    assert_eq!(run(&["--help"]).status.code(), Some(0));
    assert_eq!(run(&["--version"]).status.code(), Some(0));
}

#[test]
fn inspect_shows_the_forward_pass_glmdiff_will_run() {
    // dsv3-tiny was made from a transformers config with n_group 4, topk_group 2, sigmoid
    // scoring, 3 layers of which 1 dense, YaRN factor 40 (reference/fixtures/tiny_models.py).
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/dsv3-tiny/dsv3-tiny-f32.gguf");
    let o = run(&["inspect", p.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let fp = &r["forward_pass"]["Ok"];
    let routing = fp["routing"].as_str().unwrap();
    assert!(routing.contains("gating sigmoid"), "{routing}");
    assert!(routing.contains("groups 2 of 4"), "{routing}");
    assert!(
        fp["layers run"]
            .as_str()
            .unwrap()
            .starts_with("3 of 3 blocks"),
        "{fp}"
    );
    assert!(
        fp["rope"].as_str().unwrap().contains("YaRN factor 40"),
        "{fp}"
    );
    // Not a supported architecture: no forward-pass section, no error.
    let o = run(&[
        "inspect",
        fixture("all_types.gguf").to_str().unwrap(),
        "--json",
    ]);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(r["forward_pass"].is_null());
}

/// Regression: a directory or a device as MODEL reached mmap and failed with "No such device".
#[test]
fn inspect_on_a_directory_or_device_says_what_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    assert_error(&["inspect", d], &[d, "is a directory"]);
    if Path::new("/dev/null").exists() {
        assert_error(
            &["inspect", "/dev/null"],
            &["/dev/null", "not a regular file"],
        );
    }
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert_error(
        &["inspect", empty.to_str().unwrap()],
        &["empty.gguf", "magic"],
    );
}

/// Regression: `trace` without `--prompt` or `--tokens` said only that `--prompt` was required.
#[test]
fn trace_without_input_names_both_prompt_and_tokens() {
    let m = fixture("all_types.gguf");
    let m = m.to_str().unwrap();
    assert_error(
        &["trace", m, "--out", "x.safetensors"],
        &["--prompt", "--tokens"],
    );
    assert_error(
        &[
            "trace",
            m,
            "--prompt",
            "a",
            "--tokens",
            "1",
            "--out",
            "x.safetensors",
        ],
        &["--prompt", "--tokens", "cannot be used with"],
    );
}

/// A reader that goes away (`glmdiff inspect M | head -1`) ends glmdiff quietly: no panic from
/// `println!` on a closed pipe, no error text.
#[test]
fn a_closed_stdout_pipe_ends_quietly() {
    use std::process::Stdio;
    let mut child = bin()
        .args(["inspect", fixture("all_types.gguf").to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end before glmdiff writes its table.
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(o.status.code(), Some(101), "{err}");
    assert!(err.is_empty(), "{err}");
}

/// A flag's bad value is one error line: clap's pointer to --help is dropped.
#[test]
fn a_bad_flag_value_is_one_line() {
    let o = run(&["dequant", "x.gguf", "t", "--rows", "5..2", "--out", "o.npy"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.starts_with("error: "), "{err}");
}

#[test]
fn negative_numbers_reach_the_flag_and_get_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = fixture("all_types.gguf");
    let m = model.to_str().unwrap();
    let out = |n: &str| d.join(n).to_str().unwrap().to_string();
    let (npy, gguf) = (out("x.npy"), out("x.gguf"));
    let case = out("case");
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["step", &case, "--tol", "-1"],
            &["'--tol <VALUE>'", "-1 must be finite and not negative"],
        ),
        (
            vec!["run", m, "--layer", "-1"],
            &[
                "'--layer <N>'",
                "layer -1 is negative: a layer is an integer in 0..N",
            ],
        ),
        (
            vec!["run", m, "--layers", "-2..3"],
            &["'--layers <A..B>'", "range start -2 is negative"],
        ),
        (
            vec!["run", m, "--devices", "0,-1"],
            &["'--devices <LIST>'", "device -1 is negative"],
        ),
        (
            vec![
                "dequant",
                m,
                "q4_k.weight",
                "--rows",
                "-1..2",
                "--out",
                &npy,
            ],
            &[
                "'--rows <A..B>'",
                "range start -1 is negative: A..B takes integers from 0",
            ],
        ),
        (
            vec!["dequant-check", m, "--device", "-1"],
            &[
                "'--device <DEVICE>'",
                "device -1 is negative: a CUDA device ordinal",
            ],
        ),
        (
            vec!["synth", "--arch", "glm-dsa", "--seed", "-1", "--out", &gguf],
            &[
                "'--seed <SEED>'",
                "seed -1 is negative: a seed is an integer in 0..2^64",
            ],
        ),
        (
            vec![
                "synth", "--arch", "glm-dsa", "--layers", "-3", "--out", &gguf,
            ],
            &["'--layers <LAYERS>'", "layer count -3 is negative"],
        ),
        (
            vec!["bench", "dequant", "--device", "-1"],
            &["'--device <N>'", "device -1 is negative"],
        ),
        (
            vec!["bench", "layer", "--tokens", "-4"],
            &["'--tokens <TOKENS>'", "token count -4 is negative"],
        ),
    ];
    for (args, needles) in &cases {
        let o = run(args);
        // One message: a line, continued (if at all) on lines indented two spaces.
        let e = stderr(&o).replace("\n  ", " ");
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
        assert!(e.starts_with("error: invalid value '-"), "{args:?}: {e}");
        assert!(
            !e.contains("unexpected argument") && !e.contains("-- -"),
            "{e}"
        );
        for n in *needles {
            assert!(e.contains(n), "{args:?}: expected {n:?} in: {e}");
        }
    }
    assert!(!Path::new(&npy).exists() && !Path::new(&gguf).exists());
}

/// `--cpu-simd` caps the CPU's level (`bench dequant` names the one that ran); its default
/// comes from `GLMDIFF_CPU_SIMD` (a value that names no level is ignored); the flag wins over
/// the variable; a bad flag value is an error.
#[test]
fn cpu_simd_from_the_flag_or_the_environment() {
    let level = |flag: Option<&str>, var: Option<&str>| {
        let mut c = bin();
        if let Some(f) = flag {
            c.args(["--cpu-simd", f]);
        }
        c.args([
            "bench",
            "dequant",
            "--types",
            "q8_0",
            "--elements",
            "256",
            "--json",
        ]);
        match var {
            Some(v) => c.env("GLMDIFF_CPU_SIMD", v),
            None => c.env_remove("GLMDIFF_CPU_SIMD"),
        };
        let o = c.output().expect("run glmdiff");
        assert!(o.status.success(), "{flag:?} {var:?}: {}", stderr(&o));
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        r["cpu_simd"].as_str().unwrap().to_string()
    };
    let widest = level(None, None);
    assert_eq!(level(Some("base"), None), "base");
    assert_eq!(level(None, Some("base")), "base");
    assert_eq!(level(None, Some("")), widest);
    assert_eq!(level(None, Some("sse9")), widest);
    assert_eq!(level(Some(&widest), Some("base")), widest);
    assert_eq!(level(Some("BASE"), Some(&widest)), "base");
    assert_error(
        &["--cpu-simd", "sse9", "inspect", "x.gguf"],
        &["--cpu-simd", "base, avx2 or avx512"],
    );
}
