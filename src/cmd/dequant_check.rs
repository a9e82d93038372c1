//! `glmdiff dequant-check`: GPU dequantization against the CPU's, tensor by tensor (the work is
//! [`crate::dcheck`]'s).

use anyhow::Result;

use super::{model_input, print_report, to_stdout, write_json, Outcome};
use crate::cli::DequantCheckArgs;
use crate::dcheck;
use crate::gguf::Model;
use crate::report::dequant_check::{render, to_json};
use crate::report::progress::Bar;
use crate::util::guard::Guard;

/// Runs `glmdiff dequant-check`.
pub fn run(args: &DequantCheckArgs) -> Result<Outcome> {
    let project = args
        .project
        .as_deref()
        .map(dcheck::project::full_model)
        .transpose()?;
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
    let model = Model::open(&args.model)?;
    let names = dcheck::select(&model, &args.tensor, args.tensors.as_deref(), args.all)?;
    let options = dcheck::Options {
        devices: if args.devices.is_empty() {
            vec![args.device]
        } else {
            args.devices.clone()
        },
        staging: dcheck::Staging::pageable_if(args.pageable),
        project,
    };
    // One device reports its chunks, several the tensors they share.
    let unit = if options.devices.len() > 1 {
        "tensors"
    } else {
        "chunks"
    };
    let bar = Bar::with_unit(unit);
    let checked = dcheck::check(&model, &names, &options, &bar)?;
    print_report(&render(&checked), to_stdout(args.json.as_deref()));
    if let Some(j) = &args.json {
        write_json("--json", j, &to_json(&checked))?;
    }
    Ok(if checked.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}
