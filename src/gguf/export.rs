//! One tensor, or a range of its rows, dequantized to f32 and written as `.npy` or
//! `.safetensors` (`glmdiff dequant`), streamed: in chunks of rows (about 64 MiB of f32 each),
//! each written as it is dequantized, so a tensor of any size needs one chunk of memory and
//! shows progress; rows are whole blocks, so the values are those of one call over the whole
//! range.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};

use super::model::{Model, TensorRef};
use crate::quant::GgmlType;
use crate::util::atomic::write_atomic;
use crate::util::progress::Progress;
use crate::util::{npy, safetensors_stream};

/// The f32 bytes dequantized between two progress steps.
const CHUNK_BYTES: u64 = 64 << 20;

/// Output formats, chosen by the file extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// NumPy `.npy`.
    Npy,
    /// One tensor in a `.safetensors` file, with the source in its metadata.
    Safetensors,
}

impl ExportFormat {
    /// The format of `path`, by its extension.
    pub fn of(path: &Path) -> Result<ExportFormat> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("npy") => Ok(ExportFormat::Npy),
            Some("safetensors") => Ok(ExportFormat::Safetensors),
            other => bail!(
                "dequant: output {} has extension {:?}; use .npy or .safetensors",
                path.display(),
                other.unwrap_or("")
            ),
        }
    }
}

/// What was written.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The tensor's name.
    pub name: String,
    /// Its GGML type.
    pub ty: GgmlType,
    /// The shape written (PyTorch order): the tensor's own, or `[rows, ne0]` for a row range.
    pub shape: Vec<u64>,
    /// The rows written.
    pub rows: Range<u64>,
    /// The tensor's row count.
    pub n_rows: u64,
}

/// Dequantizes rows `rows` (all when `None`) of tensor `tensor` of `model` and writes them to
/// `out` atomically, streaming: the header first, then each chunk of rows as it is dequantized,
/// so memory holds one chunk (about [`CHUNK_BYTES`]) whatever the tensor's size; `progress`
/// counts the rows.
pub fn export_rows(
    model: &Model,
    tensor: &str,
    rows: Option<Range<u64>>,
    out: &Path,
    progress: &dyn Progress,
) -> Result<Exported> {
    let format = ExportFormat::of(out)?;
    let t = model.tensor(tensor)?;
    let n_rows = t.info.n_rows();
    let whole = rows.is_none();
    let rows = rows.unwrap_or(0..n_rows);
    if rows.end > n_rows {
        bail!(
            "dequant: --rows {}..{} is out of range: {} {:?} (shape {:?}) has {} rows of {} elements",
            rows.start,
            rows.end,
            t.info.name,
            t.info.ty,
            t.info.shape(),
            n_rows,
            t.info.row_len()
        );
    }
    // PyTorch shape: the whole tensor keeps its shape; a row range is [rows, ne0].
    let shape: Vec<u64> = if whole {
        t.info.shape()
    } else {
        vec![rows.end - rows.start, t.info.row_len()]
    };
    write_atomic(out, |w| {
        match format {
            ExportFormat::Npy => npy::write_header(w, npy::NpyDtype::F32, &shape)?,
            ExportFormat::Safetensors => {
                let meta = HashMap::from([
                    ("source".to_string(), model.file_name()),
                    ("gguf_type".to_string(), t.info.ty.name().to_string()),
                    ("rows".to_string(), format!("{}..{}", rows.start, rows.end)),
                ]);
                safetensors_stream::write_f32_header(w, &t.info.name, &shape, &meta)?;
            }
        }
        dequantize_chunked(model, t, rows.clone(), progress, &mut |chunk| {
            safetensors_stream::write_values(w, chunk)
        })
    })?;
    Ok(Exported {
        name: t.info.name.clone(),
        ty: t.info.ty,
        shape,
        rows,
        n_rows,
    })
}

/// Rows `rows` of `t` in chunks of about [`CHUNK_BYTES`] of f32, each handed to `sink` as it
/// is dequantized and counted on `progress`.
fn dequantize_chunked(
    model: &Model,
    t: TensorRef<'_>,
    rows: Range<u64>,
    progress: &dyn Progress,
    sink: &mut dyn FnMut(&[f32]) -> Result<()>,
) -> Result<()> {
    let row_len = t.info.row_len().max(1);
    let chunk = ((CHUNK_BYTES / 4) / row_len).max(1);
    progress.start(
        &format!("dequantizing {}", t.info.name),
        rows.end - rows.start,
    );
    let mut r = rows.start;
    while r < rows.end {
        let end = (r + chunk).min(rows.end);
        sink(&model.dequantize_rows(t, r..end)?)?;
        progress.inc(end - r);
        r = end;
    }
    progress.finish();
    Ok(())
}
