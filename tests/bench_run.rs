//! `bench run` on the tiny fixture models against a second CPU reference: the JSON's fields are
//! there and agree with each other (each ratio is its quotient, the projection is the sum it
//! claims, the layers and depth are the model's), not its timings; and every class of bad input
//! exits 2 before any work. The layer counts and expert counts the checks use are read from
//! the model's hyperparameters, not from the report.

use std::path::Path;
use std::process::{Command, Output};

use glmdiff::gguf::Model;
use glmdiff::model::Weights;
use serde_json::Value;

fn fixtures(sub: &str) -> std::path::PathBuf {
    crate::common::fixtures(sub)
}

fn glmdiff(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new(crate::common::glmdiff_bin());
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run glmdiff")
}

/// `(n_layer, n_dense, n_expert, n_expert_used)` of a model.
fn facts(model: &Path) -> (usize, usize, usize, usize) {
    let m = Model::open(model).unwrap();
    let w = Weights::new(&m).unwrap();
    let hp = w.hparams();
    (hp.n_layer, hp.n_dense, hp.n_expert, hp.n_expert_used)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// `a` and `b` equal to the last bits a JSON round trip and a sum's order may move.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-300)
}

fn bench_json(args: &[&str], env: &[(&str, &Path)]) -> Value {
    let o = glmdiff(args, env);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {err}"))
}

/// Checks one token count's rows, kinds and projection against each other.
fn check_run(run: &Value, layers: std::ops::Range<usize>, n_dense: usize, k: usize, e: usize) {
    let t = run["tokens"].as_u64().unwrap() as usize;
    let rows = run["layers"].as_array().unwrap();
    assert_eq!(rows.len(), layers.len());
    for (row, l) in rows.iter().zip(layers) {
        assert_eq!(row["layer"], l);
        let moe = l >= n_dense;
        assert_eq!(row["kind"], if moe { "moe" } else { "dense" });
        let (wall, r, c) = (
            f(&row["wall_s"]),
            f(&row["reference_s"]),
            f(&row["candidate_s"]),
        );
        assert!(wall > 0.0 && r > 0.0 && c > 0.0, "{row}");
        assert!(
            close(c, f(&row["chained_s"]) + f(&row["replay_s"])),
            "{row}"
        );
        // The wall the driver waited for the candidate's side beyond the reference's: part of
        // the layer's wall, and of the candidate's own time (up to the steps' thread hand-overs).
        let beyond = f(&row["candidate_beyond_s"]);
        assert!(
            beyond >= 0.0 && beyond <= wall && beyond <= c + 0.05,
            "{row}"
        );
        // A CPU candidate uploads nothing and has no copy floor.
        assert_eq!(
            (f(&row["upload_s"]), row["upload_bytes"].as_u64()),
            (0.0, Some(0))
        );
        assert!(row["copy_pinned_s"].is_null() && row["ratios"]["upload_over_copy"].is_null());
        let floor = f(&row["floor_s"]);
        assert!(close(
            floor,
            f(&row["floor"]["dequant_s"]) + f(&row["floor"]["matmul_s"])
        ));
        let ratios = &row["ratios"];
        assert!(
            close(f(&ratios["reference_over_floor"]), r / floor),
            "{row}"
        );
        assert!(
            close(f(&ratios["candidate_over_reference"]), c / r),
            "{row}"
        );
        let experts = row["experts"].as_u64().unwrap() as usize;
        if moe {
            assert!(experts >= 1 && experts <= (t * k).min(e), "{row}");
        } else {
            assert_eq!(experts, 0);
        }
    }
    // Per kind: the means of its rows, after the first when it has more than one.
    for kind in run["kinds"].as_array().unwrap() {
        let mut of: Vec<&Value> = rows.iter().filter(|r| r["kind"] == kind["kind"]).collect();
        let after_first = of.len() > 1;
        assert_eq!(kind["after_first"].as_bool(), Some(after_first), "{kind}");
        if after_first {
            of.remove(0);
        }
        assert_eq!(kind["layers"].as_u64(), Some(of.len() as u64));
        for key in ["wall_s", "reference_s", "candidate_s"] {
            let mean = of.iter().map(|r| f(&r[key])).sum::<f64>() / of.len() as f64;
            assert!(close(f(&kind[key]), mean), "{key}: {kind}");
        }
    }
    let mem = &run["memory"];
    assert!(mem["vm_hwm"].as_u64().unwrap() > 0 && mem["peak_anon"].as_u64().unwrap() > 0);
    assert!(f(&run["pipeline_s"]) > 0.0);
}

/// The projection is the sum it claims: per kind, layers at the depth x the kind's mean, except
/// that a kind's first layer, when its mean leaves it out (more than one timed), counts once as
/// itself (the rows' own wall) and the others at the mean; the bound is the larger side and its
/// ratio the quotient of the two sides.
fn check_projection(run: &Value, dense: usize, moe: usize) {
    let p = &run["projection"];
    let kinds = run["kinds"].as_array().unwrap();
    let rows = run["layers"].as_array().unwrap();
    let mean = |kind: &str, key: &str| f(&kinds.iter().find(|k| k["kind"] == kind).unwrap()[key]);
    let (mut total, mut reference, mut candidate) = (0.0, 0.0, 0.0);
    for (kind, count) in [("dense", dense), ("moe", moe)] {
        if count == 0 {
            continue;
        }
        let of: Vec<&Value> = rows.iter().filter(|r| r["kind"] == kind).collect();
        let first = (of.len() > 1).then(|| of[0]);
        let n = (count - usize::from(first.is_some())) as f64;
        let once = |key: &str| first.map_or(0.0, |r| f(&r[key]));
        let kind_total = once("wall_s") + n * mean(kind, "wall_s");
        total += kind_total;
        reference += once("reference_s") + n * mean(kind, "reference_s");
        candidate += once("candidate_s") + n * mean(kind, "candidate_s");
        let term = p["terms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["kind"] == kind)
            .unwrap();
        assert_eq!(term["count"].as_u64(), Some(count as u64));
        assert_eq!(term["at_mean"].as_u64(), Some(n as u64), "{term}");
        assert_eq!(
            term["first"]["layer"].as_u64(),
            first.and_then(|r| r["layer"].as_u64()),
            "{term}"
        );
        assert!(close(f(&term["total_s"]), kind_total), "{term}");
    }
    assert!(close(f(&p["total_s"]), total), "{p}");
    assert!(close(f(&p["reference_s"]), reference), "{p}");
    assert!(close(f(&p["candidate_s"]), candidate), "{p}");
    let (bound, hi, lo) = if reference >= candidate {
        ("reference", reference, candidate)
    } else {
        ("candidate", candidate, reference)
    };
    assert_eq!(p["bound"], bound);
    assert!(close(f(&p["bound_ratio"]), hi / lo), "{p}");
    assert_eq!(p["depth"]["dense"].as_u64(), Some(dense as u64));
    assert_eq!(p["depth"]["moe"].as_u64(), Some(moe as u64));
}

/// Both tiny quantized fixtures, two token counts, one pass each: the default layers (0
/// through the second MoE layer, or all a smaller model has), the model's own depth, every
/// field consistent.
#[test]
fn bench_run_on_tiny_models_is_consistent() {
    for m in [
        "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
        "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
    ] {
        let model = fixtures(m);
        let (n_layer, n_dense, e, k) = facts(&model);
        let j = bench_json(
            &[
                "bench",
                "run",
                "--model",
                model.to_str().unwrap(),
                "--tokens",
                "3,9",
                "--against",
                "cpu",
                "--reps",
                "1",
                "--json",
            ],
            &[],
        );
        let layers = 0..(n_dense + 2).min(n_layer);
        assert_eq!(j["layer_start"], 0);
        assert_eq!(j["layer_end"].as_u64(), Some(layers.end as u64));
        assert_eq!(j["settings"]["candidate"], "cpu");
        assert_eq!(j["settings"]["spec"], "cpu");
        assert_eq!(j["settings"]["mode"], "both");
        assert!(j["copies"].is_null() && j["synth"].is_null());
        assert_eq!(j["warmup"], true);
        assert_eq!(j["depth"]["name"], "model");
        let runs = j["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 2);
        for (run, t) in runs.iter().zip([3, 9]) {
            assert_eq!(run["tokens"], t, "{m}");
            check_run(run, layers.clone(), n_dense, k, e);
            check_projection(run, n_dense, n_layer - n_dense);
        }
    }
}

/// `--project glm5`: 3 dense + 75 MoE layers; the text report names the depth and the bound.
/// Replay alone: the candidate has no chain of its own.
#[test]
fn bench_run_projects_to_glm5() {
    let model = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let (n_layer, n_dense, e, k) = facts(&model);
    let args = [
        "bench",
        "run",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "4",
        "--against",
        "cpu",
        "--reps",
        "2",
        "--project",
        "glm5",
        "--mode",
        "replay",
    ];
    let mut json = args.to_vec();
    json.push("--json");
    let j = bench_json(&json, &[]);
    assert_eq!(j["settings"]["mode"], "replay");
    assert_eq!(j["depth"]["name"], "glm5");
    let run = &j["runs"][0];
    check_run(run, 0..(n_dense + 1).min(n_layer), n_dense, k, e);
    check_projection(run, 3, 75);
    assert!(run["layers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| f(&r["chained_s"]) == 0.0));
    let o = glmdiff(&args, &[]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8_lossy(&o.stdout);
    for want in [
        "projected to glm5 (3 dense + 75 MoE layers)",
        "wall ms",
        "bound by",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
}

/// Layers past 0 start from the reference's prefix (cached in a directory of the test's own);
/// without a dense layer timed there is no projection to a depth that has one, and a note says
/// so.
#[test]
fn bench_run_of_a_later_layer_alone() {
    let model = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let (n_layer, n_dense, e, k) = facts(&model);
    assert!(n_dense >= 1 && n_layer > n_dense);
    let cache = tempfile::tempdir().unwrap();
    let range = format!("{n_dense}..{}", n_dense + 1);
    let j = bench_json(
        &[
            "bench",
            "run",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "5",
            "--against",
            "cpu",
            "--reps",
            "2",
            "--layers",
            &range,
            "--json",
        ],
        &[("GLMDIFF_CACHE_DIR", cache.path())],
    );
    let run = &j["runs"][0];
    check_run(run, n_dense..n_dense + 1, n_dense, k, e);
    assert!(run["projection"].is_null());
    let notes: Vec<&str> = j["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("no projection to model")),
        "{notes:?}"
    );
    assert_eq!(j["depth"]["dense"].as_u64(), Some(n_dense as u64));
}

/// Without a model, `bench run` writes its synthetic model to a temporary directory and removes
/// it (a tiny one here, through the library).
#[test]
fn bench_run_writes_and_removes_its_synthetic_model() {
    use glmdiff::bench::run::{self, BenchRunOptions};
    use glmdiff::session::bench::RunPipeline;
    use glmdiff::session::{Against, CudaDtype, Modes};

    let parent = tempfile::tempdir().unwrap();
    let mut opts = BenchRunOptions::new(None, vec![2]).unwrap();
    opts.synth =
        glmdiff::synth::SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 7).unwrap();
    opts.temp_parent = parent.path().to_path_buf();
    opts.reps = 1;
    let mut p = RunPipeline::new(&Against::Cpu, Modes::BOTH, CudaDtype::F32).unwrap();
    let r = run::run_quiet(&opts, &mut p).unwrap();
    let s = r.synth.as_ref().unwrap();
    assert!(s.removed && s.file_bytes == r.model_bytes && s.file_bytes > 0);
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
    assert_eq!(r.runs.len(), 1);
    assert!(r.runs[0].projection.is_some());
}

/// Every class of bad input exits 2 with a message naming it, before any work: no model, a
/// file that is no GGUF, bad token counts, layers outside the model (and outside the synthetic
/// model, refused before it is written), a trace or a missing CUDA device as the candidate,
/// `--dtype` without CUDA, an unknown `--project`, no timed pass.
#[test]
fn bench_run_bad_inputs_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    let not_gguf = dir.path().join("not.gguf");
    std::fs::write(&not_gguf, b"this is not a gguf file").unwrap();
    let tiny = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let (n_layer, ..) = facts(&tiny);
    let tmp = tempfile::tempdir().unwrap();
    let outside = format!("0..{}", n_layer + 1);
    let outside_msg = format!("--layers {outside} is outside");
    let model = |p: &Path| vec!["--model".to_string(), p.to_str().unwrap().to_string()];
    let cases: Vec<(Vec<String>, &str)> = vec![
        (model(&missing), "missing.gguf"),
        (model(&not_gguf), "not.gguf"),
        (
            [model(&tiny), vec!["--tokens".into(), "0".into()]].concat(),
            "--tokens",
        ),
        (
            [model(&tiny), vec!["--tokens".into(), "x".into()]].concat(),
            "--tokens",
        ),
        (
            [model(&tiny), vec!["--tokens".into(), "-4".into()]].concat(),
            "negative",
        ),
        (
            [model(&tiny), vec!["--layers".into(), outside.clone()]].concat(),
            &outside_msg,
        ),
        (
            [model(&tiny), vec!["--layers".into(), "1..1".into()]].concat(),
            "empty",
        ),
        (
            vec!["--layers".into(), "5..9".into()],
            "outside the synthetic model",
        ),
        (
            [
                model(&tiny),
                vec!["--against".into(), "trace:t.safetensors".into()],
            ]
            .concat(),
            "a benchmark times an engine",
        ),
        (
            [model(&tiny), vec!["--against".into(), "cuda".into()]].concat(),
            "--against cuda",
        ),
        (
            [model(&tiny), vec!["--against".into(), "cuda:7".into()]].concat(),
            "--against cuda:7",
        ),
        (
            [
                model(&tiny),
                vec![
                    "--against".into(),
                    "cpu".into(),
                    "--dtype".into(),
                    "bf16".into(),
                ],
            ]
            .concat(),
            "--dtype bf16",
        ),
        (
            [model(&tiny), vec!["--project".into(), "glm6".into()]].concat(),
            "--project \"glm6\"",
        ),
        (
            [model(&tiny), vec!["--reps".into(), "0".into()]].concat(),
            "repetition count 0",
        ),
    ];
    for (extra, needle) in cases {
        // --wide: no error wraps, so that it is one line.
        let mut args: Vec<String> = ["--wide", "bench", "run", "--json"]
            .map(String::from)
            .to_vec();
        args.extend(extra);
        if !args.iter().any(|a| a == "--tokens") {
            args.extend(["--tokens".to_string(), "2".to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut c = Command::new(crate::common::glmdiff_bin());
        // No device visible, and the synthetic model's directory where the test can see it.
        c.args(&args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .env("TMPDIR", tmp.path());
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        // The first line names the fault (a missing CUDA library's says on a second line which
        // files were tried).
        let first = err.lines().next().unwrap_or("");
        assert!(first.starts_with("error: "), "{args:?}: {err}");
        assert!(first.contains(needle), "{args:?}: want {needle:?} in {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
    // Nothing was written for the synthetic model.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}
