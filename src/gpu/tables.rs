//! The lookup tables of the CPU dequantizers as CUDA source: generated from the very arrays
//! `src/quant` uses (never copied by hand), prepended to the kernels before NVRTC compiles them.

use std::fmt::Write as _;

use crate::quant::{grids, legacy, small};

fn array<T: Copy>(out: &mut String, c_type: &str, name: &str, v: &[T], fmt: impl Fn(T) -> String) {
    let _ = write!(
        out,
        "static __device__ const {c_type} {name}[{}] = {{",
        v.len()
    );
    for (i, &x) in v.iter().enumerate() {
        if i % 8 == 0 {
            out.push_str("\n    ");
        }
        out.push_str(&fmt(x));
        out.push(',');
    }
    out.push_str("\n};\n");
}

/// A float as a C literal that parses back to the same f32 (hex float: exact by construction).
fn f32_literal(x: f32) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0f".into()
        } else {
            "0.0f".into()
        };
    }
    // C99 hex float: sign, 1.mantissa, binary exponent (subnormals as 0x0.m p-126).
    let bits = x.to_bits();
    let sign = if bits >> 31 == 1 { "-" } else { "" };
    let exp = ((bits >> 23) & 0xFF) as i32;
    let man = bits & 0x7F_FFFF;
    if exp == 0 {
        format!("{sign}0x0.{:06x}p-126f", man << 1)
    } else {
        format!("{sign}0x1.{:06x}p{}f", man << 1, exp - 127)
    }
}

/// The CUDA source of every table the dequant kernels read.
pub fn source() -> String {
    let mut s = String::from("// Generated from src/quant by src/gpu/tables.rs: do not edit.\n");
    let hex64 = |x: u64| format!("0x{x:016x}ull");
    let hex32 = |x: u32| format!("0x{x:08x}u");
    let hex8 = |x: u8| format!("0x{x:02x}");
    array(&mut s, "u8", "kmask_iq2xs", &grids::KMASK_IQ2XS, hex8);
    array(&mut s, "u8", "ksigns_iq2xs", &grids::KSIGNS_IQ2XS, hex8);
    array(&mut s, "u64", "iq2xxs_grid", &grids::IQ2XXS_GRID, hex64);
    array(&mut s, "u64", "iq2xs_grid", &grids::IQ2XS_GRID, hex64);
    array(&mut s, "u64", "iq2s_grid", &grids::IQ2S_GRID, hex64);
    array(&mut s, "u32", "iq3xxs_grid", &grids::IQ3XXS_GRID, hex32);
    array(&mut s, "u32", "iq3s_grid", &grids::IQ3S_GRID, hex32);
    array(&mut s, "u64", "iq1s_grid", &grids::IQ1S_GRID, hex64);
    array(&mut s, "i8", "kvalues_iq4nl", &legacy::KVALUES_IQ4NL, |x| {
        x.to_string()
    });
    array(
        &mut s,
        "float",
        "kvalues_mxfp4",
        &small::KVALUES_MXFP4,
        f32_literal,
    );
    array(
        &mut s,
        "float",
        "ue4m3_half",
        &small::UE4M3_HALF,
        f32_literal,
    );
    array(&mut s, "u8", "pow3", &small::POW3, hex8);
    let _ = writeln!(
        s,
        "static __device__ const float IQ1S_DELTA = {};",
        f32_literal(grids::IQ1S_DELTA)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_are_exact_hex_floats() {
        assert_eq!(f32_literal(1.0), "0x1.000000p0f");
        assert_eq!(f32_literal(-12.0), "-0x1.800000p3f");
        assert_eq!(f32_literal(0.125), "0x1.000000p-3f");
        // The smallest subnormal: 2^-149 = 0x0.000002p-126.
        assert_eq!(f32_literal(f32::from_bits(1)), "0x0.000002p-126f");
        assert_eq!(f32_literal(-0.0), "-0.0f");
    }

    #[test]
    fn every_table_is_generated() {
        let s = source();
        for name in [
            "kmask_iq2xs[8]",
            "ksigns_iq2xs[128]",
            "iq2xxs_grid[256]",
            "iq2xs_grid[512]",
            "iq2s_grid[1024]",
            "iq3xxs_grid[256]",
            "iq3s_grid[512]",
            "iq1s_grid[2048]",
            "kvalues_iq4nl[16]",
            "kvalues_mxfp4[16]",
            "ue4m3_half[256]",
            "pow3[5]",
            "IQ1S_DELTA",
        ] {
            assert!(s.contains(name), "{name}");
        }
    }
}
