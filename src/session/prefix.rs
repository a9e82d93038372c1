//! The reference's values entering the first layer a run starts at (`--layer`, `--layers`): read
//! from the reference cache, or computed on the reference and stored there.

use std::time::Instant;

use anyhow::Result;

use super::config::RunConfig;
use super::{Watch, CACHE_NOT_WRITTEN};
use crate::driver::prefix_values;
use crate::engine::cpu::CpuEngine;
use crate::model::Weights;
use crate::tensor::HostTensor;
use crate::trace::cache::Loaded;

/// The start of a run: the plan's free inputs, how long they took, and what the cache did.
pub(super) struct Prefix {
    /// The values by name (none for a run from layer 0).
    pub values: Vec<(String, HostTensor)>,
    /// `(what, seconds)` when there was a prefix.
    pub timing: Option<(String, f64)>,
    /// What the cache did (read, or computed and stored, and where; or why not stored).
    pub note: Option<String>,
}

/// The plan's free inputs: from the cache when it holds a sound entry, else computed on
/// `reference` (and stored). A damaged entry is never compared against: it is recomputed and
/// overwritten, and said at once through `watch`.
pub(super) fn prefix(
    cfg: &RunConfig,
    weights: &Weights<'_>,
    reference: &CpuEngine<'_>,
    watch: &Watch<'_>,
) -> Result<Prefix> {
    let names = cfg.plan.free_inputs();
    if names.is_empty() {
        return Ok(Prefix {
            values: Vec::new(),
            timing: None,
            note: None,
        });
    }
    let first = cfg.layers.start;
    let t0 = Instant::now();
    let mut damaged = None;
    if let Some((c, k)) = &cfg.cache {
        match c.load(k, &names) {
            Loaded::Hit(values) => {
                return Ok(Prefix {
                    values,
                    timing: Some((
                        "reference prefix (cache)".to_string(),
                        t0.elapsed().as_secs_f64(),
                    )),
                    note: Some(format!(
                        "layers 0..{first} of the reference read from the cache {}",
                        c.path(k).display()
                    )),
                })
            }
            Loaded::Miss => {}
            Loaded::Damaged(why) => {
                (watch.say)(&format!(
                    "note: the reference cache {} is damaged ({why}); layers 0..{first} are recomputed and the entry rewritten",
                    c.path(k).display(),
                ));
                damaged = Some(why);
            }
        }
    }
    let values = prefix_values(reference, weights, &cfg.tokens, &cfg.plan, watch.layers)?;
    let timing = Some((
        format!("reference prefix (layers 0..{first}, computed)"),
        t0.elapsed().as_secs_f64(),
    ));
    let note = cfg.cache.as_ref().map(|(c, k)| match c.store(k, &values) {
        Ok(p) => format!(
            "layers 0..{first} of the reference computed and cached in {}{}",
            p.display(),
            damaged.as_ref().map_or(String::new(), |why| format!(
                " (the entry there was damaged: {why})"
            ))
        ),
        Err(e) => format!("{CACHE_NOT_WRITTEN}: {e:#}"),
    });
    Ok(Prefix {
        values,
        timing,
        note,
    })
}
