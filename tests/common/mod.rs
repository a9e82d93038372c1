//! Helpers shared by the integration tests.

pub mod gguf_bytes;
