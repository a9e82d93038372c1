//! Chained mode alone judges each token too: one token's routed-experts output scaled (x1.3 in
//! layer 1, x1.5 in layer 2 of a committed bf16 engine dump) is named at that hook with
//! `--mode chained`, against the floor plus what that token's own inputs carry.

use glmdiff::engine::HostTensor;

use crate::common::subset::write_edited;
use crate::common::{fixtures, run_trace};

#[test]
fn one_tokens_routed_output_scaled_is_named_in_chained_mode_alone() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures("models/dsv3-tiny/dsv3-tiny-f32.gguf");
    let src = fixtures("engines/dsv3-tiny/dsv3-tiny.long.cuda-bf16.trace.safetensors");
    for (layer, scale) in [(1usize, 1.3f32), (2, 1.5)] {
        let hook = format!("blk.{layer}.moe_routed");
        let dst = dir.path().join(format!("tok{layer}.trace.safetensors"));
        write_edited(&src, &dst, &|n, t| {
            if n == hook {
                let cols = t.shape[1];
                let mut v = t.as_f32(n).unwrap().to_vec();
                for x in &mut v[5 * cols..6 * cols] {
                    *x *= scale;
                }
                HostTensor::f32(t.shape.clone(), v).unwrap()
            } else {
                t
            }
        });
        for mode in ["chained", "replay"] {
            let (rc, j, text) = run_trace(dir.path(), &gguf, &dst, &["--mode", mode]);
            assert_eq!(rc, 1, "{hook} x{scale} {mode}: {text}");
            let d = if mode == "chained" {
                &j["first_divergence_chained"]
            } else {
                &j["first_divergence"]
            };
            assert_eq!(d["hook"], hook.as_str(), "{mode}: {text}");
            // x1.3 stays under the floor over the whole tensor: only that token names it.
            let note = d["note"].as_str().unwrap_or_default();
            assert!(
                layer != 1 || note.starts_with("token 5: "),
                "{mode}: {note}"
            );
        }
    }
}
