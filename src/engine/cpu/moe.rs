//! MoE router and routed experts on the CPU.
//!
//! Router (spec 2.3; transformers `GlmMoeDsaTopkRouter` / `DeepseekV3TopkRouter`; llama.cpp
//! `src/llama-graph.cpp` `build_moe_ffn`): probabilities `s = sigmoid(logits)` (or softmax),
//! selection on `s + exp_probs_b` (the bias only chooses), optional group-limited selection
//! (group score = sum of the group's two best selection scores; the `used` best groups stay),
//! top-K, weights `s[idx]` normalised to sum 1 when `expert_weights_norm`, times
//! `expert_weights_scale`. Ties in every top-k go to the lower index.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::math::Rows;
use super::math::{sigmoid, softmax_in_place, swiglu};
use super::weights::RowSource;
use super::CpuEngine;
use crate::engine::{ExpertsOut, HostTensor, Routing};
use crate::model::names::{self, blk};
use crate::model::{Gating, HParams};
use crate::util::topk::top_k;

/// Experts summed into a group's score (DeepSeek-V3: the two best of each group).
const GROUP_SCORE_TOP: usize = 2;

/// Routing of one token: selected experts (best selection score first) and their weights.
pub fn route_token(
    hp: &HParams,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> (Vec<f64>, Vec<usize>, Vec<f64>) {
    let mut probs: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
    match hp.gating {
        Gating::Sigmoid => probs.iter_mut().for_each(|p| *p = sigmoid(*p)),
        Gating::Softmax => softmax_in_place(&mut probs),
    }
    let mut score: Vec<f64> = match bias {
        Some(b) => probs
            .iter()
            .zip(b)
            .map(|(&p, &b)| p + f64::from(b))
            .collect(),
        None => probs.clone(),
    };
    if let Some((n_group, used)) = hp.groups {
        let size = hp.n_expert / n_group;
        let group_scores: Vec<f64> = score
            .chunks(size)
            .map(|g| {
                let mut best = g.to_vec();
                best.sort_by(|a, b| b.total_cmp(a));
                best.iter().take(GROUP_SCORE_TOP).sum()
            })
            .collect();
        let keep = top_k(&group_scores, used);
        for (g, chunk) in score.chunks_mut(size).enumerate() {
            if !keep.contains(&g) {
                chunk.fill(f64::NEG_INFINITY);
            }
        }
    }
    let ids = top_k(&score, hp.n_expert_used);
    let w = selected_weights(hp, &probs, &ids);
    (probs, ids, w)
}

/// The routing weights of experts `ids` of one token with probabilities `probs`: `probs[id]`,
/// normalised to sum 1 when `expert_weights_norm`, times `expert_weights_scale`.
pub fn selected_weights(hp: &HParams, probs: &[f64], ids: &[usize]) -> Vec<f64> {
    let mut w: Vec<f64> = ids
        .iter()
        .map(|&e| probs.get(e).copied().unwrap_or(0.0))
        .collect();
    if hp.expert_weights_norm {
        let sum: f64 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= sum);
    }
    w.iter_mut().for_each(|x| *x *= hp.expert_weights_scale);
    w
}

impl<'w> CpuEngine<'w> {
    /// Router of layer `layer` (see [`crate::engine::Engine::moe_route`]).
    pub(super) fn moe_route_cpu(
        &self,
        layer: usize,
        logits: &HostTensor,
    ) -> Result<Routing<HostTensor>> {
        let hp = self.weights.hparams();
        let (t, e) = logits.dims2("moe_logits")?;
        if e != hp.n_expert {
            bail!(
                "engine: cpu: layer {layer} router: {e} logits per token for {} experts",
                hp.n_expert
            );
        }
        let bias_name = names::blk(layer, blk::EXP_PROBS_B);
        let bias = if self.weights.has(&bias_name) {
            Some(self.host_vector(&bias_name)?)
        } else {
            None
        };
        let lg = logits.as_f32("moe_logits")?;
        let k = hp.n_expert_used;
        let (mut probs, mut ids, mut weights) = (
            Vec::with_capacity(t * e),
            Vec::with_capacity(t * k),
            Vec::with_capacity(t * k),
        );
        for row in lg.chunks_exact(e) {
            let (p, i, w) = route_token(hp, row, bias.as_deref());
            probs.extend(p.iter().map(|&x| x as f32));
            ids.extend(i.iter().map(|&x| x as i32));
            weights.extend(w.iter().map(|&x| x as f32));
        }
        Ok(Routing {
            probs: HostTensor::f32(vec![t, e], probs)?,
            ids: HostTensor::i32(vec![t, k], ids)?,
            weights: HostTensor::f32(vec![t, k], weights)?,
        })
    }

    /// Routed experts of layer `layer` (see [`crate::engine::Engine::moe_experts`]). Experts run
    /// one after another in ascending id; only the experts some token selected are dequantized,
    /// and only their slices of the stacked tensors. The weighted sum is accumulated in f64 in
    /// ascending expert order (fixed, so independent of threads).
    pub(super) fn moe_experts_cpu(
        &self,
        layer: usize,
        x: &HostTensor,
        ids: &HostTensor,
        weights: &HostTensor,
        want_expert: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertsOut<HostTensor>> {
        self.moe_experts_with(layer, x, ids, weights, want_expert, &|e| {
            self.expert_rows(layer, e)
        })
    }

    /// Expert `e`'s `[gate, up, down]` rows of layer `layer` as the file holds them (from
    /// `ffn_gate_exps`/`ffn_up_exps` or the fused `ffn_gate_up_exps`, and `ffn_down_exps`).
    pub fn expert_rows(&self, layer: usize, e: usize) -> Result<[Rows<'w>; 3]> {
        let (gate, up) = self.weights.expert_gate_up_desc(layer, e)?;
        let down_name = names::blk(layer, blk::FFN_DOWN_EXPS);
        let down = self.weights.expert_desc(&down_name, e)?;
        Ok([
            Rows::Source(RowSource::new(gate)),
            Rows::Source(RowSource::new(up)),
            Rows::Source(RowSource::new(down)),
        ])
    }

    /// One expert's unweighted outputs `down(silu(gate x) * up x)` for the `n` rows of `xs`
    /// (`[n, hidden]` -> `[n, hidden]`), with its `[gate, up, down]` rows.
    pub fn expert_output(&self, rows: &[Rows<'_>; 3], xs: &[f32], n: usize) -> Result<Vec<f32>> {
        let g = self.rows_matmul(&rows[0], xs, n)?; // [n, n_ff_exp]
        let u = self.rows_matmul(&rows[1], xs, n)?;
        let act = swiglu(&g, &u);
        self.rows_matmul(&rows[2], &act, n) // [n, hidden]
    }

    /// The routed experts as [`CpuEngine::moe_experts_cpu`] computes them, with expert `e`'s
    /// `[gate, up, down]` rows given by `expert(e)` (the reference passes
    /// [`CpuEngine::expert_rows`]; another realisation of the weights, e.g. an expert mapping,
    /// passes its own).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_experts_with(
        &self,
        layer: usize,
        x: &HostTensor,
        ids: &HostTensor,
        weights: &HostTensor,
        want_expert: &dyn Fn(usize) -> bool,
        expert: &(dyn Fn(usize) -> Result<[Rows<'w>; 3]> + Sync),
    ) -> Result<ExpertsOut<HostTensor>> {
        self.moe_experts_tokens(layer, x, ids, weights, None, want_expert, expert)
    }

    /// [`CpuEngine::moe_experts_with`] for the token rows `rows` only (all when `None`; see
    /// [`crate::engine::Engine::moe_experts_rows`]). A token's row is the same whichever others
    /// are computed: each expert's products are one dot product per value, and a token's sum
    /// runs over its own experts in ascending order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_experts_tokens(
        &self,
        layer: usize,
        x: &HostTensor,
        ids: &HostTensor,
        weights: &HostTensor,
        rows: Option<&[usize]>,
        want_expert: &dyn Fn(usize) -> bool,
        expert: &(dyn Fn(usize) -> Result<[Rows<'w>; 3]> + Sync),
    ) -> Result<ExpertsOut<HostTensor>> {
        let group = ExpertGroup {
            x,
            ids,
            weights,
            rows,
        };
        let mut out = self.moe_experts_groups(layer, &[group], want_expert, expert)?;
        out.pop()
            .ok_or_else(|| anyhow::anyhow!("engine: cpu: layer {layer} experts: no output"))
    }

    /// [`CpuEngine::moe_experts_tokens`] of every group of `groups` (the same layer's step from
    /// other inputs, each in its own rows) in one pass over the experts: an expert selected in
    /// several groups is dequantized once and computes all their tokens together. Each group's
    /// result is bit for bit what it gives alone, since a token's row is the same whichever
    /// others are computed.
    pub(super) fn moe_experts_groups(
        &self,
        layer: usize,
        groups: &[ExpertGroup<'_>],
        want_expert: &dyn Fn(usize) -> bool,
        expert: &(dyn Fn(usize) -> Result<[Rows<'w>; 3]> + Sync),
    ) -> Result<Vec<ExpertsOut<HostTensor>>> {
        let hp = self.weights.hparams();
        // routed[e] = (group, output row, token, weight), group by group in token order.
        let mut routed: Vec<Vec<(usize, usize, usize, f32)>> = vec![Vec::new(); hp.n_expert];
        let mut hidden = None;
        let mut values = Vec::with_capacity(groups.len());
        let mut n_tokens = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let (x, ids, weights) = (group.x, group.ids, group.weights);
            let (t, h) = x.dims2("moe input")?;
            let (ti, k) = ids.dims2("moe_topk_ids")?;
            if ti != t || weights.shape != ids.shape || hidden.is_some_and(|w| w != h) {
                bail!(
                    "engine: cpu: layer {layer} experts: input {:?}, ids {:?}, weights {:?} disagree",
                    x.shape,
                    ids.shape,
                    weights.shape
                );
            }
            hidden = Some(h);
            let (xv, idv, wv) = (
                x.as_f32("moe input")?,
                ids.as_i32("moe_topk_ids")?,
                weights.as_f32("moe_weights")?,
            );
            let tokens: Vec<usize> = match group.rows {
                None => (0..t).collect(),
                Some(r) => {
                    super::attention::check_rows(r, t).map_err(|e| {
                        anyhow::anyhow!("engine: cpu: layer {layer} experts: token {e}")
                    })?;
                    r.to_vec()
                }
            };
            for (i, &tok) in tokens.iter().enumerate() {
                for j in 0..k {
                    let e = idv[tok * k + j];
                    if e < 0 || e as usize >= hp.n_expert {
                        bail!(
                            "engine: cpu: layer {layer}: token {tok} selects expert {e} of {}",
                            hp.n_expert
                        );
                    }
                    routed[e as usize].push((g, i, tok, wv[tok * k + j]));
                }
            }
            values.push(xv);
            n_tokens.push(tokens.len());
        }
        let hidden = hidden.unwrap_or(hp.hidden);
        let mut acc: Vec<Vec<f64>> = n_tokens.iter().map(|&n| vec![0f64; n * hidden]).collect();
        let mut extra: Vec<Vec<(usize, HostTensor)>> = vec![Vec::new(); groups.len()];
        let active: Vec<usize> = (0..routed.len())
            .filter(|&e| !routed[e].is_empty())
            .collect();
        // Experts go in waves of EXPERT_WAVE, each wave's outputs computed on the threads (a
        // device's products of one expert overlap the CPU's work on another: its inputs, its
        // SwiGLU, its checks), then added in ascending expert order, each output row on a
        // thread of its own: every row's sum runs over its experts in the same order as one
        // expert at a time.
        for wave in active.chunks(EXPERT_WAVE) {
            let ys: Vec<Vec<f32>> = wave
                .par_iter()
                .map(|&e| {
                    let toks = &routed[e];
                    let xs: Vec<f32> = toks
                        .iter()
                        .flat_map(|&(g, _, tok, _)| {
                            values[g][tok * hidden..(tok + 1) * hidden].iter()
                        })
                        .copied()
                        .collect(); // [n, hidden]
                    let rows = expert(e)?;
                    if rows[0].cols() != hidden {
                        bail!(
                            "engine: cpu: layer {layer}: expert {e} takes {} inputs, the hidden size is {hidden}",
                            rows[0].cols()
                        );
                    }
                    self.expert_output(&rows, &xs, toks.len()) // [n, hidden]
                })
                .collect::<Result<_>>()?;
            // Per group and output row, its (expert of the wave, output row of that expert,
            // weight) in ascending expert order.
            let mut into: Vec<Vec<Vec<(usize, usize, f64)>>> =
                n_tokens.iter().map(|&n| vec![Vec::new(); n]).collect();
            for (k, &e) in wave.iter().enumerate() {
                for (i, &(g, row, _, w)) in routed[e].iter().enumerate() {
                    into[g][row].push((k, i, f64::from(w)));
                }
            }
            for (a, into) in acc.iter_mut().zip(&into) {
                a.par_chunks_mut(hidden.max(1))
                    .zip(into.par_iter())
                    .for_each(|(a, adds)| {
                        for &(k, i, w) in adds {
                            for (a, &v) in a.iter_mut().zip(&ys[k][i * hidden..(i + 1) * hidden]) {
                                *a += w * f64::from(v);
                            }
                        }
                    });
            }
            for (&e, y) in wave.iter().zip(&ys) {
                if !want_expert(e) {
                    continue;
                }
                let toks = &routed[e];
                for (g, out) in extra.iter_mut().enumerate() {
                    let ys: Vec<f32> = toks
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.0 == g)
                        .flat_map(|(i, _)| y[i * hidden..(i + 1) * hidden].iter())
                        .copied()
                        .collect(); // [n_g, hidden]
                    if !ys.is_empty() {
                        out.push((e, HostTensor::f32(vec![ys.len() / hidden, hidden], ys)?));
                    }
                }
            }
        }
        acc.into_iter()
            .zip(extra)
            .zip(n_tokens)
            .map(|((acc, experts), n)| {
                let out = acc.iter().map(|&v| v as f32).collect();
                Ok(ExpertsOut {
                    routed: HostTensor::f32(vec![n, hidden], out)?,
                    experts,
                })
            })
            .collect()
    }
}

/// Experts computed together (on the threads) before their outputs are added: enough to keep a
/// device busy while the CPU prepares and checks the others, few enough that their outputs
/// (`[n_e, hidden]` each) stay small.
const EXPERT_WAVE: usize = 16;

/// One group of [`CpuEngine::moe_experts_groups`]: a layer's expert inputs and the token rows
/// computed (all when `None`).
pub(super) struct ExpertGroup<'a> {
    /// `ffn_norm`, `[T, hidden]`.
    pub(super) x: &'a HostTensor,
    /// `moe_topk_ids`, `[T, K]` i32.
    pub(super) ids: &'a HostTensor,
    /// `moe_weights`, `[T, K]`.
    pub(super) weights: &'a HostTensor,
    /// Token rows computed, ascending and distinct; all when `None`.
    pub(super) rows: Option<&'a [usize]>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, RopeParams};

    fn hp(n_expert: usize, k: usize, groups: Option<(usize, usize)>) -> HParams {
        HParams {
            arch: Arch::Deepseek2,
            hidden: 4,
            n_block: 1,
            n_nextn: 0,
            n_layer: 1,
            n_dense: 0,
            n_ff: 4,
            n_ctx: None,
            n_head: 1,
            q_lora_rank: None,
            kv_lora_rank: 2,
            qk_nope: 2,
            qk_rope: 2,
            v_head: 2,
            rms_eps: 1e-6,
            n_expert,
            n_expert_used: k,
            n_expert_shared: 0,
            n_ff_exp: 2,
            groups,
            expert_weights_scale: 2.5,
            expert_weights_norm: true,
            gating: Gating::Sigmoid,
            rope: RopeParams {
                dim: 2,
                base: 10000.0,
                yarn: None,
            },
            indexer: None,
        }
    }

    /// 8 experts in 4 groups of 2, keep 2 groups, pick 2 experts. Selection scores (probs + bias)
    /// chosen by hand: groups {0,1}: 0.9+0.1 = 1.0, {2,3}: 0.5+0.5 = 1.0, {4,5}: 0.8+0.3 = 1.1,
    /// {6,7}: 0.95+0.0 = 0.95. Best groups: {4,5} (1.1), then {0,1} (1.0, tie with {2,3}, lower
    /// index wins). Expert 6 (0.95) has the second best score overall but its group is dropped,
    /// so the pick is 0 (0.9) and 4 (0.8).
    #[test]
    fn group_limited_top_k_by_hand() {
        let want_sc = [0.9, 0.1, 0.5, 0.5, 0.8, 0.3, 0.95, 0.0];
        // logits = 0 -> sigmoid = 0.5; bias = want - 0.5.
        let logits = [0f32; 8];
        let bias: Vec<f32> = want_sc.iter().map(|&s| (s - 0.5) as f32).collect();
        let (probs, ids, w) = route_token(&hp(8, 2, Some((4, 2))), &logits, Some(&bias));
        assert!(probs.iter().all(|&p| p == 0.5));
        assert_eq!(ids, vec![0, 4]);
        // Weights come from the unbiased probs: 0.5/(0.5+0.5) * 2.5 each.
        assert_eq!(w, vec![1.25, 1.25]);
        // Without groups, expert 6 wins.
        let (_, ids, _) = route_token(&hp(8, 2, None), &logits, Some(&bias));
        assert_eq!(ids, vec![6, 0]);
    }

    #[test]
    fn sigmoid_weights_normalise_and_scale() {
        // logits ln(3), 0, -ln(3): sigmoid = 0.75, 0.5, 0.25; top-2 = [0, 1];
        // weights = [0.75, 0.5] / 1.25 * 2.5 = [1.5, 1.0].
        let l3 = 3f32.ln();
        let (_, ids, w) = route_token(&hp(3, 2, None), &[l3, 0.0, -l3], None);
        assert_eq!(ids, vec![0, 1]);
        assert!((w[0] - 1.5).abs() < 1e-7 && (w[1] - 1.0).abs() < 1e-7);
    }

    #[test]
    fn softmax_gating_without_norm_by_hand() {
        // logits 0, ln 2, ln 3: softmax = 1/6, 2/6, 3/6; top-2 = [2, 1]; no normalisation
        // (DeepSeek-V2): weights = probs * 2.5 = [1.25, 0.8333...].
        let mut h = hp(3, 2, None);
        h.gating = Gating::Softmax;
        h.expert_weights_norm = false;
        let (p, ids, w) = route_token(&h, &[0.0, 2f32.ln(), 3f32.ln()], None);
        assert!((p[0] - 1.0 / 6.0).abs() < 1e-7 && (p[2] - 0.5).abs() < 1e-7);
        assert_eq!(ids, vec![2, 1]);
        assert!((w[0] - 1.25).abs() < 1e-6 && (w[1] - 2.5 / 3.0).abs() < 1e-6);
    }

    use crate::util::thread_cpu_s;

    /// Time of one routed expert of a real-size model (`[gate, up, down]` dequantized and
    /// multiplied, [`CpuEngine::expert_output`]) on one thread, ms of thread CPU time per expert
    /// (best of 3 over 4 experts), for a few token counts at each SIMD build:
    /// `GLMDIFF_EXPERT_SPEED_MODEL=m.gguf GLMDIFF_EXPERT_SPEED_LAYER=3 cargo test --release --lib
    /// expert_speed -- --ignored --nocapture` (the layer must be MoE; returns early without the
    /// model).
    #[test]
    #[ignore]
    fn expert_speed() {
        use crate::quant::simd::{detected, with_cap, Level};
        let Ok(path) = std::env::var("GLMDIFF_EXPERT_SPEED_MODEL") else {
            eprintln!("expert_speed: GLMDIFF_EXPERT_SPEED_MODEL not set, skipped");
            return;
        };
        let layer: usize = std::env::var("GLMDIFF_EXPERT_SPEED_LAYER")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3);
        let model = crate::gguf::Model::open(std::path::Path::new(&path)).unwrap();
        let weights = crate::model::Weights::new(&model).unwrap();
        let cpu = CpuEngine::new(&weights);
        let hidden = weights.hparams().hidden;
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let mut rng = crate::util::rng::SplitMix64::new(11);
        let experts = [0usize, 1, 2, 3];
        let levels = [Level::Base, Level::Avx2, Level::Avx512];
        for l in levels.into_iter().filter(|&l| l <= detected()) {
            let mut line = format!("{:6}:", l.name());
            for t in [1usize, 2, 3, 4, 5, 6, 8, 16] {
                let xs: Vec<f32> = (0..t * hidden).map(|_| rng.uniform() - 0.5).collect();
                let best = one.install(|| {
                    with_cap(l, || {
                        (0..3)
                            .map(|_| {
                                let c = thread_cpu_s();
                                for &e in &experts {
                                    let rows = cpu.expert_rows(layer, e).unwrap();
                                    std::hint::black_box(cpu.expert_output(&rows, &xs, t).unwrap());
                                }
                                (thread_cpu_s() - c) / experts.len() as f64
                            })
                            .fold(f64::INFINITY, f64::min)
                    })
                });
                line += &format!(" t={t} {:.1} ms", best * 1e3);
            }
            println!("{line}");
        }
    }
}
