//! One module per subcommand: turn checked flags into library calls and hand results to
//! [`crate::report`] for printing.

pub mod bench;
pub mod dequant;
pub mod dequant_check;
pub mod inspect;
pub mod regress;
pub mod run;
pub mod step;
pub mod synth;
pub mod trace;
pub mod weights_check;

/// How a command ended when it did not fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything checked agreed (exit 0).
    Ok,
    /// A check found a difference (exit 1).
    Differs,
}

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use crate::cli::PrefetchArgs;
use crate::quant::simd::Level;
use crate::session::config::trace_files_beside;
use crate::session::Against;
use crate::util::guard::{is_stdout, Guard};

/// Sets whether the CUDA engines this command opens prefetch the next layer's weights
/// (`--no-prefetch`), how they upload stacked expert tensors (`--expert-uploads`) and where
/// their uploads take the bytes (`--upload-from`), before it opens any.
pub(crate) fn set_prefetch(args: &PrefetchArgs) {
    #[cfg(feature = "cuda")]
    {
        crate::engine::cuda::set_prefetch_by_default(!args.no_prefetch);
        use crate::engine::cuda::ExpertUploads as Engine;
        use crate::words::ExpertUploads as Word;
        crate::engine::cuda::set_expert_uploads_by_default(match args.expert_uploads {
            Word::Auto => Engine::Auto,
            Word::Routed => Engine::Routed,
            Word::Whole => Engine::Whole,
        });
        use crate::gpu::upload::Source;
        use crate::words::UploadFrom;
        crate::gpu::upload::set_source_by_default(match args.upload_from {
            UploadFrom::Mapped => Source::Mapped,
            UploadFrom::Staged => Source::Staged,
        });
        crate::gpu::upload::set_register_pause_by_default(std::time::Duration::from_micros(
            args.register_pause,
        ));
    }
    // Without the `cuda` feature no engine uploads weights.
    #[cfg(not(feature = "cuda"))]
    let _ = args;
}

/// Sets how the host threads of the CUDA devices this command opens wait for them
/// (`--gpu-wait`), before it opens any.
pub fn set_gpu_wait(how: crate::words::GpuWait) {
    #[cfg(feature = "cuda")]
    {
        use crate::gpu::Wait;
        use crate::words::GpuWait;
        crate::gpu::set_wait_by_default(match how {
            GpuWait::Block => Wait::Block,
            GpuWait::Spin => Wait::Spin,
            GpuWait::Yield => Wait::Yield,
            GpuWait::Auto => Wait::Auto,
        });
    }
    // Without the `cuda` feature no device is opened.
    #[cfg(not(feature = "cuda"))]
    let _ = how;
}

/// The level the CPU's dequantizers and matrix products are capped at: `flag` (`--cpu-simd`),
/// else `env` (the value of [`crate::quant::simd::LEVEL_ENV`], read once at the start) when it
/// names a level (an unknown value is ignored); `None`: no cap, the widest the CPU has.
pub fn cpu_simd_cap(flag: Option<Level>, env: Option<&str>) -> Option<Level> {
    flag.or_else(|| env.and_then(Level::from_name))
}

/// Adds the files of a model (every shard of a split model) to `g` as inputs named `what`.
pub(crate) fn model_input(g: &mut Guard, what: &str, model: &Path) {
    for p in crate::gguf::shard_paths(model) {
        g.input(what, &p);
    }
}

/// Adds the candidate of `run --against SPEC` for `model`: a `trace:FILE`, or for `auto` the
/// traces it may pick (beside the model).
pub(crate) fn against_input(g: &mut Guard, against: &Against, model: &Path) {
    match against {
        Against::Trace(t) => {
            g.input("the trace candidate", t);
        }
        Against::Auto => {
            for p in trace_files_beside(model) {
                g.input(
                    "a trace beside the model",
                    p.strip_prefix(".").unwrap_or(&p),
                );
            }
        }
        Against::Cpu | Against::Cuda(_) => {}
    }
}

/// Whether `path` (a `--json`/`--jsonl` value) sends the document to stdout.
pub(crate) fn to_stdout(path: Option<&Path>) -> bool {
    path.is_some_and(is_stdout)
}

/// Prints a human report: to stdout, or to stderr when stdout carries a JSON document
/// (`--json -`), so that stdout stays one parseable document.
pub(crate) fn print_report(text: &str, json_on_stdout: bool) {
    let fitted = crate::report::layout::fit_text(text, crate::report::layout::width());
    if json_on_stdout {
        eprint!("{fitted}");
    } else {
        print!("{fitted}");
    }
}

/// Writes `doc` as pretty JSON to `path` atomically, or to stdout when `path` is `-`.
pub(crate) fn write_json<T: serde::Serialize>(flag: &str, path: &Path, doc: &T) -> Result<()> {
    write_lines(flag, path, &mut |w| {
        serde_json::to_writer_pretty(&mut *w, doc)?;
        Ok(w.write_all(b"\n")?)
    })
}

/// Writes what `fill` produces to `path` atomically, or to stdout when `path` is `-`.
pub(crate) fn write_lines(
    flag: &str,
    path: &Path,
    fill: &mut dyn FnMut(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    if is_stdout(path) {
        let mut out = std::io::stdout().lock();
        fill(&mut out)
            .and_then(|()| Ok(out.flush()?))
            .with_context(|| format!("output: {flag} -: cannot write to stdout"))
    } else {
        crate::util::atomic::write_atomic(path, |w| fill(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--cpu-simd` wins over the environment's value, which counts only when it names a level.
    #[test]
    fn cpu_simd_cap_from_the_flag_then_the_environment() {
        assert_eq!(cpu_simd_cap(None, None), None);
        assert_eq!(cpu_simd_cap(None, Some("")), None);
        assert_eq!(cpu_simd_cap(None, Some("sse9")), None);
        assert_eq!(cpu_simd_cap(None, Some(" AVX2")), Some(Level::Avx2));
        assert_eq!(
            cpu_simd_cap(Some(Level::Base), Some("avx2")),
            Some(Level::Base)
        );
        assert_eq!(cpu_simd_cap(Some(Level::Avx512), None), Some(Level::Avx512));
    }
}
