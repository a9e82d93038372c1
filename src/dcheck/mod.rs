//! `dequant-check`: GGUF tensors' raw blocks dequantized on the device and compared there with
//! the CPU's dequantization, tensor by tensor.
//!
//! - [`select`]: the tensors asked (names, a glob, all), checked against the model; this part
//!   and the data the check returns build without the `cuda` feature, so that such a build
//!   refuses bad names the same way before saying it cannot check.
//! - `tensor` (feature `cuda`): one tensor, streamed in chunks of rows, the CPU one chunk ahead
//!   on its own thread (its hash fused with its dequantization), hashes compared before any
//!   values travel.
//! - `devices` (feature `cuda`): the tensors on one device, or spread over several.

#[cfg(feature = "cuda")]
mod devices;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use tensor::{check_tensor, CHUNK_ELEMS};

use anyhow::{bail, Result};
use serde::Serialize;

use crate::gguf::Model;
use crate::util::glob;
use crate::util::progress::Progress;

/// The first differing value of a tensor, and the block it comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FirstMismatch {
    /// Flat element index.
    pub index: u64,
    /// Row (of `ne[0]` elements) and column.
    pub row: u64,
    /// Column within the row.
    pub col: u64,
    /// Block index within the row.
    pub block: u64,
    /// The block's raw bytes, hex (scales first, as stored).
    pub raw: String,
    /// The CPU's value.
    pub cpu: f32,
    /// The GPU's value.
    pub gpu: f32,
}

/// One tensor's check.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorCheck {
    /// GGUF tensor name.
    pub name: String,
    /// GGML type name.
    pub ty: String,
    /// PyTorch-order shape.
    pub shape: Vec<u64>,
    /// Elements compared.
    pub elements: u64,
    /// Values that differ (bits, NaN equal to NaN).
    pub mismatches: u64,
    /// Largest |gpu - cpu| over differing finite values.
    pub max_abs: f32,
    /// The first difference.
    pub first: Option<FirstMismatch>,
    /// Raw bytes read.
    pub bytes: u64,
    /// Time in the dequant kernels (ms).
    pub kernel_ms: f64,
    /// The kernels' throughput: (raw bytes read + f32 written) per second, GB/s.
    pub kernel_gbps: f64,
    /// Wall time split (ms): CPU dequant and hash (on its own thread; plus the values made
    /// again for a chunk whose hashes differ), host-to-device copies, compare.
    pub cpu_ms: f64,
    /// Host-to-device copies (ms).
    pub h2d_ms: f64,
    /// On-device comparison (ms).
    pub compare_ms: f64,
    /// Whole check (ms).
    pub wall_ms: f64,
}

/// A tensor that was not checked, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Skipped {
    /// GGUF tensor name.
    pub name: String,
    /// Type name.
    pub ty: String,
    /// Why.
    pub why: String,
}

/// What a check found: the device line, one result per tensor checked, the tensors skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The device (or devices, with how many tensors each checked in how long).
    pub device: String,
    /// One result per tensor checked, in the order asked.
    pub checks: Vec<TensorCheck>,
    /// Tensors not checked.
    pub skipped: Vec<Skipped>,
}

impl Checked {
    /// Whether a tensor differs.
    pub fn differs(&self) -> bool {
        self.checks.iter().any(|c| c.mismatches > 0)
    }
}

/// The tensors to check, in order: `names` (each must exist), then with `all` every tensor of
/// the model, or those matching `glob`, each once. An error when nothing is asked, a name is
/// not in the model or the glob matches none of it.
pub fn select(
    model: &Model,
    names: &[String],
    pattern: Option<&str>,
    all: bool,
) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for n in names {
        if model.find(n).is_none() {
            bail!(
                "dequant-check: {} has no tensor {n} ({} tensors; `glmdiff inspect` lists them)",
                model.file_name(),
                model.n_tensors()
            );
        }
        out.push(n.clone());
    }
    if all || pattern.is_some() {
        for t in model.tensors() {
            let keep = all || pattern.is_some_and(|g| glob::matches(g, &t.info.name));
            if keep && !out.contains(&t.info.name) {
                out.push(t.info.name.clone());
            }
        }
    }
    if let Some(g) = pattern {
        if !model.tensors().any(|t| glob::matches(g, &t.info.name)) {
            bail!(
                "dequant-check: --tensors {g:?} matches no tensor of {} ({} tensors; `glmdiff inspect` lists them)",
                model.path().display(),
                model.n_tensors()
            );
        }
    }
    if out.is_empty() {
        bail!("dequant-check: give tensor names, --tensors GLOB or --all");
    }
    Ok(out)
}

/// Checks the tensors `names` of `model` (from [`select`]) on `devices` (the first alone, or
/// spread over all when there are several), reporting chunks (one device) or tensors (several)
/// to `progress`. Without the `cuda` feature, an error that says so.
pub fn check(
    model: &Model,
    names: &[String],
    devices: &[usize],
    progress: &(dyn Progress + Sync),
) -> Result<Checked> {
    #[cfg(feature = "cuda")]
    {
        devices::check(model, names, devices, progress)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, names, devices, progress);
        bail!("dequant-check: this glmdiff was built without the `cuda` feature")
    }
}
