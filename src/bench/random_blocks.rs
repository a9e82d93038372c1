//! Deterministic random blocks of any GGML type with sane scales, for benchmarks.
//!
//! Every byte is random except the scale fields, which get finite values of moderate size
//! (an f16 `±(1 + m/1024) * 2^k` with `k` in -10..=0, an E8M0 exponent near 1, a UE4M3 byte
//! below the NaN code), so the blocks are valid and the output holds no NaN or Inf. This is
//! how ggml's own tests make K-quant and i-quant inputs (`tests/test-backend-ops.cpp` fills
//! random data; gguf-py `tests/test_quants.py` uses random bytes).
//! Field offsets follow the block structs of ggml `ggml/src/ggml-common.h`.

use crate::quant::draw::RandomDraw;
use crate::quant::GgmlType;
use crate::util::rng::SplitMix64;

/// Random bytes over all of `out`: one draw per whole 8-byte word, then one more draw for the
/// tail, used in part (or not at all when `out` is whole words). This draw count fixes the
/// bytes a seed gives.
fn fill_bytes(rng: &mut SplitMix64, out: &mut [u8]) {
    let words = out.len() - out.len() % 8;
    let (head, rest) = out.split_at_mut(words);
    rng.fill(head);
    let last = rng.next_u64().to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

/// A uniform integer in `lo..=hi` (`hi - lo` small; the modulo bias is irrelevant here).
fn range(rng: &mut SplitMix64, lo: u32, hi: u32) -> u32 {
    lo + (rng.next_u64() % u64::from(hi - lo + 1)) as u32
}

/// A 16-bit float as little-endian bytes: random sign, biased exponent in `exp.0..=exp.1`,
/// random mantissa of `mant_bits` (drawn in that order).
fn float16_bytes(rng: &mut SplitMix64, exp: (u32, u32), mant_bits: u32) -> [u8; 2] {
    let sign = range(rng, 0, 1) << 15;
    let e = range(rng, exp.0, exp.1) << mant_bits;
    let man = range(rng, 0, (1 << mant_bits) - 1);
    ((sign | e | man) as u16).to_le_bytes()
}

/// A sane f16 as little-endian bytes: `±(1 + m/1024) * 2^k`, `k` in -10..=0 (biased exponent
/// 5..=15).
fn f16_bytes(rng: &mut SplitMix64) -> [u8; 2] {
    float16_bytes(rng, (5, 15), 10)
}

/// Fills `out` (whole blocks of `ty`) with random valid blocks, drawn as `ty`'s row of the type
/// table says ([`RandomDraw`]).
pub fn fill_blocks(ty: GgmlType, rng: &mut SplitMix64, out: &mut [u8]) {
    fill_bytes(rng, out);
    let ts = ty.type_size();
    if ts == 0 {
        return;
    }
    match ty.info().random {
        // F16 `±(1 + m/1024) * 2^k`, BF16 `±(1 + m/128) * 2^k`, k in -10..=0.
        RandomDraw::Float16 { exp, mant_bits } => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&float16_bytes(rng, exp, mant_bits))),
        RandomDraw::UniformF32 => out.chunks_exact_mut(4).for_each(|c| {
            let v = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            c.copy_from_slice(&v.to_le_bytes());
        }),
        RandomDraw::UniformF64 => out.chunks_exact_mut(8).for_each(|c| {
            let v = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            c.copy_from_slice(&v.to_le_bytes());
        }),
        RandomDraw::Scaled(fields) => {
            for b in out.chunks_exact_mut(ts) {
                for &o in fields.f16 {
                    b[o..o + 2].copy_from_slice(&f16_bytes(rng));
                }
                for &o in fields.e8m0 {
                    b[o] = range(rng, 118, 136) as u8; // 2^-10 ..= 2^8
                }
                for &o in fields.ue4m3 {
                    b[o] = range(rng, 0, 0x7E) as u8;
                }
                for &(o, mask) in fields.clear {
                    b[o] &= !mask;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequant_fn, dequantize, TYPE_TABLE};

    #[test]
    fn random_blocks_dequantize_to_finite_values() {
        for row in TYPE_TABLE {
            if dequant_fn(row.ty).is_none() || row.ty == GgmlType::F64 {
                continue;
            }
            let n = 4096;
            let mut src = vec![0u8; n / row.block_size * row.type_size];
            fill_blocks(row.ty, &mut SplitMix64::new(7), &mut src);
            let mut y = vec![0f32; n];
            dequantize(row.ty, &src, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()), "{}", row.name);
        }
    }
}
