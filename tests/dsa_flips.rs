//! The DSA selection judged as a whole (src/compare/flipcount.rs): a top-k that is not the
//! top-k of the scores it was made from is named, however close to a tie each of its flips is
//! on the reference's scores; a correct engine's flips stay within what its scores' noise
//! predicts.

use std::path::{Path, PathBuf};

use glmdiff::engine::{HostData, HostTensor};
use glmdiff::trace::{read_trace, write_trace, Mode, TraceMeta};
use serde_json::Value;

use crate::common::{fixtures, run_trace};

fn model() -> PathBuf {
    crate::common::model("glm5-tiny/glm5-tiny-f32.gguf")
}

/// transformers in bf16 on an H200: a correct engine whose DSA selection prunes (48 tokens, 8
/// keys kept).
fn clean_dump() -> PathBuf {
    fixtures("engines")
        .join("glm5-tiny")
        .join("glm5-tiny.long.cuda-bf16.trace.safetensors")
}

/// The trace `src` written to `dst` with every layer's DSA selection made by a top-k that
/// skips the boundary: in each row with more keys than it keeps, its lowest kept key (by the
/// trace's own scores) is replaced by the best key it did not keep. Returns the rows changed.
fn skip_boundary(src: &Path, dst: &Path) -> usize {
    let t = read_trace(src).unwrap();
    let mut tensors = crate::common::host_tensors(&t);
    let names: Vec<String> = tensors
        .keys()
        .filter(|n| n.ends_with(".indexer_topk"))
        .cloned()
        .collect();
    let mut changed = 0;
    for name in names {
        let scores = tensors[&name.replace("indexer_topk", "indexer_scores")].clone();
        let HostData::F32(sc) = &scores.data else {
            panic!("scores")
        };
        let cols = scores.shape[1];
        let sel: &mut HostTensor = tensors.get_mut(&name).unwrap();
        let w = sel.shape[1];
        let ids = sel.as_i32_mut("ids").unwrap();
        for (t, row) in ids.chunks_mut(w).enumerate() {
            let s = &sc[t * cols..(t + 1) * cols];
            let finite = s.iter().filter(|x| x.is_finite()).count();
            if finite <= w {
                continue;
            }
            let (lo_slot, _) = row
                .iter()
                .enumerate()
                .filter(|(_, &i)| i >= 0)
                .min_by(|a, b| s[*a.1 as usize].total_cmp(&s[*b.1 as usize]))
                .unwrap();
            let best_out = (0..cols)
                .filter(|i| s[*i].is_finite() && !row.contains(&(*i as i32)))
                .max_by(|a, b| s[*a].total_cmp(&s[*b]))
                .unwrap();
            row[lo_slot] = best_out as i32;
            changed += 1;
        }
    }
    let mut extra = crate::common::subset::extra_metadata(&t.metadata);
    extra.insert("doctored".into(), "top-k skips the boundary key".into());
    let meta = TraceMeta {
        model: t.metadata["model"].clone(),
        architecture: t.metadata["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: t.metadata["engine"].clone(),
        dtype: t.metadata["dtype"].clone(),
        mode: Mode::parse(&t.metadata["mode"]).unwrap(),
        extra,
    };
    write_trace(dst, &tensors, &meta).unwrap();
    changed
}

fn first_record_with_flips<'a>(j: &'a Value, point: &str) -> Option<&'a Value> {
    j["records"].as_array()?.iter().find(|r| {
        r["hook"].as_str().is_some_and(|h| h.ends_with(point))
            && ["replay", "chained"]
                .iter()
                .any(|m| r[m]["flips"]["count"].is_object())
    })
}

/// The clean bf16 dump passes in every mode, and where its selection differs from the
/// reference's the flips are within what the measured noise predicts and are the top-k of the
/// dump's own scores.
#[test]
fn a_correct_bf16_indexer_flips_within_its_noise() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in ["replay", "chained", "both"] {
        let (code, j, text) = run_trace(
            tmp.path(),
            &model(),
            &clean_dump(),
            &["--mode", mode, "--no-cache"],
        );
        assert_eq!(code, 0, "{mode}: {text}");
        if let Some(r) = first_record_with_flips(&j, "indexer_topk") {
            for m in ["replay", "chained"] {
                let c = &r[m]["flips"]["count"];
                if c.is_object() {
                    assert!(c["observed"].as_f64().unwrap() <= c["bound"].as_f64().unwrap());
                    assert_eq!(c["not_top_k"], 0, "{mode} {m}: {c}");
                }
            }
        }
    }
}

/// A top-k that skips the boundary key flips one key in every pruned row, each flip a near tie
/// on the reference's scores; it is named at the first layer's selection in every mode,
/// because the selection is not the top-k of the dump's own scores.
#[test]
fn a_top_k_that_skips_the_boundary_key_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let doctored = tmp.path().join("skip.trace.safetensors");
    let changed = skip_boundary(&clean_dump(), &doctored);
    assert!(changed > 10, "{changed} rows changed");
    for mode in ["replay", "chained", "both"] {
        let (code, j, text) = run_trace(
            tmp.path(),
            &model(),
            &doctored,
            &["--mode", mode, "--no-cache"],
        );
        assert_eq!(code, 1, "{mode}: {text}");
        let key = if mode == "chained" {
            "first_divergence_chained"
        } else {
            "first_divergence"
        };
        let first = j[key].to_string();
        assert!(
            first.contains("blk.0.indexer_topk"),
            "{mode}: {first}\n{text}"
        );
        assert!(
            text.contains("not the top-k of the scores it selected from"),
            "{mode}: {text}"
        );
    }
}
