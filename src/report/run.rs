//! Printing `glmdiff run` and `glmdiff compare`: the header, the hook table with passing layers
//! folded, the first divergences with the command that re-runs that layer, the output
//! distributions, and the JSON document of `docs/run-json.md`. Everything here formats facts
//! computed by [`crate::compare`]; nothing is computed.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::layout::{self, shell_lines, wrap_items};
use super::Grid;
use crate::compare::logits::LogitsReport;
use crate::compare::systematic::{MIN_ELEMENTS, MIN_ROWS};
use crate::compare::{
    Comparison, HookRecord, Metrics, ModeResult, Override, Status, UntestedSummary,
};
use crate::driver::pair::{LayerTime, ReferenceWork, Work};
use crate::explain::{Explanation, Tested};
use crate::trace::Mode;
use crate::util::shell::shell_word;

/// Version of the JSON document (`glmdiff_run` key).
pub const RUN_JSON_VERSION: u32 = 1;

/// One side of a comparison as the header shows it.
#[derive(Clone, Debug, Default)]
pub struct EngineDesc {
    /// What was asked (`cpu`, `trace:FILE`).
    pub spec: String,
    /// The engine's own description (`cpu`, `transformers-5.24.0 float64`).
    pub describe: String,
    /// Its compute precision string.
    pub dtype: String,
}

/// Facts about the run that the comparison does not hold.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// Command (`run` or `compare`).
    pub command: String,
    /// Model path as given (or the reference trace for `compare`).
    pub model: String,
    /// Architecture.
    pub architecture: String,
    /// Layers run `(first, end)`, and the model's layer count.
    pub layers: Option<(usize, usize, usize)>,
    /// Prompt tokens with their text.
    pub tokens: Vec<(u32, String)>,
    /// The reference.
    pub reference: EngineDesc,
    /// The candidate.
    pub candidate: EngineDesc,
    /// Modes run.
    pub modes: Vec<Mode>,
    /// Notes to show under the header (assumptions, choices).
    pub notes: Vec<String>,
    /// What the reference cache did (read, or computed and stored, and where): a note kept apart
    /// because it changes between runs of the same inputs.
    pub cache: Option<String>,
    /// Command that re-runs the first divergent layer, when there is one.
    pub rerun: Option<String>,
    /// Timings: (what, seconds).
    pub timings: Vec<(String, f64)>,
    /// Wall time of each side's steps per layer (`run` with an engine candidate).
    pub layer_times: Vec<LayerTime>,
    /// The comparison's seconds by what it was handed (`run`), the largest first.
    pub compare_times: Vec<(String, f64)>,
    /// The reference's seconds by step and cause (`run`), the largest first.
    pub reference_times: Vec<(String, f64)>,
    /// The candidate engine's seconds by step and mode (`run`), the largest first.
    pub candidate_times: Vec<(String, f64)>,
    /// The wall by which the candidate engine's side of a step ended after the reference's, by
    /// step (`run`), the largest first.
    pub candidate_beyond_times: Vec<(String, f64)>,
    /// What the reference computed, by cause (`run`; `None` for `compare`).
    pub reference_work: Option<ReferenceWork>,
    /// What `--explain` found (`None` without it).
    pub explanation: Option<Explanation>,
    /// What `--repro` did (`None` without it).
    pub repro: Option<String>,
}

/// `per layer: ...`: the mean and the slowest layer of each side's step time, and of the part
/// of the candidate's spent on its weights (with the bytes a layer), or `None` without layers.
fn layer_time_line(times: &[LayerTime], width: Option<usize>) -> Option<String> {
    let layers: Vec<&LayerTime> = times.iter().filter(|t| t.layer.is_some()).collect();
    if layers.is_empty() {
        return None;
    }
    let part = |name: &str, f: fn(&LayerTime) -> f64| -> Option<String> {
        let total: f64 = layers.iter().map(|t| f(t)).sum();
        if total == 0.0 {
            return None;
        }
        let slow = layers.iter().max_by(|a, b| f(a).total_cmp(&f(b)))?;
        Some(format!(
            "{name} {:.3} s (slowest: layer {} {:.3} s)",
            total / layers.len() as f64,
            slow.layer.unwrap_or(0),
            f(slow)
        ))
    };
    let mut parts: Vec<String> = [
        part("reference", |t| t.reference),
        part("candidate chained", |t| t.chained),
        part("candidate replay", |t| t.replay),
    ]
    .into_iter()
    .flatten()
    .collect();
    // The part of the candidate's time spent on its weights (inside chained and replay).
    let bytes: u64 = layers.iter().map(|t| t.upload_bytes).sum();
    let upload: f64 = layers.iter().map(|t| t.upload).sum();
    if bytes > 0 || upload > 0.0 {
        let n = layers.len() as f64;
        let slow = layers
            .iter()
            .max_by(|a, b| a.upload.total_cmp(&b.upload))
            .copied()
            .copied()
            .unwrap_or_default();
        let per = bytes as f64 / n;
        let size = if per >= 1e9 {
            format!("{:.2} GB", per / 1e9)
        } else {
            format!("{:.1} MB", per / 1e6)
        };
        parts.push(format!(
            "candidate weight uploads {:.3} s (slowest: layer {} {:.3} s; {size} a layer)",
            upload / n,
            slow.layer.unwrap_or(0),
            slow.upload
        ));
    }
    parts.extend(part("comparison", |t| t.compare));
    parts.extend(part("waited for the comparison", |t| t.compare_wait));
    Some(wrap_items(
        &format!("per layer (mean over {}): ", layers.len()),
        &parts,
        ", ",
        width,
    ))
}

/// `reference work: ...`: the reference's time beyond its own chain, by cause (replayed steps
/// recomputed with the candidate's selection, the chain that follows the candidate's near
/// ties), or `None` when it computed nothing beyond its own chain.
fn reference_work_line(w: &ReferenceWork, width: Option<usize>) -> Option<String> {
    let beyond = [
        w.replay_whole,
        w.replay_rows,
        w.followed_whole,
        w.followed_rows,
    ];
    if beyond.iter().all(|x| x.steps == 0) {
        return None;
    }
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let whole = |x: Work| {
        (x.steps > 0).then(|| format!("{:.3} s whole ({})", x.seconds, plural(x.steps, "step")))
    };
    let rows = |x: Work| {
        (x.steps > 0).then(|| {
            format!(
                "{:.3} s in rows ({}, {})",
                x.seconds,
                plural(x.steps, "step"),
                plural(x.rows, "row")
            )
        })
    };
    let reused =
        |x: Work| (x.steps > 0).then(|| format!("{} taken as they were", plural(x.steps, "step")));
    let group = |name: &str, items: Vec<Option<String>>| {
        let items: Vec<String> = items.into_iter().flatten().collect();
        (!items.is_empty()).then(|| format!("{name} {}", items.join(" + ")))
    };
    let joint = (w.joint.steps > 0).then(|| {
        format!(
            "; {} also computing {} of the others",
            plural(w.joint.steps, "expert step"),
            plural(w.joint.rows, "row")
        )
    });
    let parts: Vec<String> = [
        Some(format!(
            "own chain {:.3} s ({}{})",
            w.plain.seconds,
            plural(w.plain.steps, "step"),
            joint.unwrap_or_default()
        )),
        group(
            "the candidate's selections in replay",
            vec![whole(w.replay_whole), rows(w.replay_rows)],
        ),
        group(
            "the chain following its near ties",
            vec![
                whole(w.followed_whole),
                rows(w.followed_rows),
                reused(w.followed_reused),
            ],
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    Some(wrap_items("reference work: ", &parts, ", ", width))
}

fn e(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.2e}")
    }
}

fn status_word(r: Option<&ModeResult>) -> &'static str {
    match r.map(|r| r.status) {
        None => "",
        Some(Status::Pass) => "ok",
        Some(Status::NearTie) => "near-tie",
        Some(Status::Fail) => "FAIL",
        Some(Status::Drift) => "drift",
        Some(Status::Missing) => "missing",
    }
}

fn verdict(rec: &HookRecord) -> String {
    let parts: Vec<String> = [(Mode::Replay, &rec.replay), (Mode::Chained, &rec.chained)]
        .iter()
        .filter_map(|(m, r)| r.as_ref().map(|r| (m, r)))
        .map(|(m, r)| format!("{} {}", &m.as_str()[..1], status_word(Some(r))))
        .collect();
    let all_ok = [&rec.replay, &rec.chained]
        .iter()
        .all(|r| r.as_ref().is_none_or(|r| r.status == Status::Pass));
    let near = [&rec.replay, &rec.chained].iter().all(|r| {
        r.as_ref()
            .is_none_or(|r| matches!(r.status, Status::Pass | Status::NearTie))
    });
    if near && !all_ok {
        return "ok (near-tie flips)".into();
    }
    if all_ok {
        "ok".into()
    } else {
        parts.join(", ")
    }
}

fn mode_error(r: Option<&ModeResult>) -> String {
    match r {
        None => String::new(),
        Some(r) if r.status == Status::Missing => "missing".into(),
        Some(r) => match &r.metrics {
            Some(Metrics::Ids(m)) => format!("J {:.3}", m.mean_jaccard),
            _ => e(r.error),
        },
    }
}

/// The hook's primary result: replay when it ran, else chained.
fn primary(rec: &HookRecord) -> Option<&ModeResult> {
    rec.replay
        .as_ref()
        .filter(|r| r.status != Status::Missing)
        .or(rec.chained.as_ref())
}

/// The hook as the table names it: the segment it ends (`blk.0.q_pe_rope..blk.0.attn_heads`)
/// when replay ran across hooks the trace lacks, else its name.
fn shown_name(rec: &HookRecord) -> &str {
    rec.segment.as_ref().map_or(&rec.name, |s| &s.name)
}

/// The chained error against the reference's own chain (the plain chain column).
fn plain_error(r: Option<&ModeResult>) -> String {
    match r {
        None => String::new(),
        Some(r) if r.status == Status::Missing => "missing".into(),
        Some(r) => match (&r.metrics, r.plain_error) {
            (_, None) => "-".into(),
            (Some(Metrics::Ids(_)), Some(x)) => format!("J {:.3}", 1.0 - x),
            (_, Some(x)) => e(x),
        },
    }
}

fn hook_row(rec: &HookRecord, plain: bool) -> Vec<String> {
    let p = primary(rec);
    let (maxd, nmse, cos) = match p.and_then(|r| r.metrics.as_ref()) {
        Some(Metrics::Float(m)) => (
            format!("{} @{:?}", e(m.max_abs), m.max_abs_at),
            e(m.nmse),
            format!("{:.6}", m.cosine),
        ),
        Some(Metrics::Ids(m)) => (
            format!("{}/{} rows equal", m.set_equal_rows, m.rows),
            "-".into(),
            "-".into(),
        ),
        None => (
            p.and_then(|r| r.note.clone()).unwrap_or_default(),
            "-".into(),
            "-".into(),
        ),
    };
    let mut row = vec![
        shown_name(rec).to_string(),
        format!("{:?}", rec.shape),
        maxd,
        nmse,
        cos,
        mode_error(rec.replay.as_ref()),
        mode_error(rec.chained.as_ref()),
    ];
    if plain {
        row.push(plain_error(rec.chained.as_ref()));
    }
    row.extend([e(rec.floor), verdict(rec)]);
    row
}

/// Renders the whole text report, fitted to [`layout::width`].
pub fn render(h: &Header, c: &Comparison, text: &dyn Fn(u32) -> String, all_steps: bool) -> String {
    render_at(h, c, text, all_steps, layout::width())
}

/// [`render`] fitted to `width` (`None`: every column, nothing wrapped).
pub fn render_at(
    h: &Header,
    c: &Comparison,
    text: &dyn Fn(u32) -> String,
    all_steps: bool,
    width: Option<usize>,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "glmdiff {}: {} ({})", h.command, h.model, h.architecture);
    if let Some((a, b, n)) = h.layers {
        let _ = writeln!(s, "layers: {a}..{b} of {n}");
    }
    let toks: Vec<String> = h
        .tokens
        .iter()
        .map(|(id, t)| format!("{id} {t}").trim_end().to_string())
        .collect();
    let _ = writeln!(
        s,
        "{}",
        wrap_items(
            &format!("tokens ({}): ", h.tokens.len()),
            &toks,
            " | ",
            width
        )
    );
    for (what, d) in [("reference", &h.reference), ("candidate", &h.candidate)] {
        let _ = writeln!(s, "{what}: {} = {} [{}]", d.spec, d.describe, d.dtype);
    }
    let modes: Vec<&str> = h.modes.iter().map(|m| m.as_str()).collect();
    let _ = writeln!(s, "mode: {}", modes.join(" + "));
    for n in h.notes.iter().chain(&h.cache) {
        let _ = writeln!(s, "note: {n}");
    }
    // A trace's per-step precision map is said once, in a note; its globs are in the JSON.
    for o in c
        .overrides()
        .iter()
        .filter(|o| o.source != "the trace's precision")
    {
        let _ = writeln!(s, "override: {}", override_line(o));
    }
    let _ = writeln!(s);

    // Narrow: the hook, both modes' errors, the floor and the verdict stay. The reference's
    // own chain (its own selections everywhere) is shown where it parted from the chain that
    // followed the candidate's near ties.
    let plain = c.records().iter().any(|r| {
        r.chained
            .as_ref()
            .is_some_and(|m| m.plain_error.is_some_and(|p| p != m.error && !p.is_nan()))
    });
    let mut cols = vec![
        ("hook", 0),
        ("shape", 5),
        ("max |diff| @", 3),
        ("NMSE", 4),
        ("cosine", 6),
        ("replay", 0),
        ("chained", 0),
    ];
    if plain {
        cols.push(("own chain", 0));
    }
    cols.extend([("floor", 0), ("verdict", 0)]);
    let mut t = Grid::new(&cols).whole(&[0]);
    let layers = c.layers();
    let first_bad = layers.iter().position(|g| g.failed > 0);
    for (gi, g) in layers.iter().enumerate() {
        let expand = g.layer.is_none() || all_steps || Some(gi) == first_bad;
        if expand {
            for &i in &g.records {
                t.add_row(hook_row(&c.records()[i], plain));
            }
            continue;
        }
        let worst = |slot: usize| {
            g.worst[slot].map_or(String::new(), |(i, err)| {
                let p = crate::compare::floors::point_of(&c.records()[i].name).to_string();
                format!("{} ({p})", e(err))
            })
        };
        let mut v = if g.failed > 0 {
            "FAIL".to_string()
        } else {
            "ok".to_string()
        };
        if g.failed > 0 {
            v.push_str(&format!(" ({} failed)", g.failed));
        }
        if g.drift > 0 {
            v.push_str(&format!(", {} drift", g.drift));
        }
        if g.missing > 0 {
            v.push_str(&format!(", {} missing", g.missing));
        }
        // Rows with near-tie flips, per mode that has some.
        for (n, mode) in g.near_tie.iter().zip(["replay", "chained"]) {
            if *n > 0 {
                v.push_str(&format!(", {n} near-tie row(s) {mode}"));
            }
        }
        let mut row = vec![
            format!("layer {} ({} hooks)", g.label, g.records.len()),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            worst(0),
            worst(1),
        ];
        if plain {
            row.push(g.worst_plain.map_or(String::new(), |(_, err)| e(err)));
        }
        row.extend([format!("<= {}", e(g.floor)), v]);
        t.add_row(row);
    }
    let _ = writeln!(s, "{}", t.render(width));

    let missing: Vec<&HookRecord> = c
        .records()
        .iter()
        .filter(|r| {
            [&r.replay, &r.chained]
                .iter()
                .any(|m| m.as_ref().is_some_and(|m| m.status == Status::Missing))
        })
        .collect();
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().take(12).map(|r| r.name.as_str()).collect();
        let why = missing
            .iter()
            .find_map(|r| {
                [&r.replay, &r.chained]
                    .iter()
                    .find_map(|m| m.as_ref().and_then(|m| m.note.clone()))
            })
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "not compared: {} hooks ({why}{}): {}{}",
            missing.len(),
            if missing.len() > 1 { ", ..." } else { "" },
            names.join(", "),
            if missing.len() > 12 { ", ..." } else { "" }
        );
    }
    if let Some(u) = c.untested() {
        let _ = writeln!(s, "{}", untested_line(&u, width));
    }
    for mode in [Mode::Replay, Mode::Chained] {
        if !h.modes.contains(&mode) {
            continue;
        }
        let label = match mode {
            Mode::Replay => "first divergence (replay, the step's own error):",
            Mode::Chained => "first divergence (chained, accumulated):",
        };
        match c.first_divergence(mode) {
            Some(r) => {
                let res = r.result(mode);
                let name = match mode {
                    Mode::Replay => shown_name(r),
                    Mode::Chained => &r.name,
                };
                let _ = writeln!(
                    s,
                    "{label} {name} ({})",
                    res.and_then(|x| x.note.clone()).unwrap_or_default()
                );
            }
            None => {
                let _ = writeln!(s, "{label} none");
            }
        }
    }
    if let Some(x) = &h.explanation {
        s.push_str(&render_explanation(x));
    }
    if let Some(r) = &h.repro {
        // The command on a line of its own when the line is too long.
        match r.split_once("; re-run it with: ") {
            Some((what, cmd)) if width.is_some_and(|w| r.chars().count() > w) => {
                let _ = writeln!(s, "{what};");
                let _ = writeln!(s, "{}", shell_lines("  re-run it with:", cmd, width));
            }
            _ => {
                let _ = writeln!(s, "{r}");
            }
        }
    }
    s.push_str(&render_flips(c, width));
    let drift: Vec<&HookRecord> = c
        .records()
        .iter()
        .filter(|r| {
            r.chained
                .as_ref()
                .is_some_and(|m| m.status == Status::Drift)
        })
        .collect();
    if let Some(first) = drift.first() {
        let origin = first
            .chained
            .as_ref()
            .and_then(|m| m.drift_from.clone())
            .unwrap_or_default();
        let names: Vec<&str> = drift.iter().take(8).map(|r| r.name.as_str()).collect();
        let _ = writeln!(
            s,
            "chained drift (expected, not a divergence): {} hooks differ beyond their floors downstream of {origin}: {}{}",
            drift.len(),
            names.join(", "),
            if drift.len() > 8 { ", ..." } else { "" }
        );
    }
    if let Some(cmd) = &h.rerun {
        let _ = writeln!(s, "{}", shell_lines("re-run that layer:", cmd, width));
    }
    let mode = if h.modes.contains(&Mode::Chained) {
        Mode::Chained
    } else {
        Mode::Replay
    };
    if let Some((m, l)) = c
        .logits()
        .iter()
        .find(|(m, _)| *m == mode)
        .or(c.logits().first())
    {
        let _ = writeln!(s);
        s.push_str(&render_logits(*m, l, text, width));
    }
    let by_tol: usize = (c.overrides().iter())
        .filter(|o| o.kind == "tol")
        .map(|o| o.hooks)
        .sum();
    let verdict = match (c.differs(), by_tol) {
        (true, _) => "DIFFERS: a step diverges beyond what precision explains".to_string(),
        (false, 0) => "OK: every compared hook is within its floor".to_string(),
        (false, n) => format!(
            "OK: every compared hook is within its floor ({n} of those floors set by --tol, not by precision)"
        ),
    };
    let _ = writeln!(s, "\n{verdict}");
    if !h.timings.is_empty() {
        let t: Vec<String> = h
            .timings
            .iter()
            .map(|(w, sec)| format!("{w} {sec:.2} s"))
            .collect();
        let _ = writeln!(s, "time: {}", t.join(", "));
    }
    if let Some(line) = layer_time_line(&h.layer_times, width) {
        let _ = writeln!(s, "{line}");
    }
    if let Some(line) = h
        .reference_work
        .as_ref()
        .and_then(|w| reference_work_line(w, width))
    {
        let _ = writeln!(s, "{line}");
    }
    s
}

/// `sub-floor tests not run: 61 hooks with 5 rows < 8 (prompt too short)`: the float hooks
/// whose systematic test had too few rows or values to run, by why, fitted to `width`.
fn untested_line(u: &UntestedSummary, width: Option<usize>) -> String {
    let part = |class: Option<(usize, usize, usize)>, what: &str, need: usize, why: &str| {
        class.map(|(n, a, b)| {
            let range = if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            };
            let s = if n == 1 { "" } else { "s" };
            format!("{n} hook{s} with {range} {what} < {need}{why}")
        })
    };
    let why: Vec<String> = [
        part(u.short_prompt, "rows", MIN_ROWS, " (prompt too short)"),
        part(
            u.rows_reached,
            "rows",
            MIN_ROWS,
            " (rows an upstream selection difference reaches left out)",
        ),
        part(u.few_values, "values", MIN_ELEMENTS, ""),
    ]
    .into_iter()
    .flatten()
    .collect();
    wrap_items("sub-floor tests not run: ", &why, "; ", width)
}

/// One override in the header's words: what set it, where, and what it decides.
fn override_line(o: &Override) -> String {
    let pair = shell_word(&format!("{}={}", o.glob, o.value));
    match (o.kind, o.source.as_str()) {
        ("tol", _) => format!(
            "--tol {pair} replaces the floor of {} compared hooks: their verdicts are against {}, not precision (flips keep their score hooks' precision floors)",
            o.hooks, o.value
        ),
        (_, "--precision") => format!(
            "--precision {pair} sets the candidate's precision at {} compared hooks (their floors and flip tolerances)",
            o.hooks
        ),
        (_, source) => format!(
            "{source} sets the candidate's precision {pair} at {} compared hooks (their floors and flip tolerances)",
            o.hooks
        ),
    }
}

/// A hypothesis' kind and, for a fitted family, its parameter against the model's:
/// `softmax_scale:0.53366@1 [factor fitted 0.53366 (nominal 1)]`.
fn hypothesis_name(t: &Tested) -> String {
    match (&t.param, t.fitted, t.nominal) {
        (Some(p), Some(f), Some(n)) => {
            format!(
                "{} [{p} fitted {} (nominal {})]",
                t.kind,
                short(f),
                short(n)
            )
        }
        _ => t.kind.clone(),
    }
}

/// A parameter with 5 significant digits, plain between 1e-3 and 1e6, else in e notation.
fn short(x: f64) -> String {
    let r: f64 = format!("{x:.4e}").parse().unwrap_or(x);
    if r == 0.0 || (1e-3..1e6).contains(&r.abs()) {
        format!("{r}")
    } else {
        format!("{r:e}")
    }
}

/// What `--explain` found, in a few lines: the best hypothesis and whether it reproduces the
/// candidate, the next best, and what was left out.
pub fn render_explanation(x: &Explanation) -> String {
    let mut s = String::new();
    match x {
        Explanation::NothingWrong => {
            let _ = writeln!(
                s,
                "explain: nothing to explain: no step fails in replay (every compared hook is within what precision explains)"
            );
        }
        Explanation::NotCaptured { note } => {
            let _ = writeln!(s, "explain: {note}");
        }
        Explanation::Tested {
            hook,
            step,
            allowed,
            reference_residual,
            hypotheses,
            notes,
            ..
        } => {
            let rest = |from: usize| -> String {
                let v: Vec<String> = hypotheses
                    .iter()
                    .skip(from)
                    .take(3)
                    .map(|t| format!("{} ({})", hypothesis_name(t), e(t.residual)))
                    .collect();
                if v.is_empty() {
                    String::new()
                } else {
                    format!("; next best: {}", v.join(", "))
                }
            };
            match hypotheses.first() {
                None => {
                    let _ = writeln!(
                        s,
                        "explain: {hook}: no known bug applies to this step ({step}); no known bug reproduces this"
                    );
                }
                Some(best) if best.reproduces => {
                    let _ = writeln!(
                        s,
                        "explain: {hook}: reproduced by {} (residual {}, floor {}; the reference without a fault: {}){}",
                        hypothesis_name(best),
                        e(best.residual),
                        e(*allowed),
                        e(*reference_residual),
                        rest(1)
                    );
                }
                Some(_) => {
                    let _ = writeln!(
                        s,
                        "explain: {hook}: no known bug reproduces this (floor {}; the reference without a fault: {}); closest: {}",
                        e(*allowed),
                        e(*reference_residual),
                        rest(0).trim_start_matches("; next best: ")
                    );
                }
            }
            for n in notes {
                let _ = writeln!(s, "explain: {n}");
            }
        }
    }
    s
}

/// The selections whose sets differ, one row per hook and mode: how many rows, near-tie or
/// confident, and the margins against their tolerance.
fn render_flips(c: &Comparison, width: Option<usize>) -> String {
    let mut t = Grid::new(&[
        ("selection", 0),
        ("mode", 0),
        ("rows differing", 0),
        ("near-tie", 0),
        ("confident", 0),
        ("followed", 3),
        ("margin min..max", 2),
        ("first flip (token: in / out, margin vs tolerance)", 1),
    ])
    .whole(&[0]);
    let mut any = false;
    for r in c.records() {
        for (mode, res) in [(Mode::Replay, &r.replay), (Mode::Chained, &r.chained)] {
            let Some(f) = res.as_ref().and_then(|x| x.flips.as_ref()) else {
                continue;
            };
            any = true;
            let first = f.first_confident.as_ref().or(f.first.as_ref());
            t.add_row(vec![
                r.name.clone(),
                mode.as_str().to_string(),
                format!("{} of {}", f.differing, f.rows),
                f.near_tie.to_string(),
                f.confident.to_string(),
                match mode {
                    Mode::Chained => f.followed.to_string(),
                    Mode::Replay => "-".into(),
                },
                f.margins
                    .map_or("-".into(), |(a, b)| format!("{}..{}", e(a), e(b))),
                first.map_or("-".into(), |x| {
                    format!(
                        "{}: {:?} / {:?}, {} vs {}",
                        x.token,
                        x.entered,
                        x.left,
                        e(x.margin),
                        e(x.tolerance)
                    )
                }),
            ]);
        }
    }
    if any {
        format!(
            "selections that differ (a flip within its tolerance is a near tie):\n{}\n",
            t.render(width)
        )
    } else {
        String::new()
    }
}

fn tok(text: &dyn Fn(u32) -> String, id: u32) -> String {
    format!("{id}:{}", text(id))
}

/// Renders the output-distribution section fitted to `width` (`None`: every column, nothing
/// wrapped; with a width each top-5 entry has a line of its own).
pub fn render_logits(
    mode: Mode,
    l: &LogitsReport,
    text: &dyn Fn(u32) -> String,
    width: Option<usize>,
) -> String {
    let mut s = String::new();
    let n = l.positions.len();
    let agree = l.positions.iter().filter(|p| p.top1_agree).count();
    let _ = writeln!(
        s,
        "output distribution ({mode}): top-1 agreement {agree}/{n}, KL(ref || cand) max {} mean {}",
        e(l.max_kl),
        e(l.mean_kl)
    );
    let lp = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    let _ = writeln!(
        s,
        "mean entropy (nats): reference {:.3}, candidate {:.3} (uniform over {} tokens: {:.3})",
        l.mean_entropy[0], l.mean_entropy[1], l.vocab, l.uniform_entropy,
    );
    let _ = writeln!(
        s,
        "mean logprob of the prompt's next tokens: reference {}, candidate {}",
        lp(l.mean_next_logprob[0]),
        lp(l.mean_next_logprob[1])
    );
    if l.candidate_flat {
        let _ = writeln!(
            s,
            "FLAT: the candidate's distribution is close to uniform (entropy {:.2}, uniform {:.2}, reference {:.2}): its logits carry less than half the reference's information",
            l.mean_entropy[1], l.uniform_entropy, l.mean_entropy[0]
        );
    }
    // At most 12 positions: the first 3, the last, and the largest KL.
    let mut shown: Vec<usize> = (0..n.min(3)).collect();
    if n > 0 {
        shown.push(n - 1);
    }
    let mut by_kl: Vec<usize> = (0..n).collect();
    by_kl.sort_by(|&a, &b| l.positions[b].kl.total_cmp(&l.positions[a].kl));
    shown.extend(by_kl.into_iter().take(8));
    shown.sort_unstable();
    shown.dedup();
    let mut t = Grid::new(&[
        ("pos", 0),
        ("next", 0),
        ("reference top-5 (logprob)", 0),
        ("candidate top-5 (logprob)", 0),
        ("entropy ref / cand", 2),
        ("KL", 0),
        ("logprob(next) ref / cand", 1),
    ]);
    let sep = if width.is_some() { "\n" } else { ", " };
    let tops = |v: &[(u32, f64)]| {
        v.iter()
            .map(|(id, lp)| format!("{} {lp:.2}", tok(text, *id)))
            .collect::<Vec<_>>()
            .join(sep)
    };
    for &i in &shown {
        let p = &l.positions[i];
        t.add_row(vec![
            p.position.to_string(),
            p.next_token.map_or("-".into(), |id| tok(text, id)),
            tops(&p.reference.top),
            tops(&p.candidate.top),
            format!("{:.3} / {:.3}", p.reference.entropy, p.candidate.entropy),
            e(p.kl),
            format!(
                "{} / {}",
                lp(p.reference.next_logprob),
                lp(p.candidate.next_logprob)
            ),
        ]);
    }
    let _ = writeln!(s, "{}", t.render(width));
    if shown.len() < n {
        let _ = writeln!(
            s,
            "({} of {n} positions shown; the JSON has all)",
            shown.len()
        );
    }
    s
}

fn mode_json(r: &Option<ModeResult>) -> Value {
    match r {
        None => Value::Null,
        Some(r) => {
            let mut v = json!({
                "status": r.status,
                "error": r.error,
                "allowed": r.allowed,
                "note": r.note,
                "metrics": r.metrics,
                "flips": r.flips,
                "drift_from": r.drift_from,
                "plain_error": r.plain_error,
                "systematic": r.systematic,
            });
            // Only where the systematic test could not run.
            if let (Some(u), Some(o)) = (&r.systematic_untested, v.as_object_mut()) {
                o.insert("systematic_untested".to_string(), json!(u));
            }
            v
        }
    }
}

fn divergence_json(c: &Comparison, mode: Mode) -> Value {
    match c.first_divergence(mode) {
        None => Value::Null,
        Some(r) => {
            let res = r.result(mode);
            json!({
                "hook": r.name,
                "layer": r.layer,
                "error": res.map(|x| x.error),
                "allowed": res.map(|x| x.allowed),
                "note": res.and_then(|x| x.note.clone()),
                "segment": match mode {
                    Mode::Replay => r.segment.as_ref().map(|s| s.name.clone()),
                    Mode::Chained => None,
                },
            })
        }
    }
}

/// The JSON document of `docs/run-json.md`.
pub fn to_json(h: &Header, c: &Comparison) -> Value {
    let engine = |d: &EngineDesc| json!({"spec": d.spec, "describe": d.describe, "dtype": d.dtype});
    let records: Vec<Value> = c
        .records()
        .iter()
        .map(|r| {
            json!({
                "hook": r.name,
                "layer": r.layer,
                "shape": r.shape,
                "kind": r.info.kind,
                "reduction": r.info.k,
                "quantized_weight": r.info.quantized,
                "floor": r.floor,
                "inputs": r.inputs,
                "segment": r.segment,
                "replay": mode_json(&r.replay),
                "chained": mode_json(&r.chained),
            })
        })
        .collect();
    let layers: Vec<Value> = c
        .layers()
        .iter()
        .map(|g| {
            let worst = |slot: usize| {
                g.worst[slot].map_or(
                    Value::Null,
                    |(i, err)| json!({"hook": c.records()[i].name, "error": err}),
                )
            };
            json!({
                "layer": g.layer,
                "label": g.label,
                "hooks": g.records.len(),
                "worst_replay": worst(0),
                "worst_chained": worst(1),
                "worst_chained_plain": g.worst_plain.map_or(
                    Value::Null,
                    |(i, err)| json!({"hook": c.records()[i].name, "error": err}),
                ),
                "floor": g.floor,
                "failed": g.failed,
                "drift": g.drift,
                "missing": g.missing,
            })
        })
        .collect();
    let mut logits = serde_json::Map::new();
    for (m, l) in c.logits() {
        logits.insert(m.as_str().to_string(), json!(l));
    }
    json!({
        "glmdiff_run": RUN_JSON_VERSION,
        "glmdiff_version": env!("CARGO_PKG_VERSION"),
        "command": h.command,
        "model": h.model,
        "architecture": h.architecture,
        "layers": h.layers.map(|(a, b, n)| json!({"first": a, "end": b, "model_layers": n})),
        "tokens": h.tokens.iter().map(|(id, t)| json!({"id": id, "text": t})).collect::<Vec<_>>(),
        "engines": {"reference": engine(&h.reference), "candidate": engine(&h.candidate)},
        "modes": h.modes,
        "verdict": if c.differs() { "differs" } else { "ok" },
        "first_divergence": divergence_json(c, Mode::Replay),
        "first_divergence_chained": divergence_json(c, Mode::Chained),
        "rerun": h.rerun,
        "notes": h.notes.iter().chain(&h.cache).collect::<Vec<_>>(),
        "overrides": c.overrides(),
        "records": records,
        "layer_summaries": layers,
        "logits": if logits.is_empty() { Value::Null } else { Value::Object(logits) },
        "explanation": h.explanation.as_ref().map(|x| json!(x.hypotheses())),
        "explain": h.explanation.as_ref().map(|x| {
            let mut v = json!(x);
            if let Some(o) = v.as_object_mut() {
                o.remove("hypotheses");
            }
            v
        }),
        "repro": h.repro,
        "timings": h.timings.iter().map(|(w, s)| json!({"what": w, "seconds": s})).collect::<Vec<_>>(),
        "layer_times": h.layer_times.iter().map(|t| json!({
            "layer": t.layer,
            "reference_s": t.reference,
            "chained_s": t.chained,
            "replay_s": t.replay,
            "upload_s": t.upload,
            "upload_bytes": t.upload_bytes,
            "compare_s": t.compare,
            "compare_wait_s": t.compare_wait,
            "candidate_beyond_s": t.candidate_beyond,
        })).collect::<Vec<_>>(),
        "compare_times": h.compare_times.iter().map(|(w, s)| json!({"what": w, "seconds": s})).collect::<Vec<_>>(),
        "reference_times": h.reference_times.iter().map(|(w, s)| json!({"what": w, "seconds": s})).collect::<Vec<_>>(),
        "candidate_times": h.candidate_times.iter().map(|(w, s)| json!({"what": w, "seconds": s})).collect::<Vec<_>>(),
        "candidate_beyond_times": h.candidate_beyond_times.iter().map(|(w, s)| json!({"what": w, "seconds": s})).collect::<Vec<_>>(),
        "reference_work": h.reference_work.as_ref().map(|w| {
            let work = |x: &Work| json!({"steps": x.steps, "rows": x.rows, "seconds": x.seconds});
            json!({
                "own": work(&w.plain),
                "replay_whole": work(&w.replay_whole),
                "replay_rows": work(&w.replay_rows),
                "followed_whole": work(&w.followed_whole),
                "followed_rows": work(&w.followed_rows),
                "followed_reused": work(&w.followed_reused),
                "joint": work(&w.joint),
            })
        }),
    })
}

/// The error-per-layer plot of a comparison: per layer, the worst float error in each mode, the
/// floor of the worst replay hook, and whether a hook failed.
pub fn error_plot(h: &Header, c: &Comparison) -> super::plot::ErrorPlot {
    let points = c
        .layers()
        .iter()
        .map(|g| super::plot::LayerPoint {
            label: match g.layer {
                Some(l) => l.to_string(),
                None if g.label.starts_with("token_embd") => "embd".to_string(),
                None => "out".to_string(),
            },
            replay: g.worst[0].map(|(_, e)| e),
            chained: g.worst[1].map(|(_, e)| e),
            // The floor of the hook the replay point stands for (the chained one without replay).
            floor: g.worst[0]
                .or(g.worst[1])
                .map_or(g.floor, |(i, _)| c.records()[i].floor),
            failed: g.failed > 0,
        })
        .collect();
    super::plot::ErrorPlot {
        title: format!(
            "{}: {} vs {}",
            std::path::Path::new(&h.model)
                .file_name()
                .map_or(h.model.clone(), |f| f.to_string_lossy().into_owned()),
            h.reference.spec,
            h.candidate.spec
        ),
        points,
    }
}

/// Writes the error-per-layer plot as SVG (atomically).
pub fn write_plot(h: &Header, c: &Comparison, path: &std::path::Path) -> anyhow::Result<()> {
    super::plot::write_svg(&error_plot(h, c), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(layer: Option<usize>, r: f64, c: f64, up: f64, bytes: u64) -> LayerTime {
        LayerTime {
            layer,
            reference: r,
            chained: c,
            replay: 0.0,
            upload: up,
            upload_bytes: bytes,
            compare: 0.0,
            compare_wait: 0.0,
            candidate_beyond: 0.0,
        }
    }

    /// The reference's work beyond its own chain, by cause, in words; nothing when there is
    /// none.
    #[test]
    fn reference_work_is_shown_by_cause() {
        let w = |steps, rows, seconds| Work {
            steps,
            rows,
            seconds,
        };
        let mut rw = ReferenceWork {
            plain: w(41, 41 * 4096, 17.6),
            ..ReferenceWork::default()
        };
        assert_eq!(reference_work_line(&rw, Some(200)), None);
        rw.followed_whole = w(1, 4096, 0.5);
        rw.followed_rows = w(12, 12 * 1957, 6.25);
        rw.followed_reused = w(1, 0, 0.0);
        assert_eq!(
            reference_work_line(&rw, Some(300)).unwrap(),
            "reference work: own chain 17.600 s (41 steps), the chain following its near ties \
             0.500 s whole (1 step) + 6.250 s in rows (12 steps, 23484 rows) + 1 step taken as \
             they were"
        );
        rw.joint = w(3, 30, 0.9);
        assert!(reference_work_line(&rw, Some(300))
            .unwrap()
            .starts_with("reference work: own chain 17.600 s (41 steps; 3 expert steps also computing 30 rows of the others), "));
    }

    /// The per-layer line: each side's mean and slowest layer (global steps left out), the
    /// candidate's weight uploads with the bytes a layer, and nothing about uploads for a
    /// candidate that makes none.
    #[test]
    fn layer_times_show_the_candidates_uploads_apart() {
        let times = [
            t(None, 9.0, 9.0, 9.0, 9_000_000_000),
            t(Some(0), 0.3, 0.6, 0.5, 5_000_000_000),
            t(Some(1), 0.4, 0.2, 0.01, 5_240_000_000),
        ];
        assert_eq!(
            layer_time_line(&times, None).unwrap(),
            "per layer (mean over 2): reference 0.350 s (slowest: layer 1 0.400 s), candidate chained 0.400 s (slowest: layer 0 0.600 s), candidate weight uploads 0.255 s (slowest: layer 0 0.500 s; 5.12 GB a layer)"
        );
        let small = [t(Some(3), 0.1, 0.1, 0.0, 3_000_000)];
        assert!(layer_time_line(&small, None).unwrap().ends_with(
            "candidate weight uploads 0.000 s (slowest: layer 3 0.000 s; 3.0 MB a layer)"
        ));
        let none = [t(Some(0), 0.1, 0.0, 0.0, 0)];
        assert_eq!(
            layer_time_line(&none, None).unwrap(),
            "per layer (mean over 1): reference 0.100 s (slowest: layer 0 0.100 s)"
        );
        assert!(layer_time_line(&[t(None, 1.0, 1.0, 1.0, 1)], None).is_none());
        // The comparison's own time, last.
        let mut compared = t(Some(2), 0.2, 0.0, 0.0, 0);
        compared.compare = 0.05;
        assert_eq!(
            layer_time_line(&[compared], None).unwrap(),
            "per layer (mean over 1): reference 0.200 s (slowest: layer 2 0.200 s), comparison 0.050 s (slowest: layer 2 0.050 s)"
        );
    }
}
