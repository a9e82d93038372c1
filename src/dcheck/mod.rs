//! `dequant-check`: GGUF tensors' raw blocks dequantized on the device and compared there with
//! the CPU's dequantization, tensor by tensor.
//!
//! - [`select`]: the tensors asked (names, a glob, all), checked against the model; this part
//!   and the data the check returns build without the `cuda` feature, so that such a build
//!   refuses bad names the same way before saying it cannot check.
//! - `tensor` (feature `cuda`): one tensor, streamed in chunks of rows, the CPU one chunk ahead
//!   on its own thread (its hash fused with its dequantization), hashes compared before any
//!   values travel.
//! - `tensor` (feature `cuda`): one device's pipeline over a sequence of tensors, streamed in
//!   chunks of rows: the raw blocks of the next chunks read into pinned staging and copied on
//!   a copy stream of their own ([`crate::gpu::upload`]) while the device dequantizes and
//!   hashes the current one and the CPU hashes its side on its own thread (its hash fused with
//!   its dequantization); hashes compared before any values travel. [`Staging::Pageable`]
//!   copies from the mapped file instead, as before, to compare.
//! - `devices` (feature `cuda`): the tensors on one device, or spread over several.
//! - [`project`]: the measured rates of each side and the time a whole model would take at
//!   them (no device needed).

#[cfg(feature = "cuda")]
mod devices;
pub mod project;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use tensor::{check_tensor, DeviceCheck};

use std::ops::Range;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::gguf::Model;
use crate::util::glob;
use crate::util::progress::Progress;
use project::{Busy, FullModel, Projection, Rates};

/// Elements per chunk (256 MiB of f32 per side).
pub const CHUNK_ELEMS: u64 = 1 << 26;

/// The environment variable that sets the default of `dequant-check --pageable` (read once by
/// the command line, never here: copies from pageable memory, [`Staging::Pageable`], when set to
/// anything but the empty string or `0`); the pageable staging's description names it.
pub const PAGEABLE_ENV: &str = "GLMDIFF_DCHECK_PAGEABLE";

/// How a chunk's raw blocks reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Staging {
    /// Read from the model's files into a ring of pinned buffers by an upload thread and copied
    /// on a copy stream of their own, a few chunks ahead of the device ([`crate::gpu::upload`]).
    Pinned,
    /// Copied by the device loop itself from the mapped file (pageable memory), synchronously.
    Pageable,
}

impl Staging {
    /// [`Staging::Pageable`] when `pageable` (`dequant-check --pageable`), else
    /// [`Staging::Pinned`].
    pub fn pageable_if(pageable: bool) -> Staging {
        if pageable {
            Staging::Pageable
        } else {
            Staging::Pinned
        }
    }
}

/// Rows per chunk for rows of `row_len` values and `row_bytes` raw bytes: at most `max_elems`
/// values and `max_bytes` raw bytes (one staging buffer), and at least one row.
pub fn chunk_rows(row_len: u64, row_bytes: u64, max_elems: u64, max_bytes: u64) -> u64 {
    (max_elems / row_len.max(1))
        .min(max_bytes / row_bytes.max(1))
        .max(1)
}

/// The chunks of `n_rows` rows, `per` rows at most each, in order.
pub fn row_chunks(n_rows: u64, per: u64) -> Vec<Range<u64>> {
    let per = per.max(1);
    (0..n_rows.div_ceil(per))
        .map(|i| i * per..((i + 1) * per).min(n_rows))
        .collect()
}

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
    /// CPU dequant and hash (ms, on its own thread; plus the values made again for a chunk
    /// whose hashes differ).
    pub cpu_ms: f64,
    /// Host-to-device copies (ms): with pinned staging the copy stream's time (device events),
    /// with pageable copies the host's; plus the CPU's values copied for a chunk whose hashes
    /// differ.
    pub h2d_ms: f64,
    /// Reading the raw bytes from the file into pinned staging (ms, the upload thread; 0 with
    /// pageable copies, which read the mapped file as they copy).
    pub read_ms: f64,
    /// Dequant and hash kernels (ms, device events).
    pub gpu_ms: f64,
    /// The device loop's waits for the chunks' uploads (ms): with pinned staging, for an
    /// upload still under way; with pageable copies, the copies themselves.
    pub wait_upload_ms: f64,
    /// The device loop's waits for the CPU's hashes (ms).
    pub wait_cpu_ms: f64,
    /// On-device comparison (ms).
    pub compare_ms: f64,
    /// The device loop's time on this tensor's chunks (ms; the next tensor's first chunks are
    /// already on their way meanwhile).
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

/// What a check found: the device line, one result per tensor checked, the tensors skipped,
/// what each device's pipeline did, the rates and projections.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The device (or devices, with how many tensors each checked in how long).
    pub device: String,
    /// How the raw blocks reached the device(s), in words.
    pub staging: String,
    /// One result per tensor checked, in the order asked.
    pub checks: Vec<TensorCheck>,
    /// Tensors not checked.
    pub skipped: Vec<Skipped>,
    /// Each device's pipeline.
    pub per_device: Vec<Busy>,
    /// The whole check (ms).
    pub wall_ms: f64,
    /// The rates measured (`None` when no value was checked).
    pub rates: Option<Rates>,
    /// The model at hand when only part of it was checked, then the `--project` model.
    pub projections: Vec<Projection>,
    /// The `--project` model, with its source.
    pub project: Option<FullModel>,
}

/// How to check.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// CUDA device ordinals: the first alone, or spread over all when there are several.
    pub devices: Vec<usize>,
    /// How the raw blocks reach the device.
    pub staging: Staging,
    /// A full model to project the measured rates to.
    pub project: Option<&'static FullModel>,
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

/// Checks the tensors `names` of `model` (from [`select`]) as `options` say (the first device
/// alone, or spread over all when there are several), reporting chunks (one device) or tensors
/// (several) to `progress`. Without the `cuda` feature, an error that says so.
pub fn check(
    model: &Model,
    names: &[String],
    options: &Options,
    progress: &(dyn Progress + Sync),
) -> Result<Checked> {
    #[cfg(feature = "cuda")]
    {
        devices::check(model, names, options, progress)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, names, options, progress);
        bail!("dequant-check: this glmdiff was built without the `cuda` feature")
    }
}

/// The values and raw bytes of every tensor of `model` that has a dequantizer (what `--all`
/// checks).
pub fn checkable_size(model: &Model) -> (u64, u64) {
    model
        .tensors()
        .filter(|t| t.info.ty.info().kernel.is_some())
        .fold((0, 0), |(v, b), t| {
            (v + t.info.n_elements(), b + t.info.nbytes)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks hold at most 2^26 values and one staging buffer of raw bytes, at least a row,
    /// and cover every row once, in order.
    #[test]
    fn chunks_are_bounded_by_values_and_bytes() {
        let mib = 1u64 << 20;
        // Q4_K rows of 6144 values (3456 bytes): 10922 rows by values (37.7 MB of raw bytes).
        assert_eq!(chunk_rows(6144, 3456, CHUNK_ELEMS, 256 * mib), 10922);
        // F32: 2^26 values are 256 MiB, both bounds at once.
        assert_eq!(chunk_rows(4096, 16384, CHUNK_ELEMS, 256 * mib), 16384);
        // F64 rows of 4096 values (32 KiB): the staging buffer halves the chunk.
        assert_eq!(chunk_rows(4096, 32768, CHUNK_ELEMS, 256 * mib), 8192);
        // A row larger than either bound is a chunk of its own; empty rows do not divide by 0.
        assert_eq!(chunk_rows(1 << 27, 1 << 29, CHUNK_ELEMS, 256 * mib), 1);
        assert_eq!(chunk_rows(0, 0, CHUNK_ELEMS, 256 * mib), CHUNK_ELEMS);
        assert_eq!(row_chunks(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(row_chunks(8, 4), vec![0..4, 4..8]);
        assert_eq!(row_chunks(0, 4), Vec::<Range<u64>>::new());
        assert_eq!(row_chunks(3, 0), vec![0..1, 1..2, 2..3]);
    }

    /// `--pageable` asks for pageable copies, pinned staging otherwise.
    #[test]
    fn pageable_when_asked() {
        assert_eq!(Staging::pageable_if(false), Staging::Pinned);
        assert_eq!(Staging::pageable_if(true), Staging::Pageable);
    }
}
