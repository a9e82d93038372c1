//! The GGUF file format: header, metadata values, tensor infos, split shards, bounds checks,
//! a writer for synthetic models and fixtures, one tensor dequantized to `.npy` or
//! `.safetensors` ([`export_rows`]), and a tensor's content digest ([`tensor_digest`]). Knows nothing of any model architecture.

mod dequant;
mod digest;
mod export;
mod file;
mod model;
mod value;
mod writer;

pub use digest::{tensor_digest, DIGEST_PREFIX_BYTES};
pub use export::{export_rows, ExportFormat, Exported};
pub use file::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_ELEMENTS, MAX_DIMS};
pub use model::{
    parse_split_name, shard_paths, split_file_name, Model, TensorRef, KEY_SPLIT_COUNT,
    KEY_SPLIT_NO, KEY_SPLIT_TENSORS,
};
pub use value::{Value, ValueType};
pub use writer::{FillFn, GgufWriter, GGUF_WRITE_VERSION, MAX_TENSOR_NAME_BYTES};
