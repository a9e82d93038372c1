//! The CPU reference against the float64 golden traces of `fixtures/models/` (made by
//! `reference/fixtures/make_model_fixtures.py` from transformers, cross-checked there against a numpy
//! forward of the spec), and its determinism across thread counts.
//!
//! Every `*.trace.safetensors` lists in its metadata the GGUFs it applies to (`models`) and the
//! prompt (`tokens`); each pair runs here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use glmdiff::compare::{compare, Metrics};
use glmdiff::driver::{self, Plan};
use glmdiff::engine::cpu::CpuEngine;
use glmdiff::engine::{HostData, HostTensor};
use glmdiff::explain::fault::{Fault, FaultEngine, FaultKind};
use glmdiff::gguf::Model;
use glmdiff::model::Weights;
use glmdiff::trace::{read_trace, HookFilter, Trace, TraceSink, TraceTensor, TraceValues};

/// Largest relative L2 error `|ref - golden| / |golden|` allowed at any hook.
///
/// The reference stores every weight and activation in f32 (relative rounding 2^-24 ≈ 6e-8 per
/// stored value) and accumulates in f64, so each step adds about one f32 rounding to what it
/// receives, times the step's amplification. Measured over every golden pair of the fixtures
/// (whole forward pass, chained): a correct run is at most 2.4e-7 (glm5-tiny short,
/// `blk.2.indexer_scores`); the same run with every RMSNorm's eps confused (1e-6 for 1e-5 or
/// the reverse, [`an_eps_confusion_exceeds_the_golden_limit`]) is at least 7.8e-6 (dsv3-tiny-q
/// short, `blk.0.ffn_out`) and at most 2.2e-5. 1.5e-6 sits between the two with a margin of 6.2x
/// above the correct run and 5.2x below the smallest eps confusion; layout bugs move hooks by
/// O(1).
const MAX_REL_L2: f64 = 1.5e-6;

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models")
}

/// `(trace, gguf)` pairs of every golden trace under `fixtures/models/*/`.
fn golden_pairs() -> Vec<(PathBuf, PathBuf)> {
    crate::common::trace_pairs(&fixtures_root(), &fixtures_root())
}

/// Runs the whole forward pass of `gguf` on `tokens`, keeping the hooks `filter` wants.
fn run_reference(gguf: &Path, tokens: &[u32], filter: HookFilter) -> BTreeMap<String, HostTensor> {
    run_with_eps(gguf, tokens, filter, None)
}

/// [`run_reference`], with every RMSNorm's eps replaced by `eps` when given (the `norm_eps`
/// fault of `explain::fault` around the CPU reference).
fn run_with_eps(
    gguf: &Path,
    tokens: &[u32],
    filter: HookFilter,
    eps: Option<f64>,
) -> BTreeMap<String, HostTensor> {
    let model = Model::open(gguf).unwrap();
    let weights = Weights::new(&model).unwrap();
    let engine = CpuEngine::new(&weights);
    let mut sink = TraceSink::new(filter);
    let plan = Plan::full(&weights).unwrap();
    match eps {
        None => driver::run(&engine, &weights, tokens, &plan, &mut sink).unwrap(),
        Some(e) => {
            let faulty = FaultEngine::new(
                &engine,
                &weights,
                vec![Fault::new(FaultKind::NormEps(e), None)],
            );
            driver::run(&faulty, &weights, tokens, &plan, &mut sink).unwrap()
        }
    };
    sink.into_tensors()
}

/// The largest relative L2 error over the float hooks of `mine` against `golden`, and its hook.
fn worst_rel_l2(case: &str, mine: &BTreeMap<String, HostTensor>, golden: &Trace) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for (name, g) in &golden.tensors {
        let g = golden_host(name, g);
        if let Metrics::Float(f) =
            compare(&g, &mine[name]).unwrap_or_else(|e| panic!("{case}: {name}: {e}"))
        {
            if f.rel_l2 > worst.0 {
                worst = (f.rel_l2, name.clone());
            }
        }
    }
    worst
}

/// A golden trace tensor as a host tensor (F64 rounded to f32, integers to i32).
fn golden_host(name: &str, t: &TraceTensor) -> HostTensor {
    match &t.values {
        TraceValues::Float(v) => {
            HostTensor::f32(t.shape.clone(), v.iter().map(|&x| x as f32).collect())
        }
        TraceValues::Int(v) => HostTensor::i32(
            t.shape.clone(),
            v.iter()
                .map(|&x| i32::try_from(x).unwrap_or_else(|_| panic!("{name}: index {x}")))
                .collect(),
        ),
    }
    .unwrap()
}

fn check_against_golden(trace_path: &Path, gguf: &Path, golden: &Trace) -> f64 {
    let tokens = golden.tokens().unwrap();
    let mine = run_reference(gguf, &tokens, HookFilter::default());
    let case = format!(
        "{} on {}",
        gguf.file_name().unwrap().to_string_lossy(),
        trace_path.file_name().unwrap().to_string_lossy()
    );
    let mine_names: Vec<&String> = mine.keys().collect();
    let golden_names: Vec<&String> = golden.tensors.keys().collect();
    assert_eq!(mine_names, golden_names, "{case}: hook names differ");

    let mut worst = (0.0f64, String::new());
    for (name, g) in &golden.tensors {
        let m = &mine[name];
        let g = golden_host(name, g);
        // glmdiff::compare is the metric code `run` and `compare` use; the golden values are
        // transformers', rounded to f32 here (2^-24 relative, far below the bound).
        match compare(&g, m).unwrap_or_else(|e| panic!("{case}: {name}: {e}")) {
            Metrics::Ids(ids) => assert_eq!(
                ids.set_equal_rows, ids.rows,
                "{case}: {name} selected sets differ in rows {:?}",
                ids.differing_rows
            ),
            Metrics::Float(f) => {
                assert_eq!(
                    f.nonfinite_mismatch, 0,
                    "{case}: {name}: non-finite values differ"
                );
                let r = f.rel_l2;
                if r > worst.0 {
                    worst = (r, name.clone());
                }
                assert!(
                    r <= MAX_REL_L2,
                    "{case}: {name} relative L2 error {r:.3e} > {MAX_REL_L2:e}"
                );
            }
        }
    }
    // Identical top-1 token at every position.
    let lm: Vec<f64> = mine["logits"]
        .as_f32("logits")
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let lg = golden.get("logits").unwrap();
    let vocab = lg.shape[1];
    let argmax = |v: &[f64]| {
        v.iter()
            .enumerate()
            .fold(
                (0, f64::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0
    };
    for (t, (a, b)) in lm
        .chunks(vocab)
        .zip(lg.floats("logits").unwrap().chunks(vocab))
        .enumerate()
    {
        assert_eq!(argmax(a), argmax(b), "{case}: top-1 token at position {t}");
    }
    eprintln!(
        "{case}: {} hooks, worst rel L2 {:.3e} at {}",
        golden.tensors.len(),
        worst.0,
        worst.1
    );
    worst.0
}

#[test]
fn reference_matches_golden_traces_at_every_hook() {
    let mut overall = 0.0f64;
    for (trace_path, gguf) in golden_pairs() {
        let golden = read_trace(&trace_path).unwrap();
        overall = overall.max(check_against_golden(&trace_path, &gguf, &golden));
    }
    eprintln!("worst rel L2 over all fixtures: {overall:.3e}");
}

/// The limit is tight enough to matter: the CPU reference with every RMSNorm's eps confused
/// (1e-6 for a model of 1e-5, and the reverse) exceeds [`MAX_REL_L2`] against every golden trace.
#[test]
fn an_eps_confusion_exceeds_the_golden_limit() {
    let mut least = f64::INFINITY;
    for (trace_path, gguf) in golden_pairs() {
        let golden = read_trace(&trace_path).unwrap();
        let model = Model::open(&gguf).unwrap();
        let own = Weights::new(&model).unwrap().hparams().rms_eps;
        let other = if own > 5e-6 { 1e-6 } else { 1e-5 };
        let tokens = golden.tokens().unwrap();
        let mine = run_with_eps(&gguf, &tokens, HookFilter::default(), Some(other));
        let case = format!(
            "{} (eps {own:e} -> {other:e}) on {}",
            gguf.file_name().unwrap().to_string_lossy(),
            trace_path.file_name().unwrap().to_string_lossy()
        );
        let (w, hook) = worst_rel_l2(&case, &mine, &golden);
        eprintln!("{case}: worst rel L2 {w:.3e} at {hook}");
        assert!(
            w > MAX_REL_L2,
            "{case}: an eps confusion stays within the limit: {w:.3e} <= {MAX_REL_L2:e} at {hook}"
        );
        least = least.min(w);
    }
    eprintln!("least worst rel L2 of an eps confusion over all fixtures: {least:.3e}");
}

/// Every hook, optional ones included, is bit-identical in a 1-thread and a 2-thread pool.
#[test]
fn reference_is_bit_identical_for_1_and_2_threads() {
    let all = || HookFilter {
        layers: None,
        globs: vec!["*".to_string()],
    };
    for (trace_path, gguf) in golden_pairs() {
        let tokens = read_trace(&trace_path).unwrap().tokens().unwrap();
        let run_in = |n: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
                .install(|| run_reference(&gguf, &tokens, all()))
        };
        let (one, two) = (run_in(1), run_in(2));
        assert_eq!(
            one.keys().collect::<Vec<_>>(),
            two.keys().collect::<Vec<_>>()
        );
        assert!(one.keys().any(|k| k.ends_with(".attn_probs")));
        for (name, a) in &one {
            let b = &two[name];
            assert_eq!(a.shape, b.shape, "{name}");
            let bits = |t: &HostTensor| -> Vec<u32> {
                match &t.data {
                    HostData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                    HostData::I32(v) => v.iter().map(|&x| x as u32).collect(),
                }
            };
            assert!(
                bits(a) == bits(b),
                "{}: {name} differs between 1 and 2 threads",
                gguf.display()
            );
        }
    }
}

/// Every hook, optional ones included, is bit-identical whichever SIMD build of the reference's
/// kernels runs: `glmdiff trace` of every golden pair's GGUF and prompt with `GLMDIFF_CPU_SIMD`
/// at `base` (SSE2: no fused multiply-add), `avx2` and `avx512` (a cap above what the CPU has
/// runs the widest it has, so on any machine at least two builds meet).
#[test]
fn reference_is_bit_identical_at_every_simd_build() {
    let dir = tempfile::tempdir().unwrap();
    let bits = |t: &TraceTensor| -> Vec<u64> {
        match &t.values {
            TraceValues::Float(v) => v.iter().map(|x| x.to_bits()).collect(),
            TraceValues::Int(v) => v.iter().map(|&x| x as u64).collect(),
        }
    };
    for (trace_path, gguf) in golden_pairs() {
        let tokens = read_trace(&trace_path).unwrap().tokens().unwrap();
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let run_at = |level: &str| -> Trace {
            let out = dir.path().join(format!("{level}.safetensors"));
            let r = std::process::Command::new(env!("CARGO_BIN_EXE_glmdiff"))
                .args(["trace", gguf.to_str().unwrap(), "--tokens", &ids.join(",")])
                .args(["--hook", "*", "--out", out.to_str().unwrap()])
                .env("GLMDIFF_CPU_SIMD", level)
                .output()
                .unwrap();
            assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
            read_trace(&out).unwrap()
        };
        let base = run_at("base");
        assert!(base.tensors.keys().any(|k| k.ends_with(".attn_probs")));
        for level in ["avx2", "avx512"] {
            let other = run_at(level);
            assert_eq!(
                base.tensors.keys().collect::<Vec<_>>(),
                other.tensors.keys().collect::<Vec<_>>()
            );
            for (name, a) in &base.tensors {
                assert!(
                    bits(a) == bits(&other.tensors[name]),
                    "{}: {name} differs between the base and {level} builds",
                    gguf.display()
                );
            }
        }
    }
}

fn glmdiff(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_glmdiff"))
        .args(args)
        .output()
        .expect("run glmdiff")
}

/// `glmdiff trace --prompt` tokenizes like transformers (the golden trace's ids), writes the
/// metadata keys of hooks.md, and `--layers`/`--hook` keep exactly the asked hooks.
#[test]
fn trace_command_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let (trace_path, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny."))
        .expect("a glm5-tiny golden trace");
    let golden = read_trace(&trace_path).unwrap();
    let prompt = golden.metadata["prompt"].clone();
    let out = dir.path().join("t.safetensors");
    let (g, o) = (gguf.to_str().unwrap(), out.to_str().unwrap());

    let r = glmdiff(&["trace", g, "--prompt", &prompt, "--out", o]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let t = read_trace(&out).unwrap();
    assert_eq!(t.tokens().unwrap(), golden.tokens().unwrap());
    for key in [
        "glmdiff_trace",
        "model",
        "architecture",
        "tokens",
        "engine",
        "dtype",
        "mode",
        "glmdiff_version",
    ] {
        assert!(t.metadata.contains_key(key), "metadata key {key}");
    }
    assert_eq!(t.metadata["architecture"], "glm-dsa");
    assert_eq!(t.metadata["mode"], "chained");
    assert_eq!(
        t.tensors.keys().collect::<Vec<_>>(),
        golden.tensors.keys().collect::<Vec<_>>()
    );
    assert_eq!(t.get("blk.1.indexer_topk").unwrap().dtype, "I32");

    let r = glmdiff(&[
        "trace",
        g,
        "--tokens",
        "1,2,3",
        "--layers",
        "1..2",
        "--hook",
        "blk.*.l_out",
        "--out",
        o,
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let t = read_trace(&out).unwrap();
    assert_eq!(t.tensors.keys().collect::<Vec<_>>(), vec!["blk.1.l_out"]);

    let r = glmdiff(&["trace", g, "--tokens", "1,999999", "--out", o]);
    assert_eq!(r.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("token id 999999 is outside the vocabulary")
    );
    let r = glmdiff(&["trace", g, "--tokens", "1", "--layers", "0..99", "--out", o]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("--layers 0..99 is out of range"));
}

/// `glmdiff trace` prints the five most likely next tokens after the prompt's last position: the
/// golden trace's (transformers') most likely one first, each log-probability its log softmax.
#[test]
fn trace_prints_the_most_likely_next_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (trace_path, gguf) = golden_pairs()
        .into_iter()
        .find(|(t, _)| t.to_string_lossy().contains("glm5-tiny."))
        .expect("a glm5-tiny golden trace");
    let golden = read_trace(&trace_path).unwrap();
    let tokens = golden.tokens().unwrap();
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = dir.path().join("t.safetensors");
    let r = glmdiff(&[
        "trace",
        gguf.to_str().unwrap(),
        "--tokens",
        &ids.join(","),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let text = String::from_utf8_lossy(&r.stdout).into_owned();
    let t = tokens.len();
    assert!(
        text.contains(&format!("next token after position {}:", t - 1)),
        "{text}"
    );
    // The golden logits' last row: its largest value and its log-sum-exp.
    let logits = golden.get("logits").unwrap();
    let vocab = *logits.shape.last().unwrap();
    let all = logits.floats("logits").unwrap();
    let last = &all[all.len() - vocab..];
    let (best, max) = last
        .iter()
        .copied()
        .enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |a, (i, v)| if v > a.1 { (i, v) } else { a },
        );
    let lse = max + last.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    // The table's rows (cells between `|`): rank, id, text, logit, logprob.
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| {
            l.split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect()
        })
        .filter(|c: &Vec<&str>| c.len() == 5 && c[0].parse::<u32>().is_ok())
        .collect();
    assert_eq!(rows.len(), 5, "{text}");
    assert_eq!(rows[0][0], "1", "{text}");
    assert_eq!(rows[0][1], best.to_string(), "{text}");
    let logprob: f64 = rows[0][4].parse().unwrap();
    assert!(
        (logprob - (max - lse)).abs() < 1e-3,
        "{logprob} vs {}",
        max - lse
    );
}

/// Regression: `trace --out x.npy` wrote a safetensors file under a `.npy` name, an output in a
/// missing directory failed only after the forward pass, and "no hook matched" printed Rust's
/// `Option`/`Vec` debug forms.
#[test]
fn trace_output_name_and_directory_are_checked_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let (_, gguf) = golden_pairs().into_iter().next().expect("a golden pair");
    let g = gguf.to_str().unwrap();
    let npy = dir.path().join("t.npy");
    let r = glmdiff(&["trace", g, "--tokens", "1", "--out", npy.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(e.contains("t.npy") && e.contains(".safetensors"), "{e}");
    assert!(!npy.exists());

    let missing = dir.path().join("no/such/dir/t.safetensors");
    let r = glmdiff(&[
        "trace",
        g,
        "--tokens",
        "1",
        "--out",
        missing.to_str().unwrap(),
    ]);
    let e = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(
        e.contains("no/such/dir") && e.contains("does not exist"),
        "{e}"
    );

    let out = dir.path().join("t.safetensors");
    let o = out.to_str().unwrap();
    let r = glmdiff(&[
        "trace", g, "--tokens", "1", "--hook", "nomatch*", "--out", o,
    ]);
    let e = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(
        e.contains("no hook matched --layers all --hook nomatch*"),
        "{e}"
    );
    assert!(!out.exists());
}
