
mod dequant;
mod common;
mod malformed;
mod cli;
mod tokenizer;
mod reference;
mod synth;
mod bench_layer;
