//! Number formats ([`Dtype`]) and compute precisions ([`Precision`]): how an engine stores values
//! and accumulates sums, which the tolerance floors of `compare::floors` read.
//!
//! Engines declare their precision typed (`Engine::precision`); its [`Display`](fmt::Display)
//! is the prose written into trace metadata, reports and step cases
//! (`f32 storage, f64 accumulation`). [`Precision::parse`] is for text from outside only: the
//! `dtype` of a trace written by another engine, `--precision` flags, step case files.
//!
//! Imports nothing from the crate.

use std::fmt;

use serde::Serialize;

/// A number format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE binary64.
    F64,
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// FP8 E4M3.
    Fp8,
}

impl Dtype {
    /// Unit roundoff (half an ulp relative to 1): `2^-(mantissa bits + 1)`.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F64 => 2f64.powi(-53),
            Dtype::F32 => 2f64.powi(-24),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::Fp8 => 2f64.powi(-4),
        }
    }

    /// Parses a dtype word (`f32`, `float32`, `bf16`, `bfloat16`, `fp8`, `float8_e4m3fn`, ...).
    pub fn parse(word: &str) -> Option<Dtype> {
        let w = word
            .trim()
            .trim_start_matches("torch.")
            .to_ascii_lowercase();
        Some(match w.as_str() {
            "f64" | "float64" | "fp64" | "double" => Dtype::F64,
            "f32" | "float32" | "fp32" | "float" | "tf32" => Dtype::F32,
            "f16" | "float16" | "fp16" | "half" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp8" | "f8" | "e4m3" | "float8" | "float8_e4m3fn" | "fp8_e4m3" => Dtype::Fp8,
            _ => return None,
        })
    }

    /// The word used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine's compute precision: storage of values and accumulation of sums.
///
/// Displayed as `{storage} storage, {accumulate} accumulation`, then `, q8_1 activations` when
/// activations are quantized, then ` ({note})` when there is a note: text that
/// [`Precision::parse`] reads back to the same storage, accumulation and activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Precision {
    /// Storage of activations and weights.
    pub storage: Dtype,
    /// Accumulators (f32 for every low-precision engine; f64 where said).
    pub accumulate: Dtype,
    /// Activations are quantized to 8 bits when multiplied with a block-quantized weight.
    pub q8_activations: bool,
    /// How the engine computes, in words, for its description only (`cuBLAS SGEMM, pedantic
    /// math: no TF32; absorbed MLA`); nothing decides on it.
    pub note: Option<&'static str>,
}

impl Precision {
    /// The CPU reference: f32 storage, f64 accumulation.
    pub const REFERENCE: Precision = Precision::new(Dtype::F32, Dtype::F64);

    /// Storage `storage` and accumulation `accumulate`, activations not quantized, no note.
    pub const fn new(storage: Dtype, accumulate: Dtype) -> Precision {
        Precision {
            storage,
            accumulate,
            q8_activations: false,
            note: None,
        }
    }

    /// The same precision with `note` (how the engine computes, in words).
    pub const fn with_note(self, note: &'static str) -> Precision {
        Precision {
            note: Some(note),
            ..self
        }
    }

    /// From text written outside this engine (a trace's `dtype`, a `--precision` flag, a step
    /// case): its first word is the storage precision; `f64 accumulation` anywhere in it makes
    /// sums f64 (as the CPU reference says `f32 storage, f64 accumulation`), f32 otherwise
    /// (f64 storage accumulates in f64); `q8` anywhere declares 8-bit activations. The note is
    /// not kept. `None` when the first word is not a known dtype.
    pub fn parse(text: &str) -> Option<Precision> {
        let first = text
            .split(|c: char| c.is_whitespace() || c == ',')
            .find(|w| !w.is_empty())?;
        let storage = Dtype::parse(first)?;
        let lower = text.to_ascii_lowercase();
        let accumulate = if storage == Dtype::F64
            || lower.contains("f64 accumulation")
            || lower.contains("float64 accumulation")
        {
            Dtype::F64
        } else {
            Dtype::F32
        };
        Some(Precision {
            storage,
            accumulate,
            q8_activations: lower.contains("q8"),
            note: None,
        })
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} storage, {} accumulation",
            self.storage, self.accumulate
        )?;
        if self.q8_activations {
            f.write_str(", q8_1 activations")?;
        }
        if let Some(note) = self.note {
            write!(f, " ({note})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_from_engine_dtype_strings() {
        let cpu = Precision::parse("f32 storage, f64 accumulation").unwrap();
        assert_eq!((cpu.storage, cpu.accumulate), (Dtype::F32, Dtype::F64));
        let hf = Precision::parse("float64").unwrap();
        assert_eq!((hf.storage, hf.accumulate), (Dtype::F64, Dtype::F64));
        let bf = Precision::parse("bf16 weights and activations, f32 accumulation").unwrap();
        assert_eq!((bf.storage, bf.accumulate), (Dtype::Bf16, Dtype::F32));
        assert_eq!(
            Precision::parse("torch.bfloat16").unwrap().storage,
            Dtype::Bf16
        );
        assert!(Precision::parse("int4").is_none());
        assert!(Precision::parse("").is_none());
    }

    /// The prose of a precision is the text written before the types existed (trace metadata
    /// of the CPU reference and of both CUDA precisions), and reads back to the same storage,
    /// accumulation and activations for every combination.
    #[test]
    fn precision_prose_is_the_written_text_and_reads_back() {
        assert_eq!(
            Precision::REFERENCE.to_string(),
            "f32 storage, f64 accumulation"
        );
        let sgemm = Precision::new(Dtype::F32, Dtype::F32)
            .with_note("cuBLAS SGEMM, pedantic math: no TF32; absorbed MLA");
        assert_eq!(
            sgemm.to_string(),
            "f32 storage, f32 accumulation (cuBLAS SGEMM, pedantic math: no TF32; absorbed MLA)"
        );
        let all = [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::Bf16, Dtype::Fp8];
        for storage in all {
            for accumulate in [Dtype::F64, Dtype::F32] {
                if storage == Dtype::F64 && accumulate != Dtype::F64 {
                    continue; // parse reads f64 storage as f64 sums
                }
                for q8 in [false, true] {
                    let p = Precision {
                        q8_activations: q8,
                        ..Precision::new(storage, accumulate).with_note("a note")
                    };
                    let back = Precision::parse(&p.to_string()).unwrap();
                    assert_eq!(back, Precision { note: None, ..p }, "{p}");
                }
            }
        }
    }
}
