//! Trace files: safetensors with one tensor per hook (F32, I32 for ids) and `__metadata__`
//! (`docs/hooks.md`). Written atomically; readable with the `safetensors` package alone.
//! The reader also accepts F64/F16/BF16 floats and other integer widths, so golden traces made by
//! transformers in float64 and external dumps read the same way.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

use super::Mode;
use crate::tensor::{HostData, HostTensor};
use crate::util::atomic::write_atomic;

/// Value of the `glmdiff_trace` metadata key written by this version.
pub const TRACE_FORMAT_VERSION: &str = "1";

/// What a trace records about its run (`__metadata__`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceMeta {
    /// Model file name.
    pub model: String,
    /// `general.architecture`.
    pub architecture: String,
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Engine description (`cpu`, `cuda:0 NVIDIA H200 sm_90`).
    pub engine: String,
    /// Compute precision.
    pub dtype: String,
    /// How the values were obtained (a single-engine trace is chained).
    pub mode: Mode,
    /// Further keys.
    pub extra: BTreeMap<String, String>,
}

impl TraceMeta {
    /// The `__metadata__` map: the required keys, `glmdiff_trace` and `glmdiff_version`, then extras.
    pub fn to_map(&self) -> HashMap<String, String> {
        let mut m: HashMap<String, String> = self.extra.clone().into_iter().collect();
        let tokens: Vec<String> = self.tokens.iter().map(u32::to_string).collect();
        for (k, v) in [
            ("glmdiff_trace", TRACE_FORMAT_VERSION.to_string()),
            ("model", self.model.clone()),
            ("architecture", self.architecture.clone()),
            ("tokens", format!("[{}]", tokens.join(","))),
            ("engine", self.engine.clone()),
            ("dtype", self.dtype.clone()),
            ("mode", self.mode.as_str().to_string()),
            ("glmdiff_version", env!("CARGO_PKG_VERSION").to_string()),
        ] {
            m.insert(k.to_string(), v);
        }
        m
    }
}

/// Writes `tensors` and `meta` to `path` atomically.
pub fn write_trace(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    meta: &TraceMeta,
) -> Result<()> {
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, data) = match &t.data {
                HostData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
                HostData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            };
            (name.clone(), dtype, t.shape.clone(), data)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, dtype, shape, data)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (name.as_str(), v))
                .with_context(|| format!("trace: hook {name} shape {shape:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let out = safetensors::serialize(views, Some(meta.to_map()))
        .with_context(|| format!("trace: serializing {}", path.display()))?;
    write_atomic(path, |w| Ok(w.write_all(&out)?))
}

/// Values of a trace tensor: floats widened to f64, integers to i64.
#[derive(Clone, Debug, PartialEq)]
pub enum TraceValues {
    /// F64, F32, F16 or BF16 data.
    Float(Vec<f64>),
    /// Integer data.
    Int(Vec<i64>),
}

/// One tensor of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceTensor {
    /// PyTorch-order shape.
    pub shape: Vec<usize>,
    /// Stored dtype name (`F32`, `F64`, `I32`, ...).
    pub dtype: String,
    /// The values.
    pub values: TraceValues,
}

impl TraceTensor {
    /// Float values, or an error naming the hook.
    pub fn floats(&self, name: &str) -> Result<&[f64]> {
        match &self.values {
            TraceValues::Float(v) => Ok(v),
            TraceValues::Int(_) => bail!(
                "trace: hook {name} holds {} integers, not floats",
                self.dtype
            ),
        }
    }

    /// Integer values, or an error naming the hook.
    pub fn ints(&self, name: &str) -> Result<&[i64]> {
        match &self.values {
            TraceValues::Int(v) => Ok(v),
            TraceValues::Float(_) => bail!(
                "trace: hook {name} holds {} floats, not integers",
                self.dtype
            ),
        }
    }
}

/// A trace read from a file.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// `__metadata__` (empty when the file has none).
    pub metadata: HashMap<String, String>,
    /// Tensors by hook name.
    pub tensors: BTreeMap<String, TraceTensor>,
}

impl Trace {
    /// Hook `name`, or an error naming the hook and the file's hooks count.
    pub fn get(&self, name: &str) -> Result<&TraceTensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("trace: no hook {name} among {} hooks", self.tensors.len()))
    }

    /// The `tokens` metadata parsed as a JSON list of ids.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        let s = self
            .metadata
            .get("tokens")
            .context("trace: metadata has no tokens key")?;
        serde_json::from_str(s)
            .with_context(|| format!("trace: tokens metadata {s:?} is not a JSON list of ids"))
    }
}

fn decode(dtype: Dtype, b: &[u8]) -> Result<TraceValues> {
    fn chunks<const N: usize>(b: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        b.chunks_exact(N).map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        })
    }
    Ok(match dtype {
        Dtype::F64 => TraceValues::Float(chunks::<8>(b).map(f64::from_le_bytes).collect()),
        Dtype::F32 => TraceValues::Float(
            chunks::<4>(b)
                .map(|a| f64::from(f32::from_le_bytes(a)))
                .collect(),
        ),
        Dtype::F16 => TraceValues::Float(
            chunks::<2>(b)
                .map(|a| f64::from(half::f16::from_le_bytes(a).to_f32()))
                .collect(),
        ),
        Dtype::BF16 => TraceValues::Float(
            chunks::<2>(b)
                .map(|a| f64::from(half::bf16::from_le_bytes(a).to_f32()))
                .collect(),
        ),
        Dtype::I64 => TraceValues::Int(chunks::<8>(b).map(i64::from_le_bytes).collect()),
        Dtype::I32 => TraceValues::Int(
            chunks::<4>(b)
                .map(|a| i64::from(i32::from_le_bytes(a)))
                .collect(),
        ),
        Dtype::I16 => TraceValues::Int(
            chunks::<2>(b)
                .map(|a| i64::from(i16::from_le_bytes(a)))
                .collect(),
        ),
        Dtype::I8 => TraceValues::Int(b.iter().map(|&x| i64::from(x as i8)).collect()),
        Dtype::U8 => TraceValues::Int(b.iter().map(|&x| i64::from(x)).collect()),
        Dtype::BOOL => TraceValues::Int(b.iter().map(|&x| i64::from(x != 0)).collect()),
        other => bail!("dtype {other:?} is not supported in traces"),
    })
}

/// Refuses a safetensors file cut short, with the sizes: shorter than its 8-byte header length,
/// than the header that length announces, or than the end of the data the header lays out.
/// Anything else wrong with the header is left to the safetensors parser.
pub fn check_not_truncated(path: &Path, bytes: &[u8]) -> Result<()> {
    let len = bytes.len() as u64;
    let Some(head) = bytes.get(..8) else {
        bail!(
            "trace: {} is truncated: {len} bytes, not even the 8-byte header length of a safetensors file",
            path.display()
        );
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(head);
    let header_len = u64::from_le_bytes(n);
    let header_end = header_len.saturating_add(8);
    if header_end > len {
        // A length beyond any real header is a different file, not a cut one.
        if header_len > 100_000_000 {
            bail!(
                "trace: {} is not a safetensors file: its first 8 bytes give a header of {header_len} bytes",
                path.display()
            );
        }
        bail!(
            "trace: {} is truncated: its header says it is {header_len} bytes (ending at byte {header_end}), the file has {len} bytes",
            path.display()
        );
    }
    let Ok(header) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(
        &bytes[8..header_end as usize],
    ) else {
        return Ok(());
    };
    let data_end = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let end = header_end.saturating_add(data_end);
    if end > len {
        bail!(
            "trace: {} is truncated: its header says the data ends at byte {end}, the file has {len} bytes",
            path.display()
        );
    }
    Ok(())
}

/// Whether the reader decodes `dtype` as integers ([`TraceValues::Int`]).
fn is_int(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::I64 | Dtype::I32 | Dtype::I16 | Dtype::I8 | Dtype::U8 | Dtype::BOOL
    )
}

/// Reads a trace (any safetensors file: glmdiff's, a golden trace, an external dump).
pub fn read_trace(path: &Path) -> Result<Trace> {
    let bytes =
        std::fs::read(path).with_context(|| format!("trace: cannot read {}", path.display()))?;
    check_not_truncated(path, &bytes)?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("trace: {} is not a safetensors file", path.display()))?;
    let st = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("trace: {} is not a safetensors file", path.display()))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in st.iter() {
        let values = decode(view.dtype(), view.data())
            .with_context(|| format!("trace: {}: hook {name}", path.display()))?;
        tensors.insert(
            name.to_string(),
            TraceTensor {
                shape: view.shape().to_vec(),
                dtype: format!("{:?}", view.dtype()),
                values,
            },
        );
    }
    Ok(Trace {
        metadata: meta.metadata().clone().unwrap_or_default(),
        tensors,
    })
}

/// A trace opened for reading one hook at a time (memory-mapped; a hook is decoded only when
/// asked for), so a run against a large external dump never holds the whole file in memory.
pub struct TraceFile {
    path: std::path::PathBuf,
    map: memmap2::Mmap,
    metadata: HashMap<String, String>,
    /// Hook -> (dtype, shape, byte range in the map).
    index: BTreeMap<String, (Dtype, Vec<usize>, std::ops::Range<usize>)>,
}

impl TraceFile {
    /// Opens and checks `path`: a safetensors header whose tensors lie inside the file.
    pub fn open(path: &Path) -> Result<TraceFile> {
        let file = crate::util::open_regular(path, "trace")?;
        if file.metadata().map(|m| !m.is_file()).unwrap_or(true) {
            bail!("trace: {} is not a regular file", path.display());
        }
        // SAFETY: the map is read-only and glmdiff never writes the file; a concurrent
        // truncation by another process is the usual caveat of mapped inputs.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("trace: cannot map {}", path.display()))?;
        check_not_truncated(path, &map)?;
        let (header_len, meta) = SafeTensors::read_metadata(&map)
            .with_context(|| format!("trace: {} is not a safetensors file", path.display()))?;
        let base = 8 + header_len;
        let mut index = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let (a, b) = info.data_offsets;
            let range = base + a..base + b;
            if range.end > map.len() {
                bail!(
                    "trace: {}: hook {name} ends at byte {} of a {}-byte file",
                    path.display(),
                    range.end,
                    map.len()
                );
            }
            index.insert(name.clone(), (info.dtype, info.shape.clone(), range));
        }
        Ok(TraceFile {
            path: path.to_path_buf(),
            metadata: meta.metadata().clone().unwrap_or_default(),
            map,
            index,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `__metadata__` (empty when the file has none).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Hook names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.index.keys().map(String::as_str)
    }

    /// Whether the trace has hook `name`.
    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Hook `name`'s stored shape and dtype name (`F32`, `I64`, ...), read from the header.
    pub fn hook_header(&self, name: &str) -> Option<(&[usize], String)> {
        self.index
            .get(name)
            .map(|(d, shape, _)| (shape.as_slice(), format!("{d:?}")))
    }

    /// Whether hook `name` holds integers (ids), as the reader decodes its dtype.
    pub fn holds_ints(&self, name: &str) -> Option<bool> {
        self.index.get(name).map(|(d, _, _)| is_int(*d))
    }

    /// The `tokens` metadata parsed as a JSON list of ids.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        let s = self.metadata.get("tokens").with_context(|| {
            format!("trace: {} has no tokens metadata key", self.path.display())
        })?;
        serde_json::from_str(s).with_context(|| {
            format!(
                "trace: {}: tokens metadata {s:?} is not a JSON list of ids",
                self.path.display()
            )
        })
    }

    /// Hook `name` as a host tensor (floats rounded to f32, integers to i32), `None` when the
    /// trace does not have it.
    pub fn get(&self, name: &str) -> Result<Option<HostTensor>> {
        let Some((dtype, shape, range)) = self.index.get(name) else {
            return Ok(None);
        };
        let what = || format!("trace: {}: hook {name}", self.path.display());
        let values = decode(*dtype, &self.map[range.clone()]).with_context(what)?;
        let t = match values {
            TraceValues::Float(v) => {
                HostTensor::f32(shape.clone(), v.into_iter().map(|x| x as f32).collect())
            }
            TraceValues::Int(v) => {
                let ints = v
                    .iter()
                    .map(|&x| i32::try_from(x))
                    .collect::<std::result::Result<Vec<i32>, _>>()
                    .map_err(|_| anyhow::anyhow!("an index does not fit in i32"))
                    .with_context(what)?;
                HostTensor::i32(shape.clone(), ints)
            }
        };
        t.with_context(what).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_round_trips_with_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "a".to_string(),
            HostTensor::f32(vec![2, 2], vec![1.0, -2.5, 3.0, 0.0]).unwrap(),
        );
        tensors.insert(
            "ids".to_string(),
            HostTensor::i32(vec![1, 3], vec![3, -1, 7]).unwrap(),
        );
        let meta = TraceMeta {
            model: "m.gguf".into(),
            architecture: "glm-dsa".into(),
            tokens: vec![5, 6],
            engine: "cpu".into(),
            dtype: "f32".into(),
            mode: Mode::Chained,
            extra: BTreeMap::new(),
        };
        write_trace(&p, &tensors, &meta).unwrap();
        let t = read_trace(&p).unwrap();
        assert_eq!(t.metadata["glmdiff_trace"], TRACE_FORMAT_VERSION);
        assert_eq!(t.metadata["architecture"], "glm-dsa");
        assert_eq!(t.tokens().unwrap(), vec![5, 6]);
        assert_eq!(
            t.get("a").unwrap().floats("a").unwrap(),
            &[1.0, -2.5, 3.0, 0.0]
        );
        assert_eq!(t.get("ids").unwrap().ints("ids").unwrap(), &[3, -1, 7]);
        assert_eq!(t.get("ids").unwrap().shape, vec![1, 3]);
    }
}
