//! Weight bytes the CUDA candidate put on a device, offered to the reference's products on the
//! same device (`--reference-reuse`).
//!
//! At a short prompt a MoE layer's reference spends about half of its CPU time dequantizing and
//! multiplying the routed experts, one or two tokens each, and most of the rest in the products
//! of the layer's other weights, while the CUDA candidate uploads the same raw GGUF rows to the
//! device for its own steps. The reference's products on a device (`engine::cpu::device`) do not
//! pay there when they upload the weights themselves (the link is the candidate's bottleneck),
//! but they do with bytes already on the device. So the candidate offers what it holds by file
//! span (the shard's path, the byte offset and length): each routed group's experts' rows, and
//! each whole tensor of a layer (attention, shared expert, dense MLP) once its copies are done;
//! the reference looks its products' weights up by the same span ([`find`]).
//!
//! The bytes stay the file's by proof, not by trust: before the reference uses a span's device
//! bytes it compares their hash on the device ([`Gpu::hash_bytes_queued`], `cuda/compare.cu`
//! `hash_bytes`, queued with the product) with the hash of the same span read from its own
//! memory map of the file ([`hash_bytes_host`]), a wrapping sum over the span's 4-byte words of
//! `mix64(word ^ (base + i) * GAMMA)`; a span whose hashes differ is not used (the reference
//! makes that product on the CPU from the file, and the run's note names the span). The products
//! themselves are checked as every device product is (`engine::cpu::device`: rows and tokens
//! against the CPU's `dot`, bit for bit). The values are the reference's own either way: only
//! where the multiply-adds run changes.
//!
//! An offered span keeps the candidate's buffer alive (a shared handle) until the candidate
//! forgets the layer's offers ([`keep_around`]: as it begins a layer, those of every other
//! layer but the one before); a product that uses a span holds its own handle and waits for its stream
//! before letting it go, so a buffer is never freed under a kernel.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};

use super::dequant::grid;
use super::{Gpu, COMPARE_SOURCE};
use crate::quant::simd::multiversion;

/// A span of a file's bytes: where a weight's raw rows lie.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FileSpan {
    /// The shard's path, as the model was opened.
    pub path: PathBuf,
    /// The span's first byte in the file.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// A file span's bytes on a device: a buffer of the candidate's and where the span starts in it.
#[derive(Clone)]
pub struct OnDevice {
    /// The device's ordinal.
    pub ordinal: usize,
    /// The buffer (kept alive while this handle lives).
    pub buf: Arc<CudaSlice<u8>>,
    /// The span's first byte in `buf`.
    pub at: usize,
}

impl OnDevice {
    /// The span's `len` bytes in the buffer; `None` when they do not fit in it.
    pub fn view(&self, len: usize) -> Option<CudaView<'_, u8>> {
        let end = self.at.checked_add(len)?;
        (end <= self.buf.len()).then(|| self.buf.slice(self.at..end))
    }
}

/// The offers of the candidate, by span, with the layer each belongs to.
#[derive(Default)]
struct Offers {
    spans: HashMap<FileSpan, (usize, OnDevice)>,
}

static OFFERS: Mutex<Option<Offers>> = Mutex::new(None);

/// Whether the candidate offers its bytes (`--reference-reuse`), set once by the command.
static REUSE: AtomicBool = AtomicBool::new(false);

/// Whether the CUDA candidate offers its routed experts' device bytes to the reference (the
/// command's `--reference-reuse`, set once at its start, before any engine opens).
pub fn set_reuse(on: bool) {
    REUSE.store(on, Ordering::Relaxed);
}

/// What [`set_reuse`] set (off unless told otherwise).
pub fn reuse() -> bool {
    REUSE.load(Ordering::Relaxed)
}

/// Offers `span`'s bytes, held at `on` on a device, for layer `layer` (when [`reuse`] is on).
pub fn offer(layer: usize, span: FileSpan, on: OnDevice) {
    if !reuse() {
        return;
    }
    if let Ok(mut o) = OFFERS.lock() {
        o.get_or_insert_with(Offers::default)
            .spans
            .insert(span, (layer, on));
    }
}

/// The device bytes offered for `span` on device `ordinal`, if any: an offer of that span, or
/// of a span of the same file that holds it (an expert's gate rows within its fused gate and up
/// rows), with `at` moved to the span's first byte.
pub fn find(span: &FileSpan, ordinal: usize) -> Option<OnDevice> {
    let o = OFFERS.lock().ok()?;
    let spans = &o.as_ref()?.spans;
    if let Some((_, on)) = spans.get(span) {
        return (on.ordinal == ordinal).then(|| on.clone());
    }
    spans.iter().find_map(|(s, (_, on))| {
        let at = within(s, on.at, span)?;
        (on.ordinal == ordinal).then(|| OnDevice { at, ..on.clone() })
    })
}

/// Where `want` starts in a buffer that holds the span `offer` from its byte `at`, when `offer`
/// holds all of `want` (the same file).
fn within(offer: &FileSpan, at: usize, want: &FileSpan) -> Option<usize> {
    let end = want.offset.checked_add(want.len)?;
    let holds = offer.path == want.path
        && offer.offset <= want.offset
        && offer
            .offset
            .checked_add(offer.len)
            .is_some_and(|e| end <= e);
    if !holds {
        return None;
    }
    at.checked_add(usize::try_from(want.offset - offer.offset).ok()?)
}

/// Whether an offer of layer `l` is kept as the candidate begins `layer` ([`keep_around`]).
fn kept(l: usize, layer: usize) -> bool {
    l == layer || l + 1 == layer
}

/// Forgets the offers of every layer but `layer` and the one before it, as the candidate begins
/// `layer` (the reference may still be in the layer before; a new walk from layer 0 drops an
/// earlier walk's). Their buffers are freed once no product holds them.
pub fn keep_around(layer: usize) {
    if let Ok(mut o) = OFFERS.lock() {
        if let Some(o) = o.as_mut() {
            o.spans.retain(|_, (l, _)| kept(*l, layer));
        }
    }
}

/// Bytes per parallel task of [`hash_bytes_host`] (a multiple of 4).
const HASH_TASK: usize = 1 << 18;

/// The hash `hash_bytes` computes on the device, on the host: the wrapping sum over the 4-byte
/// words `w_i` of `bytes` (little-endian; a last partial word padded with zeros) of
/// `mix64(w_i ^ (base + i) * GAMMA)`.
pub fn hash_bytes_host(bytes: &[u8], base: u64) -> u64 {
    use rayon::prelude::*;
    bytes
        .par_chunks(HASH_TASK)
        .enumerate()
        .map(|(c, chunk)| hash_words(chunk, base.wrapping_add((c * HASH_TASK / 4) as u64)))
        .reduce(|| 0u64, u64::wrapping_add)
}

multiversion! {
    /// [`hash_bytes_host`]'s sum over `bytes` alone, its first word at position `start`, on the
    /// calling thread (each term is independent of the others, so any split at a multiple of 4
    /// bytes adds up to the same hash).
    fn hash_words(bytes: &[u8], start: u64) -> u64 = hash_words_body;
}

#[inline(always)]
fn hash_words_body(bytes: &[u8], start: u64) -> u64 {
    use crate::util::rng::{mix64, GAMMA};
    let words = bytes.chunks_exact(4);
    let tail = words.remainder();
    let mut acc = 0u64;
    let mut n = 0u64;
    for (i, w) in words.enumerate() {
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let pos = start.wrapping_add(i as u64);
        acc = acc.wrapping_add(mix64(u64::from(w) ^ pos.wrapping_mul(GAMMA)));
        n = i as u64 + 1;
    }
    if !tail.is_empty() {
        let mut b = [0u8; 4];
        b[..tail.len()].copy_from_slice(tail);
        let pos = start.wrapping_add(n);
        acc = acc.wrapping_add(mix64(
            u64::from(u32::from_le_bytes(b)) ^ pos.wrapping_mul(GAMMA),
        ));
    }
    acc
}

impl Gpu {
    /// [`hash_bytes_host`] of the device bytes `v`, on this device's stream (waits for it).
    pub fn hash_bytes(&self, v: &CudaView<'_, u8>, base: u64) -> Result<u64> {
        let mut out = self.alloc_zeroed::<u64>(1, "hash")?;
        self.hash_bytes_queued(v, base, &mut out)?;
        let h = self
            .stream()
            .clone_dtoh(&out)
            .context("cuda: reading a hash")?;
        match h.first() {
            Some(&h) => Ok(h),
            None => bail!("cuda: hash_bytes gave no value"),
        }
    }

    /// Queues [`hash_bytes_host`] of the device bytes `v` on this device's stream, added into
    /// `out`'s first value (zero it first; read it once the stream has passed this).
    pub fn hash_bytes_queued(
        &self,
        v: &CudaView<'_, u8>,
        base: u64,
        out: &mut CudaSlice<u64>,
    ) -> Result<()> {
        let n = v.len() as u64;
        if n == 0 {
            return Ok(());
        }
        if out.is_empty() {
            bail!("cuda: hash_bytes: no place for the hash");
        }
        let f = self.function("compare", COMPARE_SOURCE, "hash_bytes")?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(v).arg(&n).arg(&base).arg(out);
        // SAFETY: `v` holds n bytes, which the kernel reads below n only; `out` holds at least
        // one counter, the only one written; blocks are multiples of 32 threads (the warp
        // reduction needs whole warps).
        unsafe { b.launch(grid(self, n.div_ceil(4))) }.context("cuda: launching hash_bytes")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::{mix64, GAMMA};

    /// Where a span lies in an offer of a span that holds it, by hand; layers kept.
    #[test]
    fn spans_within_offers_and_layers_kept() {
        let s = |path: &str, offset, len| FileSpan {
            path: PathBuf::from(path),
            offset,
            len,
        };
        let offer = s("/m.gguf", 1000, 500);
        assert_eq!(within(&offer, 36, &s("/m.gguf", 1000, 500)), Some(36));
        assert_eq!(within(&offer, 36, &s("/m.gguf", 1250, 250)), Some(286));
        assert_eq!(within(&offer, 36, &s("/m.gguf", 1250, 251)), None);
        assert_eq!(within(&offer, 36, &s("/m.gguf", 999, 10)), None);
        assert_eq!(within(&offer, 36, &s("/n.gguf", 1000, 500)), None);
        assert_eq!(within(&offer, 0, &s("/m.gguf", u64::MAX, 2)), None);
        assert!(kept(4, 4) && kept(3, 4) && !kept(2, 4) && !kept(5, 4));
        assert!(kept(0, 0) && !kept(7, 0));
    }

    /// The hash by hand: two words and a tail of one byte.
    #[test]
    fn the_hash_by_hand() {
        let bytes = [1u8, 2, 3, 4, 0xff, 0, 0, 0x80, 7];
        let want = mix64(0x0403_0201 ^ 5u64.wrapping_mul(GAMMA))
            .wrapping_add(mix64(0x8000_00ff ^ 6u64.wrapping_mul(GAMMA)))
            .wrapping_add(mix64(7 ^ 7u64.wrapping_mul(GAMMA)));
        assert_eq!(hash_bytes_host(&bytes, 5), want);
        assert_eq!(hash_words(&bytes, 5), want);
        assert_eq!(hash_bytes_host(&[], 3), 0);
    }

    /// Split in tasks or not, every SIMD build: the same hash; one changed bit, two swapped words
    /// or another base change it.
    #[test]
    fn the_hash_is_its_words_and_positions() {
        use crate::quant::simd::{detected, with_cap, Level};
        let mut rng = crate::util::rng::SplitMix64::new(5);
        for n in [
            0usize,
            1,
            3,
            4,
            7,
            1000,
            HASH_TASK - 1,
            HASH_TASK + 5,
            3 * HASH_TASK + 2,
        ] {
            let bytes: Vec<u8> = (0..n).map(|_| (rng.next_u64() >> 56) as u8).collect();
            let h = hash_words(&bytes, 11);
            assert_eq!(hash_bytes_host(&bytes, 11), h, "{n}");
            for l in [Level::Base, Level::Avx2, Level::Avx512] {
                if l <= detected() {
                    assert_eq!(with_cap(l, || hash_bytes_host(&bytes, 11)), h, "{n} {l:?}");
                }
            }
            if n >= 8 {
                let mut b = bytes.clone();
                b[n / 2] ^= 0x10;
                assert_ne!(hash_bytes_host(&b, 11), h, "{n}");
                let mut b = bytes.clone();
                b.swap(0, 4);
                b.swap(1, 5);
                b.swap(2, 6);
                b.swap(3, 7);
                if b != bytes {
                    assert_ne!(hash_bytes_host(&b, 11), h, "{n}");
                }
                assert_ne!(hash_bytes_host(&bytes, 12), h, "{n}");
            }
        }
    }
}
