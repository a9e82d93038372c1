//! Model knowledge for `glm-dsa` (GLM-5) and `deepseek2` (DeepSeek-V2/V3): hyperparameters from
//! GGUF metadata ([`hparams`]), tensor names and their expected shapes ([`names`]), descriptions of
//! the weights each step reads ([`weights`]: tensor and row range, kv_b split or legacy, expert
//! slices; engines realise them), RoPE/YaRN constants
//! ([`rope`]) and the ordered list of forward-pass steps ([`steps`]). No activation arithmetic
//! happens here; engines do that. [`inspect`] gathers the facts `glmdiff inspect` shows about a
//! GGUF of any architecture. [`keys`] spells the `{arch}.*` metadata keys once, for readers and
//! writers alike. [`hook_shape`] gives the shape of each hook for a model and a prompt length.

pub mod hook_shape;
pub mod hparams;
pub mod inspect;
pub mod keys;
pub mod names;
pub mod rope;
pub mod shapes;
pub mod steps;
pub mod weights;

#[cfg(test)]
pub(crate) mod testutil;

pub use hparams::{Arch, Gating, HParams, IndexerParams, RopeParams, Yarn};
pub use steps::{Op, RopeSlice, Step};
pub use weights::{KvB, WeightSlice, Weights};
