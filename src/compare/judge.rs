//! How a comparison is judged: the [`Judge`] (both sides' precisions, the floors of the
//! model's steps, `--tol` and precision overrides, the selection bias and expert groups), built
//! by one constructor from a checked [`JudgeSpec`], and every precision read from text: a
//! dtype word or an engine's dtype string ([`precision_of`]), `--precision` pairs, what a trace
//! declares about itself or its values say, the hooks a comparison keeps.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};

use super::floors::{flip_tolerance, floor, point_of, Dtype, HookInfo, Precision};
use crate::precision::storage_of_values;
use crate::trace::{HookFilter, Mode, TraceFile};
use crate::util::glob::matches as glob_match;

pub use crate::words::PrecisionOverride;

/// Settings of a comparison.
#[derive(Clone, Debug)]
pub struct Judge {
    /// The reference's precision.
    pub(super) reference: Precision,
    /// The candidate's precision.
    pub(super) candidate: Precision,
    /// Floor inputs per hook (from the model; hooks not listed use their point name).
    pub(super) infos: HashMap<String, HookInfo>,
    /// `--tol` overrides, in order: the first matching glob wins.
    pub(super) tol: Vec<(String, f64)>,
    /// Overrides of the candidate's precision (`--precision`, then what a trace declares), in
    /// order: the first matching glob wins.
    pub(super) precision: Vec<PrecisionOverride>,
    /// Selection bias (`exp_probs_b`) per MoE layer, added to the router probabilities when
    /// judging expert flips.
    pub(super) selection_bias: HashMap<usize, Vec<f32>>,
    /// Group-limited routing `(n_group, used)` of the model, if any (expert flips).
    pub(super) groups: Option<(usize, usize)>,
    /// The model's selection bias is not at hand (two traces compared without the model):
    /// expert flips are judged by the smallest gap a bias consistent with the reference's own
    /// selections leaves ([`super::selection::implied_bias`]).
    pub(super) bias_unknown: bool,
    /// Attention heads of the model, when known: hooks with a head axis flattened into their
    /// columns (`q_b`, `attn_heads`) are tested for one head's gain.
    pub(super) heads: Option<usize>,
    /// The candidate is an engine glmdiff runs: in replay its selections are made from the
    /// reference's scores (the step's input), not from its own.
    pub(super) engine_candidate: bool,
    /// Positions of the prompt (0: unknown): the RoPE angles' share of the floors.
    pub(super) positions: usize,
}

impl Judge {
    /// The judge `spec` describes, its overrides checked: every glob non-empty, every `--tol`
    /// floor finite and not negative.
    pub fn new(spec: JudgeSpec) -> Result<Judge> {
        for (g, v) in &spec.tol {
            if g.trim().is_empty() {
                bail!("--tol {g:?}={v}: the glob is empty");
            }
            if !v.is_finite() || *v < 0.0 {
                bail!("--tol {g}={v}: the floor must be finite and not negative");
            }
        }
        if let Some(o) = spec.precision.iter().find(|o| o.glob.trim().is_empty()) {
            bail!("{} {:?}={}: the glob is empty", o.source, o.glob, o.dtype);
        }
        let known = spec.model.is_some();
        let model = spec.model.unwrap_or_default();
        Ok(Judge {
            reference: spec.reference,
            candidate: spec.candidate,
            infos: model.infos,
            tol: spec.tol,
            precision: spec.precision,
            selection_bias: model.selection_bias,
            groups: model.groups,
            bias_unknown: !known,
            heads: model.heads,
            engine_candidate: spec.engine_candidate,
            positions: spec.positions,
        })
    }

    /// The reference's precision.
    pub fn reference(&self) -> Precision {
        self.reference
    }

    /// The candidate's precision (where no override matches).
    pub fn candidate(&self) -> Precision {
        self.candidate
    }

    /// The floor inputs of `name`, with the prompt's positions.
    pub fn info(&self, name: &str) -> HookInfo {
        HookInfo {
            positions: self.positions,
            ..self
                .infos
                .get(name)
                .copied()
                .unwrap_or_else(|| HookInfo::from_point(point_of(name)))
        }
    }

    /// The candidate's precision at `name` (a `--precision` override when one matches).
    pub fn candidate_precision(&self, name: &str) -> Precision {
        self.precision
            .iter()
            .find(|o| glob_match(&o.glob, name))
            .map_or(self.candidate, |o| o.precision)
    }

    /// The floor of `name` (a `--tol` override when one matches).
    pub fn floor(&self, name: &str) -> f64 {
        self.tol_override(name)
            .unwrap_or_else(|| self.precision_floor(name))
    }

    /// The `--tol` value for `name`, when a glob matches it.
    pub fn tol_override(&self, name: &str) -> Option<f64> {
        self.tol
            .iter()
            .find(|(g, _)| glob_match(g, name))
            .map(|(_, v)| *v)
    }

    /// [`Judge::precision_floor`] with a router hook judged at the storage precision, as
    /// every other hook: the chained tolerance of the router's flips (see `record`).
    pub fn storage_floor(&self, name: &str) -> f64 {
        let info = HookInfo {
            router: false,
            ..self.info(name)
        };
        flip_tolerance(&info, self.reference, self.candidate_precision(name))
    }

    /// The tolerance of the scores `name` in `mode` for the flips they decide: the precision
    /// floor in replay (both sides score the same inputs), the storage floor in chained mode
    /// (the router's scores carry what storage did to their inputs upstream, so a router finer
    /// than storage does not narrow their flips' tolerance there). Never a `--tol` override.
    pub fn score_floor(&self, name: &str, mode: Mode) -> f64 {
        match mode {
            Mode::Replay => flip_tolerance(
                &self.info(name),
                self.reference,
                self.candidate_precision(name),
            ),
            Mode::Chained => self.storage_floor(name),
        }
    }

    /// The floor of `name` from both sides' precisions (a `--precision` override included),
    /// whatever `--tol` says: the relative tolerance of the flips its scores decide.
    pub fn precision_floor(&self, name: &str) -> f64 {
        floor(
            &self.info(name),
            self.reference,
            self.candidate_precision(name),
        )
    }
}

/// What a [`Judge`] is built from ([`Judge::new`] checks it).
#[derive(Clone, Debug)]
pub struct JudgeSpec {
    /// The reference's precision.
    pub reference: Precision,
    /// The candidate's precision.
    pub candidate: Precision,
    /// `--tol` overrides `(glob, floor)`, in order: the first matching glob wins.
    pub tol: Vec<(String, f64)>,
    /// Overrides of the candidate's precision (`--precision`, then what a trace declares), in
    /// order: the first matching glob wins.
    pub precision: Vec<PrecisionOverride>,
    /// What the model tells, when it is at hand (two traces compared without `--model`: not).
    pub model: Option<ModelFacts>,
    /// The candidate is an engine glmdiff runs: in replay its selections are made from the
    /// reference's scores (the step's input), not from its own.
    pub engine_candidate: bool,
    /// Positions of the prompt (its tokens; 0 when unknown): the RoPE angles' share of the
    /// floors grows with them.
    pub positions: usize,
}

/// What the model tells a judge.
#[derive(Clone, Debug, Default)]
pub struct ModelFacts {
    /// Floor inputs per hook of the steps judged (hooks not listed use their point name).
    pub infos: HashMap<String, HookInfo>,
    /// Selection bias (`exp_probs_b`) per MoE layer.
    pub selection_bias: HashMap<usize, Vec<f32>>,
    /// Group-limited routing `(n_group, used)`, if any.
    pub groups: Option<(usize, usize)>,
    /// Attention heads.
    pub heads: Option<usize>,
}

/// The precision a dtype string names: a dtype word (`bf16`, `float32`) or an engine's dtype
/// string (its first word the storage; `f64 accumulation` where sums are f64; the router's
/// precision where it names one); `None` when it names none. The one place a precision is read
/// from text.
pub fn precision_of(dtype: &str) -> Option<Precision> {
    Precision::parse(dtype)
}

/// The precision of a case's stored candidate from its `dtype`, or, when that names none, from
/// the stored output's values (said in `notes`); an error when neither tells.
pub fn case_precision(
    dtype: &str,
    output: &crate::tensor::HostTensor,
    notes: &mut Vec<String>,
) -> Result<Precision> {
    if let Some(p) = precision_of(dtype) {
        return Ok(p);
    }
    let inferred = output.as_f32("candidate").ok().and_then(storage_of_values);
    let Some(d) = inferred else {
        bail!(
            "step: the case's candidate dtype {dtype:?} names no precision and its stored output holds no value that tells one (all zero, NaN or ids); write its precision (f32, bf16, ...) as candidate_dtype in the case's case.json"
        );
    };
    notes.push(format!(
        "the case's candidate dtype {dtype:?} names no precision; its stored output's values are {d} numbers: the floor is {d}'s"
    ));
    Ok(Precision::of_dtype(d))
}

/// Precision overrides a trace declares, in this order (the first matching glob wins, after
/// `--precision` flags):
///
/// - `precision`: a JSON object of hook globs to dtype texts (`{"blk.*.q_a": "f32 storage, f32
///   accumulation, q8 activations"}`), for an engine whose precision differs from step to step
///   (llama.cpp: each product's activations are rounded to the format its weight asks for);
/// - `indexer_dtype` (e.g. `fp8` for an FP8 DSA indexer): the precision of `blk.*.indexer_*`.
///
/// A `precision` that is not such an object, or names a dtype no precision is read from, is
/// an error: it would decide verdicts.
pub fn trace_precision(t: &TraceFile, notes: &mut Vec<String>) -> Result<Vec<PrecisionOverride>> {
    let mut out = Vec::new();
    if let Some(raw) = t.metadata().get("precision") {
        let map = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw)
            .ok()
            .with_context(|| {
                format!(
                    "{}: metadata precision is not a JSON object of hook globs to dtypes: {raw:?}",
                    t.path().display()
                )
            })?;
        for (glob, v) in &map {
            let d = v.as_str().with_context(|| {
                format!(
                    "{}: metadata precision: the value of {glob:?} is not a string: {v}",
                    t.path().display()
                )
            })?;
            let p = precision_of(d).with_context(|| {
                format!(
                    "{}: metadata precision: {glob:?} = {d:?} names no precision (its first word must be f64, f32, tf32, bf16, f16 or fp8)",
                    t.path().display()
                )
            })?;
            out.push(PrecisionOverride {
                glob: glob.clone(),
                precision: p,
                dtype: d.to_string(),
                source: "the trace's precision".to_string(),
            });
        }
        if !map.is_empty() {
            notes.push(format!(
                "the trace's precision sets the candidate's precision per step ({} hook globs; the JSON lists them)",
                map.len()
            ));
        }
    }
    let Some(d) = t.metadata().get("indexer_dtype") else {
        return Ok(out);
    };
    match precision_of(d) {
        Some(p) => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} sets the candidate's precision of blk.*.indexer_*"
            ));
            out.push(PrecisionOverride {
                glob: "blk.*.indexer_*".to_string(),
                precision: p,
                dtype: d.clone(),
                source: "the trace's indexer_dtype".to_string(),
            });
        }
        None => {
            notes.push(format!(
                "the trace's indexer_dtype {d:?} is not a known precision; ignored"
            ));
        }
    }
    Ok(out)
}

/// Hooks whose values say nothing about an engine's storage precision: the embedding (a gather
/// copies the weights' own values), the router and the index scores (engines commonly compute
/// them finer than they store activations).
fn says_nothing_of_storage(name: &str) -> bool {
    matches!(
        point_of(name),
        "token_embd" | "moe_logits" | "moe_probs" | "moe_weights" | "indexer_scores"
    )
}

/// The precision of trace `t`, one side (`whose`: `trace`, `reference trace`, `candidate trace`) of a
/// comparison: what its `dtype` metadata names, with the router's precision from it or from
/// `router_dtype`. A dtype that names none (absent, unknown) is inferred from the values: the
/// coarsest of bf16, f16 and f32 that holds every value of every activation hook, with the
/// router in f32 when its hooks hold values that format cannot; a `--precision '*=DTYPE'` in
/// `flags` sets it instead. What was read or inferred is said in `notes`; an error when the
/// values do not tell (no activation hook, or some hold only bf16 numbers and others not).
pub fn trace_side_precision(
    t: &TraceFile,
    whose: &str,
    flags: &[PrecisionOverride],
    notes: &mut Vec<String>,
) -> Result<Precision> {
    let dtype = t.metadata().get("dtype").cloned().unwrap_or_default();
    let path = t.path().display();
    let said = if dtype.is_empty() {
        "no dtype".to_string()
    } else {
        format!("the dtype {dtype:?}, which names no precision")
    };
    let mut p = match (precision_of(&dtype), flags.iter().find(|o| o.glob == "*")) {
        (Some(p), _) => p,
        (None, Some(all)) => {
            notes.push(format!(
                "the {whose} has {said}; --precision '*={}' sets it",
                all.dtype
            ));
            all.precision
        }
        (None, None) => {
            let p = infer_precision(t, whose, &said)?;
            notes.push(format!(
                "the {whose} has {said}; its values say {}: {}",
                p.0, p.1
            ));
            p.0
        }
    };
    if let Some(r) = t.metadata().get("router_dtype") {
        let Some(d) = Dtype::parse(r).filter(|d| !d.is_operand_format()) else {
            bail!(
                "trace: {path}: metadata router_dtype {r:?} is not a dtype of f64, f32, f16 or bf16"
            );
        };
        p.router =
            (d.unit_roundoff() < p.storage.unit_roundoff()).then_some(crate::precision::Router {
                compute: d,
                matrix: p.router.map_or(p.storage, |r| r.matrix),
            });
    }
    if let Some(r) = p.router {
        notes.push(format!(
            "the {whose}'s router (moe_logits, moe_probs, moe_weights) computes in {}{}: judged there at {}'s floors",
            r.compute,
            if r.matrix == r.compute {
                String::new()
            } else {
                format!(" from a {} matrix", r.matrix)
            },
            r.compute
        ));
    }
    Ok(p)
}

/// A trace's precision from its values ([`trace_side_precision`]) and the words that say why.
fn infer_precision(t: &TraceFile, whose: &str, said: &str) -> Result<(Precision, String)> {
    let mut by: std::collections::BTreeMap<Dtype, Vec<String>> = Default::default();
    let mut router: Vec<(String, Dtype)> = Vec::new();
    let names: Vec<String> = t.names().map(str::to_string).collect();
    for n in &names {
        if t.holds_ints(n) != Some(false) {
            continue;
        }
        let Some(tensor) = t.get(n)? else { continue };
        let Some(d) = tensor.as_f32(n).ok().and_then(storage_of_values) else {
            continue;
        };
        if says_nothing_of_storage(n) {
            if matches!(point_of(n), "moe_logits" | "moe_probs" | "moe_weights") {
                router.push((n.clone(), d));
            }
            continue;
        }
        by.entry(d).or_default().push(n.clone());
    }
    let count = |d: Dtype| by.get(&d).map_or(0, Vec::len);
    let example = |d: Dtype| {
        by.get(&d)
            .and_then(|v| v.first())
            .cloned()
            .unwrap_or_default()
    };
    let total: usize = by.values().map(Vec::len).sum();
    let fix = if whose.starts_with("reference") {
        "write its precision as the trace's dtype metadata (f32, bf16, ...)".to_string()
    } else {
        "give it with --precision '*=DTYPE' (f64, f32, tf32, f16, bf16, fp8) or as the trace's dtype metadata".to_string()
    };
    let path = t.path().display();
    let storage = match (count(Dtype::Bf16), count(Dtype::F16), count(Dtype::F32)) {
        (0, 0, 0) => bail!(
            "trace: {path}: the {whose} has {said} and no activation hook whose values tell one; {fix}"
        ),
        (_, 0, 0) => Dtype::Bf16,
        (_, _, 0) => Dtype::F16,
        (0, 0, _) => Dtype::F32,
        (b, h, f) => bail!(
            "trace: {path}: the {whose} has {said} and its values do not tell one: {} hold only bf16 or f16 numbers (e.g. {}), {f} hold numbers neither can (e.g. {}); {fix}",
            b + h,
            if b > 0 { example(Dtype::Bf16) } else { example(Dtype::F16) },
            example(Dtype::F32)
        ),
    };
    let mut why = match storage {
        Dtype::Bf16 => format!("every value of its {total} activation hooks is a bf16 number"),
        Dtype::F16 => format!(
            "every value of its {total} activation hooks is an f16 number, not all bf16 ones"
        ),
        _ => format!("none of its {total} activation hooks holds only bf16 or f16 numbers"),
    };
    let mut p = Precision::of_dtype(storage);
    let finer: Vec<&String> = router
        .iter()
        .filter(|(_, d)| d.unit_roundoff() < storage.unit_roundoff())
        .map(|(n, _)| n)
        .collect();
    if let Some(first) = finer.first() {
        p.router = Some(crate::precision::Router {
            compute: Dtype::F32,
            matrix: storage,
        });
        why.push_str(&format!(
            "; {} router hooks (e.g. {first}) hold values {storage} cannot: the router computes in f32",
            finer.len()
        ));
    }
    Ok((p, why))
}

/// A note listing what a trace's engine could not capture: metadata `not_captured`, a JSON object
/// from hook names or globs to the reason (a fused kernel with no hook point). Those hooks are
/// then reported as not in the trace.
pub fn not_captured_note(t: &TraceFile) -> Option<String> {
    let raw = t.metadata().get("not_captured")?;
    let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw) else {
        return Some(format!(
            "the trace's metadata not_captured is not a JSON object of hooks to reasons: {raw:?}"
        ));
    };
    if map.is_empty() {
        return None;
    }
    let items: Vec<String> = map
        .iter()
        .map(|(h, why)| match why.as_str() {
            Some(w) if !w.is_empty() => format!("{h} ({w})"),
            _ => h.clone(),
        })
        .collect();
    Some(format!(
        "the trace's engine could not capture {} hook(s), shown as not in the trace: {}",
        map.len(),
        items.join("; ")
    ))
}

/// The precision overrides of a comparison with trace candidate `trace`: `--precision` first,
/// then what the trace declares (said in `notes`, with what it could not capture).
pub fn overrides_with_trace(
    flags: &[PrecisionOverride],
    trace: Option<&TraceFile>,
    notes: &mut Vec<String>,
) -> Result<Vec<PrecisionOverride>> {
    let mut p = flags.to_vec();
    if let Some(t) = trace {
        p.extend(trace_precision(t, notes)?);
        notes.extend(not_captured_note(t));
    }
    Ok(p)
}

/// The hooks a comparison keeps: `--hook` globs (all standard hooks without them), plus the
/// score hooks behind a wanted selection (their values judge its flips).
pub fn wants_with_scores(globs: &[String]) -> Box<dyn Fn(&str) -> bool + Send + Sync> {
    let filter = HookFilter {
        layers: None,
        globs: globs.to_vec(),
    };
    Box::new(move |n: &str| {
        filter.wants(n)
            || match crate::model::names::split_blk(n) {
                Some((l, "indexer_scores")) => filter.wants(&format!("blk.{l}.indexer_topk")),
                Some((l, "moe_probs")) => filter.wants(&format!("blk.{l}.moe_topk_ids")),
                _ => false,
            }
    })
}
