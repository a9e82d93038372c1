//! `--explain` tries the plain hypotheses too: an output that is the reference times a
//! constant is fitted as the scale of the step's last matrix, and a factor that is a known
//! constant of the model is named. The candidate is a committed engine trace with one hook
//! multiplied here.

use glmdiff::engine::HostTensor;

use crate::common::subset::write_edited;
use crate::common::{fixtures, run_trace};

/// A shared expert whose output is multiplied by the routed scaling factor (2.5 in the
/// DeepSeek-V3 tiny model, as in DeepSeek-V3): the dump's `blk.1.ffn_shexp` x2.5. It fails
/// there, and `--explain` reproduces it by the shared expert's down matrix scaled by 2.5,
/// naming the routed scaling factor.
#[test]
fn a_shared_expert_times_the_routed_scaling_factor_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures("models/dsv3-tiny/dsv3-tiny-f32.gguf");
    let src = fixtures("engines/dsv3-tiny/dsv3-tiny.long.cuda-bf16.trace.safetensors");
    let dst = dir.path().join("shexp.trace.safetensors");
    write_edited(&src, &dst, &|n, t| {
        if n == "blk.1.ffn_shexp" {
            let v: Vec<f32> = t.as_f32(n).unwrap().iter().map(|x| x * 2.5).collect();
            HostTensor::f32(t.shape.clone(), v).unwrap()
        } else {
            t
        }
    });
    let (rc, j, text) = run_trace(dir.path(), &gguf, &dst, &["--mode", "replay", "--explain"]);
    assert_eq!(rc, 1, "{text}");
    assert_eq!(j["first_divergence"]["hook"], "blk.1.ffn_shexp", "{text}");
    let best = &j["explanation"][0];
    let kind = best["kind"].as_str().unwrap_or_default();
    assert!(
        kind.starts_with("weight_scale:ffn_down_shexp.weight,"),
        "{text}"
    );
    assert!(kind.ends_with("@1"), "{kind}");
    let fitted = best["fitted"].as_f64().unwrap_or(f64::NAN);
    assert!((fitted / 2.5 - 1.0).abs() < 0.01, "{fitted}");
    assert_eq!(best["reproduces"], true, "{text}");
    assert!(
        crate::common::joined(&text).contains(
            "the routed scaling factor (expert_weights_scale) applied to the shared expert"
        ),
        "{text}"
    );
}

/// Where RoPE is fused into attention (a vLLM-like dump without `q_pe_rope` and `k_pe_rope`),
/// the segment `q_pe_rope..attn_heads` is judged as one, and `--explain` re-runs the RoPE steps
/// inside it under each hypothesis: transformers in bf16 with RoPE's base x1.1 is reproduced by
/// `rope_theta` fitted near 1.1e6, as with every hook at hand.
#[test]
fn a_rope_base_inside_a_fused_segment_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let src =
        fixtures("engine-bugs/glm5-tiny/glm5-tiny.dsa.cuda-bf16.rope_theta-1p1.trace.safetensors");
    let dst = dir.path().join("vllm.trace.safetensors");
    crate::common::subset::write_subset(
        &src,
        &dst,
        &|n| crate::common::subset::keeps("vllm", n),
        "vllm",
    );
    let (rc, j, text) = run_trace(dir.path(), &gguf, &dst, &["--mode", "replay", "--explain"]);
    assert_eq!(rc, 1, "{text}");
    assert_eq!(j["first_divergence"]["hook"], "blk.0.attn_heads", "{text}");
    assert_eq!(
        j["first_divergence"]["segment"], "blk.0.q_pe_rope..blk.0.attn_heads",
        "{text}"
    );
    let best = &j["explanation"][0];
    let kind = best["kind"].as_str().unwrap_or_default();
    assert!(kind.starts_with("rope_theta:"), "{text}");
    let fitted = best["fitted"].as_f64().unwrap_or(f64::NAN);
    assert!((fitted / 1.1e6 - 1.0).abs() < 0.02, "{fitted}");
    assert_eq!(best["reproduces"], true, "{text}");
}
