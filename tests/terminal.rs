//! Output fits the terminal: every command's default output, with stdout piped and
//! `COLUMNS=100`, has no line over 100 characters; `--wide` prints the full tables; the
//! message of a machine without CUDA is two short lines, the same for every GPU command; no
//! progress bar reaches a stderr that is not a terminal, plain progress lines do (and
//! `GLMDIFF_PROGRESS=off` stops them); the progress of a run counts the output layer as its own
//! step.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::{fixtures, glmdiff_bin};

/// Runs glmdiff with stdout and stderr piped, `COLUMNS` set to `columns` (unset with `None`)
/// and its reference cache in `cache`.
fn piped(cache: &Path, columns: Option<&str>, args: &[&str]) -> Output {
    let mut c = std::process::Command::new(glmdiff_bin());
    c.args(args).env("GLMDIFF_CACHE_DIR", cache);
    match columns {
        Some(v) => c.env("COLUMNS", v),
        None => c.env_remove("COLUMNS"),
    };
    c.output().expect("run glmdiff")
}

/// Runs glmdiff with stdout and stderr piped, `COLUMNS=100`, its cache in `cache` and
/// `GLMDIFF_PROGRESS` set to `progress`.
fn piped_progress(cache: &Path, progress: &str, args: &[&str]) -> Output {
    let mut c = std::process::Command::new(glmdiff_bin());
    c.args(args)
        .env("GLMDIFF_CACHE_DIR", cache)
        .env("COLUMNS", "100")
        .env("GLMDIFF_PROGRESS", progress);
    c.output().expect("run glmdiff")
}

/// The lines of `text` longer than `width` characters (not bytes).
fn too_long(text: &str, width: usize) -> Vec<String> {
    text.lines()
        .filter(|l| l.chars().count() > width)
        .map(str::to_string)
        .collect()
}

/// Asserts that stdout and stderr of `o` fit `width` and that it exited with one of `codes`.
fn assert_fits(what: &str, o: &Output, width: usize, codes: &[i32]) {
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    let code = o.status.code().unwrap_or(-1);
    assert!(codes.contains(&code), "{what}: exit {code}\n{out}\n{err}");
    assert!(
        !out.trim().is_empty() || what.starts_with("dequant"),
        "{what}: no output"
    );
    for (stream, text) in [("stdout", &out), ("stderr", &err)] {
        let long = too_long(text, width);
        assert!(
            long.is_empty(),
            "{what}: {stream} lines over {width} characters:\n{}\n--- whole {stream}:\n{text}",
            long.join("\n")
        );
    }
}

/// A copy of fixture files in `dir` (short paths, as a user's would be), returning the copies.
fn copy(dir: &Path, files: &[&str]) -> Vec<PathBuf> {
    files
        .iter()
        .map(|f| {
            let src = fixtures(f);
            let dst = dir.join(src.file_name().unwrap());
            std::fs::copy(&src, &dst).unwrap();
            dst
        })
        .collect()
}

/// Whether the CUDA libraries and a device are present (then GPU commands do not fail).
fn has_cuda() -> bool {
    #[cfg(feature = "cuda")]
    {
        glmdiff::gpu::DeviceInfo::list().is_ok_and(|d| !d.is_empty())
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[test]
fn every_command_fits_100_columns_when_piped() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let d = dir.path();
    let [q, f16, short, long, bf16_trace] = &copy(
        d,
        &[
            "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "models/glm5-tiny/glm5-tiny-f16.gguf",
            "models/glm5-tiny/glm5-tiny.short.trace.safetensors",
            "models/glm5-tiny/glm5-tiny.long.trace.safetensors",
            "engines/glm5-tiny/glm5-tiny.short.cuda-bf16.trace.safetensors",
        ],
    )[..] else {
        unreachable!()
    };
    let dsv3 = fixtures("models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (q, f16, short, long, bf16_trace) = (s(q), s(f16), s(short), s(long), s(bf16_trace));
    let case = s(&d.join("case"));
    let jsonl = s(&d.join("r.jsonl"));
    let suite = s(&fixtures("regress/suite.toml"));
    let wcheck = |p: &str| s(&fixtures(&format!("wcheck/{p}")));
    let out = |n: &str| s(&d.join(n));
    // (what, arguments, exit codes)
    let runs: Vec<(&str, Vec<String>, &[i32])> = vec![
        ("inspect", vec!["inspect".into(), q.clone()], &[0]),
        ("inspect dsv3", vec!["inspect".into(), s(&dsv3)], &[0]),
        (
            "dequant",
            vec![
                "dequant".into(),
                q.clone(),
                "blk.0.attn_q_a.weight".into(),
                "--out".into(),
                out("x.npy"),
            ],
            &[0],
        ),
        (
            "trace",
            vec![
                "trace".into(),
                q.clone(),
                "--prompt".into(),
                "hello world".into(),
                "--out".into(),
                out("t.safetensors"),
            ],
            &[0],
        ),
        (
            "run --explain --repro",
            vec![
                "run".into(),
                q.clone(),
                "--against".into(),
                "cpu".into(),
                "--inject".into(),
                "kv_b_concat".into(),
                "--prompt".into(),
                "hello world".into(),
                "--explain".into(),
                "--repro".into(),
                case.clone(),
            ],
            &[1],
        ),
        (
            "run --layer --all-steps",
            vec![
                "run".into(),
                q.clone(),
                "--against".into(),
                "cpu".into(),
                "--layer".into(),
                "1".into(),
                "--inject".into(),
                "expert_swap:0,1".into(),
                "--tokens".into(),
                "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20".into(),
                "--all-steps".into(),
            ],
            &[1],
        ),
        (
            "run against the trace beside the model",
            vec!["run".into(), f16.clone()],
            &[0],
        ),
        (
            "compare",
            vec!["compare".into(), short.clone(), bf16_trace.clone()],
            &[0],
        ),
        (
            "compare long",
            vec!["compare".into(), long.clone(), long.clone()],
            &[0],
        ),
        ("step", vec!["step".into(), case.clone()], &[1]),
        (
            "step --explain",
            vec!["step".into(), case.clone(), "--explain".into()],
            &[1],
        ),
        (
            "regress",
            vec![
                "regress".into(),
                suite.clone(),
                "--jsonl".into(),
                jsonl.clone(),
            ],
            &[0],
        ),
        (
            "regress --baseline",
            vec![
                "regress".into(),
                suite.clone(),
                "--baseline".into(),
                jsonl.clone(),
            ],
            &[0],
        ),
        (
            "weights-check",
            vec![
                "weights-check".into(),
                wcheck("glm5-tiny-q-bf16.gguf"),
                "--hf".into(),
                wcheck("glm5-tiny-q-bf16-hf"),
            ],
            &[0],
        ),
        (
            "weights-check of a broken file",
            vec![
                "weights-check".into(),
                wcheck("broken/glm5-tiny-q-bf16.kv_b_concat.gguf"),
                "--hf".into(),
                wcheck("glm5-tiny-q-bf16-hf"),
            ],
            &[1],
        ),
        (
            "synth",
            vec![
                "synth".into(),
                "--arch".into(),
                "glm-dsa".into(),
                "--out".into(),
                out("s.gguf"),
            ],
            &[0],
        ),
        (
            "bench dequant",
            vec![
                "bench".into(),
                "dequant".into(),
                "--types".into(),
                "q4_0,q4_k".into(),
            ],
            &[0],
        ),
        (
            "bench layer",
            vec![
                "bench".into(),
                "layer".into(),
                "--model".into(),
                q.clone(),
                "--tokens".into(),
                "1".into(),
            ],
            &[0],
        ),
    ];
    for (what, args, codes) in &runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = piped(&cache, Some("100"), &args);
        assert_fits(what, &o, 100, codes);
    }
    // Without a terminal COLUMNS cannot ask for more than 100; it can ask for less.
    let run = [
        "run",
        &q,
        "--against",
        "cpu",
        "--inject",
        "kv_b_concat",
        "--tokens",
        "1,2,3",
    ];
    assert_fits("COLUMNS=300", &piped(&cache, Some("300"), &run), 100, &[1]);
    assert_fits("no COLUMNS", &piped(&cache, None, &run), 100, &[1]);
    let o = piped(&cache, Some("72"), &run);
    assert_fits("COLUMNS=72", &o, 72, &[1]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("left out to fit 72 characters"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn wide_prints_every_column_on_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let q = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let args = |wide: bool| {
        let mut a = vec![
            "run",
            q.to_str().unwrap(),
            "--against",
            "cpu",
            "--inject",
            "kv_b_concat",
            "--tokens",
            "1,2,3,4",
        ];
        if wide {
            a.insert(0, "--wide");
        }
        a
    };
    let header =
        "| hook | shape | max |diff| @ | NMSE | cosine | replay | chained | own chain | floor | verdict |";
    let squeeze = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    let o = piped(dir.path(), Some("100"), &args(true));
    assert_eq!(o.status.code(), Some(1));
    let wide = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(wide.lines().any(|l| squeeze(l) == header), "{wide}");
    assert!(!too_long(&wide, 100).is_empty(), "{wide}");
    assert!(!wide.contains("left out"), "{wide}");
    // Rows are whole lines: the failing hook with its shape and its verdict on one line.
    assert!(
        wide.lines().any(|l| l.contains("| blk.0.attn_heads ")
            && l.contains("[4, 256]")
            && l.contains("r FAIL, c FAIL")),
        "{wide}"
    );
    // The re-run command is one line.
    assert!(
        wide.lines()
            .any(|l| l.starts_with("re-run that layer: glmdiff run ")
                && l.ends_with("--inject kv_b_concat")),
        "{wide}"
    );
    // The flag goes anywhere on the line, and it is the same table.
    let mut after = args(false);
    after.push("--wide");
    let o = piped(dir.path(), Some("100"), &after);
    // (Up to the verdict: the timings after it change between runs.)
    let upto = |t: &str| t.split("DIFFERS").next().unwrap_or_default().to_string();
    assert_eq!(upto(&String::from_utf8_lossy(&o.stdout)), upto(&wide));
    // Without it, the narrow table leaves columns out and says which.
    let o = piped(dir.path(), Some("100"), &args(false));
    let narrow = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!narrow.lines().any(|l| squeeze(l) == header), "{narrow}");
    assert!(narrow.contains("--wide shows them"), "{narrow}");
}

#[test]
fn gpu_commands_fit_100_columns_or_say_in_two_short_lines_what_is_missing() {
    // Where CUDA is here (the GPU machine) the message cannot be shown: the same commands are
    // then checked to run and to fit 100 columns, so the test asserts on every machine and
    // never passes without checking something.
    let dir = tempfile::tempdir().unwrap();
    let q = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let q = q.to_str().unwrap();
    if has_cuda() {
        for args in [
            vec!["dequant-check", q, "--all"],
            vec!["run", q, "--against", "cuda", "--tokens", "1,2,3"],
            vec![
                "run",
                q,
                "--against",
                "cuda",
                "--dtype",
                "bf16",
                "--layer",
                "1",
                "--all-steps",
                "--tokens",
                "1,2,3",
            ],
        ] {
            let o = piped(dir.path(), Some("100"), &args);
            assert_fits(&args.join(" "), &o, 100, &[0]);
        }
        return;
    }
    #[cfg(feature = "cuda")]
    if glmdiff::gpu::probe_libraries().is_ok() {
        // The libraries are here but no device: one message that says so.
        let o = piped(dir.path(), Some("100"), &["dequant-check", q]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(err.contains("device"), "{err}");
        assert_fits("dequant-check without a device", &o, 100, &[2]);
        return;
    }
    let mut messages = Vec::new();
    for args in [
        vec!["dequant-check", q, "--all"],
        vec!["run", q, "--against", "cuda", "--tokens", "1,2"],
        vec![
            "run",
            q,
            "--against",
            "cuda:1",
            "--layer",
            "1",
            "--tokens",
            "1,2",
        ],
        vec!["bench", "dequant", "--device", "0"],
    ] {
        let o = piped(dir.path(), Some("100"), &args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 2, "{args:?}: {err}");
        assert!(
            lines.iter().all(|l| l.chars().count() < 100),
            "{args:?}: {err}"
        );
        assert!(lines[0].starts_with("error: cuda: no CUDA: "), "{err}");
        assert!(lines[0].contains("not found"), "{err}");
        assert!(lines[1].starts_with("  tried "), "{err}");
        // Each library name tried appears once.
        for lib in ["libcuda", "libnvrtc"] {
            assert!(err.matches(lib).count() <= 2, "{err}");
        }
        messages.push(err);
    }
    assert!(messages.windows(2).all(|w| w[0] == w[1]), "{messages:#?}");
}

#[test]
fn no_progress_bar_reaches_a_stderr_that_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let q = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let q = q.to_str().unwrap();
    let t = fixtures("models/glm5-tiny/glm5-tiny.long.trace.safetensors");
    let t = t.to_str().unwrap();
    let out = |n: &str| d.join(n).to_str().unwrap().to_string();
    let (trace, synth, case) = (out("t.safetensors"), out("s.gguf"), out("case"));
    let wc = fixtures("wcheck/glm5-tiny-q-bf16.gguf");
    let hf = fixtures("wcheck/glm5-tiny-q-bf16-hf");
    for args in [
        vec!["trace", q, "--tokens", "1,2,3", "--out", &trace],
        vec![
            "run",
            q,
            "--against",
            "cpu",
            "--layer",
            "1",
            "--tokens",
            "1,2,3",
        ],
        vec![
            "run",
            q,
            "--against",
            "cpu",
            "--inject",
            "kv_b_concat",
            "--tokens",
            "1,2,3",
            "--explain",
            "--repro",
            &case,
        ],
        vec!["step", &case, "--explain"],
        vec!["compare", t, t],
        vec!["synth", "--arch", "deepseek2", "--out", &synth],
        vec!["bench", "dequant", "--types", "q8_0"],
        vec![
            "weights-check",
            wc.to_str().unwrap(),
            "--hf",
            hf.to_str().unwrap(),
        ],
    ] {
        let o = piped(d, Some("100"), &args);
        assert!(o.status.code().is_some_and(|c| c < 2), "{args:?}: {:?}", o);
        let err = String::from_utf8_lossy(&o.stderr);
        for piece in ['\r', '\u{1b}'] {
            assert!(!err.contains(piece), "{args:?}: {err:?}");
        }
        // Plain progress lines (a slow machine may reach their first) are not bars.
        let bars: String = err
            .lines()
            .filter(|l| !l.starts_with("progress: "))
            .collect();
        for piece in ["=>", "[=", "] 0/", "hypotheses,", "output layer and logits"] {
            assert!(!bars.contains(piece), "{args:?}: {err}");
        }
    }
}

/// A [`Progress`](glmdiff::util::progress::Progress) that writes down what it is told.
#[derive(Default)]
struct Recorder {
    events: RefCell<Vec<String>>,
}

impl glmdiff::util::progress::Progress for Recorder {
    fn start(&self, what: &str, total: u64) {
        self.events
            .borrow_mut()
            .push(format!("start {what} {total}"));
    }
    fn phase(&self, what: &str) {
        self.events.borrow_mut().push(format!("phase {what}"));
    }
    fn inc(&self, n: u64) {
        self.events.borrow_mut().push(format!("inc {n}"));
    }
    fn finish(&self) {
        self.events.borrow_mut().push("finish".into());
    }
}

impl Recorder {
    fn events(&self) -> Vec<String> {
        self.events.borrow().clone()
    }
}

#[test]
fn the_output_layer_is_its_own_progress_step() {
    use glmdiff::driver::{run_from, Plan};
    use glmdiff::engine::cpu::CpuEngine;
    use glmdiff::gguf::Model;
    use glmdiff::model::Weights;
    use glmdiff::trace::{HookFilter, TraceSink};

    let model = Model::open(&fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf")).unwrap();
    let weights = Weights::new(&model).unwrap();
    let engine = CpuEngine::new(&weights);
    // Every layer and the logits: two layers, then the output layer as a third step.
    let mut sink = TraceSink::new(HookFilter::default());
    let plan = Plan::for_sink(&weights, &sink).unwrap();
    let rec = Recorder::default();
    run_from(&engine, &weights, &[1, 2, 3], &plan, &[], &mut sink, &rec).unwrap();
    assert_eq!(
        rec.events(),
        [
            "start layers 3",
            "inc 1",
            "inc 1",
            "phase output layer and logits",
            "inc 1",
            "finish"
        ]
    );
    // Layers only: no output step.
    let mut sink = TraceSink::new(HookFilter {
        layers: Some(0..1),
        globs: vec![],
    });
    let plan = Plan::for_sink(&weights, &sink).unwrap();
    let rec = Recorder::default();
    run_from(&engine, &weights, &[1, 2, 3], &plan, &[], &mut sink, &rec).unwrap();
    assert_eq!(rec.events(), ["start layers 1", "inc 1", "finish"]);
}

#[test]
fn synth_reports_every_byte_it_writes() {
    use glmdiff::synth::{self, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.gguf");
    let opts = SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 3).unwrap();
    let rec = Recorder::default();
    synth::write_with_progress(&opts, &path, &rec).unwrap();
    let ev = rec.events();
    let total: u64 = ev[0].rsplit(' ').next().unwrap().parse().unwrap();
    let done: u64 = ev
        .iter()
        .filter_map(|e| e.strip_prefix("inc "))
        .map(|n| n.parse::<u64>().unwrap())
        .sum();
    assert!(ev[0].starts_with("start synth"), "{ev:?}");
    assert_eq!(done, total);
    assert_eq!(ev.last().map(String::as_str), Some("finish"));
    // The tensor bytes are the file less its header and alignment.
    let file = std::fs::metadata(&path).unwrap().len();
    assert!(total <= file && file - total < 1 << 20, "{total} of {file}");
}

/// Asserts that `o` exited with one of `codes` and that no line of its stderr is over `width`
/// characters; an error stays one message: its first line starts with `error: ` and the lines
/// after it continue it, indented two spaces. Returns stderr.
fn assert_err_fits(what: &str, o: &Output, width: usize, codes: &[i32]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let code = o.status.code().unwrap_or(-1);
    assert!(codes.contains(&code), "{what}: exit {code}\n{err}");
    let long = too_long(&err, width);
    assert!(
        long.is_empty(),
        "{what}: stderr lines over {width} characters:\n{}\n--- whole stderr:\n{err}",
        long.join("\n")
    );
    if code == 2 && !err.contains("\nUsage:") {
        let lines: Vec<&str> = err.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("{what}: no error line:\n{err}"));
        assert!(
            lines[at + 1..].iter().all(|l| l.starts_with("  ")),
            "{what}: the error is not one message:\n{err}"
        );
    }
    err
}

#[test]
fn errors_and_notes_fit_100_columns_when_piped() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cache = d.join("cache");
    let q = copy(d, &["models/glm5-tiny-q/glm5-tiny-q-mixed.gguf"])[0].clone();
    let q = q.to_str().unwrap();
    let suite = fixtures("regress/suite.toml");
    let suite = suite.to_str().unwrap();
    let cuda_suite = fixtures("regress/suite-cuda.toml");
    let cuda_suite = cuda_suite.to_str().unwrap();
    let afile = d.join("afile");
    std::fs::write(&afile, b"not a directory").unwrap();
    let afile = afile.to_str().unwrap();
    let runs: Vec<(&str, Vec<&str>, &[i32])> = vec![
        (
            "regress --case matching nothing",
            vec!["regress", suite, "--case", "zzz*"],
            &[2],
        ),
        (
            "run --inject of an unknown kind",
            vec![
                "run",
                q,
                "--against",
                "cpu",
                "--tokens",
                "1,2",
                "--inject",
                "frob",
            ],
            &[2],
        ),
        (
            "run --hook matching nothing",
            vec![
                "run",
                q,
                "--against",
                "cpu",
                "--tokens",
                "1,2",
                "--hook",
                "nothing.*",
            ],
            &[2],
        ),
        (
            "a flag clap refuses",
            vec!["run", q, "--mode", "frob"],
            &[2],
        ),
        (
            "an unknown flag",
            vec!["run", q, "--frobnicate-everything-now"],
            &[2],
        ),
        (
            "a missing flag",
            vec!["dequant", q, "blk.0.attn_q_a.weight"],
            &[2],
        ),
        // Without CUDA every case errors and the closing error lists them all.
        (
            "regress of the CUDA suite",
            vec!["regress", cuda_suite],
            &[0, 1, 2],
        ),
        (
            "regress with a --cache-dir that is a file",
            vec![
                "regress",
                suite,
                "--case",
                "dsv3-f32-layers",
                "--cache-dir",
                afile,
            ],
            &[0],
        ),
        (
            "run with a --cache-dir that is a file",
            vec![
                "run",
                q,
                "--against",
                "cpu",
                "--tokens",
                "1,2",
                "--layer",
                "1",
                "--cache-dir",
                afile,
            ],
            &[0],
        ),
    ];
    for (what, args, codes) in &runs {
        let err = assert_err_fits(what, &piped(&cache, Some("100"), args), 100, codes);
        // regress says what run says when the cache cannot be written (run in its report).
        if what.starts_with("regress with a --cache-dir") {
            let one = err.replace("\n  ", " ");
            assert!(
                one.contains("note: case dsv3-f32-layers: the reference cache was not written: "),
                "{err}"
            );
        }
    }

    // The note of a damaged cache entry: fill the cache, cut its entry, run again.
    let layer = [
        "run",
        q,
        "--against",
        "cpu",
        "--tokens",
        "1,2",
        "--layer",
        "1",
    ];
    assert_eq!(piped(&cache, Some("100"), &layer).status.code(), Some(0));
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = entries.remove(0);
    let bytes = std::fs::read(&entry).unwrap();
    std::fs::write(&entry, &bytes[..bytes.len() / 2]).unwrap();
    let err = assert_err_fits(
        "a damaged cache",
        &piped(&cache, Some("100"), &layer),
        100,
        &[0],
    );
    assert!(err.contains("is damaged"), "{err}");
    let o = piped(&cache, Some("100"), &layer);
    assert!(
        o.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn help_fits_100_columns_when_piped() {
    let dir = tempfile::tempdir().unwrap();
    let commands: &[&[&str]] = &[
        &[],
        &["inspect"],
        &["dequant"],
        &["trace"],
        &["dequant-check"],
        &["run"],
        &["compare"],
        &["step"],
        &["regress"],
        &["synth"],
        &["weights-check"],
        &["bench"],
        &["bench", "dequant"],
        &["bench", "layer"],
    ];
    for c in commands {
        for flag in ["--help", "-h"] {
            let mut args = c.to_vec();
            args.push(flag);
            let o = piped(dir.path(), Some("100"), &args);
            assert_eq!(o.status.code(), Some(0), "{args:?}");
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("Usage:"), "{args:?}: {out}");
            let long = too_long(&out, 100);
            assert!(
                long.is_empty(),
                "{args:?}: lines over 100:\n{}",
                long.join("\n")
            );
        }
    }
    // --wide keeps every description on one line; COLUMNS narrows it.
    let o = piped(dir.path(), Some("100"), &["run", "--help", "--wide"]);
    assert!(!too_long(&String::from_utf8_lossy(&o.stdout), 100).is_empty());
    let o = piped(dir.path(), Some("72"), &["run", "--help"]);
    assert!(too_long(&String::from_utf8_lossy(&o.stdout), 72).is_empty());
}

/// Without a terminal, a long run says what it does and how far it is on stderr, in plain lines
/// (`GLMDIFF_PROGRESS` seconds apart; first after at most that long), each fitting the width,
/// its report on stdout unchanged; `GLMDIFF_PROGRESS=off` keeps stderr to results and errors.
#[test]
fn a_long_run_shows_plain_progress_lines_without_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let toks: Vec<String> = (0..768).map(|i| ((i * 7) % 440 + 1).to_string()).collect();
    let toks = toks.join(",");
    let args = [
        "run",
        gguf.to_str().unwrap(),
        "--tokens",
        &toks,
        "--against",
        "cpu",
        "--no-cache",
    ];
    let run = |every: &str| piped_progress(dir.path(), every, &args);
    let o = run("0.05");
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].starts_with("glmdiff run: ") && lines[0].contains("(glm-dsa)"),
        "{err}"
    );
    let progress: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("progress: "))
        .collect();
    assert!(
        progress
            .iter()
            .any(|l| l.contains(" layers (") && l.contains("elapsed")),
        "{err}"
    );
    assert!(progress.iter().any(|l| l.contains("done in")), "{err}");
    assert!(too_long(&err, 100).is_empty(), "{err}");
    assert!(!err.contains('\r') && !err.contains('\u{1b}'), "{err:?}");
    let quiet = run("off");
    assert_eq!(quiet.status.code(), Some(0));
    assert!(
        quiet.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&quiet.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&quiet.stdout).lines().count(),
        String::from_utf8_lossy(&o.stdout).lines().count()
    );
}

/// `regress` without a terminal, once past the first line's delay (here none), says each case
/// as it ends.
#[test]
fn regress_says_each_case_without_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let suite = fixtures("regress/suite.toml");
    let o = piped_progress(
        dir.path(),
        "0",
        &["regress", suite.to_str().unwrap(), "--case", "glm5-f32-*"],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("regress ["), "{err}");
    assert!(too_long(&err, 100).is_empty(), "{err}");
}

/// `GLMDIFF_PROGRESS=off`: no progress line on a stderr that is not a terminal.
#[test]
fn progress_lines_stay_off_a_stderr_that_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let q = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let suite = fixtures("regress/suite.toml");
    for (args, piece) in [
        (
            vec!["regress", suite.to_str().unwrap(), "--case", "glm5-f32-*"],
            "regress [",
        ),
        (
            vec![
                "bench",
                "layer",
                "--model",
                q.to_str().unwrap(),
                "--tokens",
                "1",
            ],
            "timed run",
        ),
    ] {
        let o = piped_progress(dir.path(), "off", &args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains(piece), "{args:?}: {err}");
        assert!(err.trim().is_empty(), "{args:?}: {err}");
        assert!(!o.stdout.is_empty(), "{args:?}");
    }
}
