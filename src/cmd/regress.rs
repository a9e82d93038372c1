//! `glmdiff regress`: every case of a suite is a `run` (the same code, the same metrics) plus its
//! expectations; one table row and one JSONL record per case, and the changes against a baseline.
//! Exit 0 when every case passes, 1 when one fails or the run drifted from `--baseline`, 2 when
//! one cannot run (or the suite is bad).

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::ValueEnum;
use serde_json::{json, Value};

use super::{against_input, model_input, print_report, to_stdout, write_lines, Outcome};
use crate::cli::RegressArgs;
use crate::regress::baseline::{diff, read_jsonl, summarize};
use crate::regress::{expect, suite, Case, CaseSummary, Input, Suite};
use crate::report::progress::Bar;
use crate::report::regress::{case_record, progress_line, render, render_changes};
use crate::session::{
    self, Against, CudaDtype, HookOptions, ModeChoice, Ran, RunConfig, RunRequest, Watch,
    CACHE_NOT_WRITTEN,
};
use crate::util::glob;
use crate::util::guard::Guard;
use crate::util::shell::shell_word;

/// The run a case asks for, as plain values (the suite's words are checked when it is read).
fn request(case: &Case, args: &RegressArgs) -> Result<RunRequest> {
    let (prompt, tokens) = match &case.input {
        Input::Prompt(p) => (Some(p.clone()), None),
        Input::Tokens(t) => (None, Some(t.clone())),
        Input::FromTrace => (None, None),
    };
    Ok(RunRequest {
        model: case.model.clone(),
        prompt,
        tokens,
        layers: case.layers.clone(),
        against: Against::parse(&case.against)
            .with_context(|| format!("regress: against {:?}", case.against))?,
        devices: Vec::new(),
        mode: ModeChoice::from_str(&case.mode, false).map_err(|e| anyhow!("regress: mode {e}"))?,
        dtype: CudaDtype::from_str(&case.dtype, false)
            .map_err(|e| anyhow!("regress: dtype {e}"))?,
        inject: Vec::new(),
        explain: false,
        repro: None,
        hooks: HookOptions {
            hook: case.hook.clone(),
            tol: case.tol.clone(),
            precision: case.precision.clone(),
        },
        cache_dir: args.cache_dir.clone(),
        no_cache: args.no_cache,
    })
}

/// Runs a case as `glmdiff run` would.
fn run_run(case: &Case, args: &RegressArgs) -> Result<Ran> {
    let cfg = RunConfig::check(request(case, args)?)?;
    let (layers, hypotheses) = (Bar::new(), Bar::with_unit("hypotheses"));
    let watch = Watch {
        layers: &layers,
        hypotheses: &hypotheses,
        say: &|s| crate::report::emit_err(s),
    };
    session::run(&cfg, &watch)
}

/// The `glmdiff run` command that re-runs a case (with the tokens it ran, when known).
fn run_command(case: &Case, tokens: Option<&[u32]>) -> String {
    let mut c = format!(
        "glmdiff run {}",
        shell_word(&case.model.display().to_string())
    );
    let asked = match &case.input {
        Input::Tokens(t) => Some(t.as_slice()),
        _ => None,
    };
    match (tokens.or(asked), &case.input) {
        (Some(t), _) => {
            let ids: Vec<String> = t.iter().map(u32::to_string).collect();
            c.push_str(&format!(" --tokens {}", ids.join(",")));
        }
        (None, Input::Prompt(p)) => c.push_str(&format!(" --prompt {}", shell_word(p))),
        _ => {}
    }
    if let Some(l) = &case.layers {
        c.push_str(&format!(" --layers {}..{}", l.start, l.end));
    }
    c.push_str(&format!(
        " --against {} --mode {}",
        shell_word(&case.against),
        case.mode
    ));
    for g in &case.hook {
        c.push_str(&format!(" --hook {}", shell_word(g)));
    }
    for (g, v) in &case.tol {
        c.push_str(&format!(" --tol {}", shell_word(&format!("{g}={v:e}"))));
    }
    for (g, d) in &case.precision {
        c.push_str(&format!(" --precision {}", shell_word(&format!("{g}={d}"))));
    }
    c
}

/// Runs one case: its JSONL record.
fn run_case(suite_path: &Path, index: usize, case: &Case, args: &RegressArgs) -> Value {
    let t0 = Instant::now();
    let ran = run_run(case, args);
    let seconds = t0.elapsed().as_secs_f64();
    let mut reg = json!({
        "suite": suite_path.display().to_string(),
        "case": case.name,
        "index": index,
    });
    match ran {
        Err(e) => {
            reg["status"] = json!("error");
            reg["error"] = json!(format!("{e:#}"));
            reg["checks"] = json!([]);
            reg["command"] = json!(run_command(case, None));
            case_record(None, reg, seconds)
        }
        Ok(ran) => {
            // Said at once, as `run` says it in its report: the case ran, the cache stays cold.
            if let Some(n) = ran
                .header
                .cache
                .as_deref()
                .filter(|n| n.starts_with(CACHE_NOT_WRITTEN))
            {
                crate::report::emit_err(&format!("note: case {}: {n}", case.name));
            }
            let tokens: Vec<u32> = ran.header.tokens.iter().map(|(id, _)| *id).collect();
            reg["command"] = json!(run_command(case, Some(&tokens)));
            match expect::check(&case.expect, &ran.comparison) {
                Ok(checks) => {
                    let ok = checks.iter().all(|c| c.ok);
                    reg["status"] = json!(if ok { "pass" } else { "fail" });
                    reg["error"] = Value::Null;
                    reg["checks"] = json!(checks);
                }
                Err(why) => {
                    reg["status"] = json!("error");
                    reg["error"] = json!(format!(
                        "{}: case {} {:?}: {why}",
                        suite_path.display(),
                        index + 1,
                        case.name
                    ));
                    reg["checks"] = json!([]);
                }
            }
            case_record(Some((&ran.header, &ran.comparison)), reg, seconds)
        }
    }
}

/// Runs `glmdiff regress`.
pub fn run(args: &RegressArgs) -> Result<Outcome> {
    let suite = suite::load(&args.suite)?;
    check_files(args, &suite)?;
    let baseline = match &args.baseline {
        Some(p) => Some(read_jsonl(p)?),
        None => None,
    };
    let cases = selected(args, &suite)?;
    let mut records = Vec::with_capacity(cases.len());
    let mut summaries = Vec::with_capacity(cases.len());
    for (k, (i, case)) in cases.iter().enumerate() {
        let rec = run_case(&args.suite, *i, case, args);
        let s = summarize(&rec)?;
        crate::report::progress::line(&progress_line(k, cases.len(), &s));
        summaries.push(s);
        records.push(rec);
    }

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
    let drifted = changes.as_ref().is_some_and(|c| c.drifted());
    outcome(&summaries, drifted)
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
        if let Ok(a) = Against::parse(&c.against) {
            against_input(&mut g, &a, &c.model);
        }
    }
    g.output_or_stdout("--jsonl", args.jsonl.as_deref()).check()
}

/// The cases `--case` selects (all without it), with their index in the suite.
fn selected<'s>(args: &RegressArgs, suite: &'s Suite) -> Result<Vec<(usize, &'s Case)>> {
    let cases: Vec<(usize, &Case)> = suite
        .cases
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            args.case.is_empty() || args.case.iter().any(|g| glob::matches(g, &c.name))
        })
        .collect();
    if cases.is_empty() {
        let names: Vec<&str> = suite.cases.iter().map(|c| c.name.as_str()).collect();
        bail!(
            "regress: no case of {} matches --case {} (cases: {})",
            args.suite.display(),
            args.case.join(" "),
            names.join(", ")
        );
    }
    Ok(cases)
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
