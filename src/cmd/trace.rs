//! `glmdiff trace`: run the CPU reference forward pass and write the hooks to a safetensors trace.

use anyhow::{bail, Context, Result};

use super::{model_input, Outcome};
use crate::cli::TraceArgs;
use crate::report::progress::Bar;
use crate::session::{self, TraceRequest};
use crate::tokenizer::Tokenizer;
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
    if let Some(logits) = &t.logits {
        print_next_tokens(logits, t.tokenizer.as_ref())?;
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

/// Prints the five most likely next tokens after the prompt's last position.
fn print_next_tokens(logits: &crate::engine::HostTensor, tok: Option<&Tokenizer>) -> Result<()> {
    use crate::report::trace::{render_next, top_next, NextToken};
    let values = logits.as_f32("logits")?; // [T, vocab]
    let vocab = *logits.shape.last().context("trace: logits have no shape")?;
    let t = values.len() / vocab.max(1);
    if t == 0 {
        return Ok(());
    }
    let last = &values[(t - 1) * vocab..t * vocab];
    let next: Vec<NextToken> = top_next(last, 5)
        .into_iter()
        .map(|(id, logit, logprob)| NextToken {
            id,
            text: tok.and_then(|k| token_label(k, id as u32)),
            logit,
            logprob,
        })
        .collect();
    crate::report::emit(&render_next(t - 1, &next));
    Ok(())
}

/// How a candidate token is shown: its decoded text, or, when it is a partial UTF-8 sequence
/// (one byte of a multi-byte character), its vocabulary entry marked as such.
fn token_label(tok: &Tokenizer, id: u32) -> Option<String> {
    let text = tok.decode(&[id]).ok()?;
    if text.contains('\u{FFFD}') {
        tok.token_text(id)
            .map(|v| format!("(partial UTF-8) vocab entry {v:?}"))
    } else {
        Some(format!("{text:?}"))
    }
}
