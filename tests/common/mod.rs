//! Helpers shared by the integration tests.

pub mod gguf_bytes;
pub mod hf_from_gguf;
pub mod subset;

use std::path::{Path, PathBuf};

/// The repository root: `$GLMDIFF_REPO` when set (a test binary run from another checkout, as
/// on the GPU machine), else the crate the tests were built in.
pub fn repo_root() -> PathBuf {
    std::env::var_os("GLMDIFF_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The glmdiff binary: `$GLMDIFF_BIN` when set, else the one cargo built with the tests.
pub fn glmdiff_bin() -> PathBuf {
    std::env::var_os("GLMDIFF_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_glmdiff")))
}

/// The repository's fixture directory `fixtures/<sub>`.
pub fn fixtures(sub: &str) -> PathBuf {
    repo_root().join("fixtures").join(sub)
}

/// A fixture model or golden trace, `rel` under `fixtures/models` (e.g.
/// `glm5-tiny/glm5-tiny-f32.gguf`).
pub fn model(rel: &str) -> PathBuf {
    fixtures("models").join(rel)
}

/// The prompt of the golden trace `rel` under `fixtures/models` (made by transformers, not by
/// glmdiff), as `--tokens` takes it.
pub fn golden_tokens(rel: &str) -> String {
    let t = glmdiff::trace::read_trace(&model(rel)).unwrap();
    let ids: Vec<String> = t.tokens().unwrap().iter().map(u32::to_string).collect();
    ids.join(",")
}

/// Runs glmdiff with `args`.
pub fn glmdiff(args: &[&str]) -> std::process::Output {
    std::process::Command::new(glmdiff_bin())
        .args(args)
        .output()
        .expect("run glmdiff")
}

/// `(trace, gguf)` for every `*.trace.safetensors` in the subdirectories of `traces_root` and
/// every GGUF its metadata lists (`models`, else `model`), found in the directory of the same
/// name under `models_root`. Sorted by directory and file name.
pub fn trace_pairs(traces_root: &Path, models_root: &Path) -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(traces_root)
        .unwrap_or_else(|e| panic!("no trace fixtures at {}: {e}", traces_root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        let mut traces: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".trace.safetensors"))
            .collect();
        traces.sort();
        let models_dir = models_root.join(dir.file_name().unwrap());
        for tr in traces {
            let t = glmdiff::trace::read_trace(&tr).unwrap();
            let models: Vec<String> = match t.metadata.get("models") {
                Some(m) => serde_json::from_str(m).unwrap(),
                None => vec![t.metadata["model"].clone()],
            };
            for m in models {
                out.push((tr.clone(), models_dir.join(m)));
            }
        }
    }
    assert!(!out.is_empty(), "no traces under {}", traces_root.display());
    out
}

/// The tensors of a trace as f32/i32 host tensors (what a test edits to plant a bug).
pub fn host_tensors(
    t: &glmdiff::trace::Trace,
) -> std::collections::BTreeMap<String, glmdiff::engine::HostTensor> {
    use glmdiff::engine::HostTensor;
    use glmdiff::trace::TraceValues;
    t.tensors
        .iter()
        .map(|(n, v)| {
            let h = match &v.values {
                TraceValues::Float(f) => {
                    HostTensor::f32(v.shape.clone(), f.iter().map(|&x| x as f32).collect())
                }
                TraceValues::Int(i) => {
                    HostTensor::i32(v.shape.clone(), i.iter().map(|&x| x as i32).collect())
                }
            };
            (n.clone(), h.expect("trace tensor"))
        })
        .collect()
}

/// `text` with each line continued by the width (a line wrapped with a two-space indent, as
/// errors and notes on stderr are) joined back to the line it continues: one message, one line.
pub fn joined(text: &str) -> String {
    text.replace("\n  ", " ")
}

/// A finished process's stderr, its wrapped messages [`joined`].
pub fn stderr_joined(o: &std::process::Output) -> String {
    joined(&String::from_utf8_lossy(&o.stderr))
}

/// A finished glmdiff process as (exit code, the JSON it wrote to `json` or null, its stdout
/// and stderr, its messages [`joined`]).
pub fn outcome(o: std::process::Output, json: &Path) -> (i32, serde_json::Value, String) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        stderr_joined(&o)
    );
    let j = std::fs::read_to_string(json)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::Value::Null);
    (o.status.code().unwrap_or(-1), j, text)
}

/// `glmdiff run GGUF --against trace:TRACE --json DIR/r.json EXTRA...` with its cache in `dir`:
/// exit code, the JSON and the text printed.
pub fn run_trace(
    dir: &Path,
    gguf: &Path,
    trace: &Path,
    extra: &[&str],
) -> (i32, serde_json::Value, String) {
    let json = dir.join("r.json");
    let against = format!("trace:{}", trace.display());
    let mut args = vec![
        "run",
        gguf.to_str().unwrap(),
        "--against",
        &against,
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    outcome(glmdiff_in(dir, &args), &json)
}

/// `glmdiff ARGS --json JSON` with its reference cache in `cache`, a `json` left by an earlier run
/// removed first: exit code, the JSON and the text printed.
pub fn run_json(cache: &Path, args: &[&str], json: &Path) -> (i32, serde_json::Value, String) {
    let _ = std::fs::remove_file(json);
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--json", json.to_str().unwrap()]);
    outcome(glmdiff_in(cache, &all), json)
}

/// Runs glmdiff with `args` and its reference cache in `cache`.
pub fn glmdiff_in(cache: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(glmdiff_bin())
        .args(args)
        .env("GLMDIFF_CACHE_DIR", cache)
        .output()
        .expect("run glmdiff")
}

/// A finished process's stdout, then its stderr (its messages [`joined`]).
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        stderr_joined(o)
    )
}
