//! Dequantization on the device, and the on-device comparison with the CPU's result.

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Gpu, COMPARE_SOURCE, DEQUANT_SOURCE};
use crate::quant::GgmlType;

/// The kernel-name stem of `ty` (`dequant_<stem>_f32`), `None` for types without a kernel (the
/// same ones the CPU cannot dequantize).
pub fn kernel_stem(ty: GgmlType) -> Option<&'static str> {
    use GgmlType as T;
    Some(match ty {
        T::F32 => "f32",
        T::F16 => "f16",
        T::BF16 => "bf16",
        T::F64 => "f64",
        T::I8 => "i8",
        T::I16 => "i16",
        T::I32 => "i32",
        T::I64 => "i64",
        T::Q4_0 => "q4_0",
        T::Q4_1 => "q4_1",
        T::Q5_0 => "q5_0",
        T::Q5_1 => "q5_1",
        T::Q8_0 => "q8_0",
        T::IQ4_NL => "iq4_nl",
        T::Q2_K => "q2_k",
        T::Q3_K => "q3_k",
        T::Q4_K => "q4_k",
        T::Q5_K => "q5_k",
        T::Q6_K => "q6_k",
        T::IQ4_XS => "iq4_xs",
        T::IQ2_XXS => "iq2_xxs",
        T::IQ2_XS => "iq2_xs",
        T::IQ2_S => "iq2_s",
        T::IQ3_XXS => "iq3_xxs",
        T::IQ3_S => "iq3_s",
        T::IQ1_S => "iq1_s",
        T::IQ1_M => "iq1_m",
        T::TQ1_0 => "tq1_0",
        T::TQ2_0 => "tq2_0",
        T::MXFP4 => "mxfp4",
        T::NVFP4 => "nvfp4",
        _ => return None,
    })
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

/// A grid for `n` elements: 256 threads a block, at most 32 blocks per SM (grid-stride loops).
fn grid(gpu: &Gpu, n: u64) -> LaunchConfig {
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
        let n = elements(ty, src.len())?;
        if dst.len() as u64 != n {
            bail!("cuda: {ty}: output holds {} values for {n}", dst.len());
        }
        let name = format!("dequant_{}_f32", stem(ty)?);
        let f = self.function("dequant", DEQUANT_SOURCE, &name)?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: the kernel reads n / QK whole blocks from `src` (checked: src holds exactly
        // those bytes) and writes n floats to `dst` (checked above); 64-bit indices.
        unsafe { b.launch(grid(self, n)) }.with_context(|| format!("cuda: launching {name}"))?;
        Ok(())
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
        let n = elements(ty, src.len())?;
        if dst.len() as u64 != n {
            bail!("cuda: {ty}: output holds {} values for {n}", dst.len());
        }
        let name = format!("dequant_{}_{}", stem(ty)?, format.suffix());
        let f = self.function("dequant", DEQUANT_SOURCE, &name)?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: as in `dequant_f32`, with 2-byte outputs.
        unsafe { b.launch(grid(self, n)) }.with_context(|| format!("cuda: launching {name}"))?;
        Ok(())
    }

    /// Compares `gpu` with `cpu` on the device (equal bits, or both NaN).
    pub fn compare_f32(&self, gpu: &CudaSlice<f32>, cpu: &CudaSlice<f32>) -> Result<CompareStats> {
        self.compare("compare_f32", gpu, cpu)
    }

    /// Compares 16-bit patterns on the device (exact equality).
    pub fn compare_u16(&self, gpu: &CudaSlice<u16>, cpu: &CudaSlice<u16>) -> Result<CompareStats> {
        self.compare("compare_u16", gpu, cpu)
    }

    fn compare<T: cudarc::driver::DeviceRepr>(
        &self,
        kernel: &str,
        gpu: &CudaSlice<T>,
        cpu: &CudaSlice<T>,
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
