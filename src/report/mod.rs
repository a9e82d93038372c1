//! Everything glmdiff prints to stdout: tables (comfy-table) and JSON, plus the SVG plot of
//! `run --plot` ([`plot`]). Other modules compute; this one formats. Text fits the width of
//! [`layout`] (the terminal's, at most 100 columns when stdout is not a terminal, none with
//! `--wide`).

pub mod bench;
pub mod dequant_check;
pub mod inspect;
pub mod layout;
pub mod plot;
pub mod progress;
pub mod regress;
pub mod run;
pub mod step;
pub mod synth;
pub mod trace;
pub mod weights_check;

use std::io::Write;

use anyhow::Result;
use comfy_table::Table;
use serde::Serialize;

pub use layout::Grid;

/// Prints `value` as pretty JSON on stdout.
pub fn print_json<T: Serialize>(value: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A table in glmdiff's style: plain ASCII borders, cells wrapped to fit [`layout::width`]
/// (nothing wrapped with `--wide`, stable to grep and diff).
pub fn table(header: &[&str]) -> Table {
    layout::table_at(header, layout::width())
}

/// Prints `text` on stdout, its long lines fitted to [`layout::width`].
pub fn emit(text: &str) {
    print!("{}", layout::fit_text(text, layout::width()));
}

/// Prints the line `text` on stderr, fitted to [`layout::width`] as [`emit`] does.
pub fn emit_err(text: &str) {
    eprintln!("{}", layout::fit_text(text, layout::width()));
}

/// Human-readable byte count (binary units).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
