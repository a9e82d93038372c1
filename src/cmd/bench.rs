//! `glmdiff bench dequant` and `glmdiff bench layer`.

use anyhow::{bail, Result};

use super::Outcome;
use crate::cli::{BenchDequantArgs, BenchLayerArgs};

/// Runs `glmdiff bench dequant`.
pub fn run_dequant(_args: &BenchDequantArgs) -> Result<Outcome> {
    bail!("bench: dequant benchmark not available in this build yet")
}

/// Runs `glmdiff bench layer`.
pub fn run_layer(_args: &BenchLayerArgs) -> Result<Outcome> {
    bail!("bench: layer benchmark not available in this build yet")
}
