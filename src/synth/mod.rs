//! Synthetic GGUF models with the real tensor names, shapes, metadata and a realistic type mix,
//! filled with random valid blocks whose dequantized values have a trained model's spread
//! (std `1/sqrt(fan_in)` for matrices, ~1 for norms).
//!
//! Tensor data is generated in fixed-size chunks, each from its own PRNG seeded by (seed,
//! tensor name, chunk index), in parallel batches, and streamed to the file in order: the
//! output depends only on the options, never on the thread count, and a multi-gigabyte file
//! never sits in memory.

mod blocks;
mod dims;
mod plan;
mod vocab;

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use rayon::prelude::*;

pub use blocks::{is_supported, supported, BlockGen, Init};
pub use dims::{Dims, IndexerDims, Yarn};
pub use plan::{plan, shape_fallback, TensorPlan, TypeMix};
pub use vocab::Vocab;

use crate::gguf::GgufWriter;
use crate::model::Arch;
use crate::quant::GgmlType;
use crate::util::progress::{NoProgress, Progress};
use crate::util::rng::{mix64, SplitMix64, GAMMA};

/// Target bytes of one generated chunk (rounded down to whole blocks).
const CHUNK_BYTES: usize = 1 << 20;
/// Chunks generated in parallel before they are written (bounds memory to ~32 MiB).
const BATCH_CHUNKS: usize = 32;
/// `general.quantization_version` written by current llama.cpp quantizers.
const QUANTIZATION_VERSION: u32 = 2;

/// Everything that determines a synthetic file.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Architecture.
    pub arch: Arch,
    /// Dimensions (already cut to the layers to write).
    pub dims: Dims,
    /// Type mix.
    pub mix: TypeMix,
    /// Random seed.
    pub seed: u64,
}

impl SynthOptions {
    /// Checked options from the command-line spellings.
    pub fn parse(
        arch: &str,
        dims: &str,
        layers: Option<u32>,
        types: &str,
        seed: u64,
    ) -> Result<SynthOptions> {
        let arch = Arch::from_name(arch).ok_or_else(|| {
            anyhow!("synth: unknown --arch {arch:?} (expected glm-dsa or deepseek2)")
        })?;
        let mut d = Dims::preset(arch, dims)?;
        if let Some(n) = layers {
            d = d.with_layers(u64::from(n))?;
        }
        Ok(SynthOptions {
            arch,
            dims: d,
            mix: TypeMix::parse(types)?,
            seed,
        })
    }
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SynthSummary {
    /// Number of tensors.
    pub n_tensors: usize,
    /// Blocks stored (`block_count`).
    pub block_count: u64,
    /// File size in bytes.
    pub file_bytes: u64,
    /// Per type: (tensors, bytes).
    pub types: BTreeMap<GgmlType, (usize, u64)>,
    /// Wall time of the whole write, seconds.
    pub seconds: f64,
}

/// FNV-1a 64 of a tensor name (a stable per-tensor seed component).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The seed of chunk `chunk` of tensor `name`.
fn chunk_seed(seed: u64, name: &str, chunk: u64) -> u64 {
    let t = mix64(seed ^ mix64(fnv1a(name)));
    mix64(t ^ chunk.wrapping_mul(GAMMA))
}

/// Declares the metadata and tensors of `opts` on a writer; returns it with the plan.
pub fn prepare(opts: &SynthOptions) -> Result<(GgufWriter, Vec<TensorPlan>)> {
    let (arch, d) = (opts.arch, &opts.dims);
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", arch.as_str())?;
    let name = format!(
        "synthetic {} ({} dims, {} layers, seed {})",
        arch.as_str(),
        d.name,
        d.n_layer,
        opts.seed
    );
    w.add_str("general.name", &name)?;
    w.add_u32("general.quantization_version", QUANTIZATION_VERSION)?;
    d.write_metadata(arch, &mut w)?;
    vocab::build(arch, d.vocab)?.write_metadata(arch, &mut w)?;
    let tensors = plan(arch, d, opts.mix)?;
    for t in &tensors {
        w.add_tensor(&t.name, &t.ne, t.ty)?;
    }
    Ok((w, tensors))
}

/// Writes the synthetic model to `path` (atomically).
pub fn write(opts: &SynthOptions, path: &Path) -> Result<SynthSummary> {
    write_with_progress(opts, path, &NoProgress)
}

/// [`write`], reporting the tensor bytes written to `progress`.
pub fn write_with_progress(
    opts: &SynthOptions,
    path: &Path,
    progress: &dyn Progress,
) -> Result<SynthSummary> {
    let t0 = std::time::Instant::now();
    let (w, tensors) = prepare(opts)?;
    let total = w.layout().iter().map(|t| t.nbytes).sum::<u64>();
    // The size against the free space, before a byte is written (a GLM-5-dimension model is
    // hundreds of GB).
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Some(free) = crate::util::free_bytes(dir) {
        if total > free {
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            return Err(anyhow!(
                "synth: --out {}: the model's tensors take {:.2} GiB, the file system holding {} has {:.2} GiB free",
                path.display(),
                gib(total),
                dir.display(),
                gib(free)
            ));
        }
    }
    progress.start("synth: tensors", total);
    let gens = tensors
        .iter()
        .map(|t| BlockGen::new(t.ty, t.init).with_context(|| format!("synth: tensor {}", t.name)))
        .collect::<Result<Vec<_>>>()?;
    let mut next = 0usize;
    let written = w.write_file(path, &mut |info, out| {
        let (t, g) = (&tensors[next], &gens[next]);
        next += 1;
        if t.name != info.name {
            return Err(anyhow!(
                "synth: writer asked for tensor {:?}, the plan has {:?} next",
                info.name,
                t.name
            ));
        }
        let ts = g.ty().type_size();
        let chunk = (CHUNK_BYTES / ts).max(1) * ts;
        let n_chunks = info.nbytes.div_ceil(chunk as u64);
        let mut first = 0u64;
        while first < n_chunks {
            let last = (first + BATCH_CHUNKS as u64).min(n_chunks);
            let bufs: Vec<Vec<u8>> = (first..last)
                .into_par_iter()
                .map(|c| {
                    let start = c * chunk as u64;
                    let len = (info.nbytes - start).min(chunk as u64) as usize;
                    let mut buf = vec![0u8; len];
                    g.fill(
                        &mut buf,
                        &mut SplitMix64::new(chunk_seed(opts.seed, &t.name, c)),
                    );
                    buf
                })
                .collect();
            for b in &bufs {
                out.write_all(b)?;
                progress.inc(b.len() as u64);
            }
            first = last;
        }
        Ok(())
    });
    progress.finish();
    let file_bytes = written?;
    let mut types: BTreeMap<GgmlType, (usize, u64)> = BTreeMap::new();
    for t in w.layout() {
        let e = types.entry(t.ty).or_default();
        e.0 += 1;
        e.1 += t.nbytes;
    }
    Ok(SynthSummary {
        n_tensors: tensors.len(),
        block_count: opts.dims.block_count(),
        file_bytes,
        types,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
