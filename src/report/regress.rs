//! Printing `glmdiff regress`: one line per case as it ends, the summary table (one row per
//! case), the failures with the command that re-runs each, the changes against a baseline, and
//! the JSONL record of a case (`docs/regress.md`): `run`'s document with the case's `regress`
//! object. Everything here formats facts computed elsewhere.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::run::{to_json, Header};
use super::{layout, table, Grid};
use crate::compare::Comparison;
use crate::regress::{CaseFacts, CaseSummary, Changes};

/// Version of the `regress` object of a record.
pub const REGRESS_JSON_VERSION: u32 = 1;

fn e(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.2e}")
    }
}

/// The JSONL record of a case: `run --json`'s document (when the run got that far) without the
/// cache note, which moves to `cache`; the case's own facts under `regress`; its wall time added
/// to `timings` as `case`. Only times (`timings`, `layer_times`, `compare_times`, `reference_times`, `candidate_times`, `candidate_beyond_times`, `reference_work`'s seconds) and
/// `cache` differ between runs of the same inputs.
pub fn case_record(run: Option<(&Header, &Comparison)>, facts: &CaseFacts, seconds: f64) -> Value {
    let mut doc = match run {
        Some((h, c)) => {
            let stable = Header {
                cache: None,
                ..h.clone()
            };
            let mut d = to_json(&stable, c);
            d["cache"] = json!(h.cache);
            d
        }
        None => json!({"timings": []}),
    };
    if let Some(t) = doc.get_mut("timings").and_then(Value::as_array_mut) {
        t.push(json!({"what": "case", "seconds": seconds}));
    }
    let mut reg = json!(facts);
    reg["version"] = json!(REGRESS_JSON_VERSION);
    doc["regress"] = reg;
    doc
}

fn verdict_cell(s: &CaseSummary) -> String {
    match s.status.as_str() {
        "pass" => "pass".into(),
        "error" => "ERROR".into(),
        _ if s.failed_checks.is_empty() => "FAIL".into(),
        _ => format!("FAIL ({})", s.failed_checks.join(", ")),
    }
}

/// The line printed (to stderr) when case `i` of `n` ends.
pub fn progress_line(i: usize, n: usize, s: &CaseSummary) -> String {
    format!(
        "regress [{}/{n}] {}: {}{}",
        i + 1,
        s.case,
        verdict_cell(s),
        s.seconds.map_or(String::new(), |t| format!(" ({t:.2} s)"))
    )
}

/// The summary table, the failures and the closing count, fitted to [`layout::width`].
pub fn render(suite: &str, summaries: &[CaseSummary]) -> String {
    render_at(suite, summaries, layout::width())
}

/// [`render`] fitted to `width` (`None`: every column, nothing wrapped).
pub fn render_at(suite: &str, summaries: &[CaseSummary], width: Option<usize>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "glmdiff regress: {suite} ({} cases)", summaries.len());
    let mut t = Grid::new(&[
        ("case", 0),
        ("verdict", 0),
        ("first divergence", 0),
        ("worst hook (error / allowed)", 1),
        ("KL max", 0),
        ("top-1", 2),
        ("time", 3),
    ])
    .whole(&[0]);
    // With a width the worst hook's name and its numbers are two lines of the cell.
    let sep = if width.is_some() { "\n" } else { " " };
    for c in summaries {
        t.add_row(vec![
            c.case.clone(),
            verdict_cell(c),
            c.first_divergence.clone().unwrap_or_else(|| "-".into()),
            c.worst.as_ref().map_or("-".into(), |(h, m, err, allowed)| {
                format!("{h}{sep}{m} {} / {}", e(*err), e(*allowed))
            }),
            c.max_kl.map_or("-".into(), e),
            c.top1.map_or("-".into(), |x| format!("{x:.3}")),
            c.seconds.map_or("-".into(), |x| format!("{x:.2} s")),
        ]);
    }
    let _ = writeln!(s, "{}", t.render(width));
    for c in summaries.iter().filter(|c| !c.passed()) {
        let _ = writeln!(s, "{} {}:", verdict_cell(c), c.case);
        if let Some(err) = &c.error {
            let _ = writeln!(s, "  {err}");
        }
        for d in &c.failed_details {
            let _ = writeln!(s, "  {d}");
        }
        if let Some(cmd) = &c.command {
            let _ = writeln!(s, "{}", layout::shell_lines("  re-run:", cmd, width));
        }
    }
    let count = |st: &str| summaries.iter().filter(|c| c.status == st).count();
    let (pass, fail, err) = (count("pass"), count("fail"), count("error"));
    let _ = writeln!(
        s,
        "\n{}: {} cases, {pass} pass, {fail} fail, {err} error",
        if err > 0 {
            "ERROR"
        } else if fail > 0 {
            "REGRESSION"
        } else {
            "OK"
        },
        summaries.len()
    );
    s
}

/// What changed against the baseline.
pub fn render_changes(baseline: &str, ch: &Changes) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nagainst the baseline {baseline} ({} cases in both):",
        ch.common
    );
    if ch.is_empty() {
        let _ = writeln!(s, "  no changes");
        return s;
    }
    for (c, what) in &ch.new_failures {
        let _ = writeln!(s, "  new failure: {c} ({what})");
    }
    for c in &ch.fixed {
        let _ = writeln!(s, "  fixed: {c}");
    }
    if !ch.still_failing.is_empty() {
        let _ = writeln!(s, "  still failing: {}", ch.still_failing.join(", "));
    }
    for (c, a, b) in &ch.divergence_moved {
        let w = |x: &Option<String>| x.clone().unwrap_or_else(|| "none".into());
        let _ = writeln!(s, "  first divergence moved: {c}: {} -> {}", w(a), w(b));
    }
    for (c, a, b) in &ch.top1_changed {
        let _ = writeln!(s, "  top-1 agreement changed: {c}: {a:.3} -> {b:.3}");
    }
    if !ch.moved.is_empty() {
        let mut t = table(&["case", "metric", "before", "now", "factor"]);
        for m in &ch.moved {
            let f = m.factor();
            t.add_row(vec![
                m.case.clone(),
                m.metric.clone(),
                e(m.old),
                e(m.new),
                if f.is_finite() {
                    format!("{f:.2}x")
                } else {
                    "from 0".into()
                },
            ]);
        }
        let _ = writeln!(
            s,
            "  metrics that moved by more than {}x ({}):\n{t}",
            crate::regress::baseline::MOVE_FACTOR,
            ch.moved.len()
        );
    }
    for c in &ch.added {
        let _ = writeln!(s, "  new case: {c}");
    }
    for c in &ch.removed {
        let _ = writeln!(s, "  case gone: {c}");
    }
    if ch.drifted() {
        let _ = writeln!(
            s,
            "DRIFT: this run moved from the baseline (exit 1); if intended, refresh the baseline (docs/regress.md)"
        );
    }
    s
}

/// The results as JUnit XML (the schema CI systems read: `testsuites` > `testsuite` >
/// `testcase`, a `failure` per failed case with its failed checks, an `error` per case that
/// could not run). Documented in docs/regress.md.
pub fn junit(suite: &str, summaries: &[CaseSummary]) -> String {
    let failures = summaries.iter().filter(|c| c.status == "fail").count();
    let errors = summaries.iter().filter(|c| c.status == "error").count();
    let total: f64 = summaries.iter().filter_map(|c| c.seconds).sum();
    let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let head = format!(
        "name=\"glmdiff regress {}\" tests=\"{}\" failures=\"{failures}\" errors=\"{errors}\" time=\"{total:.3}\"",
        xml_escape(suite),
        summaries.len()
    );
    let _ = writeln!(s, "<testsuites {head}>");
    let _ = writeln!(s, "  <testsuite {head}>");
    for c in summaries {
        let _ = write!(
            s,
            "    <testcase classname=\"glmdiff.regress\" name=\"{}\" time=\"{:.3}\"",
            xml_escape(&c.case),
            c.seconds.unwrap_or(0.0)
        );
        match c.status.as_str() {
            "fail" => {
                let message = c.failed_checks.join(", ");
                let mut body = c.failed_details.join("\n");
                if let Some(cmd) = &c.command {
                    body.push_str(&format!("\nre-run: {cmd}"));
                }
                let _ = writeln!(
                    s,
                    ">\n      <failure message=\"{}\" type=\"{}\">{}</failure>\n    </testcase>",
                    xml_escape(&format!("failed: {message}")),
                    xml_escape(&message),
                    xml_escape(&body)
                );
            }
            "error" => {
                let why = c.error.clone().unwrap_or_default();
                let _ = writeln!(
                    s,
                    ">\n      <error message=\"{}\" type=\"error\">{}</error>\n    </testcase>",
                    xml_escape(why.lines().next().unwrap_or("")),
                    xml_escape(&why)
                );
            }
            _ => {
                let _ = writeln!(s, "/>");
            }
        }
    }
    let _ = writeln!(s, "  </testsuite>\n</testsuites>");
    s
}

/// `text` with XML's five special characters escaped and control characters other than tab
/// and newline dropped (XML 1.0 cannot carry them).
fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' => out.push(ch),
            c if (c as u32) < 0x20 => {}
            c => out.push(c),
        }
    }
    out
}
