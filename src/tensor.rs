//! Tensors in host memory ([`HostTensor`]): the currency between engines, the driver, trace files
//! and comparisons. PyTorch-order shapes (slowest dimension first), row-major values, f32 for
//! activations and i32 for indices. It sits at the bottom of the crate so that `engine`, `trace`
//! and `compare` all use it without importing each other.

use std::sync::Arc;

use anyhow::{bail, Result};

/// Values of a host tensor, shared: a clone of a tensor shares its values (a hook handed to the
/// driver, the followed chain and a comparison is one buffer), and a write to one of several
/// sharers copies them first ([`HostTensor::as_f32_mut`], [`HostTensor::as_i32_mut`]).
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// Floating point activations.
    F32(Arc<Vec<f32>>),
    /// Indices (expert ids, selected key positions; -1 = none).
    I32(Arc<Vec<i32>>),
}

/// A tensor in host memory: PyTorch-order shape (slowest first) and row-major values.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Shape, slowest dimension first.
    pub shape: Vec<usize>,
    /// Values, `shape.iter().product()` of them.
    pub data: HostData,
}

impl HostTensor {
    /// An f32 tensor; fails when `data` does not have `shape`'s element count.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<HostTensor> {
        check_len(&shape, data.len())?;
        Ok(HostTensor {
            shape,
            data: HostData::F32(Arc::new(data)),
        })
    }

    /// An i32 tensor; fails when `data` does not have `shape`'s element count.
    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Result<HostTensor> {
        check_len(&shape, data.len())?;
        Ok(HostTensor {
            shape,
            data: HostData::I32(Arc::new(data)),
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f32 values, or an error naming `what` when the tensor holds integers.
    pub fn as_f32(&self, what: &str) -> Result<&[f32]> {
        match &self.data {
            HostData::F32(v) => Ok(v),
            HostData::I32(_) => bail!("tensor: {what}: expected f32 values, got i32"),
        }
    }

    /// The i32 values, or an error naming `what` when the tensor holds floats.
    pub fn as_i32(&self, what: &str) -> Result<&[i32]> {
        match &self.data {
            HostData::I32(v) => Ok(v),
            HostData::F32(_) => bail!("tensor: {what}: expected i32 values, got f32"),
        }
    }

    /// The f32 values to write, copied first when another tensor shares them; an error naming
    /// `what` when the tensor holds integers.
    pub fn as_f32_mut(&mut self, what: &str) -> Result<&mut [f32]> {
        match &mut self.data {
            HostData::F32(v) => Ok(Arc::make_mut(v).as_mut_slice()),
            HostData::I32(_) => bail!("tensor: {what}: expected f32 values, got i32"),
        }
    }

    /// The i32 values to write, copied first when another tensor shares them; an error naming
    /// `what` when the tensor holds floats.
    pub fn as_i32_mut(&mut self, what: &str) -> Result<&mut [i32]> {
        match &mut self.data {
            HostData::I32(v) => Ok(Arc::make_mut(v).as_mut_slice()),
            HostData::F32(_) => bail!("tensor: {what}: expected i32 values, got f32"),
        }
    }

    /// Whether `other` holds the very values of this tensor (one shares the other's buffer):
    /// then they are equal bit for bit without a look at them.
    pub fn shares_values(&self, other: &HostTensor) -> bool {
        self.shape == other.shape
            && match (&self.data, &other.data) {
                (HostData::F32(a), HostData::F32(b)) => Arc::ptr_eq(a, b),
                (HostData::I32(a), HostData::I32(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }

    /// Replaces row `row` of the first axis with the same row of `other`, which has the same
    /// shape and kind of values.
    pub fn copy_row_from(&mut self, row: usize, other: &HostTensor) -> Result<()> {
        let rows = self.shape.first().copied().unwrap_or(0);
        if other.shape != self.shape || row >= rows {
            bail!(
                "tensor: row {row} of shape {:?} cannot be taken from shape {:?}",
                self.shape,
                other.shape
            );
        }
        let w = self.len() / rows;
        let span = row * w..(row + 1) * w;
        if self.shares_values(other) {
            return Ok(());
        }
        match (&mut self.data, &other.data) {
            (HostData::F32(a), HostData::F32(b)) => {
                Arc::make_mut(a)[span.clone()].copy_from_slice(&b[span])
            }
            (HostData::I32(a), HostData::I32(b)) => {
                Arc::make_mut(a)[span.clone()].copy_from_slice(&b[span])
            }
            _ => bail!("tensor: row {row}: f32 and i32 values do not mix"),
        }
        Ok(())
    }

    /// Whether `other` has the same shape, kind and bits of every value (unlike `==`, which
    /// takes `0.0` and `-0.0` for equal and a NaN for unequal to itself): what the same
    /// arithmetic on both gives the same bits for.
    pub fn same_bits(&self, other: &HostTensor) -> bool {
        self.shares_values(other)
            || self.shape == other.shape
                && match (&self.data, &other.data) {
                    (HostData::F32(a), HostData::F32(b)) => {
                        a.len() == b.len()
                            && a.iter()
                                .zip(b.iter())
                                .all(|(x, y)| x.to_bits() == y.to_bits())
                    }
                    (HostData::I32(a), HostData::I32(b)) => a == b,
                    _ => false,
                }
    }

    /// Rows `rows` of the first axis, in that order: `[rows.len(), ..]`; an error when one is
    /// past the first axis.
    pub fn gather_rows(&self, rows: &[usize]) -> Result<HostTensor> {
        let n = self.shape.first().copied().unwrap_or(0);
        let width = self.len().checked_div(n).unwrap_or(0);
        if let Some(r) = rows.iter().find(|&&r| r >= n) {
            bail!(
                "tensor: row {r} of shape {:?} does not exist ({} rows asked for)",
                self.shape,
                rows.len()
            );
        }
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows.len();
        }
        fn pick<T: Copy>(v: &[T], rows: &[usize], width: usize) -> Vec<T> {
            rows.iter()
                .flat_map(|&r| v[r * width..(r + 1) * width].iter().copied())
                .collect()
        }
        match &self.data {
            HostData::F32(v) => HostTensor::f32(shape, pick(v, rows, width)),
            HostData::I32(v) => HostTensor::i32(shape, pick(v, rows, width)),
        }
    }

    /// The non-finite values of an f32 tensor, viewed as rows of its first axis: the first
    /// one and how many (`None`: every value is finite, or the tensor holds ids). With
    /// `masked_after_row`, `-inf` after the row's own column (row `t`, column `s > t`: the
    /// causal mask of the DSA index scores) is not counted.
    pub fn non_finite(&self, masked_after_row: bool) -> Option<NonFinite> {
        let HostData::F32(v) = &self.data else {
            return None;
        };
        // Most tensors hold none: found by the vectorised search, the slow loop below runs only
        // from the first non-finite value on.
        let first = crate::quant::first_non_finite(v)?;
        let rows = self.shape.first().copied().unwrap_or(1).max(1);
        let cols = v.len() / rows;
        let mut found: Option<NonFinite> = None;
        for (i, &x) in v.iter().enumerate().skip(first) {
            if x.is_finite() {
                continue;
            }
            let (row, col) = (i / cols.max(1), i % cols.max(1));
            if masked_after_row && x == f32::NEG_INFINITY && col > row {
                continue;
            }
            match &mut found {
                Some(f) => f.count += 1,
                None => {
                    found = Some(NonFinite {
                        row,
                        col,
                        value: x,
                        count: 1,
                    })
                }
            }
        }
        found
    }

    /// `(rows, cols)` of a 2-D tensor, or an error naming `what`.
    pub fn dims2(&self, what: &str) -> Result<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            _ => bail!(
                "tensor: {what}: expected a 2-D tensor, got shape {:?}",
                self.shape
            ),
        }
    }
}

/// Where a tensor holds non-finite values ([`HostTensor::non_finite`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NonFinite {
    /// Row (first axis) of the first one.
    pub row: usize,
    /// Its position within the row (the rest of the axes flattened).
    pub col: usize,
    /// Its value (NaN, `inf` or `-inf`).
    pub value: f32,
    /// How many there are.
    pub count: usize,
}

impl std::fmt::Display for NonFinite {
    /// `12 non-finite values, the first inf at row 3, column 40`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} non-finite value{}, the first {} at row {}, column {}",
            self.count,
            if self.count == 1 { "" } else { "s" },
            self.value,
            self.row,
            self.col
        )
    }
}

fn check_len(shape: &[usize], n: usize) -> Result<()> {
    let want: usize = shape.iter().product();
    if want != n {
        bail!("tensor: shape {shape:?} needs {want} values, got {n}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first non-finite value and the count, by hand: none; one after 300 finite values;
    /// the causal mask's `-inf` above the diagonal left out, a NaN below it counted.
    #[test]
    fn non_finite_by_hand() {
        let t = |shape: Vec<usize>, v: Vec<f32>| HostTensor::f32(shape, v).unwrap();
        assert!(t(vec![2, 300], vec![1.0; 600]).non_finite(false).is_none());
        let mut v = vec![0.5f32; 600];
        v[301] = f32::INFINITY;
        v[599] = f32::NAN;
        let f = t(vec![2, 300], v).non_finite(false).unwrap();
        assert_eq!((f.row, f.col, f.value, f.count), (1, 1, f32::INFINITY, 2));
        // 3 x 3 scores: -inf above the diagonal (masked), a NaN at (2, 0).
        let n = f32::NEG_INFINITY;
        let scores = vec![0.0, n, n, 0.0, 0.0, n, f32::NAN, 0.0, 0.0];
        let f = t(vec![3, 3], scores.clone()).non_finite(true).unwrap();
        assert_eq!((f.row, f.col, f.count), (2, 0, 1));
        assert!(f.value.is_nan());
        let f = t(vec![3, 3], scores).non_finite(false).unwrap();
        assert_eq!((f.row, f.col, f.value, f.count), (0, 1, n, 4));
    }
}
