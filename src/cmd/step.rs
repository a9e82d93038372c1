//! `glmdiff step DIR`: re-runs the step of a case written by `run --repro` (the work is
//! [`crate::session::step`]'s) and prints the verdict.

use anyhow::Result;

use super::{print_report, to_stdout, write_json, Outcome};
use crate::cli::StepArgs;
use crate::report::progress::Bar;
use crate::report::step::{render, to_json};
use crate::session::{self, StepRequest};
use crate::util::guard::Guard;

/// Runs `glmdiff step`.
pub fn run(args: &StepArgs) -> Result<Outcome> {
    super::set_prefetch(&args.prefetch);
    let mut g = Guard::new();
    if let Ok(rd) = std::fs::read_dir(&args.dir) {
        for p in rd.filter_map(|e| e.ok().map(|e| e.path())) {
            g.input("the case file", &p);
        }
    }
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
    let req = StepRequest {
        dir: args.dir.clone(),
        against: args.against.clone(),
        tol: args.tol,
        explain: args.explain,
    };
    let report = session::step(&req, &Bar::with_unit("hypotheses"))?;
    print_report(&render(&report), to_stdout(args.json.as_deref()));
    if let Some(j) = &args.json {
        write_json("--json", j, &to_json(&report))?;
    }
    Ok(if report.differs {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}
