//! The tokenizer carried in a GGUF's metadata: `tokenizer.ggml.model` = `gpt2` (byte-level BPE)
//! with the pre-tokenizer named by `tokenizer.ggml.pre`.
//!
//! Encoding: special tokens (token type CONTROL or USER_DEFINED) written in the text are matched
//! as whole tokens first, leftmost and longest first, as Hugging Face tokenizers does for added
//! tokens by default and llama.cpp does with `parse_special = true`; the text between them is
//! cut by the pre-tokenizer regexes (`pre`), each piece is mapped to GPT-2 byte characters
//! and merged by BPE (`bpe`), except that a pre-tokenizer with `ignore_merges` (llama3) takes
//! a piece that is itself a vocabulary entry as that one token. No BOS or EOS is added:
//! `encode` returns exactly the tokens of the text (see [`Tokenizer::bos_id`] and
//! [`Tokenizer::add_bos`] to add one). The `lstrip` / `rstrip` flags of Hugging Face added
//! tokens are not in GGUF and are not applied.
//!
//! Decoding: NORMAL tokens go back through the byte map to bytes, CONTROL and USER_DEFINED
//! tokens are their text as is (Hugging Face `decode(..., skip_special_tokens=False)`); the
//! bytes are read as UTF-8 with invalid sequences replaced by U+FFFD.

mod bpe;
mod pre;

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};

use crate::gguf::{Model, Value};
pub use pre::{PreTokenizer, KNOWN_PRE};

/// Metadata key naming the tokenizer model (`gpt2`, `llama`, ...).
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
/// Metadata key naming the pre-tokenizer (`glm4`, `deepseek-v3`, ...).
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
/// Metadata key holding the token texts (array of strings, index = id).
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
/// Metadata key holding the BPE merges ("left right", by rank).
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
/// Metadata key holding the token types (array of i32, [`TokenType`]).
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// Metadata key holding the BOS token id.
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
/// Metadata key holding the EOS token id.
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
/// Metadata key saying whether a BOS token starts every sequence.
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

/// Token types of `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`, gguf-py
/// `TokenType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
#[allow(missing_docs)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// The type with id `id` (`None` outside 0..=6).
    pub fn from_id(id: i128) -> Option<TokenType> {
        use TokenType::*;
        Some(match id {
            0 => Undefined,
            1 => Normal,
            2 => Unknown,
            3 => Control,
            4 => UserDefined,
            5 => Unused,
            6 => Byte,
            _ => return None,
        })
    }

    /// Whether tokens of this type are matched whole in text and decoded as their text.
    pub fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined)
    }
}

/// A byte-level BPE tokenizer built from GGUF metadata.
#[derive(Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    ids: HashMap<String, u32>,
    merges: bpe::Merges,
    pre: PreTokenizer,
    /// Special tokens by first byte, longest first: (text, id).
    specials: HashMap<u8, Vec<(String, u32)>>,
    byte_ids: [u32; 256],
    byte_chars: [char; 256],
    char_to_byte: HashMap<char, u8>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

/// The tokenizer error for an unsupported file, with the way out.
fn unsupported(what: String) -> anyhow::Error {
    anyhow!("tokenizer: {what}; glmdiff implements only gpt2 byte-level BPE tokenizers: pass token ids with --tokens instead of a prompt")
}

fn str_array<'a>(model: &'a Model, key: &str) -> Result<&'a [Value]> {
    match model.get(key) {
        Some(Value::Array(_, v)) => Ok(v),
        Some(v) => bail!(
            "tokenizer: {}: {key} has type {}, expected an array",
            model.path().display(),
            v.value_type().name()
        ),
        None => bail!(
            "tokenizer: {}: metadata key {key} is missing",
            model.path().display()
        ),
    }
}

fn opt_id(model: &Model, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    let Some(v) = model.get(key) else {
        return Ok(None);
    };
    match v.as_int() {
        Some(i) if i >= 0 && (i as u128) < n_vocab as u128 => Ok(Some(i as u32)),
        _ => bail!(
            "tokenizer: {}: {key} = {v} is not a token id below {n_vocab}",
            model.path().display()
        ),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from `model`'s `tokenizer.ggml.*` metadata.
    pub fn from_model(model: &Model) -> Result<Tokenizer> {
        let path = model.path().display().to_string();
        match model.get(KEY_MODEL).map(|v| v.as_str()) {
            Some(Some("gpt2")) => {}
            Some(Some(other)) => {
                return Err(unsupported(format!("{path}: {KEY_MODEL} is {other:?}")))
            }
            Some(None) => bail!("tokenizer: {path}: {KEY_MODEL} is not a string"),
            None => return Err(unsupported(format!("{path}: {KEY_MODEL} is missing"))),
        }
        let pre = match model.get(KEY_PRE) {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| anyhow!("tokenizer: {path}: {KEY_PRE} is not a string"))?,
            ),
        };
        let pre = PreTokenizer::new(pre).map_err(|e| anyhow!("{e} (file {path})"))?;
        let raw_tokens = str_array(model, KEY_TOKENS)?;
        let mut tokens = Vec::with_capacity(raw_tokens.len());
        for (i, t) in raw_tokens.iter().enumerate() {
            let s = t
                .as_str()
                .ok_or_else(|| anyhow!("tokenizer: {path}: {KEY_TOKENS}[{i}] is not a string"))?;
            tokens.push(s.to_string());
        }
        if tokens.len() > u32::MAX as usize {
            bail!(
                "tokenizer: {path}: {} tokens do not fit u32 ids",
                tokens.len()
            );
        }
        let types = match model.get(KEY_TOKEN_TYPE) {
            None => vec![TokenType::Normal; tokens.len()],
            Some(_) => {
                let raw = str_array(model, KEY_TOKEN_TYPE)?;
                if raw.len() != tokens.len() {
                    bail!(
                        "tokenizer: {path}: {KEY_TOKEN_TYPE} has {} entries, {KEY_TOKENS} has {}",
                        raw.len(),
                        tokens.len()
                    );
                }
                raw.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_int().and_then(TokenType::from_id).ok_or_else(|| {
                            anyhow!("tokenizer: {path}: {KEY_TOKEN_TYPE}[{i}] = {v} is not a token type (0..=6)")
                        })
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        Self::build(
            &path,
            tokens,
            types,
            str_array(model, KEY_MERGES)?,
            pre,
            model,
        )
    }

    fn build(
        path: &str,
        tokens: Vec<String>,
        types: Vec<TokenType>,
        raw_merges: &[Value],
        pre: PreTokenizer,
        model: &Model,
    ) -> Result<Tokenizer> {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            // Later duplicates do not replace the first id (Hugging Face keeps one entry per
            // text; real vocabularies have none).
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let byte_chars = bpe::byte_to_char();
        let mut byte_ids = [0u32; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            byte_ids[b] = *ids.get(c.to_string().as_str()).ok_or_else(|| {
                anyhow!(
                    "tokenizer: {path}: no token for byte 0x{b:02x} (text {c:?}); a byte-level BPE vocabulary has all 256"
                )
            })?;
        }
        let mut merges = bpe::Merges::with_capacity(raw_merges.len());
        for (rank, m) in raw_merges.iter().enumerate() {
            let s = m.as_str().ok_or_else(|| {
                anyhow!("tokenizer: {path}: {KEY_MERGES}[{rank}] is not a string")
            })?;
            let (a, b) = s.split_once(' ').ok_or_else(|| {
                anyhow!("tokenizer: {path}: {KEY_MERGES}[{rank}] = {s:?} is not two tokens separated by a space")
            })?;
            let id = |t: &str| {
                ids.get(t).copied().ok_or_else(|| {
                    anyhow!("tokenizer: {path}: {KEY_MERGES}[{rank}] = {s:?}: {t:?} is not a token")
                })
            };
            let key = (id(a)?, id(b)?);
            let joined = id(&format!("{a}{b}"))?;
            // The first (lowest) rank of a repeated pair wins.
            merges.entry(key).or_insert((rank as u32, joined));
        }
        let mut specials: HashMap<u8, Vec<(String, u32)>> = HashMap::new();
        for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
            if ty.is_special() && !t.is_empty() {
                specials
                    .entry(t.as_bytes()[0])
                    .or_default()
                    .push((t.clone(), i as u32));
            }
        }
        for v in specials.values_mut() {
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        let n = tokens.len();
        let add_bos = model
            .get(KEY_ADD_BOS)
            .and_then(Value::as_int)
            .is_some_and(|v| v != 0);
        Ok(Tokenizer {
            bos: opt_id(model, KEY_BOS, n)?,
            eos: opt_id(model, KEY_EOS, n)?,
            add_bos,
            tokens,
            types,
            ids,
            merges,
            pre,
            specials,
            byte_ids,
            byte_chars,
            char_to_byte: bpe::char_to_byte(),
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// The pre-tokenizer's name.
    pub fn pre_name(&self) -> &str {
        self.pre.name()
    }

    /// The text of token `id` as stored in the file (byte-level characters for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The id of the token whose stored text is `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// `tokenizer.ggml.bos_token_id`, if present.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// `tokenizer.ggml.eos_token_id`, if present.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The special token starting at `text[at..]`, longest first.
    fn special_at(&self, text: &str, at: usize) -> Option<(usize, u32)> {
        let cands = self.specials.get(&text.as_bytes()[at])?;
        cands
            .iter()
            .find(|(t, _)| text[at..].starts_with(t.as_str()))
            .map(|(t, id)| (t.len(), *id))
    }

    /// Tokenizes `text` (no BOS/EOS added; special tokens in the text are matched whole).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut start = 0; // start of the pending ordinary text
        let mut at = 0;
        while at < text.len() {
            if !text.is_char_boundary(at) {
                at += 1;
                continue;
            }
            match self.special_at(text, at) {
                Some((len, id)) => {
                    self.encode_ordinary(&text[start..at], &mut out)?;
                    out.push(id);
                    at += len;
                    start = at;
                }
                None => at += 1,
            }
        }
        self.encode_ordinary(&text[start..], &mut out)?;
        Ok(out)
    }

    /// Tokenizes text that holds no special tokens.
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let mut symbols = Vec::new();
        for piece in self.pre.split(text)? {
            self.encode_piece(text[piece].as_bytes(), &mut symbols, out);
        }
        Ok(())
    }

    /// Tokenizes one pre-tokenizer piece: with the pre-tokenizer's `ignore_merges`
    /// ([`PreTokenizer::ignore_merges`]) a piece whose byte-level text is a vocabulary entry is
    /// that one token (llama.cpp `llm_tokenizer_bpe_session::tokenize` in `src/llama-vocab.cpp`,
    /// Hugging Face tokenizers `BPE::tokenize_with_cache` in `models/bpe/model.rs`); otherwise
    /// its bytes are merged by BPE. `symbols` is scratch space.
    fn encode_piece(&self, bytes: &[u8], symbols: &mut Vec<u32>, out: &mut Vec<u32>) {
        if self.pre.ignore_merges() {
            let mapped: String = bytes.iter().map(|&b| self.byte_chars[b as usize]).collect();
            if let Some(&id) = self.ids.get(&mapped) {
                out.push(id);
                return;
            }
        }
        symbols.clear();
        symbols.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]));
        bpe::merge(symbols, &self.merges);
        out.extend_from_slice(symbols);
    }

    /// Turns ids back into text (special tokens as their text).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            let (Some(t), Some(ty)) = (self.tokens.get(id as usize), self.types.get(id as usize))
            else {
                bail!(
                    "tokenizer: token id {id} is outside the vocabulary of {} tokens",
                    self.tokens.len()
                );
            };
            if ty.is_special() {
                bytes.extend_from_slice(t.as_bytes());
                continue;
            }
            // A token with a character outside the byte map is taken as UTF-8 text, as Hugging
            // Face's ByteLevel decoder does.
            let mapped: Option<Vec<u8>> = t
                .chars()
                .map(|c| self.char_to_byte.get(&c).copied())
                .collect();
            match mapped {
                Some(b) => bytes.extend_from_slice(&b),
                None => bytes.extend_from_slice(t.as_bytes()),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
