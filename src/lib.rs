//! glmdiff: find the first step where a GPU forward pass of a quantized MoE GGUF model
//! (GLM-5 `glm-dsa`, DeepSeek-V3 `deepseek2`) diverges from a CPU reference.
//!
//! Layers, from the bottom: [`gguf`] (the file format) and [`quant`] (types and
//! dequantization); [`cmd`] turns flags from [`cli`] into work and [`report`] prints.
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
