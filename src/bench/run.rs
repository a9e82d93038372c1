//! `glmdiff bench run`: the time of `glmdiff run`'s own pipeline per layer and token count,
//! each side apart, against floors measured in the same run, and projected to a model's full
//! depth.
//!
//! # What is timed
//! The pipeline is `run`'s ([`Pipeline`]: `session` provides it, this layer only calls it): the
//! model opened and checked, the reference's prefix, then one pass of the reference and the
//! candidate (`--against`, `--mode`, `--dtype`) over the layers through the driver, which
//! records each side's time per layer (`driver::pair::LayerTime`: the reference, the candidate's
//! chain and replay, and the part of those the candidate spent waiting for its weight uploads,
//! with the bytes). The pass's wall time per layer is taken from the layer progress the driver
//! reports (a mark at every layer's end, [`Marks`]), so it holds everything the pass did over
//! the layer: each step's two sides at the same time (the reference on its threads, the
//! candidate on its device), downloads, the comparison; the first layer run
//! from 0 also holds the embedding.
//!
//! For each token count (random token ids, fixed seed) an untimed reference run of the layers
//! up to the last one timed comes first: it faults the model's pages in (the warm-up) and
//! records the reference's routing of every MoE layer timed (the floors need the experts it
//! touches; the pipeline's reference computes the same routing, deterministically). Then the
//! pipeline runs `reps` times; per layer the run with the lowest wall time is kept.
//!
//! # Floors, measured in the same run
//! - The CPU reference's floor of each layer and token count: `bench layer`'s
//!   ([`super::layer::layer_floor`]): the layer's weight slices (its tensors, the touched
//!   experts' rows) dequantized by `quant::dequantize_par` and multiplied by `math::matmul`
//!   with as many tokens as the layer multiplies them with; the lowest of `reps`.
//! - With a CUDA candidate, the host-to-device copy of each layer's raw GGUF bytes (every
//!   tensor its steps read), from pinned and from pageable memory ([`super::copy`]), once per
//!   layer (they do not depend on the tokens), the lowest of `reps` after an untimed copy.
//!
//! Ratios: reference / its floor, the candidate's upload wait / the pinned copy, candidate /
//! reference.
//!
//! # Projection
//! The whole run at a depth ([`Depth`]: `--project glm5`, or the model's own layer counts) is
//! projected as the sum over layer kinds of (layers of that kind) x (mean measured wall time
//! per layer of that kind, over its layers after the first when more are timed: [`by_kind`]),
//! the first then counted once as itself: the run's first layer holds the embedding and the
//! candidate's first uploads, which no prefetch hides, and the first MoE layer runs before any
//! near-tie expert flip is followed; each happens once in a whole run. The same sum over each
//! side's time says which side bounds it ([`project`]). The output layer is not in it. The
//! layers timed by default run from 0 through the second MoE layer, the first where a
//! low-precision candidate's near-tie expert flips are followed (the synthetic model has two
//! dense and two MoE layers).
//!
//! # Memory
//! Per token count, over the timed passes: `VmHWM` (reset before each pass where
//! `/proc/self/clear_refs` allows), and the peaks of `RssAnon` and `RssFile` sampled on a thread
//! of their own. The benchmark holds no map of the model during a pass (the warm-up run and the
//! floors open their own, closed before the passes).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::cpu_model;
use super::layer::{self, count_ids, glm5_synth, layer_floor, procfs, token_ids, Floor, LayerKind};
use super::scratch::{ScratchModel, SynthInfo};
use crate::driver::pair::LayerTime;
use crate::driver::{self, Plan};
use crate::engine::HostTensor;
use crate::gguf::Model;
use crate::model::names;
use crate::model::steps::{self, point};
use crate::model::{Arch, HParams, Weights};
use crate::synth::{Dims, SynthOptions};
use crate::trace::Sink;
use crate::util::progress::{NoProgress, Progress};

/// Timed passes per token count: the machine is shared, so the best of a few is kept.
pub const DEFAULT_REPS: usize = 3;
/// Seed of the random token ids.
pub const DEFAULT_SEED: u64 = layer::DEFAULT_SEED;
/// The named depths of `--project`: the layers run at inference (MTP blocks are not run) of
/// these dimension presets of `synth` (which hold each model's published configuration).
pub const NAMED_DEPTHS: [(&str, Arch); 2] =
    [("glm5", Arch::GlmDsa), ("deepseek-v3", Arch::Deepseek2)];
/// File name of the synthetic model inside the temporary directory.
const SYNTH_FILE: &str = "bench-run.gguf";
/// The name of the benchmark's temporary directories: `glmdiff-bench-run-PID-NANOS`.
const TEMP_PREFIX: &str = "glmdiff-bench-run-";

/// The layer counts a whole run is projected to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Depth {
    /// Where the counts come from: a model named by `--project`, or `model` (the file's own
    /// `block_count` less its MTP blocks, and `leading_dense_block_count`).
    pub name: String,
    /// Dense layers.
    pub dense: usize,
    /// MoE layers.
    pub moe: usize,
}

impl Depth {
    /// The depth of a model named by `--project` ([`NAMED_DEPTHS`]).
    pub fn named(name: &str) -> Result<Depth> {
        let Some(&(_, arch)) = NAMED_DEPTHS.iter().find(|(n, _)| *n == name) else {
            let known: Vec<String> = NAMED_DEPTHS
                .iter()
                .filter_map(|&(n, a)| {
                    Dims::preset(a, n).ok().map(|d| {
                        format!(
                            "{n} ({} dense + {} MoE layers)",
                            d.n_dense,
                            d.n_layer - d.n_dense
                        )
                    })
                })
                .collect();
            bail!(
                "bench: --project {name:?}: known models are {}",
                known.join(", ")
            );
        };
        let d = Dims::preset(arch, name)?;
        Ok(Depth {
            name: name.to_string(),
            dense: d.n_dense as usize,
            moe: (d.n_layer - d.n_dense.min(d.n_layer)) as usize,
        })
    }

    /// The model's own depth.
    pub fn of(hp: &HParams) -> Depth {
        let dense = hp.n_dense.min(hp.n_layer);
        Depth {
            name: "model".to_string(),
            dense,
            moe: hp.n_layer - dense,
        }
    }

    /// Layers of `kind`.
    pub fn count(&self, kind: LayerKind) -> usize {
        match kind {
            LayerKind::Dense => self.dense,
            LayerKind::Moe => self.moe,
        }
    }
}

/// The candidate engine of the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CandidateKind {
    /// A second CPU reference.
    Cpu,
    /// The CUDA engine on this device.
    Cuda(usize),
}

/// How the pipeline runs, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// The candidate.
    pub candidate: CandidateKind,
    /// The candidate as `--against` names it (`cpu`, `cuda:0`).
    pub spec: String,
    /// `--mode`.
    pub mode: String,
    /// `--dtype` (the CUDA engine's precision; `None` for a CPU candidate).
    pub dtype: Option<String>,
    /// How the candidate was chosen (`--against auto`), in words.
    pub choice: Option<String>,
    /// Whether the candidate's chain runs ahead of the pass (`--candidate-ahead`).
    pub candidate_ahead: bool,
    /// Whether the reference makes its short products from the CUDA candidate's device bytes
    /// (`--reference-reuse`).
    pub reference_reuse: bool,
    /// Where the CUDA engine's uploads take their bytes (`--upload-from`: `mapped`, `staged`;
    /// `None` for a CPU candidate).
    pub upload_from: Option<String>,
    /// Microseconds its upload thread sleeps after each registration (`--register-pause`).
    pub register_pause_us: u64,
}

/// What one run of the pipeline returns.
#[derive(Clone, Debug, Default)]
pub struct Timed {
    /// Each side's time per layer (global steps under `None`), as the driver recorded them.
    pub layer_times: Vec<LayerTime>,
    /// The candidate engine, in its own words.
    pub candidate: String,
    /// Whether the comparison found a difference.
    pub differs: bool,
    /// The run's notes (choices made, the candidate's uploads).
    pub notes: Vec<String>,
}

/// `glmdiff run`'s pipeline, as the benchmark runs it (implemented by `session`, above this
/// layer).
pub trait Pipeline {
    /// How it runs.
    fn settings(&self) -> Settings;
    /// Runs it on `model` for `tokens` over `layers`, reporting its layers to `progress` (the
    /// reference's prefix first when the layers start past 0, then the pass).
    fn run(
        &mut self,
        model: &Path,
        tokens: &[u32],
        layers: Range<usize>,
        progress: &dyn Progress,
    ) -> Result<Timed>;
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchRunOptions {
    /// The model; `None` writes [`BenchRunOptions::synth`] to a temporary directory.
    pub model: Option<PathBuf>,
    /// The synthetic model written when `model` is `None`.
    pub synth: SynthOptions,
    /// Where the temporary directory is created.
    pub temp_parent: PathBuf,
    /// Token counts.
    pub tokens: Vec<usize>,
    /// Layers timed (default: from 0 through the first MoE layer).
    pub layers: Option<Range<usize>>,
    /// The depth projected to (default: the model's own, [`Depth::of`]).
    pub project: Option<Depth>,
    /// Seed of the token ids.
    pub seed: u64,
    /// Run the reference untimed before the timed passes (it runs anyway when `baseline` needs
    /// the routing).
    pub warmup: bool,
    /// Timed passes per token count (and runs of each floor).
    pub reps: usize,
    /// Measure the floors.
    pub baseline: bool,
    /// Interval of the RSS sampling thread.
    pub sample_interval: Duration,
}

impl BenchRunOptions {
    /// `model` (or `bench layer`'s synthetic GLM-5-dimension model in the system's temporary
    /// directory) at `tokens`, with warm-up, floors, [`DEFAULT_REPS`] and the default seed.
    pub fn new(model: Option<PathBuf>, tokens: Vec<usize>) -> Result<BenchRunOptions> {
        Ok(BenchRunOptions {
            model,
            synth: run_synth()?,
            temp_parent: std::env::temp_dir(),
            tokens,
            layers: None,
            project: None,
            seed: DEFAULT_SEED,
            warmup: true,
            reps: DEFAULT_REPS,
            baseline: true,
            sample_interval: layer::DEFAULT_SAMPLE_INTERVAL,
        })
    }
}

/// Host-to-device copies of one layer's raw GGUF bytes (the floor of its uploads).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CopyFloor {
    /// The layer.
    pub layer: usize,
    /// Bytes of the tensors its steps read.
    pub bytes: u64,
    /// Seconds from pinned host memory.
    pub pinned_s: f64,
    /// Seconds from the model's map (pageable).
    pub pageable_s: f64,
    /// `bytes / pinned_s`, GB/s.
    pub pinned_gbps: f64,
    /// `bytes / pageable_s`, GB/s.
    pub pageable_gbps: f64,
}

/// The copy floors of a run with a CUDA candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Copies {
    /// The device, in words.
    pub device: String,
    /// Bytes per copy call.
    pub chunk_bytes: u64,
    /// One per layer timed.
    pub layers: Vec<CopyFloor>,
}

/// Quotients of a layer's times (`None` where the divisor is missing or 0).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Ratios {
    /// `reference_s / floor_s`.
    pub reference_over_floor: Option<f64>,
    /// `upload_s / copy_pinned_s`.
    pub upload_over_copy: Option<f64>,
    /// `candidate_s / reference_s`.
    pub candidate_over_reference: Option<f64>,
}

/// One layer at one token count (the best of the timed passes).
#[derive(Clone, Debug, Serialize)]
pub struct LayerRow {
    /// The layer.
    pub layer: usize,
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Wall time of the pass over the layer, seconds (everything the pass did there).
    pub wall_s: f64,
    /// The reference's compute, seconds.
    pub reference_s: f64,
    /// The candidate's chain, seconds.
    pub chained_s: f64,
    /// The candidate's replayed steps, seconds.
    pub replay_s: f64,
    /// `chained_s + replay_s`.
    pub candidate_s: f64,
    /// The part of `candidate_s` spent waiting for weight uploads, seconds.
    pub upload_s: f64,
    /// Weight bytes the candidate took into use.
    pub upload_bytes: u64,
    /// The comparison of the layer's pairs, its own seconds (`run`'s `compare_s`).
    pub compare_s: f64,
    /// The part of the layer's wall the driver waited for the comparison (`run`'s
    /// `compare_wait_s`).
    pub compare_wait_s: f64,
    /// The part of the layer's wall the driver waited for the candidate's side of a step after
    /// the reference's side was done (`run`'s `candidate_beyond_s`).
    pub candidate_beyond_s: f64,
    /// Routed experts the reference's tokens touched (0 for a dense layer).
    pub experts: usize,
    /// The CPU reference's floor (dequant + matmul), when measured.
    pub floor: Option<Floor>,
    /// `floor.dequant_s + floor.matmul_s`.
    pub floor_s: Option<f64>,
    /// The layer's raw bytes copied from pinned memory, seconds (CUDA candidate).
    pub copy_pinned_s: Option<f64>,
    /// The same from pageable memory, seconds.
    pub copy_pageable_s: Option<f64>,
    /// Quotients of the above.
    pub ratios: Ratios,
}

/// Means over the layers of one kind at one token count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KindRow {
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Layers of this kind in the means.
    pub layers: usize,
    /// Whether the kind's first layer timed was left out of the means ([`by_kind`]).
    pub after_first: bool,
    /// That first layer, when it was left out: it counts once, as itself, in a projection
    /// ([`project`]).
    pub first: Option<FirstLayer>,
    /// Mean wall time per layer, seconds.
    pub wall_s: f64,
    /// Mean reference time per layer, seconds.
    pub reference_s: f64,
    /// Mean candidate time per layer, seconds.
    pub candidate_s: f64,
}

/// Which side of the pass takes longer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The CPU reference.
    Reference,
    /// The candidate engine.
    Candidate,
}

/// A kind's first layer timed, left out of its means ([`by_kind`]): the one layer of a whole
/// run it is like (the run's first layer, or the first MoE layer, before any near-tie flip).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FirstLayer {
    /// The layer.
    pub layer: usize,
    /// Its wall time, seconds.
    pub wall_s: f64,
    /// Its reference time, seconds.
    pub reference_s: f64,
    /// Its candidate time, seconds.
    pub candidate_s: f64,
}

/// One kind's share of a projection.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Term {
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Layers of this kind at the depth.
    pub count: usize,
    /// The kind's first layer timed, counted once as itself when its means leave it out
    /// (`None` otherwise).
    pub first: Option<FirstLayer>,
    /// Layers at the mean: `count`, less one with `first`.
    pub at_mean: usize,
    /// Measured wall time per layer (the mean), seconds.
    pub wall_s: f64,
    /// `first`'s wall time + `at_mean * wall_s`.
    pub total_s: f64,
    /// The same of the reference's time.
    pub reference_s: f64,
    /// The same of the candidate's time.
    pub candidate_s: f64,
}

/// A whole run projected to a depth.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Projection {
    /// The depth.
    pub depth: Depth,
    /// One per kind the depth has.
    pub terms: Vec<Term>,
    /// The sum of the terms' `total_s`: the projected whole-run time, seconds.
    pub total_s: f64,
    /// The sum of the terms' `reference_s`.
    pub reference_s: f64,
    /// The sum of the terms' `candidate_s`.
    pub candidate_s: f64,
    /// The side with the larger projected time.
    pub bound: Side,
    /// Its time over the other side's (`None` when the other side's is 0).
    pub bound_ratio: Option<f64>,
}

/// Memory over the timed passes of one token count.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Memory {
    /// Resident memory before the first timed pass.
    pub rss_before: layer::Rss,
    /// `VmHWM` after the passes: the highest `VmRSS` of a pass when reset before each
    /// (`hwm_reset`), else since the process started.
    pub vm_hwm: u64,
    /// Whether `VmHWM` was reset before every pass.
    pub hwm_reset: bool,
    /// Peak `RssAnon` (sampled), bytes.
    pub peak_anon: u64,
    /// Peak `RssFile` (sampled), bytes.
    pub peak_file: u64,
}

impl Memory {
    /// Takes in one more pass: the higher peaks, and whether every pass reset `VmHWM`.
    fn add(&mut self, pass: &Memory) {
        self.hwm_reset &= pass.hwm_reset;
        self.vm_hwm = self.vm_hwm.max(pass.vm_hwm);
        self.peak_anon = self.peak_anon.max(pass.peak_anon);
        self.peak_file = self.peak_file.max(pass.peak_file);
    }
}

/// One token count.
#[derive(Clone, Debug, Serialize)]
pub struct TokenRun {
    /// Prompt length.
    pub tokens: usize,
    /// Wall time of the whole pipeline (opening, prefix, pass, comparison) of the fastest pass,
    /// seconds.
    pub pipeline_s: f64,
    /// Per layer timed.
    pub layers: Vec<LayerRow>,
    /// Per layer kind.
    pub kinds: Vec<KindRow>,
    /// The whole run projected (`None` when a kind the depth has was not timed).
    pub projection: Option<Projection>,
    /// Memory.
    pub memory: Memory,
    /// Whether any pass's comparison found a difference.
    pub differs: bool,
}

/// The whole benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// CPU model.
    pub cpu: String,
    /// rayon threads.
    pub threads: usize,
    /// Load averages before the benchmark (`/proc/loadavg`).
    pub load_before: String,
    /// Load averages after it.
    pub load_after: String,
    /// The model file (or first shard).
    pub model: String,
    /// Model bytes (all shards).
    pub model_bytes: u64,
    /// Architecture.
    pub arch: String,
    /// The synthetic model, when one was written.
    pub synth: Option<SynthInfo>,
    /// First layer timed.
    pub layer_start: usize,
    /// Layer after the last timed.
    pub layer_end: usize,
    /// Layers the model runs.
    pub n_layer: usize,
    /// Its leading dense layers.
    pub n_dense: usize,
    /// How the pipeline runs.
    pub settings: Settings,
    /// The candidate engine, in its own words.
    pub candidate: String,
    /// Seed of the token ids.
    pub seed: u64,
    /// Whether an untimed reference run came before each token count's passes.
    pub warmup: bool,
    /// Timed passes per token count.
    pub reps: usize,
    /// Sampling interval of the RSS thread, milliseconds.
    pub sample_ms: f64,
    /// The copy floors (CUDA candidate, floors on).
    pub copies: Option<Copies>,
    /// The depth projected to.
    pub depth: Depth,
    /// One per token count.
    pub runs: Vec<TokenRun>,
    /// Notes of the pipeline (each once) and of the benchmark.
    pub notes: Vec<String>,
}

/// Runs the benchmark (see the module documentation): `say` hears what it is doing, `layers`
/// the progress of each run's layers, `written` the bytes of the synthetic model written.
pub fn run(
    opts: &BenchRunOptions,
    pipeline: &mut dyn Pipeline,
    say: &mut dyn FnMut(&str),
    layers: &dyn Progress,
    written: &dyn Progress,
) -> Result<Report> {
    if opts.tokens.is_empty() || opts.tokens.contains(&0) {
        bail!(
            "bench: --tokens {:?}: give one or more token counts, each at least 1",
            opts.tokens
        );
    }
    if opts.reps == 0 {
        bail!("bench: --reps 0: at least one timed pass is needed");
    }
    let load_before = procfs::load_average();
    let Some(path) = &opts.model else {
        // The layers asked are checked against the synthetic model before it is written.
        let dims = &opts.synth.dims;
        if let Some(r) = &opts.layers {
            check_layers(
                r,
                dims.n_layer as usize,
                dims.n_layer as usize,
                "the synthetic model",
            )?;
        }
        let scratch = ScratchModel::write(
            &opts.synth,
            &opts.temp_parent,
            TEMP_PREFIX,
            SYNTH_FILE,
            say,
            written,
        )?;
        let result = measure(scratch.path(), opts, pipeline, say, layers);
        let synth = scratch.finish();
        let mut report = result?;
        report.synth = Some(synth);
        report.load_before = load_before;
        return Ok(report);
    };
    let mut report = measure(path, opts, pipeline, say, layers)?;
    report.load_before = load_before;
    Ok(report)
}

/// Refuses layers outside `0..n_layer` (`n_block` blocks in the file) of `what`.
fn check_layers(r: &Range<usize>, n_layer: usize, n_block: usize, what: &str) -> Result<()> {
    if r.start >= r.end || r.end > n_layer {
        bail!(
            "bench: --layers {}..{} is outside {what}: it runs layers 0..{n_layer} ({n_block} blocks, {} MTP not run)",
            r.start,
            r.end,
            n_block - n_layer
        );
    }
    Ok(())
}

/// MoE layers of the synthetic model: the second runs after the first one's router, where a
/// low-precision candidate takes its first near-tie expert flips, so the chain that follows
/// them runs there as in every later layer of a real run.
pub const SYNTH_MOE_LAYERS: u64 = 2;

/// Dense layers of the synthetic model: the second is like every dense layer of a real run
/// after its first (no embedding; the candidate's weights prefetched during the layer before).
pub const SYNTH_DENSE_LAYERS: u64 = 2;

/// `bench layer`'s synthetic model ([`glm5_synth`]) with [`SYNTH_DENSE_LAYERS`] dense and
/// [`SYNTH_MOE_LAYERS`] MoE layers.
fn run_synth() -> Result<SynthOptions> {
    let mut synth = glm5_synth()?;
    let n_dense = SYNTH_DENSE_LAYERS;
    let mut dims = Dims::preset(synth.arch, "glm5")?.with_layers(n_dense + SYNTH_MOE_LAYERS)?;
    dims.n_dense = n_dense;
    dims.nextn = synth.dims.nextn;
    synth.dims = dims;
    Ok(synth)
}

/// The layers timed: those asked, or from 0 through the second MoE layer (the first when the
/// model has one, all layers of a model without).
fn layer_range(asked: Option<&Range<usize>>, hp: &HParams, path: &Path) -> Result<Range<usize>> {
    match asked {
        Some(r) => {
            check_layers(r, hp.n_layer, hp.n_block, &path.display().to_string())?;
            Ok(r.clone())
        }
        None if hp.n_layer == 0 => bail!("bench: {} runs no layer", path.display()),
        None => Ok(0..(hp.n_dense + SYNTH_MOE_LAYERS as usize).min(hp.n_layer)),
    }
}

/// The model's facts the report keeps, read from a map closed again before any pass.
struct ModelFacts {
    bytes: u64,
    arch: String,
    n_layer: usize,
    n_dense: usize,
    n_vocab: usize,
    layers: Range<usize>,
    depth: Depth,
    kinds: Vec<LayerKind>,
}

fn model_facts(path: &Path, opts: &BenchRunOptions) -> Result<ModelFacts> {
    let model = Model::open(path)?;
    let weights = Weights::new(&model)?;
    let hp = weights.hparams();
    let layers = layer_range(opts.layers.as_ref(), hp, path)?;
    Ok(ModelFacts {
        bytes: model.shards().iter().map(|s| s.file_len()).sum(),
        arch: hp.arch.as_str().to_string(),
        n_layer: hp.n_layer,
        n_dense: hp.n_dense,
        n_vocab: weights.n_vocab(),
        kinds: layers.clone().map(|l| kind_of(hp, l)).collect(),
        layers,
        depth: opts.project.clone().unwrap_or_else(|| Depth::of(hp)),
    })
}

fn kind_of(hp: &HParams, l: usize) -> LayerKind {
    if hp.is_dense(l) {
        LayerKind::Dense
    } else {
        LayerKind::Moe
    }
}

/// What the token counts share: the model, the options, the pipeline's settings and the copy
/// floors.
struct Ctx<'a> {
    path: &'a Path,
    opts: &'a BenchRunOptions,
    facts: &'a ModelFacts,
    settings: &'a Settings,
    copies: Option<&'a Copies>,
}

/// What the passes say besides their times: the candidate's words and the notes, each once.
#[derive(Default)]
struct Said {
    candidate: String,
    notes: Vec<String>,
}

impl Said {
    fn note(&mut self, n: String) {
        if !self.notes.contains(&n) {
            self.notes.push(n);
        }
    }
}

/// Measures everything on `path` (see the module documentation); `synth` and `load_before` are
/// left for the caller.
fn measure(
    path: &Path,
    opts: &BenchRunOptions,
    pipeline: &mut dyn Pipeline,
    say: &mut dyn FnMut(&str),
    progress: &dyn Progress,
) -> Result<Report> {
    let facts = model_facts(path, opts)?;
    let settings = pipeline.settings();
    let copies = match settings.candidate {
        CandidateKind::Cuda(device) if opts.baseline => {
            say(&format!(
                "bench: host-to-device copies of each layer's weights on cuda:{device}"
            ));
            Some(copy_floors(path, device, &facts.layers, opts.reps)?)
        }
        _ => None,
    };
    let ctx = Ctx {
        path,
        opts,
        facts: &facts,
        settings: &settings,
        copies: copies.as_ref(),
    };
    let mut said = Said::default();
    settings.choice.iter().for_each(|c| said.note(c.clone()));
    let runs = opts
        .tokens
        .iter()
        .map(|&t| time_tokens(&ctx, t, pipeline, say, progress, &mut said))
        .collect::<Result<Vec<_>>>()?;
    Ok(Report {
        cpu: cpu_model(),
        threads: rayon::current_num_threads(),
        load_before: String::new(),
        load_after: procfs::load_average(),
        model: path.display().to_string(),
        model_bytes: facts.bytes,
        arch: facts.arch.clone(),
        synth: None,
        layer_start: facts.layers.start,
        layer_end: facts.layers.end,
        n_layer: facts.n_layer,
        n_dense: facts.n_dense,
        settings: settings.clone(),
        candidate: said.candidate,
        seed: opts.seed,
        warmup: opts.warmup || opts.baseline,
        reps: opts.reps,
        sample_ms: opts.sample_interval.as_secs_f64() * 1e3,
        copies,
        depth: facts.depth.clone(),
        runs,
        notes: said.notes,
    })
}

/// One token count: the untimed reference run, the timed passes, the floors, the ratios and
/// the projection.
fn time_tokens(
    ctx: &Ctx<'_>,
    t: usize,
    pipeline: &mut dyn Pipeline,
    say: &mut dyn FnMut(&str),
    progress: &dyn Progress,
    said: &mut Said,
) -> Result<TokenRun> {
    let (opts, facts) = (ctx.opts, ctx.facts);
    let ids = token_ids(opts.seed, t, facts.n_vocab);
    let routing = if opts.warmup || opts.baseline {
        say(&format!(
            "bench: {t} tokens: untimed reference run of layers 0..{} (warm-up, routing)",
            facts.layers.end
        ));
        reference_routing(ctx.path, &ids, &facts.layers, progress)?
    } else {
        BTreeMap::new()
    };
    let mut run = TokenRun {
        tokens: t,
        pipeline_s: f64::INFINITY,
        layers: Vec::new(),
        kinds: Vec::new(),
        projection: None,
        memory: Memory {
            rss_before: procfs::rss().unwrap_or_default(),
            hwm_reset: true,
            ..Memory::default()
        },
        differs: false,
    };
    for rep in 1..=opts.reps {
        say(&format!(
            "bench: {t} tokens: timed run {rep} of {} ({}, layers {}..{}, mode {})",
            opts.reps, ctx.settings.spec, facts.layers.start, facts.layers.end, ctx.settings.mode
        ));
        let (timed, walls, mem, seconds) = timed_pass(
            pipeline,
            ctx.path,
            &ids,
            &facts.layers,
            progress,
            opts.sample_interval,
        )?;
        run.memory.add(&mem);
        run.pipeline_s = run.pipeline_s.min(seconds);
        run.differs |= timed.differs;
        timed.notes.into_iter().for_each(|n| said.note(n));
        said.candidate = timed.candidate;
        let rows = layer_rows(facts, &timed.layer_times, &walls, &routing)?;
        run.layers = if run.layers.is_empty() {
            rows
        } else {
            std::mem::take(&mut run.layers)
                .into_iter()
                .zip(rows)
                .map(|(a, b)| if b.wall_s < a.wall_s { b } else { a })
                .collect()
        };
    }
    if opts.baseline {
        say(&format!("bench: {t} tokens: the reference's floors"));
        cpu_floors(ctx.path, &mut run.layers, t, &routing, opts.reps)?;
    }
    if let Some(c) = ctx.copies {
        for (row, f) in run.layers.iter_mut().zip(&c.layers) {
            row.copy_pinned_s = Some(f.pinned_s);
            row.copy_pageable_s = Some(f.pageable_s);
        }
    }
    for row in &mut run.layers {
        row.ratios = ratios(row);
    }
    run.kinds = by_kind(&run.layers);
    run.projection = project(&facts.depth, &run.kinds);
    if run.projection.is_none() {
        said.note(format!(
            "no projection to {} ({} dense + {} MoE layers): give --layers with a layer of each kind",
            facts.depth.name, facts.depth.dense, facts.depth.moe
        ));
    }
    Ok(run)
}

/// One timed pass: the pipeline's times, the wall time of each layer (from the marks of the
/// pass's layer progress), the memory, and the whole pipeline's seconds.
fn timed_pass(
    pipeline: &mut dyn Pipeline,
    path: &Path,
    ids: &[u32],
    layers: &Range<usize>,
    progress: &dyn Progress,
    interval: Duration,
) -> Result<(Timed, Vec<f64>, Memory, f64)> {
    let hwm_reset = procfs::reset_peak();
    let sampler = procfs::Sampler::default();
    let marks = Marks::new(progress);
    let (timed, seconds) = std::thread::scope(|s| {
        s.spawn(|| sampler.watch(interval));
        let t0 = Instant::now();
        let r = pipeline.run(path, ids, layers.clone(), &marks);
        let seconds = t0.elapsed().as_secs_f64();
        sampler.stop();
        (r, seconds)
    });
    let timed = timed?;
    let after = procfs::rss().unwrap_or_default();
    let (peak_anon, peak_file) = sampler.peaks();
    let walls = marks.layer_walls(layers.len())?;
    Ok((
        timed,
        walls,
        Memory {
            rss_before: layer::Rss::default(),
            vm_hwm: after.vm_hwm,
            hwm_reset,
            peak_anon,
            peak_file,
        },
        seconds,
    ))
}

/// The rows of the layers timed from one pass: `walls` per layer, the sides' times from
/// `times`, the experts touched from `routing`.
fn layer_rows(
    facts: &ModelFacts,
    times: &[LayerTime],
    walls: &[f64],
    routing: &BTreeMap<usize, BTreeMap<usize, usize>>,
) -> Result<Vec<LayerRow>> {
    facts
        .layers
        .clone()
        .zip(&facts.kinds)
        .zip(walls)
        .map(|((l, &kind), &wall_s)| {
            let t = times
                .iter()
                .find(|t| t.layer == Some(l))
                .with_context(|| format!("bench: the pass recorded no time for layer {l}"))?;
            Ok(LayerRow {
                layer: l,
                kind,
                wall_s,
                reference_s: t.reference,
                chained_s: t.chained,
                replay_s: t.replay,
                candidate_s: t.chained + t.replay,
                upload_s: t.upload,
                upload_bytes: t.upload_bytes,
                compare_s: t.compare,
                compare_wait_s: t.compare_wait,
                candidate_beyond_s: t.candidate_beyond,
                experts: routing.get(&l).map_or(0, BTreeMap::len),
                floor: None,
                floor_s: None,
                copy_pinned_s: None,
                copy_pageable_s: None,
                ratios: Ratios::default(),
            })
        })
        .collect()
}

/// `a / b`, `None` when `b` is missing or not positive.
fn quotient(a: f64, b: Option<f64>) -> Option<f64> {
    b.filter(|&b| b > 0.0).map(|b| a / b)
}

/// The quotients of a row.
pub fn ratios(row: &LayerRow) -> Ratios {
    Ratios {
        reference_over_floor: quotient(row.reference_s, row.floor_s),
        upload_over_copy: quotient(row.upload_s, row.copy_pinned_s),
        candidate_over_reference: quotient(row.candidate_s, Some(row.reference_s)),
    }
}

/// Means per layer kind, in kind order (dense first), over the layers of the kind after its
/// first when more than one is timed: a kind's first layer is not like the rest of a run's.
/// Layer 0 holds the embedding, and the first MoE layer runs before any near-tie expert flip
/// of a low-precision candidate: from its router on, the reference also runs the chain that
/// follows those flips, in every later MoE layer.
pub fn by_kind(rows: &[LayerRow]) -> Vec<KindRow> {
    [LayerKind::Dense, LayerKind::Moe]
        .into_iter()
        .filter_map(|kind| {
            let of_kind: Vec<&LayerRow> = rows.iter().filter(|r| r.kind == kind).collect();
            let after_first = of_kind.len() > 1;
            let rs = if after_first {
                &of_kind[1..]
            } else {
                &of_kind[..]
            };
            let n = rs.len();
            let mean = |f: fn(&LayerRow) -> f64| rs.iter().map(|r| f(r)).sum::<f64>() / n as f64;
            let first = of_kind.first().filter(|_| after_first).map(|r| FirstLayer {
                layer: r.layer,
                wall_s: r.wall_s,
                reference_s: r.reference_s,
                candidate_s: r.candidate_s,
            });
            (n > 0).then(|| KindRow {
                kind,
                layers: n,
                after_first,
                first,
                wall_s: mean(|r| r.wall_s),
                reference_s: mean(|r| r.reference_s),
                candidate_s: mean(|r| r.candidate_s),
            })
        })
        .collect()
}

/// The whole run at `depth` from the per-kind means `kinds`: for each kind the depth has,
/// `count * wall_s` (and the same of each side's time), except that a kind's first layer timed,
/// when its means leave it out, counts once as itself and the other `count - 1` at the mean: it
/// is like one layer of a whole run (the run's first, with the embedding and the candidate's
/// first uploads, which no prefetch hides; or the first MoE layer, before any near-tie expert
/// flip is followed), not like the rest. The side with the larger sum bounds it. `None` when a
/// kind the depth has is not in `kinds`.
pub fn project(depth: &Depth, kinds: &[KindRow]) -> Option<Projection> {
    let mut terms = Vec::new();
    for kind in [LayerKind::Dense, LayerKind::Moe] {
        let count = depth.count(kind);
        if count == 0 {
            continue;
        }
        let k = kinds.iter().find(|k| k.kind == kind)?;
        let first = k.first.clone();
        let at_mean = count - usize::from(first.is_some());
        let n = at_mean as f64;
        let (w0, r0, c0) = first.as_ref().map_or((0.0, 0.0, 0.0), |f| {
            (f.wall_s, f.reference_s, f.candidate_s)
        });
        terms.push(Term {
            kind,
            count,
            first,
            at_mean,
            wall_s: k.wall_s,
            total_s: w0 + n * k.wall_s,
            reference_s: r0 + n * k.reference_s,
            candidate_s: c0 + n * k.candidate_s,
        });
    }
    let total_s = terms.iter().map(|t| t.total_s).sum();
    let reference_s: f64 = terms.iter().map(|t| t.reference_s).sum();
    let candidate_s: f64 = terms.iter().map(|t| t.candidate_s).sum();
    let (bound, hi, lo) = if reference_s >= candidate_s {
        (Side::Reference, reference_s, candidate_s)
    } else {
        (Side::Candidate, candidate_s, reference_s)
    };
    Some(Projection {
        depth: depth.clone(),
        terms,
        total_s,
        reference_s,
        candidate_s,
        bound,
        bound_ratio: (lo > 0.0).then(|| hi / lo),
    })
}

/// A [`Progress`] that passes everything on to `inner` and keeps the time of each phase's
/// start and of each unit done: the pass's layer progress marks every layer's end (and, when
/// the pass ends at the model's last layer, the output layer's end after them).
pub struct Marks<'p> {
    inner: &'p dyn Progress,
    /// Per phase: its units, its start, the end of each unit done.
    phases: RefCell<Vec<(u64, Instant, Vec<Instant>)>>,
}

impl<'p> Marks<'p> {
    /// Marks in front of `inner`.
    pub fn new(inner: &'p dyn Progress) -> Marks<'p> {
        Marks {
            inner,
            phases: RefCell::new(Vec::new()),
        }
    }

    /// The seconds of each of the first `n` units of the last phase (the pass: the prefix,
    /// when there is one, is an earlier phase), from its start. The phase must have `n` units,
    /// or `n + 1` (the output layer after the layers), and have done the first `n`.
    pub fn layer_walls(&self, n: usize) -> Result<Vec<f64>> {
        let phases = self.phases.borrow();
        let Some((total, start, ends)) = phases.last() else {
            bail!("bench: the pass reported no layer progress");
        };
        let total = *total as usize;
        if (total != n && total != n + 1) || ends.len() < n {
            bail!(
                "bench: the pass reported {} layer ends of {total} for {n} layers",
                ends.len()
            );
        }
        let mut prev = *start;
        Ok(ends[..n]
            .iter()
            .map(|&e| {
                let s = (e - prev).as_secs_f64();
                prev = e;
                s
            })
            .collect())
    }
}

impl Progress for Marks<'_> {
    fn start(&self, what: &str, total: u64) {
        self.phases
            .borrow_mut()
            .push((total, Instant::now(), Vec::with_capacity(total as usize)));
        self.inner.start(what, total);
    }

    fn phase(&self, what: &str) {
        self.inner.phase(what);
    }

    fn inc(&self, n: u64) {
        let now = Instant::now();
        if let Some((_, _, ends)) = self.phases.borrow_mut().last_mut() {
            ends.extend(std::iter::repeat_n(now, n as usize));
        }
        self.inner.inc(n);
    }

    fn finish(&self) {
        self.inner.finish();
    }
}

/// The sink of the untimed reference run: the routing of the MoE layers in `layers`.
struct Routing {
    layers: Range<usize>,
    experts: BTreeMap<usize, BTreeMap<usize, usize>>,
}

impl Sink for Routing {
    fn wants(&self, name: &str) -> bool {
        names::split_blk(name)
            .is_some_and(|(l, p)| p == point::MOE_TOPK_IDS && self.layers.contains(&l))
    }

    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()> {
        if let Some((l, _)) = names::split_blk(name) {
            self.experts.insert(l, count_ids(tensor.as_i32(name)?));
        }
        Ok(())
    }
}

/// Runs the CPU reference on `ids` through the end of `layers` (untimed: the warm-up) and
/// returns, per MoE layer in `layers`, the tokens routed to each expert.
fn reference_routing(
    path: &Path,
    ids: &[u32],
    layers: &Range<usize>,
    progress: &dyn Progress,
) -> Result<BTreeMap<usize, BTreeMap<usize, usize>>> {
    let model = Model::open(path)?;
    let weights = Weights::new(&model)?;
    let plan = Plan::new(&weights, layers.end, false)?;
    let mut sink = Routing {
        layers: layers.clone(),
        experts: BTreeMap::new(),
    };
    // The reference's large products where `--reference-on` puts them (the same bits).
    let (engine, _) = crate::engine::cpu::device::reference_engine(&weights, ids.len(), None)?;
    driver::run_from(&engine, &weights, ids, &plan, &[], &mut sink, progress)?;
    Ok(sink.experts)
}

/// Fills the CPU floor of every row: the lowest of `reps` measurements on a map of its own.
fn cpu_floors(
    path: &Path,
    rows: &mut [LayerRow],
    t: usize,
    routing: &BTreeMap<usize, BTreeMap<usize, usize>>,
    reps: usize,
) -> Result<()> {
    let model = Model::open(path)?;
    let weights = Weights::new(&model)?;
    let none = BTreeMap::new();
    for row in rows.iter_mut() {
        let routed = routing.get(&row.layer).unwrap_or(&none);
        if row.kind == LayerKind::Moe && routed.is_empty() {
            continue;
        }
        let mut best: Option<Floor> = None;
        for _ in 0..reps {
            let f = layer_floor(&weights, row.layer, t, routed)?;
            if best.is_none_or(|b| f.dequant_s + f.matmul_s < b.dequant_s + b.matmul_s) {
                best = Some(f);
            }
        }
        row.floor = best;
        row.floor_s = best.map(|f| f.dequant_s + f.matmul_s);
    }
    Ok(())
}

/// The raw GGUF bytes of the tensors layer `l`'s steps read, as slices of the model's map.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn layer_bytes<'m>(weights: &Weights<'m>, l: usize) -> Result<Vec<&'m [u8]>> {
    let hp = weights.hparams();
    steps::weights_of(&steps::layer_steps(hp, l), weights)
        .iter()
        .map(|n| weights.tensor_desc(n)?.data())
        .collect()
}

/// The copy floors of `layers` on CUDA device `device`.
#[cfg(feature = "cuda")]
fn copy_floors(path: &Path, device: usize, layers: &Range<usize>, reps: usize) -> Result<Copies> {
    let gpu = crate::gpu::Gpu::open(device).context("bench: the copy floors")?;
    let model = Model::open(path)?;
    let weights = Weights::new(&model)?;
    let mut out = Vec::new();
    for l in layers.clone() {
        let parts = layer_bytes(&weights, l)?;
        let (pinned_s, pageable_s) = super::copy::layer_copy(&gpu, &parts, reps)?;
        let bytes: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let gbps = |s: f64| quotient(bytes as f64, Some(s)).map_or(0.0, |r| r / 1e9);
        out.push(CopyFloor {
            layer: l,
            bytes,
            pinned_s,
            pageable_s,
            pinned_gbps: gbps(pinned_s),
            pageable_gbps: gbps(pageable_s),
        });
    }
    Ok(Copies {
        device: gpu.describe(),
        chunk_bytes: super::copy::CHUNK_BYTES as u64,
        layers: out,
    })
}

/// Without the `cuda` feature there is no CUDA candidate to measure copies for.
#[cfg(not(feature = "cuda"))]
fn copy_floors(_: &Path, device: usize, _: &Range<usize>, _: usize) -> Result<Copies> {
    bail!("bench: cuda:{device}: this glmdiff was built without the `cuda` feature")
}

/// [`run`] without progress.
pub fn run_quiet(opts: &BenchRunOptions, pipeline: &mut dyn Pipeline) -> Result<Report> {
    run(opts, pipeline, &mut |_| {}, &NoProgress, &NoProgress)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(kind: LayerKind, wall_s: f64, reference_s: f64, candidate_s: f64) -> KindRow {
        KindRow {
            kind,
            layers: 1,
            after_first: false,
            first: None,
            wall_s,
            reference_s,
            candidate_s,
        }
    }

    /// GLM-5's depth: 3 dense + 75 MoE layers. Dense 0.5 s a layer (reference 0.375, candidate
    /// 0.125), MoE 1.25 s (reference 1.0, candidate 0.25). Whole run: 3 * 0.5 + 75 * 1.25 =
    /// 1.5 + 93.75 = 95.25 s. Reference: 3 * 0.375 + 75 * 1.0 = 1.125 + 75 = 76.125 s.
    /// Candidate: 3 * 0.125 + 75 * 0.25 = 0.375 + 18.75 = 19.125 s. The reference bounds it,
    /// 76.125 / 19.125 = 3.98039... (binary fractions, so every sum is exact).
    #[test]
    fn projection_of_glm5_by_hand() {
        let depth = Depth::named("glm5").unwrap();
        assert_eq!((depth.dense, depth.moe), (3, 75));
        let kinds = [
            kind(LayerKind::Dense, 0.5, 0.375, 0.125),
            kind(LayerKind::Moe, 1.25, 1.0, 0.25),
        ];
        let p = project(&depth, &kinds).unwrap();
        assert_eq!(p.terms.len(), 2);
        assert_eq!(p.terms[0].total_s, 1.5);
        assert_eq!(p.terms[1].total_s, 93.75);
        assert_eq!(p.total_s, 95.25);
        assert_eq!(p.reference_s, 76.125);
        assert_eq!(p.candidate_s, 19.125);
        assert_eq!(p.bound, Side::Reference);
        assert!((p.bound_ratio.unwrap() - 3.980_392_156_862_745).abs() < 1e-12);
    }

    /// A candidate slower than the reference bounds the run: 2 dense layers at 1 s (reference
    /// 0.25, candidate 0.75) and 4 MoE at 2 s (0.5, 1.5): 2 + 8 = 10 s; reference 0.5 + 2 =
    /// 2.5 s; candidate 1.5 + 6 = 7.5 s; ratio 3.
    #[test]
    fn projection_bound_by_the_candidate() {
        let depth = Depth {
            name: "model".into(),
            dense: 2,
            moe: 4,
        };
        let p = project(
            &depth,
            &[
                kind(LayerKind::Dense, 1.0, 0.25, 0.75),
                kind(LayerKind::Moe, 2.0, 0.5, 1.5),
            ],
        )
        .unwrap();
        assert_eq!((p.total_s, p.reference_s, p.candidate_s), (10.0, 2.5, 7.5));
        assert_eq!((p.bound, p.bound_ratio), (Side::Candidate, Some(3.0)));
    }

    /// A kind the depth lacks needs no measurement; a kind it has does; a side at 0 gives no
    /// ratio.
    #[test]
    fn projection_needs_every_kind_the_depth_has() {
        let dense_only = Depth {
            name: "model".into(),
            dense: 5,
            moe: 0,
        };
        let p = project(&dense_only, &[kind(LayerKind::Dense, 0.5, 0.5, 0.0)]).unwrap();
        assert_eq!((p.total_s, p.reference_s, p.candidate_s), (2.5, 2.5, 0.0));
        assert_eq!((p.bound, p.bound_ratio), (Side::Reference, None));
        let glm5 = Depth::named("glm5").unwrap();
        assert!(project(&glm5, &[kind(LayerKind::Dense, 0.5, 0.25, 0.25)]).is_none());
        assert!(project(&glm5, &[]).is_none());
    }

    #[test]
    fn named_depths_and_their_errors() {
        let d = Depth::named("deepseek-v3").unwrap();
        assert_eq!((d.dense, d.moe), (3, 58));
        let e = Depth::named("glm6").unwrap_err().to_string();
        assert!(
            e.contains("--project \"glm6\"") && e.contains("glm5 (3 dense + 75 MoE layers)"),
            "{e}"
        );
    }

    fn row(layer: usize, kind: LayerKind, wall_s: f64) -> LayerRow {
        LayerRow {
            layer,
            kind,
            wall_s,
            reference_s: wall_s / 2.0,
            chained_s: wall_s / 4.0,
            replay_s: 0.0,
            candidate_s: wall_s / 4.0,
            upload_s: 0.0,
            upload_bytes: 0,
            compare_s: 0.0,
            compare_wait_s: 0.0,
            candidate_beyond_s: 0.0,
            experts: 8,
            floor: None,
            floor_s: None,
            copy_pinned_s: None,
            copy_pageable_s: None,
            ratios: Ratios::default(),
        }
    }

    /// The synthetic model has GLM-5's dimensions, two dense and two MoE layers, no MTP block.
    #[test]
    fn the_synthetic_model_has_a_second_layer_of_each_kind() {
        let s = run_synth().unwrap();
        let layer = glm5_synth().unwrap();
        assert_eq!((s.dims.n_layer, s.dims.n_dense, s.dims.nextn), (4, 2, 0));
        assert_eq!((s.dims.hidden, s.dims.n_expert), (6144, 256));
        assert_eq!((s.mix, s.seed), (layer.mix, layer.seed));
    }

    /// A kind's means leave its first layer out when more of it are timed (layer 0's
    /// embedding, the MoE layer before any followed expert flip), and keep a lone one.
    #[test]
    fn kind_means_leave_out_the_first_layer_of_a_kind() {
        let rows = [
            row(0, LayerKind::Dense, 4.0),
            row(1, LayerKind::Moe, 1.0),
            row(2, LayerKind::Moe, 2.0),
            row(3, LayerKind::Moe, 3.0),
        ];
        let k = by_kind(&rows);
        assert_eq!(k.len(), 2);
        assert_eq!(
            (k[0].layers, k[0].after_first, k[0].wall_s),
            (1, false, 4.0)
        );
        assert_eq!((k[1].layers, k[1].after_first, k[1].wall_s), (2, true, 2.5));
        assert_eq!((k[1].reference_s, k[1].candidate_s), (1.25, 0.625));
        assert_eq!(k[0].first, None);
        let f = k[1].first.as_ref().unwrap();
        assert_eq!(
            (f.layer, f.wall_s, f.reference_s, f.candidate_s),
            (1, 1.0, 0.5, 0.25)
        );
    }

    /// A kind's first layer timed, left out of its means, counts once as itself. GLM-5's depth
    /// (3 dense + 75 MoE) from layers 0-1 dense (4 s, then 1 s) and 2-4 MoE (2, 3, 5 s; reference
    /// half the wall, candidate a quarter): dense 4 + 2 * 1 = 6 s; MoE 2 + 74 * (3 + 5) / 2 =
    /// 2 + 296 = 298 s; whole 304 s; reference 152 s, candidate 76 s (ratio 2).
    #[test]
    fn projection_counts_a_kinds_first_layer_once() {
        let rows = [
            row(0, LayerKind::Dense, 4.0),
            row(1, LayerKind::Dense, 1.0),
            row(2, LayerKind::Moe, 2.0),
            row(3, LayerKind::Moe, 3.0),
            row(4, LayerKind::Moe, 5.0),
        ];
        let p = project(&Depth::named("glm5").unwrap(), &by_kind(&rows)).unwrap();
        let t: Vec<(usize, usize, Option<usize>, f64, f64)> = p
            .terms
            .iter()
            .map(|t| {
                (
                    t.count,
                    t.at_mean,
                    t.first.as_ref().map(|f| f.layer),
                    t.wall_s,
                    t.total_s,
                )
            })
            .collect();
        assert_eq!(
            t,
            vec![(3, 2, Some(0), 1.0, 6.0), (75, 74, Some(2), 4.0, 298.0)]
        );
        assert_eq!(
            (p.total_s, p.reference_s, p.candidate_s),
            (304.0, 152.0, 76.0)
        );
        assert_eq!((p.bound, p.bound_ratio), (Side::Reference, Some(2.0)));
        // A lone layer of a kind stands for all of it: 3 * 4 + 75 * 2 = 162 s.
        let p = project(
            &Depth::named("glm5").unwrap(),
            &by_kind(
                &rows[..1]
                    .iter()
                    .chain(&rows[2..3])
                    .cloned()
                    .collect::<Vec<_>>(),
            ),
        )
        .unwrap();
        assert_eq!(p.total_s, 162.0);
        assert!(p
            .terms
            .iter()
            .all(|t| t.first.is_none() && t.at_mean == t.count));
    }

    #[test]
    fn ratios_are_quotients_and_absent_without_a_divisor() {
        let mut row = LayerRow {
            layer: 3,
            kind: LayerKind::Moe,
            wall_s: 2.0,
            reference_s: 1.5,
            chained_s: 0.25,
            replay_s: 0.125,
            candidate_s: 0.375,
            upload_s: 0.0625,
            upload_bytes: 1 << 30,
            compare_s: 0.125,
            compare_wait_s: 0.0,
            candidate_beyond_s: 0.0,
            experts: 8,
            floor: None,
            floor_s: Some(0.5),
            copy_pinned_s: Some(0.25),
            copy_pageable_s: Some(1.0),
            ratios: Ratios::default(),
        };
        let r = ratios(&row);
        assert_eq!(r.reference_over_floor, Some(3.0));
        assert_eq!(r.upload_over_copy, Some(0.25));
        assert_eq!(r.candidate_over_reference, Some(0.25));
        row.floor_s = None;
        row.copy_pinned_s = Some(0.0);
        row.reference_s = 0.0;
        let r = ratios(&row);
        assert_eq!(
            (
                r.reference_over_floor,
                r.upload_over_copy,
                r.candidate_over_reference
            ),
            (None, None, None)
        );
    }

    /// The bytes the copy floor sends for a layer are every tensor of the layer (`blk.L.*`),
    /// whole, on every fixture model: computed here from each tensor's dimensions and its type's
    /// block size and bytes.
    #[test]
    fn a_layers_copy_bytes_are_its_tensors() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models");
        for m in [
            "glm5-tiny/glm5-tiny-f32.gguf",
            "glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "dsv3-tiny/dsv3-tiny-f16.gguf",
            "dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ] {
            let model = Model::open(&dir.join(m)).unwrap();
            let w = Weights::new(&model).unwrap();
            for l in 0..w.hparams().n_layer {
                let prefix = format!("blk.{l}.");
                let want: u64 = model
                    .tensors()
                    .filter(|t| t.info.name.starts_with(&prefix))
                    .map(|t| {
                        let n: u64 = t.info.ne.iter().product();
                        n / t.info.ty.block_size() as u64 * t.info.ty.type_size() as u64
                    })
                    .sum();
                let got: u64 = layer_bytes(&w, l)
                    .unwrap()
                    .iter()
                    .map(|p| p.len() as u64)
                    .sum();
                assert_eq!(got, want, "{m} layer {l}");
            }
        }
    }

    #[test]
    fn marks_time_each_unit_of_the_last_phase() {
        let m = Marks::new(&NoProgress);
        assert!(m.layer_walls(1).is_err());
        m.start("layers", 3);
        m.inc(1);
        m.start("layers", 2);
        m.inc(1);
        std::thread::sleep(Duration::from_millis(5));
        m.inc(1);
        m.finish();
        let w = m.layer_walls(2).unwrap();
        assert_eq!(w.len(), 2);
        assert!(w[1] >= 0.004, "{w:?}");
        // The output layer's unit after the layers is not a layer's.
        assert_eq!(m.layer_walls(1).unwrap(), w[..1]);
        let e = m.layer_walls(3).unwrap_err().to_string();
        assert!(e.contains("2 layer ends of 2 for 3 layers"), "{e}");
        m.start("layers", 4);
        m.inc(2);
        assert!(m.layer_walls(3).is_err() && m.layer_walls(2).is_err());
    }
}
