//! Traces of engines that do not hand over every hook (RoPE fused into attention, the router in
//! one kernel, llama.cpp's graph names, layer outputs only, no selection scores), made from the
//! real bf16 dumps of `fixtures/engines/` by keeping a subset of their hooks (`common::subset`).
//! Replay runs across the missing hooks: every clean dump must still come out clean in replay
//! and in both modes (its selections judged by margin on the reference's own scores, the
//! near-tie alternatives kept being what the candidate really selected), in chained mode too
//! (the reference's chain follows the candidate's near ties, or the alternatives closest to its
//! next captured hook), and every planted bug must still exit 1, named at its own hook or at the
//! segment that contains it (chained: at its hook, or the first hook of its layer after it that
//! the trace has).

use std::collections::BTreeMap;
use std::path::PathBuf;

use glmdiff::trace::read_trace;
use serde_json::Value;

use crate::common::run_trace;
use crate::common::subset::{keeps, write_subset, SUBSETS};

/// The first divergence as the table shows it: the segment's name, or the hook.
fn named(j: &Value) -> String {
    let fd = &j["first_divergence"];
    if fd.is_null() {
        return "-".into();
    }
    fd["segment"]
        .as_str()
        .or(fd["hook"].as_str())
        .unwrap_or("?")
        .to_string()
}

/// The near-tie alternatives the pairs' notes say explain the candidate better:
/// `(selection, token, entered, left)`, read from `SEL token T: [..] in, [..] out`.
fn alternatives(j: &Value, mode: &str) -> Vec<(String, usize, Vec<i64>, Vec<i64>)> {
    let ids = |s: &str| -> Vec<i64> {
        s.trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().parse().unwrap())
            .collect()
    };
    let mut out = Vec::new();
    for r in j["records"].as_array().into_iter().flatten() {
        let Some(note) = r[mode]["note"].as_str() else {
            continue;
        };
        let Some((_, rest)) = note.split_once("explain") else {
            continue;
        };
        for item in rest.split(';') {
            let Some((head, tail)) = item.split_once(": ") else {
                continue;
            };
            let Some((sel, token)) = head.trim().rsplit_once(" token ") else {
                continue;
            };
            let (Some((entered, rest)), Ok(token)) = (tail.split_once(" in, "), token.parse())
            else {
                continue;
            };
            let Some((left, _)) = rest.split_once(" out") else {
                continue;
            };
            let sel = sel.rsplit(' ').next().unwrap_or(sel).to_string();
            out.push((sel, token, ids(entered), ids(left)));
        }
    }
    out
}

/// Chained: whether the first chained divergence is at `expect`, or, where the trace lacks
/// `expect`, at a hook of its layer downstream of it (the first compared hook it reaches).
fn names_hook_chained(j: &Value, expect: &str, subset: &str) -> bool {
    let fd = &j["first_divergence_chained"];
    let hook = fd["hook"].as_str().unwrap_or("");
    if hook == expect {
        return true;
    }
    let (Some((l, p)), Some((fl, fp))) = (
        glmdiff::model::names::split_blk(expect),
        glmdiff::model::names::split_blk(hook),
    ) else {
        return false;
    };
    let order = glmdiff::compare::graph::order_key;
    !keeps(subset, expect)
        && l == fl
        && order(&format!("blk.{l}.{fp}")) > order(&format!("blk.{l}.{p}"))
}

/// Whether the first divergence is at `expect` or ends a segment through it.
fn names_hook(j: &Value, expect: &str) -> bool {
    let fd = &j["first_divergence"];
    if fd["hook"] == expect {
        return true;
    }
    let hook = fd["hook"].as_str().unwrap_or("");
    j["records"].as_array().unwrap().iter().any(|r| {
        r["hook"] == hook
            && r["segment"]["through"]
                .as_array()
                .is_some_and(|t| t.iter().any(|h| h == expect))
    })
}

#[test]
fn engines_without_every_hook_are_clean_and_planted_bugs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let pairs: Vec<(PathBuf, PathBuf)> = crate::common::trace_pairs(
        &crate::common::fixtures("engines"),
        &crate::common::fixtures("models"),
    );
    // Planted bugs: one row per dump, subset and mode; clean dumps: counted per subset and mode.
    let mut rows: Vec<String> = Vec::new();
    let mut clean_runs: BTreeMap<(&str, &str), (usize, usize)> = BTreeMap::new();
    let mut alts = 0usize;
    // Chained: near-tie alternatives kept, and how many are the candidate's own selection.
    let mut chained_alts = (0usize, 0usize);
    // Chained, per subset: the largest clean error over what is allowed, the smallest planted.
    let mut chained_clean: BTreeMap<&str, (f64, String)> = BTreeMap::new();
    let mut chained_planted: BTreeMap<&str, (f64, String)> = BTreeMap::new();
    let mut judged = 0usize;
    let mut bad: Vec<String> = Vec::new();
    // Per subset: the largest clean segment error over its floor (hook), the smallest planted
    // one (hook).
    let mut clean_worst: BTreeMap<&str, (f64, String)> = BTreeMap::new();
    let mut planted_least: BTreeMap<&str, (f64, String)> = BTreeMap::new();
    for (trace, gguf) in &pairs {
        let meta = read_trace(trace).unwrap().metadata;
        let name = trace.file_name().unwrap().to_string_lossy().into_owned();
        let expect = meta.get("expect_first_divergence");
        let full = read_trace(trace).unwrap();
        for subset in SUBSETS {
            let sub = dir.path().join(format!("{subset}.{name}"));
            write_subset(
                trace,
                &sub,
                &|n| keeps(subset, n),
                "not dumped by this engine",
            );
            for mode in ["replay", "chained", "both"] {
                let (rc, j, text) = run_trace(dir.path(), gguf, &sub, &["--mode", mode]);
                match expect {
                    Some(_) if mode == "chained" => rows.push(format!(
                        "| {name} | {subset} | {mode} | {rc} | {} (chained) |",
                        j["first_divergence_chained"]["hook"]
                            .as_str()
                            .unwrap_or("-")
                    )),
                    Some(_) => rows.push(format!(
                        "| {name} | {subset} | {mode} | {rc} | {} |",
                        named(&j)
                    )),
                    None => {
                        let c = clean_runs.entry((subset, mode)).or_default();
                        c.0 += 1;
                        c.1 += usize::from(rc == 0);
                    }
                }
                if mode == "replay" {
                    match expect {
                        None => {
                            for r in j["records"].as_array().into_iter().flatten() {
                                let res = &r["replay"];
                                if r["segment"].is_null() || res["metrics"]["kind"] != "float" {
                                    continue;
                                }
                                let ratio = res["error"].as_f64().unwrap_or(f64::INFINITY)
                                    / res["allowed"].as_f64().unwrap();
                                let w = clean_worst.entry(subset).or_insert((0.0, String::new()));
                                if ratio > w.0 {
                                    *w = (ratio, format!("{} in {name}", r["segment"]["name"]));
                                }
                            }
                        }
                        Some(_) => {
                            let fd = &j["first_divergence"];
                            if let (Some(e), Some(a)) =
                                (fd["error"].as_f64(), fd["allowed"].as_f64())
                            {
                                let w = planted_least
                                    .entry(subset)
                                    .or_insert((f64::INFINITY, String::new()));
                                if e / a < w.0 {
                                    *w = (e / a, format!("{} in {name}", named(&j)));
                                }
                            }
                        }
                    }
                }
                // A near-tie alternative kept for a clean dump is what the candidate really
                // selected there (its full dump has the selection).
                if expect.is_none() {
                    for (sel, t, entered, left) in alternatives(&j, "replay") {
                        let v = full.get(&sel).unwrap();
                        let w = *v.shape.last().unwrap();
                        let row = &v.ints(&sel).unwrap()[t * w..(t + 1) * w];
                        let really = entered.iter().all(|e| row.contains(e))
                            && !left.iter().any(|l| row.contains(l));
                        alts += 1;
                        if !really {
                            bad.push(format!(
                                "{name} {subset}: {sel} token {t}: {entered:?} in, {left:?} out, the candidate selected {row:?}"
                            ));
                        }
                    }
                }
                // Every flip is judged by margin, on the reference's own scores where the
                // candidate has none.
                for r in j["records"].as_array().into_iter().flatten() {
                    for m in ["replay", "chained"] {
                        let f = &r[m]["flips"];
                        if !f.is_null() && f["judged"] != true {
                            bad.push(format!("{name} {subset} {mode}: {} {m}: {f}", r["hook"]));
                        }
                        judged += usize::from(!f.is_null() && *subset == "no_scores");
                    }
                }
                // The text names the first divergence as the JSON does (its segment).
                let shown = format!(
                    "first divergence (replay, the step's own error): {}",
                    named(&j)
                );
                if mode == "chained" {
                    match expect {
                        None => {
                            for r in j["records"].as_array().into_iter().flatten() {
                                let res = &r["chained"];
                                if res["metrics"]["kind"] != "float" {
                                    continue;
                                }
                                let ratio = res["error"].as_f64().unwrap_or(f64::INFINITY)
                                    / res["allowed"].as_f64().unwrap();
                                let w = chained_clean.entry(subset).or_insert((0.0, String::new()));
                                if ratio > w.0 {
                                    *w = (ratio, format!("{} in {name}", r["hook"]));
                                }
                            }
                        }
                        Some(_) => {
                            let fd = &j["first_divergence_chained"];
                            if let (Some(e), Some(a)) =
                                (fd["error"].as_f64(), fd["allowed"].as_f64())
                            {
                                let w = chained_planted
                                    .entry(subset)
                                    .or_insert((f64::INFINITY, String::new()));
                                if e / a < w.0 {
                                    *w = (e / a, format!("{} in {name}", fd["hook"]));
                                }
                            }
                        }
                    }
                }
                // Chained: the followed chain tries the same alternatives; count those that
                // are the candidate's own selection.
                if expect.is_none() && mode == "chained" {
                    for (sel, t, entered, left) in alternatives(&j, "chained") {
                        let v = full.get(&sel).unwrap();
                        let w = *v.shape.last().unwrap();
                        let row = &v.ints(&sel).unwrap()[t * w..(t + 1) * w];
                        let really = entered.iter().all(|e| row.contains(e))
                            && !left.iter().any(|l| row.contains(l));
                        chained_alts.0 += 1;
                        chained_alts.1 += usize::from(really);
                    }
                }
                let ok = match (expect, mode) {
                    (None, _) => rc == 0 && j["first_divergence_chained"].is_null(),
                    (Some(e), "chained") => rc == 1 && names_hook_chained(&j, e, subset),
                    (Some(e), _) => rc == 1 && names_hook(&j, e) && text.contains(&shown),
                };
                if !ok {
                    bad.push(format!(
                        "{name} {subset} --mode {mode}: exit {rc}, expected {}: {}",
                        expect.map_or("clean".into(), |e| format!("1 at {e}")),
                        text.lines()
                            .filter(|l| l.contains("first divergence") || l.contains("FAIL"))
                            .collect::<Vec<_>>()
                            .join(" / ")
                    ));
                }
            }
        }
    }
    eprintln!("\n| trace | subset | mode | exit | first divergence (replay) |");
    eprintln!("|---|---|---|---|---|");
    for ((subset, mode), (n, ok)) in &clean_runs {
        eprintln!("| {n} clean dumps and models | {subset} | {mode} | 0 in {ok} of {n} | - |");
    }
    for r in &rows {
        eprintln!("{r}");
    }
    eprintln!("\n| subset | worst clean segment error / floor | smallest planted error / floor |");
    eprintln!("|---|---|---|");
    for subset in SUBSETS {
        let c = clean_worst.get(subset).cloned().unwrap_or_default();
        let p = planted_least.get(subset).cloned().unwrap_or_default();
        eprintln!("| {subset} | {:.3} ({}) | {:.1} ({}) |", c.0, c.1, p.0, p.1);
    }
    eprintln!(
        "near-tie alternatives kept in clean dumps: {alts}, each the candidate's own selection"
    );
    eprintln!("\n| subset | worst clean chained error / allowed | smallest planted chained error / allowed |");
    eprintln!("|---|---|---|");
    for subset in SUBSETS {
        let c = chained_clean.get(subset).cloned().unwrap_or_default();
        let p = chained_planted.get(subset).cloned().unwrap_or_default();
        eprintln!("| {subset} | {:.3} ({}) | {:.1} ({}) |", c.0, c.1, p.0, p.1);
    }
    eprintln!(
        "near-tie alternatives kept by the followed chain in clean dumps: {}, {} of them the candidate's own selection",
        chained_alts.0, chained_alts.1
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(
        chained_alts.0 > 0 && chained_alts.0 == chained_alts.1,
        "the followed chain's alternatives must be the candidate's own selections: {chained_alts:?}"
    );
    assert!(
        judged > 0,
        "selections without their scores must be judged by margin"
    );
    assert!(
        alts > 0,
        "the long DSA prompts must need near-tie alternatives"
    );
}

/// `glmdiff compare REFERENCE DUMP` (two traces, no model): the reference's own trace for the
/// dump's tokens (written here by `glmdiff trace`) against every engine dump, whole and cut to
/// each subset. The same judge as far as it can go without a model: flips judged by margin
/// (the router's unknown selection bias bounded by what the reference's own selections imply),
/// drift only in the rows a near tie reaches, where a selection the dump lacks has a near tie
/// those rows may differ; every clean dump exits 0, every planted bug exits 1 at its hook or at
/// the first hook of its layer after it that the dump has.
#[test]
fn compare_of_two_traces_is_clean_for_correct_engines_and_names_planted_bugs() {
    let dir = tempfile::tempdir().unwrap();
    let pairs: Vec<(PathBuf, PathBuf)> = crate::common::trace_pairs(
        &crate::common::fixtures("engines"),
        &crate::common::fixtures("models"),
    );
    let mut references: BTreeMap<(PathBuf, Vec<u32>), PathBuf> = BTreeMap::new();
    let (mut clean, mut planted) = (0usize, 0usize);
    let mut bad: Vec<String> = Vec::new();
    for (trace, gguf) in &pairs {
        let t = read_trace(trace).unwrap();
        let tokens = t.tokens().unwrap();
        let expect = t.metadata.get("expect_first_divergence").cloned();
        let name = trace.file_name().unwrap().to_string_lossy().into_owned();
        let n = references.len();
        let reference = references
            .entry((gguf.clone(), tokens.clone()))
            .or_insert_with(|| {
                let out = dir.path().join(format!("reference{n}.trace.safetensors"));
                let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
                let o = crate::common::glmdiff_in(
                    dir.path(),
                    &[
                        "trace",
                        gguf.to_str().unwrap(),
                        "--tokens",
                        &ids.join(","),
                        "--out",
                        out.to_str().unwrap(),
                    ],
                );
                assert!(o.status.success(), "{}", crate::common::output_text(&o));
                out
            })
            .clone();
        for subset in ["full"].iter().chain(SUBSETS) {
            let dump = if *subset == "full" {
                trace.clone()
            } else {
                let sub = dir.path().join(format!("{subset}.{name}"));
                write_subset(
                    trace,
                    &sub,
                    &|n| keeps(subset, n),
                    "not dumped by this engine",
                );
                sub
            };
            let json = dir.path().join("c.json");
            let o = crate::common::glmdiff_in(
                dir.path(),
                &[
                    "compare",
                    reference.to_str().unwrap(),
                    dump.to_str().unwrap(),
                    "--json",
                    json.to_str().unwrap(),
                ],
            );
            let (rc, j, text) = crate::common::outcome(o, &json);
            let ok = match &expect {
                None => rc == 0,
                Some(e) => {
                    let s = if *subset == "full" {
                        "no_scores"
                    } else {
                        subset
                    };
                    rc == 1 && names_hook_chained(&j, e, s)
                }
            };
            match &expect {
                None => clean += 1,
                Some(_) => planted += 1,
            }
            if !ok {
                bad.push(format!(
                    "{name} ({subset}) with {}: exit {rc}, expected {}: {}",
                    gguf.file_name().unwrap().to_string_lossy(),
                    expect
                        .as_ref()
                        .map_or("clean".into(), |e| format!("1 at {e}")),
                    text.lines()
                        .filter(|l| l.contains("first divergence"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                ));
            }
        }
    }
    eprintln!("compare: {clean} clean comparisons, {planted} planted");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(
        clean > 100 && planted > 40,
        "{clean} clean, {planted} planted"
    );
}
