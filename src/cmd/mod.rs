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
