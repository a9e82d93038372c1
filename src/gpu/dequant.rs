//! Dequantization on the device, and the on-device comparison with the CPU's result.

use anyhow::{bail, Context, Result};
use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{Gpu, COMPARE_SOURCE, DEQUANT_FAMILIES};
use crate::quant::simd::multiversion;
use crate::quant::GgmlType;

/// The kernel-name stem of `ty` (`dequant_<stem>_f32`) from its row of the type table, `None`
/// for types without a kernel (the same ones the CPU cannot dequantize).
pub fn kernel_stem(ty: GgmlType) -> Option<&'static str> {
    ty.info().kernel
}

/// Output format of a dequant kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutFormat {
    /// f32, bit-exact against the CPU.
    F32,
    /// bfloat16 rounded to nearest even from that f32.
    Bf16,
    /// IEEE half rounded to nearest even from that f32.
    F16,
}

impl OutFormat {
    fn suffix(self) -> &'static str {
        match self {
            OutFormat::F32 => "f32",
            OutFormat::Bf16 => "bf16",
            OutFormat::F16 => "f16",
        }
    }
}

/// Outputs per dequant thread (a warp makes 256 in `cuda/dequant.cu`, the scalar kernels 8 a
/// thread); the launch sizes the grid by it, the kernels' grid-stride loops cover the rest.
const DQ_PER_THREAD: u64 = 8;

/// A grid for `n` work items: 256 threads a block, at most 32 blocks per SM (grid-stride loops).
pub(super) fn grid(gpu: &Gpu, n: u64) -> LaunchConfig {
    let threads = 256u32;
    let blocks = n
        .div_ceil(u64::from(threads))
        .clamp(1, u64::from(gpu.info.sms.max(1)) * 32) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn stem(ty: GgmlType) -> Result<&'static str> {
    kernel_stem(ty).with_context(|| format!("cuda: no dequant kernel for type {ty}"))
}

/// The kernel family `(name, source)` holding the dequant kernels of kernel stem `stem`
/// (`cuda/dequant_kquants.cu`, `cuda/dequant_iquants.cu` or `cuda/dequant_scalar.cu`).
pub fn dequant_family(stem: &str) -> (&'static str, &'static str) {
    const K: [&str; 6] = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"];
    const IQ: [&str; 11] = [
        "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0",
        "mxfp4", "nvfp4",
    ];
    let k = if K.contains(&stem) {
        1
    } else if IQ.contains(&stem) {
        2
    } else {
        0
    };
    DEQUANT_FAMILIES[k]
}

/// Checks that `n_bytes` are whole blocks of `ty` and returns the element count.
fn elements(ty: GgmlType, n_bytes: usize) -> Result<u64> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if ts == 0 || n_bytes % ts != 0 {
        bail!("cuda: {n_bytes} bytes are not whole blocks of {ty} ({ts} bytes each)");
    }
    Ok((n_bytes / ts * bs) as u64)
}

impl Gpu {
    /// Dequantizes the blocks of `ty` in `src` (device bytes) into `dst` (f32, exactly the
    /// element count).
    pub fn dequant_f32(
        &self,
        ty: GgmlType,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.dequant_view(ty, OutFormat::F32, &src.as_view(), &mut dst.as_view_mut())
    }

    /// Dequantizes into 16-bit values (`Bf16` or `F16` bit patterns).
    pub fn dequant_u16(
        &self,
        ty: GgmlType,
        format: OutFormat,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u16>,
    ) -> Result<()> {
        if format == OutFormat::F32 {
            bail!("cuda: dequant_u16 takes bf16 or f16");
        }
        self.dequant_view(ty, format, &src.as_view(), &mut dst.as_view_mut())
    }

    /// Launches `dequant_<type>_<format>` from `src` (whole blocks at any byte offset, e.g. a
    /// row range of a tensor kept on the device) into `dst` (`format`'s element type, 4 bytes
    /// for f32 and 2 for bf16/f16, exactly the element count, 16-byte aligned).
    pub fn dequant_view<T: DeviceRepr>(
        &self,
        ty: GgmlType,
        format: OutFormat,
        src: &CudaView<'_, u8>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let want = if format == OutFormat::F32 { 4 } else { 2 };
        if std::mem::size_of::<T>() != want {
            bail!(
                "cuda: {ty}: {format:?} output needs {want}-byte values, not {}",
                std::mem::size_of::<T>()
            );
        }
        let n = elements(ty, src.len())?;
        if dst.len() as u64 != n {
            bail!("cuda: {ty}: output holds {} values for {n}", dst.len());
        }
        let s = self.stream();
        let (ptr, _rec) = dst.device_ptr_mut(s);
        if ptr % 16 != 0 {
            bail!("cuda: {ty}: output at {ptr:#x} is not 16-byte aligned");
        }
        drop(_rec);
        let stem = stem(ty)?;
        let name = format!("dequant_{stem}_{}", format.suffix());
        let (family, source) = dequant_family(stem);
        let f = self.function(family, source, &name)?;
        let mut b = s.launch_builder(&f);
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: the kernel reads n / QK whole blocks from `src` (checked: src holds exactly
        // those bytes; it never loads outside them) and writes n values of the format's width
        // (checked above) to `dst`, 16-byte aligned (checked) for its vector stores; 64-bit
        // indices.
        unsafe { b.launch(grid(self, n.div_ceil(DQ_PER_THREAD))) }
            .with_context(|| format!("cuda: launching {name}"))?;
        Ok(())
    }

    /// Compares `gpu` with `cpu` on the device (equal bits, or both NaN).
    pub fn compare_f32(&self, gpu: &CudaSlice<f32>, cpu: &CudaSlice<f32>) -> Result<CompareStats> {
        self.compare("compare_f32", &gpu.as_view(), &cpu.as_view())
    }

    /// [`Gpu::compare_f32`] of two views (e.g. the first values of a buffer reused chunk after
    /// chunk).
    pub fn compare_f32_views(
        &self,
        gpu: &CudaView<'_, f32>,
        cpu: &CudaView<'_, f32>,
    ) -> Result<CompareStats> {
        self.compare("compare_f32", gpu, cpu)
    }

    /// Compares 16-bit patterns on the device (exact equality).
    pub fn compare_u16(&self, gpu: &CudaSlice<u16>, cpu: &CudaSlice<u16>) -> Result<CompareStats> {
        self.compare("compare_u16", &gpu.as_view(), &cpu.as_view())
    }

    fn compare<T: cudarc::driver::DeviceRepr>(
        &self,
        kernel: &str,
        gpu: &CudaView<'_, T>,
        cpu: &CudaView<'_, T>,
    ) -> Result<CompareStats> {
        if gpu.len() != cpu.len() {
            bail!("cuda: comparing {} values with {}", gpu.len(), cpu.len());
        }
        let n = gpu.len() as u64;
        let s = self.stream();
        let mut stats = s
            .alloc_zeros::<u64>(3)
            .context("cuda: allocating comparison counters")?;
        s.memcpy_htod(&[0u64, u64::MAX, 0u64], &mut stats)
            .context("cuda: initialising comparison counters")?;
        let f = self.function("compare", COMPARE_SOURCE, kernel)?;
        let mut b = s.launch_builder(&f);
        b.arg(gpu).arg(cpu).arg(&n).arg(&mut stats);
        // SAFETY: both inputs hold n values (checked); `stats` holds the 3 counters.
        unsafe { b.launch(grid(self, n)) }.with_context(|| format!("cuda: launching {kernel}"))?;
        let v = s
            .clone_dtoh(&stats)
            .context("cuda: reading comparison counters")?;
        Ok(CompareStats {
            mismatches: v[0],
            first: (v[0] > 0).then_some(v[1]),
            max_abs: f32::from_bits(v[2] as u32),
        })
    }
}

/// The hash `hash_f32` computes on the device, on the host: the wrapping sum over `i` of
/// `mix64(bits(v[i]) ^ (base + i) * GAMMA)`, every NaN as `0x7FC00000`.
pub fn hash_f32_host(v: &[f32], base: u64) -> u64 {
    use rayon::prelude::*;
    v.par_chunks(1 << 16)
        .enumerate()
        .map(|(c, chunk)| hash_run(chunk, base.wrapping_add((c as u64) << 16)))
        .reduce(|| 0u64, u64::wrapping_add)
}

multiversion! {
    /// [`hash_f32_host`]'s sum over `v` alone, its first value at position `start`, on the
    /// calling thread (each term is independent of the others, so any split of a run adds up
    /// to the same hash). Vectorized: AVX-512 multiplies 64-bit lanes in one instruction.
    fn hash_run(v: &[f32], start: u64) -> u64 = hash_run_body;
}

#[inline(always)]
fn hash_run_body(v: &[f32], start: u64) -> u64 {
    use crate::util::rng::{mix64, GAMMA};
    let mut acc = 0u64;
    for (i, &x) in v.iter().enumerate() {
        let bits = if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() };
        let pos = start.wrapping_add(i as u64);
        acc = acc.wrapping_add(mix64(u64::from(bits) ^ pos.wrapping_mul(GAMMA)));
    }
    acc
}

/// Values per tile of [`dequant_hash`]: 16 KiB of f32, which stay in L1 from the dequantizer
/// writing them to the hash reading them; a multiple of every block size.
const HASH_TILE: usize = 4096;
/// Values per parallel task of [`dequant_hash`], as [`hash_f32_host`] splits its work.
const HASH_TASK: usize = 1 << 16;

/// [`hash_f32_host`] of the values [`crate::quant::dequantize`] gives for `src` (whole blocks
/// of `ty`), the first at position `base`, without writing them out: rayon's tasks each
/// dequantize a tile at a time into a buffer of their own and hash it there, so the values
/// never reach memory and are read once, while in cache. dequant-check's CPU side: the values
/// themselves are only needed when the device's hash differs.
pub fn dequant_hash(ty: GgmlType, src: &[u8], base: u64) -> Result<u64> {
    use rayon::prelude::*;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if bs == 0 || ts == 0 || bs > HASH_TILE || src.len() % ts != 0 {
        bail!(
            "quant: {ty}: {} bytes are not whole blocks of {ts} bytes",
            src.len()
        );
    }
    let tile_blocks = HASH_TILE / bs;
    let task_blocks = (HASH_TASK / bs).max(1);
    src.par_chunks(task_blocks * ts)
        .enumerate()
        .map(|(c, task)| {
            let mut buf = [0f32; HASH_TILE];
            let mut pos = base.wrapping_add((c * task_blocks * bs) as u64);
            let mut h = 0u64;
            for raw in task.chunks(tile_blocks * ts) {
                let y = &mut buf[..raw.len() / ts * bs];
                crate::quant::dequantize(ty, raw, y)?;
                h = h.wrapping_add(hash_run(y, pos));
                pos = pos.wrapping_add(y.len() as u64);
            }
            Ok(h)
        })
        .try_reduce(|| 0u64, |a, b| Ok(a.wrapping_add(b)))
}

impl Gpu {
    /// [`hash_f32_host`] of `v` on the device.
    pub fn hash_f32(&self, v: &CudaSlice<f32>, base: u64) -> Result<u64> {
        let out = self.hash_f32_launch(v, base)?;
        self.hash_read(&out)
    }

    /// Launches [`Gpu::hash_f32`]'s kernel on the stream and returns the device counter it
    /// sums into, without waiting; [`Gpu::hash_read`] reads it.
    pub fn hash_f32_launch(&self, v: &CudaSlice<f32>, base: u64) -> Result<CudaSlice<u64>> {
        let mut out = self.alloc_zeroed::<u64>(1, "hash")?;
        self.hash_f32_into(&v.as_view(), base, &mut out)?;
        Ok(out)
    }

    /// Zeroes the counter `out` (at least one value) and launches [`Gpu::hash_f32`]'s kernel
    /// over `v` into it on the stream, without waiting or allocating; [`Gpu::hash_read`] reads
    /// it.
    pub fn hash_f32_into(
        &self,
        v: &CudaView<'_, f32>,
        base: u64,
        out: &mut CudaSlice<u64>,
    ) -> Result<()> {
        if out.is_empty() {
            bail!("cuda: hash_f32 needs a counter to sum into");
        }
        let s = self.stream();
        s.memset_zeros(out).context("cuda: zeroing the hash")?;
        let n = v.len() as u64;
        let f = self.function("compare", COMPARE_SOURCE, "hash_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(v).arg(&n).arg(&base).arg(out);
        // SAFETY: `v` holds n values; `out` at least one counter (checked); blocks are
        // multiples of 32 threads (the warp reduction needs whole warps).
        unsafe { b.launch(grid(self, n)) }.context("cuda: launching hash_f32")?;
        Ok(())
    }

    /// Compiles (or takes from the disk cache) and loads the dequant and comparison kernel
    /// families now, so that their first launches do not wait for NVRTC (a cold cache costs
    /// seconds: a caller that times its launches loads them first).
    pub fn load_dequant_kernels(&self) -> Result<()> {
        let mut families = DEQUANT_FAMILIES.to_vec();
        families.push(("compare", COMPARE_SOURCE));
        self.compile_ahead(&families);
        for (name, source) in families {
            self.load_family(name, source)?;
        }
        Ok(())
    }

    /// The hash [`Gpu::hash_f32_launch`] left in `out` (waits for the stream's work before it).
    pub fn hash_read(&self, out: &CudaSlice<u64>) -> Result<u64> {
        let v = self
            .stream()
            .clone_dtoh(out)
            .context("cuda: reading the hash")?;
        v.first()
            .copied()
            .context("cuda: reading the hash: no value")
    }
}

/// What the on-device comparison found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompareStats {
    /// Values that differ.
    pub mismatches: u64,
    /// The first differing index.
    pub first: Option<u64>,
    /// Largest |gpu - cpu| over differing finite pairs.
    pub max_abs: f32,
}

impl CompareStats {
    /// Adds a later chunk's counts (its indices offset by `offset`).
    pub fn merge(&mut self, other: CompareStats, offset: u64) {
        self.mismatches += other.mismatches;
        if self.first.is_none() {
            self.first = other.first.map(|i| i + offset);
        }
        self.max_abs = self.max_abs.max(other.max_abs);
    }
}

#[cfg(test)]
mod tests {
    use super::{dequant_family, dequant_hash, hash_f32_host};
    use crate::gpu::DEQUANT_FAMILIES;
    use crate::quant::simd::{with_cap, Level};
    use crate::quant::{dequantize, GgmlType, TYPE_TABLE};
    use crate::util::rng::SplitMix64;

    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut rng = SplitMix64::new(seed);
        (0..n).map(|_| rng.next_u64() as u8).collect()
    }

    /// Every type with a kernel is instantiated in exactly the family its launches load, and
    /// in no other.
    #[test]
    fn each_kernel_is_in_its_family() {
        for row in TYPE_TABLE.iter() {
            let Some(stem) = row.kernel else { continue };
            let (family, _) = dequant_family(stem);
            for (name, source) in DEQUANT_FAMILIES {
                let made = [
                    format!("DEQUANT_KERNELS8({stem},"),
                    format!("SCALAR_KERNELS({stem},"),
                ]
                .iter()
                .filter(|m| source.lines().any(|l| l.starts_with(m.as_str())))
                .count();
                assert_eq!(made, usize::from(name == family), "{stem} in {name}");
            }
        }
    }

    /// The fused dequantize-and-hash equals hashing [`dequantize`]'s values, for every type,
    /// on raw random blocks (every scale pattern, NaN included), at lengths that are not whole
    /// tiles or tasks and at an offset position.
    #[test]
    fn dequant_hash_equals_hash_of_values() {
        for row in TYPE_TABLE.iter().filter(|r| r.dequant.is_some()) {
            for blocks in [1, 17, (1 << 17) / row.block_size + 5] {
                let src = random_bytes(row.ty.id().into(), blocks * row.type_size);
                let mut y = vec![0f32; blocks * row.block_size];
                dequantize(row.ty, &src, &mut y).unwrap();
                for base in [0u64, 123_456_789] {
                    let want = hash_f32_host(&y, base);
                    let got = dequant_hash(row.ty, &src, base).unwrap();
                    assert_eq!(got, want, "{} {blocks} blocks at {base}", row.name);
                }
            }
        }
        let e = dequant_hash(GgmlType::Q4_K, &[0u8; 145], 0).unwrap_err();
        assert!(e.to_string().contains("145 bytes"), "{e}");
    }

    /// Every build of the hash gives the same sum, NaNs of any payload counted as one.
    #[test]
    fn hash_is_the_same_at_every_level() {
        let mut rng = SplitMix64::new(5);
        let v: Vec<f32> = (0..100_003)
            .map(|_| f32::from_bits(rng.next_u64() as u32))
            .collect();
        let base = with_cap(Level::Base, || hash_f32_host(&v[..70_001], 99));
        for l in [Level::Avx2, Level::Avx512] {
            assert_eq!(with_cap(l, || hash_f32_host(&v[..70_001], 99)), base);
        }
        // Rayon's threads do not inherit the cap: the single-thread sum shows the level.
        let by_hand = v[..3].iter().enumerate().fold(0u64, |a, (i, &x)| {
            let bits = if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() };
            a.wrapping_add(crate::util::rng::mix64(
                u64::from(bits) ^ (7 + i as u64).wrapping_mul(crate::util::rng::GAMMA),
            ))
        });
        for l in [Level::Base, Level::Avx2, Level::Avx512] {
            assert_eq!(with_cap(l, || super::hash_run(&v[..3], 7)), by_hand);
            let a = with_cap(l, || super::hash_run(&v, 11));
            assert_eq!(a, with_cap(Level::Base, || super::hash_run(&v, 11)));
        }
    }

    /// Not a test: dequant-check's CPU side on 2^26 values (one chunk), as it was (dequantize
    /// into a fresh vector, then hash it) and fused ([`dequant_hash`]), on all of rayon's
    /// threads. `cargo test --release --lib dequant_hash_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement; run by hand"]
    fn dequant_hash_speed() {
        use std::time::Instant;
        let n = 1usize << 26;
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q8_0,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ] {
            let mut src = vec![0u8; n / ty.block_size() * ty.type_size()];
            crate::bench::random_blocks::fill_blocks(ty, &mut SplitMix64::new(1), &mut src);
            let median = |f: &mut dyn FnMut() -> u64| {
                let mut t: Vec<f64> = (0..5)
                    .map(|_| {
                        let s = Instant::now();
                        std::hint::black_box(f());
                        s.elapsed().as_secs_f64()
                    })
                    .collect();
                t.sort_by(f64::total_cmp);
                n as f64 / t[2] / 1e6
            };
            let old = median(&mut || {
                let v = crate::quant::dequantize_to_vec(ty, &src, n).unwrap();
                hash_f32_host(&v, 0)
            });
            let fused = median(&mut || dequant_hash(ty, &src, 0).unwrap());
            let dq = median(&mut || {
                let v = crate::quant::dequantize_to_vec(ty, &src, n).unwrap();
                v.len() as u64
            });
            println!(
                "{ty}: {} threads: dequantize+hash {old:.0} Melem/s, fused {fused:.0} Melem/s \
                 ({:.2}x); dequantize alone {dq:.0} Melem/s",
                rayon::current_num_threads(),
                fused / old
            );
        }
    }

    /// The hash is a sum over (position, value): independent of how the host splits the work,
    /// sensitive to a value moving, NaN payloads equal.
    #[test]
    fn host_hash_by_hand() {
        use crate::util::rng::{mix64, GAMMA};
        let v = [1.0f32, -2.5];
        let want = mix64(u64::from(1.0f32.to_bits()) ^ 10u64.wrapping_mul(GAMMA)).wrapping_add(
            mix64(u64::from((-2.5f32).to_bits()) ^ 11u64.wrapping_mul(GAMMA)),
        );
        assert_eq!(hash_f32_host(&v, 10), want);
        assert_ne!(hash_f32_host(&[-2.5, 1.0], 10), want);
        let big: Vec<f32> = (0..200_000).map(|i| i as f32).collect();
        let split =
            hash_f32_host(&big[..70_000], 0).wrapping_add(hash_f32_host(&big[70_000..], 70_000));
        assert_eq!(hash_f32_host(&big, 0), split);
        assert_eq!(
            hash_f32_host(&[f32::from_bits(0x7FC0_0001)], 0),
            hash_f32_host(&[f32::NAN], 0)
        );
    }
}
