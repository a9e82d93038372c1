//! One run: the reference's prefix, the one pass over the reference and the candidate,
//! `--explain` and `--repro` at the first step that fails in replay, the header, and the command
//! that re-runs the first divergent layer.

use std::time::Instant;

use anyhow::{bail, Result};

use super::candidate::compare_candidate;
use super::config::{Chosen, RunConfig};
use super::pass::Pass;
use super::prefix::prefix;
use super::tokens::token_text;
use super::{Ran, Watch};
use crate::compare::judge::precision_of;
use crate::compare::{Comparison, Status};
use crate::engine::cpu::device::{reference_engine, CHECK_QUERIES, MIN_QUERIES};
use crate::engine::cpu::CpuEngine;
use crate::engine::Engine;
use crate::explain::case::{self, CaseMeta};
use crate::explain::{explain, CapturedStep, Explanation};
use crate::model::Weights;
use crate::report::run::{EngineDesc, Header};
use crate::trace::Mode;
use crate::util::shell::shell_word;

/// Runs a checked run: the reference (from its prefix, see [`super::prefix`]) and the candidate
/// over the configured steps, then `--explain` and `--repro`; returns the comparison and the
/// facts for its header.
pub fn run(cfg: &RunConfig, watch: &Watch<'_>) -> Result<Ran> {
    let weights = cfg.weights()?;
    let candidate_device = match &cfg.candidate {
        Chosen::Cuda { device, .. } => Some(*device),
        _ => None,
    };
    let (reference, device_note) = reference_engine(&weights, cfg.tokens.len(), candidate_device)?;
    let start = prefix(cfg, &weights, &reference, watch)?;
    let pass = Pass {
        cfg,
        weights: &weights,
        reference: &reference,
        ref_precision: reference.precision(),
        start: &start.values,
        progress: watch.layers,
    };
    let passed = compare_candidate(&pass)?;
    let mut timings: Vec<(String, f64)> = start.timing.into_iter().collect();
    timings.push(("compared".to_string(), passed.seconds));
    // Waits of 5 ms or more (what the text's two decimals show).
    for (why, s) in passed.compare_waits.iter().filter(|w| w.1 >= 0.005) {
        timings.push((why.clone(), *s));
    }
    let cmp = passed.comparison;
    if cmp.records().is_empty() {
        bail!(
            "run: no hook matched --hook {}; hook names are blk.L.<point>, token_embd, result_norm, logits",
            cfg.hook.join(" ")
        );
    }
    if let (Chosen::Trace { file, .. }, false) = (&cfg.candidate, compared_any(&cmp)) {
        bail!(
            "run: no hook of the trace {} matches the run's {} hooks (its hooks are named as `glmdiff trace` names them: blk.L.<point>, token_embd, result_norm, logits); rename them with `glmdiff compare --map` or the hook script",
            file.path().display(),
            cmp.records().len()
        );
    }
    let t0 = Instant::now();
    let explanation = explanation(cfg, &weights, &cmp, &passed.captured, watch)?;
    if explanation.is_some() {
        timings.push(("explained".to_string(), t0.elapsed().as_secs_f64()));
    }
    let meta = CaseMeta {
        model: cfg.model_path.display().to_string(),
        tokens: cfg.tokens.clone(),
        candidate: passed.candidate.spec.clone(),
        candidate_describe: passed.candidate.describe.clone(),
        // The precision the run judged by, in words `step` reads back (a trace's own dtype
        // when it names one, else what was inferred or set by --precision '*=DTYPE').
        candidate_dtype: match precision_of(&passed.candidate.dtype) {
            Some(_) => passed.candidate.dtype.clone(),
            None => cmp.judge().candidate().to_string(),
        },
        reference_dtype: reference.precision().to_string(),
    };
    let repro = repro(cfg, &weights, &passed.captured, &meta)?;
    let mut notes = cfg.notes.clone();
    notes.extend(passed.notes);
    notes.extend(device_note);
    notes.extend(device_work_note(&reference));
    let header = Header {
        command: "run".into(),
        model: cfg.model_path.display().to_string(),
        architecture: weights.hparams().arch.as_str().to_string(),
        layers: Some((cfg.layers.start, cfg.layers.end, weights.hparams().n_layer)),
        tokens: (cfg.tokens.iter())
            .map(|&id| (id, token_text(cfg.tokenizer(), id)))
            .collect(),
        reference: EngineDesc {
            spec: "cpu".into(),
            describe: reference.describe(),
            dtype: reference.precision().to_string(),
        },
        rerun: rerun(cfg, &cmp, &passed.candidate.spec),
        candidate: passed.candidate,
        modes: cfg.mode.list(),
        notes,
        cache: start.note,
        timings,
        layer_times: passed.layer_times,
        compare_times: passed.compare_times,
        reference_times: passed.reference_times,
        candidate_times: passed.candidate_times,
        candidate_beyond_times: passed.candidate_beyond_times,
        reference_work: Some(passed.reference_work),
        explanation,
        repro,
    };
    Ok(Ran {
        header,
        comparison: cmp,
    })
}

/// What the reference's device did, in a note (`None` when it made no product).
pub(super) fn device_work_note(reference: &CpuEngine<'_>) -> Option<String> {
    let d = reference.device()?;
    let w = d.work();
    if let Some(why) = d.set_aside() {
        return Some(format!(
            "the reference's products went back to the CPU after {} on {}: {why}",
            w.products,
            d.describe()
        ));
    }
    if w.products == 0 && w.attentions == 0 && w.index_scores == 0 && w.refused == 0 {
        return None;
    }
    // The attentions' time and kernels are part of the device's totals.
    let attentions = if w.attentions > 0 {
        format!(
            " and {} attentions of {MIN_QUERIES} query rows or more ({} rows: scores and weighted sums there, softmax here, each checked at {CHECK_QUERIES} rows; {:.2} s of the time)",
            w.attentions, w.attention_rows, w.attention_seconds
        )
    } else {
        String::new()
    };
    let index = if w.index_scores > 0 {
        format!(
            " and {} DSA index score sets ({} query rows, each set checked at {CHECK_QUERIES} rows; {:.2} s of the time)",
            w.index_scores, w.index_rows, w.index_seconds
        )
    } else {
        String::new()
    };
    if d.reuse_only {
        return Some(format!(
            "the reference's products with the CUDA candidate's routed experts ran on {} from the CUDA candidate's device bytes of them: {} products, {:.3} T multiply-adds, {:.2} GB of those bytes proven to be the file's by their hash ({:.2} s), in {:.2} s ({:.2} s in the kernels), {} of their elements checked on the CPU, all the same bits; {} products ({:.3} T multiply-adds) on the CPU{}",
            d.describe(),
            w.reused,
            w.multiply_adds / 1e12,
            w.reused_bytes as f64 / 1e9,
            w.hash_seconds,
            w.seconds,
            w.kernel_seconds,
            w.checked,
            w.on_cpu,
            w.on_cpu_multiply_adds / 1e12,
            refused(d, &w)
        ));
    }
    let reused = if w.reused > 0 || w.refused > 0 {
        format!(
            ", {} of them (of any token count) from the CUDA candidate's device bytes of its routed experts, {:.2} GB of them proven to be the file's by their hash ({:.2} s){}",
            w.reused,
            w.reused_bytes as f64 / 1e9,
            w.hash_seconds,
            refused(d, &w)
        )
    } else {
        String::new()
    };
    Some(format!(
        "the reference's products of {} tokens or more ran on {}: {} products ({} of them packed in pinned memory by their threads before their turn{reused}), {:.3} T multiply-adds{attentions}{index}, in {:.2} s ({:.2} s in the kernels: {}; the products' {:.2} s staging and copying their values to it, {:.2} s waiting for another's turn), {} of their elements checked on the CPU, all the same bits; {} products of fewer tokens ({:.3} T multiply-adds) on the CPU",
        d.min_tokens,
        d.describe(),
        w.products,
        w.packed,
        w.multiply_adds / 1e12,
        w.seconds,
        w.kernel_seconds,
        d.kernels(),
        w.upload_seconds,
        w.wait_seconds,
        w.checked,
        w.on_cpu,
        w.on_cpu_multiply_adds / 1e12
    ))
}

/// The note's clause on the spans of the CUDA candidate's device bytes the reference refused
/// (their hash differed from the file's), empty when none was.
fn refused(
    d: &crate::engine::cpu::device::Device,
    w: &crate::engine::cpu::device::DeviceWork,
) -> String {
    match d.refusal() {
        Some(first) => format!(
            "; {} spans of the candidate's device bytes differed from the file and were not used (their products made on the CPU): {first}",
            w.refused
        ),
        None => String::new(),
    }
}

/// Whether any hook of `cmp` was compared in some mode (not only listed as missing).
fn compared_any(cmp: &Comparison) -> bool {
    cmp.records().iter().any(|r| {
        [&r.replay, &r.chained]
            .iter()
            .any(|m| m.as_ref().is_some_and(|m| m.status != Status::Missing))
    })
}

/// What `--explain` found at the first step that fails in replay (`None` without it).
fn explanation(
    cfg: &RunConfig,
    weights: &Weights<'_>,
    cmp: &Comparison,
    captured: &Option<CapturedStep>,
    watch: &Watch<'_>,
) -> Result<Option<Explanation>> {
    if !cfg.explain {
        return Ok(None);
    }
    Ok(Some(match (cmp.first_divergence(Mode::Replay), captured) {
        (None, _) => Explanation::NothingWrong,
        (Some(r), None) => Explanation::NotCaptured {
            note: format!(
                "{} fails, but the inputs of its step were not at hand (a step replay could not run)",
                r.name
            ),
        },
        (Some(_), Some(c)) => explain(c, weights, &cfg.tokens, watch.hypotheses)?,
    }))
}

/// Writes the captured step as a case for `glmdiff step` (`--repro`); what was done.
fn repro(
    cfg: &RunConfig,
    weights: &Weights<'_>,
    captured: &Option<CapturedStep>,
    meta: &CaseMeta,
) -> Result<Option<String>> {
    Ok(match (&cfg.repro, captured) {
        (Some(dir), Some(c)) => {
            case::write(dir, c, weights, meta)?;
            Some(format!(
                "--repro: the step of {} written to {}; re-run it with: glmdiff step {} [--against cpu|cuda]",
                c.hook,
                dir.display(),
                shell_word(&dir.display().to_string())
            ))
        }
        (Some(_), None) => Some("--repro: no step fails in replay; no case written".to_string()),
        (None, _) => None,
    })
}

/// The command that re-runs the layer of the first divergence (replay, else chained), with
/// the faults that touch it, when there is one.
fn rerun(cfg: &RunConfig, cmp: &Comparison, spec: &str) -> Option<String> {
    let first = cmp
        .first_divergence(Mode::Replay)
        .or(cmp.first_divergence(Mode::Chained));
    let l = first.and_then(|r| r.layer)?;
    let ids: Vec<String> = cfg.tokens.iter().map(u32::to_string).collect();
    let injected: String = (cfg.faults.iter())
        .filter(|f| f.layers.is_none() || f.at(Some(l)))
        .map(|f| format!(" --inject {}", shell_word(&f.to_string())))
        .collect();
    let hooks: String = (cfg.hook.iter())
        .map(|g| format!(" --hook {}", shell_word(g)))
        .collect();
    Some(format!(
        "glmdiff run {} --tokens {} --layer {l} --against {} --mode {}{hooks}{injected}",
        shell_word(&cfg.model_path.display().to_string()),
        ids.join(","),
        shell_word(spec),
        cfg.mode,
    ))
}
