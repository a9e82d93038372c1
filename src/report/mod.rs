//! Everything glmdiff prints to stdout: tables (comfy-table) and JSON, plus the SVG plot of
//! `run --plot` ([`plot`]). Other modules compute; this one formats.

pub mod bench;
#[cfg(feature = "cuda")]
pub mod dequant_check;
pub mod inspect;
pub mod plot;
pub mod progress;
pub mod regress;
pub mod run;
pub mod step;
pub mod trace;
pub mod weights_check;

use std::io::Write;

use anyhow::Result;
use comfy_table::{presets, ContentArrangement, Table};
use serde::Serialize;

/// Prints `value` as pretty JSON on stdout.
pub fn print_json<T: Serialize>(value: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A table in glmdiff's style: plain ASCII borders, no wrapping (stable to grep and diff).
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    t
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
