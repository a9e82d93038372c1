//! A case's expectations checked against the comparison its run produced.

use serde::Serialize;
use serde_json::{json, Value};

use super::suite::Expect;
use crate::compare::logits::LogitsReport;
use crate::compare::Comparison;
use crate::trace::Mode;

/// The result of one expectation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// The suite key (`verdict` for the implicit one).
    pub key: String,
    /// Whether it held.
    pub ok: bool,
    /// What the suite asked.
    pub expected: Value,
    /// What the run showed.
    pub actual: Value,
    /// One line for people.
    pub detail: String,
}

/// The output distribution expectations are read from: chained when it ran (what a user's
/// output shows), else replay, as the `run` report shows it.
pub fn primary_logits(c: &Comparison) -> Option<(Mode, &LogitsReport)> {
    c.logits()
        .iter()
        .find(|(m, _)| *m == Mode::Chained)
        .or(c.logits().first())
        .map(|(m, l)| (*m, l))
}

/// Checks `expect` against `c`. `Err` when an expectation cannot be checked on this run (a
/// suite error: the run does not reach the logits), naming the key.
pub fn check(expect: &Expect, c: &Comparison) -> Result<Vec<Check>, String> {
    let mut out = vec![verdict(expect, c)];
    let logits = primary_logits(c);
    if let Some(key) = expect.needs_logits() {
        if logits.is_none() {
            return Err(format!(
                "key {key:?}: the run stops before the logits (it must run to the last layer)"
            ));
        }
    }
    let Some((mode, l)) = logits else {
        return Ok(out);
    };
    if let Some(max) = expect.max_kl {
        let worst = l
            .positions
            .iter()
            .max_by(|a, b| a.kl.total_cmp(&b.kl))
            .map(|p| (p.position, p.kl));
        let ok = l.positions.iter().all(|p| p.kl <= max);
        out.push(Check {
            key: "max_kl".into(),
            ok,
            expected: json!(max),
            actual: json!(l.max_kl),
            detail: match worst {
                Some((pos, kl)) => format!(
                    "KL(ref || cand) ({mode}) max {kl:.3e} at position {pos} {} {max:.3e}",
                    if ok { "<=" } else { ">" }
                ),
                None => "no positions".into(),
            },
        });
    }
    if let Some(min) = expect.top1_agreement {
        let n = l.positions.len();
        let agree = l.positions.iter().filter(|p| p.top1_agree).count();
        let share = if n == 0 { 0.0 } else { agree as f64 / n as f64 };
        let ok = share >= min;
        let first_disagree = l.positions.iter().find(|p| !p.top1_agree);
        out.push(Check {
            key: "top1_agreement".into(),
            ok,
            expected: json!(min),
            actual: json!(share),
            detail: format!(
                "top-1 agreement ({mode}) {agree}/{n} = {share:.4} {} {min}{}",
                if ok { ">=" } else { "<" },
                first_disagree.map_or(String::new(), |p| format!(
                    "; first disagreement at position {}: reference {:?}, candidate {:?}",
                    p.position,
                    p.reference.top.first().map(|t| t.0),
                    p.candidate.top.first().map(|t| t.0)
                ))
            ),
        });
    }
    if let Some(pins) = &expect.top5 {
        let actual: Vec<Vec<u32>> = l
            .positions
            .iter()
            .map(|p| p.reference.top.iter().take(5).map(|t| t.0).collect())
            .collect();
        // A suite error, not a failure: the pins cannot be of this prompt (a prompt's or a
        // trace's token count is known only when the case runs).
        if pins.len() != actual.len() {
            return Err(format!(
                "key \"expect_top5\": pins {} positions, but the run has {} (one row of ids per prompt position)",
                pins.len(),
                actual.len()
            ));
        }
        let mut bad = Vec::new();
        for (i, pin) in pins.iter().enumerate() {
            match actual.get(i) {
                Some(a) if a.len() >= pin.len() && a[..pin.len()] == pin[..] => {}
                Some(a) => bad.push(format!(
                    "position {i}: pinned {pin:?}, reference {:?}",
                    &a[..pin.len().min(a.len())]
                )),
                None => {}
            }
        }
        let count_ok = pins.len() == actual.len();
        let ok = count_ok && bad.is_empty();
        let mut detail = if count_ok {
            format!("{} positions", pins.len())
        } else {
            format!(
                "{} positions pinned, the run has {}",
                pins.len(),
                actual.len()
            )
        };
        if !bad.is_empty() {
            detail.push_str(&format!(
                "; {} differ: {}{}",
                bad.len(),
                bad.iter().take(3).cloned().collect::<Vec<_>>().join("; "),
                if bad.len() > 3 { "; ..." } else { "" }
            ));
        }
        out.push(Check {
            key: "expect_top5".into(),
            ok,
            expected: json!(pins),
            actual: json!(actual),
            detail: format!("reference top-5 ids: {detail}"),
        });
    }
    Ok(out)
}

/// The implicit expectation: verdict `ok`, or with `expect_divergence` verdict `differs` with
/// the first divergence (replay, else chained) at that hook.
fn verdict(expect: &Expect, c: &Comparison) -> Check {
    let first = c
        .first_divergence(Mode::Replay)
        .or(c.first_divergence(Mode::Chained))
        .map(|r| r.name.clone());
    let differs = c.differs();
    let actual = json!({
        "verdict": if differs { "differs" } else { "ok" },
        "first_divergence": first,
    });
    match &expect.divergence {
        None => Check {
            key: "verdict".into(),
            ok: !differs,
            expected: json!({"verdict": "ok", "first_divergence": null}),
            actual,
            detail: match (&first, differs) {
                (_, false) => "every compared hook within its floor".into(),
                (Some(h), true) => format!("diverges at {h}"),
                (None, true) => "differs (selections or non-finite values)".into(),
            },
        },
        Some(want) => {
            let ok = differs && first.as_deref() == Some(want.as_str());
            Check {
                key: "expect_divergence".into(),
                ok,
                expected: json!({"verdict": "differs", "first_divergence": want}),
                actual,
                detail: match (&first, differs) {
                    (_, false) => format!("expected a divergence at {want}, the run is clean"),
                    (Some(h), true) => format!(
                        "first divergence at {h}{}",
                        if ok {
                            String::new()
                        } else {
                            format!(", expected at {want}")
                        }
                    ),
                    (None, true) => {
                        format!("differs, but with no first divergence; expected at {want}")
                    }
                },
            }
        }
    }
}
