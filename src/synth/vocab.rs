//! A small but valid GPT-2 byte-level BPE tokenizer for synthetic models: the 256 byte
//! tokens, merges that build a few dozen common words letter by letter, the architecture's
//! special tokens at the end of the vocabulary (where the real models keep them) and `[PADn]`
//! tokens of type UNUSED in between, so that the token count equals `token_embd`'s rows as
//! llama.cpp's converter pads it.

use std::collections::HashSet;

use anyhow::{bail, Result};

use crate::gguf::{GgufWriter, Value, ValueType};
use crate::model::Arch;
use crate::tokenizer::TokenType;

/// Words whose merges are included (each also with a leading space).
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "on",
    "with",
    "as",
    "was",
    "be",
    "by",
    "this",
    "are",
    "or",
    "at",
    "from",
    "hello",
    "world",
    "model",
    "token",
    "layer",
    "expert",
    "attention",
    "tensor",
    "quant",
    "GLM",
    "Deep",
    "Seek",
    "The",
    "2025",
    "你好",
    "模型",
];

/// GPT-2 `bytes_to_unicode` (openai/gpt-2 `src/encoder.py`): the character for byte `b`.
fn byte_char(b: u8) -> char {
    let printable = |x: u32| (0x21..=0x7E).contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    let x = u32::from(b);
    if printable(x) {
        return char::from(b);
    }
    let rank = (0..x).filter(|&y| !printable(y)).count() as u32;
    char::from_u32(0x100 + rank).unwrap_or('\u{FFFD}')
}

/// Special tokens of each architecture (as in the real `tokenizer.json` files).
fn specials(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::GlmDsa => &[
            "<|endoftext|>",
            "[MASK]",
            "[gMASK]",
            "[sMASK]",
            "<sop>",
            "<eop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<think>",
            "</think>",
        ],
        Arch::Deepseek2 => &[
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜▁pad▁｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<think>",
            "</think>",
        ],
    }
}

/// The vocabulary: token texts, types and merges.
#[derive(Clone, Debug)]
pub struct Vocab {
    /// Token texts (index = id).
    pub tokens: Vec<String>,
    /// Token types (index = id).
    pub types: Vec<TokenType>,
    /// Merges in rank order ("left right").
    pub merges: Vec<String>,
    /// BOS id (DeepSeek) .
    pub bos: Option<u32>,
    /// EOS id.
    pub eos: u32,
    /// Padding id.
    pub pad: u32,
}

/// Builds the vocabulary of `arch` with exactly `n_vocab` tokens.
pub fn build(arch: Arch, n_vocab: u64) -> Result<Vocab> {
    let sp = specials(arch);
    let min = 256 + sp.len() as u64;
    if n_vocab < min {
        bail!("synth: vocabulary of {n_vocab} tokens is too small (needs at least {min})");
    }
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    let room = (n_vocab - min) as usize;
    'words: for w in WORDS.iter().flat_map(|w| [format!(" {w}"), w.to_string()]) {
        let chars: Vec<String> = w.bytes().map(|b| byte_char(b).to_string()).collect();
        let mut cur = chars[0].clone();
        for c in &chars[1..] {
            let joined = format!("{cur}{c}");
            if seen.insert(joined.clone()) {
                if merges.len() == room {
                    break 'words;
                }
                merges.push(format!("{cur} {c}"));
                tokens.push(joined.clone());
            }
            cur = joined;
        }
    }
    let mut types = vec![TokenType::Normal; tokens.len()];
    let n_pad = n_vocab as usize - tokens.len() - sp.len();
    for i in 0..n_pad {
        tokens.push(format!("[PAD{i}]"));
        types.push(TokenType::Unused);
    }
    let first_special = tokens.len() as u32;
    for s in sp {
        tokens.push(s.to_string());
        types.push(TokenType::Control);
    }
    let (bos, eos, pad) = match arch {
        Arch::GlmDsa => (None, first_special, first_special),
        Arch::Deepseek2 => (Some(first_special), first_special + 1, first_special + 2),
    };
    Ok(Vocab {
        tokens,
        types,
        merges,
        bos,
        eos,
        pad,
    })
}

impl Vocab {
    /// Writes the `tokenizer.ggml.*` keys.
    pub fn write_metadata(&self, arch: Arch, w: &mut GgufWriter) -> Result<()> {
        w.add_str("tokenizer.ggml.model", "gpt2")?;
        w.add_str("tokenizer.ggml.pre", arch.tokenizer_pre())?;
        w.add_str_array("tokenizer.ggml.tokens", &self.tokens)?;
        let types = self.types.iter().map(|&t| Value::I32(t as i32)).collect();
        w.add(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types),
        )?;
        w.add_str_array("tokenizer.ggml.merges", &self.merges)?;
        if let Some(b) = self.bos {
            w.add_u32("tokenizer.ggml.bos_token_id", b)?;
        }
        w.add_u32("tokenizer.ggml.eos_token_id", self.eos)?;
        w.add_u32("tokenizer.ggml.padding_token_id", self.pad)?;
        w.add_bool("tokenizer.ggml.add_bos_token", self.bos.is_some())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_match_gpt2() {
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(0xAD), 'Ń');
        assert_eq!(byte_char(b'a'), 'a');
    }

    #[test]
    fn vocab_has_the_requested_size_and_merges_fit() {
        for (arch, n) in [(Arch::GlmDsa, 512), (Arch::Deepseek2, 129_280)] {
            let v = build(arch, n).unwrap();
            assert_eq!(v.tokens.len() as u64, n);
            assert_eq!(v.types.len() as u64, n);
            assert!(v.merges.len() > 100, "{}", v.merges.len());
        }
        assert!(build(Arch::GlmDsa, 200).is_err());
    }
}
