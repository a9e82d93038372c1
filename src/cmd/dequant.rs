//! `glmdiff dequant`: one tensor (or a row range) to f32 in `.npy` or `.safetensors`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Result};

use super::{model_input, Outcome};
use crate::cli::DequantArgs;
use crate::gguf::Model;
use crate::report::progress::Bar;
use crate::util::atomic::write_atomic;
use crate::util::guard::Guard;
use crate::util::progress::{Progress, ProgressWriter};
use crate::util::{npy, safetensors_stream};

/// The f32 bytes dequantized between two progress steps.
const CHUNK_BYTES: u64 = 64 << 20;

/// Output formats, chosen by the file extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Npy,
    Safetensors,
}

fn format_of(path: &Path) -> Result<Format> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("npy") => Ok(Format::Npy),
        Some("safetensors") => Ok(Format::Safetensors),
        other => bail!(
            "dequant: output {} has extension {:?}; use .npy or .safetensors",
            path.display(),
            other.unwrap_or("")
        ),
    }
}

/// Runs `glmdiff dequant`.
pub fn run(args: &DequantArgs) -> Result<Outcome> {
    let format = format_of(&args.out)?;
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    g.output("--out", Some(&args.out)).check()?;
    let model = Model::open(&args.model)?;
    let t = model.tensor(&args.tensor)?;
    let n_rows = t.info.n_rows();
    let rows = args.rows.clone().unwrap_or(0..n_rows);
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
    // In chunks of rows (about 64 MiB of f32 each), so that a large tensor shows progress;
    // rows are whole blocks, so the values are those of one call over the whole range.
    let row_len = t.info.row_len().max(1);
    let chunk = ((CHUNK_BYTES / 4) / row_len).max(1);
    let bar = Bar::with_unit("rows");
    bar.start(
        &format!("dequantizing {}", t.info.name),
        rows.end - rows.start,
    );
    let mut data = Vec::with_capacity(((rows.end - rows.start) * row_len) as usize);
    let mut r = rows.start;
    while r < rows.end {
        let end = (r + chunk).min(rows.end);
        data.extend(model.dequantize_rows(t, r..end)?);
        bar.inc(end - r);
        r = end;
    }
    bar.finish();
    // PyTorch shape: the whole tensor keeps its shape; a row range is [rows, ne0].
    let shape: Vec<u64> = if args.rows.is_none() {
        t.info.shape()
    } else {
        vec![rows.end - rows.start, t.info.row_len()]
    };
    let bar = Bar::bytes();
    bar.start(
        &format!("writing {}", args.out.display()),
        std::mem::size_of_val(data.as_slice()) as u64,
    );
    match format {
        Format::Npy => write_atomic(&args.out, |w| {
            npy::write_f32(&mut ProgressWriter::new(w, &bar), &shape, &data)
        })?,
        Format::Safetensors => {
            let meta = HashMap::from([
                ("source".to_string(), model.file_name()),
                ("gguf_type".to_string(), t.info.ty.name().to_string()),
                ("rows".to_string(), format!("{}..{}", rows.start, rows.end)),
            ]);
            write_atomic(&args.out, |w| {
                safetensors_stream::write_f32(
                    &mut ProgressWriter::new(w, &bar),
                    &t.info.name,
                    &shape,
                    &data,
                    &meta,
                )
            })?;
        }
    }
    bar.finish();
    crate::report::emit_err(&format!(
        "wrote {} ({} {}, shape {:?}, rows {}..{} of {})",
        args.out.display(),
        t.info.name,
        t.info.ty,
        shape,
        rows.start,
        rows.end,
        n_rows
    ));
    Ok(Outcome::Ok)
}
