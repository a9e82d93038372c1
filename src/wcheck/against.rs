//! What a GGUF is checked against (its Hugging Face checkpoint or another GGUF), and the
//! whole check: the globs checked against the model, the reference opened and checked to be
//! the same model, what is known of both gathered into a [`Setup`], then [`check`].

use std::path::PathBuf;

use anyhow::{bail, Result};

use super::store::{GgufStore, HfStore};
use super::{check, same_model_gguf, same_model_hf, Dims, Options, RefKind, Report, Setup};
use crate::gguf::Model;
use crate::hf::Checkpoint;
use crate::model::HParams;
use crate::util::glob;
use crate::util::progress::Progress;

/// The reference of a check.
#[derive(Clone, Debug)]
pub enum Reference {
    /// The Hugging Face checkpoint directory the GGUF was converted from.
    Hf(PathBuf),
    /// Another GGUF of the same model.
    Gguf(PathBuf),
}

/// Checks `model` against `reference`, only the GGUF tensors matching one of `tensors` (all
/// when empty; a glob that matches no tensor is an error), chunks reported to `progress`.
pub fn check_against(
    model: &Model,
    reference: &Reference,
    tensors: &[String],
    progress: &(dyn Progress + Sync),
) -> Result<Report> {
    for g in tensors {
        if !model.tensors().any(|t| glob::matches(g, &t.info.name)) {
            bail!(
                "weights-check: --tensors {g:?} matches no tensor of {} ({} tensors; `glmdiff inspect` lists them)",
                model.path().display(),
                model.n_tensors()
            );
        }
    }
    let opts = Options {
        tensors: tensors.to_vec(),
        ..Options::default()
    };
    let index_heads = HParams::from_metadata(model)
        .ok()
        .and_then(|hp| hp.indexer.map(|i| i.n_head as u64));
    match reference {
        Reference::Hf(dir) => {
            let ckpt = Checkpoint::open(dir)?;
            same_model_hf(model, dir, &ckpt.config)?;
            let setup = Setup {
                kind: RefKind::Hf,
                dims: Dims::from_hf(&ckpt.config).or_else(|| Dims::from_gguf(model)),
                index_heads: ckpt.config.index_n_heads.map(|h| h as u64).or(index_heads),
                mtp_from: (ckpt.config.n_nextn > 0).then_some(ckpt.config.n_layers),
            };
            check(model, &HfStore { ckpt: &ckpt }, setup, &opts, progress)
        }
        Reference::Gguf(other) => {
            let other = Model::open(other)?;
            same_model_gguf(model, &other)?;
            let mtp_from = HParams::from_metadata(&other)
                .ok()
                .filter(|hp| hp.n_nextn > 0)
                .map(|hp| hp.n_layer);
            let setup = Setup {
                kind: RefKind::Gguf,
                dims: Dims::from_gguf(model).or_else(|| Dims::from_gguf(&other)),
                index_heads,
                mtp_from,
            };
            check(model, &GgufStore { model: &other }, setup, &opts, progress)
        }
    }
}
