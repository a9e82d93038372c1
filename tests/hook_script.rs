//! The hook script, the Python package `python/glmdiff_hooks`, checked without Python: the hook
//! list and metadata keys it reads from its `hooks.json` against glmdiff's own steps on every
//! fixture model, the `model::steps::point` names and the tables of docs/hooks.md; and a trace its
//! writer made (`fixtures/hook_writer/`, values from the float64 transformers golden trace) read by
//! glmdiff's trace reader with the model's shapes, the golden values and the metadata, and run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use glmdiff::driver::Plan;
use glmdiff::gguf::Model;
use glmdiff::model::steps::{expert_hook, point};
use glmdiff::model::{HParams, Weights};
use glmdiff::trace::{is_optional_point, read_trace, TraceValues};
use serde_json::Value;

use crate::common::{fixtures, glmdiff_in, output_text, repo_root};

/// The fixture GGUFs: both architectures, plain and quantized.
const MODELS: [&str; 4] = [
    "glm5-tiny/glm5-tiny-f32.gguf",
    "glm5-tiny-q/glm5-tiny-q-mixed.gguf",
    "dsv3-tiny/dsv3-tiny-f32.gguf",
    "dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
];

fn hooks_json_path() -> PathBuf {
    repo_root().join("python/glmdiff_hooks/hooks.json")
}

fn hooks_json() -> Value {
    let p = hooks_json_path();
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// One point of `hooks.json`: name, condition (`when`), number of dimensions, ids or floats.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Point {
    name: String,
    when: String,
    rank: u64,
    ids: bool,
}

fn points(v: &Value) -> Vec<Point> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| Point {
            name: p["point"].as_str().unwrap().to_string(),
            when: p["when"].as_str().unwrap_or("always").to_string(),
            rank: p["rank"].as_u64().unwrap(),
            ids: p["ids"].as_bool().unwrap_or(false),
        })
        .collect()
}

/// The package's `expected_hooks` (glmdiff_hooks/names.py) for a model, from `hooks.json`'s
/// per-layer conditions, in its order.
fn package_hooks(spec: &Value, hp: &HParams) -> Vec<String> {
    let mut out: Vec<String> = points(&spec["global_first"])
        .into_iter()
        .map(|p| p.name)
        .collect();
    let layer = points(&spec["layer_points"]);
    for l in 0..hp.n_layer {
        for p in &layer {
            let on = match p.when.as_str() {
                "always" => true,
                "q_lora" => hp.q_lora_rank.is_some(),
                "dsa" => hp.indexer.is_some(),
                "dense" => hp.is_dense(l),
                "moe" => !hp.is_dense(l),
                other => panic!("hooks.json: unknown condition {other:?} of {}", p.name),
            };
            if on {
                out.push(format!("blk.{l}.{}", p.name));
            }
        }
    }
    out.extend(points(&spec["global_last"]).into_iter().map(|p| p.name));
    out
}

/// Every hook glmdiff's full forward pass produces, in the order of its steps.
fn glmdiff_hooks_of(w: &Weights<'_>) -> Vec<String> {
    let plan = Plan::full(w).unwrap();
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for s in &plan.steps {
        for o in &s.outputs {
            if seen.insert(o.clone()) {
                out.push(o.clone());
            }
        }
    }
    out
}

/// The package's hook list is exactly the hooks glmdiff computes, in the same order, on every
/// fixture model (GLM-5 with its indexer and DeepSeek-V3, dense and MoE layers).
#[test]
fn package_hook_list_is_glmdiffs_on_every_fixture_model() {
    let spec = hooks_json();
    for f in MODELS {
        let model = Model::open(&fixtures("models").join(f)).unwrap();
        let w = Weights::new(&model).unwrap();
        let hp = w.hparams();
        if let Some(ix) = &hp.indexer {
            // the package's `dsa` condition puts both indexer points on every layer
            assert!(
                ix.full.iter().all(|&x| x),
                "{f}: a layer shares its selection"
            );
        }
        let ours = glmdiff_hooks_of(&w);
        let theirs = package_hooks(&spec, hp);
        assert_eq!(theirs, ours, "{f}: hooks.json against glmdiff's steps");
    }
}

/// The package's points are the `model::steps::point` names, and its optional points are the
/// ones glmdiff only produces when asked.
#[test]
fn package_points_are_glmdiffs_point_names() {
    let spec = hooks_json();
    let consts: Vec<&str> = point::LAYER
        .iter()
        .copied()
        .chain([
            point::ATTN_PROBS,
            point::TOKEN_EMBD,
            point::RESULT_NORM,
            point::LOGITS,
        ])
        .collect();
    let layer = points(&spec["layer_points"]);
    let optional = points(&spec["optional_layer_points"]);
    let global: Vec<Point> = points(&spec["global_first"])
        .into_iter()
        .chain(points(&spec["global_last"]))
        .collect();
    let mut package: BTreeSet<&str> = layer.iter().map(|p| p.name.as_str()).collect();
    package.extend(global.iter().map(|p| p.name.as_str()));
    for p in &layer {
        assert!(!is_optional_point(&p.name), "{}", p.name);
    }
    let mut expert = false;
    for p in &optional {
        if p.name.contains("{e}") {
            // the package's pattern, with an expert number, is glmdiff's expert hook
            let name = format!("blk.3.{}", p.name.replace("{e}", "7"));
            assert_eq!(name, expert_hook(3, 7));
            assert!(is_optional_point(&name["blk.3.".len()..]));
            expert = true;
        } else {
            assert!(is_optional_point(&p.name), "{}", p.name);
            package.insert(p.name.as_str());
        }
    }
    assert!(expert, "hooks.json has no per-expert point");
    let consts: BTreeSet<&str> = consts.into_iter().collect();
    assert_eq!(package, consts);
}

/// The tables of docs/hooks.md: per-layer points, optional points, global hooks (each with its
/// number of dimensions and whether it holds ids) and the metadata keys (required or not).
#[derive(Debug, Default, PartialEq)]
struct DocTables {
    layer: BTreeMap<String, (u64, bool)>,
    optional: BTreeMap<String, (u64, bool)>,
    global: BTreeMap<String, (u64, bool)>,
    keys: BTreeMap<String, bool>,
}

/// Number of top-level comma-separated parts of a shape such as `[T, min(top_k, T)]`, and
/// whether the cell says `I32`.
fn doc_shape(cell: &str) -> (u64, bool) {
    let inner = &cell[cell.find('[').unwrap() + 1..cell.find(']').unwrap()];
    let mut depth = 0i32;
    let mut parts = 1;
    for c in inner.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => parts += 1,
            _ => {}
        }
    }
    (parts, cell.contains("I32"))
}

/// The names in backquotes of a table cell before any parenthesis: "`ffn_gate`, `ffn_up`" gives
/// both; "`exp.{e}.out` (`blk.{L}.exp.{e}.out`)" the first.
fn doc_names(cell: &str) -> Vec<String> {
    let head = cell.split(" (").next().unwrap();
    head.split('`')
        .enumerate()
        .filter(|(i, s)| i % 2 == 1 && !s.is_empty())
        .map(|(_, s)| s.to_string())
        .collect()
}

fn parse_docs(text: &str) -> DocTables {
    let mut t = DocTables::default();
    let mut section = String::new();
    let mut table_in_section = 0;
    let mut in_table = false;
    for line in text.lines() {
        if line.starts_with("## ") {
            section = line.to_string();
            table_in_section = 0;
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let cells: Vec<&str> = line
            .trim_matches('|')
            .split(" | ")
            .map(|c| c.trim())
            .collect();
        if !in_table {
            in_table = true; // the header row
            table_in_section += 1;
            continue;
        }
        if cells[0].starts_with("---") {
            continue;
        }
        let names = doc_names(cells[0]);
        if section.starts_with("## Per layer") {
            let target = if table_in_section == 1 {
                &mut t.layer
            } else {
                &mut t.optional
            };
            for n in names {
                target.insert(n, doc_shape(cells[1]));
            }
        } else if section.starts_with("## Global") {
            for n in names {
                t.global.insert(n, doc_shape(cells[1]));
            }
        } else if section.starts_with("## Trace files") && table_in_section == 1 {
            for n in names {
                t.keys.insert(n, cells[1] == "yes");
            }
        }
    }
    t
}

/// The differences between `hooks.json` and the tables of docs/hooks.md (empty when they agree).
fn docs_vs_package(docs: &DocTables, spec: &Value) -> Vec<String> {
    let table = |v: &Value| -> BTreeMap<String, (u64, bool)> {
        points(v)
            .into_iter()
            .map(|p| (p.name, (p.rank, p.ids)))
            .collect()
    };
    let mut global = table(&spec["global_first"]);
    global.extend(table(&spec["global_last"]));
    let mut keys: BTreeMap<String, bool> = strings(&spec["metadata"]["required"])
        .into_iter()
        .map(|k| (k, true))
        .collect();
    keys.extend(
        strings(&spec["metadata"]["optional"])
            .into_iter()
            .map(|k| (k, false)),
    );
    let mut diffs = Vec::new();
    fn diff<V: PartialEq + std::fmt::Debug>(
        what: &str,
        doc: &BTreeMap<String, V>,
        pkg: &BTreeMap<String, V>,
        out: &mut Vec<String>,
    ) {
        for (k, v) in doc {
            match pkg.get(k) {
                None => out.push(format!(
                    "{what}: {k} is in docs/hooks.md, not in hooks.json"
                )),
                Some(p) if p != v => out.push(format!("{what}: {k}: docs {v:?}, hooks.json {p:?}")),
                _ => {}
            }
        }
        for k in pkg.keys().filter(|k| !doc.contains_key(*k)) {
            out.push(format!(
                "{what}: {k} is in hooks.json, not in docs/hooks.md"
            ));
        }
    }
    diff(
        "per-layer point",
        &docs.layer,
        &table(&spec["layer_points"]),
        &mut diffs,
    );
    diff(
        "optional point",
        &docs.optional,
        &table(&spec["optional_layer_points"]),
        &mut diffs,
    );
    diff("global hook", &docs.global, &global, &mut diffs);
    diff("metadata key", &docs.keys, &keys, &mut diffs);
    diffs
}

fn docs_text() -> String {
    std::fs::read_to_string(repo_root().join("docs/hooks.md")).unwrap()
}

/// hooks.json and docs/hooks.md list the same points (with their dimensions and id hooks) and the
/// same metadata keys, required or optional.
#[test]
fn package_hook_list_and_metadata_keys_are_the_docs_tables() {
    let docs = parse_docs(&docs_text());
    assert_eq!(docs.layer.len(), 25, "{docs:?}");
    assert_eq!(docs.optional.len(), 2, "{docs:?}");
    assert_eq!(docs.global.len(), 3, "{docs:?}");
    assert!(docs.keys.len() >= 12, "{docs:?}");
    let diffs = docs_vs_package(&docs, &hooks_json());
    assert!(diffs.is_empty(), "{diffs:#?}");
}

/// The comparison is not vacuous: a docs table missing a row and a hooks.json with a renamed
/// point, a wrong dimension count and a key made optional (all made here) are each named.
#[test]
fn a_planted_disagreement_with_the_docs_is_named() {
    let spec = hooks_json();
    let text = docs_text();
    let row = text
        .lines()
        .find(|l| l.starts_with("| `kv_a_norm` |"))
        .unwrap();
    let docs = parse_docs(&text.replace(&format!("{row}\n"), ""));
    assert_eq!(
        docs_vs_package(&docs, &spec),
        ["per-layer point: kv_a_norm is in hooks.json, not in docs/hooks.md"]
    );
    let mut bad = spec.clone();
    for p in bad["layer_points"].as_array_mut().unwrap() {
        if p["point"] == "moe_probs" {
            p["point"] = "moe_prob".into();
        }
        if p["point"] == "q_pe_rope" {
            p["rank"] = 2.into();
        }
    }
    bad["metadata"]["required"] = serde_json::json!(["glmdiff_trace", "model"]);
    let diffs = docs_vs_package(&parse_docs(&text), &bad);
    for want in [
        "per-layer point: moe_probs is in docs/hooks.md, not in hooks.json",
        "per-layer point: moe_prob is in hooks.json, not in docs/hooks.md",
        "per-layer point: q_pe_rope: docs (3, false), hooks.json (2, false)",
        "metadata key: tokens is in docs/hooks.md, not in hooks.json",
    ] {
        assert!(diffs.iter().any(|d| d == want), "{want}: {diffs:#?}");
    }
}

/// FNV-1a 64 as glmdiff computes it (the hash the writer fixture's manifest records).
fn fnv(bytes: &[u8]) -> String {
    format!("{:016x}", glmdiff::util::hash::fnv1a64(bytes))
}

fn writer_fixture() -> (PathBuf, Value) {
    let dir = fixtures("hook_writer");
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("MANIFEST.json")).unwrap()).unwrap();
    let files = m["files"].as_object().unwrap();
    assert_eq!(files.len(), 1);
    (dir.join(files.keys().next().unwrap()), m)
}

fn floats(v: &TraceValues) -> &[f64] {
    match v {
        TraceValues::Float(f) => f,
        TraceValues::Int(_) => panic!("ints where floats were expected"),
    }
}

/// The trace the package's pure writer made is read by glmdiff: the manifest's hash, every
/// required metadata key with the package's version, each hook's shape from the model's
/// dimensions, its stored type (F32, F64 for the logits, I32 for ids) and its values: the
/// float64 golden trace's, rounded to f32 where stored as F32.
#[test]
fn writer_fixture_is_read_with_the_models_shapes_and_metadata() {
    let spec = hooks_json();
    let (path, manifest) = writer_fixture();
    let name = path.file_name().unwrap().to_str().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(
        fnv(&bytes),
        manifest["files"][name]["fnv1a64"].as_str().unwrap()
    );
    let t = read_trace(&path).unwrap();
    let meta = &t.metadata;
    let required = strings(&spec["metadata"]["required"]);
    let optional = strings(&spec["metadata"]["optional"]);
    for k in &required {
        assert!(meta.contains_key(k), "no metadata {k}");
    }
    for k in meta.keys() {
        assert!(required.contains(k) || optional.contains(k), "metadata {k}");
    }
    let version = manifest["glmdiff_hooks"].as_str().unwrap();
    assert_eq!(meta["hook_script"], format!("glmdiff_hooks {version}"));
    assert_eq!(
        meta["glmdiff_trace"],
        spec["trace_format"].as_str().unwrap()
    );
    assert_eq!(meta["mode"], "chained");
    assert!(meta["dtype"].starts_with("f32 "));
    let not_captured: BTreeMap<String, String> =
        serde_json::from_str(&meta["not_captured"]).unwrap();
    assert_eq!(not_captured.keys().collect::<Vec<_>>(), ["blk.*.kv_a"]);

    let golden_path = fixtures("models").join("glm5-tiny/glm5-tiny.short.trace.safetensors");
    let golden = read_trace(&golden_path).unwrap();
    assert_eq!(t.tokens().unwrap(), golden.tokens().unwrap());
    assert_eq!(meta["model"], "glm5-tiny-f32.gguf");
    let model = Model::open(&fixtures("models").join("glm5-tiny").join(&meta["model"])).unwrap();
    let w = Weights::new(&model).unwrap();
    let hp = w.hparams();
    assert_eq!(meta["architecture"], hp.arch.as_str());

    let n = t.tokens().unwrap().len();
    let vocab = model.tensor("token_embd.weight").unwrap().info.ne[1] as usize;
    let top_k = hp.indexer.as_ref().unwrap().top_k.min(n);
    let last_l_out = format!("blk.{}.l_out", hp.n_layer - 1);
    let shapes: BTreeMap<&str, Vec<usize>> = [
        ("token_embd", vec![n, hp.hidden]),
        ("blk.0.attn_norm", vec![n, hp.hidden]),
        ("blk.0.q_pe_rope", vec![n, hp.n_head, hp.qk_rope]),
        ("blk.0.k_pe_rope", vec![n, hp.qk_rope]),
        ("blk.0.indexer_topk", vec![n, top_k]),
        ("blk.1.moe_logits", vec![n, hp.n_expert]),
        ("blk.1.moe_topk_ids", vec![n, hp.n_expert_used]),
        ("blk.1.moe_weights", vec![n, hp.n_expert_used]),
        (last_l_out.as_str(), vec![n, hp.hidden]),
        ("result_norm", vec![n, hp.hidden]),
        ("logits", vec![n, vocab]),
    ]
    .into_iter()
    .collect();
    assert!(!hp.is_dense(1), "layer 1 of glm5-tiny is a MoE layer");
    assert_eq!(
        t.tensors.keys().map(String::as_str).collect::<Vec<_>>(),
        shapes.keys().copied().collect::<Vec<_>>()
    );
    let rank_ids: BTreeMap<String, (u64, bool)> = ["global_first", "layer_points", "global_last"]
        .iter()
        .flat_map(|k| points(&spec[*k]))
        .map(|p| (p.name, (p.rank, p.ids)))
        .collect();
    for (hook, want) in &shapes {
        let got = &t.tensors[*hook];
        assert_eq!(&got.shape, want, "{hook}: shape");
        let point = hook.rsplit('.').next().unwrap();
        let (rank, ids) = rank_ids[point];
        assert_eq!(got.shape.len() as u64, rank, "{hook}: rank in hooks.json");
        let stored = match (ids, *hook == "logits") {
            (true, _) => "I32",
            (false, true) => "F64",
            (false, false) => "F32",
        };
        assert_eq!(got.dtype, stored, "{hook}: stored type");
        let g = &golden.tensors[*hook];
        assert_eq!(g.shape, got.shape, "{hook}: golden shape");
        match (&got.values, &g.values) {
            (TraceValues::Int(a), TraceValues::Int(b)) => assert_eq!(a, b, "{hook}"),
            (a, b) => {
                let (a, b) = (floats(a), floats(b));
                assert_eq!(a.len(), b.len());
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    let want = if stored == "F64" {
                        *y
                    } else {
                        *y as f32 as f64
                    };
                    assert_eq!(x.to_bits(), want.to_bits(), "{hook}[{i}]: {x} vs {y}");
                }
            }
        }
    }
}

/// `glmdiff run` takes the writer's trace as a candidate: its hooks pass chained and in replay
/// (where the trace lacks a step's inputs, as a segment from the hooks it has), and the
/// `not_captured` glob is named with its reason.
#[test]
fn writer_fixture_passes_run() {
    let (path, _) = writer_fixture();
    let cache = tempfile::tempdir().unwrap();
    let json = cache.path().join("r.json");
    let gguf = fixtures("models").join("glm5-tiny/glm5-tiny-f32.gguf");
    let o = glmdiff_in(
        cache.path(),
        &[
            "--wide",
            "run",
            gguf.to_str().unwrap(),
            "--against",
            &format!("trace:{}", path.display()),
            "--mode",
            "both",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(
        text.contains("blk.*.kv_a (not written: the fixture holds a few hooks of each kind)"),
        "{text}"
    );
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let t = read_trace(&path).unwrap();
    let mut chained = BTreeSet::new();
    let mut replayed = BTreeSet::new();
    for r in j["records"].as_array().unwrap() {
        let hook = r["hook"].as_str().unwrap();
        if !t.tensors.contains_key(hook) {
            continue;
        }
        assert_eq!(r["chained"]["status"], "pass", "{hook} chained: {r}");
        chained.insert(hook.to_string());
        // replay runs a step from the trace's inputs, or across the hooks it lacks
        assert_eq!(r["replay"]["status"], "pass", "{hook} replay: {r}");
        replayed.insert(hook.to_string());
    }
    let all: BTreeSet<String> = t.tensors.keys().cloned().collect();
    assert_eq!(chained, all, "every hook of the trace is compared chained");
    // inputs in the trace: token_embd -> attn_norm, moe_logits -> the selection and its weights,
    // the last l_out -> result_norm -> logits
    for h in [
        "blk.0.attn_norm",
        "blk.1.moe_topk_ids",
        "blk.1.moe_weights",
        "result_norm",
        "logits",
    ] {
        assert!(replayed.contains(h), "{h} replayed: {replayed:?}");
    }
}
