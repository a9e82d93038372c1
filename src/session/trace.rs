//! `glmdiff trace`: the CPU reference's forward pass with its hooks (those asked) written to a
//! safetensors trace.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::tokens::{prompt_tokens, token_label};
use crate::driver::{self, Plan};
use crate::engine::{Engine, HostTensor};
use crate::gguf::Model;
use crate::model::{HParams, Weights};
use crate::report::trace::NextToken;
use crate::tokenizer::Tokenizer;
use crate::trace::{write_trace, HookFilter, TraceMeta, TraceSink};
use crate::util::progress::Progress;
use crate::util::topk::top_k;

/// How many next tokens `trace` shows.
pub const NEXT_TOKENS: usize = 5;

/// What `trace` is asked, as plain values.
#[derive(Clone, Debug)]
pub struct TraceRequest {
    /// The model (any shard of a split model).
    pub model: PathBuf,
    /// Prompt text.
    pub prompt: Option<String>,
    /// Token ids.
    pub tokens: Option<Vec<u32>>,
    /// Only the hooks of layers `A..B` (all when `None`).
    pub layers: Option<Range<u64>>,
    /// Hook globs (all when empty).
    pub hook: Vec<String>,
    /// The trace file to write.
    pub out: PathBuf,
}

/// What a trace run wrote.
pub struct Traced {
    /// Hooks written.
    pub hooks: usize,
    /// Prompt tokens.
    pub tokens: usize,
    /// Layers run, and the model's layer count.
    pub layers: (usize, usize),
    /// Whether the final norm and logits ran.
    pub tail: bool,
    /// The [`NEXT_TOKENS`] most likely tokens after the prompt's last position (that
    /// position, then the tokens), when the logits were written.
    pub next: Option<(usize, Vec<NextToken>)>,
}

/// Runs the reference over the prompt, keeping the hooks asked, and writes them to `req.out`.
pub fn trace(req: &TraceRequest, progress: &dyn Progress) -> Result<Traced> {
    let model = Model::open(&req.model)?;
    let weights = Weights::new(&model)?;
    let hp = weights.hparams();
    // The tokenizer is needed for --prompt, and only nice to have for printing tokens.
    let tokenizer = Tokenizer::from_model(&model);
    let Some(tokens) = prompt_tokens(&req.tokens, &req.prompt, &tokenizer, "trace")? else {
        bail!("trace: give --tokens or --prompt");
    };
    check_tokens(&tokens, &weights, &model)?;
    let filter = HookFilter {
        layers: layers(req, hp)?,
        globs: req.hook.clone(),
    };
    let mut sink = TraceSink::new(filter);
    let plan = Plan::for_sink(&weights, &sink)?;
    let (engine, _) = crate::engine::cpu::device::reference_engine(&weights, tokens.len(), None)?;
    let summary = driver::run_from(&engine, &weights, &tokens, &plan, &[], &mut sink, progress)?;
    if summary.hooks_recorded == 0 {
        let layers =
            (req.layers.as_ref()).map_or("all".to_string(), |r| format!("{}..{}", r.start, r.end));
        let hooks = if req.hook.is_empty() {
            "(all)".to_string()
        } else {
            req.hook.join(" ")
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
        extra: BTreeMap::from([(
            crate::trace::digest::KEY_MODEL_DIGEST.to_string(),
            crate::trace::digest::model_digest(&model)?,
        )]),
    };
    write_trace(&req.out, sink.tensors(), &meta)?;
    let next = match sink.tensors().get("logits") {
        Some(logits) => next_tokens(logits, tokenizer.as_ref().ok())?,
        None => None,
    };
    Ok(Traced {
        hooks: summary.hooks_recorded,
        tokens: tokens.len(),
        layers: (summary.n_layers, hp.n_layer),
        tail: summary.tail,
        next,
    })
}

/// The [`NEXT_TOKENS`] most likely tokens after the last position of `logits` (`[T, vocab]`),
/// with that position; `None` when there is no position.
fn next_tokens(
    logits: &HostTensor,
    tok: Option<&Tokenizer>,
) -> Result<Option<(usize, Vec<NextToken>)>> {
    let values = logits.as_f32("logits")?; // [T, vocab]
    let vocab = *logits.shape.last().context("trace: logits have no shape")?;
    let t = values.len() / vocab.max(1);
    if t == 0 {
        return Ok(None);
    }
    let last = &values[(t - 1) * vocab..t * vocab];
    let next = top_next(last, NEXT_TOKENS)
        .into_iter()
        .map(|(id, logit, logprob)| NextToken {
            id,
            text: tok.and_then(|k| token_label(k, id as u32)),
            logit,
            logprob,
        })
        .collect();
    Ok(Some((t - 1, next)))
}

/// The `k` most likely next tokens given the logits of one position (ties: lower id first):
/// (id, logit, log softmax over the whole vocabulary in f64).
pub fn top_next(logits: &[f32], k: usize) -> Vec<(usize, f32, f64)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    top_k(logits, k)
        .into_iter()
        .map(|i| (i, logits[i], logits[i] as f64 - lse))
        .collect()
}

/// Refuses an empty prompt and an id outside the vocabulary.
fn check_tokens(tokens: &[u32], weights: &Weights<'_>, model: &Model) -> Result<()> {
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
    Ok(())
}

/// The layers whose hooks are kept (within the model's).
fn layers(req: &TraceRequest, hp: &HParams) -> Result<Option<Range<usize>>> {
    let Some(r) = &req.layers else {
        return Ok(None);
    };
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
    Ok(Some(r.start as usize..r.end as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_next_is_log_softmax_by_hand() {
        // logits [0, ln 3]: softmax = [1/4, 3/4].
        let l = [0.0f32, 3f32.ln()];
        let t = top_next(&l, 2);
        assert_eq!(t[0].0, 1);
        assert!((t[0].2 - 0.75f64.ln()).abs() < 1e-7);
        assert!((t[1].2 - 0.25f64.ln()).abs() < 1e-7);
    }
}
