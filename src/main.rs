//! The `glmdiff` binary: parse flags, run one command, print errors once, map outcomes to exit codes
//! (0 ok, 1 a check found a difference, 2 error).

use std::process::ExitCode;

use clap::Parser;
use glmdiff::cli::{BenchCommand, Cli, Command};
use glmdiff::cmd::{self, Outcome};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are not errors.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    glmdiff::report::layout::set_width(glmdiff::report::layout::detect(cli.wide));
    let result = match &cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Dequant(a) => cmd::dequant::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::DequantCheck(a) => cmd::dequant_check::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Compare(a) => cmd::run::compare(a),
        Command::Step(a) => cmd::step::run(a),
        Command::Regress(a) => cmd::regress::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::WeightsCheck(a) => cmd::weights_check::run(a),
        Command::Bench(BenchCommand::Dequant(a)) => cmd::bench::run_dequant(a),
        Command::Bench(BenchCommand::Layer(a)) => cmd::bench::run_layer(a),
    };
    match result {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Differs) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
