//! `synth` tests: tiny synthetic models of both architectures reopened and checked against the
//! tensor table of shared spec `glm5-architecture.md` section 3 (names, ne, types of the
//! ud-q4_k_xl mix), the metadata keys of that section, the tokenizer, the spread of the
//! dequantized values, and determinism across thread counts.

use std::collections::BTreeMap;
use std::path::Path;

use glmdiff::gguf::{Model, Value};
use glmdiff::quant::GgmlType as T;
use glmdiff::synth::{self, SynthOptions};
use glmdiff::tokenizer::Tokenizer;

/// Tiny sizes, typed in from the `tiny` preset's documented values (not read from the code).
struct Tiny {
    hidden: u64,
    heads: u64,
    q_lora: u64,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v: u64,
    dense_ff: u64,
    expert_ff: u64,
    experts: u64,
    vocab: u64,
}

const GLM_TINY: Tiny = Tiny {
    hidden: 256,
    heads: 4,
    q_lora: 256,
    kv_lora: 128,
    nope: 96,
    rope: 32,
    v: 64,
    dense_ff: 512,
    expert_ff: 256,
    experts: 8,
    vocab: 512,
};
const DS_TINY: Tiny = Tiny {
    nope: 64,
    ..GLM_TINY
};

/// The expected tensors (spec section 3 table, applied to `d`): name -> (ne, type).
fn expected(d: &Tiny, glm: bool, layers: u64, dense: u64) -> BTreeMap<String, (Vec<u64>, T)> {
    let h = d.hidden;
    let mut m = BTreeMap::new();
    let mut add = |n: String, ne: &[u64], t: T| {
        m.insert(n, (ne.to_vec(), t));
    };
    add("token_embd.weight".into(), &[h, d.vocab], T::Q4_K);
    add("output_norm.weight".into(), &[h], T::F32);
    add("output.weight".into(), &[h, d.vocab], T::Q6_K);
    let blocks = layers + u64::from(glm);
    for il in 0..blocks {
        let b = |s: &str| format!("blk.{il}.{s}");
        add(b("attn_norm.weight"), &[h], T::F32);
        add(b("attn_q_a.weight"), &[h, d.q_lora], T::Q5_K);
        add(b("attn_q_a_norm.weight"), &[d.q_lora], T::F32);
        add(
            b("attn_q_b.weight"),
            &[d.q_lora, d.heads * (d.nope + d.rope)],
            T::Q8_0,
        );
        add(b("attn_kv_a_mqa.weight"), &[h, d.kv_lora + d.rope], T::Q8_0);
        add(b("attn_kv_a_norm.weight"), &[d.kv_lora], T::F32);
        add(b("attn_k_b.weight"), &[d.nope, d.kv_lora, d.heads], T::Q8_0);
        add(b("attn_v_b.weight"), &[d.kv_lora, d.v, d.heads], T::Q8_0);
        add(b("attn_output.weight"), &[d.heads * d.v, h], T::Q4_K);
        if glm {
            add(b("indexer.attn_q_b.weight"), &[d.q_lora, 4 * 64], T::Q8_0);
            add(b("indexer.attn_k.weight"), &[h, 64], T::Q8_0);
            add(b("indexer.k_norm.weight"), &[64], T::F32);
            add(b("indexer.k_norm.bias"), &[64], T::F32);
            add(b("indexer.proj.weight"), &[h, 4], T::F32);
        }
        add(b("ffn_norm.weight"), &[h], T::F32);
        if il < dense {
            add(b("ffn_gate.weight"), &[h, d.dense_ff], T::Q4_K);
            add(b("ffn_up.weight"), &[h, d.dense_ff], T::Q4_K);
            add(b("ffn_down.weight"), &[d.dense_ff, h], T::Q6_K);
        } else {
            let (e, f) = (d.experts, d.expert_ff);
            add(b("ffn_gate_inp.weight"), &[h, e], T::F32);
            add(b("exp_probs_b.bias"), &[e], T::F32);
            add(b("ffn_gate_exps.weight"), &[h, f, e], T::Q4_K);
            add(b("ffn_up_exps.weight"), &[h, f, e], T::Q4_K);
            let down = if il == dense { T::Q6_K } else { T::Q5_K };
            add(b("ffn_down_exps.weight"), &[f, h, e], down);
            add(b("ffn_gate_shexp.weight"), &[h, f], T::Q6_K);
            add(b("ffn_up_shexp.weight"), &[h, f], T::Q6_K);
            add(b("ffn_down_shexp.weight"), &[f, h], T::Q8_0);
        }
        if glm && il == layers {
            add(b("nextn.eh_proj.weight"), &[2 * h, h], T::Q8_0);
            add(b("nextn.enorm.weight"), &[h], T::F32);
            add(b("nextn.hnorm.weight"), &[h], T::F32);
            add(b("nextn.shared_head_norm.weight"), &[h], T::F32);
        }
    }
    m
}

fn write(dir: &Path, arch: &str, layers: Option<u32>, types: &str, seed: u64) -> Model {
    let p = dir.join(format!("{arch}-{layers:?}-{types}-{seed}.gguf"));
    let o = SynthOptions::parse(arch, "tiny", layers, types, seed).unwrap();
    synth::write(&o, &p).unwrap();
    Model::open(&p).unwrap()
}

fn check_tensors(m: &Model, want: &BTreeMap<String, (Vec<u64>, T)>) {
    let got: BTreeMap<String, (Vec<u64>, T)> = m
        .tensors()
        .map(|t| (t.info.name.clone(), (t.info.ne.clone(), t.info.ty)))
        .collect();
    let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    for (k, v) in want {
        assert_eq!(&got[k], v, "{k}");
    }
}

fn int(m: &Model, k: &str) -> i128 {
    m.get(k)
        .and_then(Value::as_int)
        .unwrap_or_else(|| panic!("{k}"))
}

fn float(m: &Model, k: &str) -> f64 {
    m.get(k)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{k}"))
}

/// Dequantized std over mean-square of `name`, relative to `1/sqrt(ne0)`.
fn spread(m: &Model, name: &str) -> (f64, f64) {
    let t = m.tensor(name).unwrap();
    let x = m.dequantize(t).unwrap();
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (var.sqrt() * (t.info.ne[0] as f64).sqrt(), mean)
}

#[test]
fn glm_dsa_tiny_matches_the_spec_table() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "glm-dsa", None, "ud-q4_k_xl", 0);
    check_tensors(&m, &expected(&GLM_TINY, true, 3, 1));
    assert_eq!(m.architecture(), Some("glm-dsa"));
    let a = "glm-dsa";
    for (k, v) in [
        ("block_count", 4),
        ("nextn_predict_layers", 1),
        ("embedding_length", 256),
        ("feed_forward_length", 512),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 1),
        ("attention.key_length", 128 + 32),
        ("attention.value_length", 128),
        ("attention.key_length_mla", 96 + 32),
        ("attention.value_length_mla", 64),
        ("attention.q_lora_rank", 256),
        ("attention.kv_lora_rank", 128),
        ("rope.dimension_count", 32),
        ("expert_count", 8),
        ("expert_used_count", 2),
        ("expert_shared_count", 1),
        ("expert_group_count", 1),
        ("expert_group_used_count", 1),
        ("expert_feed_forward_length", 256),
        ("leading_dense_block_count", 1),
        ("expert_weights_norm", 1),
        ("expert_gating_func", 2),
        ("attention.indexer.head_count", 4),
        ("attention.indexer.key_length", 64),
        ("attention.indexer.top_k", 8),
    ] {
        assert_eq!(int(&m, &format!("{a}.{k}")), v, "{k}");
    }
    assert_eq!(float(&m, "glm-dsa.rope.freq_base"), 1e6);
    assert_eq!(float(&m, "glm-dsa.expert_weights_scale"), 2.5);
    assert!((float(&m, "glm-dsa.attention.layer_norm_rms_epsilon") - 1e-5).abs() < 1e-12);
    assert!(m.get("glm-dsa.rope.scaling.type").is_none());

    let tok = Tokenizer::from_model(&m).unwrap();
    assert_eq!(
        tok.n_vocab() as u64,
        m.tensor("token_embd.weight").unwrap().info.ne[1]
    );
    assert_eq!(tok.pre_name(), "glm4");
    let text = "hello world, [gMASK]<sop> the model 你好!";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() < text.len(), "merges were used: {ids:?}");
    assert_eq!(tok.decode(&ids).unwrap(), text);

    // Values: matrices ~ 1/sqrt(fan_in) with mean ~0, norms ~1.
    for name in [
        "token_embd.weight",
        "output.weight",
        "blk.0.attn_q_a.weight",
        "blk.0.attn_k_b.weight",
        "blk.0.ffn_down.weight",
        "blk.1.ffn_down_exps.weight",
        "blk.2.ffn_gate_exps.weight",
        "blk.2.ffn_down_exps.weight",
        "blk.3.nextn.eh_proj.weight",
    ] {
        let (r, mean) = spread(&m, name);
        assert!((0.9..1.1).contains(&r), "{name}: std * sqrt(ne0) = {r}");
        assert!(mean.abs() < 0.1 / (256f64).sqrt(), "{name}: mean {mean}");
    }
    let norm = m.dequantize_named("blk.1.attn_norm.weight").unwrap();
    let mean = norm.iter().sum::<f32>() / norm.len() as f32;
    assert!((mean - 1.0).abs() < 0.02, "norm mean {mean}");
}

#[test]
fn deepseek2_tiny_matches_the_spec_table() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "deepseek2", None, "ud-q4_k_xl", 0);
    check_tensors(&m, &expected(&DS_TINY, false, 3, 1));
    let a = "deepseek2";
    for (k, v) in [
        ("block_count", 3),
        ("attention.key_length_mla", 64 + 32),
        ("attention.value_length_mla", 64),
        ("expert_group_count", 4),
        ("expert_group_used_count", 2),
        ("rope.scaling.original_context_length", 256),
        ("expert_gating_func", 2),
    ] {
        assert_eq!(int(&m, &format!("{a}.{k}")), v, "{k}");
    }
    assert!(m.get("deepseek2.nextn_predict_layers").is_none());
    assert!(m.get("deepseek2.attention.indexer.head_count").is_none());
    assert_eq!(
        m.get("deepseek2.rope.scaling.type").and_then(Value::as_str),
        Some("yarn")
    );
    assert_eq!(float(&m, "deepseek2.rope.scaling.factor"), 16.0);
    assert!((float(&m, "deepseek2.rope.scaling.yarn_log_multiplier") - 0.1).abs() < 1e-7);
    let tok = Tokenizer::from_model(&m).unwrap();
    assert_eq!(tok.pre_name(), "deepseek-v3");
    assert!(tok.add_bos());
    let bos = tok.bos_id().unwrap();
    assert_eq!(tok.token_text(bos), Some("<｜begin▁of▁sentence｜>"));
    assert_eq!(
        tok.decode(&tok.encode("The 2025 tensor").unwrap()).unwrap(),
        "The 2025 tensor"
    );
}

#[test]
fn layers_keep_the_leading_dense_blocks_and_the_mtp_block() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "glm-dsa", Some(2), "ud-q4_k_xl", 1);
    check_tensors(&m, &expected(&GLM_TINY, true, 2, 1));
    assert_eq!(int(&m, "glm-dsa.block_count"), 3);
    let m = write(dir.path(), "glm-dsa", Some(1), "ud-q4_k_xl", 1);
    check_tensors(&m, &expected(&GLM_TINY, true, 1, 1));
    assert_eq!(int(&m, "glm-dsa.leading_dense_block_count"), 1);
}

#[test]
fn one_type_applies_to_every_matrix_with_fallbacks() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "deepseek2", None, "q4_k", 0);
    for t in m.tensors() {
        let i = t.info;
        let want = if i.ne.len() == 1 || i.name.contains("ffn_gate_inp") {
            T::F32
        } else if i.ne[0] % 256 != 0 {
            T::Q5_0 // spec quant-formats.md: Q4_K falls back to Q5_0
        } else {
            T::Q4_K
        };
        assert_eq!(i.ty, want, "{}", i.name);
    }
    let (r, _) = spread(&m, "blk.0.attn_k_b.weight");
    assert!((0.9..1.1).contains(&r), "{r}");
}

#[test]
fn output_depends_on_the_seed_only() {
    let dir = tempfile::tempdir().unwrap();
    let o = SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 9).unwrap();
    let mut files = Vec::new();
    for threads in [1, 3] {
        let p = dir.path().join(format!("t{threads}.gguf"));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| synth::write(&o, &p)).unwrap();
        files.push(std::fs::read(&p).unwrap());
    }
    assert_eq!(files[0], files[1]);
    let p = dir.path().join("other.gguf");
    let o = SynthOptions::parse("glm-dsa", "tiny", None, "ud-q4_k_xl", 10).unwrap();
    synth::write(&o, &p).unwrap();
    let other = std::fs::read(&p).unwrap();
    assert_eq!(other.len(), files[0].len());
    assert_ne!(other, files[0]);
}

#[test]
fn bad_options_are_errors() {
    let e = |a: &str, d: &str, l: Option<u32>, t: &str| {
        format!("{:#}", SynthOptions::parse(a, d, l, t, 0).unwrap_err())
    };
    assert!(e("llama", "tiny", None, "q8_0").contains("--arch"));
    assert!(e("deepseek2", "glm5", None, "q8_0").contains("--dims"));
    assert!(e("glm-dsa", "tiny", Some(0), "q8_0").contains("--layers"));
    assert!(e("glm-dsa", "tiny", Some(4), "q8_0").contains("--layers"));
    assert!(e("glm-dsa", "tiny", None, "q1_0").contains("--types"));
}

#[test]
fn cli_writes_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cli.gguf");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_glmdiff"))
        .args(["synth", "--arch", "deepseek2", "--types", "q8_0", "--out"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("3 blocks"));
    let m = Model::open(&p).unwrap();
    assert_eq!(
        m.tensor("blk.1.ffn_up_exps.weight").unwrap().info.ty,
        T::Q8_0
    );
}

/// A synth larger than the free space of its output's file system (GLM-5's dimensions in f32,
/// about 3 TB) is refused before a byte is written, with both sizes; nothing is left behind.
#[test]
fn a_synth_larger_than_the_free_space_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let free = glmdiff::util::free_bytes(dir.path());
    if free.is_none_or(|f| f > 2 << 40) {
        eprintln!("skipped: the file system's free space is unknown or over 2 TiB");
        return;
    }
    let out = dir.path().join("big.gguf");
    let o = crate::common::glmdiff(&[
        "synth",
        "--arch",
        "glm-dsa",
        "--dims",
        "glm5",
        "--types",
        "f32",
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("GiB free") && err.contains("the model's tensors take"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
