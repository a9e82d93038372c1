mod bench_layer;
mod cli;
mod common;
mod dequant;
mod malformed;
mod reference;
mod synth;
mod tokenizer;
