//! Checks of a trace against what it is compared with, before anything runs: a trace of another
//! architecture, of another model's dimensions, of another prompt length than its `tokens`
//! metadata says, or with a hook of the wrong kind (floats where ids belong) is an input error
//! naming the trace, the hook or key and both values, never a row of differences.

use std::path::Path;

use anyhow::{bail, Result};

use super::file::TraceFile;
use crate::model::hook_shape::{hook_shape, other_selection_width};
use crate::model::names::split_blk;
use crate::model::steps::point;
use crate::model::Weights;

/// The dtypes a hook of each kind may be stored in.
fn kind(ids: bool) -> &'static str {
    if ids {
        "integer ids (I32 or I64)"
    } else {
        "floats (F32, F64, F16 or BF16)"
    }
}

/// Checks trace `t` against the model of `weights` for a run over `tokens`: its `architecture`
/// metadata (when present) is the model's, its `model_digest` (when present) the model file's
/// ([`super::digest::check_model_digest`]), every hook of the model's forward pass it holds is
/// of a run layer and has the shape and kind the model gives it for that many tokens (a
/// selection hook of another width excepted: `model::hook_shape::other_selection_width`, judged
/// at the hook as a finding; its `moe_weights` must then be as wide as its `moe_topk_ids`). The
/// first hook whose only difference is its number of rows is reported as a disagreement with
/// the `tokens` metadata. The trace is said to be of another model's dimensions only when
/// `token_embd` disagrees or at least as many hooks disagree as match; otherwise the error
/// names the hook (or the few hooks) of the wrong shape, with both shapes.
pub fn check_against_model(t: &TraceFile, weights: &Weights<'_>, tokens: &[u32]) -> Result<()> {
    let hp = weights.hparams();
    let path = t.path().display();
    let model = weights.model().path().display();
    if let Some(a) = t.metadata().get("architecture").filter(|a| !a.is_empty()) {
        if a != hp.arch.as_str() {
            bail!(
                "trace: {path}: this trace is of architecture {a} (metadata architecture), the model {model} is {}",
                hp.arch.as_str()
            );
        }
    }
    super::digest::check_model_digest(t.path(), t.metadata(), weights.model())?;
    let n = tokens.len();
    // Hooks whose shape the model does not give them: (name, shape, dtype, wanted).
    let mut bad: Vec<(String, String)> = Vec::new();
    let mut embd_bad = false;
    let mut matched = 0usize;
    let mut kind_bad = None;
    for name in t.names() {
        let Some(want) = hook_shape(hp, weights.n_vocab(), n, name) else {
            continue;
        };
        let Some((shape, dtype)) = t.hook_header(name) else {
            continue;
        };
        if let Some((l, _)) = split_blk(name).filter(|(l, _)| *l >= hp.n_layer) {
            bail!(
                "trace: {path}: hook {name} is of layer {l}, but the model {model} runs layers 0..{} ({} blocks, {} MTP not run): this trace is of another model",
                hp.n_layer,
                hp.n_block,
                hp.n_nextn
            );
        }
        // A selection of another width (7 keys kept where the model says 8, 3 experts routed
        // where it says 2) is what the engine computed: judged at the hook, not refused here.
        let other_width = other_selection_width(name, &want, shape, n).is_some();
        if !want.fits(shape, n) && !other_width {
            if want.fits_but_tokens(shape) {
                bail!(
                    "trace: {path}: its tokens metadata lists {n} tokens, but hook {name} has shape {shape:?} (the model gives {} for {n} tokens)",
                    want.show(n)
                );
            }
            embd_bad |= name == point::TOKEN_EMBD;
            bad.push((
                name.to_string(),
                format!(
                    "hook {name} has shape {shape:?} ({dtype}), but the model {model} gives it {} for {n} tokens",
                    want.show(n)
                ),
            ));
        } else {
            matched += 1;
            if t.holds_ints(name) != Some(want.ids) {
                kind_bad.get_or_insert_with(|| {
                    format!(
                        "trace: {path}: hook {name} is stored as {dtype}, but it must hold {}",
                        kind(want.ids)
                    )
                });
            }
        }
    }
    if let Some((_, first)) = bad.first() {
        // Another model only when its core dimensions differ: the embedding width, or many
        // hooks at once; one or two hooks of odd shapes among matching ones are those hooks.
        if embd_bad || (bad.len() > 1 && bad.len() >= matched) {
            bail!(
                "trace: {path}: {first}: this trace is of another model's dimensions ({} of its {} hooks disagree)",
                bad.len(),
                bad.len() + matched
            );
        }
        let more = match bad.len() {
            1 => String::new(),
            k => format!(
                "; {} more hooks disagree too ({})",
                k - 1,
                bad[1..]
                    .iter()
                    .map(|(name, _)| name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        bail!(
            "trace: {path}: {first}{more}; the trace's other {matched} hooks match the model (this hook was written with a wrong shape)"
        );
    }
    if let Some(msg) = kind_bad {
        bail!("{msg}");
    }
    check_expert_widths(t, hp.n_layer)?;
    check_selection_ids(t, hp.n_layer, hp.n_expert, n)
}

/// Checks that every id of the selection hooks names something the model has: an expert below
/// `n_expert` in `moe_topk_ids`, a key at or before its own row's token (or -1, padding) in
/// `indexer_topk`, so that an id out of range is the trace's error, named with its file, hook,
/// row and value, not a run that stops inside an engine or a verdict on garbage.
fn check_selection_ids(
    t: &TraceFile,
    n_layer: usize,
    n_expert: usize,
    n_tokens: usize,
) -> Result<()> {
    for l in 0..n_layer {
        for p in [point::MOE_TOPK_IDS, point::INDEXER_TOPK] {
            let name = crate::model::names::blk(l, p);
            let Some(h) = t.get(&name)? else { continue };
            let Ok(ids) = h.as_i32(&name) else { continue };
            let width = h.shape.last().copied().unwrap_or(1).max(1);
            for (i, &id) in ids.iter().enumerate() {
                let row = i / width;
                let (ok, range) = if p == point::MOE_TOPK_IDS {
                    (
                        id >= 0 && (id as usize) < n_expert,
                        format!("0..{n_expert} (the model's experts)"),
                    )
                } else {
                    let last = row.min(n_tokens.saturating_sub(1));
                    (
                        id == -1 || (id >= 0 && id as usize <= last),
                        format!("-1 (padding) or 0..={last} (the keys up to its own token)"),
                    )
                };
                if !ok {
                    bail!(
                        "trace: {}: hook {name}: row {row} (token {row}) holds id {id}, outside {range}: this hook was written wrong or belongs to another model",
                        t.path().display()
                    );
                }
            }
        }
    }
    Ok(())
}

/// Checks that each layer's `moe_weights` has as many columns as its `moe_topk_ids` where the
/// trace holds both: the weights are those of the experts kept, whatever their number.
fn check_expert_widths(t: &TraceFile, n_layer: usize) -> Result<()> {
    for l in 0..n_layer {
        let ids = crate::model::names::blk(l, point::MOE_TOPK_IDS);
        let w = crate::model::names::blk(l, point::MOE_WEIGHTS);
        let (Some((si, _)), Some((sw, _))) = (t.hook_header(&ids), t.hook_header(&w)) else {
            continue;
        };
        if si.last() != sw.last() {
            bail!(
                "trace: {}: hook {w} has shape {sw:?}, but {ids} has shape {si:?}: the expert weights must be as many as the experts kept (this hook was written with a wrong shape)",
                t.path().display()
            );
        }
    }
    Ok(())
}

/// Whether the first dimension of hook `name` is the token count (every standard hook but the
/// attention probabilities and the per-expert outputs).
fn rows_are_tokens(name: &str) -> bool {
    match split_blk(name) {
        Some((_, p)) => point::LAYER.contains(&p),
        None => [point::TOKEN_EMBD, point::RESULT_NORM, point::LOGITS].contains(&name),
    }
}

/// Checks that two traces can be compared hook by hook (`glmdiff compare`): the same
/// `architecture` metadata when both have one, each trace's per-token hooks with as many rows as
/// its `tokens` metadata lists, and each pair of hooks `(reference name, candidate name)` of
/// one shape and one kind.
pub fn check_pair(
    reference: &TraceFile,
    candidate: &TraceFile,
    pairs: &[(String, String)],
) -> Result<()> {
    let (rp, cp) = (reference.path(), candidate.path());
    let arch = |t: &TraceFile| {
        t.metadata()
            .get("architecture")
            .filter(|a| !a.is_empty())
            .cloned()
    };
    if let (Some(a), Some(b)) = (arch(reference), arch(candidate)) {
        if a != b {
            bail!(
                "compare: the traces are of different architectures: {} is {a}, {} is {b} (metadata architecture)",
                rp.display(),
                cp.display()
            );
        }
    }
    let rows = |t: &TraceFile, p: &Path, name: &str| -> Result<()> {
        let (Ok(tokens), Some((shape, _))) = (t.tokens(), t.hook_header(name)) else {
            return Ok(());
        };
        if rows_are_tokens(name) && shape.first() != Some(&tokens.len()) {
            bail!(
                "trace: {}: its tokens metadata lists {} tokens, but hook {name} has shape {shape:?}",
                p.display(),
                tokens.len()
            );
        }
        Ok(())
    };
    for (r, c) in pairs {
        rows(reference, rp, r)?;
        rows(candidate, cp, c)?;
        let (Some((rs, rd)), Some((cs, cd))) = (reference.hook_header(r), candidate.hook_header(c))
        else {
            continue;
        };
        let named = if r == c {
            format!("hook {r}")
        } else {
            format!("hook {r} (the candidate's {c})")
        };
        // A selection of another width (the same rows, another number kept per row) is what
        // the candidate's engine selected: the judge names it (a finding, not an input error).
        let width_only = crate::model::hook_shape::SELECTION_POINTS
            .contains(&crate::model::names::split_blk(r).map_or("", |(_, p)| p))
            && rs.len() == 2
            && cs.len() == 2
            && rs[0] == cs[0]
            && cs[1] > 0;
        if (rs != cs && !width_only) || reference.holds_ints(r) != candidate.holds_ints(c) {
            bail!(
                "compare: {named} is {rs:?} {rd} in {}, but {cs:?} {cd} in {}",
                rp.display(),
                cp.display()
            );
        }
    }
    Ok(())
}
