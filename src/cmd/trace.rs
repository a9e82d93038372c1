//! `glmdiff trace`: run the CPU reference forward pass and write the hooks to a safetensors trace.

use anyhow::{bail, Result};

use super::{model_input, Outcome};
use crate::cli::TraceArgs;
use crate::report::progress::Bar;
use crate::report::trace::render_next;
use crate::session::{self, TraceRequest};
use crate::util::guard::Guard;

/// Runs `glmdiff trace`.
pub fn run(args: &TraceArgs) -> Result<Outcome> {
    if args.out.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        bail!(
            "trace: output {} must end in .safetensors (a trace is a safetensors file)",
            args.out.display()
        );
    }
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    g.output("--out", Some(&args.out)).check()?;
    let req = TraceRequest {
        model: args.model.clone(),
        prompt: args.prompt.clone(),
        tokens: args.tokens.clone(),
        layers: args.layers.clone(),
        hook: args.hook.clone(),
        out: args.out.clone(),
    };
    let t = session::trace(&req, &Bar::new())?;
    if let Some((position, next)) = &t.next {
        crate::report::emit(&render_next(*position, next));
    }
    crate::report::emit_err(&format!(
        "wrote {} ({} hooks, {} tokens, {} of {} layers{})",
        args.out.display(),
        t.hooks,
        t.tokens,
        t.layers.0,
        t.layers.1,
        if t.tail { ", logits" } else { "" }
    ));
    Ok(Outcome::Ok)
}
