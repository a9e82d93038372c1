//! The pipelines behind the commands that compare: `run` (the reference and one candidate over
//! the same steps), `compare` (two traces), `step` (one stored step re-run), `trace` (the
//! reference written to a trace file) and `regress` (a suite of `run` cases). Raw flags become
//! plain values in `cmd`, a checked configuration here ([`RunConfig::check`] does every check
//! before any work), then one run that returns data; `cmd` prints it.
//!
//! - [`config`]: the choices (`--against`, `--mode`, `--dtype`), the plain request and the
//!   checked [`RunConfig`], including the `auto` choice of a candidate.
//! - [`prefix`]: the reference's residual stream entering the first layer run, from the
//!   reference cache or computed (and stored).
//! - [`candidate`]: the one candidate (CPU, CUDA on one or several devices, or a trace), wrapped
//!   in a `FaultEngine` only for `--inject`.
//! - [`judge`]: precisions (every precision parse of a run is in one function here), floors,
//!   overrides and the hooks compared.
//! - [`mod@run`]: the pass itself, `--explain`/`--repro`, the header and the rerun command.
//! - [`mod@compare`]: two traces hook by hook.
//! - [`mod@step`]: a `--repro` case re-run.
//! - [`mod@trace`]: the reference's hooks into a trace file, and the most likely next tokens.
//! - [`regress`]: each case of a suite run as `run` runs it, its expectations checked.
//! - [`bench`]: `run`'s pipeline as `bench run` times it (the benchmark itself is
//!   [`crate::bench::run`]'s).
//!
//! Nothing here prints: what must be said at once is handed to [`Watch::say`].

pub mod bench;
pub mod candidate;
pub mod compare;
pub mod config;
pub mod judge;
pub mod pass;
pub mod prefix;
pub mod regress;
pub mod run;
pub mod step;
pub mod tokens;
pub mod trace;

pub use crate::engine::cpu::device::ReferenceOn;
pub use compare::{compare, CompareRequest};
pub use config::{Against, CudaDtype, HookOptions, Modes, RunConfig, RunRequest};
pub use run::run;
pub use step::{step, StepRequest};
pub use trace::{trace, TraceRequest, Traced};

use crate::compare::Comparison;
use crate::report::run::Header;
use crate::util::progress::Progress;

/// What a run or a comparison computed: the facts for the header and the comparison.
pub struct Ran {
    /// Facts about the run that the comparison does not hold.
    pub header: Header,
    /// Every hook's metrics and verdicts, and the output distributions.
    pub comparison: Comparison,
}

/// Where a run reports while it works (the library never prints).
pub struct Watch<'a> {
    /// Progress of the layers (the reference prefix, then the pass).
    pub layers: &'a dyn Progress,
    /// Progress of `--explain`'s hypotheses.
    pub hypotheses: &'a dyn Progress,
    /// Says a line at once (on stderr), before the run's report: a damaged cache entry.
    pub say: &'a dyn Fn(&str),
}

/// The start of the cache note when the reference cache could not be written (`regress` repeats
/// that note on stderr, having no run report to carry it).
pub const CACHE_NOT_WRITTEN: &str = "the reference cache was not written";
