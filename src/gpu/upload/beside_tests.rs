//! How long a small piece of device work waits beside another stream's bulk uploads: a probe
//! for the GPU machine, where the reference's device products (a few KiB in and out each) ran
//! beside the CUDA candidate's uploads of its routed experts.

use super::*;
use crate::gpu::REFERENCE_SOURCE;
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use std::time::Instant;

/// Milliseconds of the small operations `op` runs `n` times, one after another, each waited
/// for: the first, the median and the largest.
fn latencies(n: usize, mut op: impl FnMut()) -> (f64, f64, f64) {
    let mut ms: Vec<f64> = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            op();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let first = ms[0];
    ms.sort_by(f64::total_cmp);
    (first, ms[n / 2], ms[n - 1])
}

/// On a stream of its own (as the reference's products), three small operations, each waited
/// for: a 64 KiB copy to the device from pinned memory, a kernel alone, and the same 64 KiB
/// moved by a kernel from pinned memory mapped into the device's address space
/// (`reference_copy_words`); with nothing else on the device, behind 6 GiB of copies from pinned
/// memory queued on another stream (in 8 MiB copies: the first operation waits for what was
/// queued before it when copies from both streams share one queue), and beside an uploader that
/// registers and copies 768 MiB of a mapped file as the routed uploads do (jobs of 16 ranges that
/// share no page; the file written first, in the temporary directory),
/// as it does by default and sleeping 50 us after each registration (should a registration hold
/// up every other call into the driver, the sleep lets them through).
/// `cargo test --release --lib small_work_beside_uploads -- --ignored --nocapture`.
#[test]
#[ignore]
fn small_work_beside_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bytes.bin");
    {
        use std::io::Write;
        let mut rng = crate::util::rng::SplitMix64::new(3);
        let mut f = std::io::BufWriter::new(File::create(&path).unwrap());
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..(1536 + 64) {
            for w in block.chunks_exact_mut(8) {
                w.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
            f.write_all(&block).unwrap();
        }
    }
    let gpu = Gpu::open(0).unwrap();
    let probe = Gpu::open_own_stream(0).unwrap();
    let ctx = gpu.context().clone();
    ctx.bind_to_thread().unwrap();
    let ps = probe.stream().clone();
    const SMALL: usize = 64 << 10;
    // SAFETY: unset memory, written below before any read.
    let mut small_host = unsafe {
        ctx.alloc_pinned_with_flags::<u8>(SMALL, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP)
    }
    .unwrap();
    small_host.as_mut_slice().unwrap().fill(7);
    let mut mapped = 0u64;
    // SAFETY: a live cuMemHostAlloc allocation mapped into the device's address space.
    let r = unsafe {
        cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
            &mut mapped,
            small_host.as_mut_ptr().unwrap() as *mut std::ffi::c_void,
            0,
        )
    };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let mut small_dev = probe.alloc_zeroed::<u8>(SMALL, "probe").unwrap();
    let copy_fn = probe
        .function("reference", REFERENCE_SOURCE, "reference_copy_words")
        .unwrap();
    let cfg = LaunchConfig {
        grid_dim: (16, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut ops = |which: usize| match which {
        0 => {
            ps.memcpy_htod(&small_host, &mut small_dev).unwrap();
            ps.synchronize().unwrap();
        }
        1 | 2 => {
            let (dst, rec) = small_dev.device_ptr(&ps);
            let (src, n) = if which == 1 {
                (dst, 0u64)
            } else {
                (mapped, (SMALL / 4) as u64)
            };
            let mut b = ps.launch_builder(&copy_fn);
            b.arg(&src).arg(&dst).arg(&n);
            // SAFETY: both hold SMALL bytes (n words of 4 bytes, or none).
            unsafe { b.launch(cfg) }.unwrap();
            drop(rec);
            ps.synchronize().unwrap();
        }
        _ => unreachable!(),
    };
    let names = ["64 KiB copy", "a kernel", "64 KiB by a kernel, mapped"];
    for (w, name) in names.iter().enumerate() {
        let (f, m, x) = latencies(20, || ops(w));
        println!("alone: {name}: first {f:.3} ms, median {m:.3}, max {x:.3}");
    }
    // Behind copies queued on another stream.
    const BULK: usize = 1536 << 20;
    // SAFETY: unset memory, only copied from.
    let bulk_host = unsafe { ctx.alloc_pinned_with_flags::<u8>(BULK, 0) }.unwrap();
    let bulk_dev = gpu.alloc_zeroed::<u8>(BULK, "bulk").unwrap();
    let bs = gpu.stream().clone();
    for (w, name) in names.iter().enumerate() {
        let t0 = Instant::now();
        for _ in 0..4 {
            for c in chunks(BULK, 8 << 20) {
                let (dst, rec) = bulk_dev.device_ptr(&bs);
                // SAFETY: both hold the chunk's bytes; the host memory lives until the stream
                // is waited for below.
                let src = bulk_host.as_ptr().unwrap() as usize + c.start;
                let r = unsafe {
                    cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                        dst + c.start as u64,
                        src as *const std::ffi::c_void,
                        c.len(),
                        bs.cu_stream(),
                    )
                };
                assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
                drop(rec);
            }
        }
        let queued = t0.elapsed().as_secs_f64() * 1e3;
        let (f, m, x) = latencies(5, || ops(w));
        let at = t0.elapsed().as_secs_f64() * 1e3;
        bs.synchronize().unwrap();
        let bulk = t0.elapsed().as_secs_f64() * 1e3;
        println!(
            "behind 6 GiB queued on another stream ({queued:.1} ms to queue, all copied at {bulk:.1} ms): {name}: first {f:.3} ms, median {m:.3}, max {x:.3} (done at {at:.1} ms)"
        );
    }
    drop(bulk_dev);
    // Beside an uploader registering and copying a mapped file as the routed uploads do: jobs of
    // 16 ranges of 6 MiB that share no page (each registered apart), 8 jobs.
    let file = File::open(&path).unwrap();
    let mut warm = vec![0u8; 64 << 20];
    let mut at = 0;
    while at < BULK {
        read_at(&file, &mut warm, at as u64).unwrap();
        at += warm.len();
    }
    drop(warm);
    const RANGE: usize = 6 << 20;
    const RANGES: usize = 16;
    const JOBS: usize = 8;
    let ways = [0u64, 50].map(std::time::Duration::from_micros);
    for (w, give_way) in (0..names.len()).flat_map(|w| ways.map(|g| (w, g))) {
        let name = names[w];
        let up = Uploader::start_giving_way(&gpu, Source::Mapped, give_way).unwrap();
        let t0 = Instant::now();
        for j in 0..JOBS {
            let after = Arc::new(gpu.stream().record_event(None).unwrap());
            let dst = alloc_dst(&gpu, RANGE * RANGES, "probe").unwrap();
            let src = (0..RANGES)
                .map(|e| FileRange {
                    path: path.clone(),
                    offset: ((j * RANGES + e) * 2 * RANGE) as u64,
                    len: RANGE,
                })
                .collect();
            up.send(Job {
                id: j as u64,
                generation: 0,
                what: "probe".into(),
                src,
                head: Vec::new(),
                tail: Vec::new(),
                dst,
                after,
            })
            .map_err(|_| "send")
            .unwrap();
        }
        let mut all = Vec::new();
        let mut done = Vec::new();
        while done.len() < JOBS {
            let t = Instant::now();
            ops(w);
            all.push(t.elapsed().as_secs_f64() * 1e3);
            while let Some(d) = up.try_recv() {
                done.push(d);
            }
        }
        for d in done {
            if let Outcome::Ready(r) = d.outcome {
                r.wait_host().unwrap();
                drop(r.take(gpu.stream()).unwrap());
            }
        }
        let total = t0.elapsed().as_secs_f64() * 1e3;
        all.sort_by(f64::total_cmp);
        println!(
            "beside an uploader of 768 MiB mapped (8 jobs of 16 ranges), sleeping {} us after each registration ({total:.1} ms): {name}: {} ops, median {:.3} ms, 90th {:.3}, max {:.3}",
            give_way.as_micros(),
            all.len(),
            all[all.len() / 2],
            all[all.len() * 9 / 10],
            all[all.len() - 1]
        );
        drop(up);
    }
}
