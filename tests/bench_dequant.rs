//! `bench dequant --libggml PATH`: the loader's errors (each bad library made here, in a
//! temporary directory), and, where `$GLMDIFF_LIBGGML` names a libggml-base shared library
//! (llama.cpp's), every type dequantized by both libggml and glmdiff and compared bit for bit:
//! llama.cpp's C is an oracle independent of glmdiff and of gguf-py.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::glmdiff;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `bench dequant --libggml lib` on a small run of `types`.
fn bench(lib: &Path, types: &str, json: bool) -> Output {
    let mut args = vec![
        "bench",
        "dequant",
        "--types",
        types,
        "--elements",
        "4096",
        "--libggml",
        lib.to_str().unwrap(),
    ];
    if json {
        args.push("--json");
    }
    glmdiff(&args)
}

#[test]
fn a_text_file_is_not_a_library() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libggml-base.so");
    std::fs::write(&lib, "this is not an ELF file\n").unwrap();
    let o = bench(&lib, "q8_0", false);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("libggml: "), "{err}");
    assert!(err.contains(lib.to_str().unwrap()), "{err}");
    assert!(err.contains("not a loadable shared library"), "{err}");
    assert!(o.stdout.is_empty());
}

#[test]
fn a_missing_library_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("nope.so");
    let o = bench(&lib, "q8_0", false);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(lib.to_str().unwrap()) && err.contains("no such file"),
        "{err}"
    );
}

/// Builds a shared library from C source `src` in `dir`, with the C compiler that links Rust
/// programs (`$CC`, else `cc`).
fn build_library(dir: &Path, src: &str) -> std::path::PathBuf {
    let c = dir.join("lib.c");
    std::fs::write(&c, src).unwrap();
    let lib = dir.join("libfake.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&c)
        .output()
        .unwrap_or_else(|e| panic!("{cc} (needed to build a test library): {e}"));
    assert!(built.status.success(), "{}", stderr(&built));
    lib
}

/// A row dequantizer for Q8_0 that writes zeros: a library that disagrees with glmdiff.
const ZEROS_Q8_0: &str = "#include <stdint.h>\n\
     void dequantize_row_q8_0(const void * x, float * y, int64_t k) {\n\
         (void)x; for (int64_t i = 0; i < k; i++) y[i] = 0.0f;\n\
     }\n";

/// A real shared library that exports one row dequantizer but not the other asked: the error
/// names the path and the missing symbol, before any timing.
#[test]
fn a_library_without_the_symbol_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_library(dir.path(), ZEROS_Q8_0);
    let o = bench(&lib, "q8_0,q4_k", false);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(lib.to_str().unwrap()), "{err}");
    assert!(err.contains("no symbol dequantize_row_q4_K"), "{err}");
}

/// A library whose values differ from glmdiff's: a difference found (exit 1), the table says
/// which type and where, the JSON counts the values.
#[test]
fn a_library_that_disagrees_is_a_difference() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_library(dir.path(), ZEROS_Q8_0);
    let o = bench(&lib, "q8_0", false);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(1), "{}{out}", stderr(&o));
    assert!(out.contains("NO ("), "{out}");
    assert!(out.contains("Q8_0: libggml differs: "), "{out}");
    let o = bench(&lib, "q8_0", true);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = &r["rows"][0];
    assert!(row["libggml_mismatches"].as_u64().unwrap() > 0, "{row}");
    assert_eq!(row["libggml_first_mismatch"]["libggml"], 0.0, "{row}");
    assert!(row["c_anchor_melem_s"].is_null(), "{row}");
}

/// `--libggml` and `--device` measure different things: refused together.
#[test]
fn libggml_with_device_is_refused() {
    let o = glmdiff(&[
        "bench",
        "dequant",
        "--device",
        "0",
        "--libggml",
        "/nonexistent/libggml-base.so",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--libggml"), "{}", stderr(&o));
}

/// Every type both have, on random blocks: libggml's values equal glmdiff's bit for bit, and
/// every rate is filled. Needs `GLMDIFF_LIBGGML` (e.g. `build/bin/libggml-base.so` of a
/// llama.cpp build); without it the test says so and returns.
#[test]
#[ignore = "needs GLMDIFF_LIBGGML=<libggml-base.so>; run with --include-ignored"]
fn libggml_agrees_bit_for_bit() {
    let Some(lib) = std::env::var_os("GLMDIFF_LIBGGML") else {
        println!("skipped: GLMDIFF_LIBGGML is not set (a libggml-base shared library)");
        return;
    };
    let types = [
        "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
        "q6_k", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_nl",
        "iq4_xs", "tq1_0", "tq2_0", "mxfp4", "nvfp4",
    ]
    .join(",");
    let o = bench(Path::new(&lib), &types, true);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), types.split(',').count());
    for row in rows {
        let ty = row["ty"].as_str().unwrap();
        assert_eq!(row["libggml_mismatches"], 0, "{ty}: {row}");
        assert!(row["libggml_melem_s"].as_f64().unwrap() > 0.0, "{ty}");
        assert!(
            row["ratio_single_vs_libggml"].as_f64().unwrap() > 0.0,
            "{ty}"
        );
        assert!(row["c_anchor_melem_s"].is_null(), "{ty}");
    }
    println!("{}", String::from_utf8_lossy(&o.stdout));
}
