//! How a run is judged: the precisions of both sides (an engine's is typed,
//! `Engine::precision`; every precision read from text by `run`, `compare` and `step` goes
//! through [`precision_of`]), the floor and precision overrides, what a trace
//! declares about itself, the selection bias, and the hooks a comparison keeps.

use std::collections::HashMap;

use anyhow::{Context, Result};

use crate::compare::Precision;
use crate::driver::Plan;
use crate::model::Weights;
use crate::trace::{HookFilter, TraceFile};

/// The precision a dtype string names: a dtype word (`bf16`, `float32`) or an engine's dtype
/// string (its first word the storage; `f64 accumulation` where sums are f64); `None` when it
/// names none. The one place a precision is read from text.
pub(super) fn precision_of(dtype: &str) -> Option<Precision> {
    Precision::parse(dtype)
}

/// The precision a file declares for `whose` side (a trace's metadata `dtype`, a case's stored
/// candidate), or bf16 when it names no known precision, said in `notes` (`floors`: what
/// assumes bf16, e.g. `floors assume`).
pub(super) fn declared_precision(
    dtype: &str,
    whose: &str,
    floors: &str,
    notes: &mut Vec<String>,
) -> Result<Precision> {
    if let Some(p) = precision_of(dtype) {
        return Ok(p);
    }
    notes.push(format!(
        "the {whose}'s dtype {dtype:?} is not a known precision; {floors} bf16"
    ));
    precision_of("bf16").context("bf16")
}

/// `--precision` pairs as precisions.
pub(super) fn precision_overrides(p: &[(String, String)]) -> Result<Vec<(String, Precision)>> {
    p.iter()
        .map(|(g, d)| {
            precision_of(d)
                .map(|p| (g.clone(), p))
                .with_context(|| format!("--precision {g}={d}: unknown dtype"))
        })
        .collect()
}

/// Precision overrides a trace declares: `indexer_dtype` (e.g. `fp8` for an FP8 DSA indexer)
/// sets the precision of `blk.*.indexer_*`. `--precision` flags come first and win.
pub(super) fn trace_precision(t: &TraceFile, notes: &mut Vec<String>) -> Vec<(String, Precision)> {
    let Some(d) = t.metadata().get("indexer_dtype") else {
        return Vec::new();
    };
    match precision_of(d) {
        Some(p) => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} sets the candidate's precision of blk.*.indexer_*"
            ));
            vec![("blk.*.indexer_*".to_string(), p)]
        }
        None => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} is not a known precision; ignored"
            ));
            Vec::new()
        }
    }
}

/// A note listing what a trace's engine could not capture: metadata `not_captured`, a JSON object
/// from hook names or globs to the reason (a fused kernel with no hook point). Those hooks are
/// then reported as not in the trace.
pub(super) fn not_captured_note(t: &TraceFile) -> Option<String> {
    let raw = t.metadata().get("not_captured")?;
    let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw) else {
        return Some(format!(
            "the trace's metadata not_captured is not a JSON object of hooks to reasons: {raw:?}"
        ));
    };
    if map.is_empty() {
        return None;
    }
    let items: Vec<String> = map
        .iter()
        .map(|(h, why)| match why.as_str() {
            Some(w) if !w.is_empty() => format!("{h} ({w})"),
            _ => h.clone(),
        })
        .collect();
    Some(format!(
        "the trace's engine could not capture {} hook(s), shown as not in the trace: {}",
        map.len(),
        items.join("; ")
    ))
}

/// The precision overrides of a comparison with trace candidate `trace`: `--precision` first,
/// then what the trace declares (said in `notes`, with what it could not capture).
pub(super) fn overrides_with_trace(
    flags: &[(String, Precision)],
    trace: Option<&TraceFile>,
    notes: &mut Vec<String>,
) -> Vec<(String, Precision)> {
    let mut p = flags.to_vec();
    if let Some(t) = trace {
        p.extend(trace_precision(t, notes));
        notes.extend(not_captured_note(t));
    }
    p
}

/// The hooks a comparison keeps: `--hook` globs (all standard hooks without them), plus the
/// score hooks behind a wanted selection (their values judge its flips).
pub(super) fn wants_with_scores(globs: &[String]) -> Box<dyn Fn(&str) -> bool> {
    let filter = HookFilter {
        layers: None,
        globs: globs.to_vec(),
    };
    Box::new(move |n: &str| {
        filter.wants(n)
            || match crate::model::names::split_blk(n) {
                Some((l, "indexer_scores")) => filter.wants(&format!("blk.{l}.indexer_topk")),
                Some((l, "moe_probs")) => filter.wants(&format!("blk.{l}.moe_topk_ids")),
                _ => false,
            }
    })
}

/// The selection bias `exp_probs_b` of every MoE layer the plan runs.
pub(super) fn selection_bias(
    weights: &Weights<'_>,
    plan: &Plan,
) -> Result<HashMap<usize, Vec<f32>>> {
    let mut out = HashMap::new();
    for l in plan.layers() {
        let name = crate::model::names::blk(l, crate::model::names::blk::EXP_PROBS_B);
        if weights.has(&name) {
            out.insert(l, weights.vector_desc(&name)?.dequantize()?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_declared_dtype_falls_back_on_bf16_and_says_so() {
        let mut notes = Vec::new();
        let p = declared_precision("float64", "trace", "floors assume", &mut notes).unwrap();
        assert_eq!(p, precision_of("f64").unwrap());
        assert!(notes.is_empty());
        let p = declared_precision("", "trace", "floors assume", &mut notes).unwrap();
        assert_eq!(p, precision_of("bf16").unwrap());
        assert_eq!(
            notes,
            ["the trace's dtype \"\" is not a known precision; floors assume bf16"]
        );
    }

    #[test]
    fn score_hooks_come_with_their_selections() {
        let w = wants_with_scores(&["blk.1.moe_topk_ids".to_string()]);
        assert!(w("blk.1.moe_topk_ids") && w("blk.1.moe_probs"));
        assert!(!w("blk.1.indexer_scores") && !w("blk.2.moe_probs"));
    }
}
