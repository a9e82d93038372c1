//! Prompt tokens from `--tokens` or `--prompt`, and how a token is shown.

use anyhow::{Context, Result};

use crate::tokenizer::Tokenizer;

/// Prompt tokens from `--tokens` or `--prompt` (the tokenizer adds BOS when the model asks);
/// `None` when neither is given. `what` names the command in errors.
pub fn prompt_tokens(
    tokens: &Option<Vec<u32>>,
    prompt: &Option<String>,
    tokenizer: &Result<Tokenizer>,
    what: &str,
) -> Result<Option<Vec<u32>>> {
    Ok(match (tokens, prompt) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(p)) => {
            let tok = tokenizer.as_ref().map_err(|e| anyhow::anyhow!("{e:#}")).with_context(|| {
                format!("{what}: --prompt needs the model's tokenizer; pass ids with --tokens instead")
            })?;
            let mut ids = Vec::new();
            if tok.add_bos() {
                ids.extend(tok.bos_id());
            }
            ids.extend(tok.encode(p)?);
            Some(ids)
        }
        (None, None) => None,
    })
}

/// How a token is shown: its decoded text quoted, or its vocabulary entry when it is a partial
/// UTF-8 sequence, or `?` without a tokenizer.
pub fn token_text(tok: Option<&Tokenizer>, id: u32) -> String {
    let Some(tok) = tok else {
        return "?".into();
    };
    match tok.decode(&[id]) {
        Ok(t) if !t.contains('\u{FFFD}') => format!("{t:?}"),
        _ => tok.token_text(id).map_or("?".into(), |v| format!("<{v}>")),
    }
}

/// How a candidate next token of `trace` is shown: its decoded text quoted, or, when it is a
/// partial UTF-8 sequence (one byte of a multi-byte character), its vocabulary entry marked as
/// such; `None` when it cannot be decoded.
pub fn token_label(tok: &Tokenizer, id: u32) -> Option<String> {
    let text = tok.decode(&[id]).ok()?;
    if text.contains('\u{FFFD}') {
        tok.token_text(id)
            .map(|v| format!("(partial UTF-8) vocab entry {v:?}"))
    } else {
        Some(format!("{text:?}"))
    }
}
