//! Process memory and CPU time from `/proc/self` (Linux), and a thread that samples resident
//! memory while a run goes on. Everything here degrades to `None` / zero elsewhere.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Bytes in the kB unit of `/proc/self/status`.
const KB: u64 = 1024;

/// Resident memory of the process, bytes (from `/proc/self/status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Rss {
    /// `VmRSS`: all resident pages (anonymous + file-backed + shared).
    pub vm_rss: u64,
    /// `RssAnon`: anonymous pages (heap: f32 buffers, activations).
    pub rss_anon: u64,
    /// `RssFile`: resident pages of mapped files (the GGUF map: quantized weights read).
    pub rss_file: u64,
    /// `VmHWM`: peak of `VmRSS` since start or since the last reset (`/proc/self/clear_refs`).
    pub vm_hwm: u64,
}

/// Parses the text of `/proc/self/status`. Missing fields stay 0.
pub fn parse_status(text: &str) -> Rss {
    let mut r = Rss::default();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok());
        let Some(kb) = kb else { continue };
        match key {
            "VmRSS" => r.vm_rss = kb * KB,
            "RssAnon" => r.rss_anon = kb * KB,
            "RssFile" => r.rss_file = kb * KB,
            "VmHWM" => r.vm_hwm = kb * KB,
            _ => {}
        }
    }
    r
}

/// The process's resident memory now, or `None` without `/proc/self/status`.
pub fn rss() -> Option<Rss> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .map(|s| parse_status(&s))
}

/// Resets `VmHWM` to the current `VmRSS` (writes `5` to `/proc/self/clear_refs`, Linux 4.0+).
/// Returns whether it worked.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// CPU time of every thread of the process, nanoseconds: the sum of the first field of
/// `/proc/self/task/*/schedstat` (time on a CPU). `None` when unavailable.
pub fn cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    let mut any = false;
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        if let Some(ns) = text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        {
            total += ns;
            any = true;
        }
    }
    any.then_some(total)
}

/// The system's load averages (`/proc/loadavg`, first three fields), or "unknown".
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".to_string())
}

/// Peaks of `RssAnon` and `RssFile` seen by a sampling thread ([`Sampler::watch`]), overall and
/// since the last [`Sampler::take_span_anon`].
#[derive(Debug, Default)]
pub struct Sampler {
    stop: AtomicBool,
    peak_anon: AtomicU64,
    peak_file: AtomicU64,
    span_anon: AtomicU64,
}

impl Sampler {
    /// Samples every `interval` until [`Sampler::stop`]; run it on its own thread.
    pub fn watch(&self, interval: Duration) {
        while !self.stop.load(Ordering::Relaxed) {
            self.sample();
            std::thread::sleep(interval);
        }
        self.sample();
    }

    fn sample(&self) {
        if let Some(r) = rss() {
            self.peak_anon.fetch_max(r.rss_anon, Ordering::Relaxed);
            self.peak_file.fetch_max(r.rss_file, Ordering::Relaxed);
            self.span_anon.fetch_max(r.rss_anon, Ordering::Relaxed);
        }
    }

    /// Asks [`Sampler::watch`] to return after one last sample.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The peak `RssAnon` since the previous call (or the start), including the value now; the
    /// next span starts from the value now.
    pub fn take_span_anon(&self) -> u64 {
        let now = rss().map_or(0, |r| r.rss_anon);
        self.span_anon.swap(now, Ordering::Relaxed).max(now)
    }

    /// Overall peaks `(RssAnon, RssFile)` seen so far.
    pub fn peaks(&self) -> (u64, u64) {
        (
            self.peak_anon.load(Ordering::Relaxed),
            self.peak_file.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse_in_bytes() {
        let text = "Name:\tx\nVmHWM:\t    1764 kB\nVmRSS:\t    1700 kB\nRssAnon:\t     116 kB\n\
                    RssFile:\t    1584 kB\nThreads:\t1\n";
        let r = parse_status(text);
        assert_eq!(
            r,
            Rss {
                vm_rss: 1700 * 1024,
                rss_anon: 116 * 1024,
                rss_file: 1584 * 1024,
                vm_hwm: 1764 * 1024,
            }
        );
    }
}
