//! Progress bars (indicatif) for long phases, drawn on stderr only when it is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::util::progress::Progress;

/// A progress bar on stderr; hidden when stderr is not a terminal.
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    /// A hidden bar until [`Progress::start`].
    pub fn new() -> Bar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        Bar { bar }
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
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers, {elapsed}")
        {
            self.bar.set_style(style.progress_chars("=> "));
        }
        self.bar.set_message(what.to_string());
    }

    fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
