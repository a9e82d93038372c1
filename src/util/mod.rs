//! Small shared helpers at the bottom of the crate (they import nothing from it): glob matching,
//! atomic file writes and the temporaries in flight, the output guard (outputs never overwrite
//! inputs), array file formats, the cache directory ([`cache_dir`]), the FNV-1a hash ([`hash`]),
//! the SplitMix64 generator ([`rng`]), top-k with ties ([`topk`]) and shell quoting ([`shell`]).

pub mod atomic;
pub mod cache_dir;
pub mod glob;
pub mod guard;
pub mod hash;
pub mod npy;
pub mod progress;
pub mod rng;
pub mod safetensors_stream;
pub mod shell;
pub mod topk;
