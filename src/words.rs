//! The run's words as typed values, parsed in one place and shared by the flags (`cli`), the
//! pipelines (`session`, `step`) and the regression suites (`regress`): the candidate
//! ([`Against`]), the modes ([`Modes`]), the CUDA engine's precision ([`CudaDtype`]), a
//! candidate precision override ([`PrecisionOverride`]) and a floor override ([`parse_tol`]).
//! Each parser's error says what is expected; the caller names the flag or the suite's field.

use std::fmt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::builder::PossibleValue;
use clap::ValueEnum;

use crate::precision::{Dtype, Precision};
use crate::trace::Mode;

/// The candidate asked for (`run --against`, a suite's `against`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Against {
    /// `auto`: the CUDA engine when a device is present, else a trace made for the model beside it.
    Auto,
    /// `cpu`: a second CPU reference (the faulty one with `--inject`).
    Cpu,
    /// `cuda` (`None`) or `cuda:N`: the CUDA engine.
    Cuda(Option<usize>),
    /// `trace:FILE`: a trace another engine wrote (hooks of docs/hooks.md).
    Trace(PathBuf),
}

impl Against {
    /// Parses `auto`, `cpu`, `cuda`, `cuda:N` or `trace:FILE` (whether this glmdiff has the CUDA
    /// engine is checked with the rest of the run). Errors say what is expected; the caller
    /// names the flag and the value (clap does).
    pub fn parse(s: &str) -> Result<Against> {
        Ok(match s {
            "auto" => Against::Auto,
            "cpu" => Against::Cpu,
            "cuda" => Against::Cuda(None),
            c if c.starts_with("cuda:") => {
                let n = c["cuda:".len()..]
                    .parse()
                    .context("expected cuda or cuda:N with N a device index")?;
                Against::Cuda(Some(n))
            }
            t if t.starts_with("trace:") => {
                let p = PathBuf::from(&t["trace:".len()..]);
                if p.as_os_str().is_empty() {
                    bail!("trace: needs a file, e.g. --against trace:dump.safetensors");
                }
                Against::Trace(p)
            }
            _ => bail!("expected auto, cpu, cuda[:N] or trace:FILE"),
        })
    }

    /// The engine an existing case is re-run on (`step --against`): `cpu`, `cuda` or `cuda:N`
    /// (`auto` and traces are for runs); an error naming what `step` takes otherwise.
    pub fn parse_engine(s: &str) -> Result<Against> {
        match Against::parse(s) {
            Ok(a @ (Against::Cpu | Against::Cuda(_))) => Ok(a),
            Err(e) if s.starts_with("cuda:") => Err(e),
            _ => bail!("expected cpu, cuda or cuda:N"),
        }
    }
}

impl fmt::Display for Against {
    /// As `--against` takes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Against::Auto => f.write_str("auto"),
            Against::Cpu => f.write_str("cpu"),
            Against::Cuda(None) => f.write_str("cuda"),
            Against::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            Against::Trace(p) => write!(f, "trace:{}", p.display()),
        }
    }
}

/// Which modes a pass runs (`run --mode`: `both`, `replay` or `chained`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Modes {
    /// Replay: every step from the same inputs on both sides.
    pub replay: bool,
    /// Chained: each side on its own outputs.
    pub chained: bool,
}

impl Default for Modes {
    /// Both modes.
    fn default() -> Modes {
        Modes::BOTH
    }
}

impl Modes {
    /// Both modes (`both`).
    pub const BOTH: Modes = Modes {
        replay: true,
        chained: true,
    };
    /// Replay alone (`replay`).
    pub const REPLAY: Modes = Modes {
        replay: true,
        chained: false,
    };
    /// Chained alone (`chained`).
    pub const CHAINED: Modes = Modes {
        replay: false,
        chained: true,
    };

    /// Parses `both`, `replay` or `chained`.
    pub fn parse(s: &str) -> Result<Modes> {
        match s {
            "both" => Ok(Modes::BOTH),
            "replay" => Ok(Modes::REPLAY),
            "chained" => Ok(Modes::CHAINED),
            _ => bail!("{s:?} is not one of both, replay, chained"),
        }
    }

    /// The modes run, in the order reports list them.
    pub fn list(self) -> Vec<Mode> {
        [Mode::Replay, Mode::Chained]
            .into_iter()
            .filter(|x| match x {
                Mode::Replay => self.replay,
                Mode::Chained => self.chained,
            })
            .collect()
    }

    /// The word `--mode` takes (`none` for neither mode, which no word asks for).
    pub fn as_str(self) -> &'static str {
        match (self.replay, self.chained) {
            (true, true) => "both",
            (true, false) => "replay",
            (false, true) => "chained",
            (false, false) => "none",
        }
    }
}

/// The words of `--mode` (written out rather than derived, so that `--help` lists the values on
/// one line as the flag's own text explains them).
impl ValueEnum for Modes {
    fn value_variants<'a>() -> &'a [Self] {
        &[Modes::BOTH, Modes::REPLAY, Modes::CHAINED]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

impl fmt::Display for Modes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The CUDA engine's precision asked for (`run --dtype`, a suite's `dtype`); the engine's own
/// type is chosen from it where the engine is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CudaDtype {
    /// f32 weights and activations, SGEMM without TF32: the f32 floors apply.
    #[default]
    F32,
    /// bf16 weights and activations, tensor-core GEMMs with f32 accumulation: the bf16 floors.
    Bf16,
}

impl CudaDtype {
    /// Parses `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<CudaDtype> {
        match s {
            "f32" => Ok(CudaDtype::F32),
            "bf16" => Ok(CudaDtype::Bf16),
            _ => bail!("{s:?} is not one of f32, bf16"),
        }
    }

    /// The word `--dtype` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            CudaDtype::F32 => "f32",
            CudaDtype::Bf16 => "bf16",
        }
    }
}

/// The words of `--dtype`.
impl ValueEnum for CudaDtype {
    fn value_variants<'a>() -> &'a [Self] {
        &[CudaDtype::F32, CudaDtype::Bf16]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

impl fmt::Display for CudaDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the CUDA engine puts a MoE layer's stacked expert tensors on the device
/// (`--expert-uploads`); the same bits either way. The engine's own type is chosen from it where
/// the engine's default is set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertUploads {
    /// By expert, only the routed ones, when a step is expected to route to at most half of
    /// the experts (the prompt's tokens are few); else whole.
    #[default]
    Auto,
    /// Always by expert, only the routed ones, after the router.
    Routed,
    /// Always whole: every expert, prefetched with the layer.
    Whole,
}

impl ExpertUploads {
    /// The word `--expert-uploads` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            ExpertUploads::Auto => "auto",
            ExpertUploads::Routed => "routed",
            ExpertUploads::Whole => "whole",
        }
    }
}

/// The words of `--expert-uploads`.
impl ValueEnum for ExpertUploads {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            ExpertUploads::Auto,
            ExpertUploads::Routed,
            ExpertUploads::Whole,
        ]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

/// Where the CUDA engine's uploads take the weights' bytes (`--upload-from`); the same bytes
/// either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UploadFrom {
    /// The device copies the file's mapped pages, registered with the driver for the copy
    /// (staged where the driver refuses).
    #[default]
    Mapped,
    /// Host threads read the bytes into pinned staging buffers, copied from there.
    Staged,
}

impl UploadFrom {
    /// The word `--upload-from` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            UploadFrom::Mapped => "mapped",
            UploadFrom::Staged => "staged",
        }
    }
}

/// The words of `--upload-from`.
impl ValueEnum for UploadFrom {
    fn value_variants<'a>() -> &'a [Self] {
        &[UploadFrom::Mapped, UploadFrom::Staged]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

/// How a host thread waits for the device (`--gpu-wait`): the CUDA context's scheduling flag.
/// Only where the waiting threads' time goes changes, never a value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuWait {
    /// Sleep until the device is done (`CU_CTX_SCHED_BLOCKING_SYNC`): the core is free for the
    /// reference's threads meanwhile.
    Block,
    /// Spin on a core until the device is done (`CU_CTX_SCHED_SPIN`).
    Spin,
    /// Spin, yielding the core between polls (`CU_CTX_SCHED_YIELD`).
    Yield,
    /// The driver's choice (`CU_CTX_SCHED_AUTO`: spin while the process has fewer contexts than
    /// the machine has cores).
    #[default]
    Auto,
}

impl GpuWait {
    /// The word `--gpu-wait` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuWait::Block => "block",
            GpuWait::Spin => "spin",
            GpuWait::Yield => "yield",
            GpuWait::Auto => "auto",
        }
    }
}

/// The words of `--gpu-wait`.
impl ValueEnum for GpuWait {
    fn value_variants<'a>() -> &'a [Self] {
        &[GpuWait::Auto, GpuWait::Block, GpuWait::Spin, GpuWait::Yield]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

/// `on` or `off` (`--candidate-ahead`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    #[default]
    Off,
}

impl Switch {
    /// Whether it is on.
    pub fn is_on(self) -> bool {
        self == Switch::On
    }
}

/// The words `on` and `off`.
impl ValueEnum for Switch {
    fn value_variants<'a>() -> &'a [Self] {
        &[Switch::On, Switch::Off]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(match self {
            Switch::On => "on",
            Switch::Off => "off",
        }))
    }
}

/// The candidate's precision at the hooks a glob matches.
#[derive(Clone, Debug, PartialEq)]
pub struct PrecisionOverride {
    /// Hook glob.
    pub glob: String,
    /// The precision there.
    pub precision: Precision,
    /// The dtype as it was given (`fp8`).
    pub dtype: String,
    /// Who said it: `--precision`, or the trace's metadata key (`indexer_dtype`).
    pub source: String,
}

/// The words `--precision` and a suite's `precision` take.
pub const PRECISION_WORDS: &str = "f64, f32, tf32, f16, bf16, fp8";

impl PrecisionOverride {
    /// `--precision GLOB=DTYPE` (a suite's `precision` table too): a non-empty glob and a dtype
    /// word ([`PRECISION_WORDS`] and their long names).
    pub fn flag(glob: &str, dtype: &str) -> Result<PrecisionOverride> {
        let glob = glob.trim();
        if glob.is_empty() {
            bail!("--precision {glob:?}={dtype} has an empty glob");
        }
        let dtype = dtype.trim();
        if Dtype::parse(dtype).is_none() {
            bail!("--precision dtype {dtype:?} is not one of {PRECISION_WORDS}");
        }
        let precision = Precision::parse(dtype)
            .with_context(|| format!("--precision {glob}={dtype}: unknown dtype"))?;
        Ok(PrecisionOverride {
            glob: glob.to_string(),
            precision,
            dtype: dtype.to_string(),
            source: "--precision".to_string(),
        })
    }

    /// Parses `GLOB=DTYPE` ([`PrecisionOverride::flag`]).
    pub fn parse(s: &str) -> Result<PrecisionOverride> {
        let (g, d) = s
            .rsplit_once('=')
            .with_context(|| format!("expected GLOB=DTYPE, got {s:?}"))?;
        if g.trim().is_empty() {
            bail!("--precision {s:?} has an empty glob");
        }
        PrecisionOverride::flag(g, d)
    }
}

/// Parses `GLOB=VALUE` (`--tol`): a non-empty glob and a floor (relative L2) that is finite and
/// not negative.
pub fn parse_tol(s: &str) -> Result<(String, f64)> {
    let (g, v) = s
        .rsplit_once('=')
        .with_context(|| format!("expected GLOB=VALUE, got {s:?}"))?;
    let g = g.trim();
    if g.is_empty() {
        bail!("--tol {s:?} has an empty glob");
    }
    let v: f64 = v
        .trim()
        .parse()
        .with_context(|| format!("--tol value {v:?} is not a number"))?;
    check_tol(v)?;
    Ok((g.to_string(), v))
}

/// A floor override's value: finite and not negative.
pub fn check_tol(v: f64) -> Result<()> {
    if !v.is_finite() || v < 0.0 {
        bail!("--tol value {v} must be finite and not negative");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_parse_and_print_as_taken() {
        for s in ["auto", "cpu", "cuda", "cuda:1", "trace:x.safetensors"] {
            assert_eq!(Against::parse(s).unwrap().to_string(), s);
        }
        assert!(Against::parse("trace:").is_err() && Against::parse("gpu").is_err());
        assert_eq!(
            Against::parse_engine("cuda:0").unwrap(),
            Against::Cuda(Some(0))
        );
        assert!(Against::parse_engine("auto").is_err());
        for s in ["both", "replay", "chained"] {
            assert_eq!(Modes::parse(s).unwrap().as_str(), s);
        }
        assert_eq!(Modes::CHAINED.list(), [Mode::Chained]);
        assert!(Modes::parse("all").is_err());
        assert_eq!(CudaDtype::parse("bf16").unwrap(), CudaDtype::Bf16);
        // The flags' words (clap's) are the same.
        for m in [Modes::BOTH, Modes::REPLAY, Modes::CHAINED] {
            assert_eq!(
                <Modes as ValueEnum>::from_str(m.as_str(), false).unwrap(),
                m
            );
        }
        for d in [CudaDtype::F32, CudaDtype::Bf16] {
            assert_eq!(
                <CudaDtype as ValueEnum>::from_str(d.as_str(), false).unwrap(),
                d
            );
        }
        assert!(<CudaDtype as ValueEnum>::from_str("f16", false).is_err());
        let p = PrecisionOverride::parse("blk.*.indexer_*=fp8").unwrap();
        assert_eq!(
            (p.glob.as_str(), p.dtype.as_str()),
            ("blk.*.indexer_*", "fp8")
        );
        assert!(PrecisionOverride::parse("*=f12").is_err());
        assert!(PrecisionOverride::parse("=bf16").is_err());
        assert_eq!(parse_tol("*=1e-3").unwrap(), ("*".to_string(), 1e-3));
        assert!(parse_tol("*=-1").is_err() && parse_tol("*=nan").is_err());
    }
}
