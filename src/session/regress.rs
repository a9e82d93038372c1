//! `regress`: each case of a suite run as `glmdiff run` would run it (the same request, the
//! same pipeline), then its expectations checked; the facts, the run and its wall time returned.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;

use super::CACHE_NOT_WRITTEN;
use super::{run, HookOptions, Ran, RunConfig, RunRequest, Watch};
use crate::regress::{Case, CaseFacts, Input};

/// The reference cache every case of a run uses (`regress --cache-dir`, `--no-cache`).
#[derive(Clone, Debug, Default)]
pub struct CacheChoice {
    /// The cache directory (the default one when `None`).
    pub dir: Option<PathBuf>,
    /// No cache at all.
    pub off: bool,
}

/// One case's run.
pub struct CaseRun {
    /// What it came to: the `regress` object of its record.
    pub facts: CaseFacts,
    /// The run, when it got that far.
    pub ran: Option<Ran>,
    /// Its wall time, seconds (the run alone).
    pub seconds: f64,
}

/// The run a case asks for, as plain values (the suite's words are checked when it is read).
pub fn request(case: &Case, cache: &CacheChoice) -> Result<RunRequest> {
    let (prompt, tokens) = match &case.input {
        Input::Prompt(p) => (Some(p.clone()), None),
        Input::Tokens(t) => (None, Some(t.clone())),
        Input::FromTrace => (None, None),
    };
    Ok(RunRequest {
        model: case.model.clone(),
        prompt,
        tokens,
        layers: case.layers.clone(),
        against: case.against.clone(),
        devices: Vec::new(),
        mode: case.mode,
        dtype: case.dtype,
        inject: Vec::new(),
        explain: false,
        repro: None,
        hooks: HookOptions {
            hook: case.hook.clone(),
            tol: case.tol.clone(),
            precision: case.precision.clone(),
        },
        cache_dir: cache.dir.clone(),
        no_cache: cache.off,
    })
}

/// Runs case `index` of the suite `suite` as `glmdiff run` would, then checks its
/// expectations. A run that fails is a case in error, not an error: the suite goes on. A cache
/// note is said at once through `watch` (there is no run report to carry it).
pub fn run_case(
    suite: &Path,
    index: usize,
    case: &Case,
    cache: &CacheChoice,
    watch: &Watch<'_>,
) -> CaseRun {
    let t0 = Instant::now();
    let ran = request(case, cache)
        .and_then(RunConfig::check)
        .and_then(|cfg| run(&cfg, watch));
    let seconds = t0.elapsed().as_secs_f64();
    match ran {
        Err(e) => CaseRun {
            facts: CaseFacts::not_run(suite, index, case, format!("{e:#}")),
            ran: None,
            seconds,
        },
        Ok(ran) => {
            if let Some(n) = ran
                .header
                .cache
                .as_deref()
                .filter(|n| n.starts_with(CACHE_NOT_WRITTEN))
            {
                (watch.say)(&format!("note: case {}: {n}", case.name));
            }
            let tokens: Vec<u32> = ran.header.tokens.iter().map(|(id, _)| *id).collect();
            let facts = CaseFacts::ran(suite, index, case, &tokens, &ran.comparison);
            CaseRun {
                facts,
                ran: Some(ran),
                seconds,
            }
        }
    }
}

/// Checks, before any case runs, that every `expect_divergence` names a hook its case's run
/// can produce (a hook of the model's plan over the case's layers): one that names none can
/// never be met, so the suite is bad (exit 2), not the case failed.
pub fn check_expectations(suite: &Path, cases: &[(usize, &Case)]) -> Result<()> {
    for (_, case) in cases {
        let Some(hook) = &case.expect.divergence else {
            continue;
        };
        let model = crate::gguf::Model::open(&case.model)?;
        let weights = crate::model::Weights::new(&model)?;
        let hp = weights.hparams();
        let layers = case.layers.as_ref().map_or(0..hp.n_layer, |r| {
            r.start as usize..(r.end as usize).min(hp.n_layer)
        });
        let tail = layers.end == hp.n_layer;
        let plan = crate::driver::Plan::range(&weights, layers.clone(), tail)?;
        if !super::config::plan_hooks(&plan, hp)
            .iter()
            .any(|h| h == hook)
        {
            anyhow::bail!(
                "regress: {}: case {:?}: expect_divergence = {hook:?} names no hook its run produces ({}, layers {}..{} of {}: blk.L.<point>, token_embd, result_norm, logits, e.g. \"blk.{}.attn_heads\")",
                suite.display(),
                case.name,
                case.model.display(),
                layers.start,
                layers.end,
                hp.n_layer,
                layers.start
            );
        }
    }
    Ok(())
}
