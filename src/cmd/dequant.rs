//! `glmdiff dequant`: one tensor (or a row range) to f32 in `.npy` or `.safetensors` (the work
//! is [`crate::gguf::export_rows`]).

use anyhow::Result;

use super::{model_input, Outcome};
use crate::cli::DequantArgs;
use crate::gguf::{export_rows, ExportFormat, Model};
use crate::report::progress::Bar;
use crate::util::guard::Guard;

/// Runs `glmdiff dequant`.
pub fn run(args: &DequantArgs) -> Result<Outcome> {
    ExportFormat::of(&args.out)?;
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    g.output("--out", Some(&args.out)).check()?;
    let model = Model::open(&args.model)?;
    let e = export_rows(
        &model,
        &args.tensor,
        args.rows.clone(),
        &args.out,
        &Bar::with_unit("rows"),
    )?;
    crate::report::emit_err(&format!(
        "wrote {} ({} {}, shape {:?}, rows {}..{} of {})",
        args.out.display(),
        e.name,
        e.ty,
        e.shape,
        e.rows.start,
        e.rows.end,
        e.n_rows
    ));
    Ok(Outcome::Ok)
}
