//! `glmdiff weights-check`: a GGUF tensor by tensor against its Hugging Face checkpoint (or
//! another GGUF of the same model).

use anyhow::Result;

use super::{model_input, print_report, to_stdout, write_json, Outcome};
use crate::cli::WeightsCheckArgs;
use crate::gguf::Model;
use crate::hf::Checkpoint;
use crate::report::progress::Bar;
use crate::wcheck::{self, Dims, GgufStore, HfStore, Options, RefKind, Setup};

/// Runs `glmdiff weights-check`.
pub fn run(args: &WeightsCheckArgs) -> Result<Outcome> {
    let mut g = crate::util::guard::Guard::new();
    model_input(&mut g, "the input model", &args.model);
    if let Some(dir) = &args.hf {
        hf_inputs(&mut g, dir);
    }
    if let Some(other) = &args.gguf {
        model_input(&mut g, "the --gguf model", other);
    }
    g.output_or_stdout("--json", args.json.as_deref()).check()?;
    let model = Model::open(&args.model)?;
    for g in &args.tensors {
        if !model
            .tensors()
            .any(|t| crate::util::glob::matches(g, &t.info.name))
        {
            anyhow::bail!(
                "weights-check: --tensors {g:?} matches no tensor of {} ({} tensors; `glmdiff inspect` lists them)",
                model.path().display(),
                model.n_tensors()
            );
        }
    }
    let opts = Options {
        tensors: args.tensors.clone(),
        ..Options::default()
    };
    let bar = Bar::with_unit("chunks");
    let index_heads = crate::model::HParams::from_metadata(&model)
        .ok()
        .and_then(|hp| hp.indexer.map(|i| i.n_head as u64));
    let report = match (&args.hf, &args.gguf) {
        (Some(dir), _) => {
            let ckpt = Checkpoint::open(dir)?;
            wcheck::same_model_hf(&model, dir, &ckpt.config)?;
            let setup = Setup {
                kind: RefKind::Hf,
                dims: Dims::from_hf(&ckpt.config).or_else(|| Dims::from_gguf(&model)),
                index_heads: ckpt.config.index_n_heads.map(|h| h as u64).or(index_heads),
                mtp_from: (ckpt.config.n_nextn > 0).then_some(ckpt.config.n_layers),
            };
            wcheck::check(&model, &HfStore { ckpt: &ckpt }, setup, &opts, &bar)?
        }
        (None, Some(other)) => {
            let other = Model::open(other)?;
            wcheck::same_model_gguf(&model, &other)?;
            let mtp_from = crate::model::HParams::from_metadata(&other)
                .ok()
                .filter(|hp| hp.n_nextn > 0)
                .map(|hp| hp.n_layer);
            let setup = Setup {
                kind: RefKind::Gguf,
                dims: Dims::from_gguf(&model).or_else(|| Dims::from_gguf(&other)),
                index_heads,
                mtp_from,
            };
            wcheck::check(&model, &GgufStore { model: &other }, setup, &opts, &bar)?
        }
        (None, None) => anyhow::bail!("weights-check: give --hf DIR or --gguf OTHER"),
    };
    print_report(
        &crate::report::weights_check::render(&report),
        to_stdout(args.json.as_deref()),
    );
    if let Some(j) = &args.json {
        write_json("--json", j, &crate::report::weights_check::to_json(&report))?;
    }
    Ok(if report.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}

/// The files of a checkpoint directory `weights-check` reads: `config.json`, the index and every
/// `.safetensors` file.
fn hf_inputs(g: &mut crate::util::guard::Guard, dir: &std::path::Path) {
    g.input("the --hf config", &dir.join("config.json"))
        .input("the --hf index", &dir.join(crate::hf::INDEX_FILE));
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for p in rd.filter_map(|e| e.ok().map(|e| e.path())) {
        if p.extension().is_some_and(|e| e == "safetensors") {
            g.input("the --hf checkpoint file", &p);
        }
    }
}
