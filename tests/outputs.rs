//! Outputs never overwrite inputs, bad output places fail before any work, `--json -` is
//! stdout, and an interrupted write leaves no temporary file behind. Every test copies the
//! fixture files it needs into its own temporary directory and runs glmdiff there, so the
//! committed fixtures are never at risk, and checks the inputs' bytes are unchanged afterwards.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::common::{fixtures, glmdiff_bin};

const GLM: &str = "models/glm5-tiny/glm5-tiny-f32.gguf";
const GLM_TRACE: &str = "models/glm5-tiny/glm5-tiny.short.trace.safetensors";

/// glmdiff run in `dir` (relative paths are the dir's), with its cache inside it.
fn glmdiff(dir: &Path, args: &[&str]) -> Output {
    Command::new(glmdiff_bin())
        .args(args)
        .current_dir(dir)
        .env("GLMDIFF_CACHE_DIR", dir.join(".cache"))
        .output()
        .expect("run glmdiff")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A digest of a file's bytes.
fn digest(p: &Path) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
    h.finish()
}

/// Copies the fixture `fixtures/<src>` to `dir/<name>`.
fn copy_in(dir: &Path, src: &str, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::copy(fixtures(src), &to).unwrap_or_else(|e| panic!("copy {src}: {e}"));
    to
}

/// Runs `args` in `dir` and checks it is refused before any work: exit 2, one error line that
/// names the output as given and the input, and every file in `keep` unchanged.
fn refused(dir: &Path, args: &[&str], out: &str, input: &str, keep: &[&str]) -> String {
    let before: Vec<u64> = keep.iter().map(|k| digest(&dir.join(k))).collect();
    let t0 = Instant::now();
    let o = glmdiff(dir, args);
    let e = crate::common::joined(&stderr(&o));
    assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
    assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
    assert!(
        e.starts_with("error: output: ") && e.contains("refusing to overwrite an input"),
        "{args:?}: {e}"
    );
    assert!(
        e.contains(&format!(" {out} ")) && e.contains(input),
        "{args:?}: want {out} and {input} named: {e}"
    );
    assert!(o.stdout.is_empty(), "{args:?}: work was done");
    assert!(t0.elapsed() < Duration::from_secs(10), "{args:?}");
    for (k, d) in keep.iter().zip(before) {
        assert_eq!(digest(&dir.join(k)), d, "{args:?}: {k} changed");
    }
    e
}

/// No `.NAME.tmp-PID` file or directory is left in `dir`.
fn no_temporaries(dir: &Path) {
    let left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
}

#[cfg(unix)]
fn symlink(target: &str, link: &Path) {
    std::os::unix::fs::symlink(target, link).unwrap();
}

/// `run`'s `--json` and `--plot` never write over the model, a `trace:` candidate or a trace
/// `--against auto` may pick: by the same path, by `..`, through a symlink, a hard link, or a
/// symlinked directory.
#[cfg(unix)]
#[test]
fn run_refuses_to_write_over_its_model_or_traces() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM, "m.gguf");
    copy_in(dir, GLM_TRACE, "m.trace.safetensors");
    std::fs::create_dir(dir.join("sub")).unwrap();
    symlink("m.gguf", &dir.join("link.json"));
    std::fs::hard_link(dir.join("m.gguf"), dir.join("hard.json")).unwrap();
    symlink(".", &dir.join("same"));
    let keep = ["m.gguf", "m.trace.safetensors"];
    let cpu = ["run", "m.gguf", "--against", "cpu", "--tokens", "1,2"];
    for (flag, out, how) in [
        ("--json", "m.gguf", ""),
        ("--json", "sub/../m.gguf", "(the same file by another path)"),
        ("--json", "link.json", "(the same file through a symlink)"),
        ("--json", "hard.json", "(the same file through a hard link)"),
        ("--json", "same/m.gguf", "(the same file by another path)"),
    ] {
        let mut args = cpu.to_vec();
        args.extend([flag, out]);
        let e = refused(dir, &args, out, "is the input model m.gguf", &keep);
        assert!(e.contains(how), "{e}");
    }
    // The SVG plot over the model: hard link named .svg.
    std::fs::hard_link(dir.join("m.gguf"), dir.join("m.svg")).unwrap();
    let mut args = cpu.to_vec();
    args.extend(["--plot", "m.svg"]);
    refused(dir, &args, "m.svg", "is the input model m.gguf", &keep);
    // A trace candidate.
    let e = refused(
        dir,
        &[
            "run",
            "m.gguf",
            "--against",
            "trace:m.trace.safetensors",
            "--json",
            "m.trace.safetensors",
        ],
        "m.trace.safetensors",
        "is the trace candidate m.trace.safetensors",
        &keep,
    );
    assert!(!e.contains("by another path"), "{e}");
    // --against auto may pick a trace beside the model.
    refused(
        dir,
        &[
            "run",
            "m.gguf",
            "--tokens",
            "1,2",
            "--json",
            "m.trace.safetensors",
        ],
        "m.trace.safetensors",
        "a trace beside the model m.trace.safetensors",
        &keep,
    );
    no_temporaries(dir);
}

/// `compare` refuses to write its JSON over either trace or the `--map` file.
#[test]
fn compare_refuses_to_write_over_its_traces_or_map() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM_TRACE, "a.safetensors");
    copy_in(dir, GLM_TRACE, "b.safetensors");
    std::fs::write(dir.join("map.json"), "{}").unwrap();
    let keep = ["a.safetensors", "b.safetensors", "map.json"];
    let base = [
        "compare",
        "a.safetensors",
        "b.safetensors",
        "--map",
        "map.json",
    ];
    for (out, input) in [
        ("a.safetensors", "is the reference trace a.safetensors"),
        ("b.safetensors", "is the candidate trace b.safetensors"),
        ("map.json", "is the --map file map.json"),
    ] {
        let mut args = base.to_vec();
        args.extend(["--json", out]);
        refused(dir, &args, out, input, &keep);
    }
    // The same run with a free output works and writes it.
    let mut args = base.to_vec();
    args.extend(["--json", "out.json"]);
    let o = glmdiff(dir, &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(dir.join("out.json").is_file());
    no_temporaries(dir);
}

/// `weights-check` refuses its GGUF, every file of the `--hf` checkpoint, and every shard of a
/// `--gguf` split model.
#[test]
fn weights_check_refuses_to_write_over_its_checkpoint_or_models() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, "wcheck/glm5-tiny-q-bf16.gguf", "w.gguf");
    std::fs::create_dir(dir.join("hf")).unwrap();
    let hf_files = [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ];
    for f in hf_files {
        copy_in(
            dir,
            &format!("wcheck/glm5-tiny-q-bf16-hf/{f}"),
            &format!("hf/{f}"),
        );
    }
    for k in 1..=3 {
        let n = format!("all_types-{k:05}-of-00003.gguf");
        copy_in(dir, &format!("quant/split/{n}"), &n);
    }
    let keep = [
        "w.gguf",
        "hf/config.json",
        "hf/model.safetensors.index.json",
        "hf/model-00002-of-00003.safetensors",
        "all_types-00001-of-00003.gguf",
        "all_types-00002-of-00003.gguf",
        "all_types-00003-of-00003.gguf",
    ];
    let hf = ["weights-check", "w.gguf", "--hf", "hf", "--json"];
    for (out, input) in [
        ("hf/config.json", "is the --hf config hf/config.json"),
        (
            "hf/model.safetensors.index.json",
            "is the --hf index hf/model.safetensors.index.json",
        ),
        (
            "hf/model-00002-of-00003.safetensors",
            "is the --hf checkpoint file hf/model-00002-of-00003.safetensors",
        ),
        ("w.gguf", "is the input model w.gguf"),
    ] {
        let mut args = hf.to_vec();
        args.push(out);
        refused(dir, &args, out, input, &keep);
    }
    // Shard 3 of the other model, opened through shard 1.
    refused(
        dir,
        &[
            "weights-check",
            "w.gguf",
            "--gguf",
            "all_types-00001-of-00003.gguf",
            "--json",
            "all_types-00003-of-00003.gguf",
        ],
        "all_types-00003-of-00003.gguf",
        "is the --gguf model all_types-00003-of-00003.gguf",
        &keep,
    );
}

/// `dequant`, `trace` and `dequant-check` refuse any shard of a split model (opened through
/// another shard), through a symlink and a hard link.
#[cfg(unix)]
#[test]
fn dequant_trace_and_dequant_check_refuse_any_shard_of_their_model() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for k in 1..=3 {
        let n = format!("all_types-{k:05}-of-00003.gguf");
        copy_in(dir, &format!("quant/split/{n}"), &n);
    }
    copy_in(dir, GLM, "m.gguf");
    let keep = [
        "all_types-00001-of-00003.gguf",
        "all_types-00002-of-00003.gguf",
        "all_types-00003-of-00003.gguf",
        "m.gguf",
    ];
    symlink("all_types-00003-of-00003.gguf", &dir.join("x.npy"));
    let e = refused(
        dir,
        &[
            "dequant",
            "all_types-00001-of-00003.gguf",
            "t",
            "--out",
            "x.npy",
        ],
        "x.npy",
        "is the input model all_types-00003-of-00003.gguf",
        &keep,
    );
    assert!(e.contains("through a symlink"), "{e}");
    refused(
        dir,
        &[
            "dequant-check",
            "all_types-00002-of-00003.gguf",
            "--all",
            "--json",
            "all_types-00001-of-00003.gguf",
        ],
        "all_types-00001-of-00003.gguf",
        "is the input model all_types-00001-of-00003.gguf",
        &keep,
    );
    std::fs::hard_link(dir.join("m.gguf"), dir.join("t.safetensors")).unwrap();
    let e = refused(
        dir,
        &["trace", "m.gguf", "--tokens", "1", "--out", "t.safetensors"],
        "t.safetensors",
        "is the input model m.gguf",
        &keep,
    );
    assert!(e.contains("through a hard link"), "{e}");
}

/// `run --inject kv_b_concat@1 --repro case` in `dir` (a copy of the GLM-5 fixture as `m.gguf`):
/// a case to write over, or to leave half-written.
fn repro_case(dir: &Path) -> Output {
    glmdiff(
        dir,
        &[
            "run",
            "m.gguf",
            "--against",
            "cpu",
            "--tokens",
            "1,2,3",
            "--inject",
            "kv_b_concat@1",
            "--repro",
            "case",
        ],
    )
}

/// `step` refuses to write over the files of its case; `run --repro DIR` refuses a directory
/// that holds its model, or another of its outputs (the directory is replaced whole).
#[test]
fn step_and_repro_refuse_to_write_over_a_case() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM, "m.gguf");
    let o = repro_case(dir);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    no_temporaries(dir);
    let keep = [
        "case/case.json",
        "case/weights.gguf",
        "case/tensors.safetensors",
        "case/README.md",
    ];
    for f in keep {
        let out = f.to_string();
        refused(
            dir,
            &["step", "case", "--json", &out],
            &out,
            &format!("is the case file case/{}", &f[5..]),
            &keep,
        );
    }
    // The case's weights as the model of a run that would replace the case.
    refused(
        dir,
        &[
            "run",
            "case/weights.gguf",
            "--against",
            "cpu",
            "--tokens",
            "1",
            "--repro",
            "case",
        ],
        "case",
        "would replace the directory holding the input model case/weights.gguf",
        &keep,
    );
    let o = glmdiff(
        dir,
        &[
            "run",
            "m.gguf",
            "--against",
            "cpu",
            "--tokens",
            "1",
            "--repro",
            "case",
            "--json",
            "case/r.json",
        ],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("--json case/r.json is inside --repro case, which is replaced whole"),
        "{e}"
    );
    assert!(!dir.join("case/r.json").exists());
}

/// `regress` refuses its suite, its `--baseline` and the models and traces its cases name.
#[test]
fn regress_refuses_to_write_over_its_suite_baseline_or_case_inputs() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM, "m.gguf");
    copy_in(dir, GLM_TRACE, "t.safetensors");
    std::fs::write(
        dir.join("s.toml"),
        "[[case]]\nname = \"c\"\nmodel = \"m.gguf\"\nagainst = \"cpu\"\ntokens = [1, 2]\n\n\
         [[case]]\nname = \"t\"\nmodel = \"m.gguf\"\nagainst = \"trace:t.safetensors\"\n",
    )
    .unwrap();
    std::fs::write(dir.join("old.jsonl"), "").unwrap();
    let keep = ["s.toml", "old.jsonl", "m.gguf", "t.safetensors"];
    for (out, input) in [
        ("s.toml", "is the suite s.toml"),
        ("old.jsonl", "is the --baseline old.jsonl"),
        ("m.gguf", "is the model of case \"c\""),
        ("t.safetensors", "is the trace candidate"),
    ] {
        refused(
            dir,
            &[
                "regress",
                "s.toml",
                "--baseline",
                "old.jsonl",
                "--jsonl",
                out,
            ],
            out,
            input,
            &keep,
        );
    }
}

/// Two outputs of one command that are one file are refused before any work, even through a
/// symlink.
#[cfg(unix)]
#[test]
fn two_outputs_that_are_one_file_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM_TRACE, "a.safetensors");
    symlink("p.svg", &dir.join("q.svg"));
    for (json, plot) in [("p.svg", "p.svg"), ("p.svg", "q.svg")] {
        let o = glmdiff(
            dir,
            &[
                "compare",
                "a.safetensors",
                "a.safetensors",
                "--json",
                json,
                "--plot",
                plot,
            ],
        );
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(
            e.contains(&format!(
                "output: --json {json} and --plot {plot} are the same file"
            )),
            "{e}"
        );
        assert!(o.stdout.is_empty(), "work was done");
        assert!(!dir.join("p.svg").exists());
    }
}

/// A missing or unwritable output directory, an output that is a directory, and `-` for a
/// file output are errors before any work (the model does not even exist, and a GLM-5-size
/// `synth` would take half a minute), naming the path as given and never a temporary file.
#[test]
fn bad_output_places_fail_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::create_dir(dir.join("adir")).unwrap();
    let unwritable = unwritable_dir(dir);
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            run_args(&["--json", "no/such/dir/r.json"]),
            "--json no/such/dir/r.json: the directory no/such/dir does not exist".into(),
        ),
        (
            run_args(&["--plot", "no/such/p.svg"]),
            "--plot no/such/p.svg: the directory no/such does not exist".into(),
        ),
        (
            run_args(&["--json", "adir"]),
            "--json adir is a directory".into(),
        ),
        (
            run_args(&["--json", &format!("{unwritable}/r.json")]),
            format!("--json {unwritable}/r.json: cannot create a file in {unwritable}"),
        ),
        (
            run_args(&["--repro", "no/such/case"]),
            "--repro no/such/case: the directory no/such does not exist".into(),
        ),
        (
            strings(&[
                "synth",
                "--arch",
                "glm-dsa",
                "--dims",
                "glm5",
                "--out",
                &format!("{unwritable}/m.gguf"),
            ]),
            format!("--out {unwritable}/m.gguf: cannot create a file in {unwritable}"),
        ),
        (
            strings(&[
                "synth",
                "--arch",
                "glm-dsa",
                "--dims",
                "glm5",
                "--out",
                "nodir/m.gguf",
            ]),
            "--out nodir/m.gguf: the directory nodir does not exist".into(),
        ),
        (
            strings(&["synth", "--arch", "glm-dsa", "--dims", "glm5", "--out", "-"]),
            "--out -: only --json and --jsonl write to stdout".into(),
        ),
        (
            strings(&["synth", "--arch", "glm-dsa", "--out", "adir"]),
            "--out adir is a directory".into(),
        ),
    ];
    for (args, want) in cases {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        let o = glmdiff(dir, &a);
        let secs = t0.elapsed().as_secs_f64();
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{a:?}: {e}");
        assert!(e.contains(&format!("error: output: {want}")), "{a:?}: {e}");
        assert!(!e.contains(".tmp-"), "{a:?}: {e}");
        assert!(secs < 5.0, "{a:?}: {secs:.1} s");
    }
    no_temporaries(dir);
    assert_eq!(std::fs::read_dir(dir.join("adir")).unwrap().count(), 0);
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// `run` of a model that does not exist, plus `extra`.
fn run_args(extra: &[&str]) -> Vec<String> {
    let mut a = strings(&["run", "missing.gguf", "--against", "cpu", "--tokens", "1"]);
    a.extend(strings(extra));
    a
}

/// A directory in which no file can be created: `dir/ro` with mode 0555, or, when directory
/// permissions do not stop this user (root), `/proc`.
fn unwritable_dir(dir: &Path) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let ro = dir.join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        if std::fs::write(ro.join("probe"), b"").is_err() {
            return "ro".into();
        }
        std::fs::remove_file(ro.join("probe")).unwrap();
        "/proc".into()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        "no/such/place".into()
    }
}

/// `--json -` and `--jsonl -` put the document alone on stdout (the human report goes to
/// stderr) and create no file named `-`.
#[test]
fn json_dash_is_stdout() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM, "m.gguf");
    copy_in(dir, GLM_TRACE, "t.safetensors");
    std::fs::write(
        dir.join("s.toml"),
        "[[case]]\nname = \"c\"\nmodel = \"m.gguf\"\nagainst = \"cpu\"\ntokens = [1, 2]\n",
    )
    .unwrap();
    for args in [
        vec![
            "run",
            "m.gguf",
            "--against",
            "cpu",
            "--tokens",
            "1,2",
            "--json",
            "-",
        ],
        vec!["compare", "t.safetensors", "t.safetensors", "--json", "-"],
    ] {
        let o = glmdiff(dir, &args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON document: {e}"));
        assert_eq!(j["command"], args[0]);
        assert_eq!(j["verdict"], "ok");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("glmdiff {}", args[0])),
            "{args:?}: the report on stderr: {e}"
        );
    }
    let o = glmdiff(dir, &["regress", "s.toml", "--jsonl", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record per line"))
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["regress"]["status"], "pass");
    assert!(!dir.join("-").exists());
}

/// SIGINT and SIGTERM during a long write (`synth` of a GLM-5-size file, about half a minute
/// here) remove the temporary file, print one line and exit 2; no output file appears.
#[cfg(unix)]
#[test]
fn an_interrupt_removes_the_temporary_file_and_exits_2() {
    for sig in ["INT", "TERM"] {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let mut child = Command::new(glmdiff_bin())
            .args([
                "synth", "--arch", "glm-dsa", "--dims", "glm5", "--layers", "1", "--out", "m.gguf",
            ])
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let tmp = dir.join(format!(".m.gguf.tmp-{pid}"));
        let t0 = Instant::now();
        while !tmp.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{sig}: no temporary file"
            );
            assert!(child.try_wait().unwrap().is_none(), "{sig}: synth ended");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Let it write a little.
        std::thread::sleep(Duration::from_millis(300));
        let k = Command::new("kill")
            .args([format!("-{sig}"), pid.to_string()])
            .status()
            .unwrap();
        assert!(k.success());
        let t1 = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t1.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                panic!("{sig}: synth did not stop");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{sig}: {e}");
        assert_eq!(
            e.trim_end(),
            format!("error: interrupted; removed .m.gguf.tmp-{pid}"),
            "{sig}"
        );
        assert!(!tmp.exists(), "{sig}: the temporary file is left");
        assert!(!dir.join("m.gguf").exists(), "{sig}: an output appeared");
        no_temporaries(dir);
    }
}

/// A process that can no longer clean up (SIGKILL) leaves `.NAME.tmp-PID` behind: the next
/// write of NAME removes it (a file, or a `--repro` directory) when that process is gone, and
/// leaves those of live processes alone.
#[cfg(unix)]
#[test]
fn stale_temporaries_of_dead_processes_are_removed_by_the_next_write() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    copy_in(dir, GLM, "m.gguf");
    copy_in(dir, GLM_TRACE, "t.safetensors");
    // A process killed while writing out.json and case/.
    let mut victim = Command::new("sleep").arg("30").spawn().unwrap();
    let dead = victim.id();
    victim.kill().unwrap();
    victim.wait().unwrap();
    let stale = dir.join(format!(".out.json.tmp-{dead}"));
    std::fs::write(&stale, b"half a document").unwrap();
    let stale_case = dir.join(format!(".case.tmp-{dead}"));
    std::fs::create_dir(&stale_case).unwrap();
    std::fs::write(stale_case.join("weights.gguf"), b"half").unwrap();
    // A live process's (this test's) temporary stays.
    let live = dir.join(format!(".out.json.tmp-{}", std::process::id()));
    std::fs::write(&live, b"in progress").unwrap();

    let o = glmdiff(
        dir,
        &[
            "compare",
            "t.safetensors",
            "t.safetensors",
            "--json",
            "out.json",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stale.exists(), "the dead process's temporary is left");
    assert!(live.exists(), "a live process's temporary was removed");
    let o = repro_case(dir);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(!stale_case.exists(), "the dead process's case is left");
    assert!(dir.join("case/case.json").is_file());
    std::fs::remove_file(&live).unwrap();
    no_temporaries(dir);
}

/// `dequant` streams: a Q4_0 tensor of 2^27 elements (72 MiB in the file, 512 MiB of f32) is
/// written with the memory of one chunk, not the whole f32 tensor (measured as the child's peak
/// resident size, `VmHWM` of `/proc/PID/status`, read while it runs: its own since its exec, so
/// not the test process's, which a fork's child shares until then; the mapped file's pages count
/// in it).
#[cfg(target_os = "linux")]
#[test]
fn dequant_streams_a_tensor_larger_than_its_memory() {
    use crate::common::gguf_bytes::{tensor, Gguf};
    const Q4_0: u32 = 2;
    let (cols, rows) = (4096u64, 32768u64);
    let blocks = cols * rows / 32;
    // Each 18-byte block: f16 scale 1.0, then sixteen bytes of nibbles 9 and 7 (values 1 and -1).
    let mut data = Vec::with_capacity((blocks * 18) as usize);
    for _ in 0..blocks {
        data.extend_from_slice(&0x3C00u16.to_le_bytes());
        data.extend_from_slice(&[0x79u8; 16]);
    }
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("big.gguf");
    let bytes = Gguf::default()
        .tensor(tensor("big.weight", &[cols, rows], Q4_0, 0))
        .data(data)
        .bytes();
    std::fs::write(&model, bytes).unwrap();
    let out = d.path().join("big.npy");
    let mut child = Command::new(glmdiff_bin())
        .args(["dequant", "big.gguf", "big.weight", "--out", "big.npy"])
        .current_dir(d.path())
        .env("GLMDIFF_CACHE_DIR", d.path().join(".cache"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            let hwm = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
            peak_kib = peak_kib.max(hwm.unwrap_or(0));
        }
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "dequant failed: {status}");
    assert!(peak_kib > 0, "no VmHWM read from {status_file}");
    let f32_bytes = cols * rows * 4;
    let len = std::fs::metadata(&out).unwrap().len();
    assert_eq!(
        len,
        128 + f32_bytes,
        "npy header (128 bytes) and the values"
    );
    // The values: first row of block 0: nibbles 9 (low) then 7 (high) => 1 then -1.
    let mut f = std::fs::File::open(&out).unwrap();
    let mut head = [0u8; 128 + 16 * 4 + 8];
    std::io::Read::read_exact(&mut f, &mut head).unwrap();
    let v = |i: usize| f32::from_le_bytes(head[128 + 4 * i..132 + 4 * i].try_into().unwrap());
    assert_eq!((v(0), v(15), v(16), v(17)), (1.0, 1.0, -1.0, -1.0));
    let peak = peak_kib * 1024;
    assert!(
        peak < f32_bytes / 2,
        "peak resident size {peak} bytes for a {f32_bytes}-byte output: the tensor was held whole"
    );
}
