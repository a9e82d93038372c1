//! NVRTC: kernel source -> CUBIN for the device's own architecture, with glmdiff's fixed
//! options, and a disk cache of compiled modules.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::{result as nr, sys as ns};

use super::CompileOptions;

/// Whether libnvrtc can be opened (cudarc panics on first use of a missing library).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library and look the symbols up; no NVRTC call is made.
    unsafe { ns::is_culib_present() }
}

/// The NVRTC version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    if !available() {
        bail!("cuda: libnvrtc (NVRTC) is not found: {}", super::LIB_HINT);
    }
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: both pointers are valid for writes; the library is present (checked above).
    unsafe { ns::nvrtcVersion(&mut a, &mut b) }
        .result()
        .context("cuda: nvrtcVersion")?;
    Ok((a, b))
}

/// Compiles `source` (named `name` in messages) to a CUBIN. A compile error carries the file,
/// the options and NVRTC's log.
pub fn compile_cubin(source: &str, name: &str, opts: &CompileOptions) -> Result<Vec<u8>> {
    if !available() {
        bail!("cuda: libnvrtc (NVRTC) is not found: {}", super::LIB_HINT);
    }
    let csrc = CString::new(source).context("cuda: kernel source holds a NUL byte")?;
    let cname = CString::new(name).context("cuda: kernel name holds a NUL byte")?;
    let prog = nr::create_program(&csrc, Some(&cname))
        .with_context(|| format!("cuda: nvrtcCreateProgram for {name}"))?;
    let args = opts.args();
    // SAFETY: `prog` is a live program created above; the options are valid C strings.
    let compiled = unsafe { nr::compile_program(prog, &args) };
    let out = (|| -> Result<Vec<u8>> {
        if let Err(e) = compiled {
            // SAFETY: `prog` is live; the log is a NUL-terminated buffer NVRTC filled.
            let log = unsafe { nr::get_program_log(prog) }.unwrap_or_default();
            // SAFETY: the log buffer ends with NUL (NVRTC's contract for the program log).
            let log = unsafe { CStr::from_ptr(log.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            bail!(
                "cuda: NVRTC failed to compile {name} with {}: {e:?}\n{log}",
                args.join(" ")
            );
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; `size` is valid for a write.
        unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .context("cuda: nvrtcGetCUBINSize")?;
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported.
        unsafe { ns::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }
            .result()
            .context("cuda: nvrtcGetCUBIN")?;
        Ok(buf)
    })();
    // SAFETY: `prog` is destroyed once, after its last use.
    unsafe { nr::destroy_program(prog) }.ok();
    out
}

/// Where compiled modules are cached: `<glmdiff cache>/cubin`.
fn cache_dir() -> Option<PathBuf> {
    crate::util::cache_dir::default_dir()
        .ok()
        .map(|d| d.join("cubin"))
}

/// [`compile_cubin`] through the disk cache (keyed by a hash of the source, the options and the
/// NVRTC version). A cache that cannot be read or written is skipped, never an error.
pub fn compile_cached(source: &str, name: &str, opts: &CompileOptions) -> Result<Vec<u8>> {
    let (a, b) = version()?;
    let key = crate::util::hash::fnv1a64(
        format!("{source}\n{}\nnvrtc {a}.{b}", opts.args().join(" ")).as_bytes(),
    );
    let path = cache_dir().map(|d| d.join(format!("{name}-{}-{key:016x}.cubin", opts.arch)));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(bytes);
        }
    }
    let cubin = compile_cubin(source, name, opts)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let _ = crate::util::atomic::write_atomic(p, |w| Ok(w.write_all(&cubin)?));
            }
        }
    }
    Ok(cubin)
}

/// A compile of one source with one set of options, shared by the process's devices.
type Shared = Arc<OnceLock<std::result::Result<Vec<u8>, String>>>;

/// [`compile_cached`], once per process for a given family, source and options: devices of one
/// architecture that ask at the same time wait for the one compile (and share its error).
pub fn compile_shared(source: &str, name: &str, opts: &CompileOptions) -> Result<Vec<u8>> {
    static COMPILES: Mutex<Vec<(String, u64, Shared)>> = Mutex::new(Vec::new());
    let key = crate::util::hash::fnv1a64(format!("{source}\n{opts}").as_bytes());
    let shared = {
        let mut all = COMPILES
            .lock()
            .map_err(|_| anyhow::anyhow!("cuda: the compile registry is poisoned"))?;
        match all.iter().find(|(n, k, _)| n == name && *k == key) {
            Some((_, _, s)) => Arc::clone(s),
            None => {
                let s: Shared = Arc::default();
                all.push((name.to_string(), key, Arc::clone(&s)));
                s
            }
        }
    };
    shared
        .get_or_init(|| compile_cached(source, name, opts).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{family_source, COMPARE_SOURCE, DEQUANT_FAMILIES, FORWARD_SOURCE};

    /// Every kernel family compiles for sm_90 and sm_120 (NVRTC needs no GPU, only libnvrtc).
    /// Ignored by `cargo test`, so that a machine without libnvrtc counts it as ignored, never
    /// passed; `scripts/gpu-test.sh` runs it with `--include-ignored`, where a missing libnvrtc
    /// fails it.
    #[test]
    #[ignore = "needs libnvrtc (CUDA 13): scripts/gpu-test.sh runs it"]
    fn kernel_families_compile_with_nvrtc() {
        assert!(
            available(),
            "libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13 NVRTC)"
        );
        for arch in [(9, 0), (12, 0)] {
            let opts = CompileOptions::for_capability(arch.0, arch.1);
            let mut families = DEQUANT_FAMILIES.to_vec();
            families.extend([("compare", COMPARE_SOURCE), ("forward", FORWARD_SOURCE)]);
            for (name, src) in families {
                let cubin = compile_cubin(&family_source(src), name, &opts)
                    .unwrap_or_else(|e| panic!("{e:#}"));
                assert!(cubin.len() > 1000, "{name} for {}", opts.arch);
            }
        }
    }
}
