//! Regression suites (`glmdiff regress`): a TOML list of cases, each a `run` with pinned
//! expectations ([`suite`]), checked against the comparison the run produced ([`expect`]), and
//! what changed against an earlier run's JSONL ([`baseline`]); the facts of a case's run
//! ([`record`]). The format is in `docs/regress.md`. Nothing here prints or runs engines:
//! `session::regress` runs each case with `run`'s own code.

pub mod baseline;
pub mod expect;
pub mod record;
pub mod suite;

pub use baseline::{CaseSummary, Changes};
pub use expect::Check;
pub use record::CaseFacts;
pub use suite::{Case, Expect, Input, Suite};
