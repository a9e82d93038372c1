//! Printing `glmdiff dequant-check`: one row per tensor, the first difference of each failing
//! tensor with its raw block, and a summary with the time split.

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{json, Value};

use super::Grid;
use crate::cuda::check::TensorCheck;

/// A tensor that was not checked, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Skipped {
    /// GGUF tensor name.
    pub name: String,
    /// Type name.
    pub ty: String,
    /// Why.
    pub why: String,
}

/// The text report.
pub fn render(device: &str, checks: &[TensorCheck], skipped: &[Skipped]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "device: {device}");
    let mut t = Grid::new(&[
        ("tensor", 0),
        ("type", 0),
        ("shape", 3),
        ("elements", 4),
        ("mismatches", 0),
        ("max |diff|", 2),
        ("kernel GB/s", 1),
        ("verdict", 0),
    ]);
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
pub fn to_json(device: &str, checks: &[TensorCheck], skipped: &[Skipped]) -> Value {
    json!({
        "device": device,
        "tensors": checks,
        "skipped": skipped,
        "mismatching_tensors": checks.iter().filter(|c| c.mismatches > 0).count(),
    })
}
