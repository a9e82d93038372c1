//! Pre-tokenizers: the regex sequences that cut text into pieces before BPE.
//!
//! Each `tokenizer.ggml.pre` value maps to a list of regexes, copied from llama.cpp's
//! `src/llama-vocab.cpp` (`llm_tokenizer_bpe::llm_tokenizer_bpe`, the `regex_exprs` of each
//! `LLAMA_VOCAB_PRE_TYPE_*`, and the `tokenizer_pre == "..."` table in `llama_vocab::impl::load`
//! that maps names to types). The regexes are applied in order, each one to every piece left by
//! the previous one; a match becomes its own piece and so does the text between matches. That is
//! llama.cpp's `unicode_regex_split` and Hugging Face tokenizers' `Sequence` of `Split`
//! pre-tokenizers with behavior `Isolated` (which is how the GLM and DeepSeek `tokenizer.json`
//! files write them).
//!
//! Besides its regexes a pre-tokenizer carries llama.cpp's `ignore_merges` flag (see
//! [`PreTokenizer::ignore_merges`]). A GGUF has no key for it: llama.cpp derives it from
//! `tokenizer.ggml.pre` in `llama_vocab::impl::load`, and so does this module.

use anyhow::{anyhow, Result};
use fancy_regex::Regex;

/// llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3` and `LLAMA_VOCAB_PRE_TYPE_CHATGLM4` (the same regex):
/// the tokenizer.json original `(?i:'s|'t|...)` with the case-insensitive group spelled out.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp `LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`: digits in groups of up to three, then runs
/// of CJK ideographs and kana, then the word/punctuation/space regex.
const DEEPSEEK3: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// llama.cpp `LLAMA_VOCAB_PRE_TYPE_GPT2`: the original GPT-2 regex.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// llama.cpp's `default:` branch (`LLAMA_VOCAB_PRE_TYPE_DEFAULT`, also used when
/// `tokenizer.ggml.pre` is absent): punctuation runs, the GPT-2 regex, digit runs, three digits.
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// The `tokenizer.ggml.pre` names understood here, for error messages.
pub const KNOWN_PRE: &[&str] = &[
    "glm4",
    "chatglm-bpe",
    "deepseek-v3",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "gpt-2",
    "default",
];

/// A pre-tokenizer: its name and compiled regexes, plus llama.cpp's per-type flags.
#[derive(Debug)]
pub struct PreTokenizer {
    name: String,
    regexes: Vec<Regex>,
    ignore_merges: bool,
}

impl PreTokenizer {
    /// The pre-tokenizer for `tokenizer.ggml.pre` = `pre` (`None`: absent, llama.cpp's default).
    pub fn new(pre: Option<&str>) -> Result<PreTokenizer> {
        let name = pre.unwrap_or("default");
        // ignore_merges as llama.cpp's `llama_vocab::impl::load` sets it: only the llama3 names
        // (`pre_type = LLAMA_VOCAB_PRE_TYPE_LLAMA3; ignore_merges = true;`). Its glm4 /
        // chatglm-bpe branch sets only `special_bos_id`, deepseek-v3 only `clean_spaces`, gpt-2
        // and default nothing.
        let (exprs, ignore_merges): (&[&str], bool) = match name {
            "glm4" | "chatglm-bpe" => (&[LLAMA3], false),
            "deepseek-v3" => (&DEEPSEEK3, false),
            "llama3" | "llama-v3" | "llama-bpe" => (&[LLAMA3], true),
            "gpt-2" => (&[GPT2], false),
            "default" => (&DEFAULT, false),
            other => {
                return Err(anyhow!(
                    "tokenizer: tokenizer.ggml.pre {other:?} is not supported (known: {}); pass token ids with --tokens instead of a prompt",
                    KNOWN_PRE.join(", ")
                ))
            }
        };
        let regexes = exprs
            .iter()
            .map(|e| {
                Regex::new(e).map_err(|err| {
                    anyhow!(
                        "tokenizer: pre-tokenizer {name:?}: regex {e:?} does not compile: {err}"
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PreTokenizer {
            name: name.to_string(),
            regexes,
            ignore_merges,
        })
    }

    /// The pre-tokenizer's name (`tokenizer.ggml.pre`, or "default").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a piece that is itself a vocabulary entry is emitted as that one token, without
    /// running the merges over its bytes (which could stop at a different split, or never reach
    /// the entry at all).
    ///
    /// This is llama.cpp's `ignore_merges` (ggml-org/llama.cpp `src/llama-vocab.cpp`: set in
    /// `llama_vocab::impl::load` per `tokenizer.ggml.pre`, true here only for the llama3 names,
    /// and read in `llm_tokenizer_bpe_session::tokenize`, where a word with
    /// `vocab.text_to_token(word) != LLAMA_TOKEN_NULL` becomes one symbol before any merge).
    /// Hugging Face tokenizers has the same flag on its BPE model, read from the `ignore_merges`
    /// field of `tokenizer.json` (huggingface/tokenizers `tokenizers/src/models/bpe/model.rs`,
    /// `BPE::tokenize_with_cache`: `if self.ignore_merges` and the whole piece is in the
    /// vocabulary, it is returned as one token).
    ///
    /// glm4 follows llama.cpp's master (false). An open llama.cpp pull request
    /// (ggml-org/llama.cpp#27754) would set it for glm4 as well, stating that GLM's own
    /// `tokenizer.json` has `"ignore_merges": true`; if it lands, the glm4 arm of
    /// [`PreTokenizer::new`] changes with it. Both settings give the same ids for a piece whose
    /// bytes the merges carry to its vocabulary entry; they differ only for entries the merges
    /// do not reach from their bytes.
    pub fn ignore_merges(&self) -> bool {
        self.ignore_merges
    }

    /// Cuts `text` into pieces (byte ranges of `text`, in order, covering all of it).
    pub fn split(&self, text: &str) -> Result<Vec<std::ops::Range<usize>>> {
        let mut pieces: Vec<std::ops::Range<usize>> = std::iter::once(0..text.len()).collect();
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                let s = &text[p.clone()];
                let mut at = 0;
                for m in re.find_iter(s) {
                    let m = m.map_err(|e| {
                        anyhow!(
                            "tokenizer: pre-tokenizer {:?}: regex {:?} failed on {} bytes of text at byte {}: {e}",
                            self.name,
                            re.as_str(),
                            s.len(),
                            p.start
                        )
                    })?;
                    if m.start() > at {
                        next.push(p.start + at..p.start + m.start());
                    }
                    if m.end() > m.start() {
                        next.push(p.start + m.start()..p.start + m.end());
                    }
                    at = m.end();
                }
                if at < s.len() {
                    next.push(p.start + at..p.end);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces<'a>(pre: &str, text: &'a str) -> Vec<&'a str> {
        let p = PreTokenizer::new(Some(pre)).unwrap();
        p.split(text)
            .unwrap()
            .into_iter()
            .map(|r| &text[r])
            .collect()
    }

    #[test]
    fn every_known_name_compiles() {
        for n in KNOWN_PRE {
            PreTokenizer::new(Some(n)).unwrap();
        }
        PreTokenizer::new(None).unwrap();
        let e = PreTokenizer::new(Some("qwen2")).unwrap_err();
        assert!(format!("{e}").contains("--tokens"));
    }

    // Expected pieces written by hand from the regexes (and checked against Hugging Face
    // tokenizers' `Split(..., "isolated")` sequences while writing them).
    #[test]
    fn glm4_splits_like_the_llama3_regex() {
        assert_eq!(
            pieces("glm4", "Hello world's 12345  x\n\n"),
            ["Hello", " world", "'s", " ", "123", "45", " ", " x", "\n\n"]
        );
    }

    #[test]
    fn deepseek_v3_runs_three_regexes_in_sequence() {
        assert_eq!(
            pieces("deepseek-v3", "ab1234中文字cd, (x)"),
            ["ab", "123", "4", "中文字", "cd", ",", " (", "x", ")"]
        );
    }

    #[test]
    fn ignore_merges_only_for_the_llama3_names() {
        // llama.cpp src/llama-vocab.cpp, llama_vocab::impl::load: `ignore_merges = true` only in
        // the LLAMA_VOCAB_PRE_TYPE_LLAMA3 branch among the names known here.
        for n in KNOWN_PRE {
            let want = matches!(*n, "llama3" | "llama-v3" | "llama-bpe");
            assert_eq!(
                PreTokenizer::new(Some(n)).unwrap().ignore_merges(),
                want,
                "{n}"
            );
        }
        assert!(!PreTokenizer::new(None).unwrap().ignore_merges());
    }

    #[test]
    fn gpt2_and_default() {
        assert_eq!(pieces("gpt-2", "it's  ok"), ["it", "'s", " ", " ok"]);
        assert_eq!(
            pieces("default", "a+b 1234"),
            ["a", "+", "b", " ", "123", "4"]
        );
    }
}
