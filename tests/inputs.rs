//! Bad or mismatched inputs through the binary: each test makes its bad input itself in a
//! temporary directory (a fixture copied and patched byte by byte, a trace rewritten by the
//! small safetensors reader and writer below, a suite written as text) and checks that
//! glmdiff exits 2 at once with one line naming the file and the problem, its key words and
//! numbers, and leaves every input byte-identical. Nothing here is produced by glmdiff's own
//! writers; the numbers asserted are worked out from the fixtures' shapes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::common::{fixtures, glmdiff_bin};

/// The longest any command here may take before it counts as a hang.
const LIMIT: Duration = Duration::from_secs(10);

/// Runs glmdiff with `args` (its cache in `cache`), killing it and failing the test when it
/// does not return within [`LIMIT`].
fn glmdiff(cache: &Path, args: &[&str]) -> Output {
    let out_dir = tempfile::tempdir().unwrap();
    let (so, se) = (out_dir.path().join("out"), out_dir.path().join("err"));
    let mut child = Command::new(glmdiff_bin())
        .args(args)
        .env("GLMDIFF_CACHE_DIR", cache)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&so).unwrap())
        .stderr(std::fs::File::create(&se).unwrap())
        .spawn()
        .expect("start glmdiff");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("glmdiff {args:?} did not return within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: std::fs::read(&so).unwrap(),
        stderr: std::fs::read(&se).unwrap(),
    }
}

/// Stdout then stderr.
fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts exit 2 with one error line on stderr containing every one of `parts`; returns it.
fn input_error(o: &Output, parts: &[&str]) -> String {
    let err = crate::common::stderr_joined(o);
    assert_eq!(o.status.code(), Some(2), "{}", text(o));
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for p in parts {
        assert!(lines[0].contains(p), "missing {p:?} in: {}", lines[0]);
    }
    lines[0].to_string()
}

/// Copies fixture `rel` (under `fixtures/models`) into `dir`.
fn copy(dir: &Path, rel: &str) -> PathBuf {
    let src = fixtures("models").join(rel);
    let dst = dir.join(src.file_name().unwrap());
    std::fs::copy(&src, &dst).unwrap();
    dst
}

/// The bytes of `paths`, to check afterwards that nothing wrote to them.
fn snapshot(paths: &[&Path]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn unchanged(paths: &[&Path], before: &[Vec<u8>]) {
    for (p, b) in paths.iter().zip(before) {
        assert!(std::fs::read(p).unwrap() == *b, "{} changed", p.display());
    }
}

/// Rewrites the u32 value of metadata key `key` in a GGUF file (little-endian, GGUF v3:
/// u64 key length, key bytes, u32 value type 4 = UINT32, the value; ggml `docs/gguf.md`).
fn patch_u32(path: &Path, key: &str, value: u32) {
    patch_value(path, key, 4, &value.to_le_bytes());
}

/// Rewrites the 4-byte value of metadata key `key`, whose value type must be `ty`.
fn patch_value(path: &Path, key: &str, ty: u32, value: &[u8; 4]) {
    let mut b = std::fs::read(path).unwrap();
    let mut pat = (key.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(key.as_bytes());
    let at = b
        .windows(pat.len())
        .position(|w| w == pat)
        .unwrap_or_else(|| panic!("no key {key}"));
    let t = at + pat.len();
    assert_eq!(
        b[t..t + 4],
        ty.to_le_bytes(),
        "{key} is not of value type {ty}"
    );
    b[t + 4..t + 8].copy_from_slice(value);
    std::fs::write(path, b).unwrap();
}

/// One tensor of a safetensors file: name, dtype, shape, data.
type Entry = (String, String, Vec<usize>, Vec<u8>);

/// A safetensors file as bytes: its `__metadata__` and its tensors in file order. Layout
/// (huggingface/safetensors): u64 header length, JSON header, data.
struct St {
    meta: Map<String, Value>,
    tensors: Vec<Entry>,
}

impl St {
    fn read(path: &Path) -> St {
        let b = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let mut header: Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).unwrap();
        let meta = match header.remove("__metadata__") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        let mut tensors: Vec<(u64, Entry)> = header
            .into_iter()
            .map(|(name, v)| {
                let off: Vec<u64> = serde_json::from_value(v["data_offsets"].clone()).unwrap();
                let shape: Vec<usize> = serde_json::from_value(v["shape"].clone()).unwrap();
                let data = b[8 + n + off[0] as usize..8 + n + off[1] as usize].to_vec();
                let dtype = v["dtype"].as_str().unwrap().to_string();
                (off[0], (name, dtype, shape, data))
            })
            .collect();
        tensors.sort_by_key(|t| t.0);
        St {
            meta,
            tensors: tensors.into_iter().map(|(_, e)| e).collect(),
        }
    }

    fn write(&self, path: &Path) {
        let mut header = Map::new();
        header.insert("__metadata__".into(), Value::Object(self.meta.clone()));
        let mut off = 0;
        for (name, dtype, shape, data) in &self.tensors {
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}),
            );
            off += data.len();
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
        }
        std::fs::write(path, out).unwrap();
    }

    fn clone_entry(&self, name: &str) -> Entry {
        self.tensors.iter().find(|t| t.0 == name).unwrap().clone()
    }

    fn tensor(&mut self, name: &str) -> &mut Entry {
        self.tensors.iter_mut().find(|t| t.0 == name).unwrap()
    }
}

const GLM5: &str = "glm5-tiny/glm5-tiny-f32.gguf";
const GLM5_TRACE: &str = "glm5-tiny/glm5-tiny.short.trace.safetensors";
const GLM5_Q: &str = "glm5-tiny-q/glm5-tiny-q-mixed.gguf";

/// A trace of the model whose one hook `blk.0.q_a` was rewritten with another shape (the same
/// bytes as [10, 12], or reread as F32 [5, 48]) is refused naming that hook, its shape and the
/// model's [5, 24] (glm5-tiny: q_lora_rank 24, 5 tokens), never as a trace of another model.
#[test]
fn one_hook_of_a_wrong_shape_is_named_not_another_model() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let sound = St::read(&fixtures("models").join(GLM5_TRACE));
    assert_eq!(sound.clone_entry("blk.0.q_a").2, vec![5, 24]);
    let t = dir.path().join("t.safetensors");
    for (dtype, shape, shown) in [
        (
            None,
            vec![10, 12],
            "hook blk.0.q_a has shape [10, 12] (F64)",
        ),
        (
            Some("F32"),
            vec![5, 48],
            "hook blk.0.q_a has shape [5, 48] (F32)",
        ),
    ] {
        let mut st = St::read(&fixtures("models").join(GLM5_TRACE));
        let e = st.tensor("blk.0.q_a");
        e.2 = shape;
        if let Some(d) = dtype {
            e.1 = d.to_string();
        }
        st.write(&t);
        let before = snapshot(&[&m, &t]);
        let against = format!("trace:{}", t.display());
        let o = glmdiff(cache.path(), &["run", ms, "--against", &against]);
        let line = input_error(
            &o,
            &[
                "t.safetensors",
                shown,
                "gives it [5, 24] for 5 tokens",
                "hooks match the model",
            ],
        );
        assert!(!line.contains("another model"), "{line}");
        unchanged(&[&m, &t], &before);
    }
}

/// Regression: `glm-dsa.expert_count` patched to 4000000000 made `run` grow its memory at
/// ~70 MB/s until killed. Every command that reads the hyperparameters now returns at once,
/// naming the key, its value and the tensor it disagrees with; the same for a block count no
/// tensor backs, a width, and `vocab_size`.
#[test]
fn hyperparameters_patched_past_the_tensors_fail_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    // glm5-tiny-q: hidden 256, 8 experts, 2 layers (layer 1 MoE), vocabulary 464.
    let cases: [(&str, u32, &[&str]); 4] = [
        (
            "glm-dsa.expert_count",
            4_000_000_000,
            &[
                "metadata glm-dsa.expert_count = 4000000000 disagrees with tensor blk.1.",
                "is 8, not 4000000000",
            ],
        ),
        (
            "glm-dsa.block_count",
            4_000_000_000,
            &[
                "glm-dsa.block_count = 4000000000",
                "runs layers 0..4000000000, but the file has no blk.2.attn_norm.weight",
            ],
        ),
        (
            "glm-dsa.embedding_length",
            255,
            &[
                "metadata glm-dsa.embedding_length = 255 disagrees with tensor",
                "its ne[0] is 256, not 255",
            ],
        ),
        (
            "glm-dsa.vocab_size",
            465,
            &["metadata glm-dsa.vocab_size = 465 disagrees with tensor token_embd.weight: it has 464 rows"],
        ),
    ];
    for (key, value, want) in cases {
        let m = copy(dir.path(), GLM5_Q);
        patch_u32(&m, key, value);
        let before = snapshot(&[&m]);
        let ms = m.to_str().unwrap();
        for line in refused_by_run_and_trace(cache.path(), &m, &out, want) {
            assert!(line.contains("glm5-tiny-q-mixed.gguf"), "{line}");
        }
        // inspect shows any GGUF, and says why this one cannot run.
        let o = glmdiff(cache.path(), &["--wide", "inspect", ms]);
        assert!(text(&o).contains(want[0]), "{key}: {}", text(&o));
        unchanged(&[&m], &before);
        assert!(!out.exists());
    }
}

/// Asserts that `run` against the CPU and `trace` (to `out`) of model `m` both exit 2 with one
/// error line holding every one of `parts`; returns the two lines.
fn refused_by_run_and_trace(cache: &Path, m: &Path, out: &Path, parts: &[&str]) -> Vec<String> {
    let ms = m.to_str().unwrap();
    let os = out.to_str().unwrap();
    [
        vec!["run", ms, "--against", "cpu", "--tokens", "1,2,3"],
        vec!["trace", ms, "--tokens", "1,2,3", "--out", os],
    ]
    .iter()
    .map(|args| input_error(&glmdiff(cache, args), parts))
    .collect()
}

/// A trace of another architecture, a trace whose `architecture` key was edited, and a trace
/// of another model's dimensions (glm5-tiny-q's, hidden 256, against glm5-tiny, 4 heads of
/// v 24) are refused before the run, naming the trace, the key or hook
/// and both values.
#[test]
fn traces_of_other_models_are_refused_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let dsv3 = copy(dir.path(), "dsv3-tiny/dsv3-tiny.short.trace.safetensors");
    // The GLM-5 trace with its architecture key edited.
    let edited = dir.path().join("edited.trace.safetensors");
    let mut st = St::read(&fixtures("models").join(GLM5_TRACE));
    st.meta.insert("architecture".into(), "deepseek2".into());
    st.write(&edited);
    // The quantized GLM-5 fixture's trace: 2 layers of hidden 256, the f32 model has hidden 64.
    let other_dims = copy(
        dir.path(),
        "glm5-tiny-q/glm5-tiny-q.short.trace.safetensors",
    );
    let before = snapshot(&[&m, &dsv3, &edited, &other_dims]);
    for (t, want) in [
        (
            &dsv3,
            vec![
                "dsv3-tiny.short.trace.safetensors",
                "this trace is of architecture deepseek2",
                "is glm-dsa",
            ],
        ),
        (
            &edited,
            vec![
                "edited.trace.safetensors",
                "this trace is of architecture deepseek2",
                "is glm-dsa",
            ],
        ),
        (
            &other_dims,
            vec![
                "glm5-tiny-q.short.trace.safetensors",
                // glm5-tiny: 4 heads of v 24; glm5-tiny-q: hidden 256.
                "hook blk.0.attn_heads has shape [5, 256]",
                "gives it [5, 96] for 5 tokens",
                "another model's dimensions",
            ],
        ),
    ] {
        let against = format!("trace:{}", t.display());
        let o = glmdiff(cache.path(), &["run", ms, "--against", &against]);
        input_error(&o, &want);
    }
    // The same traces side by side with the GLM-5 one: compare refuses them too.
    let glm5 = copy(dir.path(), GLM5_TRACE);
    let o = glmdiff(
        cache.path(),
        &["compare", glm5.to_str().unwrap(), dsv3.to_str().unwrap()],
    );
    input_error(
        &o,
        &[
            "the traces are of different architectures",
            "is glm-dsa",
            "is deepseek2",
        ],
    );
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            glm5.to_str().unwrap(),
            other_dims.to_str().unwrap(),
        ],
    );
    input_error(
        &o,
        &[
            "compare: hook token_embd is [5, 64] F64 in",
            "but [5, 256] F64 in",
            "glm5-tiny-q.short",
        ],
    );
    unchanged(&[&m, &dsv3, &edited, &other_dims], &before);
}

/// A hook of the wrong shape or kind is named as the trace's problem (file, hook, expected
/// and found), not as a GGUF weight's; a `tokens` key that disagrees with the hooks' rows is
/// one error, not a failure of every hook.
#[test]
fn wrong_hooks_and_tokens_are_the_traces_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let src = fixtures("models").join(GLM5_TRACE);
    let run = |t: &Path| {
        let against = format!("trace:{}", t.display());
        glmdiff(cache.path(), &["run", ms, "--against", &against])
    };

    // q_b [5, 192] stored as [5, 4, 48]: the same bytes, the wrong shape.
    let shape = dir.path().join("shape.trace.safetensors");
    let mut st = St::read(&src);
    st.tensor("blk.0.q_b").2 = vec![5, 4, 48];
    st.write(&shape);
    // moe_topk_ids (I32 [5, 2]) stored as F32 of the same ids.
    let kind = dir.path().join("kind.trace.safetensors");
    let mut st = St::read(&src);
    let t = st.tensor("blk.1.moe_topk_ids");
    t.1 = "F32".into();
    t.3 =
        t.3.chunks(4)
            .flat_map(|c| (i32::from_le_bytes(c.try_into().unwrap()) as f32).to_le_bytes())
            .collect();
    st.write(&kind);
    // The tokens key lists 3 of the 5 tokens every hook has rows for.
    let tokens = dir.path().join("tokens.trace.safetensors");
    let mut st = St::read(&src);
    st.meta.insert("tokens".into(), "[393, 322, 270]".into());
    st.write(&tokens);

    let before = snapshot(&[&m, &shape, &kind, &tokens]);
    input_error(
        &run(&shape),
        &[
            "shape.trace.safetensors",
            "hook blk.0.q_b has shape [5, 4, 48] (F64)",
            "gives it [5, 192]",
        ],
    );
    input_error(
        &run(&kind),
        &[
            "kind.trace.safetensors",
            "hook blk.1.moe_topk_ids is stored as F32, but it must hold integer ids",
        ],
    );
    input_error(
        &run(&tokens),
        &[
            "tokens.trace.safetensors",
            "its tokens metadata lists 3 tokens, but hook",
            "has shape [5,",
        ],
    );
    unchanged(&[&m, &shape, &kind, &tokens], &before);
}

/// A trace cut short says "truncated", with the end its header announces and the file's size:
/// cut in the data and cut in the header.
#[test]
fn truncated_traces_say_so_with_the_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let whole = std::fs::read(fixtures("models").join(GLM5_TRACE)).unwrap();
    let header = u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
    let cut_data = dir.path().join("data.trace.safetensors");
    std::fs::write(&cut_data, &whole[..whole.len() / 2]).unwrap();
    let cut_header = dir.path().join("header.trace.safetensors");
    std::fs::write(&cut_header, &whole[..header / 2]).unwrap();
    let full = copy(dir.path(), GLM5_TRACE);
    let before = snapshot(&[&m, &cut_data, &cut_header, &full]);
    let data_msg = format!(
        "is truncated: its header says the data ends at byte {}, the file has {} bytes",
        whole.len(),
        whole.len() / 2
    );
    let header_msg = format!(
        "is truncated: its header says it is {header} bytes (ending at byte {}), the file has {} bytes",
        header + 8,
        header / 2
    );
    let against = format!("trace:{}", cut_data.display());
    let o = glmdiff(
        cache.path(),
        &["run", m.to_str().unwrap(), "--against", &against],
    );
    input_error(&o, &["data.trace.safetensors", &data_msg]);
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            cut_header.to_str().unwrap(),
            full.to_str().unwrap(),
        ],
    );
    input_error(&o, &["header.trace.safetensors", &header_msg]);
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            full.to_str().unwrap(),
            cut_data.to_str().unwrap(),
        ],
    );
    input_error(&o, &[&data_msg]);
    unchanged(&[&m, &cut_data, &cut_header, &full], &before);
}

/// Regression: `compare REF OTHER` with no hook of OTHER under glmdiff's names printed OK with
/// every hook missing. Now exit 2, pointing at --map; the same for `run --against trace:`.
#[test]
fn no_matching_hook_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let reference = copy(dir.path(), GLM5_TRACE);
    let m = copy(dir.path(), GLM5);
    let other = dir.path().join("other.trace.safetensors");
    let mut st = St::read(&reference);
    for t in &mut st.tensors {
        t.0 = format!("model.{}", t.0);
    }
    st.write(&other);
    let before = snapshot(&[&reference, &m, &other]);
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            reference.to_str().unwrap(),
            other.to_str().unwrap(),
        ],
    );
    input_error(
        &o,
        &["no hook of", "other.trace.safetensors matches", "--map"],
    );
    let against = format!("trace:{}", other.display());
    let o = glmdiff(
        cache.path(),
        &["run", m.to_str().unwrap(), "--against", &against],
    );
    input_error(&o, &["no hook of the trace", "other.trace.safetensors"]);
    unchanged(&[&reference, &m, &other], &before);
}

/// `--hook`, `--tol` and `--precision` globs that match no hook of the run are errors, in
/// `run`, `compare` and `regress` alike (a `--hook` that matches nothing always was one).
#[test]
fn globs_that_match_nothing_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let t = copy(dir.path(), GLM5_TRACE);
    let ts = t.to_str().unwrap();
    let before = snapshot(&[&m, &t]);
    let run = ["run", ms, "--against", "cpu", "--tokens", "1,2,3"];
    for (flag, value, want) in [
        (
            "--tol",
            "zzz*=0.1",
            "run: --tol glob \"zzz*\" matches none of the hooks compared in this run (layers 0..3)",
        ),
        (
            "--precision",
            "zzz*=bf16",
            "run: --precision glob \"zzz*\" matches none of the hooks compared",
        ),
        (
            "--hook",
            "zzz*",
            "run: --hook \"zzz*\" matches no hook of this run (layers 0..3)",
        ),
    ] {
        let mut args = run.to_vec();
        args.extend([flag, value]);
        input_error(&glmdiff(cache.path(), &args), &[want]);
    }
    // Layer 1 only: the embedding's tolerance matches nothing of it.
    let mut args = run.to_vec();
    args.extend(["--layer", "1", "--tol", "token_embd=0.1"]);
    input_error(
        &glmdiff(cache.path(), &args),
        &["--tol glob \"token_embd\" matches none of the hooks compared in this run (layers 1..2)"],
    );
    // A glob over hooks --hook leaves out.
    let mut args = run.to_vec();
    args.extend(["--hook", "blk.0.*", "--tol", "blk.1.*=0.1"]);
    input_error(&glmdiff(cache.path(), &args), &["--tol glob \"blk.1.*\""]);
    let o = glmdiff(cache.path(), &["compare", ts, ts, "--tol", "zzz*=0.1"]);
    input_error(
        &o,
        &["compare: --tol glob \"zzz*\" matches none of the hooks compared in the reference trace", "glm5-tiny.short.trace.safetensors"],
    );
    let suite = dir.path().join("s.toml");
    std::fs::write(
        &suite,
        format!("[[case]]\nname = \"a\"\nmodel = \"{ms}\"\ntokens = [1, 2]\nagainst = \"cpu\"\n[case.tol]\n\"zzz*\" = 0.1\n"),
    )
    .unwrap();
    let o = glmdiff(cache.path(), &["regress", suite.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--tol glob \"zzz*\" matches none"),
        "{}",
        text(&o)
    );
    // The same flags on hooks that exist are fine.
    let mut args = run.to_vec();
    args.extend(["--tol", "blk.*.moe_*=0.1", "--precision", "logits=bf16"]);
    assert_eq!(glmdiff(cache.path(), &args).status.code(), Some(0));
    unchanged(&[&m, &t], &before);
}

/// `weights-check --tensors 'zzz*'` said OK on 0 tensors; now exit 2 naming the file.
#[test]
fn weights_check_tensors_glob_matching_nothing_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let other = copy(dir.path(), "glm5-tiny/glm5-tiny-f16.gguf");
    let before = snapshot(&[&m, &other]);
    let o = glmdiff(
        cache.path(),
        &[
            "weights-check",
            m.to_str().unwrap(),
            "--gguf",
            other.to_str().unwrap(),
            "--tensors",
            "zzz*",
        ],
    );
    input_error(
        &o,
        &[
            "weights-check: --tensors \"zzz*\" matches no tensor of",
            "glm5-tiny-f32.gguf",
        ],
    );
    unchanged(&[&m, &other], &before);
}

/// `dequant-check` names a tensor the model lacks, and a `--tensors` glob that matches none of
/// its tensors, before it looks for a device (so with or without CUDA).
#[test]
fn dequant_check_refuses_names_and_globs_the_model_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let before = snapshot(&[&m]);
    let ms = m.to_str().unwrap();
    let o = glmdiff(
        cache.path(),
        &[
            "dequant-check",
            ms,
            "token_embd.weight",
            "blk.9.nope.weight",
        ],
    );
    input_error(
        &o,
        &[
            "dequant-check: glm5-tiny-f32.gguf has no tensor blk.9.nope.weight",
            "`glmdiff inspect` lists them",
        ],
    );
    let o = glmdiff(cache.path(), &["dequant-check", ms, "--tensors", "zzz*"]);
    input_error(
        &o,
        &[
            "dequant-check: --tensors \"zzz*\" matches no tensor of",
            "glm5-tiny-f32.gguf",
        ],
    );
    unchanged(&[&m], &before);
}

/// `dequant-check --project` names a model whose size glmdiff does not know, or none: exit 2
/// before the model is read or a device looked for (so with or without CUDA), naming the models
/// it knows.
#[test]
fn dequant_check_refuses_a_project_model_it_does_not_know() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let before = snapshot(&[&m]);
    let ms = m.to_str().unwrap();
    for bad in ["glm6", "GLM5", ""] {
        let o = glmdiff(
            cache.path(),
            &["dequant-check", ms, "--all", "--project", bad],
        );
        input_error(
            &o,
            &[
                &format!("dequant-check: --project {bad:?} is not a model of known size"),
                "known: glm5",
            ],
        );
    }
    // Checked first: a model that is not there is not what the error names.
    let gone = dir.path().join("gone.gguf");
    let o = glmdiff(
        cache.path(),
        &[
            "dequant-check",
            gone.to_str().unwrap(),
            "--all",
            "--project",
            "x",
        ],
    );
    input_error(&o, &["--project \"x\""]);
    // No value at all: clap's error, exit 2.
    let o = glmdiff(cache.path(), &["dequant-check", ms, "--all", "--project"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--project <MODEL>"), "{}", text(&o));
    unchanged(&[&m], &before);
}

/// `--tokens -1` suggested `-- -1`, which fails too; negative ids and ids past the vocabulary
/// now say that token ids are integers in 0..vocab (464 for the fixture).
#[test]
fn token_ids_outside_the_vocabulary_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let out = dir.path().join("t.safetensors");
    let before = snapshot(&[&m]);
    for (cmd, ids, want) in [
        (
            "run",
            "-1",
            "token id -1 is negative: token ids are integers in 0..vocab",
        ),
        (
            "run",
            "1,-2",
            "token id -2 is negative: token ids are integers in 0..vocab",
        ),
        (
            "trace",
            "-1,2",
            "token id -1 is negative: token ids are integers in 0..vocab",
        ),
    ] {
        let mut args = vec![cmd, ms, "--tokens", ids, "--against", "cpu"];
        if cmd == "trace" {
            args.truncate(4);
            args.extend(["--out", out.to_str().unwrap()]);
        }
        let o = glmdiff(cache.path(), &args);
        let err = crate::common::stderr_joined(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        // clap adds a pointer to --help under its one error line.
        let first = err.lines().next().unwrap_or("");
        assert!(
            first.starts_with("error: ") && first.contains(want),
            "{err}"
        );
        assert!(!err.contains("-- -"), "{err}");
    }
    let o = glmdiff(
        cache.path(),
        &["run", ms, "--tokens", "1,464", "--against", "cpu"],
    );
    input_error(
        &o,
        &[
            "token 1 has id 464, outside the vocabulary 0..464",
            "glm5-tiny-f32.gguf",
        ],
    );
    unchanged(&[&m], &before);
    assert!(!out.exists());
}

/// `--inject layer_weights:99` said "layer 100 is not run"; it names layer 99, the layer it
/// would go to and the run's range (the fixture: blocks 0..4, layers 0..3).
#[test]
fn inject_layer_weights_out_of_range_names_the_layers() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let before = snapshot(&[&m]);
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            m.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--against",
            "cpu",
            "--inject",
            "layer_weights:99",
        ],
    );
    let line = input_error(
        &o,
        &[
            "--inject layer_weights:99: reads layer 99's weights into layer 100",
            "has blocks 0..4 and runs layers 0..3",
            "L in 0..2",
        ],
    );
    assert!(!line.contains("layer 100 is not run"), "{line}");
    unchanged(&[&m], &before);
}

/// A reference cache entry of NaNs (the file otherwise intact), or cut short, is detected by
/// its checksum; one of NaNs whose checksum was recomputed to match is detected because a
/// residual stream is finite; each is recomputed with a one-line note on stderr and rewritten; the verdict is the
/// same as with a sound entry, never a NaN difference.
#[test]
fn damaged_reference_cache_is_recomputed_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let args = [
        "run",
        m.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--against",
        "cpu",
        "--layer",
        "2",
    ];
    let o = glmdiff(cache.path(), &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let entries: Vec<PathBuf> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    let sound = std::fs::read(entry).unwrap();
    let o = glmdiff(cache.path(), &args);
    assert!(text(&o).contains("read from the cache"), "{}", text(&o));

    let mut nans = St::read(entry);
    for t in &mut nans.tensors {
        if t.1 == "F32" {
            t.3 = t.3.chunks(4).flat_map(|_| f32::NAN.to_le_bytes()).collect();
        }
    }
    let mut resummed = St {
        meta: nans.meta.clone(),
        tensors: nans.tensors.clone(),
    };
    resummed.meta.insert(
        "cache_checksum".into(),
        json!(format!("{:016x}", cache_checksum(&resummed))),
    );
    for damage in ["nan", "cut", "nan-resummed"] {
        match damage {
            "nan" => nans.write(entry),
            "nan-resummed" => resummed.write(entry),
            _ => std::fs::write(entry, &sound[..sound.len() - 100]).unwrap(),
        }
        let before = snapshot(&[&m]);
        let o = glmdiff(cache.path(), &args);
        assert_eq!(o.status.code(), Some(0), "{damage}: {}", text(&o));
        let err = crate::common::stderr_joined(&o);
        let notes: Vec<&str> = err.lines().filter(|l| l.contains("damaged")).collect();
        assert_eq!(notes.len(), 1, "{damage}: {err}");
        assert!(
            notes[0].starts_with("note: the reference cache ")
                && notes[0].contains(&entry.display().to_string())
                && notes[0].contains("layers 0..2 are recomputed"),
            "{damage}: {err}"
        );
        assert!(!text(&o).contains("NaN"), "{damage}: {}", text(&o));
        // Rewritten: the next run reads it.
        let o = glmdiff(cache.path(), &args);
        assert!(text(&o).contains("read from the cache"), "{}", text(&o));
        unchanged(&[&m], &before);
    }
}

/// The reference cache's checksum of a trace's tensors as documented in `trace::cache`:
/// 64-bit FNV-1a over each tensor in name order: its name, a zero byte, its shape as u64s, `f`
/// or `i` and its little-endian values.
fn cache_checksum(st: &St) -> u64 {
    let mut t: Vec<&Entry> = st.tensors.iter().collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    let mut bytes = Vec::new();
    for (name, dtype, shape, data) in t {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        for d in shape {
            bytes.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        bytes.push(if dtype == "F32" { b'f' } else { b'i' });
        bytes.extend_from_slice(data);
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// An `expect_top5` with another number of rows than the case's tokens is a bad suite (exit 2
/// naming the file, the case and the key) when the suite is read; for a prompt, whose length is
/// known only once it is tokenized, the case is an error, not a FAIL.
#[test]
fn regress_expect_top5_of_the_wrong_length_is_a_bad_suite() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let suite = dir.path().join("s.toml");
    std::fs::write(
        &suite,
        format!("[[case]]\nname = \"a\"\nmodel = \"{ms}\"\ntokens = [1, 2]\nagainst = \"cpu\"\nexpect_top5 = [[1, 2, 3, 4, 5]]\n"),
    )
    .unwrap();
    let before = snapshot(&[&m, &suite]);
    let o = glmdiff(cache.path(), &["regress", suite.to_str().unwrap()]);
    input_error(
        &o,
        &["s.toml: case 1 \"a\": key \"expect_top5\": pins 1 positions, but the case has 2 tokens"],
    );
    unchanged(&[&m, &suite], &before);

    let prompt = dir.path().join("p.toml");
    std::fs::write(
        &prompt,
        format!("[[case]]\nname = \"p\"\nmodel = \"{ms}\"\nprompt = \"the fox and the dog\"\nagainst = \"cpu\"\nexpect_top5 = [[1, 2, 3, 4, 5]]\n"),
    )
    .unwrap();
    let o = glmdiff(cache.path(), &["regress", prompt.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("key \"expect_top5\": pins 1 positions, but the run has 5"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("FAIL"), "{}", text(&o));
}

/// Rewrites the f32 value of metadata key `key` in a GGUF file (value type 6 = FLOAT32).
fn patch_f32(path: &Path, key: &str, value: f32) {
    patch_value(path, key, 6, &value.to_le_bytes());
}

/// Renames tensor `from` to `to` (same length) in a GGUF file's tensor infos.
fn rename_tensor(path: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(path).unwrap();
    let mut pat = (from.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(from.as_bytes());
    let at = b
        .windows(pat.len())
        .position(|w| w == pat)
        .unwrap_or_else(|| panic!("no tensor {from}"));
    b[at + 8..at + 8 + to.len()].copy_from_slice(to.as_bytes());
    std::fs::write(path, b).unwrap();
}

/// A RoPE base of 0, -1 or 1 is refused at load (RoPE's frequencies are base^(-2i/d)), as is a
/// routed scaling factor of 0 or below, naming the key and its value, in `run`, `trace` and
/// `inspect`; the file is left as it was.
#[test]
fn hyperparameters_out_of_their_range_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    for (key, value) in [
        ("glm-dsa.rope.freq_base", 0.0f32),
        ("glm-dsa.rope.freq_base", -1.0),
        ("glm-dsa.rope.freq_base", 1.0),
        ("glm-dsa.expert_weights_scale", 0.0),
        ("glm-dsa.expert_weights_scale", -2.5),
    ] {
        let m = copy(dir.path(), GLM5);
        patch_f32(&m, key, value);
        let before = snapshot(&[&m]);
        let ms = m.to_str().unwrap();
        let want = format!("{key} = {value}");
        refused_by_run_and_trace(
            cache.path(),
            &m,
            &out,
            &[&want, "glm5-tiny-f32.gguf", "must be"],
        );
        let o = glmdiff(cache.path(), &["--wide", "inspect", ms]);
        assert!(
            text(&o).contains("cannot run") && text(&o).contains(&want),
            "{}",
            text(&o)
        );
        unchanged(&[&m], &before);
        assert!(!out.exists());
    }
}

/// A model without a tensor the forward pass reads (a routed experts' down matrix of the last
/// layer, the output norm, an indexer's head weights) is refused at load, naming the tensor,
/// before any layer runs; `inspect` says why it cannot run.
#[test]
fn a_model_without_a_tensor_it_needs_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    for (name, other) in [
        ("blk.2.ffn_down_exps.weight", "xlk.2.ffn_down_exps.weight"),
        ("output_norm.weight", "output_nozm.weight"),
        ("blk.1.indexer.proj.weight", "xlk.1.indexer.proj.weight"),
    ] {
        let m = copy(dir.path(), GLM5);
        rename_tensor(&m, name, other);
        let ms = m.to_str().unwrap();
        let o = glmdiff(
            cache.path(),
            &["run", ms, "--against", "cpu", "--tokens", "1,2,3"],
        );
        input_error(
            &o,
            &[&format!("tensor {name} is missing"), "glm5-tiny-f32.gguf"],
        );
        let o = glmdiff(cache.path(), &["--wide", "inspect", ms]);
        assert!(
            text(&o).contains(&format!("tensor {name} is missing")),
            "{}",
            text(&o)
        );
    }
}

/// A tensor info with an empty name is refused by the reader, with its index and offset.
#[test]
fn an_empty_tensor_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    // The name's length field of the first tensor info, set to 0, and the name's bytes left
    // as they are: the reader then sees an empty name.
    let name = "token_embd.weight";
    let mut b = std::fs::read(&m).unwrap();
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(name.as_bytes());
    let at = b.windows(pat.len()).position(|w| w == pat).unwrap();
    b[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&m, b).unwrap();
    let o = glmdiff(dir.path(), &["inspect", m.to_str().unwrap()]);
    input_error(
        &o,
        &["the name is empty", "at offset", "glm5-tiny-f32.gguf"],
    );
}

/// Weights that are NaN or Inf make both sides NaN wherever they reach: the reference says the
/// model is broken at the first weight it reads (tensor, row, column), exit 2, in `run`
/// (against the CPU and against a trace) and `trace`, never a difference blamed on the
/// candidate and never a trace of NaN logits.
#[test]
fn non_finite_weights_are_the_models_not_the_candidates() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    for (tensor, value) in [
        ("blk.1.ffn_up_exps.weight", f32::NAN),
        ("blk.0.attn_kv_a_norm.weight", f32::INFINITY),
    ] {
        let m = copy(dir.path(), GLM5);
        fill_f32_weight(&m, tensor, value);
        let ms = m.to_str().unwrap();
        let trace = fixtures("models").join(GLM5_TRACE);
        for args in [
            vec!["run", ms, "--against", "cpu", "--tokens", "1,2,3"],
            vec![
                "run",
                ms,
                "--against",
                &format!("trace:{}", trace.display()),
            ],
            vec![
                "trace",
                ms,
                "--tokens",
                "1,2",
                "--out",
                out.to_str().unwrap(),
            ],
        ] {
            let o = glmdiff(cache.path(), &args);
            input_error(
                &o,
                &[
                    &format!("tensor {tensor}"),
                    "non-finite weights: ",
                    " column 0, ",
                ],
            );
        }
        assert!(!out.exists());
    }
}

/// Sets every value of F32 tensor `tensor` of GGUF `m` to `value`: a norm's one row, or every
/// expert's rows of an experts tensor (the byte ranges the model's own descriptors give).
fn fill_f32_weight(m: &Path, tensor: &str, value: f32) {
    let ranges: Vec<(usize, usize)> = {
        let model = glmdiff::gguf::Model::open(m).unwrap();
        let w = glmdiff::model::Weights::new(&model).unwrap();
        let descs = if tensor.ends_with("norm.weight") {
            vec![w.vector_desc(tensor).unwrap()]
        } else {
            (0..w.hparams().n_expert)
                .map(|e| w.expert_desc(tensor, e).unwrap())
                .collect()
        };
        descs
            .iter()
            .map(|d| {
                let (_, off, len) = d.file_range().unwrap().unwrap();
                (off as usize, len as usize)
            })
            .collect()
    };
    let mut b = std::fs::read(m).unwrap();
    for (off, len) in ranges {
        for x in b[off..off + len].chunks_exact_mut(4) {
            x.copy_from_slice(&value.to_le_bytes());
        }
    }
    std::fs::write(m, b).unwrap();
}

/// `--repro DIR` where DIR holds an earlier case and anything else refuses before the run,
/// naming what it would lose; the directory is left as it was. A case alone is replaced.
#[test]
fn repro_never_deletes_what_is_not_a_case() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let case = dir.path().join("case");
    let gguf = fixtures("models").join(GLM5);
    let args = [
        "run",
        gguf.to_str().unwrap(),
        "--against",
        "cpu",
        "--tokens",
        "1,2,3",
        "--inject",
        "kv_b_concat",
        "--repro",
        case.to_str().unwrap(),
    ];
    assert_eq!(glmdiff(cache.path(), &args).status.code(), Some(1));
    assert!(case.join("case.json").is_file());
    // A case alone is replaced.
    assert_eq!(glmdiff(cache.path(), &args).status.code(), Some(1));
    std::fs::write(case.join("notes.txt"), b"mine").unwrap();
    std::fs::create_dir(case.join("runs")).unwrap();
    let o = glmdiff(cache.path(), &args);
    input_error(
        &o,
        &[
            "--repro",
            "holds a case and 2 other entries",
            "notes.txt",
            "runs",
        ],
    );
    assert_eq!(std::fs::read(case.join("notes.txt")).unwrap(), b"mine");
    assert!(case.join("runs").is_dir());
}

/// A `--tol` of 1e308 is echoed as 1e308, not 309 digits.
#[test]
fn a_huge_tolerance_is_written_short() {
    let cache = tempfile::tempdir().unwrap();
    let gguf = fixtures("models").join(GLM5);
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            "cpu",
            "--tokens",
            "1,2,3",
            "--tol",
            "*=1e308",
        ],
    );
    let t = text(&o);
    assert!(t.contains("*=1e308"), "{t}");
    assert!(!t.contains("0000000000"), "{t}");
}

/// A FIFO given as a model or a trace is refused at once (its open would wait for a writer
/// forever), naming it.
#[test]
fn a_fifo_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no mkfifo on this machine");
        return;
    }
    let f = fifo.to_str().unwrap().to_string();
    let gguf = fixtures("models").join(GLM5);
    for args in [
        vec!["inspect".to_string(), f.clone()],
        vec![
            "run".into(),
            gguf.to_str().unwrap().into(),
            "--against".into(),
            format!("trace:{f}"),
        ],
        vec!["compare".into(), f.clone(), f.clone()],
    ] {
        let mut child = std::process::Command::new(crate::common::glmdiff_bin())
            .args(&args)
            .env("GLMDIFF_CACHE_DIR", dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(20) {
                child.kill().unwrap();
                panic!("{args:?}: still waiting on the FIFO after 20 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let o = child.wait_with_output().unwrap();
        input_error(&o, &["model.gguf", "not a regular file"]);
    }
}

/// `general.architecture` stored as a number is named as such, not called missing.
#[test]
fn an_architecture_of_another_type_is_named() {
    use crate::common::gguf_bytes::{Gguf, Val};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("arch.gguf");
    let g = Gguf::default().kv("general.architecture", Val::U32(7));
    std::fs::write(&p, g.bytes()).unwrap();
    let o = glmdiff(
        dir.path(),
        &[
            "run",
            p.to_str().unwrap(),
            "--against",
            "cpu",
            "--tokens",
            "1",
        ],
    );
    input_error(
        &o,
        &[
            "general.architecture is a u32 (7), not a string",
            "arch.gguf",
        ],
    );
}

/// `expect_divergence` naming a hook no run of the case produces (a layer the model lacks, a
/// point that does not exist, a layer outside the case's `layer`) is a bad suite, exit 2 before
/// any case runs, never a FAIL.
#[test]
fn regress_expect_divergence_at_no_hook_is_a_bad_suite() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    for (hook, extra) in [
        ("blk.99.nothing", ""),
        ("blk.1.nothing", ""),
        ("blk.9.attn_heads", ""),
        ("blk.2.attn_heads", "layer = 1\n"),
    ] {
        let suite = dir.path().join("s.toml");
        std::fs::write(
            &suite,
            format!("[[case]]\nname = \"a\"\nmodel = \"{ms}\"\ntokens = [1, 2]\nagainst = \"cpu\"\n{extra}expect_divergence = \"{hook}\"\n"),
        )
        .unwrap();
        let o = glmdiff(cache.path(), &["regress", suite.to_str().unwrap()]);
        input_error(
            &o,
            &[&format!(
                "s.toml: case \"a\": expect_divergence = \"{hook}\" names no hook"
            )],
        );
        assert!(!text(&o).contains("FAIL"), "{}", text(&o));
    }
}

/// `regress --junit FILE` writes JUnit XML: one testcase per case, a failure with the failed
/// checks for a failed case, none for a passed one; the counts in the suite's attributes.
#[test]
fn regress_writes_junit_xml() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    let ms = m.to_str().unwrap();
    let suite = dir.path().join("s.toml");
    std::fs::write(
        &suite,
        format!(
            "[[case]]\nname = \"clean <ok>\"\nmodel = \"{ms}\"\ntokens = [1, 2]\nagainst = \"cpu\"\n\n\
             [[case]]\nname = \"expects a bug\"\nmodel = \"{ms}\"\ntokens = [1, 2]\nagainst = \"cpu\"\nexpect_divergence = \"blk.1.attn_heads\"\n"
        ),
    )
    .unwrap();
    let xml = dir.path().join("r.xml");
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            suite.to_str().unwrap(),
            "--junit",
            xml.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let x = std::fs::read_to_string(&xml).unwrap();
    assert!(x.starts_with("<?xml version=\"1.0\""), "{x}");
    assert!(x.contains("tests=\"2\" failures=\"1\" errors=\"0\""), "{x}");
    assert_eq!(x.matches("<testcase ").count(), 2, "{x}");
    assert!(x.contains("name=\"clean &lt;ok&gt;\""), "{x}");
    assert_eq!(x.matches("<failure ").count(), 1, "{x}");
    assert!(x.contains("name=\"expects a bug\""), "{x}");
    assert!(x.trim_end().ends_with("</testsuites>"), "{x}");
    // The output is refused where it is an input.
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            suite.to_str().unwrap(),
            "--junit",
            suite.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// `inspect --tensors` and a `compare --map` file that match nothing are errors naming the
/// glob or map, never an empty listing or a map silently ignored.
#[test]
fn inspect_tensors_and_compare_map_that_match_nothing_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures("models").join(GLM5);
    let o = glmdiff(
        dir.path(),
        &["inspect", gguf.to_str().unwrap(), "--tensors", "nothing*"],
    );
    input_error(
        &o,
        &["--tensors \"nothing*\" matches none of the 94 tensors"],
    );
    let map = dir.path().join("map.json");
    std::fs::write(&map, r#"{"layers.0.q_a": "blk.0.q_a"}"#).unwrap();
    let t = fixtures("models").join(GLM5_TRACE);
    let t = t.to_str().unwrap();
    let o = glmdiff(
        dir.path(),
        &["compare", t, t, "--map", map.to_str().unwrap()],
    );
    input_error(
        &o,
        &[
            "--map",
            "map.json: none of its 1 names is a hook of the candidate",
        ],
    );
}

/// `compare --model` with a model of other dimensions than the traces' (glm5-tiny-q, hidden
/// 256 and 2 layers, for glm5-tiny's traces) is refused, naming the model, the trace and the
/// hook that disagrees, where it used to judge the traces by the wrong model (exit 1).
#[test]
fn compare_with_another_models_dimensions_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = fixtures("models").join("glm5-tiny/glm5-tiny.long.trace.safetensors");
    let t = t.to_str().unwrap();
    let other = fixtures("models").join(GLM5_Q);
    let o = glmdiff(
        dir.path(),
        &["compare", t, t, "--model", other.to_str().unwrap()],
    );
    input_error(
        &o,
        &[
            "compare: --model",
            "glm5-tiny-q-mixed.gguf",
            "glm5-tiny.long.trace.safetensors",
            "of another model",
        ],
    );
    let own = fixtures("models").join(GLM5);
    let o = glmdiff(
        dir.path(),
        &["compare", t, t, "--model", own.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

/// A trace whose selection holds an id the model does not have (expert 999 of 8; a DSA key
/// after its own token) is refused before the run, naming the trace, the hook, the row and
/// the value, in `run --against trace:` and `compare --model`.
#[test]
fn selection_ids_out_of_range_name_the_trace_and_hook() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = fixtures("models").join(GLM5);
    let ms = m.to_str().unwrap();
    let good = fixtures("models").join(GLM5_TRACE);
    for (hook, value, row, want) in [
        (
            "blk.1.moe_topk_ids",
            999i64,
            0usize,
            "holds id 999, outside 0..8",
        ),
        (
            "blk.0.indexer_topk",
            4,
            1,
            "holds id 4, outside -1 (padding) or 0..=1",
        ),
    ] {
        let mut st = St::read(&good);
        let e = st.tensor(hook);
        let width = *e.2.last().unwrap();
        let at = row * width;
        match e.1.as_str() {
            "I64" => e.3[at * 8..at * 8 + 8].copy_from_slice(&value.to_le_bytes()),
            "I32" => e.3[at * 4..at * 4 + 4].copy_from_slice(&(value as i32).to_le_bytes()),
            other => panic!("{hook} is {other}"),
        }
        let t = dir.path().join("bad.safetensors");
        st.write(&t);
        let ts = t.to_str().unwrap();
        let parts = [
            "bad.safetensors",
            &format!("hook {hook}: row {row} (token {row})") as &str,
            want,
        ];
        let o = glmdiff(
            cache.path(),
            &["run", ms, "--against", &format!("trace:{ts}")],
        );
        input_error(&o, &parts);
        let g = good.to_str().unwrap();
        let o = glmdiff(cache.path(), &["compare", g, ts, "--model", ms]);
        input_error(&o, &parts);
    }
}

/// `bench dequant --elements` past its stated limit (2^34) is refused with the limit, not an
/// abort on a failed allocation (2^40 used to end in SIGABRT, exit 134).
#[test]
fn bench_dequant_elements_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let o = glmdiff(
        dir.path(),
        &["bench", "dequant", "--elements", "1099511627776"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("too large"), "{}", text(&o));
    assert!(text(&o).contains("2^34"), "{}", text(&o));
}

/// `run MODEL --against trace:` of `dir/t1.safetensors` with its metadata edited by `edit`
/// (written to `dir/edited.safetensors`).
fn run_edited(dir: &Path, model: &str, edit: &dyn Fn(&mut Map<String, Value>)) -> Output {
    let mut t = St::read(&dir.join("t1.safetensors"));
    edit(&mut t.meta);
    let edited = dir.join("edited.safetensors");
    t.write(&edited);
    let m = dir.join(model);
    glmdiff(
        dir,
        &[
            "run",
            m.to_str().unwrap(),
            "--against",
            &format!("trace:{}", edited.display()),
        ],
    )
}

/// A trace says which model file it was made from by content (`model_digest`, written by
/// `glmdiff trace`): a trace of a synth model with seed 1 run or compared with the seed-2 model
/// of the same dimensions is refused naming both files and the first tensor that differs (it
/// used to give "first divergence: token_embd"); a renamed copy of the right model passes
/// without a note; a trace without a digest naming another file gets a note; a malformed
/// digest, or one listing a tensor the model lacks, is an error.
#[test]
fn traces_of_another_model_file_are_refused_by_their_digest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    for seed in ["1", "2"] {
        let o = glmdiff(
            d,
            &[
                "synth",
                "--arch",
                "glm-dsa",
                "--dims",
                "tiny",
                "--types",
                "q8_0",
                "--seed",
                seed,
                "--out",
                &p(&format!("s{seed}.gguf")),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    }
    let o = glmdiff(
        d,
        &[
            "trace",
            &p("s1.gguf"),
            "--tokens",
            "1,2,3",
            "--out",
            &p("t1.safetensors"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let st = St::read(&d.join("t1.safetensors"));
    let digest: Value = serde_json::from_str(st.meta["model_digest"].as_str().unwrap()).unwrap();
    assert_eq!(digest["algorithm"], "sha256");
    assert_eq!(digest["prefix_bytes"], 1 << 20);
    let listed = digest["tensors"].as_object().unwrap();
    for n in [
        "token_embd.weight",
        "output_norm.weight",
        "blk.0.attn_norm.weight",
    ] {
        assert!(listed.contains_key(n), "{n} not listed: {listed:?}");
    }
    // The first MoE block's tensors too (glm5-tiny: layer 0 dense, 1 and 2 MoE).
    assert!(
        listed.contains_key("blk.1.ffn_gate_inp.weight"),
        "{listed:?}"
    );
    assert!(
        !listed.keys().any(|k| k.starts_with("blk.2.")),
        "{listed:?}"
    );
    let trace = format!("trace:{}", p("t1.safetensors"));

    let o = glmdiff(d, &["run", &p("s2.gguf"), "--against", &trace]);
    let n = listed.len();
    let err = input_error(
        &o,
        &[
            "t1.safetensors: made from another model file than",
            "s2.gguf (the trace names s1.gguf): its model_digest of blk.0.",
            "of its",
            "tensors differ",
            "Run it with the model it was made from",
        ],
    );
    assert!(
        err.contains(&format!(" of its {n} tensors differ")),
        "{err}"
    );
    let o = glmdiff(
        d,
        &[
            "compare",
            &p("t1.safetensors"),
            &p("t1.safetensors"),
            "--model",
            &p("s2.gguf"),
        ],
    );
    input_error(
        &o,
        &["compare: --model", "made from another model file than"],
    );

    // The right model under another name: no note, exit 0.
    std::fs::copy(d.join("s1.gguf"), d.join("renamed.gguf")).unwrap();
    let o = glmdiff(d, &["run", &p("renamed.gguf"), "--against", &trace]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("names model"), "{}", text(&o));

    // Without a digest, a trace naming another file gets a note and runs.
    let o = run_edited(d, "renamed.gguf", &|m| {
        m.remove("model_digest");
    });
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        crate::common::joined(&text(&o)).contains(
            "names model s1.gguf (metadata model), not renamed.gguf; it carries no model_digest"
        ),
        "{}",
        text(&o)
    );

    // Malformed, and a tensor the model lacks.
    for (value, parts) in [
        (
            "{\"algorithm\": \"md5\"}".to_string(),
            vec!["metadata model_digest is malformed: algorithm is \"md5\""],
        ),
        (
            json!({"algorithm": "sha256", "prefix_bytes": 1048576,
                   "tensors": {"blk.9.nothing.weight": "ab".repeat(32)}})
            .to_string(),
            vec![
                "s1.gguf has no tensor blk.9.nothing.weight",
                "1 of its 1 tensors differ",
            ],
        ),
    ] {
        let o = run_edited(d, "s1.gguf", &|m| {
            m.insert("model_digest".into(), Value::String(value.clone()));
        });
        input_error(&o, &parts);
    }
}

/// glmdiff's `model_digest` of every fixture GGUF is the one the `glmdiff_hooks` package
/// computes with gguf-py and hashlib (`fixtures/digests/digests.json`, made by
/// `reference/fixtures/model_digests.py`): the same tensors listed, the same SHA-256 of each.
#[test]
fn model_digests_match_gguf_py_and_hashlib() {
    let want: Value =
        serde_json::from_slice(&std::fs::read(fixtures("digests/digests.json")).unwrap()).unwrap();
    let models = want["models"].as_object().unwrap();
    assert!(models.len() >= 10, "{}", models.len());
    for (rel, digest) in models {
        let model = glmdiff::gguf::Model::open(&fixtures("models").join(rel)).unwrap();
        let got: Value =
            serde_json::from_str(&glmdiff::trace::digest::model_digest(&model).unwrap()).unwrap();
        assert_eq!(&got, digest, "{rel}");
    }
}

/// A model whose weights are finite but overflow f32 (an `output_norm` weight of 3e38: the
/// normalized values times it pass f32's largest) is the model's problem: `run` says the
/// reference holds non-finite values at `result_norm` and cannot judge there, `trace` writes
/// no trace; exit 2, never a verdict on the candidate.
#[test]
fn a_reference_that_overflows_is_an_error_not_a_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let m = copy(dir.path(), GLM5);
    fill_f32_weight(&m, "output_norm.weight", 3e38);
    let ms = m.to_str().unwrap();
    let out = dir.path().join("t.safetensors");
    let o = glmdiff(
        cache.path(),
        &["run", ms, "--against", "cpu", "--tokens", "1,2,3"],
    );
    input_error(
        &o,
        &[
            "hook result_norm (",
            "the reference holds ",
            "non-finite value",
            "so it cannot judge the candidate there",
        ],
    );
    let o = glmdiff(
        cache.path(),
        &[
            "trace",
            ms,
            "--tokens",
            "1,2",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    input_error(
        &o,
        &[
            "trace: hook result_norm: the forward pass computes",
            "no trace is written",
        ],
    );
    assert!(!out.exists());
}
