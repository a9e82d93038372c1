//! Comparing a candidate with the reference: metrics of one hook ([`metrics`]), tolerance floors
//! with their reasoning ([`floors`]), verdicts and the first divergence ([`verdict`]), the output
//! distributions ([`logits`]) and the order of hooks in a trace without its model ([`graph`]).
//! Shared by `run`, `compare` and the golden tests. Nothing here prints.

pub mod flipcount;
pub mod floors;
pub mod graph;
pub mod logits;
pub mod metrics;
pub mod selection;
pub mod systematic;
pub mod verdict;

pub use floors::{Dtype, HookInfo, Kind, Precision};
pub use metrics::{compare, FloatMetrics, IdMetrics, Metrics};
pub use verdict::{
    Comparison, HookRecord, Judge, LayerSummary, ModeResult, Override, PrecisionOverride, Status,
};
