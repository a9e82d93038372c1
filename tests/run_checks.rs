//! `run` checks every flag before any work: each bad combination is refused (exit 2, one error
//! naming it) before the reference computes anything. With `--layer 1` the first work would be
//! the reference's layer 0, written to the reference cache; the cache directory staying empty
//! shows that nothing ran. A good run with the same flags writes an entry there, so the check
//! would see work done.

use std::path::Path;

use crate::common::{fixtures, glmdiff_in, stderr_joined};

/// The entries of the reference cache under `dir` (none when it does not exist).
fn cache_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn run_refuses_bad_combinations_before_any_work() {
    let m = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let m = m.to_str().unwrap();
    let trace = fixtures("models/glm5-tiny/glm5-tiny.short.trace.safetensors");
    let trace = format!("trace:{}", trace.display());
    let tmp = tempfile::tempdir().unwrap();
    let (case, case_in_missing_dir) = (tmp.path().join("case"), tmp.path().join("no/such/case"));
    let (case, bad_case) = (
        case.to_str().unwrap(),
        case_in_missing_dir.to_str().unwrap(),
    );
    let base = ["run", m, "--layer", "1", "--tokens", "1,2,3"];
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--against", "cpu", "--dtype", "bf16"],
            "run: --dtype bf16 sets the CUDA engine's precision; give --against cuda",
        ),
        (
            vec!["--against", &trace, "--inject", "rope_neox"],
            "run: --inject plants a bug in an engine glmdiff runs",
        ),
        (
            vec!["--against", "cpu", "--mode", "chained", "--explain"],
            "work on the first step that fails in replay; use --mode replay or both",
        ),
        (
            vec!["--against", "cpu", "--mode", "chained", "--repro", case],
            "work on the first step that fails in replay; use --mode replay or both",
        ),
        (
            vec!["--against", "cpu", "--repro", bad_case],
            "does not exist",
        ),
        (
            vec!["--against", "cpu", "--inject", "expert_swap:0,1@7"],
            "layer 7 is not run",
        ),
        (
            vec!["--against", "cpu", "--hook", "blk.0.*"],
            "--hook \"blk.0.*\" matches no hook of this run (layers 1..2)",
        ),
        (
            vec!["--against", "cpu", "--tol", "blk.1.nothing=1e-3"],
            "--tol glob \"blk.1.nothing\" matches none of the hooks compared",
        ),
        (
            vec!["--against", "cpu", "--precision", "blk.1.nothing=bf16"],
            "--precision glob \"blk.1.nothing\" matches none of the hooks compared",
        ),
    ];
    #[cfg(feature = "cuda")]
    cases.push((
        vec!["--against", "cpu", "--devices", "0"],
        "run: --devices [0] runs the CUDA engine: give --against cuda (or leave --against out), not --against cpu",
    ));
    for (extra, needle) in cases {
        let cache = tempfile::tempdir().unwrap();
        let mut args = base.to_vec();
        args.extend(&extra);
        let o = glmdiff_in(cache.path(), &args);
        let err = stderr_joined(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(
            cache_entries(cache.path()).is_empty(),
            "{extra:?}: the reference ran before the check: {:?}",
            cache_entries(cache.path())
        );
    }
    // Tokens outside the vocabulary, and layers past the model's, with the same start.
    for (args, needle) in [
        (
            vec![
                "run",
                m,
                "--layer",
                "1",
                "--tokens",
                "1,99999",
                "--against",
                "cpu",
            ],
            "outside the vocabulary",
        ),
        (
            vec![
                "run",
                m,
                "--layers",
                "1..9",
                "--tokens",
                "1",
                "--against",
                "cpu",
            ],
            "run: layers 1..9 are out of range",
        ),
    ] {
        let cache = tempfile::tempdir().unwrap();
        let o = glmdiff_in(cache.path(), &args);
        let err = stderr_joined(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(cache_entries(cache.path()).is_empty(), "{args:?}");
    }
    // The control: the same start with good flags computes layer 0 and caches it.
    let cache = tempfile::tempdir().unwrap();
    let mut args = base.to_vec();
    args.extend(["--against", "cpu"]);
    let o = glmdiff_in(cache.path(), &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr_joined(&o));
    assert_eq!(cache_entries(cache.path()).len(), 1);
}

/// `--against`, `--mode` and `--dtype` take only their words: anything else is refused by the
/// flag parser (exit 2, one message naming the flag and the value) before the model is opened,
/// here a model that does not exist.
#[test]
fn run_choices_take_only_their_words() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing.gguf");
    let m = missing.to_str().unwrap();
    for (flag, value, needle) in [
        (
            "--against",
            "gpu",
            "expected auto, cpu, cuda[:N] or trace:FILE",
        ),
        (
            "--against",
            "cuda:x",
            "expected cuda or cuda:N with N a device index",
        ),
        (
            "--against",
            "cuda:-1",
            "expected cuda or cuda:N with N a device index",
        ),
        ("--against", "trace:", "trace: needs a file"),
        (
            "--mode",
            "bogus",
            "[possible values: both, replay, chained]",
        ),
        ("--dtype", "f16", "[possible values: f32, bf16]"),
    ] {
        let o = glmdiff_in(tmp.path(), &["run", m, "--tokens", "1", flag, value]);
        let err = stderr_joined(&o);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag} <")),
            "{flag} {value}: {err}"
        );
        assert!(err.contains(needle), "{flag} {value}: {err}");
        assert!(!err.contains("missing.gguf"), "{flag} {value}: {err}");
    }
}
