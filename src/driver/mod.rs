//! The driver: walks the model's ordered steps ([`crate::model::steps`]) over engines and hands
//! the hooks a sink wants to it.
//!
//! A [`Runner`] owns one engine's values and its position in a [`Plan`], and advances one step at
//! a time; values live in an environment keyed by hook name and are dropped after their last use,
//! so a whole model runs with a few layers' worth of activations. [`exec_step`] runs one step on
//! inputs given by reference, which is what makes replay a matter of input policy: the two-engine
//! driver ([`pair`]) feeds the candidate the reference's inputs for a step (replay) or lets it read
//! its own (chained), without either engine knowing. [`run`] is the chained run of one engine
//! (what `glmdiff trace` and the reference cache need).
//!
//! Extent: a plan covers layers `A..B` ([`Plan::range`]); a plan that does not start at layer 0
//! starts from given values of its free inputs (the residual stream entering layer A, and a
//! shared DSA selection from an earlier layer), see [`Plan::free_inputs`]. The tail (final norm
//! and logits) runs only after the model's last layer.
//!
//! Weight residency: every walk of a plan on an engine (a [`Runner`], or the replayed steps of a
//! candidate engine in [`pair`]) tells the engine which weights come next, through
//! [`Engine::begin_model`], [`Engine::begin_layer`], [`Engine::end_layer`] and
//! [`Engine::end_model`], with the names the plan gathered from `Step::weights`
//! ([`Plan::global_weights`], [`Plan::layer_weights`]). A layer is begun just before the first
//! step the engine runs in it and ended when it runs a step of another layer or the walk
//! finishes ([`Runner::finish`]).

mod follow;
mod inputs;
pub mod pair;
mod replay;
mod residency;
mod rows;
mod segment;
mod timed;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use anyhow::{bail, Context, Result};

use crate::engine::{Engine, ExpertInputs, ExpertsOut, HostData, HostTensor, MlaInputs};
use crate::model::steps::{self, expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::Sink;
use residency::Residency;
use rows::JointOut;

/// The steps to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// First layer run (0 when the plan starts at the embedding).
    pub first_layer: usize,
    /// End of the layers run (exclusive): layers `first_layer..n_layers` run.
    pub n_layers: usize,
    /// Whether the final norm and logits run.
    pub tail: bool,
    /// GGUF tensors of the plan's global steps (embedding, final norm, output projection), each
    /// once in first-use order: what [`Engine::begin_model`] is given.
    pub global_weights: Vec<String>,
    /// Per layer run, the GGUF tensors its steps read ([`Step::weights`]), each once in
    /// first-use order: what [`Engine::begin_layer`] is given.
    pub layer_weights: BTreeMap<usize, Vec<String>>,
}

impl Plan {
    /// Embedding, layers `0..n_layers`, and the tail when `tail` (which needs every layer).
    pub fn new(weights: &Weights<'_>, n_layers: usize, tail: bool) -> Result<Plan> {
        Plan::range(weights, 0..n_layers, tail)
    }

    /// Layers `layers` (with the embedding when they start at 0), and the tail when `tail` (which
    /// needs the range to end at the model's last layer).
    pub fn range(weights: &Weights<'_>, layers: Range<usize>, tail: bool) -> Result<Plan> {
        let hp = weights.hparams();
        if layers.end > hp.n_layer || layers.start > layers.end {
            bail!(
                "driver: layers {}..{} asked, the model runs layers 0..{}",
                layers.start,
                layers.end,
                hp.n_layer
            );
        }
        if tail && layers.end != hp.n_layer {
            bail!(
                "driver: logits need all {} layers, not {}",
                hp.n_layer,
                layers.end
            );
        }
        let mut s = if layers.start == 0 {
            steps::embed_steps()
        } else {
            Vec::new()
        };
        for l in layers.clone() {
            s.extend(steps::layer_steps(hp, l));
        }
        if tail {
            s.extend(steps::tail_steps(hp, layers.end, weights.output_name()));
        }
        let global_weights = steps::weights_of(s.iter().filter(|st| st.layer.is_none()), weights);
        let layer_weights = layers
            .clone()
            .map(|l| {
                let of_layer = s.iter().filter(|st| st.layer == Some(l));
                (l, steps::weights_of(of_layer, weights))
            })
            .collect();
        Ok(Plan {
            steps: s,
            first_layer: layers.start,
            n_layers: layers.end,
            tail,
            global_weights,
            layer_weights,
        })
    }

    /// The GGUF tensors layer `layer`'s steps read ([`Plan::layer_weights`]; none for a layer
    /// the plan does not run).
    pub fn weights_of_layer(&self, layer: usize) -> &[String] {
        self.layer_weights.get(&layer).map_or(&[], Vec::as_slice)
    }

    /// The whole forward pass: every layer, then final norm and logits.
    pub fn full(weights: &Weights<'_>) -> Result<Plan> {
        Plan::new(weights, weights.hparams().n_layer, true)
    }

    /// The shortest run from layer 0 that produces every hook `wants` asks for (see the module
    /// documentation).
    pub fn for_sink(weights: &Weights<'_>, sink: &dyn Sink) -> Result<Plan> {
        Plan::for_wants(weights, &|n| sink.wants(n))
    }

    /// [`Plan::for_sink`] for a predicate.
    pub fn for_wants(weights: &Weights<'_>, wants: &dyn Fn(&str) -> bool) -> Result<Plan> {
        let hp = weights.hparams();
        if wants(point::RESULT_NORM) || wants(point::LOGITS) {
            return Plan::full(weights);
        }
        let layer_wanted = |l: usize| {
            steps::layer_steps(hp, l)
                .iter()
                .flat_map(|s| &s.outputs)
                .any(|o| wants(o))
                || wants(&hook(l, point::ATTN_PROBS))
                || (!hp.is_dense(l) && (0..hp.n_expert).any(|e| wants(&expert_hook(l, e))))
        };
        let n_layers = (0..hp.n_layer)
            .rev()
            .find(|&l| layer_wanted(l))
            .map_or(0, |l| l + 1);
        Plan::new(weights, n_layers, false)
    }

    /// Names the plan reads before any of its steps produce them, in first-use order: nothing
    /// for a plan from layer 0; the residual stream entering the first layer (and a shared DSA
    /// selection of an earlier layer) otherwise.
    pub fn free_inputs(&self) -> Vec<String> {
        let mut produced: HashSet<&str> = HashSet::new();
        let mut free: Vec<String> = Vec::new();
        for s in &self.steps {
            for i in &s.inputs {
                if !produced.contains(i.as_str()) && !free.contains(i) {
                    free.push(i.clone());
                }
            }
            produced.extend(s.outputs.iter().map(String::as_str));
        }
        free
    }

    /// Layers run.
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.n_layers
    }
}

/// Checks a prompt against the model: not empty, within `context_length`, ids in the vocabulary.
pub fn check_tokens(weights: &Weights<'_>, tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        bail!("driver: the prompt has no tokens");
    }
    if let Some(n_ctx) = weights.hparams().n_ctx.filter(|&c| tokens.len() > c) {
        bail!(
            "driver: {} tokens exceed the context_length {n_ctx} of {}",
            tokens.len(),
            weights.model().file_name()
        );
    }
    if let Some((i, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= weights.n_vocab())
    {
        bail!(
            "driver: token {i} has id {id}, outside the vocabulary 0..{} of {}",
            weights.n_vocab(),
            weights.model().file_name()
        );
    }
    Ok(())
}

pub use crate::util::progress::{NoProgress, Progress};

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// End of the layers run (exclusive).
    pub n_layers: usize,
    /// Whether logits were computed.
    pub tail: bool,
    /// Hooks handed to the sink.
    pub hooks_recorded: usize,
}

/// Outputs of one step: its declared outputs in order, then optional extra hooks.
pub struct StepOutputs<T> {
    /// One tensor per `step.outputs` entry (none for [`Op::Alias`], whose output is its input).
    pub outputs: Vec<T>,
    /// Optional hooks (`attn_probs`, `exp.{e}.out`) that `wants` asked for, by name.
    pub extra: Vec<(String, T)>,
}

/// Runs one step on `engine` with `inputs` (one per `step.inputs`, in order). `tokens` feeds the
/// embedding step; `wants` says which optional hooks to produce. An [`Op::Alias`] step produces
/// nothing (its output is its input; the caller resolves the name).
pub fn exec_step<E: Engine>(
    engine: &E,
    step: &Step,
    inputs: &[&E::Tensor],
    tokens: &[u32],
    wants: &dyn Fn(&str) -> bool,
) -> Result<StepOutputs<E::Tensor>> {
    if inputs.len() != step.inputs.len() {
        bail!(
            "driver: step {:?} got {} inputs, expected {}",
            step.outputs,
            inputs.len(),
            step.inputs.len()
        );
    }
    let one = |t: E::Tensor| StepOutputs {
        outputs: vec![t],
        extra: Vec::new(),
    };
    let x = |i: usize| inputs[i];
    Ok(match &step.op {
        Op::Embed => one(engine.embed(tokens)?),
        Op::RmsNorm { weight, eps, cols } => {
            one(engine.rms_norm(x(0), weight, *eps, cols.clone())?)
        }
        Op::Linear { weight } => one(engine.linear(x(0), weight)?),
        Op::RouterLogits { layer } => one(engine.router_logits(*layer, x(0))?),
        Op::Rope(s) => one(engine.rope(x(0), s)?),
        Op::IndexerScores { layer } => one(engine.indexer_scores(*layer, x(0), x(1))?),
        Op::TopK { k } => one(engine.top_k(x(0), *k)?),
        Op::Attention { layer } => {
            let probs_name = hook(*layer, point::ATTN_PROBS);
            let inp = MlaInputs {
                q_b: x(0),
                q_pe: x(1),
                kv_norm: x(2),
                k_pe: x(3),
                selection: inputs.get(4).copied(),
            };
            let (heads, probs) = engine.mla_attention(*layer, inp, wants(&probs_name))?;
            StepOutputs {
                outputs: vec![heads],
                extra: probs.map(|p| (probs_name, p)).into_iter().collect(),
            }
        }
        Op::MoeRoute { layer } => {
            let r = engine.moe_route(*layer, x(0))?;
            StepOutputs {
                outputs: vec![r.probs, r.ids, r.weights],
                extra: Vec::new(),
            }
        }
        Op::MoeExperts { layer } => {
            let want = |e: usize| wants(&expert_hook(*layer, e));
            let inp = ExpertInputs {
                x: x(0),
                ids: x(1),
                weights: x(2),
            };
            experts_outputs(*layer, engine.moe_experts(*layer, inp, &want)?)
        }
        Op::Mlp { gate, up, down } => one(engine.mlp(x(0), gate, up, down)?),
        Op::SwiGlu => one(engine.swiglu(x(0), x(1))?),
        Op::Add => one(engine.add(x(0), x(1))?),
        Op::Alias => StepOutputs {
            outputs: Vec::new(),
            extra: Vec::new(),
        },
        Op::ZerosLike => one(engine.zeros_like(x(0))?),
    })
}

/// The routed-experts step of layer `layer` from `own` (`ffn_norm`, `moe_topk_ids`,
/// `moe_weights`) as [`exec_step`] runs it, with each of `more` (the same three inputs, and its
/// rows) in the same pass ([`Engine::moe_experts_joint`]).
#[allow(clippy::type_complexity)]
fn exec_experts_joint<E: Engine>(
    engine: &E,
    layer: usize,
    own: [&E::Tensor; 3],
    more: &[(Vec<E::Tensor>, Vec<usize>)],
    wants: &dyn Fn(&str) -> bool,
) -> Result<(StepOutputs<E::Tensor>, Vec<Option<ExpertsOut<E::Tensor>>>)> {
    let want = |e: usize| wants(&expert_hook(layer, e));
    let further = more
        .iter()
        .map(|(inputs, rows)| match inputs.as_slice() {
            [x, ids, weights] => Ok((ExpertInputs { x, ids, weights }, rows.as_slice())),
            _ => bail!(
                "driver: layer {layer} experts: {} further inputs, expected 3",
                inputs.len()
            ),
        })
        .collect::<Result<Vec<_>>>()?;
    let [x, ids, weights] = own;
    let out = engine.moe_experts_joint(layer, ExpertInputs { x, ids, weights }, &further, &want)?;
    Ok((experts_outputs(layer, out.own), out.more))
}

/// A row-wise step with weights ([`rows::joins_rows`]) in one call on the own inputs' rows and,
/// after them, each further input's rows of `more`: the own outputs (the first rows; the same
/// bits as the step alone, since a row depends on its own input row only where the engine's
/// rows are independent) and each further input's outputs in its rows. `None` (nothing run)
/// where an input or an output is not f32 rows, or the further inputs do not match the own.
#[allow(clippy::type_complexity)]
fn exec_rows_joint<E: Engine>(
    engine: &E,
    step: &Step,
    own: &[&E::Tensor],
    more: &[(Vec<E::Tensor>, Vec<usize>)],
    tokens: &[u32],
    wants: &dyn Fn(&str) -> bool,
) -> Result<Option<(StepOutputs<E::Tensor>, Vec<Option<JointOut<E::Tensor>>>)>> {
    // Per input, `[T + R, width]`: the own rows, then each further input's rows in order.
    let mut joint = Vec::with_capacity(own.len());
    let mut t_own = None;
    for (i, x) in own.iter().enumerate() {
        let host = engine.download(x)?;
        let (HostData::F32(v), Some(&t)) = (&host.data, host.shape.first()) else {
            return Ok(None);
        };
        if t_own.is_some_and(|n| n != t) {
            return Ok(None);
        }
        t_own = Some(t);
        let mut data: Vec<f32> = v.to_vec();
        let mut rows_all = t;
        for (inputs, rows) in more {
            let Some(m) = inputs.get(i) else {
                return Ok(None);
            };
            let m = engine.download(m)?;
            if m.shape != host.shape {
                return Ok(None);
            }
            let HostData::F32(p) = m.gather_rows(rows)?.data else {
                return Ok(None);
            };
            data.extend_from_slice(&p);
            rows_all += rows.len();
        }
        let mut shape = host.shape.clone();
        shape[0] = rows_all;
        joint.push(engine.upload(&HostTensor::f32(shape, data)?)?);
    }
    let Some(t) = t_own else {
        return Ok(None);
    };
    let refs: Vec<&E::Tensor> = joint.iter().collect();
    let out = exec_step(engine, step, &refs, tokens, wants)?;
    if !out.extra.is_empty() {
        bail!(
            "driver: step {:?} gave optional outputs beside a joint computation",
            step.outputs
        );
    }
    let total: usize = t + more.iter().map(|(_, r)| r.len()).sum::<usize>();
    let mut own_out = Vec::with_capacity(out.outputs.len());
    let mut parts: Vec<Vec<(String, HostTensor)>> = vec![Vec::new(); more.len()];
    let own_rows: Vec<usize> = (0..t).collect();
    for (name, o) in step.outputs.iter().zip(&out.outputs) {
        let host = engine.download(o)?;
        if host.shape.first() != Some(&total) {
            bail!(
                "driver: step output {name} of a joint computation has shape {:?}, not {total} rows",
                host.shape
            );
        }
        own_out.push(engine.upload(&host.gather_rows(&own_rows)?)?);
        let mut at = t;
        for ((_, rows), part) in more.iter().zip(parts.iter_mut()) {
            let r: Vec<usize> = (at..at + rows.len()).collect();
            part.push((name.clone(), host.gather_rows(&r)?));
            at += rows.len();
        }
    }
    Ok(Some((
        StepOutputs {
            outputs: own_out,
            extra: Vec::new(),
        },
        parts.into_iter().map(|p| Some(JointOut::Rows(p))).collect(),
    )))
}

/// A routed-experts step's outputs of layer `layer` as a step gives them: the routed sum, then
/// each expert's outputs under its hook name.
fn experts_outputs<T>(layer: usize, out: ExpertsOut<T>) -> StepOutputs<T> {
    StepOutputs {
        outputs: vec![out.routed],
        extra: out
            .experts
            .into_iter()
            .map(|(e, t)| (expert_hook(layer, e), t))
            .collect(),
    }
}

/// Where each value of a plan lives and when it dies. Aliases (`Op::Alias` outputs) resolve to
/// the value they name, which lives until the last use of any of its names.
#[derive(Clone, Debug, Default)]
struct Liveness {
    /// Alias name -> the name of the stored value.
    alias: HashMap<String, String>,
    /// Stored value name -> index of the last step reading it.
    last_use: HashMap<String, usize>,
}

impl Liveness {
    fn new(plan: &Plan) -> Liveness {
        let mut l = Liveness::default();
        for s in &plan.steps {
            if s.op == Op::Alias {
                let src = l.resolve(&s.inputs[0]).to_string();
                l.alias.insert(s.outputs[0].clone(), src);
            }
        }
        for (i, s) in plan.steps.iter().enumerate() {
            for name in &s.inputs {
                let c = l.resolve(name).to_string();
                l.last_use.insert(c, i);
            }
        }
        l
    }

    fn resolve<'n>(&'n self, name: &'n str) -> &'n str {
        self.alias.get(name).map_or(name, String::as_str)
    }
}

/// One engine's walk through a plan: its values and the next step.
pub struct Runner<'a, E: Engine> {
    engine: &'a E,
    plan: &'a Plan,
    tokens: &'a [u32],
    live: Liveness,
    /// Names kept to the end whatever their last use (values a caller takes afterwards).
    keep: HashSet<String>,
    next: usize,
    env: HashMap<String, E::Tensor>,
    residency: Residency,
}

impl<'a, E: Engine> Runner<'a, E> {
    /// A runner at the plan's first step. `start` gives every [`Plan::free_inputs`] name (host
    /// values, uploaded here); `keep` names values to keep after their last use.
    pub fn new(
        engine: &'a E,
        plan: &'a Plan,
        tokens: &'a [u32],
        start: &[(String, HostTensor)],
        keep: &[String],
    ) -> Result<Runner<'a, E>> {
        let mut env = HashMap::new();
        for name in plan.free_inputs() {
            let (_, v) = start.iter().find(|(n, _)| *n == name).with_context(|| {
                format!(
                    "driver: the run starts at layer {} and needs {name}, which was not given",
                    plan.first_layer
                )
            })?;
            env.insert(name, engine.upload(v)?);
        }
        Ok(Runner {
            engine,
            plan,
            tokens,
            live: Liveness::new(plan),
            keep: keep.iter().cloned().collect(),
            next: 0,
            env,
            residency: Residency::default(),
        })
    }

    /// The engine.
    pub fn engine(&self) -> &'a E {
        self.engine
    }

    /// The step [`Runner::step`] runs next, `None` at the end.
    pub fn peek(&self) -> Option<&'a Step> {
        self.plan.steps.get(self.next)
    }

    /// The value called `name` (aliases resolved), if it is alive: an input of the next step, or
    /// an output of the step just run.
    pub fn get(&self, name: &str) -> Option<&E::Tensor> {
        self.env.get(self.live.resolve(name))
    }

    /// Runs the next step on the runner's own values (chained), keeps its outputs (readable with
    /// [`Runner::get`] until the next call) and returns the optional hooks `wants` asked for.
    pub fn step(&mut self, wants: &dyn Fn(&str) -> bool) -> Result<Vec<(String, E::Tensor)>> {
        self.step_joint(wants, &[]).map(|(extra, _)| extra)
    }

    /// [`Runner::step`], with the same step from each further inputs of `more` (one tensor per
    /// step input) in its rows computed in the same pass over the weights: a routed-experts
    /// step's ([`Engine::moe_experts_joint`]), or at short prompts a row-wise step's with
    /// weights ([`rows::joins_rows`], one call on the own rows and the further ones after them,
    /// where the engine's rows are independent). Also returns their results (`None` where the
    /// engine computes only whole steps; none for another step or an empty `more`).
    #[allow(clippy::type_complexity)]
    fn step_joint(
        &mut self,
        wants: &dyn Fn(&str) -> bool,
        more: &[(Vec<E::Tensor>, Vec<usize>)],
    ) -> Result<(Vec<(String, E::Tensor)>, Vec<Option<JointOut<E::Tensor>>>)> {
        let i = self.next;
        let s = self
            .plan
            .steps
            .get(i)
            .context("driver: the run is already at its end")?;
        // Values nobody reads from this step on are dropped (outputs of the step just run stay
        // readable until here).
        let (live, keep) = (&self.live, &self.keep);
        self.env
            .retain(|n, _| keep.contains(n) || live.last_use.get(n).is_some_and(|&j| j >= i));
        self.residency.enter(self.engine, self.plan, s)?;
        let out = {
            let inputs = s
                .inputs
                .iter()
                .map(|n| {
                    self.get(n).with_context(|| {
                        format!(
                            "driver: step {:?} needs {n}, which no earlier step produced",
                            s.outputs
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let context = || format!("driver: step {} ({})", s.outputs.join(", "), op_name(&s.op));
            let joined = if !more.is_empty()
                && rows::joins_rows(&s.op)
                && self.engine.rows_independent()
                && self.tokens.len() <= rows::JOINT_ROWS_MAX_TOKENS
            {
                exec_rows_joint(self.engine, s, &inputs, more, self.tokens, wants)
                    .with_context(context)?
            } else {
                None
            };
            match (joined, &s.op, inputs.as_slice()) {
                (Some(j), _, _) => j,
                (None, Op::MoeExperts { layer }, [x, ids, weights]) if !more.is_empty() => {
                    let (out, more) =
                        exec_experts_joint(self.engine, *layer, [x, ids, weights], more, wants)
                            .with_context(context)?;
                    let more = more.into_iter().map(|o| o.map(JointOut::Experts)).collect();
                    (out, more)
                }
                _ => (
                    exec_step(self.engine, s, &inputs, self.tokens, wants).with_context(context)?,
                    Vec::new(),
                ),
            }
        };
        let (out, joint) = out;
        for (name, t) in s.outputs.iter().zip(out.outputs) {
            self.env.insert(name.clone(), t);
        }
        self.next += 1;
        Ok((out.extra, joint))
    }

    /// Ends the walk's weight hooks on the engine: [`Engine::end_layer`] of the layer begun and
    /// [`Engine::end_model`]. Call it after the last step (or when stopping early); the runner's
    /// values stay readable.
    pub fn finish(&mut self) -> Result<()> {
        self.residency.finish(self.engine)
    }

    /// Takes a value kept with `keep` (or still alive) out of the runner.
    pub fn take(&mut self, name: &str) -> Option<E::Tensor> {
        let c = self.live.resolve(name).to_string();
        self.env.remove(&c)
    }
}

/// Runs `plan` on `engine` for the prompt `tokens` (positions `0..T`), chained: every step reads
/// the engine's own earlier outputs. Hooks the sink wants are downloaded and recorded. The plan
/// must start at layer 0 (see [`run_from`] otherwise).
pub fn run<E: Engine>(
    engine: &E,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    sink: &mut dyn Sink,
) -> Result<RunSummary> {
    run_from(engine, weights, tokens, plan, &[], sink, &NoProgress)
}

/// [`run`] from the values `start` of the plan's free inputs, reporting layers to `progress`.
pub fn run_from<E: Engine>(
    engine: &E,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    start: &[(String, HostTensor)],
    sink: &mut dyn Sink,
    progress: &dyn Progress,
) -> Result<RunSummary> {
    check_tokens(weights, tokens)?;
    let mut runner = Runner::new(engine, plan, tokens, start, &[])?;
    let mut summary = RunSummary {
        n_layers: plan.n_layers,
        tail: plan.tail,
        hooks_recorded: 0,
    };
    let mut steps = StepProgress::start(progress, plan);
    while let Some(s) = runner.peek() {
        steps.before(s);
        let extra = {
            let wants = |n: &str| sink.wants(n);
            runner.step(&wants)?
        };
        for name in &s.outputs {
            if sink.wants(name) {
                let t = runner.get(name).context("driver: output vanished")?;
                sink.record(name, engine.download(t)?)?;
                summary.hooks_recorded += 1;
            }
        }
        for (name, t) in extra {
            if sink.wants(&name) {
                sink.record(&name, engine.download(&t)?)?;
                summary.hooks_recorded += 1;
            }
        }
        steps.after(s);
    }
    runner.finish()?;
    steps.finish();
    Ok(summary)
}

/// Runs layers `0..layer` of the reference and returns the values a plan starting at `layer`
/// needs ([`Plan::free_inputs`] of `next`), as host tensors.
pub fn prefix_values<E: Engine>(
    engine: &E,
    weights: &Weights<'_>,
    tokens: &[u32],
    next: &Plan,
    progress: &dyn Progress,
) -> Result<Vec<(String, HostTensor)>> {
    check_tokens(weights, tokens)?;
    let need = next.free_inputs();
    if need.is_empty() {
        return Ok(Vec::new());
    }
    let plan = Plan::new(weights, next.first_layer, false)?;
    let mut runner = Runner::new(engine, &plan, tokens, &[], &need)?;
    progress.start("reference prefix", plan.layers().len() as u64);
    while let Some(s) = runner.peek() {
        runner.step(&|_| false)?;
        if is_layer_end(s) {
            progress.inc(1);
        }
    }
    runner.finish()?;
    progress.finish();
    need.into_iter()
        .map(|n| {
            let t = runner.get(&n).with_context(|| {
                format!("driver: layers 0..{} did not produce {n}", next.first_layer)
            })?;
            Ok((n, engine.download(t)?))
        })
        .collect()
}

/// Whether `s` is the last step of a layer (it produces `l_out`).
/// Progress over a plan's steps: one unit per layer, and one for the output layer (the final
/// norm, the output projection and what is done with the logits) when the plan has it.
pub(crate) struct StepProgress<'p> {
    progress: &'p dyn Progress,
    tail: bool,
    in_tail: bool,
}

impl<'p> StepProgress<'p> {
    /// Starts the phase for `plan`.
    pub(crate) fn start(progress: &'p dyn Progress, plan: &Plan) -> StepProgress<'p> {
        progress.start("layers", plan.layers().len() as u64 + u64::from(plan.tail));
        StepProgress {
            progress,
            tail: plan.tail,
            in_tail: false,
        }
    }

    /// Step `s` is about to run.
    pub(crate) fn before(&mut self, s: &Step) {
        if self.tail && !self.in_tail && s.layer.is_none() && s.op != Op::Embed {
            self.in_tail = true;
            self.progress.phase("output layer and logits");
        }
    }

    /// Step `s` has run.
    pub(crate) fn after(&self, s: &Step) {
        if is_layer_end(s) {
            self.progress.inc(1);
        }
    }

    /// Every step has run.
    pub(crate) fn finish(self) {
        if self.in_tail {
            self.progress.inc(1);
        }
        self.progress.finish();
    }
}

pub(crate) fn is_layer_end(s: &Step) -> bool {
    s.layer
        .is_some_and(|l| s.outputs.iter().any(|o| *o == hook(l, point::L_OUT)))
}

/// A short name of a step kind for error messages and step cases. The router logits are a
/// projection: `linear`, the name step cases have always given them.
pub fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Embed => "embed",
        Op::RmsNorm { .. } => "rms_norm",
        Op::Linear { .. } | Op::RouterLogits { .. } => "linear",
        Op::Rope(_) => "rope",
        Op::IndexerScores { .. } => "indexer_scores",
        Op::TopK { .. } => "top_k",
        Op::Attention { .. } => "mla_attention",
        Op::MoeRoute { .. } => "moe_route",
        Op::MoeExperts { .. } => "moe_experts",
        Op::Mlp { .. } => "mlp",
        Op::SwiGlu => "swiglu",
        Op::Add => "add",
        Op::Alias => "alias",
        Op::ZerosLike => "zeros_like",
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use crate::engine::cpu::{assemble_kv_b, CpuEngine};
    use crate::engine::HostTensor;
    use crate::gguf::Model;
    use crate::model::names::{self, blk};
    use crate::model::testutil::{build_with, metadata, tensor_names, tiny_hparams, tiny_model};
    use crate::model::{Arch, HParams};
    use crate::trace::{HookFilter, TraceSink};

    const TOKENS: [u32; 5] = [3, 1, 4, 1, 5];

    fn run_all(model: &Model, filter: HookFilter) -> BTreeMap<String, HostTensor> {
        let w = Weights::new(model).unwrap();
        let engine = CpuEngine::new(&w);
        let mut sink = TraceSink::new(filter);
        let plan = Plan::for_sink(&w, &sink).unwrap();
        run(&engine, &w, &TOKENS, &plan, &mut sink).unwrap();
        sink.into_tensors()
    }

    /// Same model as `tiny_model(hp)` with the legacy unsplit `attn_kv_b` and fused
    /// `ffn_gate_up_exps` (values rebuilt from the split tensors, in the layouts of spec 3.1 and
    /// llama.cpp's fused expert tensor).
    fn legacy_and_fused(hp: &HParams, a: &Model) -> Model {
        let mut over: HashMap<String, Vec<f32>> = HashMap::new();
        let mut names_b = Vec::new();
        for name in tensor_names(hp) {
            let (l, suffix) = names::split_blk(&name).unwrap_or((0, ""));
            match suffix {
                blk::ATTN_K_B => {
                    let k_b = a.dequantize_named(&name).unwrap();
                    let v_b = a.dequantize_named(&names::blk(l, blk::ATTN_V_B)).unwrap();
                    let (h, nope, v, kv_lora) = (hp.n_head, hp.qk_nope, hp.v_head, hp.kv_lora_rank);
                    let kv = assemble_kv_b(&k_b, &v_b, h, nope, v, kv_lora);
                    let n = names::blk(l, blk::ATTN_KV_B);
                    over.insert(n.clone(), kv);
                    names_b.push(n);
                }
                blk::FFN_GATE_EXPS => {
                    let g = a.dequantize_named(&name).unwrap();
                    let u = a
                        .dequantize_named(&names::blk(l, blk::FFN_UP_EXPS))
                        .unwrap();
                    let per = hp.n_ff_exp * hp.hidden;
                    let fused: Vec<f32> = (0..hp.n_expert)
                        .flat_map(|e| {
                            g[e * per..(e + 1) * per]
                                .iter()
                                .chain(&u[e * per..(e + 1) * per])
                                .copied()
                        })
                        .collect();
                    let n = names::blk(l, blk::FFN_GATE_UP_EXPS);
                    over.insert(n.clone(), fused);
                    names_b.push(n);
                }
                blk::ATTN_V_B | blk::FFN_UP_EXPS => {}
                _ => {
                    over.insert(name.clone(), a.dequantize_named(&name).unwrap());
                    names_b.push(name);
                }
            }
        }
        build_with(hp, &metadata(hp), &names_b, 32, &over)
    }

    #[test]
    fn legacy_kv_b_and_fused_gate_up_give_identical_hooks() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let a = tiny_model(&hp);
        let b = legacy_and_fused(&hp, &a);
        assert!(
            b.find("blk.0.attn_kv_b.weight").is_some() && b.find("blk.0.attn_k_b.weight").is_none()
        );
        let (ta, tb) = (
            run_all(&a, HookFilter::default()),
            run_all(&b, HookFilter::default()),
        );
        assert!(ta.contains_key("logits") && ta.contains_key("blk.1.moe_routed"));
        assert_eq!(ta, tb);
    }

    /// The CPU engine, recording the weights its projections are asked for and the layers of
    /// its router-logits calls.
    struct RouterProbe<'w> {
        cpu: CpuEngine<'w>,
        linears: RefCell<Vec<String>>,
        routers: RefCell<Vec<usize>>,
    }

    impl Engine for RouterProbe<'_> {
        type Tensor = HostTensor;
        fn describe(&self) -> String {
            self.cpu.describe()
        }
        fn precision(&self) -> crate::precision::Precision {
            self.cpu.precision()
        }
        fn upload(&self, t: &HostTensor) -> Result<HostTensor> {
            self.cpu.upload(t)
        }
        fn download(&self, t: &HostTensor) -> Result<HostTensor> {
            self.cpu.download(t)
        }
        fn embed(&self, ids: &[u32]) -> Result<HostTensor> {
            self.cpu.embed(ids)
        }
        fn rms_norm(
            &self,
            x: &HostTensor,
            weight: &str,
            eps: f64,
            cols: Option<std::ops::Range<usize>>,
        ) -> Result<HostTensor> {
            self.cpu.rms_norm(x, weight, eps, cols)
        }
        fn linear(&self, x: &HostTensor, weight: &str) -> Result<HostTensor> {
            self.linears.borrow_mut().push(weight.to_string());
            self.cpu.linear(x, weight)
        }
        fn router_logits(&self, layer: usize, x: &HostTensor) -> Result<HostTensor> {
            self.routers.borrow_mut().push(layer);
            self.cpu.router_logits(layer, x)
        }
        fn rope(&self, x: &HostTensor, s: &crate::model::RopeSlice) -> Result<HostTensor> {
            self.cpu.rope(x, s)
        }
        fn indexer_scores(
            &self,
            layer: usize,
            a: &HostTensor,
            cq: &HostTensor,
        ) -> Result<HostTensor> {
            self.cpu.indexer_scores(layer, a, cq)
        }
        fn top_k(&self, scores: &HostTensor, k: usize) -> Result<HostTensor> {
            self.cpu.top_k(scores, k)
        }
        fn mla_attention(
            &self,
            layer: usize,
            x: MlaInputs<'_, HostTensor>,
            want_probs: bool,
        ) -> Result<(HostTensor, Option<HostTensor>)> {
            self.cpu.mla_attention(layer, x, want_probs)
        }
        fn moe_route(
            &self,
            layer: usize,
            logits: &HostTensor,
        ) -> Result<crate::engine::Routing<HostTensor>> {
            self.cpu.moe_route(layer, logits)
        }
        fn moe_experts(
            &self,
            layer: usize,
            x: ExpertInputs<'_, HostTensor>,
            want_expert: &dyn Fn(usize) -> bool,
        ) -> Result<crate::engine::ExpertsOut<HostTensor>> {
            self.cpu.moe_experts(layer, x, want_expert)
        }
        fn mlp(&self, x: &HostTensor, gate: &str, up: &str, down: &str) -> Result<HostTensor> {
            self.cpu.mlp(x, gate, up, down)
        }
        fn swiglu(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
            self.cpu.swiglu(a, b)
        }
        fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
            self.cpu.add(a, b)
        }
    }

    /// The driver hands the router logits of every MoE layer, and nothing else, to
    /// `Engine::router_logits`, never to `linear`: an engine learns which projection is the
    /// router from the step, not from a tensor name. The CPU engine computes them as the
    /// projection of `ffn_norm` by `ffn_gate_inp`.
    #[test]
    fn router_logits_reach_their_engine_method() {
        for arch in [Arch::GlmDsa, Arch::Deepseek2] {
            let hp = tiny_hparams(arch);
            let model = tiny_model(&hp);
            let w = Weights::new(&model).unwrap();
            let probe = RouterProbe {
                cpu: CpuEngine::new(&w),
                linears: RefCell::default(),
                routers: RefCell::default(),
            };
            let mut sink = TraceSink::new(HookFilter::default());
            run(&probe, &w, &TOKENS, &Plan::full(&w).unwrap(), &mut sink).unwrap();
            let moe: Vec<usize> = (0..hp.n_layer).filter(|&l| !hp.is_dense(l)).collect();
            assert!(!moe.is_empty());
            assert_eq!(*probe.routers.borrow(), moe, "{arch:?}");
            let linears = probe.linears.borrow();
            assert!(!linears.is_empty());
            assert!(
                linears.iter().all(|n| !n.ends_with(blk::FFN_GATE_INP)),
                "{arch:?}: {linears:?}"
            );
            let t = sink.into_tensors();
            for l in moe {
                let x = &t[&hook(l, point::FFN_NORM)];
                let want = probe
                    .cpu
                    .linear(x, &names::blk(l, blk::FFN_GATE_INP))
                    .unwrap();
                assert_eq!(t[&hook(l, point::MOE_LOGITS)], want, "{arch:?} layer {l}");
            }
        }
    }

    #[test]
    fn model_without_q_lora_uses_attn_q() {
        let mut hp = tiny_hparams(Arch::Deepseek2);
        hp.q_lora_rank = None;
        let t = run_all(&tiny_model(&hp), HookFilter::default());
        assert!(t.contains_key("blk.0.q_b") && !t.contains_key("blk.0.q_a"));
        assert_eq!(t["blk.0.q_b"].shape, vec![5, hp.n_head * hp.qk_head()]);
        assert_eq!(t["logits"].shape, vec![5, 32]);
    }

    #[test]
    fn shared_indexer_layer_reuses_the_previous_selection() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        if let Some(ix) = &mut hp.indexer {
            ix.full = vec![true, false];
        }
        let t = run_all(&tiny_model(&hp), HookFilter::default());
        assert!(t.contains_key("blk.0.indexer_scores") && !t.contains_key("blk.1.indexer_scores"));
        assert_eq!(t["blk.1.indexer_topk"], t["blk.0.indexer_topk"]);
        // T = 5 > top_k = 3: rows 0..2 are padded with -1.
        assert_eq!(t["blk.0.indexer_topk"].shape, vec![5, 3]);
        assert_eq!(
            &t["blk.0.indexer_topk"].as_i32("").unwrap()[..3],
            &[0, -1, -1]
        );
    }

    #[test]
    fn model_without_shared_experts_has_zero_ffn_shexp() {
        let mut hp = tiny_hparams(Arch::Deepseek2);
        hp.n_expert_shared = 0;
        let t = run_all(&tiny_model(&hp), HookFilter::default());
        let routed = t["blk.1.moe_routed"].as_f32("").unwrap();
        let shexp = &t["blk.1.ffn_shexp"];
        assert_eq!(shexp.shape, t["blk.1.moe_routed"].shape);
        assert!(shexp.as_f32("").unwrap().iter().all(|&v| v == 0.0));
        // x + 0 == x (up to the sign of zero).
        let out = t["blk.1.ffn_out"].as_f32("").unwrap();
        assert!(out.iter().zip(routed).all(|(a, b)| a == b));
    }

    #[test]
    fn run_stops_after_the_last_wanted_layer() {
        let hp = tiny_hparams(Arch::GlmDsa);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let only0 = TraceSink::new(HookFilter {
            layers: Some(0..1),
            globs: vec![],
        });
        let p = Plan::for_sink(&w, &only0).unwrap();
        assert_eq!((p.n_layers, p.tail), (1, false));
        let with_logits = TraceSink::new(HookFilter {
            layers: Some(0..1),
            globs: vec!["blk.*".into(), "logits".into()],
        });
        let p = Plan::for_sink(&w, &with_logits).unwrap();
        assert_eq!((p.n_layers, p.tail), (2, true));
        let t = run_all(
            &model,
            HookFilter {
                layers: Some(1..2),
                globs: vec!["blk.*.exp.*".into(), "blk.*.attn_probs".into()],
            },
        );
        assert!(t
            .keys()
            .all(|k| k.starts_with("blk.1.exp.") || k == "blk.1.attn_probs"));
        let n_routed: usize = t
            .iter()
            .filter(|(k, _)| k.contains(".exp."))
            .map(|(_, v)| v.shape[0])
            .sum();
        assert_eq!(n_routed, TOKENS.len() * hp.n_expert_used);
        assert_eq!(t["blk.1.attn_probs"].shape, vec![hp.n_head, 5, 5]);
    }

    /// Regression: `bench layer --tokens 999999` aborted on a 4 TB `[T, T]` allocation; a run
    /// longer than the model's `context_length` is refused before any step.
    #[test]
    fn tokens_beyond_the_context_length_are_an_error_not_an_abort() {
        let mut hp = tiny_hparams(Arch::GlmDsa);
        hp.n_ctx = Some(4);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        assert_eq!(w.hparams().n_ctx, Some(4));
        let engine = CpuEngine::new(&w);
        let mut sink = TraceSink::new(HookFilter::default());
        let plan = Plan::full(&w).unwrap();
        run(&engine, &w, &[1, 2, 3, 4], &plan, &mut sink).unwrap();
        let e = run(&engine, &w, &[1, 2, 3, 4, 5], &plan, &mut sink).unwrap_err();
        assert!(
            format!("{e:#}").contains("5 tokens exceed the context_length 4"),
            "{e:#}"
        );
    }

    #[test]
    fn tokens_outside_the_vocabulary_are_an_error() {
        let hp = tiny_hparams(Arch::Deepseek2);
        let model = tiny_model(&hp);
        let w = Weights::new(&model).unwrap();
        let engine = CpuEngine::new(&w);
        let mut sink = TraceSink::new(HookFilter::default());
        let plan = Plan::full(&w).unwrap();
        let e = run(&engine, &w, &[1, 32], &plan, &mut sink).unwrap_err();
        assert!(
            format!("{e:#}").contains("token 1 has id 32, outside the vocabulary 0..32"),
            "{e:#}"
        );
    }
}
