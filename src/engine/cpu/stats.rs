//! Counters of the CPU engine's work on weights, for `glmdiff bench layer`: thread CPU time
//! inside the dequantizers and in the dot products against dequantized weight rows, with the
//! bytes, values and multiply-adds behind them. Counting is opt-in
//! ([`CpuEngine::with_stats`](super::CpuEngine::with_stats)) and changes no value.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;

/// Measures the CPU time of the calling thread (Linux `CLOCK_THREAD_CPUTIME_ID`: time the thread
/// ran, not time it waited while preempted), or wall time where that clock is unavailable.
#[derive(Clone, Copy, Debug)]
pub struct ThreadTimer {
    cpu_ns: Option<u64>,
    wall: Instant,
}

impl ThreadTimer {
    /// Starts measuring.
    pub fn start() -> ThreadTimer {
        ThreadTimer {
            cpu_ns: thread_cpu_ns(),
            wall: Instant::now(),
        }
    }

    /// Nanoseconds of CPU time of this thread since [`ThreadTimer::start`] (wall time when the
    /// CPU clock is unavailable). Call it on the thread that started the timer.
    pub fn elapsed_ns(&self) -> u64 {
        match (self.cpu_ns, thread_cpu_ns()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => self.wall.elapsed().as_nanos() as u64,
        }
    }
}

/// CPU time of the calling thread, nanoseconds (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`).
#[cfg(target_os = "linux")]
fn thread_cpu_ns() -> Option<u64> {
    use std::os::raw::{c_int, c_long};
    /// `struct timespec` of the Linux C ABIs (`time_t` and `long` are both `long`).
    #[repr(C)]
    struct Timespec {
        tv_sec: c_long,
        tv_nsec: c_long,
    }
    extern "C" {
        fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int;
    }
    /// `CLOCK_THREAD_CPUTIME_ID` of `<linux/time.h>`.
    const CLOCK_THREAD_CPUTIME_ID: c_int = 3;
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime (libc, linked by std) writes one `struct timespec`, whose layout
    // `Timespec` reproduces, through a pointer to a live local; it keeps no reference to it.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// No thread CPU clock: [`ThreadTimer`] measures wall time.
#[cfg(not(target_os = "linux"))]
fn thread_cpu_ns() -> Option<u64> {
    None
}

/// Counters of the work done on a model's weights, shared by every thread: relaxed atomic adds
/// and two reads of the thread CPU clock per task of up to 64 Ki values (a system call each,
/// about 0.6 us on the reference VM: a few percent of a task, paid only when counting).
///
/// - dequantization: thread CPU nanoseconds inside the dequantizers ([`ThreadTimer`], summed
///   over rayon's threads, so with N busy threads it grows up to N times faster than the wall
///   clock), calls, quantized bytes read, f32 values produced;
/// - matmul arithmetic: thread CPU nanoseconds in the dot products that consume dequantized
///   rows (CPU engine matmuls against weights) and their multiply-adds.
///
/// Filled only by a [`CpuEngine`](super::CpuEngine) made with
/// [`CpuEngine::with_stats`](super::CpuEngine::with_stats); the values it computes never change.
#[derive(Debug, Default)]
pub struct WeightStats {
    dequant_ns: AtomicU64,
    dequant_calls: AtomicU64,
    bytes_in: AtomicU64,
    values_out: AtomicU64,
    matmul_ns: AtomicU64,
    madds: AtomicU64,
}

/// A snapshot of [`WeightStats`] (or the difference of two).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WeightCounts {
    /// Thread-nanoseconds spent dequantizing.
    pub dequant_ns: u64,
    /// Dequantization calls (tasks).
    pub dequant_calls: u64,
    /// Quantized bytes read.
    pub bytes_in: u64,
    /// f32 values produced.
    pub values_out: u64,
    /// Thread-nanoseconds in weight matmul dot products.
    pub matmul_ns: u64,
    /// Multiply-adds of those dot products.
    pub madds: u64,
}

impl WeightCounts {
    /// The counts accumulated since `earlier`.
    pub fn since(&self, earlier: &WeightCounts) -> WeightCounts {
        WeightCounts {
            dequant_ns: self.dequant_ns.saturating_sub(earlier.dequant_ns),
            dequant_calls: self.dequant_calls.saturating_sub(earlier.dequant_calls),
            bytes_in: self.bytes_in.saturating_sub(earlier.bytes_in),
            values_out: self.values_out.saturating_sub(earlier.values_out),
            matmul_ns: self.matmul_ns.saturating_sub(earlier.matmul_ns),
            madds: self.madds.saturating_sub(earlier.madds),
        }
    }
}

impl WeightStats {
    /// The current counts.
    pub fn snapshot(&self) -> WeightCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WeightCounts {
            dequant_ns: r(&self.dequant_ns),
            dequant_calls: r(&self.dequant_calls),
            bytes_in: r(&self.bytes_in),
            values_out: r(&self.values_out),
            matmul_ns: r(&self.matmul_ns),
            madds: r(&self.madds),
        }
    }

    /// Records one dequantization call timed by `timer` (started on this thread).
    pub fn add_dequant(&self, timer: &ThreadTimer, bytes_in: usize, values_out: usize) {
        let ns = timer.elapsed_ns();
        self.dequant_ns.fetch_add(ns, Ordering::Relaxed);
        self.dequant_calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_in.fetch_add(bytes_in as u64, Ordering::Relaxed);
        self.values_out
            .fetch_add(values_out as u64, Ordering::Relaxed);
    }

    /// Records dot products of `madds` multiply-adds timed by `timer` (started on this thread).
    pub fn add_matmul(&self, timer: &ThreadTimer, madds: usize) {
        let ns = timer.elapsed_ns();
        self.matmul_ns.fetch_add(ns, Ordering::Relaxed);
        self.madds.fetch_add(madds as u64, Ordering::Relaxed);
    }
}
