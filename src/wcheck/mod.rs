//! `weights-check`: every tensor of a GGUF against the checkpoint it was converted from (or
//! against another GGUF of the same model), with a verdict per tensor and, for a tensor that
//! fails, the mapping bug that explains it.
//!
//! # Method
//! 1. Each GGUF tensor is mapped to its reference values ([`mapping`]): a [`Gather`] that reads,
//!    for any range of the GGUF tensor's rows, the reference values in the same order.
//! 2. All tensors are cut into chunks of at most [`CHUNK_VALUES`] values; chunks run in parallel
//!    (rayon), each reading only its rows from both sides (GGUF pages are released after use,
//!    the checkpoint is read with positioned reads), so memory is a few chunks per thread,
//!    whatever the model's size. Per chunk: sums for NMSE, cosine, max |diff| ([`stats`]) and
//!    the squared error the GGUF's rounding is expected to add there, read from its block
//!    scales ([`crate::quant::noise`]; a GGUF reference adds its own), plus one BF16 rounding of
//!    the reference values BF16 cannot hold (the converter's intermediate file).
//! 3. Verdict: a tensor passes when `sum (gguf - ref)^2 <= ALLOWED_FACTOR * expected` (see
//!    [`ALLOWED_FACTOR`] for the reason of the factor; never above NMSE [`MAX_ALLOWED_NMSE`]),
//!    and has no NaN/Inf the reference lacks.
//! 4. A failing tensor is diagnosed ([`diagnose`]): the usual mapping bugs are each turned into
//!    a gather and tried on a sample of rows; the first that passes the same test is named.
//! 5. Reference tensors no GGUF tensor reads, and GGUF tensors without a reference, are listed.
//!
//! [`check_against`] is the whole command: the reference opened and checked to be the same
//! model, what is known of both gathered, then [`check`].

pub mod against;
pub mod diagnose;
pub mod gather;
pub mod mapping;
pub mod stats;
pub mod store;

use std::collections::BTreeSet;
use std::ops::Range;

use anyhow::Result;
use rayon::prelude::*;
use serde::Serialize;

pub use against::{check_against, Reference};
pub use gather::Gather;
pub use mapping::{Dims, RefKind, Resolved};
pub use stats::Acc;
pub use store::{GgufStore, HfStore, Store};

use crate::gguf::Model;
use crate::model::Arch;
use crate::quant::noise;
use crate::util::glob;
use crate::util::progress::Progress;

/// Values per work item (4 MiB of f32 per side).
pub const CHUNK_VALUES: u64 = 1 << 20;

/// A tensor passes when its summed squared error is at most this multiple of the expected one.
///
/// Why 4: the expected error is a model (`quant::noise`); against llama.cpp's own quantizers
/// (`reference/checks/wcheck_calibrate.py`: Gaussian, Laplace, Student-t and row-scaled weights, with
/// and without importance matrices) measured / expected stayed within 0.6..1.5 for every type
/// used in GLM-5 and DeepSeek-V3 GGUFs (F16, BF16, Q*_0/1, K-quants, IQ1..IQ4, MXFP4), and the
/// sum over a tensor of n values scatters only by about `sqrt(2/n)` around it. 4x leaves 2.6x
/// over the worst measured clean tensor. A mapping bug compares values with others: unrelated
/// weights of equal size give NMSE 2, two experts of eight swapped 0.5, two layers' norms (near
/// 1, spread 0.1) about 0.02, while the expected NMSE of every type but the 1- and 2-bit ones is
/// below 0.01 (Q4_K 0.005, Q8_0 3e-5, BF16 3e-6).
///
/// On the fixtures (`tests/weights_check.rs`, `clean_pairs_pass`): the worst clean tensor is
/// 1.06x expected on `glm5-tiny-q-bf16.gguf` (11 types) and 1.26x on `dsv3-tiny-q-fp8.gguf`
/// (19 types, IQ1_S..MXFP4); 36 pairs made by llama.cpp's converter and `llama-quantize`
/// (`reference/checks/wcheck_llama_quantize.py`) peak at 1.26x. The planted bugs of fixtures/wcheck
/// measure at least 15x expected (permuted IQ2_XS experts, whose own rounding is large; 4000x and
/// more elsewhere).
pub const ALLOWED_FACTOR: f64 = 4.0;

/// Largest allowed NMSE whatever the type: a copy whose rounding alone lost as much as the signal
/// (NMSE 1) cannot be told from unrelated values (NMSE about 2), so it is not accepted as one.
/// The clean 1-bit types measured up to 0.40 (IQ1_S), the ternary TQ types 0.72.
pub const MAX_ALLOWED_NMSE: f64 = 1.0;

/// How one GGUF tensor came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Within the allowed error.
    Pass,
    /// Beyond it (or NaN/Inf the reference lacks).
    Fail,
    /// The reference tensor's shape does not fit the GGUF tensor's.
    ShapeMismatch,
    /// The GGUF type has no dequantization or no rounding model.
    Skipped,
}

/// A named mapping bug that explains a failing tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diagnosis {
    /// `transposed`, `kv_b_concatenated`, `experts_permuted`, `gate_up_swapped`, `head_order`,
    /// `layer_shift`, or `unexplained`.
    pub kind: String,
    /// One line for people.
    pub summary: String,
    /// NMSE on the diagnosis sample under this hypothesis.
    pub nmse: Option<f64>,
    /// Its allowed NMSE on the same sample.
    pub allowed: Option<f64>,
    /// For permutations: GGUF group `i` holds reference group `permutation[i]`.
    pub permutation: Option<Vec<u64>>,
    /// For a layer shift: the reference layer the tensor holds.
    pub layer: Option<usize>,
    /// Every hypothesis tried: `(kind, sample NMSE)`.
    pub tried: Vec<(String, Option<f64>)>,
}

/// The result for one GGUF tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorResult {
    /// GGUF name.
    pub name: String,
    /// GGUF type.
    pub ty: String,
    /// PyTorch-order shape of the GGUF tensor.
    pub shape: Vec<u64>,
    /// Reference tensor(s).
    pub source: String,
    /// Reference storage type(s).
    pub source_dtype: String,
    /// Outcome.
    pub status: Status,
    /// Sums over the compared values (zero when not compared).
    pub acc: Acc,
    /// Expected NMSE from rounding (GGUF type, and a GGUF reference's).
    pub expected_nmse: Option<f64>,
    /// The largest passing NMSE (`ALLOWED_FACTOR * expected`, at most `MAX_ALLOWED_NMSE`).
    pub allowed_nmse: Option<f64>,
    /// Index of the largest |diff| in PyTorch order.
    pub max_at: Option<Vec<u64>>,
    /// Why it failed, where found.
    pub diagnosis: Option<Diagnosis>,
    /// A note (shape mismatch details, a skipped type).
    pub note: Option<String>,
}

/// A tensor on one side with no counterpart on the other.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unmatched {
    /// Its name.
    pub name: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// What it would be called on the other side, or why it is expected to be absent.
    pub note: String,
    /// Whether its absence is expected (an MTP layer a converter leaves out): listed, not a failure.
    pub expected: bool,
}

/// Everything `weights-check` found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The GGUF checked.
    pub gguf: String,
    /// The reference.
    pub reference: String,
    /// `hf` or `gguf`.
    pub reference_kind: String,
    /// The MLA dimensions used for `kv_b`, if known.
    pub dims: Option<Dims>,
    /// One per compared GGUF tensor, in file order.
    pub tensors: Vec<TensorResult>,
    /// GGUF tensors without a reference.
    pub gguf_only: Vec<Unmatched>,
    /// Reference tensors no GGUF tensor reads.
    pub reference_only: Vec<Unmatched>,
    /// The allowed multiple of the expected error.
    pub allowed_factor: f64,
    /// Values compared.
    pub values: u64,
    /// Notes on what was assumed.
    pub notes: Vec<String>,
}

impl Report {
    /// Whether anything differs (exit 1).
    pub fn differs(&self) -> bool {
        self.tensors
            .iter()
            .any(|t| matches!(t.status, Status::Fail | Status::ShapeMismatch))
            || !self.gguf_only.is_empty()
            || self.reference_only.iter().any(|u| !u.expected)
    }
}

/// What to check.
#[derive(Clone, Debug)]
pub struct Options {
    /// Only GGUF tensors matching one of these globs (empty: all).
    pub tensors: Vec<String>,
    /// Values per work item ([`CHUNK_VALUES`]; whole rows, at least one).
    pub chunk_values: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            tensors: vec![],
            chunk_values: CHUNK_VALUES,
        }
    }
}

impl Dims {
    /// From an HF config, when it has all four.
    pub fn from_hf(c: &crate::hf::HfConfig) -> Option<Dims> {
        Some(Dims {
            n_head: c.n_head? as u64,
            nope: c.qk_nope? as u64,
            v: c.v_head? as u64,
            kv_lora: c.kv_lora_rank? as u64,
        })
    }

    /// From a GGUF's metadata, when it parses.
    pub fn from_gguf(m: &Model) -> Option<Dims> {
        let hp = crate::model::HParams::from_metadata(m).ok()?;
        Some(Dims {
            n_head: hp.n_head as u64,
            nope: hp.qk_nope as u64,
            v: hp.v_head as u64,
            kv_lora: hp.kv_lora_rank as u64,
        })
    }
}

/// The `config.json` `model_type`s of a GGUF architecture.
fn hf_model_types(arch: crate::model::Arch) -> &'static [&'static str] {
    match arch {
        crate::model::Arch::GlmDsa => &["glm_moe_dsa"],
        crate::model::Arch::Deepseek2 => &["deepseek_v3", "deepseek_v2", "deepseek_v32"],
    }
}

/// The dimensions both sides state, as `(config.json key, its value, GGUF key, its value)`.
fn hf_dims(
    hp: &crate::model::HParams,
    c: &crate::hf::HfConfig,
) -> Vec<(&'static str, Option<usize>, &'static str, usize)> {
    use crate::model::keys;
    vec![
        ("hidden_size", c.hidden, keys::EMBEDDING_LENGTH, hp.hidden),
        (
            "num_hidden_layers",
            Some(c.n_layers),
            "block_count - nextn_predict_layers",
            hp.n_layer,
        ),
        (
            "num_attention_heads",
            c.n_head,
            keys::ATTN_HEAD_COUNT,
            hp.n_head,
        ),
        (
            "kv_lora_rank",
            c.kv_lora_rank,
            keys::ATTN_KV_LORA_RANK,
            hp.kv_lora_rank,
        ),
        (
            "q_lora_rank",
            c.q_lora_rank,
            keys::ATTN_Q_LORA_RANK,
            hp.q_lora_rank.unwrap_or(0),
        ),
        (
            "qk_nope_head_dim",
            c.qk_nope,
            "key_length_mla - rope.dimension_count",
            hp.qk_nope,
        ),
        (
            "v_head_dim",
            c.v_head,
            keys::ATTN_VALUE_LENGTH_MLA,
            hp.v_head,
        ),
        (
            "n_routed_experts",
            c.n_expert,
            keys::EXPERT_COUNT,
            hp.n_expert,
        ),
        (
            "moe_intermediate_size",
            c.n_ff_exp,
            keys::EXPERT_FEED_FORWARD_LENGTH,
            hp.n_ff_exp,
        ),
    ]
}

/// Checks, before any tensor is compared, that the checkpoint in `dir` (its `config`) is of the
/// GGUF `gguf`'s model: the architecture (`model_type`) and every dimension both state. An
/// error names both files, the keys and both values. A GGUF whose metadata does not parse, or a
/// `model_type` glmdiff does not know, is not refused here (the comparison says what it finds).
pub fn same_model_hf(gguf: &Model, dir: &std::path::Path, c: &crate::hf::HfConfig) -> Result<()> {
    let Ok(hp) = crate::model::HParams::from_metadata(gguf) else {
        return Ok(());
    };
    let (d, m) = (dir.display(), gguf.path().display());
    let known = [Arch::GlmDsa, Arch::Deepseek2]
        .iter()
        .any(|a| hf_model_types(*a).contains(&c.model_type.as_str()));
    if known && !hf_model_types(hp.arch).contains(&c.model_type.as_str()) {
        anyhow::bail!(
            "weights-check: the checkpoint {d} is {} (config.json model_type), the GGUF {m} is {}: not one model",
            c.model_type,
            hp.arch.as_str()
        );
    }
    for (hk, hv, gk, gv) in hf_dims(&hp, c) {
        if let Some(hv) = hv.filter(|&v| v != gv) {
            anyhow::bail!(
                "weights-check: the checkpoint {d} and the GGUF {m} are not one model: {hk} {hv} in config.json, {gk} {gv} in the GGUF"
            );
        }
    }
    Ok(())
}

/// Checks, before any tensor is compared, that the GGUF `other` is of `gguf`'s model: the same
/// architecture and hyperparameters that size tensors. An error names both files, the key and
/// both values. A GGUF whose metadata does not parse is not refused here.
pub fn same_model_gguf(gguf: &Model, other: &Model) -> Result<()> {
    use crate::model::keys;
    let (Ok(a), Ok(b)) = (
        crate::model::HParams::from_metadata(gguf),
        crate::model::HParams::from_metadata(other),
    ) else {
        return Ok(());
    };
    let (m, o) = (gguf.path().display(), other.path().display());
    if a.arch != b.arch {
        anyhow::bail!(
            "weights-check: the GGUF {m} is {}, the --gguf {o} is {} (general.architecture): not one model",
            a.arch.as_str(),
            b.arch.as_str()
        );
    }
    let dims = |h: &crate::model::HParams| {
        [
            (keys::EMBEDDING_LENGTH, h.hidden),
            ("block_count - nextn_predict_layers", h.n_layer),
            (keys::ATTN_HEAD_COUNT, h.n_head),
            (keys::ATTN_KV_LORA_RANK, h.kv_lora_rank),
            (keys::ATTN_Q_LORA_RANK, h.q_lora_rank.unwrap_or(0)),
            (keys::ROPE_DIMENSION_COUNT, h.qk_rope),
            (keys::ATTN_VALUE_LENGTH_MLA, h.v_head),
            (keys::FEED_FORWARD_LENGTH, h.n_ff),
            (keys::EXPERT_COUNT, h.n_expert),
            (keys::EXPERT_FEED_FORWARD_LENGTH, h.n_ff_exp),
        ]
    };
    for ((k, x), (_, y)) in dims(&a).into_iter().zip(dims(&b)) {
        if x != y {
            anyhow::bail!(
                "weights-check: the GGUF {m} and the --gguf {o} are not one model: {k} {x} in {m}, {y} in {o}"
            );
        }
    }
    Ok(())
}

/// One unit of work: rows of one tensor.
struct Item {
    tensor: usize,
    rows: Range<u64>,
}

/// A tensor resolved for comparison.
struct Planned {
    name: String,
    source: mapping::Source,
    rows: u64,
    row_len: u64,
}

/// What is known about the reference and the model.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    /// What the reference is.
    pub kind: RefKind,
    /// MLA dimensions (for `kv_b`), if known.
    pub dims: Option<Dims>,
    /// Heads of the DSA indexer, if known (head-order diagnosis of `indexer.attn_q_b`).
    pub index_heads: Option<u64>,
    /// First MTP layer of the reference, if it has any: its tensors may be absent from a GGUF.
    pub mtp_from: Option<usize>,
}

/// Checks every tensor of `gguf` against `refs`.
pub fn check(
    gguf: &Model,
    refs: &dyn Store,
    setup: Setup,
    opts: &Options,
    progress: &(dyn Progress + Sync),
) -> Result<Report> {
    let Setup {
        kind,
        dims,
        index_heads,
        mtp_from,
    } = setup;
    let left = GgufStore { model: gguf };
    let mut results: Vec<TensorResult> = Vec::new();
    let mut planned: Vec<(usize, Planned)> = Vec::new();
    let mut gguf_only = Vec::new();
    let mut consumed: BTreeSet<String> = BTreeSet::new();
    for t in gguf.tensors() {
        let name = t.info.name.clone();
        let shape = t.info.shape();
        let res = mapping::resolve(&name, &shape, refs, kind, dims.as_ref());
        match &res {
            Resolved::Found(s) => consumed.extend(s.gather.sources()),
            Resolved::Shape { desc, .. } => {
                consumed.extend(desc.split(" + ").map(|d| d.to_string()));
            }
            _ => {}
        }
        if !glob::matches_any(&opts.tensors, &name) {
            continue;
        }
        let base = TensorResult {
            name: name.clone(),
            ty: t.info.ty.name().to_string(),
            shape: shape.clone(),
            source: String::new(),
            source_dtype: String::new(),
            status: Status::Pass,
            acc: Acc::default(),
            expected_nmse: None,
            allowed_nmse: None,
            max_at: None,
            diagnosis: None,
            note: None,
        };
        match res {
            Resolved::Found(source) => {
                let srcs = source.gather.sources();
                let dtypes: BTreeSet<String> = srcs
                    .iter()
                    .filter_map(|s| refs.meta(s).map(|m| m.dtype))
                    .collect();
                let mut r = TensorResult {
                    source: source.desc.clone(),
                    source_dtype: dtypes.into_iter().collect::<Vec<_>>().join("+"),
                    ..base
                };
                if !store::comparable_type(t.info.ty) {
                    r.status = Status::Skipped;
                    r.note = Some(format!(
                        "type {} has no dequantization or rounding model",
                        t.info.ty
                    ));
                    results.push(r);
                    continue;
                }
                let rows = t.info.n_rows();
                let row_len = t.info.row_len();
                planned.push((
                    results.len(),
                    Planned {
                        name,
                        source,
                        rows,
                        row_len,
                    },
                ));
                results.push(r);
            }
            Resolved::Shape {
                desc,
                reference,
                expected,
            } => {
                let dt = refs.meta(&desc).map(|m| m.dtype).unwrap_or_default();
                results.push(TensorResult {
                    source: desc,
                    source_dtype: dt,
                    status: Status::ShapeMismatch,
                    note: Some(format!(
                        "reference shape {reference:?}, expected {expected:?} for this GGUF tensor"
                    )),
                    ..base
                });
            }
            Resolved::Missing(want) => gguf_only.push(Unmatched {
                name,
                shape,
                note: format!("no {want} in the reference"),
                expected: false,
            }),
            Resolved::Unknown => gguf_only.push(Unmatched {
                name,
                shape,
                note: "no mapping rule for this name".into(),
                expected: false,
            }),
        }
    }

    // Work items: chunks of rows, in tensor order.
    let mut items = Vec::new();
    for (pi, (_, p)) in planned.iter().enumerate() {
        let step = (opts.chunk_values / p.row_len.max(1)).max(1);
        let mut r = 0;
        while r < p.rows {
            let e = (r + step).min(p.rows);
            items.push(Item {
                tensor: pi,
                rows: r..e,
            });
            r = e;
        }
    }
    progress.start("weights-check", items.len() as u64);
    let want_var = !refs.is_original();
    let accs: Vec<Result<Acc>> = items
        .par_iter()
        .map(|it| {
            let p = &planned[it.tensor].1;
            let a = left.read(&p.name, it.rows.clone(), 0..p.row_len, false)?;
            let b = p
                .source
                .gather
                .read(refs, it.rows.clone(), p.row_len, want_var)?;
            let mut acc = Acc::default();
            acc.add(it.rows.start * p.row_len, &a.vals, &b.vals);
            acc.expected = left.sq_error(&p.name, it.rows.clone())?
                + b.var.map_or(0.0, |v| v.iter().map(|&x| f64::from(x)).sum())
                + noise::bf16_intermediate_sq_error(&b.vals);
            progress.inc(1);
            Ok(acc)
        })
        .collect();
    progress.finish();
    let mut per_tensor = vec![Acc::default(); planned.len()];
    for (it, acc) in items.iter().zip(accs) {
        per_tensor[it.tensor].merge(&acc?);
    }
    let mut values = 0;
    for ((ri, _), acc) in planned.iter().zip(&per_tensor) {
        let r = &mut results[*ri];
        values += acc.n;
        r.acc = *acc;
        r.expected_nmse = acc.expected_nmse();
        r.allowed_nmse =
            (acc.ref2 > 0.0).then(|| acc.allowed(ALLOWED_FACTOR, MAX_ALLOWED_NMSE) / acc.ref2);
        r.max_at = Some(unflatten(acc.max_at, &r.shape));
        r.status = if acc.within(ALLOWED_FACTOR, MAX_ALLOWED_NMSE) {
            Status::Pass
        } else {
            Status::Fail
        };
    }

    // Diagnose what failed.
    let failing: Vec<usize> = (0..results.len())
        .filter(|&i| matches!(results[i].status, Status::Fail | Status::ShapeMismatch))
        .collect();
    if !failing.is_empty() {
        progress.start("diagnosing", failing.len() as u64);
        let ctx = diagnose::Ctx {
            left: &left,
            refs,
            kind,
            dims,
            index_heads,
        };
        let diags: Vec<Result<Diagnosis>> = failing
            .par_iter()
            .map(|&i| {
                let d = diagnose::diagnose(&ctx, &results[i].name, &results[i].shape);
                progress.inc(1);
                d
            })
            .collect();
        progress.finish();
        for (&i, d) in failing.iter().zip(diags) {
            results[i].diagnosis = Some(d?);
        }
    }

    // Reference tensors nothing read.
    let gguf_names: BTreeSet<String> = left.names().into_iter().collect();
    let mut reference_only = Vec::new();
    for name in refs.names() {
        if consumed.contains(&name) {
            continue;
        }
        let would_be = match kind {
            RefKind::Hf => mapping::gguf_names_for_hf(&name),
            RefKind::Gguf => vec![name.clone()],
        };
        if !opts.tensors.is_empty() && !would_be.iter().any(|g| glob::matches_any(&opts.tensors, g))
        {
            continue;
        }
        let shape = refs.meta(&name).map(|m| m.shape).unwrap_or_default();
        let layer = would_be
            .first()
            .and_then(|g| crate::model::names::split_blk(g))
            .map(|x| x.0);
        let mtp_absent = match (layer, mtp_from) {
            (Some(l), Some(first)) if l >= first => {
                let prefix = format!("blk.{l}.");
                !gguf_names.iter().any(|g| g.starts_with(&prefix))
            }
            _ => false,
        };
        let note = if mtp_absent {
            "MTP layer: the GGUF has no block for it (converters may leave it out; it is not run)"
                .to_string()
        } else if would_be.is_empty() {
            "no GGUF tensor maps to it (no mapping rule)".to_string()
        } else {
            format!("would be {}", would_be.join(" + "))
        };
        reference_only.push(Unmatched {
            name,
            shape,
            note,
            expected: mtp_absent,
        });
    }
    let mut notes = Vec::new();
    if dims.is_none() {
        notes.push("MLA dimensions unknown: kv_b split taken from the GGUF tensor shapes".into());
    }
    Ok(Report {
        gguf: gguf.path().display().to_string(),
        reference: refs.describe(),
        reference_kind: match kind {
            RefKind::Hf => "hf",
            RefKind::Gguf => "gguf",
        }
        .into(),
        dims,
        tensors: results,
        gguf_only,
        reference_only,
        allowed_factor: ALLOWED_FACTOR,
        values,
        notes,
    })
}

/// A flat index as a PyTorch-order index.
fn unflatten(mut i: u64, shape: &[u64]) -> Vec<u64> {
    let mut out = vec![0; shape.len()];
    for (o, &d) in out.iter_mut().zip(shape).rev() {
        if d > 0 {
            *o = i % d;
            i /= d;
        }
    }
    out
}
