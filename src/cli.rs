//! Command-line definitions (clap) and their conversion into checked values (the typed choices
//! of `run` are [`crate::session`]'s). No work happens here.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args, Parser, Subcommand};

use crate::quant::simd::Level;
use crate::session::{Against, CudaDtype, Modes, ReferenceOn};
pub use crate::words::parse_tol;
use crate::words::PrecisionOverride;

/// glmdiff: find the first step where a GPU forward pass of a quantized MoE GGUF diverges from a CPU reference.
#[derive(Debug, Parser)]
#[command(name = "glmdiff", version, about, long_about = None)]
#[command(after_help = "Exit codes: 0 ok, 1 a check found a difference, 2 error.")]
pub struct Cli {
    /// Print tables and text at their full width: no column left out, nothing wrapped (by
    /// default output fits the terminal, or 100 columns when stdout is not a terminal).
    #[arg(long, global = true)]
    pub wide: bool,
    /// Cap the instruction set of the CPU's dequantizers and matrix products: base, avx2 or
    /// avx512 (every level gives the same bits; to compare their speeds). Default:
    /// $GLMDIFF_CPU_SIMD when it names a level, else the widest the CPU has.
    #[arg(long, global = true, value_name = "LEVEL", value_parser = parse_cpu_simd)]
    pub cpu_simd: Option<Level>,
    /// Progress when stderr is not a terminal (a pipe, a log): plain lines every SECONDS while a
    /// long phase runs (the first after at most 2 s), or `off`. A terminal gets bars instead.
    #[arg(
        long,
        global = true,
        value_name = "SECONDS|off",
        env = "GLMDIFF_PROGRESS",
        default_value = "10",
        value_parser = parse_progress
    )]
    pub progress: ProgressEvery,
    /// Where the CPU reference makes its matrix products of 32 tokens or more: auto (the CUDA
    /// candidate's device, else device 0 when there is one, else the CPU), cpu, cuda or cuda:N.
    /// The values are the CPU's either way: a device sums each element as the CPU does, and
    /// each product made there is checked on the CPU at 12 elements.
    #[arg(
        long,
        global = true,
        value_name = "WHERE",
        env = "GLMDIFF_REFERENCE_ON",
        default_value = "auto",
        value_parser = ReferenceOn::parse
    )]
    pub reference_on: ReferenceOn,
    /// The fewest tokens of a reference product made on its device (see --reference-on): with
    /// fewer, the CPU makes it. The values are the same either way; this moves where the device
    /// starts to pay.
    #[arg(
        long,
        global = true,
        value_name = "N",
        env = "GLMDIFF_REFERENCE_MIN_TOKENS",
        default_value = "32",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub reference_min_tokens: u32,
    /// How host threads wait for a CUDA device: auto (the driver's choice: spin on a machine
    /// with more cores than contexts), block (sleep until it is done, leaving the core to the
    /// CPU reference), spin, or yield (spin, yielding between polls). Only the speed changes.
    #[arg(
        long,
        global = true,
        value_enum,
        value_name = "HOW",
        env = "GLMDIFF_GPU_WAIT",
        default_value = "auto"
    )]
    pub gpu_wait: crate::words::GpuWait,
    /// Where a run's comparison computes beside the reference: background (a pool as large as
    /// the reference's, at a lower priority: it takes the cores the reference leaves idle) or N
    /// (N threads at the normal priority; `RAYON_NUM_THREADS` sizes the reference's pool). Only
    /// the speed changes.
    #[arg(
        long,
        global = true,
        value_name = "background|N",
        env = "GLMDIFF_COMPARE_POOL",
        default_value = "background",
        value_parser = parse_compare_pool
    )]
    pub compare_pool: ComparePool,
    /// Whether a run's candidate engine runs its own chain ahead of the pass at prompts of up to
    /// 64 tokens: while the reference computes a step, the candidate's next chained steps of the
    /// layer, up to its routing (an engine that uploads its routed experts starts them there).
    /// Only the speed changes.
    #[arg(
        long,
        global = true,
        value_enum,
        value_name = "on|off",
        env = "GLMDIFF_CANDIDATE_AHEAD",
        default_value = "off"
    )]
    pub candidate_ahead: crate::words::Switch,
    /// Whether the reference makes its products of fewer than --reference-min-tokens tokens from
    /// the weight bytes a CUDA candidate put on the device (its routed experts, each layer's
    /// whole tensors) instead of on the CPU: each span of bytes is first proven to be the file's
    /// (its hash on the device against the file's), and each product is checked on the CPU at
    /// 12 elements. Only the speed changes.
    #[arg(
        long,
        global = true,
        value_enum,
        value_name = "on|off",
        env = "GLMDIFF_REFERENCE_REUSE",
        default_value = "off"
    )]
    pub reference_reuse: crate::words::Switch,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show a GGUF's architecture, hyperparameters, tokenizer, type histogram and tensors.
    Inspect(InspectArgs),
    /// Dequantize one tensor (or a row range) to f32 and write it as .npy or .safetensors.
    Dequant(DequantArgs),
    /// Run the CPU reference forward pass and write every hook to a safetensors trace.
    Trace(TraceArgs),
    /// Dequantize tensors on the GPU and compare them bit for bit with the CPU, on the device.
    DequantCheck(DequantCheckArgs),
    /// Run the reference and a candidate step by step and name the first step where they part.
    Run(Box<RunArgs>),
    /// Compare two traces hook by hook (the first is the reference).
    Compare(CompareArgs),
    /// Re-run one step written by `run --repro DIR`: the candidate against the reference, from
    /// the stored inputs.
    Step(StepArgs),
    /// Run a suite of `run` cases with pinned expectations (a CI regression gate).
    Regress(RegressArgs),
    /// Write a synthetic GGUF with real tensor names, shapes and a realistic type mix.
    Synth(SynthArgs),
    /// Compare every GGUF tensor with the Hugging Face checkpoint it came from (or another GGUF).
    WeightsCheck(WeightsCheckArgs),
    /// Benchmarks (tables of measured rates, ratios against baselines measured in the same run).
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// `glmdiff inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The model: a .gguf file, or any shard of a split model (NAME-0000K-of-0000N.gguf).
    pub model: PathBuf,
    /// Only list tensors whose name matches this glob (`*` any run, `?` one character), e.g. 'blk.3.*'.
    #[arg(long, value_name = "GLOB")]
    pub tensors: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// `glmdiff dequant`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct DequantArgs {
    /// The model: a .gguf file, or any shard of a split model.
    pub model: PathBuf,
    /// GGUF tensor name, e.g. blk.3.ffn_down_exps.weight.
    pub tensor: String,
    /// Only rows A..B (rows of `ne[0]` elements over all other dimensions; end exclusive).
    #[arg(long, value_name = "A..B", allow_hyphen_values = true, value_parser = parse_range)]
    pub rows: Option<Range<u64>>,
    /// Output file: .npy or .safetensors (f32, PyTorch shape order). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// `glmdiff dequant-check`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct DequantCheckArgs {
    /// The model: a .gguf file, or any shard of a split model.
    pub model: PathBuf,
    /// GGUF tensor names to check.
    pub tensor: Vec<String>,
    /// Check every tensor of the model.
    #[arg(long)]
    pub all: bool,
    /// Check the tensors whose name matches this glob (e.g. 'blk.3.*').
    #[arg(long, value_name = "GLOB")]
    pub tensors: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, value_parser = parse_device)]
    pub device: usize,
    /// Spread the tensors over several devices, e.g. 0,1,2,3 (largest tensors first, each
    /// device taking the next when it is done); replaces --device.
    #[arg(long, value_name = "LIST", value_delimiter = ',', allow_hyphen_values = true, value_parser = parse_device)]
    pub devices: Vec<usize>,
    /// Also project the measured rates to a full model: glm5 (GLM-5, 744B values, 402 GB in
    /// UD-Q4_K_XL).
    #[arg(long, value_name = "MODEL")]
    pub project: Option<String>,
    /// Write the results as JSON (`-`: stdout, the report then on stderr). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Copy each chunk from the mapped file (pageable memory) synchronously in the device loop
    /// instead of through pinned staging, to compare (the same bits either way). On by default
    /// when $GLMDIFF_DCHECK_PAGEABLE is set to anything but empty or 0.
    #[arg(long, env = "GLMDIFF_DCHECK_PAGEABLE", default_value = "0", value_parser = parse_switch)]
    pub pageable: bool,
}

/// `glmdiff weights-check`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("reference").required(true).args(["hf", "gguf"])))]
pub struct WeightsCheckArgs {
    /// The model: a .gguf file, or any shard of a split model.
    pub model: PathBuf,
    /// The Hugging Face checkpoint directory it was converted from (config.json + safetensors).
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    /// Another GGUF of the same model to compare with (another conversion or quant mix).
    #[arg(long, value_name = "OTHER")]
    pub gguf: Option<PathBuf>,
    /// Only GGUF tensors whose name matches this glob (repeatable), e.g. 'blk.3.*'.
    #[arg(long, value_name = "GLOB")]
    pub tensors: Vec<String>,
    /// Write the results as JSON (docs/weights-check-json.md; `-`: stdout, the report then on
    /// stderr). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// `glmdiff trace`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "tokens"])))]
pub struct TraceArgs {
    /// The model: a .gguf file, or any shard of a split model.
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's own tokenizer.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Token ids, comma separated (e.g. 1,2,3), each in 0..vocab.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = parse_token_id)]
    pub tokens: Option<Vec<u32>>,
    /// Only layers A..B (end exclusive); the layers before A still run (their hooks are not kept).
    #[arg(long, value_name = "A..B", allow_hyphen_values = true, value_parser = parse_range)]
    pub layers: Option<Range<u64>>,
    /// Keep only hooks whose name matches one of these globs (repeatable), e.g. 'blk.*.attn_out'.
    #[arg(long, value_name = "GLOB")]
    pub hook: Vec<String>,
    /// Output trace file (.safetensors). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// `glmdiff run`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
#[command(group(ArgGroup::new("input").args(["prompt", "tokens"])))]
#[command(group(ArgGroup::new("range").args(["layer", "layers"])))]
pub struct RunArgs {
    /// The model: a .gguf file, or any shard of a split model.
    pub model: PathBuf,
    /// Prompt text, tokenized with the model's own tokenizer (default with a trace candidate: the
    /// trace's tokens).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Token ids, comma separated (e.g. 1,2,3), each in 0..vocab.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = parse_token_id)]
    pub tokens: Option<Vec<u32>>,
    /// Only layer N, starting from the reference's residual stream at its input (cached on disk).
    #[arg(long, value_name = "N", value_parser = parse_layer)]
    pub layer: Option<u64>,
    /// Only layers A..B (end exclusive), starting from the cached residual stream at layer A.
    #[arg(long, value_name = "A..B", allow_hyphen_values = true, value_parser = parse_range)]
    pub layers: Option<Range<u64>>,
    /// The candidate: auto, cpu, cuda or cuda:N, or trace:FILE (a trace of docs/hooks.md).
    #[arg(long, default_value = "auto", value_name = "ENGINE", value_parser = Against::parse)]
    pub against: Against,
    /// Modes: both, replay (each step from the same inputs) or chained (each side on its own outputs).
    #[arg(long, value_enum, default_value = "both")]
    pub mode: Modes,
    /// The CUDA engine's precision: f32 (SGEMM without TF32: the f32 floors apply) or bf16 (weights
    /// and activations in bf16, tensor-core GEMMs with f32 accumulation: the bf16 floors apply).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: CudaDtype,
    /// The CUDA engine over several GPUs, e.g. 0,1: layers in contiguous ranges balanced by
    /// weight bytes, the residual stream handed from GPU to GPU (implies --against cuda).
    #[arg(long, value_name = "LIST", value_delimiter = ',', allow_hyphen_values = true, value_parser = parse_device)]
    pub devices: Vec<usize>,
    /// Inject a known bug into the candidate engine (cpu or cuda), repeatable: KIND[@LAYERS]
    /// with LAYERS N, A..B or N,M. Kinds: kv_b_concat, rope_neox, indexer_rope_neox,
    /// scale_latent, softmax_gating, bias_in_weights, router_bf16, expert_swap:A,B,
    /// expert_map:A=B,.., gate_up_swap, layer_weights:L[,GLOB], q4k_scale_bits, run_mtp,
    /// tp_shard:N, transposed:GLOB, and the harmless f32_accumulate and norm_eps:X; routing and
    /// MoE: routed_scale:X, routed_scaling_ignored, routed_scaling_twice, topk_norm:on|off,
    /// bias_unused, group_limit:off|N[,K], expert_scale:E,F, gate_up_swap:dense|shared,
    /// experts_per_token:K.
    /// Attention, norms and projections: weight_scale:GLOB,F, softmax_scale:F,
    /// yarn_mscale:none|twice, rope_theta:X, dsa_topk:K, indexer_scale:F, indexer_wproj_scale:F,
    /// indexer_relu:off,
    /// norm_one_plus[:GLOB], kv_b_split:kv.
    #[arg(long, value_name = "KIND[@LAYERS]")]
    pub inject: Vec<String>,
    /// At the first step that fails in replay, test which known bug reproduces the candidate's
    /// output (recomputed on the CPU from the same inputs) and rank them; a continuous kind
    /// (a scale, a RoPE base, an eps) is tested with its parameter fitted to the candidate.
    #[arg(long)]
    pub explain: bool,
    /// Write the first step that fails in replay as a self-contained case to DIR (inputs, weight
    /// tensors, reference and candidate outputs, README); `glmdiff step DIR` re-runs it.
    #[arg(long, value_name = "DIR")]
    pub repro: Option<PathBuf>,
    /// What to compare and how to report it.
    #[command(flatten)]
    pub report: ReportArgs,
    /// Reference cache directory (default: $GLMDIFF_CACHE_DIR, $XDG_CACHE_HOME/glmdiff or ~/.cache/glmdiff).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Compute the layers before the start without reading or writing the cache.
    #[arg(long)]
    pub no_cache: bool,
    /// Weight uploads of the CUDA engine.
    #[command(flatten)]
    pub prefetch: PrefetchArgs,
}

/// The flag of the commands that open the CUDA engine (`run`, `step`, `regress`, `bench run`).
#[derive(Debug, Args)]
pub struct PrefetchArgs {
    /// Upload each layer's weights as its steps read them instead of prefetching the next
    /// layer's while the current one runs (the same bits either way; a note says so). On by
    /// default when $GLMDIFF_NO_PREFETCH is set to anything but empty or 0.
    #[arg(long, env = "GLMDIFF_NO_PREFETCH", default_value = "0", value_parser = parse_switch)]
    pub no_prefetch: bool,
    /// How a MoE layer's stacked expert tensors reach the device: auto (only the experts a step
    /// routes to, uploaded after its router, when at most half are expected to be: short
    /// prompts; else whole), routed (always those only) or whole (every expert, prefetched with
    /// the layer). The same bits either way. Default from $GLMDIFF_EXPERT_UPLOADS.
    #[arg(
        long,
        value_enum,
        env = "GLMDIFF_EXPERT_UPLOADS",
        default_value = "auto"
    )]
    pub expert_uploads: crate::words::ExpertUploads,
    /// Where uploads take the weights' bytes: mapped (the device copies the model file's pages
    /// in the page cache, registered with the driver for the copy; no host copy) or staged (host
    /// threads read them into pinned buffers first). The same bytes either way; where the
    /// driver refuses to register pages, uploads are staged and a note says so. Default from
    /// $GLMDIFF_UPLOAD_FROM.
    #[arg(
        long,
        value_enum,
        env = "GLMDIFF_UPLOAD_FROM",
        default_value = "mapped"
    )]
    pub upload_from: crate::words::UploadFrom,
    /// Microseconds the upload thread sleeps after each registration of the model file's pages
    /// (`--upload-from mapped`), so that other threads' calls into the CUDA driver get their
    /// turn between two; 0 (the default) does not sleep. Only the speed changes. Default from
    /// $GLMDIFF_REGISTER_PAUSE.
    #[arg(
        long,
        value_name = "MICROS",
        env = "GLMDIFF_REGISTER_PAUSE",
        default_value = "0",
        value_parser = clap::value_parser!(u64).range(0..=100_000)
    )]
    pub register_pause: u64,
}

/// The flags `run` and `compare` share: which hooks, floors and precisions, and the outputs.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Compare only hooks matching these globs (repeatable); optional points (attn_probs, exp.E.out) only when named.
    #[arg(long, value_name = "GLOB")]
    pub hook: Vec<String>,
    /// Expand every layer in the table (passing layers are folded to one line by default).
    #[arg(long)]
    pub all_steps: bool,
    /// Replace the floor of matching hooks: 'GLOB=VALUE' (relative L2), repeatable.
    #[arg(long, value_name = "GLOB=VALUE", value_parser = parse_tol)]
    pub tol: Vec<(String, f64)>,
    /// The candidate's precision for matching hooks: 'GLOB=DTYPE' (f64, f32, tf32, f16, bf16, fp8: tf32 and fp8 round the operands of products), repeatable, e.g. 'blk.*.indexer_*=fp8'; '*=DTYPE' also sets the precision of a trace whose dtype names none.
    #[arg(long, value_name = "GLOB=DTYPE", value_parser = PrecisionOverride::parse)]
    pub precision: Vec<PrecisionOverride>,
    /// Write the results as JSON (docs/run-json.md; `-`: stdout, the report then on stderr).
    /// Written atomically.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write an SVG plot of the error per layer. Written atomically.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// `glmdiff compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The reference trace (.safetensors).
    pub reference: PathBuf,
    /// The candidate trace (.safetensors); its `dtype` metadata sets the floors (inferred from its values when it has none).
    pub candidate: PathBuf,
    /// A JSON object or TOML table (by extension) mapping the candidate's hook names to glmdiff's ({"their.name": "blk.0.q_a"}).
    #[arg(long, value_name = "FILE")]
    pub map: Option<PathBuf>,
    /// The traces' model: floors by step (reduction lengths, quant types) and expert flips' margins (selection bias, groups) as run has them.
    #[arg(long, value_name = "FILE.gguf")]
    pub model: Option<PathBuf>,
    /// What to compare and how to report it.
    #[command(flatten)]
    pub report: ReportArgs,
}

/// `glmdiff step`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct StepArgs {
    /// The case directory (`glmdiff run --repro DIR` writes one).
    pub dir: PathBuf,
    /// The candidate: the case's stored output (default), cpu (a second reference), or cuda /
    /// cuda:N (the CUDA engine on device N).
    #[arg(long, value_name = "ENGINE", value_parser = Against::parse_engine)]
    pub against: Option<Against>,
    /// Replace the floor (relative L2) the candidate is judged by.
    #[arg(long, value_name = "VALUE", value_parser = parse_nonneg)]
    pub tol: Option<f64>,
    /// Test which known bug reproduces the candidate's output (as `run --explain`).
    #[arg(long)]
    pub explain: bool,
    /// Write the result as JSON (`-`: stdout, the report then on stderr). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Weight uploads of the CUDA engine.
    #[command(flatten)]
    pub prefetch: PrefetchArgs,
}

/// `glmdiff regress`.
#[derive(Debug, Args)]
pub struct RegressArgs {
    /// The suite: a TOML file of [[case]] tables (docs/regress.md); paths are relative to it.
    pub suite: PathBuf,
    /// Write one JSON record per case (run's --json document plus the case's results; `-`:
    /// stdout, the table then on stderr). Written atomically.
    #[arg(long, value_name = "FILE")]
    pub jsonl: Option<PathBuf>,
    /// Write the results as JUnit XML (one testcase per case: a failure with the failed checks, an
    /// error with why it could not run), the format CI systems read. Written atomically.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// An earlier --jsonl: print new failures, fixed cases and metrics that moved by more than 2x;
    /// a moved metric, first divergence or top-1 agreement (drift) exits 1.
    #[arg(long, value_name = "OLD.jsonl")]
    pub baseline: Option<PathBuf>,
    /// Run only the cases whose name matches one of these globs (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub case: Vec<String>,
    /// Reference cache directory for `layer`/`layers` cases (default as for `run`).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Compute the layers before a case's start without reading or writing the cache.
    #[arg(long)]
    pub no_cache: bool,
    /// Weight uploads of the CUDA engine.
    #[command(flatten)]
    pub prefetch: PrefetchArgs,
}

/// `glmdiff synth`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct SynthArgs {
    /// Architecture: glm-dsa or deepseek2.
    #[arg(long)]
    pub arch: String,
    /// Dimensions: glm5, deepseek-v3 or tiny.
    #[arg(long, default_value = "tiny")]
    pub dims: String,
    /// Number of layers to write (default: all of the chosen dimensions).
    #[arg(long, value_parser = parse_layer_count)]
    pub layers: Option<u32>,
    /// Type mix: ud-q4_k_xl, or one GGML type name such as q8_0 or f32.
    #[arg(long, default_value = "ud-q4_k_xl")]
    pub types: String,
    /// Random seed.
    #[arg(long, default_value_t = 0, value_parser = parse_seed)]
    pub seed: u64,
    /// Output GGUF. Written atomically.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// `glmdiff bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Dequantization speed per type, single thread and all threads, against libggml (llama.cpp's C) and gguf-py.
    Dequant(BenchDequantArgs),
    /// CPU reference time per layer (dequant vs arithmetic), bytes dequantized, peak RSS.
    Layer(BenchLayerArgs),
    /// `run`'s pipeline timed per layer and side against floors, projected to a whole model.
    Run(BenchRunArgs),
}

/// `glmdiff bench dequant`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct BenchDequantArgs {
    /// Only these types (comma separated names, e.g. q4_k,q8_0).
    #[arg(long, value_delimiter = ',')]
    pub types: Vec<String>,
    /// Benchmark the CUDA kernels of this device instead (bytes moved per second against a
    /// device-to-device copy measured in the same run).
    #[arg(long, value_name = "N", value_parser = parse_device)]
    pub device: Option<usize>,
    /// Time llama.cpp's C dequantizers from this libggml-base shared library in the same run,
    /// on the same bytes, one thread, and check their output against glmdiff's bit for bit
    /// (a difference exits 1).
    #[arg(long, value_name = "PATH", conflicts_with = "device")]
    pub libggml: Option<PathBuf>,
    /// Values per type (default 16777216: 64 MiB of f32 output, beyond most caches; a small
    /// count such as 262144 keeps the output in cache and times the arithmetic alone).
    #[arg(long, value_name = "N", value_parser = parse_elements, conflicts_with = "device")]
    pub elements: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `glmdiff bench layer`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct BenchLayerArgs {
    /// A model to run (default: a synthetic GLM-5-dimension model written to a temporary file).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Token counts to time (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16", allow_hyphen_values = true, value_parser = parse_token_count)]
    pub tokens: Vec<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `glmdiff bench run`.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct BenchRunArgs {
    /// A model to run (default: a synthetic GLM-5-dimension model, two dense and two MoE
    /// layers, written to a temporary file).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Token counts to time (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "16,1024,4096", allow_hyphen_values = true, value_parser = parse_token_count)]
    pub tokens: Vec<usize>,
    /// Layers A..B (end exclusive) to time (default: from 0 through the second MoE layer).
    #[arg(long, value_name = "A..B", allow_hyphen_values = true, value_parser = parse_range)]
    pub layers: Option<Range<u64>>,
    /// The candidate: auto (cuda when a device is present, else cpu), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_name = "ENGINE", value_parser = Against::parse)]
    pub against: Against,
    /// Modes, as for run: both, replay or chained.
    #[arg(long, value_enum, default_value = "both")]
    pub mode: Modes,
    /// The CUDA engine's precision, as for run: f32 or bf16.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: CudaDtype,
    /// Project the whole run to this model's layer counts: glm5 (3 dense + 75 MoE) or
    /// deepseek-v3 (3 + 58) (default: the model's own).
    #[arg(long, value_name = "MODEL")]
    pub project: Option<String>,
    /// Timed passes per token count (the fastest kept per layer).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_reps)]
    pub reps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Weight uploads of the CUDA engine.
    #[command(flatten)]
    pub prefetch: PrefetchArgs,
}

/// Parses a switch's value: `true` when its flag is given, else its environment variable's
/// value (its default `0` when unset): on unless empty or `0`.
pub fn parse_switch(s: &str) -> Result<bool> {
    Ok(!s.is_empty() && s != "0")
}

/// `--progress`: seconds between plain progress lines, or `None` for `off`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProgressEvery(pub Option<f64>);

/// Parses `--progress`: seconds between plain progress lines (0 to 86400; under 0.2 repeats
/// every 0.2), or `off`.
pub fn parse_progress(s: &str) -> Result<ProgressEvery> {
    let t = s.trim();
    if t == "off" {
        return Ok(ProgressEvery(None));
    }
    match t.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=86_400.0).contains(&v) => Ok(ProgressEvery(Some(v))),
        _ => bail!("{s:?} is not a number of seconds from 0 to 86400, or off"),
    }
}

/// `--compare-pool`: the comparison's pool (see [`parse_compare_pool`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComparePool(pub Option<usize>);

/// Parses `--compare-pool`: `background` (`None`) or a number of threads of 1 or more.
pub fn parse_compare_pool(s: &str) -> Result<ComparePool> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("background") {
        return Ok(ComparePool(None));
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(ComparePool(Some(n))),
        _ => bail!("expected `background` or a number of threads of 1 or more, got `{s}`"),
    }
}

/// Parses `--cpu-simd`: base, avx2 or avx512 (any case).
pub fn parse_cpu_simd(s: &str) -> Result<Level> {
    Level::from_name(s).with_context(|| format!("{s:?} is not a level: base, avx2 or avx512"))
}

/// Parses a count of timed passes (at least 1).
pub fn parse_reps(s: &str) -> Result<usize> {
    const RULE: &str = "repetitions are integers from 1";
    match unsigned(s, "repetition count", RULE)? {
        0 => bail!("repetition count 0: {RULE}"),
        n => Ok(n),
    }
}

/// Parses `A..B` (end exclusive), `A..` is not allowed: both ends are needed.
pub fn parse_range(s: &str) -> Result<Range<u64>> {
    let (a, b) = s
        .split_once("..")
        .with_context(|| format!("expected a range A..B, got {s:?}"))?;
    let a: u64 = unsigned(a, "range start", "A..B takes integers from 0")?;
    let b: u64 = unsigned(b, "range end", "A..B takes integers from 0")?;
    if a >= b {
        bail!("range {a}..{b} is empty (the end is exclusive)");
    }
    Ok(a..b)
}

/// Parses an integer of type `T` that cannot be negative; the error names `what` the value is,
/// whether it was negative, too large or not an integer, and `rule` (the values allowed).
fn unsigned<T: TryFrom<i128>>(s: &str, what: &str, rule: &str) -> Result<T> {
    let t = s.trim();
    match t.parse::<i128>() {
        Ok(v) if v < 0 => bail!("{what} {v} is negative: {rule}"),
        Ok(v) => T::try_from(v).map_err(|_| anyhow::anyhow!("{what} {v} is too large: {rule}")),
        Err(_) => bail!("{what} {t:?} is not an integer: {rule}"),
    }
}

/// Parses a layer index (`run --layer`): an integer from 0 (the model's layer count is checked
/// once it is open).
pub fn parse_layer(s: &str) -> Result<u64> {
    unsigned(
        s,
        "layer",
        "a layer is an integer in 0..N, N the model's layer count",
    )
}

/// Parses a layer count (`synth --layers`): an integer from 1 (0 and counts over the chosen
/// dimensions' are refused by `synth`, which names them).
pub fn parse_layer_count(s: &str) -> Result<u32> {
    unsigned(s, "layer count", "the layer count is an integer from 1")
}

/// Parses a CUDA device ordinal: an integer from 0 (the first GPU).
pub fn parse_device(s: &str) -> Result<usize> {
    unsigned(
        s,
        "device",
        "a CUDA device ordinal is an integer from 0 (the first GPU)",
    )
}

/// Parses a random seed: an integer in 0..2^64.
pub fn parse_seed(s: &str) -> Result<u64> {
    unsigned(s, "seed", "a seed is an integer in 0..2^64")
}

/// The most elements `bench dequant --elements` takes: 2^34, 64 GiB of f32 output per copy
/// (the benchmark holds the source blocks and two f32 outputs at once).
pub const MAX_BENCH_ELEMENTS: usize = 1 << 34;

/// Parses `bench dequant --elements`: an integer from 1 to [`MAX_BENCH_ELEMENTS`] (rounded
/// down to whole blocks, at least one block, by the benchmark).
pub fn parse_elements(s: &str) -> Result<usize> {
    const RULE: &str = "the element count is an integer from 1 to 2^34 (17179869184)";
    let n: usize = unsigned(s, "element count", RULE)?;
    if n == 0 {
        bail!("element count 0: {RULE}");
    }
    if n > MAX_BENCH_ELEMENTS {
        bail!("element count {n} is too large: {RULE}; the benchmark holds about 12 bytes per element");
    }
    Ok(n)
}

/// Parses one token count of `bench layer --tokens` (0 is refused by the command, which names
/// the whole list).
pub fn parse_token_count(s: &str) -> Result<usize> {
    unsigned(s, "token count", "token counts are integers from 1")
}

/// Parses one token id of `--tokens`: an integer in `0..vocab` (the vocabulary is checked
/// against the model once it is open). A negative id is refused here with that range rather
/// than taken for a flag.
pub fn parse_token_id(s: &str) -> Result<u32> {
    let t = s.trim();
    match t.parse::<i128>() {
        Ok(v) if v < 0 => bail!("token id {v} is negative: token ids are integers in 0..vocab (the model's vocabulary size)"),
        Ok(v) => u32::try_from(v).map_err(|_| {
            anyhow::anyhow!(
                "token id {v} is too large: token ids are integers in 0..vocab (the model's vocabulary size)"
            )
        }),
        Err(_) => bail!("token id {t:?} is not an integer: token ids are integers in 0..vocab, comma separated (e.g. 1,2,3)"),
    }
}

/// Parses a finite, non-negative number.
pub fn parse_nonneg(s: &str) -> Result<f64> {
    let v: f64 = s
        .trim()
        .parse()
        .with_context(|| format!("{s:?} is not a number"))?;
    if !v.is_finite() || v < 0.0 {
        bail!("{v} must be finite and not negative");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_reject_bad_input() {
        assert_eq!(parse_range("2..5").unwrap(), 2..5);
        assert!(parse_range("5..5").is_err());
        assert!(parse_range("x..5").is_err());
        assert!(parse_range("5").is_err());
    }

    #[test]
    fn token_ids_parse_and_reject_bad_input() {
        use clap::Parser;
        assert_eq!(parse_token_id(" 7").unwrap(), 7);
        for bad in ["-1", "4294967296", "x", "1.5"] {
            let e = parse_token_id(bad).unwrap_err().to_string();
            assert!(
                e.contains("token ids are integers in 0..vocab"),
                "{bad}: {e}"
            );
        }
        // `--tokens -1` and `--tokens 1,-2` reach the parser instead of being taken for a flag.
        for list in ["-1", "1,-2", "-1,2"] {
            let e = Cli::try_parse_from(["glmdiff", "run", "m.gguf", "--tokens", list])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("is negative: token ids are integers in 0..vocab"),
                "{list}: {e}"
            );
            assert!(!e.contains("-- -"), "{list}: {e}");
        }
        // A flag after --tokens is still a flag.
        let c = Cli::try_parse_from(["glmdiff", "run", "m.gguf", "--tokens", "1,2", "--hook", "x"])
            .unwrap();
        let Command::Run(r) = c.command else {
            panic!("not run")
        };
        assert_eq!(
            (r.tokens, r.report.hook),
            (Some(vec![1, 2]), vec!["x".to_string()])
        );
    }

    #[test]
    fn numeric_flags_take_negative_values_to_their_parsers() {
        use clap::Parser;
        let e = Cli::try_parse_from(["glmdiff", "run", "m.gguf", "--layer", "-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer -1 is negative"), "{e}");
        let e = Cli::try_parse_from([
            "glmdiff",
            "synth",
            "--arch",
            "x",
            "--seed",
            "99999999999999999999",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("seed 99999999999999999999 is too large"), "{e}");
        // Values that are fine still parse, and the flag after them is still a flag.
        let c = Cli::try_parse_from([
            "glmdiff",
            "run",
            "m.gguf",
            "--layer",
            "2",
            "--hook",
            "x",
            "--devices",
            "0,1",
        ])
        .unwrap();
        let Command::Run(r) = c.command else {
            panic!("not run")
        };
        assert_eq!((r.layer, r.devices), (Some(2), vec![0, 1]));
        assert_eq!(r.report.hook, vec!["x".to_string()]);
        let c = Cli::try_parse_from([
            "glmdiff", "dequant", "m.gguf", "t", "--rows", "0..2", "--out", "x.npy",
        ])
        .unwrap();
        let Command::Dequant(d) = c.command else {
            panic!("not dequant")
        };
        assert_eq!(d.rows, Some(0..2));
    }

    #[test]
    fn tolerances_parse_and_reject_bad_input() {
        assert_eq!(
            parse_tol("blk.*.moe_*=1e-5").unwrap(),
            ("blk.*.moe_*".to_string(), 1e-5)
        );
        assert!(parse_tol("blk.*").is_err());
        assert!(parse_tol("=1").is_err());
        assert!(parse_tol("x=-1").is_err());
        assert!(parse_tol("x=nan").is_err());
    }

    /// A switch is on when its flag is given, else from its variable's value unless that is
    /// empty or 0 (unset: off).
    #[test]
    fn switches_take_their_variables_values() {
        use clap::Parser;
        for (v, on) in [
            ("true", true),
            ("1", true),
            ("yes", true),
            ("false", true),
            ("", false),
            ("0", false),
        ] {
            assert_eq!(parse_switch(v).unwrap(), on, "{v:?}");
        }
        let pageable = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "dequant-check", "m.gguf"], args].concat());
            let Command::DequantCheck(d) = c.unwrap().command else {
                panic!("not dequant-check")
            };
            d.pageable
        };
        assert!(pageable(&["--pageable"]));
        if std::env::var_os("GLMDIFF_DCHECK_PAGEABLE").is_none() {
            assert!(!pageable(&[]));
        }
        let no_prefetch = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "run", "m.gguf"], args].concat());
            let Command::Run(r) = c.unwrap().command else {
                panic!("not run")
            };
            r.prefetch.no_prefetch
        };
        assert!(no_prefetch(&["--no-prefetch"]));
        if std::env::var_os("GLMDIFF_NO_PREFETCH").is_none() {
            assert!(!no_prefetch(&[]));
        }
        use crate::words::ExpertUploads;
        let uploads = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "bench", "run"], args].concat());
            let Command::Bench(BenchCommand::Run(r)) = c.map_err(|e| e.to_string())?.command else {
                panic!("not bench run")
            };
            Ok::<_, String>(r.prefetch.expert_uploads)
        };
        for (w, m) in [
            ("auto", ExpertUploads::Auto),
            ("routed", ExpertUploads::Routed),
            ("whole", ExpertUploads::Whole),
        ] {
            assert_eq!(uploads(&["--expert-uploads", w]), Ok(m));
        }
        if std::env::var_os("GLMDIFF_EXPERT_UPLOADS").is_none() {
            assert_eq!(uploads(&[]), Ok(ExpertUploads::Auto));
        }
        let e = uploads(&["--expert-uploads", "some"]).unwrap_err();
        assert!(
            e.contains("auto") && e.contains("routed") && e.contains("whole"),
            "{e}"
        );
        use crate::words::UploadFrom;
        let from = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "run", "m.gguf"], args].concat());
            let Command::Run(r) = c.map_err(|e| e.to_string())?.command else {
                panic!("not run")
            };
            Ok::<_, String>(r.prefetch.upload_from)
        };
        assert_eq!(from(&["--upload-from", "staged"]), Ok(UploadFrom::Staged));
        assert_eq!(from(&["--upload-from", "mapped"]), Ok(UploadFrom::Mapped));
        if std::env::var_os("GLMDIFF_UPLOAD_FROM").is_none() {
            assert_eq!(from(&[]), Ok(UploadFrom::Mapped));
        }
        let e = from(&["--upload-from", "stage"]).unwrap_err();
        assert!(e.contains("mapped") && e.contains("staged"), "{e}");
        let pause = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "run", "m.gguf"], args].concat());
            let Command::Run(r) = c.map_err(|e| e.to_string())?.command else {
                panic!("not run")
            };
            Ok::<_, String>(r.prefetch.register_pause)
        };
        assert_eq!(pause(&["--register-pause", "50"]), Ok(50));
        if std::env::var_os("GLMDIFF_REGISTER_PAUSE").is_none() {
            assert_eq!(pause(&[]), Ok(0));
        }
        let e = pause(&["--register-pause", "100001"]).unwrap_err();
        assert!(e.contains("100001") && e.contains("0..=100000"), "{e}");
        use crate::words::GpuWait;
        let wait = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff"], args, &["run", "m.gguf"]].concat());
            Ok::<_, String>(c.map_err(|e| e.to_string())?.gpu_wait)
        };
        for (w, m) in [
            ("block", GpuWait::Block),
            ("spin", GpuWait::Spin),
            ("yield", GpuWait::Yield),
            ("auto", GpuWait::Auto),
        ] {
            assert_eq!(wait(&["--gpu-wait", w]), Ok(m));
        }
        if std::env::var_os("GLMDIFF_GPU_WAIT").is_none() {
            assert_eq!(wait(&[]), Ok(GpuWait::Auto));
        }
        let e = wait(&["--gpu-wait", "sleep"]).unwrap_err();
        assert!(e.contains("block") && e.contains("spin"), "{e}");
        let pool = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "run", "m.gguf"], args].concat());
            Ok::<_, String>(c.map_err(|e| e.to_string())?.compare_pool)
        };
        assert_eq!(pool(&["--compare-pool", "3"]), Ok(ComparePool(Some(3))));
        assert_eq!(
            pool(&["--compare-pool", "Background"]),
            Ok(ComparePool(None))
        );
        if std::env::var_os("GLMDIFF_COMPARE_POOL").is_none() {
            assert_eq!(pool(&[]), Ok(ComparePool(None)));
        }
        for bad in ["0", "-1", "two"] {
            let e = pool(&["--compare-pool", bad]).unwrap_err();
            assert!(e.contains("background"), "{e}");
        }
        use crate::words::Switch;
        let ahead = |args: &[&str]| {
            let c = Cli::try_parse_from([&["glmdiff", "bench", "run"], args].concat());
            Ok::<_, String>(c.map_err(|e| e.to_string())?.candidate_ahead)
        };
        assert_eq!(ahead(&["--candidate-ahead", "on"]), Ok(Switch::On));
        assert_eq!(ahead(&["--candidate-ahead", "off"]), Ok(Switch::Off));
        if std::env::var_os("GLMDIFF_CANDIDATE_AHEAD").is_none() {
            assert_eq!(ahead(&[]), Ok(Switch::Off));
        }
        let e = ahead(&["--candidate-ahead", "yes"]).unwrap_err();
        assert!(e.contains("on") && e.contains("off"), "{e}");
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
