//! `glmdiff weights-check`: a GGUF tensor by tensor against its Hugging Face checkpoint (or
//! another GGUF of the same model); the work is [`crate::wcheck::check_against`]'s.

use anyhow::Result;

use super::{model_input, print_report, to_stdout, write_json, Outcome};
use crate::cli::WeightsCheckArgs;
use crate::gguf::Model;
use crate::report::progress::Bar;
use crate::report::weights_check::{render, to_json};
use crate::util::guard::Guard;
use crate::wcheck::{check_against, Reference};

/// Runs `glmdiff weights-check`.
pub fn run(args: &WeightsCheckArgs) -> Result<Outcome> {
    let mut g = Guard::new();
    model_input(&mut g, "the input model", &args.model);
    if let Some(dir) = &args.hf {
        let f = crate::hf::files(dir);
        g.input("the --hf config", &f.config)
            .input("the --hf index", &f.index);
        for p in &f.shards {
            g.input("the --hf checkpoint file", p);
        }
    }
    if let Some(other) = &args.gguf {
        model_input(&mut g, "the --gguf model", other);
    }
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
    let reference = match (&args.hf, &args.gguf) {
        (Some(dir), _) => Reference::Hf(dir.clone()),
        (None, Some(other)) => Reference::Gguf(other.clone()),
        (None, None) => anyhow::bail!("weights-check: give --hf DIR or --gguf OTHER"),
    };
    let model = Model::open(&args.model)?;
    let report = check_against(&model, &reference, &args.tensors, &Bar::with_unit("chunks"))?;
    print_report(&render(&report), to_stdout(args.json.as_deref()));
    if let Some(j) = &args.json {
        write_json("--json", j, &to_json(&report))?;
    }
    Ok(if report.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}
