//! The table of GGML tensor types: id, name, block size, bytes per block, and every per-type
//! fact the rest of glmdiff needs (the dequantizer, the CUDA kernel, the rounding-error model,
//! how random blocks are drawn), so that adding a type is one row plus its dequantizer.
//!
//! One row per id in ggml's `include/ggml.h` (`enum ggml_type`), including the ids that ggml
//! removed (so a file carrying one gets an error that says "removed", not "unknown") and the
//! activation-only types (Q8_1, Q8_K) that never appear as weights. Sizes follow
//! `src/ggml-common.h` (static_asserts on every block struct) and gguf-py's `GGML_QUANT_SIZES`.

use std::fmt;

use super::draw::{Codes, RandomDraw, ScaleFields, SynthDraw};
use super::noise::NoiseModel;
use super::{float, iquants, kquants, legacy, small, DequantFn};

/// What glmdiff can do with tensors of a type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeStatus {
    /// Dequantized (or converted) to f32 by [`crate::quant::dequantize`].
    Dequant,
    /// Integer storage (I8/I16/I32/I64): readable as integers and converted to f32 on request.
    Integer,
    /// Known layout but no dequantization here (activation-only formats, newest ids).
    NoDequant,
    /// The id was removed from ggml; files that use it are from an obsolete tool.
    Removed,
}

/// A GGML tensor type. The discriminant is the id stored in GGUF tensor infos.
#[allow(non_camel_case_types, missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q4_2 = 4,
    Q4_3 = 5,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    Q4_0_4_4 = 31,
    Q4_0_4_8 = 32,
    Q4_0_8_8 = 33,
    TQ1_0 = 34,
    TQ2_0 = 35,
    IQ4_NL_4_4 = 36,
    IQ4_NL_4_8 = 37,
    IQ4_NL_8_8 = 38,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
}

/// One row of the type table.
#[derive(Clone, Copy, Debug)]
pub struct TypeInfo {
    /// The type.
    pub ty: GgmlType,
    /// Name as ggml and gguf-py spell it (`Q4_K`, `IQ2_XS`, `BF16`).
    pub name: &'static str,
    /// Elements per block (1 for scalar types).
    pub block_size: usize,
    /// Bytes per block (0 for removed types, whose layout is not supported).
    pub type_size: usize,
    /// What glmdiff can do with it.
    pub status: TypeStatus,
    /// The CPU dequantizer (`None` where glmdiff has none: activation-only, removed, Q1_0).
    pub dequant: Option<DequantFn>,
    /// The stem of the CUDA dequant kernels `dequant_<stem>_<format>` in `cuda/dequant.cu`
    /// (`None` where there is no kernel); `cuda` builds the name.
    pub kernel: Option<&'static str>,
    /// The expected rounding error of the type ([`crate::quant::noise`]); `None`: no model.
    pub noise: Option<NoiseModel>,
    /// How `synth` draws blocks of a chosen spread; `None`: `synth` cannot write the type.
    pub synth: Option<SynthDraw>,
    /// How `bench` draws random blocks with sane scales.
    pub random: RandomDraw,
    /// The type a quantizer writes instead when a tensor's rows (`ne[0]`) are not whole blocks
    /// of this one (llama.cpp `src/llama-quant.cpp`, `llama_tensor_get_type`'s
    /// `nx % QK_K != 0` fallbacks), as `synth` follows it; `None` (every type with blocks
    /// shorter than `QK_K`): F16.
    pub fallback: Option<GgmlType>,
}

use GgmlType as T;
use NoiseModel as N;
use RandomDraw as R;
use SynthDraw as D;
use TypeStatus as S;

/// IQ4_NL / IQ4_XS code levels.
const IQ4NL: &[i8] = &legacy::KVALUES_IQ4NL;

/// Every GGML type id, in id order. Removed ids carry their historical block sizes where known.
///
/// The codebook factors of the IQ2/IQ3 noise models are the measured excess of their error over
/// `D^2 / 12` (see [`crate::quant::noise`]): measured with `python3
/// reference/checks/wcheck_calibrate.py` (llama.cpp's `ggml_quantize_chunk` on 256 x 1024
/// tensors of Gaussian, Laplace, Student-t(4) and row-scaled Gaussian values, each without and
/// with a log-normal importance matrix of sigma 1 and 2): the ratio of the measured error to
/// `D^2 / 12` per type ranged IQ2_XXS 1.45..2.27, IQ2_XS 1.27..2.27, IQ2_S 1.12..1.58, IQ3_XXS
/// 2.99..6.33, IQ3_S 1.74..2.86, IQ1_S 0.64..1.51, IQ1_M 0.63..1.40. The factor is the middle of
/// that range (1 for IQ1_*), so measured / expected stays within about 0.7..1.5 for every type.
/// (The same run gave 0.77..1.19 for every scalar type: Q*_0/1, K-quants, IQ4_NL/XS, MXFP4, F16,
/// BF16; the ternary TQ types 0.19..0.84, their values crowd the zero cell.)
pub const TYPE_TABLE: &[TypeInfo] = &[
    row(T::F32, "F32", 1, 4, S::Dequant)
        .dequant(float::dequant_f32, "f32")
        .noise(N::Float {
            exp_bits: 8,
            mant_bits: 23,
        })
        .synth(D::Float(float::encode_f32))
        .random(R::UniformF32),
    row(T::F16, "F16", 1, 2, S::Dequant)
        .dequant(float::dequant_f16, "f16")
        .noise(N::Float {
            exp_bits: 5,
            mant_bits: 10,
        })
        .synth(D::Float(float::encode_f16))
        .random(R::Float16 {
            exp: (5, 15),
            mant_bits: 10,
        }),
    row(T::Q4_0, "Q4_0", 32, 18, S::Dequant)
        .dequant(legacy::dequant_q4_0, "q4_0")
        .noise(N::OneScale { d_at: 0 })
        .synth(D::Scale(Codes::Ints(-8, 7)))
        .random(R::Scaled(ScaleFields::f16(&[0]))),
    row(T::Q4_1, "Q4_1", 32, 20, S::Dequant)
        .dequant(legacy::dequant_q4_1, "q4_1")
        .noise(N::OneScale { d_at: 0 })
        .synth(D::ScaleMin { levels: 16 })
        .random(R::Scaled(ScaleFields::f16(&[0, 2]))),
    row(T::Q4_2, "Q4_2", 16, 10, S::Removed),
    row(T::Q4_3, "Q4_3", 16, 12, S::Removed),
    row(T::Q5_0, "Q5_0", 32, 22, S::Dequant)
        .dequant(legacy::dequant_q5_0, "q5_0")
        .noise(N::OneScale { d_at: 0 })
        .synth(D::Scale(Codes::Ints(-16, 15)))
        .random(R::Scaled(ScaleFields::f16(&[0]))),
    row(T::Q5_1, "Q5_1", 32, 24, S::Dequant)
        .dequant(legacy::dequant_q5_1, "q5_1")
        .noise(N::OneScale { d_at: 0 })
        .synth(D::ScaleMin { levels: 32 })
        .random(R::Scaled(ScaleFields::f16(&[0, 2]))),
    row(T::Q8_0, "Q8_0", 32, 34, S::Dequant)
        .dequant(legacy::dequant_q8_0, "q8_0")
        .noise(N::OneScale { d_at: 0 })
        .synth(D::Int8 { lim: 127 })
        .random(R::Scaled(ScaleFields::f16(&[0]))),
    row(T::Q8_1, "Q8_1", 32, 36, S::NoDequant),
    row(T::Q2_K, "Q2_K", 256, 84, S::Dequant)
        .dequant(kquants::dequant_q2_k, "q2_k")
        .noise(N::Q2K)
        .synth(D::Q2K { sc: (8, 15) })
        .random(R::Scaled(ScaleFields::f16(&[80, 82])))
        .fallback(T::Q4_0),
    row(T::Q3_K, "Q3_K", 256, 110, S::Dequant)
        .dequant(kquants::dequant_q3_k, "q3_k")
        .noise(N::Q3K)
        .synth(D::Q3K { sc: (48, 63) })
        .random(R::Scaled(ScaleFields::f16(&[108])))
        .fallback(T::Q4_0),
    row(T::Q4_K, "Q4_K", 256, 144, S::Dequant)
        .dequant(kquants::dequant_q4_k, "q4_k")
        .noise(N::Q4K)
        .synth(D::Q4K {
            levels: 16,
            sc: (32, 63),
        })
        .random(R::Scaled(ScaleFields::f16(&[0, 2])))
        .fallback(T::Q5_0),
    row(T::Q5_K, "Q5_K", 256, 176, S::Dequant)
        .dequant(kquants::dequant_q5_k, "q5_k")
        .noise(N::Q4K)
        .synth(D::Q4K {
            levels: 32,
            sc: (32, 63),
        })
        .random(R::Scaled(ScaleFields::f16(&[0, 2])))
        .fallback(T::Q5_1),
    row(T::Q6_K, "Q6_K", 256, 210, S::Dequant)
        .dequant(kquants::dequant_q6_k, "q6_k")
        .noise(N::Q6K)
        .synth(D::Q6K { sc: (16, 63) })
        .random(R::Scaled(ScaleFields::f16(&[208])))
        .fallback(T::Q8_0),
    row(T::Q8_K, "Q8_K", 256, 292, S::NoDequant).fallback(T::IQ4_NL),
    row(T::IQ2_XXS, "IQ2_XXS", 256, 66, S::Dequant)
        .dequant(iquants::dequant_iq2_xxs, "iq2_xxs")
        .noise(N::Iq2Xxs { factor: 1.8 })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ2_XS, "IQ2_XS", 256, 74, S::Dequant)
        .dequant(iquants::dequant_iq2_xs, "iq2_xs")
        .noise(N::Iq2Scales {
            scales_at: 66,
            factor: 1.7,
        })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ3_XXS, "IQ3_XXS", 256, 98, S::Dequant)
        .dequant(iquants::dequant_iq3_xxs, "iq3_xxs")
        .noise(N::Iq3Xxs { factor: 4.3 })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ1_S, "IQ1_S", 256, 50, S::Dequant)
        .dequant(iquants::dequant_iq1_s, "iq1_s")
        .noise(N::Iq1S { factor: 1.0 })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ4_NL, "IQ4_NL", 32, 18, S::Dequant)
        .dequant(legacy::dequant_iq4_nl, "iq4_nl")
        .noise(N::Iq4Nl)
        .synth(D::Scale(Codes::Levels(IQ4NL)))
        .random(R::Scaled(ScaleFields::f16(&[0]))),
    row(T::IQ3_S, "IQ3_S", 256, 110, S::Dequant)
        .dequant(iquants::dequant_iq3_s, "iq3_s")
        .noise(N::Iq3S { factor: 2.2 })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ2_S, "IQ2_S", 256, 82, S::Dequant)
        .dequant(iquants::dequant_iq2_s, "iq2_s")
        .noise(N::Iq2Scales {
            scales_at: 74,
            factor: 1.3,
        })
        .synth(D::Grid)
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::IQ4_XS, "IQ4_XS", 256, 136, S::Dequant)
        .dequant(kquants::dequant_iq4_xs, "iq4_xs")
        .noise(N::Iq4Xs)
        .synth(D::Iq4Xs {
            sc: (48, 63),
            levels: IQ4NL,
        })
        .random(R::Scaled(ScaleFields::f16(&[0])))
        .fallback(T::IQ4_NL),
    row(T::I8, "I8", 1, 1, S::Integer).dequant(float::dequant_i8, "i8"),
    row(T::I16, "I16", 1, 2, S::Integer).dequant(float::dequant_i16, "i16"),
    row(T::I32, "I32", 1, 4, S::Integer).dequant(float::dequant_i32, "i32"),
    row(T::I64, "I64", 1, 8, S::Integer).dequant(float::dequant_i64, "i64"),
    row(T::F64, "F64", 1, 8, S::Dequant)
        .dequant(float::dequant_f64, "f64")
        .random(R::UniformF64),
    row(T::IQ1_M, "IQ1_M", 256, 56, S::Dequant)
        .dequant(iquants::dequant_iq1_m, "iq1_m")
        .noise(N::Iq1M { factor: 1.0 })
        .random(R::Scaled(ScaleFields {
            clear: &[(55, 0x40)],
            ..ScaleFields::NONE
        }))
        .fallback(T::IQ4_NL),
    row(T::BF16, "BF16", 1, 2, S::Dequant)
        .dequant(float::dequant_bf16, "bf16")
        .noise(N::Float {
            exp_bits: 8,
            mant_bits: 7,
        })
        .synth(D::Float(float::encode_bf16))
        .random(R::Float16 {
            exp: (117, 127),
            mant_bits: 7,
        }),
    row(T::Q4_0_4_4, "Q4_0_4_4", 32, 18, S::Removed),
    row(T::Q4_0_4_8, "Q4_0_4_8", 32, 18, S::Removed),
    row(T::Q4_0_8_8, "Q4_0_8_8", 32, 18, S::Removed),
    row(T::TQ1_0, "TQ1_0", 256, 54, S::Dequant)
        .dequant(small::dequant_tq1_0, "tq1_0")
        .noise(N::OneScale { d_at: 52 })
        .random(R::Scaled(ScaleFields::f16(&[52])))
        .fallback(T::IQ4_NL),
    row(T::TQ2_0, "TQ2_0", 256, 66, S::Dequant)
        .dequant(small::dequant_tq2_0, "tq2_0")
        .noise(N::OneScale { d_at: 64 })
        .random(R::Scaled(ScaleFields::f16(&[64])))
        .fallback(T::IQ4_NL),
    row(T::IQ4_NL_4_4, "IQ4_NL_4_4", 32, 18, S::Removed),
    row(T::IQ4_NL_4_8, "IQ4_NL_4_8", 32, 18, S::Removed),
    row(T::IQ4_NL_8_8, "IQ4_NL_8_8", 32, 18, S::Removed),
    row(T::MXFP4, "MXFP4", 32, 17, S::Dequant)
        .dequant(small::dequant_mxfp4, "mxfp4")
        .noise(N::Mxfp4)
        .random(R::Scaled(ScaleFields {
            e8m0: &[0],
            ..ScaleFields::NONE
        })),
    row(T::NVFP4, "NVFP4", 64, 36, S::Dequant)
        .dequant(small::dequant_nvfp4, "nvfp4")
        .noise(N::Nvfp4)
        .random(R::Scaled(ScaleFields {
            ue4m3: &[0, 1, 2, 3],
            ..ScaleFields::NONE
        })),
    row(T::Q1_0, "Q1_0", 128, 18, S::NoDequant),
];

/// A row with only the sizes and status: no dequantizer, kernel, noise model or synth draw;
/// bench draws random bytes.
const fn row(
    ty: GgmlType,
    name: &'static str,
    block_size: usize,
    type_size: usize,
    status: TypeStatus,
) -> TypeInfo {
    TypeInfo {
        ty,
        name,
        block_size,
        type_size,
        status,
        dequant: None,
        kernel: None,
        noise: None,
        synth: None,
        random: R::Scaled(ScaleFields::NONE),
        fallback: None,
    }
}

impl TypeInfo {
    const fn dequant(self, f: DequantFn, kernel: &'static str) -> TypeInfo {
        TypeInfo {
            dequant: Some(f),
            kernel: Some(kernel),
            ..self
        }
    }

    const fn noise(self, n: NoiseModel) -> TypeInfo {
        TypeInfo {
            noise: Some(n),
            ..self
        }
    }

    const fn synth(self, d: SynthDraw) -> TypeInfo {
        TypeInfo {
            synth: Some(d),
            ..self
        }
    }

    const fn random(self, r: RandomDraw) -> TypeInfo {
        TypeInfo { random: r, ..self }
    }

    const fn fallback(self, t: GgmlType) -> TypeInfo {
        TypeInfo {
            fallback: Some(t),
            ..self
        }
    }
}

// The table is indexed by id: check that at compile time.
const _: () = {
    let mut i = 0;
    while i < TYPE_TABLE.len() {
        assert!(TYPE_TABLE[i].ty as usize == i);
        i += 1;
    }
};

impl GgmlType {
    /// The type with GGUF id `id`, or `None` for an id outside ggml's enum.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPE_TABLE.get(id as usize).map(|r| r.ty)
    }

    /// The type named `name` (case-insensitive: `q4_k`, `Q4_K`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPE_TABLE
            .iter()
            .find(|r| r.name.eq_ignore_ascii_case(name))
            .map(|r| r.ty)
    }

    /// This type's row of [`TYPE_TABLE`].
    pub fn info(self) -> &'static TypeInfo {
        &TYPE_TABLE[self as usize]
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Name as ggml spells it.
    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.info().block_size
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.info().type_size
    }

    /// What glmdiff can do with this type.
    pub fn status(self) -> TypeStatus {
        self.info().status
    }

    /// Bytes taken by `n` elements (`n` must be a multiple of the block size), or `None` on
    /// overflow.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        (n / self.block_size() as u64).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_none() {
        for r in TYPE_TABLE {
            assert_eq!(GgmlType::from_id(r.ty.id()), Some(r.ty));
            assert_eq!(GgmlType::from_name(r.name), Some(r.ty));
        }
        assert_eq!(GgmlType::from_id(TYPE_TABLE.len() as u32), None);
        assert_eq!(GgmlType::from_id(u32::MAX), None);
    }

    #[test]
    fn sizes_match_ggml_common_h() {
        // Hand-copied from the static_asserts in ggml's src/ggml-common.h.
        let expect = [
            (T::Q4_K, 256, 144),
            (T::Q6_K, 256, 210),
            (T::IQ2_XS, 256, 74),
            (T::IQ1_M, 256, 56),
            (T::MXFP4, 32, 17),
            (T::TQ1_0, 256, 54),
        ];
        for (t, b, s) in expect {
            assert_eq!((t.block_size(), t.type_size()), (b, s), "{t}");
        }
    }

    /// Every row is complete and its per-type facts agree with its sizes: a dequantizable type
    /// has a dequantizer and a CUDA kernel (and only those do), a noise model unless it is an
    /// integer type or F64, and a bench draw whose fields lie inside the block; the models and
    /// draws fit the block layout.
    /// Every type of super-blocks names the type that replaces it for rows that are not whole
    /// super-blocks, a dequantizable type of shorter blocks; no other type names one.
    #[test]
    fn fallbacks_are_shorter_blocks() {
        for r in TYPE_TABLE {
            assert_eq!(
                r.fallback.is_some(),
                r.block_size == super::super::QK_K,
                "{}",
                r.name
            );
            if let Some(f) = r.fallback {
                assert!(f.block_size() < r.block_size, "{}", r.name);
                assert_eq!(f.status(), S::Dequant, "{}", r.name);
            }
        }
    }

    #[test]
    fn every_row_is_complete_and_consistent() {
        use super::super::draw::Codes;
        // The only dequantizable non-integer type without a rounding-error model.
        const NO_NOISE_MODEL: &[GgmlType] = &[T::F64];
        for r in TYPE_TABLE {
            let (name, bs, ts) = (r.name, r.block_size, r.type_size);
            let dequant = matches!(r.status, S::Dequant | S::Integer);
            assert_eq!(
                r.dequant.is_some(),
                dequant,
                "{name}: dequantizer vs status"
            );
            assert_eq!(r.kernel.is_some(), dequant, "{name}: kernel vs status");
            assert!(bs > 0 && ts > 0, "{name}: sizes");
            if let Some(k) = r.kernel {
                assert_eq!(k, name.to_lowercase(), "{name}: kernel stem");
            }
            let wants_noise = r.status == S::Dequant && !NO_NOISE_MODEL.contains(&r.ty);
            assert_eq!(r.noise.is_some(), wants_noise, "{name}: noise model");
            match r.noise {
                Some(N::Float {
                    exp_bits,
                    mant_bits,
                }) => {
                    assert_eq!(bs, 1, "{name}");
                    assert_eq!(8 * ts as u32, 1 + exp_bits + mant_bits, "{name}");
                }
                Some(N::OneScale { d_at }) => assert!(d_at + 2 <= ts, "{name}"),
                Some(N::Iq2Scales { scales_at, .. }) => assert!(scales_at + 8 <= ts, "{name}"),
                Some(_) | None => {}
            }
            if let Some(d) = r.synth {
                assert_eq!(
                    r.status,
                    S::Dequant,
                    "{name}: synth draws a dequantizable type"
                );
                match d {
                    D::Float(_) => assert_eq!(bs, 1, "{name}"),
                    D::Scale(Codes::Levels(l)) | D::Iq4Xs { levels: l, .. } => {
                        assert_eq!(l.len(), 16, "{name}")
                    }
                    D::Q4K { levels, .. } => assert!(levels == 16 || levels == 32, "{name}"),
                    _ => assert!(bs > 1, "{name}"),
                }
            }
            match r.random {
                R::Float16 { exp, mant_bits } => {
                    assert_eq!(ts, 2, "{name}");
                    assert!(exp.0 <= exp.1 && mant_bits < 15, "{name}");
                }
                R::UniformF32 => assert_eq!(ts, 4, "{name}"),
                R::UniformF64 => assert_eq!(ts, 8, "{name}"),
                R::Scaled(f) => {
                    assert!(f.f16.iter().all(|&o| o + 2 <= ts), "{name}: f16 scale");
                    assert!(f.e8m0.iter().all(|&o| o < ts), "{name}: e8m0 scale");
                    assert!(f.ue4m3.iter().all(|&o| o < ts), "{name}: ue4m3 scale");
                    assert!(f.clear.iter().all(|&(o, _)| o < ts), "{name}: cleared bits");
                }
            }
        }
    }
}
