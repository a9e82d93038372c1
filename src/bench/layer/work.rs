//! The thread CPU time of a span's weight work, split into dequantization and dot products.
//!
//! The CPU reference dequantizes a few weight rows per rayon task and multiplies them at once, so
//! the two kinds of work interleave on every thread, and the engine, which measures nothing,
//! cannot be asked how long each took. After a timed run, [`time`] redoes the reads the
//! counting decorator logged in the same tasks (whole rows,
//! [`rows_per_task`](crate::engine::cpu::math::rows_per_task) each; [`Read::tasks`]): per task
//! the rows are dequantized by [`quant::dequantize`] into a per-thread buffer, then every row
//! meets every token of the read through [`gemm::products`], the reference's own kernels on
//! the same bytes, with a [`ThreadTimer`] around each half.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use rayon::prelude::*;

use super::reads::Read;
use super::FLOOR_ACTIVATION;
use crate::engine::cpu::math::gemm;
use crate::gguf::Model;
use crate::quant;

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

/// Thread-nanoseconds of dequantization and of dot products of `reads`, summed over rayon's
/// threads (see the module documentation).
pub(super) fn time(model: &Model, reads: &[Read<'_>]) -> Result<(u64, u64)> {
    let (dq, mm) = (AtomicU64::new(0), AtomicU64::new(0));
    for r in reads {
        let cols = r.t.info.row_len() as usize;
        if cols == 0 {
            continue;
        }
        let per_task = r.rows_per_task();
        let x = vec![FLOOR_ACTIVATION; r.tokens * cols]; // [tokens, cols]
        (0..r.tasks()).into_par_iter().try_for_each_init(
            || (Vec::new(), Vec::new(), gemm::Scratch::default()),
            |(buf, out, scratch): &mut (Vec<f32>, Vec<f32>, gemm::Scratch), task| -> Result<()> {
                let r0 = r.rows.start + task * per_task;
                let rows = r0..(r0 + per_task).min(r.rows.end);
                let bytes = model.row_data(r.t, rows.clone())?;
                buf.resize(rows.clone().count() * cols, 0.0);
                let timer = ThreadTimer::start();
                quant::dequantize(r.t.info.ty, bytes, buf)
                    .with_context(|| format!("bench: layer: rows {rows:?} of {}", r.t.info.name))?;
                dq.fetch_add(timer.elapsed_ns(), Ordering::Relaxed);
                if r.tokens > 0 {
                    // [rows, tokens]: the task's rows against every token, as the reference.
                    let n = rows.count();
                    out.resize(n * r.tokens, 0.0);
                    let timer = ThreadTimer::start();
                    gemm::products(&x, r.tokens, buf, n, cols, out, scratch);
                    mm.fetch_add(timer.elapsed_ns(), Ordering::Relaxed);
                    std::hint::black_box(&out);
                }
                Ok(())
            },
        )?;
    }
    Ok((dq.into_inner(), mm.into_inner()))
}
