//! Naming the mapping bug behind a failing tensor.
//!
//! Each usual suspect is written as a [`Gather`] (what the reference would look like if the bug
//! were there) and tried on a sample of the GGUF tensor's rows with the same test as the verdict
//! (`sum (gguf - ref)^2 <= ALLOWED_FACTOR * expected`, NMSE at most `MAX_ALLOWED_NMSE`). Suspects, in order:
//! - **transposed**: the reference matrix transposed (per expert for stacked experts);
//! - **kv_b concatenated**: `kv_b_proj` split as all K rows, then all V rows, instead of per head;
//! - **experts permuted**: each GGUF expert matched to the reference expert whose first rows
//!   are nearest (NMSE over a sketch of [`SKETCH_VALUES`] values), a permutation if the
//!   matches are one-to-one;
//! - **gate/up swapped**: the sibling projection (`ffn_gate*` <-> `ffn_up*`);
//! - **wrong head order**: as for experts, over head-sized groups of rows (`attn_q_b`,
//!   `attn_k_b`, `attn_v_b`, `attn_kv_b`, `indexer.attn_q_b`) or columns (`attn_output`);
//! - **layer shift**: the same tensor of another layer, nearest layers first.

use std::ops::Range;

use anyhow::Result;

use super::gather::{group_rows, Gather};
use super::mapping::{self, Dims, RefKind, Resolved, KV_B, K_B, V_B};
use super::stats::Acc;
use super::store::{GgufStore, Store};
use super::{Diagnosis, ALLOWED_FACTOR, MAX_ALLOWED_NMSE};
use crate::model::names::split_blk;

/// Values read from each side for one hypothesis (spread over [`SAMPLE_RANGES`] row ranges).
pub const SAMPLE_VALUES: u64 = 1 << 18;
/// Row ranges of the sample, evenly spaced over the tensor.
pub const SAMPLE_RANGES: u64 = 8;
/// Values per group (expert, head) used to match groups.
pub const SKETCH_VALUES: u64 = 4096;

/// What a diagnosis reads from.
pub struct Ctx<'a> {
    /// The GGUF under test.
    pub left: &'a GgufStore<'a>,
    /// The reference.
    pub refs: &'a dyn Store,
    /// Its kind.
    pub kind: RefKind,
    /// MLA dimensions, if known.
    pub dims: Option<Dims>,
    /// Heads of the DSA indexer, if known.
    pub index_heads: Option<u64>,
}

/// A hypothesis: its kind, its gather, and what to say when it fits.
struct Hyp {
    kind: &'static str,
    gather: Gather,
    summary: String,
    permutation: Option<Vec<u64>>,
    layer: Option<usize>,
    /// Rows to add to the sample (the groups a permutation moves).
    extra: Vec<Range<u64>>,
}

/// Finds which mapping bug explains GGUF tensor `name` (PyTorch `shape`).
pub fn diagnose(ctx: &Ctx<'_>, name: &str, shape: &[u64]) -> Result<Diagnosis> {
    let row_len = shape.last().copied().unwrap_or(1);
    let rows: u64 = shape.iter().rev().skip(1).product();
    let ranges = sample(rows, row_len);
    let base = mapping::resolve(name, shape, ctx.refs, ctx.kind, ctx.dims.as_ref());
    let mut tried = Vec::new();
    let mut best: Option<(String, f64)> = None;
    let mut hyps = transposed(ctx, name, shape, &base);
    hyps.extend(kv_concat(ctx, name, shape));
    let found = |h: &Hyp, acc: &Acc| Diagnosis {
        kind: h.kind.to_string(),
        summary: h.summary.clone(),
        nmse: acc.nmse(),
        allowed: (acc.ref2 > 0.0).then(|| acc.allowed(ALLOWED_FACTOR, MAX_ALLOWED_NMSE) / acc.ref2),
        permutation: h.permutation.clone(),
        layer: h.layer,
        tried: vec![],
    };
    // Cheap, explicit hypotheses first; permutation searches and layer scans only if needed.
    let base_ref = &base;
    let lazy: [&dyn Fn() -> Result<Vec<Hyp>>; 4] = [
        &|| experts_permuted(ctx, name, shape, base_ref),
        &|| Ok(gate_up(ctx, name, shape)),
        &|| head_order(ctx, name, shape, base_ref),
        &|| Ok(layer_shift(ctx, name, shape)),
    ];
    let mut pending = hyps;
    let mut stage = 0;
    loop {
        for h in pending.drain(..) {
            let mut rs = ranges.clone();
            rs.extend(h.extra.iter().cloned());
            let acc = eval(ctx, name, &h.gather, &rs, row_len)?;
            tried.push((h.kind.to_string(), acc.nmse()));
            if acc.n > 0 && acc.within(ALLOWED_FACTOR, MAX_ALLOWED_NMSE) {
                let mut d = found(&h, &acc);
                d.tried = tried;
                return Ok(d);
            }
            if let Some(n) = acc.nmse() {
                if best.as_ref().is_none_or(|(_, b)| n < *b) {
                    best = Some((h.kind.to_string(), n));
                }
            }
        }
        if stage == lazy.len() {
            break;
        }
        pending = lazy[stage]()?;
        stage += 1;
    }
    let summary = match (&base, &best) {
        (Resolved::Shape {
            reference,
            expected,
            ..
        }, _) => format!(
            "shape mismatch: the reference is {reference:?}, this tensor needs {expected:?}; no known mapping bug fits"
        ),
        (_, Some((k, n))) => format!(
            "no known mapping bug fits (nearest: {k}, NMSE {n:.3e}): the values differ, not just their places"
        ),
        _ => "no known mapping bug fits".to_string(),
    };
    Ok(Diagnosis {
        kind: "unexplained".into(),
        summary,
        nmse: None,
        allowed: None,
        permutation: None,
        layer: None,
        tried,
    })
}

/// Row ranges of the sample: the whole tensor when it fits [`SAMPLE_VALUES`], else
/// [`SAMPLE_RANGES`] evenly spaced runs of rows that together do.
fn sample(rows: u64, row_len: u64) -> Vec<Range<u64>> {
    let budget = (SAMPLE_VALUES / row_len.max(1)).max(1);
    if rows <= budget {
        return std::iter::once(0..rows).collect();
    }
    let n = SAMPLE_RANGES.min(budget);
    let per = (budget / n).max(1);
    (0..n)
        .map(|k| {
            let start = (rows - per) * k / (n - 1).max(1);
            start..start + per
        })
        .collect()
}

/// The verdict's sums for `g` on the sample.
fn eval(ctx: &Ctx<'_>, name: &str, g: &Gather, ranges: &[Range<u64>], row_len: u64) -> Result<Acc> {
    let want_var = !ctx.refs.is_original();
    let mut acc = Acc::default();
    for r in ranges {
        let a = ctx.left.read(name, r.clone(), 0..row_len, false)?;
        let b = match g.read(ctx.refs, r.clone(), row_len, want_var) {
            Ok(b) => b,
            Err(_) => return Ok(Acc::default()), // the hypothesis does not fit the shapes
        };
        if b.vals.len() != a.vals.len() {
            return Ok(Acc::default());
        }
        let mut c = Acc::default();
        c.add(r.start * row_len, &a.vals, &b.vals);
        c.expected = ctx.left.sq_error(name, r.clone())?
            + b.var.map_or(0.0, |v| v.iter().map(|&x| f64::from(x)).sum())
            + crate::quant::noise::bf16_intermediate_sq_error(&b.vals);
        acc.merge(&c);
    }
    Ok(acc)
}

/// The transpose of a plain gather of `[rows, row_len]` parts (a whole tensor, or experts).
fn transpose_of(g: &Gather, part_rows: u64, row_len: u64) -> Option<Gather> {
    match g {
        Gather::Rows { name, start: 0 } => Some(Gather::Transposed {
            name: name.clone(),
            width: part_rows,
            len: row_len,
            stride: 0,
            offset: 0,
        }),
        Gather::Pieces(p) => {
            let parts: Option<Vec<_>> = p
                .iter()
                .map(|(f, n, g)| Some((*f, *n, transpose_of(g, *n, row_len)?)))
                .collect();
            Some(Gather::Pieces(parts?))
        }
        _ => None,
    }
}

fn transposed(ctx: &Ctx<'_>, name: &str, shape: &[u64], base: &Resolved) -> Vec<Hyp> {
    let n = shape.len();
    if n < 2 {
        return vec![];
    }
    let (r, c) = (shape[n - 2], shape[n - 1]);
    let mut swapped = shape.to_vec();
    swapped.swap(n - 2, n - 1);
    let src = if r == c {
        match base {
            Resolved::Found(s) => Some(s.clone()),
            _ => None,
        }
    } else {
        match mapping::resolve(name, &swapped, ctx.refs, ctx.kind, ctx.dims.as_ref()) {
            Resolved::Found(s) => Some(s),
            _ => None,
        }
    };
    let Some(src) = src else { return vec![] };
    let Some(gather) = transpose_of(&src.gather, r, c) else {
        return vec![];
    };
    vec![Hyp {
        kind: "transposed",
        gather,
        summary: format!(
            "transposed: holds {} transposed (written as {shape:?} instead of {swapped:?})",
            src.desc
        ),
        permutation: None,
        layer: None,
        extra: vec![],
    }]
    .into_iter()
    .map(|mut h| {
        if r == c {
            h.summary = format!(
                "transposed: holds {} transposed (square, so the shape could not tell)",
                src.desc
            );
        }
        h
    })
    .collect()
}

/// Rows of the reference `kv_b` (`[H * (nope + v), kv_lora]`) as a gather, where the reference has one.
fn reference_kvb(ctx: &Ctx<'_>, l: usize, d: &Dims) -> Option<(Gather, String)> {
    match ctx.kind {
        RefKind::Hf => {
            let n = format!("model.layers.{l}.self_attn.kv_b_proj.weight");
            ctx.refs.meta(&n)?;
            Some((
                Gather::Rows {
                    name: n.clone(),
                    start: 0,
                },
                n,
            ))
        }
        RefKind::Gguf => {
            let kvb = format!("blk.{l}.{KV_B}");
            if ctx.refs.meta(&kvb).is_some() {
                return Some((
                    Gather::Rows {
                        name: kvb.clone(),
                        start: 0,
                    },
                    kvb,
                ));
            }
            let shape = [d.n_head * (d.nope + d.v), d.kv_lora];
            match mapping::resolve(&kvb, &shape, ctx.refs, ctx.kind, Some(d)) {
                Resolved::Found(s) => Some((s.gather, s.desc)),
                _ => None,
            }
        }
    }
}

fn kv_concat(ctx: &Ctx<'_>, name: &str, shape: &[u64]) -> Vec<Hyp> {
    let Some((l, suffix)) = split_blk(name) else {
        return vec![];
    };
    if ![K_B, V_B, KV_B].contains(&suffix) {
        return vec![];
    }
    let Some(d) = ctx.dims else { return vec![] };
    let Some((kvb, desc)) = reference_kvb(ctx, l, &d) else {
        return vec![];
    };
    let (h, nope, v, kvl) = (d.n_head, d.nope, d.v, d.kv_lora);
    let gather = match suffix {
        K_B if shape == [h, kvl, nope] => Gather::TransposedOf {
            inner: Box::new(kvb),
            inner_row_len: kvl,
            width: kvl,
            len: nope,
            stride: nope,
            offset: 0,
        },
        V_B if shape == [h, v, kvl] => Gather::Mapped {
            inner: Box::new(kvb),
            rows: (0..h * v).map(|i| h * nope + i).collect(),
        },
        // The file's rows are all K rows (head by head), then all V rows.
        KV_B if shape == [h * (nope + v), kvl] => Gather::Mapped {
            inner: Box::new(kvb),
            rows: (0..h * (nope + v))
                .map(|r| {
                    if r < h * nope {
                        (r / nope) * (nope + v) + r % nope
                    } else {
                        let q = r - h * nope;
                        (q / v) * (nope + v) + nope + q % v
                    }
                })
                .collect(),
        },
        _ => return vec![],
    };
    let summary = if suffix == KV_B {
        format!(
            "K/V concatenated instead of interleaved per head: the rows are all {h}x{nope} K rows, then all {h}x{v} V rows ({desc} is [K_h | V_h] per head)"
        )
    } else {
        format!(
            "K/V concatenated instead of interleaved per head: {desc} was split as all {h}x{nope} K rows, then all {h}x{v} V rows (it is [K_h | V_h] per head)"
        )
    };
    vec![Hyp {
        kind: "kv_b_concatenated",
        gather,
        summary,
        permutation: None,
        layer: None,
        extra: vec![],
    }]
}

/// Matches groups of rows (or columns) of the GGUF tensor to groups of the reference by their
/// first values; `Some(perm)` when the matches form a permutation other than the identity.
fn find_perm(
    ctx: &Ctx<'_>,
    name: &str,
    base: &Gather,
    groups: u64,
    row_len: u64,
    by_cols: bool,
    group_size: u64,
) -> Result<Option<Vec<u64>>> {
    if groups < 2 {
        return Ok(None);
    }
    let (left, right): (Vec<Vec<f32>>, Vec<Vec<f32>>) = if by_cols {
        let k = (SKETCH_VALUES / group_size.max(1)).max(1);
        let rows = 0..k.min(ctx.left.meta(name).map_or(0, |m| m.rows()));
        let a = ctx.left.read(name, rows.clone(), 0..row_len, false)?.vals;
        let b = match base.read(ctx.refs, rows, row_len, false) {
            Ok(b) => b.vals,
            Err(_) => return Ok(None),
        };
        let split = |v: &[f32]| -> Vec<Vec<f32>> {
            (0..groups)
                .map(|g| {
                    v.chunks_exact(row_len as usize)
                        .flat_map(|r| {
                            r[(g * group_size) as usize..((g + 1) * group_size) as usize]
                                .iter()
                                .copied()
                        })
                        .collect()
                })
                .collect()
        };
        (split(&a), split(&b))
    } else {
        let k = (SKETCH_VALUES / row_len.max(1)).clamp(1, group_size);
        let mut l = Vec::new();
        let mut r = Vec::new();
        for g in 0..groups {
            let rows = g * group_size..g * group_size + k;
            l.push(ctx.left.read(name, rows.clone(), 0..row_len, false)?.vals);
            match base.read(ctx.refs, rows, row_len, false) {
                Ok(b) => r.push(b.vals),
                Err(_) => return Ok(None),
            }
        }
        (l, r)
    };
    let mut perm = Vec::with_capacity(groups as usize);
    for a in &left {
        let mut best = (f64::INFINITY, 0u64);
        for (f, b) in right.iter().enumerate() {
            let (mut d2, mut r2) = (0f64, 0f64);
            for (&x, &y) in a.iter().zip(b) {
                let (x, y) = (f64::from(x), f64::from(y));
                d2 += (x - y) * (x - y);
                r2 += y * y;
            }
            let nmse = if r2 > 0.0 { d2 / r2 } else { f64::INFINITY };
            if nmse < best.0 {
                best = (nmse, f as u64);
            }
        }
        perm.push(best.1);
    }
    let mut seen = vec![false; groups as usize];
    for &p in &perm {
        if std::mem::replace(&mut seen[p as usize], true) {
            return Ok(None);
        }
    }
    if perm.iter().enumerate().all(|(i, &p)| i as u64 == p) {
        return Ok(None);
    }
    Ok(Some(perm))
}

/// Sample rows covering the first moved groups of a row permutation (a few rows of each, at
/// most [`SAMPLE_VALUES`] values in all); none for column groups, which every row crosses.
fn moved_rows(perm: &[u64], group: u64, row_len: u64, by_cols: bool) -> Vec<Range<u64>> {
    if by_cols {
        return vec![];
    }
    let moved: Vec<u64> = (0..perm.len() as u64)
        .filter(|&i| perm[i as usize] != i)
        .take(16)
        .collect();
    let per = (SAMPLE_VALUES / moved.len().max(1) as u64 / row_len.max(1)).clamp(1, group);
    moved.iter().map(|&g| g * group..g * group + per).collect()
}

/// `i<-p` for every moved group.
fn moved(perm: &[u64]) -> String {
    let m: Vec<String> = perm
        .iter()
        .enumerate()
        .filter(|(i, &p)| *i as u64 != p)
        .map(|(i, p)| format!("{i}<-{p}"))
        .collect();
    let shown: Vec<&str> = m.iter().take(12).map(String::as_str).collect();
    format!(
        "{} of {} moved: {}{}",
        m.len(),
        perm.len(),
        shown.join(", "),
        if m.len() > shown.len() { ", ..." } else { "" }
    )
}

fn experts_permuted(ctx: &Ctx<'_>, name: &str, shape: &[u64], base: &Resolved) -> Result<Vec<Hyp>> {
    let Some((_, suffix)) = split_blk(name) else {
        return Ok(vec![]);
    };
    if !suffix.ends_with("_exps.weight") {
        return Ok(vec![]);
    }
    let (Resolved::Found(src), [e, per, c]) = (base, shape) else {
        return Ok(vec![]);
    };
    let Some(perm) = find_perm(ctx, name, &src.gather, *e, *c, false, *per)? else {
        return Ok(vec![]);
    };
    Ok(vec![Hyp {
        kind: "experts_permuted",
        gather: Gather::Mapped {
            inner: Box::new(src.gather.clone()),
            rows: group_rows(&perm, *per),
        },
        summary: format!(
            "experts permuted: GGUF expert i holds reference expert perm[i] ({})",
            moved(&perm)
        ),
        extra: moved_rows(&perm, *per, *c, false),
        permutation: Some(perm),
        layer: None,
    }])
}

fn gate_up(ctx: &Ctx<'_>, name: &str, shape: &[u64]) -> Vec<Hyp> {
    let Some((l, suffix)) = split_blk(name) else {
        return vec![];
    };
    let other = if let Some(rest) = suffix.strip_prefix("ffn_gate") {
        format!("ffn_up{rest}")
    } else if let Some(rest) = suffix.strip_prefix("ffn_up") {
        format!("ffn_gate{rest}")
    } else {
        return vec![];
    };
    if other.starts_with("ffn_gate_inp") || suffix.starts_with("ffn_gate_inp") {
        return vec![];
    }
    let sib = format!("blk.{l}.{other}");
    match mapping::resolve(&sib, shape, ctx.refs, ctx.kind, ctx.dims.as_ref()) {
        Resolved::Found(s) => vec![Hyp {
            kind: "gate_up_swapped",
            gather: s.gather,
            summary: format!("gate/up swapped: holds {} (the {sib} source)", s.desc),
            permutation: None,
            layer: None,
            extra: vec![],
        }],
        _ => vec![],
    }
}

fn head_order(ctx: &Ctx<'_>, name: &str, shape: &[u64], base: &Resolved) -> Result<Vec<Hyp>> {
    let (Some((_, suffix)), Resolved::Found(src)) = (split_blk(name), base) else {
        return Ok(vec![]);
    };
    let row_len = shape.last().copied().unwrap_or(1);
    let rows: u64 = shape.iter().rev().skip(1).product();
    let heads = match suffix {
        "indexer.attn_q_b.weight" => ctx.index_heads,
        _ => ctx.dims.map(|d| d.n_head).or(match (suffix, shape) {
            (K_B | V_B, [h, _, _]) => Some(*h),
            _ => None,
        }),
    };
    let Some(h) = heads.filter(|&h| h > 1) else {
        return Ok(vec![]);
    };
    let by_cols = match suffix {
        "attn_output.weight" => true,
        "attn_q_b.weight" | K_B | V_B | KV_B | "indexer.attn_q_b.weight" => false,
        _ => return Ok(vec![]),
    };
    let total = if by_cols { row_len } else { rows };
    if total % h != 0 {
        return Ok(vec![]);
    }
    let gs = total / h;
    let Some(perm) = find_perm(ctx, name, &src.gather, h, row_len, by_cols, gs)? else {
        return Ok(vec![]);
    };
    let gather = if by_cols {
        Gather::ColMapped {
            inner: Box::new(src.gather.clone()),
            cols: group_rows(&perm, gs),
        }
    } else {
        Gather::Mapped {
            inner: Box::new(src.gather.clone()),
            rows: group_rows(&perm, gs),
        }
    };
    Ok(vec![Hyp {
        kind: "head_order",
        gather,
        summary: format!(
            "wrong head order: GGUF head i holds reference head perm[i] ({})",
            moved(&perm)
        ),
        extra: moved_rows(&perm, gs, row_len, by_cols),
        permutation: Some(perm),
        layer: None,
    }])
}

fn layer_shift(ctx: &Ctx<'_>, name: &str, shape: &[u64]) -> Vec<Hyp> {
    let Some((l, suffix)) = split_blk(name) else {
        return vec![];
    };
    let n_layers = ctx
        .refs
        .names()
        .iter()
        .filter_map(|n| match ctx.kind {
            RefKind::Hf => mapping::gguf_names_for_hf(n)
                .first()
                .and_then(|g| split_blk(g).map(|x| x.0)),
            RefKind::Gguf => split_blk(n).map(|x| x.0),
        })
        .max()
        .map_or(0, |m| m + 1);
    let mut order: Vec<usize> = (0..n_layers).filter(|&x| x != l).collect();
    order.sort_by_key(|&x| (x.abs_diff(l), x));
    order
        .into_iter()
        .filter_map(|x| {
            let other = format!("blk.{x}.{suffix}");
            match mapping::resolve(&other, shape, ctx.refs, ctx.kind, ctx.dims.as_ref()) {
                Resolved::Found(s) => Some(Hyp {
                    kind: "layer_shift",
                    gather: s.gather,
                    summary: format!(
                        "layer off by {:+}: blk.{l} holds layer {x}'s {}",
                        x as i64 - l as i64,
                        s.desc
                    ),
                    permutation: None,
                    layer: Some(x),
                    extra: vec![],
                }),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_cover_the_tensor_without_overlap() {
        let s = sample(100_000, 64);
        assert_eq!(s.len(), 8);
        assert_eq!(s[0], 0..512);
        assert_eq!(s.last().unwrap().end, 100_000);
        assert_eq!(
            (sample(1000, 64).len(), sample(1000, 64)[0].clone()),
            (1, 0..1000)
        );
        assert!(s.windows(2).all(|w| w[0].end <= w[1].start));
        assert_eq!((sample(3, 64).len(), sample(3, 64)[0].clone()), (1, 0..3));
        assert_eq!(moved(&[1, 0, 2]), "2 of 3 moved: 0<-1, 1<-0");
    }
}
