//! `glmdiff run`: the reference and a candidate side by side over the same steps, and
//! `glmdiff compare`: the same table for two traces. The work is [`crate::session`]'s.

use std::path::Path;

use anyhow::{bail, Result};

use super::{against_input, model_input, print_report, to_stdout, write_json, Outcome};
use crate::cli::{CompareArgs, ReportArgs, RunArgs};
use crate::compare::Comparison;
use crate::report::progress::Bar;
use crate::report::run::{render, to_json, Header};
use crate::session::tokens::token_text;
use crate::session::{self, CompareRequest, HookOptions, RunConfig, RunRequest, Watch};
use crate::util::guard::Guard;

/// Runs `glmdiff run`.
pub fn run(args: &RunArgs) -> Result<Outcome> {
    super::set_prefetch(&args.prefetch);
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    against_input(&mut g, &args.against, &args.model);
    check_outputs(g, &args.report, args.repro.as_deref())?;
    let cfg = RunConfig::check(request(args))?;
    crate::report::progress::started(&cfg.summary());
    let (layers, hypotheses) = (Bar::new(), Bar::with_unit("hypotheses"));
    let watch = Watch {
        layers: &layers,
        hypotheses: &hypotheses,
        say: &|s| crate::report::emit_err(s),
    };
    let ran = session::run(&cfg, &watch)?;
    let text = |id: u32| token_text(cfg.tokenizer(), id);
    finish(&ran.header, &ran.comparison, &text, &args.report)
}

/// The plain values of `run`'s flags.
fn request(args: &RunArgs) -> RunRequest {
    RunRequest {
        model: args.model.clone(),
        prompt: args.prompt.clone(),
        tokens: args.tokens.clone(),
        layers: match args.layer {
            Some(n) => Some(n..n.saturating_add(1)),
            None => args.layers.clone(),
        },
        against: args.against.clone(),
        devices: args.devices.clone(),
        mode: args.mode,
        dtype: args.dtype,
        inject: args.inject.clone(),
        explain: args.explain,
        repro: args.repro.clone(),
        hooks: hook_options(&args.report),
        cache_dir: args.cache_dir.clone(),
        no_cache: args.no_cache,
    }
}

/// The hooks, floors and precisions of `run`'s and `compare`'s flags.
fn hook_options(report: &ReportArgs) -> HookOptions {
    HookOptions {
        hook: report.hook.clone(),
        tol: report.tol.clone(),
        precision: report.precision.clone(),
    }
}

/// Runs `glmdiff compare`.
pub fn compare(args: &CompareArgs) -> Result<Outcome> {
    let mut g = Guard::new();
    g.input("the reference trace", &args.reference)
        .input("the candidate trace", &args.candidate);
    if let Some(m) = &args.map {
        g.input("the --map file", m);
    }
    check_outputs(g, &args.report, None)?;
    let req = CompareRequest {
        reference: args.reference.clone(),
        candidate: args.candidate.clone(),
        map: args.map.clone(),
        model: args.model.clone(),
        hooks: hook_options(&args.report),
    };
    let ran = session::compare(&req, &Bar::with_unit("hooks"))?;
    let text = |id: u32| id.to_string();
    finish(&ran.header, &ran.comparison, &text, &args.report)
}

/// Checks the outputs of `run` and `compare` against each other and the inputs `g` lists,
/// before any work.
fn check_outputs(mut g: Guard, report: &ReportArgs, repro: Option<&Path>) -> Result<()> {
    if let Some(p) = &report.plot {
        if p.extension().and_then(|e| e.to_str()) != Some("svg") {
            bail!("--plot {} must end in .svg", p.display());
        }
    }
    g.output_or_stdout("--json", report.json.as_deref())
        .output("--plot", report.plot.as_deref())
        .output_dir("--repro", repro)
        .check()
}

/// Prints the report, writes `--json` and `--plot`, and turns the verdict into the outcome.
fn finish(
    h: &Header,
    c: &Comparison,
    text: &dyn Fn(u32) -> String,
    report: &ReportArgs,
) -> Result<Outcome> {
    print_report(
        &render(h, c, text, report.all_steps),
        to_stdout(report.json.as_deref()),
    );
    if let Some(j) = &report.json {
        write_json("--json", j, &to_json(h, c))?;
    }
    if let Some(p) = &report.plot {
        crate::report::run::write_plot(h, c, p)?;
    }
    Ok(if c.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}
