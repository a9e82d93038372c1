//! `weights-check` against the fixtures of `reference/fixtures/make_wcheck_fixtures.py` (fixtures/wcheck/):
//! tiny HF checkpoints (F16, sharded F16, sharded BF16, FP8 with block scales), the GGUFs llama.cpp
//! converted and quantized from them, and copies with planted mapping bugs whose expected
//! diagnosis the fixture manifest records. Also: GGUF against GGUF, malformed checkpoints, and
//! the streaming bound.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use glmdiff::gguf::Model;
use glmdiff::hf::Checkpoint;
use glmdiff::util::progress::NoProgress;
use glmdiff::wcheck::store::{Meta, Values};
use glmdiff::wcheck::{
    self, Dims, GgufStore, HfStore, Options, RefKind, Report, Setup, Status, Store,
};
use serde_json::Value;

use crate::common::{fixtures, glmdiff_bin, hf_from_gguf, stderr_joined};

fn wc(sub: &str) -> PathBuf {
    fixtures("wcheck").join(sub)
}

fn check_hf(gguf: &Path, hf: &Path, opts: &Options) -> Report {
    let model = Model::open(gguf).unwrap();
    let ckpt = Checkpoint::open(hf).unwrap();
    let setup = Setup {
        kind: RefKind::Hf,
        dims: Dims::from_hf(&ckpt.config),
        index_heads: ckpt.config.index_n_heads.map(|h| h as u64),
        mtp_from: (ckpt.config.n_nextn > 0).then_some(ckpt.config.n_layers),
    };
    wcheck::check(&model, &HfStore { ckpt: &ckpt }, setup, opts, &NoProgress).unwrap()
}

fn check_gguf(gguf: &Path, other: &Path) -> Report {
    let model = Model::open(gguf).unwrap();
    let other = Model::open(other).unwrap();
    let setup = Setup {
        kind: RefKind::Gguf,
        dims: Dims::from_gguf(&model),
        index_heads: None,
        mtp_from: None,
    };
    let store = GgufStore { model: &other };
    wcheck::check(&model, &store, setup, &Options::default(), &NoProgress).unwrap()
}

/// Every tensor compared and within its rounding; nothing unmatched. Returns the worst
/// measured / expected ratio.
fn assert_clean(r: &Report, what: &str) -> f64 {
    let bad: Vec<String> = r
        .tensors
        .iter()
        .filter(|t| t.status != Status::Pass)
        .map(|t| format!("{} {:?} {:?}", t.name, t.status, t.diagnosis))
        .collect();
    assert!(bad.is_empty(), "{what}: {bad:#?}");
    assert!(r.gguf_only.is_empty(), "{what}: {:?}", r.gguf_only);
    assert!(
        r.reference_only.is_empty(),
        "{what}: {:?}",
        r.reference_only
    );
    assert!(!r.differs());
    r.tensors
        .iter()
        .filter_map(|t| Some(t.acc.nmse()? / t.expected_nmse.filter(|&e| e > 0.0)?))
        .fold(0.0, f64::max)
}

/// The pairs a converter made: F32/F16 GGUFs of f16-exact models, a BF16 checkpoint quantized
/// with llama.cpp's quantizers (11 types), an FP8 checkpoint quantized (19 types).
#[test]
fn clean_pairs_pass() {
    let models = fixtures("models");
    let pairs = [
        (
            models.join("glm5-tiny/glm5-tiny-f32.gguf"),
            wc("glm5-tiny-hf"),
        ),
        (
            models.join("glm5-tiny/glm5-tiny-f16.gguf"),
            wc("glm5-tiny-hf"),
        ),
        (
            models.join("dsv3-tiny/dsv3-tiny-f32.gguf"),
            wc("dsv3-tiny-hf"),
        ),
        (
            models.join("dsv3-tiny/dsv3-tiny-f16.gguf"),
            wc("dsv3-tiny-hf"),
        ),
        (wc("glm5-tiny-q-bf16.gguf"), wc("glm5-tiny-q-bf16-hf")),
        (wc("dsv3-tiny-q-fp8.gguf"), wc("dsv3-tiny-q-fp8-hf")),
    ];
    for (g, h) in pairs {
        let r = check_hf(&g, &h, &Options::default());
        let n = Model::open(&g).unwrap().n_tensors();
        assert_eq!(r.tensors.len(), n, "{}", g.display());
        let worst = assert_clean(&r, &g.display().to_string());
        println!(
            "{}: {} tensors ok, worst measured/expected {worst:.2}",
            g.display(),
            n
        );
        assert!(worst < 1.6, "{}: {worst}", g.display());
    }
}

/// What the manifest says each broken GGUF must be diagnosed with.
fn planted() -> BTreeMap<String, (String, BTreeMap<String, Value>)> {
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(wc("MANIFEST.json")).unwrap()).unwrap();
    let mut out = BTreeMap::new();
    for (file, e) in m["broken"].as_object().unwrap() {
        let reference = e["reference"].as_str().unwrap().to_string();
        let tensors = e["planted"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.insert(file.clone(), (reference, tensors));
    }
    assert_eq!(out.len(), 4);
    out
}

/// Each planted tensor fails with the planted diagnosis (and permutation or layer); every other
/// tensor passes.
fn assert_diagnosed(r: &Report, planted: &BTreeMap<String, Value>, what: &str) {
    assert!(r.differs(), "{what}");
    for t in &r.tensors {
        match planted.get(&t.name) {
            None => assert_eq!(
                t.status,
                Status::Pass,
                "{what}: {} {:?}",
                t.name,
                t.diagnosis
            ),
            Some(p) => {
                assert_ne!(t.status, Status::Pass, "{what}: {} passed", t.name);
                let d = t.diagnosis.as_ref().unwrap();
                println!("{what}: {}: {}", t.name, d.summary);
                assert_eq!(
                    d.kind,
                    p["diagnosis"].as_str().unwrap(),
                    "{what}: {}",
                    t.name
                );
                if let Some(perm) = p.get("permutation") {
                    let want: Vec<u64> = serde_json::from_value(perm.clone()).unwrap();
                    assert_eq!(d.permutation.as_ref(), Some(&want), "{what}: {}", t.name);
                }
                if let Some(l) = p.get("layer") {
                    assert_eq!(d.layer, Some(l.as_u64().unwrap() as usize), "{}", t.name);
                }
            }
        }
    }
    let failing = r
        .tensors
        .iter()
        .filter(|t| t.status != Status::Pass)
        .count();
    assert_eq!(failing, planted.len(), "{what}");
}

#[test]
fn planted_mapping_bugs_are_named_against_the_checkpoint() {
    for (file, (reference, tensors)) in planted() {
        let r = check_hf(
            &wc(&format!("broken/{file}")),
            &wc(&reference),
            &Options::default(),
        );
        assert_diagnosed(&r, &tensors, &file);
    }
}

/// The same bugs with only a clean GGUF of the model at hand.
#[test]
fn planted_mapping_bugs_are_named_against_another_gguf() {
    let models = fixtures("models");
    for (file, (_, tensors)) in planted() {
        let clean = if file.starts_with("glm5-tiny-q-bf16") {
            wc("glm5-tiny-q-bf16.gguf")
        } else {
            models.join("dsv3-tiny/dsv3-tiny-f32.gguf")
        };
        let r = check_gguf(&wc(&format!("broken/{file}")), &clean);
        assert_diagnosed(&r, &tensors, &format!("{file} vs {}", clean.display()));
    }
    let r = check_gguf(
        &models.join("glm5-tiny/glm5-tiny-f16.gguf"),
        &models.join("glm5-tiny/glm5-tiny-f32.gguf"),
    );
    assert_clean(&r, "glm5-tiny f16 vs f32");
}

/// `--tensors` narrows both the compared tensors and the unmatched lists.
#[test]
fn tensor_glob_selects() {
    let opts = Options {
        tensors: vec!["blk.1.ffn_*".into()],
        ..Options::default()
    };
    let r = check_hf(
        &wc("broken/glm5-tiny-q-bf16.experts_permuted.gguf"),
        &wc("glm5-tiny-q-bf16-hf"),
        &opts,
    );
    assert!(r.tensors.iter().all(|t| t.name.starts_with("blk.1.ffn_")));
    assert_eq!(r.tensors.len(), 8); // ffn_norm, ffn_gate_inp, 3 stacked experts, 3 shared
    assert!(r.reference_only.is_empty());
}

/// A copy of fixture checkpoint `name` with tensor `old` renamed `new` (same length, so the
/// header's offsets stay valid) in its index (if any) and its shard header.
fn with_renamed(name: &str, old: &str, new: &str) -> tempfile::TempDir {
    assert_eq!(old.len(), new.len());
    let dir = copy_ckpt(name);
    let idx = dir.path().join("model.safetensors.index.json");
    let shard = if idx.exists() {
        let text = std::fs::read_to_string(&idx).unwrap();
        let shard = text
            .lines()
            .find(|l| l.contains(old))
            .and_then(|l| l.split('"').nth(3))
            .unwrap()
            .to_string();
        std::fs::write(&idx, text.replace(old, new)).unwrap();
        shard
    } else {
        "model.safetensors".to_string()
    };
    let p = dir.path().join(&shard);
    let mut bytes = std::fs::read(&p).unwrap();
    let at = bytes
        .windows(old.len())
        .position(|w| w == old.as_bytes())
        .unwrap();
    bytes[at..at + old.len()].copy_from_slice(new.as_bytes());
    std::fs::write(&p, bytes).unwrap();
    dir
}

/// A checkpoint without a tensor the GGUF needs, and with one the GGUF lacks, lists both.
#[test]
fn unmatched_tensors_are_listed() {
    let old = "model.layers.0.mlp.up_proj.weight";
    let new = "model.layers.0.mlp.up_pro.weight_";
    let dir = with_renamed("dsv3-tiny-hf", old, new);
    let r = check_hf(
        &fixtures("models").join("dsv3-tiny/dsv3-tiny-f16.gguf"),
        dir.path(),
        &Options::default(),
    );
    assert!(r.differs());
    assert_eq!(r.gguf_only.len(), 1);
    assert_eq!(r.gguf_only[0].name, "blk.0.ffn_up.weight");
    assert!(r.gguf_only[0].note.contains(old), "{}", r.gguf_only[0].note);
    assert_eq!(r.reference_only.len(), 1);
    assert_eq!(r.reference_only[0].name, new);
    assert!(!r.reference_only[0].expected);
}

/// A checkpoint's MTP layer that the GGUF has no block for (DeepSeek's converter drops it) is
/// listed as expected, not as a failure.
#[test]
fn a_dropped_mtp_layer_is_expected() {
    // Layer 1 of glm5-tiny-q becomes "layer 2", an MTP layer for num_hidden_layers = 2.
    let old = "model.layers.1.input_layernorm.weight";
    let dir = with_renamed(
        "glm5-tiny-q-bf16-hf",
        old,
        "model.layers.2.input_layernorm.weight",
    );
    let cfg = dir.path().join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["num_nextn_predict_layers"] = 1.into();
    std::fs::write(&cfg, c.to_string()).unwrap();
    let r = check_hf(
        &wc("glm5-tiny-q-bf16.gguf"),
        dir.path(),
        &Options::default(),
    );
    assert_eq!(r.reference_only.len(), 1);
    let u = &r.reference_only[0];
    assert!(u.expected && u.note.contains("MTP layer"), "{u:?}");
    assert_eq!(r.gguf_only.len(), 1); // blk.1.attn_norm.weight lost its source
}

/// The binary: exit 0 on a clean pair, 1 on a planted bug (with the diagnosis in the JSON),
/// 2 on bad input.
#[test]
fn command_exit_codes_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("wc.json");
    let run = |gguf: PathBuf, hf: PathBuf, json: Option<&Path>| {
        let mut c = Command::new(glmdiff_bin());
        c.arg("weights-check").arg(gguf).arg("--hf").arg(hf);
        if let Some(j) = json {
            c.arg("--json").arg(j);
        }
        c.output().unwrap()
    };
    let out = run(wc("dsv3-tiny-q-fp8.gguf"), wc("dsv3-tiny-q-fp8-hf"), None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK: every tensor"));
    let out = run(
        wc("broken/glm5-tiny-q-bf16.kv_b_concat.gguf"),
        wc("glm5-tiny-q-bf16-hf"),
        Some(&json),
    );
    assert_eq!(out.status.code(), Some(1));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["glmdiff_weights_check"], 1);
    assert_eq!(doc["verdict"], "differs");
    let kb = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.1.attn_k_b.weight")
        .unwrap();
    assert_eq!(kb["status"], "fail");
    assert_eq!(kb["diagnosis"]["kind"], "kv_b_concatenated");
    assert!(kb["nmse"].as_f64().unwrap() > 0.1);
    let out = run(wc("glm5-tiny-q-bf16.gguf"), dir.path().join("nope"), None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a directory"));
}

/// Inputs that are not one model are refused before any tensor is compared (exit 2, one line
/// naming both files, the key and both values), never reported as every tensor FAIL: a
/// DeepSeek-V3 GGUF against a GLM-5 checkpoint or GGUF, a GGUF against a GGUF or a checkpoint
/// of other dimensions (glm5-tiny: hidden 64; glm5-tiny-q: 256), and a checkpoint whose
/// config.json was edited to another hidden size.
#[test]
fn inputs_of_different_models_are_refused_before_comparing() {
    let models = fixtures("models");
    let dsv3 = models.join("dsv3-tiny/dsv3-tiny-f16.gguf");
    let glm5 = models.join("glm5-tiny/glm5-tiny-f32.gguf");
    let glm5_q = wc("glm5-tiny-q-bf16.gguf");
    let edited = copy_ckpt("glm5-tiny-hf");
    let cfg = edited.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(text.contains("\"hidden_size\": 64,"));
    std::fs::write(
        &cfg,
        text.replace("\"hidden_size\": 64,", "\"hidden_size\": 96,"),
    )
    .unwrap();
    let hf = |d: &Path| vec!["--hf".to_string(), d.display().to_string()];
    let gg = |g: &Path| vec!["--gguf".to_string(), g.display().to_string()];
    let glm5_hf = wc("glm5-tiny-hf");
    let cases: Vec<(&Path, Vec<String>, Vec<String>)> = vec![
        (
            &dsv3,
            hf(&glm5_hf),
            vec![
                format!(
                    "the checkpoint {} is glm_moe_dsa (config.json model_type)",
                    glm5_hf.display()
                ),
                format!("the GGUF {} is deepseek2", dsv3.display()),
            ],
        ),
        (
            &glm5,
            gg(&dsv3),
            vec![format!(
                "the GGUF {} is glm-dsa, the --gguf {} is deepseek2",
                glm5.display(),
                dsv3.display()
            )],
        ),
        (
            &glm5,
            gg(&glm5_q),
            vec![format!(
                "embedding_length 64 in {}, 256 in {}",
                glm5.display(),
                glm5_q.display()
            )],
        ),
        (
            &glm5_q,
            hf(&glm5_hf),
            vec!["hidden_size 64 in config.json, embedding_length 256 in the GGUF".into()],
        ),
        (
            &glm5,
            hf(edited.path()),
            vec![
                format!("the checkpoint {}", edited.path().display()),
                "hidden_size 96 in config.json, embedding_length 64 in the GGUF".into(),
            ],
        ),
    ];
    for (model, reference, want) in cases {
        let out = Command::new(glmdiff_bin())
            .arg("weights-check")
            .arg(model)
            .args(&reference)
            .output()
            .unwrap();
        // A long error wraps at the width; its continuation lines are joined back.
        let err = stderr_joined(&out);
        let what = format!("{} {reference:?}", model.display());
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(
            out.stdout.is_empty(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{what}: {err}");
        assert!(
            lines[0].starts_with("error: weights-check: "),
            "{what}: {err}"
        );
        for w in &want {
            assert!(
                lines[0].contains(w.as_str()),
                "{what}: missing {w:?} in {err}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed checkpoints: each error names the file and the tensor.
// ---------------------------------------------------------------------------------------------

/// A copy of fixture checkpoint `name` in a temporary directory.
fn copy_ckpt(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(wc(name)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    dir
}

fn open_err(dir: &Path) -> String {
    format!("{:#}", Checkpoint::open(dir).unwrap_err())
}

/// A single-file safetensors with the given header entries (data zero-filled to `data_len`).
fn safetensors_bytes(header: Value, data_len: usize) -> Vec<u8> {
    let mut text = header.to_string();
    text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
    let mut b = (text.len() as u64).to_le_bytes().to_vec();
    b.extend(text.as_bytes());
    b.extend(vec![0u8; data_len]);
    b
}

#[test]
fn malformed_checkpoints_give_clear_errors() {
    // Missing config.json.
    let d = copy_ckpt("glm5-tiny-hf");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let e = open_err(d.path());
    assert!(e.contains("no config.json"), "{e}");

    // Bad index: not JSON, then no weight_map.
    let d = copy_ckpt("dsv3-tiny-hf");
    let idx = d.path().join("model.safetensors.index.json");
    std::fs::write(&idx, "{\"weight_map\": {").unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("model.safetensors.index.json: not valid JSON"),
        "{e}"
    );
    std::fs::write(&idx, "{\"metadata\": {}}").unwrap();
    let e = open_err(d.path());
    assert!(e.contains("no \"weight_map\""), "{e}");

    // Missing shard: the message names the shard and a tensor mapped to it.
    let d = copy_ckpt("dsv3-tiny-hf");
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("model-00002-of-00002.safetensors, which does not exist")
            && e.contains("among them model."),
        "{e}"
    );

    // An index entry whose shard lacks the tensor.
    let d = copy_ckpt("dsv3-tiny-hf");
    let idx = d.path().join("model.safetensors.index.json");
    let t = std::fs::read_to_string(&idx).unwrap();
    std::fs::write(
        &idx,
        t.replace(
            "\"weight_map\": {",
            "\"weight_map\": {\n    \"model.layers.9.ghost.weight\": \"model-00001-of-00002.safetensors\",",
        ),
    )
    .unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("puts tensor model.layers.9.ghost.weight in model-00001-of-00002.safetensors"),
        "{e}"
    );

    // Shape mismatch in a header: data_offsets do not hold the shape.
    let d = copy_ckpt("glm5-tiny-hf");
    let st = safetensors_bytes(
        serde_json::json!({"model.norm.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 100]}}),
        100,
    );
    std::fs::write(d.path().join("model.safetensors"), st).unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("model.safetensors: tensor model.norm.weight: shape mismatch")
            && e.contains("needs 128 bytes"),
        "{e}"
    );

    // Offsets past the file.
    let st = safetensors_bytes(
        serde_json::json!({"model.norm.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]}}),
        64,
    );
    std::fs::write(d.path().join("model.safetensors"), st).unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("tensor model.norm.weight: data_offsets [0, 128] outside"),
        "{e}"
    );

    // FP8 scale of the wrong shape.
    let d = copy_ckpt("glm5-tiny-hf");
    std::fs::write(
        d.path().join("model.safetensors"),
        safetensors_bytes(
            serde_json::json!({
                "model.layers.0.mlp.up_proj.weight": {"dtype": "F8_E4M3", "shape": [300, 64], "data_offsets": [0, 19200]},
                "model.layers.0.mlp.up_proj.weight_scale_inv": {"dtype": "F32", "shape": [2, 1], "data_offsets": [19200, 19208]}
            }),
            19208,
        ),
    )
    .unwrap();
    let e = open_err(d.path());
    assert!(
        e.contains("shape mismatch: model.layers.0.mlp.up_proj.weight_scale_inv is F32 [2, 1], expected F32/BF16 [3, 1]"),
        "{e}"
    );
}

/// A dtype glmdiff does not read fails when the comparison needs it, naming file and tensor.
#[test]
fn unsupported_dtype_is_named() {
    let d = copy_ckpt("glm5-tiny-hf");
    let src = Checkpoint::open(&wc("glm5-tiny-hf")).unwrap();
    // Rewrite the checkpoint with model.norm.weight as I16 (same byte size as F16).
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for t in src.tensors() {
        let v = src.read_rows(&t.name, 0..t.n_rows()).unwrap();
        let dtype = if t.name == "model.norm.weight" {
            "I16"
        } else {
            "F32"
        };
        let bytes: Vec<u8> = if dtype == "I16" {
            vec![0u8; v.len() * 2]
        } else {
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        };
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": dtype, "shape": t.shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend(bytes);
    }
    let mut st = safetensors_bytes(Value::Object(header), 0);
    st.extend(data);
    std::fs::write(d.path().join("model.safetensors"), st).unwrap();
    let model = Model::open(&fixtures("models").join("glm5-tiny/glm5-tiny-f32.gguf")).unwrap();
    let ckpt = Checkpoint::open(d.path()).unwrap();
    let setup = Setup {
        kind: RefKind::Hf,
        dims: Dims::from_hf(&ckpt.config),
        index_heads: None,
        mtp_from: None,
    };
    let e = wcheck::check(
        &model,
        &HfStore { ckpt: &ckpt },
        setup,
        &Options::default(),
        &NoProgress,
    )
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("model.safetensors: tensor model.norm.weight has dtype I16"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------------

/// A store that records the largest single read and the total read.
struct Counting<'a> {
    inner: &'a dyn Store,
    largest: AtomicU64,
    total: AtomicU64,
}

impl Store for Counting<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn is_original(&self) -> bool {
        self.inner.is_original()
    }
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn meta(&self, name: &str) -> Option<Meta> {
        self.inner.meta(name)
    }
    fn read(
        &self,
        name: &str,
        rows: Range<u64>,
        cols: Range<u64>,
        want_var: bool,
    ) -> anyhow::Result<Values> {
        let n = (rows.end - rows.start) * (cols.end - cols.start);
        self.largest.fetch_max(n, Ordering::Relaxed);
        self.total.fetch_add(n, Ordering::Relaxed);
        self.inner.read(name, rows, cols, want_var)
    }
}

/// A synthetic GLM-5-layout model (tiny dims, UD-Q4_K_XL mix) against a BF16 (F32 for float
/// tensors) checkpoint of its own values, in chunks of 4096 values: no read of the checkpoint is larger than one chunk, the
/// checkpoint is read once, and the pair passes.
#[test]
fn the_reference_is_read_in_bounded_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("synth.gguf");
    let opts =
        glmdiff::synth::SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 3).unwrap();
    glmdiff::synth::write(&opts, &gguf).unwrap();
    let model = Model::open(&gguf).unwrap();
    let hf = dir.path().join("hf");
    hf_from_gguf::write(&model, &hf, 1 << 20).unwrap();
    let ckpt = Checkpoint::open(&hf).unwrap();
    assert!(ckpt.n_shards() > 1);
    let inner = HfStore { ckpt: &ckpt };
    let counting = Counting {
        inner: &inner,
        largest: AtomicU64::new(0),
        total: AtomicU64::new(0),
    };
    let chunk = 4096;
    let setup = Setup {
        kind: RefKind::Hf,
        dims: Dims::from_hf(&ckpt.config),
        index_heads: None,
        mtp_from: Some(ckpt.config.n_layers),
    };
    let wopts = Options {
        tensors: vec![],
        chunk_values: chunk,
    };
    let r = wcheck::check(&model, &counting, setup, &wopts, &NoProgress).unwrap();
    assert_clean(&r, "synth tiny vs its BF16 checkpoint");
    let largest_tensor = ckpt.tensors().map(|t| t.n_elements()).max().unwrap();
    let largest_row = ckpt.tensors().map(|t| t.row_len()).max().unwrap();
    let largest = counting.largest.load(Ordering::Relaxed);
    println!(
        "largest read {largest} values (chunk {chunk}, largest row {largest_row}, largest tensor {largest_tensor})"
    );
    assert!(largest <= chunk.max(largest_row), "{largest}");
    assert!(largest_tensor > 16 * chunk);
    let elements: u64 = ckpt.tensors().map(|t| t.n_elements()).sum();
    assert_eq!(counting.total.load(Ordering::Relaxed), elements);
}

/// Not a test: writes the checkpoint of the GGUF `$GLMDIFF_WCHECK_GGUF` (BF16 for block-quantized
/// tensors, 4 GiB shards) to `$GLMDIFF_WCHECK_HF`, for the memory measurement in docs/weights-check.md:
/// `glmdiff synth --arch glm-dsa --dims glm5 --layers 1 --out M.gguf`, this, then
/// `/usr/bin/time -v glmdiff weights-check M.gguf --hf DIR`.
#[test]
#[ignore = "writes tens of GB; run by hand (docs/weights-check.md, memory)"]
fn write_checkpoint_of_gguf() {
    let (Some(g), Some(out)) = (
        std::env::var_os("GLMDIFF_WCHECK_GGUF"),
        std::env::var_os("GLMDIFF_WCHECK_HF"),
    ) else {
        panic!("set GLMDIFF_WCHECK_GGUF and GLMDIFF_WCHECK_HF");
    };
    let model = Model::open(Path::new(&g)).unwrap();
    hf_from_gguf::write(&model, Path::new(&out), 4 << 30).unwrap();
}

// ---------------------------------------------------------------------------------------------
// More suspects, planted here by rewriting the F32 fixture GGUF byte by byte (the GGUF writer,
// not weights-check, makes them).
// ---------------------------------------------------------------------------------------------

/// A rewritten tensor: name, `ne`, f32 values in row-major PyTorch order.
type Tensor = (String, Vec<u64>, Vec<f32>);

/// The tensors of an F32 GGUF as `Tensor`s.
fn f32_tensors(m: &Model) -> Vec<Tensor> {
    m.tensors()
        .map(|t| {
            assert_eq!(t.info.ty, glmdiff::quant::GgmlType::F32);
            let v = m.dequantize(t).unwrap();
            (t.info.name.clone(), t.info.ne.clone(), v)
        })
        .collect()
}

/// Writes `tensors` as an F32 GGUF with `m`'s metadata.
fn write_f32(m: &Model, tensors: &[Tensor], path: &Path) {
    let mut w = glmdiff::gguf::GgufWriter::new();
    for (k, v) in m.metadata() {
        w.add(k, v.clone()).unwrap();
    }
    for (n, ne, _) in tensors {
        w.add_tensor(n, ne, glmdiff::quant::GgmlType::F32).unwrap();
    }
    let mut i = 0;
    w.write_file(path, &mut |_, out| {
        let bytes: Vec<u8> = tensors[i].2.iter().flat_map(|x| x.to_le_bytes()).collect();
        i += 1;
        Ok(out.write_all(&bytes)?)
    })
    .unwrap();
}

fn get<'a>(ts: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    ts.iter_mut().find(|t| t.0 == name).unwrap()
}

/// Rows `[rows, row_len]` permuted in groups of `g` rows: group `i` takes group `perm[i]`.
fn permute_rows(v: &[f32], row_len: usize, g: usize, perm: &[usize]) -> Vec<f32> {
    let gl = g * row_len;
    perm.iter()
        .flat_map(|&p| v[p * gl..(p + 1) * gl].iter().copied())
        .collect()
}

#[test]
fn more_planted_bugs_are_named() {
    let src = fixtures("models").join("glm5-tiny/glm5-tiny-f32.gguf");
    let m = Model::open(&src).unwrap();
    let clean = f32_tensors(&m);
    let dir = tempfile::tempdir().unwrap();
    let heads = [1usize, 3, 0, 2];
    let mut ts = clean.clone();
    // gate <-> up of the dense layer.
    let gate = get(&mut ts, "blk.0.ffn_gate.weight").2.clone();
    let up = std::mem::replace(&mut get(&mut ts, "blk.0.ffn_up.weight").2, gate);
    get(&mut ts, "blk.0.ffn_gate.weight").2 = up;
    // q_b rows: 4 heads of 48 (nope 32 + rope 16) rows of 24.
    let q = get(&mut ts, "blk.1.attn_q_b.weight");
    q.2 = permute_rows(&q.2, 24, 48, &heads);
    // attn_output columns: 64 rows of 4 heads x 24 values.
    let o = get(&mut ts, "blk.2.attn_output.weight");
    o.2 =
        o.2.chunks_exact(96)
            .flat_map(|r| permute_rows(r, 1, 24, &heads))
            .collect();
    // The square indexer key projection [64, 64], transposed.
    let k = get(&mut ts, "blk.2.indexer.attn_k.weight");
    k.2 = (0..64 * 64).map(|i| k.2[(i % 64) * 64 + i / 64]).collect();
    let p = dir.path().join("bugs.gguf");
    write_f32(&m, &ts, &p);
    let r = check_hf(&p, &wc("glm5-tiny-hf"), &Options::default());
    let want: BTreeMap<String, Value> = [
        (
            "blk.0.ffn_gate.weight",
            serde_json::json!({"diagnosis": "gate_up_swapped"}),
        ),
        (
            "blk.0.ffn_up.weight",
            serde_json::json!({"diagnosis": "gate_up_swapped"}),
        ),
        (
            "blk.1.attn_q_b.weight",
            serde_json::json!({"diagnosis": "head_order", "permutation": heads}),
        ),
        (
            "blk.2.attn_output.weight",
            serde_json::json!({"diagnosis": "head_order", "permutation": heads}),
        ),
        (
            "blk.2.indexer.attn_k.weight",
            serde_json::json!({"diagnosis": "transposed"}),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_diagnosed(&r, &want, "rewritten glm5-tiny-f32");

    // Older files store kv_b unsplit (attn_kv_b, [H * (nope + v), kv_lora]): right, then concatenated.
    let (h, nope, v, kvl) = (4usize, 32usize, 24usize, 40usize);
    for concat in [false, true] {
        let mut ts: Vec<Tensor> = Vec::new();
        for t in &clean {
            if t.0.ends_with("attn_v_b.weight") {
                continue;
            }
            if !t.0.ends_with("attn_k_b.weight") {
                ts.push(t.clone());
                continue;
            }
            let l = t.0.split('.').nth(1).unwrap();
            let vb = &clean
                .iter()
                .find(|x| x.0 == format!("blk.{l}.attn_v_b.weight"))
                .unwrap()
                .2;
            let (kb, mut kv) = (&t.2, vec![0f32; h * (nope + v) * kvl]);
            for x in 0..h {
                for d in 0..nope {
                    let row = if concat {
                        x * nope + d
                    } else {
                        x * (nope + v) + d
                    };
                    for c in 0..kvl {
                        kv[row * kvl + c] = kb[(x * kvl + c) * nope + d];
                    }
                }
                for j in 0..v {
                    let row = if concat {
                        h * nope + x * v + j
                    } else {
                        x * (nope + v) + nope + j
                    };
                    kv[row * kvl..(row + 1) * kvl]
                        .copy_from_slice(&vb[(x * v + j) * kvl..(x * v + j + 1) * kvl]);
                }
            }
            ts.push((
                format!("blk.{l}.attn_kv_b.weight"),
                vec![kvl as u64, (h * (nope + v)) as u64],
                kv,
            ));
        }
        let p = dir.path().join(format!("kvb-{concat}.gguf"));
        write_f32(&m, &ts, &p);
        let r = check_hf(&p, &wc("glm5-tiny-hf"), &Options::default());
        if concat {
            let want: BTreeMap<String, Value> = (0..4)
                .map(|l| {
                    (
                        format!("blk.{l}.attn_kv_b.weight"),
                        serde_json::json!({"diagnosis": "kv_b_concatenated"}),
                    )
                })
                .collect();
            assert_diagnosed(&r, &want, "attn_kv_b concatenated");
        } else {
            assert_clean(&r, "attn_kv_b interleaved");
            // and against the split GGUF it came from
            assert_clean(&check_gguf(&p, &src), "attn_kv_b vs attn_k_b/attn_v_b");
            assert_clean(&check_gguf(&src, &p), "attn_k_b/attn_v_b vs attn_kv_b");
        }
    }
}
