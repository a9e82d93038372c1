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
//! Nothing here prints.

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

/// The two-way clustered variance of a sum of per-element scores `s_i`, filled one score at a
/// time (in index order, which fixes the bits of every sum; [`Clusters::variance`]):
/// `V_rows + V_cols - V_elements`, never below either one-way estimate; a way with fewer than
/// [`MIN_CLUSTERS`] clusters is inflated by `G / (G - 1)`, and a way with one cluster carries
/// no information of its own.
struct Clusters {
    rows: usize,
    cols: usize,
    by_row: Vec<f64>,
    by_col: Vec<f64>,
    v_el: f64,
}

impl Clusters {
    fn new(layout: Layout) -> Clusters {
        let (rows, cols) = (layout.rows.max(1), layout.cols.max(1));
        Clusters {
            rows,
            cols,
            by_row: vec![0f64; rows],
            by_col: vec![0f64; cols],
            v_el: 0.0,
        }
    }

    #[inline]
    fn add(&mut self, i: usize, s: f64) {
        self.by_row[(i / self.cols).min(self.rows - 1)] += s;
        self.by_col[i % self.cols] += s;
        self.v_el += s * s;
    }

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

/// Fits the gain of the error `e` on the reference `r` over `idx` (flat indices into
/// `[rows, cols]`) and its clustered standard error. `None` when the group has no signal
/// (`sum r^2 = 0`).
fn fit(r: &[f64], e: &[f64], layout: Layout, over: Over, group: Group) -> Option<Gain> {
    // Two passes over the group's finite elements in index order (the order fixes the sums'
    // bits): the sums of the fit, then the scores into their clusters.
    let (mut rr, mut er) = (0.0f64, 0.0f64);
    over.each(layout, &mut |i| {
        if r[i].is_finite() && e[i].is_finite() {
            rr += r[i] * r[i];
            er += e[i] * r[i];
        }
    });
    if rr <= 0.0 {
        return None;
    }
    let a = er / rr;
    let mut c = Clusters::new(layout);
    over.each(layout, &mut |i| {
        if r[i].is_finite() && e[i].is_finite() {
            c.add(i, r[i] * (e[i] - a * r[i]));
        }
    });
    let se = c.variance().sqrt() / rr;
    Some(Gain {
        group,
        gain: 1.0 + a,
        se,
        sigma: sigma_of(a, se),
    })
}

/// The elements a [`fit`] runs over, in index order.
#[derive(Clone, Copy)]
enum Over {
    /// All `rows * cols` of them.
    All,
    /// Head `k` of `heads`: columns `k * w .. (k + 1) * w` of every row (`w = cols / heads`).
    Head(usize, usize),
}

impl Over {
    #[inline]
    fn each(self, layout: Layout, f: &mut dyn FnMut(usize)) {
        let cols = layout.cols;
        match self {
            Over::All => (0..layout.rows * cols).for_each(f),
            Over::Head(k, heads) => {
                let w = cols / heads.max(1);
                for t in 0..layout.rows {
                    (t * cols + k * w..t * cols + (k + 1) * w).for_each(&mut *f);
                }
            }
        }
    }
}

/// Fits the error `e` on the reference `r` and a direction `p` jointly (`e = a r + b p + u`)
/// and returns `b` as a [`Gain`] (`1 + b`) with its clustered standard error: the direction's
/// coefficient beyond what an overall gain explains. `None` when the two are (nearly)
/// collinear or `p` is zero.
fn fit_part(r: &[f64], p: &[f64], e: &[f64], layout: Layout, group: Group) -> Option<Gain> {
    let member = |i: usize| r[i].is_finite() && e[i].is_finite() && p[i].is_finite();
    let (mut rr, mut rp, mut pp, mut er, mut ep) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for i in (0..e.len()).filter(|&i| member(i)) {
        rr += r[i] * r[i];
        rp += r[i] * p[i];
        pp += p[i] * p[i];
        er += e[i] * r[i];
        ep += e[i] * p[i];
    }
    let det = rr * pp - rp * rp;
    if pp <= 0.0 || rr <= 0.0 || det <= 1e-12 * rr * pp {
        return None;
    }
    // (X'X)^-1 = [[pp, -rp], [-rp, rr]] / det; its second row gives b and its scores.
    let a = (pp * er - rp * ep) / det;
    let b = (rr * ep - rp * er) / det;
    let (w0, w1) = (-rp / det, rr / det);
    let mut c = Clusters::new(layout);
    for i in (0..e.len()).filter(|&i| member(i)) {
        c.add(i, (w0 * r[i] + w1 * p[i]) * (e[i] - a * r[i] - b * p[i]));
    }
    let se = c.variance().sqrt();
    Some(Gain {
        group,
        gain: 1.0 + b,
        se,
        sigma: sigma_of(b, se),
    })
}

/// A bug family's direction at a hook (flat, the hook's size), computed by the reference.
#[derive(Clone, Copy, Debug)]
pub struct Direction<'a> {
    /// What a coefficient on it means (`expert 5`, `softmax scale`).
    pub label: &'a str,
    /// Its family: the threshold rises with the number of directions of one family.
    pub family: &'a str,
    /// The values.
    pub values: &'a [f32],
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

/// The systematic test of candidate `c` against reference `r` (flat, `layout.rows *
/// layout.cols` values each), with the directions of the bug families the step has (`parts`).
/// `None` when nothing can be fitted (no finite signal, or the sizes disagree).
pub fn analyse(
    r: &[f32],
    c: &[f32],
    layout: Layout,
    parts: &[Direction<'_>],
) -> Option<Systematic> {
    let n = layout.rows * layout.cols;
    if r.len() != n || c.len() != n || n == 0 {
        return None;
    }
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
    let rows_with_values = ev
        .chunks(layout.cols.max(1))
        .filter(|row| row.iter().any(|x| x.is_finite()))
        .count();
    if ev.iter().filter(|x| x.is_finite()).count() < MIN_ELEMENTS || rows_with_values < MIN_ROWS {
        return None;
    }
    let overall = fit(&rv, &ev, layout, Over::All, Group::All)?;
    let cols = layout.cols;
    let mut groups: Vec<(Vec<Gain>, usize)> = Vec::new();
    if let Some(h) = layout.heads.filter(|&h| h > 1 && cols % h == 0) {
        let v: Vec<Gain> = (0..h)
            .into_par_iter()
            .filter_map(|k| fit(&rv, &ev, layout, Over::Head(k, h), Group::Head(k)))
            .collect();
        groups.push((v, h));
    }
    // The bug families' directions: each coefficient against its own noise, and against the
    // spread of its family's coefficients (each expert's weights were rounded once: a correct
    // engine's experts scatter around 1 by that, consistently over their tokens).
    // One fit per direction, each on its own thread (a routed-experts step has one per expert
    // the tokens chose); the order of `parts` is kept.
    let fitted: Vec<(&Direction<'_>, Gain)> = parts
        .par_iter()
        .filter(|d| d.values.len() == n)
        .filter_map(|d| {
            let x: Vec<f64> = d.values.iter().map(|&v| f64::from(v)).collect();
            let g = fit_part(&rv, &x, &ev, layout, Group::Part(d.label.to_string()))?;
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
    let residual = finding.as_ref().map(|f| {
        let (mut d2, mut r2) = (0.0, 0.0);
        for i in 0..n {
            if !ev[i].is_finite() {
                continue;
            }
            let j = i % cols.max(1);
            let inside = match &f.group {
                Group::All => true,
                Group::Head(k) => layout
                    .heads
                    .is_some_and(|h| j / (cols / h.max(1)).max(1) == *k),
                Group::Part(_) => false,
            };
            let u = match &f.group {
                Group::Part(label) => {
                    let x = parts
                        .iter()
                        .find(|d| d.label == label.as_str())
                        .and_then(|d| d.values.get(i))
                        .map_or(0.0, |&v| f64::from(v));
                    ev[i] - (f.gain - 1.0) * x
                }
                _ if inside => ev[i] - (f.gain - 1.0) * rv[i],
                _ => ev[i],
            };
            d2 += u * u;
            r2 += rv[i] * rv[i];
        }
        if r2 > 0.0 {
            (d2 / r2).sqrt()
        } else {
            0.0
        }
    });
    Some(Systematic {
        overall,
        worst_group: worst.map(|(g, _)| g),
        best_part: best_part.map(|(g, _)| g),
        finding,
        residual,
    })
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
}
