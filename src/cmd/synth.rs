//! `glmdiff synth`: flags to [`crate::synth::SynthOptions`], write the file, print a summary.

use anyhow::Result;

use super::Outcome;
use crate::cli::SynthArgs;
use crate::report::progress::Bar;
use crate::synth::{self, SynthOptions};

/// Runs `glmdiff synth`.
pub fn run(args: &SynthArgs) -> Result<Outcome> {
    let opts = SynthOptions::parse(&args.arch, &args.dims, args.layers, &args.types, args.seed)?;
    crate::util::guard::Guard::new()
        .output("--out", Some(&args.out))
        .check()?;
    let s = synth::write_with_progress(&opts, &args.out, &Bar::bytes())?;
    crate::report::emit(&crate::report::synth::render(&args.out, &opts, &s));
    Ok(Outcome::Ok)
}
