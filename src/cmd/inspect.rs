//! `glmdiff inspect`: what a GGUF holds, for any architecture.

use anyhow::Result;

use super::Outcome;
use crate::cli::InspectArgs;
use crate::gguf::Model;
use crate::model::inspect;

/// Runs `glmdiff inspect`.
pub fn run(args: &InspectArgs) -> Result<Outcome> {
    let model = Model::open(&args.model)?;
    if let Some(g) = args.tensors.as_deref() {
        if !model
            .tensors()
            .any(|t| crate::util::glob::matches(g, &t.info.name))
        {
            anyhow::bail!(
                "inspect: --tensors {g:?} matches none of the {} tensors of {} (names like token_embd.weight, blk.0.attn_norm.weight)",
                model.tensors().count(),
                args.model.display()
            );
        }
    }
    let report = inspect::build(&model, args.tensors.as_deref());
    if args.json {
        crate::report::print_json(&report)?;
    } else {
        crate::report::inspect::print(&report);
    }
    Ok(Outcome::Ok)
}
