//! The chained state a hook passes on to the steps that read it ([`Chain`]), and the sums it is
//! measured with: the error over the rows a selection difference does not reach
//! ([`masked_error`]), a tensor's norm ([`l2`]), which steps read other rows ([`mixes_rows`]).

use std::collections::BTreeSet;

use rayon::prelude::*;

use super::floors::point_of;
use crate::tensor::HostTensor;

/// Chained: what a hook passes on to the steps that read it.
#[derive(Clone, Debug, Default)]
pub(super) struct Chain {
    /// Rows (tokens) that a selection difference the reference's chain did not follow reaches:
    /// they differ for that reason, and are not judged again.
    pub(super) touched: BTreeSet<usize>,
    /// Of those, the rows this hook's own selection difference added (following it drops them).
    pub(super) own: BTreeSet<usize>,
    /// The chained error over the other rows (0 for selections); for a hook the candidate
    /// lacks, what stands for it: what its inputs carry, passed on by its step, composed with
    /// its floor as a segment's floor is (`floors::segment_floor`).
    pub(super) clean: f64,
    /// `|reference|` (how much of a residual add it weighs).
    pub(super) norm: f64,
    /// The candidate lacks the hook: `clean` is that estimate, not a measurement.
    pub(super) estimated: bool,
    /// Where the difference of the touched rows started (hook, token, margin).
    pub(super) origin: Option<String>,
    /// A selection the candidate lacks: the rows whose near tie it may have taken otherwise
    /// (touched until the selection's consumer shows whether they did).
    pub(super) possible: BTreeSet<usize>,
    /// Each token's chained error as the token criterion judges it (metrics'
    /// `per_token_judged`), where the hook was measured with a row per token and no row
    /// touched; for the inputs of a step (`Comparison::upstream_chained`), the largest any
    /// input carries into that token (through attention: any earlier token's key or value).
    /// Empty when unknown.
    pub(super) per_token: Vec<f64>,
}

/// Whether the step producing hook `name` reads other rows than its own through its input
/// `input`: attention reads the keys and values of every earlier token (`kv_a_norm`,
/// `k_pe_rope`), the index scores every earlier token's key (from `attn_norm`).
pub(super) fn mixes_rows(name: &str, input: &str) -> bool {
    matches!(
        (point_of(name), point_of(input)),
        (
            "attn_heads" | "attn_probs",
            "kv_a_norm" | "k_pe_rope" | "kv_a"
        ) | ("indexer_scores", "attn_norm")
    )
}

/// Relative L2 error of `candidate` against `reference` over the rows of the first axis not in
/// `skip`; NaN when no row is left, the values are not floats or the shapes differ.
pub(super) fn masked_error(
    reference: &HostTensor,
    candidate: &HostTensor,
    skip: &BTreeSet<usize>,
) -> f64 {
    let (Ok(r), Ok(c)) = (reference.as_f32(""), candidate.as_f32("")) else {
        return f64::NAN;
    };
    let rows = reference.shape.first().copied().unwrap_or(0);
    if reference.shape != candidate.shape || rows == 0 || skip.len() >= rows {
        return f64::NAN;
    }
    let w = r.len() / rows;
    // By row on the threads, the rows' sums added in row order.
    let sums: Vec<(f64, f64)> = (0..rows)
        .into_par_iter()
        .filter(|t| !skip.contains(t))
        .map(|t| {
            let (mut d2, mut r2) = (0f64, 0f64);
            for (&a, &b) in r[t * w..(t + 1) * w].iter().zip(&c[t * w..(t + 1) * w]) {
                if a.is_finite() && b.is_finite() {
                    let (a, b) = (f64::from(a), f64::from(b));
                    d2 += (b - a) * (b - a);
                    r2 += a * a;
                }
            }
            (d2, r2)
        })
        .collect();
    let (d2, r2) = sums
        .iter()
        .fold((0f64, 0f64), |(x, y), (d, r)| (x + d, y + r));
    if r2 > 0.0 {
        (d2 / r2).sqrt()
    } else if d2 > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// `|t|`, the L2 norm of a float tensor's finite values (0 for ids); summed in chunks on the
/// threads, the chunks' sums in order.
pub(super) fn l2(t: &HostTensor) -> f64 {
    t.as_f32("")
        .map(|v| {
            let sums: Vec<f64> = v
                .par_chunks(1 << 16)
                .map(|c| {
                    c.iter()
                        .filter(|x| x.is_finite())
                        .map(|&x| f64::from(x) * f64::from(x))
                        .sum::<f64>()
                })
                .collect();
            sums.iter().sum::<f64>().sqrt()
        })
        .unwrap_or(0.0)
}
