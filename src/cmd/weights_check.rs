//! `glmdiff weights-check`: a GGUF tensor by tensor against its Hugging Face checkpoint (or
//! another GGUF of the same model).

use anyhow::Result;

use super::Outcome;
use crate::cli::WeightsCheckArgs;
use crate::gguf::Model;
use crate::hf::Checkpoint;
use crate::report::progress::Bar;
use crate::wcheck::{self, Dims, GgufStore, HfStore, Options, RefKind, Setup};

/// Runs `glmdiff weights-check`.
pub fn run(args: &WeightsCheckArgs) -> Result<Outcome> {
    if let Some(j) = &args.json {
        crate::util::atomic::check_output_dir(j)?;
    }
    let model = Model::open(&args.model)?;
    let opts = Options {
        tensors: args.tensors.clone(),
        ..Options::default()
    };
    let bar = Bar::with_unit("chunks");
    let index_heads = crate::model::HParams::from_model(&model)
        .ok()
        .and_then(|hp| hp.indexer.map(|i| i.n_head as u64));
    let report = match (&args.hf, &args.gguf) {
        (Some(dir), _) => {
            let ckpt = Checkpoint::open(dir)?;
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
            let mtp_from = crate::model::HParams::from_model(&other)
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
    crate::report::emit(&crate::report::weights_check::render(&report));
    if let Some(j) = &args.json {
        let doc = crate::report::weights_check::to_json(&report);
        crate::util::atomic::write_atomic(j, |w| {
            serde_json::to_writer_pretty(&mut *w, &doc)?;
            Ok(w.write_all(b"\n")?)
        })?;
    }
    Ok(if report.differs() {
        Outcome::Differs
    } else {
        Outcome::Ok
    })
}
