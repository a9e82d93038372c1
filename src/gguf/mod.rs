//! The GGUF file format: header, metadata values, tensor infos, split shards, bounds checks,
//! and a writer for synthetic models and fixtures. Knows nothing of any model architecture.

mod dequant;
mod file;
mod model;
mod value;
mod writer;

pub use file::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
pub use model::{
    parse_split_name, shard_paths, split_file_name, Model, TensorRef, KEY_SPLIT_COUNT,
    KEY_SPLIT_NO, KEY_SPLIT_TENSORS,
};
pub use value::{Value, ValueType};
pub use writer::{FillFn, GgufWriter, GGUF_WRITE_VERSION, MAX_TENSOR_NAME_BYTES};
