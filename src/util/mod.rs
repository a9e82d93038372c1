//! Small shared helpers at the bottom of the crate (they import nothing from it): glob matching,
//! atomic file writes and the temporaries in flight, the output guard (outputs never overwrite
//! inputs), array file formats, the SplitMix64 generator ([`rng`]) and top-k with
//! ties ([`topk`]).

pub mod atomic;
pub mod glob;
pub mod guard;
pub mod npy;
pub mod progress;
pub mod rng;
pub mod safetensors_stream;
pub mod topk;
