//! Progress of long phases on stderr: bars (indicatif) when stderr is a terminal; plain lines
//! when it is not (a pipe, a log file), so that a log shows life while a long run works.
//!
//! # Plain lines
//! Without a terminal nothing is drawn; instead, once a phase has run [`FIRST_LINE`] (so that
//! quick commands leave their stderr to results, notes and errors), a line says what, how far,
//! the rate and the time left, and again every [`LINE_EVERY`] while it runs:
//!
//! ```text
//! progress: reference layers: 12/78 layers (15%), 0.41 layers/s, 2m 40s elapsed, ETA 2m 32s
//! ```
//!
//! The command's own start line ([`started`], `glmdiff run: MODEL ...`) comes before the first
//! such line. `--progress SECONDS|off` (default `$GLMDIFF_PROGRESS`, else 10) sets the interval
//! (the first line then comes after at most that long), or turns the lines off.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::util::progress::Progress;

/// How long a phase runs before its first plain line.
pub const FIRST_LINE: Duration = Duration::from_secs(2);
/// How often a plain line repeats while a phase runs.
pub const LINE_EVERY: Duration = Duration::from_secs(10);
/// The plain lines' timing (first line, interval), `None` when turned off; set once by
/// [`set_interval`] (the `--progress` flag), the defaults until then.
static TIMING: OnceLock<Option<(Duration, Duration)>> = OnceLock::new();

/// Sets the interval of the plain lines in seconds (`--progress`, `GLMDIFF_PROGRESS`; `None`:
/// off). The first line of a phase comes after [`FIRST_LINE`] or the interval, the shorter.
pub fn set_interval(seconds: Option<f64>) {
    let t = seconds.map(|s| {
        let s = if s.is_finite() {
            s.clamp(0.0, 86_400.0)
        } else {
            10.0
        };
        let every = Duration::from_secs_f64(s.max(0.2));
        (FIRST_LINE.min(Duration::from_secs_f64(s)), every)
    });
    let _ = TIMING.set(t);
}

/// The plain lines' timing: `None` when turned off.
fn plain_timing() -> Option<(Duration, Duration)> {
    *TIMING.get_or_init(|| Some((FIRST_LINE, LINE_EVERY)))
}

/// Whether stderr is a terminal (bars) or not (plain lines).
fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// When the process began showing progress (the first [`started`] or bar): [`line`] keeps
/// quiet before [`FIRST_LINE`] has passed since.
fn process_start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The start line of [`started`], until the first plain line prints it.
static PENDING_START: Mutex<Option<String>> = Mutex::new(None);

/// Says what the command is about to do. In a terminal the report's header says it at the end;
/// without one the line is printed before the first progress line, so that a log that shows
/// progress also shows what it is the progress of.
pub fn started(text: &str) {
    process_start();
    if !stderr_is_terminal() {
        if let Ok(mut p) = PENDING_START.lock() {
            *p = Some(text.to_string());
        }
    }
}

/// Prints the pending start line, once.
fn flush_start() {
    let pending = PENDING_START.lock().ok().and_then(|mut p| p.take());
    if let Some(t) = pending {
        super::emit_err(&t);
    }
}

/// A phase as plain lines tell it.
struct PlainPhase {
    what: String,
    pos: u64,
    len: u64,
    since: Instant,
    /// A line was printed for this phase (its end then gets one too).
    said: bool,
}

/// The plain-line state of a bar and its clock thread.
struct Plain {
    unit: &'static str,
    phase: Mutex<Option<PlainPhase>>,
    /// Set to stop the clock thread; the condition variable wakes it.
    stop: Mutex<bool>,
    wake: Condvar,
}

impl Plain {
    /// The line for `p` now.
    fn text(&self, p: &PlainPhase) -> String {
        let elapsed = p.since.elapsed().as_secs_f64();
        let count = |n: u64| {
            if self.unit == BYTES {
                super::human_bytes(n)
            } else {
                n.to_string()
            }
        };
        let mut t = format!("progress: {}: {}", p.what, count(p.pos));
        if p.len > 0 {
            t += &format!("/{}", count(p.len));
        }
        if self.unit != BYTES {
            t += &format!(" {}", self.unit);
        }
        if p.len > 0 {
            t += &format!(" ({:.0}%)", 100.0 * p.pos.min(p.len) as f64 / p.len as f64);
        }
        let rate = p.pos as f64 / elapsed.max(1e-9);
        if p.pos > 0 {
            t += &if self.unit == BYTES {
                format!(", {}/s", super::human_bytes(rate as u64))
            } else {
                format!(", {rate:.3} {}/s", self.unit)
            };
        }
        t += &format!(", {} elapsed", duration_words(elapsed));
        if p.pos > 0 && p.len > p.pos {
            t += &format!(", ETA {}", duration_words((p.len - p.pos) as f64 / rate));
        }
        t
    }

    /// Prints the line of the running phase, if any.
    fn say(&self) {
        let text = match self.phase.lock() {
            Ok(mut g) => match g.as_mut() {
                Some(p) => {
                    p.said = true;
                    self.text(p)
                }
                None => return,
            },
            Err(_) => return,
        };
        flush_start();
        super::emit_err(&text);
    }
}

/// `75 s`, `2m 05s`, `1h 02m`.
fn duration_words(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match s {
        0..=99 => format!("{s} s"),
        100..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, (s / 60) % 60),
    }
}

/// A progress bar on stderr when it is a terminal; plain lines otherwise (module
/// documentation).
pub struct Bar {
    bar: ProgressBar,
    plain: Option<Arc<Plain>>,
    clock: Mutex<Option<std::thread::JoinHandle<()>>>,
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
        let plain = (!stderr_is_terminal() && plain_timing().is_some()).then(|| {
            Arc::new(Plain {
                unit,
                phase: Mutex::new(None),
                stop: Mutex::new(false),
                wake: Condvar::new(),
            })
        });
        Bar {
            bar,
            plain,
            clock: Mutex::new(None),
        }
    }

    /// Starts the clock thread of the plain lines, if there are any and it is not running.
    fn start_clock(&self) {
        let (Some(plain), Some((first, every))) = (&self.plain, plain_timing()) else {
            return;
        };
        let Ok(mut clock) = self.clock.lock() else {
            return;
        };
        if clock.is_some() {
            return;
        }
        if let Ok(mut stop) = plain.stop.lock() {
            *stop = false;
        }
        let plain = Arc::clone(plain);
        *clock = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                let mut wait = first;
                loop {
                    let Ok(stop) = plain.stop.lock() else { return };
                    let Ok((stop, timeout)) = plain.wake.wait_timeout(stop, wait) else {
                        return;
                    };
                    if *stop {
                        return;
                    }
                    drop(stop);
                    if timeout.timed_out() {
                        plain.say();
                        wait = every;
                    }
                }
            })
            .ok();
    }

    /// Stops the clock thread and waits for it.
    fn stop_clock(&self) {
        let Some(plain) = &self.plain else { return };
        if let Ok(mut stop) = plain.stop.lock() {
            *stop = true;
        }
        plain.wake.notify_all();
        let handle = self.clock.lock().ok().and_then(|mut c| c.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
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
        process_start();
        if let Some(plain) = &self.plain {
            if let Ok(mut p) = plain.phase.lock() {
                *p = Some(PlainPhase {
                    what: what.to_string(),
                    pos: 0,
                    len: total,
                    since: Instant::now(),
                    said: false,
                });
            }
            self.start_clock();
        }
        self.bar.set_length(total);
        self.bar.reset();
        self.bar.set_message(what.to_string());
        self.bar.set_draw_target(ProgressDrawTarget::stderr());
        // Redrawn on a clock as well, so that the elapsed time moves during a long unit.
        self.bar.enable_steady_tick(TICK);
    }

    fn phase(&self, what: &str) {
        if let Some(plain) = &self.plain {
            if let Ok(mut g) = plain.phase.lock() {
                if let Some(p) = g.as_mut() {
                    p.what = what.to_string();
                }
            }
        }
        self.bar.set_message(what.to_string());
    }

    fn inc(&self, n: u64) {
        if let Some(plain) = &self.plain {
            if let Ok(mut g) = plain.phase.lock() {
                if let Some(p) = g.as_mut() {
                    p.pos = p.pos.saturating_add(n);
                }
            }
        }
        self.bar.inc(n);
    }

    fn finish(&self) {
        self.stop_clock();
        if let Some(plain) = &self.plain {
            // A phase that said it was under way says that it ended.
            let done = plain.phase.lock().ok().and_then(|mut g| g.take());
            if let Some(p) = done.filter(|p| p.said) {
                let elapsed = duration_words(p.since.elapsed().as_secs_f64());
                super::emit_err(&format!("progress: {}: done in {elapsed}", p.what));
            }
        }
        self.bar.disable_steady_tick();
        self.bar.finish_and_clear();
        self.bar.set_draw_target(ProgressDrawTarget::hidden());
    }
}

impl Drop for Bar {
    /// A phase cut short by an error leaves no bar behind the error message.
    fn drop(&mut self) {
        self.stop_clock();
        self.bar.disable_steady_tick();
        self.bar.finish_and_clear();
    }
}

/// Prints the progress line `text` on stderr (fitted to the width): always on a terminal;
/// without one once the command has run [`FIRST_LINE`] (after its start line), so that a quick
/// command leaves a log to its results, notes and errors while a long one shows each step.
pub fn line(text: &str) {
    if stderr_is_terminal() {
        super::emit_err(text);
    } else if let Some((first, _)) = plain_timing() {
        if process_start().elapsed() >= first {
            flush_start();
            super::emit_err(text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_words() {
        assert_eq!(duration_words(0.4), "0 s");
        assert_eq!(duration_words(75.0), "75 s");
        assert_eq!(duration_words(125.0), "2m 05s");
        assert_eq!(duration_words(3720.0), "1h 02m");
    }

    /// What a plain line says: count, share, rate and time left (by hand: 3 of 12 layers in
    /// 6 s is 0.5 layers/s, 9 left take 18 s).
    #[test]
    fn a_plain_line_by_hand() {
        let plain = Plain {
            unit: "layers",
            phase: Mutex::new(None),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        };
        let p = PlainPhase {
            what: "reference layers".into(),
            pos: 3,
            len: 12,
            since: Instant::now() - Duration::from_secs(6),
            said: false,
        };
        let t = plain.text(&p);
        assert!(
            t.starts_with("progress: reference layers: 3/12 layers (25%), 0.50"),
            "{t}"
        );
        assert!(t.ends_with("6 s elapsed, ETA 18 s"), "{t}");
        let bytes = Plain {
            unit: BYTES,
            ..plain
        };
        let q = PlainPhase {
            pos: 0,
            len: 2048,
            ..p
        };
        assert!(bytes
            .text(&q)
            .starts_with("progress: reference layers: 0 B/2.00 KiB (0%), 6 s"));
    }
}
