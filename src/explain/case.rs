//! Step cases (`--repro DIR`, `glmdiff step DIR`).

use std::path::Path;

use anyhow::Result;

use super::CapturedStep;
use crate::model::Weights;

/// Facts about the run a case records beside the step.
#[derive(Clone, Debug)]
pub struct CaseMeta {
    /// The model path as given.
    pub model: String,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// The candidate as asked (`cpu`, `trace:FILE`).
    pub candidate: String,
    /// The candidate's own description.
    pub candidate_describe: String,
    /// The candidate's precision string.
    pub candidate_dtype: String,
    /// The reference's precision string.
    pub reference_dtype: String,
}

/// Checks that `dir` can be written.
pub fn check_target(dir: &Path) -> Result<()> {
    let _ = dir;
    Ok(())
}

/// Writes the case.
pub fn write(dir: &Path, c: &CapturedStep, weights: &Weights<'_>, meta: &CaseMeta) -> Result<()> {
    let _ = (dir, c, weights, meta);
    anyhow::bail!("not yet")
}
