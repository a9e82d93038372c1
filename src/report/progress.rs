//! Progress bars (indicatif) for long phases, drawn on stderr only when it is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::util::progress::Progress;

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub struct Bar {
    bar: ProgressBar,
    unit: &'static str,
}

/// The unit of [`Bar::bytes`], counted as binary multiples.
const BYTES: &str = "bytes";

impl Bar {
    /// A hidden bar until [`Progress::start`], counting layers.
    pub fn new() -> Bar {
        Bar::with_unit("layers")
    }

    /// The same, counting `unit`s.
    pub fn with_unit(unit: &'static str) -> Bar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        Bar { bar, unit }
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
        self.bar.reset();
        self.bar.set_length(total);
        self.bar.set_position(0);
        let template = if self.unit == BYTES {
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes}, {elapsed}".to_string()
        } else {
            format!(
                "{{msg}} [{{bar:30}}] {{pos}}/{{len}} {}, {{elapsed}}",
                self.unit
            )
        };
        if let Ok(style) = ProgressStyle::with_template(&template) {
            self.bar.set_style(style.progress_chars("=> "));
        }
        self.bar.set_message(what.to_string());
    }

    fn phase(&self, what: &str) {
        self.bar.set_message(what.to_string());
    }

    fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
