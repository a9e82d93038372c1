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
    /// TensorFloat-32: binary32's range with a 10-bit mantissa, the format tensor cores round
    /// the operands of an f32 matrix product to (sums stay f32). A format of product operands
    /// only ([`Dtype::is_operand_format`]).
    Tf32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// FP8 E4M3 (with a scale per row or block, as FP8 GEMMs and FP8 indexers use it). A format
    /// of product operands only ([`Dtype::is_operand_format`]).
    Fp8,
}

impl Dtype {
    /// Unit roundoff (half an ulp relative to 1): `2^-(mantissa bits + 1)`.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F64 => 2f64.powi(-53),
            Dtype::F32 => 2f64.powi(-24),
            Dtype::Tf32 => 2f64.powi(-11),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
            Dtype::Fp8 => 2f64.powi(-4),
        }
    }

    /// Whether this is a format engines round the operands of matrix products to, never what
    /// they keep values in between steps: tf32 (tensor cores on f32 data) and fp8 (FP8 GEMMs
    /// and indexers, whose outputs are bf16 or f32).
    pub fn is_operand_format(self) -> bool {
        matches!(self, Dtype::Tf32 | Dtype::Fp8)
    }

    /// Parses a dtype word (`f32`, `float32`, `tf32`, `bf16`, `bfloat16`, `fp8`,
    /// `float8_e4m3fn`, ...).
    pub fn parse(word: &str) -> Option<Dtype> {
        let w = word
            .trim()
            .trim_start_matches("torch.")
            .to_ascii_lowercase();
        Some(match w.as_str() {
            "f64" | "float64" | "fp64" | "double" => Dtype::F64,
            "f32" | "float32" | "fp32" | "float" => Dtype::F32,
            "tf32" | "tensorfloat32" | "tensorfloat-32" => Dtype::Tf32,
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
            Dtype::Tf32 => "tf32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }

    /// Whether `x` is exactly representable in this format (NaN and infinities are, in every
    /// format that has them; f16 also needs `x` within its range). The operand formats and f64
    /// hold every f32 value as far as a trace can tell (tf32 and fp8 values are never stored as
    /// such).
    pub fn holds(self, x: f32) -> bool {
        match self {
            Dtype::Bf16 => x.to_bits() & 0xffff == 0,
            Dtype::F16 => !x.is_finite() || (half::f16::from_f32(x).to_f32() == x),
            Dtype::F64 | Dtype::F32 | Dtype::Tf32 | Dtype::Fp8 => true,
        }
    }
}
/// The coarsest storage format of bf16, f16 and f32 that holds every value of `values` exactly,
/// or `None` when no value tells (every one is zero, NaN or infinite): what a tensor written by
/// an engine of unknown precision says about that precision.
pub fn storage_of_values(values: &[f32]) -> Option<Dtype> {
    let telling = |x: &&f32| x.is_finite() && **x != 0.0;
    if !values.iter().any(|x| telling(&x)) {
        return None;
    }
    [Dtype::Bf16, Dtype::F16]
        .into_iter()
        .find(|d| values.iter().all(|&x| d.holds(x)))
        .or(Some(Dtype::F32))
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The router's precision when it differs from the engine's storage: the router's logits,
/// probabilities and weights are computed (inputs, arithmetic, outputs) in `compute`, from its
/// matrix `ffn_gate_inp` held in `matrix`.
///
/// The CUDA engine's bf16 mode keeps the whole router in f32 (`Engine::router_logits`' rule):
/// `compute` and `matrix` f32. transformers in bf16 casts its bf16-loaded matrix to f32 and
/// computes the router in f32: `compute` f32, `matrix` bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Router {
    /// Inputs, arithmetic and outputs of the router (logits, probabilities, weights).
    pub compute: Dtype,
    /// The router matrix's values.
    pub matrix: Dtype,
}

/// An engine's compute precision: storage of values and accumulation of sums, the operands of
/// matrix products when they are rounded coarser than storage, and the router when it runs
/// finer than storage.
///
/// Displayed as `{storage} storage, {accumulate} accumulation`, then `, {operands} products`
/// when products round their operands coarser (tf32, fp8), `, q8_1 activations` when
/// activations are quantized, `, {compute} router` (with ` from a {matrix} matrix` when the
/// matrix is coarser) when the router runs finer than storage, then ` ({note})` when there is a
/// note: text that [`Precision::parse`] reads back to the same precision but the note.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Precision {
    /// Storage of activations and weights between steps (never an operand format: tf32 and fp8
    /// are [`Precision::operands`]).
    pub storage: Dtype,
    /// Accumulators (f32 for every low-precision engine; f64 where said).
    pub accumulate: Dtype,
    /// The format the operands of matrix products are rounded to when coarser than storage
    /// (tf32 on tensor cores, fp8 for FP8 GEMMs and indexers); `None`: storage.
    pub operands: Option<Dtype>,
    /// Activations are quantized to 8 bits when multiplied with a block-quantized weight.
    pub q8_activations: bool,
    /// The router's precision when finer than storage; `None`: storage.
    pub router: Option<Router>,
    /// How the engine computes, in words, for its description only (`cuBLAS SGEMM, pedantic
    /// math: no TF32; absorbed MLA`); nothing decides on it.
    pub note: Option<&'static str>,
}

impl Precision {
    /// The CPU reference: f32 storage, f64 accumulation.
    pub const REFERENCE: Precision = Precision::new(Dtype::F32, Dtype::F64);

    /// Storage `storage` and accumulation `accumulate`, operands as stored, activations not
    /// quantized, the router as stored, no note.
    pub const fn new(storage: Dtype, accumulate: Dtype) -> Precision {
        Precision {
            storage,
            accumulate,
            operands: None,
            q8_activations: false,
            router: None,
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

    /// The same precision with the router computed in `compute` from its matrix held in
    /// `matrix`.
    pub const fn with_router(self, compute: Dtype, matrix: Dtype) -> Precision {
        Precision {
            router: Some(Router { compute, matrix }),
            ..self
        }
    }

    /// The precision a lone dtype word names: its storage, f32 accumulation (f64 for f64);
    /// an operand format (tf32, fp8) names the operands of products over the storage engines
    /// keep beside it: f32 under tf32 (tensor cores on f32 data), bf16 under fp8 (FP8 GEMMs and
    /// indexers write bf16 or f32 and keep activations in bf16 between steps).
    pub fn of_dtype(d: Dtype) -> Precision {
        match d {
            Dtype::Tf32 => Precision {
                operands: Some(Dtype::Tf32),
                ..Precision::new(Dtype::F32, Dtype::F32)
            },
            Dtype::Fp8 => Precision {
                operands: Some(Dtype::Fp8),
                ..Precision::new(Dtype::Bf16, Dtype::F32)
            },
            Dtype::F64 => Precision::new(Dtype::F64, Dtype::F64),
            d => Precision::new(d, Dtype::F32),
        }
    }

    /// From text written outside this engine (a trace's `dtype`, a `--precision` flag, a step
    /// case). `None` when the first word is not a known dtype. Read from it:
    ///
    /// - the first word: the storage ([`Precision::of_dtype`]: `tf32` and `fp8` name the
    ///   operands of products over f32 and bf16 storage);
    /// - `f64 accumulation` anywhere: sums in f64 (f64 storage accumulates in f64); `f16
    ///   accumulation` or `bf16 accumulation`: sums in that format; else f32;
    /// - `X products`: operands rounded to X where X is coarser than the storage;
    /// - `q8` anywhere: 8-bit activations;
    /// - the router: `X router` (`from a Y matrix` after it: the matrix in Y, else in X), or,
    ///   in an engine's own prose, a clause (between `;`, `,`, `(` and `)`) that names the
    ///   router and a dtype (`router and indexer scores f32 as transformers computes them`):
    ///   computed in that dtype from a matrix as stored (the cautious reading: prose that says
    ///   the router's outputs are f32 does not say its matrix was kept finer than the weights).
    ///   Kept only when finer than the storage.
    ///
    /// The note is not kept.
    pub fn parse(text: &str) -> Option<Precision> {
        let words = |t: &str| -> Vec<String> {
            t.split(|c: char| c.is_whitespace() || matches!(c, ',' | '=' | ':' | ';' | '(' | ')'))
                .filter(|w| !w.is_empty())
                .map(str::to_ascii_lowercase)
                .collect()
        };
        let all = words(text);
        let mut p = Precision::of_dtype(Dtype::parse(all.first()?)?);
        let lower = text.to_ascii_lowercase();
        if p.storage == Dtype::F64
            || lower.contains("f64 accumulation")
            || lower.contains("float64 accumulation")
        {
            p.accumulate = Dtype::F64;
        }
        let finer = |a: Dtype, b: Dtype| a.unit_roundoff() < b.unit_roundoff();
        for w in all.windows(2) {
            // `f16 accumulation`, `bf16 accumulation`: sums kept in that format (cuBLAS's
            // half-precision compute type), coarser than the f32 every other engine keeps.
            if w[1] == "accumulation" {
                if let Some(d @ (Dtype::F16 | Dtype::Bf16)) = Dtype::parse(&w[0]) {
                    p.accumulate = d;
                }
            }
            if w[1] == "products" {
                if let Some(d) = Dtype::parse(&w[0]) {
                    if finer(p.storage, d) {
                        p.operands = Some(d);
                    }
                }
            }
        }
        p.q8_activations = lower.contains("q8");
        // Per clause: `X router[ from a Y matrix]`, as written by Display, else a clause of
        // prose that names the router and a dtype.
        let clauses: Vec<Vec<String>> = lower.split([';', ',', '(', ')']).map(words).collect();
        let displayed = |c: &Vec<String>| -> Option<Router> {
            let i = c.iter().position(|w| w == "router")?;
            let compute = Dtype::parse(c.get(i.checked_sub(1)?)?)?;
            let matrix = match c.get(i + 1..i + 5) {
                Some([from, a, m, matrix]) if from == "from" && a == "a" && matrix == "matrix" => {
                    Dtype::parse(m).unwrap_or(compute)
                }
                _ => compute,
            };
            Some(Router { compute, matrix })
        };
        let prose = |c: &Vec<String>| -> Option<Router> {
            if !c.iter().any(|w| w == "router") {
                return None;
            }
            let compute = c.iter().find_map(|w| Dtype::parse(w))?;
            Some(Router {
                compute,
                matrix: p.storage,
            })
        };
        let router = clauses
            .iter()
            .find_map(displayed)
            .or_else(|| clauses.iter().find_map(prose));
        p.router = router.filter(|r| finer(r.compute, p.storage));
        Some(p)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} storage, {} accumulation",
            self.storage, self.accumulate
        )?;
        if let Some(o) = self.operands {
            write!(f, ", {o} products")?;
        }
        if self.q8_activations {
            f.write_str(", q8_1 activations")?;
        }
        if let Some(r) = self.router {
            write!(f, ", {} router", r.compute)?;
            if r.matrix != r.compute {
                write!(f, " from a {} matrix", r.matrix)?;
            }
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
    /// accumulation, operands, activations and router for every combination.
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
        let storages = [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::Bf16];
        for storage in storages {
            for accumulate in [Dtype::F64, Dtype::F32] {
                if storage == Dtype::F64 && accumulate != Dtype::F64 {
                    continue; // parse reads f64 storage as f64 sums
                }
                let coarser = |d: Dtype| d.unit_roundoff() > storage.unit_roundoff();
                let operands = [None, Some(Dtype::Tf32), Some(Dtype::Fp8)]
                    .into_iter()
                    .filter(|o| o.is_none_or(coarser));
                for operands in operands {
                    let routers = storages
                        .iter()
                        .filter(|&&c| !coarser(c) && c != storage)
                        .flat_map(|&c| [(c, c), (c, storage)])
                        .map(|(c, m)| {
                            Some(Router {
                                compute: c,
                                matrix: m,
                            })
                        })
                        .chain([None]);
                    for router in routers {
                        for q8 in [false, true] {
                            let p = Precision {
                                operands,
                                q8_activations: q8,
                                router,
                                ..Precision::new(storage, accumulate).with_note("a note")
                            };
                            let back = Precision::parse(&p.to_string()).unwrap();
                            assert_eq!(back, Precision { note: None, ..p }, "{p}");
                        }
                    }
                }
            }
        }
    }

    /// llama.cpp's CUDA backend multiplies F16 weights through cuBLAS's half compute type:
    /// f16 operands, f16 sums; its dtype text reads back to the same precision.
    #[test]
    fn half_accumulation() {
        let p = Precision::parse("f32 storage, f16 accumulation, f16 products").unwrap();
        assert_eq!(
            (p.storage, p.accumulate, p.operands),
            (Dtype::F32, Dtype::F16, Some(Dtype::F16))
        );
        assert_eq!(Precision::parse(&p.to_string()), Some(p));
        let q = Precision::parse("f32 storage, f32 accumulation, tf32 products, q8 activations")
            .unwrap();
        assert_eq!(
            (q.accumulate, q.operands, q.q8_activations),
            (Dtype::F32, Some(Dtype::Tf32), true)
        );
    }

    /// tf32 is f32 storage whose products round their operands to a 10-bit mantissa, not f32;
    /// fp8 is bf16 storage with fp8 operands (an FP8 engine keeps activations in bf16).
    #[test]
    fn operand_formats_are_not_storage() {
        let tf32 = Precision::parse("tf32").unwrap();
        assert_eq!(
            (tf32.storage, tf32.operands, tf32.accumulate),
            (Dtype::F32, Some(Dtype::Tf32), Dtype::F32)
        );
        assert_ne!(tf32, Precision::parse("f32").unwrap());
        assert_eq!(Dtype::Tf32.unit_roundoff(), 2f64.powi(-11));
        let fp8 = Precision::parse("fp8").unwrap();
        assert_eq!((fp8.storage, fp8.operands), (Dtype::Bf16, Some(Dtype::Fp8)));
        assert_eq!(
            fp8.to_string(),
            "bf16 storage, f32 accumulation, fp8 products"
        );
        // "products" naming a format finer than storage says nothing.
        assert_eq!(
            Precision::parse("bf16 storage, f32 products")
                .unwrap()
                .operands,
            None
        );
    }

    /// The router's precision from an engine's prose (transformers' dumps), from Display's
    /// words, and only when finer than the storage.
    #[test]
    fn router_precision_from_prose() {
        let dump = "bf16 weights and activations (transformers from_pretrained dtype=bfloat16; router and indexer scores f32 as transformers computes them)";
        let p = Precision::parse(dump).unwrap();
        assert_eq!(p.storage, Dtype::Bf16);
        assert_eq!(
            p.router,
            Some(Router {
                compute: Dtype::F32,
                matrix: Dtype::Bf16
            })
        );
        let cuda = Precision::new(Dtype::Bf16, Dtype::F32).with_router(Dtype::F32, Dtype::F32);
        assert_eq!(
            cuda.to_string(),
            "bf16 storage, f32 accumulation, f32 router"
        );
        assert_eq!(Precision::parse("bf16, bf16 router").unwrap().router, None);
        assert_eq!(Precision::parse("f32; router f32").unwrap().router, None);
        assert_eq!(
            Precision::parse("bf16; no router_bf16 here")
                .unwrap()
                .router,
            None
        );
    }

    #[test]
    fn storage_from_values() {
        assert_eq!(storage_of_values(&[0.0, f32::NAN]), None);
        assert_eq!(storage_of_values(&[1.5, 0.0, -2.0]), Some(Dtype::Bf16));
        assert_eq!(
            storage_of_values(&[1.5, 1.0 + 2f32.powi(-10)]),
            Some(Dtype::F16)
        );
        assert_eq!(
            storage_of_values(&[1.5, 1.0 + 2f32.powi(-20)]),
            Some(Dtype::F32)
        );
        assert_eq!(storage_of_values(&[0.1]), Some(Dtype::F32));
    }

    /// Exactness of f32 values in the narrower formats.
    #[test]
    fn formats_hold_their_own_values() {
        assert!(
            Dtype::Bf16.holds(1.5)
                && Dtype::Bf16.holds(-(2f32.powi(100)))
                && Dtype::Bf16.holds(0.0)
        );
        assert!(!Dtype::Bf16.holds(1.0 + 2f32.powi(-10)));
        assert!(Dtype::F16.holds(1.0 + 2f32.powi(-10)) && !Dtype::F16.holds(1.0 + 2f32.powi(-11)));
        assert!(!Dtype::F16.holds(1.0e6) && Dtype::F16.holds(f32::INFINITY));
        assert!(Dtype::F32.holds(0.1));
    }
}
