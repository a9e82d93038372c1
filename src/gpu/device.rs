//! Devices and contexts: library probing, the device list, a context and stream per device,
//! kernel modules compiled and loaded once per device.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use cudarc::driver::{
    sys as drv, sys::CUctx_flags, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DeviceRepr, DriverError, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::{family_source, nvrtc, CompileOptions};

/// Checks that libcuda and libnvrtc can be opened; the error says what is missing on its first
/// line and the file names tried on a second ([`missing_libraries`]).
pub fn probe_libraries() -> Result<()> {
    let mut missing = Vec::new();
    // SAFETY: only dlopen + symbol lookup; no CUDA call is made.
    if !unsafe { drv::is_culib_present() } {
        missing.push(("cuda", "NVIDIA driver"));
    }
    if !nvrtc::available() {
        missing.push(("nvrtc", "CUDA 13"));
    }
    if !missing.is_empty() {
        bail!(
            "{}",
            missing_libraries(&missing, &cudarc::get_lib_name_candidates)
        );
    }
    Ok(())
}

/// The message for missing libraries `(stem, what)` (`("cuda", "NVIDIA driver")`): what is
/// missing on one line, and on a second the file names `candidates` gives for each stem (the
/// names tried, deduplicated), the stems' common endings written once:
/// `lib{cuda,nvrtc}{.so, .so.{1,9..13}, 64.so, ...}`.
pub(crate) fn missing_libraries(
    missing: &[(&str, &str)],
    candidates: &dyn Fn(&str) -> Vec<String>,
) -> String {
    let what: Vec<String> = missing
        .iter()
        .map(|(stem, what)| format!("lib{stem} ({what})"))
        .collect();
    // The endings tried for each stem, in a short form.
    let endings: Vec<(String, String)> = missing
        .iter()
        .map(|(stem, _)| {
            let prefix = format!("lib{stem}");
            let mut ends: Vec<String> = Vec::new();
            for n in candidates(stem) {
                let e = n.strip_prefix(&prefix).unwrap_or(&n).to_string();
                if !ends.contains(&e) {
                    ends.push(e);
                }
            }
            (stem.to_string(), compact_endings(&ends))
        })
        .collect();
    let same = endings.windows(2).all(|w| w[0].1 == w[1].1);
    let searched = match (same, endings.as_slice()) {
        (_, [(stem, e)]) => format!("lib{stem}{{{e}}}"),
        (true, [(_, e), ..]) => {
            let stems: Vec<&str> = endings.iter().map(|(s, _)| s.as_str()).collect();
            format!("lib{{{}}}{{{e}}}", stems.join(","))
        }
        _ => endings
            .iter()
            .map(|(stem, e)| format!("lib{stem}{{{e}}}"))
            .collect::<Vec<_>>()
            .join(" "),
    };
    format!(
        "cuda: no CUDA: {} not found; see LD_LIBRARY_PATH\n  tried {searched}",
        what.join(", ")
    )
}

/// Endings such as `.so.12`, `.so.13`, `64_9.so` written shortly: those that differ only in
/// their last number share one entry with the numbers listed, runs of three or more as `A..B`
/// (`.so.{1,9..13}`), in the order their forms first appear.
fn compact_endings(ends: &[String]) -> String {
    // (form with the last number replaced by `#`, numbers)
    let mut forms: Vec<(String, Vec<u64>)> = Vec::new();
    for e in ends {
        let (form, num) = match e.rfind(|c: char| c.is_ascii_digit()) {
            Some(last) => {
                let start = e[..=last]
                    .rfind(|c: char| !c.is_ascii_digit())
                    .map_or(0, |i| i + 1);
                // A number right after the stem (`64.so`) is part of the name, not a version.
                match e[start..=last].parse::<u64>() {
                    Ok(n) if start > 0 && e[..start].ends_with(['.', '_']) => {
                        (format!("{}#{}", &e[..start], &e[last + 1..]), Some(n))
                    }
                    _ => (e.clone(), None),
                }
            }
            None => (e.clone(), None),
        };
        match forms.iter_mut().find(|(f, _)| *f == form) {
            Some((_, nums)) => nums.extend(num),
            None => forms.push((form, num.into_iter().collect())),
        }
    }
    forms
        .into_iter()
        .map(|(form, mut nums)| {
            nums.sort_unstable();
            nums.dedup();
            let list = match nums.len() {
                0 => return form,
                1 => nums[0].to_string(),
                _ => {
                    let mut parts = Vec::new();
                    let mut i = 0;
                    while i < nums.len() {
                        let mut j = i;
                        while j + 1 < nums.len() && nums[j + 1] == nums[j] + 1 {
                            j += 1;
                        }
                        if j - i >= 2 {
                            parts.push(format!("{}..{}", nums[i], nums[j]));
                        } else {
                            parts.extend(nums[i..=j].iter().map(u64::to_string));
                        }
                        i = j + 1;
                    }
                    format!("{{{}}}", parts.join(","))
                }
            };
            form.replacen('#', &list, 1)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the driver says about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability.
    pub capability: (i32, i32),
    /// Memory in bytes.
    pub memory: u64,
    /// Streaming multiprocessors.
    pub sms: u32,
}

impl DeviceInfo {
    /// Every device, without creating contexts.
    pub fn list() -> Result<Vec<DeviceInfo>> {
        probe_libraries()?;
        use cudarc::driver::result::device as dev;
        use drv::CUdevice_attribute as A;
        let n = CudaContext::device_count().context("cuda: cuInit / cuDeviceGetCount")?;
        let mut out = Vec::new();
        for i in 0..n {
            let d = dev::get(i).with_context(|| format!("cuda: cuDeviceGet({i})"))?;
            // SAFETY: `d` is a valid device handle from cuDeviceGet.
            let attr = |a| unsafe { dev::get_attribute(d, a) };
            out.push(DeviceInfo {
                ordinal: i as usize,
                name: dev::get_name(d)?,
                capability: (
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                ),
                // SAFETY: as above.
                memory: unsafe { dev::total_mem(d) }? as u64,
                sms: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            });
        }
        Ok(out)
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} sm_{}{} ({:.1} GiB, {} SMs)",
            self.ordinal,
            self.name,
            self.capability.0,
            self.capability.1,
            self.memory as f64 / (1u64 << 30) as f64,
            self.sms
        )
    }
}

/// One device in use: its context, stream, compile options and loaded kernel modules.
pub struct Gpu {
    /// The device.
    pub info: DeviceInfo,
    /// The NVRTC options kernels are compiled with.
    pub options: CompileOptions,
    /// NVRTC and driver versions, `(nvrtc, driver)` as `major.minor` strings.
    pub versions: (String, String),
    /// How host threads wait for it ([`Wait`]), in words.
    wait: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Families being compiled on threads of their own ([`Gpu::compile_ahead`]): their
    /// CUBINs, taken by the first load.
    pending: Mutex<HashMap<&'static str, Compiling>>,
}

/// How the host threads of a device's context wait for it (the context's scheduling flag,
/// `cuCtxSetFlags`); only where their time goes changes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Wait {
    /// Sleep until the device is done (`CU_CTX_SCHED_BLOCKING_SYNC`). A thread that spins
    /// holds a core for as long as it waits, beside the CPU reference's pool, which has a
    /// thread per core; a sleeping one wakes later (the driver's wake-up on every wait).
    Block,
    /// Spin on a core (`CU_CTX_SCHED_SPIN`).
    Spin,
    /// Spin, yielding between polls (`CU_CTX_SCHED_YIELD`).
    Yield,
    /// The driver's heuristic (`CU_CTX_SCHED_AUTO`: spin while the process has fewer
    /// contexts than the machine has cores).
    #[default]
    Auto,
}

impl Wait {
    /// The word for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Wait::Block => "block",
            Wait::Spin => "spin",
            Wait::Yield => "yield",
            Wait::Auto => "auto",
        }
    }

    fn flags(self) -> CUctx_flags {
        match self {
            Wait::Block => CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC,
            Wait::Spin => CUctx_flags::CU_CTX_SCHED_SPIN,
            Wait::Yield => CUctx_flags::CU_CTX_SCHED_YIELD,
            Wait::Auto => CUctx_flags::CU_CTX_SCHED_AUTO,
        }
    }

    fn from_u8(v: u8) -> Wait {
        match v {
            0 => Wait::Block,
            1 => Wait::Spin,
            2 => Wait::Yield,
            _ => Wait::Auto,
        }
    }
}

/// The [`Wait`] of the devices opened from now on (a [`Wait`] as `u8`).
static WAIT: AtomicU8 = AtomicU8::new(Wait::Auto as u8);

/// Sets how the host threads of the devices opened from now on wait for them (`--gpu-wait`).
pub fn set_wait_by_default(wait: Wait) {
    WAIT.store(wait as u8, Ordering::Relaxed);
}

/// The [`Wait`] [`set_wait_by_default`] set ([`Wait::Auto`] unless told otherwise).
pub fn wait_by_default() -> Wait {
    Wait::from_u8(WAIT.load(Ordering::Relaxed))
}

/// Sets the scheduling bits of `ctx`'s flags to `want`'s and keeps the others
/// (`cuCtxSetFlags` replaces every flag, the coredump and memory-operation ones too).
fn set_sched_flags(ctx: &CudaContext, want: Wait) -> std::result::Result<(), DriverError> {
    ctx.bind_to_thread()?;
    let mut flags: std::ffi::c_uint = 0;
    // SAFETY: `flags` is a live local the driver writes; `ctx` is current on this thread (bound
    // above).
    unsafe { drv::cuCtxGetFlags(&mut flags) }.result()?;
    let sched = CUctx_flags::CU_CTX_SCHED_MASK as u32;
    let new = (flags & !sched) | want.flags() as u32;
    // SAFETY: `ctx` is current on this thread; `new` is its own flags with only the scheduling
    // bits replaced by one valid scheduling flag.
    unsafe { drv::cuCtxSetFlags(new) }.result()
}

/// A kernel family's compile on its own thread.
type Compiling = std::thread::JoinHandle<Result<Vec<u8>>>;

impl Gpu {
    /// Opens device `ordinal`; a bad ordinal lists the devices there are.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        Gpu::open_with(ordinal, false)
    }

    /// [`Gpu::open`] with a stream of its own (non-blocking), not the context's default one:
    /// its work does not wait for another `Gpu`'s on the same device, nor that for it.
    pub fn open_own_stream(ordinal: usize) -> Result<Gpu> {
        Gpu::open_with(ordinal, true)
    }

    fn open_with(ordinal: usize, own_stream: bool) -> Result<Gpu> {
        let devices = DeviceInfo::list()?;
        if devices.is_empty() {
            bail!("cuda: the driver reports no CUDA device");
        }
        let Some(info) = devices.get(ordinal).cloned() else {
            let list: Vec<String> = devices.iter().map(|d| format!("  {d}")).collect();
            bail!(
                "cuda: no device {ordinal}; the devices are:\n{}",
                list.join("\n")
            );
        };
        let ctx = CudaContext::new(ordinal)
            .with_context(|| format!("cuda: creating a context on device {ordinal}"))?;
        // The device's primary context, shared by every `Gpu` of this device: its flag holds
        // for all of them. `auto` is the context's own default, left as it is; a driver that
        // refuses another keeps its own (only the speed differs), and the report says which.
        let want = wait_by_default();
        let wait = match want {
            Wait::Auto => want.as_str().to_string(),
            _ => match set_sched_flags(&ctx, want) {
                Ok(()) => want.as_str().to_string(),
                Err(e) => format!(
                    "{} (the driver refused {}: {e})",
                    Wait::Auto.as_str(),
                    want.as_str()
                ),
            },
        };
        let stream = if own_stream {
            ctx.new_stream()
                .with_context(|| format!("cuda: creating a stream on device {ordinal}"))?
        } else {
            ctx.default_stream()
        };
        let (nv_a, nv_b) = nvrtc::version()?;
        let mut drv_ver = 0i32;
        // SAFETY: `drv_ver` is valid for a write; the driver library is present.
        unsafe { drv::cuDriverGetVersion(&mut drv_ver) }
            .result()
            .context("cuda: cuDriverGetVersion")?;
        Ok(Gpu {
            options: CompileOptions::for_capability(info.capability.0, info.capability.1),
            versions: (
                format!("{nv_a}.{nv_b}"),
                format!("{}.{}", drv_ver / 1000, (drv_ver % 1000) / 10),
            ),
            info,
            wait,
            ctx,
            stream,
            modules: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
        })
    }

    /// The stream every launch and copy of this device goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A line for report headers: device, options, NVRTC and driver versions.
    pub fn describe(&self) -> String {
        format!(
            "{} | NVRTC {} ({}) | driver CUDA {} | host waits: {}",
            self.info, self.versions.0, self.options, self.versions.1, self.wait
        )
    }

    /// Kernel `function` of family `name` (source `source`), compiling and loading the family
    /// on first use.
    pub fn function(
        &self,
        name: &'static str,
        source: &str,
        function: &str,
    ) -> Result<CudaFunction> {
        self.module(name, source)?
            .load_function(function)
            .with_context(|| format!("cuda: kernel {function} not found in {name}"))
    }

    /// Lets kernel `function` of family `name` (source `source`) have `bytes` of dynamic shared
    /// memory a block: `Ok(())` when it may (past the default 48 KiB it opts in to what the
    /// device allows a block: 227 KiB on sm_90, 99 KiB on sm_120), else `Err(most)`, the bytes
    /// it could have.
    pub fn opt_in_shared(
        &self,
        name: &'static str,
        source: &str,
        function: &str,
        bytes: usize,
    ) -> Result<std::result::Result<(), usize>> {
        use drv::{CUdevice_attribute, CUfunction_attribute};
        let f = self.function(name, source, function)?;
        let optin = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .context("cuda: the device's shared memory per block")?;
        let fixed = f
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .with_context(|| format!("cuda: {function}'s static shared memory"))?;
        let most = usize::try_from(optin - fixed).unwrap_or(0);
        if bytes > most {
            return Ok(Err(most));
        }
        if bytes > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .with_context(|| {
                format!("cuda: {function}: opting in to {bytes} bytes of shared memory")
            })?;
        }
        Ok(Ok(()))
    }

    /// Compiles (NVRTC, or the disk cache) and loads kernel family `name` (source `source`)
    /// now, unless it is loaded already: a caller that times its launches does it first, so
    /// that no compile falls inside its timings.
    pub fn load_family(&self, name: &'static str, source: &str) -> Result<()> {
        self.module(name, source).map(|_| ())
    }

    /// Starts compiling (NVRTC, or reading the disk cache) each of `families` (`(name,
    /// source)`) not loaded or started yet, each on a thread of its own, and returns at once:
    /// NVRTC compiles one source on one thread, so families compile side by side, and beside
    /// whatever the caller does until their first use, which waits for its own.
    pub fn compile_ahead(&self, families: &[(&'static str, &'static str)]) {
        let loaded: Vec<&'static str> = match self.modules.lock() {
            Ok(m) => m.keys().copied().collect(),
            Err(_) => return,
        };
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        for &(name, source) in families {
            if loaded.contains(&name) || pending.contains_key(name) {
                continue;
            }
            let options = self.options.clone();
            let started = std::thread::Builder::new()
                .name(format!("nvrtc-{name}"))
                .spawn(move || nvrtc::compile_shared(&family_source(source), name, &options));
            // A thread that cannot start leaves the family to its first use.
            if let Ok(handle) = started {
                pending.insert(name, handle);
            }
        }
    }

    /// The module of family `name`, compiled and loaded on first use.
    fn module(&self, name: &'static str, source: &str) -> Result<Arc<CudaModule>> {
        let mut m = self
            .modules
            .lock()
            .map_err(|_| anyhow::anyhow!("cuda: module cache poisoned"))?;
        if let Some(x) = m.get(name) {
            return Ok(x.clone());
        }
        let ahead = self.pending.lock().ok().and_then(|mut p| p.remove(name));
        let cubin = match ahead {
            Some(handle) => handle.join().map_err(|_| {
                anyhow::anyhow!("cuda: the compile of kernel family {name} panicked")
            })??,
            None => nvrtc::compile_shared(&family_source(source), name, &self.options)?,
        };
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .with_context(|| format!("cuda: loading module {name} for {}", self.options.arch))?;
        m.insert(name, module.clone());
        Ok(module)
    }

    /// A device copy of `host`; out of memory says how much was asked and how much is free.
    pub fn alloc_copy<T: DeviceRepr>(&self, host: &[T], what: &str) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.oom(e, std::mem::size_of_val(host), what))
    }

    /// Zeroed device memory for `n` values.
    pub fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| self.oom(e, n * std::mem::size_of::<T>(), what))
    }

    /// The error for a failed allocation of `bytes` for `what`: asked and free memory.
    pub(crate) fn oom(&self, e: DriverError, bytes: usize, what: &str) -> anyhow::Error {
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        let free = self.memory().map_or("unknown".to_string(), |(f, t)| {
            format!("{} of {}", gib(f), gib(t))
        });
        anyhow::anyhow!(
            "cuda: cannot allocate {} for {what} on {}: {e} (free: {free})",
            gib(bytes as u64),
            self.info
        )
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().context("cuda: cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names cudarc 0.19 tries for a library, written out by hand.
    fn names(stem: &str) -> Vec<String> {
        [
            ".so",
            "64.so",
            "64_13.so",
            "64_130.so",
            "64_130_0.so",
            "64_130_0.so",
            "64_10.so",
            "64_11.so",
            "64_12.so",
            "64_130_0.so",
            "64_9.so",
            ".so.13",
            ".so.12",
            ".so.11",
            ".so.10",
            ".so.9",
            ".so.1",
        ]
        .iter()
        .map(|e| format!("lib{stem}{e}"))
        .collect()
    }

    #[test]
    fn missing_libraries_fit_two_short_lines() {
        let m = missing_libraries(&[("cuda", "NVIDIA driver"), ("nvrtc", "CUDA 13")], &names);
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines.len(), 2, "{m}");
        assert_eq!(
            lines[0],
            "cuda: no CUDA: libcuda (NVIDIA driver), libnvrtc (CUDA 13) not found; see LD_LIBRARY_PATH"
        );
        assert_eq!(
            lines[1],
            "  tried lib{cuda,nvrtc}{.so, 64.so, 64_{9..13,130}.so, 64_130_0.so, .so.{1,9..13}}"
        );
        // With main's `error: `, both lines fit 100 columns.
        assert!(lines.iter().all(|l| l.len() + "error: ".len() < 100), "{m}");
        let one = missing_libraries(&[("nvrtc", "CUDA 13")], &names);
        assert!(
            one.ends_with(
                "tried libnvrtc{.so, 64.so, 64_{9..13,130}.so, 64_130_0.so, .so.{1,9..13}}"
            ),
            "{one}"
        );
    }

    #[test]
    fn endings_list_each_name_once() {
        let e: Vec<String> = [".so.3", ".so.1", ".so.2", ".so.5", "x.so", ".so.2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(compact_endings(&e), ".so.{1..3,5}, x.so");
        let two: Vec<String> = [".so.7", ".so.8"].iter().map(|s| s.to_string()).collect();
        assert_eq!(compact_endings(&two), ".so.{7,8}");
    }
}
