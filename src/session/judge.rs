//! What judging a run needs of the driver: the model's facts for the [`Judge`] (the floors of the
//! plan's steps, the selection bias of the layers it runs, the expert groups, the heads). The
//! judge itself, and every precision read from text, are `compare::judge`'s.

use std::collections::HashMap;

use anyhow::Result;

use crate::compare::floors::hook_infos;
use crate::compare::ModelFacts;
use crate::driver::Plan;
use crate::model::{Step, Weights};

pub(super) use crate::compare::judge::{
    case_precision, overrides_with_trace, trace_side_precision, wants_with_scores,
};

/// What the model tells the judge of `steps` (the plan's, or one step's), with the selection
/// bias of the layers `bias_of` runs (none without a plan).
pub(super) fn model_facts(
    weights: &Weights<'_>,
    steps: &[Step],
    bias_of: Option<&Plan>,
) -> Result<ModelFacts> {
    Ok(ModelFacts {
        infos: hook_infos(steps, weights),
        selection_bias: match bias_of {
            Some(plan) => selection_bias(weights, plan)?,
            None => HashMap::new(),
        },
        groups: weights.hparams().groups,
        heads: Some(weights.hparams().n_head),
    })
}

/// The selection bias `exp_probs_b` of every MoE layer the plan runs.
fn selection_bias(weights: &Weights<'_>, plan: &Plan) -> Result<HashMap<usize, Vec<f32>>> {
    let mut out = HashMap::new();
    for l in plan.layers() {
        let name = crate::model::names::blk(l, crate::model::names::blk::EXP_PROBS_B);
        if weights.has(&name) {
            out.insert(l, weights.vector_desc(&name)?.dequantize()?);
        }
    }
    Ok(out)
}
