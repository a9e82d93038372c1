//! `glmdiff regress`: every case of a suite is a `run` (the same code, the same metrics) plus its
//! expectations ([`crate::session::regress`]); one table row and one JSONL record per case, and
//! the changes against a baseline. Exit 0 when every case passes, 1 when one fails or the run
//! drifted from `--baseline`, 2 when one cannot run (or the suite is bad).

use anyhow::{bail, Result};
use serde_json::Value;

use super::{against_input, model_input, print_report, to_stdout, write_lines, Outcome};
use crate::cli::RegressArgs;
use crate::regress::baseline::{diff, read_jsonl, summarize};
use crate::regress::{suite, Case, CaseSummary, Suite};
use crate::report::progress::Bar;
use crate::report::regress::{case_record, progress_line, render, render_changes};
use crate::session::regress::{run_case, CacheChoice};
use crate::session::Watch;
use crate::util::guard::Guard;

/// Runs `glmdiff regress`.
pub fn run(args: &RegressArgs) -> Result<Outcome> {
    super::set_prefetch(&args.prefetch);
    let suite = suite::load(&args.suite)?;
    check_files(args, &suite)?;
    let baseline = match &args.baseline {
        Some(p) => Some(read_jsonl(p)?),
        None => None,
    };
    let cases = suite.select(&args.case)?;
    crate::session::regress::check_expectations(&args.suite, &cases)?;
    let (records, summaries) = run_cases(args, &cases)?;
    let json_on_stdout = to_stdout(args.jsonl.as_deref());
    print_report(
        &render(&args.suite.display().to_string(), &summaries),
        json_on_stdout,
    );
    let changes = baseline.as_ref().map(|b| diff(b, &summaries));
    if let (Some(ch), Some(path)) = (&changes, &args.baseline) {
        print_report(
            &render_changes(&path.display().to_string(), ch),
            json_on_stdout,
        );
    }
    if let Some(j) = &args.jsonl {
        write_lines("--jsonl", j, &mut |w| {
            for r in &records {
                serde_json::to_writer(&mut *w, r)?;
                w.write_all(b"\n")?;
            }
            Ok(())
        })?;
    }
    if let Some(j) = &args.junit {
        let xml = crate::report::regress::junit(&args.suite.display().to_string(), &summaries);
        write_lines("--junit", j, &mut |w| Ok(w.write_all(xml.as_bytes())?))?;
    }
    let drifted = changes.as_ref().is_some_and(|c| c.drifted());
    outcome(&summaries, drifted)
}

/// Runs `cases` one by one, a progress line as each ends: their JSONL records and summaries.
fn run_cases(
    args: &RegressArgs,
    cases: &[(usize, &Case)],
) -> Result<(Vec<Value>, Vec<CaseSummary>)> {
    crate::report::progress::started(&format!(
        "glmdiff regress: {}, {} case(s)",
        args.suite.display(),
        cases.len()
    ));
    let cache = CacheChoice {
        dir: args.cache_dir.clone(),
        off: args.no_cache,
    };
    let mut records = Vec::with_capacity(cases.len());
    let mut summaries = Vec::with_capacity(cases.len());
    for (k, (i, case)) in cases.iter().enumerate() {
        let (layers, hypotheses) = (Bar::new(), Bar::with_unit("hypotheses"));
        let watch = Watch {
            layers: &layers,
            hypotheses: &hypotheses,
            say: &|s| crate::report::emit_err(s),
        };
        let r = run_case(&args.suite, *i, case, &cache, &watch);
        let run = r.ran.as_ref().map(|r| (&r.header, &r.comparison));
        let rec = case_record(run, &r.facts, r.seconds);
        let s = summarize(&rec)?;
        crate::report::progress::line(&progress_line(k, cases.len(), &s));
        summaries.push(s);
        records.push(rec);
    }
    Ok((records, summaries))
}

/// Checks the outputs against the inputs: the suite, the baseline, every case's model and
/// candidate trace.
fn check_files(args: &RegressArgs, suite: &Suite) -> Result<()> {
    let mut g = Guard::new();
    g.input("the suite", &args.suite);
    if let Some(b) = &args.baseline {
        g.input("the --baseline", b);
    }
    for c in &suite.cases {
        model_input(&mut g, &format!("the model of case {:?}", c.name), &c.model);
        against_input(&mut g, &c.against, &c.model);
    }
    g.output_or_stdout("--jsonl", args.jsonl.as_deref())
        .output("--junit", args.junit.as_deref())
        .check()
}

/// Exit 2 when a case could not run, 1 when one failed or the run drifted, else 0.
fn outcome(summaries: &[CaseSummary], drifted: bool) -> Result<Outcome> {
    let errors: Vec<&str> = summaries
        .iter()
        .filter(|s| s.status == "error")
        .map(|s| s.case.as_str())
        .collect();
    if !errors.is_empty() {
        bail!(
            "regress: {} case(s) could not run: {}",
            errors.len(),
            errors.join(", ")
        );
    }
    Ok(if summaries.iter().all(|s| s.passed()) && !drifted {
        Outcome::Ok
    } else {
        Outcome::Differs
    })
}
