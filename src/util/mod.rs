//! Small shared helpers at the bottom of the crate (they import nothing from it): glob matching,
//! atomic file writes and the temporaries in flight, the output guard (outputs never overwrite
//! inputs), array file formats, the cache directory ([`cache_dir`]), the FNV-1a hash ([`hash`]),
//! the SplitMix64 generator ([`rng`]), top-k with ties ([`topk`]) and shell quoting ([`shell`]).

pub mod atomic;
pub mod background;
pub mod cache_dir;
pub mod glob;
pub mod guard;
pub mod hash;
pub mod npy;
pub mod progress;
pub mod rng;
pub mod safetensors_stream;
pub mod shell;
pub mod topk;

/// CPU time of the calling thread so far, seconds (`CLOCK_THREAD_CPUTIME_ID`): the speed tests'
/// clock.
#[cfg(all(test, unix))]
pub(crate) fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Opens `path` for reading once it is known to be a regular file (followed through links): a
/// FIFO blocks its open until a writer comes, a device or socket its reads, so they are refused
/// before the open. `who` starts the error (`gguf`, `trace`).
pub fn open_regular(path: &std::path::Path, who: &str) -> anyhow::Result<std::fs::File> {
    use anyhow::Context;
    let meta = std::fs::metadata(path)
        .with_context(|| format!("{who}: cannot open {}", path.display()))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, socket or device: glmdiff reads files only)"
        };
        anyhow::bail!("{who}: {} is {what}", path.display());
    }
    std::fs::File::open(path).with_context(|| format!("{who}: cannot open {}", path.display()))
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`, `None` when
/// the system does not say.
#[cfg(unix)]
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all-zero bytes are a valid
    // value.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `s` is a valid, writable
    // `statvfs` the call fills.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    (rc == 0).then(|| (s.f_bavail as u64).saturating_mul(s.f_frsize as u64))
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`: unknown here.
#[cfg(not(unix))]
pub fn free_bytes(_dir: &std::path::Path) -> Option<u64> {
    None
}
