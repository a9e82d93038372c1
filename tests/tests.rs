
mod dequant;
mod common;
mod malformed;
mod tokenizer;
