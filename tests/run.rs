//! `glmdiff run` and `glmdiff compare` end to end on the fixture models: a second CPU reference
//! (plumbing: the same engine twice, every error 0) and the float64 transformers traces
//! (independent of glmdiff) must come out clean in both modes; traces with an error planted by
//! the test at one hook must be named at that hook.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glmdiff::engine::HostTensor;
use glmdiff::trace::{read_trace, write_trace, Mode, TraceMeta};
use serde_json::Value;

fn fixtures() -> PathBuf {
    crate::common::fixtures("models")
}

/// Every (golden trace, GGUF) pair of the fixtures.
fn golden_pairs() -> Vec<(PathBuf, PathBuf)> {
    let out = crate::common::trace_pairs(&fixtures(), &fixtures());
    assert!(out.len() >= 12, "fixture pairs: {}", out.len());
    out
}

/// Runs glmdiff with a private cache directory.
use crate::common::{glmdiff_in as glmdiff, output_text as text};

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// A copy of a golden trace with `edit` applied to its tensors, written as F32/I32.
fn doctored(src: &Path, dst: &Path, edit: impl FnOnce(&mut BTreeMap<String, HostTensor>)) {
    let t = read_trace(src).unwrap();
    let mut tensors: BTreeMap<String, HostTensor> = crate::common::host_tensors(&t);
    edit(&mut tensors);
    let meta = TraceMeta {
        model: t.metadata["model"].clone(),
        architecture: t.metadata["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: "doctored copy".into(),
        dtype: t.metadata["dtype"].clone(),
        mode: Mode::Chained,
        extra: [("models".to_string(), t.metadata["models"].clone())]
            .into_iter()
            .collect(),
    };
    write_trace(dst, &tensors, &meta).unwrap();
}

fn scale(t: &mut HostTensor, f: f32) {
    if let Ok(v) = t.as_f32_mut("scaled") {
        v.iter_mut().for_each(|x| *x *= f);
    }
}

/// Plumbing: the candidate is a second instance of the same deterministic CPU engine, so every
/// hook's error is 0 by construction and nothing here can show a numerical difference. What it
/// checks is the run machinery (two engines, both modes, the records, the verdict) adding
/// nothing; that the reference is right is `run_against_golden_traces_is_clean_in_both_modes`
/// and `tests/reference.rs`.
#[test]
fn run_against_cpu_plumbing_is_exactly_zero_on_every_fixture_in_both_modes() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (trace, gguf) in golden_pairs() {
        let tokens = read_trace(&trace).unwrap().tokens().unwrap();
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let json = dir.path().join("r.json");
        let o = glmdiff(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--tokens",
                &ids.join(","),
                "--against",
                "cpu",
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}: {}", gguf.display(), text(&o));
        let j = read_json(&json);
        assert_eq!(j["verdict"], "ok");
        assert!(j["first_divergence"].is_null() && j["first_divergence_chained"].is_null());
        let records = j["records"].as_array().unwrap();
        assert!(records.len() > 30);
        for r in records {
            for m in ["replay", "chained"] {
                assert_eq!(
                    r[m]["status"],
                    "pass",
                    "{}: {} {m}",
                    gguf.display(),
                    r["hook"]
                );
                // Two instances of the same deterministic engine agree bit for bit.
                assert_eq!(r[m]["error"], 0.0, "{}: {} {m}", gguf.display(), r["hook"]);
            }
        }
        assert_eq!(j["logits"]["chained"]["top1_agreement"], 1.0);
    }
}

/// The transformers float64 traces are an independent engine: clean in both modes, every hook
/// within its floor, nothing missing.
#[test]
fn run_against_golden_traces_is_clean_in_both_modes() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (trace, gguf) in golden_pairs() {
        let json = dir.path().join("r.json");
        let against = format!("trace:{}", trace.display());
        let o = glmdiff(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--against",
                &against,
                "--json",
                json.to_str().unwrap(),
            ],
        );
        let case = format!("{} vs {}", gguf.display(), trace.display());
        assert_eq!(o.status.code(), Some(0), "{case}: {}", text(&o));
        let j = read_json(&json);
        let mut worst = (0.0f64, String::new());
        for r in j["records"].as_array().unwrap() {
            for m in ["replay", "chained"] {
                assert_eq!(
                    r[m]["status"], "pass",
                    "{case}: {} {m}: {}",
                    r["hook"], r[m]
                );
                let e = r[m]["error"].as_f64().unwrap();
                if e > worst.0 {
                    worst = (e, format!("{} {m}", r["hook"]));
                }
            }
        }
        eprintln!("{case}: worst {:.3e} at {} ", worst.0, worst.1);
        assert_eq!(j["logits"]["chained"]["top1_agreement"], 1.0, "{case}");
    }
}

/// An error planted at one hook of an otherwise exact trace is named at that hook by replay and
/// chained runs and by `compare`.
#[test]
fn a_planted_error_is_named_at_its_hook() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny.long"))
        .unwrap();
    let bad = dir.path().join("bad.trace.safetensors");
    // 1% too large: far above the f64-vs-f32 floor (~4e-7), far below garbage.
    doctored(&trace, &bad, |t| {
        scale(t.get_mut("blk.1.attn_out").unwrap(), 1.01)
    });
    let json = dir.path().join("r.json");
    let against = format!("trace:{}", bad.display());
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = read_json(&json);
    assert_eq!(j["verdict"], "differs");
    assert_eq!(j["first_divergence"]["hook"], "blk.1.attn_out");
    assert_eq!(j["first_divergence_chained"]["hook"], "blk.1.attn_out");
    let e = j["first_divergence"]["error"].as_f64().unwrap();
    assert!((e - 0.01).abs() < 1e-4, "replay error {e}");
    let out = text(&o);
    assert!(
        out.contains("first divergence (replay, the step's own error): blk.1.attn_out"),
        "{out}"
    );
    assert!(out.contains("--layer 1"), "{out}");

    // The same through compare (two traces, chained only).
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            trace.to_str().unwrap(),
            bad.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = read_json(&json);
    assert_eq!(j["first_divergence_chained"]["hook"], "blk.1.attn_out");
    assert!(j["first_divergence"].is_null());

    // A selection bug: one row of blk.2's experts differs while its logits are exact.
    let bad_ids = dir.path().join("ids.trace.safetensors");
    doctored(&trace, &bad_ids, |t| {
        let ids = t.get_mut("blk.2.moe_topk_ids").unwrap();
        let k = ids.shape[1];
        if let Ok(v) = ids.as_i32_mut("moe_topk_ids") {
            // Token 3's first expert becomes one it did not select.
            let row = &mut v[3 * k..4 * k];
            let unused = (0..64).find(|e| !row.contains(e)).unwrap();
            row[0] = unused;
        }
    });
    let against = format!("trace:{}", bad_ids.display());
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = read_json(&json);
    assert_eq!(j["first_divergence"]["hook"], "blk.2.moe_topk_ids");
    assert_eq!(j["first_divergence_chained"]["hook"], "blk.2.moe_topk_ids");
}

/// Garbage logits (the failure glmdiff was made for: every token near -ln vocab) are flagged
/// FLAT; each mode alone gives its own verdicts; `--all-steps` expands every layer.
#[test]
fn flat_logits_modes_and_all_steps() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny-q.short"))
        .unwrap();
    let flat = dir.path().join("flat.trace.safetensors");
    doctored(&trace, &flat, |t| scale(t.get_mut("logits").unwrap(), 0.01));
    let g = gguf.to_str().unwrap();
    let against = format!("trace:{}", flat.display());
    let json = dir.path().join("r.json");
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            g,
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("FLAT: the candidate's distribution is close to uniform"),
        "{}",
        text(&o)
    );
    let j = read_json(&json);
    assert_eq!(j["first_divergence"]["hook"], "logits");
    assert_eq!(j["logits"]["chained"]["candidate_flat"], true);

    let good = format!("trace:{}", trace.display());
    for mode in ["replay", "chained"] {
        let o = glmdiff(
            cache.path(),
            &[
                "run",
                g,
                "--against",
                &good,
                "--mode",
                mode,
                "--all-steps",
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", text(&o));
        let j = read_json(&json);
        assert_eq!(j["modes"], serde_json::json!([mode]));
        let other = if mode == "replay" {
            "chained"
        } else {
            "replay"
        };
        assert!(j["records"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r[other].is_null()));
        // Every hook has its own row: blk.1.l_out is printed, not folded.
        assert!(text(&o).contains("| blk.1.l_out"), "{}", text(&o));
    }
}

/// A trace without the DSA selection still replays attention, on the reference's selection
/// made from the trace's own scores, and says so; `compare --map` reads a trace whose hooks
/// have other names.
#[test]
fn selection_fallback_and_name_map() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny.long"))
        .unwrap();
    let nosel = dir.path().join("nosel.trace.safetensors");
    doctored(&trace, &nosel, |t| {
        t.remove("blk.1.indexer_topk");
    });
    let json = dir.path().join("r.json");
    let against = format!("trace:{}", nosel.display());
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j = read_json(&json);
    let rec = j["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["hook"] == "blk.1.attn_heads")
        .unwrap()
        .clone();
    assert_eq!(rec["replay"]["status"], "pass", "{rec}");
    assert!(
        rec["replay"]["note"]
            .as_str()
            .unwrap()
            .contains("blk.1.indexer_topk not in the trace: the reference's own selection from the trace's inputs"),
        "{rec}"
    );

    // The candidate calls q_a "layers.0.self_attn.q_a_proj"; the map names it back.
    let renamed = dir.path().join("renamed.trace.safetensors");
    doctored(&trace, &renamed, |t| {
        let v = t.remove("blk.0.q_a").unwrap();
        t.insert("layers.0.self_attn.q_a_proj".into(), v);
    });
    let map = dir.path().join("map.json");
    std::fs::write(&map, r#"{"layers.0.self_attn.q_a_proj": "blk.0.q_a"}"#).unwrap();
    let (t, r) = (trace.to_str().unwrap(), renamed.to_str().unwrap());
    let o = glmdiff(
        cache.path(),
        &["compare", t, r, "--json", json.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("not compared: 1 hooks"), "{}", text(&o));
    let o = glmdiff(
        cache.path(),
        &[
            "compare",
            t,
            r,
            "--map",
            map.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("not compared"), "{}", text(&o));
    let j = read_json(&json);
    let q_a = j["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["hook"] == "blk.0.q_a")
        .unwrap()
        .clone();
    assert_eq!(q_a["chained"]["status"], "pass");
    let o = glmdiff(cache.path(), &["compare", t, r, "--map", "/no/map.json"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("/no/map.json"), "{}", text(&o));
}

/// Hooks missing from a trace are listed, not fatal, and replay runs across them (the steps
/// that read them are compared as segments); a trace of other tokens is an error.
#[test]
fn missing_hooks_are_listed_and_other_tokens_refused() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("dsv3-tiny.short"))
        .unwrap();
    let partial = dir.path().join("partial.trace.safetensors");
    doctored(&trace, &partial, |t| {
        t.retain(|n, _| !n.ends_with(".q_a") && n != "blk.1.l_out");
    });
    let json = dir.path().join("r.json");
    let against = format!("trace:{}", partial.display());
    let g = gguf.to_str().unwrap();
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            g,
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j = read_json(&json);
    let status = |hook: &str, mode: &str| -> String {
        j["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["hook"] == hook)
            .map(|r| r[mode]["status"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert_eq!(status("blk.0.q_a", "chained"), "missing");
    assert_eq!(status("blk.0.q_a", "replay"), "missing");
    // q_a_norm reads q_a, which the reference computes from the trace's attn_norm; blk.2's
    // attn_norm reads blk.1.l_out, computed from the trace's blk.1.ffn_inp and ffn_out.
    let segment = |hook: &str| -> Value {
        j["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["hook"] == hook)
            .map(|r| r["segment"].clone())
            .unwrap_or_default()
    };
    assert_eq!(status("blk.0.q_a_norm", "replay"), "pass");
    assert_eq!(status("blk.0.q_a_norm", "chained"), "pass");
    assert_eq!(
        segment("blk.0.q_a_norm")["name"],
        "blk.0.q_a..blk.0.q_a_norm"
    );
    assert_eq!(segment("blk.0.q_a_norm")["from"][0], "blk.0.attn_norm");
    assert_eq!(status("blk.2.attn_norm", "replay"), "pass");
    assert_eq!(
        segment("blk.2.attn_norm")["name"],
        "blk.1.l_out..blk.2.attn_norm"
    );
    assert!(segment("blk.0.q_b").is_null());
    assert!(text(&o).contains("not compared:"), "{}", text(&o));

    let o = glmdiff(
        cache.path(),
        &["run", g, "--against", &against, "--tokens", "1,2,3"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("was made for tokens"), "{}", text(&o));
}

/// `--layer N` starts from the cached residual stream: the first run computes and stores it,
/// the second reads it, and both give the same numbers as a full run.
#[test]
fn layer_runs_reuse_the_reference_cache() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (trace, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny.long"))
        .unwrap();
    let g = gguf.to_str().unwrap();
    let against = format!("trace:{}", trace.display());
    let (j1, j2, jf) = (
        dir.path().join("1.json"),
        dir.path().join("2.json"),
        dir.path().join("f.json"),
    );
    // `glmdiff run` against the trace, writing `json`, with `extra` flags.
    let run = |json: &Path, extra: &[&str]| {
        let mut args = vec![
            "run",
            g,
            "--against",
            &against,
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        glmdiff(cache.path(), &args)
    };
    let o1 = run(&j1, &["--layer", "2"]);
    assert_eq!(o1.status.code(), Some(0), "{}", text(&o1));
    assert!(text(&o1).contains("computed and cached"), "{}", text(&o1));
    let o2 = run(&j2, &["--layer", "2"]);
    assert_eq!(o2.status.code(), Some(0), "{}", text(&o2));
    assert!(text(&o2).contains("read from the cache"), "{}", text(&o2));
    let o = run(&jf, &[]);
    assert_eq!(o.status.code(), Some(0));
    let (a, b, full) = (read_json(&j1), read_json(&j2), read_json(&jf));
    let recs = |j: &Value| -> BTreeMap<String, Value> {
        j["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["hook"].as_str().unwrap().to_string(), r.clone()))
            .collect()
    };
    let (ra, rb, rf) = (recs(&a), recs(&b), recs(&full));
    assert_eq!(ra, rb);
    assert!(ra
        .keys()
        .all(|k| k.starts_with("blk.2.") || k == "result_norm" || k == "logits"));
    for (k, v) in &ra {
        assert_eq!(v["replay"], rf[k]["replay"], "{k}");
        assert_eq!(v["chained"]["metrics"], rf[k]["chained"]["metrics"], "{k}");
    }
    let t = |j: &Value, w: &str| {
        j["timings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["what"].as_str().unwrap().starts_with(w))
            .map(|x| x["seconds"].as_f64().unwrap())
    };
    eprintln!(
        "--layer 2: prefix computed in {:?} s, read from the cache in {:?} s",
        t(&a, "reference prefix (layers"),
        t(&b, "reference prefix (cache)")
    );
    assert!(t(&b, "reference prefix (cache)").is_some());
}

/// `run --json`'s times by step, with an engine candidate: each the largest first; the wall by
/// which the candidate's side of a step ended after the reference's, by step, adds up to the
/// layers' own.
#[test]
fn json_times_by_step_add_up() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures().join("glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let (code, j, out) = crate::common::run_json(
        cache.path(),
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            "cpu",
            "--tokens",
            "5",
        ],
        &dir.path().join("r.json"),
    );
    assert_eq!(code, 0, "{out}");
    let secs = |key: &str| -> Vec<f64> {
        let a = j[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {}", j[key]));
        a.iter().map(|t| t["seconds"].as_f64().unwrap()).collect()
    };
    for key in [
        "reference_times",
        "candidate_times",
        "candidate_beyond_times",
    ] {
        let s = secs(key);
        assert!(
            !s.is_empty() || key == "candidate_beyond_times",
            "{key} empty"
        );
        assert!(
            s.windows(2).all(|w| w[0] >= w[1]),
            "{key} not largest first: {s:?}"
        );
    }
    let whats = j["candidate_beyond_times"].as_array().unwrap();
    assert!(whats
        .iter()
        .all(|t| t["what"].as_str().unwrap().ends_with(" beyond")));
    let by_step: f64 = secs("candidate_beyond_times").iter().sum();
    let by_layer: f64 = j["layer_times"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["candidate_beyond_s"].as_f64().unwrap())
        .sum();
    assert!(
        (by_step - by_layer).abs() <= 1e-9 * (1.0 + by_layer),
        "{by_step} by step against {by_layer} by layer"
    );
}

#[test]
fn json_contract_plot_and_errors() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures().join("glm5-tiny-q/glm5-tiny-q-mixed.gguf");
    let g = gguf.to_str().unwrap();
    let json = dir.path().join("r.json");
    let svg = dir.path().join("p.svg");
    let o = glmdiff(
        cache.path(),
        &[
            "run",
            g,
            "--json",
            json.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("--against auto"), "{}", text(&o));
    let j = read_json(&json);
    for key in [
        "glmdiff_run",
        "first_divergence",
        "first_divergence_chained",
        "engines",
        "tokens",
        "records",
        "logits",
        "modes",
        "verdict",
        "layer_summaries",
    ] {
        assert!(j.get(key).is_some(), "JSON key {key}");
    }
    assert_eq!(j["modes"], serde_json::json!(["replay", "chained"]));
    let r = &j["records"][1];
    for key in [
        "hook", "layer", "shape", "kind", "floor", "inputs", "replay", "chained",
    ] {
        assert!(r.get(key).is_some(), "record key {key}: {r}");
    }
    for key in [
        "max_abs",
        "max_abs_at",
        "max_rel",
        "nmse",
        "rel_l2",
        "cosine",
        "nan",
        "inf",
        "per_token",
    ] {
        assert!(
            r["replay"]["metrics"].get(key).is_some(),
            "metric {key}: {r}"
        );
    }
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("replay"));

    for (args, needle) in [
        (
            vec!["run", g, "--tokens", "1", "--against", "cuda:x"],
            "cuda:N with N a device index",
        ),
        (
            vec!["run", g, "--against", "gpu"],
            "expected auto, cpu, cuda[:N] or trace:FILE",
        ),
        (
            vec!["run", g, "--against", "cpu"],
            "give --tokens or --prompt",
        ),
        (
            vec![
                "run",
                g,
                "--against",
                "cpu",
                "--tokens",
                "1",
                "--layer",
                "9",
            ],
            "out of range",
        ),
        (
            vec![
                "run",
                g,
                "--tokens",
                "1",
                "--against",
                "trace:/no/such.safetensors",
            ],
            "/no/such.safetensors",
        ),
        (
            vec!["run", g, "--tokens", "1,2", "--against", "auto"],
            "no trace beside",
        ),
        (
            vec![
                "run",
                g,
                "--tokens",
                "1",
                "--against",
                "cpu",
                "--plot",
                "x.png",
            ],
            "must end in .svg",
        ),
        (
            vec![
                "run",
                g,
                "--tokens",
                "1",
                "--against",
                "cpu",
                "--tol",
                "q_a",
            ],
            "GLOB=VALUE",
        ),
        (vec!["compare", g, g], "not a safetensors file"),
    ] {
        let o = glmdiff(cache.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(needle), "{args:?}: {}", text(&o));
    }
    // Device 99: no CUDA on this machine, or no such device where there is one.
    let args = ["run", g, "--tokens", "1", "--against", "cuda:99"];
    let o = glmdiff(cache.path(), &args);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
    assert!(
        text(&o).contains("no CUDA") || text(&o).contains("no device 99"),
        "{args:?}: {}",
        text(&o)
    );
}

/// A float hook whose systematic test had too few rows says so: a 5-token prompt, clean or
/// with a 2% `attn_output` gain, carries `systematic_untested` on every float hook's results and
/// one line under the table, within 100 columns, with no verdict changed by it; the committed
/// 32-token trace tests every hook and shows no such line, and the 21-token one leaves only the
/// router's narrow weights untested.
#[test]
fn untested_systematic_tests_are_said() {
    let cache = tempfile::tempdir().unwrap();
    let gguf = fixtures().join("glm5-tiny/glm5-tiny-f32.gguf");
    let g = gguf.to_str().unwrap();
    let five = ["run", g, "--tokens", "1,2,3,4,5", "--against", "cpu"];
    let inject = ["--inject", "weight_scale:blk.1.attn_output.weight,1.02"];
    for (extra, code) in [(&[][..], 0), (&inject[..], 1)] {
        let args: Vec<&str> = five
            .iter()
            .chain(extra)
            .chain(&["--json", "-"])
            .copied()
            .collect();
        let o = glmdiff(cache.path(), &args);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {}", text(&o));
        let j: Value = serde_json::from_slice(&o.stdout).unwrap();
        let rec = j["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["hook"] == "blk.1.attn_out")
            .unwrap();
        for m in ["replay", "chained"] {
            let u = &rec[m]["systematic_untested"];
            assert_eq!(u["rows"], 5, "{args:?} {m}: {}", rec[m]);
            assert_eq!(u["elements"], 5 * 64, "{args:?} {m}: {}", rec[m]);
            assert_eq!(u["reason"], "5 rows; the sub-floor tests need 8");
            assert!(rec[m]["systematic"].is_null());
        }
        // Selections have no systematic test: nothing to say of them.
        let sel = j["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["hook"] == "blk.1.moe_topk_ids")
            .unwrap();
        assert!(sel["replay"].get("systematic_untested").is_none());
        let report = String::from_utf8_lossy(&o.stderr).to_string();
        let lines: Vec<&str> = report
            .lines()
            .filter(|l| l.starts_with("sub-floor tests not run"))
            .collect();
        assert_eq!(
            lines,
            ["sub-floor tests not run: 61 hooks with 5 rows < 8 (prompt too short)"],
            "{report}"
        );
        assert!(report.lines().all(|l| l.chars().count() <= 100), "{report}");
    }
    // Long prompts: the committed candidates.
    for (trace, line) in [
        ("glm5-tiny.dsa.cpu-bf16", None),
        (
            "glm5-tiny.long.cpu-bf16",
            Some("sub-floor tests not run: 2 hooks with 42 values < 64"),
        ),
    ] {
        let t =
            crate::common::fixtures("engines").join(format!("glm5-tiny/{trace}.trace.safetensors"));
        let (code, j, report) = crate::common::run_trace(cache.path(), &gguf, &t, &[]);
        assert_eq!(code, 0, "{trace}: {report}");
        let untested: Vec<&str> = j["records"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| {
                ["replay", "chained"]
                    .iter()
                    .any(|m| r[m].get("systematic_untested").is_some())
            })
            .map(|r| r["hook"].as_str().unwrap())
            .collect();
        let shown: Vec<&str> = report
            .lines()
            .filter(|l| l.starts_with("sub-floor tests not run"))
            .collect();
        match line {
            None => {
                assert!(untested.is_empty(), "{trace}: {untested:?}");
                assert!(shown.is_empty(), "{trace}: {report}");
            }
            Some(line) => {
                assert_eq!(
                    untested,
                    ["blk.1.moe_weights", "blk.2.moe_weights"],
                    "{trace}"
                );
                assert_eq!(shown, [line], "{trace}: {report}");
            }
        }
    }
}
