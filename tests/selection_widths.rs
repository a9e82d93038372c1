//! A selection of another width than the model's (an engine that keeps 7 DSA keys where the
//! model says 8, or routes 3 experts per token where it says 2) is a finding: the trace is
//! accepted, the hook fails in replay and chained with a note naming both widths, and
//! `--explain` names the known bug of that width first. Any other hook of a wrong shape stays an
//! input error (exit 2). The traces are committed engine traces with one layer's selection
//! narrowed or widened here.

use std::path::{Path, PathBuf};

use glmdiff::engine::HostTensor;

use crate::common::subset::write_edited;
use crate::common::{fixtures, run_trace};

/// `t` ([T, W]) with each row's last `drop` columns left out.
fn narrower(t: &HostTensor, drop: usize) -> HostTensor {
    let (rows, w) = t.dims2("selection").unwrap();
    let keep = w - drop;
    match t.as_i32("") {
        Ok(v) => HostTensor::i32(
            vec![rows, keep],
            v.chunks(w).flat_map(|r| r[..keep].to_vec()).collect(),
        ),
        Err(_) => HostTensor::f32(
            vec![rows, keep],
            t.as_f32("")
                .unwrap()
                .chunks(w)
                .flat_map(|r| r[..keep].to_vec())
                .collect(),
        ),
    }
    .unwrap()
}

/// `t` ([T, W]) with one more column per row: `id` for ids (an expert no row kept), `w` for
/// weights.
fn wider(t: &HostTensor, id: i32, w: f32) -> HostTensor {
    let (rows, n) = t.dims2("selection").unwrap();
    match t.as_i32("") {
        Ok(v) => HostTensor::i32(
            vec![rows, n + 1],
            v.chunks(n)
                .flat_map(|r| r.iter().copied().chain([id]).collect::<Vec<_>>())
                .collect(),
        ),
        Err(_) => HostTensor::f32(
            vec![rows, n + 1],
            t.as_f32("")
                .unwrap()
                .chunks(n)
                .flat_map(|r| r.iter().copied().chain([w]).collect::<Vec<_>>())
                .collect(),
        ),
    }
    .unwrap()
}

/// Where a doctored copy of `src` goes.
fn doctored(dir: &Path, src: &Path) -> PathBuf {
    dir.join(src.file_name().unwrap())
}

/// The GLM-5 tiny model and its DSA trace (21 tokens, index_topk 8: the indexer prunes).
fn glm5_dsa() -> (PathBuf, PathBuf) {
    (
        fixtures("models/glm5-tiny/glm5-tiny-f32.gguf"),
        fixtures("engines/glm5-tiny/glm5-tiny.dsa.cuda-bf16.trace.safetensors"),
    )
}

/// The DeepSeek-V3 tiny model and its long trace.
fn dsv3_long() -> (PathBuf, PathBuf) {
    (
        fixtures("models/dsv3-tiny/dsv3-tiny-f32.gguf"),
        fixtures("engines/dsv3-tiny/dsv3-tiny.long.cuda-bf16.trace.safetensors"),
    )
}

/// `src` copied into `dir` with the hooks `edit` changes changed.
fn doctor(dir: &Path, src: &Path, edit: &dyn Fn(&str, HostTensor) -> HostTensor) -> PathBuf {
    let dst = doctored(dir, src);
    write_edited(src, &dst, edit);
    dst
}

/// Checks a run of a candidate whose selection `hook` keeps `k` where the model says `m`: exit
/// 1, the first divergence at `hook` in `mode` with the note naming both widths.
fn check_width_finding(rc: i32, j: &serde_json::Value, text: &str, hook: &str, k: usize, m: usize) {
    assert_eq!(rc, 1, "{text}");
    assert_eq!(j["verdict"], "differs", "{text}");
    let words = format!("the candidate keeps {k}, the model says {m}");
    let mut seen = 0;
    for key in ["first_divergence", "first_divergence_chained"] {
        let d = &j[key];
        if d.is_null() {
            continue;
        }
        seen += 1;
        assert_eq!(d["hook"], hook, "{key}: {text}");
        assert!(
            d["note"].as_str().unwrap_or("").contains(&words),
            "{key}: {}",
            d["note"]
        );
    }
    assert!(seen > 0, "no first divergence: {text}");
    assert!(
        text.contains(&format!("{hook} (the candidate keeps {k}")),
        "{text}"
    );
}

/// A DSA selection of 7 keys where the model keeps 8 (the committed bf16 engine trace, layer
/// 1's `indexer_topk` without its last column): the hook fails in replay and chained, and
/// `--explain` names `dsa_topk:7` first, reproducing it.
#[test]
fn a_narrower_dsa_selection_fails_at_its_hook_and_is_explained_as_dsa_topk() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, src) = glm5_dsa();
    let dst = doctor(dir.path(), &src, &|n, t| {
        if n == "blk.1.indexer_topk" {
            narrower(&t, 1)
        } else {
            t
        }
    });
    for mode in ["replay", "chained"] {
        let (rc, j, text) = run_trace(dir.path(), &gguf, &dst, &["--mode", mode]);
        check_width_finding(rc, &j, &text, "blk.1.indexer_topk", 7, 8);
    }
    let (rc, j, text) = run_trace(dir.path(), &gguf, &dst, &["--mode", "both", "--explain"]);
    check_width_finding(rc, &j, &text, "blk.1.indexer_topk", 7, 8);
    let best = &j["explanation"][0];
    assert_eq!(best["kind"], "dsa_topk:7@1", "{text}");
    assert_eq!(best["reproduces"], true, "{text}");
    assert!(
        text.contains("explain: blk.1.indexer_topk: reproduced by dsa_topk:7@1"),
        "{text}"
    );
}

/// The CPU engine routing 3 experts per token where the model says 2 (`--inject
/// experts_per_token:3@1`): `moe_topk_ids` fails at layer 1 in both modes with the widths in its
/// note, and `--explain` reproduces it with `experts_per_token:3` first.
#[test]
fn an_engine_routing_more_experts_is_named_at_the_routing_and_explained() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let gguf = fixtures("models/dsv3-tiny/dsv3-tiny-f32.gguf");
    let tokens = crate::common::golden_tokens("dsv3-tiny/dsv3-tiny.long.trace.safetensors");
    let base = [
        "run",
        gguf.to_str().unwrap(),
        "--tokens",
        &tokens,
        "--against",
        "cpu",
        "--inject",
        "experts_per_token:3@1",
    ];
    for mode in ["replay", "chained"] {
        let (rc, j, text) =
            crate::common::run_json(dir.path(), &[&base[..], &["--mode", mode]].concat(), &json);
        check_width_finding(rc, &j, &text, "blk.1.moe_topk_ids", 3, 2);
    }
    let (rc, j, text) = crate::common::run_json(
        dir.path(),
        &[&base[..], &["--mode", "both", "--explain"]].concat(),
        &json,
    );
    check_width_finding(rc, &j, &text, "blk.1.moe_topk_ids", 3, 2);
    let best = &j["explanation"][0];
    assert_eq!(best["kind"], "experts_per_token:3@1", "{text}");
    assert_eq!(best["reproduces"], true, "{text}");
}

/// A trace routing 1 expert per token where the model says 2 (the committed bf16 engine trace,
/// layer 1's `moe_topk_ids` and `moe_weights` without their last column), and one routing 3 (an
/// expert appended): the ids fail at layer 1 with both widths in the note, later hooks are
/// judged without an input error, and `--explain` names `experts_per_token:K` first.
#[test]
fn a_trace_routing_another_number_of_experts_fails_at_its_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, src) = dsv3_long();
    let one = doctor(dir.path(), &src, &|n, t| {
        if n == "blk.1.moe_topk_ids" || n == "blk.1.moe_weights" {
            narrower(&t, 1)
        } else {
            t
        }
    });
    for mode in ["replay", "chained"] {
        let (rc, j, text) = run_trace(dir.path(), &gguf, &one, &["--mode", mode]);
        check_width_finding(rc, &j, &text, "blk.1.moe_topk_ids", 1, 2);
    }
    let (rc, j, text) = run_trace(dir.path(), &gguf, &one, &["--mode", "both", "--explain"]);
    check_width_finding(rc, &j, &text, "blk.1.moe_topk_ids", 1, 2);
    assert_eq!(
        j["explanation"][0]["kind"], "experts_per_token:1@1",
        "{text}"
    );
    let wide = dir.path().join("wide");
    std::fs::create_dir_all(&wide).unwrap();
    let three = doctor(&wide, &src, &|n, t| match n {
        "blk.1.moe_topk_ids" => wider(&t, 7, 0.0),
        "blk.1.moe_weights" => wider(&t, 0, 0.01),
        _ => t,
    });
    let (rc, j, text) = run_trace(dir.path(), &gguf, &three, &["--mode", "both", "--explain"]);
    check_width_finding(rc, &j, &text, "blk.1.moe_topk_ids", 3, 2);
    assert_eq!(
        j["explanation"][0]["kind"], "experts_per_token:3@1",
        "{text}"
    );
    assert!(
        text.contains(
            "the candidate keeps 3, the model says 2: experts_per_token:3@1 is ranked first"
        ),
        "{text}"
    );
}

/// Any other hook of the wrong shape is still an input error (exit 2): a float hook with a
/// hidden size one short, and expert weights of another width than the trace's expert ids.
#[test]
fn other_wrong_shapes_stay_input_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, src) = glm5_dsa();
    let bad = doctor(dir.path(), &src, &|n, t| {
        if n == "blk.1.attn_norm" {
            narrower(&t, 1)
        } else {
            t
        }
    });
    let (rc, _, text) = run_trace(dir.path(), &gguf, &bad, &[]);
    assert_eq!(rc, 2, "{text}");
    assert!(text.contains("hook blk.1.attn_norm has shape"), "{text}");
    assert!(
        text.contains("this hook was written with a wrong shape"),
        "{text}"
    );
    let (gguf, src) = dsv3_long();
    let bad = doctor(dir.path(), &src, &|n, t| {
        if n == "blk.1.moe_weights" {
            narrower(&t, 1)
        } else {
            t
        }
    });
    let (rc, _, text) = run_trace(dir.path(), &gguf, &bad, &[]);
    assert_eq!(rc, 2, "{text}");
    assert!(
        text.contains(
            "hook blk.1.moe_weights has shape [21, 1], but blk.1.moe_topk_ids has shape [21, 2]"
        ),
        "{text}"
    );
}

/// `compare` of two traces judges a selection of another width the same way: exit 1 at that
/// hook in chained mode, naming the reference trace's width (without `--model`) or the model's.
#[test]
fn compare_names_another_selection_width() {
    let dir = tempfile::tempdir().unwrap();
    let reference = fixtures("models/glm5-tiny/glm5-tiny.long.trace.safetensors");
    let src = fixtures("engines/glm5-tiny/glm5-tiny.long.cuda-bf16.trace.safetensors");
    let seven = doctor(dir.path(), &src, &|n, t| {
        if n == "blk.0.indexer_topk" {
            narrower(&t, 1)
        } else {
            t
        }
    });
    let json = dir.path().join("c.json");
    let (r, c, j) = (
        reference.to_str().unwrap(),
        seven.to_str().unwrap(),
        json.to_str().unwrap(),
    );
    let gguf = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    for (extra, words) in [
        (vec![], "the candidate keeps 7, the reference keeps 8"),
        (
            vec!["--model", gguf.to_str().unwrap()],
            "the candidate keeps 7, the model says 8",
        ),
    ] {
        let _ = std::fs::remove_file(&json);
        let mut args = vec!["compare", r, c, "--json", j];
        args.extend(extra);
        let (rc, v, text) = crate::common::outcome(crate::common::glmdiff(&args), &json);
        assert_eq!(rc, 1, "{text}");
        let d = &v["first_divergence_chained"];
        assert_eq!(d["hook"], "blk.0.indexer_topk", "{text}");
        assert!(d["note"].as_str().unwrap_or("").contains(words), "{d}");
    }
}
