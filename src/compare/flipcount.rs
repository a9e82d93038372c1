//! Judging a wide selection's flips by their distribution: the DSA indexer's top-k at long
//! prompts.
//!
//! [`super::selection`] judges each differing row on its own, by its margin against a
//! tolerance. Once a query sees more keys than the indexer keeps (2048 of GLM-5's), a correct
//! bf16 indexer flips a key or two in about half of its rows, each one a near tie; a tolerance
//! per row wide enough for every one of them would also forgive a bug that moves many keys by
//! a little. So a wide selection is also judged as a whole: how many keys leave it, and by
//! which margins, against what the scores' own noise predicts.
//!
//! # The noise model
//! Each score of row `t` carries an independent error of standard deviation `sigma_t`. The
//! reference's selection is the top-k of its scores `s`; its boundary is `theta_t = (lowest
//! selected + highest unselected) / 2`. A selected key `i` leaves when its noisy score falls
//! below the noisy boundary, with probability `Q((s_i - theta_t) / sigma_p)`, and an unselected
//! key `j` enters with `Q((theta_t - s_j) / sigma_p)`, where `Q` is the standard normal's upper
//! tail and `sigma_p = sqrt(2) sigma_t` (two noisy scores: the key's and the boundary key's). A
//! top-k of fixed width swaps as many keys in as out, so the keys expected to leave row `t` are
//! `E_t = (sum over selected + sum over unselected) / 2`, and over the hook `E = sum E_t`.
//!
//! `sigma_t` is:
//! - **measured** where the candidate's own scores of the row are at hand: the standard
//!   deviation of `c - r` about its mean (a shift common to the row moves no key) over the
//!   [`BAND`] keys nearest the boundary on each side, which is where the noise decides; never
//!   more than the score hook's relative tolerance times the RMS of the row's scores (what
//!   the precision model allows them): a candidate's wrong scores cannot widen their own test;
//! - **predicted** otherwise: the score hook's relative tolerance without the floors' safety
//!   factor (`rel_tol / SAFETY`), times the RMS of the row's scores. That estimate sits about
//!   3.5x above what correct bf16 engines show (floors.rs), so the prediction is lenient.
//!
//! # The tests
//! - **count**: the keys that left the reference's selection, summed over the rows judged,
//!   must not exceed [`count_bound`]`(E)`: a few times `E` plus Poisson-like slack, because
//!   real errors are neither independent nor exactly normal (correlated errors move fewer
//!   keys than independent ones, so the model over-predicts on correct engines).
//! - **margins**: with measured noise, a flip whose margin is more than [`z_max`] noise
//!   standard deviations (`sigma_p`) is one noise of that size does not make among that many
//!   keys (the largest of `n` normal draws stays below `sqrt(2 ln n)`); the row counts as a
//!   confident flip.
//!
//! - **own scores**: where the scores the candidate's selection was made from are at hand (its
//!   own score hook, in chained mode or from a trace; in replay of an engine, the reference's
//!   scores it was given), its selection must be their top-k: no unselected key may score
//!   above a selected one by more than the rounding of the candidate's storage (`2 u max(|a|,
//!   |b|)`: ties the dump's rounding made). A top-k bug (a key skipped at the boundary, a
//!   masked key kept) breaks this in every row it touches, however small its margins on the
//!   reference's scores.
//!
//! Rows where the selection keeps every causal key (no pruning) expect no flip and have none.
//! Nothing here prints.

use serde::Serialize;

use super::floors::SAFETY;

/// Keys on each side of the boundary whose score errors measure a row's noise.
pub const BAND: usize = 32;

/// The distribution of one selection hook's flips against what its scores' noise predicts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlipCount {
    /// Rows judged (rows an unfollowed selection difference upstream reaches are left out).
    pub rows: usize,
    /// Keys that left the reference's selection, summed over those rows.
    pub observed: usize,
    /// Keys the noise model expects to leave (`E`).
    pub expected: f64,
    /// Most keys allowed to leave ([`count_bound`]).
    pub bound: f64,
    /// Whether `sigma` was measured from the candidate's scores (otherwise predicted from the
    /// precision floor).
    pub measured: bool,
    /// Median over the rows of `sigma_t / rms(row)`: the scores' noise relative to their size.
    pub noise: f64,
    /// Largest margin of a flipped row in units of its `sigma_p` (`None`: no flip).
    pub max_z: Option<f64>,
    /// The margin allowed in units of `sigma_p` ([`z_max`]; measured noise only).
    pub z_allowed: Option<f64>,
    /// Flipped rows whose margin is beyond `z_allowed`.
    pub beyond_z: usize,
    /// The first of those rows.
    pub first_beyond_z: Option<usize>,
    /// Rows checked against the scores the candidate selected from (0: not at hand).
    pub own_rows: usize,
    /// Of those, rows whose selection is not the top-k of those scores.
    pub not_top_k: usize,
    /// The first such row: `(row, gap, tie tolerance)`, the gap by which an unselected key
    /// scores above a selected one (infinite: a selected key has no finite score).
    pub first_not_top_k: Option<(usize, f64, f64)>,
}

impl FlipCount {
    /// Whether the flips are more, or wider, than the noise makes.
    pub fn exceeded(&self) -> bool {
        self.observed as f64 > self.bound || self.beyond_z > 0 || self.not_top_k > 0
    }

    /// Adds the check against the scores the candidate selected from: `(row, result)` of
    /// [`not_top_k`] for each row checked.
    pub fn with_own(mut self, rows: usize, bad: &[(usize, f64, f64)]) -> FlipCount {
        self.own_rows = rows;
        self.not_top_k = bad.len();
        self.first_not_top_k = bad.first().copied();
        self
    }
}

/// Whether `ids` (-1 padding ignored) are the top-k of `own`, the scores they were selected
/// from, within ties of relative size `2 u`: `Some((gap, tolerance))` when not (an unselected
/// key scores `gap` above the lowest selected one, more than `tolerance`; a selected key
/// without a finite score gives an infinite gap).
pub fn not_top_k(own: &[f32], ids: &[i32], u: f64) -> Option<(f64, f64)> {
    let n = own.len();
    let mut selected = vec![false; n];
    let mut lo = f64::INFINITY;
    for &i in ids.iter().filter(|&&i| i >= 0) {
        match own.get(i as usize) {
            Some(v) if v.is_finite() => {
                selected[i as usize] = true;
                lo = lo.min(f64::from(*v));
            }
            _ => return Some((f64::INFINITY, 0.0)),
        }
    }
    let hi = own
        .iter()
        .enumerate()
        .filter(|(i, v)| !selected[*i] && v.is_finite())
        .map(|(_, &v)| f64::from(v))
        .fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let tol = 2.0 * u * lo.abs().max(hi.abs());
    (hi - lo > tol).then_some((hi - lo, tol))
}

/// The most keys a correct engine may flip when the noise model expects `e`: `2 e + 4 sqrt(e)
/// + 4`. The factor 2 covers a noise estimate low by up to 40% (the flips grow about linearly
/// with `sigma`), the square root a count's own spread, the constant a handful of exact ties.
pub fn count_bound(e: f64) -> f64 {
    2.0 * e + 4.0 * e.max(0.0).sqrt() + 4.0
}

/// The largest margin, in noise standard deviations, that noise makes among `n` key
/// comparisons: `sqrt(2 ln n) + 2` (the largest of `n` standard normal draws stays below
/// `sqrt(2 ln n)` with probability tending to one; 2 more leaves a margin for a noise estimate
/// from [`BAND`] keys).
pub fn z_max(n: usize) -> f64 {
    (2.0 * (n.max(2) as f64).ln()).sqrt() + 2.0
}

/// One row's inputs: the reference's scores (non-finite: not a key, e.g. masked), the
/// candidate's scores of the same row when at hand, and both selections (-1 padding).
pub struct Row<'a> {
    /// Reference scores.
    pub reference: &'a [f32],
    /// Candidate scores.
    pub candidate: Option<&'a [f32]>,
    /// The reference's selected ids.
    pub ref_ids: &'a [i32],
    /// The candidate's selected ids.
    pub cand_ids: &'a [i32],
}

/// What one row contributes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowCount {
    /// Keys expected to leave.
    pub expected: f64,
    /// Keys that left.
    pub observed: usize,
    /// `sigma_t`.
    pub sigma: f64,
    /// `sigma_t / rms(row)`.
    pub relative: f64,
    /// Whether `sigma_t` was measured.
    pub measured: bool,
    /// The row's margin in units of `sigma_p` when it flipped.
    pub z: Option<f64>,
}

/// Counts one row (module documentation); `rel_tol` is the score hook's relative tolerance
/// (the prediction's source where the candidate's scores are not at hand). `None` when the row
/// has no finite reference score.
pub fn count_row(row: &Row<'_>, rel_tol: f64) -> Option<RowCount> {
    let r = row.reference;
    let n = r.len();
    let mut selected = vec![false; n];
    for &i in row.ref_ids {
        if i >= 0 && (i as usize) < n {
            selected[i as usize] = true;
        }
    }
    let (mut lo_sel, mut hi_un) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut sq, mut finite) = (0.0f64, 0usize);
    for (i, &x) in r.iter().enumerate() {
        if !x.is_finite() {
            continue;
        }
        let x = f64::from(x);
        sq += x * x;
        finite += 1;
        if selected[i] {
            lo_sel = lo_sel.min(x);
        } else {
            hi_un = hi_un.max(x);
        }
    }
    if finite == 0 {
        return None;
    }
    let rms = (sq / finite as f64).sqrt();
    let left = left_keys(row.ref_ids, row.cand_ids, r);
    // Every causal key kept, or nothing kept: no boundary, nothing expected.
    if !lo_sel.is_finite() || !hi_un.is_finite() {
        return Some(RowCount {
            expected: 0.0,
            observed: left.len(),
            sigma: 0.0,
            relative: 0.0,
            measured: row.candidate.is_some(),
            z: (!left.is_empty()).then_some(f64::INFINITY),
        });
    }
    let theta = 0.5 * (lo_sel + hi_un);
    // Measured noise may narrow the prediction, never widen what the precision model allows
    // the scores (module documentation).
    let measured = row
        .candidate
        .and_then(|c| band_sigma(r, c, theta))
        .map(|m| m.min(rel_tol * rms));
    let sigma = measured.unwrap_or(rel_tol / SAFETY * rms);
    let sp = std::f64::consts::SQRT_2 * sigma;
    let mut e = 0.0;
    if sp > 0.0 {
        for (i, &x) in r.iter().enumerate() {
            if !x.is_finite() {
                continue;
            }
            let d = (f64::from(x) - theta) / sp;
            let d = if selected[i] { d } else { -d };
            if d < 9.0 {
                e += upper_tail(d);
            }
        }
        e *= 0.5;
    }
    let z = row_z(r, row.ref_ids, row.cand_ids, &left, sp);
    Some(RowCount {
        expected: e,
        observed: left.len(),
        sigma,
        relative: if rms > 0.0 { sigma / rms } else { 0.0 },
        measured: measured.is_some(),
        z,
    })
}

/// Sums rows (`rows` in order; `n_keys` the finite keys over all of them, for [`z_max`]).
pub fn summarize(rows: &[(usize, RowCount)], n_keys: usize) -> FlipCount {
    let expected: f64 = rows.iter().map(|(_, r)| r.expected).sum();
    let observed: usize = rows.iter().map(|(_, r)| r.observed).sum();
    let measured = !rows.is_empty() && rows.iter().all(|(_, r)| r.measured);
    let mut rel: Vec<f64> = rows
        .iter()
        .filter(|(_, r)| r.sigma > 0.0)
        .map(|(_, r)| r.relative)
        .collect();
    rel.sort_by(f64::total_cmp);
    let noise = rel.get(rel.len() / 2).copied().unwrap_or(0.0);
    let max_z = rows
        .iter()
        .filter_map(|(_, r)| r.z)
        .fold(None, |m: Option<f64>, z| Some(m.map_or(z, |m| m.max(z))));
    let z_allowed = measured.then(|| z_max(n_keys));
    let beyond: Vec<usize> = match z_allowed {
        Some(zl) => rows
            .iter()
            .filter(|(_, r)| r.z.is_some_and(|z| z > zl))
            .map(|(t, _)| *t)
            .collect(),
        None => Vec::new(),
    };
    FlipCount {
        rows: rows.len(),
        observed,
        expected,
        bound: count_bound(expected),
        measured,
        noise,
        max_z,
        z_allowed,
        beyond_z: beyond.len(),
        first_beyond_z: beyond.first().copied(),
        own_rows: 0,
        not_top_k: 0,
        first_not_top_k: None,
    }
}

/// The reference's selected ids (with a finite score) the candidate did not select.
fn left_keys(ref_ids: &[i32], cand_ids: &[i32], r: &[f32]) -> Vec<i32> {
    let mut c: Vec<i32> = cand_ids.iter().copied().filter(|&x| x >= 0).collect();
    c.sort_unstable();
    let mut out: Vec<i32> = ref_ids
        .iter()
        .copied()
        .filter(|&x| x >= 0 && c.binary_search(&x).is_err())
        .filter(|&x| r.get(x as usize).is_some_and(|v| v.is_finite()))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A row's margin in units of `sp`: over the keys that entered, the largest distance from the
/// nearest key that left (the margin of [`super::selection`]); `None` without a flip; infinite
/// for a key with no finite score, or a selection of another size.
fn row_z(r: &[f32], ref_ids: &[i32], cand_ids: &[i32], left: &[i32], sp: f64) -> Option<f64> {
    let mut rs: Vec<i32> = ref_ids.iter().copied().filter(|&x| x >= 0).collect();
    rs.sort_unstable();
    rs.dedup();
    let mut entered: Vec<i32> = cand_ids
        .iter()
        .copied()
        .filter(|&x| x >= 0 && rs.binary_search(&x).is_err())
        .collect();
    entered.sort_unstable();
    entered.dedup();
    if entered.is_empty() && left.is_empty() {
        return None;
    }
    let score = |i: i32| -> f64 {
        r.get(i as usize)
            .map_or(f64::NAN, |&v| f64::from(v))
            .max(f64::NEG_INFINITY)
    };
    let mut out_scores: Vec<f64> = left.iter().map(|&l| score(l)).collect();
    if entered.len() != left.len() || out_scores.iter().any(|v| !v.is_finite()) {
        return Some(f64::INFINITY);
    }
    out_scores.sort_by(f64::total_cmp);
    let mut worst = 0.0f64;
    for &e in &entered {
        let s = score(e);
        if !s.is_finite() {
            return Some(f64::INFINITY);
        }
        let at = out_scores.partition_point(|&v| v < s);
        let mut best = f64::INFINITY;
        if at < out_scores.len() {
            best = best.min(out_scores[at] - s);
        }
        if at > 0 {
            best = best.min(s - out_scores[at - 1]);
        }
        worst = worst.max(best);
    }
    Some(if sp > 0.0 {
        worst / sp
    } else if worst > 0.0 {
        f64::INFINITY
    } else {
        0.0
    })
}

/// The standard deviation (about the mean) of `c - r` over the [`BAND`] keys nearest `theta` on
/// each side; `None` with fewer than 4 keys where both are finite.
fn band_sigma(r: &[f32], c: &[f32], theta: f64) -> Option<f64> {
    let mut above: Vec<(f64, f64)> = Vec::new();
    let mut below: Vec<(f64, f64)> = Vec::new();
    for (&a, &b) in r.iter().zip(c) {
        if !(a.is_finite() && b.is_finite()) {
            continue;
        }
        let (a, b) = (f64::from(a), f64::from(b));
        let d = a - theta;
        if d >= 0.0 {
            above.push((d, b - a));
        } else {
            below.push((-d, b - a));
        }
    }
    let mut errs: Vec<f64> = Vec::with_capacity(2 * BAND);
    for side in [&mut above, &mut below] {
        if side.len() > BAND {
            side.select_nth_unstable_by(BAND - 1, |x, y| x.0.total_cmp(&y.0));
            side.truncate(BAND);
        }
        errs.extend(side.iter().map(|x| x.1));
    }
    if errs.len() < 4 {
        return None;
    }
    let n = errs.len() as f64;
    let mean = errs.iter().sum::<f64>() / n;
    let var = errs.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / (n - 1.0);
    Some(var.sqrt())
}

/// The standard normal's upper tail `Q(x) = P(Z > x)` (erfc by Numerical Recipes' Chebyshev
/// fit, `erfcc`: relative error below 1.2e-7 everywhere).
pub fn upper_tail(x: f64) -> f64 {
    0.5 * erfc(x / std::f64::consts::SQRT_2)
}

/// The complementary error function (Numerical Recipes 2nd ed., 6.2, `erfcc`).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_tail_by_table() {
        // Standard normal tail values (15 digits); the fit's relative error is below 1.2e-7.
        for (x, q) in [
            (0.0, 0.5),
            (1.0, 0.158_655_253_931_457),
            (1.96, 0.024_997_895_148_220),
            (3.0, 0.001_349_898_031_630),
            (-1.0, 0.841_344_746_068_543),
            (5.0, 2.866_515_718_791_939e-7),
        ] {
            let got = upper_tail(x);
            assert!(
                (got - q).abs() <= 2e-7 * q.max(1e-3),
                "Q({x}) = {got}, table {q}"
            );
        }
    }

    #[test]
    fn expected_flips_by_hand() {
        // Scores 4, 3, 1, 0; top-2 {0, 1}: theta = 2. Predicted sigma = rel/SAFETY * rms with
        // rel = 4 * SAFETY / rms(scores) chosen so that sigma = 1 (rms = sqrt(26/4)).
        let r = [4.0f32, 3.0, 1.0, 0.0];
        let rms = (26.0f64 / 4.0).sqrt();
        let rel = SAFETY / rms;
        let row = Row {
            reference: &r,
            candidate: None,
            ref_ids: &[0, 1],
            cand_ids: &[0, 1],
        };
        let got = count_row(&row, rel).unwrap();
        let sp = std::f64::consts::SQRT_2;
        // Selected: 4 and 3 at distances 2 and 1; unselected 1 and 0 at 1 and 2.
        let by_hand = 0.5 * (2.0 * upper_tail(2.0 / sp) + 2.0 * upper_tail(1.0 / sp));
        assert!((got.expected - by_hand).abs() < 1e-12);
        assert_eq!(got.observed, 0);
        assert_eq!(got.z, None);
        assert!((got.sigma - 1.0).abs() < 1e-12);
        assert!(!got.measured);
    }

    #[test]
    fn a_flip_and_its_margin_in_sigmas() {
        let r = [4.0f32, 3.0, 1.0, 0.0];
        let rel = SAFETY / (26.0f64 / 4.0).sqrt();
        let row = Row {
            reference: &r,
            candidate: None,
            ref_ids: &[0, 1],
            cand_ids: &[0, 2],
        };
        let got = count_row(&row, rel).unwrap();
        assert_eq!(got.observed, 1);
        // Key 2 (score 1) in, key 1 (score 3) out: margin 2, sigma_p = sqrt(2).
        assert!((got.z.unwrap() - 2.0 / std::f64::consts::SQRT_2).abs() < 1e-12);
        // A selection of another size, and a masked key, are infinitely far.
        let row = Row {
            reference: &[4.0, 3.0, f32::NEG_INFINITY, 0.0],
            candidate: None,
            ref_ids: &[0, 1],
            cand_ids: &[0, 2],
        };
        assert_eq!(count_row(&row, rel).unwrap().z, Some(f64::INFINITY));
    }

    #[test]
    fn measured_noise_is_the_band_spread_about_its_mean() {
        // A common shift of 0.5 moves nothing: only the spread (+-0.1) counts.
        let r: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let c: Vec<f32> = r
            .iter()
            .enumerate()
            .map(|(i, &x)| x + 0.5 + if i % 2 == 0 { 0.1 } else { -0.1 })
            .collect();
        let row = Row {
            reference: &r,
            candidate: Some(&c),
            ref_ids: &[7, 6, 5, 4],
            cand_ids: &[7, 6, 5, 4],
        };
        let got = count_row(&row, 1.0).unwrap();
        assert!(got.measured);
        // 8 errors of +-0.1 about mean 0: sample std 0.1 * sqrt(8/7).
        let by_hand = 0.1 * (8.0f64 / 7.0).sqrt();
        assert!((got.sigma - by_hand).abs() < 1e-6, "{}", got.sigma);
    }

    #[test]
    fn a_row_that_keeps_every_key_expects_nothing() {
        let row = Row {
            reference: &[1.0, 2.0, f32::NEG_INFINITY],
            candidate: None,
            ref_ids: &[1, 0, -1],
            cand_ids: &[0, 1, -1],
        };
        let got = count_row(&row, 0.1).unwrap();
        assert_eq!((got.expected, got.observed, got.z), (0.0, 0, None));
    }

    #[test]
    fn a_selection_must_be_the_top_k_of_its_own_scores() {
        let own = [4.0f32, 3.0, 2.0, 1.0, f32::NEG_INFINITY];
        assert_eq!(not_top_k(&own, &[0, 1, -1], 2f64.powi(-8)), None);
        // Key 2 kept instead of key 1: an unselected key 1.0 above the lowest selected.
        let (gap, tol) = not_top_k(&own, &[0, 2], 2f64.powi(-8)).unwrap();
        assert_eq!(gap, 1.0);
        assert_eq!(tol, 2.0 * 2f64.powi(-8) * 3.0);
        // A tie within the rounding passes; a masked key kept never does.
        assert_eq!(not_top_k(&[4.0, 3.0, 3.01], &[0, 1], 2f64.powi(-8)), None);
        assert_eq!(
            not_top_k(&own, &[0, 4], 2f64.powi(-8)),
            Some((f64::INFINITY, 0.0))
        );
        // Every key kept: nothing to compare.
        assert_eq!(not_top_k(&[1.0, 2.0], &[1, 0], 0.0), None);
    }

    #[test]
    fn bounds_by_hand() {
        assert_eq!(count_bound(0.0), 4.0);
        assert_eq!(count_bound(100.0), 244.0);
        let z = z_max(1_000_000);
        assert!((z - ((2.0 * 1e6f64.ln()).sqrt() + 2.0)).abs() < 1e-12);
        let rows = vec![
            (
                0,
                RowCount {
                    expected: 1.5,
                    observed: 9,
                    sigma: 1.0,
                    relative: 0.1,
                    measured: true,
                    z: Some(1.0),
                },
            ),
            (
                3,
                RowCount {
                    expected: 0.5,
                    observed: 0,
                    sigma: 1.0,
                    relative: 0.3,
                    measured: true,
                    z: Some(100.0),
                },
            ),
        ];
        let s = summarize(&rows, 1000);
        assert_eq!(s.observed, 9);
        assert_eq!(s.expected, 2.0);
        assert!((s.bound - (4.0 + 4.0 * 2f64.sqrt() + 4.0)).abs() < 1e-12);
        assert!(s.observed as f64 <= s.bound);
        assert_eq!((s.beyond_z, s.first_beyond_z), (1, Some(3)));
        assert!(s.exceeded());
        assert_eq!(s.noise, 0.3);
    }
}
