//! Text summary of `glmdiff trace`: the next-token prediction at the last position.

use std::fmt::Write as _;

use super::table;

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
