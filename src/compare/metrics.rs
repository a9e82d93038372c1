//! Metrics of one hook: a candidate tensor against the reference's.
//!
//! Floats ([`FloatMetrics`]): with `a` the candidate and `b` the reference, over the positions
//! where the reference is finite:
//! - `max_abs = max |a - b|` and where (a multi-index in the hook's shape),
//! - `max_rel = max |a - b| / max |b|` (relative to the reference's largest magnitude, so that
//!   values near zero do not blow it up),
//! - `nmse = sum (a - b)^2 / sum b^2` and `rel_l2 = sqrt(nmse)` (what the floors bound),
//! - `cosine = a.b / (|a| |b|)`,
//! - NaN and Inf counts on each side, and `nonfinite_mismatch`: positions where exactly one side
//!   is non-finite or both are but differ. Positions where both hold the same infinity (the `-inf`
//!   above the diagonal of `indexer_scores`) are masks, not errors,
//! - per token (first axis) relative L2.
//!
//! Index sets ([`IdMetrics`], `moe_topk_ids`, `indexer_topk`: `[T, k]`, -1 padding): rows equal in
//! order, rows equal as sets, mean and smallest Jaccard similarity, and the differing rows.
//! Everything is accumulated in f64.

use rayon::prelude::*;
use serde::Serialize;

use crate::tensor::{HostData, HostTensor};

/// Float metrics of one hook (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FloatMetrics {
    /// Elements compared (the reference's finite positions).
    pub n: usize,
    /// `max |a - b|`.
    pub max_abs: f64,
    /// Where `max_abs` is, as an index per dimension.
    pub max_abs_at: Vec<usize>,
    /// `max |a - b| / max |b|` (0 when both are zero everywhere).
    pub max_rel: f64,
    /// `sum (a-b)^2 / sum b^2` (0 when identical, infinite when b is zero and a is not).
    pub nmse: f64,
    /// `sqrt(nmse)`.
    pub rel_l2: f64,
    /// Cosine similarity (1 when both are zero).
    pub cosine: f64,
    /// NaN counts: reference, candidate.
    pub nan: [usize; 2],
    /// Inf counts: reference, candidate.
    pub inf: [usize; 2],
    /// Positions where the two sides disagree about being finite (or hold different non-finite
    /// values).
    pub nonfinite_mismatch: usize,
    /// Relative L2 error per token (per index of the first axis).
    pub per_token: Vec<f64>,
    /// Per token, the error judged by the token criterion: relative to the larger of the row's
    /// own norm and [`SMALL_ROW`] times the tensor's RMS row norm (not in the JSON).
    #[serde(skip)]
    pub per_token_judged: Vec<f64>,
}

/// A row whose reference norm is below this share of the tensor's RMS row norm (a sum that
/// cancelled, as a DSA index score over heads with weights of both signs can) is judged by its
/// error relative to that share: its rounding error is set by the size of the terms it summed,
/// not by its small result. Rows of normal size are judged by their own norm.
pub const SMALL_ROW: f64 = 0.25;

impl FloatMetrics {
    /// The token (first index) with the largest relative error, and that error.
    pub fn worst_token(&self) -> Option<(usize, f64)> {
        worst(&self.per_token)
    }

    /// The token with the largest error as the token criterion judges it ([`SMALL_ROW`]).
    pub fn worst_token_judged(&self) -> Option<(usize, f64)> {
        worst(&self.per_token_judged)
    }
}

/// The largest value and its index (NaN never wins).
fn worst(v: &[f64]) -> Option<(usize, f64)> {
    v.iter()
        .copied()
        .enumerate()
        .fold(None, |best, (i, e)| match best {
            Some((_, b)) if b >= e || e.is_nan() => best,
            _ => Some((i, e)),
        })
}

/// Index-set metrics of one selection hook (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IdMetrics {
    /// Rows compared.
    pub rows: usize,
    /// Rows identical in order.
    pub exact_rows: usize,
    /// Rows equal as sets.
    pub set_equal_rows: usize,
    /// Mean Jaccard similarity over rows (1 = identical sets).
    pub mean_jaccard: f64,
    /// Smallest Jaccard similarity.
    pub min_jaccard: f64,
    /// Rows whose sets differ (the first 64).
    pub differing_rows: Vec<usize>,
}

/// Metrics of a hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Metrics {
    /// Float values.
    Float(FloatMetrics),
    /// Index sets.
    Ids(IdMetrics),
}

impl Metrics {
    /// The headline error: relative L2 for floats, `1 - mean Jaccard` for index sets.
    pub fn error(&self) -> f64 {
        match self {
            Metrics::Float(m) => m.rel_l2,
            Metrics::Ids(m) => 1.0 - m.mean_jaccard,
        }
    }
}

/// Compares two tensors of one hook. Index tensors (i32 on both sides) give [`IdMetrics`]; a
/// shape mismatch or a float/int mismatch is an `Err` with a sentence saying so.
pub fn compare(reference: &HostTensor, candidate: &HostTensor) -> Result<Metrics, String> {
    if reference.shape != candidate.shape {
        return Err(format!(
            "shape {:?} against the reference's {:?}",
            candidate.shape, reference.shape
        ));
    }
    match (&reference.data, &candidate.data) {
        (HostData::F32(b), HostData::F32(a)) => {
            Ok(Metrics::Float(float_metrics(&reference.shape, a, b)))
        }
        (HostData::I32(b), HostData::I32(a)) => {
            let width = reference.shape.last().copied().unwrap_or(1);
            Ok(Metrics::Ids(id_metrics(a, b, width)))
        }
        (HostData::I32(_), HostData::F32(_)) => {
            Err("floats where the reference has indices".to_string())
        }
        (HostData::F32(_), HostData::I32(_)) => {
            Err("indices where the reference has floats".to_string())
        }
    }
}

/// Whole rows of about this many elements make one chunk of [`float_metrics`]: each chunk is
/// summed in index order and the chunks' sums in chunk order, so the bits do not depend on how
/// many threads run them.
const CHUNK_ELEMENTS: usize = 1 << 16;

/// One chunk's share of [`FloatMetrics`]: its rows' sums and counts.
#[derive(Default)]
struct Chunk {
    n: usize,
    nan: [usize; 2],
    inf: [usize; 2],
    nonfinite_mismatch: usize,
    /// `sum d^2`, `sum b^2`, `sum a^2`, `sum a b`.
    sums: [f64; 4],
    bmax: f64,
    /// The first largest `|d|` and its flat index.
    max_abs: f64,
    at: usize,
    row_d2: Vec<f64>,
    row_b2: Vec<f64>,
}

/// Float metrics of candidate `a` against reference `b` (same length, shape `shape`), in
/// chunks of whole rows on the threads.
pub fn float_metrics(shape: &[usize], a: &[f32], b: &[f32]) -> FloatMetrics {
    let n_all: usize = shape.iter().product::<usize>().min(a.len()).min(b.len());
    let rows = shape.first().copied().unwrap_or(1).max(1);
    let per_row = (n_all / rows).max(1);
    let chunk_rows = (CHUNK_ELEMENTS / per_row).max(1);
    let chunks: Vec<Chunk> = (0..rows.div_ceil(chunk_rows))
        .into_par_iter()
        .map(|k| {
            let (r0, r1) = (k * chunk_rows, ((k + 1) * chunk_rows).min(rows));
            let mut c = Chunk {
                row_d2: vec![0f64; r1 - r0],
                row_b2: vec![0f64; r1 - r0],
                ..Chunk::default()
            };
            // The last row takes whatever is left of a length that is not rows * per_row.
            let end = if r1 == rows { n_all } else { r1 * per_row };
            for i in (r0 * per_row).min(end)..end {
                let (x, y) = (f64::from(a[i]), f64::from(b[i]));
                c.nan[0] += usize::from(y.is_nan());
                c.nan[1] += usize::from(x.is_nan());
                c.inf[0] += usize::from(y.is_infinite());
                c.inf[1] += usize::from(x.is_infinite());
                if !y.is_finite() || !x.is_finite() {
                    // Same infinity on both sides: a mask. Anything else: a mismatch.
                    if !(x == y && x.is_infinite()) {
                        c.nonfinite_mismatch += 1;
                    }
                    continue;
                }
                c.n += 1;
                let d = x - y;
                if d.abs() > c.max_abs {
                    c.max_abs = d.abs();
                    c.at = i;
                }
                c.bmax = c.bmax.max(y.abs());
                c.sums[0] += d * d;
                c.sums[1] += y * y;
                c.sums[2] += x * x;
                c.sums[3] += x * y;
                let r = (i / per_row).min(rows - 1) - r0;
                c.row_d2[r] += d * d;
                c.row_b2[r] += y * y;
            }
            c
        })
        .collect();
    let mut m = FloatMetrics {
        n: 0,
        max_abs: 0.0,
        max_abs_at: Vec::new(),
        max_rel: 0.0,
        nmse: 0.0,
        rel_l2: 0.0,
        cosine: 1.0,
        nan: [0, 0],
        inf: [0, 0],
        nonfinite_mismatch: 0,
        per_token: Vec::new(),
        per_token_judged: Vec::new(),
    };
    let (mut sums, mut bmax, mut at) = ([0f64; 4], 0f64, 0usize);
    let mut row_d2 = Vec::with_capacity(rows);
    let mut row_b2 = Vec::with_capacity(rows);
    for c in chunks {
        m.n += c.n;
        for k in 0..2 {
            m.nan[k] += c.nan[k];
            m.inf[k] += c.inf[k];
        }
        m.nonfinite_mismatch += c.nonfinite_mismatch;
        for (s, x) in sums.iter_mut().zip(c.sums) {
            *s += x;
        }
        bmax = bmax.max(c.bmax);
        if c.max_abs > m.max_abs {
            m.max_abs = c.max_abs;
            at = c.at;
        }
        row_d2.extend(c.row_d2);
        row_b2.extend(c.row_b2);
    }
    let [d2, b2, a2, ab] = sums;
    m.max_abs_at = unravel(at, shape);
    m.max_rel = ratio(m.max_abs, bmax);
    m.nmse = ratio(d2, b2);
    m.rel_l2 = m.nmse.sqrt();
    m.cosine = if a2 == 0.0 && b2 == 0.0 {
        1.0
    } else if a2 == 0.0 || b2 == 0.0 {
        0.0
    } else {
        ab / (a2.sqrt() * b2.sqrt())
    };
    m.per_token = row_d2
        .iter()
        .zip(&row_b2)
        .map(|(&d, &b)| ratio(d, b).sqrt())
        .collect();
    let small = SMALL_ROW * SMALL_ROW * b2 / rows as f64;
    m.per_token_judged = row_d2
        .iter()
        .zip(&row_b2)
        .map(|(&d, &b)| ratio(d, b.max(small)).sqrt())
        .collect();
    m
}

/// A column needs this many finite values in the rows judged before it is judged on its own
/// (as the sub-floor tests need rows): a column of one or two values is one or two rounding
/// errors, whose tail the floor's safety factor is not made for.
pub const MIN_COLUMN_ROWS: usize = 8;

/// One column of a `[rows, cols]` tensor, judged as [`FloatMetrics::per_token_judged`] judges
/// a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColumnError {
    /// Column (last index).
    pub col: usize,
    /// Finite values of the column in the rows judged.
    pub rows: usize,
    /// Its relative L2 error, against the larger of its own norm and [`SMALL_ROW`] times the
    /// typical column's norm over as many values.
    pub error: f64,
}

/// The column (last axis; leading axes are rows) with the largest judged relative error of
/// candidate `a` against reference `b`, over the rows not in `skip_rows` and the columns not
/// in `skip_cols` with at least [`MIN_COLUMN_ROWS`] finite values on both sides. A column is a
/// key of the DSA index scores or an expert of the router probabilities: a bug in one key or
/// one expert hides in the whole tensor's error as one token's does.
pub fn worst_column_judged(
    shape: &[usize],
    a: &[f32],
    b: &[f32],
    skip_rows: &std::collections::BTreeSet<usize>,
    skip_cols: &std::collections::BTreeSet<usize>,
) -> Option<ColumnError> {
    let cols = *shape.last()?;
    if shape.len() < 2 || cols == 0 {
        return None;
    }
    let n = shape.iter().product::<usize>().min(a.len()).min(b.len());
    // Per column: sum d^2, sum b^2, finite values.
    let mut d2 = vec![0f64; cols];
    let mut b2 = vec![0f64; cols];
    let mut cnt = vec![0usize; cols];
    for (t, (ra, rb)) in a[..n].chunks(cols).zip(b[..n].chunks(cols)).enumerate() {
        if skip_rows.contains(&t) {
            continue;
        }
        for (j, (&x, &y)) in ra.iter().zip(rb).enumerate() {
            if !x.is_finite() || !y.is_finite() {
                continue;
            }
            let (x, y) = (f64::from(x), f64::from(y));
            d2[j] += (x - y) * (x - y);
            b2[j] += y * y;
            cnt[j] += 1;
        }
    }
    let judged: Vec<usize> = (0..cols)
        .filter(|j| cnt[*j] >= MIN_COLUMN_ROWS && !skip_cols.contains(j))
        .collect();
    let (sb, sn) = judged
        .iter()
        .fold((0f64, 0usize), |(s, k), &j| (s + b2[j], k + cnt[j]));
    if sn == 0 {
        return None;
    }
    // The typical value's square; a column is judged against SMALL_ROW of a typical column of
    // as many values.
    let typical = sb / sn as f64;
    judged
        .iter()
        .map(|&j| ColumnError {
            col: j,
            rows: cnt[j],
            error: ratio(
                d2[j],
                b2[j].max(SMALL_ROW * SMALL_ROW * typical * cnt[j] as f64),
            )
            .sqrt(),
        })
        .fold(None, |best: Option<ColumnError>, c| match best {
            Some(b) if b.error >= c.error || c.error.is_nan() => Some(b),
            _ => Some(c),
        })
}

/// `num / den` with `0/0 = 0` and `x/0 = inf`.
fn ratio(num: f64, den: f64) -> f64 {
    if num == 0.0 {
        0.0
    } else if den == 0.0 {
        f64::INFINITY
    } else {
        num / den
    }
}

/// The multi-index of flat index `i` in `shape`.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    for (o, &d) in out.iter_mut().zip(shape).rev() {
        if d > 0 {
            *o = i % d;
            i /= d;
        }
    }
    out
}

/// Index-set metrics of candidate rows `a` against reference rows `b` (`width` per row; negative
/// entries are padding).
pub fn id_metrics(a: &[i32], b: &[i32], width: usize) -> IdMetrics {
    let w = width.max(1);
    let mut m = IdMetrics {
        rows: 0,
        exact_rows: 0,
        set_equal_rows: 0,
        mean_jaccard: 1.0,
        min_jaccard: 1.0,
        differing_rows: Vec::new(),
    };
    // Each row's similarity on the threads; summed in row order (the same sum as one at a time).
    let rows: Vec<(bool, f64)> = a
        .par_chunks(w)
        .zip(b.par_chunks(w))
        .map(|(ra, rb)| (ra == rb, jaccard(ra, rb)))
        .collect();
    let mut sum = 0f64;
    for (r, (exact, j)) in rows.into_iter().enumerate() {
        m.rows += 1;
        if exact {
            m.exact_rows += 1;
        }
        if j == 1.0 {
            m.set_equal_rows += 1;
        } else if m.differing_rows.len() < 64 {
            m.differing_rows.push(r);
        }
        m.min_jaccard = m.min_jaccard.min(j);
        sum += j;
    }
    if m.rows > 0 {
        m.mean_jaccard = sum / m.rows as f64;
    }
    m
}

pub use crate::trace::row_set;

/// Jaccard similarity `|A ∩ B| / |A ∪ B|` of two rows' sets (1 when both are empty).
pub fn jaccard(a: &[i32], b: &[i32]) -> f64 {
    let (sa, sb) = (row_set(a), row_set(b));
    let inter = sa.iter().filter(|x| sb.binary_search(x).is_ok()).count();
    let union = sa.len() + sb.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(shape: Vec<usize>, v: Vec<f32>) -> HostTensor {
        HostTensor::f32(shape, v).unwrap()
    }

    #[test]
    fn small_rows_are_judged_against_a_quarter_of_the_typical_row() {
        // reference rows [3, 4] (norm 5) and [0.01, 0] (a cancelled sum); candidate off by 1e-3
        // in the small row. Its own relative error is 0.1; the RMS row norm is
        // sqrt((25 + 1e-4) / 2), a quarter of it 0.884, so it is judged at 1e-3 / 0.884.
        let m = compare(
            &f(vec![2, 2], vec![3.0, 4.0, 0.01, 0.0]),
            &f(vec![2, 2], vec![3.0, 4.0, 0.011, 0.0]),
        )
        .unwrap();
        let Metrics::Float(m) = m else { panic!() };
        assert!((m.per_token[1] - 0.1).abs() < 1e-5, "{:?}", m.per_token);
        let quarter = SMALL_ROW * ((25.0 + 1e-4) / 2f64).sqrt();
        let (t, e) = m.worst_token_judged().unwrap();
        assert_eq!(t, 1);
        assert!((e - 1e-3 / quarter).abs() < 1e-6, "{e}");
        // A row of normal size keeps its own relative error.
        assert_eq!(m.per_token_judged[0], m.per_token[0]);
    }

    #[test]
    fn worst_column_by_hand() {
        use std::collections::BTreeSet;
        // 10 rows x 3 columns: column 0 all 1.0, column 1 all 2.0, column 2 all 0.01 (far
        // smaller than the typical column). The candidate adds 0.1 to every value of column 0,
        // 0.01 to column 1, 0.001 to column 2; row 9 is masked (-inf) in column 1.
        let (rows, cols) = (10, 3);
        let mut b = Vec::new();
        let mut a = Vec::new();
        for t in 0..rows {
            b.extend([1.0f32, if t == 9 { f32::NEG_INFINITY } else { 2.0 }, 0.01]);
            a.extend([1.1f32, if t == 9 { f32::NEG_INFINITY } else { 2.01 }, 0.011]);
        }
        let none = BTreeSet::new();
        let c = worst_column_judged(&[rows, cols], &a, &b, &none, &none).unwrap();
        // Column 0: 0.1 relative. Column 1 (9 values): 0.005. Column 2: |d| = 0.001 per value
        // against SMALL_ROW of the typical value, typical^2 = (10 * 1 + 9 * 4 + 10 * 1e-4) / 29.
        let typical = ((10.0 + 36.0 + 10.0 * 1e-4) / 29.0f64).sqrt();
        let c2 = 1e-3 / (SMALL_ROW * typical);
        assert!(c2 < 0.1);
        assert_eq!((c.col, c.rows), (0, 10));
        assert!((c.error - 0.1).abs() < 1e-6, "{}", c.error);
        // Rows left out make every column too short to judge (7 < MIN_COLUMN_ROWS values).
        let skip: BTreeSet<usize> = (0..3).collect();
        assert_eq!(
            worst_column_judged(&[rows, cols], &a, &b, &skip, &none),
            None
        );
        // Without column 0: column 1 (0.005) is worse than column 2 (c2 = 0.0032, against
        // the typical of columns 1 and 2 only).
        let typical = ((36.0 + 10.0 * 1e-4) / 19.0f64).sqrt();
        let c2 = 1e-3 / (SMALL_ROW * typical);
        let c = worst_column_judged(&[rows, cols], &a, &b, &none, &BTreeSet::from([0])).unwrap();
        assert!(c2 < 0.005, "{c2}");
        assert_eq!((c.col, c.rows), (1, 9));
        assert!((c.error - 0.005).abs() < 1e-6, "{}", c.error);
    }

    #[test]
    fn float_metrics_by_hand() {
        // reference b = [[3, 4], [0, 0]], candidate a = [[3, 4], [0, 1]].
        // d = [0, 0, 0, 1]: max_abs 1 at (1, 1); max|b| = 4 -> max_rel 0.25;
        // nmse = 1 / 25 = 0.04, rel_l2 = 0.2; a.b = 25, |a| = sqrt(26), |b| = 5 -> cos = 5/sqrt(26);
        // per token: row 0 exact (0), row 1 has |b| = 0 and |d| = 1 -> inf.
        let m = compare(
            &f(vec![2, 2], vec![3.0, 4.0, 0.0, 0.0]),
            &f(vec![2, 2], vec![3.0, 4.0, 0.0, 1.0]),
        )
        .unwrap();
        let Metrics::Float(m) = m else { panic!() };
        assert_eq!(m.n, 4);
        assert_eq!(m.max_abs, 1.0);
        assert_eq!(m.max_abs_at, vec![1, 1]);
        assert_eq!(m.max_rel, 0.25);
        assert!((m.nmse - 0.04).abs() < 1e-15);
        assert!((m.rel_l2 - 0.2).abs() < 1e-15);
        assert!((m.cosine - 5.0 / 26f64.sqrt()).abs() < 1e-15);
        assert_eq!(m.per_token, vec![0.0, f64::INFINITY]);
        assert_eq!(m.worst_token(), Some((1, f64::INFINITY)));
    }

    /// In chunks on the threads, the metrics of a tensor of many chunks are what one pass in
    /// index order gives: counts, the first largest difference and where, the sums to their
    /// rounding.
    #[test]
    fn chunked_metrics_are_one_pass() {
        let (rows, cols) = (97, 3001);
        let mut s = 7u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32
        };
        let mut b: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let mut a: Vec<f32> = b.iter().map(|&x| x + 1e-3 * next()).collect();
        // Two equal largest differences, in different chunks: the first one is named.
        for i in [40_000, 250_000] {
            (a[i], b[i]) = (5.25, 0.25);
        }
        a[7] = f32::NAN;
        let m = float_metrics(&[rows, cols], &a, &b);
        let (mut d2, mut b2, mut n, mut max_abs, mut at) = (0f64, 0f64, 0, 0f64, 0);
        let mut per = vec![(0f64, 0f64); rows];
        for i in 0..rows * cols {
            let (x, y) = (f64::from(a[i]), f64::from(b[i]));
            if !x.is_finite() {
                continue;
            }
            n += 1;
            let d = x - y;
            if d.abs() > max_abs {
                (max_abs, at) = (d.abs(), i);
            }
            d2 += d * d;
            b2 += y * y;
            per[i / cols].0 += d * d;
            per[i / cols].1 += y * y;
        }
        assert_eq!((m.n, m.nan, m.nonfinite_mismatch), (n, [0, 1], 1));
        assert_eq!(
            (m.max_abs, m.max_abs_at.clone()),
            (max_abs, unravel(at, &[rows, cols]))
        );
        assert_eq!(at, 40_000);
        assert!((m.nmse - d2 / b2).abs() <= 1e-12 * m.nmse);
        for (t, &(d, y)) in per.iter().enumerate() {
            assert!((m.per_token[t] - (d / y).sqrt()).abs() <= 1e-12 * m.per_token[t]);
        }
    }

    #[test]
    fn identical_and_zero_tensors() {
        let z = f(vec![3], vec![0.0; 3]);
        let Metrics::Float(m) = compare(&z, &z).unwrap() else {
            panic!()
        };
        assert_eq!(
            (m.nmse, m.rel_l2, m.cosine, m.max_rel),
            (0.0, 0.0, 1.0, 0.0)
        );
        let Metrics::Float(m) = compare(&z, &f(vec![3], vec![0.0, 2.0, 0.0])).unwrap() else {
            panic!()
        };
        assert_eq!((m.nmse, m.cosine), (f64::INFINITY, 0.0));
    }

    #[test]
    fn masks_are_not_errors_but_new_non_finite_values_are() {
        let inf = f32::NEG_INFINITY;
        let b = f(vec![2, 2], vec![1.0, inf, 2.0, 3.0]);
        let a = f(vec![2, 2], vec![1.0, inf, 2.0, 3.0]);
        let Metrics::Float(m) = compare(&b, &a).unwrap() else {
            panic!()
        };
        assert_eq!((m.n, m.nonfinite_mismatch, m.inf), (3, 0, [1, 1]));
        assert_eq!(m.rel_l2, 0.0);
        let a = f(vec![2, 2], vec![f32::NAN, 0.0, 2.0, f32::INFINITY]);
        let Metrics::Float(m) = compare(&b, &a).unwrap() else {
            panic!()
        };
        // NaN where b = 1, 0 where b = -inf (mask filled), +inf where b = 3.
        assert_eq!(
            (m.nan, m.inf, m.nonfinite_mismatch, m.n),
            ([0, 1], [1, 1], 3, 1)
        );
    }

    #[test]
    fn id_metrics_by_hand() {
        // rows (width 3): [1 2 3] vs [1 2 3] exact; [3 2 1] vs [1 2 3] same set, other order;
        // [1 2 -1] vs [1 4 -1]: {1,2} vs {1,4}: J = 1/3.
        let b = [1, 2, 3, 1, 2, 3, 1, 2, -1];
        let a = [1, 2, 3, 3, 2, 1, 1, 4, -1];
        let m = id_metrics(&a, &b, 3);
        assert_eq!((m.rows, m.exact_rows, m.set_equal_rows), (3, 1, 2));
        assert!((m.mean_jaccard - (1.0 + 1.0 + 1.0 / 3.0) / 3.0).abs() < 1e-15);
        assert!((m.min_jaccard - 1.0 / 3.0).abs() < 1e-15);
        assert_eq!(m.differing_rows, vec![2]);
        assert_eq!(jaccard(&[-1, -1], &[-1, -1]), 1.0);
    }

    #[test]
    fn shape_and_kind_mismatches_are_explained() {
        let a = f(vec![2], vec![0.0, 1.0]);
        let b = f(vec![1, 2], vec![0.0, 1.0]);
        assert!(compare(&a, &b).unwrap_err().contains("[1, 2]"));
        let i = HostTensor::i32(vec![2], vec![0, 1]).unwrap();
        assert!(compare(&i, &a).unwrap_err().contains("floats"));
    }

    #[test]
    fn unravel_is_row_major() {
        assert_eq!(unravel(7, &[2, 2, 3]), vec![1, 0, 1]);
        assert_eq!(unravel(0, &[]), Vec::<usize>::new());
    }
}
