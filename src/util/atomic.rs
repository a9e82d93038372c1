//! Atomic output files: write to a temporary file in the destination's directory, flush it to
//! disk, then rename over the destination. A crash or error never leaves a half-written file.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Checks, before any work, that `path` names a file in an existing directory, so that a long
/// run does not end in "cannot create" (the write itself still reports its own errors).
pub fn check_output_dir(path: &Path) -> Result<()> {
    if path.file_name().is_none() {
        bail!("output: {} is not a file path", path.display());
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => return Ok(()),
    };
    if !dir.is_dir() {
        bail!(
            "output: the directory {} of {} does not exist",
            dir.display(),
            path.display()
        );
    }
    Ok(())
}

/// Writes `path` atomically with the bytes produced by `write`.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .with_context(|| format!("output: {} is not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        let f = File::create(&tmp)
            .with_context(|| format!("output: cannot create {}", tmp.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        write(&mut w)?;
        let f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("output: cannot write {}", tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("output: cannot flush {}", tmp.display()))?;
        fs::rename(&tmp, path).with_context(|| {
            format!(
                "output: cannot rename {} to {}",
                tmp.display(),
                path.display()
            )
        })
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_write_leaves_nothing_behind() {
        let dir = std::env::temp_dir().join(format!("glmdiff-atomic-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.bin");
        write_atomic(&p, |w| Ok(w.write_all(b"ok")?)).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"ok");
        let r = write_atomic(&p, |w| {
            w.write_all(b"partial")?;
            anyhow::bail!("boom")
        });
        assert!(r.is_err());
        assert_eq!(fs::read(&p).unwrap(), b"ok");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
