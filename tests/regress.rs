//! `glmdiff regress` end to end: the fixture suite passes with stable JSONL records and matches
//! its committed baseline; a suite with a wrong expectation (written here) fails naming the case;
//! `--baseline` reports changes planted here in an earlier JSONL and exits 1 on drift; bad suites
//! exit 2 naming the case and the key. Also the traces of
//! the hook script `python/glmdiff_hooks` (`fixtures/hooks/`), `not_captured`, and `compare --map` in TOML.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glmdiff::engine::HostTensor;
use glmdiff::trace::{read_trace, write_trace, Mode, TraceMeta, TraceValues};
use serde_json::Value;

fn suite() -> PathBuf {
    crate::common::fixtures("regress").join("suite.toml")
}

use crate::common::{glmdiff_in as glmdiff, output_text as text};

fn records(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A record without what changes between runs of the same inputs (`timings`, `cache`).
fn stable(mut r: Value) -> String {
    let o = r.as_object_mut().unwrap();
    o.remove("timings");
    o.remove("layer_times");
    o.remove("compare_times");
    o.remove("reference_times");
    o.remove("candidate_times");
    o.remove("candidate_beyond_times");
    o.remove("cache");
    // The reference's work by cause: its steps and rows are stable, its seconds are times.
    if let Some(w) = o.get_mut("reference_work").and_then(Value::as_object_mut) {
        for cause in w.values_mut() {
            if let Some(c) = cause.as_object_mut() {
                c.remove("seconds");
            }
        }
    }
    serde_json::to_string(&r).unwrap()
}

fn model(rel: &str) -> String {
    crate::common::model(rel).display().to_string()
}

/// A suite of three cases with absolute paths: a CPU run with a pinned top-5 (transformers'
/// float64 trace), a float64 trace candidate, a `--layer` start. The `cpu` candidates are
/// plumbing (the same engine twice, every hook error 0): only their pins and the machinery can
/// fail.
fn small_suite(top5: &str, max_kl: &str) -> String {
    format!(
        r#"
[[case]]
name = "glm5-prompt"
model = "{g}"
prompt = "the fox and the dog"
against = "cpu"
expect_top5 = {top5}
[[case]]
name = "dsv3-golden"
model = "{d}"
against = "trace:{dt}"
max_kl = {max_kl}
[[case]]
name = "glm5-q-layer"
model = "{q}"
tokens = [393, 322, 270]
against = "cpu"
layer = 1
top1_agreement = 1.0
"#,
        g = model("glm5-tiny/glm5-tiny-f32.gguf"),
        d = model("dsv3-tiny/dsv3-tiny-f32.gguf"),
        dt = model("dsv3-tiny/dsv3-tiny.short.trace.safetensors"),
        q = model("glm5-tiny-q/glm5-tiny-q-mixed.gguf"),
    )
}

/// The top-5 ids per position of glm5-tiny's short prompt, from the float64 transformers trace.
fn pinned_top5() -> Vec<Vec<u32>> {
    let t = read_trace(
        &crate::common::fixtures("models").join("glm5-tiny/glm5-tiny.short.trace.safetensors"),
    )
    .unwrap();
    let l = &t.tensors["logits"];
    let TraceValues::Float(v) = &l.values else {
        panic!("logits are floats")
    };
    v.chunks(l.shape[1])
        .map(|row| {
            let mut ids: Vec<u32> = (0..row.len() as u32).collect();
            ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            ids.truncate(5);
            ids
        })
        .collect()
}

/// The pins with the first two ids of position 0 swapped.
fn wrong_top5() -> Vec<Vec<u32>> {
    let mut p = pinned_top5();
    p[0].swap(0, 1);
    p
}

#[test]
fn fixture_suite_passes_with_stable_jsonl() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = suite();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    for out in [&a, &b] {
        let o = glmdiff(
            cache.path(),
            &[
                "regress",
                s.to_str().unwrap(),
                "--jsonl",
                out.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(text(&o).contains("OK: "), "{}", text(&o));
    }
    let (ra, rb) = (records(&a), records(&b));
    let cases = glmdiff::regress::suite::load(&s).unwrap().cases;
    assert_eq!(ra.len(), cases.len());
    // The second run read the `--layer` prefixes from the cache: only `cache` and times differ.
    assert!(ra.iter().zip(&rb).any(|(x, y)| x["cache"] != y["cache"]));
    for (x, y) in ra.iter().zip(&rb) {
        assert_eq!(
            stable(x.clone()),
            stable(y.clone()),
            "{}",
            x["regress"]["case"]
        );
    }

    // Every record carries `run --json`'s fields, the case's verdict and checks.
    let json = dir.path().join("run.json");
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            &model("glm5-tiny/glm5-tiny-f32.gguf"),
            "--tokens",
            "1,2,3",
            "--against",
            "cpu",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let mut pinned = 0;
    for (r, case) in ra.iter().zip(&cases) {
        for k in run.as_object().unwrap().keys() {
            assert!(r.get(k).is_some(), "{}: no {k}", case.name);
        }
        assert_eq!(r["regress"]["case"], case.name.as_str());
        assert_eq!(r["regress"]["status"], "pass", "{}", r["regress"]);
        assert!(r["timings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["what"] == "case"));
        for c in r["regress"]["checks"].as_array().unwrap() {
            assert_eq!(c["ok"], true, "{}: {c}", case.name);
            pinned += usize::from(c["key"] == "expect_top5");
        }
    }
    assert!(pinned >= 5, "pinned top-5 checks: {pinned}");
    // Both architectures, float and quantized files, layer starts, traces and a planted bug.
    let m: Vec<String> = cases
        .iter()
        .map(|c| c.model.display().to_string())
        .collect();
    for want in ["glm5-tiny-f32", "dsv3-tiny-f16", "-q-mixed"] {
        assert!(m.iter().any(|x| x.contains(want)), "{want}");
    }
    assert!(cases.iter().any(|c| c.layers.is_some()));
    // Candidates that really differ from the reference: transformers' bf16 dumps, clean and with
    // planted bugs. The `cpu` candidates are plumbing (the same deterministic engine twice): every
    // hook error is 0, as the suite's notes say; every other candidate shows non-zero errors.
    let dumps: Vec<&glmdiff::regress::Case> = cases
        .iter()
        .filter(|c| c.against.to_string().contains("/engines/"))
        .collect();
    assert!(dumps.iter().any(|c| c.expect.divergence.is_some()));
    assert!(
        dumps
            .iter()
            .filter(|c| c.expect.divergence.is_none())
            .count()
            >= 3
    );
    for (r, case) in ra.iter().zip(&cases) {
        let worst = r["records"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|h| ["replay", "chained"].map(|m| h[m]["error"].as_f64().unwrap_or(0.0)))
            .fold(0.0f64, f64::max);
        if case.against == glmdiff::session::Against::Cpu {
            assert_eq!(worst, 0.0, "{}: a cpu candidate is plumbing", case.name);
        } else {
            assert!(worst > 0.0, "{}: the candidate differs", case.name);
        }
    }
}

#[test]
fn the_cuda_twin_suite_has_the_same_cases_against_cuda() {
    let cpu = glmdiff::regress::suite::load(&suite()).unwrap();
    let cuda = glmdiff::regress::suite::load(&suite().with_file_name("suite-cuda.toml")).unwrap();
    assert!(cuda
        .cases
        .iter()
        .all(|c| c.against == glmdiff::session::Against::Cuda(None)));
    for c in &cuda.cases {
        let twin = cpu.cases.iter().find(|x| x.name == c.name).unwrap();
        assert_eq!((&twin.model, &twin.expect), (&c.model, &c.expect));
    }
    let dumps = cpu
        .cases
        .iter()
        .filter(|c| c.against.to_string().contains("/engines/"))
        .count();
    assert_eq!(
        cuda.cases.len() + dumps,
        cpu.cases.len(),
        "all but the engine-dump cases"
    );
}

#[test]
fn a_wrong_expectation_exits_1_and_names_the_case() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = format!("{:?}", pinned_top5());
    let p = dir.path().join("wrong.toml");
    std::fs::write(&p, small_suite(&format!("{:?}", wrong_top5()), "1e-30")).unwrap();
    let jsonl = dir.path().join("w.jsonl");
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--jsonl",
            jsonl.to_str().unwrap(),
        ],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL (expect_top5) glm5-prompt:"), "{t}");
    assert!(t.contains("position 0: pinned"), "{t}");
    assert!(t.contains("FAIL (max_kl) dsv3-golden:"), "{t}");
    assert!(t.contains("re-run: glmdiff run "), "{t}");
    assert!(
        t.contains("REGRESSION: 3 cases, 1 pass, 2 fail, 0 error"),
        "{t}"
    );
    let st: Vec<String> = records(&jsonl)
        .iter()
        .map(|r| r["regress"]["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(st, ["fail", "fail", "pass"]);

    // The same suite with the right pins passes.
    std::fs::write(&p, small_suite(&good, "1e-6")).unwrap();
    let o = glmdiff(cache.path(), &["regress", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // --case runs a subset.
    let o = glmdiff(
        cache.path(),
        &["regress", p.to_str().unwrap(), "--case", "dsv3-*"],
    );
    assert!(text(&o).contains("(1 cases)"), "{}", text(&o));
}

#[test]
fn baseline_reports_planted_changes() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = format!("{:?}", pinned_top5());
    let p = dir.path().join("s.toml");
    std::fs::write(&p, small_suite(&good, "1e-6")).unwrap();
    let base = dir.path().join("base.jsonl");
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--jsonl",
            base.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // Against itself: nothing changed.
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--baseline",
            base.to_str().unwrap(),
        ],
    );
    assert!(text(&o).contains("no changes"), "{}", text(&o));

    // Planted in the baseline: glm5-prompt failed then; dsv3-golden's KL was 1e-9 and one hook's
    // error 1/10 of today's; glm5-q-layer did not exist.
    let mut recs = records(&base);
    recs[0]["regress"]["status"] = "fail".into();
    let kl = recs[1]["logits"]["chained"]["max_kl"].as_f64().unwrap();
    assert!(kl < 1e-10, "{kl}");
    recs[1]["logits"]["chained"]["max_kl"] = 1e-9.into();
    let hook = recs[1]["records"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|r| r["replay"]["error"].as_f64().is_some_and(|e| e > 1e-9))
        .unwrap();
    let name = hook["hook"].as_str().unwrap().to_string();
    let e = hook["replay"]["error"].as_f64().unwrap();
    hook["replay"]["error"] = (e / 10.0).into();
    recs.remove(2);
    let planted = dir.path().join("planted.jsonl");
    let lines: Vec<String> = recs.iter().map(|r| r.to_string()).collect();
    std::fs::write(&planted, lines.join("\n") + "\n").unwrap();
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--baseline",
            planted.to_str().unwrap(),
        ],
    );
    let t = text(&o);
    // Every case passes, but metrics moved by more than 2x: drift, exit 1.
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("OK: 3 cases, 3 pass"), "{t}");
    assert!(
        t.contains("DRIFT: this run moved from the baseline (exit 1)"),
        "{t}"
    );
    assert!(t.contains("fixed: glm5-prompt"), "{t}");
    assert!(t.contains("new case: glm5-q-layer"), "{t}");
    assert!(t.contains("| dsv3-golden | max_kl"), "{t}");
    assert!(
        t.contains(&format!("| dsv3-golden | {name} (replay)")),
        "{t}"
    );
    assert!(t.contains("10.00x"), "{t}");

    // A suite that fails today against a passing baseline: a new failure.
    std::fs::write(&p, small_suite(&format!("{:?}", wrong_top5()), "1e-6")).unwrap();
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--baseline",
            base.to_str().unwrap(),
        ],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("new failure: glm5-prompt (fails expect_top5)"),
        "{t}"
    );

    // A baseline that is not regress JSONL is an error naming its line.
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "{\"x\": 1}\n").unwrap();
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--baseline",
            junk.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("junk.jsonl line 1"), "{}", text(&o));
}

/// The committed baseline (`fixtures/regress/baseline.jsonl`, what `.ci/run` judges the suite
/// against) holds exactly the suite's cases and this build shows no change against it; a copy
/// with one hook's error planted 3x away (written here) is drift, exit 1, naming the case and
/// the hook; 1.9x is within the tolerance (2x), exit 0.
#[test]
fn committed_baseline_has_every_case_and_catches_drift() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = suite();
    let committed = s.with_file_name("baseline.jsonl");
    let judge = |baseline: &Path| {
        glmdiff(
            cache.path(),
            &[
                "regress",
                s.to_str().unwrap(),
                "--baseline",
                baseline.to_str().unwrap(),
            ],
        )
    };
    let o = judge(&committed);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    let cases = glmdiff::regress::suite::load(&s).unwrap().cases;
    assert!(
        t.contains(&format!("({} cases in both):\n  no changes", cases.len())),
        "refresh fixtures/regress/baseline.jsonl (docs/regress.md): {t}"
    );

    // One hook of a clean engine-dump case, its chained error scaled in a copy of the baseline.
    let recs = records(&committed);
    let (k, hook) = recs
        .iter()
        .enumerate()
        .find_map(|(k, r)| {
            let engine = r["regress"]["case"].as_str().unwrap() == "glm5-bf16-dump";
            let h = r["records"]
                .as_array()
                .unwrap()
                .iter()
                .find(|h| h["chained"]["error"].as_f64().is_some_and(|e| e > 1e-3))?;
            engine.then(|| (k, h["hook"].as_str().unwrap().to_string()))
        })
        .expect("a hook of glm5-bf16-dump with a chained error above 1e-3");
    for (factor, rc) in [(3.0, 1), (1.0 / 3.0, 1), (1.9, 0), (1.0 / 1.9, 0)] {
        let mut planted = recs.clone();
        for h in planted[k]["records"].as_array_mut().unwrap() {
            if h["hook"] == hook.as_str() {
                let e = h["chained"]["error"].as_f64().unwrap();
                h["chained"]["error"] = (e * factor).into();
            }
        }
        let p = dir.path().join("planted.jsonl");
        let lines: Vec<String> = planted.iter().map(|r| r.to_string()).collect();
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        let o = judge(&p);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(rc), "x{factor}: {t}");
        let row = format!("| glm5-bf16-dump | {hook} (chained)");
        if rc == 1 {
            assert!(t.contains(&row) && t.contains("DRIFT: "), "x{factor}: {t}");
        } else {
            assert!(
                t.contains("no changes") && !t.contains("DRIFT"),
                "x{factor}: {t}"
            );
        }
    }
}

#[test]
fn bad_suites_exit_2_naming_the_case_and_the_key() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let g = model("glm5-tiny/glm5-tiny-f32.gguf");
    let head =
        format!("[[case]]\nname = \"a\"\nmodel = \"{g}\"\ntokens = [1, 2]\nagainst = \"cpu\"\n");
    let bad = [
        (format!("{head}max_k1 = 1e-6\n"), "case 1 \"a\": key \"max_k1\": unknown key"),
        (format!("{head}max_kl = \"tiny\"\n"), "case 1 \"a\": key \"max_kl\": expected a number"),
        (format!("{head}[[case]]\nname = \"b\"\nmodel = \"nope.gguf\"\nagainst = \"cpu\"\ntokens = [1]\n"), "case 2 \"b\": key \"model\": no such file"),
        (format!("{head}expect_top5 = [1, 2]\n"), "case 1 \"a\": key \"expect_top5\""),
        ("[[case]\n".to_string(), "is not valid TOML"),
    ];
    for (i, (s, want)) in bad.iter().enumerate() {
        let p = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&p, s).unwrap();
        let o = glmdiff(cache.path(), &["regress", p.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(want), "{want}: {}", text(&o));
    }

    // A case that cannot run (no CUDA engine, a token out of range) is an error row: exit 2
    // after the others ran, each named.
    let p = dir.path().join("err.toml");
    std::fs::write(
        &p,
        format!("{head}[[case]]\nname = \"gpu\"\nmodel = \"{g}\"\ntokens = [1]\nagainst = \"cuda\"\n[[case]]\nname = \"oov\"\nmodel = \"{g}\"\ntokens = [99999]\nagainst = \"cpu\"\n[[case]]\nname = \"nologits\"\nmodel = \"{g}\"\ntokens = [1]\nagainst = \"cpu\"\nlayers = \"0..1\"\nmax_kl = 1e-6\n"),
    )
    .unwrap();
    let jsonl = dir.path().join("e.jsonl");
    let o = glmdiff(
        cache.path(),
        &[
            "regress",
            p.to_str().unwrap(),
            "--jsonl",
            jsonl.to_str().unwrap(),
        ],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("3 case(s) could not run: gpu, oov, nologits"),
        "{t}"
    );
    assert!(t.contains("CUDA"), "{t}");
    assert!(
        t.contains("key \"max_kl\": the run stops before the logits"),
        "{t}"
    );
    let r = records(&jsonl);
    assert_eq!(r[0]["regress"]["status"], "pass");
    assert_eq!(r[1]["regress"]["status"], "error");
}

/// A copy of a trace with `edit` applied and extra metadata, written as F32/I32.
fn doctored(
    src: &Path,
    dst: &Path,
    extra: &[(&str, &str)],
    edit: impl FnOnce(&mut BTreeMap<String, HostTensor>),
) {
    let t = read_trace(src).unwrap();
    let mut tensors: BTreeMap<String, HostTensor> = crate::common::host_tensors(&t);
    edit(&mut tensors);
    let meta = TraceMeta {
        model: t.metadata["model"].clone(),
        architecture: t.metadata["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: t.metadata["engine"].clone(),
        dtype: t.metadata["dtype"].clone(),
        mode: Mode::Chained,
        extra: extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    write_trace(dst, &tensors, &meta).unwrap();
}

/// The traces of the hook script `python/glmdiff_hooks` (transformers float32, forward hooks only) pass
/// `run` in both modes; a hook the engine lists in `not_captured` is named and not compared.
#[test]
fn hook_script_traces_pass_run_and_not_captured_is_shown() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pairs = crate::common::trace_pairs(
        &crate::common::fixtures("hooks"),
        &crate::common::fixtures("models"),
    );
    assert!(pairs.len() >= 2);
    for (trace, gguf) in &pairs {
        let t = read_trace(trace).unwrap();
        assert!(t.metadata["hook_script"].starts_with("glmdiff_hooks"));
        assert_eq!(t.metadata["not_captured"], "{}");
        let json = dir.path().join("r.json");
        let o = glmdiff(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--against",
                &format!("trace:{}", trace.display()),
                "--mode",
                "both",
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let j: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        for r in j["records"].as_array().unwrap() {
            for m in ["replay", "chained"] {
                assert_eq!(
                    r[m]["status"],
                    "pass",
                    "{}: {} {m}",
                    trace.display(),
                    r["hook"]
                );
            }
        }
    }
    // An engine that fuses q_a_norm says so: the hook is shown as not in the trace.
    let (trace, gguf) = &pairs[0];
    let fused = dir.path().join("fused.trace.safetensors");
    doctored(
        trace,
        &fused,
        &[(
            "not_captured",
            r#"{"blk.*.q_a_norm": "fused into the q_b GEMM"}"#,
        )],
        |t| t.retain(|n, _| !n.ends_with(".q_a_norm")),
    );
    let o = glmdiff(
        cache.path(),
        &[
            "--wide",
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &format!("trace:{}", fused.display()),
        ],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains("could not capture 1 hook(s), shown as not in the trace: blk.*.q_a_norm (fused into the q_b GEMM)"),
        "{t}"
    );
    assert!(t.contains("not compared:"), "{t}");
    assert!(t.contains("blk.0.q_a_norm"), "{t}");
}

#[test]
fn compare_map_reads_toml_and_refuses_two_names_for_one_hook() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let reference =
        crate::common::fixtures("models").join("glm5-tiny/glm5-tiny.short.trace.safetensors");
    let renamed = dir.path().join("renamed.trace.safetensors");
    doctored(&reference, &renamed, &[], |t| {
        let v = t.remove("blk.0.q_a").unwrap();
        t.insert("model.layers.0.self_attn.q_a_proj".into(), v);
    });
    let (r, c) = (reference.to_str().unwrap(), renamed.to_str().unwrap());
    let map = dir.path().join("map.toml");
    std::fs::write(
        &map,
        "\"model.layers.0.self_attn.q_a_proj\" = \"blk.0.q_a\"\n",
    )
    .unwrap();
    let o = glmdiff(
        cache.path(),
        &["compare", r, c, "--map", map.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("not compared"), "{}", text(&o));
    std::fs::write(
        &map,
        "\"model.layers.0.self_attn.q_a_proj\" = \"blk.0.q_a\"\n\"x\" = \"blk.0.q_a\"\n",
    )
    .unwrap();
    let o = glmdiff(
        cache.path(),
        &["compare", r, c, "--map", map.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("are both mapped to \"blk.0.q_a\""),
        "{}",
        text(&o)
    );
    std::fs::write(&map, "not = [toml\n").unwrap();
    let o = glmdiff(
        cache.path(),
        &["compare", r, c, "--map", map.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("is not a TOML table"), "{}", text(&o));
}
