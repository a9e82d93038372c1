//! `glmdiff synth`.

use anyhow::{bail, Result};

use super::Outcome;

/// Runs `glmdiff synth`.
pub fn run(_args: &crate::cli::SynthArgs) -> Result<Outcome> {
    bail!("synth: not available in this build yet")
}
