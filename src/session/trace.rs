//! `glmdiff trace`: the CPU reference's forward pass with its hooks (those asked) written to a
//! safetensors trace.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Result};

use super::tokens::prompt_tokens;
use crate::driver::{self, Plan};
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, HostTensor};
use crate::gguf::Model;
use crate::model::{HParams, Weights};
use crate::tokenizer::Tokenizer;
use crate::trace::{write_trace, HookFilter, TraceMeta, TraceSink};
use crate::util::progress::Progress;

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
    /// The logits `[T, vocab]`, when written.
    pub logits: Option<HostTensor>,
    /// The model's tokenizer, when it has one.
    pub tokenizer: Option<Tokenizer>,
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
    let engine = CpuEngine::new(&weights);
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
        extra: BTreeMap::new(),
    };
    write_trace(&req.out, sink.tensors(), &meta)?;
    Ok(Traced {
        hooks: summary.hooks_recorded,
        tokens: tokens.len(),
        layers: (summary.n_layers, hp.n_layer),
        tail: summary.tail,
        logits: sink.tensors().get("logits").cloned(),
        tokenizer: tokenizer.ok(),
    })
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
