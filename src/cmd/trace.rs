//! `glmdiff trace`.

use anyhow::{bail, Result};

use super::Outcome;

/// Runs `glmdiff trace`.
pub fn run(_args: &crate::cli::TraceArgs) -> Result<Outcome> {
    bail!("trace: not available in this build yet")
}
