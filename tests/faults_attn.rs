//! The attention, norm and projection kinds of `--inject` (`weight_scale`, `softmax_scale`,
//! `yarn_mscale`, `rope_theta`, `yarn_factor`, `dsa_topk`, `indexer_scale`, `indexer_wproj_scale`,
//! `norm_one_plus`, `kv_b_split`) planted in the candidate engine on the fixture models: each is
//! named at the hook the bug lives in (replay, judged by `compare`, independent of how it is
//! planted), `--explain` names it first, and a continuous kind's parameter is fitted back from the
//! candidate's numbers to within 0.5% of the planted value (the fit sees only the captured
//! step's inputs and outputs, not the planted value). Kinds that cannot apply are clear errors.

use crate::common::{golden_tokens, model, run_json as run};

// The golden traces' prompts (`golden_tokens`) have 21 tokens, more than the fixtures'
// index_topk (8), so the DSA indexer prunes.
const GLM: &str = "glm5-tiny/glm5-tiny-f32.gguf";
const GLM_LONG: &str = "glm5-tiny/glm5-tiny.long.trace.safetensors";
const DS: &str = "dsv3-tiny/dsv3-tiny-f32.gguf";
const DS_LONG: &str = "dsv3-tiny/dsv3-tiny.long.trace.safetensors";

/// One planted kind: where it first diverges, what `--explain` names first, and for a fitted
/// kind the parameter's name and planted value.
struct Case {
    model: &'static str,
    prompt: &'static str,
    inject: &'static str,
    hook: &'static str,
    named: &'static [&'static str],
    fitted: Option<(&'static str, f64)>,
}

const fn case(
    model: &'static str,
    prompt: &'static str,
    inject: &'static str,
    hook: &'static str,
    named: &'static [&'static str],
    fitted: Option<(&'static str, f64)>,
) -> Case {
    Case {
        model,
        prompt,
        inject,
        hook,
        named,
        fitted,
    }
}

/// Sizes: a 5% scale is 5e-2 at its hook (1e-2 to 3e-2 in attention), far above the f32 floors
/// (4e-7 to 9e-7) and above the bf16 ones (2.7e-2 to 5.7e-2) only for the projections; a 1%
/// scale is left to the systematic-error check, its fit is unit-tested (`explain::fit_attn`).
const CASES: &[Case] = &[
    // GLM-5: no YaRN, the DSA indexer (index_topk 8).
    case(
        GLM,
        GLM_LONG,
        "weight_scale:attn_output.weight,1.05@1",
        "blk.1.attn_out",
        &["weight_scale:attn_output.weight,1.05@1"],
        Some(("factor", 1.05)),
    ),
    case(
        GLM,
        GLM_LONG,
        "weight_scale:blk.1.attn_q_a_norm.weight,0.95",
        "blk.1.q_a_norm",
        &["weight_scale:attn_q_a_norm.weight,0.95@1"],
        Some(("factor", 0.95)),
    ),
    case(
        GLM,
        GLM_LONG,
        "softmax_scale:1.05@2",
        "blk.2.attn_heads",
        &["softmax_scale:1.05@2"],
        Some(("factor", 1.05)),
    ),
    case(
        GLM,
        GLM_LONG,
        "kv_b_split:kv@1",
        "blk.1.attn_heads",
        &["kv_b_split:kv@1"],
        None,
    ),
    case(
        GLM,
        GLM_LONG,
        "norm_one_plus@1",
        "blk.1.attn_norm",
        &["norm_one_plus@1"],
        None,
    ),
    case(
        GLM,
        GLM_LONG,
        "norm_one_plus:attn_kv_a_norm.weight@2",
        "blk.2.kv_a_norm",
        &["norm_one_plus@2"],
        None,
    ),
    case(
        GLM,
        GLM_LONG,
        "dsa_topk:7@1",
        "blk.1.indexer_topk",
        &["dsa_topk:7@1"],
        None,
    ),
    case(
        GLM,
        GLM_LONG,
        "dsa_topk:9@2",
        "blk.2.indexer_topk",
        &["dsa_topk:9@2"],
        None,
    ),
    // The two indexer scales multiply every score alike: either is named first, with the same
    // residual (checked below).
    case(
        GLM,
        GLM_LONG,
        "indexer_scale:1.05@1",
        "blk.1.indexer_scores",
        &["indexer_scale:1.05@1", "indexer_wproj_scale:1.05@1"],
        Some(("factor", 1.05)),
    ),
    case(
        GLM,
        GLM_LONG,
        "indexer_wproj_scale:0.5@2",
        "blk.2.indexer_scores",
        &["indexer_scale:0.5@2", "indexer_wproj_scale:0.5@2"],
        Some(("factor", 0.5)),
    ),
    case(
        GLM,
        GLM_LONG,
        "rope_theta:10000@1",
        "blk.1.q_pe_rope",
        &["rope_theta:10000@1"],
        Some(("theta", 10000.0)),
    ),
    case(
        GLM,
        GLM_LONG,
        "rope_theta:1.05e6@2",
        "blk.2.q_pe_rope",
        &["rope_theta:1050000@2"],
        Some(("theta", 1.05e6)),
    ),
    // DeepSeek-V3: YaRN (factor 40, mscale_all_dim 1: mscale^2 = 1.874), no indexer.
    // The YaRN factor read as 4 (another checkpoint's, or a config misread): the interpolated
    // frequencies and the cos/sin attention factor change at the RoPE step, fitted back to 4.
    case(
        DS,
        DS_LONG,
        "yarn_factor:4@1",
        "blk.1.q_pe_rope",
        &["yarn_factor:4@1"],
        Some(("factor", 4.0)),
    ),
    case(
        DS,
        DS_LONG,
        "yarn_mscale:none@1",
        "blk.1.attn_heads",
        &["yarn_mscale:none@1"],
        None,
    ),
    case(
        DS,
        DS_LONG,
        "yarn_mscale:twice@2",
        "blk.2.q_pe_rope",
        &["yarn_mscale:twice@2"],
        None,
    ),
    case(
        DS,
        DS_LONG,
        "rope_theta:10500@0",
        "blk.0.q_pe_rope",
        &["rope_theta:10500@0"],
        Some(("theta", 10500.0)),
    ),
    case(
        DS,
        DS_LONG,
        "softmax_scale:0.95@1",
        "blk.1.attn_heads",
        &["softmax_scale:0.95@1"],
        Some(("factor", 0.95)),
    ),
    case(
        DS,
        DS_LONG,
        "weight_scale:attn_v_b.weight,1.05@2",
        "blk.2.attn_heads",
        &["weight_scale:attn_v_b.weight,1.05@2"],
        Some(("factor", 1.05)),
    ),
    case(
        DS,
        DS_LONG,
        "weight_scale:attn_k_b.weight,0.95@1",
        "blk.1.attn_heads",
        &["weight_scale:attn_k_b.weight,0.95@1"],
        Some(("factor", 0.95)),
    ),
    case(
        DS,
        DS_LONG,
        "kv_b_split:kv@2",
        "blk.2.attn_heads",
        &["kv_b_split:kv@2"],
        None,
    ),
    case(
        DS,
        DS_LONG,
        "weight_scale:output.weight,1.05",
        "logits",
        &["weight_scale:output.weight,1.05"],
        Some(("factor", 1.05)),
    ),
    case(
        DS,
        DS_LONG,
        "norm_eps:1e-4@1",
        "blk.1.attn_norm",
        &["norm_eps:1e-4@1"],
        Some(("eps", 1e-4)),
    ),
];

/// Every kind on the fixtures: exit 1, the first divergence at the bug's own hook, `--explain`
/// names it first and it reproduces the candidate; a fitted kind carries `param`, `fitted`
/// (within 0.5% of the planted value) and `nominal`, and the report shows them; a discrete kind
/// carries none.
#[test]
fn attention_kinds_are_named_at_their_hook_and_fitted() {
    check_kinds("cpu");
}

/// The same kinds around the CUDA engine: the faulty steps are computed on the host from the
/// engine's own inputs, every other step is the CUDA engine's.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
fn gpu_attention_kinds_around_the_cuda_engine() {
    check_kinds("cuda");
}

fn check_kinds(against: &str) {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    for c in CASES {
        let gguf = model(c.model);
        let (rc, j, text) = run(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--tokens",
                &golden_tokens(c.prompt),
                "--against",
                against,
                "--inject",
                c.inject,
                "--explain",
            ],
            &json,
        );
        let what = format!("{} --inject {} against {against}", c.model, c.inject);
        let text = crate::common::joined(&text);
        assert_eq!(rc, 1, "{what}: {text}");
        assert_eq!(j["first_divergence"]["hook"], c.hook, "{what}: {text}");
        let best = &j["explanation"][0];
        let kind = best["kind"].as_str().unwrap();
        assert!(c.named.contains(&kind), "{what}: {kind}: {text}");
        assert_eq!(best["hook"], c.hook, "{what}");
        assert_eq!(best["reproduces"], true, "{what}: {text}");
        match c.fitted {
            Some((param, planted)) => {
                assert_eq!(best["param"], param, "{what}");
                let fitted = best["fitted"].as_f64().unwrap();
                assert!(
                    (fitted / planted - 1.0).abs() < 5e-3,
                    "{what}: fitted {fitted} for {planted}"
                );
                assert!(best["nominal"].as_f64().is_some(), "{what}");
                assert!(
                    text.contains(&format!("reproduced by {kind} [{param} fitted ")),
                    "{what}: {text}"
                );
            }
            None => {
                for k in ["param", "fitted", "nominal"] {
                    assert!(best.get(k).is_none(), "{what}: {k} on a discrete kind");
                }
            }
        }
        if c.named.len() == 2 {
            // indexer_scale and indexer_wproj_scale: the same output, said so.
            let second = &j["explanation"][1];
            assert!(
                c.named.contains(&second["kind"].as_str().unwrap()),
                "{what}"
            );
            assert_eq!(second["residual"], best["residual"], "{what}");
            assert!(text.contains("cannot tell them apart"), "{what}: {text}");
        }
    }
}

/// The two kv_b layout mistakes are told apart: under each, the other is tested at the same
/// hook and does not reproduce; `yarn_mscale:none` is also matched by the fitted softmax scale,
/// which names the factor it found (`1 / mscale^2`, 0.5337 for dsv3-tiny's YaRN factor 40).
#[test]
fn explain_tells_the_kv_b_directions_apart_and_names_the_mscale_factor() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let gguf = model(DS);
    let toks = golden_tokens(DS_LONG);
    let run_one = |inject: &str| {
        run(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--tokens",
                &toks,
                "--against",
                "cpu",
                "--inject",
                inject,
                "--explain",
            ],
            &json,
        )
    };
    for (planted, other) in [
        ("kv_b_split:kv@1", "kv_b_concat@1"),
        ("kv_b_concat@1", "kv_b_split:kv@1"),
    ] {
        let (rc, j, text) = run_one(planted);
        assert_eq!(rc, 1, "{text}");
        let hyps = j["explanation"].as_array().unwrap();
        assert_eq!(hyps[0]["kind"], planted, "{text}");
        let o = hyps.iter().find(|h| h["kind"] == other).unwrap();
        assert_eq!(o["reproduces"], false, "{planted}: {text}");
        assert!(o["residual"].as_f64().unwrap() > 0.1, "{planted}: {o}");
    }
    let (rc, j, text) = run_one("yarn_mscale:none@1");
    let text = crate::common::joined(&text);
    assert_eq!(rc, 1, "{text}");
    let soft = j["explanation"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["param"] == "factor")
        .unwrap()
        .clone();
    // 1 / (0.1 ln 40 + 1)^2, computed by hand: 0.533659.
    let want = 1.0 / (0.1 * 40f64.ln() + 1.0).powi(2);
    let f = soft["fitted"].as_f64().unwrap();
    assert!((f / want - 1.0).abs() < 1e-3, "{f} vs {want}");
    assert_eq!(soft["reproduces"], true, "{text}");
    assert!(
        j["explain"]["notes"]
            .to_string()
            .contains("is that of yarn_mscale:none (1 / mscale^2)"),
        "{text}"
    );
}

/// Kinds that cannot apply are refused with a clear error naming why (exit 2).
#[test]
fn inapplicable_attention_kinds_are_clear_errors() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    for (m, inject, want) in [
        (GLM, "yarn_mscale:none", "has no YaRN rope scaling"),
        (DS, "dsa_topk:7", "has no DSA indexer"),
        (DS, "indexer_scale:2", "has no DSA indexer"),
        (GLM, "dsa_topk:8", "8 is the model's own index_topk"),
        (GLM, "rope_theta:1e6", "is the model's own rope.freq_base"),
        (
            GLM,
            "weight_scale:ffn_gate_exps.weight,1.1@1",
            "blk.1.ffn_gate_exps.weight is read inside the DSA indexer or the routed experts",
        ),
        (
            GLM,
            "weight_scale:nothing.weight,1.1",
            "no tensor of layers [0, 1, 2] matches \"nothing.weight\"",
        ),
        (
            GLM,
            "norm_one_plus:attn_output.weight",
            "no RMSNorm weight of layers [0, 1, 2] matches",
        ),
        (GLM, "softmax_scale:1", "factor 1 changes nothing"),
        (GLM, "softmax_scale:-2", "must be finite and above 0"),
        (
            GLM,
            "weight_scale:attn_output.weight",
            "expected weight_scale:GLOB,F",
        ),
        (GLM, "kv_b_split", "kv_b_split:kv"),
        (
            DS,
            "yarn_mscale:thrice",
            "expected yarn_mscale:none or yarn_mscale:twice",
        ),
        (GLM, "rope_theta:0.5", "must be finite and above 1"),
        (GLM, "dsa_topk:0", "keeps at least one key"),
    ] {
        let gguf = model(m);
        let (rc, _, text) = run(
            cache.path(),
            &[
                "run",
                gguf.to_str().unwrap(),
                "--tokens",
                "1,2,3",
                "--against",
                "cpu",
                "--inject",
                inject,
            ],
            &json,
        );
        assert_eq!(rc, 2, "{m} {inject}: {text}");
        assert!(text.contains(want), "{m} {inject}: {text}");
    }
}
