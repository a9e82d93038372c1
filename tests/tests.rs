
mod dequant;
mod common;
mod malformed;
