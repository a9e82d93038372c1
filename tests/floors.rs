//! Floors a user cannot silently defeat: no floor a layout bug hides under (an FP8 indexer's,
//! `--precision '*=fp8'`), the precision of a trace that names none read from its values (or
//! refused), the router judged at the precision the trace or engine says it ran in, `--tol` and
//! precision overrides said in the header and the JSON and never widening flips, and `compare
//! --model` judging flips with `run`'s margins. Every doctored input is made here, in a temporary
//! directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glmdiff::engine::HostTensor;
use glmdiff::trace::{read_trace, write_trace, Mode, TraceMeta};
use serde_json::Value;

use crate::common::{fixtures, glmdiff_in, run_json};

fn model(dir: &str, file: &str) -> PathBuf {
    fixtures("models").join(dir).join(file)
}

fn engine_dump(dir: &str, file: &str) -> PathBuf {
    fixtures("engines").join(dir).join(file)
}

/// `glmdiff ARGS --json OUT` with a private cache: (exit code, JSON, text with messages joined).
fn run(tmp: &Path, args: &[&str]) -> (i32, Value, String) {
    run_json(&tmp.join("cache"), args, &tmp.join("r.json"))
}

/// A copy of trace `src` at `dst` (tensors as F32/I32) with metadata `dtype`, the extra keys
/// `extra` (besides `models`) and `edit` applied to its tensors.
fn doctored(
    src: &Path,
    dst: &Path,
    dtype: &str,
    extra: &[(&str, &str)],
    edit: impl FnOnce(&mut BTreeMap<String, HostTensor>),
) {
    let t = read_trace(src).unwrap();
    let mut tensors = crate::common::host_tensors(&t);
    edit(&mut tensors);
    let mut keys: BTreeMap<String, String> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    keys.insert("models".into(), t.metadata["models"].clone());
    let meta = TraceMeta {
        model: t.metadata["model"].clone(),
        architecture: t.metadata["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: "doctored copy".into(),
        dtype: dtype.into(),
        mode: Mode::Chained,
        extra: keys,
    };
    write_trace(dst, &tensors, &meta).unwrap();
}

fn scale(t: &mut HostTensor, f: f32) {
    if let Ok(v) = t.as_f32_mut("scaled") {
        v.iter_mut().for_each(|x| *x *= f);
    }
}

fn record<'a>(j: &'a Value, hook: &str) -> &'a Value {
    j["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["hook"] == hook)
        .unwrap_or_else(|| panic!("no record {hook}"))
}

fn notes(j: &Value) -> String {
    j["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The committed FP8-indexer dumps stay clean in both modes, judged with the indexer floor
/// their metadata sets (listed as an override from the trace); an indexer bug under the same
/// FP8 precision fails at its scores: the half-split RoPE injected into the CPU engine (0.44
/// against the floor of 0.1, where the whole indexer at fp8 allowed 1.22), and a doctored FP8
/// dump whose layer-1 scores are 25% too large (a softmax-scale bug, which selects the same keys).
#[test]
fn fp8_indexer_dumps_are_clean_and_indexer_bugs_under_fp8_fail() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let glm = model("glm5-tiny", "glm5-tiny-f32.gguf");
    let dump = engine_dump(
        "glm5-tiny",
        "glm5-tiny.dsa.cuda-bf16.fp8idx.trace.safetensors",
    );
    let dumps = [
        (glm.clone(), dump.clone()),
        (
            model("glm5-tiny-q", "glm5-tiny-q-mixed.gguf"),
            engine_dump(
                "glm5-tiny-q",
                "glm5-tiny-q.dsa.cuda-bf16.fp8idx.trace.safetensors",
            ),
        ),
    ];
    for (gguf, trace) in &dumps {
        for mode in ["replay", "both"] {
            let against = format!("trace:{}", trace.display());
            let (rc, j, text) = run(
                t,
                &[
                    "run",
                    gguf.to_str().unwrap(),
                    "--against",
                    &against,
                    "--mode",
                    mode,
                ],
            );
            assert_eq!(rc, 0, "{} --mode {mode}: {text}", trace.display());
            let o = &j["overrides"][0];
            assert_eq!(
                (&o["kind"], &o["glob"], &o["value"], &o["source"]),
                (
                    &Value::from("precision"),
                    &Value::from("blk.*.indexer_*"),
                    &Value::from("fp8"),
                    &Value::from("the trace's indexer_dtype")
                ),
                "{text}"
            );
            let scores = record(&j, "blk.0.indexer_scores");
            assert_eq!(scores["floor"], 0.1, "{text}");
            assert!(
                text.contains("override: the trace's indexer_dtype sets"),
                "{text}"
            );
        }
    }

    let tokens: Vec<String> = read_trace(&dump)
        .unwrap()
        .tokens()
        .unwrap()
        .iter()
        .map(u32::to_string)
        .collect();
    let (rc, j, text) = run(
        t,
        &[
            "run",
            glm.to_str().unwrap(),
            "--tokens",
            &tokens.join(","),
            "--against",
            "cpu",
            "--inject",
            "indexer_rope_neox",
            "--precision",
            "blk.*.indexer_*=fp8",
            "--mode",
            "replay",
        ],
    );
    assert_eq!(rc, 1, "{text}");
    let fd = &j["first_divergence"];
    assert_eq!(fd["hook"], "blk.0.indexer_scores", "{text}");
    assert_eq!(fd["allowed"], 0.1);
    assert!(fd["error"].as_f64().unwrap() > 0.25, "{fd}");

    let bad = t.join("fp8idx-scaled.safetensors");
    doctored(&dump, &bad, "bf16", &[("indexer_dtype", "fp8")], |m| {
        scale(m.get_mut("blk.1.indexer_scores").unwrap(), 1.25)
    });
    let against = format!("trace:{}", bad.display());
    let (rc, j, text) = run(t, &["run", glm.to_str().unwrap(), "--against", &against]);
    assert_eq!(rc, 1, "{text}");
    assert_eq!(
        j["first_divergence"]["hook"], "blk.1.indexer_scores",
        "{text}"
    );
}

/// `--precision '*=fp8'` (an engine computing every product in FP8) no longer lets a planted
/// expert swap through: every floor is capped, and the swap's 0.55 stays above it.
#[test]
fn fp8_everywhere_still_names_an_expert_swap() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = model("dsv3-tiny-q", "dsv3-tiny-q-mixed.gguf");
    let swap = engine_dump(
        "dsv3-tiny-q",
        "dsv3-tiny-q.long.cuda-bf16.expert_swap.trace.safetensors",
    );
    let clean = engine_dump(
        "dsv3-tiny-q",
        "dsv3-tiny-q.long.cuda-bf16.trace.safetensors",
    );
    for (trace, want) in [(&swap, 1), (&clean, 0)] {
        let against = format!("trace:{}", trace.display());
        let (rc, j, text) = run(
            tmp.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--against",
                &against,
                "--precision",
                "*=fp8",
            ],
        );
        assert_eq!(rc, want, "{text}");
        for r in j["records"].as_array().unwrap() {
            assert!(r["floor"].as_f64().unwrap() <= 0.1, "{}", r["hook"]);
        }
        if want == 1 {
            assert_eq!(j["first_divergence"]["hook"], "blk.1.moe_routed", "{text}");
        }
    }
}

/// A trace whose dtype names no precision (absent, or a word glmdiff does not know) is judged
/// by what its values say, said in a note: transformers' bf16 dump is bf16 with an f32 router
/// and stays clean; the float64 golden trace is f32, so a 1% error planted at one hook (under
/// bf16's floor, which such a trace used to get) fails there. A trace whose activations are
/// part bf16 and part not is refused (exit 2) unless `--precision '*=DTYPE'` says it.
#[test]
fn a_trace_without_a_dtype_is_judged_by_its_values() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let glm = model("glm5-tiny", "glm5-tiny-f32.gguf");
    let gguf = glm.to_str().unwrap();
    let bf16_dump = engine_dump("glm5-tiny", "glm5-tiny.long.cuda-bf16.trace.safetensors");
    let golden = model("glm5-tiny", "glm5-tiny.long.trace.safetensors");

    for dtype in ["", "int4 wizardry"] {
        let p = t.join("bf16-nodtype.safetensors");
        doctored(&bf16_dump, &p, dtype, &[], |_| {});
        let against = format!("trace:{}", p.display());
        let (rc, j, text) = run(t, &["run", gguf, "--against", &against]);
        assert_eq!(rc, 0, "{dtype:?}: {text}");
        let n = notes(&j);
        assert!(n.contains("its values say bf16 storage"), "{n}");
        assert!(
            n.contains("router hooks (e.g. blk.1.moe_logits) hold values bf16 cannot"),
            "{n}"
        );
        // The router is judged at f32 (a floor near 1e-6), the rest at bf16.
        assert!(
            record(&j, "blk.1.moe_probs")["floor"].as_f64().unwrap() < 1e-5,
            "{text}"
        );
        assert!(
            record(&j, "blk.1.attn_out")["floor"].as_f64().unwrap() > 1e-2,
            "{text}"
        );
    }

    let planted = t.join("golden-1pct.safetensors");
    doctored(&golden, &planted, "", &[], |m| {
        scale(m.get_mut("blk.1.attn_out").unwrap(), 1.01)
    });
    let against = format!("trace:{}", planted.display());
    let (rc, j, text) = run(t, &["run", gguf, "--against", &against, "--mode", "replay"]);
    assert_eq!(rc, 1, "{text}");
    assert_eq!(j["first_divergence"]["hook"], "blk.1.attn_out", "{text}");
    assert!(notes(&j).contains("its values say f32 storage"), "{text}");

    let mixed = t.join("bf16-mixed.safetensors");
    doctored(&bf16_dump, &mixed, "", &[], |m| {
        scale(m.get_mut("blk.1.attn_out").unwrap(), 1.01)
    });
    let against = format!("trace:{}", mixed.display());
    let (rc, _, text) = run(t, &["run", gguf, "--against", &against]);
    assert_eq!(rc, 2, "{text}");
    for want in [
        "trace: ",
        "bf16-mixed.safetensors: the trace has no dtype and its values do not tell one",
        "hold numbers neither can (e.g. blk.1.attn_out)",
        "--precision '*=DTYPE'",
    ] {
        assert!(text.contains(want), "{want:?} not in: {text}");
    }
    let (rc, j, text) = run(
        t,
        &["run", gguf, "--against", &against, "--precision", "*=bf16"],
    );
    // A 1% gain is under the bf16 floor of relative L2, but rounding cannot make it.
    assert_eq!(rc, 1, "{text}");
    assert!(notes(&j).contains("--precision '*=bf16' sets it"), "{text}");
    assert_eq!(j["first_divergence"]["hook"], "blk.1.attn_out", "{text}");
    let note = j["first_divergence"]["note"].as_str().unwrap_or_default();
    let gain: f64 = note
        .split("systematic: gain ")
        .nth(1)
        .and_then(|x| x.split_whitespace().next())
        .and_then(|x| x.parse().ok())
        .unwrap_or(f64::NAN);
    assert!((gain - 1.01).abs() < 2e-3, "{note}");
}

/// The router's precision is read from the trace: a dtype that says only `bf16` judges the
/// router at bf16's floors; `router_dtype: f32` (or the dumps' prose, "router ... f32") at
/// f32's, with the router matrix at the trace's storage; a `router_dtype` that is no dtype is
/// refused.
#[test]
fn the_router_precision_comes_from_the_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let gguf = model("dsv3-tiny", "dsv3-tiny-f32.gguf");
    let dump = engine_dump("dsv3-tiny", "dsv3-tiny.short.cuda-bf16.trace.safetensors");
    let floor_of = |j: &Value, h: &str| record(j, h)["floor"].as_f64().unwrap();
    let p = t.join("d.safetensors");
    let against = format!("trace:{}", p.display());
    let args = ["run", gguf.to_str().unwrap(), "--against", &against];

    doctored(&dump, &p, "bf16", &[], |_| {});
    let (rc, plain, text) = run(t, &args);
    assert_eq!(rc, 0, "{text}");
    assert!(floor_of(&plain, "blk.1.moe_probs") > 1e-2, "{text}");

    doctored(&dump, &p, "bf16", &[("router_dtype", "f32")], |_| {});
    let (rc, f32r, text) = run(t, &args);
    assert_eq!(rc, 0, "{text}");
    for h in ["blk.1.moe_probs", "blk.1.moe_weights"] {
        assert!(floor_of(&f32r, h) < 2e-6, "{h}: {text}");
    }
    // The logits: f32 arithmetic on a bf16 matrix, between f32's floor and bf16's.
    let logits = floor_of(&f32r, "blk.1.moe_logits");
    assert!(
        logits > 1e-2 && logits < floor_of(&plain, "blk.1.moe_logits"),
        "{text}"
    );
    assert!(
        notes(&f32r).contains("computes in f32 from a bf16 matrix"),
        "{text}"
    );
    assert_eq!(
        floor_of(&f32r, "blk.1.attn_out"),
        floor_of(&plain, "blk.1.attn_out")
    );

    let (rc, prose, text) = run(
        t,
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &format!("trace:{}", dump.display()),
        ],
    );
    assert_eq!(rc, 0, "{text}");
    assert_eq!(
        floor_of(&prose, "blk.1.moe_probs"),
        floor_of(&f32r, "blk.1.moe_probs")
    );

    doctored(&dump, &p, "bf16", &[("router_dtype", "int4")], |_| {});
    let (rc, _, text) = run(t, &args);
    assert_eq!(rc, 2, "{text}");
    assert!(
        text.contains("d.safetensors: metadata router_dtype \"int4\" is not a dtype"),
        "{text}"
    );
}

/// `--tol '*=10'` is said in the header, the verdict line and the JSON, with the hooks it
/// decides; the flips keep the tolerances of their scores' precision floors.
#[test]
fn tol_overrides_are_said_and_leave_flips_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let gguf = model("glm5-tiny", "glm5-tiny-f32.gguf");
    let dump = engine_dump("glm5-tiny", "glm5-tiny.dsa.cuda-bf16.trace.safetensors");
    let against = format!("trace:{}", dump.display());
    let base = ["run", gguf.to_str().unwrap(), "--against", &against];
    let (rc, plain, text) = run(t, &base);
    assert_eq!(rc, 0, "{text}");
    assert!(plain["overrides"].as_array().unwrap().is_empty());
    assert!(!text.contains("override:"), "{text}");
    let mut args = base.to_vec();
    args.extend(["--tol", "*=10"]);
    let (rc, wide, text) = run(t, &args);
    assert_eq!(rc, 0, "{text}");
    let n = wide["records"].as_array().unwrap().len();
    assert_eq!(
        wide["overrides"],
        serde_json::json!([{"kind": "tol", "glob": "*", "value": "10", "source": "--tol", "hooks": n}])
    );
    assert!(
        text.contains(&format!(
            "override: --tol '*=10' replaces the floor of {n} compared hooks"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "OK: every compared hook is within its floor ({n} of those floors set by --tol, not by precision)"
        )),
        "{text}"
    );
    // Every flip has the tolerance it had without --tol.
    let flips = |j: &Value| -> Vec<(String, String)> {
        let mut v = Vec::new();
        for r in j["records"].as_array().unwrap() {
            for m in ["replay", "chained"] {
                let f = &r[m]["flips"];
                if !f.is_null() {
                    v.push((r["hook"].to_string(), f.to_string()));
                }
            }
        }
        v
    };
    assert!(!flips(&plain).is_empty());
    assert_eq!(flips(&plain), flips(&wide));
}

/// `compare --model` reads the selection bias, the expert groups and the floors by step from
/// the GGUF: the DeepSeek dump's expert flip then has `run`'s margin and verdict. Without it, a
/// note says what the margins and floors lack; a model of another architecture is refused.
#[test]
fn compare_with_the_model_has_runs_margins() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let gguf = model("dsv3-tiny", "dsv3-tiny-f32.gguf");
    let golden = model("dsv3-tiny", "dsv3-tiny.long.trace.safetensors");
    let dump = engine_dump("dsv3-tiny", "dsv3-tiny.long.cuda-bf16.trace.safetensors");
    let first_flip = |j: &Value| -> (f64, f64, String) {
        let r = record(j, "blk.2.moe_topk_ids");
        let c = &r["chained"];
        let f = &c["flips"]["first"];
        (
            f["margin"].as_f64().unwrap(),
            f["tolerance"].as_f64().unwrap(),
            c["status"].as_str().unwrap().to_string(),
        )
    };
    let (rc_run, ran, text) = run(
        t,
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &format!("trace:{}", dump.display()),
            "--mode",
            "chained",
        ],
    );
    assert_eq!(rc_run, 0, "{text}");
    let cmp = ["compare", golden.to_str().unwrap(), dump.to_str().unwrap()];
    let (_, without, text) = run(t, &cmp);
    assert!(
        notes(&without).contains("margins ignore the selection bias (exp_probs_b)"),
        "{text}"
    );
    let mut args = cmp.to_vec();
    args.extend(["--model", gguf.to_str().unwrap()]);
    let (rc, with, text) = run(t, &args);
    assert_eq!(rc, rc_run, "{text}");
    assert!(!notes(&with).contains("--model"), "{text}");
    let (a, b) = (first_flip(&ran), first_flip(&with));
    assert!(
        (a.0 - b.0).abs() < 1e-9,
        "margins: run {a:?}, compare {b:?}"
    );
    // The tolerance is bounded below by the largest difference between the two sides' scores in
    // the row: run's reference computes them, compare reads the golden trace's f32 values, which
    // moves that bound in its last digits.
    assert!(
        (a.1 - b.1).abs() < 1e-4 * a.1,
        "tolerances: run {a:?}, compare {b:?}"
    );
    assert_eq!(a.2, b.2);
    // Without the bias the margin is unknown: the flip is counted, not judged.
    let f = &record(&without, "blk.2.moe_topk_ids")["chained"]["flips"];
    assert_eq!(f["judged"], Value::Bool(false), "{f}");
    assert!(f["first"]["margin"].is_null(), "{f}");

    let mut args = cmp.to_vec();
    let glm = model("glm5-tiny", "glm5-tiny-f32.gguf");
    args.extend(["--model", glm.to_str().unwrap()]);
    let (rc, _, text) = run(t, &args);
    assert_eq!(rc, 2, "{text}");
    assert!(
        text.contains("compare: --model") && text.contains("is a glm-dsa model"),
        "{text}"
    );
}

/// `tf32` is its own precision: products round their operands to a 10-bit mantissa, so a
/// projection's floor is far above f32's and under f16's; `f32` keeps f32's.
#[test]
fn tf32_is_not_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = model("glm5-tiny", "glm5-tiny-f32.gguf");
    let floor = |dtype: &str| {
        let p = format!("blk.*={dtype}");
        let (rc, j, text) = run(
            tmp.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--tokens",
                "1,2,3",
                "--against",
                "cpu",
                "--layer",
                "0",
                "--precision",
                &p,
            ],
        );
        assert_eq!(rc, 0, "{text}");
        (
            record(&j, "blk.0.q_a")["floor"].as_f64().unwrap(),
            record(&j, "blk.0.attn_norm")["floor"].as_f64().unwrap(),
        )
    };
    let (f32_lin, f32_norm) = floor("f32");
    let (tf32_lin, tf32_norm) = floor("tf32");
    let (f16_lin, _) = floor("f16");
    assert!(
        tf32_lin > 100.0 * f32_lin && tf32_lin < f16_lin,
        "{f32_lin} {tf32_lin} {f16_lin}"
    );
    assert_eq!(tf32_norm, f32_norm);
}

/// A case written by `run --repro` for a trace without a dtype carries the precision the run
/// judged by, so `step` judges the same; a case whose candidate dtype names none is judged by
/// its stored output's values, said in a note.
#[test]
fn a_case_keeps_the_precision_its_run_judged_by() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let gguf = model("glm5-tiny", "glm5-tiny-f32.gguf");
    let golden = model("glm5-tiny", "glm5-tiny.long.trace.safetensors");
    let planted = t.join("golden-1pct.safetensors");
    doctored(&golden, &planted, "", &[], |m| {
        scale(m.get_mut("blk.1.attn_out").unwrap(), 1.01)
    });
    let case = t.join("case");
    let (rc, _, text) = run(
        t,
        &[
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &format!("trace:{}", planted.display()),
            "--mode",
            "replay",
            "--repro",
            case.to_str().unwrap(),
        ],
    );
    assert_eq!(rc, 1, "{text}");
    let header = case.join("case.json");
    let mut h: Value = serde_json::from_str(&std::fs::read_to_string(&header).unwrap()).unwrap();
    assert_eq!(h["candidate_dtype"], "f32 storage, f32 accumulation", "{h}");
    let step = |t: &Path| {
        let o = glmdiff_in(&t.join("cache"), &["step", case.to_str().unwrap()]);
        (o.status.code().unwrap(), crate::common::output_text(&o))
    };
    let (rc, text) = step(t);
    assert_eq!(rc, 1, "{text}");
    h["candidate_dtype"] = Value::from("");
    std::fs::write(&header, serde_json::to_string_pretty(&h).unwrap()).unwrap();
    let (rc, text) = step(t);
    assert_eq!(rc, 1, "{text}");
    assert!(
        text.contains("its stored output's values are f32 numbers"),
        "{text}"
    );
}
