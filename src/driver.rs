//! The driver: walks the model's ordered steps ([`crate::model::steps`]) over an [`Engine`] and
//! hands every hook a sink wants to it.
//!
//! Values live in an environment keyed by hook name and are dropped after their last use, so a
//! whole model runs with a few layers' worth of activations. A step reads its inputs by hook
//! name, which is what makes an isolated (replay) mode a matter of input policy: [`exec_step`]
//! takes its inputs as references, so a two-engine driver can feed the candidate engine the
//! reference's downloaded-and-uploaded inputs instead of its own, step by step, without either
//! engine knowing. [`run`] is the chained mode of one engine (what `glmdiff trace` needs).
//!
//! Extent: layers run in order from 0; the run stops after the last layer that has a hook the
//! sink wants, unless the sink wants `result_norm` or `logits`, in which case every layer runs
//! and the final norm and logits follow ([`Plan::for_sink`]).

use std::collections::HashMap;
use std::rc::Rc;

use anyhow::{bail, Context, Result};

use crate::engine::Engine;
use crate::model::steps::{self, expert_hook, hook, point, Op, Step};
use crate::model::Weights;
use crate::trace::Sink;

/// The steps to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// Layers run (`0..n_layers`).
    pub n_layers: usize,
    /// Whether the final norm and logits run.
    pub tail: bool,
}

impl Plan {
    /// Embedding, layers `0..n_layers`, and the tail when `tail` (which needs every layer).
    pub fn new(weights: &Weights<'_>, n_layers: usize, tail: bool) -> Result<Plan> {
        let hp = weights.hparams();
        if n_layers > hp.n_layer {
            bail!(
                "driver: {n_layers} layers asked, the model runs {}",
                hp.n_layer
            );
        }
        if tail && n_layers != hp.n_layer {
            bail!(
                "driver: logits need all {} layers, not {n_layers}",
                hp.n_layer
            );
        }
        let mut s = steps::embed_steps();
        for l in 0..n_layers {
            s.extend(steps::layer_steps(hp, l));
        }
        if tail {
            s.extend(steps::tail_steps(hp, n_layers, weights.output_name()));
        }
        Ok(Plan {
            steps: s,
            n_layers,
            tail,
        })
    }

    /// The whole forward pass: every layer, then final norm and logits.
    pub fn full(weights: &Weights<'_>) -> Result<Plan> {
        Plan::new(weights, weights.hparams().n_layer, true)
    }

    /// The shortest run that produces every hook `sink` wants (see the module documentation).
    pub fn for_sink(weights: &Weights<'_>, sink: &dyn Sink) -> Result<Plan> {
        let hp = weights.hparams();
        if sink.wants(point::RESULT_NORM) || sink.wants(point::LOGITS) {
            return Plan::full(weights);
        }
        let layer_wanted = |l: usize| {
            steps::layer_steps(hp, l)
                .iter()
                .flat_map(|s| &s.outputs)
                .any(|o| sink.wants(o))
                || sink.wants(&hook(l, point::ATTN_PROBS))
                || (!hp.is_dense(l) && (0..hp.n_expert).any(|e| sink.wants(&expert_hook(l, e))))
        };
        let n_layers = (0..hp.n_layer)
            .rev()
            .find(|&l| layer_wanted(l))
            .map_or(0, |l| l + 1);
        Plan::new(weights, n_layers, false)
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Layers run.
    pub n_layers: usize,
    /// Whether logits were computed.
    pub tail: bool,
    /// Hooks handed to the sink.
    pub hooks_recorded: usize,
}

/// Outputs of one step: its declared outputs in order, then optional extra hooks.
pub struct StepOutputs<T> {
    /// One tensor per `step.outputs` entry.
    pub outputs: Vec<Rc<T>>,
    /// Optional hooks (`attn_probs`, `exp.{e}.out`) the sink asked for, by name.
    pub extra: Vec<(String, T)>,
}

/// Runs one step on `engine` with `inputs` (one per `step.inputs`, in order). `tokens` feeds the
/// embedding step; `sink` is only asked which optional hooks to produce.
pub fn exec_step<E: Engine>(
    engine: &E,
    step: &Step,
    inputs: &[Rc<E::Tensor>],
    tokens: &[u32],
    sink: &dyn Sink,
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
        outputs: vec![Rc::new(t)],
        extra: Vec::new(),
    };
    let x = |i: usize| inputs[i].as_ref();
    Ok(match &step.op {
        Op::Embed => one(engine.embed(tokens)?),
        Op::RmsNorm { weight, eps, cols } => {
            one(engine.rms_norm(x(0), weight, *eps, cols.clone())?)
        }
        Op::Linear { weight } => one(engine.linear(x(0), weight)?),
        Op::Rope(s) => one(engine.rope(x(0), s)?),
        Op::IndexerScores { layer } => one(engine.indexer_scores(*layer, x(0), x(1))?),
        Op::TopK { k } => one(engine.top_k(x(0), *k)?),
        Op::Attention { layer } => {
            let probs_name = hook(*layer, point::ATTN_PROBS);
            let want = sink.wants(&probs_name);
            let sel = inputs.get(4).map(|t| t.as_ref());
            let (heads, probs) = engine.mla_attention(*layer, x(0), x(1), x(2), x(3), sel, want)?;
            StepOutputs {
                outputs: vec![Rc::new(heads)],
                extra: probs.map(|p| (probs_name, p)).into_iter().collect(),
            }
        }
        Op::MoeRoute { layer } => {
            let r = engine.moe_route(*layer, x(0))?;
            StepOutputs {
                outputs: vec![Rc::new(r.probs), Rc::new(r.ids), Rc::new(r.weights)],
                extra: Vec::new(),
            }
        }
        Op::MoeExperts { layer } => {
            let want = |e: usize| sink.wants(&expert_hook(*layer, e));
            let out = engine.moe_experts(*layer, x(0), x(1), x(2), &want)?;
            StepOutputs {
                outputs: vec![Rc::new(out.routed)],
                extra: out
                    .experts
                    .into_iter()
                    .map(|(e, t)| (expert_hook(*layer, e), t))
                    .collect(),
            }
        }
        Op::Mlp { gate, up, down } => one(engine.mlp(x(0), gate, up, down)?),
        Op::SwiGlu => one(engine.swiglu(x(0), x(1))?),
        Op::Add => one(engine.add(x(0), x(1))?),
        Op::Alias => StepOutputs {
            outputs: vec![Rc::clone(&inputs[0])],
            extra: Vec::new(),
        },
        Op::ZerosLike => one(engine.zeros_like(x(0))?),
    })
}

/// Runs `plan` on `engine` for the prompt `tokens` (positions `0..T`), chained: every step reads
/// the engine's own earlier outputs. Hooks the sink wants are downloaded and recorded.
pub fn run<E: Engine>(
    engine: &E,
    weights: &Weights<'_>,
    tokens: &[u32],
    plan: &Plan,
    sink: &mut dyn Sink,
) -> Result<RunSummary> {
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
    // Index of the last step reading each name: values are dropped after it.
    let mut last_use: HashMap<&str, usize> = HashMap::new();
    for (i, s) in plan.steps.iter().enumerate() {
        for name in &s.inputs {
            last_use.insert(name, i);
        }
    }
    let mut env: HashMap<String, Rc<E::Tensor>> = HashMap::new();
    let mut summary = RunSummary {
        n_layers: plan.n_layers,
        tail: plan.tail,
        hooks_recorded: 0,
    };
    for (i, s) in plan.steps.iter().enumerate() {
        let inputs = s
            .inputs
            .iter()
            .map(|n| {
                env.get(n).cloned().with_context(|| {
                    format!(
                        "driver: step {:?} needs {n}, which no earlier step produced",
                        s.outputs
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let out = exec_step(engine, s, &inputs, tokens, &*sink).with_context(|| {
            format!("driver: step {} ({})", s.outputs.join(", "), op_name(&s.op))
        })?;
        drop(inputs);
        for (name, t) in s.outputs.iter().zip(out.outputs) {
            if sink.wants(name) {
                sink.record(name, engine.download(&t)?)?;
                summary.hooks_recorded += 1;
            }
            if last_use.get(name.as_str()).is_some_and(|&j| j > i) {
                env.insert(name.clone(), t);
            }
        }
        for (name, t) in out.extra {
            if sink.wants(&name) {
                sink.record(&name, engine.download(&t)?)?;
                summary.hooks_recorded += 1;
            }
        }
        for name in &s.inputs {
            if last_use.get(name.as_str()) == Some(&i) {
                env.remove(name);
            }
        }
    }
    Ok(summary)
}

/// A short name of a step kind for error messages.
fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Embed => "embed",
        Op::RmsNorm { .. } => "rms_norm",
        Op::Linear { .. } => "linear",
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
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::HostTensor;
    use crate::gguf::Model;
    use crate::model::names::{self, blk};
    use crate::model::testutil::{
        assemble_kv_b_for_tests, build_with, metadata, tensor_names, tiny_hparams, tiny_model,
    };
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
                    let kv = assemble_kv_b_for_tests(&k_b, &v_b, hp);
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
