//! Judging a selection that differs (DSA keys, routed experts) by its margin.
//!
//! A low-precision engine that computes the scores a little differently will pick another key
//! or expert wherever two candidates are nearly tied: that is expected, not a bug. A mapping or
//! router bug picks others with a clear gap. For each row whose selected set differs, with the
//! reference's scores `s` of that row (the DSA index scores, or the router probabilities plus
//! the selection bias):
//!
//! - `entered` = what the candidate chose and the reference did not, `left` = the reverse;
//! - the row's margin is `max over e in entered of min over l in left of |s(e) - s(l)|`: the
//!   score gap between what came in and the closest thing that went out (padding or a masked,
//!   non-causal key makes it infinite);
//! - the row's tolerance is `rel_tol * rms(finite scores of the row)`, where `rel_tol` is the
//!   relative error the precision model allows the scores at the score hook in that mode (its
//!   floor; in chained mode the floor plus what the scores' inputs may carry, never more than
//!   the chained tolerance they were judged by). Nothing the candidate hands over widens it: an
//!   engine whose selection follows its own wrong scores must not be excused by them (the
//!   scores are judged at their own hook, by their floor and along their columns,
//!   [`super::systematic`]'s column test);
//! - with group-limited routing (`n_group` groups of experts, the `used` best by the sum of
//!   their two best scores, as `moe.rs` `route_token` selects), an expert also enters or leaves
//!   with its group: for `e` and `l` in different groups the pair's gap is the smaller of their
//!   score gap and their groups' score gap (a near-tie between two groups moves whole groups),
//!   and where `e`'s group was not among the reference's selected groups, the gap to the
//!   closest of those, where `l`'s group was, the gap to the closest group it did not select (a
//!   near tie of either group with a third one, whose experts need not make the top-k, moves
//!   `e` in and `l` out);
//! - margin <= tolerance: a near-tie flip (expected, counted); otherwise a confident flip (a
//!   divergence).

use rayon::prelude::*;
use serde::Serialize;

use super::metrics::row_set;

/// One flipped row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlipAt {
    /// Row (token).
    pub token: usize,
    /// Score gap between what entered and what left (module documentation).
    pub margin: f64,
    /// What the gap is allowed to be.
    pub tolerance: f64,
    /// Chosen by the candidate only.
    pub entered: Vec<i32>,
    /// Chosen by the reference only.
    pub left: Vec<i32>,
}

/// Flips of one selection hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlipStats {
    /// Rows compared.
    pub rows: usize,
    /// Rows whose sets differ.
    pub differing: usize,
    /// Of those, within the tolerance.
    pub near_tie: usize,
    /// Of those, beyond it (or not judged: no scores).
    pub confident: usize,
    /// Smallest and largest margin over differing rows.
    pub margins: Option<(f64, f64)>,
    /// The largest margin / tolerance.
    pub max_ratio: Option<f64>,
    /// The first differing row.
    pub first: Option<FlipAt>,
    /// The first confident flip.
    pub first_confident: Option<FlipAt>,
    /// Whether the reference's scores were at hand (otherwise every flip counts as confident).
    pub judged: bool,
    /// Chained: near-tie rows whose selection the reference's chain took from the candidate
    /// (so both chains stay comparable downstream).
    pub followed: usize,
    /// Chained: differing rows downstream of a selection difference the reference's chain did
    /// not follow (that difference explains them; they are not judged again).
    pub drift: usize,
    /// A wide selection (the DSA keys): its flips against what the scores' noise predicts
    /// ([`super::flipcount`]).
    pub count: Option<super::flipcount::FlipCount>,
}

/// The reference's scores of one selection: `[rows, cols]` values plus an optional per-column
/// bias added for selection (`exp_probs_b`), and the relative tolerance.
#[derive(Clone, Copy)]
pub struct Scores<'a> {
    /// Row-major scores.
    pub values: &'a [f32],
    /// Columns per row.
    pub cols: usize,
    /// Selection bias per column.
    pub bias: Option<&'a [f32]>,
    /// Relative error allowed at the score hook.
    pub rel_tol: f64,
    /// Group-limited routing: `(n_group, used)` (expert selections only).
    pub groups: Option<(usize, usize)>,
    /// An unknown selection bias (two traces, no model): `[cols, cols]` lower bounds on
    /// `bias[a] - bias[b]` that the reference's own selections imply ([`implied_bias`]); a
    /// pair's gap is then the smallest any such bias leaves.
    pub implied: Option<&'a [f64]>,
    /// The candidate's own scores of the same `[rows, cols]` (without bias), when its trace
    /// has them: [`super::flipcount`] measures their noise, which may only narrow what the
    /// precision model predicts (module documentation: they never widen a tolerance).
    pub candidate: Option<&'a [f32]>,
}

/// What the reference's own selections say about a selection bias it added to `scores` (an
/// expert router's `exp_probs_b`, unknown without the model): each row that selected `s` and
/// not `u` says `bias[s] - bias[u] >= scores[u] - scores[s]`; closed over paths (longest
/// paths, Floyd-Warshall), `[cols, cols]` lower bounds on `bias[a] - bias[b]`
/// (`-inf`: unbounded). `None` when the selections contradict each other beyond `slack` (a
/// cycle of positive length: another rule chose, such as group-limited routing).
pub fn implied_bias(
    scores: &[f32],
    cols: usize,
    ids: &[i32],
    width: usize,
    slack: f64,
) -> Option<Vec<f64>> {
    let (c, w) = (cols.max(1), width.max(1));
    let mut g = vec![f64::NEG_INFINITY; c * c];
    for i in 0..c {
        g[i * c + i] = 0.0;
    }
    for (row, sel) in scores.chunks(c).zip(ids.chunks(w)) {
        let chosen: Vec<usize> = sel
            .iter()
            .filter(|&&x| x >= 0 && (x as usize) < c)
            .map(|&x| x as usize)
            .collect();
        for &a in &chosen {
            for b in (0..c).filter(|b| !chosen.contains(b)) {
                let (sa, sb) = (f64::from(row[a]), f64::from(row[b]));
                if sa.is_finite() && sb.is_finite() {
                    let v = &mut g[a * c + b];
                    *v = v.max(sb - sa);
                }
            }
        }
    }
    for k in 0..c {
        for i in 0..c {
            let ik = g[i * c + k];
            if ik == f64::NEG_INFINITY {
                continue;
            }
            for j in 0..c {
                let v = ik + g[k * c + j];
                if v > g[i * c + j] {
                    g[i * c + j] = v;
                }
            }
        }
    }
    (0..c).all(|i| g[i * c + i] <= slack).then_some(g)
}

/// Judges the rows of `candidate` against `reference` (`width` ids per row, -1 padding).
pub fn judge_flips(
    reference: &[i32],
    candidate: &[i32],
    width: usize,
    scores: Option<&Scores<'_>>,
) -> FlipStats {
    let w = width.max(1);
    let mut st = FlipStats {
        rows: row_count(reference, candidate, w),
        differing: 0,
        near_tie: 0,
        confident: 0,
        margins: None,
        max_ratio: None,
        first: None,
        first_confident: None,
        judged: scores.is_some(),
        followed: 0,
        drift: 0,
        count: None,
    };
    // Each differing row judged on the threads, gathered in row order.
    let flips: Vec<FlipAt> = row_differences(reference, candidate, w)
        .into_par_iter()
        .map(|(t, entered, left)| {
            let (margin, tolerance) = match scores {
                None => (f64::INFINITY, 0.0),
                Some(s) => row_margin(s, t, &entered, &left),
            };
            FlipAt {
                token: t,
                margin,
                tolerance,
                entered,
                left,
            }
        })
        .collect();
    for at in flips {
        st.differing += 1;
        let (margin, tolerance) = (at.margin, at.tolerance);
        st.margins = Some(match st.margins {
            None => (margin, margin),
            Some((a, b)) => (a.min(margin), b.max(margin)),
        });
        let ratio = if tolerance > 0.0 {
            margin / tolerance
        } else {
            f64::INFINITY
        };
        st.max_ratio = Some(st.max_ratio.map_or(ratio, |r: f64| r.max(ratio)));
        if margin <= tolerance {
            st.near_tie += 1;
        } else {
            st.confident += 1;
            if st.first_confident.is_none() {
                st.first_confident = Some(at.clone());
            }
        }
        if st.first.is_none() {
            st.first = Some(at);
        }
    }
    st
}

/// The rows of `candidate` whose set differs from `reference`'s only by near-tie flips (margin
/// within the row's tolerance, as [`judge_flips`] counts them), in order; none without scores.
pub fn near_tie_rows(
    reference: &[i32],
    candidate: &[i32],
    width: usize,
    scores: Option<&Scores<'_>>,
) -> Vec<usize> {
    let Some(s) = scores else {
        return Vec::new();
    };
    row_differences(reference, candidate, width.max(1))
        .into_par_iter()
        .filter(|(t, entered, left)| {
            let (margin, tolerance) = row_margin(s, *t, entered, left);
            margin <= tolerance
        })
        .map(|(t, _, _)| t)
        .collect()
}

/// The rows whose sets differ (as [`judge_flips`] counts them), in order.
pub fn differing_rows(reference: &[i32], candidate: &[i32], width: usize) -> Vec<usize> {
    let w = width.max(1);
    reference
        .par_chunks(w)
        .zip(candidate.par_chunks(w))
        .enumerate()
        .filter(|(_, (rr, cr))| row_difference(rr, cr).is_some())
        .map(|(t, _)| t)
        .collect()
}

/// The rows both selections have (`w` ids a row, a last short row counted).
fn row_count(reference: &[i32], candidate: &[i32], w: usize) -> usize {
    reference.len().div_ceil(w).min(candidate.len().div_ceil(w))
}

/// Each row whose sets differ, with what entered it and what left it ([`row_difference`]), in
/// row order; the rows are compared on the threads.
fn row_differences(
    reference: &[i32],
    candidate: &[i32],
    w: usize,
) -> Vec<(usize, Vec<i32>, Vec<i32>)> {
    reference
        .par_chunks(w)
        .zip(candidate.par_chunks(w))
        .enumerate()
        .filter_map(|(t, (rr, cr))| row_difference(rr, cr).map(|(e, l)| (t, e, l)))
        .collect()
}

/// What entered a row's set and what left it, `None` when the sets (and their padding) agree.
fn row_difference(rr: &[i32], cr: &[i32]) -> Option<(Vec<i32>, Vec<i32>)> {
    if crate::trace::rows_agree(rr, cr) {
        return None;
    }
    let (sr, sc) = (row_set(rr), row_set(cr));
    let entered: Vec<i32> = sc
        .iter()
        .copied()
        .filter(|x| sr.binary_search(x).is_err())
        .collect();
    let left: Vec<i32> = sr
        .iter()
        .copied()
        .filter(|x| sc.binary_search(x).is_err())
        .collect();
    Some((entered, left))
}

/// One row of scores as selection sees it: values with the bias added, group scores, and the
/// row's tolerance.
struct RowScores<'a> {
    row: &'a [f32],
    s: &'a Scores<'a>,
    /// Group-limited routing: the sum of each group's two best selection scores.
    group_scores: Option<Vec<f64>>,
    /// `rel_tol * rms(finite scores of the row)`.
    tolerance: f64,
}

impl<'a> RowScores<'a> {
    /// Row `t` of `s`, `None` past the last row.
    fn new(s: &'a Scores<'a>, t: usize) -> Option<RowScores<'a>> {
        let row = s.values.get(t * s.cols..(t + 1) * s.cols)?;
        let finite: Vec<f64> = row
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from(x))
            .collect();
        let rms = if finite.is_empty() {
            0.0
        } else {
            (finite.iter().map(|x| x * x).sum::<f64>() / finite.len() as f64).sqrt()
        };
        let mut r = RowScores {
            row,
            s,
            group_scores: None,
            tolerance: s.rel_tol * rms,
        };
        r.group_scores = s.groups.filter(|&(g, _)| g > 0).map(|(g, _)| {
            let size = (s.cols / g).max(1);
            (0..g)
                .map(|k| {
                    let mut v: Vec<f64> = (k * size..((k + 1) * size).min(s.cols))
                        .map(|i| r.score(i as i32))
                        .collect();
                    v.sort_by(|a, b| b.total_cmp(a));
                    v.iter().take(2).sum()
                })
                .collect()
        });
        Some(r)
    }

    /// Selection score of column `i` (bias added); NaN outside the row.
    fn score(&self, i: i32) -> f64 {
        if i < 0 || i as usize >= self.s.cols {
            return f64::NAN;
        }
        let b = self
            .s
            .bias
            .and_then(|b| b.get(i as usize))
            .map_or(0.0, |&b| f64::from(b));
        f64::from(self.row[i as usize]) + b
    }

    /// The gap between `e` entering and `l` leaving (module documentation): their score gap,
    /// or their groups' when that is smaller; infinite when either is not a score.
    fn pair_gap(&self, e: i32, l: i32) -> f64 {
        let gap = |a: f64, b: f64| -> f64 {
            let d = (a - b).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                d
            }
        };
        if let Some(g) = self.s.implied {
            // `l` was selected over `e`: the smallest gap a bias consistent with every row's
            // selection leaves (0 where nothing bounds them).
            let c = self.s.cols;
            let (el, le) = (e as usize, l as usize);
            if e < 0 || l < 0 || el >= c || le >= c {
                return f64::INFINITY;
            }
            let d = f64::from(self.row[le]) - f64::from(self.row[el]) + g[le * c + el];
            return if d.is_nan() {
                f64::INFINITY
            } else {
                d.max(0.0)
            };
        }
        let d = gap(self.score(e), self.score(l));
        match (&self.group_scores, self.s.groups) {
            (Some(gs), Some((g, used))) if e >= 0 && l >= 0 => {
                let group_of = |i: i32| (i as usize) / (self.s.cols / g).max(1);
                let (ge, gl) = (group_of(e), group_of(l));
                if ge == gl || ge >= gs.len() || gl >= gs.len() {
                    return d;
                }
                // `e`'s group entered the selected groups: it displaced one of them, `l`'s
                // or another whose experts did not make the top-k (a near tie of two groups
                // then moves an expert of a third): the closest selected group's gap.
                let mut dg = gap(gs[ge], gs[gl]);
                let selected = top_groups(gs, used);
                if !selected.contains(&ge) {
                    for &k in &selected {
                        dg = dg.min(gap(gs[ge], gs[k]));
                    }
                }
                // `l`'s group left the selected groups: displaced by a group the reference did
                // not select, whose own experts need not make the top-k either.
                if selected.contains(&gl) {
                    for k in (0..gs.len()).filter(|k| !selected.contains(k)) {
                        dg = dg.min(gap(gs[gl], gs[k]));
                    }
                }
                d.min(dg)
            }
            _ => d,
        }
    }
}

/// The `used` best groups by group score, ties to the lower index (as `moe.rs` selects them).
fn top_groups(gs: &[f64], used: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..gs.len()).collect();
    order.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]).then(a.cmp(&b)));
    order.truncate(used);
    order
}

/// `(margin, tolerance)` of row `t` (module documentation).
fn row_margin(s: &Scores<'_>, t: usize, entered: &[i32], left: &[i32]) -> (f64, f64) {
    let Some(r) = RowScores::new(s, t) else {
        return (f64::INFINITY, 0.0);
    };
    // Different counts (padding where the other side has a key) cannot be a tie.
    let margin = if entered.len() != left.len() {
        f64::INFINITY
    } else {
        entered
            .iter()
            .map(|&e| {
                left.iter()
                    .map(|&l| r.pair_gap(e, l))
                    .fold(f64::INFINITY, f64::min)
            })
            .fold(0.0, f64::max)
    };
    (margin, r.tolerance)
}

/// Whether row `t` of a selection made from `s` (`chosen`, -1 padding ignored) has any
/// near-tie alternative: a selected id and an unselected one with a finite score whose gap (as
/// [`judge_flips`] measures it) is within the row's tolerance.
pub fn has_near_tie(s: &Scores<'_>, t: usize, chosen: &[i32]) -> bool {
    let Some(r) = RowScores::new(s, t) else {
        return false;
    };
    let tol = r.tolerance;
    if tol.is_nan() || tol <= 0.0 {
        return false;
    }
    let selected: Vec<i32> = chosen
        .iter()
        .copied()
        .filter(|&i| r.score(i).is_finite())
        .collect();
    (0..s.cols as i32)
        .filter(|i| !selected.contains(i) && r.score(*i).is_finite())
        .any(|e| selected.iter().any(|&l| r.pair_gap(e, l) <= tol))
}

/// One near-tie alternative of a selected row: the ids of `left` replaced by those of
/// `entered` (one each for a swap; a group's experts for a flip of two groups).
#[derive(Clone, Debug, PartialEq)]
pub struct NearTieSwap {
    /// Selected, leave.
    pub left: Vec<i32>,
    /// Not selected, enter (as many).
    pub entered: Vec<i32>,
    /// The gap ([`judge_flips`]' margin of the row this alternative would give).
    pub margin: f64,
    /// The row's tolerance.
    pub tolerance: f64,
}

/// The near-tie alternatives of row `t` of a selection made from `s` itself (`chosen`, -1
/// padding ignored), smallest gap first, at most `max`, each within the row's tolerance:
///
/// - a single swap of a selected id for an unselected one with a finite score, whose score gap
///   is within it (with group-limited routing, only ids of the selected groups: what a near tie
///   of two experts changes);
/// - with group-limited routing, a flip of a selected group for an unselected one whose group
///   scores are within it: the top-k over the other groups (what a near tie of two groups
///   changes).
///
/// These are the flips a near tie makes of a top-k; each is judged by the same gap as
/// [`judge_flips`].
pub fn near_tie_swaps(s: &Scores<'_>, t: usize, chosen: &[i32], max: usize) -> Vec<NearTieSwap> {
    let Some(r) = RowScores::new(s, t) else {
        return Vec::new();
    };
    let tol = r.tolerance;
    if max == 0 || tol.is_nan() || tol <= 0.0 {
        return Vec::new();
    }
    let mut selected: Vec<i32> = chosen
        .iter()
        .copied()
        .filter(|&i| r.score(i).is_finite())
        .collect();
    selected.sort_unstable();
    selected.dedup();
    // With groups: the selected groups (the `used` best by group score, ties to the lower).
    let groups: Option<(usize, Vec<usize>, &Vec<f64>)> = match (&r.group_scores, s.groups) {
        (Some(gs), Some((g, used))) => Some(((s.cols / g).max(1), top_groups(gs, used), gs)),
        _ => None,
    };
    let in_selected_group = |i: i32| {
        groups
            .as_ref()
            .is_none_or(|(size, keep, _)| keep.contains(&(i as usize / size)))
    };
    let mut others: Vec<i32> = (0..s.cols as i32)
        .filter(|i| {
            selected.binary_search(i).is_err() && r.score(*i).is_finite() && in_selected_group(*i)
        })
        .collect();
    let mut found: Vec<NearTieSwap> = Vec::new();
    // Single swaps: the selected from the lowest score up, the others from the highest down;
    // once a selected id is more than the tolerance above the best other, so are all after it.
    let score = |i: i32| r.score(i);
    selected.sort_by(|&a, &b| score(a).total_cmp(&score(b)));
    others.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
    if let Some(&best_other) = others.first() {
        for &l in &selected {
            if score(l) - score(best_other) > tol {
                break;
            }
            for &e in &others {
                if score(l) - score(e) > tol {
                    break;
                }
                let gap = (score(e) - score(l)).abs();
                if gap <= tol {
                    found.push(NearTieSwap {
                        left: vec![l],
                        entered: vec![e],
                        margin: gap,
                        tolerance: tol,
                    });
                }
            }
        }
    }
    // Group flips: the top-k of the selected groups with one exchanged.
    if let Some((size, keep, gs)) = &groups {
        let k = selected.len();
        for &out in keep {
            for g_in in (0..gs.len()).filter(|g| !keep.contains(g)) {
                let gap = (gs[out] - gs[g_in]).abs();
                if gap.is_nan() || gap > tol {
                    continue;
                }
                let mut pool: Vec<i32> = (0..s.cols as i32)
                    .filter(|&i| {
                        let g = i as usize / size;
                        (g == g_in || (keep.contains(&g) && g != out)) && score(i).is_finite()
                    })
                    .collect();
                pool.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
                pool.truncate(k);
                pool.sort_unstable();
                let entered: Vec<i32> = pool
                    .iter()
                    .copied()
                    .filter(|x| !selected.contains(x))
                    .collect();
                let left: Vec<i32> = selected
                    .iter()
                    .copied()
                    .filter(|x| pool.binary_search(x).is_err())
                    .collect();
                if !entered.is_empty() && entered.len() == left.len() {
                    found.push(NearTieSwap {
                        left,
                        entered,
                        margin: gap,
                        tolerance: tol,
                    });
                }
            }
        }
    }
    found.sort_by(|a, b| a.margin.total_cmp(&b.margin));
    found.truncate(max);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margins_by_hand() {
        // One row of 4 scores [1.0, 0.9, 0.5, 0.1], top-2 reference {0, 1}.
        // rms = sqrt((1 + 0.81 + 0.25 + 0.01) / 4) = sqrt(0.5175) = 0.71937.
        let v = [1.0f32, 0.9, 0.5, 0.1];
        let s = Scores {
            values: &v,
            cols: 4,
            bias: None,
            rel_tol: 0.1, // tolerance 0.071937
            groups: None,
            implied: None,
            candidate: None,
        };
        // Candidate {0, 2}: 2 entered, 1 left: margin |0.5 - 0.9| = 0.4 > 0.072: confident.
        let st = judge_flips(&[0, 1], &[0, 2], 2, Some(&s));
        assert_eq!((st.differing, st.near_tie, st.confident), (1, 0, 1));
        let f = st.first_confident.unwrap();
        assert!(
            (f.margin - 0.4).abs() < 1e-6 && (f.tolerance - 0.1 * 0.5175f64.sqrt()).abs() < 1e-9
        );
        assert_eq!((f.entered, f.left), (vec![2], vec![1]));
        // A bias moves expert 2 next to expert 1: 0.5 + 0.38 = 0.88 vs 0.9: gap 0.02 < 0.072.
        let b = [0.0f32, 0.0, 0.38, 0.0];
        let s = Scores {
            bias: Some(&b),
            ..s
        };
        let st = judge_flips(&[0, 1], &[0, 2], 2, Some(&s));
        assert_eq!((st.near_tie, st.confident), (1, 0));
        assert!((st.margins.unwrap().0 - 0.02).abs() < 1e-6);
        // Order alone is not a flip; padding against a key is confident.
        assert_eq!(judge_flips(&[0, 1], &[1, 0], 2, Some(&s)).differing, 0);
        let st = judge_flips(&[0, 1], &[0, -1], 2, Some(&s));
        assert_eq!(st.confident, 1);
        // Without scores every flip is confident and the stats say it was not judged.
        let st = judge_flips(&[0, 1], &[0, 2], 2, None);
        assert_eq!((st.confident, st.judged), (1, false));
    }

    #[test]
    fn near_tie_swaps_by_hand() {
        // One row [1.0, 0.9, 0.85, 0.5, 0.1], the top-2 {0, 1}; rms = sqrt(2.7925 / 5) =
        // 0.747329.
        let v = [1.0f32, 0.9, 0.85, 0.5, 0.1];
        let s = Scores {
            values: &v,
            cols: 5,
            bias: None,
            rel_tol: 0.1, // tolerance 0.0747
            groups: None,
            implied: None,
            candidate: None,
        };
        // Only 2 for 1 is within it (gap 0.05); 2 for 0 is 0.15, 3 for 1 is 0.4.
        let sw = near_tie_swaps(&s, 0, &[0, 1], 4);
        assert_eq!(sw.len(), 1);
        assert_eq!((&sw[0].left[..], &sw[0].entered[..]), (&[1][..], &[2][..]));
        assert!((sw[0].margin - 0.05).abs() < 1e-6);
        assert!((sw[0].tolerance - 0.1 * 0.5585f64.sqrt()).abs() < 1e-9);
        // A wider tolerance (0.187) lets 2 for 0 in too, after the closer one; `max` cuts.
        let wide = Scores { rel_tol: 0.25, ..s };
        let sw = near_tie_swaps(&wide, 0, &[0, 1], 4);
        let pairs: Vec<(i32, i32)> = sw.iter().map(|x| (x.left[0], x.entered[0])).collect();
        assert_eq!(pairs, [(1, 2), (0, 2)]);
        assert_eq!(near_tie_swaps(&wide, 0, &[0, 1], 1).len(), 1);
        // Masked (non-finite) columns never enter, padding never leaves; past the last row,
        // nothing.
        let m = [1.0f32, f32::NEG_INFINITY, 0.99];
        let s = Scores {
            values: &m,
            cols: 3,
            bias: None,
            rel_tol: 0.1,
            groups: None,
            implied: None,
            candidate: None,
        };
        let sw = near_tie_swaps(&s, 0, &[0, -1], 4);
        let pairs: Vec<(i32, i32)> = sw.iter().map(|x| (x.left[0], x.entered[0])).collect();
        assert_eq!(pairs, [(0, 2)]);
        assert!(near_tie_swaps(&s, 1, &[0, -1], 4).is_empty());
        // The gap is the one flips are judged by: the swap's margin is the flip's margin.
        let st = judge_flips(&[0, -1], &[2, -1], 2, Some(&s));
        assert_eq!(st.margins.unwrap().0, sw[0].margin);
    }

    #[test]
    fn group_ties_move_whole_groups() {
        // 8 experts in 4 groups of 2, 2 groups used. Scores per group: {0.9, 0.1}, {0.5, 0.45},
        // {0.6, 0.3}, {0.2, 0.1}: group scores 1.0, 0.95, 0.9, 0.3: groups 0 and 1 win;
        // top-2 of experts 0..4 -> {0, 2}. A candidate whose group 2 (0.90) beat group 1 (0.95)
        // picks {0, 4}: expert gap |0.6 - 0.5| = 0.1, group gap 0.05.
        let v = [0.9f32, 0.1, 0.5, 0.45, 0.6, 0.3, 0.2, 0.1];
        let s = Scores {
            values: &v,
            cols: 8,
            bias: None,
            rel_tol: 0.1, // rms = sqrt(1.6825 / 8) = 0.45860: tolerance 0.04586
            groups: Some((4, 2)),
            implied: None,
            candidate: None,
        };
        let st = judge_flips(&[0, 2], &[0, 4], 2, Some(&s));
        let m = st.margins.unwrap().0;
        assert!((m - 0.05).abs() < 1e-6, "{m}");
        assert_eq!(st.confident, 1); // 0.05 > 0.0459
        let s = Scores { rel_tol: 0.12, ..s }; // tolerance 0.0550
        assert_eq!(judge_flips(&[0, 2], &[0, 4], 2, Some(&s)).near_tie, 1);
        // Its near-tie alternatives: 3 for 2 (same selected group, gap 0.05), and group 2 for
        // group 1 (group gap 0.05), whose top-2 over groups {0, 2} is {0, 4}: 4 for 2. Group 3
        // (0.3) is far from both selected groups; no swap with an expert of an unselected group.
        let sw = near_tie_swaps(&s, 0, &[0, 2], 4);
        let mut alts: Vec<(Vec<i32>, Vec<i32>)> = sw
            .iter()
            .map(|x| (x.left.clone(), x.entered.clone()))
            .collect();
        alts.sort();
        assert_eq!(alts, [(vec![2], vec![3]), (vec![2], vec![4])]);
        assert!(sw.iter().all(|x| (x.margin - 0.05).abs() < 1e-6));
        // Without groups the same flip has the expert gap 0.1: confident.
        let s = Scores { groups: None, ..s };
        assert_eq!(judge_flips(&[0, 2], &[0, 4], 2, Some(&s)).confident, 1);
    }

    #[test]
    fn a_group_tie_with_a_third_group_moves_an_expert_of_another() {
        // 8 experts in 4 groups of 2, 2 groups used. Scores {0.9, 0.8}, {0.1, 0.05},
        // {0.75, 0.2}, {0.85, 0.09}: group scores 1.7, 0.15, 0.95, 0.94. The reference selects
        // groups 0 and 2, and of their experts {0, 1} (0.75 < 0.8): group 2 keeps none. A
        // candidate whose group 3 beat group 2 selects groups 0 and 3 and the experts {0, 6}:
        // 6 in, 1 out. Their expert gap is 0.05 and their groups' 0.76, but group 3 entered in
        // place of group 2, 0.01 apart: the margin is 0.01.
        let v2 = [0.9f32, 0.8, 0.1, 0.05, 0.75, 0.2, 0.85, 0.09];
        let s = Scores {
            values: &v2,
            cols: 8,
            bias: None,
            rel_tol: 0.05, // rms = sqrt(2.7956 / 8) = 0.5911: tolerance 0.0296
            groups: Some((4, 2)),
            implied: None,
            candidate: None,
        };
        let st = judge_flips(&[0, 1], &[0, 6], 2, Some(&s));
        let m = st.margins.unwrap().0;
        assert!((m - 0.01).abs() < 1e-6, "{m}");
        assert_eq!((st.near_tie, st.confident), (1, 0));
    }

    #[test]
    fn a_group_displaced_by_a_third_group_lets_an_expert_of_a_kept_group_in() {
        // 8 experts in 4 groups of 2, 2 groups used. Scores {0.9, 0.8}, {0.85, 0.1},
        // {0.5, 0.44}, {0, 0}: group scores 1.7, 0.95, 0.94, 0. The reference selects groups
        // 0 and 1 and the experts {0, 2}. A candidate whose group 2 beat group 1 selects groups
        // 0 and 2 and the experts {0, 1} (group 2's best, 0.5, is below 0.8): 1 in, 2 out.
        // Their expert gap is 0.05, their groups' 0.75; group 1 left for group 2, 0.01 apart.
        let v = [0.9f32, 0.8, 0.85, 0.1, 0.5, 0.44, 0.0, 0.0];
        let s = Scores {
            values: &v,
            cols: 8,
            bias: None,
            rel_tol: 0.05, // rms = sqrt(2.6261 / 8) = 0.5729: tolerance 0.0286
            groups: Some((4, 2)),
            implied: None,
            candidate: None,
        };
        let st = judge_flips(&[0, 2], &[0, 1], 2, Some(&s));
        let m = st.margins.unwrap().0;
        assert!((m - 0.01).abs() < 1e-6, "{m}");
        assert_eq!((st.near_tie, st.confident), (1, 0));
    }

    /// Top-1 of 3 with an unknown bias. Row 0 [0.5, 0.45, 0.1] selects 1: b1 - b0 >= 0.05 and
    /// b1 - b2 >= -0.35; row 1 [0.3, 0.32, 0.9] selects 1: b1 - b0 >= -0.02, b1 - b2 >= 0.58.
    /// A candidate selecting 0 in row 0 is a tie under b1 - b0 = 0.05 (gap 0); in row 1 the
    /// smallest gap any consistent bias leaves is 0.32 - 0.3 + 0.05 = 0.07. Rows that contradict
    /// each other (1 over 0 by 0.1 and 0 over 1 by 0.1) imply no bias.
    #[test]
    fn an_unknown_bias_is_bounded_by_the_references_own_selections() {
        let v = [0.5f32, 0.45, 0.1, 0.3, 0.32, 0.9];
        let g = implied_bias(&v, 3, &[1, 1], 1, 1e-9).unwrap();
        assert!(
            (g[3] - 0.05).abs() < 1e-6 && (g[5] - 0.58).abs() < 1e-6,
            "{g:?}"
        );
        assert_eq!(g[1], f64::NEG_INFINITY);
        let s = Scores {
            values: &v,
            cols: 3,
            bias: None,
            rel_tol: 0.05,
            groups: None,
            implied: Some(&g),
            candidate: None,
        };
        let st = judge_flips(&[1, 1], &[0, 0], 1, Some(&s));
        let f = st.first.unwrap();
        assert!(f.margin.abs() < 1e-6, "{f:?}");
        assert_eq!(near_tie_rows(&[1, 1], &[0, 0], 1, Some(&s)), [0]);
        let f = st.first_confident.unwrap();
        assert_eq!(f.token, 1);
        assert!((f.margin - 0.07).abs() < 1e-6, "{f:?}");
        assert!(implied_bias(&[0.5, 0.4, 0.4, 0.5], 2, &[1, 0], 1, 1e-9).is_none());
    }

    #[test]
    fn candidate_scores_never_widen_the_tolerance() {
        // The reference's scores: keys 0 and 1 selected. The candidate's scores have key 2 up
        // by 0.45 and key 1 down by 0.05 (a bug in the scores), and its selection follows them:
        // {0, 2}. rms = sqrt(2.07 / 4) = 0.7194; the tolerance 0.01 * 0.7194 = 0.0072 is all the
        // precision model allows, so the gap 0.4 is confident whatever the candidate's scores.
        let r = [1.0f32, 0.9, 0.5, 0.1];
        let c = [1.0f32, 0.85, 0.95, 0.1];
        for cand in [None, Some(&c[..]), Some(&r[..])] {
            let s = Scores {
                values: &r,
                cols: 4,
                bias: None,
                rel_tol: 0.01,
                groups: None,
                implied: None,
                candidate: cand,
            };
            let st = judge_flips(&[0, 1], &[0, 2], 2, Some(&s));
            assert_eq!((st.near_tie, st.confident), (0, 1));
            let tol = st.first.map(|f| f.tolerance).unwrap_or(f64::NAN);
            assert!((tol - 0.01 * (2.07f64 / 4.0).sqrt()).abs() < 1e-9, "{tol}");
        }
    }
}
