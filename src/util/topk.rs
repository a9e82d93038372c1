//! Top-k with ties: the indices of the `k` largest scores, largest first, equal scores in
//! ascending index order. One stable order for every top-k in glmdiff (DSA key selection,
//! expert routing, next-token candidates), so a result never depends on the sort
//! implementation.

use std::cmp::Ordering;

/// A score with a total order (floats by IEEE 754 `totalOrder`, so NaN and -0.0 have a place).
pub trait Score {
    /// Compares `self` with `other` in the total order.
    fn total_order(&self, other: &Self) -> Ordering;
}

impl Score for f32 {
    fn total_order(&self, other: &Self) -> Ordering {
        self.total_cmp(other)
    }
}

impl Score for f64 {
    fn total_order(&self, other: &Self) -> Ordering {
        self.total_cmp(other)
    }
}

/// Indices of the `min(k, scores.len())` largest scores, largest first; ties go to the lower
/// index.
///
/// The order (score descending, then index ascending) is total, so the `k` first are one set
/// in one order however they are found: the `k` are selected first (linear time), then only
/// they are sorted (a row of 154880 logits keeps 5, a DSA row of 4096 scores 2048).
pub fn top_k<T: Score>(scores: &[T], k: usize) -> Vec<usize> {
    let order = |a: &usize, b: &usize| scores[*b].total_order(&scores[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn largest_first_ties_to_the_lower_index() {
        assert_eq!(top_k(&[1.0f32, 3.0, 3.0, 2.0], 3), vec![1, 2, 3]);
        assert_eq!(top_k(&[0.5f64, -1.0, 0.5, 0.5], 2), vec![0, 2]);
        assert_eq!(top_k(&[5.0f32], 4), vec![0]);
        assert!(top_k::<f64>(&[], 2).is_empty());
        assert!(top_k(&[1.0f32], 0).is_empty());
    }

    /// The selection is the whole sort's first k, for every k, with many ties, -0.0, NaN and
    /// infinities among the scores.
    #[test]
    fn selection_is_the_sorts_prefix() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in [1usize, 2, 7, 64, 301] {
            let v: Vec<f32> = (0..n)
                .map(|_| match next() % 9 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::NAN,
                    3 => f32::INFINITY,
                    4 => f32::NEG_INFINITY,
                    r => (r % 3) as f32 + (next() % 4) as f32 * 0.25,
                })
                .collect();
            let mut all: Vec<usize> = (0..n).collect();
            all.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
            for k in 0..=n + 1 {
                assert_eq!(top_k(&v, k), all[..k.min(n)].to_vec(), "n={n} k={k}");
            }
        }
    }
}
