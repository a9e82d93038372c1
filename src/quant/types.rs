//! The table of GGML tensor types: id, name, block size and bytes per block.
//!
//! One row per id in ggml's `include/ggml.h` (`enum ggml_type`), including the ids that ggml
//! removed (so a file carrying one gets an error that says "removed", not "unknown") and the
//! activation-only types (Q8_1, Q8_K) that never appear as weights. Sizes follow
//! `src/ggml-common.h` (static_asserts on every block struct) and gguf-py's `GGML_QUANT_SIZES`.

use std::fmt;

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
}

use GgmlType as T;
use TypeStatus as S;

/// Every GGML type id, in id order. Removed ids carry their historical block sizes where known.
pub const TYPE_TABLE: &[TypeInfo] = &[
    row(T::F32, "F32", 1, 4, S::Dequant),
    row(T::F16, "F16", 1, 2, S::Dequant),
    row(T::Q4_0, "Q4_0", 32, 18, S::Dequant),
    row(T::Q4_1, "Q4_1", 32, 20, S::Dequant),
    row(T::Q4_2, "Q4_2", 16, 10, S::Removed),
    row(T::Q4_3, "Q4_3", 16, 12, S::Removed),
    row(T::Q5_0, "Q5_0", 32, 22, S::Dequant),
    row(T::Q5_1, "Q5_1", 32, 24, S::Dequant),
    row(T::Q8_0, "Q8_0", 32, 34, S::Dequant),
    row(T::Q8_1, "Q8_1", 32, 36, S::NoDequant),
    row(T::Q2_K, "Q2_K", 256, 84, S::Dequant),
    row(T::Q3_K, "Q3_K", 256, 110, S::Dequant),
    row(T::Q4_K, "Q4_K", 256, 144, S::Dequant),
    row(T::Q5_K, "Q5_K", 256, 176, S::Dequant),
    row(T::Q6_K, "Q6_K", 256, 210, S::Dequant),
    row(T::Q8_K, "Q8_K", 256, 292, S::NoDequant),
    row(T::IQ2_XXS, "IQ2_XXS", 256, 66, S::Dequant),
    row(T::IQ2_XS, "IQ2_XS", 256, 74, S::Dequant),
    row(T::IQ3_XXS, "IQ3_XXS", 256, 98, S::Dequant),
    row(T::IQ1_S, "IQ1_S", 256, 50, S::Dequant),
    row(T::IQ4_NL, "IQ4_NL", 32, 18, S::Dequant),
    row(T::IQ3_S, "IQ3_S", 256, 110, S::Dequant),
    row(T::IQ2_S, "IQ2_S", 256, 82, S::Dequant),
    row(T::IQ4_XS, "IQ4_XS", 256, 136, S::Dequant),
    row(T::I8, "I8", 1, 1, S::Integer),
    row(T::I16, "I16", 1, 2, S::Integer),
    row(T::I32, "I32", 1, 4, S::Integer),
    row(T::I64, "I64", 1, 8, S::Integer),
    row(T::F64, "F64", 1, 8, S::Dequant),
    row(T::IQ1_M, "IQ1_M", 256, 56, S::Dequant),
    row(T::BF16, "BF16", 1, 2, S::Dequant),
    row(T::Q4_0_4_4, "Q4_0_4_4", 32, 18, S::Removed),
    row(T::Q4_0_4_8, "Q4_0_4_8", 32, 18, S::Removed),
    row(T::Q4_0_8_8, "Q4_0_8_8", 32, 18, S::Removed),
    row(T::TQ1_0, "TQ1_0", 256, 54, S::Dequant),
    row(T::TQ2_0, "TQ2_0", 256, 66, S::Dequant),
    row(T::IQ4_NL_4_4, "IQ4_NL_4_4", 32, 18, S::Removed),
    row(T::IQ4_NL_4_8, "IQ4_NL_4_8", 32, 18, S::Removed),
    row(T::IQ4_NL_8_8, "IQ4_NL_8_8", 32, 18, S::Removed),
    row(T::MXFP4, "MXFP4", 32, 17, S::Dequant),
    row(T::NVFP4, "NVFP4", 64, 36, S::Dequant),
    row(T::Q1_0, "Q1_0", 128, 18, S::NoDequant),
];

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
}
