//! A model made of one GGUF file or of split shards `NAME-0000K-of-0000N.gguf`.
//!
//! Opening any shard opens all N: each must carry `split.no` = its index, the same
//! `split.count` and `split.tensors.count`, and together they must hold exactly
//! `split.tensors.count` distinct tensors. Metadata comes from the first shard (as llama.cpp's
//! `llama-model-loader.cpp` does); tensors are served from whichever shard holds them.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::file::{GgufFile, TensorInfo};
use super::value::Value;

/// Key holding the 0-based shard index.
pub const KEY_SPLIT_NO: &str = "split.no";
/// Key holding the number of shards.
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Key holding the total number of tensors over all shards.
pub const KEY_SPLIT_TENSORS: &str = "split.tensors.count";

/// A tensor of a model: its info and the shard that holds it.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'m> {
    /// The tensor's info.
    pub info: &'m TensorInfo,
    /// Index of the shard that holds it.
    pub shard: usize,
}

/// An opened model: one or more GGUF files.
#[derive(Debug)]
pub struct Model {
    shards: Vec<GgufFile>,
    /// (shard, index within the shard) in shard order, then file order.
    order: Vec<(usize, usize)>,
    by_name: HashMap<String, (usize, usize)>,
}

/// Splits `NAME-00001-of-00003.gguf` into (`NAME`, 1, 3).
pub fn parse_split_name(path: &Path) -> Option<(String, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    if no.len() != 5 || count.len() != 5 {
        return None;
    }
    let no: u32 = no.parse().ok()?;
    let count: u32 = count.parse().ok()?;
    Some((prefix.to_string(), no, count))
}

/// The file name of shard `no` (1-based) of `count` for `prefix`, as llama.cpp's `llama_split_path` writes it.
pub fn split_file_name(prefix: &str, no: u32, count: u32) -> String {
    format!("{prefix}-{no:05}-of-{count:05}.gguf")
}

/// Every file of the model `path` names: all N shards when its name is
/// `NAME-0000K-of-0000N.gguf` (whether they exist or not), else `path` alone. Nothing is opened.
pub fn shard_paths(path: &Path) -> Vec<PathBuf> {
    match parse_split_name(path) {
        Some((prefix, _, count)) if count >= 1 => {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (1..=count)
                .map(|k| dir.join(split_file_name(&prefix, k, count)))
                .collect()
        }
        _ => vec![path.to_path_buf()],
    }
}

fn int_key(f: &GgufFile, key: &str) -> Result<Option<i128>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => match v.as_int() {
            Some(i) => Ok(Some(i)),
            None => bail!(
                "gguf: {}: {key} has type {}, expected an integer",
                f.path().display(),
                v.value_type().name()
            ),
        },
    }
}

impl Model {
    /// Opens `path`; when its name is `NAME-0000K-of-0000N.gguf`, opens all N shards.
    pub fn open(path: &Path) -> Result<Model> {
        match parse_split_name(path) {
            Some((prefix, no, count)) => {
                if no == 0 || no > count {
                    bail!(
                        "gguf: {}: shard number {no} in the file name is outside 1..={count}",
                        path.display()
                    );
                }
                let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
                let paths: Vec<PathBuf> = (1..=count)
                    .map(|k| dir.join(split_file_name(&prefix, k, count)))
                    .collect();
                for p in &paths {
                    if !p.exists() {
                        bail!(
                            "gguf: missing shard {} of the {count}-shard model opened through {}",
                            p.display(),
                            path.display()
                        );
                    }
                }
                let shards = paths
                    .iter()
                    .map(|p| GgufFile::open(p))
                    .collect::<Result<Vec<_>>>()?;
                Self::from_shards(shards)
            }
            None => {
                let f = GgufFile::open(path)?;
                if let Some(n) = int_key(&f, KEY_SPLIT_COUNT)? {
                    if n > 1 {
                        bail!(
                            "gguf: {}: the file says it is one of {n} shards ({KEY_SPLIT_COUNT} = {n}), but its name does not follow NAME-0000K-of-{n:05}.gguf, so the other shards cannot be found",
                            path.display()
                        );
                    }
                }
                Self::from_shards(vec![f])
            }
        }
    }

    /// Builds a model from already-parsed files in shard order, checking split metadata.
    pub fn from_shards(shards: Vec<GgufFile>) -> Result<Model> {
        let n = shards.len();
        if n == 0 {
            bail!("gguf: no files given");
        }
        let mut expected_total: Option<i128> = None;
        if n > 1 || int_key(&shards[0], KEY_SPLIT_COUNT)?.is_some() {
            for (k, f) in shards.iter().enumerate() {
                let p = f.path().display();
                let count = int_key(f, KEY_SPLIT_COUNT)?.with_context(|| {
                    format!("gguf: {p}: shard {} of {n} has no {KEY_SPLIT_COUNT}", k + 1)
                })?;
                if count != n as i128 {
                    bail!(
                        "gguf: {p}: {KEY_SPLIT_COUNT} is {count}, but the model has {n} shards: this shard belongs to another model"
                    );
                }
                let no = int_key(f, KEY_SPLIT_NO)?
                    .with_context(|| format!("gguf: {p}: shard has no {KEY_SPLIT_NO}"))?;
                if no != k as i128 {
                    bail!(
                        "gguf: {p}: {KEY_SPLIT_NO} is {no}, expected {k} for shard {} of {n}",
                        k + 1
                    );
                }
                let total = int_key(f, KEY_SPLIT_TENSORS)?
                    .with_context(|| format!("gguf: {p}: shard has no {KEY_SPLIT_TENSORS}"))?;
                match expected_total {
                    None => expected_total = Some(total),
                    Some(t) if t != total => bail!(
                        "gguf: {p}: {KEY_SPLIT_TENSORS} is {total}, but shard 1 says {t}: this shard belongs to another model"
                    ),
                    _ => {}
                }
            }
        }
        let mut order = Vec::new();
        let mut by_name: HashMap<String, (usize, usize)> = HashMap::new();
        for (s, f) in shards.iter().enumerate() {
            for (i, t) in f.tensors().iter().enumerate() {
                if let Some((s0, _)) = by_name.insert(t.name.clone(), (s, i)) {
                    bail!(
                        "gguf: tensor {:?} is in both {} and {}",
                        t.name,
                        shards[s0].path().display(),
                        f.path().display()
                    );
                }
                order.push((s, i));
            }
        }
        if let Some(t) = expected_total {
            if t != order.len() as i128 {
                bail!(
                    "gguf: {}: {KEY_SPLIT_TENSORS} is {t}, but the {n} shards hold {} tensors",
                    shards[0].path().display(),
                    order.len()
                );
            }
        }
        Ok(Model {
            shards,
            order,
            by_name,
        })
    }

    /// The shards, in order (one for a single-file model).
    pub fn shards(&self) -> &[GgufFile] {
        &self.shards
    }

    /// The first shard's path (what the user opened stands for the model).
    pub fn path(&self) -> &Path {
        self.shards[0].path()
    }

    /// A short name for reports: the file name of the first shard.
    pub fn file_name(&self) -> String {
        self.path()
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Metadata, from the first shard.
    pub fn metadata(&self) -> &[(String, Value)] {
        self.shards[0].metadata()
    }

    /// The value of metadata key `key` (first shard).
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.shards[0].get(key)
    }

    /// `general.architecture`, if present.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    /// All tensors, in shard order then file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> + '_ {
        self.order.iter().map(|&(s, i)| TensorRef {
            info: &self.shards[s].tensors()[i],
            shard: s,
        })
    }

    /// Number of tensors over all shards.
    pub fn n_tensors(&self) -> usize {
        self.order.len()
    }

    /// Tensor `name`, or `None`.
    pub fn find(&self, name: &str) -> Option<TensorRef<'_>> {
        self.by_name.get(name).map(|&(s, i)| TensorRef {
            info: &self.shards[s].tensors()[i],
            shard: s,
        })
    }

    /// Tensor `name`, or an error that names the file and suggests near names.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        self.find(name).with_context(|| {
            let mut near: Vec<&str> = self
                .by_name
                .keys()
                .filter(|k| similar(k, name))
                .map(String::as_str)
                .collect();
            near.sort_unstable();
            near.truncate(5);
            let hint = if near.is_empty() {
                String::new()
            } else {
                format!("; similar names: {}", near.join(", "))
            };
            format!(
                "gguf: {}: no tensor named {name:?} among its {} tensors{hint}",
                self.path().display(),
                self.order.len()
            )
        })
    }

    /// The raw bytes of a whole tensor (zero-copy). `t` must come from this model.
    pub fn tensor_data(&self, t: TensorRef<'_>) -> Result<&[u8]> {
        self.shard_of(t)?.tensor_data(t.info)
    }

    /// The raw bytes of rows `rows` of a tensor (zero-copy). `t` must come from this model.
    pub fn row_data(&self, t: TensorRef<'_>, rows: Range<u64>) -> Result<&[u8]> {
        self.shard_of(t)?.row_data(t.info, rows)
    }

    /// Where [`Model::row_data`]`(t, rows)` lies in the model's files: the shard's path, the
    /// byte offset in it and the length; `None` for a shard held in memory (not a map of a
    /// file). `t` must come from this model.
    pub fn row_file_range(
        &self,
        t: TensorRef<'_>,
        rows: Range<u64>,
    ) -> Result<Option<(&Path, u64, u64)>> {
        let shard = self.shard_of(t)?;
        let data = shard.row_data(t.info, rows.clone())?;
        if !shard.is_mapped() {
            return Ok(None);
        }
        let offset = shard.data_start() + t.info.offset + rows.start * t.info.row_bytes();
        Ok(Some((shard.path(), offset, data.len() as u64)))
    }

    /// Drops the mapped pages of rows `rows` of `t` from the resident set (see
    /// [`GgufFile::release_rows`]).
    pub fn release_rows(&self, t: TensorRef<'_>, rows: Range<u64>) {
        if let Some(s) = self.shards.get(t.shard) {
            s.release_rows(t.info, rows);
        }
    }

    /// The shard that `t` names, or an error when the index is past this model's shards.
    pub(crate) fn shard_of(&self, t: TensorRef<'_>) -> Result<&GgufFile> {
        self.shards.get(t.shard).with_context(|| {
            format!(
                "gguf: {}: tensor {:?} names shard {} but the model has {} shard(s); the reference comes from another model",
                self.path().display(),
                t.info.name,
                t.shard,
                self.shards.len()
            )
        })
    }
}

/// Whether two tensor names look alike (same suffix after the block number, or one contains the other).
fn similar(a: &str, b: &str) -> bool {
    let tail = |s: &str| s.rsplit('.').nth(1).map(str::to_string).unwrap_or_default();
    a.contains(b) || b.contains(a) || (!tail(a).is_empty() && tail(a) == tail(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names_parse() {
        let p = Path::new("/x/GLM-5-UD-Q4_K_XL-00002-of-00010.gguf");
        assert_eq!(
            parse_split_name(p),
            Some(("GLM-5-UD-Q4_K_XL".to_string(), 2, 10))
        );
        assert_eq!(parse_split_name(Path::new("model.gguf")), None);
        assert_eq!(parse_split_name(Path::new("m-1-of-2.gguf")), None);
        assert_eq!(split_file_name("a", 3, 12), "a-00003-of-00012.gguf");
    }

    /// Every tensor's row ranges of the 3-shard split fixture, read from the file
    /// `row_file_range` names at its offset, are the bytes `row_data` maps; rows past the end are
    /// an error; a shard held in memory has no file.
    #[test]
    fn row_file_ranges_are_where_the_rows_lie() {
        use std::os::unix::fs::FileExt;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/quant/split");
        let m = Model::open(&dir.join("all_types-00002-of-00003.gguf")).unwrap();
        let mut shards_seen = std::collections::BTreeSet::new();
        for t in m.tensors() {
            let n = t.info.n_rows();
            for rows in [0..n, 0..n.min(1), n / 2..n, n..n] {
                let want = m.row_data(t, rows.clone()).unwrap();
                let (path, offset, len) = m.row_file_range(t, rows.clone()).unwrap().unwrap();
                assert_eq!(len as usize, want.len(), "{} {rows:?}", t.info.name);
                let mut got = vec![0u8; want.len()];
                std::fs::File::open(path)
                    .unwrap()
                    .read_exact_at(&mut got, offset)
                    .unwrap();
                assert_eq!(got, want, "{} {rows:?}", t.info.name);
                shards_seen.insert(path.to_path_buf());
            }
            let e = m.row_file_range(t, 0..n + 1).unwrap_err().to_string();
            assert!(e.contains("out of range"), "{e}");
        }
        assert_eq!(shards_seen.len(), 3);
        let bytes = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/quant/all_types.gguf"),
        )
        .unwrap();
        let mem =
            Model::from_shards(vec![GgufFile::from_bytes("mem.gguf", bytes).unwrap()]).unwrap();
        let t = mem.tensors().next().unwrap();
        assert!(mem.row_file_range(t, 0..1).unwrap().is_none());
    }
}
