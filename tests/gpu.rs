//! GPU tests: every dequant kernel against the CPU dequantizers, bit for bit, on the quant
//! fixtures (every type) and on freshly drawn blocks (calibrated blocks, and raw random bytes so
//! that every f16 scale pattern occurs: subnormals, infinities, NaN), and the bf16 / f16 kernels
//! against the CPU's f32 rounded to nearest even.
//!
//! They need a CUDA device, so they are `#[ignore]`d: `cargo test` reports them as ignored
//! (counted, never a silent pass) and `scripts/gpu-test.sh` runs them on the GPU machine with
//! `--include-ignored`; run there without a device they fail. Two tests below run everywhere:
//! `run --against cuda` with no device visible (the devices hidden from it where there are some)
//! must exit 2 saying so, and `dequant-check` exits 2 without CUDA and 0 with it.

use std::path::PathBuf;

use crate::common::glmdiff;

fn fixtures(sub: &str) -> PathBuf {
    crate::common::fixtures(sub)
}

/// glmdiff with every CUDA device hidden from it (`CUDA_VISIBLE_DEVICES=""`): no device, on any
/// machine.
fn glmdiff_without_devices(args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::common::glmdiff_bin())
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("run glmdiff")
}

/// Without a CUDA device `run --against cuda` is a clear error (exit 2). Where there are
/// devices they are hidden from the command, so this runs (and can fail) everywhere; with a
/// device, `gpu_run_against_cuda` below is the test.
#[test]
fn run_against_cuda_without_a_gpu_says_so() {
    let f = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let o = glmdiff_without_devices(&[
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
        err.contains("no CUDA")
            || err.contains("--against cuda")
            || err.contains("without the `cuda` feature"),
        "{err}"
    );
    let o = glmdiff_without_devices(&[
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

/// `--reference-on cuda` without a device is a clear error naming the flag (exit 2), a bad
/// value too; `auto` (the default) runs on the CPU then, the same run as `--reference-on cpu`.
#[test]
fn reference_on_a_device_without_one_says_so() {
    let f = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
    let tokens: Vec<String> = (0..70).map(|i| ((i * 37 + 5) % 200).to_string()).collect();
    let tokens = tokens.join(",");
    let run = |on: &str| {
        glmdiff_without_devices(&[
            "run",
            f.to_str().unwrap(),
            "--tokens",
            &tokens,
            "--against",
            "cpu",
            "--layers",
            "0..1",
            "--no-cache",
            "--reference-on",
            on,
        ])
    };
    let o = run("cuda");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--reference-on cuda:0"), "{err}");
    let o = run("gpu");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("expected auto, cpu, cuda or cuda:N"), "{err}");
    for on in ["auto", "cpu"] {
        let o = run(on);
        let text =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{on}: {text}");
        assert!(!text.contains("ran on cuda"), "{on}: {text}");
    }
}

/// Without CUDA (CI, developers' machines) `dequant-check` is a clear error, exit 2; with it, the
/// fixtures check clean (exit 0).
#[test]
fn dequant_check_without_a_gpu_says_so() {
    let f = fixtures("quant/all_types.gguf");
    let o = glmdiff(&["dequant-check", f.to_str().unwrap(), "--all"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    #[cfg(feature = "cuda")]
    let has_cuda = glmdiff::gpu::DeviceInfo::list().is_ok_and(|d| !d.is_empty());
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
    // `--project glm5` is taken: the same exit without a device; with one, the projection of
    // the measured rates to GLM-5's 744 G values and 402 GB, and its bound.
    let o = glmdiff(&[
        "dequant-check",
        f.to_str().unwrap(),
        "--all",
        "--project",
        "glm5",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    if has_cuda {
        assert_eq!(o.status.code(), Some(0), "{out}{err}");
        let joined = crate::common::joined(&out);
        assert!(
            joined.contains("GLM-5 UD-Q4_K_XL's 744 G values (402 GB) would take"),
            "{out}"
        );
        assert!(joined.contains("bound by the"), "{out}");
    } else {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(!err.contains("--project"), "{err}");
    }
}

#[cfg(feature = "cuda")]
mod device {
    use glmdiff::bench::random_blocks::fill_blocks;
    use glmdiff::compare::metrics::{compare, Metrics};
    use glmdiff::dcheck::{DeviceCheck, Staging, TensorCheck, CHUNK_ELEMS};
    use glmdiff::driver::NoProgress;
    use glmdiff::engine::cpu::CpuEngine;
    use glmdiff::engine::cuda::{CudaEngine, GpuDtype};
    use glmdiff::engine::{Engine, ExpertInputs, HostData, HostTensor, MlaInputs};
    use glmdiff::gguf::{GgufWriter, Model, TensorRef};
    use glmdiff::gpu::dequant::{kernel_stem, OutFormat};
    use glmdiff::gpu::Gpu;
    use glmdiff::model::Weights;
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
            let mut dc = DeviceCheck::new(&g, Staging::Pinned);
            for t in model.tensors() {
                if kernel_stem(t.info.ty).is_none() {
                    continue;
                }
                let c = dc.check_tensor(&model, t, &NoProgress).unwrap();
                assert_eq!(c.mismatches, 0, "{f}: {} ({}): {:?}", c.name, c.ty, c.first);
                n += 1;
            }
            eprintln!("{f}: {n} tensors bit-exact");
            assert!(n >= 25, "{f}: only {n} tensors checked");
        }
    }

    /// The tensors of `model` with a dequantizer.
    fn checkable(model: &Model) -> Vec<TensorRef<'_>> {
        model
            .tensors()
            .filter(|t| kernel_stem(t.info.ty).is_some())
            .collect()
    }

    /// `ts` through one pipeline of `g` in one run: the results in order.
    fn run_pipeline(
        dc: &mut DeviceCheck<'_>,
        model: &Model,
        ts: &[TensorRef<'_>],
    ) -> anyhow::Result<Vec<TensorCheck>> {
        let mut it = ts.iter().copied().enumerate();
        let mut out = Vec::new();
        dc.run(model, &mut || it.next(), &NoProgress, &mut |i, c| {
            assert_eq!(i, out.len(), "results out of order");
            out.push(c);
            Ok(())
        })?;
        Ok(out)
    }

    /// A model of a few tensors larger than a chunk of the default size (2^26 values), so that
    /// the pinned ring carries full-size chunks and a tensor's last chunk overlaps the next
    /// tensor's first: Q4_K [6144 x 12000] (2 chunks), Q8_0 [4096 x 20000] (2 chunks), a small
    /// F32 and an IQ4_XS between them; random valid blocks. About 135 MB.
    fn write_big_model(path: &std::path::Path) {
        let tensors: [(&str, [u64; 2], GgmlType); 4] = [
            ("big.q4_k.weight", [6144, 12_000], GgmlType::Q4_K),
            ("small.f32.weight", [4096, 3], GgmlType::F32),
            ("big.q8_0.weight", [4096, 20_000], GgmlType::Q8_0),
            ("mid.iq4_xs.weight", [2048, 3000], GgmlType::IQ4_XS),
        ];
        let mut w = GgufWriter::new();
        w.add_str("general.architecture", "none").unwrap();
        for (name, ne, ty) in &tensors {
            w.add_tensor(name, ne, *ty).unwrap();
        }
        let mut k = 0u64;
        w.write_file(path, &mut |info, out| {
            k += 1;
            let mut bytes = vec![0u8; info.nbytes as usize];
            fill_blocks(info.ty, &mut SplitMix64::new(k), &mut bytes);
            out.write_all(&bytes)?;
            Ok(())
        })
        .unwrap();
    }

    /// The pinned pipeline (an upload thread reading into a pinned ring, a copy stream, chunks
    /// a few ahead) and pageable copies check the same tensors bit-exact with the same
    /// results, on the quant fixtures (every type, and the 3-shard split, whose chunks come
    /// from three files) in chunks of 1024 values (hundreds of chunks, tensors following each
    /// other through the ring) and of the default size, and on a model of tensors of several
    /// full-size chunks; pinned staging reads and copies every raw byte once, pageable copies
    /// read none through staging.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dcheck_pinned_equals_pageable() {
        let g = gpu();
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.gguf");
        write_big_model(&big);
        let cases: Vec<(std::path::PathBuf, Vec<u64>)> = vec![
            (fixtures("quant/all_types.gguf"), vec![1024, CHUNK_ELEMS]),
            (
                fixtures("quant/split/all_types-00001-of-00003.gguf"),
                vec![1024, CHUNK_ELEMS],
            ),
            (big.clone(), vec![CHUNK_ELEMS, 3 << 20]),
        ];
        for (f, sizes) in cases {
            let model = Model::open(&f).unwrap();
            let ts = checkable(&model);
            let bytes: u64 = ts.iter().map(|t| t.info.nbytes).sum();
            let values: u64 = ts.iter().map(|t| t.info.n_elements()).sum();
            for chunk in sizes {
                let mut runs = Vec::new();
                for staging in [Staging::Pinned, Staging::Pageable] {
                    let mut dc = DeviceCheck::new(&g, staging).with_chunk_elems(chunk);
                    let pinned = staging == Staging::Pinned;
                    assert_eq!(dc.is_pinned(), pinned, "{}", dc.staging());
                    let t0 = std::time::Instant::now();
                    let out = run_pipeline(&mut dc, &model, &ts).unwrap();
                    let b = dc.busy().clone();
                    eprintln!(
                        "{} chunks of {chunk}, {staging:?}: {} tensors in {:.3} s; {b:?}",
                        f.display(),
                        out.len(),
                        t0.elapsed().as_secs_f64()
                    );
                    assert_eq!(out.len(), ts.len());
                    for c in &out {
                        assert_eq!(c.mismatches, 0, "{staging:?} {}: {:?}", c.name, c.first);
                    }
                    assert_eq!((b.values, b.bytes, b.copy_bytes), (values, bytes, bytes));
                    assert_eq!(b.read_bytes, if pinned { bytes } else { 0 });
                    assert!(b.cpu_ms > 0.0 && b.gpu_ms > 0.0 && b.copy_ms > 0.0, "{b:?}");
                    runs.push(
                        out.into_iter()
                            .map(|c| (c.name, c.elements, c.bytes, c.mismatches, c.first))
                            .collect::<Vec<_>>(),
                    );
                }
                assert_eq!(runs[0], runs[1], "{}: chunks of {chunk}", f.display());
            }
        }
    }

    /// The device side's time is its kernels' alone: a pipeline on a device whose kernels are
    /// not loaded yet loads them before its loop (`load_ms`, in no rate: a cold NVRTC cache
    /// costs seconds, which once sat inside the first chunk's timing span and made the device
    /// side look like the bound), and a second run on the same pipeline loads nothing. The
    /// kernels of the quant fixtures' ~30 small tensors take well under the module load (a
    /// 1.5 MB cubin, from the disk cache at best); before the fix the load was inside
    /// `gpu_ms`, so `gpu_ms` exceeded it. Bit-exact both times, both stagings.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dcheck_kernel_time_holds_no_kernel_load() {
        let model = Model::open(&fixtures("quant/all_types.gguf")).unwrap();
        let ts = checkable(&model);
        for staging in [Staging::Pinned, Staging::Pageable] {
            // A device of its own: nothing loaded on it yet.
            let g = gpu();
            let mut dc = DeviceCheck::new(&g, staging);
            let out = run_pipeline(&mut dc, &model, &ts).unwrap();
            assert!(out.iter().all(|c| c.mismatches == 0), "{staging:?}");
            let first = dc.busy().clone();
            eprintln!("{staging:?}, first run: {first:?}");
            assert!(first.load_ms > 0.0, "{first:?}");
            assert!(
                first.gpu_ms > 0.0 && first.gpu_ms < first.load_ms,
                "the kernels' span holds the kernel load: {first:?}"
            );
            let out = run_pipeline(&mut dc, &model, &ts).unwrap();
            assert!(out.iter().all(|c| c.mismatches == 0), "{staging:?}");
            let second = dc.busy().clone();
            assert_eq!(second.load_ms, first.load_ms, "loaded again: {second:?}");
            assert_eq!(second.values, 2 * first.values);
            assert_eq!(second.copy_bytes, 2 * first.copy_bytes);
        }
    }

    /// A model file replaced while it is open (the map keeps the old bytes, the upload thread
    /// reads the new file): the pinned pipeline refuses the chunk whose first bytes changed,
    /// naming the tensor, the file, the offset and the length, exit-2 material, not a wrong
    /// verdict; the pipeline then drains what was under way, and once the file's bytes are
    /// back it checks bit-exact again. Pageable copies read the map and do not see the change.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dcheck_pinned_refuses_a_changed_file() {
        use std::os::unix::fs::FileExt;
        let g = gpu();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::copy(fixtures("quant/all_types.gguf"), &path).unwrap();
        let model = Model::open(&path).unwrap();
        let ts = checkable(&model);
        // The fifth tensor's first byte, changed in a copy that replaces the file.
        let victim = ts[4];
        let shard = &model.shards()[0];
        let at = shard.data_start() + victim.info.offset;
        let original = std::fs::read(&path).unwrap();
        let mut changed = original.clone();
        changed[at as usize] ^= 0xff;
        let tmp = dir.path().join("m.gguf.new");
        std::fs::write(&tmp, &changed).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let mut dc = DeviceCheck::new(&g, Staging::Pinned).with_chunk_elems(1024);
        let e = format!("{:#}", run_pipeline(&mut dc, &model, &ts).unwrap_err());
        eprintln!("{e}");
        assert!(
            e.contains(&victim.info.name)
                && e.contains("differ from those mapped")
                && e.contains(&format!("offset {at}"))
                && e.contains("m.gguf"),
            "{e}"
        );
        // The pageable copies read the map: the old bytes, bit-exact.
        let mut pg = DeviceCheck::new(&g, Staging::Pageable).with_chunk_elems(1024);
        let out = run_pipeline(&mut pg, &model, &ts).unwrap();
        assert!(out.iter().all(|c| c.mismatches == 0));
        // The new file's bytes put back (in place: the upload thread keeps the file open); the
        // same pipeline checks everything bit-exact.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&original[at as usize..at as usize + 1], at)
            .unwrap();
        let out = run_pipeline(&mut dc, &model, &ts).unwrap();
        assert_eq!(out.len(), ts.len());
        assert!(out.iter().all(|c| c.mismatches == 0));
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
        use glmdiff::gpu::dequant::hash_f32_host;
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
                &["--devices", "0,0"][..],
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

    /// NMSE allowed per op of the op table.
    /// - Element-wise and row-wise ops without a GEMM (embed, rms_norm, rope, swiglu/add): both
    ///   engines compute in f64 from the same f32 inputs and round once to f32, so they differ
    ///   by at most an ulp here and there (a reduction summed in another order): relative error
    ///   2^-24 per value at most, NMSE < 4e-15; 1e-13 leaves a margin for the f64 reduction order.
    /// - Ops with a GEMM (linear, logits, mla, indexer, moe): cuBLAS accumulates in f32, the
    ///   reference in f64: a sum of K products carries a relative error of about sqrt(K) * 2^-24
    ///   (random signs), NMSE about K * 2^-48 <= 6e-11 for K <= 16384; the absorbed MLA adds one
    ///   f32 rounding of q_lat and o_lat. 1e-9 leaves a 15x margin; a wrong weight, head or
    ///   expert gives NMSE of order 1.
    fn op_threshold(op: &str) -> f64 {
        match op {
            "embed" | "rms_norm" | "rope" | "swiglu" => 1e-13,
            _ => 1e-9,
        }
    }

    /// One case of the op table: its (CPU, CUDA) output pairs.
    type OpCase<'a> = Box<dyn Fn() -> Vec<(HostTensor, HostTensor)> + 'a>;

    /// The two engines of the op table.
    struct Pair<'a, 'w> {
        cpu: &'a CpuEngine<'w>,
        gpu: &'a CudaEngine<'w>,
    }

    /// Runs the body with `$e` bound to the CPU engine, then to the CUDA engine; pairs the outputs.
    macro_rules! on_both {
        ($pair:expr, |$e:ident| $body:expr) => {{
            let a = {
                let $e = $pair.cpu;
                let r: Vec<HostTensor> = $body;
                r
            };
            let b = {
                let $e = $pair.gpu;
                let r: Vec<HostTensor> = $body;
                r
            };
            a.into_iter().zip(b).collect::<Vec<_>>()
        }};
    }

    fn rand_t(rng: &mut SplitMix64, shape: Vec<usize>, scale: f32) -> HostTensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect();
        HostTensor::f32(shape, v).unwrap()
    }

    /// Each CUDA op against the CPU step on fresh random inputs, on the tiny fixtures and on a
    /// synthetic GLM-5-dimension layer (real shapes, UD-Q4_K_XL mix). The case name
    /// (`op/model`) is printed and is the filter: `GLMDIFF_OP=mla` runs the cases containing it.
    /// NaN/Inf first, then NMSE against the op's threshold ([`op_threshold`]); ids must be equal.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_op_table() {
        let filter = std::env::var("GLMDIFF_OP").unwrap_or_default();
        let dir = tempfile::tempdir().unwrap();
        let synth = dir.path().join("glm5-1.gguf");
        let o = glmdiff(&[
            "synth",
            "--arch",
            "glm-dsa",
            "--dims",
            "glm5",
            "--layers",
            "1",
            "--out",
            synth.to_str().unwrap(),
        ]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let models = [
            (
                "glm5-tiny-q",
                fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf"),
                1usize,
                12usize,
            ),
            (
                "dsv3-tiny-q",
                fixtures("models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf"),
                1,
                12,
            ),
            ("glm5-dims", synth.clone(), 1, 6),
        ];
        let g = gpu();
        let mut ran = 0;
        let mut failed = Vec::new();
        for (label, path, moe_layer, t) in models {
            let m = Model::open(&path).unwrap();
            let w = Weights::new(&m).unwrap();
            let hp = w.hparams().clone();
            let cpu = CpuEngine::new(&w);
            let cuda = CudaEngine::new(&g, &w, GpuDtype::F32).unwrap();
            let pair = Pair {
                cpu: &cpu,
                gpu: &cuda,
            };
            let mut rng = SplitMix64::new(5);
            let l = 0usize;
            let name = |s: &str| format!("blk.{l}.{s}");
            let x = rand_t(&mut rng, vec![t, hp.hidden], 1.0);
            let q_lora = hp.q_lora_rank.unwrap_or(hp.hidden);
            let cq = rand_t(&mut rng, vec![t, q_lora], 1.0);
            let qk = hp.qk_head();
            let q_b = rand_t(&mut rng, vec![t, hp.n_head * qk], 1.0);
            let q_pe = rand_t(&mut rng, vec![t, hp.n_head, hp.qk_rope], 1.0);
            let kv = rand_t(&mut rng, vec![t, hp.kv_lora_rank], 1.0);
            let k_pe = rand_t(&mut rng, vec![t, hp.qk_rope], 1.0);
            let logits = rand_t(&mut rng, vec![t, hp.n_expert.max(1)], 2.0);
            let a = rand_t(&mut rng, vec![t, 300], 3.0);
            let b = rand_t(&mut rng, vec![t, 300], 3.0);
            let rope_q = glmdiff::model::RopeSlice {
                heads: hp.n_head,
                stride: qk,
                offset: hp.qk_nope,
                keep_head_axis: true,
            };
            let has = |n: &str| w.has(n);
            let mut cases: Vec<(&str, OpCase)> = vec![
                (
                    "embed",
                    Box::new(|| {
                        on_both!(pair, |e| vec![e
                            .download(&e.embed(&[1, 5, 7, 2]).unwrap())
                            .unwrap()])
                    }),
                ),
                (
                    "rms_norm",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let u = e.upload(&x).unwrap();
                            vec![e
                                .download(
                                    &e.rms_norm(&u, &name("attn_norm.weight"), hp.rms_eps, None)
                                        .unwrap(),
                                )
                                .unwrap()]
                        })
                    }),
                ),
                (
                    "linear",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let u = e.upload(&x).unwrap();
                            let wname = if has(&name("attn_q_a.weight")) {
                                name("attn_q_a.weight")
                            } else {
                                name("attn_q.weight")
                            };
                            vec![e.download(&e.linear(&u, &wname).unwrap()).unwrap()]
                        })
                    }),
                ),
                (
                    "logits",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let u = e.upload(&x).unwrap();
                            vec![e.download(&e.linear(&u, w.output_name()).unwrap()).unwrap()]
                        })
                    }),
                ),
                (
                    "rope",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let u = e.upload(&q_b).unwrap();
                            vec![e.download(&e.rope(&u, &rope_q).unwrap()).unwrap()]
                        })
                    }),
                ),
                (
                    "mla",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let (a1, a2, a3, a4) = (
                                e.upload(&q_b).unwrap(),
                                e.upload(&q_pe).unwrap(),
                                e.upload(&kv).unwrap(),
                                e.upload(&k_pe).unwrap(),
                            );
                            let (o, p) = e
                                .mla_attention(
                                    l,
                                    MlaInputs {
                                        q_b: &a1,
                                        q_pe: &a2,
                                        kv_norm: &a3,
                                        k_pe: &a4,
                                        selection: None,
                                    },
                                    true,
                                )
                                .unwrap();
                            vec![e.download(&o).unwrap(), e.download(&p.unwrap()).unwrap()]
                        })
                    }),
                ),
                (
                    "swiglu",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let (u, v) = (e.upload(&a).unwrap(), e.upload(&b).unwrap());
                            vec![
                                e.download(&e.swiglu(&u, &v).unwrap()).unwrap(),
                                e.download(&e.add(&u, &v).unwrap()).unwrap(),
                            ]
                        })
                    }),
                ),
            ];
            if hp.indexer.is_some() {
                cases.push((
                    "indexer",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let (u, v) = (e.upload(&x).unwrap(), e.upload(&cq).unwrap());
                            let sc = e.indexer_scores(l, &u, &v).unwrap();
                            let k = e.top_k(&sc, 4).unwrap();
                            vec![e.download(&sc).unwrap(), e.download(&k).unwrap()]
                        })
                    }),
                ));
            }
            if hp.n_expert > 0 {
                cases.push((
                    "moe",
                    Box::new(|| {
                        on_both!(pair, |e| {
                            let lg = e.upload(&logits).unwrap();
                            let r = e.moe_route(moe_layer, &lg).unwrap();
                            let xx = e.upload(&x).unwrap();
                            let out = e
                                .moe_experts(
                                    moe_layer,
                                    ExpertInputs {
                                        x: &xx,
                                        ids: &r.ids,
                                        weights: &r.weights,
                                    },
                                    &|_| false,
                                )
                                .unwrap();
                            vec![
                                e.download(&r.probs).unwrap(),
                                e.download(&r.ids).unwrap(),
                                e.download(&r.weights).unwrap(),
                                e.download(&out.routed).unwrap(),
                            ]
                        })
                    }),
                ));
            }
            for (op, f) in &cases {
                let case = format!("{op}/{label}");
                if !case.contains(&filter) {
                    continue;
                }
                let outs = f();
                for (i, (c, gq)) in outs.iter().enumerate() {
                    let verdict = match (&c.data, &gq.data) {
                        (HostData::I32(x), HostData::I32(y)) => {
                            if x == y {
                                "ok".to_string()
                            } else {
                                format!(
                                    "ids differ: {:?} vs {:?}",
                                    &x[..x.len().min(8)],
                                    &y[..y.len().min(8)]
                                )
                            }
                        }
                        (HostData::F32(x), HostData::F32(y)) => {
                            let fin = |v: &[f32]| {
                                v.iter()
                                    .filter(|z| !z.is_finite() && **z != f32::NEG_INFINITY)
                                    .count()
                            };
                            // The metrics `run` judges by (the CPU side is the reference): -inf
                            // on both sides is a mask and not compared; -inf on one side only is
                            // a non-finite mismatch.
                            let m = match compare(c, gq) {
                                Ok(Metrics::Float(m)) => Ok(m),
                                Ok(Metrics::Ids(_)) => Err("ids where floats were".to_string()),
                                Err(e) => Err(e),
                            };
                            match m {
                                _ if fin(x) + fin(y) > 0 => {
                                    format!("NaN/Inf: cpu {} cuda {}", fin(x), fin(y))
                                }
                                Err(e) => e,
                                Ok(m) if m.nonfinite_mismatch > 0 => {
                                    format!("-inf masks differ at {} values", m.nonfinite_mismatch)
                                }
                                Ok(m) if m.nmse > op_threshold(op) => {
                                    format!("NMSE {:.2e} > {:.0e}", m.nmse, op_threshold(op))
                                }
                                Ok(m) => format!("ok (NMSE {:.2e})", m.nmse),
                            }
                        }
                        _ => "dtypes differ".to_string(),
                    };
                    eprintln!("{case}[{i}] {:?}: {verdict}", c.shape);
                    if !verdict.starts_with("ok") {
                        failed.push(format!("{case}[{i}]: {verdict}"));
                    }
                }
                ran += 1;
            }
        }
        eprintln!("{ran} op cases");
        assert!(failed.is_empty(), "{failed:#?}");
        assert!(
            filter.is_empty() || ran > 0,
            "no op case matches GLMDIFF_OP={filter}"
        );
    }

    /// `run --against cuda --dtype bf16 --mode chained` on 40 tokens, where the bf16 engine
    /// flips near-tie keys and experts: clean it exits 0 (the reference's chain follows those
    /// flips, so nothing is excused as drift), and with the gate and up projections of every
    /// expert exchanged in layer 1 (`--inject gate_up_swap@1`) it exits 1 naming
    /// `blk.1.moe_routed` in chained mode (before, one near tie upstream excused it as drift:
    /// "first divergence (chained): none" with top-1 agreement 21/40).
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_chained_follows_near_ties_and_names_a_planted_bug() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("r.json");
        let tokens: Vec<String> = (0..40u32)
            .map(|i| ((i * 37 + 11) % 400).to_string())
            .collect();
        let tokens = tokens.join(",");
        for m in [
            "models/glm5-tiny/glm5-tiny-f32.gguf",
            "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ] {
            let f = fixtures(m);
            for inject in [None, Some("gate_up_swap@1")] {
                let mut args = vec![
                    "run",
                    f.to_str().unwrap(),
                    "--tokens",
                    &tokens,
                    "--against",
                    "cuda",
                    "--dtype",
                    "bf16",
                    "--mode",
                    "chained",
                    "--no-cache",
                    "--json",
                    json.to_str().unwrap(),
                ];
                if let Some(k) = inject {
                    args.extend(["--inject", k]);
                }
                let o = glmdiff(&args);
                let (rc, j, text) = crate::common::outcome(o, &json);
                eprintln!("== {m} {inject:?}: exit {rc}\n{text}");
                match inject {
                    None => {
                        assert_eq!(rc, 0, "{m}: {text}");
                        assert!(j["first_divergence_chained"].is_null(), "{m}: {text}");
                    }
                    Some(_) => {
                        assert_eq!(rc, 1, "{m} {inject:?}: {text}");
                        assert_eq!(
                            j["first_divergence_chained"]["hook"], "blk.1.moe_routed",
                            "{m} {inject:?}: {text}"
                        );
                    }
                }
            }
        }
    }

    /// Names of the hooks of `a` and `b` that differ in bits (or that one lacks).
    fn differing(
        a: &std::collections::BTreeMap<String, HostTensor>,
        b: &std::collections::BTreeMap<String, HostTensor>,
    ) -> Vec<String> {
        let mut v: Vec<String> = a
            .iter()
            .filter(|(n, t)| b.get(*n).is_none_or(|u| !t.same_bits(u)))
            .map(|(n, _)| n.clone())
            .collect();
        v.extend(b.keys().filter(|n| !a.contains_key(*n)).cloned());
        v
    }

    /// Routed expert uploads change which bytes go to the device, not the results: every hook
    /// of a chained run of the whole model is bit-identical with the stacked expert tensors
    /// uploaded whole and by expert (routed and `auto`, prefetch on and off, one device and a
    /// two-device run), at 2 tokens (the fixtures' 8 experts, 2 a token: `auto` goes by
    /// expert) and 16 (whole); by expert at 2 tokens no prefetch falls back and fewer bytes go
    /// up than whole.
    /// The uploader copies file ranges to the device bit for bit from either source: staged, and
    /// from the mapped file's registered pages (`gpu::upload::Source::Mapped`). Ranges at odd
    /// offsets and lengths, ranges sharing pages (within a job, and across jobs in flight at
    /// once), a range inside one page, an empty range, a page-aligned one, and jobs larger than
    /// a staging buffer; the expected bytes are the file's, as written here. A job whose
    /// fingerprint disagrees with the file fails, naming it; the uploader's later jobs still
    /// land.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_mapped_uploads_equal_the_file() {
        use glmdiff::gpu::upload::{
            alloc_dst, FileRange, Job, Outcome, Source, Uploader, STAGING_BYTES,
        };
        use std::sync::Arc;
        let _ = NEEDS;
        let g = gpu();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bytes.bin");
        let len = STAGING_BYTES + (40 << 20) + 1234;
        let mut rng = SplitMix64::new(7);
        let data: Vec<u8> = (0..len).map(|_| (rng.next_u64() >> 56) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let range = |offset: usize, len: usize| FileRange {
            path: path.clone(),
            offset: offset as u64,
            len,
        };
        // Each job's ranges, laid one after another in its buffer.
        let jobs: Vec<Vec<FileRange>> = vec![
            vec![range(5, 3 * 4096 + 17)],
            // Adjacent ranges sharing pages, then a range inside one page, an empty one.
            vec![
                range(3 * 4096 + 22, 10_000),
                range(3 * 4096 + 22 + 10_000, 70_001),
                range(100_000 + 10, 300),
                range(9, 0),
            ],
            // Shares a page with the job before it (in flight at the same time).
            vec![range(3 * 4096 + 22 + 80_001, 50_000)],
            vec![range(8192, 16 * 4096)],
            // Larger than a staging buffer, unaligned at both ends.
            vec![range(4096 * 300 + 1, STAGING_BYTES + (20 << 20) + 3)],
            // The same bytes twice in one job, and again in the next.
            vec![range(1 << 20, 1 << 20), range(1 << 20, 1 << 20)],
            vec![range((1 << 20) + 4095, (1 << 20) + 2)],
        ];
        for source in [Source::Mapped, Source::Staged] {
            let up = Uploader::start_from(&g, source).unwrap();
            let after = Arc::new(g.stream().record_event(None).unwrap());
            let mut want = Vec::new();
            for (id, src) in jobs.iter().enumerate() {
                let bytes: Vec<u8> = src
                    .iter()
                    .flat_map(|r| data[r.offset as usize..r.offset as usize + r.len].iter())
                    .copied()
                    .collect();
                let k = 64.min(bytes.len());
                let mut head = bytes[..k].to_vec();
                // Job 3's fingerprint is wrong: that job fails.
                if id == 3 {
                    head[0] ^= 1;
                }
                let dst = alloc_dst(&g, bytes.len().max(1), "test").unwrap();
                up.send(Job {
                    id: id as u64,
                    generation: 0,
                    what: format!("job {id}"),
                    src: src.clone(),
                    head,
                    tail: bytes[bytes.len() - k..].to_vec(),
                    dst,
                    after: after.clone(),
                })
                .map_err(|_| "send")
                .unwrap();
                want.push(bytes);
            }
            for _ in 0..jobs.len() {
                let d = up.recv().unwrap();
                let id = d.id as usize;
                match d.outcome {
                    Outcome::Ready(r) => {
                        assert_ne!(id, 3, "{source:?}: a wrong fingerprint was uploaded");
                        assert!(r.note().is_none(), "{source:?}: {:?}", r.note());
                        let buf = r.take(g.stream()).unwrap();
                        let mut host = vec![0u8; want[id].len()];
                        if !host.is_empty() {
                            g.stream()
                                .memcpy_dtoh(&buf.slice(0..host.len()), &mut host)
                                .unwrap();
                        }
                        assert!(
                            host == want[id],
                            "{source:?}: job {id} differs from the file"
                        );
                    }
                    Outcome::Failed(why) => {
                        assert_eq!(id, 3, "{source:?}: job {id} failed: {why}");
                        assert!(
                            why.contains("job 3") && why.contains("bytes.bin"),
                            "{source:?}: {why}"
                        );
                    }
                    Outcome::Cancelled => panic!("{source:?}: job {id} cancelled"),
                }
            }
        }
    }

    /// The CUDA candidate's chain run ahead of the pass to each layer's routing
    /// (`--candidate-ahead on`, its routed uploads started there) changes nothing a run reports
    /// but its times: the same exit and the same JSON less its timings, f32 and bf16, 16 tokens.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_candidate_ahead_changes_only_the_times() {
        for (what, runs) in cuda_runs_by_setting("--candidate-ahead", &[], &[]) {
            eprintln!("== {what}: exits {:?} {:?}", runs[0].0, runs[1].0);
            assert_eq!(runs[0].0, runs[1].0, "{what}");
            assert!(runs[0].1 == runs[1].1, "{what}: the runs' JSON differ");
        }
    }

    /// `run --against cuda` of 16 tokens on both quantized fixtures, f32 and bf16, with the
    /// global flag `flag` off then on (and `extra` after `run`): per model and dtype, each run's
    /// exit code, its JSON without its times, commands and `ignore`'s keys, and its notes.
    #[allow(clippy::type_complexity)]
    fn cuda_runs_by_setting(
        flag: &str,
        extra: &[&str],
        ignore: &[&str],
    ) -> Vec<(String, Vec<(Option<i32>, serde_json::Value, String)>)> {
        fn strip(v: &serde_json::Value, ignore: &[&str]) -> serde_json::Value {
            use serde_json::Value;
            const TIMES: [&str; 10] = [
                "timings",
                "layer_times",
                "compare_times",
                "reference_times",
                "candidate_times",
                "candidate_beyond_times",
                "reference_work",
                "command",
                "rerun",
                "repro",
            ];
            match v {
                Value::Object(m) => Value::Object(
                    m.iter()
                        .filter(|(k, _)| {
                            !TIMES.contains(&k.as_str()) && !ignore.contains(&k.as_str())
                        })
                        .map(|(k, v)| (k.clone(), strip(v, ignore)))
                        .collect(),
                ),
                Value::Array(a) => Value::Array(a.iter().map(|v| strip(v, ignore)).collect()),
                x => x.clone(),
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<String> = (0..16u32)
            .map(|i| ((i * 37 + 11) % 200).to_string())
            .collect();
        let tokens = tokens.join(",");
        let mut out = Vec::new();
        for m in [
            "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ] {
            let f = fixtures(m);
            for dtype in ["f32", "bf16"] {
                let mut got = Vec::new();
                for setting in ["off", "on"] {
                    let json = dir.path().join(format!("{setting}-{dtype}.json"));
                    let mut args = vec![flag, setting, "run", f.to_str().unwrap()];
                    args.extend_from_slice(extra);
                    args.extend_from_slice(&[
                        "--tokens",
                        &tokens,
                        "--against",
                        "cuda",
                        "--dtype",
                        dtype,
                        "--no-cache",
                        "--json",
                        json.to_str().unwrap(),
                    ]);
                    let o = glmdiff(&args);
                    let err = String::from_utf8_lossy(&o.stderr).into_owned();
                    let j: serde_json::Value = serde_json::from_slice(
                        &std::fs::read(&json)
                            .unwrap_or_else(|e| panic!("{m} {flag} {setting}: {e}: {err}")),
                    )
                    .unwrap();
                    let notes = j["notes"].to_string();
                    got.push((o.status.code(), strip(&j, ignore), notes));
                }
                out.push((format!("{m} {dtype}"), got));
            }
        }
        out
    }

    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_routed_expert_uploads_are_bit_identical() {
        use glmdiff::driver::{run, Plan};
        use glmdiff::engine::cuda::multi::MultiCudaEngine;
        use glmdiff::engine::cuda::ExpertUploads;
        use glmdiff::trace::{HookFilter, TraceSink};

        let gpus = [gpu(), gpu()];
        for m in [
            "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
        ] {
            let model = Model::open(&fixtures(m)).unwrap();
            let w = Weights::new(&model).unwrap();
            let plan = Plan::full(&w).unwrap();
            let n_vocab = w.n_vocab() as u32;
            for n in [2u32, 16] {
                let tokens: Vec<u32> = (0..n).map(|i| (i * 37 + 11) % n_vocab).collect();
                let one = |mode: ExpertUploads, prefetch: bool| {
                    let e = CudaEngine::new(&gpus[0], &w, GpuDtype::F32)
                        .unwrap()
                        .with_prefetch(prefetch)
                        .with_expert_uploads(mode);
                    let mut sink = TraceSink::new(HookFilter::default());
                    run(&e, &w, &tokens, &plan, &mut sink).unwrap();
                    (
                        sink.into_tensors(),
                        e.take_upload_stats(),
                        e.prefetch_summary(),
                    )
                };
                let (whole, up_whole, _) = one(ExpertUploads::Whole, true);
                assert!(whole.contains_key("logits") && whole.len() > 20, "{m}");
                for (mode, prefetch) in [
                    (ExpertUploads::Routed, true),
                    (ExpertUploads::Routed, false),
                    (ExpertUploads::Auto, true),
                ] {
                    let (got, up, pf) = one(mode, prefetch);
                    eprintln!(
                        "== {m}, {n} tokens, {mode:?}, prefetch {prefetch}: {up:?} {pf:?} (whole: {up_whole:?})"
                    );
                    let d = differing(&whole, &got);
                    assert!(d.is_empty(), "{m} {n} {mode:?} {prefetch}: changed {d:?}");
                    assert_eq!(pf.fallbacks, 0, "{m} {n} {mode:?}: {pf:?}");
                    if n == 2 && mode != ExpertUploads::Whole {
                        assert!(
                            up.bytes < up_whole.bytes,
                            "{m}: by expert {} bytes, whole {}",
                            up.bytes,
                            up_whole.bytes
                        );
                    }
                }
                let e = MultiCudaEngine::new(&gpus, &w, GpuDtype::F32).unwrap();
                let e = e.with_expert_uploads(ExpertUploads::Routed);
                let mut sink = TraceSink::new(HookFilter::default());
                run(&e, &w, &tokens, &plan, &mut sink).unwrap();
                let d = differing(&whole, &sink.into_tensors());
                assert!(d.is_empty(), "{m} {n}: two devices by expert changed {d:?}");
            }
        }
    }

    /// Prefetch changes where the bytes come from, not the results: every hook of a chained
    /// run of the whole model (the CUDA engine on one device, and as a two-device run on the
    /// one GPU) is bit-identical with prefetch on and off (and off twice, so a difference is
    /// prefetch's, not the engine's own nondeterminism); with prefetch on, the later layers'
    /// raw tensors come from the prefetch with no fallback, and the engine counts weight bytes
    /// both ways. Then `run --json` reports `upload_s` and `upload_bytes` for every layer, with
    /// prefetch on and with `GLMDIFF_NO_PREFETCH=1` (whose note says so).
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_prefetch_is_bit_identical_and_timed() {
        use glmdiff::driver::{run, Plan};
        use glmdiff::engine::cuda::multi::MultiCudaEngine;
        use glmdiff::trace::{HookFilter, TraceSink};

        let gpus = [gpu(), gpu()];
        for m in [
            "models/glm5-tiny-q/glm5-tiny-q-mixed.gguf",
            "models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf",
            "models/glm5-tiny/glm5-tiny-f16.gguf",
        ] {
            let model = Model::open(&fixtures(m)).unwrap();
            let w = Weights::new(&model).unwrap();
            let plan = Plan::full(&w).unwrap();
            let n_vocab = w.n_vocab() as u32;
            let tokens: Vec<u32> = (0..16u32).map(|i| (i * 37 + 11) % n_vocab).collect();
            let hooks = |e: &dyn Fn(&mut TraceSink) -> glmdiff::engine::UploadStats| {
                let mut sink = TraceSink::new(HookFilter::default());
                let up = e(&mut sink);
                (sink.into_tensors(), up)
            };
            // One device.
            let one = |on: bool| {
                let e = CudaEngine::new(&gpus[0], &w, GpuDtype::F32)
                    .unwrap()
                    .with_prefetch(on);
                let (t, up) = hooks(&|sink: &mut TraceSink| {
                    run(&e, &w, &tokens, &plan, sink).unwrap();
                    e.take_upload_stats()
                });
                (t, up, e.prefetch_summary())
            };
            let (off, up_off, pf_off) = one(false);
            let (off2, _, _) = one(false);
            let (on, up_on, pf_on) = one(true);
            eprintln!(
                "== {m}: {} hooks; off: {up_off:?} {pf_off:?}; on: {up_on:?} {pf_on:?}",
                off.len()
            );
            assert!(off.contains_key("logits") && off.len() > 20, "{m}");
            let d = differing(&off, &off2);
            assert!(d.is_empty(), "{m}: the engine differs from itself: {d:?}");
            let d = differing(&off, &on);
            assert!(d.is_empty(), "{m}: prefetch changed {d:?}");
            assert!(!pf_off.on && pf_off.tensors == 0, "{m}: {pf_off:?}");
            assert!(
                pf_on.on && pf_on.tensors > 0 && pf_on.bytes > 0,
                "{m}: {pf_on:?}"
            );
            assert_eq!(pf_on.fallbacks, 0, "{m}: {pf_on:?}");
            assert!(up_off.bytes > 0 && up_on.bytes > 0, "{m}");
            // Two engines on the GPU, layers split between them.
            let two = |on: bool| {
                let e = MultiCudaEngine::new(&gpus, &w, GpuDtype::F32)
                    .unwrap()
                    .with_prefetch(on);
                let (t, _) = hooks(&|sink: &mut TraceSink| {
                    run(&e, &w, &tokens, &plan, sink).unwrap();
                    e.take_upload_stats()
                });
                (t, e.prefetch_summary())
            };
            let (two_off, _) = two(false);
            let (two_on, pf_two) = two(true);
            eprintln!("   two devices, on: {pf_two:?}");
            let d = differing(&two_off, &two_on);
            assert!(d.is_empty(), "{m}: prefetch changed {d:?} on two devices");
            assert_eq!(pf_two.fallbacks, 0, "{m}: {pf_two:?}");
        }

        // The CLI: the per-layer figures in the JSON, on and off.
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("r.json");
        let f = fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf");
        for off in [false, true] {
            let mut c = std::process::Command::new(crate::common::glmdiff_bin());
            c.args([
                "run",
                f.to_str().unwrap(),
                "--prompt",
                "The capital of France is Paris, and the capital of Italy is",
                "--against",
                "cuda",
                "--no-cache",
                "--json",
                json.to_str().unwrap(),
            ]);
            if off {
                c.env("GLMDIFF_NO_PREFETCH", "1");
            } else {
                c.env_remove("GLMDIFF_NO_PREFETCH");
            }
            let (rc, j, text) = crate::common::outcome(c.output().expect("run glmdiff"), &json);
            eprintln!("== run, prefetch off: {off}: exit {rc}\n{text}");
            assert_eq!(rc, 0, "{text}");
            let times = j["layer_times"].as_array().expect("layer_times");
            let layers: Vec<&serde_json::Value> =
                times.iter().filter(|t| !t["layer"].is_null()).collect();
            assert_eq!(layers.len(), 2, "{text}");
            for t in &layers {
                let up = t["upload_s"].as_f64().expect("upload_s");
                let total = t["chained_s"].as_f64().unwrap() + t["replay_s"].as_f64().unwrap();
                assert!(up >= 0.0 && up <= total, "{t}");
                assert!(t["upload_bytes"].as_u64().expect("upload_bytes") > 0, "{t}");
            }
            assert!(text.contains("candidate weight uploads"), "{text}");
            let notes = j["notes"].to_string();
            assert_eq!(notes.contains("prefetch off"), off, "{notes}");
            assert!(!notes.contains("uploaded on demand instead"), "{notes}");
        }
    }

    /// The CLI on one device and on two (`--devices 0,0`), pinned and with
    /// `GLMDIFF_DCHECK_PAGEABLE=1`: the same verdicts, the staging named, the rates measured,
    /// the projections of the model at hand (only part of it checked) and of `--project glm5`.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_dcheck_cli_staging_rates_and_projections() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("d.json");
        let f = fixtures("quant/split/all_types-00002-of-00003.gguf");
        let mut verdicts = Vec::new();
        for devices in ["0", "0,0"] {
            for pageable in [false, true] {
                let mut c = std::process::Command::new(crate::common::glmdiff_bin());
                c.args([
                    "dequant-check",
                    f.to_str().unwrap(),
                    "--tensors",
                    "q*",
                    "--devices",
                    devices,
                    "--project",
                    "glm5",
                    "--json",
                    json.to_str().unwrap(),
                ]);
                if pageable {
                    c.env("GLMDIFF_DCHECK_PAGEABLE", "1");
                } else {
                    c.env_remove("GLMDIFF_DCHECK_PAGEABLE");
                }
                let (rc, j, text) = crate::common::outcome(c.output().expect("run glmdiff"), &json);
                eprintln!("== --devices {devices}, pageable {pageable}: exit {rc}\n{text}");
                assert_eq!(rc, 0, "{text}");
                let staging = j["staging"].as_str().unwrap();
                assert!(
                    staging.starts_with(if pageable { "pageable" } else { "pinned" }),
                    "{staging}"
                );
                assert_eq!(
                    j["per_device"].as_array().unwrap().len(),
                    devices.split(',').count()
                );
                let r = &j["rates"];
                assert!(r["cpu_values_s"].as_f64().unwrap() > 0.0, "{r}");
                assert_eq!(r["read_bytes_s"].is_null(), pageable, "{r}");
                let names: Vec<&str> = j["projections"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["name"].as_str().unwrap())
                    .collect();
                assert_eq!(names.len(), 2, "{names:?}");
                assert_eq!(names[1], "GLM-5 UD-Q4_K_XL");
                assert!(text.contains("projection: at these rates"), "{text}");
                let v: Vec<(String, u64)> = j["tensors"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| {
                        (
                            t["name"].as_str().unwrap().to_string(),
                            t["mismatches"].as_u64().unwrap(),
                        )
                    })
                    .collect();
                assert!(!v.is_empty() && v.iter().all(|x| x.1 == 0), "{v:?}");
                verdicts.push(v);
            }
        }
        assert!(verdicts.windows(2).all(|w| w[0] == w[1]), "{verdicts:?}");
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

    /// A prompt past the 6144 tokens whose scores fit the default 48 KiB of shared memory a
    /// block: the CUDA attention opts in to more, and a correct engine (f32 and bf16, DSA
    /// active: the tiny model keeps 8 keys) passes against the reference at 7000 tokens.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_attention_past_6144_tokens() {
        // The fixture with its context length (4096) raised to 8192, written here.
        let mut bytes =
            std::fs::read(fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf")).unwrap();
        let key = b"glm-dsa.context_length";
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        assert_eq!(
            bytes[at..at + 8],
            [4, 0, 0, 0, 0, 16, 0, 0],
            "a u32 of 4096"
        );
        bytes[at + 4..at + 8].copy_from_slice(&8192u32.to_le_bytes());
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("glm5-tiny-q-8k.gguf");
        std::fs::write(&m, bytes).unwrap();
        let tokens: Vec<String> = (0..7000u32)
            .map(|i| ((i * 37 + 11) % 400).to_string())
            .collect();
        let tokens = tokens.join(",");
        for dtype in ["f32", "bf16"] {
            let o = glmdiff(&[
                "run",
                m.to_str().unwrap(),
                "--tokens",
                &tokens,
                "--against",
                "cuda",
                "--dtype",
                dtype,
                "--layer",
                "0",
                "--no-cache",
            ]);
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert_eq!(
                o.status.code(),
                Some(0),
                "{dtype}: {}{err}",
                out.lines().rev().take(30).collect::<Vec<_>>().join("\n")
            );
            assert!(out.contains("OK: "), "{dtype}: {out}");
        }
    }

    /// The CUDA engine's causal top-k against the CPU's, element for element: rows sorted in
    /// shared memory (up to 2^14 keys) and the one-thread-a-row passes past them, with ties,
    /// infinities and NaNs, k below, at and above a row's length.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_top_k_is_the_cpus() {
        let m = Model::open(&fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf")).unwrap();
        let w = Weights::new(&m).unwrap();
        let cpu = CpuEngine::new(&w);
        let g = gpu();
        let cuda = CudaEngine::new(&g, &w, GpuDtype::F32).unwrap();
        let mut rng = SplitMix64::new(41);
        for (t, k) in [
            (1, 4),
            (5, 3),
            (300, 64),
            (2100, 2048),
            (4096, 2048),
            (7000, 2048),
            (16385, 16),
        ] {
            // Few distinct values (ties everywhere), a few infinities and NaNs.
            let v: Vec<f32> = (0..t * t)
                .map(|i| match rng.next_u64() % 97 {
                    0 => f32::INFINITY,
                    1 => f32::NEG_INFINITY,
                    2 => f32::NAN,
                    3 => -0.0,
                    _ => ((rng.next_u64() % 64) as f32 - 32.0) * 0.25 + (i % 3) as f32,
                })
                .collect();
            let scores = HostTensor::f32(vec![t, t], v).unwrap();
            let want = cpu.top_k(&scores, k).unwrap();
            let up = cuda.upload(&scores).unwrap();
            let got = cuda.download(&cuda.top_k(&up, k).unwrap()).unwrap();
            assert_eq!(got.shape, want.shape, "t {t} k {k}");
            let (a, b) = (got.as_i32("gpu").unwrap(), want.as_i32("cpu").unwrap());
            if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
                let width = want.shape[1];
                panic!(
                    "t {t} k {k}: row {} slot {}: gpu {} cpu {}",
                    i / width,
                    i % width,
                    a[i],
                    b[i]
                );
            }
        }
    }

    /// `bench run --against cuda` on the quantized fixtures (f32 and bf16): the copy floors of
    /// every layer timed are there, from pinned and from pageable memory, each of the layer's
    /// bytes (its tensors, computed here from their dimensions and block table); every row
    /// carries them with the upload / copy quotient; the CUDA engine took weights into use.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_bench_run_has_copy_floors() {
        for (m, dtype) in [
            ("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf", "f32"),
            ("models/dsv3-tiny-q/dsv3-tiny-q-mixed.gguf", "bf16"),
        ] {
            let f = fixtures(m);
            let o = glmdiff(&[
                "bench",
                "run",
                "--model",
                f.to_str().unwrap(),
                "--tokens",
                "4,16",
                "--against",
                "cuda",
                "--dtype",
                dtype,
                "--reps",
                "2",
                "--json",
            ]);
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert_eq!(o.status.code(), Some(0), "{m}: {err}");
            let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            eprintln!("== {m}: {}", j["copies"]);
            assert_eq!(j["settings"]["candidate"], serde_json::json!({ "cuda": 0 }));
            assert_eq!(j["settings"]["dtype"], dtype);
            let copies = &j["copies"];
            assert!(
                copies["device"].as_str().unwrap().starts_with("cuda:0"),
                "{copies}"
            );
            let model = Model::open(&f).unwrap();
            let start = j["layer_start"].as_u64().unwrap() as usize;
            let floors = copies["layers"].as_array().unwrap();
            assert_eq!(
                floors.len() as u64,
                j["layer_end"].as_u64().unwrap() - start as u64
            );
            for (i, c) in floors.iter().enumerate() {
                let l = start + i;
                let prefix = format!("blk.{l}.");
                let want: u64 = model
                    .tensors()
                    .filter(|t| t.info.name.starts_with(&prefix))
                    .map(|t| {
                        let n: u64 = t.info.ne.iter().product();
                        n / t.info.ty.block_size() as u64 * t.info.ty.type_size() as u64
                    })
                    .sum();
                assert_eq!(c["layer"].as_u64(), Some(l as u64));
                assert_eq!(c["bytes"].as_u64(), Some(want), "{m} layer {l}");
                let (pinned, pageable) = (
                    c["pinned_s"].as_f64().unwrap(),
                    c["pageable_s"].as_f64().unwrap(),
                );
                assert!(pinned > 0.0 && pageable > 0.0, "{c}");
                let gbps = want as f64 / pinned / 1e9;
                assert!((c["pinned_gbps"].as_f64().unwrap() - gbps).abs() <= 1e-9 * gbps);
            }
            let mut uploaded = 0;
            for run in j["runs"].as_array().unwrap() {
                for (row, c) in run["layers"].as_array().unwrap().iter().zip(floors) {
                    assert_eq!(row["copy_pinned_s"], c["pinned_s"]);
                    assert_eq!(row["copy_pageable_s"], c["pageable_s"]);
                    let up = row["upload_s"].as_f64().unwrap();
                    let q = up / c["pinned_s"].as_f64().unwrap();
                    let r = row["ratios"]["upload_over_copy"].as_f64().unwrap();
                    assert!((r - q).abs() <= 1e-12 * q.max(1e-300), "{row}");
                    uploaded += row["upload_bytes"].as_u64().unwrap();
                }
            }
            assert!(uploaded > 0, "{m}: no weight bytes taken into use");
        }
    }

    /// f32 values of mixed signs over 2^-40 .. 2^20 with a few large opposite pairs, so that
    /// partial sums cancel and any other order of the adds shows in the f32 result.
    /// The first element whose bits differ between `want` and `got`.
    fn first_bit_difference(want: &[f32], got: &[f32]) -> Option<usize> {
        want.iter()
            .zip(got)
            .position(|(a, b)| a.to_bits() != b.to_bits())
    }

    fn mixed(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = rng.next_u64();
                let sign = if u & 1 == 1 { -1.0f32 } else { 1.0 };
                let m = 1.0 + ((u >> 8) & 0xff_ffff) as f32 / (1 << 24) as f32;
                let e = if (u >> 1) % 13 == 0 {
                    20
                } else {
                    ((u >> 40) % 60) as i32 - 40
                };
                sign * m * 2f32.powi(e)
            })
            .collect()
    }

    /// The reference's products made on the device equal the CPU's (`math::matmul`, every
    /// element `dot`) bit for bit: f32 weights over token, row and column counts around the
    /// kernel's tiles (32 x 32, 64 columns a chunk, 8 lanes), and the raw blocks of quantized
    /// types dequantized on the device, against the CPU's dequantization and products.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_products_are_the_cpus_bits() {
        use glmdiff::engine::cpu::math::matmul;
        use glmdiff::engine::cpu::Matrix;
        use glmdiff::gpu::reference::KERNELS;
        use glmdiff::gpu::reference::{ReferenceProducts, Weights as W};
        for (k, kernel) in KERNELS.iter().enumerate() {
            let p = ReferenceProducts::open(0).unwrap().with_kernel(k);
            eprintln!("{} {:?}", p.describe(), p.kernel_rates());
            let mut rng = SplitMix64::new(41);
            let mut n = 0;
            // One product of f32 weights against the CPU's.
            let mut dense = |t: usize, rows: usize, cols: usize| {
                let x = mixed(&mut rng, t * cols);
                let w = Matrix {
                    rows,
                    cols,
                    data: mixed(&mut rng, rows * cols),
                };
                let want = matmul(&x, t, &w);
                let got = p
                    .products(&x, t, W::Dense(&w.data), rows, cols)
                    .unwrap()
                    .unwrap();
                let bad = first_bit_difference(&want, &got);
                assert!(
                    bad.is_none(),
                    "t {t} rows {rows} cols {cols}: element {bad:?}"
                );
                n += 1;
            };
            for &t in &[1usize, 31, 64, 97, 130] {
                for &rows in &[1usize, 33, 100] {
                    for &cols in &[1usize, 7, 8, 63, 65, 300, 1030] {
                        dense(t, rows, cols);
                    }
                }
            }
            // Past one staging buffer (32 MiB of input) and past one chunk of dequantized weights
            // (2^26 values: the rows go in two chunks, the second written from column r0 > 0).
            dense(2100, 40, 4096);
            dense(40, 17_000, 4096);
            // Quantized rows: random valid blocks of each type, dequantized on the device.
            for ty in [
                GgmlType::Q4_K,
                GgmlType::Q6_K,
                GgmlType::Q8_0,
                GgmlType::IQ4_XS,
                GgmlType::BF16,
            ] {
                let (rows, cols, t) = (70usize, 512usize, 80usize);
                let bytes_n = rows * cols / ty.block_size() * ty.type_size();
                let mut bytes = vec![0u8; bytes_n];
                fill_blocks(ty, &mut SplitMix64::new(7), &mut bytes);
                let mut data = vec![0f32; rows * cols];
                dequantize_par(ty, &bytes, &mut data).unwrap();
                let x = mixed(&mut rng, t * cols);
                let want = matmul(&x, t, &Matrix { rows, cols, data });
                let got = p
                    .products(&x, t, W::Raw { ty, bytes: &bytes }, rows, cols)
                    .unwrap()
                    .unwrap();
                let bad = first_bit_difference(&want, &got);
                assert!(bad.is_none(), "{ty}: element {bad:?}");
                n += 1;
            }
            eprintln!("{}: {n} products bit-exact", kernel.0);
        }
    }

    /// Products packed in pinned parcels by their threads and queued during their turn
    /// (`gpu::parcels`, `ReferenceProducts::submit`) equal the CPU's bit for bit: f32 and raw
    /// quantized weights, several queued before the first is waited for (each one's output
    /// copied back before the next overwrites the device's buffers), 48 asked from the threads
    /// at once under one lock as the reference asks them; a raw weight that dequantizes to
    /// infinity gives none (the CPU names it).
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_packed_products_are_the_cpus_bits() {
        use glmdiff::engine::cpu::math::matmul;
        use glmdiff::engine::cpu::Matrix;
        use glmdiff::gpu::reference::{ReferenceProducts, Weights as W};
        use rayon::prelude::*;
        /// One product: its input, tokens, weights (raw blocks or f32), rows, columns and the
        /// CPU's output.
        struct Case {
            x: Vec<f32>,
            t: usize,
            raw: Option<(GgmlType, Vec<u8>)>,
            dense: Vec<f32>,
            rows: usize,
            cols: usize,
            want: Vec<f32>,
        }
        fn weights(c: &Case) -> W<'_> {
            match &c.raw {
                Some((ty, bytes)) => W::Raw { ty: *ty, bytes },
                None => W::Dense(&c.dense),
            }
        }
        let p = ReferenceProducts::open(0).unwrap();
        let parcels = p.parcels();
        let mut rng = SplitMix64::new(43);
        let mut cases = Vec::new();
        for &(t, rows, cols) in &[
            (32usize, 70usize, 512usize),
            (97, 33, 300),
            (130, 100, 1030),
        ] {
            let x = mixed(&mut rng, t * cols);
            let dense = mixed(&mut rng, rows * cols);
            let want = matmul(
                &x,
                t,
                &Matrix {
                    rows,
                    cols,
                    data: dense.clone(),
                },
            );
            cases.push(Case {
                x,
                t,
                raw: None,
                dense,
                rows,
                cols,
                want,
            });
        }
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
            GgmlType::BF16,
        ] {
            let (rows, cols, t) = (96usize, 768usize, 40usize);
            let mut bytes = vec![0u8; rows * cols / ty.block_size() * ty.type_size()];
            fill_blocks(ty, &mut SplitMix64::new(9), &mut bytes);
            let mut data = vec![0f32; rows * cols];
            dequantize_par(ty, &bytes, &mut data).unwrap();
            let x = mixed(&mut rng, t * cols);
            let want = matmul(&x, t, &Matrix { rows, cols, data });
            cases.push(Case {
                x,
                t,
                raw: Some((ty, bytes)),
                dense: Vec::new(),
                rows,
                cols,
                want,
            });
        }
        // All queued, then all waited for, in order.
        let mut sent = Vec::new();
        for c in &cases {
            let mut parcel = parcels
                .pack(&c.x, c.t, &weights(c), c.rows, c.cols)
                .unwrap()
                .unwrap();
            let s = p.submit(&mut parcel).unwrap();
            sent.push((parcel, s));
        }
        for (i, ((mut parcel, s), c)) in sent.into_iter().zip(&cases).enumerate() {
            let (got, secs) = s.wait(&mut parcel).unwrap();
            let got = got.unwrap();
            assert!(secs > 0.0);
            let bad = first_bit_difference(&c.want, &got);
            assert!(bad.is_none(), "case {i}: element {bad:?}");
            parcels.give(parcel);
        }
        // From the threads, each packing its own before its turn.
        let turn = std::sync::Mutex::new(());
        (0..48).into_par_iter().for_each(|i| {
            let c = &cases[i % cases.len()];
            let mut parcel = parcels
                .pack(&c.x, c.t, &weights(c), c.rows, c.cols)
                .unwrap()
                .unwrap();
            let s = {
                let _turn = turn.lock().unwrap();
                p.submit(&mut parcel).unwrap()
            };
            let (got, _) = s.wait(&mut parcel).unwrap();
            let bad = first_bit_difference(&c.want, &got.unwrap());
            assert!(bad.is_none(), "product {i}: element {bad:?}");
            parcels.give(parcel);
        });
        // A BF16 weight of +inf (0x7f80): no product.
        let (rows, cols, t) = (4usize, 64usize, 8usize);
        let mut bytes = vec![0u8; rows * cols * 2];
        bytes[2 * 70..2 * 70 + 2].copy_from_slice(&0x7f80u16.to_le_bytes());
        let x = mixed(&mut rng, t * cols);
        let mut parcel = parcels
            .pack(
                &x,
                t,
                &W::Raw {
                    ty: GgmlType::BF16,
                    bytes: &bytes,
                },
                rows,
                cols,
            )
            .unwrap()
            .unwrap();
        let s = p.submit(&mut parcel).unwrap();
        assert!(s.wait(&mut parcel).unwrap().0.is_none());
        // Too large for a parcel: left to the staging path.
        let big = vec![0f32; 4096 * 4096];
        assert!(parcels
            .pack(&big, 4096, &W::Dense(&big), 4096, 4096)
            .unwrap()
            .is_none());
    }

    /// The reference's MLA attention with its scores and weighted sums on the device equals the
    /// CPU's bit for bit: causal and with DSA selections (ragged, repeated and out-of-range ids),
    /// all rows and a subset, values over a wide range, an infinite V value (the CPU's rows one
    /// at a time).
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_attention_is_the_cpus() {
        use glmdiff::engine::cpu::device::Device;
        use glmdiff::engine::cpu::mla_host_kv;
        let m = Model::open(&fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf")).unwrap();
        let w = Weights::new(&m).unwrap();
        let hp = w.hparams().clone();
        let dev = Device::open(0, true).unwrap();
        let mut rng = SplitMix64::new(77);
        let (h, nope, rd, v) = (hp.n_head, hp.qk_nope, hp.qk_rope, hp.v_head);
        let mut n = 0;
        for &t in &[40usize, 300, 1500] {
            let q_b = rand_t(&mut rng, vec![t, h * (nope + rd)], 1.0);
            let q_pe = rand_t(&mut rng, vec![t, h, rd], 1.0);
            let kv_norm = rand_t(&mut rng, vec![t, hp.kv_lora_rank], 1.0);
            let k_pe = rand_t(&mut rng, vec![t, rd], 3.0);
            let mut kv: Vec<f32> = mixed(&mut rng, t * h * (nope + v));
            let k = 17usize.min(t);
            let sel: Vec<i32> = (0..t * k)
                .map(|i| {
                    let row = (i / k) as u64;
                    match rng.next_u64() % 11 {
                        0 => -1,
                        1 => (row + 3) as i32,
                        _ => (rng.next_u64() % (row + 1)) as i32,
                    }
                })
                .collect();
            let sel = HostTensor::i32(vec![t, k], sel).unwrap();
            for (label, selection, rows) in [
                ("causal", None, None),
                ("selection", Some(&sel), None),
                (
                    "selection, rows",
                    Some(&sel),
                    Some((0..t).filter(|r| r % 3 != 1).collect::<Vec<_>>()),
                ),
            ] {
                for poison in [false, true] {
                    let at = (t / 2) * h * (nope + v) + nope + 1;
                    let kept = kv[at];
                    if poison {
                        kv[at] = f32::INFINITY;
                    }
                    let x = || MlaInputs {
                        q_b: &q_b,
                        q_pe: &q_pe,
                        kv_norm: &kv_norm,
                        k_pe: &k_pe,
                        selection,
                    };
                    let cpu = mla_host_kv(&hp, 0, x(), &kv, 0.07, rows.as_deref(), None).unwrap();
                    let gpu =
                        mla_host_kv(&hp, 0, x(), &kv, 0.07, rows.as_deref(), Some(&dev)).unwrap();
                    kv[at] = kept;
                    let (a, b) = (cpu.as_f32("cpu").unwrap(), gpu.as_f32("gpu").unwrap());
                    let bad = a.iter().zip(b).position(|(x, y)| {
                        x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan())
                    });
                    assert!(
                        bad.is_none(),
                        "t {t} {label} poison {poison}: element {bad:?}"
                    );
                    n += 1;
                }
            }
        }
        let work = dev.work();
        assert!(work.attentions >= 12, "{work:?}");
        eprintln!(
            "{n} attentions bit-exact, {} on the device",
            work.attentions
        );
    }

    /// The DSA index scores made on the device equal the CPU's bit for bit: GLM-5's indexer
    /// widths (32 heads of 128) and a narrow odd one, with and without the ReLU, a NaN query
    /// value and an infinite key value.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_index_scores_are_the_cpus() {
        use glmdiff::engine::cpu::device::Device;
        use glmdiff::engine::cpu::index_scores_on;
        let dev = Device::open(0, true).unwrap();
        let mut rng = SplitMix64::new(79);
        let mut n = 0;
        for &(t, ni, di) in &[(40usize, 3usize, 37usize), (700, 32, 128), (2100, 32, 128)] {
            let mut q = mixed(&mut rng, t * ni * di);
            let mut k = mixed(&mut rng, t * di);
            let hw: Vec<f32> = mixed(&mut rng, t * ni);
            q[(t / 2) * ni * di + 5] = f32::NAN;
            k[(t / 3) * di + 2] = f32::INFINITY;
            for relu in [true, false] {
                let scale = 1.0 / ((ni * di) as f64).sqrt();
                let cpu = index_scores_on(&q, &k, &hw, (t, ni, di), scale, relu, None).unwrap();
                let gpu =
                    index_scores_on(&q, &k, &hw, (t, ni, di), scale, relu, Some(&dev)).unwrap();
                let bad = cpu
                    .iter()
                    .zip(&gpu)
                    .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()));
                assert!(
                    bad.is_none(),
                    "t {t} heads {ni} width {di} relu {relu}: element {bad:?}: {:?} against {:?}",
                    bad.map(|i| gpu[i]),
                    bad.map(|i| cpu[i])
                );
                n += 1;
            }
        }
        let work = dev.work();
        assert_eq!(work.index_scores, n, "{work:?}");
        eprintln!("{n} index score sets bit-exact on the device");
    }

    /// `run` with the reference's products on the device gives the same records as with them
    /// on the CPU (80 tokens: every projection of the tiny model is made there), and says so.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_on_the_device_gives_the_same_run() {
        let f = fixtures("models/glm5-tiny/glm5-tiny-f32.gguf");
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<String> = (0..80).map(|i| ((i * 37 + 5) % 200).to_string()).collect();
        let tokens = tokens.join(",");
        let mut records = Vec::new();
        for on in ["cpu", "cuda:0"] {
            let out = dir.path().join(format!("{on}.json").replace(':', "_"));
            let o = glmdiff(&[
                "run",
                f.to_str().unwrap(),
                "--tokens",
                &tokens,
                "--against",
                "cpu",
                "--reference-on",
                on,
                "--no-cache",
                "--json",
                out.to_str().unwrap(),
            ]);
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert_eq!(o.status.code(), Some(0), "{on}: {err}");
            let j: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
            let notes = j["notes"].to_string();
            assert_eq!(
                notes.contains("ran on cuda:0"),
                on != "cpu",
                "{on}: {notes}"
            );
            assert_eq!(
                notes.contains(" attentions of "),
                on != "cpu",
                "{on}: {notes}"
            );
            assert_eq!(
                notes.contains(" DSA index score sets "),
                on != "cpu",
                "{on}: {notes}"
            );
            assert!(
                on == "cpu" || !notes.contains("(0 of them packed"),
                "the products are packed by their threads: {notes}"
            );
            records.push(j["records"].clone());
        }
        assert!(records[0].as_array().is_some_and(|r| !r.is_empty()));
        assert_eq!(records[0], records[1]);
    }

    /// `gpu::resident`'s hash on the device is the host's over any span of bytes (lengths not a
    /// multiple of 4, unaligned starts), and one flipped bit changes it.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_resident_bytes_hash_as_on_the_host() {
        use glmdiff::gpu::resident::hash_bytes_host;
        let _ = NEEDS;
        let g = gpu();
        let mut rng = SplitMix64::new(31);
        let bytes: Vec<u8> = (0..1_000_003)
            .map(|_| (rng.next_u64() >> 56) as u8)
            .collect();
        let d = g.alloc_copy(&bytes, "bytes").unwrap();
        for (at, len) in [
            (0usize, 0usize),
            (0, 1),
            (1, 7),
            (2, 4),
            (3, 4099),
            (0, 1_000_003),
            (5, 999_990),
        ] {
            let got = g.hash_bytes(&d.slice(at..at + len), 7).unwrap();
            assert_eq!(got, hash_bytes_host(&bytes[at..at + len], 7), "{at} {len}");
        }
        let mut flipped = bytes.clone();
        flipped[500_001] ^= 0x20;
        let f = g.alloc_copy(&flipped, "flipped").unwrap();
        assert_ne!(
            g.hash_bytes(&f.as_view(), 0).unwrap(),
            hash_bytes_host(&bytes, 0)
        );
    }

    /// The reference's products made from device bytes offered for an expert's rows
    /// (`--reference-reuse`) are the CPU's bits; bytes that differ from the file (one flipped bit
    /// in each of an expert's three tensors, planted here) are refused by their hash, named, and
    /// those products made on the CPU from the file.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_reuses_only_the_files_bytes() {
        use glmdiff::engine::cpu::device::Device;
        use glmdiff::engine::cpu::math::Rows;
        use glmdiff::gpu::resident::{self, FileSpan, OnDevice};
        use std::sync::Arc;
        let g = gpu();
        let model = Model::open(&fixtures("models/glm5-tiny-q/glm5-tiny-q-mixed.gguf")).unwrap();
        let w = Weights::new(&model).unwrap();
        let hp = w.hparams();
        let layer = hp.n_dense;
        let cpu = CpuEngine::new(&w);
        let dev = CpuEngine::new(&w).with_device(Arc::new(Device::open(0, false).unwrap()));
        resident::set_reuse(true);
        let mut rng = SplitMix64::new(3);
        let xs: Vec<f32> = (0..2 * hp.hidden).map(|_| rng.uniform() - 0.5).collect();
        let mut offered = 0u64;
        for (e, flip) in [(0usize, false), (1, true)] {
            for r in cpu.expert_rows(layer, e).unwrap().iter() {
                let Rows::Source(src) = r else {
                    panic!("expert {e}: rows not from the file")
                };
                let (path, offset, len) = src.file_range().unwrap().unwrap();
                let mut b = src.raw().unwrap().1.to_vec();
                if flip {
                    b[len as usize / 2] ^= 0x04;
                } else {
                    offered += len;
                }
                // The span at an odd place of a larger buffer, as in a group of experts.
                let mut padded = vec![0xa5u8; 36];
                padded.extend_from_slice(&b);
                let buf = Arc::new(g.alloc_copy(&padded, "offered").unwrap());
                let span = FileSpan {
                    path: path.to_path_buf(),
                    offset,
                    len,
                };
                resident::offer(
                    layer,
                    span,
                    OnDevice {
                        ordinal: 0,
                        buf,
                        at: 36,
                    },
                );
            }
            for n in [1usize, 2] {
                let want = cpu
                    .expert_output(&cpu.expert_rows(layer, e).unwrap(), &xs[..n * hp.hidden], n)
                    .unwrap();
                let got = dev
                    .expert_output(&dev.expert_rows(layer, e).unwrap(), &xs[..n * hp.hidden], n)
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "expert {e}, {n} tokens");
            }
        }
        resident::keep_around(usize::MAX - 5);
        resident::set_reuse(false);
        let d = dev.device().unwrap();
        let work = d.work();
        eprintln!("{work:?}; {:?}", d.refusal());
        assert_eq!(work.reused, 6, "{work:?}");
        assert_eq!(work.reused_bytes, offered, "{work:?}");
        assert_eq!(work.refused, 3, "{work:?}");
        assert!(d.set_aside().is_none(), "{:?}", d.set_aside());
        let why = d.refusal().unwrap();
        assert!(
            why.contains(&format!("blk.{layer}.ffn_")) && why.contains("hash"),
            "{why}"
        );
    }

    /// `run --reference-reuse on` gives the run of `off` (records, verdicts, exit) against a
    /// CUDA candidate that uploads its routed experts, f32 and bf16, with no span refused; `off`
    /// makes no product from the candidate's bytes. Both with `--register-pause 50`.
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu-test.sh runs it"]
    fn gpu_reference_reuse_changes_only_the_times() {
        // With the upload thread sleeping after each registration too (`--register-pause`, which
        // every other GPU test leaves at 0).
        let extra = ["--expert-uploads", "routed", "--register-pause", "50"];
        for (what, runs) in cuda_runs_by_setting("--reference-reuse", &extra, &["notes"]) {
            for (setting, (exit, _, notes)) in ["off", "on"].iter().zip(&runs) {
                eprintln!("== {what} reuse {setting}: exit {exit:?}; {notes}");
                // Whether the reference met an offer before making a product on the CPU
                // depends on the timing (a tiny model's experts take microseconds there);
                // `gpu_reference_reuses_only_the_files_bytes` makes them deterministically.
                if *setting == "off" {
                    assert!(!notes.contains("device bytes"), "{what}: {notes}");
                }
                assert!(!notes.contains("differed from the file"), "{notes}");
            }
            assert_eq!(runs[0].0, runs[1].0, "{what}");
            assert!(matches!(runs[0].0, Some(0 | 1)), "{what}: {:?}", runs[0].0);
            assert!(runs[0].1 == runs[1].1, "{what}: the runs' JSON differ");
        }
    }
}
