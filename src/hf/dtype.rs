//! Hugging Face safetensors element types and their conversion to f32.
//!
//! Formats: huggingface/safetensors `safetensors/src/tensor.rs` (`Dtype` names), IEEE 754 binary16,
//! bfloat16 (the top 16 bits of an f32) and OCP FP8 E4M3 "fn" (bias 7, no infinities, `S.1111.111`
//! is NaN, largest finite 448), as PyTorch's `torch.float8_e4m3fn` stores it.

/// The element type of a safetensors tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
    /// FP8 E4M3 (`F8_E4M3`), with a block scale (`weight_scale_inv`) where the checkpoint has one.
    F8E4M3,
    /// Any other dtype the header names (`F64`, `I64`, `F8_E5M2`, ...): listed, never read.
    Other(String),
}

impl Dtype {
    /// The dtype spelled `s` in a safetensors header.
    pub fn parse(s: &str) -> Dtype {
        match s {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "F8_E4M3" => Dtype::F8E4M3,
            other => Dtype::Other(other.to_string()),
        }
    }

    /// The header spelling.
    pub fn name(&self) -> &str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::Other(s) => s,
        }
    }

    /// Bytes per element, or `None` for a dtype glmdiff does not read.
    pub fn size(&self) -> Option<u64> {
        match self {
            Dtype::F32 => Some(4),
            Dtype::F16 | Dtype::BF16 => Some(2),
            Dtype::F8E4M3 => Some(1),
            Dtype::Other(s) => other_size(s),
        }
    }

    /// Whether glmdiff converts this dtype to f32.
    pub fn readable(&self) -> bool {
        !matches!(self, Dtype::Other(_))
    }
}

/// Sizes of the dtypes glmdiff does not convert (for checking header offsets only).
fn other_size(s: &str) -> Option<u64> {
    Some(match s {
        "F64" | "I64" | "U64" => 8,
        "I32" | "U32" => 4,
        "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E5M2" | "F8_E8M0" => 1,
        _ => return None,
    })
}

/// FP8 E4M3fn to f32 for every byte (exact: every E4M3 value is an f32).
pub const E4M3_TO_F32: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
};

/// One E4M3fn byte as f32: `(-1)^s * 2^(e-7) * (1 + m/8)`, subnormal `(-1)^s * 2^-6 * m/8`,
/// `0x7F`/`0xFF` NaN.
const fn e4m3_to_f32(x: u8) -> f32 {
    let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((x >> 3) & 0xF) as i32;
    let m = (x & 7) as f32;
    if e == 15 && x & 7 == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * pow2(-6)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    sign * v
}

/// `2^k` for `-126 <= k <= 127`.
const fn pow2(k: i32) -> f32 {
    f32::from_bits(((127 + k) as u32) << 23)
}

/// Converts little-endian `bytes` of `dtype` to f32, appending to `out`.
/// `dtype` must be readable; the caller checked the byte count.
pub fn extend_f32(dtype: &Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        Dtype::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        Dtype::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        ),
        Dtype::F8E4M3 => out.extend(bytes.iter().map(|&b| E4M3_TO_F32[usize::from(b)])),
        Dtype::Other(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values checked by hand against the OCP FP8 specification's E4M3 table.
    #[test]
    fn e4m3_values_by_hand() {
        assert_eq!(E4M3_TO_F32[0x00], 0.0);
        assert_eq!(E4M3_TO_F32[0x38], 1.0); // e=7, m=0
        assert_eq!(E4M3_TO_F32[0x7E], 448.0); // e=15, m=6: largest finite
        assert_eq!(E4M3_TO_F32[0x01], 2f32.powi(-9)); // smallest subnormal
        assert_eq!(E4M3_TO_F32[0xC0], -2.0);
        assert!(E4M3_TO_F32[0x7F].is_nan() && E4M3_TO_F32[0xFF].is_nan());
    }

    #[test]
    fn half_types_convert_exactly() {
        let mut out = Vec::new();
        extend_f32(&Dtype::BF16, &[0x80, 0x3F, 0x00, 0xC0], &mut out);
        extend_f32(&Dtype::F16, &[0x00, 0x3C, 0x01, 0x00], &mut out);
        assert_eq!(out, vec![1.0, -2.0, 1.0, 2f32.powi(-24)]);
    }
}
