//! Printing `glmdiff step`: the case, the candidate against the reference at the case's hook,
//! and what `--explain` found. Formats facts; computes nothing.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::run::{render_explanation, EngineDesc};
use crate::compare::{HookRecord, Metrics, Status};
use crate::explain::case::CaseHeader;
use crate::explain::Explanation;

/// Version of `glmdiff step --json`'s document (`glmdiff_step` key).
pub const STEP_JSON_VERSION: u32 = 1;

/// What `glmdiff step` found.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// The case directory.
    pub dir: String,
    /// The case's header.
    pub header: CaseHeader,
    /// The candidate judged.
    pub candidate: EngineDesc,
    /// The reference's precision string.
    pub reference_dtype: String,
    /// The hook's record (replay).
    pub record: HookRecord,
    /// Whether the candidate differs beyond the floor.
    pub differs: bool,
    /// Notes (a reference that no longer matches the stored one, an unknown dtype).
    pub notes: Vec<String>,
    /// What `--explain` found.
    pub explanation: Option<Explanation>,
}

fn e(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3e}")
    } else {
        "not finite".into()
    }
}

/// The text report.
pub fn render(r: &StepReport) -> String {
    let h = &r.header;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "glmdiff step: {} ({}, {}{})",
        r.dir,
        h.step,
        h.op,
        h.layer.map_or(String::new(), |l| format!(", layer {l}"))
    );
    let _ = writeln!(
        s,
        "case: {} of {} ({}), {} tokens; the run found error {} against a floor of {} (candidate {})",
        h.hook,
        h.model,
        h.architecture,
        h.tokens.len(),
        h.error.map_or("not finite".into(), e),
        e(h.allowed),
        h.candidate
    );
    for w in &h.weights {
        let _ = writeln!(s, "weight: {} {} {:?}", w.name, w.ty, w.shape);
    }
    let _ = writeln!(
        s,
        "candidate: {} = {} [{}]",
        r.candidate.spec, r.candidate.describe, r.candidate.dtype
    );
    let _ = writeln!(s, "reference: cpu [{}]", r.reference_dtype);
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    if let Some(res) = &r.record.replay {
        match &res.metrics {
            Some(Metrics::Float(m)) => {
                let _ = writeln!(
                    s,
                    "{}: relative L2 {}, max |diff| {} at {:?}, cosine {:.6}, floor {}",
                    r.record.name,
                    e(res.error),
                    e(m.max_abs),
                    m.max_abs_at,
                    m.cosine,
                    e(res.allowed)
                );
            }
            Some(Metrics::Ids(m)) => {
                let _ = writeln!(
                    s,
                    "{}: {} of {} rows select the same set",
                    r.record.name, m.set_equal_rows, m.rows
                );
            }
            None => {}
        }
        if let Some(n) = &res.note {
            let _ = writeln!(s, "note: {n}");
        }
    }
    if let Some(x) = &r.explanation {
        s.push_str(&render_explanation(x));
    }
    let status = r.record.replay.as_ref().map(|x| x.status);
    let _ = writeln!(
        s,
        "\n{}",
        if r.differs || status == Some(Status::Fail) {
            "DIFFERS: the candidate is beyond what precision explains at this step"
        } else {
            "OK: the candidate matches the reference within the floor"
        }
    );
    s
}

/// The JSON document: the case header, the candidate, the hook's replay result (as a record of
/// `run --json`), the verdict and the explanation.
pub fn to_json(r: &StepReport) -> Value {
    let res = r.record.replay.as_ref();
    json!({
        "glmdiff_step": STEP_JSON_VERSION,
        "glmdiff_version": env!("CARGO_PKG_VERSION"),
        "dir": r.dir,
        "case": r.header,
        "candidate": {"spec": r.candidate.spec, "describe": r.candidate.describe, "dtype": r.candidate.dtype},
        "hook": r.record.name,
        "status": res.map(|x| x.status),
        "error": res.map(|x| x.error),
        "allowed": res.map(|x| x.allowed),
        "metrics": res.and_then(|x| x.metrics.clone()),
        "note": res.and_then(|x| x.note.clone()),
        "verdict": if r.differs { "differs" } else { "ok" },
        "notes": r.notes,
        "explanation": r.explanation.as_ref().map(|x| json!(x.hypotheses())),
        "explain": r.explanation.as_ref().map(|x| {
            let mut v = json!(x);
            if let Some(o) = v.as_object_mut() {
                o.remove("hypotheses");
            }
            v
        }),
    })
}
