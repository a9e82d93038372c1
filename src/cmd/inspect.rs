//! `glmdiff inspect`: what a GGUF holds, for any architecture.

use anyhow::Result;

use super::Outcome;
use crate::cli::InspectArgs;
use crate::gguf::Model;
use crate::model::inspect;

/// Runs `glmdiff inspect`.
pub fn run(args: &InspectArgs) -> Result<Outcome> {
    let model = Model::open(&args.model)?;
    let report = inspect::build(&model, args.tensors.as_deref());
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::inspect::print(&report);
    }
    Ok(Outcome::Ok)
}
