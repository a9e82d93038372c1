//! The reference cache: the reference's values entering layer A (the residual stream, and a
//! shared DSA selection of an earlier layer), kept on disk so that `run --layer A` does not
//! recompute layers `0..A` every time.
//!
//! Where: `$GLMDIFF_CACHE_DIR`, else `$XDG_CACHE_HOME/glmdiff`, else `$HOME/.cache/glmdiff`
//! ([`default_dir`](crate::util::cache_dir::default_dir)). One safetensors file per entry (the trace format; metadata holds the key),
//! named by a 64-bit FNV-1a hash of the key, written atomically. The key is the model's identity
//! (canonical path, size and modification time of every shard, a hash of every shard's header:
//! metadata and tensor infos), the tokens, the layer and glmdiff's version; an entry whose stored
//! key differs from the asked one (a hash collision, a stale file) is ignored and overwritten.
//! Each entry also stores an FNV-1a hash of every tensor's name, shape and values
//! (`cache_checksum`): an entry whose values do not hash to it (a damaged or edited file), or that
//! cannot be read, is reported as [`Loaded::Damaged`] so that the caller recomputes it and says
//! so, never compares against it. The cached values are the reference's residual stream (and
//! selected positions), always finite: an entry holding a NaN or an infinity is damaged too, even
//! when its checksum matches (an edited file whose checksum was recomputed), and values that are
//! not finite are never stored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};

use super::file::{write_trace, TraceFile, TraceMeta};
use super::Mode;
use crate::gguf::Model;
use crate::precision::Precision;
use crate::tensor::{HostData, HostTensor};
use crate::util::hash::fnv1a64;

/// Identity of one cache entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// Canonical model path, shard sizes, mtimes and header hashes, one line per shard.
    pub model_identity: String,
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// The layer whose inputs the entry holds.
    pub layer: usize,
    /// glmdiff's version (another version may compute differently).
    pub version: String,
}

impl CacheKey {
    /// The key of `model`'s inputs to `layer` for `tokens`.
    pub fn new(model: &Model, tokens: &[u32], layer: usize) -> Result<CacheKey> {
        let mut id = String::new();
        for shard in model.shards() {
            let p = shard.path();
            let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
            let meta = std::fs::metadata(p)
                .with_context(|| format!("cache: cannot stat {}", p.display()))?;
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            id.push_str(&format!(
                "{} size={} mtime_ns={} header_fnv={:016x}\n",
                canon.display(),
                meta.len(),
                mtime,
                fnv1a64(shard.header_bytes())
            ));
        }
        Ok(CacheKey {
            model_identity: id,
            tokens: tokens.to_vec(),
            layer,
            version: env!("CARGO_PKG_VERSION").to_string(),
        })
    }

    fn metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert("cache_model".into(), self.model_identity.clone());
        m.insert("cache_layer".into(), self.layer.to_string());
        m.insert("cache_version".into(), self.version.clone());
        m
    }

    fn file_name(&self) -> String {
        let toks: Vec<String> = self.tokens.iter().map(u32::to_string).collect();
        let all = format!(
            "{}|{}|{}|{}",
            self.model_identity,
            toks.join(","),
            self.layer,
            self.version
        );
        format!(
            "layer{}-{:016x}.safetensors",
            self.layer,
            fnv1a64(all.as_bytes())
        )
    }
}

/// The metadata key holding the checksum of an entry's values.
const CHECKSUM_KEY: &str = "cache_checksum";

/// FNV-1a over each tensor's name, shape and little-endian values, in the order given.
fn checksum(values: &[(String, HostTensor)]) -> u64 {
    let mut bytes = Vec::new();
    for (name, t) in values {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        for d in &t.shape {
            bytes.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        match &t.data {
            crate::tensor::HostData::F32(v) => {
                bytes.push(b'f');
                v.iter()
                    .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
            }
            crate::tensor::HostData::I32(v) => {
                bytes.push(b'i');
                v.iter()
                    .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
            }
        }
    }
    fnv1a64(&bytes)
}

/// The first f32 tensor among `values` holding a NaN or an infinity, said as `NAME holds N
/// non-finite values of M (the first at index I)`; `None` when every value is finite.
fn non_finite(values: &[(String, HostTensor)]) -> Option<String> {
    values.iter().find_map(|(name, t)| match &t.data {
        HostData::F32(v) => {
            let first = crate::quant::first_non_finite(v)?;
            let n = v.iter().filter(|x| !x.is_finite()).count();
            Some(format!(
                "{name} holds {n} non-finite values of {} (the first at index {first}); a residual stream is finite",
                v.len()
            ))
        }
        HostData::I32(_) => None,
    })
}

/// What [`RefCache::load`] found.
#[derive(Debug, PartialEq)]
pub enum Loaded {
    /// The entry, checked: the values in the order asked.
    Hit(Vec<(String, HostTensor)>),
    /// No entry for this key (absent, another key's file, one an earlier glmdiff wrote without
    /// a checksum, or without a value asked for).
    Miss,
    /// An entry for this key that is damaged: why (to be recomputed and overwritten).
    Damaged(String),
}

/// A cache directory.
pub struct RefCache {
    dir: PathBuf,
}

impl RefCache {
    /// The cache in `dir` (created on the first store).
    pub fn new(dir: &Path) -> RefCache {
        RefCache {
            dir: dir.to_path_buf(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry's path.
    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The values stored under `key`: a [`Loaded::Hit`] when an entry with exactly this key
    /// holds every name in `names` and its values hash to its stored checksum;
    /// [`Loaded::Damaged`] when the entry is there but cannot be read or its values do not match
    /// its checksum (a truncated, edited or corrupted file).
    pub fn load(&self, key: &CacheKey, names: &[String]) -> Loaded {
        let p = self.path(key);
        if !p.exists() {
            return Loaded::Miss;
        }
        let f = match TraceFile::open(&p) {
            Ok(f) => f,
            Err(e) => return Loaded::Damaged(format!("{e:#}")),
        };
        let want = key.metadata();
        if want.iter().any(|(k, v)| f.metadata().get(k) != Some(v))
            || f.tokens().ok().as_ref() != Some(&key.tokens)
        {
            return Loaded::Miss;
        }
        // Written without a checksum (an earlier glmdiff): stale, recomputed and overwritten.
        let Some(stored) = f.metadata().get(CHECKSUM_KEY) else {
            return Loaded::Miss;
        };
        let mut all: Vec<String> = f.names().map(str::to_string).collect();
        all.sort();
        let mut values = Vec::with_capacity(all.len());
        for n in &all {
            match f.get(n) {
                Ok(Some(t)) => values.push((n.clone(), t)),
                Ok(None) => return Loaded::Miss,
                Err(e) => return Loaded::Damaged(format!("{e:#}")),
            }
        }
        let sum = format!("{:016x}", checksum(&values));
        if *stored != sum {
            return Loaded::Damaged(format!(
                "its values hash to {sum}, not to the stored checksum {stored}"
            ));
        }
        if let Some(why) = non_finite(&values) {
            return Loaded::Damaged(why);
        }
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            match values.iter().find(|(v, _)| v == n) {
                Some(v) => out.push(v.clone()),
                None => return Loaded::Miss,
            }
        }
        Loaded::Hit(out)
    }

    /// Stores `values` under `key` (atomically).
    pub fn store(&self, key: &CacheKey, values: &[(String, HostTensor)]) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cache: cannot create {}", self.dir.display()))?;
        let p = self.path(key);
        if let Some(why) = non_finite(values) {
            anyhow::bail!("cache: not written to {}: {why}", p.display());
        }
        let tensors: BTreeMap<String, HostTensor> = values.iter().cloned().collect();
        let sorted: Vec<(String, HostTensor)> = tensors.clone().into_iter().collect();
        let mut extra = key.metadata();
        extra.insert(CHECKSUM_KEY.into(), format!("{:016x}", checksum(&sorted)));
        let meta = TraceMeta {
            model: key.model_identity.lines().next().unwrap_or("").to_string(),
            architecture: String::new(),
            tokens: key.tokens.clone(),
            engine: "cpu".into(),
            dtype: Precision::REFERENCE.to_string(),
            mode: Mode::Chained,
            extra,
        };
        write_trace(&p, &tensors, &meta)
            .with_context(|| format!("cache: cannot write {}", p.display()))?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_other_keys_miss() {
        let dir = tempfile::tempdir().unwrap();
        let c = RefCache::new(dir.path());
        let key = CacheKey {
            model_identity: "/m.gguf size=1 mtime_ns=2 header_fnv=3\n".into(),
            tokens: vec![1, 2],
            layer: 3,
            version: "x".into(),
        };
        let v = vec![(
            "blk.2.l_out".to_string(),
            HostTensor::f32(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
        )];
        assert_eq!(c.load(&key, &["blk.2.l_out".into()]), Loaded::Miss);
        c.store(&key, &v).unwrap();
        assert_eq!(
            c.load(&key, &["blk.2.l_out".into()]),
            Loaded::Hit(v.clone())
        );
        assert_eq!(c.load(&key, &["blk.1.l_out".into()]), Loaded::Miss);
        let mut other = key.clone();
        other.tokens = vec![1, 3];
        assert_eq!(c.load(&other, &["blk.2.l_out".into()]), Loaded::Miss);
        // A file under the right name whose stored key differs is not used.
        std::fs::copy(c.path(&key), c.path(&other)).unwrap();
        assert_eq!(c.load(&other, &["blk.2.l_out".into()]), Loaded::Miss);
    }

    /// A value changed in place (the file otherwise intact) or a file cut short is damaged,
    /// never a hit.
    #[test]
    fn damaged_entries_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let c = RefCache::new(dir.path());
        let key = CacheKey {
            model_identity: "/m.gguf size=1 mtime_ns=2 header_fnv=3\n".into(),
            tokens: vec![1, 2],
            layer: 1,
            version: "x".into(),
        };
        let v = vec![(
            "blk.0.l_out".to_string(),
            HostTensor::f32(vec![1, 2], vec![1.5, -2.0]).unwrap(),
        )];
        let p = c.store(&key, &v).unwrap();
        let names = ["blk.0.l_out".to_string()];
        let good = std::fs::read(&p).unwrap();
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        match c.load(&key, &names) {
            Loaded::Damaged(why) => assert!(why.contains("stored checksum"), "{why}"),
            other => panic!("{other:?}"),
        }
        std::fs::write(&p, &good[..n - 2]).unwrap();
        match c.load(&key, &names) {
            Loaded::Damaged(why) => assert!(why.contains("truncated"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
