//! Systematic error: the part of a candidate's error that rounding cannot produce.
//!
//! A floor bounds the relative L2 error a correct engine's rounding leaves, with a margin of
//! about ten: a bug whose error is smaller passes it. But rounding error is unbiased and
//! uncorrelated with the signal, and the errors of small real bugs are not: a wrong constant is
//! a *gain* on the whole output (`c = g r`), a wrong block scale or a wrong expert scale is a
//! gain on some rows or some columns, a wrong head a gain on one head's block. Each such
//! component is a regression of the error `e = c - r` on the reference `r` over a group of
//! elements:
//!
//! ```text
//! a = sum(e r) / sum(r r)        (gain g = 1 + a)
//! ```
//!
//! and is judged by two numbers:
//! - **significance** `z = a / se(a)`, with `se` estimated from the data: the residual
//!   `u = e - a r` of the same elements, in a sandwich estimate clustered two ways, by rows
//!   (tokens: an input rounded once feeds every output of its row) and by columns (channels: a
//!   weight rounded once feeds every row of its column), `V = V_rows + V_cols - V_elements`
//!   (Cameron, Gelbach and Miller 2011), never below either one-way estimate. Clustering
//!   admits that rounding errors are correlated within a row and within a column, so a correct
//!   engine's rounding does not look significant however many elements there are. With few
//!   clusters the estimate is noisy; a cluster count below [`MIN_CLUSTERS`] inflates it by
//!   `G / (G - 1)` and the threshold stays high ([`Z_MIN`]);
//! - **size** `|a|`: a gain below [`MIN_GAIN`] is not named, however significant (a correct
//!   engine's bias: bf16 weights rounded once can tilt a row's output by 1e-4 in a consistent
//!   direction; see the measured line in the README's separation table).
//!
//! Components tested, each where the step allows:
//! - the whole tensor (an overall gain: a wrong constant, a scaled weight, a norm weight);
//! - each head's block of columns, where the hook has a head axis (`q_b`, `q_pe_rope`,
//!   `attn_heads`): one head scaled. A group's gain is named only when it differs from the
//!   overall gain by [`MIN_GAIN`] and by [`group_z`] of its own errors (the threshold raised
//!   for the number of heads tested);
//! - the directions of bug families the reference computes from the step's inputs
//!   ([`Direction`]): each routed expert's weighted contribution to `moe_routed` (one expert's
//!   output scaled: its coefficient is the scale minus one), and the change of `attn_heads`
//!   per relative change of the softmax scale (its coefficient is the scale's relative error).
//!   A coefficient is named at [`MIN_PART`] and [`group_z`] of its family's count.
//!
//! Not tested: one row's or one column's own gain. Measured on correct bf16 engines, both
//! exceed 1% at dozens of (clustered) standard errors: a column of a norm's output carries its
//! weight's bf16 rounding (up to 2^-8), and a row of a low-rank MLP's output carries the
//! rounding of its few intermediate activations, which a column-clustered estimate takes as
//! independent. Rounding can produce those, so they are not named.
//! Positions where either side is non-finite are left out (the `-inf` mask of the DSA scores).
//!
//! Cost: every sum runs over chunks of whole rows on the threads (`CHUNK_ELEMENTS`), each
//! chunk in index order and the chunks' sums in chunk order, so the bits do not depend on the
//! thread count; nothing is copied to f64 (a 4096-token hook holds 100M values). A direction
//! that is zero outside some rows (an expert's tokens) is fitted in time proportional to its
//! rows: outside them a score is `w0 r (e - a r)`, whose sums by row, by column and squared
//! follow from the hook's totals of `r^2`, `e r`, `r^4`, `r^3 e` and `r^2 e^2`, less the rows'
//! own share (`tests::chunked_and_sparse_fits_are_the_definition` checks both against the
//! element-by-element definition). A direction known only on a sample of rows (an attention's
//! directions past 1024 tokens, [`Direction::sampled`]) is fitted, with the overall gain, over
//! those rows alone: taken as zero on the others, the overall gain fitted there would take the
//! share of its change that lies along the reference.
//! Nothing here prints.

use crate::tensor::HostTensor;
use rayon::prelude::*;
use serde::Serialize;

/// Smallest gain named: `|g - 1|` below this is not a bug worth a verdict (a correct engine's
/// consistent bias stays below it: measured, README's separation table).
pub const MIN_GAIN: f64 = 0.004;

/// Significance required of the overall gain (in standard errors).
pub const Z_MIN: f64 = 8.0;

/// Finite elements a hook needs before its systematic components are tested: a gain over a
/// handful of numbers cannot be told from noise, whose size is estimated from those numbers.
pub const MIN_ELEMENTS: usize = 64;

/// Rows (tokens) a hook needs before its systematic components are tested. A row's outputs
/// share its inputs' rounding, and through a low-rank step (an expert's few intermediate
/// values) that rounding tilts the whole row one way: the noise of a gain lives mostly between
/// rows, and is estimated from them. Measured on a correct bf16 engine: one row alone of a
/// tiny model's routed experts shows a gain of 0.992 at 20 column-clustered standard errors.
pub const MIN_ROWS: usize = 8;

/// Below this many clusters (rows or columns) a one-way variance estimate is inflated by
/// `G / (G - 1)` and the other way's is required too.
pub const MIN_CLUSTERS: usize = 8;

/// Significance required of the most significant of `groups` group gains: [`Z_MIN`] raised
/// for the number of groups tested (`sqrt(2 ln groups)`, the growth of the largest of that
/// many normal deviates).
pub fn group_z(groups: usize) -> f64 {
    Z_MIN + (2.0 * (groups.max(1) as f64).ln()).sqrt()
}

/// The hook's layout for group gains: `[rows, cols]` with `heads` equal blocks of columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Rows (tokens: the first axis).
    pub rows: usize,
    /// Columns (everything after the first axis, flattened).
    pub cols: usize,
    /// Equal blocks of columns, one per head, when the hook has a head axis.
    pub heads: Option<usize>,
}

/// Which elements a gain is fitted over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "over", content = "index", rename_all = "snake_case")]
pub enum Group {
    /// Every element.
    All,
    /// One head's block of columns.
    Head(usize),
    /// A bug family's direction computed by the reference ([`Direction`]), by its label.
    Part(String),
}

/// One fitted gain.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gain {
    /// Where.
    pub group: Group,
    /// The gain `g = 1 + a`.
    pub gain: f64,
    /// Its standard error.
    pub se: f64,
    /// `|g - 1| / se` (for a group: `|g - g_all| / se`).
    pub sigma: f64,
}

/// What the systematic test found at one hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Systematic {
    /// The overall gain.
    pub overall: Gain,
    /// The most significant group gain, when any group was tested.
    pub worst_group: Option<Gain>,
    /// The most significant bug-family direction (against its family's threshold), when the
    /// step has any.
    pub best_part: Option<Gain>,
    /// The component named as a bug, when one is (significant and large enough).
    pub finding: Option<Gain>,
    /// The relative L2 error left once the named component is removed (what rounding and
    /// everything else leave), when one is named.
    pub residual: Option<f64>,
}

impl Systematic {
    /// The finding in words (`gain 1.0100 on the whole tensor, 240 sigma`), when there is one.
    pub fn describe(&self) -> Option<String> {
        let f = self.finding.as_ref()?;
        let place = match &f.group {
            Group::All => "the whole tensor".to_string(),
            Group::Head(h) => format!("head {h}"),
            Group::Part(p) => p.clone(),
        };
        let sigma = if f.sigma >= 1e4 {
            ">1e4".to_string()
        } else {
            format!("{:.0}", f.sigma)
        };
        Some(match f.group {
            Group::Part(_) => format!(
                "systematic: {place} x{:.4}, {sigma} sigma (rounding error is unbiased: it cannot produce it)",
                f.gain
            ),
            _ => format!(
                "systematic: gain {:.4} on {place}, {sigma} sigma (rounding error is unbiased: it cannot produce it)",
                f.gain
            ),
        })
    }
}

/// Whole rows of about this many elements make one chunk of the passes over a hook. The
/// chunks, not the threads, fix the order of every sum (each chunk in index order, the chunks'
/// sums in chunk order): the bits do not depend on how many threads run them.
const CHUNK_ELEMENTS: usize = 1 << 16;

/// A hook's values as the fits read them: the reference `r` and the candidate `c`, flat
/// `[rows, cols]`, in chunks of whole rows.
#[derive(Clone, Copy)]
struct Values<'a> {
    r: &'a [f32],
    c: &'a [f32],
    layout: Layout,
    /// Rows per chunk.
    chunk_rows: usize,
}

impl<'a> Values<'a> {
    fn new(r: &'a [f32], c: &'a [f32], layout: Layout) -> Values<'a> {
        Values {
            r,
            c,
            layout,
            chunk_rows: (CHUNK_ELEMENTS / layout.cols.max(1)).max(1),
        }
    }

    /// The chunks' row ranges, in order.
    fn chunks(&self) -> Vec<std::ops::Range<usize>> {
        let rows = self.layout.rows;
        (0..rows.div_ceil(self.chunk_rows))
            .map(|k| k * self.chunk_rows..((k + 1) * self.chunk_rows).min(rows))
            .collect()
    }

    /// Element `i` as `(r, e)` with `e = c - r` in f64, when both sides are finite (a member of
    /// every fit; the `-inf` mask of the DSA scores is not).
    #[inline]
    fn member(&self, i: usize) -> Option<(f64, f64)> {
        let (r, c) = (self.r[i], self.c[i]);
        (r.is_finite() && c.is_finite()).then(|| (f64::from(r), f64::from(c) - f64::from(r)))
    }
}

/// Sums over a hook's members (both sides finite), by chunk then combined in chunk order
/// ([`CHUNK_ELEMENTS`]): everything the fits of the whole tensor, of its heads and of its
/// row-sparse directions take from it.
struct Totals {
    /// Members.
    members: usize,
    /// Rows with at least one member.
    rows_with_values: usize,
    /// `sum r^2`, `sum e r`.
    rr: f64,
    er: f64,
    /// Per head block (when the layout has heads): `sum r^2`, `sum e r`.
    head_rr: Vec<f64>,
    head_er: Vec<f64>,
    /// Per row: `sum r^2`, `sum e r` (for row-sparse directions).
    row_rr: Vec<f64>,
    row_er: Vec<f64>,
    /// Per column: `sum r^2`, `sum e r` (for row-sparse directions; empty without them).
    col_rr: Vec<f64>,
    col_er: Vec<f64>,
    /// `sum r^4`, `sum r^3 e`, `sum r^2 e^2` (for row-sparse directions).
    r4: f64,
    r3e: f64,
    r2e2: f64,
}

/// The heads of a layout whose columns split evenly into them (more than one).
fn heads_of(layout: Layout) -> Option<usize> {
    layout
        .heads
        .filter(|&h| h > 1 && layout.cols % h == 0 && layout.cols > 0)
}

impl Totals {
    /// One pass over `v`; the per-column sums only when `columns`.
    fn new(v: &Values<'_>, columns: bool) -> Totals {
        let cols = v.layout.cols.max(1);
        let heads = heads_of(v.layout).unwrap_or(0);
        let w = cols.checked_div(heads).unwrap_or(cols);
        struct Part {
            members: usize,
            rows_with_values: usize,
            s: [f64; 5],
            head: Vec<[f64; 2]>,
            row: Vec<[f64; 2]>,
            col: Vec<[f64; 2]>,
        }
        let parts: Vec<Part> = v
            .chunks()
            .into_par_iter()
            .map(|range| {
                let mut p = Part {
                    members: 0,
                    rows_with_values: 0,
                    s: [0.0; 5],
                    head: vec![[0.0; 2]; heads],
                    row: Vec::with_capacity(range.len()),
                    col: if columns {
                        vec![[0.0; 2]; cols]
                    } else {
                        Vec::new()
                    },
                };
                for t in range {
                    let (mut rr, mut er, mut any) = (0.0, 0.0, false);
                    for j in 0..cols {
                        let Some((r, e)) = v.member(t * cols + j) else {
                            continue;
                        };
                        any = true;
                        p.members += 1;
                        let (r2, re) = (r * r, e * r);
                        rr += r2;
                        er += re;
                        if heads > 0 {
                            let h = &mut p.head[j / w];
                            h[0] += r2;
                            h[1] += re;
                        }
                        if columns {
                            let c = &mut p.col[j];
                            c[0] += r2;
                            c[1] += re;
                            p.s[2] += r2 * r2;
                            p.s[3] += r2 * re;
                            p.s[4] += re * re;
                        }
                    }
                    p.rows_with_values += usize::from(any);
                    p.s[0] += rr;
                    p.s[1] += er;
                    p.row.push([rr, er]);
                }
                p
            })
            .collect();
        let mut t = Totals {
            members: 0,
            rows_with_values: 0,
            rr: 0.0,
            er: 0.0,
            head_rr: vec![0.0; heads],
            head_er: vec![0.0; heads],
            row_rr: Vec::with_capacity(v.layout.rows),
            row_er: Vec::with_capacity(v.layout.rows),
            col_rr: if columns { vec![0.0; cols] } else { Vec::new() },
            col_er: if columns { vec![0.0; cols] } else { Vec::new() },
            r4: 0.0,
            r3e: 0.0,
            r2e2: 0.0,
        };
        for p in parts {
            t.members += p.members;
            t.rows_with_values += p.rows_with_values;
            t.rr += p.s[0];
            t.er += p.s[1];
            t.r4 += p.s[2];
            t.r3e += p.s[3];
            t.r2e2 += p.s[4];
            for (k, h) in p.head.iter().enumerate() {
                t.head_rr[k] += h[0];
                t.head_er[k] += h[1];
            }
            for r in &p.row {
                t.row_rr.push(r[0]);
                t.row_er.push(r[1]);
            }
            for (j, c) in p.col.iter().enumerate() {
                t.col_rr[j] += c[0];
                t.col_er[j] += c[1];
            }
        }
        t
    }
}

/// The two-way clustered variance of a sum of per-element scores `s_i` from their sums by row
/// and by column and the sum of their squares ([`Clusters::variance`]):
/// `V_rows + V_cols - V_elements`, never below either one-way estimate; a way with fewer than
/// [`MIN_CLUSTERS`] clusters is inflated by `G / (G - 1)`, and a way with one cluster carries
/// no information of its own.
struct Clusters {
    by_row: Vec<f64>,
    by_col: Vec<f64>,
    v_el: f64,
}

impl Clusters {
    fn variance(&self) -> f64 {
        let one_way = |sums: &[f64]| -> (f64, usize) {
            let g = sums.iter().filter(|&&s| s != 0.0).count();
            let v: f64 = sums.iter().map(|s| s * s).sum();
            let v = if g > 1 && g < MIN_CLUSTERS {
                v * g as f64 / (g as f64 - 1.0)
            } else {
                v
            };
            (v, g)
        };
        let (v_row, g_row) = one_way(&self.by_row);
        let (v_col, g_col) = one_way(&self.by_col);
        let v_el = self.v_el;
        match (g_row > 1, g_col > 1) {
            (true, true) => (v_row + v_col - v_el).max(v_row).max(v_col),
            (true, false) => v_row.max(v_el),
            (false, true) => v_col.max(v_el),
            (false, false) => v_el,
        }
    }
}

/// The clusters of the scores `score(i, j, r, e)` of the members in columns `cols` of every
/// row (`j` the column within the block), in chunks ([`CHUNK_ELEMENTS`]).
fn clusters(
    v: &Values<'_>,
    cols: std::ops::Range<usize>,
    score: &(dyn Fn(usize, usize, f64, f64) -> f64 + Sync),
) -> Clusters {
    let width = v.layout.cols;
    let w = cols.len();
    let parts: Vec<(Vec<f64>, Vec<f64>, f64)> = v
        .chunks()
        .into_par_iter()
        .map(|range| {
            let mut by_row = Vec::with_capacity(range.len());
            let mut by_col = vec![0f64; w];
            let mut v_el = 0f64;
            for t in range {
                let mut row = 0f64;
                for (j, col) in by_col.iter_mut().enumerate() {
                    let i = t * width + cols.start + j;
                    if let Some((r, e)) = v.member(i) {
                        let s = score(i, j, r, e);
                        row += s;
                        *col += s;
                        v_el += s * s;
                    }
                }
                by_row.push(row);
            }
            (by_row, by_col, v_el)
        })
        .collect();
    let mut c = Clusters {
        by_row: Vec::with_capacity(v.layout.rows),
        by_col: vec![0f64; w],
        v_el: 0.0,
    };
    for (rows, by_col, v_el) in parts {
        c.by_row.extend(rows);
        for (a, b) in c.by_col.iter_mut().zip(&by_col) {
            *a += b;
        }
        c.v_el += v_el;
    }
    c
}

/// `|a| / se`, infinite for a nonzero coefficient without noise.
fn sigma_of(a: f64, se: f64) -> f64 {
    if se > 0.0 {
        a.abs() / se
    } else if a == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

/// Fits the gain of the error on the reference over columns `cols` of every row (the whole
/// tensor, or one head's block), given the block's sums `rr = sum r^2` and `er = sum e r`,
/// and its clustered standard error. `None` when the group has no signal (`sum r^2 = 0`).
fn fit(
    v: &Values<'_>,
    cols: std::ops::Range<usize>,
    (rr, er): (f64, f64),
    group: Group,
) -> Option<Gain> {
    if rr <= 0.0 {
        return None;
    }
    let a = er / rr;
    let c = clusters(v, cols, &|_, _, r, e| r * (e - a * r));
    let se = c.variance().sqrt() / rr;
    Some(Gain {
        group,
        gain: 1.0 + a,
        se,
        sigma: sigma_of(a, se),
    })
}

/// The joint fit `e = a r + b p + u` from its sums: `a`, `b` and the weights of `b`'s scores
/// (`(w0 r + w1 p) u`). `None` when the two are (nearly) collinear or `p` is zero.
fn joint(rr: f64, rp: f64, pp: f64, er: f64, ep: f64) -> Option<(f64, f64, f64, f64)> {
    let det = rr * pp - rp * rp;
    if pp <= 0.0 || rr <= 0.0 || det <= 1e-12 * rr * pp {
        return None;
    }
    // (X'X)^-1 = [[pp, -rp], [-rp, rr]] / det; its second row gives b and its scores.
    let a = (pp * er - rp * ep) / det;
    let b = (rr * ep - rp * er) / det;
    Some((a, b, -rp / det, rr / det))
}

/// Fits the error on the reference and a dense direction `p` (the hook's size) jointly
/// (`e = a r + b p + u`) and returns `b` as a [`Gain`] (`1 + b`) with its clustered standard
/// error: the direction's coefficient beyond what an overall gain explains. `None` when the
/// two are (nearly) collinear or `p` is zero.
fn fit_part(v: &Values<'_>, p: &[f32], group: Group) -> Option<Gain> {
    let cols = v.layout.cols;
    let sums: Vec<[f64; 5]> = v
        .chunks()
        .into_par_iter()
        .map(|range| {
            let mut s = [0f64; 5];
            let span = range.start * cols..range.end * cols;
            for (i, &x) in span.clone().zip(&p[span]) {
                let x = f64::from(x);
                if let (Some((r, e)), true) = (v.member(i), x.is_finite()) {
                    s[0] += r * r;
                    s[1] += r * x;
                    s[2] += x * x;
                    s[3] += e * r;
                    s[4] += e * x;
                }
            }
            s
        })
        .collect();
    let mut s = [0f64; 5];
    for x in &sums {
        for (a, b) in s.iter_mut().zip(x) {
            *a += b;
        }
    }
    let (a, b, w0, w1) = joint(s[0], s[1], s[2], s[3], s[4])?;
    let c = clusters(v, 0..cols, &|i, _, r, e| {
        let x = f64::from(p[i]);
        if x.is_finite() {
            (w0 * r + w1 * x) * (e - a * r - b * x)
        } else {
            0.0
        }
    });
    Some(part_gain(group, b, &c))
}

/// A direction's coefficient `b` as a [`Gain`], its standard error from the clusters of its
/// scores.
fn part_gain(group: Group, b: f64, c: &Clusters) -> Gain {
    let se = c.variance().sqrt();
    Gain {
        group,
        gain: 1.0 + b,
        se,
        sigma: sigma_of(b, se),
    }
}

/// [`fit_part`] for a direction that is zero outside rows `rows` (ascending, distinct), its
/// values there `p` (`[rows.len(), cols]`), in time proportional to those rows: the sums
/// outside them come from the hook's [`Totals`] (by row, by column, and of `r^4`, `r^3 e`,
/// `r^2 e^2`) less the rows' own share, since there a member's score is `w0 r (e - a r)`.
fn fit_sparse(v: &Values<'_>, t: &Totals, rows: &[usize], p: &[f32], group: Group) -> Option<Gain> {
    let cols = v.layout.cols;
    // Sums over the support's members: of the joint fit where p is finite, and of r^2 and e r
    // where it is not (those members leave the fit).
    let (mut rp, mut pp, mut ep, mut rr_out, mut er_out) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (k, &row) in rows.iter().enumerate() {
        for j in 0..cols {
            let Some((r, e)) = v.member(row * cols + j) else {
                continue;
            };
            let x = f64::from(p[k * cols + j]);
            if x.is_finite() {
                rp += r * x;
                pp += x * x;
                ep += e * x;
            } else {
                rr_out += r * r;
                er_out += e * r;
            }
        }
    }
    let (rr, er) = (t.rr - rr_out, t.er - er_out);
    let (a, b, w0, w1) = joint(rr, rp, pp, er, ep)?;
    // Outside the support: by row from the row totals, by column and squared from the column
    // and global totals less the support's share.
    let mut by_row: Vec<f64> = t
        .row_rr
        .iter()
        .zip(&t.row_er)
        .map(|(&rr, &er)| w0 * (er - a * rr))
        .collect();
    let mut by_col: Vec<f64> = t
        .col_rr
        .iter()
        .zip(&t.col_er)
        .map(|(&rr, &er)| w0 * (er - a * rr))
        .collect();
    let mut v_el = w0 * w0 * (t.r2e2 - 2.0 * a * t.r3e + a * a * t.r4);
    for (k, &row) in rows.iter().enumerate() {
        let mut sum = 0f64;
        for (j, col) in by_col.iter_mut().enumerate() {
            let Some((r, e)) = v.member(row * cols + j) else {
                continue;
            };
            let off = w0 * r * (e - a * r);
            let x = f64::from(p[k * cols + j]);
            let s = if x.is_finite() {
                (w0 * r + w1 * x) * (e - a * r - b * x)
            } else {
                0.0
            };
            *col += s - off;
            v_el += s * s - off * off;
            sum += s;
        }
        by_row[row] = sum;
    }
    let c = Clusters {
        by_row,
        by_col,
        v_el: v_el.max(0.0),
    };
    Some(part_gain(group, b, &c))
}

/// A direction along which a family of bugs moves a hook's value, computed by the reference
/// from the same inputs: the error's coefficient on it is the bug's size
/// (this module); computed by `explain::directions`, handed to the comparison with its pair.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// What a coefficient on it means (`expert 5`, `softmax scale`).
    pub label: String,
    /// Parts of one family are tested together (the threshold rises with their number).
    pub family: &'static str,
    /// The direction: the expert's weighted contribution to the routed sum, or the change of
    /// the output per relative change of the parameter. The hook's shape, or `[rows.len(),
    /// ...]` when `rows` is given.
    pub tensor: HostTensor,
    /// The hook's rows the tensor holds (ascending, distinct; the direction is zero in the
    /// others: an expert's tokens), or `None` for every row.
    pub rows: Option<Vec<usize>>,
    /// Whether `rows` are a sample of the rows, the direction unknown in the others (an
    /// attention's directions at a long prompt): fitted over those rows alone.
    pub sampled: bool,
}

/// A bug family's direction at a hook, computed by the reference: the hook's size, or zero
/// outside some rows (an expert's contribution, on the tokens routed to it).
#[derive(Clone, Copy, Debug)]
pub struct Direction<'a> {
    /// What a coefficient on it means (`expert 5`, `softmax scale`).
    pub label: &'a str,
    /// Its family: the threshold rises with the number of directions of one family.
    pub family: &'a str,
    /// The values: flat, the hook's size; or `[rows.len(), cols]` when `rows` is given.
    pub values: &'a [f32],
    /// The rows the values are for (ascending, distinct), zero in the others; `None`: every
    /// row.
    pub rows: Option<&'a [usize]>,
    /// Whether `rows` are a sample of the hook's rows on which the direction is known, not its
    /// support (an attention's directions at a long prompt): it is then fitted over those rows
    /// alone, as a hook of `rows.len()` rows, so that an overall gain fitted over the other
    /// rows, where the direction's own change is unexplained, does not take its share.
    pub sampled: bool,
}

impl Direction<'_> {
    /// Whether its values have the size its rows say for a hook of `layout`.
    fn fits(&self, layout: Layout) -> bool {
        match self.rows {
            None => self.values.len() == layout.rows * layout.cols,
            Some(rows) => {
                self.values.len() == rows.len() * layout.cols
                    && rows.windows(2).all(|w| w[0] < w[1])
                    && rows.last().is_none_or(|&r| r < layout.rows)
            }
        }
    }

    /// Its value at flat index `i` (`row_pos`: for each row, its place in `rows`).
    fn at(&self, i: usize, cols: usize, row_pos: &[Option<usize>]) -> f64 {
        match self.rows {
            None => self.values.get(i).map_or(0.0, |&v| f64::from(v)),
            Some(_) => row_pos
                .get(i / cols.max(1))
                .copied()
                .flatten()
                .and_then(|k| self.values.get(k * cols + i % cols.max(1)))
                .map_or(0.0, |&v| f64::from(v)),
        }
    }
}

/// Smallest coefficient on a bug family's direction that is named (an expert's output scaled
/// by 1.01, a softmax scale off by 1%), unless the family's own spread asks for more
/// ([`SPREAD_FACTOR`]). Measured on correct bf16 engines of the tiny fixture models: experts
/// scatter up to 0.72% (a tiny expert's few weights, each rounded to bf16 once, tilt its
/// output consistently), the softmax scale's coefficient stays under 0.3%.
pub const MIN_PART: f64 = 0.01;

/// A coefficient is named only beyond this many times its family's spread
/// ([`spread`]: robust, from the data) when the family has [`SPREAD_MIN`] members or more.
pub const SPREAD_FACTOR: f64 = 4.0;

/// Members a family needs before its spread is estimated.
pub const SPREAD_MIN: usize = 6;

/// The robust spread of a family's coefficients: `1.4826 * median |a - median(a)|` (the
/// standard deviation of a normal sample, insensitive to the one member a bug moved); 0 with
/// fewer than [`SPREAD_MIN`] members.
pub fn spread(a: &[f64]) -> f64 {
    if a.len() < SPREAD_MIN {
        return 0.0;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let m = v.len() / 2;
        if v.len() % 2 == 1 {
            v[m]
        } else {
            0.5 * (v[m - 1] + v[m])
        }
    };
    let mut v = a.to_vec();
    let m = median(&mut v);
    let mut d: Vec<f64> = a.iter().map(|x| (x - m).abs()).collect();
    1.4826 * median(&mut d)
}

/// A hook whose systematic test did not run for want of data: fewer than [`MIN_ROWS`] rows or
/// [`MIN_ELEMENTS`] finite elements to fit a gain and estimate its noise from (a short prompt;
/// in chained mode, also the rows a selection difference upstream reaches, left out).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Untested {
    /// Rows with a finite element on both sides.
    pub rows: usize,
    /// Elements finite on both sides.
    pub elements: usize,
    /// Why, in words (`5 rows; the sub-floor tests need 8`).
    pub reason: String,
}

impl Untested {
    /// The record of a hook with `rows` rows and `elements` elements compared, when they are too
    /// few for the test; `None` when they are enough.
    pub fn of(rows: usize, elements: usize) -> Option<Untested> {
        let few_rows = rows < MIN_ROWS;
        let few_elements = elements < MIN_ELEMENTS;
        let reason = match (few_rows, few_elements) {
            (false, false) => return None,
            (true, false) => format!("{rows} rows; the sub-floor tests need {MIN_ROWS}"),
            (false, true) => {
                format!("{elements} values; the sub-floor tests need {MIN_ELEMENTS}")
            }
            (true, true) => format!(
                "{rows} rows, {elements} values; the sub-floor tests need {MIN_ROWS} rows, {MIN_ELEMENTS} values"
            ),
        };
        Some(Untested {
            rows,
            elements,
            reason,
        })
    }

    /// Whether it lacked rows (rather than only values).
    pub fn few_rows(&self) -> bool {
        self.rows < MIN_ROWS
    }
}

/// What the systematic test made of one hook ([`test`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// It ran.
    Tested(Systematic),
    /// It could not run: too few rows or values ([`Untested`]).
    Untested(Untested),
    /// Nothing to fit: no finite signal, or the sizes disagree.
    Nothing,
}

/// The systematic test of candidate `c` against reference `r` (flat, `layout.rows *
/// layout.cols` values each), with the directions of the bug families the step has (`parts`).
/// `None` when it did not run ([`test`] says why).
pub fn analyse(
    r: &[f32],
    c: &[f32],
    layout: Layout,
    parts: &[Direction<'_>],
) -> Option<Systematic> {
    match test(r, c, layout, parts) {
        Outcome::Tested(s) => Some(s),
        Outcome::Untested(_) | Outcome::Nothing => None,
    }
}

/// [`analyse`], saying also when the test could not run for want of data
/// ([`Outcome::Untested`]).
pub fn test(r: &[f32], c: &[f32], layout: Layout, parts: &[Direction<'_>]) -> Outcome {
    let n = layout.rows * layout.cols;
    if r.len() != n || c.len() != n || n == 0 {
        return Outcome::Nothing;
    }
    let v = Values::new(r, c, layout);
    let parts: Vec<&Direction<'_>> = parts.iter().filter(|d| d.fits(layout)).collect();
    let sparse = parts.iter().any(|d| d.rows.is_some());
    let totals = Totals::new(&v, sparse);
    if let Some(u) = Untested::of(totals.rows_with_values, totals.members) {
        return Outcome::Untested(u);
    }
    match fitted(&v, &totals, &parts) {
        Some(s) => Outcome::Tested(s),
        None => Outcome::Nothing,
    }
}

/// The fits of [`test`] over a hook with enough rows and values.
fn fitted(v: &Values<'_>, totals: &Totals, parts: &[&Direction<'_>]) -> Option<Systematic> {
    let (r, c, layout) = (v.r, v.c, v.layout);
    let v = *v;
    let cols = layout.cols;
    let overall = fit(&v, 0..cols, (totals.rr, totals.er), Group::All)?;
    let mut groups: Vec<(Vec<Gain>, usize)> = Vec::new();
    if let Some(h) = heads_of(layout) {
        let w = cols / h;
        let v: Vec<Gain> = (0..h)
            .into_par_iter()
            .filter_map(|k| {
                let sums = (totals.head_rr[k], totals.head_er[k]);
                fit(&v, k * w..(k + 1) * w, sums, Group::Head(k))
            })
            .collect();
        groups.push((v, h));
    }
    // The bug families' directions: each coefficient against its own noise, and against the
    // spread of its family's coefficients (each expert's weights were rounded once: a correct
    // engine's experts scatter around 1 by that, consistently over their tokens).
    // One fit per direction, each on its own thread (a routed-experts step has one per expert
    // the tokens chose); the order of `parts` is kept. A sampled direction's rows are gathered
    // once per set of rows.
    let samples = Samples::new(r, c, layout, parts);
    let fitted: Vec<(&Direction<'_>, Gain)> = parts
        .par_iter()
        .filter_map(|&d| {
            let group = Group::Part(d.label.to_string());
            let g = match (d.rows, samples.of(d)) {
                (None, _) => fit_part(&v, d.values, group),
                (Some(_), Some(sv)) => fit_part(&sv, d.values, group),
                (Some(rows), None) => fit_sparse(&v, totals, rows, d.values, group),
            }?;
            Some((d, g))
        })
        .collect();
    let mut best_part: Option<(Gain, f64)> = None;
    let mut named_part: Option<(Gain, f64)> = None;
    for (d, g) in &fitted {
        let family: Vec<f64> = fitted
            .iter()
            .filter(|(x, _)| x.family == d.family)
            .map(|(_, g)| g.gain - 1.0)
            .collect();
        let count = family.len();
        let least = MIN_PART.max(SPREAD_FACTOR * spread(&family));
        {
            let g = g.clone();
            let score = g.sigma / group_z(count);
            let big = (g.gain - 1.0).abs() >= least;
            if big && named_part.as_ref().is_none_or(|(_, s)| score > *s) {
                named_part = Some((g.clone(), score));
            }
            if best_part.as_ref().is_none_or(|(_, s)| score > *s) {
                best_part = Some((g, score));
            }
        }
    }
    // Group gains against the overall one: how far each is from it, in its own errors.
    let mut worst: Option<(Gain, f64)> = None;
    for (gains, count) in &groups {
        let need = group_z(*count);
        for g in gains {
            let d = (g.gain - overall.gain).abs();
            let sigma = if g.se > 0.0 { d / g.se } else { 0.0 };
            let scored = Gain { sigma, ..g.clone() };
            // Ranked by how far past its own threshold it is.
            let score = sigma / need;
            if worst.as_ref().is_none_or(|(_, s)| score > *s) {
                worst = Some((scored, score));
            }
        }
    }
    let overall_named = overall.sigma >= Z_MIN && (overall.gain - 1.0).abs() >= MIN_GAIN;
    let group_named = worst.as_ref().is_some_and(|(g, score)| {
        *score >= 1.0
            && (g.gain - overall.gain).abs() >= MIN_GAIN
            && (g.gain - 1.0).abs() >= MIN_GAIN
    });
    let part_named = named_part.as_ref().filter(|(_, score)| *score >= 1.0);
    // Of the components named, the one furthest past its own threshold: one head or one
    // expert scaled moves the overall gain too, but less than itself.
    let mut named: Vec<(Gain, f64)> = Vec::new();
    if overall_named {
        named.push((overall.clone(), overall.sigma / Z_MIN));
    }
    if let Some((g, score)) = part_named {
        named.push((g.clone(), *score));
    }
    if let (true, Some((g, score))) = (group_named, &worst) {
        named.push((g.clone(), *score));
    }
    let finding = named
        .into_iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(g, _)| g);
    let residual = finding.as_ref().map(|f| residual(&v, f, parts, &samples));
    Some(Systematic {
        overall,
        worst_group: worst.map(|(g, _)| g),
        best_part: best_part.map(|(g, _)| g),
        finding,
        residual,
    })
}

/// The hook's rows that sampled directions ([`Direction::sampled`]) are known on, gathered:
/// one `[rows.len(), cols]` copy of the reference and the candidate per set of rows.
struct Samples {
    /// Per set of rows: the rows, the reference's and the candidate's values on them.
    sets: Vec<(Vec<usize>, Vec<f32>, Vec<f32>)>,
    layout: Layout,
}

impl Samples {
    fn new(r: &[f32], c: &[f32], layout: Layout, parts: &[&Direction<'_>]) -> Samples {
        let cols = layout.cols;
        let mut sets: Vec<(Vec<usize>, Vec<f32>, Vec<f32>)> = Vec::new();
        for d in parts.iter().filter(|d| d.sampled) {
            let Some(rows) = d.rows else { continue };
            if sets.iter().any(|(s, _, _)| s.as_slice() == rows) {
                continue;
            }
            let pick = |x: &[f32]| -> Vec<f32> {
                rows.iter()
                    .flat_map(|&t| x[t * cols..(t + 1) * cols].iter().copied())
                    .collect()
            };
            sets.push((rows.to_vec(), pick(r), pick(c)));
        }
        Samples { sets, layout }
    }

    /// The values of a sampled direction's rows as a hook of their own; `None` for a direction
    /// that is not sampled.
    fn of(&self, d: &Direction<'_>) -> Option<Values<'_>> {
        let rows = d.rows.filter(|_| d.sampled)?;
        let (_, r, c) = self.sets.iter().find(|(s, _, _)| s.as_slice() == rows)?;
        Some(Values::new(
            r,
            c,
            Layout {
                rows: rows.len(),
                ..self.layout
            },
        ))
    }
}

/// The relative L2 error left once finding `f` is removed from the error (chunked like the
/// fits); for a sampled direction, over its rows.
fn residual(v: &Values<'_>, f: &Gain, parts: &[&Direction<'_>], samples: &Samples) -> f64 {
    let part = match &f.group {
        Group::Part(label) => parts.iter().find(|d| d.label == label.as_str()).copied(),
        _ => None,
    };
    if let Some((d, sv)) = part.and_then(|d| Some((d, samples.of(d)?))) {
        let dense = Direction {
            rows: None,
            sampled: false,
            ..*d
        };
        return residual_of(&sv, f, Some(&dense));
    }
    residual_of(v, f, part)
}

/// [`residual`] over `v`, `part` the finding's direction when it is one.
fn residual_of(v: &Values<'_>, f: &Gain, part: Option<&Direction<'_>>) -> f64 {
    let (layout, cols) = (v.layout, v.layout.cols.max(1));
    let a = f.gain - 1.0;
    // For a row-sparse direction, each row's place among its rows.
    let mut row_pos: Vec<Option<usize>> = Vec::new();
    if let Some(rows) = part.and_then(|d| d.rows) {
        row_pos = vec![None; layout.rows];
        for (k, &t) in rows.iter().enumerate() {
            row_pos[t] = Some(k);
        }
    }
    let block = |j: usize| match (&f.group, layout.heads) {
        (Group::All, _) => true,
        (Group::Head(k), Some(h)) => j / (cols / h.max(1)).max(1) == *k,
        _ => false,
    };
    let sums: Vec<(f64, f64)> = v
        .chunks()
        .into_par_iter()
        .map(|range| {
            let (mut d2, mut r2) = (0f64, 0f64);
            for i in range.start * cols..range.end * cols {
                let Some((r, e)) = v.member(i) else {
                    continue;
                };
                let u = match part {
                    Some(d) => e - a * d.at(i, cols, &row_pos),
                    None if block(i % cols) => e - a * r,
                    None => e,
                };
                d2 += u * u;
                r2 += r * r;
            }
            (d2, r2)
        })
        .collect();
    let (d2, r2) = sums
        .iter()
        .fold((0.0, 0.0), |(a, b), (d, r)| (a + d, b + r));
    if r2 > 0.0 {
        (d2 / r2).sqrt()
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random stream in [-1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    fn round_bf16(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    /// A `[rows, cols]` reference and a candidate that is the reference through bf16 (unbiased
    /// rounding, relative 2^-9).
    fn pair(rows: usize, cols: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let r: Vec<f32> = noise(seed, rows * cols).iter().map(|&x| x as f32).collect();
        let c = r.iter().map(|&x| round_bf16(x)).collect();
        (r, c)
    }

    #[test]
    fn rounding_alone_is_not_systematic() {
        for seed in 0..20 {
            let (r, c) = pair(12, 256, seed);
            let s = analyse(
                &r,
                &c,
                Layout {
                    rows: 12,
                    cols: 256,
                    heads: Some(4),
                },
                &[],
            )
            .unwrap();
            assert!(s.finding.is_none(), "seed {seed}: {s:?}");
            assert!(s.overall.sigma < Z_MIN, "seed {seed}: {:?}", s.overall);
        }
    }

    #[test]
    fn a_one_percent_gain_is_found_by_hand() {
        // e = 0.01 r plus one rounding: the gain is 1.01 to within the rounding's noise.
        let (r, _) = pair(12, 256, 3);
        let c: Vec<f32> = r.iter().map(|&x| round_bf16(x * 1.01)).collect();
        let s = analyse(
            &r,
            &c,
            Layout {
                rows: 12,
                cols: 256,
                heads: None,
            },
            &[],
        )
        .unwrap();
        let f = s.finding.clone().expect("found");
        assert_eq!(f.group, Group::All);
        assert!((f.gain - 1.01).abs() < 2e-4, "{f:?}");
        assert!(f.sigma > 100.0, "{f:?}");
        assert!(s
            .describe()
            .unwrap()
            .contains("gain 1.0100 on the whole tensor"));
        // Under the floor of relative L2 a bf16 linear gets, as the bug is.
        assert!(s.residual.unwrap() < 4e-3);
    }

    #[test]
    fn a_small_gain_is_not_named() {
        let (r, c) = pair(12, 256, 4);
        let c: Vec<f32> = c.iter().map(|&x| x * 1.002).collect();
        let s = analyse(
            &r,
            &c,
            Layout {
                rows: 12,
                cols: 256,
                heads: None,
            },
            &[],
        )
        .unwrap();
        assert!(s.overall.sigma > Z_MIN, "significant: {:?}", s.overall);
        assert!(s.finding.is_none(), "but too small to name: {s:?}");
    }

    #[test]
    fn one_head_scaled_is_named_by_head() {
        let (r, c) = pair(12, 256, 5);
        let w = 64;
        let c: Vec<f32> = c
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                if (i % 256) / w == 2 {
                    round_bf16(x * 1.02)
                } else {
                    x
                }
            })
            .collect();
        let s = analyse(
            &r,
            &c,
            Layout {
                rows: 12,
                cols: 256,
                heads: Some(4),
            },
            &[],
        )
        .unwrap();
        let f = s.finding.clone().expect("found");
        assert_eq!(f.group, Group::Head(2), "{s:?}");
        assert!((f.gain - 1.02).abs() < 1e-3, "{f:?}");
    }

    #[test]
    fn a_shared_rounding_per_column_is_not_a_gain() {
        // Every row's error in a column is the same weight error times the row's input: the
        // column clusters absorb it (a one-way, element-wise estimate would call it 1000 sigma).
        let rows = 64;
        let cols = 128;
        let x = noise(11, rows * 8);
        let w = noise(12, cols * 8);
        let dw: Vec<f64> = w
            .iter()
            .map(|&v| f64::from(round_bf16(v as f32)) - v)
            .collect();
        let mut r = vec![0f32; rows * cols];
        let mut c = vec![0f32; rows * cols];
        for t in 0..rows {
            for j in 0..cols {
                let (mut a, mut b) = (0.0, 0.0);
                for k in 0..8 {
                    a += x[t * 8 + k] * w[j * 8 + k];
                    b += x[t * 8 + k] * dw[j * 8 + k];
                }
                r[t * cols + j] = a as f32;
                c[t * cols + j] = (a + b) as f32;
            }
        }
        let s = analyse(
            &r,
            &c,
            Layout {
                rows,
                cols,
                heads: None,
            },
            &[],
        )
        .unwrap();
        assert!(s.finding.is_none(), "{s:?}");
    }

    #[test]
    fn one_expert_scaled_is_named_by_its_direction() {
        // Eight experts' contributions on disjoint rows; expert 5's scaled by 1.02.
        let (rows, cols) = (32, 64);
        let base = noise(21, rows * cols);
        let parts: Vec<Vec<f32>> = (0..8)
            .map(|e| {
                (0..rows * cols)
                    .map(|i| {
                        if (i / cols) % 8 == e {
                            base[i] as f32
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect();
        let labels: Vec<String> = (0..8).map(|e| format!("expert {e}")).collect();
        let dirs: Vec<Direction<'_>> = parts
            .iter()
            .zip(&labels)
            .map(|(v, l)| Direction {
                label: l,
                family: "expert",
                values: v,
                rows: None,
                sampled: false,
            })
            .collect();
        let r: Vec<f32> = base.iter().map(|&x| x as f32).collect();
        let layout = Layout {
            rows,
            cols,
            heads: None,
        };
        let clean: Vec<f32> = r.iter().map(|&x| round_bf16(x)).collect();
        assert!(analyse(&r, &clean, layout, &dirs)
            .unwrap()
            .finding
            .is_none());
        let c: Vec<f32> = clean
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                if (i / cols) % 8 == 5 {
                    round_bf16(r[i] * 1.02)
                } else {
                    x
                }
            })
            .collect();
        let s = analyse(&r, &c, layout, &dirs).unwrap();
        let f = s.finding.clone().expect("found");
        assert_eq!(f.group, Group::Part("expert 5".into()));
        assert!((f.gain - 1.02).abs() < 1e-3, "{f:?}");
        assert!(
            s.describe().unwrap().contains("expert 5 x1.020"),
            "{:?}",
            s.describe()
        );
        // The same directions held on their rows only: the same finding and residual.
        let rows_of: Vec<Vec<usize>> = (0..8)
            .map(|e| (0..rows).filter(|t| t % 8 == e).collect())
            .collect();
        let held: Vec<Vec<f32>> = rows_of
            .iter()
            .map(|rs| {
                rs.iter()
                    .flat_map(|&t| r[t * cols..(t + 1) * cols].iter().copied())
                    .collect()
            })
            .collect();
        let sparse: Vec<Direction<'_>> = (0..8)
            .map(|e| Direction {
                label: &labels[e],
                family: "expert",
                values: &held[e],
                rows: Some(&rows_of[e]),
                sampled: false,
            })
            .collect();
        let t = analyse(&r, &c, layout, &sparse).unwrap();
        let g = t.finding.clone().expect("found");
        assert_eq!(g.group, f.group);
        assert!(
            close(g.gain, f.gain, 1e-12) && close(g.se, f.se, 1e-9),
            "{g:?} {f:?}"
        );
        assert!(close(t.residual.unwrap(), s.residual.unwrap(), 1e-12));
    }

    #[test]
    fn spread_is_robust_to_one_outlier() {
        let a = [0.001, -0.002, 0.0, 0.002, -0.001, 0.0015, 0.05];
        let s = spread(&a);
        assert!(s > 0.0005 && s < 0.005, "{s}");
        assert_eq!(spread(&a[..3]), 0.0);
    }

    #[test]
    fn masks_small_hooks_and_mismatched_sizes() {
        // The -inf mask above a causal diagonal is left out; the rest is fitted.
        let (rows, cols) = (12, 12);
        let (r0, _) = pair(rows, cols, 9);
        let mask = |i: usize| i % cols > i / cols;
        let r: Vec<f32> = r0
            .iter()
            .enumerate()
            .map(|(i, &x)| if mask(i) { f32::NEG_INFINITY } else { x })
            .collect();
        let c: Vec<f32> = r
            .iter()
            .map(|&x| {
                if x.is_finite() {
                    round_bf16(x * 1.05)
                } else {
                    x
                }
            })
            .collect();
        let layout = Layout {
            rows,
            cols,
            heads: None,
        };
        let s = analyse(&r, &c, layout, &[]).unwrap();
        assert_eq!(s.finding.unwrap().group, Group::All);
        assert!((s.overall.gain - 1.05).abs() < 1e-3, "{:?}", s.overall);
        // Too few finite values, or sizes that disagree: nothing is fitted.
        let small = Layout {
            rows: 2,
            cols: 2,
            heads: None,
        };
        assert!(analyse(&[1.0, 2.0, 3.0, 4.0], &[1.1, 2.2, 3.3, 4.4], small, &[]).is_none());
        assert!(analyse(&r, &c[..3], layout, &[]).is_none());
        assert!(analyse(&vec![0.0; 144], &vec![0.0; 144], layout, &[]).is_none());
    }

    #[test]
    fn too_few_rows_or_values_say_why_the_test_did_not_run() {
        // A 2% gain over 5 rows of 64: plain in the data, but too few rows to test.
        let (r, c) = pair(5, 64, 11);
        let c: Vec<f32> = c.iter().map(|&x| x * 1.02).collect();
        let layout = Layout {
            rows: 5,
            cols: 64,
            heads: None,
        };
        let Outcome::Untested(u) = test(&r, &c, layout, &[]) else {
            panic!("5 rows should leave the test untested");
        };
        assert_eq!((u.rows, u.elements), (5, 320));
        assert!(u.few_rows());
        assert_eq!(u.reason, "5 rows; the sub-floor tests need 8");
        assert!(analyse(&r, &c, layout, &[]).is_none());
        // Rows enough, values too few (a router's two weights a token).
        let (r, c) = pair(21, 2, 12);
        let narrow = Layout {
            rows: 21,
            cols: 2,
            heads: None,
        };
        let Outcome::Untested(u) = test(&r, &c, narrow, &[]) else {
            panic!("42 values should leave the test untested");
        };
        assert!(!u.few_rows());
        assert_eq!(u.reason, "42 values; the sub-floor tests need 64");
        // Both short; and non-finite rows do not count.
        let mut r = vec![1.0f32; 16];
        r[..4].fill(f32::NAN);
        let wide = Layout {
            rows: 4,
            cols: 4,
            heads: None,
        };
        let Outcome::Untested(u) = test(&r, &r, wide, &[]) else {
            panic!("3 rows of 4 should leave the test untested");
        };
        assert_eq!((u.rows, u.elements), (3, 12));
        assert_eq!(
            u.reason,
            "3 rows, 12 values; the sub-floor tests need 8 rows, 64 values"
        );
        // Enough of both: the test runs; nothing to fit or sizes that disagree: no reason given.
        let (r, c) = pair(8, 8, 13);
        let enough = Layout {
            rows: 8,
            cols: 8,
            heads: None,
        };
        assert!(matches!(test(&r, &c, enough, &[]), Outcome::Tested(_)));
        assert_eq!(test(&r, &c[..3], enough, &[]), Outcome::Nothing);
        assert_eq!(test(&[0.0; 64], &[0.0; 64], enough, &[]), Outcome::Nothing);
        assert_eq!(Untested::of(8, 64), None);
    }

    /// The fits by their definition, one element at a time in index order: the two-way
    /// clustered variance filled score by score (module documentation).
    mod definition {
        use super::super::*;

        fn variance(by_row: &[f64], by_col: &[f64], v_el: f64) -> f64 {
            Clusters {
                by_row: by_row.to_vec(),
                by_col: by_col.to_vec(),
                v_el,
            }
            .variance()
        }

        /// `(a, se)` of the gain of `e` on `r` over the elements `inside` selects.
        pub fn gain(
            r: &[f64],
            e: &[f64],
            l: Layout,
            inside: &dyn Fn(usize) -> bool,
        ) -> Option<(f64, f64)> {
            let m = |i: usize| inside(i) && r[i].is_finite() && e[i].is_finite();
            let (mut rr, mut er) = (0.0, 0.0);
            for i in (0..r.len()).filter(|&i| m(i)) {
                rr += r[i] * r[i];
                er += e[i] * r[i];
            }
            if rr <= 0.0 {
                return None;
            }
            let a = er / rr;
            let (mut by_row, mut by_col, mut v_el) = (vec![0.0; l.rows], vec![0.0; l.cols], 0.0);
            for i in (0..r.len()).filter(|&i| m(i)) {
                let s = r[i] * (e[i] - a * r[i]);
                by_row[i / l.cols] += s;
                by_col[i % l.cols] += s;
                v_el += s * s;
            }
            Some((a, variance(&by_row, &by_col, v_el).sqrt() / rr))
        }

        /// `(b, se)` of the joint fit `e = a r + b p + u`.
        pub fn part(r: &[f64], p: &[f64], e: &[f64], l: Layout) -> Option<(f64, f64)> {
            let m = |i: usize| r[i].is_finite() && e[i].is_finite() && p[i].is_finite();
            let (mut rr, mut rp, mut pp, mut er, mut ep) = (0.0, 0.0, 0.0, 0.0, 0.0);
            for i in (0..r.len()).filter(|&i| m(i)) {
                rr += r[i] * r[i];
                rp += r[i] * p[i];
                pp += p[i] * p[i];
                er += e[i] * r[i];
                ep += e[i] * p[i];
            }
            let det = rr * pp - rp * rp;
            let a = (pp * er - rp * ep) / det;
            let b = (rr * ep - rp * er) / det;
            let (w0, w1) = (-rp / det, rr / det);
            let (mut by_row, mut by_col, mut v_el) = (vec![0.0; l.rows], vec![0.0; l.cols], 0.0);
            for i in (0..r.len()).filter(|&i| m(i)) {
                let s = (w0 * r[i] + w1 * p[i]) * (e[i] - a * r[i] - b * p[i]);
                by_row[i / l.cols] += s;
                by_col[i % l.cols] += s;
                v_el += s * s;
            }
            Some((b, variance(&by_row, &by_col, v_el).sqrt()))
        }
    }

    /// Within `rel` of each other, relatively.
    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-300)
    }

    /// The reference in f64 and the error `c - r` where both are finite (NaN elsewhere), as the
    /// definition takes them.
    fn reference_and_error(r: &[f32], c: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let rv: Vec<f64> = r.iter().map(|&x| f64::from(x)).collect();
        let ev: Vec<f64> = c
            .iter()
            .zip(r)
            .map(|(&a, &b)| {
                if a.is_finite() && b.is_finite() {
                    f64::from(a) - f64::from(b)
                } else {
                    f64::NAN
                }
            })
            .collect();
        (rv, ev)
    }

    /// The chunked fits (parallel, sums combined by chunk) and the row-sparse directions' fits
    /// from the hook's totals give what the definition gives element by element, on a hook of
    /// several chunks with masked and non-finite values, heads, dense and row-sparse
    /// directions (one with a non-finite value on its rows, one on a single row).
    #[test]
    fn chunked_and_sparse_fits_are_the_definition() {
        let (rows, cols, heads) = (300, 1024, 8);
        let l = Layout {
            rows,
            cols,
            heads: Some(heads),
        };
        assert!(rows * cols > 4 * CHUNK_ELEMENTS);
        let n = rows * cols;
        let mut r: Vec<f32> = noise(31, n).iter().map(|&x| x as f32).collect();
        let wobble = noise(32, n);
        let mut c: Vec<f32> = r
            .iter()
            .zip(&wobble)
            .enumerate()
            .map(|(i, (&x, &w))| {
                // Head 3 a little scaled, everything a little noisy.
                let g = if (i % cols) / (cols / heads) == 3 {
                    1.003
                } else {
                    1.0
                };
                (f64::from(x) * g + 1e-3 * w) as f32
            })
            .collect();
        r[17] = f32::NEG_INFINITY;
        c[17] = f32::NEG_INFINITY;
        c[70_000] = f32::NAN;
        r[200_001] = f32::INFINITY;
        // Directions: one dense, three zero outside some rows.
        let dense: Vec<f32> = noise(33, n).iter().map(|&x| x as f32).collect();
        let support =
            |k: usize| -> Vec<usize> { (0..rows).filter(|t| (t * 7 + k) % 5 == 0).collect() };
        let sparse_rows = [support(0), support(1), vec![123]];
        let sparse_vals: Vec<Vec<f32>> = sparse_rows
            .iter()
            .enumerate()
            .map(|(k, rs)| {
                let mut v: Vec<f32> = noise(40 + k as u64, rs.len() * cols)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                if k == 1 {
                    v[5] = f32::INFINITY;
                }
                v
            })
            .collect();
        let labels = ["d", "s0", "s1", "s2"];
        let mut dirs = vec![Direction {
            label: labels[0],
            family: "f",
            values: &dense,
            rows: None,
            sampled: false,
        }];
        for k in 0..3 {
            dirs.push(Direction {
                label: labels[k + 1],
                family: "f",
                values: &sparse_vals[k],
                rows: Some(&sparse_rows[k]),
                sampled: false,
            });
        }
        let got = analyse(&r, &c, l, &dirs).unwrap();

        let (rv, ev) = reference_and_error(&r, &c);
        let (a, se) = definition::gain(&rv, &ev, l, &|_| true).unwrap();
        assert!(
            close(got.overall.gain, 1.0 + a, 1e-12),
            "{:?} {a}",
            got.overall
        );
        assert!(close(got.overall.se, se, 1e-9), "{:?} {se}", got.overall);
        let w = cols / heads;
        let worst = got.worst_group.clone().unwrap();
        assert_eq!(worst.group, Group::Head(3));
        let (a3, se3) = definition::gain(&rv, &ev, l, &|i| (i % cols) / w == 3).unwrap();
        assert!(close(worst.gain, 1.0 + a3, 1e-12), "{worst:?} {a3}");
        assert!(close(worst.sigma, (a3 - a).abs() / se3, 1e-9), "{worst:?}");
        // Each direction, dense in the definition.
        let mut want = Vec::new();
        let dense_of = |k: usize| -> Vec<f64> {
            let mut p = vec![0f64; n];
            for (j, &t) in sparse_rows[k].iter().enumerate() {
                for x in 0..cols {
                    p[t * cols + x] = f64::from(sparse_vals[k][j * cols + x]);
                }
            }
            p
        };
        let pd: Vec<f64> = dense.iter().map(|&x| f64::from(x)).collect();
        want.push(definition::part(&rv, &pd, &ev, l).unwrap());
        for k in 0..3 {
            want.push(definition::part(&rv, &dense_of(k), &ev, l).unwrap());
        }
        let v = Values::new(&r, &c, l);
        let totals = Totals::new(&v, true);
        for (k, d) in dirs.iter().enumerate() {
            let g = Group::Part(d.label.to_string());
            let fitted = match d.rows {
                None => fit_part(&v, d.values, g),
                Some(rows) => fit_sparse(&v, &totals, rows, d.values, g),
            }
            .unwrap();
            let (b, se) = want[k];
            assert!(close(fitted.gain - 1.0, b, 1e-9), "{k}: {fitted:?} {b}");
            assert!(close(fitted.se, se, 1e-8), "{k}: {fitted:?} {se}");
        }
    }

    /// A direction known on a sample of rows that moves along the reference too (a softmax
    /// scale moves an attention's output partly along itself): fitted over its rows alone its
    /// coefficient is the planted one, and it is named; taken as zero on the other rows it is
    /// not (the overall gain, fitted where the direction's change is left unexplained, takes
    /// a share), which is why a sample is not a support.
    #[test]
    fn a_sampled_direction_is_fitted_over_its_rows() {
        let (rows, cols) = (256, 64);
        let r: Vec<f64> = noise(1, rows * cols);
        let o: Vec<f64> = noise(2, rows * cols);
        let d: Vec<f64> = r.iter().zip(&o).map(|(&r, &o)| 1.3 * r + o).collect();
        let rf: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        let c: Vec<f32> = r
            .iter()
            .zip(&d)
            .map(|(&r, &d)| round_bf16((r + 0.02 * d) as f32))
            .collect();
        let layout = Layout {
            rows,
            cols,
            heads: None,
        };
        let sample: Vec<usize> = (0..rows).filter(|t| t % 4 == 3).collect();
        let whole: Vec<f32> = d.iter().map(|&x| x as f32).collect();
        let held: Vec<f32> = sample
            .iter()
            .flat_map(|&t| whole[t * cols..(t + 1) * cols].iter().copied())
            .collect();
        let fit = |rows: Option<&[usize]>, sampled: bool| {
            let values = if rows.is_some() { &held } else { &whole };
            let dir = Direction {
                label: "softmax scale",
                family: "softmax scale",
                values,
                rows,
                sampled,
            };
            analyse(&rf, &c, layout, &[dir]).unwrap()
        };
        for (rows, sampled) in [(None, false), (Some(sample.as_slice()), true)] {
            let t = fit(rows, sampled);
            let f = t.finding.expect("named");
            assert_eq!(f.group, Group::Part("softmax scale".to_string()));
            assert!((f.gain - 1.02).abs() < 4.0 * f.se, "{f:?}");
            let left = t.residual.unwrap();
            assert!(left < 5e-3, "residual {left}");
        }
        let zero_outside = fit(Some(sample.as_slice()), false).best_part.unwrap();
        assert!(
            (zero_outside.gain - 1.02).abs() > 20.0 * zero_outside.se,
            "{zero_outside:?}"
        );
    }
}
