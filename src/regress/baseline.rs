//! Case summaries read back from JSONL records (this run's and an earlier one's, through the same
//! code), and what changed between two runs of a suite: new failures, fixed cases, a moved first
//! divergence, metrics that moved by more than [`MOVE_FACTOR`] (drift, [`Changes::drifted`]).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A metric "moved" when the larger of its old and new values is more than this times the smaller.
pub const MOVE_FACTOR: f64 = 2.0;

/// Values at or below this are rounding noise (relative errors and KL in f64): a metric moves
/// only when one side is above it.
pub const NOISE: f64 = 1e-12;

/// What the table and the baseline comparison need from one record.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CaseSummary {
    /// Case name.
    pub case: String,
    /// `pass`, `fail` or `error`.
    pub status: String,
    /// Keys of the checks that failed.
    pub failed_checks: Vec<String>,
    /// The detail line of each failed check.
    pub failed_details: Vec<String>,
    /// The `glmdiff run` command that re-runs the case.
    pub command: Option<String>,
    /// The run's error (status `error`).
    pub error: Option<String>,
    /// First divergence: replay's hook, else chained's.
    pub first_divergence: Option<String>,
    /// The float hook with the largest `error / allowed`: (hook, mode, error, allowed).
    pub worst: Option<(String, String, f64, f64)>,
    /// The output distribution's KL max and mean, top-1 agreement (chained, else replay).
    pub max_kl: Option<f64>,
    /// Mean KL.
    pub mean_kl: Option<f64>,
    /// Top-1 agreement share.
    pub top1: Option<f64>,
    /// Relative error per (hook, mode) for float hooks that were compared.
    pub errors: BTreeMap<(String, String), f64>,
    /// The case's wall time in seconds.
    pub seconds: Option<f64>,
}

impl CaseSummary {
    /// Whether the case passed.
    pub fn passed(&self) -> bool {
        self.status == "pass"
    }
}

/// The summary of one JSONL record (`docs/regress.md`).
pub fn summarize(record: &Value) -> Result<CaseSummary> {
    let reg = record
        .get("regress")
        .context("no \"regress\" object: not a record of glmdiff regress")?;
    let case = reg
        .get("case")
        .and_then(Value::as_str)
        .context("regress.case is missing")?
        .to_string();
    let status = reg
        .get("status")
        .and_then(Value::as_str)
        .context("regress.status is missing")?
        .to_string();
    let failed: Vec<&Value> = reg
        .get("checks")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter(|c| c.get("ok") == Some(&Value::Bool(false)))
                .collect()
        })
        .unwrap_or_default();
    let field = |c: &Value, k: &str| c.get(k).and_then(Value::as_str).map(str::to_string);
    let failed_checks = failed.iter().filter_map(|c| field(c, "key")).collect();
    let failed_details = failed
        .iter()
        .map(|c| {
            format!(
                "{}: {}",
                field(c, "key").unwrap_or_default(),
                field(c, "detail").unwrap_or_default()
            )
        })
        .collect();
    let hook_of = |k: &str| {
        record
            .get(k)
            .and_then(|d| d.get("hook"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let mut errors = BTreeMap::new();
    let mut worst: Option<(String, String, f64, f64)> = None;
    for r in record
        .get("records")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(hook) = r.get("hook").and_then(Value::as_str) else {
            continue;
        };
        for mode in ["replay", "chained"] {
            let Some(m) = r.get(mode).filter(|m| !m.is_null()) else {
                continue;
            };
            let float = m
                .get("metrics")
                .and_then(|x| x.get("kind"))
                .and_then(Value::as_str)
                == Some("float");
            let status = m.get("status").and_then(Value::as_str).unwrap_or("");
            let (Some(err), true) = (m.get("error").and_then(Value::as_f64), float) else {
                continue;
            };
            errors.insert((hook.to_string(), mode.to_string()), err);
            let allowed = m.get("allowed").and_then(Value::as_f64).unwrap_or(0.0);
            if (status == "pass" || status == "fail") && err > 0.0 && allowed > 0.0 {
                let ratio = err / allowed;
                if worst.as_ref().is_none_or(|w| ratio > w.2 / w.3) {
                    worst = Some((hook.to_string(), mode.to_string(), err, allowed));
                }
            }
        }
    }
    let logits = record.get("logits").filter(|l| !l.is_null()).and_then(|l| {
        l.get("chained")
            .filter(|x| !x.is_null())
            .or(l.get("replay"))
    });
    let lf = |k: &str| logits.and_then(|l| l.get(k)).and_then(Value::as_f64);
    let seconds = record
        .get("timings")
        .and_then(Value::as_array)
        .and_then(|t| {
            t.iter()
                .find(|x| x.get("what").and_then(Value::as_str) == Some("case"))
        })
        .and_then(|x| x.get("seconds"))
        .and_then(Value::as_f64);
    Ok(CaseSummary {
        case,
        status,
        failed_checks,
        failed_details,
        command: field(reg, "command"),
        error: reg.get("error").and_then(Value::as_str).map(str::to_string),
        first_divergence: hook_of("first_divergence").or(hook_of("first_divergence_chained")),
        worst,
        max_kl: lf("max_kl"),
        mean_kl: lf("mean_kl"),
        top1: lf("top1_agreement"),
        errors,
        seconds,
    })
}

/// Reads a JSONL file of regress records; errors name the file and the line.
pub fn read_jsonl(path: &Path) -> Result<Vec<CaseSummary>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("regress: cannot read the baseline {}", path.display()))?;
    let mut out: Vec<CaseSummary> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).with_context(|| {
            format!(
                "regress: the baseline {} line {} is not JSON",
                path.display(),
                i + 1
            )
        })?;
        let s = summarize(&v)
            .with_context(|| format!("regress: the baseline {} line {}", path.display(), i + 1))?;
        if out.iter().any(|o| o.case == s.case) {
            bail!(
                "regress: the baseline {} line {}: case {:?} appears twice",
                path.display(),
                i + 1,
                s.case
            );
        }
        out.push(s);
    }
    if out.is_empty() {
        bail!("regress: the baseline {} has no records", path.display());
    }
    Ok(out)
}

/// One metric of one case that moved by more than [`MOVE_FACTOR`].
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    /// Case name.
    pub case: String,
    /// What (`max_kl`, `mean_kl`, or `HOOK (mode)`).
    pub metric: String,
    /// Before.
    pub old: f64,
    /// Now.
    pub new: f64,
}

impl Move {
    /// `new / old` (infinite from zero).
    pub fn factor(&self) -> f64 {
        if self.old == 0.0 {
            f64::INFINITY
        } else {
            self.new / self.old
        }
    }
}

/// What changed between a baseline and this run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// Cases in both.
    pub common: usize,
    /// Passed (or were absent) before, fail or error now: (case, what fails now).
    pub new_failures: Vec<(String, String)>,
    /// Failed before, pass now.
    pub fixed: Vec<String>,
    /// Failed before and now.
    pub still_failing: Vec<String>,
    /// First divergence changed: (case, before, now).
    pub divergence_moved: Vec<(String, Option<String>, Option<String>)>,
    /// Top-1 agreement changed: (case, before, now).
    pub top1_changed: Vec<(String, f64, f64)>,
    /// Metrics that moved by more than [`MOVE_FACTOR`], the largest factor first per case.
    pub moved: Vec<Move>,
    /// Cases only in this run.
    pub added: Vec<String>,
    /// Cases only in the baseline.
    pub removed: Vec<String>,
}

impl Changes {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.new_failures.is_empty()
            && self.fixed.is_empty()
            && self.divergence_moved.is_empty()
            && self.top1_changed.is_empty()
            && self.moved.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
    }

    /// Whether this run drifted from the baseline: a metric of a case in both moved by more
    /// than [`MOVE_FACTOR`] (up or down), a first divergence moved, or a top-1 agreement
    /// changed. `regress --baseline` exits 1 then, even when every case passes. New, removed and
    /// fixed cases are reported but are not drift.
    pub fn drifted(&self) -> bool {
        !self.moved.is_empty() || !self.divergence_moved.is_empty() || !self.top1_changed.is_empty()
    }
}

/// Whether `old -> new` is a move by more than [`MOVE_FACTOR`] above the noise.
fn moved(old: f64, new: f64) -> bool {
    if !old.is_finite() || !new.is_finite() {
        return old.is_finite() != new.is_finite();
    }
    let (lo, hi) = (old.abs().min(new.abs()), old.abs().max(new.abs()));
    hi > NOISE && hi > MOVE_FACTOR * lo
}

/// What failing means in a summary, in a few words.
pub fn failure_words(s: &CaseSummary) -> String {
    match s.status.as_str() {
        "error" => format!("error: {}", s.error.clone().unwrap_or_default()),
        _ if s.failed_checks.is_empty() => s.status.clone(),
        _ => format!("fails {}", s.failed_checks.join(", ")),
    }
}

/// Compares this run's summaries with a baseline's, case by case (by name).
pub fn diff(old: &[CaseSummary], new: &[CaseSummary]) -> Changes {
    let mut ch = Changes::default();
    for n in new {
        let Some(o) = old.iter().find(|o| o.case == n.case) else {
            ch.added.push(n.case.clone());
            if !n.passed() {
                ch.new_failures.push((n.case.clone(), failure_words(n)));
            }
            continue;
        };
        ch.common += 1;
        match (o.passed(), n.passed()) {
            (true, false) => ch.new_failures.push((n.case.clone(), failure_words(n))),
            (false, true) => ch.fixed.push(n.case.clone()),
            (false, false) => ch.still_failing.push(n.case.clone()),
            (true, true) => {}
        }
        if o.first_divergence != n.first_divergence {
            ch.divergence_moved.push((
                n.case.clone(),
                o.first_divergence.clone(),
                n.first_divergence.clone(),
            ));
        }
        if let (Some(a), Some(b)) = (o.top1, n.top1) {
            if a != b {
                ch.top1_changed.push((n.case.clone(), a, b));
            }
        }
        let mut moves = Vec::new();
        for (metric, a, b) in [
            ("max_kl", o.max_kl, n.max_kl),
            ("mean_kl", o.mean_kl, n.mean_kl),
        ] {
            if let (Some(a), Some(b)) = (a, b) {
                if moved(a, b) {
                    moves.push(Move {
                        case: n.case.clone(),
                        metric: metric.into(),
                        old: a,
                        new: b,
                    });
                }
            }
        }
        for (key, &b) in &n.errors {
            if let Some(&a) = o.errors.get(key) {
                if moved(a, b) {
                    moves.push(Move {
                        case: n.case.clone(),
                        metric: format!("{} ({})", key.0, key.1),
                        old: a,
                        new: b,
                    });
                }
            }
        }
        moves.sort_by(|x, y| {
            let f = |m: &Move| {
                let r = m.factor();
                if r < 1.0 {
                    1.0 / r
                } else {
                    r
                }
            };
            f(y).total_cmp(&f(x))
        });
        ch.moved.extend(moves);
    }
    for o in old {
        if !new.iter().any(|n| n.case == o.case) {
            ch.removed.push(o.case.clone());
        }
    }
    ch
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(case: &str, status: &str, kl: f64, err: f64) -> Value {
        json!({
            "regress": {"case": case, "status": status, "checks": [{"key": "max_kl", "ok": status == "pass"}]},
            "first_divergence": null,
            "first_divergence_chained": null,
            "records": [{"hook": "blk.0.q_a", "replay": {"status": "pass", "error": err, "allowed": 1e-3,
                "metrics": {"kind": "float"}}, "chained": null}],
            "logits": {"chained": {"max_kl": kl, "mean_kl": kl / 2.0, "top1_agreement": 1.0}},
            "timings": [{"what": "case", "seconds": 0.5}],
        })
    }

    #[test]
    fn summaries_and_changes() {
        let a = summarize(&record("a", "pass", 1e-6, 1e-5)).unwrap();
        assert_eq!(a.worst.as_ref().unwrap().0, "blk.0.q_a");
        assert_eq!(a.seconds, Some(0.5));
        let old = vec![
            a.clone(),
            summarize(&record("b", "fail", 1e-6, 1e-5)).unwrap(),
            summarize(&record("c", "pass", 1e-6, 1e-5)).unwrap(),
        ];
        let new = vec![
            summarize(&record("a", "fail", 3e-6, 1e-5)).unwrap(),
            summarize(&record("b", "pass", 1.5e-6, 1e-5)).unwrap(),
            summarize(&record("d", "pass", 0.0, 0.0)).unwrap(),
        ];
        let ch = diff(&old, &new);
        assert_eq!(ch.new_failures, vec![("a".into(), "fails max_kl".into())]);
        assert_eq!(ch.fixed, vec!["b".to_string()]);
        assert_eq!(ch.added, vec!["d".to_string()]);
        assert_eq!(ch.removed, vec!["c".to_string()]);
        let m: Vec<&str> = ch.moved.iter().map(|m| m.metric.as_str()).collect();
        assert_eq!(m, vec!["max_kl", "mean_kl"]);
        assert!(ch.drifted());
        // Only added, removed and fixed cases: reported, not drift.
        let quiet = diff(&old, &[old[0].clone(), new[1].clone(), new[2].clone()]);
        assert!(!quiet.is_empty() && quiet.moved.is_empty(), "{quiet:?}");
        assert!(!quiet.drifted(), "{quiet:?}");
        // A hook error 2.01x smaller is drift too.
        let mut better = old[0].clone();
        for e in better.errors.values_mut() {
            *e /= 2.01;
        }
        assert!(diff(&old[..1], &[better]).drifted());
        assert!(!moved(1e-14, 1e-13), "noise");
        assert!(moved(0.0, 1e-9));
        assert!(!moved(1.0, 2.0));
        assert!(moved(1.0, 2.01));
    }
}
