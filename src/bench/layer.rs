//! `glmdiff bench layer`: the CPU reference's time per layer, split into dequantization and
//! arithmetic, the weight bytes it dequantized, and the process's resident memory.
//!
//! Without a model, [`run`] writes a synthetic GLM-5-dimension model ([`glm5_synth`]: one dense
//! and one MoE layer, `ud-q4_k_xl`) to a temporary directory, removed afterwards. For each token
//! count it opens the model (a fresh map, so file-backed RSS counts only that run's pages), runs
//! the embedding and the layers up to the first MoE layer through [`driver::run`] with random
//! token ids (fixed seed), once untimed to fault the mapped pages in and once timed, with a sink
//! that keeps nothing but layer boundaries and routing.
//!
//! # What is counted, and what the split means
//! The engine runs inside [`Counted`], a decorator over the [`Engine`](crate::engine::Engine)
//! trait owned by this benchmark: it delegates every step and logs the weight slices the step
//! reads, from the step's arguments and the model's step table, so bytes, values, multiply-adds
//! and tasks ([`WeightCounts`]) come from the shapes; the reference itself measures nothing.
//! The CPU engine dequantizes a few weight rows per rayon task and uses them at once, so the two
//! kinds of work interleave on every thread and have no separate wall-clock time. After each
//! timed run the logged reads of each layer are redone in the reference's tasks with a timer
//! around each half (`work`), adding up *thread CPU time* (time a thread ran, not time it sat
//! preempted on a loaded machine): `dequant` inside the dequantizer, `matmul` in the dot
//! products against weights, summed over threads. `CPU` is the time all threads of the process
//! were on a CPU over the layer in the timed run (`/proc/self/task/*/schedstat`); `other` =
//! CPU - dequant - matmul (norms, RoPE, attention scores, routing, copies, rayon's scheduling
//! and spinning). `dq share` = dequant / CPU: the share of the layer's wall time attributable to
//! dequantization. With N cores free, CPU approaches N x wall.
//!
//! # Baseline
//! The floor of a layer is measured in the same run on the same bytes: [`quant::dequantize_par`](crate::quant::dequantize_par)
//! over exactly the slices the layer read (its tensors; only the touched experts' rows), then
//! [`math::matmul`](crate::engine::cpu::math::matmul) (the engine's own f64-accumulating kernel, parallel over rows) of the
//! dequantized f32 rows with as many tokens as the layer multiplied them with, in chunks of
//! [`FLOOR_CHUNK_ELEMS`] values; a slice whose products pass [`FLOOR_SAMPLE_MADDS`]
//! multiply-adds has them timed over its first chunks to that count and scaled to all its rows
//! (the reference's multiply-adds at the rate the CPU measured on them). `wall / floor` says how close the layer gets to its own
//! dequantize-then-multiply cost; everything else the layer does is in the difference.
//!
//! # Memory
//! `VmHWM` (reset before each timed run where `/proc/self/clear_refs` allows) counts every
//! resident page, and pages of the mapped GGUF count as soon as they are read. So RSS is
//! reported split: `RssAnon` (heap: f32 scratch and activations, sampled every few ms for its
//! peak) and `RssFile` (quantized weights read through the map: clean page-cache pages the kernel
//! can drop at any time). The claim to check: the anonymous peak stays near one layer's scratch,
//! and the file-backed part equals the bytes the run read, never the model's size.

mod counted;
pub(crate) mod procfs;
mod reads;
mod work;

use super::cpu_model;
use super::scratch::ScratchModel;
pub use super::scratch::SynthInfo;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde::Serialize;

pub use counted::{Counted, WeightCounts};
pub use procfs::{parse_status, Rss};

use reads::{floor, layer_reads, Read};

use crate::driver::{self, Plan};
use crate::engine::cpu::CpuEngine;
use crate::engine::HostTensor;
use crate::gguf::Model;
use crate::model::names;
use crate::model::steps::point;
use crate::model::{Arch, Weights};
use crate::synth::{Dims, SynthOptions, TypeMix};
use crate::trace::Sink;
use crate::util::progress::{NoProgress, Progress};
use crate::util::rng::{SplitMix64, GAMMA};

/// Seed of the random prompt token ids.
pub const DEFAULT_SEED: u64 = 0x0062_656E_6368; // "bench" in ASCII
/// Timed runs per token count: the machine is shared, so the best of a few is kept.
pub const DEFAULT_REPS: usize = 3;
/// Interval of the thread sampling `RssAnon`/`RssFile`.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(5);
/// Values per timed call of the floor measurement (4 MiB of f32).
pub const FLOOR_CHUNK_ELEMS: usize = 1 << 20;
/// Multiply-adds of a slice's products that the floor times; a slice with more (a long prompt's
/// projections: 4096 tokens of a [12288, 6144] matrix are 309 G) has them timed on its first
/// rows and scaled to the rest, so that the floor costs a fraction of what it measures.
pub const FLOOR_SAMPLE_MADDS: u64 = 1 << 31;
/// Layers of the default synthetic model.
pub const SYNTH_LAYERS: u64 = 2;
/// Leading dense layers of the default synthetic model (the rest are MoE).
pub const SYNTH_DENSE: u64 = 1;
/// Seed of the default synthetic model's weights.
pub const SYNTH_SEED: u64 = 0;
/// Activation value of the floor's matmuls (any finite value: only the time is kept).
pub(crate) const FLOOR_ACTIVATION: f32 = 0.5;
/// File name of the synthetic model inside the temporary directory.
const SYNTH_FILE: &str = "bench-layer.gguf";

/// GLM-5 dimensions (`--arch glm-dsa --dims glm5`, `ud-q4_k_xl`) cut to [`SYNTH_LAYERS`] layers
/// of which [`SYNTH_DENSE`] dense, without the MTP layer: every tensor of a dense and of a MoE
/// layer at full size (about 8 GB, most of it the MoE layer's 256 experts).
pub fn glm5_synth() -> Result<SynthOptions> {
    let mut dims = Dims::preset(Arch::GlmDsa, "glm5")?.with_layers(SYNTH_LAYERS)?;
    dims.n_dense = SYNTH_DENSE;
    dims.nextn = 0;
    Ok(SynthOptions {
        arch: Arch::GlmDsa,
        dims,
        mix: TypeMix::UdQ4KXl,
        seed: SYNTH_SEED,
    })
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchLayerOptions {
    /// The model; `None` writes [`BenchLayerOptions::synth`] to a temporary directory.
    pub model: Option<PathBuf>,
    /// The synthetic model written when `model` is `None`.
    pub synth: SynthOptions,
    /// Where the temporary directory is created.
    pub temp_parent: PathBuf,
    /// Token counts, one timed run each.
    pub tokens: Vec<usize>,
    /// Seed of the token ids.
    pub seed: u64,
    /// Run once untimed before the timed runs (faults the mapped pages in).
    pub warmup: bool,
    /// Timed runs per token count, each followed by its floor; per layer the fastest is kept.
    pub reps: usize,
    /// Measure the dequantize-then-matmul floor of every layer.
    pub baseline: bool,
    /// Interval of the RSS sampling thread.
    pub sample_interval: Duration,
}

impl BenchLayerOptions {
    /// `model` (or the synthetic [`glm5_synth`] model in the system's temporary directory) at
    /// `tokens`, with warm-up, baseline and the default seed and sampling interval.
    pub fn new(model: Option<PathBuf>, tokens: Vec<usize>) -> Result<BenchLayerOptions> {
        Ok(BenchLayerOptions {
            model,
            synth: glm5_synth()?,
            temp_parent: std::env::temp_dir(),
            tokens,
            seed: DEFAULT_SEED,
            warmup: true,
            reps: DEFAULT_REPS,
            baseline: true,
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
        })
    }
}

/// Kind of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Dense MLP.
    Dense,
    /// Routed experts (plus shared expert).
    Moe,
}

impl LayerKind {
    /// `dense` or `MoE`.
    pub fn label(self) -> &'static str {
        match self {
            LayerKind::Dense => "dense",
            LayerKind::Moe => "MoE",
        }
    }
}

/// The floor of one layer: the same slices dequantized and multiplied by plain kernels.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Floor {
    /// Wall time of `quant::dequantize_par` over the layer's slices, seconds.
    pub dequant_s: f64,
    /// Wall time of `math::matmul` of those f32 rows with the layer's tokens, seconds.
    pub matmul_s: f64,
}

/// One layer of one timed run.
#[derive(Clone, Debug, Serialize)]
pub struct LayerRow {
    /// Layer index.
    pub layer: usize,
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// CPU time of all threads, seconds (`None` without `/proc/self/task/*/schedstat`).
    pub cpu_s: Option<f64>,
    /// Thread-seconds in dequantization.
    pub dequant_s: f64,
    /// Thread-seconds in weight matmul dot products.
    pub matmul_s: f64,
    /// The counters' difference over the layer.
    pub counts: WeightCounts,
    /// Quantized bytes of the slices the layer should read (all its tensors, touched experts).
    pub expected_bytes_in: u64,
    /// f32 values of those slices.
    pub expected_values_out: u64,
    /// Multiply-adds of those slices with the layer's tokens.
    pub expected_madds: u64,
    /// Routed experts some token selected -> tokens routed to each (empty for dense layers).
    pub experts: BTreeMap<usize, usize>,
    /// Peak `RssAnon` during the layer (sampled), bytes.
    pub peak_anon: u64,
    /// The dequantize-then-matmul floor, when measured.
    pub floor: Option<Floor>,
}

/// Mean over the layers of one kind in one run.
#[derive(Clone, Debug, Serialize)]
pub struct KindRow {
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Layers of this kind that ran.
    pub layers: usize,
    /// Mean wall time per layer, seconds.
    pub wall_s: f64,
    /// Mean CPU time per layer, seconds.
    pub cpu_s: Option<f64>,
    /// Mean dequantization thread-seconds per layer.
    pub dequant_s: f64,
    /// Mean matmul thread-seconds per layer.
    pub matmul_s: f64,
    /// Mean quantized bytes read per layer.
    pub bytes_in: u64,
    /// Mean f32 values produced per layer.
    pub values_out: u64,
    /// Mean routed experts touched per layer.
    pub experts: f64,
    /// Mean floor per layer (dequant + matmul), seconds.
    pub floor_s: Option<f64>,
    /// Largest per-layer `RssAnon` peak, bytes.
    pub peak_anon: u64,
}

/// One token count.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// Prompt length.
    pub tokens: usize,
    /// Wall time of the whole timed run (embedding and layers), seconds.
    pub wall_s: f64,
    /// Counters of the embedding step.
    pub embed: WeightCounts,
    /// Per layer.
    pub layers: Vec<LayerRow>,
    /// Per layer kind.
    pub kinds: Vec<KindRow>,
    /// Resident memory after opening the model, before any run of this token count.
    pub rss_before: Rss,
    /// Resident memory after the timed run.
    pub rss_after: Rss,
    /// Whether `VmHWM` was reset before the timed run (`rss_after.vm_hwm` is then its peak).
    pub hwm_reset: bool,
    /// Peak `RssAnon` of the timed run (sampled), bytes.
    pub peak_anon: u64,
    /// Peak `RssFile` of the timed run (sampled), bytes.
    pub peak_file: u64,
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
    /// Size of the model's files, bytes.
    pub model_bytes: u64,
    /// `general.architecture`.
    pub arch: String,
    /// The synthetic model, when one was written.
    pub synth: Option<SynthInfo>,
    /// Layers run (`0..layers_run`: up to the first MoE layer).
    pub layers_run: usize,
    /// Routed experts per MoE layer.
    pub n_expert: usize,
    /// Experts per token.
    pub n_expert_used: usize,
    /// Seed of the token ids.
    pub seed: u64,
    /// Whether the timed runs followed an untimed one.
    pub warmup: bool,
    /// Timed runs per token count (the best kept).
    pub reps: usize,
    /// Sampling interval of the RSS thread, milliseconds.
    pub sample_ms: f64,
    /// Resident memory when the benchmark started (before the model was opened).
    pub rss_start: Rss,
    /// One per token count.
    pub runs: Vec<Run>,
}

/// Runs the benchmark (see the module documentation).
pub fn run(opts: &BenchLayerOptions) -> Result<Report> {
    run_with_progress(opts, &mut |_| {}, &NoProgress)
}

/// [`run`], telling `progress` what it is doing (writing the model, each run) and `written`
/// the bytes of the synthetic model written.
pub fn run_with_progress(
    opts: &BenchLayerOptions,
    progress: &mut dyn FnMut(&str),
    written: &dyn Progress,
) -> Result<Report> {
    if opts.tokens.is_empty() || opts.tokens.contains(&0) {
        bail!(
            "bench: layer: token counts {:?}: need at least one, each at least 1",
            opts.tokens
        );
    }
    let load_before = procfs::load_average();
    let rss_start = procfs::rss().unwrap_or_default();
    let Some(path) = &opts.model else {
        let scratch = ScratchModel::write(
            &opts.synth,
            &opts.temp_parent,
            TEMP_PREFIX,
            SYNTH_FILE,
            progress,
            written,
        )?;
        let result = measure(scratch.path(), opts, progress);
        let synth = scratch.finish();
        let mut report = result?;
        report.synth = Some(synth);
        report.load_before = load_before;
        report.rss_start = rss_start;
        return Ok(report);
    };
    let mut report = measure(path, opts, progress)?;
    report.load_before = load_before;
    report.rss_start = rss_start;
    Ok(report)
}

/// Opens `path` once per token count and measures; `synth`, `load_before` and `rss_start` are
/// left for the caller.
fn measure(
    path: &Path,
    opts: &BenchLayerOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Report> {
    let mut runs = Vec::with_capacity(opts.tokens.len());
    let mut info = None;
    for &t in &opts.tokens {
        let model = Model::open(path)?;
        let weights = Weights::new(&model)?;
        let hp = weights.hparams();
        let n_layers = (hp.n_dense + 1).min(hp.n_layer);
        let plan = Plan::new(&weights, n_layers, false)?;
        let engine = Counted::new(CpuEngine::new(&weights), &weights);
        let ids = token_ids(opts.seed, t, weights.n_vocab());
        let rss_before = procfs::rss().unwrap_or_default();
        if opts.warmup {
            progress(&format!(
                "bench: {t} tokens: warm-up run of {n_layers} layers"
            ));
            timed_run(&engine, &weights, &ids, &plan, opts.sample_interval, false)?;
        }
        let mut best: Option<Run> = None;
        for rep in 1..=opts.reps.max(1) {
            progress(&format!(
                "bench: {t} tokens: timed run {rep} of {} ({n_layers} layers{})",
                opts.reps.max(1),
                if opts.baseline {
                    ", then the floor"
                } else {
                    ""
                }
            ));
            let hwm_reset = procfs::reset_peak();
            let mut run = timed_run(&engine, &weights, &ids, &plan, opts.sample_interval, true)?;
            run.hwm_reset = hwm_reset;
            if opts.baseline {
                for row in &mut run.layers {
                    let reads = layer_reads(&weights, row.layer, t, &row.experts)?;
                    row.floor = Some(floor(&model, &reads)?);
                }
            }
            best = Some(match best {
                None => run,
                Some(b) => best_of(b, run),
            });
        }
        let Some(mut run) = best else {
            bail!("bench: layer: no timed run for {t} tokens");
        };
        run.rss_before = rss_before;
        run.kinds = by_kind(&run.layers);
        runs.push(run);
        info = Some((
            model.shards().iter().map(|s| s.file_len()).sum::<u64>(),
            hp.arch.as_str().to_string(),
            n_layers,
            hp.n_expert,
            hp.n_expert_used,
        ));
    }
    let Some((model_bytes, arch, layers_run, n_expert, n_expert_used)) = info else {
        bail!("bench: layer: no token counts to run");
    };
    Ok(Report {
        cpu: cpu_model(),
        threads: rayon::current_num_threads(),
        load_before: String::new(),
        load_after: procfs::load_average(),
        model: path.display().to_string(),
        model_bytes,
        arch,
        synth: None,
        layers_run,
        n_expert,
        n_expert_used,
        seed: opts.seed,
        warmup: opts.warmup,
        reps: opts.reps.max(1),
        sample_ms: opts.sample_interval.as_secs_f64() * 1e3,
        rss_start: Rss::default(),
        runs,
    })
}

/// `t` random token ids below `n_vocab` (the same for the same seed and count).
pub(crate) fn token_ids(seed: u64, t: usize, n_vocab: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed ^ (t as u64).wrapping_mul(GAMMA));
    (0..t)
        .map(|_| (rng.next_u64() % n_vocab.max(1) as u64) as u32)
        .collect()
}

/// A point in a run: time, position in the engine's log of reads, CPU time and the `RssAnon`
/// peak since the previous mark.
struct Mark {
    at: Instant,
    reads: usize,
    cpu_ns: Option<u64>,
    span_anon: u64,
}

/// The sink of a timed run: keeps no hook values, only marks at the embedding and at every
/// layer's `l_out` (the driver records a wanted hook right after the step that made it) and the
/// routing of every MoE layer (`moe_topk_ids`, for the experts touched).
struct Clock<'a, 'm> {
    engine: &'a Counted<'m, CpuEngine<'m>>,
    sampler: &'a procfs::Sampler,
    marks: Vec<Mark>,
    topk: BTreeMap<usize, Vec<i32>>,
}

impl Clock<'_, '_> {
    fn mark(&mut self) {
        let at = Instant::now();
        self.marks.push(Mark {
            at,
            reads: self.engine.position(),
            cpu_ns: procfs::cpu_ns(),
            span_anon: self.sampler.take_span_anon(),
        });
    }
}

impl Sink for Clock<'_, '_> {
    fn wants(&self, name: &str) -> bool {
        name == point::TOKEN_EMBD
            || names::split_blk(name)
                .is_some_and(|(_, p)| p == point::L_OUT || p == point::MOE_TOPK_IDS)
    }

    fn record(&mut self, name: &str, tensor: HostTensor) -> Result<()> {
        match names::split_blk(name) {
            Some((l, p)) if p == point::MOE_TOPK_IDS => {
                self.topk.insert(l, tensor.as_i32(name)?.to_vec());
            }
            _ => self.mark(),
        }
        Ok(())
    }
}

/// One driver run of `plan` on `ids`, with marks; floors and kinds are left empty, and so are
/// the times of the counts unless `time_work` ([`work::time`], after the run).
fn timed_run<'m>(
    engine: &Counted<'m, CpuEngine<'m>>,
    weights: &Weights<'m>,
    ids: &[u32],
    plan: &Plan,
    interval: Duration,
    time_work: bool,
) -> Result<Run> {
    engine.clear();
    let sampler = procfs::Sampler::default();
    let (clock, wall) = std::thread::scope(|s| {
        s.spawn(|| sampler.watch(interval));
        let mut clock = Clock {
            engine,
            sampler: &sampler,
            marks: Vec::with_capacity(plan.n_layers + 2),
            topk: BTreeMap::new(),
        };
        clock.mark();
        let t0 = Instant::now();
        let r = driver::run(engine, weights, ids, plan, &mut clock);
        let wall = t0.elapsed();
        sampler.stop();
        (r.map(|_| clock), wall)
    });
    let clock = clock?;
    let rss_after = procfs::rss().unwrap_or_default();
    let (peak_anon, peak_file) = sampler.peaks();
    let m = &clock.marks;
    if m.len() != plan.n_layers + 2 {
        bail!(
            "bench: layer: {} marks for {} layers (expected the embedding and one per layer)",
            m.len(),
            plan.n_layers
        );
    }
    let hp = weights.hparams();
    let t = ids.len();
    // The counts of the reads between two marks, timed when asked.
    let counts = |a: &Mark, b: &Mark| -> Result<WeightCounts> {
        let reads = engine.reads(a.reads..b.reads);
        let mut c = WeightCounts::of(&reads);
        if time_work {
            (c.dequant_ns, c.matmul_ns) = work::time(weights.model(), &reads)?;
        }
        Ok(c)
    };
    let mut layers = Vec::with_capacity(plan.n_layers);
    for l in 0..plan.n_layers {
        let (a, b) = (&m[l + 1], &m[l + 2]);
        let counts = counts(a, b)?;
        let experts = clock
            .topk
            .get(&l)
            .map(|ids| count_ids(ids))
            .unwrap_or_default();
        let reads = layer_reads(weights, l, t, &experts)?;
        layers.push(LayerRow {
            layer: l,
            kind: if hp.is_dense(l) {
                LayerKind::Dense
            } else {
                LayerKind::Moe
            },
            wall_s: (b.at - a.at).as_secs_f64(),
            cpu_s: a
                .cpu_ns
                .zip(b.cpu_ns)
                .map(|(x, y)| y.saturating_sub(x) as f64 * 1e-9),
            dequant_s: counts.dequant_ns as f64 * 1e-9,
            matmul_s: counts.matmul_ns as f64 * 1e-9,
            counts,
            expected_bytes_in: reads.iter().map(Read::bytes).sum(),
            expected_values_out: reads.iter().map(Read::values).sum(),
            expected_madds: reads.iter().map(Read::madds).sum(),
            experts,
            peak_anon: b.span_anon,
            floor: None,
        });
    }
    Ok(Run {
        tokens: t,
        wall_s: wall.as_secs_f64(),
        embed: counts(&m[0], &m[1])?,
        layers,
        kinds: Vec::new(),
        rss_before: Rss::default(),
        rss_after,
        hwm_reset: false,
        peak_anon,
        peak_file,
    })
}

/// The floor of layer `layer` on `t` tokens whose routing is `routed` (expert -> tokens routed
/// to it; empty for a dense layer): the slices the layer reads dequantized and multiplied by
/// plain kernels (see the module documentation).
pub(crate) fn layer_floor(
    weights: &Weights<'_>,
    layer: usize,
    t: usize,
    routed: &BTreeMap<usize, usize>,
) -> Result<Floor> {
    floor(weights.model(), &layer_reads(weights, layer, t, routed)?)
}

/// Keeps the best of two timed runs of the same tokens: per layer the row with the lower wall
/// time, and separately the lower floor; memory peaks are the higher of the two (counts,
/// routing and expected bytes are the same in both runs).
fn best_of(a: Run, b: Run) -> Run {
    let floor_s = |f: &Option<Floor>| f.map_or(f64::INFINITY, |f| f.dequant_s + f.matmul_s);
    let layers = a
        .layers
        .into_iter()
        .zip(b.layers)
        .map(|(x, y)| {
            let floor = if floor_s(&x.floor) <= floor_s(&y.floor) {
                x.floor
            } else {
                y.floor
            };
            let peak_anon = x.peak_anon.max(y.peak_anon);
            let mut row = if x.wall_s <= y.wall_s { x } else { y };
            row.floor = floor;
            row.peak_anon = peak_anon;
            row
        })
        .collect();
    let mut rss_after = b.rss_after;
    rss_after.vm_hwm = a.rss_after.vm_hwm.max(b.rss_after.vm_hwm);
    Run {
        wall_s: a.wall_s.min(b.wall_s),
        layers,
        rss_after,
        hwm_reset: a.hwm_reset && b.hwm_reset,
        peak_anon: a.peak_anon.max(b.peak_anon),
        peak_file: a.peak_file.max(b.peak_file),
        ..b
    }
}

/// Tokens per expert from `[T, K]` routing ids (each token selects distinct experts).
pub(crate) fn count_ids(ids: &[i32]) -> BTreeMap<usize, usize> {
    let mut m = BTreeMap::new();
    for &e in ids {
        *m.entry(e.max(0) as usize).or_insert(0) += 1;
    }
    m
}

/// Means per layer kind.
fn by_kind(layers: &[LayerRow]) -> Vec<KindRow> {
    let mut kinds: Vec<LayerKind> = layers.iter().map(|l| l.kind).collect();
    kinds.sort();
    kinds.dedup();
    kinds
        .into_iter()
        .map(|kind| {
            let ls: Vec<&LayerRow> = layers.iter().filter(|l| l.kind == kind).collect();
            let n = ls.len();
            let mean =
                |f: &dyn Fn(&LayerRow) -> f64| ls.iter().map(|l| f(l)).sum::<f64>() / n as f64;
            let mean_u =
                |f: &dyn Fn(&LayerRow) -> u64| ls.iter().map(|l| f(l)).sum::<u64>() / n as u64;
            let cpu = ls.iter().map(|l| l.cpu_s).sum::<Option<f64>>();
            let floor = ls
                .iter()
                .map(|l| l.floor.map(|f| f.dequant_s + f.matmul_s))
                .sum::<Option<f64>>();
            KindRow {
                kind,
                layers: n,
                wall_s: mean(&|l| l.wall_s),
                cpu_s: cpu.map(|c| c / n as f64),
                dequant_s: mean(&|l| l.dequant_s),
                matmul_s: mean(&|l| l.matmul_s),
                bytes_in: mean_u(&|l| l.counts.bytes_in),
                values_out: mean_u(&|l| l.counts.values_out),
                experts: mean(&|l| l.experts.len() as f64),
                floor_s: floor.map(|f| f / n as f64),
                peak_anon: ls.iter().map(|l| l.peak_anon).max().unwrap_or(0),
            }
        })
        .collect()
}

/// The name of the benchmark's temporary directories: `glmdiff-bench-layer-PID-NANOS`.
const TEMP_PREFIX: &str = "glmdiff-bench-layer-";
