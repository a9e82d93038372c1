//! Deterministic random blocks of any GGML type with sane scales, for benchmarks.
//!
//! Every byte is random except the scale fields, which get finite values of moderate size
//! (an f16 `±(1 + m/1024) * 2^k` with `k` in -10..=0, an E8M0 exponent near 1, a UE4M3 byte
//! below the NaN code), so the blocks are valid and the output holds no NaN or Inf. This is
//! how ggml's own tests make K-quant and i-quant inputs (`tests/test-backend-ops.cpp` fills
//! random data; gguf-py `tests/test_quants.py` uses random bytes).
//! Field offsets follow the block structs of ggml `ggml/src/ggml-common.h`.

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

/// A sane f16 as little-endian bytes: `±(1 + m/1024) * 2^k`, `k` in -10..=0.
fn f16_bytes(rng: &mut SplitMix64) -> [u8; 2] {
    let sign = range(rng, 0, 1) << 15;
    let exp = range(rng, 5, 15) << 10; // biased exponent 5..=15 -> 2^-10..=2^0
    let man = range(rng, 0, 1023);
    ((sign | exp | man) as u16).to_le_bytes()
}

/// Where a block keeps its scales: offsets of f16 fields, and the special one-byte scales.
struct ScaleFields {
    /// Byte offsets of f16 scales (`d`, `dmin`, `m`) inside the block.
    f16: &'static [usize],
    /// Byte offsets of E8M0 exponents (MXFP4 `e`).
    e8m0: &'static [usize],
    /// Byte offsets of UE4M3 scales (NVFP4 `d[4]`).
    ue4m3: &'static [usize],
}

/// The scale fields of `ty` (ggml `src/ggml-common.h` block structs).
fn scale_fields(ty: GgmlType) -> ScaleFields {
    use GgmlType as T;
    let f16: &'static [usize] = match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::IQ4_XS => &[0],
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => &[0, 2],
        T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S | T::IQ1_S => &[0],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::Q6_K => &[208],
        T::TQ1_0 => &[52],
        T::TQ2_0 => &[64],
        _ => &[],
    };
    let e8m0: &'static [usize] = if ty == T::MXFP4 { &[0] } else { &[] };
    let ue4m3: &'static [usize] = if ty == T::NVFP4 { &[0, 1, 2, 3] } else { &[] };
    ScaleFields { f16, e8m0, ue4m3 }
}

/// IQ1_M assembles its f16 scale from the top nibbles of four u16 sub-scales at bytes 48..56;
/// bit 14 of the f16 (the exponent's top bit) is bit 6 of byte 55. Clearing it keeps |d| < 2.
const IQ1_M_SCALE_EXP_TOP_BYTE: usize = 55;
const IQ1_M_SCALE_EXP_TOP_MASK: u8 = 0x40;

/// Fills `out` (whole blocks of `ty`) with random valid blocks.
pub fn fill_blocks(ty: GgmlType, rng: &mut SplitMix64, out: &mut [u8]) {
    use GgmlType as T;
    fill_bytes(rng, out);
    let ts = ty.type_size();
    if ts == 0 {
        return;
    }
    match ty {
        T::F16 => out
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&f16_bytes(rng))),
        T::BF16 => out.chunks_exact_mut(2).for_each(|c| {
            // bf16 `±(1 + m/128) * 2^k`, k in -10..=0: biased exponent 117..=127.
            let bits = (range(rng, 0, 1) << 15) | (range(rng, 117, 127) << 7) | range(rng, 0, 127);
            c.copy_from_slice(&(bits as u16).to_le_bytes());
        }),
        T::F32 => out.chunks_exact_mut(4).for_each(|c| {
            let v = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            c.copy_from_slice(&v.to_le_bytes());
        }),
        T::F64 => out.chunks_exact_mut(8).for_each(|c| {
            let v = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            c.copy_from_slice(&v.to_le_bytes());
        }),
        _ => {
            let fields = scale_fields(ty);
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
                if ty == T::IQ1_M {
                    b[IQ1_M_SCALE_EXP_TOP_BYTE] &= !IQ1_M_SCALE_EXP_TOP_MASK;
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
