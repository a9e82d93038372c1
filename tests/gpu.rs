//! GPU tests: every dequant kernel against the CPU dequantizers, bit for bit, on the quant
//! fixtures (every type) and on freshly drawn blocks (calibrated blocks, and raw random bytes so
//! that every f16 scale pattern occurs: subnormals, infinities, NaN), and the bf16 / f16 kernels
//! against the CPU's f32 rounded to nearest even.
//!
//! They need a CUDA device, so they are `#[ignore]`d: `cargo test` reports them as ignored
//! (counted, never a silent pass) and `scripts/gpu-test.sh` runs them on the GPU machine with
//! `--ignored`; run there without a device they fail. One test below runs everywhere: without
//! CUDA, `dequant-check` must exit 2 saying so.

use std::path::PathBuf;

fn fixtures(sub: &str) -> PathBuf {
    crate::common::fixtures(sub)
}

fn glmdiff(args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::common::glmdiff_bin())
        .args(args)
        .output()
        .expect("run glmdiff")
}

/// Without a CUDA device `run --against cuda` is a clear error (exit 2); with one, it is the
/// GPU test below.
#[test]
fn run_against_cuda_without_a_gpu_says_so() {
    #[cfg(feature = "cuda")]
    let has_cuda = glmdiff::cuda::DeviceInfo::list().is_ok_and(|d| !d.is_empty());
    #[cfg(not(feature = "cuda"))]
    let has_cuda = false;
    if has_cuda {
        eprintln!("skipped: a CUDA device is present (gpu_run_against_cuda covers it)");
        return;
    }
    let f = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let o = glmdiff(&[
        "run",
        f.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--against",
        "cuda",
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--against cuda") && err.contains("cuda"),
        "{err}"
    );
    let o = glmdiff(&[
        "run",
        f.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--against",
        "cuda:x",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cuda:N"));
}

/// Without CUDA (CI, developers' machines) `dequant-check` is a clear error, exit 2; with it, the
/// fixtures check clean (exit 0).
#[test]
fn dequant_check_without_a_gpu_says_so() {
    let f = fixtures("quant/all_types.gguf");
    let o = glmdiff(&["dequant-check", f.to_str().unwrap(), "--all"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    #[cfg(feature = "cuda")]
    let has_cuda = glmdiff::cuda::DeviceInfo::list().is_ok_and(|d| !d.is_empty());
    #[cfg(not(feature = "cuda"))]
    let has_cuda = false;
    if has_cuda {
        assert_eq!(o.status.code(), Some(0), "{err}");
    } else {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("no CUDA")
                || err.contains("no CUDA device")
                || err.contains("without the `cuda` feature"),
            "{err}"
        );
    }
    let o = glmdiff(&["dequant-check", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("give tensor names, --tensors GLOB or --all")
    );
}

#[cfg(feature = "cuda")]
mod device {
    use glmdiff::bench::random_blocks::fill_blocks;
    use glmdiff::cuda::check::check_tensor;
    use glmdiff::cuda::dequant::{kernel_stem, OutFormat};
    use glmdiff::cuda::Gpu;
    use glmdiff::driver::NoProgress;
    use glmdiff::gguf::Model;
    use glmdiff::quant::{dequantize_par, GgmlType, TYPE_TABLE};
    use glmdiff::util::rng::SplitMix64;

    use super::{fixtures, glmdiff};

    const NEEDS: &str = "needs a CUDA device: scripts/gpu-test.sh runs it";

    fn gpu() -> Gpu {
        Gpu::open(0).unwrap_or_else(|e| panic!("a GPU test ran without a usable device: {e:#}"))
    }

    /// Every tensor of the quant fixtures (one per type, plus the 3-shard split), bit-exact.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dequant_fixtures_bit_exact() {
        let _ = NEEDS;
        let g = gpu();
        eprintln!("{}", g.describe());
        for f in [
            "quant/all_types.gguf",
            "quant/split/all_types-00001-of-00003.gguf",
        ] {
            let model = Model::open(&fixtures(f)).unwrap();
            let mut n = 0;
            for t in model.tensors() {
                if kernel_stem(t.info.ty).is_none() {
                    continue;
                }
                let c = check_tensor(&g, &model, t, &NoProgress).unwrap();
                assert_eq!(c.mismatches, 0, "{f}: {} ({}): {:?}", c.name, c.ty, c.first);
                n += 1;
            }
            eprintln!("{f}: {n} tensors bit-exact");
            assert!(n >= 25, "{f}: only {n} tensors checked");
        }
    }

    /// CPU f32 of `bytes` (whole blocks of `ty`).
    fn cpu_f32(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / ty.type_size() * ty.block_size();
        let mut v = vec![0f32; n];
        dequantize_par(ty, bytes, &mut v).unwrap();
        v
    }

    /// Fresh blocks of every type: calibrated random blocks, then raw random bytes (every f16
    /// scale pattern); f32 bit-exact, bf16 and f16 equal to the CPU's f32 rounded to nearest even.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_fresh_blocks_every_type() {
        let g = gpu();
        let s = g.stream();
        let mut checked = 0;
        for info in TYPE_TABLE.iter() {
            let ty = info.ty;
            if kernel_stem(ty).is_none() {
                continue;
            }
            let blocks = (1 << 20) / ty.block_size();
            for (label, seed) in [("calibrated", 11u64), ("raw bytes", 12u64)] {
                let mut bytes = vec![0u8; blocks * ty.type_size()];
                let mut rng = SplitMix64::new(seed ^ u64::from(ty.id()));
                if label == "calibrated" {
                    fill_blocks(ty, &mut rng, &mut bytes);
                } else {
                    rng.fill(&mut bytes);
                }
                let want = cpu_f32(ty, &bytes);
                let raw = g.alloc_copy(&bytes, "raw").unwrap();
                let cpu = g.alloc_copy(&want, "cpu").unwrap();
                let mut out = g.alloc_zeroed::<f32>(want.len(), "gpu").unwrap();
                g.dequant_f32(ty, &raw, &mut out).unwrap();
                let st = g.compare_f32(&out, &cpu).unwrap();
                let first = st.first.map(|i| {
                    let got = s
                        .clone_dtoh(&out.slice(i as usize..i as usize + 1))
                        .unwrap()[0];
                    let blk = i as usize / ty.block_size();
                    let b = &bytes[blk * ty.type_size()..(blk + 1) * ty.type_size()];
                    format!(
                        "index {i} (block {blk}, element {}): cpu {:e} gpu {got:e}; block {:02x?}",
                        i as usize % ty.block_size(),
                        want[i as usize],
                        &b[..b.len().min(24)]
                    )
                });
                assert_eq!(st.mismatches, 0, "{ty} {label}: {first:?}");
                for (fmt, round) in [
                    (
                        OutFormat::Bf16,
                        (|x: f32| half::bf16::from_f32(x).to_bits()) as fn(f32) -> u16,
                    ),
                    (OutFormat::F16, |x: f32| half::f16::from_f32(x).to_bits()),
                ] {
                    let want16: Vec<u16> = want.iter().map(|&x| round(x)).collect();
                    let cpu16 = g.alloc_copy(&want16, "cpu16").unwrap();
                    let mut out16 = g.alloc_zeroed::<u16>(want.len(), "gpu16").unwrap();
                    g.dequant_u16(ty, fmt, &raw, &mut out16).unwrap();
                    let st = g.compare_u16(&out16, &cpu16).unwrap();
                    // NaN payloads may differ; count only non-NaN disagreements.
                    let mism = if st.mismatches == 0 {
                        0
                    } else {
                        let got = s.clone_dtoh(&out16).unwrap();
                        got.iter()
                            .zip(&want16)
                            .zip(&want)
                            .filter(|((a, b), w)| a != b && !w.is_nan())
                            .count()
                    };
                    assert_eq!(mism, 0, "{ty} {label} {fmt:?}: first at {:?}", st.first);
                }
            }
            checked += 1;
        }
        eprintln!("{checked} types bit-exact on 2 x 1M elements each (f32, bf16, f16)");
        assert!(checked >= 30, "{checked} types");
    }

    /// Blocks at every byte offset 0..16 from a 16-byte boundary (a row range of a tensor kept
    /// on the device starts anywhere), block counts that leave a tail past the last whole 256
    /// values, and the first and last 16-byte words only partly the tensor's: f32 and bf16
    /// bit-exact against the CPU.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dequant_at_every_offset() {
        let g = gpu();
        let s = g.stream();
        let mut cases = 0;
        for info in TYPE_TABLE.iter() {
            let ty = info.ty;
            if kernel_stem(ty).is_none() {
                continue;
            }
            // 256 * 37 + 96 values (a tail) where the block allows, 37 whole 256s otherwise.
            let n = if 96 % ty.block_size() == 0 {
                256 * 37 + 96
            } else {
                256 * 37
            };
            let blocks = n / ty.block_size();
            let mut bytes = vec![0u8; blocks * ty.type_size()];
            fill_blocks(
                ty,
                &mut SplitMix64::new(77 ^ u64::from(ty.id())),
                &mut bytes,
            );
            let want = cpu_f32(ty, &bytes);
            let want16: Vec<u16> = want
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            let cpu = g.alloc_copy(&want, "cpu").unwrap();
            let cpu16 = g.alloc_copy(&want16, "cpu16").unwrap();
            for pad in 0..=16usize {
                let mut padded = vec![0xA5u8; pad + bytes.len() + 16];
                padded[pad..pad + bytes.len()].copy_from_slice(&bytes);
                let raw = g.alloc_copy(&padded, "raw").unwrap();
                let view = raw.slice(pad..pad + bytes.len());
                let mut out = g.alloc_zeroed::<f32>(n, "gpu").unwrap();
                g.dequant_view(ty, OutFormat::F32, &view, &mut out.as_view_mut())
                    .unwrap();
                let st = g.compare_f32(&out, &cpu).unwrap();
                assert_eq!(
                    st.mismatches, 0,
                    "{ty} at offset {pad}: first at {:?}",
                    st.first
                );
                let mut out16 = g.alloc_zeroed::<u16>(n, "gpu16").unwrap();
                g.dequant_view(ty, OutFormat::Bf16, &view, &mut out16.as_view_mut())
                    .unwrap();
                let st = g.compare_u16(&out16, &cpu16).unwrap();
                assert_eq!(
                    st.mismatches, 0,
                    "{ty} bf16 at offset {pad}: first at {:?}",
                    st.first
                );
                cases += 1;
            }
        }
        s.synchronize().unwrap();
        eprintln!("{cases} type x offset cases bit-exact (f32, bf16)");
        assert!(cases >= 30 * 17, "{cases} cases");
    }

    /// The comparison machinery itself: a planted difference is found by the hash, and
    /// compare_f32 names its index and size; NaN equals NaN whatever the payload.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_compare_and_hash_find_a_planted_difference() {
        use glmdiff::cuda::dequant::hash_f32_host;
        let g = gpu();
        let mut rng = SplitMix64::new(5);
        let a: Vec<f32> = (0..1_000_003).map(|_| rng.normal()).collect();
        let mut b = a.clone();
        let (da, db) = (
            g.alloc_copy(&a, "a").unwrap(),
            g.alloc_copy(&b, "b").unwrap(),
        );
        assert_eq!(g.hash_f32(&da, 7).unwrap(), hash_f32_host(&a, 7));
        assert_eq!(g.compare_f32(&da, &db).unwrap().mismatches, 0);
        b[123_457] += 0.5;
        b[999_999] = f32::from_bits(0x7FC0_0001); // a NaN where a has a number
        let db = g.alloc_copy(&b, "b").unwrap();
        assert_ne!(g.hash_f32(&db, 7).unwrap(), hash_f32_host(&a, 7));
        assert_eq!(g.hash_f32(&db, 7).unwrap(), hash_f32_host(&b, 7));
        let st = g.compare_f32(&da, &db).unwrap();
        assert_eq!((st.mismatches, st.first), (2, Some(123_457)));
        assert!((st.max_abs - 0.5).abs() < 1e-6, "{}", st.max_abs);
        // Two different NaN payloads are equal.
        let n1 = vec![f32::from_bits(0x7FC0_0000); 64];
        let n2 = vec![f32::from_bits(0xFFFF_FFFF); 64];
        let (d1, d2) = (
            g.alloc_copy(&n1, "n1").unwrap(),
            g.alloc_copy(&n2, "n2").unwrap(),
        );
        assert_eq!(g.compare_f32(&d1, &d2).unwrap().mismatches, 0);
        assert_eq!(g.hash_f32(&d1, 0).unwrap(), g.hash_f32(&d2, 0).unwrap());
    }

    /// `run --against cuda` on every fixture model, both modes, every hook (per-expert and
    /// attention-probability points too): the CUDA engine (absorbed MLA, cuBLAS SGEMM on weights
    /// dequantized per step) within the f32 floors of the CPU reference at every step, and with
    /// `--dtype bf16` within the bf16 floors; exit 0.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_run_against_cuda() {
        let models = [
            "models/glm5-tiny/glm5-tiny-f32.gguf",
            "models/glm5-tiny/glm5-tiny-f16.gguf",
            "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "models/dsv3-tiny/dsv3-tiny-f32.gguf",
            "models/dsv3-tiny/dsv3-tiny-f16.gguf",
            "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ];
        let mut failed = Vec::new();
        for m in models {
            let f = fixtures(m);
            for extra in [
                &[][..],
                &["--all-steps", "--layer", "1"][..],
                &["--dtype", "bf16"][..],
            ] {
                let mut args = vec![
                    "run",
                    f.to_str().unwrap(),
                    "--prompt",
                    "The capital of France is Paris, and the capital of Italy is",
                    "--against",
                    "cuda",
                    "--no-cache",
                ];
                args.extend_from_slice(extra);
                let o = glmdiff(&args);
                let out = String::from_utf8_lossy(&o.stdout).into_owned();
                eprintln!(
                    "== {m} {extra:?}: exit {:?}\n{out}{}",
                    o.status.code(),
                    String::from_utf8_lossy(&o.stderr)
                );
                if o.status.code() != Some(0) {
                    failed.push(format!("{m} {extra:?}"));
                }
            }
        }
        assert!(failed.is_empty(), "run --against cuda failed on {failed:?}");
    }

    /// A bad device ordinal lists the devices; the CLI checks the fixtures clean.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_cli_and_errors() {
        let e = Gpu::open(99).err().expect("device 99 should not exist");
        let msg = format!("{e:#}");
        assert!(
            msg.contains("no device 99") && msg.contains("cuda:0"),
            "{msg}"
        );
        let f = fixtures("quant/all_types.gguf");
        let o = glmdiff(&["dequant-check", f.to_str().unwrap(), "--all"]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(
            o.status.code(),
            Some(0),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains("every value bit-exact"), "{out}");
        eprintln!("{out}");
    }
}
