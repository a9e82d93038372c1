//! glmdiff's cache directory, shared by the reference cache (`trace::cache`) and the compiled
//! kernels (`gpu::nvrtc`, under `cubin/`).

use std::path::PathBuf;

use anyhow::{bail, Result};

/// The cache directory: `$GLMDIFF_CACHE_DIR`, `$XDG_CACHE_HOME/glmdiff` or `$HOME/.cache/glmdiff`.
pub fn default_dir() -> Result<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("GLMDIFF_CACHE_DIR") {
        return Ok(d);
    }
    if let Some(d) = env("XDG_CACHE_HOME") {
        return Ok(d.join("glmdiff"));
    }
    if let Some(h) = env("HOME") {
        return Ok(h.join(".cache").join("glmdiff"));
    }
    bail!("cache: no cache directory: set GLMDIFF_CACHE_DIR (or XDG_CACHE_HOME or HOME)")
}
