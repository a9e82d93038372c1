//! Progress bars (indicatif) for long phases and progress lines, shown on stderr only when it is
//! a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::util::progress::Progress;

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub struct Bar {
    bar: ProgressBar,
}

/// How often a bar is redrawn while nothing moves.
const TICK: std::time::Duration = std::time::Duration::from_millis(250);

/// The unit of [`Bar::bytes`], counted as binary multiples.
const BYTES: &str = "bytes";

impl Bar {
    /// A hidden bar until [`Progress::start`], counting layers.
    pub fn new() -> Bar {
        Bar::with_unit("layers")
    }

    /// The same, counting `unit`s.
    pub fn with_unit(unit: &'static str) -> Bar {
        // The style is set before anything is drawn (indicatif's default style would flash).
        let template = if unit == BYTES {
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes}, {elapsed}".to_string()
        } else {
            format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit}, {{elapsed}}")
        };
        // Hidden until a phase starts, so that nothing half-set is drawn.
        let mut bar = ProgressBar::hidden();
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar = bar.with_style(style.progress_chars("=> "));
        }
        Bar { bar }
    }

    /// The same, counting bytes (shown as KiB, MiB, GiB).
    pub fn bytes() -> Bar {
        Bar::with_unit(BYTES)
    }
}

impl Default for Bar {
    fn default() -> Self {
        Bar::new()
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        self.bar.set_length(total);
        self.bar.reset();
        self.bar.set_message(what.to_string());
        self.bar.set_draw_target(ProgressDrawTarget::stderr());
        // Redrawn on a clock as well, so that the elapsed time moves during a long unit.
        self.bar.enable_steady_tick(TICK);
    }

    fn phase(&self, what: &str) {
        self.bar.set_message(what.to_string());
    }

    fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    fn finish(&self) {
        self.bar.disable_steady_tick();
        self.bar.finish_and_clear();
        self.bar.set_draw_target(ProgressDrawTarget::hidden());
    }
}

impl Drop for Bar {
    /// A phase cut short by an error leaves no bar behind the error message.
    fn drop(&mut self) {
        self.bar.disable_steady_tick();
        self.bar.finish_and_clear();
    }
}

/// Prints the progress line `text` on stderr (fitted to the width) when stderr is a terminal;
/// nothing otherwise, so that a log or a pipe gets only the results, notes and errors.
pub fn line(text: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        super::emit_err(text);
    }
}
