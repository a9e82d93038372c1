//! The facts of one case's run: the `regress` object of its JSONL record (`docs/regress.md`).

use std::path::Path;

use serde::Serialize;

use super::expect::{self, Check};
use super::suite::Case;
use crate::compare::Comparison;

/// What one case came to.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CaseFacts {
    /// The suite file as given.
    pub suite: String,
    /// The case's name.
    pub case: String,
    /// Its index in the suite (from 0).
    pub index: usize,
    /// `pass`, `fail` or `error`.
    pub status: String,
    /// Why it could not run or be checked (status `error`).
    pub error: Option<String>,
    /// Each expectation's result (none when it could not be checked).
    pub checks: Vec<Check>,
    /// The `glmdiff run` command that re-runs it.
    pub command: String,
}

impl CaseFacts {
    /// Case `index` of `suite`, which could not run: `error` says why.
    pub fn not_run(suite: &Path, index: usize, case: &Case, error: String) -> CaseFacts {
        CaseFacts {
            suite: suite.display().to_string(),
            case: case.name.clone(),
            index,
            status: "error".into(),
            error: Some(error),
            checks: Vec::new(),
            command: case.run_command(None),
        }
    }

    /// Case `index` of `suite`, which ran on `tokens` to `comparison`: its expectations
    /// checked (an error when one cannot be checked on this run).
    pub fn ran(
        suite: &Path,
        index: usize,
        case: &Case,
        tokens: &[u32],
        comparison: &Comparison,
    ) -> CaseFacts {
        let (status, error, checks) = match expect::check(&case.expect, comparison) {
            Ok(checks) => {
                let ok = checks.iter().all(|c| c.ok);
                (if ok { "pass" } else { "fail" }, None, checks)
            }
            Err(why) => (
                "error",
                Some(format!(
                    "{}: case {} {:?}: {why}",
                    suite.display(),
                    index + 1,
                    case.name
                )),
                Vec::new(),
            ),
        };
        CaseFacts {
            suite: suite.display().to_string(),
            case: case.name.clone(),
            index,
            status: status.into(),
            error,
            checks,
            command: case.run_command(Some(tokens)),
        }
    }
}
