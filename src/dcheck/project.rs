//! dequant-check's measured rates and what they say about a whole model: each side of the
//! check (the CPU's fused dequantize-and-hash, the device's dequant and hash, the copies to the
//! device, the reads of the file into pinned staging) runs at once with the others, so a model
//! of `N` values and `B` raw bytes takes at least the longest of `N / cpu`, `N / gpu`,
//! `B / copy` and `B / read`: that side bounds it.
//!
//! Plain arithmetic on figures the check measured ([`Busy`]); no device needed, so it builds
//! and is tested without the `cuda` feature. The sizes of full models named by `--project` are
//! [`FULL_MODELS`], with their sources.

use anyhow::{bail, Result};
use serde::Serialize;

/// A full model's size, for `--project`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FullModel {
    /// The word `--project` takes.
    pub key: &'static str,
    /// What it is, for the report.
    pub name: &'static str,
    /// Values (parameters) of every tensor.
    pub values: u64,
    /// Bytes of the GGUF (all shards).
    pub bytes: u64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// GLM-5 in Unsloth's UD-Q4_K_XL mix.
pub const GLM5_UD_Q4_K_XL: FullModel = FullModel {
    key: "glm5",
    name: "GLM-5 UD-Q4_K_XL",
    values: 744_000_000_000,
    bytes: 402_000_000_000,
    source: "744B parameters: the zai-org/GLM-5 model card (78 layers: 3 dense, 75 MoE of 256 \
             experts); 402 GB: the UD-Q4_K_XL shards of unsloth/GLM-5-GGUF as listed on Hugging \
             Face (decimal GB)",
};

/// Every model `--project` knows.
pub const FULL_MODELS: &[FullModel] = &[GLM5_UD_Q4_K_XL];

/// The model `--project KEY` names; an error listing the known keys otherwise.
pub fn full_model(key: &str) -> Result<&'static FullModel> {
    match FULL_MODELS.iter().find(|m| m.key == key) {
        Some(m) => Ok(m),
        None => {
            let known: Vec<&str> = FULL_MODELS.iter().map(|m| m.key).collect();
            bail!(
                "dequant-check: --project {key:?} is not a model of known size; known: {}",
                known.join(", ")
            )
        }
    }
}

/// What one device's pipeline did and how long each side of it was busy.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Busy {
    /// The device's line (its ordinal, name).
    pub device: String,
    /// Tensors checked.
    pub tensors: usize,
    /// Values checked.
    pub values: u64,
    /// Raw bytes of those values.
    pub bytes: u64,
    /// CPU side: its thread's time dequantizing and hashing (ms).
    pub cpu_ms: f64,
    /// Device side: dequant and hash kernels (ms, device events recorded just before the
    /// dequant launch and just after the hash launch; kernels loaded and buffers allocated
    /// beforehand, so the span holds nothing else).
    pub gpu_ms: f64,
    /// Bytes copied to the device.
    pub copy_bytes: u64,
    /// Their copies (ms): device events on the copy stream for pinned staging, the host's
    /// synchronous copies out of the mapped file for pageable ones.
    pub copy_ms: f64,
    /// Bytes read from the model's files into pinned staging (0 when pageable).
    pub read_bytes: u64,
    /// Their reads (ms, the upload thread's positional reads).
    pub read_ms: f64,
    /// The device loop's waits for a chunk's upload (ms).
    pub wait_upload_ms: f64,
    /// The device loop's waits for a chunk's CPU hash (ms).
    pub wait_cpu_ms: f64,
    /// The device loop from start to end (ms).
    pub wall_ms: f64,
    /// Loading the kernels before the device loop starts (ms: an NVRTC compile on a cold
    /// cache, the disk cache's read otherwise); in `wall_ms` and the rates neither.
    pub load_ms: f64,
}

/// A side of the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// The CPU's dequantize-and-hash.
    CpuHash,
    /// The device's dequant and hash.
    Gpu,
    /// Host-to-device copies.
    Copy,
    /// Reading the model's files.
    DiskRead,
}

impl Side {
    /// Words for the report.
    pub fn words(self) -> &'static str {
        match self {
            Side::CpuHash => "the CPU hash",
            Side::Gpu => "the GPU",
            Side::Copy => "the copies to the device",
            Side::DiskRead => "the file reads",
        }
    }
}

/// The measured rates, over all devices (devices run at once: their rates add up).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    /// Values per second the CPU side dequantizes and hashes.
    pub cpu_values_s: f64,
    /// Values per second the devices dequantize and hash.
    pub gpu_values_s: f64,
    /// Bytes per second copied to the devices.
    pub copy_bytes_s: f64,
    /// Bytes per second read from the files into pinned staging; `None` when nothing was
    /// (pageable copies read the mapped file themselves: their rate is the copy's).
    pub read_bytes_s: Option<f64>,
    /// Values per second end to end: all values checked over the check's wall time.
    pub values_s: f64,
    /// Raw bytes per second end to end.
    pub bytes_s: f64,
}

/// `amount` per second over `ms`, when both are positive.
fn per_s(amount: u64, ms: f64) -> Option<f64> {
    (amount > 0 && ms > 0.0).then(|| amount as f64 * 1e3 / ms)
}

impl Rates {
    /// The rates of `busy` (one per device), end to end over `wall_ms`; `None` when no value
    /// was checked or the wall time is not positive.
    pub fn measure(busy: &[Busy], wall_ms: f64) -> Option<Rates> {
        let values: u64 = busy.iter().map(|b| b.values).sum();
        let bytes: u64 = busy.iter().map(|b| b.bytes).sum();
        let values_s = per_s(values, wall_ms)?;
        let sum = |f: &dyn Fn(&Busy) -> Option<f64>| -> Option<f64> {
            let v: Vec<f64> = busy.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| v.iter().sum())
        };
        Some(Rates {
            cpu_values_s: sum(&|b| per_s(b.values, b.cpu_ms))?,
            gpu_values_s: sum(&|b| per_s(b.values, b.gpu_ms))?,
            copy_bytes_s: sum(&|b| per_s(b.copy_bytes, b.copy_ms))?,
            read_bytes_s: sum(&|b| per_s(b.read_bytes, b.read_ms)),
            values_s,
            bytes_s: per_s(bytes, wall_ms).unwrap_or(0.0),
        })
    }

    /// How long `values` values of `bytes` raw bytes (`name`) would take at these rates.
    pub fn project(&self, name: &str, values: u64, bytes: u64) -> Projection {
        let (v, b) = (values as f64, bytes as f64);
        let mut sides = vec![
            (Side::CpuHash, v / self.cpu_values_s),
            (Side::Gpu, v / self.gpu_values_s),
            (Side::Copy, b / self.copy_bytes_s),
        ];
        if let Some(r) = self.read_bytes_s {
            sides.push((Side::DiskRead, b / r));
        }
        // The first of the longest, in the order above.
        let (bound, seconds) =
            sides
                .iter()
                .copied()
                .fold((Side::CpuHash, f64::NEG_INFINITY), |best, s| {
                    if s.1 > best.1 {
                        s
                    } else {
                        best
                    }
                });
        Projection {
            name: name.to_string(),
            values,
            bytes,
            seconds,
            bound,
            sides,
            end_to_end_s: v / self.values_s,
        }
    }
}

/// The projections a check shows at `rates`: the model at hand (`name`, `values`, `bytes`:
/// what `--all` checks) when fewer than its values were checked, then `full` when asked.
pub fn projections(
    rates: &Rates,
    (name, values, bytes): (&str, u64, u64),
    checked_values: u64,
    full: Option<&FullModel>,
) -> Vec<Projection> {
    let mut v = Vec::new();
    if checked_values < values {
        v.push(rates.project(name, values, bytes));
    }
    if let Some(m) = full {
        v.push(rates.project(m.name, m.values, m.bytes));
    }
    v
}

/// How long a model would take at the measured rates.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Projection {
    /// The model (this one's file name, or a [`FullModel::name`]).
    pub name: String,
    /// Its values.
    pub values: u64,
    /// Its raw bytes.
    pub bytes: u64,
    /// Seconds at the slowest side's rate: the least a check can take with every side
    /// overlapped.
    pub seconds: f64,
    /// That side.
    pub bound: Side,
    /// Every side's seconds.
    pub sides: Vec<(Side, f64)>,
    /// Seconds at the end-to-end rate measured (by values): what the check would take if the
    /// rest of the model overlapped as the part checked did.
    pub end_to_end_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(values: u64, bytes: u64, cpu_ms: f64, gpu_ms: f64, copy_ms: f64) -> Busy {
        Busy {
            device: "cuda:0".into(),
            tensors: 1,
            values,
            bytes,
            cpu_ms,
            gpu_ms,
            copy_bytes: bytes,
            copy_ms,
            ..Busy::default()
        }
    }

    /// Rates and projections worked out by hand: 6e9 values (3.24e9 bytes) on one device whose
    /// CPU side was busy 2 s (3e9 values/s), kernels 0.02 s (3e11/s), copies 0.1 s
    /// (3.24e10 B/s), reads 0.6 s (5.4e9 B/s), all in 2.5 s of wall (2.4e9 values/s).
    #[test]
    fn one_device_by_hand() {
        let mut b = busy(6_000_000_000, 3_240_000_000, 2000.0, 20.0, 100.0);
        b.read_bytes = 3_240_000_000;
        b.read_ms = 600.0;
        let r = Rates::measure(&[b], 2500.0).unwrap();
        assert_eq!(r.cpu_values_s, 3e9);
        assert_eq!(r.gpu_values_s, 3e11);
        assert_eq!(r.copy_bytes_s, 3.24e10);
        assert_eq!(r.read_bytes_s, Some(5.4e9));
        assert_eq!(r.values_s, 2.4e9);
        assert_eq!(r.bytes_s, 1.296e9);
        // GLM-5: 744e9 / 3e9 = 248 s of CPU hash, 744e9 / 3e11 = 2.48 s of GPU,
        // 402e9 / 3.24e10 = 12.407... s of copies, 402e9 / 5.4e9 = 74.44... s of reads.
        let p = r.project("GLM-5", GLM5_UD_Q4_K_XL.values, GLM5_UD_Q4_K_XL.bytes);
        assert_eq!(p.bound, Side::CpuHash);
        assert_eq!(p.seconds, 248.0);
        assert_eq!(p.end_to_end_s, 310.0);
        let sides: Vec<Side> = p.sides.iter().map(|s| s.0).collect();
        assert_eq!(
            sides,
            [Side::CpuHash, Side::Gpu, Side::Copy, Side::DiskRead]
        );
        assert!((p.sides[1].1 - 2.48).abs() < 1e-12);
        assert!((p.sides[2].1 - 402.0 / 32.4).abs() < 1e-12);
        assert!((p.sides[3].1 - 402.0 / 5.4).abs() < 1e-12);
        // A model of many bytes per value is bound by its reads: 1e9 values, 1e12 bytes:
        // CPU 0.333 s, GPU 0.00333 s, copy 30.86 s, read 185.19 s.
        let p = r.project("wide", 1_000_000_000, 1_000_000_000_000);
        assert_eq!(p.bound, Side::DiskRead);
        assert!((p.seconds - 1e12 / 5.4e9).abs() < 1e-9);
    }

    /// Two devices run at once: each one's rate is its values over its own busy time, and the
    /// rates add. Device 0: 4e9 values in 2 s of CPU (2e9/s); device 1: 2e9 in 1 s (2e9/s):
    /// 4e9/s together. Copies 2e9 B in 0.5 s (4e9 B/s) and 1e9 B in 0.5 s (2e9 B/s): 6e9 B/s.
    /// Pageable copies: no read rate, and no read side in a projection.
    #[test]
    fn devices_add_up_and_pageable_has_no_read_side() {
        let a = busy(4_000_000_000, 2_000_000_000, 2000.0, 10.0, 500.0);
        let b = busy(2_000_000_000, 1_000_000_000, 1000.0, 10.0, 500.0);
        let r = Rates::measure(&[a, b], 3000.0).unwrap();
        assert_eq!(r.cpu_values_s, 4e9);
        assert_eq!(r.gpu_values_s, 4e11 + 2e11);
        assert_eq!(r.copy_bytes_s, 6e9);
        assert_eq!(r.read_bytes_s, None);
        assert_eq!(r.values_s, 2e9);
        // 8e9 values, 6e10 bytes: CPU 2 s, GPU 0.0133 s, copy 10 s: the copies bound it.
        let p = r.project("m.gguf", 8_000_000_000, 60_000_000_000);
        assert_eq!(p.bound, Side::Copy);
        assert_eq!(p.seconds, 10.0);
        assert_eq!(p.sides.len(), 3);
        assert_eq!(p.end_to_end_s, 4.0);
        // A device that checked nothing adds nothing.
        let idle = Busy::default();
        let a = busy(4_000_000_000, 2_000_000_000, 2000.0, 10.0, 500.0);
        let r2 = Rates::measure(&[a, idle], 2000.0).unwrap();
        assert_eq!(r2.cpu_values_s, 2e9);
    }

    /// The model at hand is projected only when part of it was checked; the full model only
    /// when asked, after it.
    #[test]
    fn which_projections() {
        let r = Rates::measure(&[busy(1_000, 500, 1.0, 1.0, 1.0)], 1.0).unwrap();
        let here = ("m.gguf", 4_000, 2_000);
        assert!(projections(&r, here, 4_000, None).is_empty());
        let p = projections(&r, here, 1_000, Some(&GLM5_UD_Q4_K_XL));
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["m.gguf", "GLM-5 UD-Q4_K_XL"]);
        // 4000 values at 1e6/s (1000 values in 1 ms): 4 ms, every side alike.
        assert_eq!(p[0].seconds, 0.004);
        assert_eq!(p[0].bound, Side::CpuHash);
        let p = projections(&r, here, 4_000, Some(&GLM5_UD_Q4_K_XL));
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].values, 744_000_000_000);
    }

    /// Nothing checked, or no time: no rates.
    #[test]
    fn no_values_no_rates() {
        assert_eq!(Rates::measure(&[], 1000.0), None);
        assert_eq!(Rates::measure(&[Busy::default()], 1000.0), None);
        let b = busy(10, 10, 1.0, 1.0, 1.0);
        assert_eq!(Rates::measure(std::slice::from_ref(&b), 0.0), None);
        // A side with no time measured (a kernel too fast for the events) gives no rates
        // rather than an infinite one.
        let b = busy(10, 10, 1.0, 0.0, 1.0);
        assert_eq!(Rates::measure(&[b], 1.0), None);
    }

    /// `--project` knows glm5 (with the figures of its source) and names the keys it knows
    /// otherwise.
    #[test]
    fn full_models_by_key() {
        let m = full_model("glm5").unwrap();
        assert_eq!((m.values, m.bytes), (744_000_000_000, 402_000_000_000));
        assert!(m.source.contains("744B") && m.source.contains("402 GB"));
        let e = full_model("glm6").unwrap_err().to_string();
        assert_eq!(
            e,
            "dequant-check: --project \"glm6\" is not a model of known size; known: glm5"
        );
    }
}
