//! Streaming comparison sums: everything a tensor's verdict needs, accumulated chunk by chunk in
//! f64 and merged in a fixed order, so results do not depend on the thread count.

use serde::Serialize;

/// Sums over the compared values of one tensor (or one chunk of it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Acc {
    /// Values compared.
    pub n: u64,
    /// `sum ref^2`.
    pub ref2: f64,
    /// `sum gguf^2`.
    pub gguf2: f64,
    /// `sum gguf * ref`.
    pub dot: f64,
    /// `sum (gguf - ref)^2`.
    pub diff2: f64,
    /// Largest `|gguf - ref|`.
    pub max_abs: f64,
    /// Flat index of [`Acc::max_abs`] (first occurrence).
    pub max_at: u64,
    /// Values that are NaN or infinite in the GGUF where the reference is finite.
    pub nonfinite_gguf: u64,
    /// Values that are NaN or infinite in the reference.
    pub nonfinite_ref: u64,
    /// Expected `sum (gguf - ref)^2` from both sides' rounding (`quant::noise`).
    pub expected: f64,
}

impl Acc {
    /// Adds the values of a chunk whose first value has flat index `first`.
    pub fn add(&mut self, first: u64, gguf: &[f32], reference: &[f32]) {
        for (i, (&a, &b)) in gguf.iter().zip(reference).enumerate() {
            if !b.is_finite() {
                self.nonfinite_ref += 1;
                continue;
            }
            if !a.is_finite() {
                self.nonfinite_gguf += 1;
                continue;
            }
            let (a, b) = (f64::from(a), f64::from(b));
            let d = a - b;
            self.n += 1;
            self.ref2 += b * b;
            self.gguf2 += a * a;
            self.dot += a * b;
            self.diff2 += d * d;
            if d.abs() > self.max_abs {
                self.max_abs = d.abs();
                self.max_at = first + i as u64;
            }
        }
    }

    /// Merges a later chunk.
    pub fn merge(&mut self, o: &Acc) {
        self.n += o.n;
        self.ref2 += o.ref2;
        self.gguf2 += o.gguf2;
        self.dot += o.dot;
        self.diff2 += o.diff2;
        if o.max_abs > self.max_abs {
            self.max_abs = o.max_abs;
            self.max_at = o.max_at;
        }
        self.nonfinite_gguf += o.nonfinite_gguf;
        self.nonfinite_ref += o.nonfinite_ref;
        self.expected += o.expected;
    }

    /// `sum (gguf - ref)^2 / sum ref^2`; `None` when the reference is all zeros.
    pub fn nmse(&self) -> Option<f64> {
        (self.ref2 > 0.0).then(|| self.diff2 / self.ref2)
    }

    /// Expected NMSE from rounding; `None` when the reference is all zeros.
    pub fn expected_nmse(&self) -> Option<f64> {
        (self.ref2 > 0.0).then(|| self.expected / self.ref2)
    }

    /// Cosine similarity; `None` when either side is all zeros.
    pub fn cosine(&self) -> Option<f64> {
        let d = (self.ref2 * self.gguf2).sqrt();
        (d > 0.0).then(|| self.dot / d)
    }

    /// The largest passing `sum (gguf - ref)^2`: `factor` times the expected one, but never more
    /// than `cap * sum ref^2` (NMSE `cap`).
    pub fn allowed(&self, factor: f64, cap: f64) -> f64 {
        let a = factor * self.expected;
        if self.ref2 > 0.0 {
            a.min(cap * self.ref2)
        } else {
            a
        }
    }

    /// Whether the measured error is within [`Acc::allowed`] and no value is non-finite on the
    /// GGUF side only. A reference of zeros passes only what its rounding explains.
    pub fn within(&self, factor: f64, cap: f64) -> bool {
        self.nonfinite_gguf == 0 && self.diff2 <= self.allowed(factor, cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_by_hand() {
        let mut a = Acc::default();
        a.add(0, &[1.0, 2.0], &[1.0, 1.0]);
        let mut b = Acc::default();
        b.add(2, &[f32::NAN, 0.0], &[3.0, 2.0]);
        a.merge(&b);
        assert_eq!(
            (a.n, a.diff2, a.ref2, a.max_abs, a.max_at),
            (3, 5.0, 6.0, 2.0, 3)
        );
        assert_eq!(a.nonfinite_gguf, 1);
        assert_eq!(a.nmse(), Some(5.0 / 6.0));
        assert!(!a.within(1e9, 1e9));
    }
}
