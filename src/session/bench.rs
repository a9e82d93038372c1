//! The pipeline `glmdiff bench run` times: `run`'s own ([`super::run`]), on token ids the
//! benchmark draws, over the layers it times, against one engine candidate. The candidate is
//! checked before any work: `auto` is the CUDA engine on device 0 when a device is present,
//! else a second CPU reference; a trace is refused (a benchmark times engines glmdiff runs);
//! a CUDA candidate needs the `cuda` feature, its libraries and the device.

use std::cell::RefCell;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::config::{Against, CudaDtype, HookOptions, Modes, RunConfig, RunRequest};
use super::Watch;
use crate::bench::run::{CandidateKind, Pipeline, Settings, Timed};
use crate::util::progress::{NoProgress, Progress};

/// `run`'s pipeline with a fixed candidate, mode and precision.
#[derive(Clone, Debug)]
pub struct RunPipeline {
    candidate: CandidateKind,
    mode: Modes,
    dtype: CudaDtype,
    /// What `auto` chose, in words.
    choice: Option<String>,
}

impl RunPipeline {
    /// The pipeline of `--against against --mode mode --dtype dtype`, checked (see the module
    /// documentation).
    pub fn new(against: &Against, mode: Modes, dtype: CudaDtype) -> Result<RunPipeline> {
        let candidate = match against {
            Against::Cpu => CandidateKind::Cpu,
            Against::Cuda(n) => CandidateKind::Cuda(cuda_device(against, n.unwrap_or(0))?),
            Against::Auto => match cuda_devices() {
                Ok(n) if n > 0 => CandidateKind::Cuda(0),
                _ => CandidateKind::Cpu,
            },
            Against::Trace(_) => bail!(
                "bench: --against {against}: a benchmark times an engine glmdiff runs; give cpu, cuda or cuda:N"
            ),
        };
        if dtype != CudaDtype::F32 && candidate == CandidateKind::Cpu {
            bail!("bench: --dtype {dtype} sets the CUDA engine's precision; give --against cuda");
        }
        let choice = (*against == Against::Auto).then(|| match candidate {
            CandidateKind::Cuda(_) => {
                "--against auto: a CUDA device is present; timing the CUDA engine on device 0"
                    .to_string()
            }
            CandidateKind::Cpu => {
                "--against auto: no CUDA device; timing a second CPU reference as the candidate"
                    .to_string()
            }
        });
        Ok(RunPipeline {
            candidate,
            mode,
            dtype,
            choice,
        })
    }

    /// `--against` of `run` for this candidate.
    fn against(&self) -> Against {
        match self.candidate {
            CandidateKind::Cpu => Against::Cpu,
            CandidateKind::Cuda(n) => Against::Cuda(Some(n)),
        }
    }
}

/// Devices the driver reports (an error without the `cuda` feature or its libraries).
fn cuda_devices() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        Ok(crate::gpu::DeviceInfo::list()?.len())
    }
    #[cfg(not(feature = "cuda"))]
    {
        bail!("this glmdiff was built without the `cuda` feature")
    }
}

/// Device `n`, checked to be there.
fn cuda_device(against: &Against, n: usize) -> Result<usize> {
    let count = cuda_devices().with_context(|| format!("bench: --against {against}"))?;
    if n >= count {
        bail!(
            "bench: --against {against}: no CUDA device {n} ({count} visible{})",
            if count == 0 {
                "; CUDA_VISIBLE_DEVICES may hide them"
            } else {
                ""
            }
        );
    }
    Ok(n)
}

impl Pipeline for RunPipeline {
    fn settings(&self) -> Settings {
        Settings {
            candidate: self.candidate,
            spec: self.against().to_string(),
            mode: self.mode.as_str().to_string(),
            dtype: match self.candidate {
                CandidateKind::Cpu => None,
                CandidateKind::Cuda(_) => Some(self.dtype.as_str().to_string()),
            },
            choice: self.choice.clone(),
            candidate_ahead: crate::driver::pair::candidate_ahead(),
            reference_reuse: reference_reuse(),
            upload_from: match self.candidate {
                CandidateKind::Cpu => None,
                CandidateKind::Cuda(_) => upload_from(),
            },
            register_pause_us: register_pause_us(),
        }
    }

    fn run(
        &mut self,
        model: &Path,
        tokens: &[u32],
        layers: Range<usize>,
        progress: &dyn Progress,
    ) -> Result<Timed> {
        let cfg = RunConfig::check(RunRequest {
            model: model.to_path_buf(),
            prompt: None,
            tokens: Some(tokens.to_vec()),
            layers: Some(layers.start as u64..layers.end as u64),
            against: self.against(),
            devices: Vec::new(),
            mode: self.mode,
            dtype: self.dtype,
            inject: Vec::new(),
            explain: false,
            repro: None,
            hooks: HookOptions::default(),
            cache_dir: None,
            no_cache: false,
        })?;
        let said = RefCell::new(Vec::new());
        let say = |s: &str| said.borrow_mut().push(s.to_string());
        let watch = Watch {
            layers: progress,
            hypotheses: &NoProgress,
            say: &say,
        };
        let ran = super::run(&cfg, &watch)?;
        let mut notes = ran.header.notes;
        notes.extend(ran.header.cache);
        notes.extend(said.into_inner());
        Ok(Timed {
            layer_times: ran.header.layer_times,
            candidate: ran.header.candidate.describe,
            differs: ran.comparison.differs(),
            notes,
        })
    }
}

/// `--reference-reuse` as the command set it (off without the `cuda` feature).
fn reference_reuse() -> bool {
    #[cfg(feature = "cuda")]
    return crate::gpu::resident::reuse();
    #[cfg(not(feature = "cuda"))]
    false
}

/// `--upload-from` as the command set it, in its words (`None` without the `cuda` feature).
fn upload_from() -> Option<String> {
    #[cfg(feature = "cuda")]
    return Some(
        match crate::gpu::upload::source_by_default() {
            crate::gpu::upload::Source::Mapped => "mapped",
            crate::gpu::upload::Source::Staged => "staged",
        }
        .to_string(),
    );
    #[cfg(not(feature = "cuda"))]
    None
}

/// `--register-pause` as the command set it, microseconds (0 without the `cuda` feature).
fn register_pause_us() -> u64 {
    #[cfg(feature = "cuda")]
    return u64::try_from(crate::gpu::upload::register_pause_by_default().as_micros())
        .unwrap_or(u64::MAX);
    #[cfg(not(feature = "cuda"))]
    0
}
