//! Two traces hook by hook (`glmdiff compare`): the first is the reference, the second the
//! candidate, whose hooks a `--map` file may rename to glmdiff's names. Each hook is compared as
//! it stands (chained: each trace holds its own engine's accumulated values). With `--model`
//! the floors and flip margins are `run`'s: reduction lengths and quant types per hook, the
//! selection bias and the expert groups, read from the GGUF.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::candidate::trace_desc;
use super::config::{check_globs, HookOptions};
use super::judge::{model_facts, overrides_with_trace, trace_side_precision, wants_with_scores};
use super::Ran;
use crate::compare::floors::point_of;
use crate::compare::graph::{order_key, upstream};
use crate::compare::{Comparison, Judge, JudgeSpec, ModelFacts};
use crate::report::run::Header;
use crate::trace::{Mode, Pair, PairSink, TraceFile};
use crate::util::progress::Progress;

/// What `compare` is asked, as plain values.
#[derive(Clone, Debug)]
pub struct CompareRequest {
    /// The reference trace.
    pub reference: PathBuf,
    /// The candidate trace.
    pub candidate: PathBuf,
    /// A JSON object or TOML table from the candidate's hook names to glmdiff's.
    pub map: Option<PathBuf>,
    /// The traces' model: floors by step and flip margins as `run` has them.
    pub model: Option<PathBuf>,
    /// Hooks, floors and precisions.
    pub hooks: HookOptions,
}

/// Compares the candidate trace with the reference trace hook by hook; `progress` counts hooks.
pub fn compare(req: &CompareRequest, progress: &dyn Progress) -> Result<Ran> {
    let reference = TraceFile::open(&req.reference)?;
    let candidate = TraceFile::open(&req.candidate)?;
    let (rt, ct) = (reference.tokens(), candidate.tokens());
    if let (Ok(a), Ok(b)) = (&rt, &ct) {
        if a != b {
            bail!(
                "compare: the traces were made for different tokens: {} has {:?}, {} has {:?}",
                req.reference.display(),
                a,
                req.candidate.display(),
                b
            );
        }
    }
    let tokens = rt.unwrap_or_default();
    // Candidate name -> glmdiff name.
    let map = match &req.map {
        Some(p) => read_map(p)?,
        None => HashMap::new(),
    };
    if let Some(p) = &req.map {
        let mut unused: Vec<&String> = map
            .keys()
            .filter(|k| candidate.names().all(|n| n != k.as_str()))
            .collect();
        unused.sort();
        if !map.is_empty() && unused.len() == map.len() {
            bail!(
                "compare: --map {}: none of its {} names is a hook of the candidate {} (e.g. {:?}; the candidate has {} hooks, e.g. {:?})",
                p.display(),
                map.len(),
                req.candidate.display(),
                unused[0],
                candidate.names().count(),
                candidate.names().next().unwrap_or("")
            );
        }
    }
    let cand_names: HashMap<String, String> = candidate
        .names()
        .map(|n| {
            (
                map.get(n).cloned().unwrap_or_else(|| n.to_string()),
                n.to_string(),
            )
        })
        .collect();
    let mut notes = Vec::new();
    let judge = traces_judge(req, &reference, &candidate, &mut notes)?;
    let mut names: Vec<String> = reference.names().map(str::to_string).collect();
    names.sort_by_key(|n| order_key(n));
    check_globs(
        "compare",
        &format!("the reference trace {}", req.reference.display()),
        &names,
        &req.hooks,
    )?;
    check_pairs(req, &reference, &candidate, &names, &cand_names)?;
    let mut cmp = Comparison::new(judge, wants_with_scores(&req.hooks.hook), &tokens);
    compare_hooks(
        &mut cmp,
        &reference,
        &candidate,
        &names,
        &cand_names,
        progress,
    )?;
    if cmp.records().is_empty() {
        bail!("compare: no hook of {} matched", req.reference.display());
    }
    let header = Header {
        command: "compare".into(),
        model: reference
            .metadata()
            .get("model")
            .cloned()
            .unwrap_or_else(|| req.reference.display().to_string()),
        architecture: reference
            .metadata()
            .get("architecture")
            .cloned()
            .unwrap_or_else(|| "?".into()),
        layers: None,
        tokens: tokens.iter().map(|&id| (id, String::new())).collect(),
        reference: trace_desc(req.reference.display().to_string(), &reference),
        candidate: trace_desc(req.candidate.display().to_string(), &candidate),
        modes: vec![Mode::Chained],
        notes,
        ..Header::default()
    };
    Ok(Ran {
        header,
        comparison: cmp,
    })
}

/// The judge of two traces: each side's declared (or inferred) precision, the overrides
/// (`--precision`, then the candidate's own, said in `notes`), and with `model` the floors by
/// step, the selection bias and the expert groups of `run` (without it, a note says what the
/// floors and margins lack).
fn traces_judge(
    req: &CompareRequest,
    reference: &TraceFile,
    candidate: &TraceFile,
    notes: &mut Vec<String>,
) -> Result<Judge> {
    let flags = req.hooks.precision.clone();
    let reference_precision = trace_side_precision(reference, "reference trace", &[], notes)?;
    let candidate_precision = trace_side_precision(candidate, "candidate trace", &flags, notes)?;
    let precision = overrides_with_trace(&flags, Some(candidate), notes)?;
    let model = match &req.model {
        None => {
            notes.push(
                "without --model the floors take every reduction length as 8192 and no weight as quantized, and expert flips' margins ignore the selection bias (exp_probs_b) and expert groups; --model FILE.gguf reads them as run does".to_string(),
            );
            None
        }
        Some(path) => Some(traces_model(req, path, reference, candidate)?),
    };
    Judge::new(JudgeSpec {
        reference: reference_precision,
        candidate: candidate_precision,
        tol: req.hooks.tol.clone(),
        precision,
        model,
        engine_candidate: false,
        positions: reference.tokens().map_or(0, |t| t.len()),
    })
}

/// What `--model` tells the judge of two traces: the floors by step, the selection bias and
/// the expert groups of `run`; an error when it is another architecture than the reference
/// trace's, or another model's dimensions than either trace's.
fn traces_model(
    req: &CompareRequest,
    path: &std::path::Path,
    reference: &TraceFile,
    candidate: &TraceFile,
) -> Result<ModelFacts> {
    let model = crate::gguf::Model::open(path)?;
    let weights = crate::model::Weights::new(&model)?;
    let arch = weights.hparams().arch.as_str();
    if let Some(a) = reference.metadata().get("architecture") {
        if a != arch {
            bail!(
                "compare: --model {} is a {arch} model; the reference trace {} was made by a {a} one",
                path.display(),
                req.reference.display()
            );
        }
    }
    // Both traces must be of this model's dimensions (hook shapes, selection widths aside),
    // as `run` checks a trace against its model; the candidate under glmdiff's names only
    // (with --map its own names are the map's business).
    let mut sides = vec![reference];
    if req.map.is_none() {
        sides.push(candidate);
    } else {
        // Under its own names the candidate still says which model file it was made from.
        crate::trace::digest::check_model_digest(candidate.path(), candidate.metadata(), &model)
            .with_context(|| format!("compare: --model {}", path.display()))?;
    }
    for t in sides {
        if let Ok(tokens) = t.tokens() {
            crate::trace::check::check_against_model(t, &weights, &tokens)
                .with_context(|| format!("compare: --model {}", path.display()))?;
        }
    }
    let plan = crate::driver::Plan::full(&weights)?;
    model_facts(&weights, &plan.steps, Some(&plan))
}

/// Refuses a comparison in which no wanted hook of the reference has a candidate, and checks
/// the pairs that do (shapes, tokens).
fn check_pairs(
    req: &CompareRequest,
    reference: &TraceFile,
    candidate: &TraceFile,
    names: &[String],
    cand_names: &HashMap<String, String>,
) -> Result<()> {
    let wanted = wants_with_scores(&req.hooks.hook);
    let pairs: Vec<(String, String)> = names
        .iter()
        .filter(|n| wanted(n))
        .filter_map(|n| cand_names.get(n).map(|c| (n.clone(), c.clone())))
        .collect();
    if pairs.is_empty() {
        bail!(
            "compare: no hook of {} matches {} ({} of its hooks compared, none under those names in the candidate); rename the candidate's hooks with --map FILE (a JSON object or TOML table of their names to glmdiff's)",
            req.candidate.display(),
            req.reference.display(),
            names.iter().filter(|n| wanted(n)).count()
        );
    }
    crate::trace::check::check_pair(reference, candidate, &pairs)
}

/// Records every wanted hook of `names` (the reference's, in order) into `cmp`: against the
/// candidate's hook of that name, or missing.
fn compare_hooks(
    cmp: &mut Comparison,
    reference: &TraceFile,
    candidate: &TraceFile,
    names: &[String],
    cand_names: &HashMap<String, String>,
    progress: &dyn Progress,
) -> Result<()> {
    let last_l_out = names
        .iter()
        .rev()
        .find(|n| point_of(n) == "l_out")
        .cloned()
        .unwrap_or_default();
    let present = |n: &str| reference.has(n);
    progress.start("compare", names.len() as u64);
    for n in names {
        progress.inc(1);
        if !cmp.wants(n) {
            continue;
        }
        let inputs = upstream(n, &present, &last_l_out);
        let r = reference.get(n)?.context("compare: hook vanished")?;
        match cand_names.get(n) {
            None => {
                // The reference's value stands for what the hook carries downstream, and a
                // selection the candidate lacks may differ wherever it has a near tie.
                cmp.reference_only(n, Mode::Chained, &inputs, &r);
                if matches!(point_of(n), "indexer_topk" | "moe_topk_ids") {
                    cmp.unfollowed_near_ties(n, &r);
                }
                cmp.missing(n, Mode::Chained, "not in the candidate trace");
            }
            Some(cn) => {
                let c = candidate.get(cn)?.context("compare: hook vanished")?;
                cmp.record(Pair {
                    name: n,
                    mode: Mode::Chained,
                    inputs: &inputs,
                    reference: r,
                    candidate: c,
                    note: None,
                })?;
            }
        }
    }
    progress.finish();
    Ok(())
}

/// Reads a `--map` file: a JSON object or a TOML table from the candidate's names to glmdiff's
/// (`.toml` is read as TOML, `.json` as JSON, anything else as whichever parses). Two names
/// mapped to one hook are refused.
pub fn read_map(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("compare: cannot read --map {}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let json = || serde_json::from_str::<std::collections::BTreeMap<String, String>>(&text);
    let toml = || toml::from_str::<std::collections::BTreeMap<String, String>>(&text);
    let map = match ext {
        "json" => json().map_err(|e| anyhow::anyhow!("{e}")),
        "toml" => toml().map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end())),
        _ => json().or_else(|je| {
            toml().map_err(|te| {
                anyhow::anyhow!("as JSON: {je}; as TOML: {}", te.to_string().trim_end())
            })
        }),
    }
    .with_context(|| {
        format!(
            "compare: --map {} is not a {} of names to names (e.g. {})",
            path.display(),
            match ext {
                "json" => "JSON object",
                "toml" => "TOML table",
                _ => "JSON object or TOML table",
            },
            match ext {
                "toml" => r#""layers.0.self_attn.q_a_proj" = "blk.0.q_a""#,
                _ => r#"{"layers.0.self_attn.q_a_proj": "blk.0.q_a"}"#,
            }
        )
    })?;
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for (from, to) in &map {
        if let Some(other) = seen.insert(to.as_str(), from.as_str()) {
            bail!(
                "compare: --map {}: {other:?} and {from:?} are both mapped to {to:?}",
                path.display()
            );
        }
    }
    Ok(map.into_iter().collect())
}
