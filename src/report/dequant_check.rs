//! Printing `glmdiff dequant-check`: one row per tensor, the first difference of each failing
//! tensor with its raw block, and a summary with the time split.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::Grid;
use crate::dcheck::{Checked, TensorCheck};

/// The text report.
pub fn render(r: &Checked) -> String {
    let (checks, skipped) = (&r.checks, &r.skipped);
    let mut s = String::new();
    let _ = writeln!(s, "device: {}", r.device);
    let mut t = Grid::new(&[
        ("tensor", 0),
        ("type", 0),
        ("shape", 3),
        ("elements", 4),
        ("mismatches", 0),
        ("max |diff|", 2),
        ("kernel GB/s", 1),
        ("verdict", 0),
    ])
    .whole(&[0]);
    for c in checks {
        t.add_row(vec![
            c.name.clone(),
            c.ty.clone(),
            format!("{:?}", c.shape),
            c.elements.to_string(),
            c.mismatches.to_string(),
            if c.mismatches == 0 {
                "0".into()
            } else {
                format!("{:e}", c.max_abs)
            },
            format!("{:.0}", c.kernel_gbps),
            if c.mismatches == 0 {
                "bit-exact"
            } else {
                "DIFFERS"
            }
            .into(),
        ]);
    }
    let _ = writeln!(s, "{t}");
    for c in checks {
        if let Some(f) = &c.first {
            // Four bytes to a group, so a long block wraps between groups.
            let raw: Vec<String> = f
                .raw
                .as_bytes()
                .chunks(8)
                .map(|g| String::from_utf8_lossy(g).into_owned())
                .collect();
            let _ = writeln!(
                s,
                "{}: first difference at element {} (row {}, column {}, block {}): cpu {:e} ({:#010x}), gpu {:e} ({:#010x}); block bytes {}",
                c.name,
                f.index,
                f.row,
                f.col,
                f.block,
                f.cpu,
                f.cpu.to_bits(),
                f.gpu,
                f.gpu.to_bits(),
                raw.join(" ")
            );
        }
    }
    for k in skipped {
        let _ = writeln!(s, "not checked: {} ({}): {}", k.name, k.ty, k.why);
    }
    let sum = |f: &dyn Fn(&TensorCheck) -> f64| checks.iter().map(f).sum::<f64>();
    let bad = checks.iter().filter(|c| c.mismatches > 0).count();
    let elems: u64 = checks.iter().map(|c| c.elements).sum();
    let _ = writeln!(
        s,
        "{} tensors, {elems} elements: {}; time {:.0} ms (CPU dequant {:.0} ms on its own thread, copies to the device {:.0} ms, kernels {:.1} ms, compare {:.0} ms)",
        checks.len(),
        if bad == 0 {
            "every value bit-exact".to_string()
        } else {
            format!("{bad} tensors DIFFER")
        },
        sum(&|c| c.wall_ms),
        sum(&|c| c.cpu_ms),
        sum(&|c| c.h2d_ms),
        sum(&|c| c.kernel_ms),
        sum(&|c| c.compare_ms)
    );
    s
}

/// The JSON document.
pub fn to_json(r: &Checked) -> Value {
    json!({
        "device": r.device,
        "tensors": r.checks,
        "skipped": r.skipped,
        "mismatching_tensors": r.checks.iter().filter(|c| c.mismatches > 0).count(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dcheck::{FirstMismatch, Skipped};

    fn check(name: &str, mismatches: u64) -> TensorCheck {
        TensorCheck {
            name: name.into(),
            ty: "IQ2_XXS".into(),
            shape: vec![256, 2048, 6144],
            elements: 3_221_225_472,
            mismatches,
            max_abs: if mismatches > 0 { 0.125 } else { 0.0 },
            first: (mismatches > 0).then(|| FirstMismatch {
                index: 123_456_789,
                row: 20_093,
                col: 4_821,
                block: 18,
                raw: "ab".repeat(48),
                cpu: 0.5,
                gpu: 0.625,
            }),
            bytes: 1 << 30,
            kernel_ms: 2.5,
            kernel_gbps: 3862.0,
            cpu_ms: 1500.0,
            h2d_ms: 80.0,
            compare_ms: 3.0,
            wall_ms: 1600.0,
        }
    }

    /// A report at GLM-5 dimensions, printed as `emit` prints it, fits 100 columns.
    #[test]
    fn a_report_with_a_difference_fits_100_columns() {
        let device = "cuda:0 NVIDIA H200 sm_90 (139.8 GiB, 132 SMs) | NVRTC 13.0 (arch sm_90 \
                      fmad=false ftz=false prec-div=true prec-sqrt=true) | driver CUDA 13.0";
        let checked = Checked {
            device: device.into(),
            checks: vec![
                check("blk.77.ffn_gate_exps.weight", 0),
                check("blk.78.ffn_down_exps.weight", 17),
            ],
            skipped: vec![Skipped {
                name: "blk.3.attn_q_b.weight".into(),
                ty: "Q1_0".into(),
                why: "no dequantizer for this type (CPU or GPU)".into(),
            }],
        };
        let text = crate::report::layout::fit_text(&render(&checked), Some(100));
        for l in text.lines() {
            assert!(l.chars().count() <= 100, "{l}\n{text}");
        }
        assert!(
            text.contains("DIFFERS") && text.contains("bit-exact"),
            "{text}"
        );
        // The block's bytes in groups of four, all of them.
        assert_eq!(text.matches("abababab").count(), 12, "{text}");
    }
}
