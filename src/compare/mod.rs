//! Comparing a candidate with the reference: metrics of one hook ([`metrics`]), tolerance floors
//! with their reasoning ([`floors`]), the judge ([`judge`]), the rules a hook is judged by ([`rules`]), the comparison that applies them
//! ([`comparison`]) and its records ([`records`]), the output
//! distributions ([`logits`]) and the order of hooks in a trace without its model ([`graph`]).
//! Shared by `run`, `compare` and the golden tests. Nothing here prints.

pub mod chain;
pub mod comparison;
pub mod flipcount;
pub mod floors;
pub mod graph;
pub mod judge;
pub mod logits;
pub mod metrics;
pub mod records;
pub mod rules;
pub mod selection;
pub mod systematic;
pub mod ties;

pub use comparison::Comparison;
pub use floors::{Dtype, HookInfo, Kind, Precision};
pub use judge::{Judge, JudgeSpec, ModelFacts, PrecisionOverride};
pub use metrics::{compare, FloatMetrics, IdMetrics, Metrics};
pub use records::{
    HookRecord, LayerSummary, ModeResult, Override, Segment, Status, UntestedSummary,
};
