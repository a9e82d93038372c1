//! Printing `glmdiff dequant-check`: one row per tensor, the first difference of each failing
//! tensor with its raw block, a summary with the time split, the staging, the measured rates
//! and the projections.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::Grid;
use crate::dcheck::project::{Projection, Rates};
use crate::dcheck::{Checked, TensorCheck};

/// `x` with an SI prefix and three figures before `unit`: `si(7.8e9, " values")` is
/// `7.80 G values`, `si(4.82e10, "B/s")` is `48.2 GB/s`, `si(512.0, " values")` `512 values`.
fn si(x: f64, unit: &str) -> String {
    let (d, p) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .into_iter()
        .find(|&(d, _)| x >= d)
        .unwrap_or((1.0, ""));
    let v = x / d;
    let digits = if v >= 99.95 {
        0
    } else if v >= 9.995 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {}", format!("{p}{unit}").trim_start())
}

/// The rates line.
fn rates_line(r: &Rates, waited_upload_s: f64, waited_cpu_s: f64, load_s: f64) -> String {
    let read = match r.read_bytes_s {
        Some(b) => format!(", file reads {}", si(b, "B/s")),
        None => String::new(),
    };
    format!(
        "rates: CPU hash {}, GPU {}, copies {}{read}; end to end {} ({}); the device waited {waited_upload_s:.1} s for uploads, {waited_cpu_s:.1} s for the CPU; kernels loaded in {load_s:.1} s before (in no rate)",
        si(r.cpu_values_s, " values/s"),
        si(r.gpu_values_s, " values/s"),
        si(r.copy_bytes_s, "B/s"),
        si(r.values_s, " values/s"),
        si(r.bytes_s, "B/s"),
    )
}

/// A projection's line.
fn projection_line(p: &Projection) -> String {
    let sides: Vec<String> = p
        .sides
        .iter()
        .map(|(side, s)| format!("{} {s:.1} s", side.words().trim_start_matches("the ")))
        .collect();
    format!(
        "projection: at these rates {}'s {} ({}) would take {:.1} s, bound by {} ({}); at the end-to-end rate {:.1} s",
        p.name,
        si(p.values as f64, " values"),
        si(p.bytes as f64, "B"),
        p.seconds,
        p.bound.words(),
        sides.join(", "),
        p.end_to_end_s
    )
}

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
    let _ = writeln!(s, "staging: {}", r.staging);
    if let Some(rates) = &r.rates {
        let waited = |f: &dyn Fn(&crate::dcheck::project::Busy) -> f64| {
            r.per_device.iter().map(f).sum::<f64>() * 1e-3
        };
        let _ = writeln!(
            s,
            "{}",
            rates_line(
                rates,
                waited(&|b| b.wait_upload_ms),
                waited(&|b| b.wait_cpu_ms),
                waited(&|b| b.load_ms)
            )
        );
    }
    for p in &r.projections {
        let _ = writeln!(s, "{}", projection_line(p));
    }
    s
}

/// The JSON document.
pub fn to_json(r: &Checked) -> Value {
    json!({
        "device": r.device,
        "staging": r.staging,
        "tensors": r.checks,
        "skipped": r.skipped,
        "mismatching_tensors": r.checks.iter().filter(|c| c.mismatches > 0).count(),
        "wall_ms": r.wall_ms,
        "per_device": r.per_device,
        "rates": r.rates,
        "projections": r.projections,
        "project": r.project,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dcheck::project::{Busy, Side, GLM5_UD_Q4_K_XL};
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
            read_ms: 200.0,
            gpu_ms: 9.0,
            wait_upload_ms: 1.0,
            wait_cpu_ms: 1400.0,
            compare_ms: 3.0,
            wall_ms: 1600.0,
        }
    }

    fn checked(device: &str, checks: Vec<TensorCheck>) -> Checked {
        Checked {
            device: device.into(),
            staging: "pinned: a ring of 2 x 256 MiB a device, 4 reader threads, a copy stream, \
                      2 chunks ahead"
                .into(),
            checks,
            skipped: vec![],
            per_device: vec![Busy {
                device: "cuda:0".into(),
                wait_upload_ms: 400.0,
                wait_cpu_ms: 41_200.0,
                load_ms: 15_800.0,
                ..Busy::default()
            }],
            wall_ms: 3300.0,
            rates: Some(Rates {
                cpu_values_s: 7.8e9,
                gpu_values_s: 4.12e11,
                copy_bytes_s: 4.82e10,
                read_bytes_s: Some(9.1e9),
                values_s: 6.1e9,
                bytes_s: 3.41e9,
            }),
            projections: vec![Projection {
                name: GLM5_UD_Q4_K_XL.name.into(),
                values: GLM5_UD_Q4_K_XL.values,
                bytes: GLM5_UD_Q4_K_XL.bytes,
                seconds: 95.38,
                bound: Side::CpuHash,
                sides: vec![
                    (Side::CpuHash, 95.38),
                    (Side::Gpu, 1.806),
                    (Side::Copy, 8.34),
                    (Side::DiskRead, 44.18),
                ],
                end_to_end_s: 121.97,
            }],
            project: Some(GLM5_UD_Q4_K_XL),
        }
    }

    /// The rates and the projection as given, with their units: three figures and an SI
    /// prefix, the bound named, the pageable staging without a read rate.
    #[test]
    fn rates_and_projection_lines() {
        let c = checked("cuda:0", vec![check("blk.3.ffn_up_exps.weight", 0)]);
        let text = render(&c);
        assert!(
            text.contains(
                "rates: CPU hash 7.80 G values/s, GPU 412 G values/s, copies 48.2 GB/s, \
                 file reads 9.10 GB/s; end to end 6.10 G values/s (3.41 GB/s); the device \
                 waited 0.4 s for uploads, 41.2 s for the CPU; kernels loaded in 15.8 s before \
                 (in no rate)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "projection: at these rates GLM-5 UD-Q4_K_XL's 744 G values (402 GB) would take \
                 95.4 s, bound by the CPU hash (CPU hash 95.4 s, GPU 1.8 s, copies to the device \
                 8.3 s, file reads 44.2 s); at the end-to-end rate 122.0 s"
            ),
            "{text}"
        );
        assert!(
            text.contains("staging: pinned: a ring of 2 x 256 MiB"),
            "{text}"
        );
        let mut c = c;
        if let Some(r) = c.rates.as_mut() {
            r.read_bytes_s = None;
        }
        let text = render(&c);
        assert!(!text.contains("file reads 9"), "{text}");
        assert!(text.contains("copies 48.2 GB/s; end to end"), "{text}");
        let j = to_json(&c);
        assert_eq!(j["projections"][0]["bound"], "cpu_hash");
        assert_eq!(j["project"]["values"], 744_000_000_000u64);
        assert!(j["rates"]["read_bytes_s"].is_null());
        assert_eq!(si(512.0, " values"), "512 values");
        assert_eq!(si(1.5e3, "B"), "1.50 kB");
    }

    /// A report at GLM-5 dimensions, printed as `emit` prints it, fits 100 columns.
    #[test]
    fn a_report_with_a_difference_fits_100_columns() {
        let device = "cuda:0 NVIDIA H200 sm_90 (139.8 GiB, 132 SMs) | NVRTC 13.0 (arch sm_90 \
                      fmad=false ftz=false prec-div=true prec-sqrt=true) | driver CUDA 13.0";
        let mut checked = checked(
            device,
            vec![
                check("blk.77.ffn_gate_exps.weight", 0),
                check("blk.78.ffn_down_exps.weight", 17),
            ],
        );
        checked.skipped = vec![Skipped {
            name: "blk.3.attn_q_b.weight".into(),
            ty: "Q1_0".into(),
            why: "no dequantizer for this type (CPU or GPU)".into(),
        }];
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
