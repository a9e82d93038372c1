//! glmdiff: find the first step where a GPU forward pass of a quantized MoE GGUF model
//! (GLM-5 `glm-dsa`, DeepSeek-V3 `deepseek2`) diverges from a CPU reference.
//!
//! # Layers
//! From the bottom; each module imports only from modules listed before it (`use crate::`):
//!
//! 1. [`util`]: glob matching, atomic writes (and the temporaries in flight an interrupt
//!    removes), the output guard (outputs never overwrite inputs), array files, the cache
//!    directory and the FNV-1a hash, SplitMix64, top-k with ties, the progress trait, thread
//!    pools of lower priority. Imports nothing from the crate.
//! 2. [`quant`]: the GGML type table and the dequantizers (each compiled for the baseline,
//!    AVX2 and AVX-512 and chosen at run time, [`quant::simd`]). Imports nothing from the crate;
//!    per-type facts of higher layers (CUDA kernel stems, how `synth` and `bench` draw blocks,
//!    `synth`'s fallback type for rows that are not whole blocks) live in its rows as plain data
//!    that those layers interpret.
//! 3. [`tensor`]: host tensors (shape + f32/i32 values), the currency between engines, traces
//!    and comparisons. Imports nothing from the crate.
//! 4. [`precision`]: number formats and compute precisions (storage, accumulation), which
//!    engines declare and the floors of `compare` read. Imports nothing from the crate.
//! 5. [`gguf`]: the file format (reader, split shards, streaming writer); uses `quant` for tensor
//!    types and `util`.
//! 6. [`model`]: hyperparameters, metadata keys, tensor names, weight descriptions (tensor,
//!    row range, raw bytes; kv_b split or legacy) that engines realise, the ordered steps and
//!    the GGUF tensors each reads, and the facts `inspect` shows; uses `gguf`, `quant`, `util`.
//! 7. [`gpu`]: the device layer: devices, NVRTC, the tables generated from `quant` as CUDA
//!    source, the dequant and comparison kernels; uses `quant`, `util` (the cache directory and
//!    its hash).
//! 8. [`engine`]: the `Engine` trait (steps and weight residency hooks), the CPU reference,
//!    which dequantizes the descriptions (and measures nothing), and (feature `cuda`) the CUDA
//!    engine; uses `model`, `quant`, `tensor`, `precision`, `util`, and `gpu` for the GPU.
//! 9. [`trace`]: sinks (one tensor, or reference/candidate pairs), hook selection, trace files,
//!    the reference cache; uses `model`, `gguf`, `tensor`, `precision`, `util`.
//! 10. [`words`]: the run's words as typed values (the candidate, the modes, the CUDA engine's
//!     precision, precision and floor overrides), parsed in one place for the flags, the
//!     pipelines and the regression suites; uses `precision`, `trace` (the mode).
//! 11. [`compare`]: metrics, tolerance floors, verdicts, first divergence, output distributions;
//!     uses `trace` (it is a pair sink), `model`, `tensor`, `precision`, `util`.
//! 12. [`driver`]: walks the steps over one engine into a sink, or over a reference and a
//!     candidate (engine or trace) into a pair sink, in replay and chained modes; uses `trace`,
//!     `engine`, `model`, `gguf`, `util`.
//! 13. [`explain`]: the known bugs of [`explain::fault`] (the `--inject` kinds, `FaultEngine`
//!     around any engine; that room uses only `engine`, `model`, `quant`, `util`), and
//!     `--explain` and step cases: the first failing replay step captured with its inputs (a
//!     pair sink in front of a comparison), recomputed under each known bug and ranked;
//!     `--repro` cases written and read; uses `driver`, `compare`, `engine`, `trace`, `model`,
//!     `gguf`, `quant`, `util`.
//! 14. [`regress`]: suites of `run` cases (their selection, the command that re-runs one),
//!     their expectations, the facts of a case's run and the changes against a baseline; uses
//!     `compare`, `trace`, `util`.
//! 15. [`tokenizer`]: byte-level BPE from GGUF metadata; uses only `gguf`.
//! 16. [`synth`]: synthetic GGUFs; uses `tokenizer`, `model`, `gguf`, `quant`, `util`.
//! 17. [`bench`](mod@bench): benchmarks that measure and return data (the layer benchmark
//!     wraps the CPU reference in its own counting decorator; `bench run` times `run`'s
//!     pipeline through a trait `session` implements); uses `synth`, `driver`, `gpu` (the GPU
//!     dequant benchmark, the copy floors), `trace`, `engine`, `model`, `gguf`, `quant`, `util`.
//! 18. [`hf`]: Hugging Face checkpoints (config, shards, BF16/F16/F32/FP8 block-scaled reads).
//!     Imports nothing from the crate.
//! 19. [`wcheck`]: `weights-check`, a GGUF tensor by tensor against its HF checkpoint or another
//!     GGUF (mapping, streamed comparison, diagnosis); uses `hf`, `gguf`, `quant`, `model`, `util`.
//! 20. [`dcheck`]: `dequant-check`: the tensors asked, and (feature `cuda`) their raw blocks
//!     dequantized on the device and compared there with the CPU's, streamed in chunks through
//!     pinned staging on a copy stream, on one device or spread over several; the measured
//!     rates and projections to a whole model; uses `gpu`, `gguf`, `quant`, `util`.
//! 21. [`report`]: all formatting for stdout (tables, JSON, plots, progress bars) of the data
//!     the layers below return; uses `compare`, `explain`, `regress`, `dcheck`, `bench`,
//!     `wcheck`, `synth` (the summary of a file written), `driver` (layer timings), `model`,
//!     `trace`, `util`.
//! 22. [`session`]: the pipelines of `run`, `compare`, `step`, `trace` and `regress` (and
//!     `run`'s as `bench run` times it): plain values checked into a configuration before any
//!     work, then one run that returns data (what must be said at once goes through a
//!     callback); uses `driver`, `explain`, `compare`, `engine`, `trace`, `regress`, `gpu`,
//!     `tokenizer`, `bench` (the pipeline trait it implements), `model`, `gguf`, `tensor`,
//!     `util`, and the data types `report` prints (`Header`, `EngineDesc`, `StepReport`,
//!     `NextToken`).
//! 23. [`cli`]: the flags; uses `words` (the typed choices of `run`), `session` and `compare`.
//! 24. [`cmd`]: one module per command, turning flags from `cli` into calls to the layers below
//!     (with the output guard before any work) and handing results to `report`, then choosing
//!     the exit code; it computes nothing itself.
//!
//! In the library only `report` and `cmd` write to stdout or stderr.
#![warn(missing_docs)]

pub mod bench;
pub mod cli;
pub mod cmd;
pub mod compare;
pub mod dcheck;
pub mod driver;
pub mod engine;
pub mod explain;
pub mod gguf;
pub mod gpu;
pub mod hf;
pub mod model;
pub mod precision;
pub mod quant;
pub mod regress;
pub mod report;
pub mod session;
pub mod synth;
pub mod tensor;
pub mod tokenizer;
pub mod trace;
pub mod util;
pub mod wcheck;
pub mod words;
