//! Hugging Face checkpoints: `config.json` plus `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`; BF16, F16, F32 and FP8 E4M3 with 2-D block scales
//! (`<name>_scale_inv`, DeepSeek's and GLM's FP8 releases: `w = fp8 * scale_inv[i / 128][j / 128]`,
//! the product in f32 as llama.cpp's converter computes it, `conversion/base.py` `dequant_simple`).
//!
//! Only headers are read when a checkpoint is opened (every offset, shape and dtype checked, and
//! every file the index names opened). Tensor data is read on request, by row ranges or row x
//! column blocks, with positioned reads into buffers of exactly that size: nothing is mapped, so
//! the process holds only what the caller asked for, whatever the checkpoint's size.
//! Layout: huggingface/safetensors `README.md` (u64 little-endian header length, JSON header,
//! data; `data_offsets` relative to the end of the header).

pub mod config;
pub mod dtype;

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub use config::HfConfig;
pub use dtype::Dtype;

/// File of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Suffix of FP8 block-scale tensors (`X.weight` -> `X.weight_scale_inv`).
pub const SCALE_SUFFIX: &str = "_scale_inv";
/// Largest safetensors header accepted (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// The files of a checkpoint directory that opening it may read.
#[derive(Clone, Debug, PartialEq)]
pub struct Files {
    /// `config.json`.
    pub config: PathBuf,
    /// The index of a sharded checkpoint ([`INDEX_FILE`]), whether it is there or not.
    pub index: PathBuf,
    /// Every `.safetensors` file in the directory (none when it cannot be read).
    pub shards: Vec<PathBuf>,
}

/// The files of checkpoint directory `dir` (see [`Files`]); reads only the directory listing.
pub fn files(dir: &Path) -> Files {
    let shards = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect()
        })
        .unwrap_or_default();
    Files {
        config: dir.join("config.json"),
        index: dir.join(INDEX_FILE),
        shards,
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug)]
pub struct HfTensor {
    /// Name (`model.layers.3.mlp.experts.7.down_proj.weight`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, slowest dimension first (PyTorch order).
    pub shape: Vec<u64>,
    /// Index into the checkpoint's shards.
    pub shard: usize,
    /// Absolute file offset of the first byte.
    offset: u64,
    /// Name of the FP8 block-scale tensor, for F8_E4M3 weights that have one.
    pub scale: Option<String>,
}

impl HfTensor {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Elements per row: the last dimension (1 for a scalar).
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Rows: the product of all dimensions but the last.
    pub fn n_rows(&self) -> u64 {
        match self.shape.split_last() {
            Some((_, lead)) => lead.iter().product(),
            None => 1,
        }
    }
}

/// One opened safetensors file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    file: File,
}

/// An opened checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    /// Its `config.json`.
    pub config: HfConfig,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, HfTensor>,
}

impl Checkpoint {
    /// Opens `dir`: config, index (if any), every shard's header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if !dir.is_dir() {
            bail!(
                "hf: {} is not a directory (give the checkpoint directory, with config.json)",
                dir.display()
            );
        }
        let config = HfConfig::read(dir)?;
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        // File name -> the tensors the index assigns to it (None: take all of a single file).
        let mut wanted: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
        if index.is_file() {
            for (file, names) in read_index(&index)? {
                wanted.insert(file, Some(names));
            }
        } else if single.is_file() {
            wanted.insert(SINGLE_FILE.to_string(), None);
        } else {
            bail!(
                "hf: {}: neither {SINGLE_FILE} nor {INDEX_FILE} is there",
                dir.display()
            );
        }
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (file, names) in wanted {
            let path = dir.join(&file);
            if !path.is_file() {
                let example = names
                    .as_ref()
                    .and_then(|n| n.first())
                    .map(|n| format!(" (among them {n})"))
                    .unwrap_or_default();
                bail!(
                    "hf: {}: {INDEX_FILE} maps {} tensor(s){example} to {file}, which does not exist",
                    dir.display(),
                    names.as_ref().map_or(0, Vec::len)
                );
            }
            let f = crate::util::open_regular(&path, "hf")?;
            let shard = shards.len();
            let mut in_file = read_header(&path, &f, shard)?;
            match names {
                Some(names) => {
                    for n in names {
                        let t = in_file.remove(&n).with_context(|| {
                            format!(
                                "hf: {}: {INDEX_FILE} puts tensor {n} in {file}, but that file has no such tensor",
                                dir.display()
                            )
                        })?;
                        tensors.insert(n, t);
                    }
                }
                None => tensors.extend(in_file),
            }
            shards.push(Shard { path, file: f });
        }
        link_scales(dir, &config, &mut tensors)?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of safetensors files.
    pub fn n_shards(&self) -> usize {
        self.shards.len()
    }

    /// Weight tensors (FP8 scale tensors are part of their weight, not listed), by name.
    pub fn tensors(&self) -> impl Iterator<Item = &HfTensor> + '_ {
        let scales: std::collections::HashSet<&str> = self
            .tensors
            .values()
            .filter_map(|t| t.scale.as_deref())
            .collect();
        self.tensors
            .values()
            .filter(move |t| !scales.contains(t.name.as_str()))
    }

    /// Tensor `name`.
    pub fn get(&self, name: &str) -> Option<&HfTensor> {
        self.tensors.get(name)
    }

    /// Tensor `name`, or an error naming the checkpoint.
    pub fn tensor(&self, name: &str) -> Result<&HfTensor> {
        self.get(name).with_context(|| {
            format!(
                "hf: {}: no tensor {name} ({} tensors)",
                self.dir.display(),
                self.tensors.len()
            )
        })
    }

    /// The file that holds `t`.
    pub fn file_of(&self, t: &HfTensor) -> &Path {
        &self.shards[t.shard].path
    }

    /// Rows `rows` of tensor `name` as f32 (`[rows.len(), row_len]` row-major; rows run over all
    /// dimensions but the last).
    pub fn read_rows(&self, name: &str, rows: Range<u64>) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        self.read_block(t, rows, 0..t.row_len())
    }

    /// The block `rows` x `cols` of tensor `t` as f32, row-major `[rows.len(), cols.len()]`.
    pub fn read_block(&self, t: &HfTensor, rows: Range<u64>, cols: Range<u64>) -> Result<Vec<f32>> {
        let (n_rows, row_len) = (t.n_rows(), t.row_len());
        if rows.start > rows.end || rows.end > n_rows || cols.start > cols.end || cols.end > row_len
        {
            bail!(
                "hf: {}: tensor {} {:?}: block rows {}..{} x cols {}..{} is outside [{n_rows}, {row_len}]",
                self.file_of(t).display(),
                t.name,
                t.shape,
                rows.start,
                rows.end,
                cols.start,
                cols.end
            );
        }
        let Some(size) = t.dtype.size().filter(|_| t.dtype.readable()) else {
            bail!(
                "hf: {}: tensor {} has dtype {}, which glmdiff does not read (BF16, F16, F32, F8_E4M3)",
                self.file_of(t).display(),
                t.name,
                t.dtype.name()
            );
        };
        let n_cols = cols.end - cols.start;
        let mut out = Vec::with_capacity(((rows.end - rows.start) * n_cols) as usize);
        let file = &self.shards[t.shard];
        if n_cols == row_len {
            let mut buf = vec![0u8; ((rows.end - rows.start) * row_len * size) as usize];
            read_at(file, &mut buf, t.offset + rows.start * row_len * size)?;
            dtype::extend_f32(&t.dtype, &buf, &mut out);
        } else {
            let mut buf = vec![0u8; (n_cols * size) as usize];
            for r in rows.clone() {
                read_at(file, &mut buf, t.offset + (r * row_len + cols.start) * size)?;
                dtype::extend_f32(&t.dtype, &buf, &mut out);
            }
        }
        if t.dtype == Dtype::F8E4M3 {
            self.apply_scale(t, rows, cols, &mut out)?;
        }
        Ok(out)
    }

    /// Multiplies FP8 values by their block's `scale_inv` (f32 product, as the converter does).
    fn apply_scale(
        &self,
        t: &HfTensor,
        rows: Range<u64>,
        cols: Range<u64>,
        vals: &mut [f32],
    ) -> Result<()> {
        let Some(sname) = &t.scale else {
            bail!(
                "hf: {}: tensor {} is F8_E4M3 but has no {}{SCALE_SUFFIX} block scale (and config.json has no fp8 weight_block_size for it)",
                self.file_of(t).display(),
                t.name,
                t.name
            );
        };
        let s = self.tensor(sname)?;
        let [br, bc] = self.config.fp8_block.unwrap_or([128, 128]);
        let n_cols = (cols.end - cols.start) as usize;
        if n_cols == 0 {
            return Ok(());
        }
        let (b0, b1) = (rows.start / br, rows.end.div_ceil(br));
        let srows = self.read_block(s, b0..b1, 0..s.row_len())?;
        let sw = s.row_len() as usize;
        for (i, row) in vals.chunks_exact_mut(n_cols).enumerate() {
            let r = rows.start + i as u64;
            let srow = &srows[((r / br - b0) as usize) * sw..][..sw];
            for (j, v) in row.iter_mut().enumerate() {
                let c = cols.start + j as u64;
                *v *= srow[(c / bc) as usize];
            }
        }
        Ok(())
    }
}

/// Positioned read of exactly `buf.len()` bytes at `offset`.
fn read_at(shard: &Shard, buf: &mut [u8], offset: u64) -> Result<()> {
    read_exact_at(&shard.file, buf, offset).with_context(|| {
        format!(
            "hf: {}: cannot read {} bytes at offset {offset}",
            shard.path.display(),
            buf.len()
        )
    })
}

#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset)
}

#[cfg(windows)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match f.seek_read(&mut buf[done..], offset + done as u64)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => done += n,
        }
    }
    Ok(())
}

/// The index's `weight_map`, grouped by file: file -> tensor names.
fn read_index(path: &Path) -> Result<BTreeMap<String, Vec<String>>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("hf: cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("hf: {}: not valid JSON", path.display()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("hf: {}: no \"weight_map\" object", path.display()))?;
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().with_context(|| {
            format!(
                "hf: {}: weight_map entry {name} is {file}, expected a file name",
                path.display()
            )
        })?;
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|f| f == std::ffi::OsStr::new(file));
        if !plain {
            bail!(
                "hf: {}: weight_map entry {name} names {file:?}, which is not a plain file name in the checkpoint directory",
                path.display()
            );
        }
        by_file
            .entry(file.to_string())
            .or_default()
            .push(name.clone());
    }
    if by_file.is_empty() {
        bail!("hf: {}: weight_map is empty", path.display());
    }
    Ok(by_file)
}

/// Parses and checks one safetensors header.
fn read_header(path: &Path, file: &File, shard: usize) -> Result<BTreeMap<String, HfTensor>> {
    let len = file
        .metadata()
        .with_context(|| format!("hf: cannot stat {}", path.display()))?
        .len();
    let sh = Shard {
        path: path.to_path_buf(),
        file: file.try_clone()?,
    };
    if len < 8 {
        bail!(
            "hf: {}: {len} bytes, too short for a safetensors header length (8 bytes)",
            path.display()
        );
    }
    let mut n8 = [0u8; 8];
    read_at(&sh, &mut n8, 0)?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > len - 8 {
        bail!(
            "hf: {}: header length {n} at offset 0 exceeds the file ({len} bytes) or the limit {MAX_HEADER}",
            path.display()
        );
    }
    let mut hb = vec![0u8; n as usize];
    read_at(&sh, &mut hb, 8)?;
    let header: Value = serde_json::from_slice(&hb).with_context(|| {
        format!(
            "hf: {}: the safetensors header is not valid JSON",
            path.display()
        )
    })?;
    let obj = header.as_object().with_context(|| {
        format!(
            "hf: {}: the safetensors header is not an object",
            path.display()
        )
    })?;
    let data_start = 8 + n;
    let data_len = len - data_start;
    let mut out = BTreeMap::new();
    for (name, e) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| -> anyhow::Error {
            anyhow::anyhow!("hf: {}: tensor {name}: {what} (entry {e})", path.display())
        };
        let dtype = Dtype::parse(
            e.get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("no dtype"))?,
        );
        let shape: Vec<u64> = e
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad("a dimension is not a non-negative integer"))
            })
            .collect::<Result<_>>()?;
        let offs: Vec<u64> = e
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no data_offsets"))?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let [s, end] = offs[..] else {
            return Err(bad("data_offsets is not two non-negative integers"));
        };
        if s > end || end > data_len {
            bail!(
                "hf: {}: tensor {name}: data_offsets [{s}, {end}] outside the data section ({data_len} bytes after the header)",
                path.display()
            );
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad("shape overflows"))?;
        if let Some(size) = dtype.size() {
            if numel.checked_mul(size) != Some(end - s) {
                bail!(
                    "hf: {}: tensor {name}: shape mismatch: shape {shape:?} of {} needs {} bytes, data_offsets [{s}, {end}] hold {}",
                    path.display(),
                    dtype.name(),
                    numel.saturating_mul(size),
                    end - s
                );
            }
        }
        out.insert(
            name.clone(),
            HfTensor {
                name: name.clone(),
                dtype,
                shape,
                shard,
                offset: data_start + s,
                scale: None,
            },
        );
    }
    Ok(out)
}

/// Links each F8_E4M3 weight to its `_scale_inv` tensor and checks the scale's shape.
fn link_scales(
    dir: &Path,
    config: &HfConfig,
    tensors: &mut BTreeMap<String, HfTensor>,
) -> Result<()> {
    let names: Vec<String> = tensors
        .values()
        .filter(|t| t.dtype == Dtype::F8E4M3)
        .map(|t| t.name.clone())
        .collect();
    for name in names {
        let sname = format!("{name}{SCALE_SUFFIX}");
        let Some(s) = tensors.get(&sname) else {
            continue; // reported when the weight is read
        };
        let t = &tensors[&name];
        let [br, bc] = config.fp8_block.unwrap_or([128, 128]);
        let want: Vec<u64> = match t.shape[..] {
            [r, c] => vec![r.div_ceil(br), c.div_ceil(bc)],
            _ => bail!(
                "hf: {}: FP8 tensor {name} has shape {:?}; block scales are supported for 2-D weights only",
                dir.display(),
                t.shape
            ),
        };
        if s.shape != want || !matches!(s.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            bail!(
                "hf: {}: shape mismatch: {sname} is {} {:?}, expected F32/BF16 {:?} for {name} {:?} in {}x{} blocks",
                dir.display(),
                s.dtype.name(),
                s.shape,
                want,
                t.shape,
                br,
                bc
            );
        }
        if let Some(t) = tensors.get_mut(&name) {
            t.scale = Some(sname);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The listing keeps the `.safetensors` files only; a directory that cannot be read has none.
    #[test]
    fn files_lists_the_safetensors_of_a_directory() {
        let d = tempfile::tempdir().unwrap();
        for f in ["config.json", "a.safetensors", "b.safetensors", "notes.txt"] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        let f = files(d.path());
        let mut shards = f.shards.clone();
        shards.sort();
        assert_eq!(
            shards,
            vec![
                d.path().join("a.safetensors"),
                d.path().join("b.safetensors")
            ]
        );
        assert_eq!(f.config, d.path().join("config.json"));
        assert_eq!(f.index, d.path().join(INDEX_FILE));
        assert!(files(&d.path().join("absent")).shards.is_empty());
    }
}
