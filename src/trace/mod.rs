//! Hook selection, sinks and trace files.
//!
//! A [`Sink`] receives hook tensors from the driver. The driver asks [`Sink::wants`] *before* it
//! downloads a tensor from an engine, so unwatched tensors never leave the device.
//! [`HookFilter`] is the selection behind `--layers` and `--hook`; [`TraceSink`] keeps what the
//! filter wants and writes a safetensors trace ([`file`](mod@file)).

pub mod file;

use std::collections::BTreeMap;
use std::ops::Range;

use anyhow::{bail, Result};

use crate::engine::HostTensor;
use crate::model::names::split_blk;
use crate::model::steps::point;
use crate::util::glob::matches_any;

pub use file::{
    read_trace, write_trace, Trace, TraceMeta, TraceTensor, TraceValues, TRACE_FORMAT_VERSION,
};

/// Receives hook tensors.
pub trait Sink {
    /// Whether the sink keeps hook `name` (asked before the tensor is downloaded).
    fn wants(&self, name: &str) -> bool;
    /// Receives hook `name` (only called when [`Sink::wants`] said yes).
    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()>;
}

/// Points that are off unless a `--hook` pattern names them: `attn_probs` and `exp.{e}.out`.
pub fn is_optional_point(point_name: &str) -> bool {
    point_name == point::ATTN_PROBS || point_name.starts_with("exp.")
}

/// Which hooks to keep: `--layers A..B` and `--hook GLOB` (repeatable).
///
/// - Per-layer hooks `blk.{L}.*` are kept when `L` is in the layer range (all layers without
///   `--layers`) and the name matches a glob (any name without `--hook`).
/// - Optional points (`attn_probs`, `exp.{e}.out`) are kept only when a glob matches them.
/// - Global hooks (`token_embd`, `result_norm`, `logits`) are kept without `--layers` when they
///   match the globs; with `--layers` only when a `--hook` glob names them explicitly. Asking for
///   `result_norm` or `logits` makes the run go through every layer; otherwise it stops after
///   the last layer with a wanted hook.
#[derive(Clone, Debug, Default)]
pub struct HookFilter {
    /// `--layers A..B` (end exclusive).
    pub layers: Option<Range<usize>>,
    /// `--hook` globs (empty = every standard hook).
    pub globs: Vec<String>,
}

impl HookFilter {
    /// Whether hook `name` is kept.
    pub fn wants(&self, name: &str) -> bool {
        match split_blk(name) {
            Some((l, p)) => {
                if self.layers.as_ref().is_some_and(|r| !r.contains(&l)) {
                    return false;
                }
                if is_optional_point(p) {
                    return !self.globs.is_empty() && matches_any(&self.globs, name);
                }
                matches_any(&self.globs, name)
            }
            None => {
                if self.layers.is_some() {
                    !self.globs.is_empty() && matches_any(&self.globs, name)
                } else {
                    matches_any(&self.globs, name)
                }
            }
        }
    }
}

/// A sink that keeps the hooks its filter wants, in memory, for a trace file.
#[derive(Debug, Default)]
pub struct TraceSink {
    filter: HookFilter,
    tensors: BTreeMap<String, HostTensor>,
}

impl TraceSink {
    /// A sink keeping what `filter` wants.
    pub fn new(filter: HookFilter) -> TraceSink {
        TraceSink {
            filter,
            tensors: BTreeMap::new(),
        }
    }

    /// The kept tensors by hook name.
    pub fn tensors(&self) -> &BTreeMap<String, HostTensor> {
        &self.tensors
    }

    /// Takes the kept tensors.
    pub fn into_tensors(self) -> BTreeMap<String, HostTensor> {
        self.tensors
    }
}

impl Sink for TraceSink {
    fn wants(&self, name: &str) -> bool {
        self.filter.wants(name)
    }

    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()> {
        if self.tensors.insert(name.to_string(), tensor).is_some() {
            bail!("trace: hook {name} recorded twice");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_layers_globs_and_optional_points() {
        let all = HookFilter::default();
        assert!(all.wants("blk.0.attn_norm"));
        assert!(all.wants("logits"));
        assert!(!all.wants("blk.0.attn_probs"));
        assert!(!all.wants("blk.3.exp.7.out"));

        let layers = HookFilter {
            layers: Some(2..4),
            globs: vec![],
        };
        assert!(layers.wants("blk.3.l_out"));
        assert!(!layers.wants("blk.4.l_out"));
        assert!(!layers.wants("blk.1.l_out"));
        assert!(!layers.wants("logits"));

        let named = HookFilter {
            layers: Some(2..4),
            globs: vec!["logits".into(), "blk.*.exp.*".into()],
        };
        assert!(named.wants("logits"));
        assert!(!named.wants("blk.3.l_out"));
        assert!(named.wants("blk.3.exp.7.out"));
        assert!(!named.wants("blk.5.exp.7.out"));
    }
}
