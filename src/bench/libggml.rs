//! libggml's own row dequantizers, opened at run time from a `libggml-base` shared library, so
//! that `bench dequant --libggml PATH` times llama.cpp's C code on the same bytes in the same
//! run and checks its output against glmdiff's bit for bit.
//!
//! The functions are looked up by their exported names (`dequantize_row_q4_K` ... in ggml
//! `src/ggml-quants.h`, `ggml_fp16_to_fp32_row` and `ggml_bf16_to_fp32_row` in
//! `include/ggml.h`), all of the C type `void f(const void * x, float * y, int64_t k)`. Names
//! rather than `ggml_get_type_traits`: a library that lacks a type then says so by a missing
//! symbol, where an id past its `GGML_TYPE_COUNT` would index past its traits table (ggml
//! checks the id with a plain `assert`, compiled out of release builds), and no struct layout
//! has to be mirrored.

use std::ffi::c_void;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::quant::GgmlType;

/// ggml's `ggml_to_float_t`: `k` values from `k / block_size` blocks at `x` into `y`.
type ToFloat = unsafe extern "C" fn(x: *const c_void, y: *mut f32, k: i64);

/// The exported libggml function that converts whole blocks (or scalars) of `ty` to f32, or
/// `None` where ggml exports none (F32, F64 and the integer types: ggml has no row conversion
/// for them).
pub fn row_symbol(ty: GgmlType) -> Option<String> {
    match ty {
        GgmlType::F16 => Some("ggml_fp16_to_fp32_row".to_string()),
        GgmlType::BF16 => Some("ggml_bf16_to_fp32_row".to_string()),
        _ if ty.block_size() > 1 => {
            // ggml spells the K-quants with a capital K (`dequantize_row_q4_K`), every other
            // type in lower case (`dequantize_row_iq4_xs`).
            let lower = ty.name().to_ascii_lowercase();
            let name = match lower.strip_suffix("_k") {
                Some(stem) => format!("{stem}_K"),
                None => lower,
            };
            Some(format!("dequantize_row_{name}"))
        }
        _ => None,
    }
}

/// An opened libggml with the row functions of some types resolved. The function pointers
/// live as long as the library handle beside them (both private: they drop together).
pub struct LibGgml {
    path: PathBuf,
    fns: Vec<(GgmlType, ToFloat)>,
    // Dropped last (fields drop in declaration order): closes the library after the pointers
    // into it are gone.
    _lib: libloading::Library,
}

impl LibGgml {
    /// Opens the shared library at `path` and resolves the row function of each of `types`
    /// that ggml has one for ([`row_symbol`]). An error names the path (not a loadable
    /// library) or the path and the missing symbol.
    pub fn open(path: &Path, types: &[GgmlType]) -> Result<LibGgml> {
        if !path.exists() {
            bail!("libggml: {}: no such file", path.display());
        }
        // SAFETY: loading a shared library runs its initialisers. The path is the library the
        // user asked to be measured (libggml-base, whose initialisers only set up ggml's own
        // tables); glmdiff trusts it as it trusts any program it is told to run.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
            anyhow::anyhow!(
                "libggml: {}: not a loadable shared library: {}",
                path.display(),
                one_line(&e.to_string())
            )
        })?;
        let mut fns = Vec::new();
        for &ty in types {
            let Some(name) = row_symbol(ty) else {
                continue;
            };
            // SAFETY: every symbol `row_symbol` names is declared in ggml's headers as
            // `void f(const T * x, float * y, int64_t k)` with `T` a block struct (or
            // ggml_fp16_t / ggml_bf16_t), which is ABI-identical to `ToFloat` on every C ABI
            // Rust supports (pointers are pointers, int64_t is i64).
            let f = unsafe { lib.get::<ToFloat>(name.as_bytes()) };
            match f {
                Ok(f) => fns.push((ty, *f)),
                Err(_) => bail!(
                    "libggml: {}: no symbol {name} (the row dequantizer of {ty}; leave {ty} out \
                     of --types, or give a libggml-base that has it)",
                    path.display()
                ),
            }
        }
        Ok(LibGgml {
            path: path.to_path_buf(),
            fns,
            _lib: lib,
        })
    }

    /// The library's path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the row function of `ty` was resolved.
    pub fn has(&self, ty: GgmlType) -> bool {
        self.fns.iter().any(|(t, _)| *t == ty)
    }

    /// Dequantizes `src` (whole blocks of `ty`) into `dst` with libggml's function, on the
    /// calling thread. An error when `ty` was not resolved or the sizes disagree.
    pub fn dequantize(&self, ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
        let Some(&(_, f)) = self.fns.iter().find(|(t, _)| *t == ty) else {
            bail!(
                "libggml: {}: no row dequantizer resolved for {ty}",
                self.path.display()
            );
        };
        let (bs, ts) = (ty.block_size(), ty.type_size());
        if bs == 0 || ts == 0 || dst.len() % bs != 0 || src.len() != dst.len() / bs * ts {
            bail!(
                "libggml: {ty}: {} output elements need {} bytes, got {}",
                dst.len(),
                dst.len() / bs.max(1) * ts,
                src.len()
            );
        }
        // ggml's block structs are at most 2-byte aligned (ggml_half fields); the C code may
        // rely on it.
        if src.as_ptr().align_offset(2) != 0 {
            bail!("libggml: {ty}: the input buffer is not 2-byte aligned");
        }
        let Ok(k) = i64::try_from(dst.len()) else {
            bail!(
                "libggml: {ty}: {} elements do not fit an int64_t",
                dst.len()
            );
        };
        // SAFETY: `f` was resolved from the library `self` keeps open. It reads
        // `k / bs` blocks of `ts` bytes from `src` (exactly `src.len()`, checked above, and
        // suitably aligned) and writes `k` floats to `dst` (its length); the two slices do not
        // overlap (one is borrowed shared, the other exclusive). It keeps no pointer after
        // returning and touches no other state.
        unsafe { f(src.as_ptr().cast(), dst.as_mut_ptr(), k) };
        Ok(())
    }
}

/// `s` on one line (dlopen errors can carry newlines).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_names_follow_ggml() {
        let name = |t| row_symbol(t).unwrap_or_default();
        assert_eq!(name(GgmlType::Q4_K), "dequantize_row_q4_K");
        assert_eq!(name(GgmlType::Q8_0), "dequantize_row_q8_0");
        assert_eq!(name(GgmlType::IQ4_XS), "dequantize_row_iq4_xs");
        assert_eq!(name(GgmlType::MXFP4), "dequantize_row_mxfp4");
        assert_eq!(name(GgmlType::F16), "ggml_fp16_to_fp32_row");
        assert_eq!(row_symbol(GgmlType::F32), None);
        assert_eq!(row_symbol(GgmlType::I8), None);
    }

    #[test]
    fn missing_file_and_text_file_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.so");
        let e = LibGgml::open(&missing, &[GgmlType::Q4_K])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("libggml: ") && e.contains("no such file"),
            "{e}"
        );
        let text = dir.path().join("lib.so");
        std::fs::write(&text, "not a library\n").unwrap();
        let e = LibGgml::open(&text, &[GgmlType::Q4_K])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a loadable shared library"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
