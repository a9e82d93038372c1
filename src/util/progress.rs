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

/// A writer that counts the bytes written through it as units of a [`Progress`] (a phase
/// started by the caller), so that writing a large output shows how far it is.
pub struct ProgressWriter<'a> {
    inner: &'a mut dyn std::io::Write,
    progress: &'a dyn Progress,
}

impl<'a> ProgressWriter<'a> {
    /// Writes through `inner`, adding each write's bytes to `progress`.
    pub fn new(
        inner: &'a mut dyn std::io::Write,
        progress: &'a dyn Progress,
    ) -> ProgressWriter<'a> {
        ProgressWriter { inner, progress }
    }
}

impl std::io::Write for ProgressWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.progress.inc(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::io::Write;

    struct Count(Cell<u64>);

    impl Progress for Count {
        fn start(&self, _: &str, _: u64) {}
        fn inc(&self, n: u64) {
            self.0.set(self.0.get() + n);
        }
        fn finish(&self) {}
    }

    #[test]
    fn progress_writer_counts_every_byte_written() {
        let c = Count(Cell::new(0));
        let mut out = Vec::new();
        let mut w = ProgressWriter::new(&mut out, &c);
        w.write_all(&[7u8; 1000]).unwrap();
        w.write_all(b"abc").unwrap();
        assert_eq!(c.0.get(), 1003);
        assert_eq!(out.len(), 1003);
    }
}
