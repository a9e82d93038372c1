//! The `glmdiff` binary: choose the width, parse flags, run one command, print errors once (fitted
//! to the width), map outcomes to exit codes
//! (0 ok, 1 a check found a difference, 2 error). An interrupt (SIGINT, SIGTERM, SIGHUP) removes
//! the temporary files in flight and exits with 2.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use glmdiff::cli::{BenchCommand, Cli, Command};
use glmdiff::cmd::{self, Outcome};
use glmdiff::report::layout;

fn main() -> ExitCode {
    // The width is chosen before the flags are parsed, so that help and every error, clap's
    // included, fit it: `--wide` is looked for among the words before a `--`.
    let wide = std::env::args_os()
        .take_while(|a| a != "--")
        .any(|a| a == "--wide");
    let width = layout::detect(wide);
    layout::set_width(width);
    let parsed = Cli::command()
        .term_width(width.unwrap_or(0))
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are not errors.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One error where clap has one: its pointer to --help is dropped (the error
            // already names the flag and the value).
            let text = e.render().to_string();
            let text = text
                .trim_end()
                .trim_end_matches("For more information, try '--help'.")
                .trim_end();
            glmdiff::report::emit_err(text);
            return ExitCode::from(2);
        }
    };
    // The CPU's vector level, for the whole process: --cpu-simd, else $GLMDIFF_CPU_SIMD, whose
    // value is read here once.
    let simd_env = std::env::var(glmdiff::quant::simd::LEVEL_ENV).ok();
    if let Some(cap) = cmd::cpu_simd_cap(cli.cpu_simd, simd_env.as_deref()) {
        glmdiff::quant::simd::set_cap(cap);
    }
    glmdiff::report::progress::set_interval(cli.progress.0);
    glmdiff::engine::cpu::device::set_reference_on(cli.reference_on);
    glmdiff::engine::cpu::device::set_min_tokens(cli.reference_min_tokens as usize);
    cmd::set_gpu_wait(cli.gpu_wait);
    glmdiff::util::background::set_compare_threads(cli.compare_pool.0);
    glmdiff::driver::pair::set_candidate_ahead(cli.candidate_ahead.is_on());
    #[cfg(feature = "cuda")]
    glmdiff::gpu::resident::set_reuse(cli.reference_reuse.is_on());
    install_interrupt_handler();
    restore_default_sigpipe();
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
        Command::Bench(BenchCommand::Run(a)) => cmd::bench::run_run(a),
    };
    // A kernel compile still running on a thread of its own (started ahead, never waited for)
    // may be writing the disk cache: its temporary file goes with the process.
    glmdiff::util::atomic::remove_in_flight();
    match result {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Differs) => ExitCode::from(1),
        Err(e) => {
            glmdiff::report::emit_err(&format!("error: {e:#}"));
            ExitCode::from(2)
        }
    }
}

/// On SIGINT, SIGTERM or SIGHUP: remove the temporary files and directories in flight (a
/// half-written output never stays behind), say so in one line and exit with 2. The handler
/// runs on its own thread (the `ctrlc` crate), not inside the signal handler.
fn install_interrupt_handler() {
    let r = ctrlc::set_handler(|| {
        let removed = glmdiff::util::atomic::remove_in_flight();
        if removed.is_empty() {
            glmdiff::report::emit_err("error: interrupted");
        } else {
            let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            glmdiff::report::emit_err(&format!("error: interrupted; removed {}", names.join(", ")));
        }
        std::process::exit(2);
    });
    if let Err(e) = r {
        // Without the handler an interrupt still stops the process; its temporaries are then
        // removed by the next write of the same file.
        glmdiff::report::emit_err(&format!(
            "warning: cannot install the interrupt handler: {e}"
        ));
    }
}

/// `glmdiff ... | head` ends quietly when the reader goes away, as other Unix tools do, instead
/// of a panic in `println!` (Rust ignores SIGPIPE by default). Reports go to stdout only after
/// every output file was written, so no temporary file is in flight then.
fn restore_default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default, before any other thread of this
    // process writes to stdout; `signal` has no other precondition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
