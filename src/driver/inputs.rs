//! What a pass of the two sides runs on ([`RunInputs`]): the same for the reference and the
//! candidate, and for every stage of the driver.

use super::Plan;
use crate::model::Weights;
use crate::tensor::HostTensor;
use crate::trace::NearTies;

/// What a pass runs on, the same for both sides.
#[derive(Clone, Copy)]
pub struct RunInputs<'a> {
    /// The model's weights.
    pub weights: &'a Weights<'a>,
    /// The prompt.
    pub tokens: &'a [u32],
    /// The steps run.
    pub plan: &'a Plan,
    /// The plan's free inputs.
    pub start: &'a [(String, HostTensor)],
    /// What the driver asks back about selections (near ties), from the scores the sink keeps.
    pub ties: &'a (dyn NearTies + Sync),
}
