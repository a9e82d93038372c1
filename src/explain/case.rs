//! Step cases: the first failing step of a run, written as a self-contained directory
//! (`run --repro DIR`) that `glmdiff step DIR` re-runs without the model or the candidate. The
//! format is documented in `docs/step-case.md`:
//!
//! - `case.json`: the header ([`CaseHeader`]): which step (named by its first output hook), the
//!   failing hook, the inputs, the weight tensors, both sides' precisions, the error and floor
//!   the run found, the source model and prompt;
//! - `tensors.safetensors` (the trace format of `docs/hooks.md`, F32/I32): every input
//!   as `input.<hook>`, the reference's and the candidate's output at the failing hook as
//!   `reference.<hook>` and `candidate.<hook>`;
//! - `weights.gguf`: the GGUF tensors the step reads, whole and as the model holds them (raw
//!   quant blocks, same type and `ne`), with the model's metadata (its split keys left out), so
//!   that any engine realises them as it would from the model;
//! - `README.md`: what the case is and the commands that re-run it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::CapturedStep;
use crate::driver::{exec_step, op_name};
use crate::engine::{Engine, HostTensor};
use crate::gguf::{GgufWriter, Model};
use crate::model::steps::{self, Step};
use crate::model::Weights;
use crate::trace::{write_trace, Mode, TraceFile, TraceMeta};
use crate::util::atomic::{write_atomic, InFlightDir};

/// Version of the case format (`glmdiff_case` in `case.json`).
pub const CASE_VERSION: u32 = 1;
/// The header file.
pub const CASE_JSON: &str = "case.json";
/// The tensors file.
pub const CASE_TENSORS: &str = "tensors.safetensors";
/// The weights file.
pub const CASE_WEIGHTS: &str = "weights.gguf";
/// The README.
pub const CASE_README: &str = "README.md";

/// Facts about the run a case records beside the step.
#[derive(Clone, Debug)]
pub struct CaseMeta {
    /// The model path as given.
    pub model: String,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// The candidate as asked (`cpu`, `trace:FILE`).
    pub candidate: String,
    /// The candidate's own description.
    pub candidate_describe: String,
    /// The candidate's precision string.
    pub candidate_dtype: String,
    /// The reference's precision string.
    pub reference_dtype: String,
}

/// One weight tensor of the case.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaseWeight {
    /// GGUF name.
    pub name: String,
    /// GGML type name.
    #[serde(rename = "type")]
    pub ty: String,
    /// PyTorch shape (`ne` reversed).
    pub shape: Vec<u64>,
}

/// `case.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaseHeader {
    /// Format version ([`CASE_VERSION`]).
    pub glmdiff_case: u32,
    /// glmdiff's version that wrote it.
    pub glmdiff_version: String,
    /// The source model as given to `run`.
    pub model: String,
    /// `general.architecture`.
    pub architecture: String,
    /// The prompt.
    pub tokens: Vec<u32>,
    /// The step, by its first output hook.
    pub step: String,
    /// The step's kind (`linear`, `mla_attention`, ...).
    pub op: String,
    /// The step's layer (`null` for global steps).
    pub layer: Option<usize>,
    /// The step's inputs, in order (`input.<name>` in the tensors file).
    pub inputs: Vec<String>,
    /// The failing hook (`reference.<hook>` and `candidate.<hook>` in the tensors file).
    pub hook: String,
    /// The tensors of the weights file.
    pub weights: Vec<CaseWeight>,
    /// The reference's precision string.
    pub reference_dtype: String,
    /// The candidate as asked (`cpu`, `trace:FILE`).
    pub candidate: String,
    /// Its description.
    pub candidate_describe: String,
    /// Its precision string (decides the floor).
    pub candidate_dtype: String,
    /// The candidate's replay error the run found (`null` when not finite).
    pub error: Option<f64>,
    /// The floor the run judged it by.
    pub allowed: f64,
}

/// Checks, before a run, that a case can be written to `dir`: its parent exists, and `dir` is
/// absent, empty or an earlier case holding only a case's files (which is replaced).
pub fn check_target(dir: &Path) -> Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            bail!(
                "--repro {}: the directory {} does not exist",
                dir.display(),
                parent.display()
            );
        }
    }
    if dir.exists() {
        if !dir.is_dir() {
            bail!("--repro {}: exists and is not a directory", dir.display());
        }
        let mut entries: Vec<String> = std::fs::read_dir(dir)
            .with_context(|| format!("--repro {}: cannot read it", dir.display()))?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("--repro {}: cannot read it", dir.display()))?;
        entries.sort();
        if !entries.is_empty() && !dir.join(CASE_JSON).is_file() {
            bail!(
                "--repro {}: the directory is not empty and holds no {CASE_JSON}: not overwriting it",
                dir.display()
            );
        }
        // An earlier case is replaced whole: anything else in it would be lost with it.
        let own = [CASE_JSON, CASE_TENSORS, CASE_WEIGHTS, CASE_README];
        let other: Vec<&String> = entries
            .iter()
            .filter(|e| !own.contains(&e.as_str()))
            .collect();
        if !other.is_empty() {
            bail!(
                "--repro {}: the directory holds a case and {} other entr{} ({}): a case is replaced whole, so not overwriting it; move them or give another directory",
                dir.display(),
                other.len(),
                if other.len() == 1 { "y" } else { "ies" },
                other.iter().take(5).map(|e| e.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
    }
    Ok(())
}

/// Writes `c` as a case in `dir`: built in a temporary directory beside it (`.NAME.tmp-PID`,
/// removed if the process is interrupted), then moved into place, replacing an earlier case.
pub fn write(dir: &Path, c: &CapturedStep, weights: &Weights<'_>, meta: &CaseMeta) -> Result<()> {
    check_target(dir)?;
    let tmp = InFlightDir::beside(dir).context("--repro")?;
    write_files(tmp.path(), dir, c, weights, meta)?;
    tmp.commit(dir).context("--repro")
}

/// The files of a case, written to `to`; `dir` is where the case will be (named in its README).
fn write_files(
    to: &Path,
    dir: &Path,
    c: &CapturedStep,
    weights: &Weights<'_>,
    meta: &CaseMeta,
) -> Result<()> {
    let model = weights.model();
    let names = c.step.weights(weights);

    // The weights: the model's metadata and the step's tensors as the model holds them.
    let mut w = GgufWriter::new();
    for (k, v) in model.metadata() {
        if !k.starts_with("split.") {
            w.add(k, v.clone())?;
        }
    }
    let mut listed = Vec::new();
    for n in &names {
        let t = model.tensor(n)?;
        w.add_tensor(n, &t.info.ne, t.info.ty)?;
        listed.push(CaseWeight {
            name: n.clone(),
            ty: t.info.ty.name().to_string(),
            shape: t.info.shape(),
        });
    }
    w.write_file(&to.join(CASE_WEIGHTS), &mut |info, out| {
        let t = model.tensor(&info.name)?;
        out.write_all(model.tensor_data(t)?)?;
        Ok(())
    })
    .with_context(|| format!("--repro: writing {}", dir.join(CASE_WEIGHTS).display()))?;

    // The tensors.
    let mut tensors: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (n, t) in &c.inputs {
        tensors.insert(format!("input.{n}"), t.clone());
    }
    tensors.insert(format!("reference.{}", c.hook), c.reference.clone());
    tensors.insert(format!("candidate.{}", c.hook), c.candidate.clone());
    let trace_meta = TraceMeta {
        model: model.file_name(),
        architecture: weights.hparams().arch.as_str().to_string(),
        tokens: meta.tokens.clone(),
        engine: format!("step case of {}", c.hook),
        dtype: meta.candidate_dtype.clone(),
        mode: Mode::Replay,
        extra: BTreeMap::new(),
    };
    write_trace(&to.join(CASE_TENSORS), &tensors, &trace_meta)
        .with_context(|| format!("--repro: writing {}", dir.join(CASE_TENSORS).display()))?;

    let header = CaseHeader {
        glmdiff_case: CASE_VERSION,
        glmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        model: meta.model.clone(),
        architecture: weights.hparams().arch.as_str().to_string(),
        tokens: meta.tokens.clone(),
        step: c.step.outputs.first().cloned().unwrap_or_default(),
        op: op_name(&c.step.op).to_string(),
        layer: c.step.layer,
        inputs: c.step.inputs.clone(),
        hook: c.hook.clone(),
        weights: listed,
        reference_dtype: meta.reference_dtype.clone(),
        candidate: meta.candidate.clone(),
        candidate_describe: meta.candidate_describe.clone(),
        candidate_dtype: meta.candidate_dtype.clone(),
        error: c.error.is_finite().then_some(c.error),
        allowed: c.allowed,
    };
    write_atomic(&to.join(CASE_JSON), |f| {
        serde_json::to_writer_pretty(&mut *f, &header)?;
        Ok(f.write_all(b"\n")?)
    })?;
    let readme = readme(&header, dir);
    write_atomic(&to.join(CASE_README), |f| {
        Ok(f.write_all(readme.as_bytes())?)
    })?;
    Ok(())
}

fn readme(h: &CaseHeader, dir: &Path) -> String {
    let d = dir.display();
    let weights: Vec<String> = h
        .weights
        .iter()
        .map(|w| format!("- `{}` {} {:?}", w.name, w.ty, w.shape))
        .collect();
    let inputs: Vec<String> = h.inputs.iter().map(|i| format!("`input.{i}`")).collect();
    format!(
        "# glmdiff step case: `{hook}`\n\n\
         The step `{step}` ({op}) of `{model}` diverged first in replay: the candidate `{cand}` \
         ({describe}; {dtype}) is at relative L2 error {err} from the reference at `{hook}`, \
         against a floor of {floor:.3e}.\n\n\
         Re-run just this step:\n\n\
         ```sh\n\
         glmdiff step {d}                 # the stored candidate output against the reference\n\
         glmdiff step {d} --against cpu   # a second CPU reference (must pass)\n\
         glmdiff step {d} --against cuda  # the CUDA engine on device 0\n\
         glmdiff step {d} --explain       # which known bug reproduces the stored candidate\n\
         ```\n\n\
         Exit 0 when the candidate matches the reference within the floor, 1 otherwise.\n\n\
         Files (format: glmdiff's `docs/step-case.md`):\n\n\
         - `{CASE_JSON}`: this case's header;\n\
         - `{CASE_TENSORS}`: the inputs {inputs}, `reference.{hook}`, `candidate.{hook}` \
         (F32/I32, readable with the `safetensors` package);\n\
         - `{CASE_WEIGHTS}`: the tensors the step reads, as the model holds them, with the model's \
         metadata:\n\n{weights}\n\n\
         Prompt tokens: {tokens:?}\n",
        hook = h.hook,
        step = h.step,
        op = h.op,
        model = h.model,
        cand = h.candidate,
        describe = h.candidate_describe,
        dtype = h.candidate_dtype,
        err = h
            .error
            .map_or("not finite".to_string(), |e| format!("{e:.3e}")),
        floor = h.allowed,
        inputs = inputs.join(", "),
        weights = weights.join("\n"),
        tokens = h.tokens,
    )
}

/// A case read back: its header, its weights file and its tensors.
pub struct Case {
    /// The directory.
    pub dir: PathBuf,
    /// `case.json`.
    pub header: CaseHeader,
    /// `weights.gguf`.
    pub model: Model,
    /// `tensors.safetensors`.
    pub tensors: TraceFile,
}

impl Case {
    /// Reads the case in `dir`.
    pub fn read(dir: &Path) -> Result<Case> {
        let hp = dir.join(CASE_JSON);
        let text = std::fs::read_to_string(&hp).with_context(|| {
            format!(
                "step: {} is not a glmdiff step case (no readable {CASE_JSON}; `glmdiff run --repro DIR` writes one)",
                dir.display()
            )
        })?;
        let header: CaseHeader = serde_json::from_str(&text)
            .with_context(|| format!("step: {} is not a case header", hp.display()))?;
        if header.glmdiff_case != CASE_VERSION {
            bail!(
                "step: {}: case format {} is not the format {CASE_VERSION} this glmdiff reads",
                hp.display(),
                header.glmdiff_case
            );
        }
        let model = Model::open(&dir.join(CASE_WEIGHTS))?;
        let tensors = TraceFile::open(&dir.join(CASE_TENSORS))?;
        Ok(Case {
            dir: dir.to_path_buf(),
            header,
            model,
            tensors,
        })
    }

    /// The step rebuilt from the weights file's hyperparameters and checked against the header,
    /// with its stored inputs and outputs.
    pub fn captured(&self, weights: &Weights<'_>) -> Result<CapturedStep> {
        let h = &self.header;
        let step = find_step(weights, &h.step, h.layer)
            .with_context(|| format!("step: {}: case.json step {}", self.dir.display(), h.step))?;
        if step.inputs != h.inputs {
            bail!(
                "step: {}: the step {} reads {:?}, the case lists {:?}",
                self.dir.display(),
                h.step,
                step.inputs,
                h.inputs
            );
        }
        let get = |name: String| -> Result<HostTensor> {
            self.tensors.get(&name)?.with_context(|| {
                format!("step: {}: {CASE_TENSORS} has no {name}", self.dir.display())
            })
        };
        let inputs = h
            .inputs
            .iter()
            .map(|n| Ok((n.clone(), get(format!("input.{n}"))?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(CapturedStep {
            step,
            hook: h.hook.clone(),
            inputs,
            reference: get(format!("reference.{}", h.hook))?,
            candidate: get(format!("candidate.{}", h.hook))?,
            error: h.error.unwrap_or(f64::INFINITY),
            allowed: h.allowed,
            noise: None,
            inside: Vec::new(),
        })
    }
}

/// The step of the model whose outputs include `name` (in layer `layer`, or a global step).
pub fn find_step(weights: &Weights<'_>, name: &str, layer: Option<usize>) -> Result<Step> {
    let hp = weights.hparams();
    let candidates: Vec<Step> = match layer {
        Some(l) if l < hp.n_layer => steps::layer_steps(hp, l),
        Some(l) => bail!("layer {l} is not run (the model runs 0..{})", hp.n_layer),
        None => steps::embed_steps()
            .into_iter()
            .chain(steps::tail_steps(hp, hp.n_layer, weights.output_name()))
            .collect(),
    };
    candidates
        .into_iter()
        .find(|s| s.outputs.iter().any(|o| o == name))
        .with_context(|| format!("no step of the model produces {name}"))
}

/// Runs `c`'s step on `engine` from its stored inputs, with the weight hooks of a one-step walk,
/// and returns its output at `c.hook`.
pub fn output_on<E: Engine>(
    engine: &E,
    weights: &Weights<'_>,
    c: &CapturedStep,
    tokens: &[u32],
) -> Result<HostTensor> {
    let names = c.step.weights(weights);
    match c.step.layer {
        Some(l) => {
            engine.begin_model(&[])?;
            engine.begin_layer(l, &names)?;
        }
        None => engine.begin_model(&names)?,
    }
    let up = c
        .inputs
        .iter()
        .map(|(_, t)| engine.upload(t))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&E::Tensor> = up.iter().collect();
    let wants = |n: &str| n == c.hook;
    let out = exec_step(engine, &c.step, &refs, tokens, &wants)?;
    let t = match c.step.outputs.iter().position(|o| *o == c.hook) {
        Some(i) => out.outputs.get(i),
        None => out.extra.iter().find(|(n, _)| *n == c.hook).map(|(_, t)| t),
    }
    .with_context(|| format!("step: the step did not produce {}", c.hook))?;
    let host = engine.download(t)?;
    if let Some(l) = c.step.layer {
        engine.end_layer(l)?;
    }
    engine.end_model()?;
    Ok(host)
}
