//! Background threads: a rayon pool whose threads run at a lower scheduling priority than the
//! process's others, for work that must not slow the work it runs beside (the comparison of a
//! pass beside the reference's steps: it takes the cores the reference leaves idle, between its
//! steps and in their serial parts, and catches up whenever the driver waits for it). A pool of
//! a fixed size at the normal priority takes its place when one is asked for
//! ([`set_compare_threads`], `--compare-pool N`).
//!
//! The priority is the Linux per-thread nice value (`setpriority` on the thread's id), raised by
//! [`BACKGROUND_NICE`]: raising it needs no privilege. Where it cannot be raised (another
//! system, a refusal), the threads run at the normal priority: only the speed differs, never a
//! value (the work's results do not depend on the threads that run it).

use std::sync::atomic::{AtomicUsize, Ordering};

/// How much the background threads' nice value is raised: at 10 a thread competing with
/// normal ones gets about a tenth of a core's share (the kernel's weights 110 against 1024).
pub const BACKGROUND_NICE: i32 = 10;

/// A pool of `threads` threads named `<name>-<i>`, each at a lower priority
/// ([`BACKGROUND_NICE`]); `None` when the pool cannot be built (its work then runs on the
/// caller's pool).
pub fn pool(name: &str, threads: usize) -> Option<rayon::ThreadPool> {
    pool_at(name, threads, true)
}

/// A pool of `threads` threads named `<name>-<i>`, at a lower priority when `lower`.
fn pool_at(name: &str, threads: usize, lower: bool) -> Option<rayon::ThreadPool> {
    let name = name.to_string();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("{name}-{i}"))
        .start_handler(move |_| {
            if lower {
                lower_this_thread();
            }
        })
        .build()
        .ok()
}

/// The comparison's pool as `--compare-pool` set it: 0 for [`pool`]'s (as many threads as
/// the reference's pool, at a lower priority), else that many threads at the normal priority.
static COMPARE_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the comparison's pool of the passes started from now on (`--compare-pool`): `None`,
/// as many threads as the reference's pool at a lower priority; `Some(n)`, `n` threads at the
/// normal priority (the cores the reference's pool leaves free: `RAYON_NUM_THREADS` sizes it).
pub fn set_compare_threads(n: Option<usize>) {
    COMPARE_THREADS.store(n.unwrap_or(0), Ordering::Relaxed);
}

/// The pool the comparison of a pass runs its parallel work on, as [`set_compare_threads`]
/// set it, beside a reference pool of `reference_threads`; `None` when it cannot be built.
pub fn compare_pool(reference_threads: usize) -> Option<rayon::ThreadPool> {
    match COMPARE_THREADS.load(Ordering::Relaxed) {
        0 => pool("compare", reference_threads),
        n => pool_at("compare", n, false),
    }
}

/// Raises the calling thread's nice value by [`BACKGROUND_NICE`] (best effort); whether it did.
pub fn lower_this_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid takes no arguments and returns the calling thread's id.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        // SAFETY: getpriority/setpriority take plain integers (the thread's id as the "process"
        // of PRIO_PROCESS, Linux's per-thread priority); errno is cleared first so that a
        // legitimate -1 from getpriority is told from an error.
        unsafe {
            *libc::__errno_location() = 0;
            let now = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            if now == -1 && *libc::__errno_location() != 0 {
                return false;
            }
            libc::setpriority(
                libc::PRIO_PROCESS,
                tid as libc::id_t,
                (now + BACKGROUND_NICE).min(19),
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool's threads run its work at a nice value raised by BACKGROUND_NICE (capped at
    /// 19), the caller's own stays as it was, and a parallel sum gives the same value there.
    #[test]
    fn pool_threads_run_lower() {
        #[cfg(target_os = "linux")]
        fn nice() -> i32 {
            // SAFETY: as in lower_this_thread.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid);
                libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t)
            }
        }
        let p = pool("test-bg", 2).expect("a pool");
        #[cfg(target_os = "linux")]
        {
            let before = nice();
            let inside = p.install(nice);
            assert_eq!(inside, (before + BACKGROUND_NICE).min(19));
            assert_eq!(nice(), before);
        }
        use rayon::prelude::*;
        let v: Vec<f64> = (0..100_000).map(|i| f64::from(i) * 0.5).collect();
        let chunks = |v: &[f64]| -> f64 {
            let s: Vec<f64> = v.par_chunks(1000).map(|c| c.iter().sum::<f64>()).collect();
            s.iter().sum()
        };
        assert_eq!(p.install(|| chunks(&v)).to_bits(), chunks(&v).to_bits());
        // `--compare-pool N`: N threads at the caller's priority.
        let q = pool_at("test-normal", 3, false).expect("a pool");
        assert_eq!(q.current_num_threads(), 3);
        #[cfg(target_os = "linux")]
        assert_eq!(q.install(nice), nice());
    }
}
