//! The synthetic model a benchmark writes when it is given none: a GGUF in a temporary
//! directory of its own, removed when the benchmark is done (or by the interrupt handler, or by
//! the next benchmark when the process that made it is gone).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::synth::{self, SynthOptions, TypeMix};
use crate::util::progress::Progress;

/// The synthetic model of a run.
#[derive(Clone, Debug, Serialize)]
pub struct SynthInfo {
    /// What was written (architecture, dimensions, layers, types).
    pub description: String,
    /// Where it was written.
    pub path: String,
    /// File size, bytes.
    pub file_bytes: u64,
    /// Time to write it, seconds.
    pub write_s: f64,
    /// Whether the temporary directory is gone after the run.
    pub removed: bool,
}

/// A synthetic model written to a temporary directory; the directory goes when this is
/// dropped or [`ScratchModel::finish`]ed.
pub(crate) struct ScratchModel {
    dir: TempDir,
    path: PathBuf,
    info: SynthInfo,
}

impl ScratchModel {
    /// Writes `synth` as `file` into a new directory `PREFIX<pid>-<nanos>` of `parent` (those of
    /// dead processes with the same prefix are removed first), saying what it writes to
    /// `progress` and counting the bytes written on `written`.
    pub(crate) fn write(
        synth: &SynthOptions,
        parent: &Path,
        prefix: &str,
        file: &str,
        progress: &mut dyn FnMut(&str),
        written: &dyn Progress,
    ) -> Result<ScratchModel> {
        let dir = TempDir::create(parent, prefix)?;
        let path = dir.path().join(file);
        let description = describe(synth);
        let planned = synth::prepare(synth)?.0.file_len();
        progress(&format!(
            "bench: writing {description}, {planned} bytes, to {}",
            path.display()
        ));
        let t0 = Instant::now();
        let summary = synth::write_with_progress(synth, &path, written)?;
        let info = SynthInfo {
            description,
            path: path.display().to_string(),
            file_bytes: summary.file_bytes,
            write_s: t0.elapsed().as_secs_f64(),
            removed: false,
        };
        Ok(ScratchModel { dir, path, info })
    }

    /// The model file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the directory; what was written, and whether the directory is gone.
    pub(crate) fn finish(self) -> SynthInfo {
        let dir_path = self.dir.path().to_path_buf();
        drop(self.dir);
        SynthInfo {
            removed: !dir_path.exists(),
            ..self.info
        }
    }
}

/// What `s` writes, in words.
fn describe(s: &SynthOptions) -> String {
    format!(
        "synthetic {} ({} dims, {} layers of which {} dense, {} MTP, {} types, seed {})",
        s.arch.as_str(),
        s.dims.name,
        s.dims.n_layer,
        s.dims.n_dense,
        s.dims.nextn,
        mix_name(s.mix),
        s.seed
    )
}

/// The command-line spelling of a type mix.
fn mix_name(mix: TypeMix) -> String {
    match mix {
        TypeMix::UdQ4KXl => "ud-q4_k_xl".to_string(),
        TypeMix::Single(t) => t.name().to_lowercase(),
    }
}

/// A directory removed (with its contents) when dropped, or by the interrupt handler (it is
/// registered as in flight). Those of dead processes are removed when a new one is made.
struct TempDir(crate::util::atomic::InFlightDir);

impl TempDir {
    /// `parent/PREFIX<pid>-<nanos>`.
    fn create(parent: &Path, prefix: &str) -> Result<TempDir> {
        crate::util::atomic::remove_stale_in(parent, prefix);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let p = parent.join(format!("{prefix}{}-{nanos:09}", std::process::id()));
        let d = crate::util::atomic::InFlightDir::create(&p)
            .with_context(|| format!("bench: creating {}", p.display()))?;
        Ok(TempDir(d))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}
