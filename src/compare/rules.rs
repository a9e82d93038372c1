//! The rules a hook is judged by, as one table ([`RULES`]): one row per check, in the order
//! they apply, each with its threshold and the reason for it beside it. The first deciding rule
//! that applies gives the verdict; the rules after the deciding ones are tried on whatever the
//! deciding one left. [`judge_pair`] applies the table to one pair, from what the comparison
//! prepared ([`Judging`]): the floor, what the inputs carry in chained mode, the reference's
//! scores behind a selection, the bug families' directions.

use std::collections::BTreeSet;

use super::chain::{l2, masked_error, Chain};
use super::flipcount::FlipCount;
use super::floors::{point_of, Kind, TOKEN_FACTOR};
use super::judge::Judge;
use super::metrics::{compare, worst_column_judged, FloatMetrics, Metrics};
use super::records::{ModeResult, Status};
use super::selection::{differing_rows, implied_bias, judge_flips, FlipAt, FlipStats, Scores};
use super::systematic::{test as test_systematic, Direction, Layout, Outcome, Part, Systematic};
use crate::trace::{Mode, Pair};

/// How far the reference's selections may contradict the selection bias they imply before the
/// implication is dropped (scores rounded to f32 after a selection made from f64 ones).
pub(super) const IMPLIED_SLACK: f64 = 1e-5;

/// Chained, a score hook's column is held to the larger of its floor and this many times the
/// tensor's own error, where that is below the allowance (the inputs' error at its worst
/// amplification, several times what correct engines show), times [`TOKEN_FACTOR`]. Measured
/// on the committed clean dumps (transformers bf16, llama.cpp), the worst column of 8 to 24
/// values reaches 3.4 x the tensor's error in chained mode where that error is small against
/// the floor (2.5 x in replay); 2 x 3 = 6 x keeps a 1.8x margin there, and the floor bounds
/// the rest. One key's scores x1.5 or x0.5 show 8 to 14 x.
pub const COLUMN_SPREAD: f64 = 2.0;

/// One check of a hook in one mode.
pub struct Rule {
    /// Short name.
    pub name: &'static str,
    /// The hooks and modes it judges.
    pub judges: &'static str,
    /// What it allows.
    pub threshold: &'static str,
    /// Why that threshold.
    pub reason: &'static str,
    /// Whether it gives the verdict when it applies (the first deciding rule that applies
    /// does; the others are not tried), or is tried after the deciding ones.
    pub decides: bool,
    /// Applies the rule; whether it applied.
    check: fn(&Judging<'_>, &mut Verdict) -> bool,
}

/// The rules, in the order they apply (module documentation).
pub const RULES: &[Rule] = &[
    Rule {
        name: "comparable",
        judges: "every hook, both modes",
        threshold: "the same shape and kind (floats or ids) on both sides",
        reason: "values of another shape or kind cannot be the same step's: the hook fails and nothing else is judged; a selection that keeps another number per row than the model says is named so (the candidate keeps K, the model says M), the bug of a wrong top-k or experts per token",
        decides: true,
        check: comparable,
    },
    Rule {
        name: "non-finite",
        judges: "float hooks, both modes",
        threshold: "no NaN/Inf where the reference has a finite value (or the reverse)",
        reason: "rounding never makes a NaN or an Inf out of finite values",
        decides: true,
        check: non_finite,
    },
    Rule {
        name: "per token",
        judges: "float hooks, replay; chained where every input was measured per token and no unfollowed selection difference reaches (not the routing weights, a row's selection's)",
        threshold: "each token's relative L2 error at most TOKEN_FACTOR x the floor (a row far smaller than the typical row against SMALL_ROW of that row); chained, TOKEN_FACTOR x (the floor + chain_amp x the largest error that token's inputs carry, through attention any earlier token's)",
        reason: "a bug in one token's row hides in the whole tensor's error; rounding spreads over every row alike",
        decides: true,
        check: per_token,
    },
    Rule {
        name: "per column",
        judges: "score hooks (indexer_scores: a key's column; moe_probs: an expert's), both modes",
        threshold: "each column's relative L2 error (MIN_COLUMN_ROWS or more values, rows and keys an unfollowed selection difference reaches left out) at most TOKEN_FACTOR x the allowed error, chained at most TOKEN_FACTOR x the larger of the floor and COLUMN_SPREAD x the tensor's error where that is less (a column far smaller than the typical one against SMALL_ROW of it)",
        reason: "a bug in one key's or one expert's scores hides in the whole tensor's error, and a selection that follows them is excused by nothing: the selection is judged by the reference's scores, the scores here; rounding, even shared down a column (a key's cached vector rounded once), errs each value within the floor",
        decides: true,
        check: per_column,
    },
    Rule {
        name: "floor",
        judges: "float hooks no unfollowed selection difference upstream reaches, both modes",
        threshold: "relative L2 error at most the floor (replay; composed over a segment), floor + chain_amp x the inputs' chained error (chained; at least what inputs the candidate lacks carry, composed over the step)",
        reason: "the floor is the rounding error of the candidate's precision over the step (floors); in chained mode a correct step passes on what its inputs carry, amplified at most by chain_amp",
        decides: true,
        check: within_floor,
    },
    Rule {
        name: "unfollowed rows",
        judges: "float hooks downstream of a selection difference the reference's chain did not follow, chained",
        threshold: "the allowed error over the rows no such difference reaches; the rows it reaches are drift",
        reason: "rows that selected otherwise differ for that reason (drift, naming where it started); the others are judged as everywhere",
        decides: true,
        check: unfollowed_rows,
    },
    Rule {
        name: "same selection",
        judges: "selection hooks (indexer_topk, moe_topk_ids) whose sets agree in every row, both modes",
        threshold: "every row selects the same set",
        reason: "nothing to judge; downstream of an unfollowed difference it names where that started",
        decides: true,
        check: same_selection,
    },
    Rule {
        name: "selection flips",
        judges: "selection hooks whose sets differ, both modes",
        threshold: "each flip's margin by the reference's scores within the tolerance of the score hook (near tie); DSA keys also as a whole: no more flips, and none wider, than the scores' noise makes, and the candidate's selection the top-k of its own scores",
        reason: "a lower precision flips near ties only (selection); a confident flip, or more flips than the noise makes, is another selection rule or another score",
        decides: true,
        check: selection_flips,
    },
    Rule {
        name: "systematic",
        judges: "float hooks with a row per token (and an expert's rows), both modes, after a pass",
        threshold: "no systematic component (an overall, group or bug-family gain) significant beyond what unbiased rounding makes (systematic)",
        reason: "a bug smaller than the floor still moves the error along its direction; rounding error is unbiased and cannot",
        decides: false,
        check: systematic_rule,
    },
];

/// What judging one pair starts from, prepared by the comparison.
pub(super) struct Judging<'a> {
    /// The pair.
    pub pair: &'a Pair<'a>,
    /// The comparison's settings.
    pub judge: &'a Judge,
    /// The floor (`--tol`, or composed over a segment).
    pub floor: f64,
    /// The bug families' directions at the hook.
    pub parts: &'a [Part],
    /// Rows of the prompt (the first axis of per-token hooks).
    pub rows: usize,
    /// Chained: the state the step starts from (what its inputs carry); default in replay.
    pub up: Chain,
    /// Chained, where the candidate lacks an input of the step: what the inputs carry composed
    /// over the step with the floor (`floors::segment_floor`).
    pub composed: Option<f64>,
    /// The reference's scores behind a selection hook, when kept.
    pub scores: Option<Scores<'a>>,
}

/// A pair's verdict as the rules build it.
pub(super) struct Verdict {
    /// The metrics, or why the two values are not comparable.
    metrics: Result<Metrics, String>,
    /// Whether the pair is judged in chained mode.
    chained: bool,
    /// Whether the first axis holds the prompt's tokens (per-row verdicts).
    token_rows: bool,
    /// The result.
    r: ModeResult,
    /// What the hook passes on downstream (chained).
    next: Chain,
    /// Nothing more is judged.
    stop: bool,
}

impl Verdict {
    /// The float metrics, when the values are comparable floats.
    fn float(&self) -> Option<&FloatMetrics> {
        match &self.metrics {
            Ok(Metrics::Float(m)) => Some(m),
            _ => None,
        }
    }

    /// Fails with `note`.
    fn fail(&mut self, note: String) {
        self.r.status = Status::Fail;
        self.r.note = Some(note);
    }
}

/// Judges one pair by [`RULES`]; in chained mode also what the hook passes on downstream.
pub(super) fn judge_pair(j: &Judging<'_>) -> (ModeResult, Option<Chain>) {
    let pair = j.pair;
    let chained = pair.mode == Mode::Chained;
    let metrics = compare(&pair.reference, &pair.candidate);
    let error = metrics.as_ref().map_or(f64::INFINITY, Metrics::error);
    let amp = j.judge.info(pair.name).kind.chain_amp();
    let allowed = match (pair.mode, j.composed) {
        (Mode::Replay, _) => j.floor,
        // Where the candidate lacks inputs, at least what they carry composed over the step
        // (the floor of the segment the reference ran through them).
        (Mode::Chained, Some(composed)) => (j.floor + amp * j.up.clean).max(composed),
        (Mode::Chained, None) => j.floor + amp * j.up.clean,
    };
    let mut v = Verdict {
        metrics,
        chained,
        // Per-row verdicts need the first axis to be the prompt's tokens.
        token_rows: pair.reference.shape.first().copied() == Some(j.rows)
            && !matches!(point_of(pair.name), "attn_probs")
            && !pair.name.contains(".exp."),
        r: ModeResult {
            metrics: None,
            error,
            allowed,
            status: Status::Pass,
            note: None,
            flips: None,
            drift_from: None,
            plain_error: chained.then_some(error),
            systematic: None,
            systematic_untested: None,
        },
        // What the hook passes on (chained): the rows upstream differences reach, its error
        // over the others.
        next: Chain {
            clean: 0.0,
            norm: l2(&pair.reference),
            estimated: false,
            possible: BTreeSet::new(),
            ..j.up.clone()
        },
        stop: false,
    };
    let mut decided = false;
    for rule in RULES {
        if v.stop {
            break;
        }
        if rule.decides && decided {
            continue;
        }
        if (rule.check)(j, &mut v) && rule.decides {
            decided = true;
        }
    }
    let Verdict {
        metrics,
        chained,
        mut r,
        next,
        ..
    } = v;
    r.metrics = metrics.ok();
    if let Some(n) = &pair.note {
        r.note = Some(match r.note {
            Some(x) => format!("{x}; {n}"),
            None => n.clone(),
        });
    }
    (r, chained.then_some(next))
}

/// `comparable`: values of another shape or kind fail, and nothing else is judged.
fn comparable(j: &Judging<'_>, v: &mut Verdict) -> bool {
    let Err(why) = &v.metrics else {
        return false;
    };
    let why = match selection_widths(j.pair) {
        // Two traces without a model: the reference trace's width stands for the model's.
        Some((k, m)) if j.judge.bias_unknown => format!(
            "the candidate keeps {k}, the reference keeps {m}: another selection width than the reference's ({why})"
        ),
        Some((k, m)) => format!(
            "the candidate keeps {k}, the model says {m}: another selection width than the model's ({why})"
        ),
        None => why.clone(),
    };
    v.r = ModeResult {
        metrics: None,
        error: f64::INFINITY,
        allowed: j.floor,
        status: Status::Fail,
        note: Some(why),
        flips: None,
        drift_from: None,
        plain_error: None,
        systematic: None,
        systematic_untested: None,
    };
    v.next = j.up.clone();
    v.stop = true;
    true
}

/// For a selection hook (`indexer_topk`, `moe_topk_ids`, `moe_weights`) whose candidate keeps
/// another number per row than the reference (the same rows, another last axis): `(the
/// candidate's width, the reference's)`.
pub fn selection_widths(pair: &Pair<'_>) -> Option<(usize, usize)> {
    if !crate::model::hook_shape::SELECTION_POINTS.contains(&point_of(pair.name)) {
        return None;
    }
    match (&pair.reference.shape[..], &pair.candidate.shape[..]) {
        (&[rr, m], &[cr, k]) if rr == cr && k != m => Some((k, m)),
        _ => None,
    }
}

/// `non-finite`: NaN/Inf where the reference differs.
fn non_finite(_: &Judging<'_>, v: &mut Verdict) -> bool {
    let Some(m) = v.float().filter(|m| m.nonfinite_mismatch > 0) else {
        return false;
    };
    let note = format!(
        "{} NaN/Inf where the reference differs (candidate NaN {}, Inf {}; reference NaN {}, Inf {})",
        m.nonfinite_mismatch, m.nan[1], m.inf[1], m.nan[0], m.inf[0]
    );
    v.fail(note);
    v.next.clean = v.r.error;
    true
}

/// `per token`: the tensor is within its floor but one token is far above it (replay only).
fn per_token(j: &Judging<'_>, v: &mut Verdict) -> bool {
    if j.pair.mode == Mode::Chained {
        return per_token_chained(j, v);
    }
    let (error, allowed) = (v.r.error, v.r.allowed);
    let Some((t, e)) = v
        .float()
        .filter(|_| error <= allowed)
        .and_then(FloatMetrics::worst_token_judged)
        .filter(|&(_, e)| e > TOKEN_FACTOR * allowed)
    else {
        return false;
    };
    v.fail(format!(
        "token {t}: error {e:.3e} above {TOKEN_FACTOR} x the floor {allowed:.3e} (the whole tensor: {error:.3e})"
    ));
    true
}

/// `per token`, chained: each token against the floor plus what that token's own inputs carry,
/// amplified (as the whole tensor is judged against what its inputs carry), where every input
/// was measured per token and no unfollowed selection difference reaches the hook.
fn per_token_chained(j: &Judging<'_>, v: &mut Verdict) -> bool {
    let (error, allowed) = (v.r.error, v.r.allowed);
    // The routing weights of a row are its selection's: where a near tie selected otherwise
    // (the sibling `moe_topk_ids`, followed) they are another selection's, not a rounding's.
    if !v.token_rows
        || j.up.per_token.len() != j.rows
        || !j.up.touched.is_empty()
        || point_of(j.pair.name) == "moe_weights"
    {
        return false;
    }
    let amp = j.judge.info(j.pair.name).kind.chain_amp();
    let Some(m) = v
        .float()
        .filter(|m| error <= allowed && m.per_token_judged.len() == j.rows)
    else {
        return false;
    };
    let worst = m
        .per_token_judged
        .iter()
        .zip(&j.up.per_token)
        .enumerate()
        .map(|(t, (&e, &up))| (t, e, TOKEN_FACTOR * (j.floor + amp * up)))
        .filter(|(_, e, limit)| e > limit)
        .max_by(|a, b| (a.1 / a.2).total_cmp(&(b.1 / b.2)));
    let Some((t, e, limit)) = worst else {
        return false;
    };
    let up = j.up.per_token[t];
    v.fail(format!(
        "token {t}: error {e:.3e} above {TOKEN_FACTOR} x (the floor {:.3e} + {amp} x its inputs' {up:.3e}) = {limit:.3e} (the whole tensor: {error:.3e})",
        j.floor
    ));
    true
}

/// `per column`: the columns of a score hook (a key of the DSA index scores, an expert of the
/// router probabilities), each against the allowed error as a row is.
fn per_column(j: &Judging<'_>, v: &mut Verdict) -> bool {
    let pair = j.pair;
    let what = match point_of(pair.name) {
        "indexer_scores" => "key",
        "moe_probs" => "expert",
        _ => return false,
    };
    let (error, allowed) = (v.r.error, v.r.allowed);
    if v.float().is_none() || error.is_nan() || error > allowed {
        return false;
    }
    let (Ok(a), Ok(b)) = (
        pair.candidate.as_f32(pair.name),
        pair.reference.as_f32(pair.name),
    ) else {
        return false;
    };
    // Keys are tokens: a token an unfollowed difference reaches is left out as a key too.
    let no_cols = BTreeSet::new();
    let skip_cols = if what == "key" {
        &j.up.touched
    } else {
        &no_cols
    };
    // Chained, the allowance carries the inputs' error at its worst amplification; a column
    // is held to the larger of the floor and COLUMN_SPREAD x the error the tensor shows where
    // that is less (never more than the allowance).
    let spread = (j.pair.mode == Mode::Chained)
        .then(|| j.floor.max(COLUMN_SPREAD * error))
        .filter(|&s| s < allowed);
    let limit = spread.unwrap_or(allowed);
    let Some(c) = worst_column_judged(&pair.reference.shape, a, b, &j.up.touched, skip_cols)
        .filter(|c| c.error > TOKEN_FACTOR * limit)
    else {
        return false;
    };
    let limit_text = match spread {
        None => format!("the allowed {allowed:.3e}"),
        Some(_) => format!(
            "the larger of the floor {:.3e} and {COLUMN_SPREAD} x the tensor's own error, {limit:.3e}",
            j.floor
        ),
    };
    v.fail(format!(
        "{what} {}: error {:.3e} over its {} values, above {TOKEN_FACTOR} x {limit_text} (the whole tensor: {error:.3e})",
        c.col, c.error, c.rows
    ));
    true
}

/// `floor`: a float hook no unfollowed selection difference upstream reaches.
fn within_floor(j: &Judging<'_>, v: &mut Verdict) -> bool {
    if v.float().is_none() || !j.up.touched.is_empty() {
        return false;
    }
    let (error, allowed) = (v.r.error, v.r.allowed);
    v.next.clean = error;
    if let Some(m) = v
        .float()
        .filter(|m| v.token_rows && m.per_token_judged.len() == j.rows)
    {
        v.next.per_token = m.per_token_judged.clone();
    }
    if error > allowed {
        v.fail(format!("error {error:.3e} above the allowed {allowed:.3e}"));
    }
    true
}

/// `unfollowed rows`: chained, downstream of a selection difference the reference's chain did
/// not follow. The rows it reaches differ for that reason (drift); the others are judged as
/// everywhere. A row that only may have selected otherwise (a selection the candidate lacks,
/// with a near tie there) and agrees here, at the first hook after the selection that the
/// candidate has (before a sum dilutes it), as closely as the other rows (or within the floor)
/// did not: it is not reached any more.
fn unfollowed_rows(j: &Judging<'_>, v: &mut Verdict) -> bool {
    let Some(m) = v.float() else {
        return false;
    };
    let pair = j.pair;
    let clean = if v.token_rows {
        masked_error(&pair.reference, &pair.candidate, &j.up.touched)
    } else {
        f64::NAN
    };
    let per_token =
        (v.token_rows && m.per_token_judged.len() == j.rows).then(|| m.per_token_judged.clone());
    v.next.clean = if clean.is_finite() { clean } else { 0.0 };
    if let Some(per_token) = per_token {
        // Agrees: as close as the rows no difference reaches, or within the floor.
        let agrees = if clean.is_finite() {
            (2.0 * clean).max(j.floor)
        } else {
            j.floor
        };
        v.next.touched.retain(|t| {
            !j.up.possible.contains(t) || per_token.get(*t).is_none_or(|&e| e > agrees)
        });
        if v.next.touched.is_empty() {
            v.next.origin = None;
        }
    }
    let (error, allowed, rows) = (v.r.error, v.r.allowed, j.rows);
    let origin = j.up.origin.clone();
    if clean.is_finite() && clean > allowed {
        v.fail(format!(
            "error {clean:.3e} above the allowed {allowed:.3e} over the {} of {rows} rows no selection difference upstream reaches (all rows: {error:.3e})",
            rows.saturating_sub(j.up.touched.len())
        ));
    } else if error > allowed {
        v.r.status = Status::Drift;
        v.r.note = Some(format!(
            "drift after a selection that differs upstream, from {} ({} of {rows} rows reached{})",
            origin.as_deref().unwrap_or("?"),
            j.up.touched.len(),
            if clean.is_finite() {
                format!("; the others: {clean:.3e}")
            } else {
                String::new()
            }
        ));
        v.r.drift_from = origin;
    } else {
        v.r.drift_from = origin;
    }
    true
}

/// `same selection`: every row selects the same set.
fn same_selection(j: &Judging<'_>, v: &mut Verdict) -> bool {
    if !matches!(&v.metrics, Ok(Metrics::Ids(m)) if m.set_equal_rows == m.rows) {
        return false;
    }
    if !j.up.touched.is_empty() {
        v.r.drift_from = j.up.origin.clone();
    }
    true
}

/// `selection flips`: sets that differ, judged by the margin of each flip (and, for the DSA
/// keys, as a whole).
fn selection_flips(j: &Judging<'_>, v: &mut Verdict) -> bool {
    if !matches!(&v.metrics, Ok(Metrics::Ids(_))) {
        return false;
    }
    let pair = j.pair;
    let (reference, candidate) = (
        pair.reference.as_i32(pair.name).unwrap_or(&[]),
        pair.candidate.as_i32(pair.name).unwrap_or(&[]),
    );
    let width = pair.reference.shape.last().copied().unwrap_or(1).max(1);
    let mut scores = j.scores;
    // Without the model's selection bias: what the reference's selections imply.
    let bias_unknown = j.judge.bias_unknown && point_of(pair.name) == "moe_topk_ids";
    let implied = match &scores {
        Some(sc) if bias_unknown => {
            implied_bias(sc.values, sc.cols, reference, width, IMPLIED_SLACK)
        }
        _ => None,
    };
    if let (Some(sc), Some(g)) = (&mut scores, &implied) {
        sc.implied = Some(g);
    }
    // The selections contradict any one bias (another rule chose: group-limited routing):
    // without the model the flips cannot be judged.
    let unjudgeable = bias_unknown && implied.is_none();
    if unjudgeable {
        scores = None;
    }
    let chained = v.chained;
    let token_rows = v.token_rows;
    // Rows an unfollowed difference upstream reaches are not judged again.
    let reached = |t: usize| chained && token_rows && j.up.touched.contains(&t);
    let mut st = judge_flips(reference, candidate, width, scores.as_ref());
    let differing = differing_rows(reference, candidate, width);
    // A row that selected otherwise (followed or not) is not judged per token downstream:
    // what it carries is another selection's, not a rounding's.
    if v.next.per_token.len() == st.rows {
        for &t in &differing {
            v.next.per_token[t] = f64::INFINITY;
        }
    }
    let own_rows: Vec<usize> = differing.into_iter().filter(|&t| !reached(t)).collect();
    let mut judged = if own_rows.len() < st.differing {
        let mut c = candidate.to_vec();
        for t in (0..st.rows).filter(|&t| reached(t)) {
            c[t * width..(t + 1) * width].copy_from_slice(&reference[t * width..(t + 1) * width]);
        }
        judge_flips(reference, &c, width, scores.as_ref())
    } else {
        st.clone()
    };
    st.drift = st.differing - judged.differing;
    // A wide selection (the DSA keys) is also judged as a whole: its flips against what the
    // scores' noise predicts (module flipcount).
    let count = match &scores {
        Some(sc) if point_of(pair.name) == "indexer_topk" && !unjudgeable => {
            Some(dsa_count(j, sc, reference, candidate, width, &reached))
        }
        _ => None,
    };
    if unjudgeable {
        // Counted as near ties, said so, never a divergence.
        for x in [&mut st, &mut judged] {
            x.near_tie += x.confident;
            x.confident = 0;
            x.first_confident = None;
        }
    }
    let what = format!(
        "{}{}",
        flips_text(&st, unjudgeable),
        count.as_ref().map_or(String::new(), count_text)
    );
    flips_verdict(j, v, &judged, count.as_ref(), what);
    if chained {
        v.next.own = own_rows.iter().copied().collect();
        v.next.touched.extend(own_rows.iter().copied());
        if v.next.origin.is_none() {
            v.next.origin = judged
                .first_confident
                .as_ref()
                .or(judged.first.as_ref())
                .map(|f| flip_origin(pair.name, f));
        }
    }
    st.count = count;
    v.r.flips = Some(st);
    true
}

/// Where a flip at `name` started a selection difference (hook, token, margin).
fn flip_origin(name: &str, f: &FlipAt) -> String {
    format!(
        "{} token {} (margin {:.2e}, tolerance {:.2e})",
        name, f.token, f.margin, f.tolerance
    )
}

/// The DSA keys' flips as a whole, over the rows `reached` leaves: the scores the candidate
/// selected from are the reference's in replay of an engine (its step's input), otherwise its
/// own when at hand.
fn dsa_count(
    j: &Judging<'_>,
    sc: &Scores<'_>,
    reference: &[i32],
    candidate: &[i32],
    width: usize,
    reached: &dyn Fn(usize) -> bool,
) -> FlipCount {
    let own = if j.pair.mode != Mode::Chained && j.judge.engine_candidate {
        Some(sc.values)
    } else {
        sc.candidate
    };
    let scores_hook = j.pair.name.replace("indexer_topk", "indexer_scores");
    let u = j
        .judge
        .candidate_precision(&scores_hook)
        .storage
        .unit_roundoff();
    flip_count(sc, reference, candidate, width, reached, own, u)
}

/// What a selection's flips are: how many rows differ, near ties and confident flips, their
/// margins, and why they may not be judged.
fn flips_text(st: &FlipStats, unjudgeable: bool) -> String {
    let margins = st.margins.map_or(String::new(), |(a, b)| {
        format!(", margins {a:.2e}..{b:.2e}")
    });
    format!(
        "{} of {} rows select another set: {} near-tie, {} confident{margins}{}{}",
        st.differing,
        st.rows,
        st.near_tie,
        st.confident,
        if st.drift > 0 {
            format!(
                "; {} of them reached by a selection difference upstream",
                st.drift
            )
        } else {
            String::new()
        },
        if unjudgeable {
            " (without the model the router's selection bias and groups are unknown, and the reference's own selections do not pin them down: margins unknown, not judged)"
        } else if st.judged {
            ""
        } else {
            " (the reference's scores were not compared: margins unknown)"
        }
    )
}

/// What the DSA keys' flips as a whole say, appended to [`flips_text`].
fn count_text(c: &FlipCount) -> String {
    let mut n = format!(
        "; {} key(s) left where the scores' {} noise ({:.1e} of their RMS) predicts {:.1} (at most {:.0}){}",
        c.observed,
        if c.measured { "measured" } else { "predicted" },
        c.noise,
        c.expected,
        c.bound,
        match (c.max_z, c.z_allowed) {
            (Some(z), Some(zl)) => format!(", largest margin {z:.1} sigma (at most {zl:.1})"),
            (Some(z), None) => format!(", largest margin {z:.1} sigma"),
            _ => String::new(),
        }
    );
    if let Some((t, gap, tol)) = c.first_not_top_k {
        n.push_str(&format!(
            "; the candidate's selection is not the top-k of the scores it selected from in {} of {} rows (first: token {t}, an unselected key scores {gap:.2e} above a selected one, ties allowed {tol:.2e})",
            c.not_top_k, c.own_rows
        ));
    }
    n
}

/// The status of a selection that differs: the DSA count exceeded, a confident flip, near
/// ties only, or drift alone; `what` says what the flips are.
fn flips_verdict(
    j: &Judging<'_>,
    v: &mut Verdict,
    judged: &FlipStats,
    count: Option<&FlipCount>,
    what: String,
) {
    let count_failed = count.is_some_and(FlipCount::exceeded);
    if judged.confident == 0 && count_failed {
        v.fail(match count {
            Some(c) if c.not_top_k > 0 => what,
            Some(FlipCount {
                first_beyond_z: Some(t),
                ..
            }) => format!("{what}; the flip at token {t} is wider than the scores' noise makes"),
            _ => format!("{what}; more keys flip than the scores' noise makes"),
        });
    } else if judged.confident > 0 {
        v.fail(match judged.first_confident.as_ref() {
            Some(c) => format!(
                "{what}; first confident flip at token {}: {:?} in, {:?} out, margin {:.2e} > tolerance {:.2e}",
                c.token, c.entered, c.left, c.margin, c.tolerance
            ),
            None => what,
        });
    } else if judged.differing > 0 {
        v.r.status = Status::NearTie;
        v.r.note = Some(what);
        if let Some(f) = &judged.first {
            v.r.drift_from = Some(format!(
                "the near-tie flip at {} token {} (margin {:.2e} <= tolerance {:.2e})",
                j.pair.name, f.token, f.margin, f.tolerance
            ));
        }
    } else {
        let origin = j.up.origin.clone();
        v.r.status = Status::Drift;
        v.r.note = Some(format!(
            "{what}; after drift from {}",
            origin.as_deref().unwrap_or("?")
        ));
        v.r.drift_from = origin;
    }
}

/// `systematic`: the systematic components of a finite float pair's error, and a pass failed
/// when one is named as a bug.
fn systematic_rule(j: &Judging<'_>, v: &mut Verdict) -> bool {
    let expert = j.pair.name.contains(".exp.") && j.up.touched.is_empty();
    let Some(m) = v.float() else {
        return false;
    };
    if m.nonfinite_mismatch != 0 || !(v.token_rows || expert) {
        return false;
    }
    match systematic(j) {
        Outcome::Tested(s) => v.r.systematic = Some(s),
        Outcome::Untested(u) => v.r.systematic_untested = Some(u),
        Outcome::Nothing => {}
    }
    let named = v.r.systematic.as_ref().and_then(Systematic::describe);
    if let (Some(text), Status::Pass) = (named, v.r.status) {
        let (error, allowed) = (v.r.error, v.r.allowed);
        v.fail(format!(
            "{text}; relative L2 {error:.3e} is within the allowed {allowed:.3e}"
        ));
    }
    true
}

/// The systematic components of a float pair's error ([`super::systematic`]), over the rows no
/// selection difference upstream reaches (`up.touched`, chained), or why the test could not run.
fn systematic(j: &Judging<'_>) -> Outcome {
    let pair = j.pair;
    if matches!(j.judge.info(pair.name).kind, Kind::Selection | Kind::Zeros) {
        return Outcome::Nothing;
    }
    let (Ok(r), Ok(c)) = (pair.reference.as_f32(""), pair.candidate.as_f32("")) else {
        return Outcome::Nothing;
    };
    let shape = &pair.reference.shape;
    let Some(rows) = shape.first().copied() else {
        return Outcome::Nothing;
    };
    let cols: usize = shape[1..].iter().product();
    let heads = match (shape.len(), point_of(pair.name)) {
        (3, _) => Some(shape[1]),
        (2, "q_b" | "attn_heads") => j.judge.heads,
        _ => None,
    };
    let layout = Layout { rows, cols, heads };
    let dirs: Vec<Direction<'_>> = j
        .parts
        .iter()
        .filter_map(|p| {
            Some(Direction {
                label: &p.label,
                family: p.family,
                values: p.tensor.as_f32("").ok()?,
                rows: p.rows.as_deref(),
                sampled: p.sampled,
            })
        })
        .collect();
    let touched = &j.up.touched;
    if touched.is_empty() {
        return test_systematic(r, c, layout, &dirs);
    }
    let mut masked = c.to_vec();
    for &t in touched.iter().filter(|&&t| t < rows) {
        masked[t * cols..(t + 1) * cols].fill(f32::NAN);
    }
    test_systematic(r, &masked, layout, &dirs)
}

/// The flips of DSA selection `candidate` against `reference` (`width` ids per row) as a whole,
/// over the rows `reached` does not exclude ([`super::flipcount`]).
fn flip_count(
    sc: &Scores<'_>,
    reference: &[i32],
    candidate: &[i32],
    width: usize,
    reached: &dyn Fn(usize) -> bool,
    own: Option<&[f32]>,
    u: f64,
) -> FlipCount {
    use super::flipcount::{count_row, not_top_k, summarize, Row};
    use rayon::prelude::*;
    let (w, cols) = (width.max(1), sc.cols.max(1));
    // Rows are independent: counted on the threads, kept in row order (the same sums as one
    // at a time: `summarize` adds them in that order).
    let n = (reference.len() / w)
        .min(candidate.len() / w)
        .min(sc.values.len() / cols);
    let skip: Vec<bool> = (0..n).map(reached).collect();
    let counted: Vec<(usize, usize, Option<super::flipcount::RowCount>)> = (0..n)
        .into_par_iter()
        .filter(|&t| !skip[t])
        .map(|t| {
            let r = &sc.values[t * cols..(t + 1) * cols];
            let row = Row {
                reference: r,
                candidate: sc.candidate.and_then(|c| c.get(t * cols..(t + 1) * cols)),
                ref_ids: &reference[t * w..(t + 1) * w],
                cand_ids: &candidate[t * w..(t + 1) * w],
            };
            let finite = r.iter().filter(|x| x.is_finite()).count();
            (t, finite, count_row(&row, sc.rel_tol))
        })
        .collect();
    let keys: usize = counted.iter().map(|(_, k, _)| k).sum();
    let rows: Vec<(usize, super::flipcount::RowCount)> = counted
        .into_iter()
        .filter_map(|(t, _, c)| c.map(|c| (t, c)))
        .collect();
    let (mut own_rows, mut bad) = (0usize, Vec::new());
    if let Some(own) = own {
        let m = (candidate.len() / w).min(own.len() / cols);
        own_rows = m;
        bad = (0..m)
            .into_par_iter()
            .filter_map(|t| {
                not_top_k(
                    &own[t * cols..(t + 1) * cols],
                    &candidate[t * w..(t + 1) * w],
                    u,
                )
                .map(|(gap, tol)| (t, gap, tol))
            })
            .collect();
    }
    summarize(&rows, keys).with_own(own_rows, &bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule table as `docs/architecture.md` shows it.
    fn table() -> String {
        let mut t = String::from(
            "| # | rule | judges | threshold | why | gives the verdict |\n|---|---|---|---|---|---|\n",
        );
        for (i, r) in RULES.iter().enumerate() {
            t.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                i + 1,
                r.name,
                r.judges,
                r.threshold,
                r.reason,
                if r.decides { "yes" } else { "after" }
            ));
        }
        t
    }

    #[test]
    fn the_rule_table_in_the_docs_is_the_code_s() {
        let docs = include_str!("../../docs/architecture.md");
        let (begin, end) = ("<!-- rules:begin -->\n", "<!-- rules:end -->");
        let at = docs.find(begin).map(|i| i + begin.len());
        let shown = at.and_then(|i| docs[i..].find(end).map(|j| &docs[i..i + j]));
        assert_eq!(
            shown,
            Some(table().as_str()),
            "docs/architecture.md's rule table (between {begin:?} and {end:?}) should read:\n{}",
            table()
        );
    }

    #[test]
    fn every_rule_says_its_threshold_and_reason_and_the_deciding_ones_come_first() {
        let mut names = std::collections::BTreeSet::new();
        for r in RULES {
            assert!(names.insert(r.name), "{} twice", r.name);
            assert!(!r.judges.is_empty() && !r.threshold.is_empty() && !r.reason.is_empty());
        }
        let first_after = RULES.iter().position(|r| !r.decides).unwrap_or(RULES.len());
        assert!(RULES[first_after..].iter().all(|r| !r.decides));
        assert_eq!(RULES[0].name, "comparable");
    }
}
