//! Text summary of `glmdiff trace`: the next-token prediction at the last position.

use std::fmt::Write as _;

use super::table;
use crate::util::topk::top_k;

/// One candidate next token.
#[derive(Clone, Debug)]
pub struct NextToken {
    /// Token id.
    pub id: usize,
    /// Decoded text as shown (quoted), when the model has a tokenizer.
    pub text: Option<String>,
    /// Raw logit.
    pub logit: f32,
    /// log softmax over the whole vocabulary (computed in f64).
    pub logprob: f64,
}

/// The `k` most likely next tokens given the logits of one position (ties: lower id first).
pub fn top_next(logits: &[f32], k: usize) -> Vec<(usize, f32, f64)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    top_k(logits, k)
        .into_iter()
        .map(|i| (i, logits[i], logits[i] as f64 - lse))
        .collect()
}

/// Renders the next-token table.
pub fn render_next(position: usize, next: &[NextToken]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "next token after position {position}:");
    let mut t = table(&["rank", "id", "text", "logit", "logprob"]);
    for (r, n) in next.iter().enumerate() {
        t.add_row(vec![
            (r + 1).to_string(),
            n.id.to_string(),
            n.text.clone().unwrap_or_else(|| "-".into()),
            format!("{:.4}", n.logit),
            format!("{:.4}", n.logprob),
        ]);
    }
    let _ = writeln!(s, "{t}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_next_is_log_softmax_by_hand() {
        // logits [0, ln 3]: softmax = [1/4, 3/4].
        let l = [0.0f32, 3f32.ln()];
        let t = top_next(&l, 2);
        assert_eq!(t[0].0, 1);
        assert!((t[0].2 - 0.75f64.ln()).abs() < 1e-7);
        assert!((t[1].2 - 0.25f64.ln()).abs() < 1e-7);
    }
}
