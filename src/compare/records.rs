//! The records of a comparison: how a hook fared in each mode ([`Status`], [`ModeResult`]),
//! everything known about one hook ([`HookRecord`] and the [`Segment`] it ends), the overrides
//! that decided floors ([`Override`]), the records folded by layer ([`LayerSummary`]), and the
//! hooks whose systematic test could not run, folded ([`UntestedSummary`]). Data:
//! the rules that fill them are in [`super::rules`], the comparison that keeps them in
//! [`super::comparison`].

use serde::Serialize;

use super::floors::HookInfo;
use super::metrics::Metrics;
use super::selection::FlipStats;
use super::systematic::{Systematic, Untested};
use crate::trace::Mode;

/// How one hook fared in one mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Within the allowed error.
    Pass,
    /// A selection that differs only in near-tie flips (expected of a lower precision).
    #[serde(rename = "near_tie")]
    NearTie,
    /// Above it (or NaN/Inf, or a confident selection change).
    Fail,
    /// Chained only: different because an earlier selection differed (expected downstream of a
    /// near-tie flip).
    Drift,
    /// Not compared (missing from a trace, incomparable inputs).
    Missing,
}

/// One mode's result at one hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModeResult {
    /// Metrics (absent when the hook was not compared or shapes disagree).
    pub metrics: Option<Metrics>,
    /// Headline error: relative L2 (floats), 1 - mean Jaccard (selections).
    pub error: f64,
    /// Error allowed here: the floor (replay), floor plus what the inputs explain (chained).
    pub allowed: f64,
    /// Verdict.
    pub status: Status,
    /// Why, when not a plain pass.
    pub note: Option<String>,
    /// Selections: the flips and their margins.
    pub flips: Option<FlipStats>,
    /// Chained: the selection difference upstream that explains this hook's drift.
    pub drift_from: Option<String>,
    /// Chained: the relative error against the reference's own chain (its own selections
    /// everywhere: what the user's output shows), where `error` is against the chain that
    /// follows the candidate's near-tie selections; the same as `error` where both chains
    /// agree, or where the reference cannot follow (two traces).
    pub plain_error: Option<f64>,
    /// Float hooks: the systematic components of the error ([`super::systematic`]): the
    /// overall gain, the most significant group gain, and the one named as a bug.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub systematic: Option<Systematic>,
    /// Float hooks whose systematic test could not run for want of data (too few rows or
    /// values, [`super::systematic::Untested`]): what they had, and why in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub systematic_untested: Option<Untested>,
}

/// Steps the reference replayed as one: from hooks of the trace through hooks the trace lacks
/// to the compared hook (`floors`, Segments).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Segment {
    /// `FIRST..LAST`: the first hook the reference computed inside the segment and the
    /// compared hook (`blk.0.q_pe_rope..blk.0.attn_heads`).
    pub name: String,
    /// The hooks it starts from: taken from the trace (or the run's starting values).
    pub from: Vec<String>,
    /// The hooks the trace lacks that the reference computed on the way, in forward-pass order.
    pub through: Vec<String>,
}

/// Everything known about one hook.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HookRecord {
    /// Hook name.
    pub name: String,
    /// Layer (`None` for global hooks).
    pub layer: Option<usize>,
    /// Shape (the reference's).
    pub shape: Vec<usize>,
    /// Step kind and what the floor depends on.
    pub info: HookInfo,
    /// The floor (relative L2), after `--tol`; for a segment, composed over its steps.
    pub floor: f64,
    /// The hooks its step read.
    pub inputs: Vec<String>,
    /// Replay: the segment this hook ends, when its step read hooks the trace lacks.
    pub segment: Option<Segment>,
    /// Replay result.
    pub replay: Option<ModeResult>,
    /// Chained result.
    pub chained: Option<ModeResult>,
}

impl HookRecord {
    /// The result in `mode`.
    pub fn result(&self, mode: Mode) -> Option<&ModeResult> {
        match mode {
            Mode::Replay => self.replay.as_ref(),
            Mode::Chained => self.chained.as_ref(),
        }
    }

    pub(super) fn slot(&mut self, mode: Mode) -> &mut Option<ModeResult> {
        match mode {
            Mode::Replay => &mut self.replay,
            Mode::Chained => &mut self.chained,
        }
    }

    /// Whether any mode failed.
    pub fn failed(&self) -> bool {
        [&self.replay, &self.chained]
            .iter()
            .any(|r| r.as_ref().is_some_and(|r| r.status == Status::Fail))
    }
}

/// A `--tol` or precision override and how many compared hooks it decides (the first matching
/// glob of its kind wins).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Override {
    /// `tol` (a floor replaced) or `precision` (the candidate's precision set).
    pub kind: &'static str,
    /// Hook glob.
    pub glob: String,
    /// As given: a floor (`10`) or a dtype (`fp8`).
    pub value: String,
    /// Who said it: `--tol`, `--precision`, or a trace's metadata key (`indexer_dtype`).
    pub source: String,
    /// Compared hooks it decides.
    pub hooks: usize,
}

/// One layer's (or the global hooks') records, folded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerSummary {
    /// Layer (`None` for global hooks).
    pub layer: Option<usize>,
    /// `"3"`, or the global hooks' names.
    pub label: String,
    /// Indices into [`Comparison::records`].
    pub records: Vec<usize>,
    /// Worst float error per mode (replay, chained): record index and error.
    pub worst: [Option<(usize, f64)>; 2],
    /// Worst chained float error against the reference's own chain (`ModeResult::plain_error`).
    pub worst_plain: Option<(usize, f64)>,
    /// Largest floor among the records.
    pub floor: f64,
    /// Results that failed (both modes counted).
    pub failed: usize,
    /// Results that drifted.
    pub drift: usize,
    /// Results missing.
    pub missing: usize,
    /// Rows with near-tie flips per mode (replay, chained).
    pub near_tie: [usize; 2],
    /// Smallest and largest near-tie margin per mode.
    pub margins: [Option<(f64, f64)>; 2],
}

/// The records folded by layer, in order (global hooks are grouped under `None`).
pub fn fold_layers(records: &[HookRecord]) -> Vec<LayerSummary> {
    let mut out: Vec<LayerSummary> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let group = r.layer;
        let new = out
            .last()
            .is_none_or(|g| g.layer != group || r.name == "token_embd");
        if new {
            out.push(LayerSummary {
                layer: group,
                label: group.map_or_else(|| r.name.clone(), |l| l.to_string()),
                records: Vec::new(),
                worst: [None, None],
                worst_plain: None,
                floor: 0.0,
                failed: 0,
                drift: 0,
                missing: 0,
                near_tie: [0, 0],
                margins: [None, None],
            });
        }
        let Some(g) = out.last_mut() else { continue };
        if group.is_none() && !new {
            g.label = format!("{}, {}", g.label, r.name);
        }
        g.records.push(i);
        g.floor = g.floor.max(r.floor);
        if let Some(c) = &r.chained {
            if let (Some(x), Some(Metrics::Float(_)) | None) = (c.plain_error, &c.metrics) {
                if c.status != Status::Missing && g.worst_plain.is_none_or(|(_, w)| x > w) {
                    g.worst_plain = Some((i, x));
                }
            }
        }
        for (slot, res) in [(0usize, &r.replay), (1, &r.chained)] {
            let Some(res) = res else { continue };
            match res.status {
                Status::NearTie => {
                    if let Some(f) = &res.flips {
                        g.near_tie[slot] += f.near_tie;
                        if let Some((a, b)) = f.margins {
                            g.margins[slot] = Some(match g.margins[slot] {
                                None => (a, b),
                                Some((x, y)) => (x.min(a), y.max(b)),
                            });
                        }
                    }
                }
                Status::Fail => g.failed += 1,
                Status::Drift => g.drift += 1,
                Status::Missing => g.missing += 1,
                Status::Pass => {}
            }
            if res.status != Status::Missing
                && matches!(res.metrics, Some(Metrics::Float(_)) | None)
                && g.worst[slot].as_ref().is_none_or(|(_, e)| res.error > *e)
            {
                g.worst[slot] = Some((i, res.error));
            }
        }
    }
    out
}

/// The float hooks whose systematic test could not run for want of data
/// ([`ModeResult::systematic_untested`]), folded: a hook counts once, by its first such result
/// (replay, then chained). Each class: how many hooks, and the fewest and most rows (or
/// values) they had.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UntestedSummary {
    /// Hooks not tested.
    pub hooks: usize,
    /// Short of rows with every row compared: the prompt is too short.
    pub short_prompt: Option<(usize, usize, usize)>,
    /// Short of rows once the rows a selection difference upstream reaches are left out
    /// (chained).
    pub rows_reached: Option<(usize, usize, usize)>,
    /// Rows enough, short of values (a narrow hook: a router's weights).
    pub few_values: Option<(usize, usize, usize)>,
}

/// The hooks of `records` whose systematic test could not run, folded; `None` when there are
/// none.
pub fn fold_untested(records: &[HookRecord]) -> Option<UntestedSummary> {
    let add = |slot: &mut Option<(usize, usize, usize)>, x: usize| {
        *slot = Some(match *slot {
            None => (1, x, x),
            Some((n, a, b)) => (n + 1, a.min(x), b.max(x)),
        });
    };
    let mut s = UntestedSummary::default();
    for r in records {
        let Some(u) = [&r.replay, &r.chained]
            .into_iter()
            .find_map(|m| m.as_ref().and_then(|m| m.systematic_untested.as_ref()))
        else {
            continue;
        };
        s.hooks += 1;
        match (u.few_rows(), r.shape.first() == Some(&u.rows)) {
            (true, true) => add(&mut s.short_prompt, u.rows),
            (true, false) => add(&mut s.rows_reached, u.rows),
            (false, _) => add(&mut s.few_values, u.elements),
        }
    }
    (s.hooks > 0).then_some(s)
}
