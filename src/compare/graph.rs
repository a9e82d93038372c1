//! The forward pass's hook order and data flow from hook names alone, for comparing two traces
//! without their model (`glmdiff compare`). With a model the plan's steps say the same; a test
//! checks that both agree on the fixture architectures.

use crate::model::names::split_blk;

/// Points of a layer in forward-pass order (`docs/hooks.md`), optional ones after the
/// hook they detail.
pub const POINT_ORDER: &[&str] = &[
    "attn_norm",
    "q_a",
    "q_a_norm",
    "q_b",
    "q_pe_rope",
    "kv_a",
    "kv_a_norm",
    "k_pe_rope",
    "indexer_scores",
    "indexer_topk",
    "attn_heads",
    "attn_probs",
    "attn_out",
    "ffn_inp",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_act",
    "moe_logits",
    "moe_probs",
    "moe_topk_ids",
    "moe_weights",
    "moe_routed",
    "exp.*",
    "ffn_shexp",
    "ffn_out",
    "l_out",
];

/// Sort key of a hook name in forward-pass order: `token_embd`, layers in order with their
/// points in [`POINT_ORDER`], `result_norm`, `logits`, then unknown names alphabetically.
pub fn order_key(name: &str) -> (usize, usize, usize, String) {
    match split_blk(name) {
        Some((l, p)) => {
            let (i, e) = match p.strip_prefix("exp.") {
                Some(rest) => (
                    POINT_ORDER.iter().position(|&x| x == "exp.*").unwrap_or(99),
                    rest.split('.')
                        .next()
                        .and_then(|e| e.parse().ok())
                        .unwrap_or(0),
                ),
                None => (POINT_ORDER.iter().position(|&x| x == p).unwrap_or(99), 0),
            };
            (1 + l, i, e, p.to_string())
        }
        None => match name {
            "token_embd" => (0, 0, 0, String::new()),
            "result_norm" => (usize::MAX - 2, 0, 0, String::new()),
            "logits" => (usize::MAX - 1, 0, 0, String::new()),
            _ => (usize::MAX, 0, 0, name.to_string()),
        },
    }
}

/// The hooks the step producing `name` reads, among those `present` says exist: the data flow
/// of `shared/spec/glm5-architecture.md` section 2 written by point name. `last_layer_out` is the
/// name of the residual entering the tail (for `result_norm`).
pub fn upstream(name: &str, present: &dyn Fn(&str) -> bool, last_layer_out: &str) -> Vec<String> {
    let keep = |v: Vec<String>| -> Vec<String> { v.into_iter().filter(|n| present(n)).collect() };
    let Some((l, p)) = split_blk(name) else {
        return keep(match name {
            "result_norm" => vec![last_layer_out.to_string()],
            "logits" => vec!["result_norm".to_string()],
            _ => vec![],
        });
    };
    let h = |q: &str| format!("blk.{l}.{q}");
    let x_in = if l == 0 {
        "token_embd".to_string()
    } else {
        format!("blk.{}.l_out", l - 1)
    };
    let attn = || {
        vec![
            h("q_b"),
            h("q_pe_rope"),
            h("kv_a_norm"),
            h("k_pe_rope"),
            h("indexer_topk"),
        ]
    };
    let experts = || vec![h("ffn_norm"), h("moe_topk_ids"), h("moe_weights")];
    keep(match p {
        "attn_norm" => vec![x_in],
        "q_a" | "kv_a" => vec![h("attn_norm")],
        "q_a_norm" => vec![h("q_a")],
        "q_b" => {
            if present(&h("q_a_norm")) {
                vec![h("q_a_norm")]
            } else {
                vec![h("attn_norm")]
            }
        }
        "q_pe_rope" => vec![h("q_b")],
        "kv_a_norm" | "k_pe_rope" => vec![h("kv_a")],
        "indexer_scores" => vec![h("attn_norm"), h("q_a_norm")],
        "indexer_topk" => vec![h("indexer_scores")],
        "attn_heads" | "attn_probs" => attn(),
        "attn_out" => vec![h("attn_heads")],
        "ffn_inp" => vec![x_in, h("attn_out")],
        "ffn_norm" => vec![h("ffn_inp")],
        "ffn_gate" | "ffn_up" | "moe_logits" | "ffn_shexp" => vec![h("ffn_norm")],
        "ffn_act" => vec![h("ffn_gate"), h("ffn_up")],
        "moe_probs" | "moe_topk_ids" | "moe_weights" => vec![h("moe_logits")],
        "moe_routed" => experts(),
        "ffn_out" => {
            if present(&h("ffn_act")) {
                vec![h("ffn_act")]
            } else {
                vec![h("moe_routed"), h("ffn_shexp")]
            }
        }
        "l_out" => vec![h("ffn_inp"), h("ffn_out")],
        q if q.starts_with("exp.") => experts(),
        _ => vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Plan;
    use crate::model::testutil::{tiny_hparams, tiny_model};
    use crate::model::{Arch, Weights};

    /// The name-based data flow agrees with the plan's steps (outputs in the same order, the
    /// same inputs) on both architectures, with and without q_lora.
    #[test]
    fn name_based_flow_matches_the_plan() {
        for (arch, q_lora) in [
            (Arch::GlmDsa, true),
            (Arch::Deepseek2, true),
            (Arch::Deepseek2, false),
        ] {
            let mut hp = tiny_hparams(arch);
            if !q_lora {
                hp.q_lora_rank = None;
            }
            let model = tiny_model(&hp);
            let w = Weights::new(&model).unwrap();
            let plan = Plan::full(&w).unwrap();
            let all: Vec<String> = plan.steps.iter().flat_map(|s| s.outputs.clone()).collect();
            let present = |n: &str| all.iter().any(|a| a == n);
            let last = format!("blk.{}.l_out", hp.n_layer - 1);
            let mut sorted = all.clone();
            sorted.sort_by_key(|n| order_key(n));
            assert_eq!(sorted, all, "{arch:?}: order");
            for s in &plan.steps {
                for o in &s.outputs {
                    let mut want = s.inputs.clone();
                    let mut got = upstream(o, &present, &last);
                    want.sort();
                    got.sort();
                    assert_eq!(got, want, "{arch:?}: inputs of {o}");
                }
            }
        }
    }
}
