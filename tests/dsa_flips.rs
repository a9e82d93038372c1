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
    write_doctored(&t, &tensors, dst, "top-k skips the boundary key");
    changed
}

/// Writes `tensors` to `dst` with the metadata of `t` and a `doctored` note saying what was
/// changed.
fn write_doctored(
    t: &glmdiff::trace::Trace,
    tensors: &std::collections::BTreeMap<String, HostTensor>,
    dst: &Path,
    what: &str,
) {
    let mut extra = crate::common::subset::extra_metadata(&t.metadata);
    extra.insert("doctored".into(), what.to_string());
    let meta = TraceMeta {
        model: t.metadata["model"].clone(),
        architecture: t.metadata["architecture"].clone(),
        tokens: t.tokens().unwrap(),
        engine: t.metadata["engine"].clone(),
        dtype: t.metadata["dtype"].clone(),
        mode: Mode::parse(&t.metadata["mode"]).unwrap(),
        extra,
    };
    write_trace(dst, tensors, &meta).unwrap();
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

/// `run` of the GLM-5 model against `trace` in `mode` (cache in `dir`): exit code, the first
/// divergence that mode decides with (`first_divergence_chained` for chained alone), the text.
fn first_divergence(dir: &Path, trace: &Path, mode: &str) -> (i32, Value, String) {
    let (code, j, text) = run_trace(dir, &model(), trace, &["--mode", mode, "--no-cache"]);
    let key = if mode == "chained" {
        "first_divergence_chained"
    } else {
        "first_divergence"
    };
    (code, j[key].clone(), text)
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
        let (code, first, text) = first_divergence(tmp.path(), &doctored, mode);
        assert_eq!(code, 1, "{mode}: {text}");
        let first = first.to_string();
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

/// The bf16 dump whose 32-token prompt prunes in every layer (8 keys of up to 32 kept).
fn pruning_dump() -> PathBuf {
    fixtures("engines")
        .join("glm5-tiny")
        .join("glm5-tiny.dsa.cuda-bf16.trace.safetensors")
}

/// The trace `src` written to `dst` with one key's DSA index scores in `layer` multiplied by
/// `scale` (a bug in that key's cached indexer key), that layer's selection the top-k of the
/// doctored scores (an engine that selects from its own scores), and the hooks after that
/// selection left out (as a serving engine dumps a subset). The key is the one of smallest
/// scores (so the whole tensor's error stays small) among those with 12 or more causal rows
/// whose doctoring changes a selection. Returns `(key, rows whose selection changed)`.
fn scale_one_key(src: &Path, dst: &Path, layer: usize, scale: f32) -> (usize, usize) {
    let t = read_trace(src).unwrap();
    let mut tensors = crate::common::host_tensors(&t);
    let (sn, tn) = (
        format!("blk.{layer}.indexer_scores"),
        format!("blk.{layer}.indexer_topk"),
    );
    let cols = tensors[&sn].shape[1];
    let w = tensors[&tn].shape[1];
    let scores = tensors[&sn].as_f32("scores").unwrap().to_vec();
    let norm = |k: usize| -> f64 {
        scores
            .chunks(cols)
            .map(|r| r[k])
            .filter(|x| x.is_finite())
            .map(|x| f64::from(x) * f64::from(x))
            .sum()
    };
    let rows_of = |k: usize| scores.chunks(cols).filter(|r| r[k].is_finite()).count();
    let mut keys: Vec<usize> = (0..cols).filter(|&k| rows_of(k) >= 12).collect();
    keys.sort_by(|&a, &b| norm(a).total_cmp(&norm(b)));
    let top_k = |s: &[f32]| -> Vec<i32> {
        let mut order: Vec<usize> = (0..cols).filter(|&i| s[i].is_finite()).collect();
        order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
        let mut v: Vec<i32> = order.iter().take(w).map(|&i| i as i32).collect();
        v.resize(w, -1);
        v
    };
    let same = |a: &[i32], b: &[i32]| {
        let (mut a, mut b) = (a.to_vec(), b.to_vec());
        a.sort_unstable();
        b.sort_unstable();
        a == b
    };
    let ids = tensors[&tn].as_i32("ids").unwrap().to_vec();
    let (key, doctored, selection, changed) = keys
        .iter()
        .find_map(|&k| {
            let mut d = scores.clone();
            for row in d.chunks_mut(cols) {
                if row[k].is_finite() {
                    row[k] *= scale;
                }
            }
            let mut sel = Vec::with_capacity(ids.len());
            let mut changed = 0;
            for (row, old) in d.chunks(cols).zip(ids.chunks(w)) {
                let new = top_k(row);
                changed += usize::from(!same(&new, old));
                sel.extend(new);
            }
            (changed > 0).then_some((k, d, sel, changed))
        })
        .expect("a key whose scaling changes a selection");
    tensors
        .get_mut(&sn)
        .unwrap()
        .as_f32_mut("scores")
        .unwrap()
        .copy_from_slice(&doctored);
    tensors
        .get_mut(&tn)
        .unwrap()
        .as_i32_mut("ids")
        .unwrap()
        .copy_from_slice(&selection);
    // Keep what comes before the selection: earlier layers, and this layer up to it.
    let order = glmdiff::compare::graph::POINT_ORDER;
    let upto = order.iter().position(|p| *p == "indexer_topk").unwrap();
    tensors.retain(|n, _| match n.strip_prefix("blk.") {
        Some(rest) => {
            let (l, point) = rest.split_once('.').unwrap();
            let l: usize = l.parse().unwrap();
            l < layer || (l == layer && order[..=upto].contains(&point))
        }
        None => n == "token_embd",
    });
    let what =
        format!("layer {layer}: key {key}'s index scores x{scale}, the selection following them");
    write_doctored(&t, &tensors, dst, &what);
    (key, changed)
}

/// An engine whose selection is the top-k of its own wrong scores (one key's scores x0.5 or
/// x1.5) is not excused by them: however small the scores' error is over the whole tensor,
/// that key's column is named at the score hook (chained alone, past layers whose carried
/// error widens the allowance, the selection's confident flip), in every mode.
#[test]
fn a_selection_following_its_own_wrong_scores_is_named_at_the_scores() {
    let tmp = tempfile::tempdir().unwrap();
    for layer in [0usize, 2] {
        for scale in [0.5f32, 1.5] {
            let doctored = tmp
                .path()
                .join(format!("key.{layer}.{scale}.trace.safetensors"));
            let (key, changed) = scale_one_key(&pruning_dump(), &doctored, layer, scale);
            assert!(changed > 0, "layer {layer} x{scale}: no selection changed");
            for mode in ["replay", "chained", "both"] {
                let (code, first, text) = first_divergence(tmp.path(), &doctored, mode);
                let what = format!("layer {layer}, key {key} x{scale}, {mode}");
                assert_eq!(code, 1, "{what}: {text}");
                let first = &first;
                let hook = first["hook"].as_str().unwrap_or_default();
                let note = first["note"].as_str().unwrap_or_default();
                if mode == "chained" && hook == format!("blk.{layer}.indexer_topk") {
                    // Chained alone, past layers whose error the scores' allowance carries,
                    // the selection's confident flip names it.
                    assert!(note.contains("confident flip"), "{what}: {note}");
                } else {
                    assert_eq!(
                        hook,
                        format!("blk.{layer}.indexer_scores"),
                        "{what}: {first}"
                    );
                    assert!(note.starts_with(&format!("key {key}:")), "{what}: {note}");
                }
            }
        }
    }
}
