//! Progress of long work, reported by the library (which never prints) to whoever displays it
//! (`report::progress` draws bars).

/// Progress of long work: a phase of units (layers, chunks) at a time.
pub trait Progress {
    /// A phase of `total` units begins.
    fn start(&self, what: &str, total: u64);
    /// The phase's work is now `what` (the output layer after the layers); the count goes on.
    fn phase(&self, what: &str) {
        let _ = what;
    }
    /// `n` more units are done.
    fn inc(&self, n: u64);
    /// The phase ended.
    fn finish(&self);
}

/// A [`Progress`] that reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _: &str, _: u64) {}
    fn inc(&self, _: u64) {}
    fn finish(&self) {}
}
