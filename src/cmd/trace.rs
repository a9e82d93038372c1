//! `glmdiff trace`: run the CPU reference forward pass and write the hooks to a safetensors trace.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};

use super::{model_input, Outcome};
use crate::cli::TraceArgs;
use crate::driver::{self, Plan};
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::gguf::Model;
use crate::model::Weights;
use crate::tokenizer::Tokenizer;
use crate::trace::{write_trace, HookFilter, TraceMeta, TraceSink};
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
    let model = Model::open(&args.model)?;
    let weights = Weights::new(&model)?;
    let hp = weights.hparams();

    // The tokenizer is needed for --prompt, and only nice to have for printing tokens.
    let tokenizer = Tokenizer::from_model(&model);
    let tokens = match (&args.tokens, &args.prompt) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => {
            let tok = tokenizer
                .as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .context(
                    "trace: --prompt needs the model's tokenizer; pass ids with --tokens instead",
                )?;
            let mut ids = Vec::new();
            if tok.add_bos() {
                ids.extend(tok.bos_id());
            }
            ids.extend(tok.encode(p)?);
            ids
        }
        (None, None) => bail!("trace: give --tokens or --prompt"),
    };
    if tokens.is_empty() {
        bail!("trace: the prompt has no tokens");
    }
    if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= weights.n_vocab()) {
        bail!(
            "trace: token id {bad} is outside the vocabulary 0..{} of {}",
            weights.n_vocab(),
            model.file_name()
        );
    }

    let layers = match &args.layers {
        None => None,
        Some(r) => {
            if r.end > hp.n_layer as u64 {
                bail!(
                    "trace: --layers {}..{} is out of range: the model runs layers 0..{} ({} blocks, {} MTP not run)",
                    r.start,
                    r.end,
                    hp.n_layer,
                    hp.n_block,
                    hp.n_nextn
                );
            }
            Some(r.start as usize..r.end as usize)
        }
    };
    let filter = HookFilter {
        layers,
        globs: args.hook.clone(),
    };
    let mut sink = TraceSink::new(filter);
    let plan = Plan::for_sink(&weights, &sink)?;
    let engine = CpuEngine::new(&weights);
    let bar = crate::report::progress::Bar::new();
    let summary = driver::run_from(&engine, &weights, &tokens, &plan, &[], &mut sink, &bar)?;
    if summary.hooks_recorded == 0 {
        let layers = args
            .layers
            .as_ref()
            .map_or("all".to_string(), |r| format!("{}..{}", r.start, r.end));
        let hooks = if args.hook.is_empty() {
            "(all)".to_string()
        } else {
            args.hook.join(" ")
        };
        bail!(
            "trace: no hook matched --layers {layers} --hook {hooks}; hook names are blk.L.<point>, token_embd, result_norm, logits"
        );
    }
    let meta = TraceMeta {
        model: model.file_name(),
        architecture: hp.arch.as_str().to_string(),
        tokens: tokens.clone(),
        engine: engine.describe(),
        dtype: engine.precision().to_string(),
        mode: crate::trace::Mode::Chained,
        extra: BTreeMap::new(),
    };
    write_trace(&args.out, sink.tensors(), &meta)?;
    if let Some(logits) = sink.tensors().get("logits") {
        print_next_tokens(logits, tokenizer.as_ref().ok())?;
    }
    crate::report::emit_err(&format!(
        "wrote {} ({} hooks, {} tokens, {} of {} layers{})",
        args.out.display(),
        summary.hooks_recorded,
        tokens.len(),
        summary.n_layers,
        hp.n_layer,
        if summary.tail { ", logits" } else { "" }
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
