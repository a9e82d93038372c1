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
pub fn top_k<T: Score>(scores: &[T], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_order(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
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
    }
}
