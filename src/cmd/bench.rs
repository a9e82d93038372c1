//! `glmdiff bench dequant` and `glmdiff bench layer`.

use anyhow::{bail, Context, Result};

use super::Outcome;
use crate::bench::dequant::{self, BenchDequantOptions};
use crate::cli::{BenchDequantArgs, BenchLayerArgs};
use crate::quant::GgmlType;

/// Runs `glmdiff bench dequant`.
pub fn run_dequant(args: &BenchDequantArgs) -> Result<Outcome> {
    let types = args
        .types
        .iter()
        .map(|n| {
            GgmlType::from_name(n).with_context(|| format!("bench: --types: unknown type {n:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let opts = BenchDequantOptions {
        types,
        ..BenchDequantOptions::default()
    };
    let report = dequant::run(&opts)?;
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        print!("{}", dequant::render_table(&report));
    }
    Ok(Outcome::Ok)
}

/// Runs `glmdiff bench layer`.
pub fn run_layer(_args: &BenchLayerArgs) -> Result<Outcome> {
    bail!("bench: layer benchmark not available in this build yet")
}
