//! The output distribution of both sides: per position, each side's top tokens with log
//! probabilities, entropy, `KL(ref || cand)`, top-1 agreement and the log probability each side
//! gives the prompt's actual next token. All in f64 from the f32 logits.
//!
//! Flat distributions are flagged: the candidate is *flat* when its mean entropy is less than
//! [`FLAT_GAP_RATIO`] of the reference's distance from the uniform distribution (`ln vocab -
//! H`), i.e. its logits carry less than half the information the reference's do. That is the
//! failure glmdiff was made for: top tokens near -5, known tokens at -20, no preference left.

use rayon::prelude::*;
use serde::Serialize;

/// The candidate is flat when `ln V - H_cand < FLAT_GAP_RATIO * (ln V - H_ref)`.
pub const FLAT_GAP_RATIO: f64 = 0.5;

/// One side's view of one position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SideView {
    /// Top tokens, most likely first: (id, logprob).
    pub top: Vec<(u32, f64)>,
    /// Entropy in nats.
    pub entropy: f64,
    /// Logprob of the prompt's next token (absent at the last position).
    pub next_logprob: Option<f64>,
}

/// Both sides at one position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionLogits {
    /// Position in the prompt.
    pub position: usize,
    /// The prompt's next token (absent at the last position).
    pub next_token: Option<u32>,
    /// The reference.
    pub reference: SideView,
    /// The candidate.
    pub candidate: SideView,
    /// `KL(reference || candidate)` in nats.
    pub kl: f64,
    /// Whether the most likely tokens agree.
    pub top1_agree: bool,
}

/// The output distributions of one comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LogitsReport {
    /// Vocabulary size.
    pub vocab: usize,
    /// `ln vocab`: the entropy of a uniform distribution.
    pub uniform_entropy: f64,
    /// Per position.
    pub positions: Vec<PositionLogits>,
    /// Share of positions whose top-1 tokens agree.
    pub top1_agreement: f64,
    /// Largest KL over positions.
    pub max_kl: f64,
    /// Mean KL over positions.
    pub mean_kl: f64,
    /// Mean entropy of the reference and the candidate.
    pub mean_entropy: [f64; 2],
    /// Mean logprob of the prompt's next tokens, reference and candidate (None for one token).
    pub mean_next_logprob: [Option<f64>; 2],
    /// The candidate's distribution is flat where the reference's is not.
    pub candidate_flat: bool,
}

/// Log-softmax of one row in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&l| (f64::from(l) - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&l| f64::from(l) - lse).collect()
}

/// The `k` largest entries (index, value), largest first, ties to the lower index.
pub fn top_k(v: &[f64], k: usize) -> Vec<(u32, f64)> {
    crate::util::topk::top_k(v, k)
        .into_iter()
        .map(|i| (i as u32, v[i]))
        .collect()
}

fn entropy(lp: &[f64]) -> f64 {
    -lp.iter()
        .filter(|l| l.is_finite())
        .map(|&l| l.exp() * l)
        .sum::<f64>()
}

fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .filter(|(lp, _)| lp.is_finite())
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
        .max(0.0)
}

/// Compares `[T, vocab]` logits; `tokens` are the prompt's ids (for the next-token logprobs);
/// `k` top tokens per side.
pub fn analyse(
    reference: &[f32],
    candidate: &[f32],
    vocab: usize,
    tokens: &[u32],
    k: usize,
) -> LogitsReport {
    let vocab = vocab.max(1);
    // One position per task (each on its own, in order).
    let positions: Vec<PositionLogits> = reference
        .par_chunks_exact(vocab)
        .zip(candidate.par_chunks_exact(vocab))
        .enumerate()
        .map(|(t, (r, c))| {
            let (lr, lc) = (log_softmax(r), log_softmax(c));
            let next = tokens.get(t + 1).copied().filter(|&n| (n as usize) < vocab);
            let side = |lp: &[f64]| SideView {
                top: top_k(lp, k),
                entropy: entropy(lp),
                next_logprob: next.map(|n| lp[n as usize]),
            };
            let (sr, sc) = (side(&lr), side(&lc));
            PositionLogits {
                position: t,
                next_token: next,
                kl: kl(&lr, &lc),
                top1_agree: sr.top.first().map(|x| x.0) == sc.top.first().map(|x| x.0),
                reference: sr,
                candidate: sc,
            }
        })
        .collect();
    let n = positions.len().max(1) as f64;
    let mean = |f: &dyn Fn(&PositionLogits) -> f64| positions.iter().map(f).sum::<f64>() / n;
    let mean_next = |f: &dyn Fn(&PositionLogits) -> Option<f64>| {
        let v: Vec<f64> = positions.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let uniform = (vocab as f64).ln();
    let mean_entropy = [
        mean(&|p| p.reference.entropy),
        mean(&|p| p.candidate.entropy),
    ];
    LogitsReport {
        vocab,
        uniform_entropy: uniform,
        top1_agreement: mean(&|p| f64::from(u8::from(p.top1_agree))),
        max_kl: positions.iter().map(|p| p.kl).fold(0.0, f64::max),
        mean_kl: mean(&|p| p.kl),
        mean_next_logprob: [
            mean_next(&|p| p.reference.next_logprob),
            mean_next(&|p| p.candidate.next_logprob),
        ],
        candidate_flat: vocab > 1
            && uniform - mean_entropy[0] > 0.0
            && uniform - mean_entropy[1] < FLAT_GAP_RATIO * (uniform - mean_entropy[0]),
        mean_entropy,
        positions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_hand_two_token_vocabulary() {
        // Reference logits [0, ln 3] -> p = [1/4, 3/4]; candidate [0, 0] -> q = [1/2, 1/2].
        // KL(p||q) = 1/4 ln(1/2) + 3/4 ln(3/2); entropies H(p) = -(1/4 ln 1/4 + 3/4 ln 3/4), H(q) = ln 2.
        let r = [0.0f32, 3f32.ln()];
        let c = [0.0f32, 0.0];
        let a = analyse(&r, &c, 2, &[0], 2);
        let p = &a.positions[0];
        let want_kl = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
        assert!((p.kl - want_kl).abs() < 1e-7, "{}", p.kl);
        let hp = -(0.25 * 0.25f64.ln() + 0.75 * 0.75f64.ln());
        assert!((p.reference.entropy - hp).abs() < 1e-7);
        assert!((p.candidate.entropy - 2f64.ln()).abs() < 1e-12);
        assert_eq!(p.reference.top[0].0, 1);
        // Candidate ties: the lower id first, so top-1 differs.
        assert_eq!(p.candidate.top[0].0, 0);
        assert!(!p.top1_agree);
        assert_eq!(p.next_token, None);
        // Gaps to uniform: reference ln 2 - 0.562 = 0.131, candidate 0 < 0.5 * 0.131: flat.
        assert!(a.candidate_flat);
        // Vocab 4: reference [0, 0, 0, 5] (H = 0.11 nats, gap 1.27), candidate [0, 0, 0, 4]
        // (H = 0.27, gap 1.11 > 0.5 * 1.27): less sharp, not flat; the reverse is not flat either.
        let a = analyse(&[0.0, 0.0, 0.0, 5.0], &[0.0, 0.0, 0.0, 4.0], 4, &[0], 1);
        assert!(a.mean_entropy[0] < 0.2 && !a.candidate_flat);
        let a = analyse(&[0.0, 0.0, 0.0, 4.0], &[0.0, 0.0, 0.0, 5.0], 4, &[0], 1);
        assert!(!a.candidate_flat);
    }

    #[test]
    fn next_token_logprobs_follow_the_prompt() {
        // Two positions, vocab 3; prompt [2, 1]: position 0's next token is 1.
        let r = [0.0f32, 1.0, 2.0, 0.0, 0.0, 0.0];
        let a = analyse(&r, &r, 3, &[2, 1], 3);
        let lp = log_softmax(&r[..3]);
        assert_eq!(a.positions[0].next_token, Some(1));
        assert_eq!(a.positions[0].reference.next_logprob, Some(lp[1]));
        assert_eq!(a.positions[1].next_token, None);
        assert_eq!(a.max_kl, 0.0);
        assert_eq!(a.top1_agreement, 1.0);
        assert!(!a.candidate_flat);
    }
}
