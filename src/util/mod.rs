//! Small shared helpers: glob matching, atomic file writes, array file formats.

pub mod atomic;
pub mod glob;
pub mod npy;
pub mod safetensors_stream;
