//! glmdiff: find the first step where a GPU forward pass of a quantized MoE GGUF model
//! (GLM-5 `glm-dsa`, DeepSeek-V3 `deepseek2`) diverges from a CPU reference.
//!
//! # Layers
//! From the bottom; each module imports only from modules listed before it (`use crate::`):
//!
//! 1. [`util`]: glob matching, atomic writes, array files, SplitMix64, top-k with ties. Imports
//!    nothing from the crate.
//! 2. [`quant`]: the GGML type table and the dequantizers. Imports nothing from the crate.
//! 3. [`gguf`]: the file format (reader, split shards, streaming writer); uses `quant` for tensor
//!    types and `util`.
//! 4. [`model`]: hyperparameters, metadata keys, tensor names, weight views, the ordered steps,
//!    and the facts `inspect` shows; uses `gguf`, `quant`, `util`.
//! 5. [`engine`]: the `Engine` trait and the CPU reference; uses `model`, `util`.
//! 6. [`trace`]: sinks, hook selection, trace files; uses `engine`, `model`, `util`.
//! 7. [`driver`]: walks the steps over an engine into a sink; uses `trace`, `engine`, `model`.
//! 8. [`tokenizer`]: byte-level BPE from GGUF metadata; uses only `gguf`.
//! 9. [`synth`]: synthetic GGUFs; uses `tokenizer`, `model`, `gguf`, `quant`, `util`.
//! 10. [`bench`](mod@bench): benchmarks that measure and return data; uses `synth`, `driver`,
//!     `trace`, `engine`, `model`, `gguf`, `quant`, `util`.
//! 11. [`report`]: all formatting for stdout (tables, JSON) of the data `model` and `bench`
//!     return; uses `bench`, `model`, `util`.
//! 12. [`cli`]: the flags. Imports nothing from the crate.
//! 13. [`cmd`]: one module per command, turning flags from `cli` into calls to the layers below
//!     and handing results to `report`; the only module that uses them all.
//!
//! In the library only `report` and `cmd` write to stdout or stderr.
#![warn(missing_docs)]

pub mod bench;
pub mod cli;
pub mod cmd;
pub mod compare;
pub mod driver;
pub mod engine;
pub mod gguf;
pub mod model;
pub mod quant;
pub mod report;
pub mod synth;
pub mod tensor;
pub mod tokenizer;
pub mod trace;
pub mod util;
